//! Issue #16 item 4, resuming: the config saved in the checkpoint is compared with the
//! new one. Changes that break exactness (model, data, seed, a started stage's length or
//! θ) are refused with the key, the old and new values and the fix; layout changes need
//! `--allow-layout-change` and must keep the samples per step; the others (learning
//! rate, steps, cadence, stages not started) are reported and the run continues. A
//! saved state that is inconsistent (a stage past the last, steps past the stage, more
//! updates than steps, weights of another shape) is an error, never a "finished" run.
//!
//! Runs: built-in tiny Llama, passkey data, CPU, stopped after 2 steps of stage 0.

use candle_core::{Device, Tensor};
use longctx::train::config::{RunConfig, Stage};
use longctx::train::trainer::{run_with, RunOptions};
use std::path::Path;
use std::process::Command;

/// A change to a run config, and to a checkpoint's `state.json`.
type ConfigEdit = Box<dyn Fn(&mut RunConfig)>;
type StateEdit = Box<dyn Fn(&mut serde_json::Value)>;

fn config(dir: &Path) -> RunConfig {
    let stage = |seq_length, rope_theta, steps| Stage::new(seq_length, rope_theta, steps);
    let mut c = RunConfig { seed: 9, output_dir: dir.to_path_buf(), ..Default::default() };
    c.train.batch_size = 2;
    c.train.learning_rate = 3e-3;
    c.parallel.token_chunk = 32;
    c.stages = vec![stage(32, 1e4, 4), stage(64, 1e5, 2)];
    if let Err(e) = c.validate(Path::new("<test>")) {
        panic!("test config: {e}");
    }
    c
}

fn stopped_at_2(dir: &Path) -> RunConfig {
    let c = config(dir);
    let s = run_with(&c, false, &RunOptions { stop_at_global_step: Some(2), ..Default::default() }).unwrap_or_else(|e| panic!("{e}"));
    assert_eq!(s.steps, 2);
    c
}

fn resume_err(c: &RunConfig, allow_layout_change: bool) -> String {
    match run_with(c, true, &RunOptions { allow_layout_change, ..Default::default() }) {
        Ok(_) => panic!("the resume was accepted"),
        Err(e) => e.to_string(),
    }
}

fn assert_has(text: &str, needles: &[&str]) {
    for n in needles {
        assert!(text.contains(n), "`{n}` missing from: {text}");
    }
}

#[test]
fn changes_that_break_exactness_are_refused_with_the_key_and_the_fix() {
    let tmp = tempfile::tempdir().unwrap();
    let c = stopped_at_2(tmp.path());
    let fix = ["set it back to", "--overwrite", "cannot resume", "state.json"];
    let cases: Vec<(&str, &str, &str, ConfigEdit)> = vec![
        ("seed", "9", "10", Box::new(|c| c.seed = 10)),
        (
            "model.source",
            "\"builtin:tiny\"",
            "\"builtin:llama2-7b-shape\"",
            Box::new(|c| c.model.source = "builtin:llama2-7b-shape".into()),
        ),
        (
            "data.dataset",
            "\"synthetic:retrieval-answer\"",
            "\"synthetic:passkey\"",
            Box::new(|c| c.data.dataset = "synthetic:passkey".into()),
        ),
        ("data.shuffle_buffer", "64", "8", Box::new(|c| c.data.shuffle_buffer = 8)),
        ("stage[0].seq_length", "32", "64", Box::new(|c| c.stages[0].seq_length = 64)),
        ("stage[0].rope_theta", "10000.0", "20000.0", Box::new(|c| c.stages[0].rope_theta = 2e4)),
    ];
    for (key, old, new, change) in cases {
        let mut d = c.clone();
        change(&mut d);
        let e = resume_err(&d, false);
        assert_has(&e, &[&format!("`{key}` changed from {old} to {new}"), &format!("set it back to {old}")]);
        assert_has(&e, &fix);
    }
    // The layout: refused without the flag, and with it when the samples per step change.
    let mut d = c.clone();
    d.parallel.world_size = 2;
    assert_has(&resume_err(&d, false), &["`parallel.world_size` changed from 1 to 2", "--allow-layout-change"]);
    assert_has(&resume_err(&d, true), &["samples per optimizer step", "from 2 to 4"]);
    // Two refused keys are both named.
    let mut d = c.clone();
    d.seed = 1;
    d.train.batch_size = 4;
    assert_has(&resume_err(&d, false), &["`seed`", "`train.batch_size`"]);
}

/// Allowed changes, through the binary: listed in one note, and the run completes. A
/// stage not started yet may change its θ too.
#[test]
fn allowed_changes_are_reported_and_the_run_continues() {
    let tmp = tempfile::tempdir().unwrap();
    let c = stopped_at_2(tmp.path());
    let mut d = c.clone();
    d.stages[1].rope_theta = 2e5;
    let toml_path = tmp.path().join("resume.toml");
    std::fs::write(&toml_path, toml::to_string(&d).unwrap()).unwrap();
    let o = Command::new(env!("CARGO_BIN_EXE_longctx"))
        .args(["train", "--config", toml_path.to_str().unwrap(), "--resume", "--learning-rate", "2e-3", "--checkpoint-every", "3"])
        .env("HF_HUB_OFFLINE", "1")
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(o.status.success(), "{err}");
    assert_has(
        &err,
        &[
            "note: resuming with changed settings:",
            "stage[1].rope_theta: 100000.0 -> 200000.0",
            "train.checkpoint_every: 0 -> 3",
            "train.learning_rate: 0.003 -> 0.002",
        ],
    );
    assert!(tmp.path().join("export/model.safetensors").is_file());
}

fn edit_state(dir: &Path, f: impl Fn(&mut serde_json::Value)) {
    let p = dir.join("checkpoint/state.json");
    let mut v: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&p).unwrap()).unwrap();
    f(&mut v);
    std::fs::write(&p, v.to_string()).unwrap();
}

#[test]
fn an_inconsistent_saved_state_is_an_error_not_a_finished_run() {
    let tmp = tempfile::tempdir().unwrap();
    let c = stopped_at_2(tmp.path());
    let original = std::fs::read_to_string(tmp.path().join("checkpoint/state.json")).unwrap();
    let restore = || std::fs::write(tmp.path().join("checkpoint/state.json"), &original).unwrap();
    let cases: Vec<(StateEdit, &str)> = vec![
        (Box::new(|v| v["stage"] = 7.into()), "stage 7 step 2 is past the last stage (the run has 2 stages)"),
        (Box::new(|v| v["stage_step"] = 9.into()), "stage 0 records 9 steps done of its 4"),
        (Box::new(|v| v["adam_step"] = 5.into()), "5 optimizer updates but 2 steps in the run"),
        (Box::new(|v| v["optimizer_shards"] = 0.into()), "`optimizer_shards` is 0"),
        (Box::new(|v| v["skipped_steps"] = 3.into()), "3 skipped steps"),
        // Counters cross-checked (issue #33): fewer AdamW updates than steps done, a global
        // step no run of these stages reaches.
        (Box::new(|v| v["adam_step"] = 1.into()), "field `adam_step` is 1 but 2 steps were done"),
        (Box::new(|v| v["global_step"] = 1_000_000_000_000_000u64.into()), "field `global_step` is 1000000000000000"),
        (
            Box::new(|v| {
                v["global_step"] = 1.into();
                v["stage_step"] = 1.into();
                v["adam_step"] = 1.into();
                v["stage"] = 1.into();
            }),
            "with 1 finished stage(s)",
        ),
        // The data cursor against the steps (issue #33): a stage 2 steps in at 2 samples
        // per step has drawn 4 samples.
        (Box::new(|v| v["data"]["position"] = 6.into()), "the data cursor (field `data`) is at epoch 0 sample 6, but stage 0 step 2"),
        (Box::new(|v| v["data"]["epoch"] = 9.into()), "at epoch 9 sample 4"),
        (Box::new(|v| v["data"] = serde_json::Value::Null), "stage 0 is 2 steps in but field `data` holds no data cursor"),
        (Box::new(|v| v["data"] = "x".into()), "field `data` is not a data cursor"),
    ];
    for (edit, needle) in cases {
        edit_state(tmp.path(), edit);
        assert_has(&resume_err(&c, false), &["inconsistent checkpoint state", needle, "--overwrite"]);
        restore();
    }
    // Consistent, but the new config gave the stage fewer steps than it already did.
    let mut d = c.clone();
    d.stages[0].steps = 2;
    assert_has(&resume_err(&d, false), &["stage[0].steps", "already did 2 steps", "give it more than 2"]);
    // A tensor of another shape in the checkpoint's weights.
    let mp = tmp.path().join("checkpoint/model.safetensors");
    let mut w = candle_core::safetensors::load(&mp, &Device::Cpu).unwrap();
    w.insert("model.norm.weight".into(), Tensor::zeros(3, candle_core::DType::F32, &Device::Cpu).unwrap());
    candle_core::safetensors::save(&w, &mp).unwrap();
    assert_has(&resume_err(&c, false), &["model.norm.weight", "has shape [3]", "another model"]);
}
