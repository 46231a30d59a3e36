//! Issue #16 item 5, numbers users type: every numeric setting of the run config is
//! checked with a message naming the key, the value and the accepted range (exit status
//! 1, one `error:` line, no panic); sizes that would not fit in memory or in 64 bits are
//! refused before anything is allocated (config.json shapes, batch × length, ranks, the
//! host memory a run needs); the planner's and `inspect`'s arithmetic is checked.

use longctx::parallel::dims::ParallelMode;
use longctx::plan::{self, ModelShape, PlanRequest};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn longctx(args: &[&str]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_longctx"));
    c.args(args).env("HF_HUB_OFFLINE", "1");
    for k in ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LONGCTX_FAULT"] {
        c.env_remove(k);
    }
    c.output().expect("run longctx")
}

/// Exit status 1 and one `error:` line holding every needle; no panic.
fn refused(args: &[&str], needles: &[&str]) {
    let o = longctx(args);
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{args:?}: expected a refusal, got {:?}:\n{err}", o.status.code());
    assert!(!err.contains("panicked") && !err.contains("memory allocation"), "{args:?}: {err}");
    let line = err.lines().find(|l| l.starts_with("error:")).unwrap_or_else(|| panic!("{args:?}: no error line:\n{err}"));
    for n in needles {
        assert!(line.contains(n), "{args:?}: `{n}` missing from: {line}");
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

const STAGE: &str = "[[stage]]\nseq_length = 64\nrope_theta = 1e4\nsteps = 2\n";

#[test]
fn numeric_flags_out_of_range_are_refused_with_key_value_and_range() {
    let dry = |flags: &[&str], needles: &[&str]| {
        let mut a = vec!["train", "--dry-run"];
        a.extend_from_slice(flags);
        refused(&a, needles);
    };
    dry(&["--clip-grad", "nan"], &["train.clip_grad", "got NaN", "[0, ∞)"]);
    dry(&["--clip-grad", "-1"], &["train.clip_grad", "got -1", "[0, ∞)"]);
    dry(&["--learning-rate", "inf"], &["train.learning_rate", "got inf", "(0, 1]"]);
    dry(&["--learning-rate", "-0.001"], &["train.learning_rate", "got -0.001"]);
    dry(&["--learning-rate", "1e30"], &["train.learning_rate", "got 1000000000000000000000000000000", "(0, 1]"]);
    dry(&["--checkpoint-interval-min", "-5"], &["train.checkpoint_interval_min", "got -5"]);
    dry(&["--max-skipped-steps", "0"], &["train.max_skipped_steps", "got 0", "expected 1 to"]);
    dry(&["--batch-size", "2000000"], &["train.batch_size", "got 2000000", "expected 1 to 1048576"]);
    dry(&["--gradient-accumulate-every", "2000000"], &["train.gradient_accumulate_every", "got 2000000"]);
    dry(&["--world-size", "100000"], &["parallel.world_size", "got 100000", "expected 1 to 65536"]);
    dry(&["--seq-length", "4294967296"], &["stage[0].seq_length", "got 4294967296", "expected 1 to 2147483648"]);
    dry(&["--token-chunk", "0"], &["parallel.token_chunk", "got 0"]);
    dry(&["--batch-size", "1048576", "--seq-length", "65536"], &["train.batch_size", "tokens per micro-batch", "lower the batch size"]);
}

#[test]
fn numeric_config_keys_out_of_range_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let cases = [
        ("[train]\nmin_lr_ratio = -0.5\n", "train.min_lr_ratio", "got -0.5", "[0, 1]"),
        ("[train.adamw]\nbeta1 = 1.0\n", "train.adamw.beta1", "got 1", "[0, 1)"),
        ("[train.adamw]\nbeta2 = -0.1\n", "train.adamw.beta2", "got -0.1", "[0, 1)"),
        ("[train.adamw]\neps = 0.0\n", "train.adamw.eps", "got 0", "(0, 1]"),
        ("[train.adamw]\nweight_decay = -1.0\n", "train.adamw.weight_decay", "got -1", "[0, 1]"),
        ("[data]\nshuffle_buffer = 1000000000\n", "data.shuffle_buffer", "got 1000000000", "expected 0 to"),
        ("[export]\nmax_position_embeddings = 0\n", "export.max_position_embeddings", "got 0", "expected 1 to"),
    ];
    for (i, (text, key, got, range)) in cases.iter().enumerate() {
        let cfg = write(tmp.path(), &format!("c{i}.toml"), &format!("{text}{STAGE}"));
        refused(&["train", "--dry-run", "--config", cfg.to_str().unwrap()], &[&format!("c{i}.toml"), key, got, range]);
    }
    let cfg = write(tmp.path(), "lr.toml", &format!("{STAGE}learning_rate = nan\n"));
    refused(&["train", "--dry-run", "--config", cfg.to_str().unwrap()], &["stage[0].learning_rate", "got NaN"]);
    // Per-stage settings and the new train keys.
    let stage_cases = [
        ("batch_size = 0\n", "stage[0].batch_size", "got 0"),
        ("gradient_accumulate_every = 2000000\n", "stage[0].gradient_accumulate_every", "got 2000000"),
        ("batch_size = 1048576\n", "stage[0].batch_size", "tokens per micro-batch"),
        ("dataset = \"  \"\n", "stage[0].dataset", "is empty"),
        ("seed = -1\n", "stage[0].seed", ""),
    ];
    for (i, (text, key, got)) in stage_cases.iter().enumerate() {
        let cfg = write(tmp.path(), &format!("s{i}.toml"), &format!("[[stage]]\nseq_length = 65536\nrope_theta = 1e4\nsteps = 2\n{text}"));
        refused(&["train", "--dry-run", "--config", cfg.to_str().unwrap()], &[&format!("s{i}.toml"), key, got]);
    }
    let cfg = write(tmp.path(), "peak.toml", &format!("[train]\npeak_tflops = -3.0\n{STAGE}"));
    refused(&["train", "--dry-run", "--config", cfg.to_str().unwrap()], &["train.peak_tflops", "got -3"]);
    refused(&["train", "--dry-run", "--peak-tflops", "0"], &["train.peak_tflops", "got 0"]);
}

/// A config.json with huge sizes: `inspect`, `plan` and `train` refuse it naming the key
/// (no allocation of a parameter list, no overflow); a large but real shape is inspected.
#[test]
fn huge_model_shapes_are_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let model = |name: &str, layers: u64, hidden: u64, vocab: u64| -> PathBuf {
        let d = tmp.path().join(name);
        std::fs::create_dir_all(&d).unwrap();
        let json = serde_json::json!({
            "model_type": "llama", "hidden_size": hidden, "intermediate_size": hidden * 2, "num_hidden_layers": layers,
            "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": vocab, "max_position_embeddings": 4096,
        });
        std::fs::write(d.join("config.json"), json.to_string()).unwrap();
        d
    };
    let layers = model("layers", 1_000_000_000_000, 4096, 32000);
    let wide = model("wide", 32, 1 << 40, 32000);
    let params = model("params", 16000, 1 << 20, 32000);
    for cmd in [&["inspect", "--model"][..], &["plan", "--model"], &["train", "--max-train-steps", "1", "--model"]] {
        let on = |d: &Path, needles: &[&str]| {
            let mut a: Vec<&str> = cmd.to_vec();
            a.push(d.to_str().unwrap());
            refused(&a, needles);
        };
        on(&layers, &["config.json", "num_hidden_layers", "got 1000000000000", "expected 1 to 16384"]);
        on(&wide, &["hidden_size", "got 1099511627776"]);
        on(&params, &["num_hidden_layers", "parameters, more than the limit"]);
    }
    // Llama-3-405B's shape: inspected, its parameter count exact.
    let big = model("big", 126, 16384, 128256);
    let o = longctx(&["inspect", "--json", "--model", big.to_str().unwrap()]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    let (h, i, v_, l) = (16384u64, 32768u64, 128256u64, 126u64);
    let kv = 8 * (h / 32); // 8 kv heads of head_dim hidden / 32 heads
    let per_layer = h * h + 2 * h * kv + h * h + 3 * h * i + 2 * h;
    assert_eq!(v["parameters"].as_u64(), Some(2 * v_ * h + l * per_layer + h));
}

/// Within every single limit but too much for this machine's memory (or for one process's
/// threads): `train` refuses before the first allocation, naming what it needs.
#[test]
fn runs_too_large_for_the_host_are_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let big = tmp.path().join("big");
    refused(
        &["train", "--seq-length", "1073741824", "--max-train-steps", "1", "--output-dir", big.to_str().unwrap()],
        &["host memory", "saved activations", "this machine has"],
    );
    assert!(!big.join("checkpoint").exists() && !big.join("metrics.jsonl").exists());
    let out = tmp.path().join("run");
    refused(&["train", "--world-size", "5000", "--output-dir", out.to_str().unwrap()], &["parallel.world_size", "longctx launch"]);
    assert!(!out.exists(), "nothing was created");
}

/// The planner's byte counts are checked: a shape whose memory does not fit in 64 bits
/// is an error (a debug build would panic on the overflow otherwise), and a GPU count
/// beyond the limit is refused naming `gpus`.
#[test]
fn the_planner_reports_overflow_instead_of_wrapping() {
    let shape = ModelShape {
        params: u64::MAX / 3,
        layer_params: 100_000,
        layers: 2,
        hidden: 64,
        intermediate: 128,
        heads: 4,
        kv_heads: 2,
        head_dim: 16,
        vocab: 256,
        tied_head: false,
    };
    let req = PlanRequest::new(1024, 1, 80_000_000_000, ParallelMode::DataParallel);
    let e = plan::estimate(&shape, &req).unwrap_err().to_string();
    assert!(e.contains("memory estimate") && e.contains("64 bits"), "{e}");
    let ok = ModelShape { params: 1_000_000, ..shape.clone() };
    assert!(plan::estimate(&ok, &req).is_ok());
    let many = PlanRequest::new(1024, 1 << 30, 80_000_000_000, ParallelMode::DataParallel);
    let e = plan::estimate(&ok, &many).unwrap_err().to_string();
    assert!(e.contains("gpus") && e.contains("got 1073741824"), "{e}");
}
