//! `longctx check`: the user's own run (model, data, parallel mode, world size) for a few
//! steps against one device on the same samples, step by step.
//!
//! Both runs are `longctx train` processes of this binary, on the first stage of the
//! resolved config cut to `--steps` optimizer steps, without checkpoints:
//! - the run as configured: its ranks as threads of one process, or with `--launch` one
//!   process per rank through `longctx launch` (the rendezvous and per-rank files too);
//! - the reference: `data_parallel` on one rank, with `gradient_accumulate_every`
//!   multiplied by the run's data-parallel degree, so that every optimizer step sees the
//!   same global samples in the same order (the loader deals each step's samples out by
//!   global position) and sums the same loss over the same counted tokens.
//!
//! Per step it prints both losses and gradient norms and their relative differences, and
//! a verdict against the tolerance of the run's dtype (`--tolerance` overrides it): f32
//! 1e-5 (what the tests measure: only summation order differs), bf16/f16 2e-2 (bf16
//! rounds every activation; the modes cut sums differently). Exit status 1 when a step
//! exceeds it.

use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{bail, Context, Result};
use clap::Args;
use longctx::train::config::ParallelMode;
use longctx::train::RunConfig;

#[derive(Args, Debug, Clone)]
pub struct CheckArgs {
    /// Optimizer steps compared (the first stage's first steps).
    #[arg(long, default_value_t = 3)]
    pub steps: u64,
    /// Run the checked layout as one process per rank (`longctx launch`), as on GPUs.
    #[arg(long)]
    pub launch: bool,
    /// Largest relative difference of a step's loss or gradient norm that passes
    /// [default: 1e-5 for f32, 2e-2 for bf16/f16].
    #[arg(long)]
    pub tolerance: Option<f64>,
    /// Where both runs go (kept); default: a fresh directory under the system temp dir, removed after.
    #[arg(long)]
    pub work_dir: Option<PathBuf>,
    /// The `longctx train` arguments of the run to check (after `--`), e.g.
    /// `-- --config recipes/X.toml --world-size 4 --parallel-mode zigzag_ring_attn`.
    #[arg(last = true, required = true)]
    pub train_args: Vec<String>,
}

/// (loss, grad_norm) of every step in `dir/metrics.jsonl`.
fn steps_of(dir: &Path) -> Result<Vec<(f64, f64)>> {
    let file = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&file).with_context(|| format!("reading {}", file.display()))?;
    let mut out = Vec::new();
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if let (Some(l), Some(g)) = (v.get("loss").and_then(|x| x.as_f64()), v.get("grad_norm").and_then(|x| x.as_f64())) {
            out.push((l, g));
        }
    }
    Ok(out)
}

fn rel(a: f64, b: f64) -> f64 {
    if a == b {
        0.0
    } else {
        (a - b).abs() / b.abs().max(1e-30)
    }
}

/// Runs this binary with `args`; its stderr is kept for the error.
fn run(args: &[String], what: &str) -> Result<()> {
    let exe = std::env::current_exe().context("locating the longctx binary")?;
    let o = Command::new(exe).args(args).output().with_context(|| format!("starting the {what}"))?;
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        let last =
            err.lines().rfind(|l| l.starts_with("error:")).map_or("(no error line)", |l| l.trim_start_matches("error: ")).to_string();
        bail!("the {what} failed ({}): {last}", o.status);
    }
    Ok(())
}

/// The first stage of `cfg`, `steps` long, no checkpoints, written to `dir/name.toml`.
fn write_config(cfg: &RunConfig, dir: &Path, name: &str) -> Result<PathBuf> {
    let path = dir.join(format!("{name}.toml"));
    std::fs::write(&path, toml::to_string(cfg).context("writing the check's config")?)
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(path)
}

pub fn check(a: CheckArgs) -> Result<()> {
    if a.steps == 0 {
        bail!("--steps: expected at least 1 step to compare");
    }
    // The run's own config, resolved exactly as `train` resolves it.
    let exe = std::env::current_exe().context("locating the longctx binary")?;
    let mut dry: Vec<String> = vec!["train".into()];
    dry.extend(a.train_args.iter().cloned());
    dry.push("--dry-run".into());
    let o = Command::new(&exe).args(&dry).output().context("resolving the run's config (train --dry-run)")?;
    if !o.status.success() {
        let err = String::from_utf8_lossy(&o.stderr);
        let why = err.lines().find(|l| l.starts_with("error:")).map_or("train --dry-run failed", |l| l.trim_start_matches("error: "));
        bail!("the run's arguments do not resolve: {why}");
    }
    let mut cfg: RunConfig =
        toml::from_str(&String::from_utf8_lossy(&o.stdout)).context("reading the resolved config of train --dry-run")?;
    cfg.stages.truncate(1);
    let Some(stage) = cfg.stages.first_mut() else { bail!("the run has no stage to check") };
    stage.steps = a.steps;
    cfg.train.checkpoint_every = 0;
    cfg.train.checkpoint_interval_min = 0.0;
    let s = cfg.stage_settings(0);
    let world = cfg.parallel.world_size.max(1);
    let tol = a.tolerance.unwrap_or(if cfg.model.dtype == "f32" || cfg.model.device == "cpu" { 1e-5 } else { 2e-2 });

    let (remove, work) = match &a.work_dir {
        Some(d) => (false, d.clone()),
        None => (true, std::env::temp_dir().join(format!("longctx-check-{}", std::process::id()))),
    };
    std::fs::create_dir_all(&work).with_context(|| format!("creating {}", work.display()))?;

    let mut run_cfg = cfg.clone();
    run_cfg.output_dir = work.join("run");
    let mut one = cfg.clone();
    one.output_dir = work.join("one-device");
    one.parallel.mode = ParallelMode::DataParallel;
    one.parallel.world_size = 1;
    one.parallel.sp_size = 0;
    one.parallel.ulysses_size = 0;
    one.stages[0].parallel_mode = None;
    one.stages[0].gradient_accumulate_every = Some(s.gradient_accumulate_every * s.dp);
    let (run_toml, one_toml) = (write_config(&run_cfg, &work, "run")?, write_config(&one, &work, "one-device")?);

    let label = format!("{} on {world} rank(s) (sp {} × dp {})", s.mode, s.sp, s.dp);
    eprintln!("check: {label} against one device, {} step(s) of {} tokens, tolerance {tol:.0e}", a.steps, s.seq_length);
    let train = |toml: &Path| -> Vec<String> {
        vec!["train".into(), "--config".into(), toml.display().to_string(), "--overwrite".into(), "-q".into()]
    };
    let mut checked = train(&run_toml);
    if a.launch && world > 1 {
        let mut l: Vec<String> =
            ["launch", "--nproc-per-node", &world.to_string(), "--master-port", "0", "--"].iter().map(|x| x.to_string()).collect();
        l.extend(checked);
        checked = l;
    }
    let runs = run(&checked, &format!("checked run ({label})")).and_then(|_| run(&train(&one_toml), "one-device reference"));
    let logged = runs.and_then(|_| Ok((steps_of(&run_cfg.output_dir)?, steps_of(&one.output_dir)?)));
    if remove {
        let _ = std::fs::remove_dir_all(&work);
    }
    let (got, want) = logged?;
    if got.len() != want.len() || got.is_empty() {
        bail!("the runs logged {} and {} steps; expected {} each", got.len(), want.len(), a.steps);
    }
    println!("| step | loss (run) | loss (one device) | rel | grad norm (run) | grad norm (one device) | rel |");
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut worst = 0f64;
    for (i, ((lg, ng), (lw, nw))) in got.iter().zip(&want).enumerate() {
        let (el, en) = (rel(*lg, *lw), rel(*ng, *nw));
        worst = worst.max(el).max(en);
        println!("| {} | {lg:.6} | {lw:.6} | {el:.1e} | {ng:.6} | {nw:.6} | {en:.1e} |", i + 1);
    }
    if !worst.is_finite() || worst > tol {
        bail!("{label} differs from one device by {worst:.2e} relative (tolerance {tol:.0e}): the layout is not exact on this run; see the table above");
    }
    println!("ok: {label} matches one device within {worst:.1e} relative (tolerance {tol:.0e})");
    Ok(())
}
