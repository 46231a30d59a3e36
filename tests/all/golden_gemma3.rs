//! Gemma 3 text against Hugging Face transformers 5.24, on the fixtures that
//! `scripts/make_gemma3_fixtures.py` generated (tiny random Gemma3ForCausalLM, f32, CPU;
//! the batch of tests/all/golden.rs): both RoPE tables (full-attention and sliding layers),
//! logits, per-token loss, and the gradient of the SUM loss w.r.t. every parameter through
//! Candle's autograd (the model API) AND through the training engine (explicit layer
//! backward: the `1 + w` norms, the attention- and MLP-output norms, GeGLU-tanh, the
//! embedding scale written out; and its autograd layer backward).
//!
//! - `gemma3_text`: sliding_window 32 ≥ the 24 tokens, so full causal attention is exact.
//! - `gemma3_window4`: sliding_window 4 < 24, so the sliding layers' band mask matters; its
//!   config.json is the transformers 4 form (`rope_theta`, `rope_scaling`,
//!   `rope_local_base_freq`, `sliding_window_pattern`).
//!
//! Also: the config in both forms and its write-back, a stage's RoPE landing on the
//! full-attention layers, bad configs refused naming the field, generation's cached forward
//! against the full one, and a short training run whose export transformers loads with
//! the logits longctx computes.
//!
//! Errors relative to the reference's scale, `max|ours − ref| / max|ref|`, except cos/sin
//! (absolute). Tolerances as tests/all/golden_rope.rs (f32 on both sides): cos/sin 1e-6
//! absolute, logits and losses 5e-6 relative, gradients 2e-5 relative per parameter
//! (--nocapture prints the measured errors).

use candle_core::{safetensors, DType, Device, Tensor};
use longctx::attention::{local::LocalAttention, AttentionMode};
use longctx::model::{Arch, Llama, LlamaConfig, RopeScaling};
use longctx::train::engine::{Engine, EngineOptions};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::common;
use common::fixture::*;

/// Both RoPE tables against transformers' `rotary_emb(.., layer_type)`.
fn check_rope(name: &str, model: &Llama, r: &HashMap<String, Tensor>) -> (f32, f32) {
    let pos = r["position_ids"].to_dtype(DType::U32).unwrap();
    let tables = model.rope_tables(&pos, None).unwrap();
    let local = tables.local.as_ref().expect("Gemma 3 has a local table");
    let err = |t: &longctx::model::RopeTable, key: &str| {
        abs_err(&t.cos.squeeze(2).unwrap(), &r[&format!("{key}.cos")]).max(abs_err(&t.sin.squeeze(2).unwrap(), &r[&format!("{key}.sin")]))
    };
    let (eg, el) = (err(&tables.global, "rope"), err(local, "rope_local"));
    assert!(eg <= ROPE_TOL && el <= ROPE_TOL, "{name}: rope abs err global {eg:e}, local {el:e}");
    assert!(abs_err(&tables.global.cos, &local.cos) > 1e-2, "{name}: the two tables differ");
    (eg, el)
}

fn golden(name: &str) {
    let f = load(name);
    let mut rope = (0.0, 0.0);
    let m = check_against_reference(name, &f, |model| rope = check_rope(name, model, &f.reference));
    println!("{name}: rope abs global {:.1e} local {:.1e}, {m}", rope.0, rope.1);
}

#[test]
fn golden_gemma3_text() {
    golden("gemma3_text");
}

/// Sliding-window layers that see the last 4 positions only (the window honoured in the
/// attention, not only the local RoPE).
#[test]
fn golden_gemma3_window4() {
    golden("gemma3_window4");
}

/// What config.json says, as longctx reads it: layer types, both RoPEs, the attention
/// scale, head_dim from the config, tied embeddings; the transformers 4 form (fixture B)
/// gives the same RoPE tables as transformers built from it.
#[test]
fn gemma3_config_in_both_forms() {
    for name in ["gemma3_text", "gemma3_window4"] {
        let f = load(name);
        let c = &f.cfg;
        assert_eq!(c.arch, Arch::Gemma3);
        assert_eq!(c.local_rope_layers, vec![true, false, true], "{name}: sliding, full, sliding");
        assert_eq!((c.head_dim, c.hidden_size / c.num_attention_heads), (16, 8), "{name}");
        assert!(c.tie_word_embeddings && !f.vars.contains_key("lm_head.weight"), "{name}: tied");
        assert_eq!(c.rope_theta, 1e6);
        assert_eq!(c.rope_scaling, Some(RopeScaling::Linear { factor: 8.0 }));
        assert_eq!(c.rope_local.as_ref().map(|l| (l.theta, l.scaling.clone())), Some((1e4, None)), "{name}");
        assert_eq!(c.attention_scale(), 1.0 / 24f64.sqrt(), "{name}: query_pre_attn_scalar");
        assert_eq!(c.embed_scale(), Some(32f64.sqrt()));
        let model = Engine::from_vars(c, &f.vars, EngineOptions::default()).unwrap().tracked;
        check_rope(name, &model, &f.reference);
        // Written back as read.
        let file: Value = serde_json::from_str(&std::fs::read_to_string(dir(name).join("config.json")).unwrap()).unwrap();
        assert_eq!(c.to_json_value(), file, "{name}: write-back");
    }
}

/// A stage's θ and RoPE method are the full-attention layers' (the sliding layers keep
/// theirs), written where transformers reads them in either form, by the model config and
/// by the export's context fields.
#[test]
fn gemma3_stage_rope_goes_to_the_full_attention_layers() {
    let v5 = load("gemma3_text").cfg.with_rope(5e6, Some(RopeScaling::Linear { factor: 16.0 })).to_json_value();
    assert_eq!(v5["rope_parameters"]["full_attention"], json!({"rope_type": "linear", "factor": 16.0, "rope_theta": 5e6}));
    assert_eq!(v5["rope_parameters"]["sliding_attention"], json!({"rope_type": "default", "rope_theta": 1e4}));
    let v4 = load("gemma3_window4").cfg.with_rope_theta(5e6).to_json_value();
    assert_eq!((v4["rope_theta"].as_f64(), v4["rope_local_base_freq"].as_f64()), (Some(5e6), Some(1e4)));
    let back = LlamaConfig::from_value("config.json", v5).unwrap();
    assert_eq!((back.rope_theta, back.rope_local.unwrap().theta), (5e6, 1e4));

    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(dir("gemma3_text").join("config.json")).unwrap()).unwrap();
    longctx::hub::set_context_fields(&mut c, 2e6, 4096).unwrap();
    assert_eq!(c["rope_parameters"]["full_attention"]["rope_theta"].as_f64(), Some(2e6));
    assert_eq!(c["rope_parameters"]["sliding_attention"]["rope_theta"].as_f64(), Some(1e4), "the local base stays");
    // The window and the layer types (which also pick each layer's RoPE) stay as they were.
    assert_eq!(c["sliding_window"], json!(32));
    assert_eq!(c["layer_types"], json!(["sliding_attention", "full_attention", "sliding_attention"]));
}

/// Generation's cached forward (the attention-output norm, per-layer RoPE and embedding
/// scale on its own path) equals the whole-sequence forward: a prompt of 10 tokens, a
/// block of 13, then one decoding step, against one pass over the 24 tokens (f32, 1e-5).
#[test]
fn gemma3_cached_forward_equals_the_full_forward() {
    let f = load("gemma3_text");
    let model = Engine::from_vars(&f.cfg, &f.vars, EngineOptions::default()).unwrap().tracked;
    let ids = f.reference["input_ids"].to_dtype(DType::U32).unwrap().narrow(0, 0, 1).unwrap();
    let pos = Tensor::arange(0u32, 24, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let full = model.forward_hidden(&ids, &pos, &attn).unwrap();
    let mut cache = longctx::model::KvCache::new(&model);
    let parts: Vec<Tensor> = [(0, 10), (10, 13), (23, 1)]
        .iter()
        .map(|&(st, n)| model.forward_hidden_cached(&ids.narrow(1, st, n).unwrap(), &mut cache).unwrap())
        .collect();
    let cached = Tensor::cat(&parts, 1).unwrap();
    let e = rel_err(&cached, &full);
    assert!(e <= 1e-5, "cached vs full forward rel err {e:e}");
}

/// A change to the fixture's config.json, parsed: the error text.
fn refused(edit: impl FnOnce(&mut Value)) -> String {
    let path = dir("gemma3_text").join("config.json");
    let mut c: Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    edit(&mut c);
    LlamaConfig::from_value(&path, c).map(|_| ()).unwrap_err().to_string()
}

#[test]
fn gemma3_bad_configs_are_refused_naming_the_field() {
    let e = refused(|c| c["attn_logit_softcapping"] = json!(50.0));
    assert!(e.contains("attn_logit_softcapping") && e.contains("null"), "{e}");
    let e = refused(|c| c["final_logit_softcapping"] = json!(30.0));
    assert!(e.contains("final_logit_softcapping"), "{e}");
    let e = refused(|c| c["hidden_activation"] = json!("gelu"));
    assert!(e.contains("hidden_activation") && e.contains("gelu_pytorch_tanh"), "{e}");
    let e = refused(|c| c["layer_types"] = json!(["sliding_attention", "full_attention"]));
    assert!(e.contains("layer_types") && e.contains("3 entries"), "{e}");
    let e = refused(|c| c["layer_types"][1] = json!("chunked_attention"));
    assert!(e.contains("layer_types"), "{e}");
    let e = refused(|c| c["rope_parameters"]["global"] = json!({"rope_type": "default"}));
    assert!(e.contains("rope_parameters.global") && e.contains("full_attention"), "{e}");
    let e = refused(|c| c["rope_parameters"]["sliding_attention"]["rope_type"] = json!("su"));
    assert!(e.contains("rope_parameters.sliding_attention.rope_type"), "{e}");
    let e = refused(|c| c["use_bidirectional_attention"] = json!(true));
    assert!(e.contains("use_bidirectional_attention"), "{e}");
    let e = refused(|c| c["query_pre_attn_scalar"] = json!(0));
    assert!(e.contains("query_pre_attn_scalar"), "{e}");
    // The multimodal checkpoint (vision tower, `language_model.` names) is another model.
    let e = refused(|c| {
        c["model_type"] = json!("gemma3");
        c["architectures"] = json!(["Gemma3ForConditionalGeneration"]);
    });
    assert!(e.contains("Gemma3ForConditionalGeneration") && e.contains("gemma3_text"), "{e}");
}

/// Training on the Gemma 3 fixture (explicit layer backward), then its export: the
/// checkpoint's tensor names, the config kept (layer types, both RoPEs, the model's own
/// fields); where python has transformers, the export loads in it with no missing or
/// unexpected keys and gives the logits longctx computes from the exported weights
/// (scripts/check_export_logits.py; skipped without python transformers).
#[test]
fn gemma3_trains_and_exports_what_transformers_loads() {
    use longctx::train::config::{RunConfig, Stage};
    let tmp = tempfile::tempdir().unwrap();
    let src = dir("gemma3_text");
    let mut c = RunConfig { seed: 5, output_dir: tmp.path().to_path_buf(), ..RunConfig::default() };
    c.model.source = src.to_string_lossy().into_owned();
    c.data.dataset = "synthetic:passkey".into();
    c.train.batch_size = 1;
    c.train.learning_rate = 1e-2;
    c.parallel.token_chunk = 8;
    c.stages = vec![Stage::new(32, 2e6, 3)];
    c.validate(Path::new("<test>")).unwrap();
    let s = longctx::train::trainer::run(&c, false).unwrap();
    assert!(s.stage_losses.iter().all(|(_, a, b)| a.is_finite() && b.is_finite()), "{s:?}");

    let export = tmp.path().join("export");
    let names = |p: &Path| {
        let mut v: Vec<String> = safetensors::load(p, &Device::Cpu).unwrap().into_keys().collect();
        v.sort();
        v
    };
    assert_eq!(names(&export.join("model.safetensors")), names(&src.join("model.safetensors")));
    let cfg = LlamaConfig::from_file(export.join("config.json")).unwrap();
    assert_eq!((cfg.arch, cfg.rope_theta, cfg.rope_local.as_ref().map(|l| l.theta)), (Arch::Gemma3, 2e6, Some(1e4)));
    assert_eq!(cfg.local_rope_layers, vec![true, false, true]);
    assert_eq!(cfg.attention_scale(), 1.0 / 24f64.sqrt());
    let trained = safetensors::load(export.join("model.safetensors"), &Device::Cpu).unwrap();
    let before = safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let key = "model.layers.1.pre_feedforward_layernorm.weight";
    assert!(abs_err(&trained[key], &before[key]) > 0.0, "the Gemma norms train");

    // Our logits from the exported weights, for transformers to compare with.
    let vb = longctx::hub::Checkpoint::open(&export).unwrap().var_builder(DType::F32, &Device::Cpu);
    let model = Llama::load(vb, &cfg).unwrap();
    let r = &load("gemma3_text").reference;
    let (ids, pos) = (r["input_ids"].to_dtype(DType::U32).unwrap(), r["position_ids"].to_dtype(DType::U32).unwrap());
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let logits = model.logits(&model.forward_hidden(&ids, &pos, &attn).unwrap()).unwrap();
    assert!(abs_err(&logits, &r["logits"]) > 1e-3, "training moved the logits");
    let ours = tmp.path().join("ours.safetensors");
    let batch = HashMap::from([
        ("input_ids".to_string(), r["input_ids"].clone()),
        ("position_ids".to_string(), r["position_ids"].clone()),
        ("logits".to_string(), logits),
    ]);
    safetensors::save(&batch, &ours).unwrap();
    check_in_transformers(&export, &ours);
}

/// Runs scripts/check_export_logits.py on `export` and `logits` (skipped without python
/// transformers: CI has none; the fixtures carry transformers' reference for the rest).
fn check_in_transformers(export: &Path, logits: &Path) {
    let has = std::process::Command::new("python3").args(["-c", "import transformers, torch"]).output().is_ok_and(|o| o.status.success());
    if !has {
        println!("skipped: python transformers not available");
        return;
    }
    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("scripts/check_export_logits.py");
    let run = std::process::Command::new("python3").arg(script).arg(export).arg(logits).output().unwrap();
    let stdout = String::from_utf8_lossy(&run.stdout);
    println!("{stdout}");
    assert!(run.status.success(), "transformers check failed:\n{stdout}\n{}", String::from_utf8_lossy(&run.stderr));
}
