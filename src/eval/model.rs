//! A checkpoint to evaluate: any model the toolkit loads (a local directory, a hub id, a
//! run's export, or `builtin:NAME` with its seeded random init), its tokenizer when it has
//! one, and the context length it was trained for (`max_position_embeddings` in
//! config.json).

use std::path::PathBuf;

use candle_core::{DType, Device};
use candle_nn::VarBuilder;

use crate::hub::{resolve_model_config, Checkpoint, HubOptions};
use crate::model::{Llama, LlamaConfig, RopeScaling};
use crate::{Error, Result};

/// A loaded model and what an evaluation reports about it.
pub struct EvalModel {
    /// The `--model` value it was loaded from (the label in tables and plots).
    pub name: String,
    pub model: Llama,
    /// `tokenizer.json` of the model directory (truncation and padding off), if any.
    pub tokenizer: Option<tokenizers::Tokenizer>,
    /// The model directory (`None` for a built-in model).
    pub dir: Option<PathBuf>,
}

impl EvalModel {
    /// Loads `spec` on `device` in `dtype`. A built-in model gets its seeded random init
    /// (seed 0): useful only to check the plumbing.
    pub fn load(spec: &str, device: &Device, dtype: DType, hub: &HubOptions) -> Result<Self> {
        let m = resolve_model_config(spec, hub)?;
        let Some(dir) = m.dir else {
            let w = crate::model::init::random_init(&m.cfg, 0, dtype, device)?;
            let model = Llama::load(VarBuilder::from_tensors(w, dtype, device), &m.cfg)?;
            return Ok(Self { name: spec.to_string(), model, tokenizer: None, dir: None });
        };
        let model = Llama::load(Checkpoint::open(&dir)?.var_builder(dtype, device), &m.cfg)?;
        let tokenizer = if dir.join(crate::hub::tokenizer::TOKENIZER_FILE).is_file() {
            let mut t = crate::hub::load_tokenizer(&dir)?;
            t.with_truncation(None).map_err(|e| Error::checkpoint(&dir, format!("tokenizer: cannot turn truncation off: {e}")))?;
            t.with_padding(None);
            Some(t)
        } else {
            None
        };
        Ok(Self { name: spec.to_string(), model, tokenizer, dir: Some(dir) })
    }

    pub fn cfg(&self) -> &LlamaConfig {
        &self.model.cfg
    }

    /// The context length it was trained for: `max_position_embeddings` of config.json.
    pub fn trained_context(&self) -> usize {
        self.cfg().max_position_embeddings
    }

    /// The longest context its RoPE is meant for: the trained context, or with rope
    /// scaling the original context times the factor when that is larger.
    pub fn max_context(&self) -> usize {
        let c = self.cfg();
        let Some(sc) = &c.rope_scaling else { return c.max_position_embeddings };
        let original = match sc {
            RopeScaling::Yarn { original_max_position_embeddings: Some(o), .. } => *o,
            RopeScaling::Llama3 { original_max_position_embeddings: o, .. } => *o,
            _ => c.max_position_embeddings,
        };
        c.max_position_embeddings.max((original as f64 * sc.factor()) as usize)
    }

    /// A one-line description: name, trained context, RoPE.
    pub fn describe(&self) -> String {
        let c = self.cfg();
        let scaling = c.rope_scaling.as_ref().map(|s| format!(", rope_scaling {} ×{}", s.type_name(), s.factor())).unwrap_or_default();
        format!(
            "{}: trained context {} tokens (max_position_embeddings), rope_theta {}{scaling}, vocab {}, {}",
            self.name,
            c.max_position_embeddings,
            c.rope_theta,
            c.vocab_size,
            if self.tokenizer.is_some() { "tokenizer.json" } else { "no tokenizer (token ids)" }
        )
    }

    /// Checks that `len` tokens are within what the model is meant for, unless
    /// `allow_extrapolation`. `flag` names the option that set the length.
    pub fn check_length(&self, len: usize, allow_extrapolation: bool, flag: &str) -> Result<()> {
        let max = self.max_context();
        if len > max && !allow_extrapolation {
            let why = if self.cfg().rope_scaling.is_some() {
                "its context with rope scaling"
            } else {
                "its trained context and it has no rope scaling"
            };
            return Err(Error::config(
                flag,
                flag.trim_start_matches("--"),
                format!(
                    "length {len} is beyond {} tokens, {why} ({}); use lengths up to {max}, or pass \
                     --allow-extrapolation to measure past it (e.g. where a base model breaks down)",
                    max, self.name
                ),
            ));
        }
        Ok(())
    }
}

/// The device named by `--device` (`cpu`, `cuda`, `cuda:N`) and the dtype to run in: f32
/// on the CPU (CPU bf16 matmuls round-trip through f32), `dtype` on a GPU.
pub fn device_and_dtype(device: &str, dtype: DType) -> Result<(Device, DType)> {
    let dev = crate::device::parse_device(device, std::path::Path::new("--device"))?;
    let dt = if dev.is_cpu() { DType::F32 } else { dtype };
    Ok((dev, dt))
}

/// What an evaluation of one model keeps in memory at least (bytes): its weights, the
/// activations of one layer over one window, and the KV cache of a generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvalMemory {
    pub weights: u64,
    pub activations: u64,
    pub kv_cache: u64,
}

/// [`EvalMemory`] of `cfg` in `dtype` for a forward over `window` tokens and a KV cache of
/// `kv_tokens` tokens, with checked arithmetic. A lower bound: per token, the ids and
/// targets, the residual stream in and out of a layer, q/k/v/o and the three MLP
/// activations of one layer; per cached token, k and v of every layer. The per-token
/// and weight counts are checked (an error on overflow), the token products saturate.
pub fn eval_memory(cfg: &LlamaConfig, dtype: DType, window: u64, kv_tokens: u64) -> Result<EvalMemory> {
    use crate::limits::{add, mul};
    let what = "the evaluation's memory estimate";
    let b = dtype.size_in_bytes() as u64;
    let w = |x: usize| x as u64;
    let (h, i, d) = (w(cfg.hidden_size), w(cfg.intermediate_size), w(cfg.head_dim));
    let (hq, hkv) = (w(cfg.num_attention_heads), w(cfg.num_key_value_heads));
    let qkvo = add(what, &[mul(what, &[2, hq, d])?, mul(what, &[2, hkv, d])?])?;
    let per_token = add(what, &[12, mul(what, &[b, add(what, &[mul(what, &[2, h])?, qkvo, mul(what, &[3, i])?])?])?])?;
    let kv_per_token = mul(what, &[w(cfg.num_hidden_layers), 2, hkv, d, b])?;
    Ok(EvalMemory {
        weights: mul(what, &[cfg.param_count()?, b])?,
        // Saturating: a count past 64 bits is past any memory (and past the positions,
        // which `check_eval_size` reports first).
        activations: window.saturating_mul(per_token),
        kv_cache: kv_tokens.saturating_mul(kv_per_token),
    })
}

/// The memory an evaluation can use on `device` (`cpu`: host memory available now;
/// a GPU: its total memory), `None` where unknown.
pub fn eval_memory_available(device: &str) -> Result<Option<u64>> {
    if device.trim() == "cpu" {
        return Ok(crate::device::host_available());
    }
    crate::device::gpu_memory(device, std::path::Path::new("--device"))
}

/// Refuses, before anything is allocated, an evaluation that cannot run: `tokens` (a
/// window, or prompt + new tokens) beyond the positions a model can take (u32, 2³¹), or
/// `need` beyond `have` bytes. `flag` is the option that set the size, `fix` how to
/// lower it.
pub fn check_eval_size(tokens: u64, need: &[(&str, u64)], have: Option<u64>, device: &str, flag: &str, fix: &str) -> Result<()> {
    let key = flag.trim_start_matches("--");
    let max = crate::limits::MAX_SEQ_LEN as u64;
    if tokens > max {
        return Err(Error::config(
            flag,
            key,
            format!("{tokens} tokens is beyond {max}, the most one sequence can hold (positions are 32-bit); {fix}"),
        ));
    }
    let total = need.iter().fold(0u64, |acc, p| acc.saturating_add(p.1));
    let Some(have) = have else { return Ok(()) };
    if total > have {
        let gb = |b: u64| format!("{:.1} GB", b as f64 / 1e9);
        let parts = need.iter().filter(|p| p.1 > 0).map(|(n, b)| format!("{n} {}", gb(*b))).collect::<Vec<_>>().join(", ");
        let on = if device.trim() == "cpu" { "host memory available".to_string() } else { format!("memory on {device}") };
        return Err(Error::config(
            flag,
            key,
            format!("{tokens} tokens need at least {} ({parts}) but there are {} of {on}; {fix}", gb(total), gb(have)),
        ));
    }
    Ok(())
}
