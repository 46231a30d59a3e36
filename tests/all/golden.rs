//! The model against Hugging Face transformers: logits, per-token loss, RoPE cos/sin and
//! the gradient of the SUM loss w.r.t. every parameter, on the fixtures that
//! `scripts/make_fixtures.py` generated (tiny random checkpoints, f32, CPU).
//!
//! Errors are measured relative to the reference's scale: `max|ours − ref| / max|ref|`.
//! Tolerances (f32 on both sides; what remains is summation order and libm vs torch's
//! vectorised transcendentals). Measured (see the report printed with --nocapture):
//! cos/sin ≤ 1.2e-7, logits ≤ 7.2e-7, loss ≤ 2.9e-7, gradients ≤ 2.5e-6 (Candle's autograd and
//! the training engine's explicit and autograd backward, `common::fixture`). Asserted:
//! - RoPE cos/sin: 1e-6 absolute (angles reach ~1000 rad: an error in `inv_freq` or in
//!   the position arithmetic shows up far above this);
//! - logits, per-token loss, loss sum, mean loss: 5e-6 relative;
//! - gradients: 2e-5 relative, per parameter.

use candle_core::{safetensors, DType, Device, Tensor, Var};
use candle_nn::{VarBuilder, VarMap};
use longctx::attention::{local::LocalAttention, AttentionMode};
use longctx::model::{Llama, LlamaConfig};
use std::sync::Arc;

use crate::common;
use common::fixture::*;

const ALL: &[&str] = &["llama_mha", "llama_gqa_bias", "qwen2_tied", "llama3_rope", "mistral_linear", "llama_dynamic", "llama_yarn"];

/// The fixture's model with every parameter a Var of the fixture (so gradients reach them).
fn model(f: &Fixture) -> Llama {
    let varmap = VarMap::new();
    varmap.data().lock().unwrap().extend(f.vars.iter().map(|(k, v)| (k.clone(), v.clone())));
    Llama::load(VarBuilder::from_varmap(&varmap, DType::F32, &Device::Cpu), &f.cfg).unwrap()
}

fn inputs(f: &Fixture) -> (Tensor, Tensor, Tensor) {
    let r = &f.reference;
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let pos = r["position_ids"].to_dtype(DType::U32).unwrap();
    (ids, pos, r["targets"].clone())
}

/// The shared golden check (names, logits, loss, counted tokens, every gradient through
/// autograd and both engine backwards), and first the RoPE tables, the mean loss and the
/// whole-model `Llama::loss`; prints the measured errors.
fn golden(name: &str) {
    let f = load(name);
    let r = &f.reference;
    let (ids, pos, targets) = inputs(&f);
    let mut rope = (0.0, 0.0);
    let m = check_against_reference(name, &f, |model| {
        let table = model.rope_table(&pos, None).unwrap();
        let e_cos = abs_err(&table.cos.squeeze(2).unwrap(), &r["rope.cos"]);
        let e_sin = abs_err(&table.sin.squeeze(2).unwrap(), &r["rope.sin"]);
        assert!(e_cos <= ROPE_TOL && e_sin <= ROPE_TOL, "{name}: rope cos err {e_cos:e}, sin err {e_sin:e} > {ROPE_TOL:e}");
        rope = (e_cos, e_sin);
        let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
        let (api_sum, n) = model.loss(&ids, &targets, &pos, &attn).unwrap();
        assert!(rel_err(&api_sum, &r["loss_sum"]) <= LOSS_TOL, "{name}: Llama::loss differs");
        let mean = api_sum.to_scalar::<f32>().unwrap() / n as f32;
        let ref_mean = r["loss_mean"].to_scalar::<f32>().unwrap();
        assert!((mean - ref_mean).abs() <= LOSS_TOL * ref_mean.abs(), "{name}: mean loss {mean} vs {ref_mean}");
    });
    println!("{name}: rope cos/sin abs {:.1e}/{:.1e}, {m}", rope.0, rope.1);
}

#[test]
fn golden_llama_mha() {
    golden("llama_mha");
}

#[test]
fn golden_llama_gqa_bias() {
    golden("llama_gqa_bias");
}

#[test]
fn golden_qwen2_tied() {
    golden("qwen2_tied");
}

#[test]
fn golden_llama3_rope() {
    golden("llama3_rope");
}

#[test]
fn golden_mistral_linear_rope() {
    golden("mistral_linear");
}

#[test]
fn golden_llama_dynamic_rope() {
    golden("llama_dynamic");
}

#[test]
fn golden_llama_yarn_rope() {
    golden("llama_yarn");
}

/// Every parameter (every tensor of the checkpoint, and every gradient the reference
/// has) gets a finite, non-zero gradient through Candle's backward: nothing silently
/// cuts the graph (rotary_emb, softmax_last_dim, rms_norm would).
#[test]
fn every_parameter_gets_a_nonzero_gradient() {
    for name in ALL {
        let f = load(name);
        let (ids, pos, targets) = inputs(&f);
        let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
        let llama = model(&f);
        let (loss, _) = llama.loss(&ids, &targets, &pos, &attn).unwrap();
        let grads = loss.backward().unwrap();
        let params = llama.named_parameters();
        let mut names: Vec<&String> = params.iter().map(|(n, _)| n).collect();
        names.sort();
        let mut in_file: Vec<&String> = f.vars.keys().collect();
        in_file.sort();
        assert_eq!(names, in_file, "{name}: parameters vs checkpoint tensors");
        let n_ref = f.reference.keys().filter(|k| k.starts_with("grad.")).count();
        assert_eq!(params.len(), n_ref, "{name}: parameters vs reference gradients");
        for (pname, t) in &params {
            let g = grads.get(t).unwrap_or_else(|| panic!("{name}: {pname} gets no gradient"));
            let m = g.abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(m.is_finite() && m > 0.0, "{name}: {pname} has gradient max |g| = {m}");
        }
    }
}

/// A checkpoint tensor of the wrong shape is reported with its name and both shapes.
#[test]
fn shape_mismatch_names_the_tensor() {
    let d = dir("llama_mha");
    let cfg = LlamaConfig::from_file(d.join("config.json")).unwrap();
    let original = safetensors::load(d.join("model.safetensors"), &Device::Cpu).unwrap();
    let mut tensors = original.clone();
    let key = "model.layers.1.self_attn.k_proj.weight";
    tensors.insert(key.into(), Tensor::zeros((32, 64), DType::F32, &Device::Cpu).unwrap());
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let msg = Llama::load(vb, &cfg).unwrap_err().to_string();
    assert!(msg.contains(key) && msg.contains("[64, 64]") && msg.contains("[32, 64]"), "{msg}");
    assert!(msg.contains("llama_mha"), "names the checkpoint folder: {msg}");

    // A missing tensor (everything else intact) is named too.
    let mut tensors = original;
    tensors.remove("model.norm.weight");
    let vb = VarBuilder::from_tensors(tensors, DType::F32, &Device::Cpu);
    let msg = Llama::load(vb, &cfg).unwrap_err().to_string();
    assert!(msg.contains("model.norm.weight"), "{msg}");
}

/// The masked cross-entropy on its own, against a host f64 computation: value, count,
/// gradient (softmax − one-hot on counted rows, 0 on ignored rows), and bad targets.
/// Tolerance 1e-6 absolute (values of order 1, f32).
#[test]
fn masked_cross_entropy_matches_a_naive_reference() {
    let v = 5usize;
    let raw: Vec<f32> = (0..3 * v).map(|i| ((i * 7 % 11) as f32 - 5.0) * 0.7).collect();
    let logits = Var::from_vec(raw.clone(), (1, 3, v), &Device::Cpu).unwrap();
    let targets = Tensor::new(&[[-100i64, 2, 4]], &Device::Cpu).unwrap();
    let (per_tok, n) = longctx::model::per_token_loss(logits.as_tensor(), &targets).unwrap();
    assert_eq!(n, 2);
    let got: Vec<f32> = per_tok.flatten_all().unwrap().to_vec1().unwrap();
    let grads = per_tok.sum_all().unwrap().backward().unwrap();
    let g: Vec<f32> = grads.get(logits.as_tensor()).unwrap().flatten_all().unwrap().to_vec1().unwrap();
    for (row, t) in [(0usize, None), (1, Some(2usize)), (2, Some(4))] {
        let x: Vec<f64> = raw[row * v..(row + 1) * v].iter().map(|&a| a as f64).collect();
        let lse = x.iter().map(|a| a.exp()).sum::<f64>().ln();
        let want = t.map_or(0.0, |t| lse - x[t]);
        assert!((got[row] as f64 - want).abs() <= 1e-6, "row {row}: {} vs {want}", got[row]);
        for j in 0..v {
            let want_g = t.map_or(0.0, |t| (x[j] - lse).exp() - if j == t { 1.0 } else { 0.0 });
            assert!((g[row * v + j] as f64 - want_g).abs() <= 1e-6, "grad row {row} col {j}: {} vs {want_g}", g[row * v + j]);
        }
    }
    let bad = Tensor::new(&[[0i64, 5, 1]], &Device::Cpu).unwrap();
    let msg = longctx::model::per_token_loss(logits.as_tensor(), &bad).unwrap_err().to_string();
    assert!(msg.contains('5') && msg.contains("vocab_size"), "{msg}");
    let none = Tensor::new(&[[-100i64, -100, -100]], &Device::Cpu).unwrap();
    let (s, n) = longctx::model::cross_entropy_sum(logits.as_tensor(), &none).unwrap();
    assert_eq!((s.to_scalar::<f32>().unwrap(), n), (0.0, 0));
}

/// Dynamic NTK leaves RoPE untouched while max(position) + 1 <= max_position_embeddings,
/// and rescales it past that (the fixture covers the rescaled values against HF);
/// an explicit global length overrides the one inferred from the positions (shards).
#[test]
fn dynamic_rope_depends_on_the_global_length() {
    let cfg = LlamaConfig::from_file(dir("llama_dynamic").join("config.json")).unwrap();
    let mut plain = cfg.clone();
    plain.rope_scaling = None;
    let (dynamic, plain) = (longctx::model::Rope::new(&cfg), longctx::model::Rope::new(&plain));
    let pos = Tensor::new(&[[0u32, 1, 100, 255]], &Device::Cpu).unwrap();
    let a = dynamic.table(&pos, None, DType::F32).unwrap();
    let b = plain.table(&pos, None, DType::F32).unwrap();
    assert_eq!(abs_err(&a.cos, &b.cos), 0.0);
    let c = dynamic.table(&pos, Some(4096), DType::F32).unwrap();
    assert!(abs_err(&c.cos, &b.cos) > 1e-2, "a 4096-token sequence must rescale the base");
    assert_eq!(dynamic.inv_freq(256), plain.inv_freq(256));
    assert_ne!(dynamic.inv_freq(257), plain.inv_freq(257));
}
