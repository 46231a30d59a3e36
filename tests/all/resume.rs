//! Resume equivalence of the trainer: a run stopped after k optimizer steps
//! (`RunOptions::stop_at_global_step`, which writes a checkpoint there) and continued with
//! `run(cfg, resume = true)` in the same output directory ends bit for bit where the
//! uninterrupted run ends: the same exported weights, the same final checkpoint
//! (weights, AdamW master/moments, state) and the same per-step log (loss, lr, grad norm
//! compared as f64 bits).
//!
//! Runs: built-in tiny Llama, passkey data, two stages (64 tokens θ 1e4 × 3 steps, then
//! 128 tokens θ 1e5 × 2 steps), cosine schedule with warmup, clipping. Stop points inside
//! stage 0, at the stage boundary, and a chain of several stops; in-process world 1,
//! data parallel 2 (ZeRO-1 shards) and sequence parallel 2 (zigzag ring, then Ulysses).
//! One more run stops under data parallel 2 and resumes on one rank (the optimizer shards
//! are re-cut): not bitwise then, its losses must agree within 1e-4 relative.

use candle_core::{DType, Device, Tensor};
use longctx::parallel::dims::ParallelMode;
use longctx::train::config::{RunConfig, Stage};
use longctx::train::optim::Schedule;
use longctx::train::trainer::{run, run_with, RunOptions};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Relative tolerance of the re-sharded (dp 2 → dp 1) resume, per logged step.
const RESHARD_TOL: f64 = 1e-4;

fn stage(seq_length: usize, rope_theta: f64, steps: u64, mode: Option<ParallelMode>) -> Stage {
    Stage { parallel_mode: mode, ..Stage::new(seq_length, rope_theta, steps) }
}

/// The run of a variant: `world` in-process ranks, `modes` per stage.
fn config(dir: &Path, world: usize, batch: usize, modes: [ParallelMode; 2], checkpoint_every: u64) -> RunConfig {
    let mut c = RunConfig { seed: 3, output_dir: dir.to_path_buf(), ..Default::default() };
    c.train.batch_size = batch;
    c.train.learning_rate = 3e-3;
    c.train.lr_schedule = Schedule::Cosine;
    c.train.warmup_steps = 2;
    c.train.clip_grad = 1.0;
    c.train.checkpoint_every = checkpoint_every;
    c.parallel.world_size = world;
    c.parallel.mode = modes[0];
    c.parallel.token_chunk = 24;
    c.stages = vec![stage(64, 1e4, 3, Some(modes[0])), stage(128, 1e5, 2, Some(modes[1]))];
    if let Err(e) = c.validate(Path::new("<resume test>")) {
        panic!("test config: {e}");
    }
    c
}

fn stop_at(k: u64) -> RunOptions {
    RunOptions { stop_at_global_step: Some(k), ..Default::default() }
}

/// The run in `dir`: stopped at each of `stops` in turn (resuming after the first), then
/// resumed to the end.
fn run_in(dir: &Path, cfg: &RunConfig, stops: &[u64]) -> longctx::Result<()> {
    let mut c = cfg.clone();
    c.output_dir = dir.to_path_buf();
    for (i, &k) in stops.iter().enumerate() {
        let s = run_with(&c, i > 0, &stop_at(k))?;
        assert!(!s.completed, "stopped at {k}");
        assert_eq!(s.steps, k, "global step at the stop");
        assert!(!dir.join("export").exists(), "a stopped run exports nothing");
    }
    let s = run(&c, !stops.is_empty())?;
    assert!(s.completed);
    assert_eq!(s.steps, 5);
    Ok(())
}

/// Logged steps: (stage, step, global_step, tokens) and the f64 bits of loss, lr, grad_norm.
fn log_of(dir: &Path) -> Vec<(u64, u64, u64, u64, [u64; 3])> {
    let path = dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap_or_else(|e| panic!("{}: bad line {l}: {e}", path.display())))
        .filter(|v| v.get("loss").is_some())
        .map(|v| {
            let u = |k: &str| v[k].as_u64().unwrap_or(u64::MAX);
            let f = |k: &str| v[k].as_f64().unwrap_or(f64::NAN).to_bits();
            (u("stage"), u("step"), u("global_step"), u("tokens"), [f("loss"), f("lr"), f("grad_norm")])
        })
        .collect()
}

fn load_st(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// Every tensor of two safetensors files has the same name, shape and bits.
fn assert_same_tensors(a: &Path, b: &Path) -> longctx::Result<()> {
    let (ta, tb) = (load_st(a), load_st(b));
    let mut names: Vec<_> = ta.keys().collect();
    names.sort();
    let mut names_b: Vec<_> = tb.keys().collect();
    names_b.sort();
    assert_eq!(names, names_b, "{} vs {}: tensor names", a.display(), b.display());
    assert!(!names.is_empty());
    for n in names {
        let (x, y) = (&ta[n], &tb[n]);
        assert_eq!(x.dims(), y.dims(), "{n}: shape");
        let bits = |t: &Tensor| -> longctx::Result<Vec<u32>> {
            Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?.into_iter().map(f32::to_bits).collect())
        };
        assert!(bits(x)? == bits(y)?, "{n}: {} and {} differ", a.display(), b.display());
    }
    Ok(())
}

fn state_without_paths(dir: &Path) -> serde_json::Value {
    let p = dir.join("checkpoint/state.json");
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    let mut v: serde_json::Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
    if let Some(c) = v.get_mut("config").and_then(|c| c.as_object_mut()) {
        c.remove("output_dir");
    }
    v
}

/// `b` ended exactly where `a` ended.
fn assert_same_run(what: &str, a: &Path, b: &Path) -> longctx::Result<()> {
    let (la, lb) = (log_of(a), log_of(b));
    assert_eq!(la.len(), 5, "{what}: logged steps of the straight run");
    assert_eq!(la, lb, "{what}: per-step log (stage, step, global step, tokens, loss/lr/grad-norm bits)");
    assert_same_tensors(&a.join("export/model.safetensors"), &b.join("export/model.safetensors"))?;
    assert_same_tensors(&a.join("checkpoint/model.safetensors"), &b.join("checkpoint/model.safetensors"))?;
    let st = state_without_paths(a);
    assert_eq!(st, state_without_paths(b), "{what}: checkpoint state");
    let shards = st["optimizer_shards"].as_u64().unwrap_or(0);
    assert_eq!(Some(shards), st["config"]["parallel"]["world_size"].as_u64(), "{what}: one optimizer shard per rank");
    for d in 0..shards {
        let f = format!("checkpoint/optimizer-shard{d}.safetensors");
        assert_same_tensors(&a.join(&f), &b.join(&f))?;
    }
    let cfg = |d: &Path| std::fs::read_to_string(d.join("export/config.json")).unwrap_or_default();
    assert_eq!(cfg(a), cfg(b), "{what}: exported config.json");
    Ok(())
}

/// Straight run once, then each chain of stops in its own directory.
fn check_variant(what: &str, cfg: &RunConfig, chains: &[&[u64]]) -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let straight: PathBuf = tmp.path().join("straight");
    run_in(&straight, cfg, &[])?;
    for stops in chains {
        let dir = tmp.path().join(format!("stops{stops:?}").replace([' ', ',', '[', ']'], "_"));
        run_in(&dir, cfg, stops)?;
        assert_same_run(&format!("{what}, stops {stops:?}"), &straight, &dir)?;
    }
    Ok(())
}

#[test]
fn single_rank_resume_is_bit_exact() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let m = ParallelMode::DataParallel;
    // step 2: inside stage 0; step 3: the end of stage 0; then a chain of three stops
    check_variant("world 1", &config(tmp.path(), 1, 2, [m, m], 1), &[&[2], &[3], &[1, 3, 4]])
}

#[test]
fn data_parallel_resume_is_bit_exact() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let m = ParallelMode::DataParallel;
    // no periodic checkpoints: the stop writes its own
    check_variant("data parallel 2", &config(tmp.path(), 2, 1, [m, m], 0), &[&[2], &[3]])
}

#[test]
fn sequence_parallel_resume_is_bit_exact() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let modes = [ParallelMode::ZigzagRingAttn, ParallelMode::UlyssesAttn];
    check_variant("sequence parallel 2", &config(tmp.path(), 2, 2, modes, 1), &[&[2], &[3]])
}

/// Stage 0 data-parallel (dp 2), stage 1 zigzag ring (sp 2, dp 1): the optimizer is
/// sharded over both ranks in either stage, so the data-parallel size may change between
/// stages; stops inside stage 0 and at its end resume bit-exactly.
#[test]
fn stages_with_different_dp_resume_is_bit_exact() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let modes = [ParallelMode::DataParallel, ParallelMode::ZigzagRingAttn];
    let cfg = config(tmp.path(), 2, 1, modes, 1);
    check_variant("dp 2 then ring 2", &cfg, &[&[2], &[3]])
}

/// Per-stage settings (EasyContext's recipes): stage 1 reads another file dataset with its
/// own seed, batch × accumulation, warmup, and starts with a fresh optimizer. Stops inside
/// stage 0, at its end (the resumed run makes the reset itself) and inside stage 1 (the
/// checkpoint holds the moments after the reset) all continue bit for bit.
#[test]
fn per_stage_data_batch_and_optimizer_reset_resume_is_bit_exact() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let data = tmp.path().join("stage1.jsonl.gz");
    {
        use std::io::Write;
        let f = std::fs::File::create(&data).map_err(|e| longctx::Error::io(&data, e))?;
        let mut gz = flate2::write::GzEncoder::new(f, flate2::Compression::fast());
        for d in 0..200u32 {
            let ids: Vec<u32> = (0..37).map(|k| 3 + (d * 37 + k) % 250).collect();
            writeln!(gz, "{}", serde_json::json!({ "input_ids": ids })).map_err(|e| longctx::Error::io(&data, e))?;
        }
        gz.finish().map_err(|e| longctx::Error::io(&data, e))?;
    }
    let m = ParallelMode::DataParallel;
    let mut cfg = config(tmp.path(), 2, 1, [m, m], 1);
    cfg.stages[1] = Stage {
        seed: Some(2023),
        dataset: Some(data.to_string_lossy().into_owned()),
        gradient_accumulate_every: Some(2),
        warmup_steps: Some(1),
        reset_optimizer: Some(true),
        ..cfg.stages[1].clone()
    };
    cfg.validate(Path::new("<resume test>"))?;
    check_variant("per-stage settings", &cfg, &[&[2], &[3], &[4]])?;
    let straight = tmp.path().join("straight-check");
    run_in(&straight, &cfg, &[])?;
    let tokens: Vec<u64> = log_of(&straight).iter().map(|l| l.3).collect();
    assert_eq!(tokens, [128, 128, 128, 512, 512], "batch 1 × dp 2 × 64; then batch 1 × accumulate 2 × dp 2 × 128");
    let st = state_without_paths(&straight);
    assert_eq!((st["adam_step"].as_u64(), st["optimizer_since_step"].as_u64()), (Some(2), Some(3)), "reset at stage 1's first step");
    Ok(())
}

/// The straight dp 2 × batch 1 run against one stopped at step 2 under `(w1, b1)` ranks ×
/// batch and resumed under `(w2, b2)` (the same samples per step either way): the
/// optimizer state is re-cut between shard layouts; losses, lr and gradient norms agree
/// within [`RESHARD_TOL`] and the final checkpoint has one shard per rank of the resumed run.
fn resharded_resume(first: (usize, usize), rest: (usize, usize)) -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let m = ParallelMode::DataParallel;
    let dp2 = config(&tmp.path().join("straight"), 2, 1, [m, m], 1);
    run_in(&tmp.path().join("straight"), &dp2, &[])?;
    let dir = tmp.path().join("resharded");
    run_with(&config(&dir, first.0, first.1, [m, m], 1), false, &stop_at(2))?;
    let relayout = RunOptions { allow_layout_change: true, ..Default::default() };
    let s = run_with(&config(&dir, rest.0, rest.1, [m, m], 1), true, &relayout)?;
    assert_eq!(s.steps, 5);
    let (want, got) = (log_of(&tmp.path().join("straight")), log_of(&dir));
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(&got) {
        assert_eq!((w.0, w.1, w.2, w.3), (g.0, g.1, g.2, g.3), "step identity");
        for (i, name) in ["loss", "lr", "grad_norm"].iter().enumerate() {
            let (x, y) = (f64::from_bits(w.4[i]), f64::from_bits(g.4[i]));
            let e = (x - y).abs() / x.abs().max(1e-12);
            assert!(e <= RESHARD_TOL, "step {}: {name} {y} vs {x} ({e:.1e})", w.2);
        }
    }
    assert_eq!(state_without_paths(&dir)["optimizer_shards"].as_u64(), Some(rest.0 as u64));
    Ok(())
}

/// Stop under dp 2 × batch 1, continue on one rank with batch 2: two shards into one.
#[test]
fn resume_on_fewer_ranks_continues_the_run() -> longctx::Result<()> {
    resharded_resume((2, 1), (1, 2))
}

/// Stop on one rank with batch 2, continue under dp 2 × batch 1: each rank reads its
/// half of the optimizer state from the one shard file.
#[test]
fn resume_on_more_ranks_continues_the_run() -> longctx::Result<()> {
    resharded_resume((1, 2), (2, 1))
}

/// A stop between the two renames of a checkpoint swap leaves only the previous
/// checkpoint, set aside as `.checkpoint.old`: `--resume` continues from it, bit-exactly.
#[test]
fn resume_from_a_checkpoint_left_aside() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let m = ParallelMode::DataParallel;
    let cfg = config(&tmp.path().join("straight"), 1, 2, [m, m], 1);
    run_in(&tmp.path().join("straight"), &cfg, &[])?;
    let dir = tmp.path().join("crashed");
    let mut c = cfg.clone();
    c.output_dir = dir.clone();
    run_with(&c, false, &stop_at(2))?;
    std::fs::rename(dir.join("checkpoint"), dir.join(".checkpoint.old")).map_err(|e| longctx::Error::io(&dir, e))?;
    // A line the crashed run logged after its checkpoint: that step runs again, the line goes.
    let log = dir.join("metrics.jsonl");
    let mut text = std::fs::read_to_string(&log).map_err(|e| longctx::Error::io(&log, e))?;
    text.push_str("{\"stage\": 0, \"step\": 3, \"global_step\": 3, \"tokens\": 1, \"loss\": 9.0, \"lr\": 0.0, \"grad_norm\": 0.0}\n");
    std::fs::write(&log, text).map_err(|e| longctx::Error::io(&log, e))?;
    let s = run(&c, true)?;
    assert!(s.completed && s.steps == 5);
    assert_eq!(log_of(&tmp.path().join("straight")), log_of(&dir), "per-step log after resuming from the set-aside checkpoint");
    // A fresh run in the same directory (with --overwrite) starts a fresh log.
    run_with(&c, false, &RunOptions { overwrite: true, ..Default::default() })?;
    assert_eq!(log_of(&tmp.path().join("straight")), log_of(&dir), "a fresh run's log holds only its own steps");
    assert!(!dir.join(".checkpoint.old").exists(), "the set-aside checkpoint is cleaned up by the next save");
    Ok(())
}

#[test]
fn resume_without_checkpoint_is_an_error() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let m = ParallelMode::DataParallel;
    let cfg = config(&tmp.path().join("empty"), 1, 1, [m, m], 1);
    let e = match run(&cfg, true) {
        Ok(_) => panic!("resume from an empty directory succeeded"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("state.json") && e.contains("--resume"), "{e}");
    Ok(())
}

/// `--allow-layout-change` across an epoch wrap (issue #33): a file dataset whose epoch has
/// an odd number of samples (7 of 33 tokens), 2 samples per optimizer step, so step 4
/// takes the epoch's last sample and the next epoch's first. Stopped on one rank after
/// step 2 and resumed under dp 2 × batch 1, the run must see the same global samples per
/// step as the straight one-rank run: the losses agree within [`RESHARD_TOL`] at every
/// step, the wrap included (the 2-rank loader used to drop the odd last sample: 1e-2 off
/// from step 4 on).
#[test]
fn layout_change_across_an_epoch_wrap_keeps_the_sample_order() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let data = tmp.path().join("docs.jsonl");
    // 7 · 33 + 5 tokens in 9 documents: concat packing cuts 7 samples of 33, the rest is dropped.
    let tokens: Vec<u32> = (0..7 * 33 + 5).map(|k: u32| 3 + (k * 37 + k / 7) % 250).collect();
    let lines: Vec<String> = tokens.chunks(26).map(|c| serde_json::json!({ "input_ids": c }).to_string()).collect();
    std::fs::write(&data, lines.join("\n")).map_err(|e| longctx::Error::io(&data, e))?;
    let cfg = |dir: &Path, world: usize, batch: usize| {
        let mut c = RunConfig { seed: 3, output_dir: dir.to_path_buf(), ..Default::default() };
        c.data.dataset = data.to_str().unwrap().into();
        c.data.shuffle_buffer = 4;
        c.train.batch_size = batch;
        c.train.learning_rate = 3e-3;
        c.train.warmup_steps = 1;
        c.train.checkpoint_every = 1;
        c.parallel.world_size = world;
        c.parallel.mode = ParallelMode::DataParallel;
        c.parallel.token_chunk = 16;
        c.stages = vec![stage(32, 1e4, 6, Some(ParallelMode::DataParallel))];
        c.validate(Path::new("<resume test>")).unwrap_or_else(|e| panic!("test config: {e}"));
        c
    };
    let straight = tmp.path().join("straight");
    run_with(&cfg(&straight, 1, 2), false, &RunOptions::default())?;
    let dir = tmp.path().join("relayout");
    run_with(&cfg(&dir, 1, 2), false, &stop_at(2))?;
    let relayout = RunOptions { allow_layout_change: true, ..Default::default() };
    let s = run_with(&cfg(&dir, 2, 1), true, &relayout)?;
    assert_eq!(s.steps, 6);
    let (want, got) = (log_of(&straight), log_of(&dir));
    assert_eq!(want.len(), 6, "one log line per step");
    assert_eq!(want.len(), got.len());
    for (w, g) in want.iter().zip(&got) {
        assert_eq!((w.1, w.2, w.3), (g.1, g.2, g.3), "step identity");
        let (x, y) = (f64::from_bits(w.4[0]), f64::from_bits(g.4[0]));
        let e = (x - y).abs() / x.abs().max(1e-12);
        assert!(e <= RESHARD_TOL, "step {}: loss {y} after the layout change vs {x} straight ({e:.1e})", w.2);
    }
    Ok(())
}
