//! Built-in models (no download): configs embedded in the binary and a seeded random
//! initialisation as transformers does it (`normal(0, initializer_range)` for linear
//! and embedding weights, zeros for biases, ones for RMSNorm weights).

use crate::model::LlamaConfig;
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::path::Path;

/// The names `builtin:<name>` accepts.
pub const BUILTINS: &str = "tiny, tinyllama-1.1b-shape, llama2-7b-shape (each with an optional `@layers=N`)";

/// `config.json` of a built-in model; `NAME@layers=N` cuts (or extends) it to `N`
/// decoder layers (memory and speed checks at a length where all layers would be slow).
pub fn builtin_config_json(name: &str) -> Result<serde_json::Value> {
    let Some((base, layers)) = name.split_once("@layers=") else { return builtin_base_json(name) };
    let n: usize = match layers.parse() {
        Ok(n) if (1..=1024).contains(&n) => n,
        _ => {
            return Err(Error::config(
                "--model",
                "model.source",
                format!("`builtin:{name}`: `@layers=` takes a layer count from 1 to 1024, got `{layers}`"),
            ))
        }
    };
    let mut json = builtin_base_json(base)?;
    json["num_hidden_layers"] = serde_json::json!(n);
    Ok(json)
}

fn builtin_base_json(name: &str) -> Result<serde_json::Value> {
    match name {
        // ~0.4M parameters: trains on 2 CPU cores in about a minute per stage of the demo.
        "tiny" => Ok(serde_json::json!({
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 176,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 256,
            "vocab_size": 256,
            "tie_word_embeddings": false,
            "attention_bias": false,
            "initializer_range": 0.02,
            "bos_token_id": 1,
            "eos_token_id": 2,
            "torch_dtype": "float32"
        })),
        // Shapes of TinyLlama-1.1B and Llama-2-7B with random weights: for benchmarks and
        // memory planning without downloading the real checkpoints.
        "tinyllama-1.1b-shape" => Ok(serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 2048, "vocab_size": 32000,
            "tie_word_embeddings": false, "initializer_range": 0.02,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"
        })),
        "llama2-7b-shape" => Ok(serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 32, "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0, "max_position_embeddings": 4096, "vocab_size": 32000,
            "tie_word_embeddings": false, "initializer_range": 0.02,
            "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float16"
        })),
        _ => Err(Error::config("--model", "model.source", format!("unknown built-in model `builtin:{name}`; available: {BUILTINS}"))),
    }
}

pub fn builtin_config(name: &str) -> Result<LlamaConfig> {
    LlamaConfig::from_value(Path::new(&format!("builtin:{name}/config.json")), builtin_config_json(name)?)
}

/// Names and shapes of every parameter of a config (tied head omitted).
pub fn parameter_shapes(cfg: &LlamaConfig) -> Vec<(String, Vec<usize>)> {
    let (h, i, v, d) = (cfg.hidden_size, cfg.intermediate_size, cfg.vocab_size, cfg.head_dim);
    let (hq, hkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
    let mut out = vec![("model.embed_tokens.weight".to_string(), vec![v, h])];
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        // In `Llama::named_parameters` order: each projection's weight, then its bias.
        let projections = [
            ("self_attn.q_proj", hq * d, h, cfg.qkv_bias()),
            ("self_attn.k_proj", hkv * d, h, cfg.qkv_bias()),
            ("self_attn.v_proj", hkv * d, h, cfg.qkv_bias()),
            ("self_attn.o_proj", h, hq * d, cfg.o_bias()),
            ("mlp.gate_proj", i, h, cfg.has_mlp_bias()),
            ("mlp.up_proj", i, h, cfg.has_mlp_bias()),
            ("mlp.down_proj", h, i, cfg.has_mlp_bias()),
        ];
        for (name, rows, cols, bias) in projections {
            out.push((format!("{p}.{name}.weight"), vec![rows, cols]));
            if bias {
                out.push((format!("{p}.{name}.bias"), vec![rows]));
            }
            if name == "self_attn.o_proj" && cfg.qk_norm() {
                out.push((format!("{p}.self_attn.q_norm.weight"), vec![d]));
                out.push((format!("{p}.self_attn.k_norm.weight"), vec![d]));
            }
        }
        out.push((format!("{p}.input_layernorm.weight"), vec![h]));
        out.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
        if cfg.gemma_block() {
            out.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h]));
            out.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h]));
        }
    }
    out.push(("model.norm.weight".to_string(), vec![h]));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".to_string(), vec![v, h]));
    }
    out
}

/// Seeded random weights (same seed → same bits on every rank and run). Each tensor has
/// its own generator, seeded from `seed` and the tensor's index, so tensors are filled in
/// parallel.
pub fn random_init(cfg: &LlamaConfig, seed: u64, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    use rayon::prelude::*;
    let std = match cfg.extra.get("initializer_range").filter(|v| !v.is_null()) {
        None => 0.02,
        Some(v) => match v.as_f64() {
            Some(x) if x.is_finite() && x > 0.0 && x <= 1.0 => x,
            _ => return Err(Error::config(cfg.source(), "initializer_range", format!("got {v}, expected a number in (0, 1]"))),
        },
    };
    let shapes = parameter_shapes(cfg);
    let filled: Vec<(String, Vec<usize>, Vec<f32>)> = shapes
        .into_par_iter()
        .enumerate()
        .map(|(i, (name, shape))| {
            let n: usize = shape.iter().product();
            let data: Vec<f32> = if name.ends_with("norm.weight") {
                // Gemma's norms apply 1 + w: the unit norm is w = 0 (as transformers initialises).
                vec![if cfg.gemma_block() { 0.0 } else { 1.0 }; n]
            } else if name.ends_with(".bias") {
                vec![0.0; n]
            } else {
                let mut rng = rand::rngs::StdRng::seed_from_u64(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(i as u64));
                (0..n)
                    .map(|_| {
                        // Box–Muller.
                        let u1: f64 = rng.random::<f64>().max(1e-300);
                        let u2: f64 = rng.random::<f64>();
                        ((-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos() * std) as f32
                    })
                    .collect()
            };
            (name, shape, data)
        })
        .collect();
    let mut out = HashMap::new();
    for (name, shape, data) in filled {
        out.insert(name, Tensor::from_vec(data, shape, &Device::Cpu)?.to_dtype(dtype)?.to_device(device)?);
    }
    Ok(out)
}

/// Turn weights into Vars (the tensors the optimizer updates in place).
pub fn to_vars(weights: HashMap<String, Tensor>) -> Result<HashMap<String, Var>> {
    weights.into_iter().map(|(n, t)| Ok((n, Var::from_tensor(&t)?))).collect()
}
