//! Issue #16 item 2, numeric guards: a step whose gradient norm is not finite is skipped
//! on every rank (no update, its data consumed, counted in the metrics and the
//! checkpoint); `train.max_skipped_steps` of them in a row abort the run with the last
//! good checkpoint kept; an update that makes the weights non-finite aborts before
//! anything is written; checkpoints and exports never hold a NaN or an infinity.
//!
//! Faults are injected with `RunOptions::faults` (a huge learning rate is refused by the
//! config validation, so an exploding update is simulated): the built-in tiny Llama,
//! synthetic passkey data, CPU. Weights are compared bit for bit.

use candle_core::{DType, Device, Tensor};
use longctx::train::checkpoint;
use longctx::train::config::{RunConfig, Stage};
use longctx::train::trainer::{run_with, Fault, RunOptions};
use std::collections::HashMap;
use std::path::Path;

/// One stage of 6 steps at 32 tokens; `world` in-process data-parallel ranks.
fn config(dir: &Path, world: usize, checkpoint_every: u64) -> RunConfig {
    let mut c = RunConfig { seed: 5, output_dir: dir.to_path_buf(), ..Default::default() };
    c.train.batch_size = 2;
    c.train.learning_rate = 3e-3;
    c.train.checkpoint_every = checkpoint_every;
    c.train.checkpoint_interval_min = 0.0;
    c.parallel.world_size = world;
    c.parallel.token_chunk = 32;
    c.stages = vec![Stage::new(32, 1e4, 6)];
    if let Err(e) = c.validate(Path::new("<test>")) {
        panic!("test config: {e}");
    }
    c
}

fn opts(stop: Option<u64>, faults: Vec<Fault>) -> RunOptions {
    RunOptions { stop_at_global_step: stop, faults, ..Default::default() }
}

fn load(path: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(path, &Device::Cpu).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn bits(t: &Tensor) -> Vec<u32> {
    t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap().into_iter().map(f32::to_bits).collect()
}

fn state(dir: &Path) -> serde_json::Value {
    let p = dir.join("checkpoint/state.json");
    serde_json::from_str(&std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))).unwrap()
}

/// Every tensor of every safetensors file of a checkpoint or export holds finite values.
fn assert_all_finite(dir: &Path) {
    let mut files = 0;
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            files += 1;
            for (n, t) in load(&p) {
                let v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
                assert!(v.iter().all(|x| x.is_finite()), "{}: `{n}` holds a non-finite value", p.display());
            }
        }
    }
    assert!(files > 0, "no safetensors file in {}", dir.display());
}

fn metrics(dir: &Path) -> Vec<serde_json::Value> {
    let text = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    text.lines().map(|l| serde_json::from_str(l).unwrap()).filter(|v: &serde_json::Value| v.get("loss").is_some()).collect()
}

/// Two data-parallel ranks; only rank 1's gradient is NaN at step 3. Both ranks skip the
/// update (the weights after step 3 are those after step 2, bit for bit: had one rank
/// updated its optimizer shard, the gathered weights would differ), the AdamW step count
/// stays at 2, and the data of step 3 is consumed (the cursor equals a clean run's after 3
/// steps). The metrics mark the step, and the run then goes on to the end.
#[test]
fn a_non_finite_gradient_norm_skips_the_update_on_every_rank() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let at2 = tmp.path().join("clean-2");
    let at3 = tmp.path().join("clean-3");
    let faulty = tmp.path().join("faulty");
    run_with(&config(&at2, 2, 1), false, &opts(Some(2), vec![]))?;
    run_with(&config(&at3, 2, 1), false, &opts(Some(3), vec![]))?;
    let nan3 = vec![Fault::NanGradient { rank: 1, first: 3, last: 3 }];
    let s = run_with(&config(&faulty, 2, 1), false, &opts(Some(3), nan3.clone()))?;
    assert_eq!((s.steps, s.skipped_steps), (3, 1));
    let (w2, wf) = (load(&at2.join("checkpoint/model.safetensors")), load(&faulty.join("checkpoint/model.safetensors")));
    for (n, t) in &w2 {
        assert_eq!(bits(t), bits(&wf[n]), "`{n}`: the skipped update changed the weights");
    }
    let (st3, stf) = (state(&at3), state(&faulty));
    assert_eq!(stf["adam_step"], 2, "the skipped step did not count as an AdamW step");
    assert_eq!(stf["global_step"], 3);
    assert_eq!((stf["skipped_steps"].as_u64(), stf["skipped_in_row"].as_u64()), (Some(1), Some(1)));
    assert_eq!(stf["data"], st3["data"], "the skipped step's data was consumed like a clean step's");
    let m = metrics(&faulty);
    assert_eq!(m[2]["skipped"], true, "{}", m[2]);
    assert!(m[2]["grad_norm"].is_null(), "a NaN norm is logged as null: {}", m[2]);
    assert_eq!((m[1]["skipped"].as_bool(), m[2]["skipped_steps"].as_u64()), (Some(false), Some(1)));
    // The same run to its end: it completes, exports finite weights, counts one skip.
    let full = tmp.path().join("full");
    let s = run_with(&config(&full, 2, 0), false, &opts(None, nan3))?;
    assert!(s.completed && s.skipped_steps == 1);
    assert_all_finite(&full.join("export"));
    assert_eq!(metrics(&full).last().map(|l| l["skipped_steps"].clone()), Some(1.into()));
    Ok(())
}

/// Rank 0's loss of step 2 is NaN (its gradients finite): the all-reduced loss is NaN on
/// both ranks, both skip the update (the weights after step 2 are those after step 1),
/// the metrics log the NaN loss as null and the step as skipped.
#[test]
fn a_non_finite_loss_skips_the_update_on_every_rank() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let (at1, faulty) = (tmp.path().join("clean-1"), tmp.path().join("faulty"));
    run_with(&config(&at1, 2, 1), false, &opts(Some(1), vec![]))?;
    let s = run_with(&config(&faulty, 2, 1), false, &opts(Some(2), vec![Fault::NanLoss { rank: 0, step: 2 }]))?;
    assert_eq!(s.skipped_steps, 1);
    let (w1, wf) = (load(&at1.join("checkpoint/model.safetensors")), load(&faulty.join("checkpoint/model.safetensors")));
    for (n, t) in &w1 {
        assert_eq!(bits(t), bits(&wf[n]), "`{n}`: the skipped update changed the weights");
    }
    let m = metrics(&faulty);
    assert!(m[1]["loss"].is_null() && m[1]["skipped"] == true, "{}", m[1]);
    assert_eq!(state(&faulty)["adam_step"], 1);
    Ok(())
}

/// From step 4 on every gradient is NaN; `max_skipped_steps = 3`: steps 4, 5, 6 are
/// skipped and step 6 aborts. The checkpoint of step 4 (written by `checkpoint_every = 2`
/// while the weights were still those of step 3) stays, finite; nothing is exported.
#[test]
fn non_finite_steps_in_a_row_abort_keeping_the_last_good_checkpoint() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let mut c = config(tmp.path(), 1, 2);
    c.train.max_skipped_steps = 3;
    let e = match run_with(&c, false, &opts(None, vec![Fault::NanGradient { rank: 0, first: 4, last: 100 }])) {
        Ok(_) => panic!("the run went on through 3 non-finite steps"),
        Err(e) => e.to_string(),
    };
    for needle in ["3 optimizer steps in a row", "train.max_skipped_steps = 3", "last good checkpoint", "after global step 4", "--resume"] {
        assert!(e.contains(needle), "`{needle}` missing from: {e}");
    }
    let st = state(tmp.path());
    assert_eq!((st["global_step"].as_u64(), st["adam_step"].as_u64(), st["skipped_in_row"].as_u64()), (Some(4), Some(3), Some(1)));
    assert_all_finite(&tmp.path().join("checkpoint"));
    assert!(!tmp.path().join("export").exists(), "an aborted run exports nothing");
    Ok(())
}

/// The update of step 3 leaves NaN weights (an exploding update) with `checkpoint_every =
/// 1`, on two ranks: the run aborts on both before writing; the checkpoint of step 2 is
/// the one on disk, every tensor of it (weights and optimizer shards) finite; no export.
/// Without step checkpoints but with a time-based interval that is always due, the same:
/// the time-based checkpoint of step 2 stands.
#[test]
fn an_update_that_explodes_writes_nothing_non_finite() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    for (name, every, minutes) in [("every-step", 1, 0.0), ("by-time", 0, 1e-9)] {
        let dir = tmp.path().join(name);
        let mut c = config(&dir, 2, every);
        c.train.checkpoint_interval_min = minutes;
        let e = match run_with(&c, false, &opts(None, vec![Fault::NanWeights { step: 3 }])) {
            Ok(_) => panic!("{name}: the run went on with NaN weights"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("made the weights non-finite") && e.contains("nothing was written"), "{name}: {e}");
        assert!(e.contains("after global step 2"), "{name}: {e}");
        assert_eq!(state(&dir)["global_step"], 2, "{name}");
        assert_all_finite(&dir.join("checkpoint"));
        assert!(!dir.join("export").exists(), "{name}");
    }
    // Neither step nor time checkpoints: the message says that nothing was kept.
    let dir = tmp.path().join("none");
    let e = run_with(&config(&dir, 1, 0), false, &opts(None, vec![Fault::NanWeights { step: 2 }])).err().map(|e| e.to_string());
    assert!(e.as_deref().is_some_and(|e| e.contains("no checkpoint was written yet")), "{e:?}");
    assert!(!dir.join("checkpoint").exists());
    Ok(())
}

/// The last lines of defence in the library: `checkpoint::finish` refuses NaN weights
/// (the previous checkpoint stays, byte for byte), `write_shard` a NaN moment, and an
/// export a NaN weight or an f32 weight that overflows f16 (nothing is created).
#[test]
fn checkpoint_and_export_writers_refuse_non_finite_values() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let out = tmp.path().join("run");
    run_with(&config(&out, 1, 0), false, &opts(Some(2), vec![]))?;
    let before = std::fs::read(out.join("checkpoint/model.safetensors")).map_err(|e| longctx::Error::io(&out, e))?;
    let st = checkpoint::read_state(&out.join("checkpoint"))?;
    let tmpdir = checkpoint::begin(&out)?;
    let good = [0.5f32; 4];
    checkpoint::write_shard(&tmpdir, 0, &checkpoint::OptimShard { master: &good, m: &good, v: &good })?;
    let bad = [0.5f32, f32::NAN, 0.0, 1.0];
    let e = checkpoint::write_shard(&tmpdir, 1, &checkpoint::OptimShard { master: &good, m: &good, v: &bad }).unwrap_err().to_string();
    assert!(e.contains("second moment 1") && e.contains("not finite"), "{e}");
    let nan = Tensor::new(&[1.0f32, f32::NAN], &Device::Cpu)?;
    let weights: HashMap<String, Tensor> = [("w".to_string(), nan.clone())].into();
    let e = checkpoint::finish(&out, &weights, &st).unwrap_err().to_string();
    assert!(e.contains("`w`") && e.contains("previous checkpoint is kept"), "{e}");
    let after = std::fs::read(out.join("checkpoint/model.safetensors")).map_err(|e| longctx::Error::io(&out, e))?;
    assert!(before == after, "the previous checkpoint changed");

    let cfg = serde_json::json!({"model_type": "llama"});
    let target = tmp.path().join("export");
    let e = longctx::hub::export(&target, &[("w".into(), nan)], &cfg, None, &Default::default()).unwrap_err().to_string();
    assert!(e.contains("not exported") && e.contains("`w`"), "{e}");
    let big = Tensor::new(&[1e5f32, 1.0], &Device::Cpu)?;
    let f16 = longctx::hub::ExportOptions { dtype: Some(DType::F16), ..Default::default() };
    let e = longctx::hub::export(&target, &[("w".into(), big.clone())], &cfg, None, &f16).unwrap_err().to_string();
    assert!(e.contains("once converted to F16"), "{e}");
    assert!(!target.exists(), "a refused export creates nothing");
    longctx::hub::export(&target, &[("w".into(), big)], &cfg, None, &Default::default())?;
    Ok(())
}

/// The same guards under ZeRO-3 with the weights in host memory (each rank holds only its
/// slice), also with the gradients there: a NaN gradient on one rank skips the update on both (the weights after the
/// skipped step equal those before it), and NaN weights after an update abort the run
/// before anything non-finite is written.
#[test]
fn the_guards_hold_under_zero_3_with_offloaded_weights() -> longctx::Result<()> {
    // With the optimizer state on the device, the update is applied at once and guarded
    // after the step; with it on the host too, the update is deferred into the next
    // step's forward and guarded when it is settled (here: before the checkpoint); and so
    // with the gradients in host memory too (`offload_gradients`: the NaN reaches the norm
    // through the units' sums of squares).
    for (optimizer_on_host, offload_gradients) in [(false, false), (true, false), (true, true)] {
        let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
        let zero3 = |dir: &Path, every: u64| {
            let mut c = config(dir, 2, every);
            c.train.zero_stage = 3;
            c.train.offload_params = true;
            c.train.optimizer_on_host = optimizer_on_host;
            c.train.offload_gradients = offload_gradients;
            c
        };
        let (at2, faulty) = (tmp.path().join("z3-clean-2"), tmp.path().join("z3-faulty"));
        run_with(&zero3(&at2, 1), false, &opts(Some(2), vec![]))?;
        let s = run_with(&zero3(&faulty, 1), false, &opts(Some(3), vec![Fault::NanGradient { rank: 1, first: 3, last: 3 }]))?;
        assert_eq!((s.steps, s.skipped_steps), (3, 1));
        let (w2, wf) = (load(&at2.join("checkpoint/model.safetensors")), load(&faulty.join("checkpoint/model.safetensors")));
        for (n, t) in &w2 {
            assert_eq!(bits(t), bits(&wf[n]), "`{n}`: the skipped update changed the weights (optimizer on host: {optimizer_on_host})");
        }
        // NaN weights after update 3: with checkpoints every step and every 2 steps (the
        // deferred update is then guarded in step 4's forward, not by a checkpoint).
        for every in [1, 2] {
            let dir = tmp.path().join(format!("z3-nan-weights-{every}"));
            let e = match run_with(&zero3(&dir, every), false, &opts(None, vec![Fault::NanWeights { step: 3 }])) {
                Ok(_) => panic!("the run went on with NaN weights (optimizer on host: {optimizer_on_host})"),
                Err(e) => e.to_string(),
            };
            assert!(e.contains("made the weights non-finite") && e.contains("slice of the weights (ZeRO-3)"), "{e}");
            assert!(e.contains("global step 3"), "the message names the update: {e}");
            assert_eq!(state(&dir)["global_step"], 2);
            assert_all_finite(&dir.join("checkpoint"));
            assert!(!dir.join("export").exists());
        }
    }
    Ok(())
}

/// A skipped step and the steps after it, under ZeRO-3 with weights and optimizer on the
/// host, two ranks, two micro-batches a step: with the gradients in host memory the run
/// goes on exactly as with them on the device (no slice of the skipped step is added to
/// the next one's, no stale sum of squares enters its norm). Same steps, same skip, the
/// same final weights within 1e-5 of their scale (the norm's sums are ordered differently)
/// and the same logged losses and gradient norms within 1e-5.
#[test]
fn a_skipped_step_leaves_nothing_behind_with_the_gradients_on_the_host() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let run = |grads: bool| {
        let dir = tmp.path().join(format!("grads-on-host-{grads}"));
        let mut c = config(&dir, 2, 0);
        (c.train.zero_stage, c.train.offload_params, c.train.optimizer_on_host, c.train.offload_gradients) = (3, true, true, grads);
        c.train.batch_size = 1;
        c.train.gradient_accumulate_every = 2;
        let s = run_with(&c, false, &opts(None, vec![Fault::NanGradient { rank: 0, first: 3, last: 3 }]))
            .unwrap_or_else(|e| panic!("offload_gradients {grads}: {e}"));
        assert_eq!((s.steps, s.skipped_steps), (6, 1), "offload_gradients {grads}");
        dir
    };
    let (device, host) = (run(false), run(true));
    let (a, b) = (load(&host.join("export/model.safetensors")), load(&device.join("export/model.safetensors")));
    assert_eq!(a.len(), b.len());
    let f32s = |t: &Tensor| t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for (n, t) in &b {
        let (x, y) = (f32s(&a[n]), f32s(t));
        let scale = y.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-30);
        let diff = x.iter().zip(&y).fold(0f32, |m, (p, q)| m.max((p - q).abs()));
        assert!(diff / scale <= 1e-5, "`{n}`: {diff:e} apart (scale {scale:e})");
    }
    let logged = |dir: &Path| -> Vec<(f64, f64)> {
        std::fs::read_to_string(dir.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
            .filter_map(|v| Some((v.get("loss")?.as_f64()?, v.get("grad_norm").and_then(|g| g.as_f64()).unwrap_or(f64::NAN))))
            .collect()
    };
    let (h, d) = (logged(&host), logged(&device));
    assert_eq!(h.len(), d.len());
    assert!(h.len() >= 6, "{h:?}");
    for (i, ((lh, gh), (ld, gd))) in h.iter().zip(&d).enumerate() {
        assert!((lh - ld).abs() <= 1e-5 * ld.abs(), "line {i}: loss {lh} against {ld}");
        assert!(gh.is_nan() == gd.is_nan() && (gh.is_nan() || (gh - gd).abs() <= 1e-5 * gd.abs()), "line {i}: norm {gh} against {gd}");
    }
    Ok(())
}

/// A checkpoint damaged after it was written (issue #33): a NaN weight, a NaN master
/// weight or a negative second moment in an optimizer shard is refused at resume, naming
/// the file and the value, as damage rather than a divergence (no "lower the learning
/// rate", no "last good checkpoint"). Finite weights that overflow in the forward pass
/// (every tensor × 1e15) abort after `max_skipped_steps` saying that no update was
/// applied, so the learning rate is not the cause, and name the checkpoint resumed from
/// instead of calling it the last good one.
#[test]
fn a_damaged_checkpoint_is_named_not_blamed_on_the_learning_rate() -> longctx::Result<()> {
    let tmp = tempfile::tempdir().map_err(|e| longctx::Error::io("<tempdir>", e))?;
    let mut c = config(tmp.path(), 1, 2);
    c.train.max_skipped_steps = 2;
    run_with(&c, false, &opts(Some(2), vec![]))?;
    let ck = tmp.path().join("checkpoint");
    let (mp, sp) = (ck.join("model.safetensors"), ck.join("optimizer-shard0.safetensors"));
    let (weights, shard) = (std::fs::read(&mp).unwrap(), std::fs::read(&sp).unwrap());
    let resume_err = || match run_with(&c, true, &opts(None, vec![])) {
        Ok(_) => panic!("the resume of a damaged checkpoint ran to the end"),
        Err(e) => e.to_string(),
    };
    let set = |path: &Path, name: &str, at: usize, x: f32| {
        let mut w = load(path);
        let t = &w[name];
        let mut v = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        v[at] = x;
        let new = Tensor::from_vec(v, t.shape(), &Device::Cpu).unwrap().to_dtype(t.dtype()).unwrap();
        w.insert(name.to_string(), new);
        candle_core::safetensors::save(&w, path).unwrap();
    };
    let cases: [(&Path, &str, f32, &[&str]); 3] = [
        (&mp, "model.layers.0.mlp.up_proj.weight", f32::NAN, &["model.safetensors", "tensor `model.layers.0.mlp.up_proj.weight`"]),
        (&sp, "master", f32::NAN, &["optimizer-shard0.safetensors", "element 5 of the optimizer's `master` is NaN"]),
        (&sp, "v", -1.0, &["optimizer-shard0.safetensors", "element 5 of the optimizer's `v` is -1"]),
    ];
    for (path, name, x, needles) in cases {
        set(path, name, 5, x);
        let e = resume_err();
        for n in needles.iter().chain(&["cannot resume", "damaged or altered after it was written", "intact copy"]) {
            assert!(e.contains(n), "`{n}` missing from: {e}");
        }
        assert!(!e.contains("learning rate") && !e.contains("last good checkpoint"), "{e}");
        std::fs::write(&mp, &weights).unwrap();
        std::fs::write(&sp, &shard).unwrap();
    }
    // Finite but overflowing weights: every step skipped, then the abort.
    let huge: HashMap<String, Tensor> = load(&mp).into_iter().map(|(n, t)| (n, t.affine(1e15, 0.0).unwrap())).collect();
    candle_core::safetensors::save(&huge, &mp).unwrap();
    let e = resume_err();
    for n in ["2 optimizer steps in a row", "no update was applied since this run started", "the learning rate is not the cause"] {
        assert!(e.contains(n), "`{n}` missing from: {e}");
    }
    assert!(e.contains("the checkpoint this run resumed") && e.contains(&ck.display().to_string()), "{e}");
    assert!(!e.contains("last good checkpoint") && !e.contains("lower the learning rate"), "{e}");
    Ok(())
}
