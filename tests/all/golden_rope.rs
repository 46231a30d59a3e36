//! Qwen3 and LongRoPE against Hugging Face transformers, on the fixtures that
//! `scripts/make_rope_fixtures.py` generated (tiny random checkpoints, f32, CPU; the same
//! batch as tests/all/golden.rs): RoPE cos/sin, logits, per-token loss, and the gradient of
//! the SUM loss w.r.t. every parameter through Candle's autograd (the model API) AND
//! through the training engine's explicit layer backward (`src/train/layer_grad.rs`,
//! which for Qwen3 differentiates the per-head q/k norms by hand); also YaRN (its
//! attention factor on cos/sin) through the engine, on tests/fixtures/llama_yarn; and
//! Phi-3 (scripts/make_phi3_fixture.py: fused qkv_proj/gate_up_proj split at load,
//! LongRoPE, GQA), whose export fuses them back exactly.
//!
//! Errors relative to the reference's scale, `max|ours − ref| / max|ref|`, except cos/sin
//! (absolute). Tolerances as tests/all/golden.rs (f32 on both sides): cos/sin 1e-6 absolute,
//! logits and losses 5e-6 relative, gradients 2e-5 relative per parameter. Measured
//! (--nocapture prints them): cos/sin ≤ 1.2e-7, logits ≤ 4.6e-7, loss ≤ 3.0e-7, gradients
//! ≤ 1.0e-6 (autograd) and ≤ 1.6e-6 (engine, explicit: Qwen3's q_norm the worst).

use candle_core::{safetensors, DType, Device, Tensor};
use longctx::model::{LlamaConfig, Rope};

use crate::common;
use common::fixture::*;

fn golden(name: &str) {
    let f = load(name);
    let pos = f.reference["position_ids"].to_dtype(DType::U32).unwrap();
    let mut rope = (0.0, 0.0);
    let m = check_against_reference(name, &f, |model| {
        let table = model.rope_table(&pos, None).unwrap();
        let e_cos = abs_err(&table.cos.squeeze(2).unwrap(), &f.reference["rope.cos"]);
        let e_sin = abs_err(&table.sin.squeeze(2).unwrap(), &f.reference["rope.sin"]);
        assert!(e_cos <= ROPE_TOL && e_sin <= ROPE_TOL, "{name}: rope cos err {e_cos:e}, sin err {e_sin:e}");
        // The engine builds its table from the global length (the trainer passes it).
        let global = model.rope_table(&pos, Some(1024)).unwrap();
        assert_eq!(abs_err(&global.cos, &table.cos), 0.0, "{name}: the training table is the eval table");
        rope = (e_cos, e_sin);
    });
    println!("{name}: rope cos/sin abs {:.1e}/{:.1e}, {m}", rope.0, rope.1);
}

#[test]
fn golden_qwen3_tied() {
    golden("qwen3_tied");
    let f = load("qwen3_tied");
    assert_eq!(f.cfg.arch, longctx::model::Arch::Qwen3);
    assert_eq!((f.cfg.head_dim, f.cfg.hidden_size / f.cfg.num_attention_heads), (12, 8));
    assert!(f.vars.contains_key("model.layers.1.self_attn.q_norm.weight"));
    assert!(!f.vars.contains_key("lm_head.weight"), "tied");
}

#[test]
fn golden_llama_longrope() {
    golden("llama_longrope");
}

/// YaRN (tests/fixtures/llama_yarn, made by scripts/make_fixtures.py): its attention
/// factor scales the cos/sin that the training engine's fused RoPE applies too, so the
/// engine's gradients match transformers' as the model API's do.
#[test]
fn golden_llama_yarn_through_the_engine() {
    golden("llama_yarn");
    let (_, att) = Rope::new(&load("llama_yarn").cfg).inv_freq(1024);
    assert_eq!(att, (0.1 * 4f64.ln() + 1.0) as f32);
}

/// LongRoPE picks the short factors while the sequence fits the pretrained context and
/// the long ones past it (transformers: max(position_ids) + 1 > original), both scaled by
/// the same attention factor √(1 + ln 4 / ln 256).
#[test]
fn longrope_short_and_long_factors() {
    let f = load("llama_longrope");
    let r = &f.reference;
    let rope = Rope::new(&f.cfg);
    let pos = Tensor::arange(0u32, 24, &Device::Cpu).unwrap().unsqueeze(0).unwrap();
    let short = rope.table(&pos, None, DType::F32).unwrap();
    let e =
        abs_err(&short.cos.squeeze(2).unwrap(), &r["rope_short.cos"]).max(abs_err(&short.sin.squeeze(2).unwrap(), &r["rope_short.sin"]));
    assert!(e <= ROPE_TOL, "short factors: cos/sin abs err {e:e}");
    // The same positions inside a long sequence (a shard of it) take the long factors.
    let long = rope.table(&pos, Some(257), DType::F32).unwrap();
    assert!(abs_err(&long.cos, &short.cos) > 1e-3);
    let (_, att_short) = rope.inv_freq(256);
    let (_, att_long) = rope.inv_freq(257);
    let want = (1.0 + 4f64.ln() / 256f64.ln()).sqrt() as f32;
    assert_eq!((att_short, att_long), (want, want));
    assert_eq!(short.cos.get(0).unwrap().get(0).unwrap().max_all().unwrap().to_scalar::<f32>().unwrap(), want, "cos(0) = attention factor");
}

#[test]
fn golden_phi3_longrope() {
    golden("phi3_longrope");
    let f = load("phi3_longrope");
    assert_eq!(f.cfg.arch, longctx::model::Arch::Phi3);
    assert!(f.vars.contains_key("model.layers.0.self_attn.k_proj.weight") && f.vars.contains_key("model.layers.1.mlp.up_proj.weight"));
    assert!(!f.vars.keys().any(|k| k.contains("qkv_proj") || k.contains("gate_up_proj")), "fused names are split at load");
}

/// The export of a Phi-3 checkpoint writes the fused tensors transformers loads, equal
/// to the original bit for bit (split at load, concatenated at export); a partial rotary
/// factor is refused with the field named.
#[test]
fn phi3_export_fuses_the_projections_back() {
    let src = dir("phi3_longrope");
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    longctx::hub::export::ModelExport::from_model_dir(&src).unwrap().write(&out).unwrap();
    let want = safetensors::load(src.join("model.safetensors"), &Device::Cpu).unwrap();
    let got = safetensors::load(out.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut names: Vec<&String> = got.keys().collect();
    names.sort();
    let mut want_names: Vec<&String> = want.keys().collect();
    want_names.sort();
    assert_eq!(names, want_names);
    for (k, t) in &want {
        assert_eq!(abs_err(&got[k], t), 0.0, "{k}");
    }
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(src.join("config.json")).unwrap()).unwrap();
    cfg["rope_parameters"]["partial_rotary_factor"] = 0.75.into();
    let e = LlamaConfig::from_value(src.join("config.json"), cfg).unwrap_err().to_string();
    assert!(e.contains("rope_parameters.partial_rotary_factor") && e.contains("0.75"), "{e}");
}
