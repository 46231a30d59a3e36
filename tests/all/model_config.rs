//! config.json parsing: every bad input names the file and the field; unknown fields and
//! unchanged values survive a parse -> write round trip; transformers v4 (`rope_theta` +
//! `rope_scaling`) and v5 (`rope_parameters`) spellings mean the same model.

use longctx::model::{Arch, LlamaConfig, RopeScaling};
use serde_json::{json, Value};
use std::path::PathBuf;

const FILE: &str = "/ckpt/tiny/config.json";

/// A complete transformers-v4 style Llama config (as Llama-2 checkpoints ship).
fn v4() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 4096,
        "vocab_size": 300,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000,
        "rope_scaling": null,
        "tie_word_embeddings": false,
        "torch_dtype": "bfloat16",
        "hidden_act": "silu",
        "bos_token_id": 1,
        "pretraining_tp": 1,
        "my_custom_field": {"nested": [1, 2.5, "x"], "flag": true}
    })
}

fn with(mut v: Value, key: &str, val: Value) -> Value {
    v.as_object_mut().unwrap().insert(key.into(), val);
    v
}

fn without(mut v: Value, key: &str) -> Value {
    v.as_object_mut().unwrap().remove(key);
    v
}

/// Parses, expects an error, returns its message after checking it names the file and `field`.
fn err(v: Value, field: &str) -> String {
    let msg = match LlamaConfig::from_value(FILE, v) {
        Ok(c) => panic!("expected an error about `{field}`, got {c:?}"),
        Err(e) => e.to_string(),
    };
    assert!(msg.contains(FILE), "message does not name the file: {msg}");
    assert!(msg.contains(&format!("`{field}`")), "message does not name field `{field}`: {msg}");
    msg
}

#[test]
fn parses_a_v4_config_with_defaults_applied() {
    let c = LlamaConfig::from_value(FILE, v4()).unwrap();
    assert_eq!(c.arch, Arch::Llama);
    assert_eq!((c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim), (64, 4, 2, 16));
    assert_eq!((c.rope_theta, c.rope_scaling.clone()), (10000.0, None));
    assert_eq!(c.torch_dtype.as_deref(), Some("bfloat16"));
    let c = LlamaConfig::from_value(FILE, without(v4(), "num_key_value_heads")).unwrap();
    assert_eq!(c.num_key_value_heads, 4, "defaults to num_attention_heads");
    // head_dim may differ from hidden / heads.
    let c = LlamaConfig::from_value(FILE, with(v4(), "head_dim", json!(32))).unwrap();
    assert_eq!(c.head_dim, 32);
}

#[test]
fn missing_field_is_named() {
    let msg = err(without(v4(), "hidden_size"), "hidden_size");
    assert!(msg.contains("missing"), "{msg}");
}

#[test]
fn wrong_type_is_named_with_the_value() {
    let msg = err(with(v4(), "num_hidden_layers", json!("abc")), "num_hidden_layers");
    assert!(msg.contains("expected a positive integer") && msg.contains("\"abc\""), "{msg}");
    let msg = err(with(v4(), "vocab_size", json!(0)), "vocab_size");
    assert!(msg.contains("positive integer"), "{msg}");
    let msg = err(with(v4(), "rms_norm_eps", json!("small")), "rms_norm_eps");
    assert!(msg.contains("positive number"), "{msg}");
    let msg = err(with(v4(), "tie_word_embeddings", json!(1)), "tie_word_embeddings");
    assert!(msg.contains("true or false"), "{msg}");
}

#[test]
fn unsupported_architecture_is_named_with_the_supported_list() {
    let msg = err(with(v4(), "model_type", json!("gpt2")), "model_type");
    assert!(msg.contains("\"gpt2\"") && msg.contains("llama") && msg.contains("mistral") && msg.contains("qwen2"), "{msg}");
    let v = with(without(v4(), "model_type"), "architectures", json!(["GPT2LMHeadModel"]));
    let msg = err(v, "architectures");
    assert!(msg.contains("GPT2LMHeadModel") && msg.contains("LlamaForCausalLM"), "{msg}");
    // model_type may be inferred from architectures.
    let v = with(without(v4(), "model_type"), "architectures", json!(["Qwen2ForCausalLM"]));
    assert_eq!(LlamaConfig::from_value(FILE, v).unwrap().arch, Arch::Qwen2);
}

#[test]
fn heads_not_divisible_by_kv_heads_is_named() {
    let msg = err(with(v4(), "num_key_value_heads", json!(3)), "num_key_value_heads");
    assert!(msg.contains('4') && msg.contains('3'), "{msg}");
}

#[test]
fn unknown_rope_scaling_type_is_named() {
    let msg = err(with(v4(), "rope_scaling", json!({"type": "spiral", "factor": 2.0})), "rope_scaling.rope_type");
    assert!(msg.contains("\"spiral\"") && msg.contains("yarn") && msg.contains("llama3"), "{msg}");
    // The v5 spelling is checked the same way.
    let v = with(without(v4(), "rope_scaling"), "rope_parameters", json!({"rope_type": "spiral", "rope_theta": 1e4}));
    err(v, "rope_parameters.rope_type");
    // longrope is supported now: its required keys are named.
    let v = with(without(v4(), "rope_scaling"), "rope_parameters", json!({"rope_type": "longrope", "rope_theta": 1e4}));
    err(v, "rope_parameters.original_max_position_embeddings");
    // A known type with a missing factor names the sub-field.
    err(with(v4(), "rope_scaling", json!({"rope_type": "linear"})), "rope_scaling.factor");
}

#[test]
fn non_silu_activation_is_rejected() {
    let msg = err(with(v4(), "hidden_act", json!("gelu")), "hidden_act");
    assert!(msg.contains("gelu"), "{msg}");
}

#[test]
fn from_file_names_the_path() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("config.json");
    std::fs::write(&path, serde_json::to_string(&without(v4(), "intermediate_size")).unwrap()).unwrap();
    let msg = LlamaConfig::from_file(&path).unwrap_err().to_string();
    assert!(msg.contains(&path.display().to_string()) && msg.contains("`intermediate_size`"), "{msg}");
}

#[test]
fn round_trip_keeps_unknown_fields_and_spelling() {
    let c = LlamaConfig::from_value(FILE, v4()).unwrap();
    assert_eq!(c.to_json_value(), v4(), "unchanged config must be written back as read");
    // Serde goes through the same path.
    let back: LlamaConfig = serde_json::from_value(serde_json::to_value(&c).unwrap()).unwrap();
    assert_eq!(back.to_json_value(), v4());

    // Changing the RoPE base / length changes exactly those fields.
    let mut c2 = c.with_rope_theta(500000.0);
    c2.set_max_position_embeddings(32768);
    let out = c2.to_json_value();
    assert_eq!(out["rope_theta"], json!(500000.0));
    assert_eq!(out["max_position_embeddings"], json!(32768));
    assert_eq!(out["my_custom_field"], v4()["my_custom_field"]);
    assert_eq!(
        without(without(out, "rope_theta"), "max_position_embeddings"),
        without(without(v4(), "rope_theta"), "max_position_embeddings")
    );
}

fn fixtures() -> Vec<PathBuf> {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut v: Vec<PathBuf> =
        std::fs::read_dir(&root).unwrap().map(|e| e.unwrap().path().join("config.json")).filter(|p| p.exists()).collect();
    v.sort();
    v
}

/// Configs written by transformers 5 (the fixtures) round-trip exactly, and raising
/// rope_theta lands inside `rope_parameters` where transformers 5 reads it (Gemma 3's
/// per-layer-type dict: in `full_attention`). gemma3_window4 is in the transformers 4 form
/// (top-level `rope_theta`) on purpose: it round-trips, and the θ lands on top.
#[test]
fn transformers_v5_configs_round_trip() {
    let files = fixtures();
    assert!(files.len() >= 7, "fixtures missing: {files:?}");
    for f in files {
        let text = std::fs::read_to_string(&f).unwrap();
        let orig: Value = serde_json::from_str(&text).unwrap();
        let c = LlamaConfig::from_file(&f).unwrap();
        assert_eq!(c.to_json_value(), orig, "{}", f.display());
        let out = c.with_rope_theta(123456.0).to_json_value();
        let rp = &out["rope_parameters"];
        let theta = match (rp.is_null(), rp.get("full_attention")) {
            (true, _) => &out["rope_theta"],
            (false, Some(full)) => &full["rope_theta"],
            (false, None) => &rp["rope_theta"],
        };
        assert_eq!(theta, &json!(123456.0), "{}", f.display());
        assert!(rp.is_null() || out.get("rope_theta").is_none(), "{}", f.display());
    }
}

/// The same RoPE written the v4 way and the v5 way parses to the same config values.
#[test]
fn v4_and_v5_rope_spellings_agree() {
    let scaling = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64});
    let a = LlamaConfig::from_value(FILE, with(with(v4(), "rope_scaling", scaling.clone()), "rope_theta", json!(500000.0))).unwrap();
    let mut params = scaling.clone();
    params["rope_theta"] = json!(500000.0);
    let b = LlamaConfig::from_value(FILE, with(without(without(v4(), "rope_scaling"), "rope_theta"), "rope_parameters", params)).unwrap();
    assert_eq!(a.rope_theta, 500000.0);
    assert_eq!((a.rope_theta, &a.rope_scaling), (b.rope_theta, &b.rope_scaling));
    assert_eq!(
        a.rope_scaling,
        Some(RopeScaling::Llama3 { factor: 8.0, low_freq_factor: 1.0, high_freq_factor: 4.0, original_max_position_embeddings: 64 })
    );
    // The old `type` key works too and is written back under its own name.
    let c = LlamaConfig::from_value(FILE, with(v4(), "rope_scaling", json!({"type": "dynamic", "factor": 2.0}))).unwrap();
    assert_eq!(c.rope_scaling, Some(RopeScaling::Dynamic { factor: 2.0 }));
    assert_eq!(c.to_json_value()["rope_scaling"], json!({"type": "dynamic", "factor": 2.0}));
}

/// `init::parameter_shapes` (used by `random_init` and the planner's parameter count)
/// lists exactly what `Llama::load` needs and `named_parameters` returns, in that order,
/// for every bias combination (attention biases, MLP biases, tied head).
#[test]
fn parameter_shapes_match_the_model() {
    use candle_core::{DType, Device};
    let cases = [
        json!({"attention_bias": false, "mlp_bias": false, "tie_word_embeddings": false}),
        json!({"attention_bias": true, "mlp_bias": true, "tie_word_embeddings": false}),
        json!({"attention_bias": false, "mlp_bias": true, "tie_word_embeddings": true}),
    ];
    for extra in cases {
        let mut cfg = v4();
        for (k, v) in extra.as_object().unwrap() {
            cfg[k] = v.clone();
        }
        let cfg = LlamaConfig::from_value(PathBuf::from(FILE), cfg).unwrap();
        let shapes = longctx::train::init::parameter_shapes(&cfg);
        let weights = longctx::train::init::random_init(&cfg, 1, DType::F32, &Device::Cpu).unwrap();
        let vb = candle_nn::VarBuilder::from_tensors(weights, DType::F32, &Device::Cpu);
        let model = longctx::model::Llama::load(vb, &cfg).unwrap();
        let named: Vec<(String, Vec<usize>)> = model.named_parameters().into_iter().map(|(n, t)| (n, t.dims().to_vec())).collect();
        assert_eq!(shapes, named, "{extra}");
        let count: usize = named.iter().map(|(_, s)| s.iter().product::<usize>()).sum();
        assert_eq!(longctx::plan::param_count(&cfg), count as u64, "{extra}");
    }
}
