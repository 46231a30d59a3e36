//! `longctx`: extend the context window of Llama-family models by continued training.
//!
//! Subcommands: `train` (the main job; with no argument it trains a tiny built-in
//! Llama on synthetic passkey data on the CPU), `export`, `inspect`, `plan`,
//! `launch` (one process per GPU) and `bench`.

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use longctx::train::config::{ParallelMode, RunConfig, Stage};
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(name = "longctx", version, about = "Long-context continued training of Llama-family models (ring / Ulysses / FPDT sequence parallelism)")]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Train (continued pre-training over one or more rope_theta stages). With no
    /// argument: the embedded demo (tiny built-in Llama, synthetic passkey data, CPU).
    Train(TrainArgs),
}

/// Flags follow EasyContext's train.py where it has them; every flag overrides the
/// TOML config file given with --config.
#[derive(Args, Debug, Default)]
struct TrainArgs {
    /// TOML run config (see configs/ and recipes/); flags override its values.
    #[arg(long)]
    config: Option<PathBuf>,
    /// Model: `builtin:tiny`, a local HF checkpoint directory, or a hub id (org/name).
    #[arg(long)]
    model: Option<String>,
    /// Dataset: `synthetic:passkey`, a jsonl/txt/parquet/.bin file or directory, or a hub dataset id.
    #[arg(long)]
    dataset: Option<String>,
    /// Column or field with token ids or text (input_ids or text).
    #[arg(long)]
    dataset_column: Option<String>,
    /// Where checkpoints, metrics and the final export go.
    #[arg(long)]
    output_dir: Option<PathBuf>,
    /// Sequences per step per data-parallel rank.
    #[arg(long)]
    batch_size: Option<usize>,
    /// Micro-steps accumulated per optimizer step.
    #[arg(long)]
    gradient_accumulate_every: Option<usize>,
    /// Peak learning rate.
    #[arg(long)]
    learning_rate: Option<f64>,
    /// Learning-rate schedule: constant, linear (warmup then constant) or cosine.
    #[arg(long)]
    lr_schedule: Option<String>,
    /// Linear warmup steps.
    #[arg(long)]
    warmup_steps: Option<u64>,
    /// Global-norm gradient clipping (0 = off).
    #[arg(long)]
    clip_grad: Option<f64>,
    /// Optimizer steps (with --seq-length/--rope-theta: a single stage of this many steps;
    /// otherwise caps the steps of every stage).
    #[arg(long)]
    max_train_steps: Option<u64>,
    /// Sequence length (replaces the config's stages by one stage).
    #[arg(long)]
    seq_length: Option<usize>,
    /// RoPE base theta of that stage.
    #[arg(long)]
    rope_theta: Option<f64>,
    /// data_parallel | zigzag_ring_attn | ulysses_attn | fpdt | usp
    #[arg(long)]
    parallel_mode: Option<String>,
    /// Ranks in this process (threads sharing the device) when not started by `launch`.
    #[arg(long)]
    world_size: Option<usize>,
    /// Sequence-parallel degree (default: all ranks for sequence-parallel modes).
    #[arg(long)]
    sp_size: Option<usize>,
    /// USP: Ulysses degree within a ring group.
    #[arg(long)]
    ulysses_size: Option<usize>,
    /// FPDT chunk size in global tokens.
    #[arg(long)]
    fpdt_chunk_size: Option<usize>,
    /// FPDT: keep kv chunks in host memory.
    #[arg(long)]
    fpdt_offload: bool,
    /// Keep saved layer inputs in host memory between forward and backward.
    #[arg(long)]
    offload_activations: bool,
    /// Tokens per chunk for the token-wise parts (MLP, norms, head, loss).
    #[arg(long)]
    token_chunk: Option<usize>,
    /// Model dtype on the device: f32, bf16, f16.
    #[arg(long)]
    dtype: Option<String>,
    /// cpu, cuda or cuda:N.
    #[arg(long)]
    device: Option<String>,
    /// Random seed (init of builtin models, data shuffle).
    #[arg(long)]
    seed: Option<u64>,
    /// Write a resumable checkpoint every N optimizer steps.
    #[arg(long)]
    checkpoint_every: Option<u64>,
    /// Continue from <output-dir>/checkpoint.
    #[arg(long)]
    resume: bool,
    /// rope_theta written into the exported config.json (default: last stage's).
    #[arg(long)]
    final_rope_theta: Option<f64>,
    /// Print the resolved config and exit.
    #[arg(long)]
    dry_run: bool,
}

fn resolve_config(a: &TrainArgs) -> Result<(RunConfig, PathBuf)> {
    let (mut c, src) = match &a.config {
        Some(p) => (RunConfig::from_file(p)?, p.clone()),
        None => (RunConfig::default(), PathBuf::from("<flags>")),
    };
    let flags = Path::new("<flags>");
    if let Some(v) = &a.model {
        c.model.source = v.clone();
    }
    if let Some(v) = &a.dataset {
        c.data.dataset = v.clone();
    }
    if let Some(v) = &a.dataset_column {
        c.data.column = Some(v.clone());
    }
    if let Some(v) = &a.output_dir {
        c.output_dir = v.clone();
    }
    if let Some(v) = a.batch_size {
        c.train.batch_size = v;
    }
    if let Some(v) = a.gradient_accumulate_every {
        c.train.gradient_accumulate_every = v;
    }
    if let Some(v) = a.learning_rate {
        c.train.learning_rate = v;
    }
    if let Some(v) = &a.lr_schedule {
        c.train.lr_schedule = match v.as_str() {
            "constant" => longctx::train::optim::Schedule::Constant,
            "linear" => longctx::train::optim::Schedule::Linear,
            "cosine" => longctx::train::optim::Schedule::Cosine,
            _ => return Err(longctx::Error::config(flags, "--lr-schedule", format!("expected constant, linear or cosine, got `{v}`")).into()),
        };
    }
    if let Some(v) = a.warmup_steps {
        c.train.warmup_steps = v;
    }
    if let Some(v) = a.clip_grad {
        c.train.clip_grad = v;
    }
    if let Some(v) = &a.parallel_mode {
        c.parallel.mode = v.parse::<ParallelMode>().map_err(|e| longctx::Error::config(flags, "--parallel-mode", e.to_string()))?;
    }
    if let Some(v) = a.world_size {
        c.parallel.world_size = v;
    }
    if let Some(v) = a.sp_size {
        c.parallel.sp_size = v;
    }
    if let Some(v) = a.ulysses_size {
        c.parallel.ulysses_size = v;
    }
    if let Some(v) = a.fpdt_chunk_size {
        c.parallel.fpdt_chunk_size = v;
    }
    if a.fpdt_offload {
        c.parallel.fpdt_offload = true;
    }
    if a.offload_activations {
        c.parallel.offload_activations = true;
    }
    if let Some(v) = a.token_chunk {
        c.parallel.token_chunk = v;
    }
    if let Some(v) = &a.dtype {
        c.model.dtype = v.clone();
    }
    if let Some(v) = &a.device {
        c.model.device = v.clone();
    }
    if let Some(v) = a.seed {
        c.seed = v;
    }
    if let Some(v) = a.checkpoint_every {
        c.train.checkpoint_every = v;
    }
    if let Some(v) = a.final_rope_theta {
        c.export.final_rope_theta = Some(v);
    }
    match (a.seq_length, a.rope_theta) {
        (Some(len), theta) => {
            let theta = theta.or(c.stages.last().map(|s| s.rope_theta)).unwrap_or(10_000.0);
            let steps = a.max_train_steps.or(c.stages.last().map(|s| s.steps)).unwrap_or(100);
            c.stages = vec![Stage { seq_length: len, rope_theta: theta, steps, learning_rate: None, parallel_mode: None, fpdt_chunk_size: None }];
        }
        (None, Some(theta)) => {
            for s in &mut c.stages {
                s.rope_theta = theta;
            }
        }
        (None, None) => {}
    }
    if let Some(m) = a.max_train_steps {
        for s in &mut c.stages {
            s.steps = s.steps.min(m);
        }
    }
    c.validate(&src)?;
    Ok((c, src))
}

fn main() {
    let cli = Cli::parse();
    let res = match cli.cmd {
        Cmd::Train(a) => train(a),
    };
    if let Err(e) = res {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn train(a: TrainArgs) -> Result<()> {
    let (cfg, src) = resolve_config(&a).context("resolving the run config")?;
    if a.dry_run {
        println!("{}", toml::to_string_pretty(&cfg)?);
        return Ok(());
    }
    eprintln!("longctx train — resolved config (from {}):", src.display());
    eprintln!("{}", toml::to_string(&cfg)?.trim_end());
    let summary = longctx::train::trainer::run(&cfg, a.resume).context("training")?;
    println!("exported to {}", summary.export_dir.display());
    Ok(())
}
