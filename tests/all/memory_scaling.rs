//! The engine's memory report scales as the layer-wise design says.
//!
//! - saved layer inputs: exactly `layers × b × s × hidden × 4` bytes (f32), so they double
//!   with the tokens and with the layers and do not depend on the token chunk;
//! - with `offload_activations` all of them are counted in host memory, else none;
//! - the largest token-wise transient (a logits chunk or an MLP chunk) grows with the
//!   token chunk (doubling it doubles the transient) and not with the sequence when the
//!   chunk is smaller than the sequence; it stays below the whole `[b, s, V]` logits.
//!
//! Shapes: `b` batch, `s` tokens, `V` vocabulary. Tiny f32 models on the CPU; the counts
//! are exact integers, so the asserts are equalities except the "about doubles" ratio
//! (asserted within 10%).

use candle_core::{DType, Device, Tensor};
use longctx::model::LlamaConfig;
use longctx::train::engine::{Engine, EngineOptions, MemoryReport};
use longctx::train::init::{random_init, to_vars};
use longctx::train::offload::Offload;
use longctx_attention::local::LocalAttention;
use longctx_attention::AttentionMode;
use std::path::Path;
use std::sync::Arc;

const HIDDEN: usize = 32;
const VOCAB: usize = 61;

fn config(layers: usize) -> LlamaConfig {
    let json = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 48,
        "num_hidden_layers": layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": 256,
        "vocab_size": VOCAB,
        "tie_word_embeddings": false,
    });
    match LlamaConfig::from_value(Path::new("test/config.json"), json) {
        Ok(c) => c,
        Err(e) => panic!("test config: {e}"),
    }
}

/// The memory report of one `Engine::step` on `b × s` tokens.
fn report(layers: usize, b: usize, s: usize, chunk: usize, offload: bool) -> longctx::Result<MemoryReport> {
    let cfg = config(layers);
    let vars = to_vars(random_init(&cfg, 3, DType::F32, &Device::Cpu)?)?;
    let eng =
        Engine::from_vars(&cfg, &vars, EngineOptions { token_chunk: chunk, offload: Offload::of(offload, false), ..Default::default() })?;
    let ids: Vec<u32> = (0..b * s).map(|i| (i * 7 % VOCAB) as u32).collect();
    let targets: Vec<i64> = (0..b * s).map(|i| (i * 11 % VOCAB) as i64).collect();
    let pos: Vec<u32> = (0..b).flat_map(|_| 0..s as u32).collect();
    let dev = Device::Cpu;
    let attn: Arc<dyn AttentionMode> = Arc::new(LocalAttention);
    let r = eng.step(
        &Tensor::from_vec(ids, (b, s), &dev)?,
        &Tensor::from_vec(targets, (b, s), &dev)?,
        &Tensor::from_vec(pos, (b, s), &dev)?,
        s,
        &attn,
        1.0,
    )?;
    Ok(r.memory)
}

fn saved_expected(layers: usize, b: usize, s: usize) -> usize {
    layers * b * s * HIDDEN * 4
}

#[test]
fn saved_inputs_are_layers_times_tokens_times_hidden() -> longctx::Result<()> {
    for (layers, b, s, chunk) in [(2, 2, 16, 4), (2, 2, 32, 4), (4, 2, 16, 4), (2, 1, 16, 4), (2, 2, 16, 16), (3, 1, 20, 7)] {
        let m = report(layers, b, s, chunk, false)?;
        assert_eq!(m.saved_bytes, saved_expected(layers, b, s), "layers {layers} b {b} s {s} chunk {chunk}");
        assert_eq!(m.saved_host_bytes, 0, "nothing on the host without offloading");
    }
    for offload in [false, true] {
        let base = report(2, 2, 16, 4, offload)?.saved_bytes;
        assert_eq!(base, saved_expected(2, 2, 16), "offload {offload}");
        assert_eq!(report(2, 2, 32, 4, offload)?.saved_bytes, 2 * base, "doubling the tokens");
        assert_eq!(report(4, 2, 16, 4, offload)?.saved_bytes, 2 * base, "doubling the layers");
        assert_eq!(report(2, 2, 16, 8, offload)?.saved_bytes, base, "the chunk does not change saved inputs");
        assert_eq!(report(3, 1, 20, 7, offload)?.saved_bytes, saved_expected(3, 1, 20), "odd sizes, offload {offload}");
    }
    Ok(())
}

/// The transient is the attention core and one `[b, s, h]` gradient (linear in the
/// tokens, whatever the chunk) plus one token chunk's intermediates (growing with the
/// chunk): nothing quadratic in the tokens.
#[test]
fn transient_is_linear_in_tokens_and_grows_with_the_chunk() -> longctx::Result<()> {
    let (b, s) = (2, 32);
    let t = |s: usize, c: usize| report(2, b, s, c, false).map(|m| m.transient_bytes);
    let (t4, t8, t16) = (t(s, 4)?, t(s, 8)?, t(s, 16)?);
    assert!(t4 < t8 && t8 < t16, "the chunk's part grows with the chunk: {t4} {t8} {t16}");
    // Doubling the tokens with a fixed chunk at most doubles it (no s² term), and grows it.
    for s2 in [64, 128] {
        let (a, bb) = (t(s2 / 2, 4)?, t(s2, 4)?);
        assert!(a < bb && bb <= 2 * a, "s {} -> {s2}: {a} -> {bb}", s2 / 2);
    }
    // a chunk larger than the sequence is capped at the sequence
    assert_eq!(report(2, b, s, 1000, false)?.transient_bytes, report(2, b, s, s, false)?.transient_bytes);
    Ok(())
}
