//! `longctx`: extend the context window of Llama-family models by continued training.
//!
//! Subcommands:
//! - `train`: the main job (with no argument it trains a tiny built-in Llama on synthetic
//!   passkey data on the CPU); flags follow EasyContext's train.py and override `--config`;
//! - `export`: a training checkpoint or any HF model directory → an HF checkpoint with a
//!   new `rope_theta` / `max_position_embeddings` / dtype / shard size;
//! - `inspect`: architecture, parameter count, dtype, RoPE and a training memory estimate;
//! - `plan`: per-GPU memory of a layout, whether it fits, and a layout that does;
//! - `launch`: one process per GPU (`longctx launch --nproc-per-node 8 -- train ...`);
//! - `bench attention`: throughput and correctness of the attention kernel (CUDA).
//! - `bench engine`: step time and memory of the training engine, activation offload on/off.
//!
//! Every failure prints one `error: ...` line (with context) and exits with status 1.

mod bench;
mod bench_engine;

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Parser, Subcommand};
use longctx::dist::{DistEnv, LaunchArgs};
use longctx::model::LlamaConfig;
use longctx::plan::{self, PlanRequest};
use longctx::train::checkpoint;
use longctx::train::config::{ParallelMode, RunConfig, Stage};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

#[derive(Parser, Debug)]
#[command(
    name = "longctx",
    version,
    about = "Long-context continued training of Llama-family models (ring / Ulysses / FPDT sequence parallelism)"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
#[allow(clippy::large_enum_variant)] // parsed once; boxing would only obscure the match
enum Cmd {
    /// Train (continued pre-training over one or more rope_theta stages). With no
    /// argument: the embedded demo (tiny built-in Llama, synthetic passkey data, CPU).
    Train(TrainArgs),
    /// Write a Hugging Face checkpoint from a training checkpoint or an HF model, with a
    /// new rope_theta, max_position_embeddings, dtype or shard size.
    Export(ExportArgs),
    /// Show a model's architecture, parameter count, dtype, RoPE settings and the memory
    /// training it at a sequence length takes.
    Inspect(InspectArgs),
    /// Predict memory per GPU for a model, sequence length, GPU count and parallel mode;
    /// say whether it fits and suggest a mode (and FPDT chunk size) that does.
    Plan(PlanArgs),
    /// Start one process per GPU running a longctx command (torchrun-style environment):
    /// `longctx launch --nproc-per-node 8 -- train --config recipes/X.toml`.
    Launch(LaunchArgs),
    /// Benchmarks.
    Bench {
        #[command(subcommand)]
        what: BenchCmd,
    },
}

#[derive(Subcommand, Debug)]
enum BenchCmd {
    /// Attention kernel throughput (TFLOP/s) and correctness checks of every mode (CUDA build).
    Attention(bench::BenchAttentionArgs),
    /// One forward+backward of the layer-wise engine: step time, tokens/s, device memory
    /// peak, with layer inputs on the device and/or offloaded (gradients compared).
    Engine(bench_engine::BenchEngineArgs),
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) if !e.use_stderr() => {
            // --help / --version: print to stdout and succeed.
            let _ = e.print();
            std::process::exit(0);
        }
        Err(e) => {
            // Usage errors: clap's first line (it names the flag and the problem), status 1.
            let text = e.render().to_string();
            let first = text.lines().map(str::trim).find(|l| !l.is_empty()).unwrap_or("invalid arguments");
            eprintln!("{} (see --help)", first.trim_end_matches('.'));
            std::process::exit(1);
        }
    };
    let res = match cli.cmd {
        Cmd::Train(a) => train(a),
        Cmd::Export(a) => export(a),
        Cmd::Inspect(a) => inspect(a),
        Cmd::Plan(a) => plan_cmd(a),
        Cmd::Launch(a) => launch(a),
        Cmd::Bench { what: BenchCmd::Attention(a) } => bench::attention(&a),
        Cmd::Bench { what: BenchCmd::Engine(a) } => bench_engine::engine(&a),
    };
    if let Err(e) = res {
        eprintln!("error: {}", one_line(&format!("{e:#}")));
        std::process::exit(1);
    }
}

/// Error chains are printed on one line.
fn one_line(s: &str) -> String {
    s.lines().map(str::trim).filter(|l| !l.is_empty()).collect::<Vec<_>>().join(" ")
}

// ------------------------------------------------------------------------ train

/// Sequence-parallel layout and memory flags, shared by `train` and `plan`.
#[derive(Args, Debug, Default, Clone)]
struct SpFlags {
    /// Sequence-parallel degree [default: all ranks for sequence-parallel modes].
    #[arg(long)]
    sp_size: Option<usize>,
    /// USP: Ulysses degree within a ring group.
    #[arg(long)]
    ulysses_size: Option<usize>,
    /// FPDT chunk size in global tokens [default: 65536].
    #[arg(long)]
    fpdt_chunk_size: Option<usize>,
    /// FPDT: park kv chunks (and saved q/o/lse, dq partials) in host memory.
    #[arg(long)]
    fpdt_offload: bool,
    /// Keep saved layer inputs in host memory between forward and backward.
    #[arg(long)]
    offload_activations: bool,
    /// Tokens per chunk for the token-wise parts (MLP, norms, head, loss) [default: 4096].
    #[arg(long)]
    token_chunk: Option<usize>,
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
    /// RoPE base theta of that stage (without --seq-length: of every stage).
    #[arg(long, allow_negative_numbers = true)]
    rope_theta: Option<f64>,
    /// data_parallel | zigzag_ring_attn | ulysses_attn | fpdt | usp
    #[arg(long)]
    parallel_mode: Option<String>,
    /// Ranks in this process (threads sharing the device) when not started by `launch`.
    #[arg(long)]
    world_size: Option<usize>,
    #[command(flatten)]
    sp: SpFlags,
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
    #[arg(long, allow_negative_numbers = true)]
    final_rope_theta: Option<f64>,
    /// Print the resolved config and exit.
    #[arg(long)]
    dry_run: bool,
    /// Stop once this many optimizer steps (counted across resumes) are done: write a
    /// checkpoint there and exit without exporting; continue with --resume (a planned
    /// preemption, e.g. before a scheduler's time limit).
    #[arg(long)]
    stop_at_step: Option<u64>,
}

/// The run config from `--config` (or the embedded demo) with the flags applied.
/// `launched_world`: WORLD_SIZE when started by a launcher (it sets the world size).
fn resolve_config(a: &TrainArgs, launched_world: Option<usize>) -> Result<(RunConfig, PathBuf)> {
    let (mut c, src) = match &a.config {
        Some(p) => (RunConfig::from_file(p)?, p.clone()),
        // No config file: the embedded demo, unless the user names their own model or
        // data, in which case the demo's hyper-parameters (lr 3e-3, batch 8, warmup)
        // would be wrong: start from the plain defaults (EasyContext-like: batch 1, lr 2e-5).
        None if a.model.is_some() || a.dataset.is_some() => (RunConfig::plain(), PathBuf::from("<flags>")),
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
            _ => {
                return Err(longctx::Error::config(flags, "--lr-schedule", format!("expected constant, linear or cosine, got `{v}`")).into())
            }
        };
    }
    if let Some(v) = a.warmup_steps {
        c.train.warmup_steps = v;
    }
    if let Some(v) = a.clip_grad {
        c.train.clip_grad = v;
    }
    if let Some(v) = &a.parallel_mode {
        c.parallel.mode = parse_mode(v, "--parallel-mode")?;
    }
    if let Some(v) = a.world_size {
        c.parallel.world_size = v;
    }
    if let Some(w) = launched_world {
        if a.world_size.is_some_and(|v| v != w) {
            bail!(
                "--world-size {} conflicts with the launcher's WORLD_SIZE {w}; under `longctx launch` the world is one rank per process",
                c.parallel.world_size
            );
        }
        if c.parallel.world_size != w && c.parallel.world_size != 1 {
            eprintln!("note: {}: world_size {} replaced by the launcher's WORLD_SIZE {w}", src.display(), c.parallel.world_size);
        }
        c.parallel.world_size = w;
    }
    let sp = &a.sp;
    if let Some(v) = sp.sp_size {
        c.parallel.sp_size = v;
    }
    if let Some(v) = sp.ulysses_size {
        c.parallel.ulysses_size = v;
    }
    if let Some(v) = sp.fpdt_chunk_size {
        c.parallel.fpdt_chunk_size = v;
    }
    c.parallel.fpdt_offload |= sp.fpdt_offload;
    c.parallel.offload_activations |= sp.offload_activations;
    if let Some(v) = sp.token_chunk {
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
            c.stages =
                vec![Stage { seq_length: len, rope_theta: theta, steps, learning_rate: None, parallel_mode: None, fpdt_chunk_size: None }];
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

fn parse_mode(v: &str, field: &str) -> Result<ParallelMode> {
    v.parse::<ParallelMode>().map_err(|e| {
        let msg = match e {
            longctx::Error::Setting(m) => m,
            other => other.to_string(),
        };
        anyhow!(longctx::Error::config("<flags>", field, msg))
    })
}

fn train(a: TrainArgs) -> Result<()> {
    let dist = DistEnv::from_env().context("reading the distributed environment (RANK, WORLD_SIZE, ...)")?;
    let (cfg, src) = resolve_config(&a, dist.as_ref().map(|d| d.world)).context("resolving the run config")?;
    // The model's head counts against every stage's layout, when its config is at hand
    // without downloading (a hub model not yet cached is checked by the trainer).
    if let Some(m) = model_config(&cfg.model.source, false).context("reading the model config")? {
        plan::check_run(&cfg, &m.cfg, &src).context("checking the parallel layout against the model")?;
    }
    let limits = longctx::train::trainer::RunLimits { stop_at_global_step: a.stop_at_step };
    if a.dry_run {
        println!("{}", toml::to_string_pretty(&cfg)?);
        return Ok(());
    }
    if let Some(env) = dist {
        return train_launched(&env, &cfg, a.resume, limits);
    }
    eprintln!("longctx train — resolved config (from {}):", src.display());
    eprintln!("{}", toml::to_string(&cfg)?.trim_end());
    let summary = longctx::train::trainer::run_with_limits(&cfg, a.resume, limits).context("training")?;
    if !summary.completed {
        return Ok(());
    }
    println!("exported to {}", summary.export_dir.display());
    Ok(())
}

/// One rank of a multi-process run (started by `longctx launch`, torchrun or Slurm):
/// rendezvous → world communicator (NCCL on GPUs, the process transport on the CPU) →
/// the same rank loop as in-process runs.
fn train_launched(env: &DistEnv, cfg: &RunConfig, resume: bool, limits: longctx::train::trainer::RunLimits) -> Result<()> {
    let summary =
        longctx::train::trainer::run_launched(cfg, resume, env, limits).with_context(|| format!("rank {} of {}", env.rank, env.world))?;
    if let Some(s) = summary.filter(|s| s.completed) {
        println!("exported to {}", s.export_dir.display());
    }
    Ok(())
}

// ------------------------------------------------------------------------ model configs

/// A model's config.json, typed, and the directory it came from (None for builtins).
struct ModelInfo {
    cfg: LlamaConfig,
    dir: Option<PathBuf>,
}

/// The config of `--model` without its weights: `builtin:NAME`, a directory with
/// config.json, a config.json file, or a hub id (from the HF cache; downloaded — config.json
/// only — when `fetch` and not offline). `Ok(None)`: a hub model that is not cached and
/// `fetch` is false.
fn model_config(spec: &str, fetch: bool) -> Result<Option<ModelInfo>> {
    if let Some(name) = spec.strip_prefix("builtin:") {
        return Ok(Some(ModelInfo { cfg: longctx::train::init::builtin_config(name)?, dir: None }));
    }
    let path = match longctx::hub::ModelSpec::parse(spec) {
        longctx::hub::ModelSpec::Local(p) if p.is_file() => p,
        longctx::hub::ModelSpec::Local(p) if p.is_dir() => longctx::hub::config_path(&p)?,
        longctx::hub::ModelSpec::Local(p) => {
            return Err(longctx::Error::checkpoint(
                p,
                "model not found: neither a directory, a config.json, `builtin:NAME` nor a hub id `org/name[@revision]`",
            )
            .into())
        }
        longctx::hub::ModelSpec::Hub { repo_id, revision } => {
            let opts = longctx::hub::HubOptions::from_env();
            match cached_hub_config(&opts.cache_dir, &repo_id, &revision) {
                Some(p) => p,
                None if fetch && !opts.offline => download_hub_config(&opts, &repo_id, &revision)?,
                None if fetch => bail!(
                    "model `{repo_id}` has no cached config.json in {} and HF_HUB_OFFLINE forbids downloading it",
                    opts.cache_dir.display()
                ),
                None => return Ok(None),
            }
        }
    };
    let text = std::fs::read_to_string(&path).map_err(|e| longctx::Error::io(&path, e))?;
    let json: Value = serde_json::from_str(&text).map_err(|e| longctx::Error::checkpoint(&path, format!("not valid JSON: {e}")))?;
    let cfg = LlamaConfig::from_value(&path, json)?;
    Ok(Some(ModelInfo { cfg, dir: path.parent().map(Path::to_path_buf) }))
}

/// `<cache>/models--org--name/snapshots/<commit>/config.json` when the revision is cached.
fn cached_hub_config(cache: &Path, repo_id: &str, revision: &str) -> Option<PathBuf> {
    let folder = cache.join(format!("models--{}", repo_id.replace('/', "--")));
    let commit = if revision.len() == 40 && folder.join("snapshots").join(revision).is_dir() {
        revision.to_string()
    } else {
        std::fs::read_to_string(folder.join("refs").join(revision)).ok()?.trim().to_string()
    };
    let p = folder.join("snapshots").join(commit).join("config.json");
    p.is_file().then_some(p)
}

/// Downloads config.json only (into the HF cache).
fn download_hub_config(opts: &longctx::hub::HubOptions, repo_id: &str, revision: &str) -> Result<PathBuf> {
    let mut b =
        hf_hub::api::sync::ApiBuilder::new().with_cache_dir(opts.cache_dir.clone()).with_token(opts.token.clone()).with_progress(false);
    if let Some(ep) = &opts.endpoint {
        b = b.with_endpoint(ep.clone());
    }
    let api = b.build().context("setting up the Hugging Face hub client")?;
    let repo = api.repo(hf_hub::Repo::with_revision(repo_id.to_string(), hf_hub::RepoType::Model, revision.to_string()));
    repo.get("config.json").with_context(|| {
        format!(
            "downloading config.json of `{repo_id}@{revision}` (no network? gated model: set HF_TOKEN; offline: pass a local directory)"
        )
    })
}

fn parse_dtype(s: &str, field: &str) -> Result<candle_core::DType> {
    Ok(longctx::train::trainer::parse_dtype(s, Path::new("<flags>"), field)?)
}

fn size_arg(s: &str) -> std::result::Result<u64, String> {
    plan::parse_size(s)
}

fn tokens_arg(s: &str) -> std::result::Result<usize, String> {
    plan::parse_tokens(s)
}

fn positive_theta(v: f64, field: &str) -> Result<f64> {
    if v > 0.0 && v.is_finite() {
        Ok(v)
    } else {
        Err(longctx::Error::config("<flags>", field, format!("must be a positive number, got {v}")).into())
    }
}

// ------------------------------------------------------------------------ export

#[derive(Args, Debug)]
struct ExportArgs {
    /// What to export: a training output directory (holding checkpoint/), a checkpoint
    /// directory (holding state.json), a Hugging Face model directory, or a hub id.
    source: String,
    /// Directory to write the Hugging Face checkpoint to (replaced atomically if it exists).
    #[arg(long, short = 'o')]
    output_dir: PathBuf,
    /// rope_theta written into config.json [default: a training checkpoint's final theta
    /// (export.final_rope_theta, else its last trained stage's); an HF model's own].
    #[arg(long, allow_negative_numbers = true)]
    rope_theta: Option<f64>,
    /// max_position_embeddings written into config.json [default: the trained length, at
    /// least the model's; an HF model's own].
    #[arg(long)]
    max_position_embeddings: Option<usize>,
    /// Largest weight shard: bytes or a size such as 5GB, 500MB, 2GiB [default: the run's
    /// export.max_shard_bytes, else 5GB].
    #[arg(long, value_parser = size_arg)]
    max_shard_size: Option<u64>,
    /// dtype of the written weights: f32, bf16, f16 [default: as stored].
    #[arg(long)]
    dtype: Option<String>,
}

/// Where a training checkpoint's state.json is, if `source` is one (or a run holding one).
fn training_checkpoint_dir(source: &str) -> Option<PathBuf> {
    let p = Path::new(source);
    if p.join("state.json").is_file() && p.join("model.safetensors").is_file() {
        return Some(p.to_path_buf());
    }
    let c = checkpoint::checkpoint_dir(p);
    c.join("state.json").is_file().then_some(c)
}

/// Loads every tensor of a model directory in its stored dtype.
fn load_stored(dir: &Path) -> Result<Vec<(String, candle_core::Tensor)>> {
    let ck = longctx::hub::Checkpoint::open(dir)?;
    let mut out = Vec::new();
    for name in ck.names() {
        let (dt, _) = ck.info(name).ok_or_else(|| anyhow!("tensor `{name}` vanished from {}", dir.display()))?;
        let dtype = longctx::hub::st_file::float_dtype(dt)
            .ok_or_else(|| longctx::Error::checkpoint(dir, format!("tensor `{name}` is {dt}, not a floating-point weight")))?;
        out.push((name.to_string(), ck.load(name, dtype, &candle_core::Device::Cpu)?));
    }
    Ok(out)
}

/// What an export starts from: the weights, config.json and the defaults the source implies.
struct ExportSource {
    tensors: Vec<(String, candle_core::Tensor)>,
    config: Value,
    /// Directories the export must not replace (the source, the model it came from).
    dirs: Vec<PathBuf>,
    /// Where tokenizer files are copied from.
    tokenizer_dir: Option<PathBuf>,
    theta: Option<f64>,
    max_pos: Option<usize>,
    max_shard: Option<u64>,
    dtype: Option<String>,
    /// For the summary line.
    what: String,
}

/// A training checkpoint: weights from `model.safetensors`, the model config from the run
/// config saved in `state.json`, defaults as the trainer's own export would use.
fn training_source(dir: &Path) -> Result<ExportSource> {
    let sp = dir.join("state.json");
    let state = longctx::train::checkpoint::read_state(dir)?;
    let run: RunConfig = serde_json::from_value(state.config.clone())
        .map_err(|e| longctx::Error::checkpoint(&sp, format!("field `config` is not a run config: {e}")))?;
    let (mcfg, mut config, model_dir) =
        run_model_config(&run).with_context(|| format!("the model of the run saved in {}", sp.display()))?;
    longctx::hub::disable_sliding_window(&mut config)?; // trained with full causal attention, as the trainer's export says
    let n = run.stages.len();
    let finished = state.stage >= n;
    // The last stage that trained: the one in progress, or the one before when it has not started.
    let trained = if state.stage_step > 0 { state.stage } else { state.stage.saturating_sub(1) };
    let st =
        run.stages.get(trained.min(n.saturating_sub(1))).ok_or_else(|| longctx::Error::checkpoint(&sp, "the run config has no stage"))?;
    let theta = if finished { run.export.final_rope_theta.unwrap_or(st.rope_theta) } else { st.rope_theta };
    let max_pos = match (finished, run.export.max_position_embeddings) {
        (true, Some(m)) => m,
        _ => st.seq_length.max(mcfg.max_position_embeddings),
    };
    let what = if finished {
        format!("finished run ({n} stage(s), {} steps)", state.global_step)
    } else {
        format!("mid-run checkpoint (stage {} step {} of {n} stage(s))", state.stage, state.stage_step)
    };
    let mut dirs = vec![dir.to_path_buf()];
    dirs.extend(model_dir.clone());
    Ok(ExportSource {
        tensors: load_stored(dir)?,
        config,
        dirs,
        tokenizer_dir: model_dir,
        theta: Some(theta),
        max_pos: Some(max_pos),
        max_shard: run.export.max_shard_bytes,
        dtype: run.export.dtype.clone(),
        what,
    })
}

/// A Hugging Face model directory or hub id: everything as stored unless flags say otherwise.
fn hf_source(spec: &str) -> Result<ExportSource> {
    let resolved = longctx::hub::resolve_model(spec, &longctx::hub::HubOptions::from_env())?;
    let dir = resolved.dir;
    Ok(ExportSource {
        tensors: load_stored(&dir)?,
        config: longctx::hub::read_config(&dir)?,
        dirs: vec![dir.clone()],
        tokenizer_dir: Some(dir.clone()),
        theta: None,
        max_pos: None,
        max_shard: None,
        dtype: None,
        what: format!("Hugging Face model {}", dir.display()),
    })
}

fn export(a: ExportArgs) -> Result<()> {
    if let Some(t) = a.rope_theta {
        positive_theta(t, "--rope-theta")?;
    }
    if a.max_position_embeddings == Some(0) {
        return Err(longctx::Error::config("<flags>", "--max-position-embeddings", "must be at least 1").into());
    }
    let flag_dtype = a.dtype.as_deref().map(|d| parse_dtype(d, "--dtype")).transpose()?;
    let mut src = match training_checkpoint_dir(&a.source) {
        Some(dir) => {
            // `-o <run dir>` would replace the run (checkpoint included) by the export.
            if let Some(run_dir) = dir.parent() {
                refuse_overwrite(&[run_dir.to_path_buf()], &a.output_dir)?;
            }
            training_source(&dir)?
        }
        None => hf_source(&a.source)?,
    };
    refuse_overwrite(&src.dirs, &a.output_dir)?;
    let cur = LlamaConfig::from_value("config.json", src.config.clone()).ok();
    let theta = a.rope_theta.or(src.theta);
    let max_pos = a.max_position_embeddings.or(src.max_pos);
    if theta.is_some() || max_pos.is_some() {
        let t = theta
            .or(cur.as_ref().map(|c| c.rope_theta))
            .ok_or_else(|| anyhow!("config.json has no readable rope_theta; pass --rope-theta"))?;
        let m = max_pos
            .or(cur.as_ref().map(|c| c.max_position_embeddings))
            .ok_or_else(|| anyhow!("config.json has no readable max_position_embeddings; pass --max-position-embeddings"))?;
        longctx::hub::set_context_fields(&mut src.config, t, m)?;
    }
    let dtype = match (flag_dtype, &src.dtype) {
        (Some(d), _) => Some(d),
        (None, Some(d)) => Some(parse_dtype(d, "export.dtype")?),
        (None, None) => None,
    };
    let opts = longctx::hub::ExportOptions { max_shard_bytes: a.max_shard_size.or(src.max_shard).unwrap_or(5_000_000_000), dtype };
    let rep = longctx::hub::export(&a.output_dir, &src.tensors, &src.config, src.tokenizer_dir.as_deref(), &opts)
        .context("writing the export")?;
    let after = LlamaConfig::from_value("config.json", src.config).ok();
    println!(
        "exported {} tensors ({}) in {} file(s) to {} from {}; rope_theta {}, max_position_embeddings {}",
        src.tensors.len(),
        human_bytes(rep.total_size),
        rep.weight_files.len(),
        rep.dir.display(),
        src.what,
        after.as_ref().map_or("?".into(), |c| c.rope_theta.to_string()),
        after.as_ref().map_or("?".into(), |c| c.max_position_embeddings.to_string()),
    );
    Ok(())
}

/// Error when writing `out` would replace one of `dirs` or a directory holding one.
fn refuse_overwrite(dirs: &[PathBuf], out: &Path) -> Result<()> {
    let Ok(o) = out.canonicalize() else { return Ok(()) }; // does not exist yet
    for d in dirs {
        if let Ok(d) = d.canonicalize() {
            if d.starts_with(&o) {
                bail!("--output-dir {} would replace the source {}; export to another directory", out.display(), d.display());
            }
        }
    }
    Ok(())
}

/// The model config of a run (builtin or its source's config.json) and the source
/// directory (for the tokenizer files).
fn run_model_config(run: &RunConfig) -> Result<(LlamaConfig, Value, Option<PathBuf>)> {
    if let Some(name) = run.model.source.strip_prefix("builtin:") {
        let json = longctx::train::init::builtin_config_json(name)?;
        return Ok((longctx::train::init::builtin_config(name)?, json, None));
    }
    let resolved = longctx::hub::resolve_model(&run.model.source, &longctx::hub::HubOptions::from_env())?;
    let json = longctx::hub::read_config(&resolved.dir)?;
    let cfg = LlamaConfig::from_value(resolved.dir.join("config.json"), json.clone())?;
    Ok((cfg, json, Some(resolved.dir)))
}

// ------------------------------------------------------------------------ inspect

#[derive(Args, Debug)]
struct InspectArgs {
    /// Model: `builtin:NAME`, a Hugging Face model directory (or its config.json), or a
    /// hub id (config.json is fetched; weights are read only if already cached).
    #[arg(long)]
    model: String,
    /// Sequence length of the training memory estimate (e.g. 65536, 64K, 1M)
    /// [default: max_position_embeddings].
    #[arg(long, value_parser = tokens_arg)]
    seq_length: Option<usize>,
    /// GPUs of the memory estimate.
    #[arg(long, default_value_t = 1)]
    gpus: usize,
    /// Memory of one GPU: bytes or a size such as 141GB, 80GiB.
    #[arg(long, default_value = "141GB", value_parser = size_arg)]
    gpu_memory: u64,
    /// Parallel mode of the estimate [default: data_parallel on 1 GPU, zigzag_ring_attn on more].
    #[arg(long)]
    parallel_mode: Option<String>,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

/// What the weight files say.
#[derive(serde::Serialize)]
struct StoredWeights {
    files: usize,
    tensors: usize,
    parameters: u64,
    bytes: u64,
    /// dtype → parameters stored in it.
    dtypes: BTreeMap<String, u64>,
}

fn stored_weights(dir: &Path) -> Result<Option<StoredWeights>> {
    let has = dir.join(longctx::hub::load::SINGLE_FILE).is_file() || dir.join(longctx::hub::load::INDEX_FILE).is_file();
    if !has {
        return Ok(None);
    }
    let ck = longctx::hub::Checkpoint::open(dir)?;
    let mut w = StoredWeights { files: ck.files().len(), tensors: 0, parameters: 0, bytes: 0, dtypes: BTreeMap::new() };
    for name in ck.names() {
        if name.ends_with("rotary_emb.inv_freq") {
            continue; // a buffer some old checkpoints store, not a parameter
        }
        let Some((dt, shape)) = ck.info(name) else { continue };
        let n: u64 = shape.iter().map(|&x| x as u64).product();
        w.tensors += 1;
        w.parameters += n;
        w.bytes += n * longctx::hub::st_file::dtype_size(dt).unwrap_or(0) as u64;
        *w.dtypes.entry(dt.to_string()).or_default() += n;
    }
    Ok(Some(w))
}

fn inspect(a: InspectArgs) -> Result<()> {
    let m = model_config(&a.model, true)?.ok_or_else(|| anyhow!("model `{}` not found", a.model))?;
    let c = &m.cfg;
    let stored = match &m.dir {
        Some(d) => stored_weights(d).with_context(|| format!("reading the weights in {}", d.display()))?,
        None => None,
    };
    let shape = plan::ModelShape::from_config(c);
    let seq = a.seq_length.unwrap_or(c.max_position_embeddings);
    let mode = match &a.parallel_mode {
        Some(v) => parse_mode(v, "--parallel-mode")?,
        None if a.gpus > 1 => ParallelMode::ZigzagRingAttn,
        None => ParallelMode::DataParallel,
    };
    let req = PlanRequest::new(seq, a.gpus, a.gpu_memory, mode);
    let p = plan::plan(&shape, &req).context("memory estimate")?;
    let arch = c.architectures.as_ref().map(|v| v.join(",")).unwrap_or_else(|| c.arch.model_type().to_string());
    let rope_scaling = c.rope_scaling.as_ref().map(|r| format!("{} (factor {})", r.type_name(), r.factor()));
    if a.json {
        let out = serde_json::json!({
            "model": a.model,
            "architecture": arch,
            "model_type": c.arch.model_type(),
            "parameters": stored.as_ref().map_or(shape.params, |w| w.parameters),
            "parameters_from_config": shape.params,
            "stored": stored,
            "torch_dtype": c.torch_dtype,
            "rope_theta": c.rope_theta,
            "rope_scaling": rope_scaling,
            "max_position_embeddings": c.max_position_embeddings,
            "vocab_size": c.vocab_size,
            "hidden_size": c.hidden_size,
            "intermediate_size": c.intermediate_size,
            "num_hidden_layers": c.num_hidden_layers,
            "num_attention_heads": c.num_attention_heads,
            "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.head_dim,
            "tie_word_embeddings": c.tie_word_embeddings,
            "memory": p,
        });
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(());
    }
    println!("model                    {}", a.model);
    println!("architecture             {arch} (model_type {})", c.arch.model_type());
    match &stored {
        Some(w) => {
            let dts: Vec<String> = w.dtypes.iter().map(|(k, n)| format!("{k} ({} params)", group(*n))).collect();
            println!(
                "parameters               {} ({} tensors in {} file(s), {} on disk)",
                group(w.parameters),
                w.tensors,
                w.files,
                human_bytes(w.bytes)
            );
            println!("dtype on disk            {}", dts.join(", "));
            if w.parameters != shape.params {
                println!("parameters (config)      {} — differs from the weight files", group(shape.params));
            }
        }
        None => {
            println!("parameters               {} (from config.json; no weight files at hand)", group(shape.params));
            println!("dtype on disk            - (config torch_dtype: {})", c.torch_dtype.as_deref().unwrap_or("unset"));
        }
    }
    println!("rope_theta               {}", c.rope_theta);
    println!("rope_scaling             {}", rope_scaling.as_deref().unwrap_or("none"));
    println!("max_position_embeddings  {}", c.max_position_embeddings);
    println!("vocab_size               {}", c.vocab_size);
    println!("layers / hidden / mlp    {} / {} / {}", c.num_hidden_layers, c.hidden_size, c.intermediate_size);
    println!("heads / kv heads / dim   {} / {} / {}", c.num_attention_heads, c.num_key_value_heads, c.head_dim);
    println!("tied embeddings          {}", c.tie_word_embeddings);
    let e = &p.estimate;
    println!(
        "training memory          {} GB per GPU at {} tokens, {} on {} GPU(s) (bf16, optimizer on host): {} in {} GB",
        plan::gb(e.device.peak),
        plan::tokens_label(seq),
        mode,
        a.gpus,
        if e.fits { "fits" } else { "does not fit" },
        plan::gb(a.gpu_memory)
    );
    print_suggestion(&p);
    Ok(())
}

/// Bytes in GB, MB or kB (powers of 1000).
fn human_bytes(b: u64) -> String {
    match b {
        b if b >= 1_000_000_000 => format!("{:.2} GB", b as f64 / 1e9),
        b if b >= 1_000_000 => format!("{:.2} MB", b as f64 / 1e6),
        b => format!("{:.1} kB", b as f64 / 1e3),
    }
}

/// 6738415616 → 6,738,415,616.
fn group(n: u64) -> String {
    let s = n.to_string();
    let mut out = String::new();
    for (i, ch) in s.chars().enumerate() {
        if i > 0 && (s.len() - i).is_multiple_of(3) {
            out.push(',');
        }
        out.push(ch);
    }
    out
}

// ------------------------------------------------------------------------ plan

#[derive(Args, Debug)]
struct PlanArgs {
    /// Model: `builtin:NAME`, a Hugging Face model directory (or its config.json), or a hub
    /// id (only config.json is fetched) [default: the --config's model].
    #[arg(long)]
    model: Option<String>,
    /// Run config: plan every stage with its parallel settings (flags override).
    #[arg(long)]
    config: Option<PathBuf>,
    /// Sequence length in tokens (e.g. 524288, 512K, 1M) [required without --config].
    #[arg(long, value_parser = tokens_arg)]
    seq_length: Option<usize>,
    /// GPUs in total [default: --world-size, else the config's world_size, else 1].
    #[arg(long)]
    gpus: Option<usize>,
    /// Nodes the GPUs are spread over.
    #[arg(long, default_value_t = 1)]
    nnodes: usize,
    /// Ranks, one GPU each [default: --gpus]; more ranks than GPUs is an error.
    #[arg(long)]
    world_size: Option<usize>,
    /// Memory of one GPU: bytes or a size such as 141GB, 80GB, 96GiB.
    #[arg(long, default_value = "141GB", value_parser = size_arg)]
    gpu_memory: u64,
    /// Host memory of one node (checked only when given), e.g. 2TB.
    #[arg(long, value_parser = size_arg)]
    host_memory: Option<u64>,
    /// data_parallel | zigzag_ring_attn | ulysses_attn | fpdt | usp
    /// [default: the config's; data_parallel on 1 GPU, else zigzag_ring_attn].
    #[arg(long)]
    parallel_mode: Option<String>,
    #[command(flatten)]
    sp: SpFlags,
    /// Sequences per micro-batch per data-parallel rank [default: 1].
    #[arg(long)]
    batch_size: Option<usize>,
    /// Model dtype on the GPU: bf16, f16 or f32 [default: the config's if not f32, else bf16].
    #[arg(long)]
    dtype: Option<String>,
    /// Keep the AdamW state (f32 master, m, v) on the GPU instead of the host.
    #[arg(long)]
    optimizer_on_device: bool,
    /// Fixed allowance per GPU (CUDA context, workspaces, fragmentation).
    #[arg(long, default_value = "3GB", value_parser = size_arg)]
    overhead: u64,
    /// Print JSON instead of text.
    #[arg(long)]
    json: bool,
}

fn plan_cmd(a: PlanArgs) -> Result<()> {
    let run = match &a.config {
        Some(p) => {
            let c = RunConfig::from_file(p)?;
            c.validate(p)?;
            Some((c, p.clone()))
        }
        None => None,
    };
    let spec = match (&a.model, &run) {
        (Some(m), _) => m.clone(),
        (None, Some((c, _))) => c.model.source.clone(),
        (None, None) => bail!("--model is required (or --config with a model.source)"),
    };
    let info = model_config(&spec, true)?.ok_or_else(|| anyhow!("model `{spec}` not found"))?;
    let shape = plan::ModelShape::from_config(&info.cfg);
    if let Some((c, p)) = &run {
        plan::check_run(c, &info.cfg, p)?;
    }
    let bytes = |d: &str| -> Result<usize> { Ok(parse_dtype(d, "--dtype")?.size_in_bytes()) };
    let world = a.world_size.or(run.as_ref().map(|(c, _)| c.parallel.world_size));
    let gpus = a.gpus.or(world).unwrap_or(1);
    let world = world.unwrap_or(gpus);
    let flag_mode = a.parallel_mode.as_deref().map(|m| parse_mode(m, "--parallel-mode")).transpose()?;
    let base = |mode: ParallelMode, seq: usize| -> Result<PlanRequest> {
        let mut r = PlanRequest::new(seq, gpus, a.gpu_memory, mode);
        r.world = world;
        r.nnodes = a.nnodes;
        r.host_memory = a.host_memory;
        r.optimizer_on_host = !a.optimizer_on_device;
        r.overhead = a.overhead;
        r.dtype_bytes = match (&a.dtype, &run) {
            (Some(d), _) => bytes(d)?,
            (None, Some((c, _))) if c.model.dtype != "f32" && c.model.dtype != "float32" => bytes(&c.model.dtype)?,
            _ => 2,
        };
        if let Some((c, _)) = &run {
            r.sp = (c.parallel.sp_size > 0).then_some(c.parallel.sp_size);
            r.ulysses = Some(c.parallel.ulysses_size);
            r.fpdt_chunk = c.parallel.fpdt_chunk_size;
            r.fpdt_offload = c.parallel.fpdt_offload;
            r.offload_activations = c.parallel.offload_activations;
            r.token_chunk = c.parallel.token_chunk;
            r.batch_size = c.train.batch_size;
        }
        r.sp = a.sp.sp_size.or(r.sp);
        r.ulysses = a.sp.ulysses_size.or(r.ulysses);
        r.fpdt_chunk = a.sp.fpdt_chunk_size.unwrap_or(r.fpdt_chunk);
        r.fpdt_offload |= a.sp.fpdt_offload;
        r.offload_activations |= a.sp.offload_activations;
        r.token_chunk = a.sp.token_chunk.unwrap_or(r.token_chunk);
        r.batch_size = a.batch_size.unwrap_or(r.batch_size);
        Ok(r)
    };
    let default_mode = if world > 1 { ParallelMode::ZigzagRingAttn } else { ParallelMode::DataParallel };
    let mut reqs: Vec<(String, PlanRequest)> = Vec::new();
    match (&run, a.seq_length) {
        (Some((c, _)), None) => {
            for (i, st) in c.stages.iter().enumerate() {
                let mode = flag_mode.or(st.parallel_mode).unwrap_or(c.parallel.mode);
                let mut r = base(mode, st.seq_length)?;
                if a.sp.fpdt_chunk_size.is_none() {
                    r.fpdt_chunk = st.fpdt_chunk_size.unwrap_or(r.fpdt_chunk);
                }
                reqs.push((format!("stage {i} (rope_theta {})", st.rope_theta), r));
            }
        }
        (Some((c, _)), Some(seq)) => reqs.push((String::new(), base(flag_mode.unwrap_or(c.parallel.mode), seq)?)),
        (None, Some(seq)) => reqs.push((String::new(), base(flag_mode.unwrap_or(default_mode), seq)?)),
        (None, None) => bail!("--seq-length is required (or --config with stages)"),
    }
    let mut plans = Vec::new();
    for (label, r) in &reqs {
        let p =
            plan::plan(&shape, r).with_context(|| if label.is_empty() { "planning".to_string() } else { format!("planning {label}") })?;
        plans.push((label.clone(), p));
    }
    if a.json {
        let v: Vec<&plan::Plan> = plans.iter().map(|(_, p)| p).collect();
        println!("{}", serde_json::to_string_pretty(&if v.len() == 1 { serde_json::to_value(v[0])? } else { serde_json::to_value(&v)? })?);
        return Ok(());
    }
    println!(
        "model: {spec}: {} parameters, {} layers, hidden {}, {} query / {} kv heads × {}, vocab {}",
        group(shape.params),
        shape.layers,
        shape.hidden,
        shape.heads,
        shape.kv_heads,
        shape.head_dim,
        shape.vocab
    );
    for (label, p) in &plans {
        if !label.is_empty() {
            println!("\n== {label}");
        }
        print_plan(p);
    }
    Ok(())
}

fn print_plan(p: &plan::Plan) {
    let r = &p.request;
    let e = &p.estimate;
    let l = &e.layout;
    let mut how = format!("{}", l.mode);
    match l.mode {
        ParallelMode::Usp => how += &format!(" (ulysses {} × ring {})", l.ulysses, l.ring),
        ParallelMode::Fpdt => how += &format!(" (chunk {}{})", r.fpdt_chunk, if r.fpdt_offload { ", kv offload" } else { "" }),
        _ => {}
    }
    println!(
        "{} tokens, {how} on {} GPU(s) ({} rank(s), sp {} × dp {}): {} tokens per GPU, micro-batch {}, {}-byte weights, token chunk {}{}",
        plan::tokens_label(r.seq_len),
        r.gpus,
        l.world,
        l.sp,
        l.dp,
        l.local_tokens,
        r.batch_size,
        r.dtype_bytes,
        r.token_chunk,
        if r.offload_activations { ", activations offloaded" } else { "" }
    );
    let d = &e.device;
    let rows: [(&str, u64, &str); 13] = [
        ("weights", d.weights, ""),
        ("gradients (f32)", d.gradients, ""),
        ("optimizer (f32 master, m, v)", d.optimizer, if r.optimizer_on_host { "on the host" } else { "ZeRO-1 over all ranks" }),
        ("saved activations", d.saved_activations, if r.offload_activations { "offloaded" } else { "" }),
        ("layer transient", d.layer_transient, "backward of one layer, of which:"),
        ("  [b, s, h] tensors", d.layer_io, ""),
        ("  q/k/v/o + grads", d.attention_local, ""),
        ("  lse", d.lse, ""),
        ("  attention mode", d.attention_mode, ""),
        ("  mlp chunk", d.mlp_chunk, ""),
        ("head transient", d.head, "logits chunk; not alive with the layer's"),
        ("overhead", d.overhead, ""),
        ("gradient all-reduce buffer", d.grad_reduce, "optimizer step only"),
    ];
    println!("  per GPU                             GB");
    for (name, v, note) in rows {
        println!("{}", format!("  {name:<30} {:>8}  {note}", plan::gb(v)).trim_end());
    }
    println!("  peak, forward/backward         {:>8}", plan::gb(d.peak_compute));
    println!("  peak, optimizer step           {:>8}", plan::gb(d.peak_step));
    println!(
        "  peak                           {:>8}  of {} GB: {}",
        plan::gb(d.peak),
        plan::gb(r.gpu_memory),
        if e.fits_gpu {
            format!("fits ({} GB free)", plan::gb(r.gpu_memory - d.peak))
        } else {
            format!("does NOT fit ({} GB short)", plan::gb(d.peak - r.gpu_memory))
        }
    );
    let h = &e.host;
    println!(
        "  host: {} GB per rank (optimizer {}, offloaded activations {}, fpdt parked {}, trainer copies {}), {} GB per node of {} rank(s){}",
        plan::gb(h.per_rank),
        plan::gb(h.optimizer),
        plan::gb(h.saved_activations),
        plan::gb(h.fpdt_parked),
        plan::gb(h.weights_copy + h.grads_copy),
        plan::gb(h.per_node),
        h.ranks_per_node,
        match (e.fits_host, r.host_memory) {
            (Some(true), Some(m)) => format!(": fits in {} GB", plan::gb(m)),
            (Some(false), Some(m)) => format!(": does NOT fit in {} GB", plan::gb(m)),
            _ => String::new(),
        }
    );
    print_suggestion(p);
}

fn print_suggestion(p: &plan::Plan) {
    match &p.suggestion {
        Some(s) if s.as_requested => println!("  suggestion: as requested ({} GB peak)", plan::gb(s.peak)),
        Some(s) => {
            let mut flags = format!("--parallel-mode {}", s.mode);
            if s.mode != ParallelMode::DataParallel && s.sp != p.request.world {
                flags += &format!(" --sp-size {}", s.sp);
            }
            if s.mode == ParallelMode::Usp {
                flags += &format!(" --ulysses-size {}", s.ulysses);
            }
            if let Some(c) = s.fpdt_chunk {
                flags += &format!(" --fpdt-chunk-size {c}");
            }
            if s.fpdt_offload {
                flags += " --fpdt-offload";
            }
            if s.offload_activations {
                flags += " --offload-activations";
            }
            println!("  suggestion: {flags} ({} GB peak)", plan::gb(s.peak));
        }
        None => println!(
            "  suggestion: none fits on {} GPU(s) of {} GB; add GPUs (the activation terms shrink with sp) or a smaller micro-batch",
            p.request.gpus,
            plan::gb(p.request.gpu_memory)
        ),
    }
}

// ------------------------------------------------------------------------ launch

fn launch(a: LaunchArgs) -> Result<()> {
    let opts = a.into_options()?;
    match longctx::dist::launch(opts) {
        Ok(0) => Ok(()),
        Ok(code) => std::process::exit(code),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(e.exit_code());
        }
    }
}
