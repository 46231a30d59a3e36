//! DeepSpeed JSON configs read as is (`--deepspeed FILE`, or a `[deepspeed]` table in the
//! TOML): what each key of EasyContext's `zero3_offload.json` (our copy:
//! `configs/zero3_offload.json`) sets, that every key is reported, that unknown keys are
//! named in a warning, that impossible choices are errors naming the key, that the TOML
//! table and the JSON file give the same run, and that `plan` counts the offload.

use longctx::train::config::{ParallelMode, RunConfig, Stage};
use longctx::train::deepspeed::{apply, resolve, BatchFlags, Level};
use longctx::train::optim::Schedule;
use serde_json::{json, Value};
use std::path::Path;

use crate::common;
use common::repo_root as root;

fn zero3() -> serde_json::Value {
    longctx::train::deepspeed::read(&root().join("configs/zero3_offload.json")).unwrap()
}

/// Every key path of `v` down to the leaves that the mapping reports on (the values of
/// `optimizer.params`, `scheduler.params`, the offload sections and `bf16`/`fp16` are
/// reported one key each).
fn leaf_keys(v: &serde_json::Value, prefix: &str, out: &mut Vec<String>) {
    for (k, x) in v.as_object().unwrap() {
        let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
        match x.as_object() {
            Some(_) => leaf_keys(x, &key, out),
            None => out.push(key),
        }
    }
}

#[test]
fn easycontext_zero3_offload_json_is_accepted_and_every_key_reported() {
    let ds = zero3();
    let mut cfg = RunConfig::plain();
    cfg.train.learning_rate = 7e-5;
    let lines = apply(&ds, Path::new("zero3_offload.json"), &mut cfg).unwrap().lines;
    // What it sets.
    assert!(cfg.train.optimizer_on_host, "offload_optimizer.device = cpu");
    assert_eq!(cfg.train.learning_rate, 2e-5, "WarmupLR's warmup_max_lr replaces the optimizer's lr");
    assert_eq!(cfg.train.lr_schedule, Schedule::WarmupLr);
    // warmup_min_lr = warmup_max_lr: a constant 2e-5 from the first step.
    let s = cfg.lr_schedule(0);
    for k in 0..5 {
        assert!((s.lr(k) - 2e-5).abs() < 1e-18, "step {k}: {}", s.lr(k));
    }
    assert_eq!((cfg.train.adamw.beta1, cfg.train.adamw.beta2, cfg.train.adamw.eps, cfg.train.adamw.weight_decay), (0.9, 0.95, 1e-8, 0.1));
    assert_eq!(cfg.train.batch_size, 1);
    assert_eq!(cfg.model.dtype, RunConfig::plain().model.dtype, "bf16.enabled = auto keeps the dtype");
    // Every leaf key has its line (type/params of the optimizer and scheduler included).
    let mut keys = Vec::new();
    leaf_keys(&ds, "", &mut keys);
    for k in &keys {
        let covered = lines.iter().any(|l| l.key == *k);
        assert!(covered, "no line for `{k}`:\n{}", lines.iter().map(|l| l.to_string()).collect::<Vec<_>>().join("\n"));
    }
    // Stage 3 and both offloads are taken; nothing is left unimplemented; the accepted
    // no-ops are notes.
    assert_eq!((cfg.train.zero_stage, cfg.train.offload_params), (3, true));
    let warn: Vec<&str> = lines.iter().filter(|l| l.level == Level::Warning).map(|l| l.key.as_str()).collect();
    assert!(warn.is_empty(), "{lines:#?}");
    for k in ["zero_optimization.stage", "zero_optimization.offload_param.device", "zero_optimization.offload_optimizer.device"] {
        assert!(lines.iter().any(|l| l.key == k && l.level == Level::Set), "no setting line for {k}: {lines:#?}");
    }
    for k in ["zero_optimization.overlap_comm", "zero_optimization.stage3_max_live_parameters", "steps_per_print", "wall_clock_breakdown"] {
        let l = lines.iter().find(|l| l.key == k).unwrap_or_else(|| panic!("no line for {k}"));
        assert_eq!(l.level, Level::Note, "{l}");
        assert!(l.text.contains("no effect"), "{l}");
    }
}

#[test]
fn unknown_keys_are_named_and_bad_values_are_errors() {
    let mut cfg = RunConfig::plain();
    let ds = json!({"zero_optimization": {"stage": 2, "overlap_com": true}, "train_micro_batch_size_per_gpu": 2,
                    "gradient_accumulation_steps": 8, "gradient_clipping": 0.5, "bf16": {"enabled": true}, "foo": 1});
    let lines = apply(&ds, Path::new("ds.json"), &mut cfg).unwrap().lines;
    let warns: Vec<String> = lines.iter().filter(|l| l.level == Level::Warning).map(|l| l.to_string()).collect();
    assert_eq!(warns.len(), 2, "{warns:?}");
    assert!(warns.iter().any(|w| w.contains("`zero_optimization.overlap_com`") && w.contains("unknown")), "{warns:?}");
    assert!(warns.iter().any(|w| w.contains("`foo`")), "{warns:?}");
    assert_eq!((cfg.train.batch_size, cfg.train.gradient_accumulate_every, cfg.train.clip_grad), (2, 8, 0.5));
    assert_eq!(cfg.model.dtype, "bf16");
    assert!(!cfg.train.optimizer_on_host);

    let bad = |ds: serde_json::Value, needles: &[&str]| {
        let e = apply(&ds, Path::new("ds.json"), &mut RunConfig::plain()).unwrap_err().to_string();
        for n in needles {
            assert!(e.contains(n), "error lacks `{n}`: {e}");
        }
    };
    bad(json!({"zero_optimization": {"stage": 4}}), &["ds.json", "zero_optimization.stage", "0 to 3"]);
    bad(json!({"zero_optimization": {"offload_optimizer": {"device": "nvme"}}}), &["offload_optimizer.device", "nvme", "cpu"]);
    bad(json!({"optimizer": {"type": "SGD"}}), &["optimizer.type", "AdamW"]);
    bad(json!({"bf16": {"enabled": true}, "fp16": {"enabled": true}}), &["enable one"]);
    bad(json!({"gradient_accumulation_steps": "many"}), &["gradient_accumulation_steps", "auto"]);
    bad(json!({"optimizer": {"params": {"betas": [0.9]}}}), &["optimizer.params.betas", "[beta1, beta2]"]);
    bad(json!({"optimizer": {"params": {"betas": "sometimes"}}}), &["optimizer.params.betas", "\"auto\""]);
    bad(json!([1, 2]), &["one JSON object"]);
}

/// `"betas": "auto"` (Hugging Face's standard ZeRO-3 JSON) keeps longctx's betas, as
/// "auto" does for lr and eps.
#[test]
fn auto_betas_keep_longctx_values() {
    let mut cfg = RunConfig::plain();
    let (b1, b2) = (cfg.train.adamw.beta1, cfg.train.adamw.beta2);
    apply(
        &json!({"optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto"}}}),
        Path::new("ds.json"),
        &mut cfg,
    )
    .unwrap();
    assert_eq!((cfg.train.adamw.beta1, cfg.train.adamw.beta2), (b1, b2));
}

#[test]
fn a_toml_deepspeed_table_equals_the_json_file() {
    let dir = tempfile::tempdir().unwrap();
    let toml_path = dir.path().join("run.toml");
    // The same settings as configs/zero3_offload.json, as TOML.
    let body = "[[stage]]\nseq_length = 64\nrope_theta = 10000.0\nsteps = 1\n\n[deepspeed]\ngradient_clipping = \"auto\"\ntrain_micro_batch_size_per_gpu = 1\n\
                [deepspeed.zero_optimization]\nstage = 3\noverlap_comm = true\n[deepspeed.zero_optimization.offload_optimizer]\n\
                device = \"cpu\"\n[deepspeed.zero_optimization.offload_param]\ndevice = \"cpu\"\n[deepspeed.optimizer]\ntype = \"AdamW\"\n[deepspeed.optimizer.params]\nbetas = [0.9, 0.95]\n\
                weight_decay = 0.1\n[deepspeed.scheduler]\ntype = \"WarmupLR\"\n[deepspeed.scheduler.params]\nwarmup_max_lr = 2e-5\n\
                warmup_min_lr = 2e-5\nwarmup_num_steps = 0\nwarmup_type = \"linear\"\n";
    std::fs::write(&toml_path, body).unwrap();
    let mut from_toml = RunConfig::from_file(&toml_path).unwrap();
    assert!(from_toml.deepspeed.is_some());
    let lines = resolve(&mut from_toml, None, &toml_path).unwrap().lines;
    assert!(from_toml.deepspeed.is_none(), "the table is consumed (a checkpoint records the resolved settings)");
    assert!(lines.iter().any(|l| l.key == "zero_optimization.offload_optimizer.device" && l.level == Level::Set));
    let mut from_json = RunConfig::from_file(&toml_path).unwrap();
    let json_path = dir.path().join("ds.json");
    std::fs::write(&json_path, serde_json::to_string(&zero3()).unwrap()).unwrap();
    resolve(&mut from_json, Some(&json_path), &toml_path).unwrap();
    assert_eq!(from_toml.train, from_json.train, "TOML table and JSON file set the same training settings");
    assert!(from_toml.train.optimizer_on_host);
}

fn longctx(args: &[&str]) -> std::process::Output {
    common::longctx_cmd(args).output().expect("cannot run the longctx binary")
}

#[test]
fn train_and_plan_take_deepspeed_and_plan_counts_the_offload() {
    // train --dry-run: the resolved config says optimizer_on_host, and stderr reports the keys.
    let o = longctx(&["train", "--deepspeed", "configs/zero3_offload.json", "--model", "builtin:tiny", "--dry-run"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("optimizer_on_host = true"), "{out}");
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("deepspeed: `zero_optimization.stage`: train.zero_stage = 3"), "{err}");
    assert!(out.contains("zero_stage = 3") && out.contains("offload_params = true"), "{out}");
    assert!(err.contains("deepspeed note: `zero_optimization.overlap_comm`"), "{err}");
    // A flag still wins over the file.
    let o =
        longctx(&["train", "--deepspeed", "configs/zero3_offload.json", "--model", "builtin:tiny", "--learning-rate", "3e-4", "--dry-run"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("learning_rate = 0.0003"), "{}", String::from_utf8_lossy(&o.stdout));
    // plan: the optimizer state on the host leaves the GPU's peak lower by about its size.
    let peak = |extra: &[&str]| -> f64 {
        let mut args = vec!["plan", "--model", "builtin:tinyllama-1.1b-shape", "--seq-length", "16384", "--json"];
        args.extend_from_slice(extra);
        let o = longctx(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
        v["estimate"]["device"]["peak"].as_f64().unwrap()
    };
    let (on_gpu, offloaded) = (peak(&[]), peak(&["--deepspeed", "configs/zero3_offload.json"]));
    // 1.1B parameters: f32 master + two moments = 12 bytes each, ~13 GB.
    assert!(on_gpu - offloaded > 10e9, "plan with the optimizer on the host: {offloaded} vs {on_gpu}");
    // A missing or broken file is one clear error.
    let o = longctx(&["train", "--deepspeed", "no/such.json", "--dry-run"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("no/such.json"));
}

// ---------------------------------------------------------------------------------------
// DeepSpeed's meaning, key by key. The references below are written from DeepSpeed's own
// code (deepspeed/runtime/lr_schedules.py, config.py, engine.py), independently of
// longctx's: they are what a DeepSpeed run does.

/// The rate of DeepSpeed's `kind` scheduler at its `last_batch_iteration` `it` (`get_lr`),
/// for the JSON `params` and the optimizer's `lr`.
fn deepspeed_get_lr(kind: &str, p: &Value, lr: f64, it: i64) -> f64 {
    let num = |k: &str| p.get(k).and_then(Value::as_f64);
    // `__init__`: warmup_num_steps defaults to 1000, taken as at least 2; log by default.
    let warmup = (num("warmup_num_steps").unwrap_or(1000.0) as i64).max(2);
    let log = p.get("warmup_type").and_then(Value::as_str).unwrap_or("log") != "linear";
    let total = num("total_num_steps").unwrap_or(f64::NAN);
    let inverse_log_warm_up = 1.0 / (warmup as f64).ln();
    let warm = |it: i64| if log { inverse_log_warm_up * ((it + 1) as f64).ln() } else { it as f64 / warmup as f64 };
    if kind == "WarmupCosineLR" {
        if it < 0 {
            return 0.0; // "before it has started"
        }
        let (wmr, cmr) = (num("warmup_min_ratio").unwrap_or(0.0), num("cos_min_ratio").unwrap_or(0.0001));
        let ratio = if it < warmup {
            wmr + warm(it) * (1.0 - wmr)
        } else {
            let real_last_step = (it - warmup + 1) as f64;
            let real_total_steps = (total - warmup as f64).max(1.0);
            let cosine_progress = (real_last_step / real_total_steps).min(1.0);
            (cmr + (1.0 - cmr) * (1.0 + (std::f64::consts::PI * cosine_progress).cos()) / 2.0).max(0.0)
        };
        return lr * ratio;
    }
    let min_lr = num("warmup_min_lr").unwrap_or(0.0);
    // WarmupLR's warmup_max_lr defaults to the optimizer's lr, WarmupDecayLR's to 0.001.
    let max_lr = num("warmup_max_lr").unwrap_or(if kind == "WarmupLR" { lr } else { 0.001 });
    if it < 0 {
        return min_lr;
    }
    let gamma = if it < warmup {
        warm(it)
    } else if kind == "WarmupLR" {
        1.0
    } else {
        ((total - it as f64) / (total - warmup as f64).max(1.0)).max(0.0)
    };
    min_lr + (max_lr - min_lr) * gamma
}

/// The rates DeepSpeed's engine trains optimizer steps 0..n with: the scheduler is built
/// with `last_batch_iteration = -1` (its constructor sets the optimizer's rate) and
/// stepped after every optimizer step (`_take_model_step`).
fn deepspeed_rates(kind: &str, params: &Value, lr: f64, n: usize) -> Vec<f64> {
    let mut last_batch_iteration = -1;
    let mut rates = vec![deepspeed_get_lr(kind, params, lr, last_batch_iteration)];
    while rates.len() < n {
        last_batch_iteration += 1;
        rates.push(deepspeed_get_lr(kind, params, lr, last_batch_iteration));
    }
    rates
}

/// A one-stage run of `steps` steps (`world` ranks under `mode`) with `ds` applied,
/// settled and validated as `train` does.
fn run_with(ds: &Value, steps: u64, world: usize, mode: ParallelMode, flags: BatchFlags) -> longctx::Result<(RunConfig, Vec<String>)> {
    let mut cfg = RunConfig::plain();
    cfg.stages = vec![Stage::new(64, 1e4, steps)];
    (cfg.parallel.world_size, cfg.parallel.mode) = (world, mode);
    let applied = apply(ds, Path::new("ds.json"), &mut cfg)?;
    let more = applied.finish(&mut cfg, flags)?;
    applied.validate(&cfg, Path::new("run.toml"))?;
    let lines = applied.lines.iter().chain(&more).map(|l| l.to_string()).collect();
    Ok((cfg, lines))
}

/// longctx's rates for steps 0..n of stage 0 against DeepSpeed's.
fn assert_rates(ds: &Value, steps: u64, n: usize, what: &str) {
    let (cfg, lines) = run_with(ds, steps, 1, ParallelMode::DataParallel, BatchFlags::default()).unwrap();
    let kind = ds["scheduler"]["type"].as_str().unwrap();
    let lr = ds["optimizer"]["params"]["lr"].as_f64().unwrap_or(RunConfig::plain().train.learning_rate);
    let want = deepspeed_rates(kind, &ds["scheduler"]["params"], lr, n);
    let s = cfg.lr_schedule(0);
    for (k, w) in want.iter().enumerate() {
        let got = s.lr(k as u64);
        assert!((got - w).abs() <= 1e-12 * w.abs() + 1e-18, "{what}: step {k}: longctx {got:e}, DeepSpeed {w:e}\n{}", lines.join("\n"));
    }
}

#[test]
fn warmup_lr_matches_deepspeed_step_by_step() {
    for warmup_type in ["log", "linear"] {
        for (min, max, w) in [(1e-5, 1e-4, 10), (0.0, 3e-4, 4), (2e-5, 2e-5, 0), (1e-6, 1e-4, 1), (5e-5, 1e-4, 2)] {
            let p = json!({"warmup_min_lr": min, "warmup_max_lr": max, "warmup_num_steps": w, "warmup_type": warmup_type});
            let ds = json!({"optimizer": {"type": "AdamW", "params": {"lr": 7e-4}}, "scheduler": {"type": "WarmupLR", "params": p}});
            assert_rates(&ds, 30, 30, &format!("WarmupLR {p}"));
        }
    }
    // Every parameter absent: DeepSpeed's defaults (0 → the optimizer's lr, log, 1000 steps).
    let ds = json!({"optimizer": {"params": {"lr": 3e-4}}, "scheduler": {"type": "WarmupLR"}});
    assert_rates(&ds, 10, 1005, "WarmupLR with DeepSpeed's defaults");
}

#[test]
fn warmup_decay_lr_matches_deepspeed_step_by_step() {
    for warmup_type in ["log", "linear"] {
        for (min, w, total) in [(1e-5, 5, 20), (0.0, 3, 12), (2e-6, 10, 10), (1e-5, 6, 4)] {
            let p = json!({"warmup_min_lr": min, "warmup_max_lr": 1e-4, "warmup_num_steps": w, "warmup_type": warmup_type,
                           "total_num_steps": total});
            let ds = json!({"scheduler": {"type": "WarmupDecayLR", "params": p}});
            // Past total_num_steps too: the rate stays at warmup_min_lr.
            assert_rates(&ds, 40, 30, &format!("WarmupDecayLR {p}"));
        }
    }
    // warmup_max_lr absent: DeepSpeed's 0.001; total_num_steps "auto": the stage's steps.
    let ds = json!({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 4, "total_num_steps": 16}}});
    assert_rates(&ds, 16, 20, "WarmupDecayLR, default max");
    let (cfg, _) = run_with(
        &json!({"scheduler": {"type": "WarmupDecayLR", "params": {"warmup_num_steps": 4, "total_num_steps": "auto"}}}),
        16,
        1,
        ParallelMode::DataParallel,
        BatchFlags::default(),
    )
    .unwrap();
    let want = deepspeed_rates("WarmupDecayLR", &json!({"warmup_num_steps": 4, "total_num_steps": 16}), 0.0, 20);
    let s = cfg.lr_schedule(0);
    for (k, w) in want.iter().enumerate() {
        assert!((s.lr(k as u64) - w).abs() <= 1e-12 * w, "auto total, step {k}: {} vs {w}", s.lr(k as u64));
    }
}

#[test]
fn warmup_cosine_lr_matches_deepspeed_step_by_step() {
    for warmup_type in ["log", "linear"] {
        for (wmr, cmr, w, total) in [(0.1, 0.05, 5, 20), (0.0, 0.0, 3, 12), (0.5, 0.2, 8, 8), (0.2, 0.1, 6, 3)] {
            let p = json!({"warmup_min_ratio": wmr, "cos_min_ratio": cmr, "warmup_num_steps": w, "warmup_type": warmup_type,
                           "total_num_steps": total});
            let ds = json!({"optimizer": {"type": "AdamW", "params": {"lr": 2e-4}}, "scheduler": {"type": "WarmupCosineLR", "params": p}});
            assert_rates(&ds, 40, 30, &format!("WarmupCosineLR {p}"));
        }
    }
    let ds = json!({"optimizer": {"params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupCosineLR", "params": {"total_num_steps": 2000}}});
    assert_rates(&ds, 2000, 2003, "WarmupCosineLR with DeepSpeed's defaults");
}

/// Regression (#33): keys were applied in sorted order, so `warmup_min_ratio` overwrote
/// `cos_min_ratio`; and `warmup_min_lr` was ignored (the warm-up started from 0).
#[test]
fn each_scheduler_key_keeps_its_own_meaning() {
    let p = json!({"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05, "warmup_type": "linear"});
    let ds = json!({"optimizer": {"params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupCosineLR", "params": p}});
    let (cfg, _) = run_with(&ds, 20, 1, ParallelMode::DataParallel, BatchFlags::default()).unwrap();
    assert_eq!((cfg.train.min_lr_ratio, cfg.train.warmup_min_ratio), (0.05, 0.1));
    let s = cfg.lr_schedule(0);
    assert!((s.lr(1) - 1e-5).abs() < 1e-18, "the warm-up starts at warmup_min_ratio × lr: {}", s.lr(1));
    assert!((s.lr(20) - 5e-6).abs() < 1e-18, "the decay ends at cos_min_ratio × lr: {}", s.lr(20));

    let p = json!({"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-4, "warmup_num_steps": 10, "warmup_type": "linear"});
    let (cfg, _) =
        run_with(&json!({"scheduler": {"type": "WarmupLR", "params": p}}), 20, 1, ParallelMode::DataParallel, BatchFlags::default())
            .unwrap();
    let s = cfg.lr_schedule(0);
    assert!((s.lr(0) - 1e-5).abs() < 1e-18 && (s.lr(1) - 1e-5).abs() < 1e-18, "warm-up from warmup_min_lr: {} {}", s.lr(0), s.lr(1));
    assert!((s.lr(6) - (1e-5 + 9e-5 * 0.5)).abs() < 1e-18, "{}", s.lr(6));
    assert!((s.lr(11) - 1e-4).abs() < 1e-18, "{}", s.lr(11));

    // A [deepspeed] table in the TOML with the keys in another order means the same.
    let dir = tempfile::tempdir().unwrap();
    let toml_path = dir.path().join("run.toml");
    let body = "[[stage]]\nseq_length = 64\nrope_theta = 10000.0\nsteps = 20\n[deepspeed.optimizer.params]\nlr = 1e-4\n\
                [deepspeed.scheduler]\ntype = \"WarmupCosineLR\"\n[deepspeed.scheduler.params]\ncos_min_ratio = 0.05\n\
                warmup_type = \"linear\"\nwarmup_min_ratio = 0.1\nwarmup_num_steps = 5\ntotal_num_steps = 20\n";
    std::fs::write(&toml_path, body).unwrap();
    let mut from_toml = RunConfig::from_file(&toml_path).unwrap();
    resolve(&mut from_toml, None, &toml_path).unwrap();
    assert_eq!((from_toml.train.min_lr_ratio, from_toml.train.warmup_min_ratio), (0.05, 0.1));
    assert_eq!(from_toml.lr_schedule(0), cfg_cosine(&ds));
}

fn cfg_cosine(ds: &Value) -> longctx::train::optim::LrSchedule {
    run_with(ds, 20, 1, ParallelMode::DataParallel, BatchFlags::default()).unwrap().0.lr_schedule(0)
}

/// `warmup_min_lr` is a rate: a `--learning-rate` flag after the JSON keeps it (the ratio
/// is taken again), and one below it is refused naming the key.
#[test]
fn warmup_min_lr_stays_a_rate_under_a_learning_rate_flag() {
    let p = json!({"warmup_min_lr": 1e-5, "warmup_max_lr": 1e-4, "warmup_num_steps": 10});
    let ds = json!({"scheduler": {"type": "WarmupLR", "params": p}});
    let mut cfg = RunConfig::plain();
    let applied = apply(&ds, Path::new("ds.json"), &mut cfg).unwrap();
    cfg.train.learning_rate = 4e-5; // --learning-rate 4e-5
    let lines = applied.finish(&mut cfg, BatchFlags::default()).unwrap();
    assert!((cfg.train.warmup_min_ratio - 0.25).abs() < 1e-15, "{lines:?}");
    assert!((cfg.lr_schedule(0).lr(0) - 1e-5).abs() < 1e-18);
    cfg.train.learning_rate = 5e-6;
    let e = applied.finish(&mut cfg, BatchFlags::default()).unwrap_err().to_string();
    for n in ["ds.json", "scheduler.params.warmup_min_lr", "1e-5", "5e-6", "flags"] {
        assert!(e.contains(n), "error lacks `{n}`: {e}");
    }
}

#[test]
fn scheduler_parameters_deepspeed_refuses_are_errors() {
    let bad = |ds: Value, needles: &[&str]| {
        let e = apply(&ds, Path::new("ds.json"), &mut RunConfig::plain()).unwrap_err().to_string();
        for n in needles {
            assert!(e.contains(n), "error lacks `{n}`: {e}");
        }
    };
    let sched = |kind: &str, p: Value| json!({"scheduler": {"type": kind, "params": p}});
    bad(
        sched("WarmupCosineLR", json!({"total_num_steps": 10, "warmup_max_lr": 1e-4})),
        &["ds.json", "scheduler.params.warmup_max_lr", "WarmupCosineLR takes", "cos_min_ratio"],
    );
    bad(sched("WarmupLR", json!({"cos_min_ratio": 0.1})), &["scheduler.params.cos_min_ratio", "WarmupLR takes"]);
    bad(sched("WarmupDecayLR", json!({"warmup_num_steps": 10})), &["scheduler.params.total_num_steps", "needs", "\"auto\""]);
    bad(sched("WarmupLR", json!({"warmup_min_lr": 1e-3, "warmup_max_lr": 1e-4})), &["scheduler.params.warmup_min_lr", "at most 1e-4"]);
    bad(sched("WarmupLR", json!({"warmup_type": 3})), &["scheduler.params.warmup_type", "\"log\" or \"linear\""]);
    bad(sched("WarmupCosineLR", json!({"total_num_steps": 10, "cos_min_ratio": 1.5})), &["scheduler.params.cos_min_ratio", "[0, 1]"]);
    bad(sched("WarmupLR", json!({"warmup_num_steps": -1})), &["scheduler.params.warmup_num_steps", "whole number"]);
    // An unknown warmup_type is DeepSpeed's warning and log warm-up; another scheduler a warning.
    let mut cfg = RunConfig::plain();
    let lines = apply(&sched("WarmupLR", json!({"warmup_type": "cubic"})), Path::new("ds.json"), &mut cfg).unwrap().lines;
    assert!(lines.iter().any(|l| l.level == Level::Warning && l.key == "scheduler.params.warmup_type"), "{lines:?}");
    assert_eq!(cfg.train.warmup_type, Some(longctx::train::optim::WarmupType::Log));
    let mut cfg = RunConfig::plain();
    let lines = apply(&sched("OneCycle", json!({"cycle_min_lr": 1e-5})), Path::new("ds.json"), &mut cfg).unwrap().lines;
    assert_eq!(cfg.train.lr_schedule, Schedule::Constant);
    assert!(lines.iter().any(|l| l.level == Level::Warning && l.key == "scheduler.params.cycle_min_lr"), "{lines:?}");
}

/// DeepSpeed's batch rule (`_set_batch_related_parameters` then `_batch_assertion`), with
/// its floor divisions: (micro-batch, accumulation), or `None` where DeepSpeed refuses.
fn deepspeed_batch(total: u64, micro: Option<u64>, accum: Option<u64>, world: u64) -> Option<(u64, u64)> {
    let (m, a) = match (micro, accum) {
        (Some(m), Some(a)) => (m, a),
        (Some(m), None) => (m, total / m / world),
        (None, Some(a)) => (total / world / a, a),
        (None, None) => (total / world, 1),
    };
    (m > 0 && a > 0 && total == m * a * world).then_some((m, a))
}

/// Regression (#33): `train_batch_size` 64 with a micro-batch of 8 ran 8 per step. Every
/// combination of the three keys at 1 and 2 data-parallel ranks gives DeepSpeed's
/// micro-batch and accumulation, or is refused where DeepSpeed refuses it.
#[test]
fn batch_triple_is_derived_and_checked_as_deepspeed_does() {
    for world in [1u64, 2] {
        for total in [1u64, 6, 8, 60, 64] {
            for micro in [None, Some(1u64), Some(4), Some(8)] {
                for accum in [None, Some(1u64), Some(2), Some(8)] {
                    let mut ds = json!({"train_batch_size": total});
                    if let Some(m) = micro {
                        ds["train_micro_batch_size_per_gpu"] = m.into();
                    }
                    if let Some(a) = accum {
                        ds["gradient_accumulation_steps"] = a.into();
                    }
                    let got = run_with(&ds, 4, world as usize, ParallelMode::DataParallel, BatchFlags::default());
                    match (deepspeed_batch(total, micro, accum, world), got) {
                        (Some((m, a)), Ok((cfg, _))) => {
                            let s = cfg.stage_settings(0);
                            assert_eq!((s.batch_size as u64, s.gradient_accumulate_every as u64), (m, a), "{ds} at world {world}");
                            assert_eq!(s.samples_per_step(), total);
                        }
                        (None, Err(e)) => {
                            let e = e.to_string();
                            assert!(e.contains("ds.json: field `train_batch_size`") && e.contains(&total.to_string()), "{ds}: {e}");
                        }
                        (want, got) => {
                            panic!("{ds} at world {world}: DeepSpeed {want:?}, longctx {:?}", got.map(|(c, _)| c.stage_settings(0)))
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn batch_errors_name_the_keys_the_values_and_the_fix() {
    let dp = ParallelMode::DataParallel;
    let err = |ds: Value, world: usize| run_with(&ds, 4, world, dp, BatchFlags::default()).unwrap_err().to_string();
    let e = err(json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 8}), 2);
    for n in [
        "ds.json: field `train_batch_size`",
        "64 ≠",
        "train_micro_batch_size_per_gpu 8",
        "gradient_accumulation_steps 8",
        "2 data-parallel ranks",
        "= 128",
        "set train_batch_size to 128",
    ] {
        assert!(e.contains(n), "error lacks `{n}`: {e}");
    }
    let e = err(json!({"train_batch_size": 60, "train_micro_batch_size_per_gpu": 8}), 1);
    for n in ["60 is not a multiple of train_micro_batch_size_per_gpu 8 × 1 data-parallel rank = 8", "56 or 64"] {
        assert!(e.contains(n), "error lacks `{n}`: {e}");
    }
    let e = err(json!({"train_batch_size": 3}), 2);
    assert!(e.contains("not a multiple of the 2 data-parallel ranks") && e.contains("2 or 4"), "{e}");
    // The data-parallel degree is what counts: 2 ranks in one ring are 1 data-parallel rank.
    let (cfg, lines) = run_with(
        &json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}),
        4,
        2,
        ParallelMode::ZigzagRingAttn,
        BatchFlags::default(),
    )
    .unwrap();
    assert_eq!(cfg.train.gradient_accumulate_every, 8, "{lines:?}");
    assert!(
        lines.iter().any(|l| l.contains("64 = 8 × 8 × 1 data-parallel rank (parallel.world_size 2 / sequence-parallel 2)")),
        "{lines:?}"
    );
}

/// A flag's micro-batch or accumulation is given, as its "auto" keeps longctx's own; a
/// conflict names the flag.
#[test]
fn batch_flags_and_auto_count_as_given() {
    let mut cfg = RunConfig::plain();
    cfg.stages = vec![Stage::new(64, 1e4, 4)];
    let applied = apply(&json!({"train_batch_size": 64}), Path::new("ds.json"), &mut cfg).unwrap();
    cfg.train.batch_size = 4; // --batch-size 4
    applied.finish(&mut cfg, BatchFlags { batch_size: true, gradient_accumulate_every: false }).unwrap();
    assert_eq!((cfg.train.batch_size, cfg.train.gradient_accumulate_every), (4, 16));

    let mut cfg = RunConfig::plain();
    cfg.stages = vec![Stage::new(64, 1e4, 4)];
    let applied = apply(&json!({"train_batch_size": 64, "gradient_accumulation_steps": 2}), Path::new("ds.json"), &mut cfg).unwrap();
    cfg.train.batch_size = 4;
    let e = applied.finish(&mut cfg, BatchFlags { batch_size: true, gradient_accumulate_every: false }).unwrap_err().to_string();
    assert!(e.contains("--batch-size 4") && e.contains("gradient_accumulation_steps 2") && e.contains("= 8"), "{e}");

    let mut cfg = RunConfig::plain();
    cfg.stages = vec![Stage::new(64, 1e4, 4)];
    cfg.train.batch_size = 2;
    let applied =
        apply(&json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": "auto"}), Path::new("ds.json"), &mut cfg).unwrap();
    applied.finish(&mut cfg, BatchFlags::default()).unwrap();
    assert_eq!((cfg.train.batch_size, cfg.train.gradient_accumulate_every), (2, 32));

    // Stages with different data-parallel degrees each get their own accumulation.
    let mut cfg = RunConfig::plain();
    cfg.parallel.world_size = 2;
    cfg.stages = vec![Stage::new(64, 1e4, 4), Stage { parallel_mode: Some(ParallelMode::ZigzagRingAttn), ..Stage::new(128, 1e5, 4) }];
    let applied = apply(&json!({"train_batch_size": 16, "train_micro_batch_size_per_gpu": 2}), Path::new("ds.json"), &mut cfg).unwrap();
    applied.finish(&mut cfg, BatchFlags::default()).unwrap();
    let accum: Vec<usize> = (0..2).map(|i| cfg.stage_settings(i).gradient_accumulate_every).collect();
    assert_eq!(accum, vec![4, 8]);
}

/// Regression (#33): values from a DeepSpeed config were blamed on `<flags>` or the TOML.
#[test]
fn values_from_a_deepspeed_config_are_blamed_on_their_keys() {
    let bad = |ds: Value, needles: &[&str]| {
        let e = run_with(&ds, 4, 1, ParallelMode::DataParallel, BatchFlags::default()).unwrap_err().to_string();
        for n in needles {
            assert!(e.contains(n), "error lacks `{n}`: {e}");
        }
        assert!(!e.contains("<flags>") && !e.contains("run.toml"), "{e}");
    };
    bad(json!({"optimizer": {"params": {"lr": 5}}}), &["ds.json: field `optimizer.params.lr`", "(0, 1]"]);
    bad(json!({"optimizer": {"params": {"betas": [0.9, 1.5]}}}), &["ds.json: field `optimizer.params.betas`"]);
    bad(json!({"optimizer": {"params": {"weight_decay": -0.1}}}), &["ds.json: field `optimizer.params.weight_decay`"]);
    bad(json!({"gradient_clipping": -1}), &["ds.json: field `gradient_clipping`"]);
    bad(json!({"gradient_accumulation_steps": 0}), &["ds.json: field `gradient_accumulation_steps`"]);
    bad(json!({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 2}}}), &["ds.json: field `scheduler.params.warmup_max_lr`"]);
    // A check that needs the stages (tokens per micro-batch) blames the key too.
    let mut cfg = RunConfig::plain();
    cfg.stages = vec![Stage::new(1 << 15, 1e4, 4)];
    let applied = apply(&json!({"train_micro_batch_size_per_gpu": 1 << 20}), Path::new("ds.json"), &mut cfg).unwrap();
    let e = applied.validate(&cfg, Path::new("run.toml")).unwrap_err().to_string();
    assert!(e.contains("ds.json: field `train_micro_batch_size_per_gpu`") && e.contains("train.batch_size"), "{e}");
    // ... unless a flag replaced the value: then the flag's source is named.
    cfg.train.batch_size = (1 << 20) - 1;
    let e = applied.validate(&cfg, Path::new("<flags>")).unwrap_err().to_string();
    assert!(e.starts_with("<flags>: field `train.batch_size`"), "{e}");
    // From a TOML's [deepspeed] table: the TOML file and the table's key.
    let dir = tempfile::tempdir().unwrap();
    let toml_path = dir.path().join("run.toml");
    std::fs::write(&toml_path, "[[stage]]\nseq_length = 64\nrope_theta = 10000.0\nsteps = 1\n[deepspeed.optimizer.params]\nlr = 5\n")
        .unwrap();
    let mut c = RunConfig::from_file(&toml_path).unwrap();
    let e = resolve(&mut c, None, &toml_path).unwrap_err().to_string();
    assert!(e.contains("run.toml: field `deepspeed.optimizer.params.lr`"), "{e}");
}

/// `offload_param` below stage 3 has no effect in DeepSpeed: a warning, not an error
/// blamed on the TOML's `train.offload_params`.
#[test]
fn offload_param_below_stage_3_has_no_effect() {
    let ds = json!({"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}});
    let (cfg, lines) = run_with(&ds, 4, 1, ParallelMode::DataParallel, BatchFlags::default()).unwrap();
    assert!(!cfg.train.offload_params);
    assert!(
        lines.iter().any(|l| l.starts_with("deepspeed warning: `zero_optimization.offload_param.device`") && l.contains("stage 2")),
        "{lines:?}"
    );
    let (cfg, _) = run_with(
        &json!({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
        4,
        1,
        ParallelMode::DataParallel,
        BatchFlags::default(),
    )
    .unwrap();
    assert!(cfg.train.offload_params);
}

#[test]
fn precision_sections_mean_what_deepspeed_means() {
    let dtype = |ds: Value| {
        let mut cfg = RunConfig::plain();
        cfg.model.dtype = "bf16".into();
        apply(&ds, Path::new("ds.json"), &mut cfg).unwrap();
        cfg.model.dtype
    };
    assert_eq!(dtype(json!({"bf16": {}})), "f32", "`enabled` absent is false; neither enabled: fp32");
    assert_eq!(dtype(json!({"bf16": {"enabled": false}})), "f32");
    assert_eq!(dtype(json!({"bf16": {"enabled": false}, "fp16": {"enabled": "auto"}})), "bf16");
    assert_eq!(dtype(json!({"fp16": {"enabled": true}, "bf16": {"enabled": false}})), "f16");
    assert_eq!(dtype(json!({"bfloat16": {"enabled": true}})), "bf16");
    assert_eq!(dtype(json!({"zero_optimization": {"stage": 1}})), "bf16", "no precision section: the config's");
}

/// The command line: the derived accumulation, the scheduler's keys and the blame reach
/// `train --dry-run` (each failed before #33's fix).
#[test]
fn train_takes_deepspeed_semantics_from_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let write = |name: &str, v: Value| {
        let p = dir.path().join(name);
        std::fs::write(&p, v.to_string()).unwrap();
        p.to_str().unwrap().to_string()
    };
    let tbs = write("tbs.json", json!({"train_batch_size": 64, "train_micro_batch_size_per_gpu": 8}));
    let dry = |extra: &[&str]| {
        let mut args = vec!["train", "--model", "builtin:tiny", "--dry-run"];
        args.extend_from_slice(extra);
        longctx(&args)
    };
    let o = dry(&["--deepspeed", &tbs]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("gradient_accumulate_every = 8"), "{out}\n{}", String::from_utf8_lossy(&o.stderr));
    let o = dry(&["--deepspeed", &tbs, "--world-size", "2", "--parallel-mode", "data_parallel"]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("gradient_accumulate_every = 4"), "{}", String::from_utf8_lossy(&o.stderr));
    let o = dry(&["--deepspeed", &tbs, "--gradient-accumulate-every", "2"]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("tbs.json: field `train_batch_size`") && err.contains("--gradient-accumulate-every 2"), "{err}");

    let p = json!({"total_num_steps": 20, "warmup_num_steps": 5, "warmup_min_ratio": 0.1, "cos_min_ratio": 0.05});
    let cos = write(
        "cos.json",
        json!({"optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}, "scheduler": {"type": "WarmupCosineLR", "params": p}}),
    );
    let out = String::from_utf8_lossy(&dry(&["--deepspeed", &cos]).stdout).to_string();
    for n in [
        "lr_schedule = \"warmup_cosine_lr\"",
        "min_lr_ratio = 0.05",
        "warmup_min_ratio = 0.1",
        "warmup_type = \"log\"",
        "schedule_steps = 20",
    ] {
        assert!(out.contains(n), "no `{n}`:\n{out}");
    }
    let bad = write("badlr.json", json!({"optimizer": {"params": {"lr": 5}}}));
    let o = dry(&["--deepspeed", &bad]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("badlr.json: field `optimizer.params.lr`") && !err.contains("<flags>"), "{err}");
}

/// A run trains with DeepSpeed's rates: metrics.jsonl's `lr` of every step is DeepSpeed's.
#[test]
fn a_run_logs_deepspeeds_rates() {
    let dir = tempfile::tempdir().unwrap();
    let p = json!({"total_num_steps": 6, "warmup_num_steps": 3, "warmup_min_ratio": 0.2, "cos_min_ratio": 0.1, "warmup_type": "linear"});
    let ds = json!({"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "scheduler": {"type": "WarmupCosineLR", "params": p}});
    let json_path = dir.path().join("ds.json");
    std::fs::write(&json_path, ds.to_string()).unwrap();
    let out = dir.path().join("run");
    let o = longctx(&[
        "train",
        "--model",
        "builtin:tiny",
        "--deepspeed",
        json_path.to_str().unwrap(),
        "--seq-length",
        "32",
        "--max-train-steps",
        "8",
        "--output-dir",
        out.to_str().unwrap(),
        "--quiet",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let text = std::fs::read_to_string(out.join("metrics.jsonl")).unwrap();
    let got: Vec<f64> = text.lines().filter_map(|l| serde_json::from_str::<Value>(l).ok()?["lr"].as_f64()).collect();
    let want = deepspeed_rates("WarmupCosineLR", &p, 1e-3, 8);
    assert_eq!(got.len(), 8, "{text}");
    for (k, (g, w)) in got.iter().zip(&want).enumerate() {
        assert!((g - w).abs() <= 1e-12 * w + 1e-18, "step {k}: logged {g:e}, DeepSpeed {w:e}");
    }
}
