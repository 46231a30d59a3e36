//! `longctx train`: resolve the run config (the TOML, or the embedded demo, with the flags
//! over it), check it, and run it in this process or as one rank of a launched world.

use super::overrides::{DataFlags, LayoutFlags, RunFlags, StageFlags, TrainFlags};
use anyhow::{bail, Context, Result};
use clap::Args;
use longctx::parallel::DistEnv;
use longctx::train::config::RunConfig;
use longctx::train::trainer::{self, RunOptions, RunSummary, StopFlag, StopReason};
use std::path::PathBuf;

/// Flags follow EasyContext's train.py where it has them; every flag overrides the
/// TOML config file given with --config.
#[derive(Args, Debug, Default)]
pub struct TrainArgs {
    /// TOML run config (see configs/ and recipes/); flags override its values.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// A DeepSpeed JSON config (e.g. EasyContext's zero3_offload.json), read as is: its
    /// optimizer, scheduler, bf16/fp16, batch, accumulation, clipping and
    /// zero_optimization offloads set the matching settings over --config's (flags still
    /// win); every key gets a line saying what it set, or why it has no effect here.
    #[arg(long, value_name = "FILE")]
    pub deepspeed: Option<PathBuf>,
    #[command(flatten)]
    pub layout: LayoutFlags,
    #[command(flatten)]
    pub stages: StageFlags,
    #[command(flatten)]
    pub data: DataFlags,
    #[command(flatten)]
    pub train: TrainFlags,
    #[command(flatten)]
    pub run: RunFlags,
    /// Continue from <output-dir>/checkpoint, with the config saved there (flags, and a
    /// --config given with it, override it). The saved config is compared with the new one:
    /// changes that break exactness (model, data, seed, a started stage's length or θ) are
    /// refused, others (learning rate, steps, cadence...) are listed. A finished run (its
    /// export in place) is left as it is.
    #[arg(long)]
    pub resume: bool,
    /// Start afresh in an output directory that holds a run (its checkpoint, metrics and
    /// export are removed); without it such a directory is refused.
    #[arg(long, conflicts_with = "resume")]
    pub overwrite: bool,
    /// With --resume: allow a new parallel layout (world size, mode, batch split); the
    /// optimizer state is re-cut and the run continues within rounding, not bit for bit.
    #[arg(long, requires = "resume")]
    pub allow_layout_change: bool,
    /// Print the resolved config and the plan (per stage: tokens per step, data, seed,
    /// memory per GPU when the model's config is at hand) and exit.
    #[arg(long)]
    pub dry_run: bool,
    /// Run even when the memory planner estimates that a stage does not fit the GPU (or
    /// the host memory its offloads need), or that the checkpoints and the export do not
    /// fit the free space of the output directory's disk; by default such a run is refused
    /// before any work, with the largest length that fits and a layout that fits (or the
    /// sizes to write).
    #[arg(long)]
    pub skip_memory_check: bool,
    /// Stop once this many optimizer steps (counted across resumes) are done: write a
    /// checkpoint there and exit without exporting; continue with --resume (a planned
    /// preemption, e.g. before a scheduler's time limit).
    #[arg(long)]
    pub stop_at_step: Option<u64>,
    /// Do not print the resolved config at the start (one line says where it came from;
    /// --dry-run prints it, and every checkpoint's state.json keeps it).
    #[arg(long, short)]
    pub quiet: bool,
}

/// The run config from `--config` (or the embedded demo) with the flags applied, and
/// where it came from. `launched_world`: WORLD_SIZE when started by a launcher (it sets
/// the world size).
pub fn resolve_config(a: &TrainArgs, launched_world: Option<usize>) -> Result<(RunConfig, PathBuf)> {
    let (mut c, src) = match &a.config {
        Some(p) => (RunConfig::from_file(p)?, p.clone()),
        // `--resume` alone: the config the run was started with, as its checkpoint saved it.
        None if a.resume => saved_config(a)?,
        // No config file: the embedded demo, unless the user names their own model or
        // data, in which case the demo's hyper-parameters (lr 3e-3, batch 8, warmup)
        // would be wrong: start from the plain defaults (EasyContext-like: batch 1, lr 2e-5).
        None if a.layout.model.is_some() || a.data.dataset.is_some() => (RunConfig::plain(), PathBuf::from(super::FLAGS)),
        None => (RunConfig::default(), PathBuf::from(super::FLAGS)),
    };
    let ds = longctx::train::deepspeed::resolve(&mut c, a.deepspeed.as_deref(), &src)?;
    let rank0 = std::env::var("RANK").map_or(true, |r| r == "0");
    let print = |lines: &[longctx::train::deepspeed::Line]| lines.iter().filter(|_| rank0).for_each(|l| eprintln!("{l}"));
    print(&ds.lines);
    a.run.apply(&mut c);
    a.data.apply(&mut c);
    a.train.apply(&mut c)?;
    a.layout.apply(&mut c)?;
    if let Some(w) = launched_world {
        if a.layout.parallel.world_size.is_some_and(|v| v != w) {
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
    a.stages.apply(a.layout.seq_length, &mut c);
    a.layout.parallel.apply_ring_degree(&mut c)?;
    // DeepSpeed's batch rule needs the final layout; its values are blamed on its keys.
    let flags = longctx::train::deepspeed::BatchFlags {
        batch_size: a.layout.batch_size.is_some(),
        gradient_accumulate_every: a.train.gradient_accumulate_every.is_some(),
    };
    print(&ds.finish(&mut c, flags)?);
    ds.validate(&c, &src)?;
    Ok((c, src))
}

/// The run config saved in the checkpoint of the output directory that `--resume`
/// continues (`--output-dir`, or the demo's), and its `state.json` as the source.
fn saved_config(a: &TrainArgs) -> Result<(RunConfig, PathBuf)> {
    let out = a.run.output_dir.clone().unwrap_or_else(|| RunConfig::default().output_dir);
    let dir = longctx::train::checkpoint::resume_dir(&out);
    let file = dir.join("state.json");
    if !file.is_file() {
        bail!(
            "--resume: {} holds no checkpoint ({} not found), so there is no run to continue; start it without --resume \
             (with --overwrite if the directory holds a run that stopped before its first checkpoint), or point --output-dir \
             at the directory of a run that wrote one",
            out.display(),
            file.display()
        );
    }
    let state = longctx::train::checkpoint::read_state(&dir)?;
    let mut c: RunConfig = serde_json::from_value(state.config).map_err(|e| {
        longctx::Error::checkpoint(
            &file,
            format!("field `config` is not a run config of this version ({e}); resume with the longctx that wrote it, or give --config"),
        )
    })?;
    c.output_dir = out; // (the directory may have moved since)
    if std::env::var("RANK").map_or(true, |r| r == "0") {
        eprintln!("note: --resume without --config: the run's config as saved in {} (flags override it)", file.display());
    }
    Ok((c, file))
}

/// What a run without --config starts from, when it is not the demo as is: with --model or
/// --dataset, plain training settings under the demo's stages (said, so that nobody takes
/// them for the demo's or their own).
fn base_note(a: &TrainArgs) -> Option<String> {
    if a.config.is_some() || a.resume || (a.layout.model.is_none() && a.data.dataset.is_none()) {
        return None;
    }
    let (demo, plain) = (RunConfig::default(), RunConfig::plain());
    Some(format!(
        "no --config: with --model/--dataset the run keeps the demo's {} stages ({}) but not its training settings: batch \
         {}, learning rate {:e}, warmup {}, token chunk {}, dataset {} unless given (the demo's: batch {}, lr {:e}, warmup {}, \
         token chunk {}, {}); write your own TOML and pass --config for anything else",
        demo.stages.len(),
        demo.stages
            .iter()
            .map(|s| format!("{} tokens × {} steps", longctx::plan::tokens_label(s.seq_length), s.steps))
            .collect::<Vec<_>>()
            .join(", "),
        plain.train.batch_size,
        plain.train.learning_rate,
        plain.train.warmup_steps,
        plain.parallel.token_chunk,
        plain.data.dataset,
        demo.train.batch_size,
        demo.train.learning_rate,
        demo.train.warmup_steps,
        demo.parallel.token_chunk,
        demo.data.dataset,
    ))
}

/// Before any work (also with --dry-run): every stage's dataset that names a local path
/// exists, and a hub id that looks like a mistyped local path (`data/tarin.jsonl` where
/// `data/` exists) is refused as such (a hub dataset itself is fetched by the trainer).
fn check_datasets(cfg: &RunConfig, opts: &longctx::hub::HubOptions) -> Result<()> {
    use longctx::data::source::SourceSpec;
    let mut seen = std::collections::BTreeSet::new();
    let mixture = cfg.data.sources.iter().map(|m| m.dataset.clone());
    for ds in (0..cfg.stages.len()).map(|i| cfg.stage_settings(i).dataset).chain(mixture) {
        if ds.starts_with("synthetic:") || !seen.insert(ds.clone()) {
            continue;
        }
        match SourceSpec::parse(&ds) {
            SourceSpec::Local(p) if !p.exists() => {
                return Err(longctx::Error::data(
                    p,
                    "dataset not found: no such file or directory (and not a hub id `org/name`); \
                     make the file, or point `dataset` in [data] (or the stage) or --dataset at one",
                )
                .into())
            }
            SourceSpec::Local(_) => {}
            SourceSpec::Hub { .. } if ds.starts_with("hf:") => {} // explicitly a hub id
            SourceSpec::Hub { repo_id, .. } => longctx::data::source::check_not_local_looking(&repo_id, opts)?,
        }
    }
    Ok(())
}

pub fn train(a: TrainArgs) -> Result<()> {
    let dist = DistEnv::from_env().context("reading the distributed environment (RANK, WORLD_SIZE, ...)")?;
    let (cfg, src) = resolve_config(&a, dist.as_ref().map(|d| d.world)).context("resolving the run config")?;
    if let (Some(n), false) = (a.stop_at_step, cfg.train.save) {
        anyhow::bail!(
            "--stop-at-step {n} stops with a checkpoint to continue from, but train.save = false (--no-save) writes none: drop one of them"
        );
    }
    // The model's head counts against every stage's layout, when its config is at hand
    // without downloading (a hub model not yet cached is checked by the trainer).
    let opts = longctx::hub::HubOptions::from_env();
    check_datasets(&cfg, &opts).context("checking the data")?;
    let model = longctx::hub::model_config(&cfg.model.source, &opts, false).context("reading the model config")?;
    if let Some(m) = &model {
        longctx::plan::check_run(&cfg, &m.cfg, &src).context("checking the parallel layout against the model")?;
        // Memory, before any work: a stage that cannot fit the GPU (or the host, when
        // activations or the optimizer live there) is refused with the numbers.
        if !a.skip_memory_check && !a.dry_run {
            if let Some(gpu) = longctx::device::gpu_memory(&cfg.model.device, &src)? {
                // Launched ranks: the host check counts the ranks of this node.
                let nodes = dist.as_ref().map_or(1, |d| d.world / d.local_world.max(1));
                longctx::plan::preflight(&cfg, &m.cfg, gpu, longctx::device::host_available(), nodes, &src).context("checking memory")?;
            }
            // Disk: the checkpoints and the export must fit the output directory's filesystem.
            if let Some(free) = longctx::device::disk_free(&cfg.output_dir).filter(|_| cfg.train.save) {
                // --overwrite removes the previous run first: its bytes count as free
                let freed = if a.overwrite { longctx::train::rundir::run_bytes(&cfg.output_dir) } else { 0 };
                longctx::plan::preflight_disk(&cfg, &m.cfg, free.saturating_add(freed), a.resume, &src).context("checking disk space")?;
            }
        }
    }
    let base = base_note(&a);
    if a.dry_run {
        if let Some(n) = &base {
            println!("# {n}");
        }
        println!("{}", toml::to_string_pretty(&cfg)?);
        let gpu = longctx::device::gpu_memory(&cfg.model.device, &src)?;
        super::plan::print_run_plan(&cfg, model.as_ref().map(|m| &m.cfg), gpu)?;
        super::plan::print_document_peek(&cfg, model.as_ref());
        return Ok(());
    }
    // SIGINT/SIGTERM: a checkpoint at the next step boundary, then exit (a second one
    // exits at once).
    let stop = StopFlag::new();
    stop.install_signal_handlers(cfg.train.save)?;
    // The embedded demo run as is (`longctx train` and no flag that changes it) replaces
    // its own previous run in runs/demo: it is the README's first command, run again.
    let demo = a.config.is_none() && !a.resume && cfg == RunConfig::default();
    if demo && !a.overwrite && !longctx::train::rundir::run_files(&cfg.output_dir).is_empty() {
        eprintln!("note: the demo replaces its previous run in {}", cfg.output_dir.display());
    }
    let opts = RunOptions {
        stop_at_global_step: a.stop_at_step,
        overwrite: a.overwrite || demo,
        allow_layout_change: a.allow_layout_change,
        stop: Some(stop),
        faults: match std::env::var(trainer::FAULT_ENV) {
            Ok(v) => trainer::Fault::parse_list(&v)?,
            Err(_) => Vec::new(),
        },
    };
    if let Some(env) = dist {
        return train_launched(&env, &cfg, a.resume, &opts);
    }
    if let Some(n) = &base {
        eprintln!("note: {n}");
    }
    if a.quiet {
        eprintln!(
            "longctx train — config from {} (--quiet: not printed; written to {} at the start, --dry-run prints it)",
            src.display(),
            cfg.output_dir.join(longctx::train::rundir::CONFIG_FILE).display()
        );
    } else {
        eprintln!("longctx train — resolved config (from {}):", src.display());
        eprintln!("{}", toml::to_string(&cfg)?.trim_end());
    }
    let summary = trainer::run_with(&cfg, a.resume, &opts).context("training")?;
    finish(&summary, false);
    Ok(())
}

/// Reports the end of a run. A run stopped by a signal exits with 128 + the signal (its
/// checkpoint is complete) so that scripts see the interruption; a rank under a launcher
/// exits 0 (the launcher reports the interruption, and a rank's non-zero exit would read
/// as a failure to it).
fn finish(s: &RunSummary, launched: bool) {
    match s.stopped {
        None => match &s.export_dir {
            Some(d) if s.already_finished => println!("already finished; exported to {}", d.display()),
            Some(d) => println!("exported to {}", d.display()),
            None => println!("done; nothing saved (train.save = false, --no-save): the metrics are in the output directory"),
        },
        Some(StopReason::Signal(Some(sig))) if !launched => std::process::exit(128 + sig),
        Some(_) => {}
    }
}

/// One rank of a multi-process run (started by `longctx launch`, torchrun or Slurm):
/// rendezvous → world communicator (NCCL on GPUs, the process transport on the CPU) →
/// the same rank loop as in-process runs.
fn train_launched(env: &DistEnv, cfg: &RunConfig, resume: bool, opts: &RunOptions) -> Result<()> {
    let summary = trainer::run_launched(cfg, resume, env, opts).with_context(|| format!("rank {} of {}", env.rank, env.world))?;
    if let Some(s) = summary {
        finish(&s, true);
    }
    Ok(())
}
