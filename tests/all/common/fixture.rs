//! A transformers-made golden fixture (tests/fixtures/NAME: config.json, model.safetensors,
//! reference.safetensors from scripts/make_*fixtures.py) read for the golden tests, and the
//! error measures they assert with.

use candle_core::{safetensors, DType, Device, Tensor, Var};
use longctx::attention::{local::LocalAttention, AttentionMode};
use longctx::model::{Llama, LlamaConfig};
use longctx::train::engine::{Engine, EngineOptions, LayerBackward};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;

/// The f32 tolerances of the golden tests, relative to the reference's scale (cos/sin
/// absolute): transformers and longctx sum in other orders, nothing more.
pub const ROPE_TOL: f32 = 1e-6;
pub const LOGIT_TOL: f32 = 5e-6;
pub const LOSS_TOL: f32 = 5e-6;
pub const GRAD_TOL: f32 = 2e-5;

pub fn dir(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures").join(name)
}

/// `max|a − b| / max|b|` (see `longctx_attention::testing::rel_err`).
pub fn rel_err(a: &Tensor, b: &Tensor) -> f32 {
    longctx_attention::testing::rel_err(a, b).unwrap() as f32
}

pub fn abs_err(a: &Tensor, b: &Tensor) -> f32 {
    assert_eq!(a.dims(), b.dims());
    a.sub(b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap()
}

pub struct Fixture {
    pub cfg: LlamaConfig,
    pub vars: HashMap<String, Var>,
    pub reference: HashMap<String, Tensor>,
}

/// The fixture's config, its weights through the checkpoint reader (which splits Phi-3's
/// fused projections) as f32 Vars, and transformers' reference tensors.
pub fn load(name: &str) -> Fixture {
    let d = dir(name);
    let cfg = LlamaConfig::from_file(d.join("config.json")).unwrap_or_else(|e| panic!("{name}: {e}"));
    let tensors = longctx::hub::Checkpoint::open(&d).unwrap().load_all(DType::F32, &Device::Cpu).unwrap();
    let vars = tensors.into_iter().map(|(k, t)| (k, Var::from_tensor(&t).unwrap())).collect();
    let reference = safetensors::load(d.join("reference.safetensors"), &Device::Cpu).unwrap();
    Fixture { cfg, vars, reference }
}

/// What [`check_against_reference`] measured: logits and per-token loss errors, and the
/// worst gradient error (with its parameter) of each backward path.
pub struct Measured {
    pub logits: f32,
    pub loss: f32,
    /// ("autograd" | "engine Explicit" | "engine Autograd", error, parameter)
    pub worst_grad: Vec<(String, f32, String)>,
}

impl std::fmt::Display for Measured {
    fn fmt(&self, out: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(out, "logits rel {:.1e}, loss rel {:.1e}, worst grad rel:", self.logits, self.loss)?;
        for (path, e, p) in &self.worst_grad {
            write!(out, " {path} {e:.1e} ({p})")?;
        }
        Ok(())
    }
}

/// The golden check every family shares, asserted within the tolerances above: the
/// model's parameter names are the checkpoint's tensors (what the export writes back);
/// `extra` checks the model first (e.g. its RoPE tables); logits, per-token loss, the
/// counted tokens and the SUM loss; every gradient through Candle's autograd (the model
/// API) and through the training engine's explicit layer backward (recomputing, and
/// keeping the attention and the MLP's projections from the forward) and its autograd
/// layer backward (global length 1024, as the trainer passes it for this batch).
pub fn check_against_reference(name: &str, f: &Fixture, extra: impl FnOnce(&Llama)) -> Measured {
    let r = &f.reference;
    let ids = r["input_ids"].to_dtype(DType::U32).unwrap();
    let pos = r["position_ids"].to_dtype(DType::U32).unwrap();
    let targets = r["targets"].clone();
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let opts = |lb| EngineOptions { token_chunk: 7, layer_backward: lb, ..Default::default() };
    let eng = Engine::from_vars(&f.cfg, &f.vars, opts(LayerBackward::Explicit)).unwrap_or_else(|e| panic!("{name}: {e}"));
    let model: &Llama = &eng.tracked;
    let mut names: Vec<String> = model.named_parameters().into_iter().map(|(n, _)| n).collect();
    let mut in_file: Vec<String> = f.vars.keys().cloned().collect();
    names.sort();
    in_file.sort();
    assert_eq!(names, in_file, "{name}: parameters vs checkpoint tensors (export writes these names)");
    extra(model);

    let logits = model.logits(&model.forward_hidden(&ids, &pos, &attn).unwrap()).unwrap();
    let e_logits = rel_err(&logits, &r["logits"]);
    assert!(e_logits <= LOGIT_TOL, "{name}: logits rel err {e_logits:e}");
    let (per_tok, n) = longctx::model::per_token_loss(&logits, &targets).unwrap();
    assert_eq!(n as i64, r["n_tokens"].to_scalar::<i64>().unwrap(), "{name}: counted tokens");
    let e_tok = rel_err(&per_tok, &r["per_token_loss"]);
    assert!(e_tok <= LOSS_TOL, "{name}: per-token loss rel err {e_tok:e}");
    let loss_sum = per_tok.sum_all().unwrap();
    assert!(rel_err(&loss_sum, &r["loss_sum"]) <= LOSS_TOL, "{name}: loss sum");

    let worst = |it: &mut dyn Iterator<Item = (String, &Tensor)>, path: &str| -> (String, f32, String) {
        let mut w = (path.to_string(), 0f32, String::new());
        for (pname, g) in it {
            let e = rel_err(g, &r[&format!("grad.{pname}")]);
            assert!(e <= GRAD_TOL, "{name}: {path} grad of {pname} rel err {e:e} > {GRAD_TOL:e}");
            if e > w.1 {
                (w.1, w.2) = (e, pname);
            }
        }
        w
    };
    let grads = loss_sum.backward().unwrap();
    let params = model.named_parameters();
    let mut auto = params.iter().map(|(p, t)| (p.clone(), grads.get(t).unwrap_or_else(|| panic!("{name}: no gradient for {p}"))));
    let mut worst_grad = vec![worst(&mut auto, "autograd")];
    let saved = EngineOptions { save_attention: true, save_mlp: true, ..opts(LayerBackward::Explicit) };
    for (what, o) in [("Explicit", opts(LayerBackward::Explicit)), ("Explicit, saved", saved), ("Autograd", opts(LayerBackward::Autograd))]
    {
        let eng = Engine::from_vars(&f.cfg, &f.vars, o).unwrap();
        let out = eng.step(&ids, &targets, &pos, 1024, &attn, 1.0).unwrap();
        let want = r["loss_sum"].to_scalar::<f32>().unwrap();
        assert!((out.loss_sum as f32 - want).abs() <= LOSS_TOL * want.abs(), "{name}: engine ({what}) loss {} vs {want}", out.loss_sum);
        let mut it = eng.params.iter().zip(&out.grads).map(|((p, _), g)| (p.clone(), g));
        worst_grad.push(worst(&mut it, &format!("engine {what}")));
    }
    Measured { logits: e_logits, loss: e_tok, worst_grad }
}
