//! A transformers-made golden fixture (tests/fixtures/NAME: config.json, model.safetensors,
//! reference.safetensors from scripts/make_*fixtures.py) read for the golden tests, and the
//! error measures they assert with.

use candle_core::{safetensors, DType, Device, Tensor, Var};
use longctx::model::LlamaConfig;
use std::collections::HashMap;
use std::path::PathBuf;

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
