//! Helpers shared by the engine-level tests: a small test model and token batches.
#![allow(dead_code)]

use candle_core::{Device, Tensor};
use longctx::model::{LlamaConfig, IGNORE_INDEX};
use std::path::Path;

/// The test model (2 layers, 4/2 heads × 8, vocab 61); `dynamic_rope`: dynamic NTK RoPE
/// with max_position_embeddings 16, so the rotary base depends on the global length.
pub fn small_config(dynamic_rope: bool) -> LlamaConfig {
    let mut json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": 32,
        "intermediate_size": 48,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 64,
        "vocab_size": 61,
        "tie_word_embeddings": false,
        "initializer_range": 0.2,
    });
    if dynamic_rope {
        json["max_position_embeddings"] = 16.into();
        json["rope_scaling"] = serde_json::json!({"rope_type": "dynamic", "factor": 2.0});
    }
    match LlamaConfig::from_value(Path::new("test/config.json"), json) {
        Ok(c) => c,
        Err(e) => panic!("test config: {e}"),
    }
}

/// `ids [b, s]` u32 and shifted targets `[b, s]` i64 from a xorshift stream seeded by
/// `seed`; `masked(row, t)` → ignored target.
pub fn token_batch(b: usize, s: usize, vocab: usize, seed: u64, masked: impl Fn(usize, usize) -> bool) -> longctx::Result<(Tensor, Tensor)> {
    let mut state = seed | 1;
    let mut raw = Vec::new();
    for _ in 0..b * (s + 1) {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        raw.push((state % vocab as u64) as u32);
    }
    let (mut x, mut y) = (Vec::new(), Vec::new());
    for r in 0..b {
        for t in 0..s {
            x.push(raw[r * (s + 1) + t]);
            y.push(if masked(r, t) { IGNORE_INDEX } else { raw[r * (s + 1) + t + 1] as i64 });
        }
    }
    Ok((Tensor::from_vec(x, (b, s), &Device::Cpu)?, Tensor::from_vec(y, (b, s), &Device::Cpu)?))
}

/// `max|got − want| / max|want|` (the absolute difference when `want` is all zeros; a NaN
/// gives infinity): the attention crate's one definition.
pub fn rel_err(got: &Tensor, want: &Tensor) -> longctx::Result<f64> {
    Ok(longctx_attention::testing::rel_err(got, want)?)
}
