//! Flags that override a run config (TOML, see `configs/`), shared by `train` and `plan`.
//!
//! Each struct groups the flags of one part of [`RunConfig`] and sets them with `apply`;
//! a command flattens (`#[command(flatten)]`) the groups it takes, so its `--help` lists
//! every flag and a flag means the same in every command. [`LayoutFlags`] (model, dtype,
//! length, micro-batch, parallel layout: what memory depends on) is taken by both `train`
//! and `plan`; `plan` rewords some of their help to say its own defaults. The other groups
//! are `train`'s. An unset flag leaves the config's value.

use super::{parse_mode, FLAGS};
use anyhow::Result;
use clap::Args;
use longctx::train::config::{RunConfig, Stage};
use longctx::train::optim::Schedule;
use std::path::PathBuf;

/// The parallel layout and memory flags: `[parallel]`.
#[derive(Args, Debug, Default, Clone)]
pub struct ParallelFlags {
    /// data_parallel | zigzag_ring_attn | ulysses_attn | fpdt | usp
    #[arg(long)]
    pub parallel_mode: Option<String>,
    /// Ranks in this process (threads sharing the device) when not started by `launch`.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Sequence-parallel degree [default: all ranks for sequence-parallel modes].
    #[arg(long)]
    pub sp_size: Option<usize>,
    /// USP: Ulysses degree within a ring group.
    #[arg(long)]
    pub ulysses_size: Option<usize>,
    /// FPDT chunk size in global tokens [default: 65536].
    #[arg(long)]
    pub fpdt_chunk_size: Option<usize>,
    /// FPDT: park kv chunks (and saved q/o/lse, dq partials) in host memory.
    #[arg(long)]
    pub fpdt_offload: bool,
    /// Keep saved layer inputs in host memory between forward and backward.
    #[arg(long)]
    pub offload_activations: bool,
    /// Keep each layer's attention q, k, v, o and LSE from the forward for the backward
    /// (no attention recompute; in host memory with --offload-activations).
    #[arg(long)]
    pub save_attention: bool,
    /// Tokens per chunk for the token-wise parts (MLP, norms, head, loss) [default: 4096].
    #[arg(long)]
    pub token_chunk: Option<usize>,
}

impl ParallelFlags {
    pub fn apply(&self, c: &mut RunConfig) -> Result<()> {
        let p = &mut c.parallel;
        if let Some(v) = &self.parallel_mode {
            p.mode = parse_mode(v, "--parallel-mode")?;
        }
        set(&mut p.world_size, self.world_size);
        set(&mut p.sp_size, self.sp_size);
        set(&mut p.ulysses_size, self.ulysses_size);
        set(&mut p.fpdt_chunk_size, self.fpdt_chunk_size);
        p.fpdt_offload |= self.fpdt_offload;
        p.offload_activations |= self.offload_activations;
        p.save_attention |= self.save_attention;
        set(&mut p.token_chunk, self.token_chunk);
        Ok(())
    }
}

/// What the memory of a run depends on: `[model]` source and dtype, the length (one
/// stage), `[train].batch_size` and `[parallel]`. Taken by `train` and `plan`.
#[derive(Args, Debug, Default, Clone)]
pub struct LayoutFlags {
    /// Model: `builtin:tiny`, a local HF checkpoint directory, or a hub id (org/name).
    #[arg(long)]
    pub model: Option<String>,
    /// Model dtype on the device: f32, bf16, f16.
    #[arg(long)]
    pub dtype: Option<String>,
    /// Sequence length (replaces the config's stages by one stage).
    #[arg(long)]
    pub seq_length: Option<usize>,
    /// Sequences per step per data-parallel rank.
    #[arg(long)]
    pub batch_size: Option<usize>,
    #[command(flatten)]
    pub parallel: ParallelFlags,
}

impl LayoutFlags {
    /// Sets model, dtype, micro-batch and layout. `--seq-length` is applied with the
    /// stage flags, by [`StageFlags::apply`].
    pub fn apply(&self, c: &mut RunConfig) -> Result<()> {
        set(&mut c.model.source, self.model.clone());
        set(&mut c.model.dtype, self.dtype.clone());
        set(&mut c.train.batch_size, self.batch_size);
        self.parallel.apply(c)
    }
}

/// The stages: `[[stage]]`.
#[derive(Args, Debug, Default, Clone)]
pub struct StageFlags {
    /// Optimizer steps (with --seq-length/--rope-theta: a single stage of this many steps;
    /// otherwise caps the steps of every stage).
    #[arg(long)]
    pub max_train_steps: Option<u64>,
    /// RoPE base theta of that stage (without --seq-length: of every stage).
    #[arg(long, allow_negative_numbers = true)]
    pub rope_theta: Option<f64>,
}

impl StageFlags {
    /// With `seq_length` (the `--seq-length` of [`LayoutFlags`]): one stage of that length
    /// replaces the config's, its theta and steps from the flags or the config's last stage.
    /// Without: `--rope-theta` sets every stage's theta. `--max-train-steps` then caps
    /// every stage.
    pub fn apply(&self, seq_length: Option<usize>, c: &mut RunConfig) {
        match (seq_length, self.rope_theta) {
            (Some(len), theta) => {
                let theta = theta.or(c.stages.last().map(|s| s.rope_theta)).unwrap_or(10_000.0);
                let steps = self.max_train_steps.or(c.stages.last().map(|s| s.steps)).unwrap_or(100);
                c.stages = vec![Stage::new(len, theta, steps)];
            }
            (None, Some(theta)) => c.stages.iter_mut().for_each(|s| s.rope_theta = theta),
            (None, None) => {}
        }
        if let Some(m) = self.max_train_steps {
            for s in &mut c.stages {
                s.steps = s.steps.min(m);
            }
        }
    }
}

/// The optimization: `[train]` (but `batch_size`, a layout flag).
#[derive(Args, Debug, Default, Clone)]
pub struct TrainFlags {
    /// Micro-steps accumulated per optimizer step.
    #[arg(long)]
    pub gradient_accumulate_every: Option<usize>,
    /// Peak learning rate.
    #[arg(long, allow_negative_numbers = true)]
    pub learning_rate: Option<f64>,
    /// Learning-rate schedule: constant, linear (warmup then constant) or cosine.
    #[arg(long)]
    pub lr_schedule: Option<String>,
    /// Linear warmup steps.
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Global-norm gradient clipping (0 = off).
    #[arg(long, allow_negative_numbers = true)]
    pub clip_grad: Option<f64>,
    /// Write a resumable checkpoint every N optimizer steps [default: 0, only at stage
    /// ends and every --checkpoint-interval-min].
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Also write one when this many minutes have passed since the last (0 = off) [default: 30].
    #[arg(long, allow_negative_numbers = true)]
    pub checkpoint_interval_min: Option<f64>,
    /// Abort after this many steps in a row with a non-finite gradient norm or loss (each
    /// is skipped) [default: 5].
    #[arg(long)]
    pub max_skipped_steps: Option<u64>,
}

impl TrainFlags {
    pub fn apply(&self, c: &mut RunConfig) -> Result<()> {
        let t = &mut c.train;
        set(&mut t.gradient_accumulate_every, self.gradient_accumulate_every);
        set(&mut t.learning_rate, self.learning_rate);
        if let Some(v) = &self.lr_schedule {
            t.lr_schedule = match v.as_str() {
                "constant" => Schedule::Constant,
                "linear" => Schedule::Linear,
                "cosine" => Schedule::Cosine,
                _ => {
                    let msg = format!("expected constant, linear or cosine, got `{v}`");
                    return Err(longctx::Error::config(FLAGS, "--lr-schedule", msg).into());
                }
            };
        }
        set(&mut t.warmup_steps, self.warmup_steps);
        set(&mut t.clip_grad, self.clip_grad);
        set(&mut t.checkpoint_every, self.checkpoint_every);
        set(&mut t.checkpoint_interval_min, self.checkpoint_interval_min);
        set(&mut t.max_skipped_steps, self.max_skipped_steps);
        Ok(())
    }
}

/// The data: `[data]`.
#[derive(Args, Debug, Default, Clone)]
pub struct DataFlags {
    /// Dataset: `synthetic:passkey`, a jsonl/txt/parquet/.bin file or directory, or a hub dataset id.
    #[arg(long)]
    pub dataset: Option<String>,
    /// Column or field with token ids or text (input_ids or text).
    #[arg(long)]
    pub dataset_column: Option<String>,
}

impl DataFlags {
    pub fn apply(&self, c: &mut RunConfig) {
        set(&mut c.data.dataset, self.dataset.clone());
        if let Some(v) = &self.dataset_column {
            c.data.column = Some(v.clone());
        }
    }
}

/// Where the run goes: `output_dir`, `seed`, `[model].device`, `[export].final_rope_theta`.
#[derive(Args, Debug, Default, Clone)]
pub struct RunFlags {
    /// Where checkpoints, metrics and the final export go.
    #[arg(long)]
    pub output_dir: Option<PathBuf>,
    /// cpu, cuda or cuda:N.
    #[arg(long)]
    pub device: Option<String>,
    /// Random seed (init of builtin models, data shuffle).
    #[arg(long)]
    pub seed: Option<u64>,
    /// rope_theta written into the exported config.json (default: last stage's).
    #[arg(long, allow_negative_numbers = true)]
    pub final_rope_theta: Option<f64>,
    /// Seconds a collective waits for the other ranks before every rank aborts naming the
    /// rank and the collective; 0 = no timeout [default: 600] (`parallel.collective_timeout_s`).
    #[arg(long, allow_negative_numbers = true)]
    pub collective_timeout: Option<f64>,
}

impl RunFlags {
    pub fn apply(&self, c: &mut RunConfig) {
        set(&mut c.output_dir, self.output_dir.clone());
        set(&mut c.model.device, self.device.clone());
        set(&mut c.seed, self.seed);
        if let Some(v) = self.final_rope_theta {
            c.export.final_rope_theta = Some(v);
        }
        set(&mut c.parallel.collective_timeout_s, self.collective_timeout);
    }
}

/// `*field = v` when the flag was given.
fn set<T>(field: &mut T, v: Option<T>) {
    if let Some(v) = v {
        *field = v;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;
    use longctx::train::config::ParallelMode;

    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        layout: LayoutFlags,
        #[command(flatten)]
        stages: StageFlags,
        #[command(flatten)]
        train: TrainFlags,
    }

    fn apply(v: &[&str]) -> Result<RunConfig> {
        let f = Cmd::try_parse_from(std::iter::once("x").chain(v.iter().copied()))?;
        let mut c = RunConfig::default();
        f.train.apply(&mut c)?;
        f.layout.apply(&mut c)?;
        f.stages.apply(f.layout.seq_length, &mut c);
        Ok(c)
    }

    #[test]
    fn unset_flags_keep_the_config() {
        assert_eq!(apply(&[]).unwrap(), RunConfig::default());
    }

    #[test]
    fn flags_set_their_fields() {
        let c = apply(&["--parallel-mode", "fpdt", "--world-size", "4", "--fpdt-offload", "--batch-size", "2", "--lr-schedule", "cosine"])
            .unwrap();
        assert_eq!((c.parallel.mode, c.parallel.world_size, c.parallel.fpdt_offload), (ParallelMode::Fpdt, 4, true));
        assert_eq!((c.train.batch_size, c.train.lr_schedule), (2, Schedule::Cosine));
        let c = apply(&["--seq-length", "256"]).unwrap();
        assert_eq!((c.stages.len(), c.stages[0].rope_theta, c.stages[0].steps), (1, 1e5, 60), "theta and steps of the last stage");
        let c = apply(&["--max-train-steps", "7", "--rope-theta", "3e5"]).unwrap();
        assert!(c.stages.iter().all(|s| (s.steps, s.rope_theta) == (7, 3e5)));
        for (flags, field) in [(["--parallel-mode", "ring"], "--parallel-mode"), (["--lr-schedule", "step"], "--lr-schedule")] {
            let err = apply(&flags).unwrap_err().to_string();
            assert!(err.contains(FLAGS) && err.contains(field), "{err}");
        }
    }
}
