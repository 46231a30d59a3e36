//! Documents packing through the binary, in the shape users run it: `longctx train
//! --packing documents` on a jsonl of pre-tokenized documents (lengths 1 to 90, so
//! documents of 1–3 tokens and documents longer than the sample, split), one process on
//! one device against `longctx launch` processes in zigzag ring, FPDT and USP. Every
//! step's loss and gradient norm agree within 1e-5 relative (f32; the modes reorder
//! sums); the same data concatenated (no document mask) gives other losses.

use std::path::Path;
use std::process::Command;

use crate::common;

const TOL: f64 = 1e-5;

fn write_docs(path: &Path) {
    let lens = [1usize, 2, 3, 40, 7, 90, 1, 12, 33, 5, 64, 2, 70, 9, 3, 28, 50, 1, 45, 11, 6, 80, 15, 2, 37];
    let mut out = String::new();
    let mut x = 7u64;
    for _ in 0..4 {
        for &l in &lens {
            let ids: Vec<u64> = (0..l)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    3 + (x >> 33) % 250
                })
                .collect();
            out.push_str(&serde_json::json!({ "input_ids": ids }).to_string());
            out.push('\n');
        }
    }
    std::fs::write(path, out).unwrap();
}

fn args(data: &Path, out: &Path, packing: &str, mode: &str, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = [
        "train",
        "--model",
        "builtin:tiny",
        "--dataset",
        data.to_str().unwrap(),
        "--packing",
        packing,
        "--seq-length",
        "64",
        "--rope-theta",
        "1e5",
        "--max-train-steps",
        "3",
        "--batch-size",
        "2",
        "--learning-rate",
        "3e-3",
        "--device",
        "cpu",
        "--token-chunk",
        "24",
        "--parallel-mode",
        mode,
        "--output-dir",
        out.to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect();
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

fn run(mut c: Command, what: &str) {
    let o = c.output().expect("run longctx");
    assert!(o.status.success(), "{what}: {}\n{}", String::from_utf8_lossy(&o.stdout), String::from_utf8_lossy(&o.stderr));
}

fn one(data: &Path, out: &Path, packing: &str) -> Vec<(f64, f64)> {
    let mut c = common::longctx_cmd(&[]);
    c.args(args(data, out, packing, "data_parallel", &[]));
    run(c, "one process");
    steps(out)
}

fn launched(data: &Path, out: &Path, n: usize, mode: &str, extra: &[&str]) -> Vec<(f64, f64)> {
    let mut c = common::longctx_cmd(&["launch", "--nproc-per-node", &n.to_string(), "--master-port", "0", "--"]);
    c.args(args(data, out, "documents", mode, extra));
    run(c, mode);
    steps(out)
}

/// (loss, grad_norm) of every step.
fn steps(dir: &Path) -> Vec<(f64, f64)> {
    std::fs::read_to_string(dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter(|v| v.get("loss").is_some())
        .map(|v| (v["loss"].as_f64().unwrap(), v["grad_norm"].as_f64().unwrap()))
        .collect()
}

fn rel(a: f64, b: f64) -> f64 {
    (a - b).abs() / b.abs().max(1e-30)
}

#[test]
fn launched_modes_train_packed_documents_as_one_device_does() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("docs.jsonl");
    write_docs(&data);
    let want = one(&data, &tmp.path().join("one"), "documents");
    assert_eq!(want.len(), 3);
    for (n, mode, extra) in [
        (2, "zigzag_ring_attn", &[][..]),
        (2, "fpdt", &["--fpdt-chunk-size", "16", "--fpdt-offload"][..]),
        (4, "usp", &["--ulysses-size", "2"][..]),
    ] {
        let got = launched(&data, &tmp.path().join(mode), n, mode, extra);
        assert_eq!(got.len(), want.len(), "{mode}");
        for (i, ((lg, ng), (lw, nw))) in got.iter().zip(&want).enumerate() {
            assert!(rel(*lg, *lw) <= TOL && rel(*ng, *nw) <= TOL, "{mode} x{n} step {i}: loss {lg} vs {lw}, grad norm {ng} vs {nw}");
        }
    }
    let concat = one(&data, &tmp.path().join("concat"), "concat");
    assert!(rel(concat[0].0, want[0].0) > 1e-3, "concat {} vs documents {}: the mask must matter", concat[0].0, want[0].0);
}

/// The dry run reports the documents per sample and the attention work.
#[test]
fn dry_run_reports_documents_per_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("docs.jsonl");
    write_docs(&data);
    let mut a = args(&data, &tmp.path().join("o"), "documents", "data_parallel", &[]);
    a.push("--dry-run".into());
    let o = common::run(&a.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.code, 0, "{}", o.stderr);
    let all = format!("{}{}", o.stdout, o.stderr);
    assert!(all.contains("documents per sample"), "{all}");
}

/// The trainer really runs under the document mask: the first step's loss of a run (no
/// shuffle, one sample) equals the mean loss of that sample's documents, each run alone
/// through the engine from the same initial weights (no document code in the reference).
#[test]
fn the_first_step_loss_is_that_of_the_documents_alone() {
    use candle_core::{DType, Device, Tensor};
    use longctx::data::loader::{Loader, Shard};
    use longctx::train::engine::{Engine, EngineOptions};
    use longctx_attention::{local::LocalAttention, AttentionMode};
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("docs.jsonl");
    write_docs(&data);
    let toml = tmp.path().join("run.toml");
    std::fs::write(&toml, "[data]\nshuffle_buffer = 0\n").unwrap();
    let out = tmp.path().join("o");
    let mut a =
        args(&data, &out, "documents", "zigzag_ring_attn", &["--config", toml.to_str().unwrap(), "--world-size", "2", "--seed", "3"]);
    set(&mut a, "--batch-size", "1");
    set(&mut a, "--max-train-steps", "1");
    let dry: Vec<String> = a.iter().cloned().chain(["--dry-run".to_string()]).collect();
    let o = common::run(&dry.iter().map(String::as_str).collect::<Vec<_>>());
    assert_eq!(o.code, 0, "{}", o.stderr);
    let cfg: longctx::train::RunConfig = toml::from_str(&o.stdout).unwrap();
    let mut c = common::longctx_cmd(&[]);
    c.args(&a);
    run(c, "train");
    let got = steps(&out)[0].0;

    let mut mcfg = longctx::train::init::builtin_config("tiny").unwrap();
    mcfg.rope_theta = cfg.stages[0].rope_theta; // the stage's θ, as the trainer sets it
    let spec = longctx::train::trainer::stage_data_spec(&cfg, &mcfg, &cfg.stage_settings(0)).unwrap();
    let batch = Loader::new(&spec, None, Shard { rank: 0, world: 1 }).unwrap().next_batch(1).unwrap().unwrap();
    let starts = &batch.doc_starts[0];
    assert!(starts.len() >= 4, "the first sample packs several documents: {starts:?}");
    let w = longctx::train::init::random_init(&mcfg, cfg.seed, DType::F32, &Device::Cpu).unwrap();
    let eng = Engine::from_vars(&mcfg, &longctx::train::init::to_vars(w).unwrap(), EngineOptions { token_chunk: 24, ..Default::default() })
        .unwrap();
    let attn: std::sync::Arc<dyn AttentionMode> = std::sync::Arc::new(LocalAttention);
    let s = batch.seq_len;
    let n = batch.targets.iter().filter(|&&t| t >= 0).count();
    let mut sum = 0.0;
    for (i, &a0) in starts.iter().enumerate() {
        let (a0, b0) = (a0 as usize, starts.get(i + 1).map_or(s, |&x| x as usize));
        let l = b0 - a0;
        let x = Tensor::from_slice(&batch.ids[a0..b0], (1, l), &Device::Cpu).unwrap();
        let y = Tensor::from_slice(&batch.targets[a0..b0], (1, l), &Device::Cpu).unwrap();
        let pos = Tensor::arange(0u32, l as u32, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
        sum += eng.step(&x, &y, &pos, l, &attn, 1.0).unwrap().loss_sum;
    }
    let want = sum / n as f64;
    assert!(rel(got, want) <= TOL, "first step loss {got} vs the documents alone {want}");
    // metrics.jsonl reports the attention work under the mask (what MFU counts).
    let line: serde_json::Value =
        serde_json::from_str(std::fs::read_to_string(out.join("metrics.jsonl")).unwrap().lines().find(|l| l.contains("\"loss\"")).unwrap())
            .unwrap();
    let docs = longctx_attention::Docs::new(vec![starts.iter().map(|&x| x as usize).collect()], s).unwrap();
    let work = line["attention_work"].as_f64().unwrap();
    assert!((work - docs.work_fraction()).abs() < 1e-12 && work < 0.5, "attention_work {work} vs {}", docs.work_fraction());
}

fn set(args: &mut [String], flag: &str, value: &str) {
    let i = args.iter().position(|x| x == flag).unwrap();
    args[i + 1] = value.into();
}
