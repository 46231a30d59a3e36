//! Flags that override a run config (TOML, see `configs/`), shared by `train` and `plan`.
//!
//! Each struct groups the flags of one part of [`RunConfig`] and sets them with `apply`;
//! a command flattens (`#[command(flatten)]`) the groups it takes, so its `--help` lists
//! every flag and a flag means the same in every command. [`LayoutFlags`] (model, dtype,
//! length, micro-batch, parallel layout: what memory depends on) is taken by both `train`
//! and `plan`; `plan` rewords some of their help to say its own defaults. The other groups
//! are `train`'s. An unset flag leaves the config's value; a flag for a key that stages
//! may set per stage (seed, dataset, column, batch size, accumulation, learning rate,
//! warmup) also replaces every stage's own value.
//!
//! EasyContext's spellings are accepted (`--parallel_mode`, `--ring_degree`, `--batch_size`:
//! every flag's underscore spelling, see `cli::underscore_spellings`; the mode `usp_attn`),
//! so its scripts' arguments run unchanged;
//! `--wandb` is accepted and points at the TensorBoard files W&B can sync.

use super::{parse_mode, FLAGS};
use anyhow::Result;
use clap::Args;
use longctx::train::config::{RunConfig, Stage};
use longctx::train::optim::Schedule;
use std::path::PathBuf;

/// The parallel layout and memory flags: `[parallel]`.
#[derive(Args, Debug, Default, Clone)]
pub struct ParallelFlags {
    /// data_parallel | zigzag_ring_attn | ulysses_attn | fpdt | usp (EasyContext's usp_attn too)
    #[arg(long)]
    pub parallel_mode: Option<String>,
    /// Ranks in this process (threads sharing the device) when not started by `launch`.
    #[arg(long)]
    pub world_size: Option<usize>,
    /// Sequence-parallel degree [default: all ranks for sequence-parallel modes].
    #[arg(long)]
    pub sp_size: Option<usize>,
    /// USP: Ulysses degree within a ring group.
    #[arg(long, alias = "ulysses-degree")]
    pub ulysses_size: Option<usize>,
    /// USP: ring degree (EasyContext's --ring_degree): the Ulysses degree becomes the
    /// sequence-parallel degree divided by it.
    #[arg(long, conflicts_with = "ulysses_size")]
    pub ring_degree: Option<usize>,
    /// FPDT chunk size in global tokens, e.g. 65536 or 64K [default: 65536].
    #[arg(long, value_parser = super::chunk_arg)]
    pub fpdt_chunk_size: Option<usize>,
    /// FPDT: park kv chunks (and saved q/o/lse, dq partials) in host memory.
    #[arg(long)]
    pub fpdt_offload: bool,
    /// Keep saved layer inputs in host memory between forward and backward.
    #[arg(long)]
    pub offload_activations: bool,
    /// Keep only the saved layer inputs in host memory, the attention's and MLP's saved
    /// tensors on the GPU (the device memory for more --save-mlp-layers, at the host cost
    /// of one [b, s, h] tensor a layer); a part of --offload-activations.
    #[arg(long, conflicts_with = "offload_activations")]
    pub offload_layer_inputs: bool,
    /// Keep each layer's attention q, k, v, o and LSE from the forward for the backward
    /// (no attention recompute; in host memory with --offload-activations).
    #[arg(long)]
    pub save_attention: bool,
    /// Keep each layer's MLP input and gate/up projections from the forward for the
    /// backward (no o_proj, gate or up recompute; in host memory with
    /// --offload-activations).
    #[arg(long)]
    pub save_mlp: bool,
    /// Keep the MLP tensors of the top N layers only, the others recomputing theirs: the
    /// memory between none and --save-mlp (`longctx plan` suggests N when every layer's
    /// does not fit) (`parallel.save_mlp_layers`).
    #[arg(long, value_name = "N")]
    pub save_mlp_layers: Option<usize>,
    /// Tokens per chunk for the token-wise parts (MLP, norms, head, loss), e.g. 4096 or 4K
    /// [default: 4096].
    #[arg(long, value_parser = super::chunk_arg)]
    pub token_chunk: Option<usize>,
    /// CUDA attention kernel: auto (per call the one measured faster on that shape), cudnn,
    /// or native (longctx's own Hopper forward and backward, sm_90a builds; shapes it does
    /// not cover run cuDNN) [default: auto] (`attention.kernel`).
    #[arg(long)]
    pub attention_kernel: Option<String>,
}

impl ParallelFlags {
    pub fn apply(&self, c: &mut RunConfig) -> Result<()> {
        // A flag that a stage can also set replaces every stage's own value, as for the
        // training flags.
        if self.parallel_mode.is_some() {
            c.stages.iter_mut().for_each(|s| s.parallel_mode = None);
        }
        if self.fpdt_chunk_size.is_some() {
            c.stages.iter_mut().for_each(|s| s.fpdt_chunk_size = None);
        }
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
        p.offload_layer_inputs |= self.offload_layer_inputs;
        p.save_attention |= self.save_attention;
        p.save_mlp |= self.save_mlp;
        if self.save_mlp_layers.is_some() {
            p.save_mlp_layers = self.save_mlp_layers;
        }
        set(&mut p.token_chunk, self.token_chunk);
        if let Some(k) = &self.attention_kernel {
            c.attention.kernel = k.parse().map_err(|e: String| longctx::Error::config(FLAGS, "--attention-kernel", e))?;
        }
        Ok(())
    }

    /// `--ring-degree R`: `parallel.ulysses_size = sp / R` under the final world size (call
    /// after the launcher's world is known).
    pub fn apply_ring_degree(&self, c: &mut RunConfig) -> Result<()> {
        let Some(r) = self.ring_degree else { return Ok(()) };
        let sp = c.sp_size_for(longctx::train::ParallelMode::Usp);
        if r == 0 || !sp.is_multiple_of(r) {
            let msg = format!("got {r}, expected a divisor of the sequence-parallel degree {sp} (ulysses degree = {sp} / ring degree)");
            return Err(longctx::Error::config(FLAGS, "--ring-degree", msg).into());
        }
        c.parallel.ulysses_size = sp / r;
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
    /// Sequence length in tokens, e.g. 65536, 64K or 1M (K = 1024) (replaces the config's
    /// stages by one stage).
    #[arg(long, value_parser = super::tokens_arg)]
    pub seq_length: Option<usize>,
    /// Sequences per micro-batch per data-parallel rank (every stage).
    #[arg(long)]
    pub batch_size: Option<usize>,
    /// Keep the AdamW state (f32 master, m, v) and its update in host memory, like
    /// DeepSpeed's offload_optimizer [default: on the GPU] (`train.optimizer_on_host`).
    #[arg(long)]
    pub optimizer_on_host: bool,
    /// With the AdamW state in host memory: keep the first N ZeRO units' (the embedding,
    /// then one decoder layer each) and their update on the GPU, like DeepSpeed's
    /// offload_optimizer ratio; implies --optimizer-on-host [default: 0]
    /// (`train.optimizer_device_units`).
    #[arg(long, value_name = "N")]
    pub optimizer_device_units: Option<usize>,
    /// ZeRO stage, as DeepSpeed numbers them: 0 replicated optimizer state, 1 sharded
    /// optimizer state [default], 2 also sharded gradients (reduced layer by layer), 3 also
    /// sharded weights (gathered layer by layer) (`train.zero_stage`).
    #[arg(long, value_parser = clap::value_parser!(u8).range(0..=3))]
    pub zero_stage: Option<u8>,
    /// Keep this rank's slice of the weights in host memory, each layer copied to the GPU
    /// only while it runs, like DeepSpeed's offload_param; implies --zero-stage 3
    /// (`train.offload_params`).
    #[arg(long)]
    pub offload_params: bool,
    /// With the optimizer in host memory (ZeRO stage 2 or 3), put each layer's f32
    /// gradient there too once the backward is done with it: the GPU keeps two layers'
    /// gradients instead of the whole model's (4 bytes a parameter), the host holds them
    /// instead; implies --optimizer-on-host (`train.offload_gradients`).
    #[arg(long)]
    pub offload_gradients: bool,
    #[command(flatten)]
    pub parallel: ParallelFlags,
}

impl LayoutFlags {
    /// Sets model, dtype, micro-batch and layout. `--seq-length` is applied with the
    /// stage flags, by [`StageFlags::apply`].
    pub fn apply(&self, c: &mut RunConfig) -> Result<()> {
        set(&mut c.model.source, self.model.clone());
        set(&mut c.model.dtype, self.dtype.clone());
        if let Some(b) = self.batch_size {
            c.train.batch_size = b;
            c.stages.iter_mut().for_each(|s| s.batch_size = None);
        }
        c.train.optimizer_on_host |= self.optimizer_on_host;
        if let Some(n) = self.optimizer_device_units {
            c.train.optimizer_device_units = n;
            c.train.optimizer_on_host |= n > 0;
        }
        if let Some(z) = self.zero_stage {
            c.train.zero_stage = z;
        }
        if self.offload_gradients {
            c.train.offload_gradients = true;
            c.train.optimizer_on_host = true;
        }
        if self.offload_params {
            c.train.offload_params = true;
            if self.zero_stage.is_none() {
                c.train.zero_stage = 3;
            }
        }
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
    /// Micro-batches accumulated per optimizer step (every stage).
    #[arg(long)]
    pub gradient_accumulate_every: Option<usize>,
    /// Peak learning rate (every stage).
    #[arg(long, allow_negative_numbers = true)]
    pub learning_rate: Option<f64>,
    /// Learning-rate schedule: constant (after the warmup, as EasyContext's
    /// constant-with-warmup), linear (the same), cosine (warmup, then decay), or
    /// DeepSpeed's warmup_lr, warmup_decay_lr, warmup_cosine_lr (docs/config.md).
    #[arg(long)]
    pub lr_schedule: Option<String>,
    /// Linear warmup steps at the start of every stage (in every schedule).
    #[arg(long)]
    pub warmup_steps: Option<u64>,
    /// Global-norm gradient clipping (0 = off).
    #[arg(long, alias = "gradient-clipping", allow_negative_numbers = true)]
    pub clip_grad: Option<f64>,
    /// Start every stage after the first with a fresh AdamW state (EasyContext: a new job per stage).
    #[arg(long)]
    pub reset_optimizer: bool,
    /// Peak dense TFLOP/s of one GPU, for MFU [default: from the GPU's name; 989 if unknown].
    #[arg(long)]
    pub peak_tflops: Option<f64>,
    /// Do not write TensorBoard event files (`<output-dir>/tensorboard/`).
    #[arg(long)]
    pub no_tensorboard: bool,
    /// Accepted for EasyContext's scripts: longctx does not call W&B; it writes TensorBoard
    /// files that `wandb sync --sync-tensorboard <output-dir>/tensorboard` uploads.
    #[arg(long, value_name = "PROJECT")]
    pub wandb: Option<String>,
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
    /// Write no checkpoint and no export, only the metrics: for throughput runs (nothing
    /// to resume from or to load afterwards).
    #[arg(long)]
    pub no_save: bool,
}

impl TrainFlags {
    pub fn apply(&self, c: &mut RunConfig) -> Result<()> {
        let t = &mut c.train;
        if let Some(g) = self.gradient_accumulate_every {
            t.gradient_accumulate_every = g;
            c.stages.iter_mut().for_each(|s| s.gradient_accumulate_every = None);
        }
        if let Some(lr) = self.learning_rate {
            t.learning_rate = lr;
            c.stages.iter_mut().for_each(|s| s.learning_rate = None);
        }
        if let Some(w) = self.warmup_steps {
            t.warmup_steps = w;
            c.stages.iter_mut().for_each(|s| s.warmup_steps = None);
        }
        if self.reset_optimizer {
            t.reset_optimizer = true;
            c.stages.iter_mut().for_each(|s| s.reset_optimizer = None);
        }
        if self.peak_tflops.is_some() {
            t.peak_tflops = self.peak_tflops;
        }
        if self.no_tensorboard {
            t.tensorboard = false;
        }
        if let Some(p) = &self.wandb {
            t.tensorboard = true;
            eprintln!(
                "note: --wandb {p}: longctx writes TensorBoard files; upload them with `wandb sync --sync-tensorboard -p {p} {}/tensorboard`",
                c.output_dir.display()
            );
        }
        if let Some(v) = &self.lr_schedule {
            t.lr_schedule = Schedule::from_name(v).ok_or_else(|| {
                let msg = format!("expected constant, linear, cosine, warmup_lr, warmup_decay_lr or warmup_cosine_lr, got `{v}`");
                longctx::Error::config(FLAGS, "--lr-schedule", msg)
            })?;
        }
        set(&mut t.clip_grad, self.clip_grad);
        set(&mut t.checkpoint_every, self.checkpoint_every);
        set(&mut t.checkpoint_interval_min, self.checkpoint_interval_min);
        set(&mut t.max_skipped_steps, self.max_skipped_steps);
        if self.no_save {
            t.save = false;
        }
        Ok(())
    }
}

/// The data: `[data]`.
#[derive(Args, Debug, Default, Clone)]
pub struct DataFlags {
    /// Dataset (every stage): `synthetic:passkey`, a jsonl(.gz/.zst)/txt/parquet/.bin file or
    /// directory, or a hub dataset id.
    #[arg(long)]
    pub dataset: Option<String>,
    /// Column or field with token ids or text (input_ids or text).
    #[arg(long)]
    pub dataset_column: Option<String>,
    /// Split of a hub dataset or dataset directory to read (`*`: every file) [default: train].
    #[arg(long)]
    pub dataset_split: Option<String>,
    /// How documents become samples: concat (one stream cut into samples; EasyContext's),
    /// truncate (one document per sample) or documents (packed, each token attending to its
    /// own document only, positions restarting per document) [default: concat].
    #[arg(long, value_parser = ["concat", "truncate", "documents"])]
    pub packing: Option<String>,
    /// Held-out documents to evaluate at every stage end (`eval.dataset`): perplexity at
    /// the stage's length and the model's original context, and a passkey grid, logged to
    /// metrics.jsonl and TensorBoard, plotted in eval.png; `synthetic:passkey` for fresh
    /// synthetic samples.
    #[arg(long)]
    pub eval_dataset: Option<String>,
    /// Also evaluate every N global steps (`eval.every`; 0: at stage ends only).
    #[arg(long)]
    pub eval_every: Option<u64>,
}

impl DataFlags {
    pub fn apply(&self, c: &mut RunConfig) {
        if let Some(d) = &self.dataset {
            c.data.dataset = d.clone();
            c.data.column = None;
            c.stages.iter_mut().for_each(|s| (s.dataset, s.column) = (None, None));
        }
        if let Some(v) = &self.dataset_column {
            c.data.column = Some(v.clone());
            c.stages.iter_mut().for_each(|s| s.column = None);
        }
        set(&mut c.data.split, self.dataset_split.clone());
        if let Some(p) = &self.packing {
            c.data.packing = match p.as_str() {
                "truncate" => longctx::train::config::PackingMode::Truncate,
                "documents" => longctx::train::config::PackingMode::Documents,
                _ => longctx::train::config::PackingMode::Concat,
            };
        }
        set(&mut c.eval.dataset, self.eval_dataset.clone());
        set(&mut c.eval.every, self.eval_every);
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
    /// Random seed (init of builtin models, data order: stage i uses seed + i unless it
    /// sets its own; this flag replaces the stages' own seeds).
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
        if let Some(s) = self.seed {
            c.seed = s;
            c.stages.iter_mut().for_each(|st| st.seed = None);
        }
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
    fn attention_kernel_flag() {
        use longctx_attention::kernel::CudaKernel;
        assert_eq!(apply(&["--attention-kernel", "native"]).unwrap().attention.kernel, CudaKernel::Native);
        assert_eq!(apply(&["--attention-kernel", "cuDNN"]).unwrap().attention.kernel, CudaKernel::Cudnn);
        assert_eq!(apply(&["--attention-kernel", "auto"]).unwrap().attention.kernel, CudaKernel::Auto);
        let e = apply(&["--attention-kernel", "flash"]).unwrap_err().to_string();
        assert!(e.contains("--attention-kernel") && e.contains("flash") && e.contains("cudnn, native, auto"), "{e}");
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
        assert_eq!((c.stages.len(), c.stages[0].rope_theta, c.stages[0].steps), (1, 1e5, 50), "theta and steps of the last stage");
        let c = apply(&["--max-train-steps", "7", "--rope-theta", "3e5"]).unwrap();
        assert!(c.stages.iter().all(|s| (s.steps, s.rope_theta) == (7, 3e5)));
        for (flags, field) in [(["--parallel-mode", "ring"], "--parallel-mode"), (["--lr-schedule", "step"], "--lr-schedule")] {
            let err = apply(&flags).unwrap_err().to_string();
            assert!(err.contains(FLAGS) && err.contains(field), "{err}");
        }
    }
}
