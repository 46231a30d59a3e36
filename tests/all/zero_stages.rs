//! ZeRO stages 0–3 and the offloads (`train.zero_stage`, `train.offload_params`,
//! `train.optimizer_on_host`) against the unsharded run.
//!
//! Every variant trains the built-in tiny Llama cut to 6 layers (untied head) on passkey data
//! for 4 steps with clipping and warmup, 2 ranks, in the data-parallel and the zigzag
//! ring layouts. The reference is stage 0 (each rank the whole optimizer state, the
//! gradients all-reduced). Every other stage and offload choice must end with the same
//! exported weights (f32, max |a − b| ≤ 1e-5 · max |b| per tensor: the sums are the same
//! but cut into other collectives) and log the same loss and gradient norm each step
//! (1e-5 relative). The bytes each rank holds must shrink as designed: stage 1 halves the
//! optimizer state, stage 2 the gradients (a slice plus one layer's scratch), stage 3 the
//! weights. A checkpoint written under one stage resumes under another (the optimizer
//! state is re-cut from the units recorded in `state.json`). And the same runs as real
//! processes (`longctx launch`) equal the thread runs.

use longctx::parallel::dims::ParallelMode;
use longctx::train::config::{RunConfig, Stage};
use longctx::train::optim::Schedule;
use longctx::train::trainer::{run, run_with, Resident, RunOptions, RunSummary};
use std::collections::HashMap;
use std::path::Path;

use crate::common;

/// Relative tolerance of a ZeRO variant against stage 0 (f32).
const TOL: f64 = 1e-5;

fn config(dir: &Path, mode: ParallelMode, stage: u8, offload_params: bool, optimizer_on_host: bool) -> RunConfig {
    let mut c = RunConfig { seed: 5, output_dir: dir.to_path_buf(), ..Default::default() };
    c.model.source = "builtin:tiny@layers=6".into(); // the layers outweigh embedding and head, as in real models
    c.train.batch_size = 2;
    c.train.learning_rate = 3e-3;
    c.train.lr_schedule = Schedule::Cosine;
    c.train.warmup_steps = 1;
    c.train.clip_grad = 0.5;
    c.train.zero_stage = stage;
    c.train.offload_params = offload_params;
    c.train.optimizer_on_host = optimizer_on_host;
    c.parallel.world_size = 2;
    c.parallel.mode = mode;
    c.parallel.token_chunk = 24;
    c.stages = vec![Stage::new(64, 1e4, 4)];
    if let Err(e) = c.validate(Path::new("<zero test>")) {
        panic!("test config: {e}");
    }
    c
}

fn weights(path: &Path) -> HashMap<String, Vec<f32>> {
    let t = candle_core::safetensors::load(path, &candle_core::Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    t.into_iter().map(|(k, v)| (k, v.to_dtype(candle_core::DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap())).collect()
}

/// Every tensor within TOL of the reference's (max |a−b| / max |b|).
fn same_weights(got: &Path, want: &Path, what: &str) {
    close_weights(got, want, TOL, what)
}

/// The same tensors as the reference, each within `tol` of it (max |a−b| / max |b|).
fn close_weights(got: &Path, want: &Path, tol: f64, what: &str) {
    let (a, b) = (weights(got), weights(want));
    assert_eq!(a.len(), b.len(), "{what}: tensor count");
    for (k, vb) in &b {
        let va = a.get(k).unwrap_or_else(|| panic!("{what}: `{k}` missing"));
        let scale = vb.iter().fold(0f64, |m, x| m.max(x.abs() as f64)).max(1e-30);
        let diff = va.iter().zip(vb).fold(0f64, |m, (x, y)| m.max((*x as f64 - *y as f64).abs()));
        assert!(diff / scale <= tol, "{what}: `{k}` differs by {diff:e} (scale {scale:e}, allowed {tol:e})");
    }
}

/// `(loss, grad_norm)` per logged step.
fn log(dir: &Path) -> Vec<(f64, f64)> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics.jsonl");
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["loss"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap()))
        .collect()
}

fn same_log(got: &Path, want: &Path, what: &str) {
    let (a, b) = (log(got), log(want));
    assert_eq!(a.len(), 4, "{what}: {a:?}");
    assert_eq!(a.len(), b.len(), "{what}");
    for (i, ((la, na), (lb, nb))) in a.iter().zip(&b).enumerate() {
        assert!((la - lb).abs() <= TOL * lb.abs(), "{what}: step {i} loss {la} vs {lb}");
        assert!((na - nb).abs() <= TOL * nb.abs(), "{what}: step {i} grad norm {na} vs {nb}");
    }
}

fn train(dir: &Path, c: &RunConfig) -> RunSummary {
    run(c, false).unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
}

#[test]
fn every_stage_and_offload_gives_the_unsharded_weights_and_holds_less() {
    let tmp = tempfile::tempdir().unwrap();
    for mode in [ParallelMode::DataParallel, ParallelMode::ZigzagRingAttn] {
        let reference = tmp.path().join(format!("{mode:?}-stage0"));
        let r0 = train(&reference, &config(&reference, mode, 0, false, false)).resident;
        let mut held: Vec<(String, Resident)> = vec![("stage 0".into(), r0)];
        for (stage, offload, host_opt) in [(1, false, false), (2, false, false), (3, false, false), (3, true, false), (3, true, true)] {
            let what = format!(
                "{mode:?} stage {stage}{}{}",
                if offload { " +offload_params" } else { "" },
                if host_opt { " +optimizer_on_host" } else { "" }
            );
            let dir = tmp.path().join(what.replace([' ', '+'], "_"));
            let s = train(&dir, &config(&dir, mode, stage, offload, host_opt));
            same_weights(&dir.join("export/model.safetensors"), &reference.join("export/model.safetensors"), &what);
            same_log(&dir, &reference, &what);
            // The checkpoint holds the whole weights too (gathered under stage 3).
            same_weights(&dir.join("checkpoint/model.safetensors"), &reference.join("checkpoint/model.safetensors"), &what);
            held.push((what, s.resident));
        }
        let r = |i: usize| held[i].1;
        let report: Vec<String> = held.iter().map(|(w, r)| format!("{w}: {r}")).collect();
        eprintln!("bytes held per rank, 2 ranks:\n{}", report.join("\n"));
        // Stage 1: half the optimizer state (up to one padded element per unit and array).
        assert!(r(1).optimizer <= r(0).optimizer / 2 + 12, "{report:#?}");
        assert_eq!(r(1).grads, r(0).grads, "stage 1 keeps the whole gradient: {report:#?}");
        // Stage 2: the gradient is a slice plus one unit's scratch, well under the whole.
        assert!(r(2).grads < r(1).grads * 3 / 4, "{report:#?}");
        assert_eq!(r(2).weights, r(1).weights, "{report:#?}");
        // Stage 3: half the weights (plus padding of at most one element per unit).
        let units = 8; // embedding, 6 layers, norm + head
        assert!(r(3).weights <= r(2).weights / 2 + 4 * units, "{report:#?}");
        assert!(r(3).optimizer <= r(1).optimizer + 12 * units, "{report:#?}");
        // offload_params: the weights' slice is kept in host memory, and only then. (Where
        // the optimizer state lives cannot differ on a CPU device: always the host.)
        assert_eq!(r(3).weights_host, 0, "{report:#?}");
        assert!(r(4).weights_host == r(4).weights && r(4).weights > 0, "{report:#?}");
    }
}

#[test]
fn a_checkpoint_resumes_under_another_stage() {
    let tmp = tempfile::tempdir().unwrap();
    let mode = ParallelMode::DataParallel;
    let straight = tmp.path().join("straight");
    train(&straight, &config(&straight, mode, 1, false, false));
    // Stopped after 2 steps under stage 3 (per-layer units), resumed under stage 1 (one
    // unit), and the other way round.
    for (first, then) in [(3u8, 1u8), (1, 3), (2, 0)] {
        let dir = tmp.path().join(format!("{first}-then-{then}"));
        let s =
            run_with(&config(&dir, mode, first, false, false), false, &RunOptions { stop_at_global_step: Some(2), ..Default::default() })
                .unwrap_or_else(|e| panic!("stage {first}: {e}"));
        assert!(!s.completed);
        let s = run(&config(&dir, mode, then, then == 3, false), true).unwrap_or_else(|e| panic!("resume under stage {then}: {e}"));
        assert!(s.completed);
        same_weights(
            &dir.join("export/model.safetensors"),
            &straight.join("export/model.safetensors"),
            &format!("stage {first} then {then}"),
        );
    }
}

#[test]
fn launched_processes_under_stages_0_2_and_3_with_offloads_equal_the_thread_runs() {
    let tmp = tempfile::tempdir().unwrap();
    let args = |out: &Path, extra: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "train", "--model", "builtin:tiny@layers=6", "--dataset", "synthetic:passkey", "--seq-length", "64", "--rope-theta", "1e4",
            "--max-train-steps", "3", "--batch-size", "2", "--learning-rate", "3e-3", "--clip-grad", "0.5", "--device", "cpu",
            "--checkpoint-every", "1", "--token-chunk", "24", "--parallel-mode", "zigzag_ring_attn", "--output-dir",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        a.push(out.display().to_string());
        a.extend(extra.iter().map(|s| s.to_string()));
        a
    };
    let check = |o: std::process::Output, what: &str| {
        assert!(o.status.success(), "{what}: {}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
        String::from_utf8_lossy(&o.stderr).to_string()
    };
    let threads = tmp.path().join("threads-stage0");
    let mut a = args(&threads, &["--zero-stage", "0", "--world-size", "2"]);
    a.push("--overwrite".into());
    check(common::longctx_cmd(&[]).args(&a).output().unwrap(), "threads");
    for (name, extra) in [
        ("stage0", &["--zero-stage", "0"][..]),
        ("stage2", &["--zero-stage", "2"][..]),
        ("stage3", &["--offload-params", "--optimizer-on-host"][..]),
        ("stage3-grads", &["--offload-params", "--offload-gradients"][..]), // implies the host optimizer
        ("stage2-grads", &["--zero-stage", "2", "--offload-gradients"][..]),
    ] {
        let procs = tmp.path().join(format!("processes-{name}"));
        let mut a: Vec<String> = ["launch", "--nproc-per-node", "2", "--master-port", "0", "--"].iter().map(|s| s.to_string()).collect();
        a.extend(args(&procs, extra));
        let err = check(common::longctx_cmd(&[]).args(&a).output().unwrap(), name);
        assert!(err.contains(&format!("ZeRO stage {} over 2 rank(s)", &name[5..6])), "{err}");
        if name.ends_with("-grads") {
            assert!(err.contains("optimizer offloaded") && !err.contains("(0.000 MB on the host), optimizer"), "{err}");
        }
        same_weights(
            &procs.join("export/model.safetensors"),
            &threads.join("export/model.safetensors"),
            &format!("processes {name} vs threads stage 0"),
        );
    }
    let procs = tmp.path().join("processes-stage3");
    // One optimizer shard per rank, each its slice of every unit.
    let state: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(procs.join("checkpoint/state.json")).unwrap()).unwrap();
    assert_eq!(state["optimizer_shards"], 2);
    assert_eq!(state["optimizer_units"].as_array().map(|a| a.len()), Some(8), "{state}");
}

/// A ZeRO-3 checkpoint of two ranks resumes on one (the optimizer slices are re-cut from
/// the per-layer units the checkpoint records; the samples per step stay: batch 2 × 2
/// ranks, then 4 × 1): the exported weights within 1e-4 of the straight two-rank run (the
/// gradient sums are added in another order, so not bit for bit).
#[test]
fn a_zero_3_checkpoint_resumes_on_another_world_size() {
    let tmp = tempfile::tempdir().unwrap();
    let mode = ParallelMode::DataParallel;
    let straight = tmp.path().join("straight");
    train(&straight, &config(&straight, mode, 3, true, false));
    let dir = tmp.path().join("two-then-one");
    let s = run_with(&config(&dir, mode, 3, true, false), false, &RunOptions { stop_at_global_step: Some(2), ..Default::default() })
        .unwrap_or_else(|e| panic!("two ranks: {e}"));
    assert!(!s.completed);
    let mut one = config(&dir, mode, 3, true, false);
    one.parallel.world_size = 1;
    one.train.batch_size = 4;
    let s =
        run_with(&one, true, &RunOptions { allow_layout_change: true, ..Default::default() }).unwrap_or_else(|e| panic!("one rank: {e}"));
    assert!(s.completed);
    close_weights(&dir.join("export/model.safetensors"), &straight.join("export/model.safetensors"), 1e-4, "two ranks, then one");
}

/// The deferred host update (stage 3, weights and optimizer on the host) with two
/// micro-batches per step (the first one's forward applies it, the second finds it done)
/// and a checkpoint after step 2 (which settles it mid-run) gives exactly the weights,
/// checkpoint and per-step loss and gradient norm of stage 3 with both on the device (the
/// same summation order; the host and device AdamW agree bit for bit). Against stage 0 the
/// two micro-batches are summed in another order (each reduce-scattered on its own):
/// 3.8e-5 relative after 4 steps here, from gradient elements that cancel across ranks.
#[test]
fn the_deferred_update_holds_under_accumulation_and_mid_run_checkpoints() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |dir: &Path, offload: bool| {
        let mut c = config(dir, ParallelMode::DataParallel, 3, offload, offload);
        c.train.batch_size = 1;
        c.train.gradient_accumulate_every = 2;
        c.train.checkpoint_every = 2;
        c
    };
    let (reference, deferred) = (tmp.path().join("stage3"), tmp.path().join("stage3-offload"));
    train(&reference, &cfg(&reference, false));
    train(&deferred, &cfg(&deferred, true));
    for file in ["export/model.safetensors", "checkpoint/model.safetensors"] {
        let (a, b) = (weights(&deferred.join(file)), weights(&reference.join(file)));
        assert_eq!(a.len(), b.len(), "{file}");
        for (k, vb) in &b {
            let same = a[k].iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "{file}: `{k}` differs from stage 3 on the device");
        }
    }
    assert_eq!(log(&deferred), log(&reference), "per-step loss and gradient norm");
    assert_eq!(log(&deferred).len(), 4);
}

/// A split optimizer placement (`train.optimizer_device_units`, two ranks, ZeRO-3 with the
/// weights on the host): the first units' AdamW on the device (on a CPU device, its CPU
/// twin) applied at once when the next forward starts, the others' deferred on the host as
/// before. The host and device AdamW agree bit for bit, so the weights, the checkpoint and
/// the per-step loss and gradient norm are exactly the all-host run's, with 2 units (the
/// embedding and layer 0) and with 7 (all but the head); a checkpoint written split
/// resumes on the host and the other way round, the same bits again.
#[test]
fn a_split_optimizer_placement_equals_the_host_one_and_resumes_across_placements() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |dir: &Path, units: usize| {
        let mut c = config(dir, ParallelMode::DataParallel, 3, true, true);
        c.train.optimizer_device_units = units;
        c.train.batch_size = 1;
        c.train.gradient_accumulate_every = 2;
        c.train.checkpoint_every = 2;
        c
    };
    let bits = |got: &Path, want: &Path, what: &str| {
        for file in ["export/model.safetensors", "checkpoint/model.safetensors"] {
            let (a, b) = (weights(&got.join(file)), weights(&want.join(file)));
            assert_eq!(a.len(), b.len(), "{what}: {file}");
            for (k, vb) in &b {
                let same = a[k].iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits());
                assert!(same, "{what}: {file}: `{k}` differs from the all-host run");
            }
        }
    };
    let host = tmp.path().join("host");
    train(&host, &cfg(&host, 0));
    for units in [2, 7] {
        let dir = tmp.path().join(format!("split-{units}"));
        let s = train(&dir, &cfg(&dir, units));
        bits(&dir, &host, &format!("{units} units on the device"));
        assert_eq!(log(&dir), log(&host), "{units} units on the device: per-step loss and gradient norm");
        // The device part is counted where it lives; the host keeps the whole slice's state.
        assert!(s.resident.optimizer > s.resident.optimizer_host, "{units} units: {}", s.resident);
        // ...and so are those units' weights (beside the host shard, which keeps its length).
        assert!(s.resident.weights > s.resident.weights_host, "{units} units: {}", s.resident);
    }
    for (first, then) in [(2, 0), (0, 7)] {
        let dir = tmp.path().join(format!("resume-{first}-then-{then}"));
        let s = run_with(&cfg(&dir, first), false, &RunOptions { stop_at_global_step: Some(2), ..Default::default() })
            .unwrap_or_else(|e| panic!("{first} units: {e}"));
        assert!(!s.completed);
        let s = run(&cfg(&dir, then), true).unwrap_or_else(|e| panic!("resumed with {then} units: {e}"));
        assert!(s.completed);
        bits(&dir, &host, &format!("{first} units, resumed with {then}"));
    }
}

/// More device units than the model has, or device units with the whole state on the GPU
/// already: one error naming the field, the count and the fix, before anything trains.
#[test]
fn device_units_beyond_the_model_or_without_the_host_optimizer_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("too-many");
    let mut c = config(&dir, ParallelMode::DataParallel, 3, true, true);
    c.train.optimizer_device_units = 9;
    let Err(e) = run(&c, false) else { panic!("9 units of 8 ran") };
    let e = e.to_string();
    assert!(e.contains("optimizer_device_units = 9") && e.contains("8 ZeRO unit(s)") && e.contains("at most 8"), "{e}");
    c.train.optimizer_on_host = false;
    c.train.optimizer_device_units = 2;
    let Err(e) = c.validate(Path::new("run.toml")) else { panic!("units without the host optimizer validated") };
    let e = e.to_string();
    assert!(e.contains("train.optimizer_device_units") && e.contains("optimizer_on_host"), "{e}");
}

/// The split placement without the deferred update (ZeRO-2, the weights in the model, two
/// ranks: the device units' new weights all-gathered unit by unit, then the host pass from
/// the first host unit) and under ZeRO-1 (one unit: all of it on the device): the same
/// bits as the optimizer wholly on the host.
#[test]
fn a_split_optimizer_placement_holds_under_stages_1_and_2() {
    let tmp = tempfile::tempdir().unwrap();
    for (stage, units) in [(2u8, 3usize), (1, 1)] {
        let host = tmp.path().join(format!("stage{stage}-host"));
        train(&host, &config(&host, ParallelMode::DataParallel, stage, false, true));
        let dir = tmp.path().join(format!("stage{stage}-split{units}"));
        let mut c = config(&dir, ParallelMode::DataParallel, stage, false, true);
        c.train.optimizer_device_units = units;
        train(&dir, &c);
        let (a, b) = (weights(&dir.join("export/model.safetensors")), weights(&host.join("export/model.safetensors")));
        for (k, vb) in &b {
            let same = a[k].iter().zip(vb).all(|(x, y)| x.to_bits() == y.to_bits());
            assert!(same, "stage {stage}, {units} unit(s) on the device: `{k}` differs from the all-host run");
        }
        assert_eq!(log(&dir), log(&host), "stage {stage}, {units} unit(s): per-step loss and gradient norm");
    }
}

/// The step profile (`train.profile`) tells the deferred update's parts apart: the
/// step's end (`optimizer`: norm and clipping), the next forward's first unit
/// (`update_first`: here the 2 device units' update) and its later units and head
/// (`update_wait`: the host update, applied unit by unit as the forward reaches them).
/// Every step after the first has time in all three (the first has no pending update);
/// the phases never add up to more than the step.
#[test]
fn the_profile_splits_the_deferred_update_into_its_three_places() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("profiled");
    let mut c = config(&dir, ParallelMode::DataParallel, 3, true, true);
    c.train.optimizer_device_units = 2;
    c.train.profile = true;
    train(&dir, &c);
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).expect("metrics.jsonl");
    let steps: Vec<serde_json::Value> =
        text.lines().filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok()).filter(|v| v.get("profile").is_some()).collect();
    assert_eq!(steps.len(), 4, "{text}");
    for (i, s) in steps.iter().enumerate() {
        let p = s["profile"].as_object().expect("profile object");
        let secs = |k: &str| p.get(k).and_then(|v| v.as_f64()).unwrap_or_else(|| panic!("step {}: no `{k}` in {p:?}", i + 1));
        let named: f64 = p.iter().filter(|(k, _)| k.as_str() != "other").map(|(_, v)| v.as_f64().unwrap_or(0.0)).sum();
        let step = s["seconds"].as_f64().expect("seconds");
        assert!(named <= step * 1.001 + 1e-4, "step {}: phases {named} s in a {step} s step: {p:?}", i + 1);
        assert!(secs("optimizer") > 0.0, "step {}: {p:?}", i + 1);
        if i > 0 {
            assert!(secs("update_first") > 0.0 && secs("update_wait") > 0.0, "step {}: {p:?}", i + 1);
        }
    }
}

/// The gradients in host memory (`train.offload_gradients`, the optimizer there under
/// ZeRO-2 or 3): each unit's slice is parked there when the backward is done with it and
/// the update reads it in place: deferred into the next forward (ZeRO-3 with the weights
/// on the host too), or at once after the backward (ZeRO-3 with the weights on the
/// device; ZeRO-2, the model's own weights). Against the same run keeping the gradient
/// shard on the device: the exported weights, the checkpoint and the per-step loss and
/// gradient norm within TOL (the norm is summed unit by unit, so its last bits may
/// differ), on one and on two ranks, with two micro-batches a step (a unit's slice comes
/// back and the second micro-batch's is added) and with a split optimizer (the device
/// units' slices stay on the device). The device holds less gradient memory and the host
/// the slices' 4 bytes a parameter. Stages 0–1 or the optimizer on the GPU are refused by
/// name.
#[test]
fn gradients_in_host_memory_train_like_the_device_shard() {
    let tmp = tempfile::tempdir().unwrap();
    let cfg = |dir: &Path, (stage, weights_on_host): (u8, bool), world: usize, units: usize, grads: bool| {
        let mut c = config(dir, ParallelMode::DataParallel, stage, weights_on_host, true);
        if units == usize::MAX {
            // A tied head (the embedding's gradient gets the head's first, its unit last).
            c.model.source = "tests/fixtures/qwen2_tied".into();
        }
        let units = if units == usize::MAX { 0 } else { units };
        c.parallel.world_size = world;
        c.train.optimizer_device_units = units;
        c.train.offload_gradients = grads;
        c.train.batch_size = 1;
        c.train.gradient_accumulate_every = 2;
        c.train.checkpoint_every = 2;
        if let Err(e) = c.validate(Path::new("<zero test>")) {
            panic!("test config: {e}");
        }
        c
    };
    let deferred = (3u8, true);
    let cases = [
        (deferred, 1usize, 0usize),
        (deferred, 2, 0),
        (deferred, 1, 2),
        (deferred, 2, 3),
        ((3, false), 1, 0),
        ((3, false), 2, 0),
        ((2, false), 1, 0),
        ((2, false), 2, 2),
        ((2, false), 1, 8), // every unit's state on the device: nothing goes to the host
        (deferred, 1, usize::MAX),
        ((2, false), 2, usize::MAX),
    ];
    for (layout, world, units) in cases {
        let tied = units == usize::MAX;
        let model = if tied { "the tied fixture".to_string() } else { format!("{units} device unit(s)") };
        let what = format!("stage {}{}, {world} rank(s), {model}", layout.0, if layout.1 { " weights on the host" } else { "" });
        let tag = format!("{}{}-{world}-{units}", layout.0, layout.1);
        let reference = tmp.path().join(format!("dev-{tag}"));
        let r = train(&reference, &cfg(&reference, layout, world, units, false)).resident;
        let dir = tmp.path().join(format!("host-{tag}"));
        let h = train(&dir, &cfg(&dir, layout, world, units, true)).resident;
        for file in ["export/model.safetensors", "checkpoint/model.safetensors"] {
            close_weights(&dir.join(file), &reference.join(file), TOL, &format!("{what}: {file}"));
        }
        same_log(&dir, &reference, &what);
        assert_eq!(r.grads_host, 0, "{what}: {r}");
        if units == 8 {
            assert_eq!(h, r, "{what}: all on the device either way");
            continue;
        }
        assert!(h.grads_host > 0 && h.grads > h.grads_host, "{what}: {h}");
        if !tied {
            // On the device: the device units' slices and, one rank, two units' turns (else
            // the shared scratch); well under the whole slice the reference keeps there (not
            // so with a tied fixture: two layers beside a large embedding).
            assert!(h.grads - h.grads_host < (r.grads - r.grads_host) * 3 / 4, "{what}: {h} against {r}");
        }
        // What `longctx plan` counts, both ways: on the device, what was allocated plus the
        // slices in flight (one brought back with one rank; several ranks, three reduced
        // slices); in host memory, this rank's slices of the host units. Within the padding
        // of each unit's slice to a multiple of the ranks.
        let model = match tied {
            true => longctx::model::LlamaConfig::from_file("tests/fixtures/qwen2_tied/config.json").unwrap(),
            false => longctx::model::init::builtin_config("tiny@layers=6").unwrap(),
        };
        assert_eq!(model.tie_word_embeddings, tied);
        let shape = longctx::plan::ModelShape::from_config(&model);
        let (vh, hidden) = (model.vocab_size * model.hidden_size, model.hidden_size);
        let unit_max = (shape.layer_params as usize).max(if tied { hidden } else { vh + hidden }).max(vh);
        let in_flight = if world == 1 { unit_max } else { 3 * unit_max.div_ceil(world) };
        let pad = 4 * world * (model.num_hidden_layers + 2);
        for (grads, res, name) in [(true, &h, "host"), (false, &r, "device")] {
            let c = cfg(tmp.path(), layout, world, units, grads);
            let e = longctx::plan::estimate(&shape, &longctx::plan::run_requests(&c, 141_000_000_000, 4)[0]).unwrap();
            let planned = e.device.gradients as usize - if grads { 4 * in_flight } else { 0 };
            let (dev, host) = (res.grads - res.grads_host, res.grads_host);
            assert!(planned.abs_diff(dev) <= pad, "{what}, gradients on the {name}: plan {planned} B on the device, allocated {dev}");
            assert!(
                (e.host.gradients as usize).abs_diff(host) <= pad,
                "{what}, {name}: plan {} B on the host, got {host}",
                e.host.gradients
            );
        }
    }
    // A checkpoint written with the gradients on the host resumes with them on the device
    // and the other way round (the checkpoint holds no gradient): the straight run's result.
    let straight = tmp.path().join(format!("host-{}{}-1-0", deferred.0, deferred.1));
    for (first, then) in [(true, false), (false, true)] {
        let dir = tmp.path().join(format!("resume-{first}-{then}"));
        let s = run_with(&cfg(&dir, deferred, 1, 0, first), false, &RunOptions { stop_at_global_step: Some(2), ..Default::default() })
            .unwrap_or_else(|e| panic!("offload_gradients {first}: {e}"));
        assert!(!s.completed);
        let s = run(&cfg(&dir, deferred, 1, 0, then), true).unwrap_or_else(|e| panic!("resumed with offload_gradients {then}: {e}"));
        assert!(s.completed);
        close_weights(
            &dir.join("export/model.safetensors"),
            &straight.join("export/model.safetensors"),
            TOL,
            &format!("resume {first} -> {then}"),
        );
    }
    for (stage, host_opt) in [(1u8, true), (3, false)] {
        let dir = tmp.path().join("refused");
        let mut c = config(&dir, ParallelMode::DataParallel, stage, false, host_opt);
        c.train.offload_gradients = true;
        let Err(e) = c.validate(Path::new("run.toml")) else {
            panic!("gradients offloaded under stage {stage}, host optimizer {host_opt}")
        };
        let e = e.to_string();
        let got = format!("zero_stage = {stage}, optimizer_on_host = {host_opt}");
        assert!(e.contains("train.offload_gradients") && e.contains(&got) && e.contains("--zero-stage 3 --optimizer-on-host"), "{e}");
    }
}
