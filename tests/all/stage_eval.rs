//! Evaluation during training (`[eval]`, src/train/stage_eval.rs): the lines appear at
//! every stage end and every `eval.every` steps, hold perplexity at the right lengths and
//! a passkey grid, reach TensorBoard and eval.png; a stopped and resumed run logs the same
//! lines as an uninterrupted one (no line lost, none twice); a length of `eval.lengths`
//! beyond a stage's waits for the stage that trains that long; the same model evaluated
//! through two zigzag ranks or two data-parallel replicas scores what one device scores
//! (f32, 1e-5 relative); the perplexity equals one computed here from the exported
//! model's per-token losses; bad `[eval]` values are refused naming the field.
//!
//! Runs: built-in tiny Llama, passkey data, two stages (32 tokens θ 1e4 × 4 steps, then
//! 64 tokens θ 1e5 × 4 steps), checkpoints every step, CPU.

use longctx::eval::ppl::Method;
use longctx::parallel::dims::ParallelMode;
use longctx::train::config::{RunConfig, Stage};
use longctx::train::stage_eval::{read_lines, EvalLine, EvalSection};
use longctx::train::trainer::{run, run_with, RunOptions};
use std::path::{Path, PathBuf};

/// Relative tolerance of perplexities across layouts of the same run (f32).
const TOL: f64 = 1e-5;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("longctx-stage-eval-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

fn config(dir: &Path, world: usize, mode: ParallelMode, accumulate: usize) -> RunConfig {
    let mut c = RunConfig { seed: 7, output_dir: dir.to_path_buf(), ..RunConfig::default() };
    c.data.dataset = "synthetic:passkey".into();
    c.train.batch_size = 2;
    c.train.gradient_accumulate_every = accumulate;
    c.train.learning_rate = 3e-3;
    c.train.checkpoint_every = 1;
    c.train.tensorboard = true;
    c.parallel.token_chunk = 24;
    c.parallel.world_size = world;
    c.parallel.mode = mode;
    c.stages = vec![Stage::new(32, 1e4, 4), Stage::new(64, 1e5, 4)];
    c.eval = EvalSection {
        dataset: "synthetic:passkey".into(),
        every: 3,
        lengths: vec![16, 64],
        tokens: 256,
        passkey_trials: 2,
        passkey_depths: vec![0.0, 0.5],
        ..EvalSection::default()
    };
    c.validate(Path::new("<test>")).unwrap();
    c
}

/// The lines without their timing (everything else must agree exactly).
fn untimed(mut lines: Vec<EvalLine>) -> Vec<EvalLine> {
    lines.iter_mut().for_each(|l| l.seconds = 0.0);
    lines
}

#[test]
fn lines_at_stage_ends_and_every_n_steps_with_tensorboard_and_plot() {
    let dir = tmp("lines");
    let cfg = config(&dir, 1, ParallelMode::DataParallel, 1);
    run(&cfg, false).unwrap();
    let lines = read_lines(&dir.join("metrics.jsonl")).unwrap();
    let at: Vec<(usize, u64, u64, bool)> = lines.iter().map(|l| (l.stage, l.step, l.global_step, l.stage_end)).collect();
    // every 3 global steps (3, 6) and at the stage ends (4, 8)
    assert_eq!(at, vec![(0, 3, 3, false), (0, 4, 4, true), (1, 2, 6, false), (1, 4, 8, true)]);
    for l in &lines {
        assert_eq!(l.event, "eval");
        // eval.lengths beyond the stage's own wait for the stage that trains that long
        let lengths = if l.stage == 0 { vec![16] } else { vec![16, 64] };
        assert_eq!(l.ppl.iter().map(|p| p.length).collect::<Vec<_>>(), lengths);
        for p in &l.ppl {
            // the same 256 tokens (255 targets) at every length: sliding windows over one stream
            assert_eq!(p.tokens, 255, "{p:?}");
            assert!(p.ppl.is_some_and(|v| v.is_finite() && v > 1.0), "{p:?}");
        }
        assert_eq!(l.passkey.len(), 2 * lengths.len(), "lengths × 2 depths");
        assert!(l.passkey.iter().all(|c| c.trials == 2 && c.right <= 2));
        assert!(l.passkey_rate.is_some());
        assert_eq!(l.rope_theta, if l.stage == 0 { 1e4 } else { 1e5 });
    }
    // training lowers the held-out loss: the last model beats the first evaluated one
    let first = lines[0].ppl[0].ppl.unwrap();
    let last = lines[3].ppl[0].ppl.unwrap();
    assert!(last < first, "ppl at 16 tokens: {first} -> {last}");
    // TensorBoard got the scalars, eval.png is a real PNG
    let tb = std::fs::read_dir(dir.join("tensorboard")).unwrap().next().unwrap().unwrap().path();
    let bytes = std::fs::read(tb).unwrap();
    for tag in ["eval/ppl@16", "eval/ppl@64", "eval/passkey@16"] {
        assert!(bytes.windows(tag.len()).any(|w| w == tag.as_bytes()), "TensorBoard tag {tag}");
    }
    let png = std::fs::read(dir.join("eval.png")).unwrap();
    assert_eq!(&png[1..4], b"PNG");
    let (w, h) = (u32::from_be_bytes(png[16..20].try_into().unwrap()), u32::from_be_bytes(png[20..24].try_into().unwrap()));
    assert!(w >= 400 && h >= 300, "{w}x{h}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_resumed_run_logs_every_evaluation_once() {
    let whole = tmp("whole");
    run(&config(&whole, 1, ParallelMode::DataParallel, 1), false).unwrap();
    let want = untimed(read_lines(&whole.join("metrics.jsonl")).unwrap());
    // stops right after an evaluation (3, and the stage end 4) and between two (5)
    for stop in [3u64, 4, 5] {
        let dir = tmp(&format!("stop{stop}"));
        let cfg = config(&dir, 1, ParallelMode::DataParallel, 1);
        let s = run_with(&cfg, false, &RunOptions { stop_at_global_step: Some(stop), ..Default::default() }).unwrap();
        assert!(!s.completed);
        run(&cfg, true).unwrap();
        let got = untimed(read_lines(&dir.join("metrics.jsonl")).unwrap());
        assert_eq!(got, want, "stopped at global step {stop}, then resumed");
        let _ = std::fs::remove_dir_all(&dir);
    }
    let _ = std::fs::remove_dir_all(&whole);
}

/// Perplexities of two runs' lines, within [`TOL`] relative, and the same passkey cells.
fn assert_close(a: &[EvalLine], b: &[EvalLine], what: &str) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        assert_eq!((x.stage, x.global_step), (y.stage, y.global_step), "{what}");
        for (p, q) in x.ppl.iter().zip(&y.ppl) {
            assert_eq!((p.length, p.tokens), (q.length, q.tokens), "{what}");
            let (p, q) = (p.ppl.unwrap(), q.ppl.unwrap());
            assert!((p - q).abs() <= TOL * q, "{what}: ppl {p} vs {q} at global step {}", x.global_step);
        }
        assert_eq!(x.passkey, y.passkey, "{what}: passkey cells");
    }
}

#[test]
fn zigzag_ranks_and_data_parallel_replicas_score_what_one_device_scores() {
    // two zigzag ranks train and evaluate what one device does (same samples per step)
    let (one, ring) = (tmp("one"), tmp("ring"));
    run(&config(&one, 1, ParallelMode::DataParallel, 1), false).unwrap();
    run(&config(&ring, 2, ParallelMode::ZigzagRingAttn, 1), false).unwrap();
    let reference = read_lines(&one.join("metrics.jsonl")).unwrap();
    assert_close(&read_lines(&ring.join("metrics.jsonl")).unwrap(), &reference, "zigzag 2 ranks vs one device");
    // two replicas split the windows and cases: against one device accumulating twice
    let (acc, dp) = (tmp("acc"), tmp("dp"));
    run(&config(&acc, 1, ParallelMode::DataParallel, 2), false).unwrap();
    run(&config(&dp, 2, ParallelMode::DataParallel, 1), false).unwrap();
    assert_close(
        &read_lines(&dp.join("metrics.jsonl")).unwrap(),
        &read_lines(&acc.join("metrics.jsonl")).unwrap(),
        "data parallel 2 vs one device × accumulate 2",
    );
    for d in [one, ring, acc, dp] {
        let _ = std::fs::remove_dir_all(&d);
    }
}

#[test]
fn the_last_line_is_the_exported_models_perplexity() {
    use longctx::eval::forward::Ranks;
    use longctx::eval::model::EvalModel;
    use longctx::eval::ppl::{read_docs, score_windows, sliding_windows, DocSource};
    let dir = tmp("export");
    let mut cfg = config(&dir, 1, ParallelMode::DataParallel, 1);
    cfg.eval.every = 0;
    cfg.eval.passkey_trials = 0;
    run(&cfg, false).unwrap();
    let lines = read_lines(&dir.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.len(), 2, "stage ends only");
    assert!(lines.iter().all(|l| l.passkey.is_empty() && l.passkey_rate.is_none()));
    // the exported model scored here through the public eval pieces, on the same stream
    let m = EvalModel::load(
        &dir.join("export").display().to_string(),
        &candle_core::Device::Cpu,
        candle_core::DType::F32,
        &longctx::hub::HubOptions::from_env(),
    )
    .unwrap();
    let src = DocSource {
        dataset: "synthetic:passkey".into(),
        column: None,
        split: "*".into(),
        token_width: longctx::data::source::TokenWidth::U16,
        max_tokens: 257,
        max_docs: usize::MAX,
        seed: cfg.seed ^ 0x5eed_e7a1,
    };
    let docs = read_docs(&src, &m.model, None, 64).unwrap();
    let stream: Vec<u32> = docs.iter().flatten().copied().take(257).collect();
    for p in &lines[1].ppl {
        let (sum, n) = score_windows(&Ranks::single(24), &m.model, &sliding_windows(&stream, p.length, p.length, 256), || {}).unwrap();
        let want = (sum / n as f64).exp();
        let got = p.ppl.unwrap();
        // the export holds the same f32 weights (config.json θ: the last stage's)
        assert!((got - want).abs() <= TOL * want, "length {}: logged {got}, export {want}", p.length);
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn bad_eval_settings_are_refused_naming_the_field() {
    let dir = tmp("bad");
    let base = config(&dir, 1, ParallelMode::DataParallel, 1);
    type Edit = Box<dyn Fn(&mut EvalSection)>;
    let cases: Vec<(Edit, &str)> = vec![
        (Box::new(|e| e.method = Method::Documents), "eval.method"),
        (Box::new(|e| e.passkey_depths = vec![1.5]), "eval.passkey_depths"),
        (Box::new(|e| e.lengths = vec![1]), "eval.lengths"),
        (Box::new(|e| e.lengths = vec![16, 128]), "eval.lengths"),
        (Box::new(|e| e.tokens = 1 << 40), "eval.tokens"),
        (Box::new(|e| e.max_docs = 0), "eval.max_docs"),
        (Box::new(|e| e.split = " ".into()), "eval.split"),
    ];
    for (f, field) in cases {
        let mut c = base.clone();
        f(&mut c.eval);
        let e = c.validate(Path::new("run.toml")).unwrap_err().to_string();
        assert!(e.contains(field) && e.contains("run.toml"), "{field}: {e}");
    }
    // an unknown key of the section, and a dataset that is not there (before training)
    let e = toml::from_str::<RunConfig>("[[stage]]\nseq_length = 32\nrope_theta = 1e4\nsteps = 1\n[eval]\ndatset = \"x\"\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("datset"), "{e}");
    let mut c = base.clone();
    c.eval.dataset = dir.join("missing.jsonl").display().to_string();
    let e = run(&c, false).unwrap_err().to_string();
    assert!(e.contains("eval.dataset") && e.contains("missing.jsonl"), "{e}");
    assert!(!dir.join("checkpoint").exists(), "refused before the first step");
    let _ = std::fs::remove_dir_all(&dir);
}
