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
            let w = crate::train::init::random_init(&m.cfg, 0, dtype, device)?;
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
