//! Issue #33 through the binary, for `eval` and `generate`: a model file with a NaN or
//! infinite weight is refused at load (file and tensor named), sizes too large for 32-bit
//! positions or for the machine's memory are refused before anything is allocated (no
//! abort, no panic), the output files of one evaluation replace those of an earlier run as
//! a set, and negative numbers reach the range checks instead of clap's "unexpected
//! argument".

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::common;
use common::{fails, ok, repo_root, run, write_st};

fn s(p: &Path) -> String {
    p.display().to_string()
}

/// A copy of the `llama_mha` fixture (config, tokenizer) in `dir/name`, its weights
/// re-written with `edit` applied to the tensors by name.
fn model_copy(dir: &Path, name: &str, edit: impl Fn(&str, Tensor) -> Tensor) -> PathBuf {
    let src = repo_root().join("tests/fixtures/llama_mha");
    let out = dir.join(name);
    std::fs::create_dir_all(&out).unwrap();
    for f in ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(src.join(f), out.join(f)).unwrap();
    }
    let w = candle_core::safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = w.keys().collect();
    names.sort();
    let tensors: Vec<(&str, Tensor)> = names.iter().map(|n| (n.as_str(), edit(n, w[*n].clone()))).collect();
    write_st(&out.join("model.safetensors"), &tensors);
    out
}

/// `t` with its element `i` (flattened) set to `v`, in its dtype.
fn poke(t: Tensor, i: usize, v: f32) -> Tensor {
    let (dt, shape) = (t.dtype(), t.dims().to_vec());
    let mut xs = t.to_dtype(DType::F32).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
    xs[i] = v;
    Tensor::from_vec(xs, shape, &Device::Cpu).unwrap().to_dtype(dt).unwrap()
}

const DOWN: &str = "model.layers.1.mlp.down_proj.weight";
const HEAD: &str = "lm_head.weight";

#[test]
fn a_model_file_with_a_nan_or_infinite_weight_is_refused_at_load_naming_the_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let good = model_copy(tmp.path(), "good", |_, t| t);
    let nan = model_copy(tmp.path(), "nan", |n, t| if n == DOWN { poke(t, 37, f32::NAN) } else { t });
    let inf = model_copy(tmp.path(), "inf", |n, t| if n == HEAD { poke(t, 5, f32::NEG_INFINITY) } else { t });
    let ev = s(&tmp.path().join("eval"));
    // The copy itself is fine: what fails below fails for the one bad value.
    ok(&["generate", "--model", &s(&good), "--prompt", "the quick", "--max-new-tokens", "3"]);
    ok(&["eval", "ppl", "--model", &s(&good), "--lengths", "16", "--max-docs", "1", "--output-dir", &ev]);
    for (dir, tensor) in [(&nan, DOWN), (&inf, HEAD)] {
        let file = s(&dir.join("model.safetensors"));
        let needles = [file.as_str(), tensor, "NaN or infinite", "re-download or re-export"];
        fails(&run(&["generate", "--model", &s(dir), "--prompt", "the quick", "--max-new-tokens", "3"]), &needles, false);
        fails(&run(&["eval", "ppl", "--model", &s(dir), "--lengths", "16", "--max-docs", "1", "--output-dir", &ev]), &needles, false);
        let needle = ["eval", "needle", "--model", &s(dir), "--lengths", "256", "--depths", "0.5", "--trials", "1", "--output-dir", &ev];
        fails(&run(&needle), &needles, false);
        // train reads its start weights through the same check (it blamed the learning
        // rate before).
        let out = s(&tmp.path().join("train"));
        fails(&run(&["train", "--model", &s(dir), "--seq-length", "32", "--max-train-steps", "2", "--output-dir", &out]), &needles, false);
    }
}

#[test]
fn sizes_beyond_positions_or_memory_are_refused_before_allocating() {
    let tmp = tempfile::tempdir().unwrap();
    let m = s(&model_copy(tmp.path(), "m", |_, t| t));
    let ev = s(&tmp.path().join("eval"));
    let max = "2147483648";
    // generate: beyond 32-bit positions (2^64 − 1 panicked on a capacity overflow before).
    for n in ["1000000000000", "18446744073709551615"] {
        let o = run(&["generate", "--model", &m, "--prompt", "the quick", "--max-new-tokens", n]);
        fails(&o, &["--max-new-tokens", n, max, "positions are 32-bit", "lower --max-new-tokens"], true);
    }
    // Within positions, but the KV cache (2 layers × k, v × 4 heads × 16 × 4 bytes = 1 KiB a
    // token) is ~2.2 TB: refused with the parts, before the weights are read.
    let o = run(&["generate", "--model", &m, "--prompt", "the quick", "--max-new-tokens", "2147483000"]);
    fails(&o, &["--max-new-tokens", "KV cache", "host memory available", "lower --max-new-tokens"], true);
    // eval ppl / needle with --allow-extrapolation: 10^12, 10^10, 2^64 − 1 tokens (an
    // allocation abort, or a divide by zero in ppl.rs, before).
    for n in ["1000000000000", "18446744073709551615"] {
        let o = run(&["eval", "ppl", "--model", &m, "--lengths", n, "--allow-extrapolation", "--output-dir", &ev]);
        fails(&o, &["--lengths", n, max, "use shorter --lengths"], true);
    }
    for n in ["10000000000", "18446744073709551615"] {
        let o = run(&["eval", "needle", "--model", &m, "--lengths", n, "--allow-extrapolation", "--output-dir", &ev]);
        fails(&o, &["--lengths", n, max], true);
    }
    // 2^31 tokens fit the positions; one window's activations (~6.6 TB) do not fit.
    let o = run(&["eval", "ppl", "--model", &m, "--lengths", max, "--allow-extrapolation", "--output-dir", &ev]);
    fails(&o, &["--lengths", "activations of one window", "host memory available"], true);
    let o = run(&["eval", "needle", "--model", &m, "--lengths", max, "--allow-extrapolation", "--output-dir", &ev]);
    fails(&o, &["--lengths", "activations of one window", "host memory available"], true);
}

/// The files in `dir`, sorted.
fn listing(dir: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect();
    v.sort();
    v
}

#[test]
fn a_second_evaluation_replaces_the_first_ones_files_as_a_set_and_max_docs_0_is_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let a = s(&model_copy(tmp.path(), "a", |_, t| t));
    let b = s(&model_copy(tmp.path(), "b", |_, t| t));
    let ev = tmp.path().join("eval");
    let evs = s(&ev);
    // --max-docs 0 scored one document before.
    let o = run(&["eval", "ppl", "--model", &a, "--lengths", "16", "--max-docs", "0", "--output-dir", &evs]);
    fails(&o, &["--max-docs", "got 0", "at least 1"], true);
    // Two models, then one: the second run's files hold its model only, and nothing else
    // (no temporary) is left in the directory.
    ok(&["eval", "ppl", "--model", &a, "--model", &b, "--lengths", "16", "--max-docs", "1", "--output-dir", &evs]);
    assert!(std::fs::read_to_string(ev.join("ppl.csv")).unwrap().contains(&b));
    ok(&["eval", "ppl", "--model", &a, "--lengths", "16", "--max-docs", "1", "--output-dir", &evs]);
    let csv = std::fs::read_to_string(ev.join("ppl.csv")).unwrap();
    assert!(csv.contains(&a) && !csv.contains(&b), "{csv}");
    let json: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(ev.join("ppl.json")).unwrap()).unwrap();
    assert_eq!(json["models"].as_array().unwrap().len(), 1, "{json}");
    assert_eq!(listing(&ev), ["ppl.csv", "ppl.json", "ppl.png"]);
    // needle with greedy generation, then --no-generate: the first run's greedy map is not
    // left next to the second run's results (it was before).
    let needle = |extra: &[&str]| {
        let mut args = vec!["eval", "needle", "--model", &a, "--lengths", "256", "--depths", "0.5", "--trials", "1", "--output-dir", &evs];
        args.extend_from_slice(extra);
        ok(&args);
    };
    needle(&[]);
    assert!(ev.join("needle_greedy.png").is_file());
    needle(&["--no-generate"]);
    assert_eq!(listing(&ev), ["needle.json", "needle.png", "ppl.csv", "ppl.json", "ppl.png"]);
}

#[test]
fn negative_numbers_reach_the_range_checks() {
    let tmp = tempfile::tempdir().unwrap();
    let m = s(&model_copy(tmp.path(), "m", |_, t| t));
    let ev = s(&tmp.path().join("eval"));
    let o = run(&["generate", "--model", &m, "--prompt", "the quick", "--temperature", "-1"]);
    fails(&o, &["--temperature", "got -1", "≥ 0"], false);
    let o = run(&["generate", "--model", &m, "--prompt", "the quick", "--top-p", "-0.5"]);
    fails(&o, &["--top-p", "got -0.5", "(0, 1]"], false);
    for cmd in ["ppl", "needle"] {
        let o = run(&["eval", cmd, "--model", &m, "--lengths", "64", "--collective-timeout", "-5", "--output-dir", &ev]);
        fails(&o, &["--collective-timeout", "got -5", "seconds ≥ 0"], true);
    }
}

#[test]
fn eval_ruler_checks_sizes_too() {
    let tmp = tempfile::tempdir().unwrap();
    let m = s(&model_copy(tmp.path(), "m", |_, t| t));
    let ev = s(&tmp.path().join("eval"));
    for n in ["10000000000", "2147483648"] {
        let o = run(&["eval", "ruler", "--model", &m, "--lengths", n, "--allow-extrapolation", "--output-dir", &ev]);
        fails(&o, &["--lengths", n, "use shorter --lengths"], true);
    }
}
