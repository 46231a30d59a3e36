//! DeepSpeed JSON configs read as is (`--deepspeed FILE`, or a `[deepspeed]` table in the
//! TOML): what each key of EasyContext's `zero3_offload.json` (our copy:
//! `configs/zero3_offload.json`) sets, that every key is reported, that unknown keys are
//! named in a warning, that impossible choices are errors naming the key, that the TOML
//! table and the JSON file give the same run, and that `plan` counts the offload.

use longctx::train::config::RunConfig;
use longctx::train::deepspeed::{apply, resolve, Level};
use longctx::train::optim::Schedule;
use serde_json::json;
use std::path::Path;

mod common;
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
    let lines = apply(&ds, Path::new("zero3_offload.json"), &mut cfg).unwrap();
    // What it sets.
    assert!(cfg.train.optimizer_on_host, "offload_optimizer.device = cpu");
    assert_eq!(cfg.train.learning_rate, 2e-5, "WarmupLR's warmup_max_lr replaces the optimizer's lr");
    assert_eq!(cfg.train.lr_schedule, Schedule::Constant, "WarmupLR with 0 warm-up steps");
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
    let lines = apply(&ds, Path::new("ds.json"), &mut cfg).unwrap();
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
                warmup_num_steps = 0\n";
    std::fs::write(&toml_path, body).unwrap();
    let mut from_toml = RunConfig::from_file(&toml_path).unwrap();
    assert!(from_toml.deepspeed.is_some());
    let lines = resolve(&mut from_toml, None, &toml_path).unwrap();
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
