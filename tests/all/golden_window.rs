//! Sliding-window attention (issue #31) against Hugging Face transformers, on the fixtures
//! that `scripts/make_window_fixtures.py` generated (tiny random checkpoints, f32, CPU,
//! eager attention WITH the window; the batch of tests/all/golden.rs, 24 tokens per row):
//! - `mistral_window`: Mistral, `sliding_window` 5 on both layers;
//! - `qwen2_window`: Qwen2, `use_sliding_window`, `sliding_window` 4, `max_window_layers`
//!   1 (transformers writes `layer_types` = [full, sliding]).
//!
//! Logits, per-token loss and the gradient of the SUM loss w.r.t. every parameter through
//! Candle's autograd (the model API) and through the training engine (explicit and
//! autograd layer backward); the KV-cache path of generation over the same tokens; the
//! window resolution per layer; and the export of a run: config.json keeps the window,
//! and transformers reading that export back reproduces the fixture's logits
//! (scripts/check_export_transformers.py; skipped without a Python that has transformers,
//! `LONGCTX_PYTHON` or `python3`). Tolerances as tests/all/golden.rs (f32 both sides): logits
//! and losses 5e-6 relative, gradients 2e-5 relative per parameter.

use candle_core::{DType, Device, Tensor};
use longctx::model::{KvCache, Llama, LlamaConfig};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

use crate::common;
use common::fixture::*;

fn golden(name: &str) {
    let m = check_against_reference(name, &load(name), |_| {});
    println!("{name}: {m}");
}

#[test]
fn golden_mistral_window() {
    golden("mistral_window");
    assert_eq!(load("mistral_window").cfg.layer_windows().unwrap(), vec![Some(5), Some(5)]);
}

#[test]
fn golden_qwen2_window() {
    golden("qwen2_window");
    assert_eq!(load("qwen2_window").cfg.layer_windows().unwrap(), vec![None, Some(4)]);
}

/// Generation's KV-cache path (a prompt, single decoding steps, a chunk after a cache)
/// gives row 0's reference logits (its positions are 0..24, as the cache counts them).
#[test]
fn the_kv_cache_honours_the_window() {
    for name in ["mistral_window", "qwen2_window"] {
        let f = load(name);
        let r = &f.reference;
        let weights: HashMap<String, Tensor> = f.vars.iter().map(|(k, v)| (k.clone(), v.as_tensor().clone())).collect();
        let model = Llama::load(candle_nn::VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu), &f.cfg).unwrap();
        let ids = r["input_ids"].to_dtype(DType::U32).unwrap().narrow(0, 0, 1).unwrap();
        let mut cache = KvCache::new(&model);
        let mut parts = Vec::new();
        let mut at = 0;
        for n in [7, 1, 1, 10, 5] {
            let h = model.forward_hidden_cached(&ids.narrow(1, at, n).unwrap(), &mut cache).unwrap();
            parts.push(model.logits(&h).unwrap());
            at += n;
        }
        let got = Tensor::cat(&parts, 1).unwrap();
        let e = rel_err(&got, &r["logits"].narrow(0, 0, 1).unwrap());
        assert!(e <= LOGIT_TOL, "{name}: cached logits rel err {e:e}");
    }
}

/// Qwen2 without `layer_types` resolves the same layers from `max_window_layers`;
/// `use_sliding_window: false` turns the window off.
#[test]
fn qwen2_layers_from_max_window_layers() {
    let mut json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir("qwen2_window").join("config.json")).unwrap()).unwrap();
    json.as_object_mut().unwrap().remove("layer_types");
    let cfg = LlamaConfig::from_value("config.json", json.clone()).unwrap();
    assert_eq!(cfg.layer_windows().unwrap(), vec![None, Some(4)]);
    json["max_window_layers"] = 0.into();
    assert_eq!(LlamaConfig::from_value("config.json", json.clone()).unwrap().layer_windows().unwrap(), vec![Some(4), Some(4)]);
    json["use_sliding_window"] = false.into();
    assert_eq!(LlamaConfig::from_value("config.json", json).unwrap().layer_windows().unwrap(), vec![None, None]);
}

/// Bad sliding-window fields are refused at parse time, naming config.json's field.
#[test]
fn bad_window_fields_are_refused() {
    let base: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dir("qwen2_window").join("config.json")).unwrap()).unwrap();
    let err = |edit: &dyn Fn(&mut serde_json::Value)| {
        let mut j = base.clone();
        edit(&mut j);
        LlamaConfig::from_value("config.json", j).unwrap_err().to_string()
    };
    let e = err(&|j| j["sliding_window"] = 0.into());
    assert!(e.contains("config.json") && e.contains("sliding_window") && e.contains("0 tokens"), "{e}");
    let e = err(&|j| j["sliding_window"] = "big".into());
    assert!(e.contains("sliding_window") && e.contains("positive integer"), "{e}");
    let e = err(&|j| j["layer_types"] = serde_json::json!(["full_attention"]));
    assert!(e.contains("layer_types") && e.contains("1 entries") && e.contains("num_hidden_layers = 2"), "{e}");
    let e = err(&|j| j["layer_types"] = serde_json::json!(["full_attention", "chunked_attention"]));
    assert!(e.contains("layer_types[1]") && e.contains("chunked_attention") && e.contains("sliding_attention"), "{e}");
    let e = err(&|j| j["use_sliding_window"] = 1.into());
    assert!(e.contains("use_sliding_window") && e.contains("true or false"), "{e}");
    let e = err(&|j| j["max_window_layers"] = (-1).into());
    assert!(e.contains("max_window_layers"), "{e}");
    // Mistral: a window of 0 too
    let mut m: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir("mistral_window").join("config.json")).unwrap()).unwrap();
    m["sliding_window"] = 0.into();
    let e = LlamaConfig::from_value("config.json", m).unwrap_err().to_string();
    assert!(e.contains("sliding_window"), "{e}");
}

fn python() -> Option<String> {
    let py = std::env::var("LONGCTX_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = std::process::Command::new(&py).args(["-c", "import transformers, torch"]).output().map(|o| o.status.success());
    ok.unwrap_or(false).then_some(py)
}

/// A run that trained with the window exports config.json with the window as the
/// checkpoint had it, and transformers running that export gives the fixture's logits.
#[test]
fn a_run_exports_the_window_and_transformers_runs_it() {
    use longctx::hub::export::ModelExport;
    use longctx::train::export::RunProgress;
    let tmp = tempfile::tempdir().unwrap();
    let mut run = longctx::train::RunConfig::default();
    run.stages.truncate(1); // 32 tokens at θ 1e4: the fixtures' own θ, max positions kept
    let mut cases = Vec::new();
    for name in ["mistral_window", "qwen2_window"] {
        let src = dir(name);
        let export =
            ModelExport::from_model_dir(&src).unwrap().for_run(&run, RunProgress::finished(&run), 2048, Path::new("run.toml")).unwrap();
        let out = tmp.path().join(name);
        export.write(&out).unwrap();
        let got: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
        let want: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
        for key in ["sliding_window", "use_sliding_window", "max_window_layers", "layer_types"] {
            assert_eq!(got.get(key), want.get(key), "{name}: {key} kept");
        }
        // and longctx reads the same windows back
        let back = LlamaConfig::from_file(out.join("config.json")).unwrap();
        assert_eq!(back.layer_windows().unwrap(), load(name).cfg.layer_windows().unwrap());
        cases.extend(["--case".to_string(), out.display().to_string(), src.display().to_string(), "same".into(), "same".into()]);
    }
    let Some(py) = python() else {
        println!("skipped the transformers check: no python with transformers (set LONGCTX_PYTHON)");
        return;
    };
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/check_export_transformers.py");
    let o = std::process::Command::new(py)
        .arg(script)
        .args(&cases)
        .env("HF_HUB_OFFLINE", "1")
        .env("TRANSFORMERS_VERBOSITY", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    println!("{stdout}");
    assert!(o.status.success(), "transformers check failed:\n{stdout}\n{}", String::from_utf8_lossy(&o.stderr));
}
