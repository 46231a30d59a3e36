//! `config.json` of a Llama-family checkpoint (llama, mistral, qwen2, qwen3, phi3, gemma3_text),
//! as Hugging Face transformers reads it.
//!
//! Parsing goes field by field through `serde_json::Value`, so every error names the file,
//! the field and what was expected. Fields this crate does not use are kept verbatim in
//! [`LlamaConfig::extra`] and written back unchanged by [`LlamaConfig::to_json_value`].

use crate::error::{Error, Result};
use serde::ser::SerializeMap;
use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};
use std::path::{Path, PathBuf};

/// The architectures whose blocks this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Arch {
    Llama,
    Mistral,
    Qwen2,
    /// Qwen3: a per-head RMSNorm on q and k (`q_norm`, `k_norm` of size head_dim) before
    /// RoPE; biases as Llama's `attention_bias`.
    Qwen3,
    /// Phi-3 / Phi-3.5: a Llama block without biases whose checkpoint fuses q/k/v into
    /// `qkv_proj` and gate/up into `gate_up_proj` (split at load by [`crate::hub::Checkpoint`],
    /// fused again at export); LongRoPE in its config. `partial_rotary_factor` must be 1.
    Phi3,
    /// Gemma 3 text (`gemma3_text`, `Gemma3ForCausalLM`): RMSNorms that scale by `1 + w` in
    /// f32, four of them per layer (around attention and MLP), per-head q/k norms, GeGLU
    /// with the tanh GELU, the embedding scaled by `sqrt(hidden_size)`, attention scale
    /// `query_pre_attn_scalar^-1/2`, and sliding-window layers with their own RoPE base.
    Gemma3,
}

/// Supported values, for error messages.
const SUPPORTED: &str = "llama, mistral, qwen2, qwen3, phi3, gemma3_text (LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
     Qwen3ForCausalLM, Phi3ForCausalLM, Gemma3ForCausalLM)";

impl Arch {
    pub fn model_type(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Mistral => "mistral",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Phi3 => "phi3",
            Arch::Gemma3 => "gemma3_text",
        }
    }
    fn from_model_type(s: &str) -> Option<Self> {
        match s {
            "llama" => Some(Arch::Llama),
            "mistral" => Some(Arch::Mistral),
            "qwen2" => Some(Arch::Qwen2),
            "qwen3" => Some(Arch::Qwen3),
            "phi3" => Some(Arch::Phi3),
            "gemma3_text" => Some(Arch::Gemma3),
            _ => None,
        }
    }
    fn from_architecture(s: &str) -> Option<Self> {
        match s {
            "LlamaForCausalLM" => Some(Arch::Llama),
            "MistralForCausalLM" => Some(Arch::Mistral),
            "Qwen2ForCausalLM" => Some(Arch::Qwen2),
            "Qwen3ForCausalLM" => Some(Arch::Qwen3),
            "Phi3ForCausalLM" => Some(Arch::Phi3),
            "Gemma3ForCausalLM" => Some(Arch::Gemma3),
            _ => None,
        }
    }
}

/// `rope_scaling` (key `type` or `rope_type`), the variants transformers implements for Llama.
/// Optional fields are `None` when absent; transformers' defaults are applied in [`super::rope`].
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Position interpolation: `inv_freq / factor`.
    Linear { factor: f64 },
    /// Dynamic NTK: the base grows with the sequence length past `max_position_embeddings`.
    Dynamic { factor: f64 },
    /// YaRN: ramped interpolation between extrapolated and interpolated frequencies,
    /// cos/sin scaled by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: Option<usize>,
        beta_fast: Option<f64>,
        beta_slow: Option<f64>,
        mscale: Option<f64>,
        mscale_all_dim: Option<f64>,
        attention_factor: Option<f64>,
        truncate: Option<bool>,
    },
    /// Llama 3.x: low frequencies divided by `factor`, a smooth band in between.
    Llama3 { factor: f64, low_freq_factor: f64, high_freq_factor: f64, original_max_position_embeddings: usize },
    /// LongRoPE (Phi-3): per-frequency divisors, `short_factor` while the sequence fits in
    /// `original_max_position_embeddings`, `long_factor` past it (each `head_dim / 2`
    /// long); cos/sin scaled by `attention_factor` (default
    /// `sqrt(1 + ln(factor) / ln(original_max_position_embeddings))`, 1 when factor ≤ 1).
    /// `factor` is resolved at parse time: the one given, else `max_position_embeddings /
    /// original_max_position_embeddings` as transformers does.
    LongRope {
        factor: f64,
        short_factor: Vec<f64>,
        long_factor: Vec<f64>,
        attention_factor: Option<f64>,
        original_max_position_embeddings: usize,
    },
}

/// The RoPE types [`RopeScaling`] implements (`default` is no scaling), for error messages.
pub const ROPE_TYPES: &str = "default, linear, dynamic, yarn, llama3, longrope";

impl RopeScaling {
    pub fn type_name(&self) -> &'static str {
        match self {
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Dynamic { .. } => "dynamic",
            RopeScaling::Yarn { .. } => "yarn",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::LongRope { .. } => "longrope",
        }
    }
    pub fn factor(&self) -> f64 {
        match self {
            RopeScaling::Linear { factor }
            | RopeScaling::Dynamic { factor }
            | RopeScaling::Yarn { factor, .. }
            | RopeScaling::Llama3 { factor, .. }
            | RopeScaling::LongRope { factor, .. } => *factor,
        }
    }

    /// The pretrained context the method scales from, when it names one.
    pub fn original_max_position_embeddings(&self) -> Option<usize> {
        match self {
            RopeScaling::Linear { .. } | RopeScaling::Dynamic { .. } => None,
            RopeScaling::Yarn { original_max_position_embeddings, .. } => *original_max_position_embeddings,
            RopeScaling::Llama3 { original_max_position_embeddings, .. }
            | RopeScaling::LongRope { original_max_position_embeddings, .. } => Some(*original_max_position_embeddings),
        }
    }
}

/// `head_dim` of a Qwen3 config that does not set it (transformers' `Qwen3Config` default).
const QWEN3_HEAD_DIM: usize = 128;

/// Gemma3TextConfig's defaults: `head_dim`, `max_position_embeddings`, the RoPE bases of
/// the full-attention and the sliding layers, `query_pre_attn_scalar`, the layer pattern
/// (every 6th layer global) when `layer_types` is absent.
const GEMMA3_HEAD_DIM: usize = 256;
const GEMMA3_MAX_POS: usize = 131_072;
const GEMMA3_THETA: f64 = 1_000_000.0;
const GEMMA3_LOCAL_THETA: f64 = 10_000.0;
const GEMMA3_QUERY_PRE_ATTN_SCALAR: f64 = 256.0;
const GEMMA3_PATTERN: usize = 6;
const GEMMA3_SLIDING_WINDOW: usize = 4096;

/// The RoPE of Gemma 3's sliding-window layers (`rope_local_base_freq`, or
/// `rope_parameters.sliding_attention` as transformers 5 writes it).
#[derive(Debug, Clone, PartialEq)]
pub struct LocalRope {
    pub theta: f64,
    pub scaling: Option<RopeScaling>,
}

/// The model configuration. Sizes are resolved (defaults applied) at parse time.
#[derive(Debug, Clone, PartialEq)]
pub struct LlamaConfig {
    pub arch: Arch,
    /// `architectures` as written (absent stays absent).
    pub architectures: Option<Vec<String>>,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// Defaults to `num_attention_heads` (plain multi-head attention).
    pub num_key_value_heads: usize,
    /// Defaults to `hidden_size / num_attention_heads`.
    pub head_dim: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    pub max_position_embeddings: usize,
    pub vocab_size: usize,
    pub tie_word_embeddings: bool,
    /// Llama/Mistral: bias on q, k, v and o. Qwen2 ignores it (q/k/v bias always, o none).
    pub attention_bias: bool,
    pub mlp_bias: bool,
    pub torch_dtype: Option<String>,
    /// Gemma 3: the RoPE of the sliding-window layers (the fields above are the
    /// full-attention layers', which a stage's θ and `rope` change); `None` otherwise.
    pub rope_local: Option<LocalRope>,
    /// Gemma 3: per layer, whether it is a sliding-window layer (`layer_types`, or every
    /// layer but each 6th as transformers derives it), i.e. takes [`Self::rope_local`].
    /// Empty for the other families (one RoPE for all layers).
    pub local_rope_layers: Vec<bool>,
    /// Every other field of config.json, written back unchanged.
    pub extra: Map<String, Value>,
    /// Key `torch_dtype` came from (`torch_dtype`, or `dtype` as transformers v5 writes).
    dtype_key: &'static str,
    /// Whether `rope_theta` was a top-level field.
    theta_on_top: bool,
    /// The RoPE dict as read (to keep its unknown keys on write-back) and its key,
    /// `rope_scaling` (transformers v4) or `rope_parameters` (v5).
    rope_raw: Option<Map<String, Value>>,
    rope_key: &'static str,
    /// Gemma 3 in the transformers 5 form: `rope_parameters` holds one dict per layer type;
    /// `rope_raw` is then its `full_attention` dict and this the `sliding_attention` one.
    rope_local_raw: Option<Map<String, Value>>,
    /// Where the config came from (for error messages); `config.json` when parsed from memory.
    source: PathBuf,
    /// The JSON object as read (to write unchanged values back with their original spelling).
    original: Map<String, Value>,
}

/// The sizes read by [`Fields::shape`].
struct Shape {
    hidden_size: usize,
    intermediate_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    num_key_value_heads: usize,
    head_dim: usize,
    vocab_size: usize,
}

/// What [`Fields::rope`] read: θ, the parsed scaling, and what write-back needs.
struct RopeFields {
    theta: f64,
    scaling: Option<RopeScaling>,
    theta_on_top: bool,
    raw: Option<Map<String, Value>>,
    key: &'static str,
    /// Gemma 3: the sliding layers' RoPE and, in the per-layer-type form, its dict.
    local: Option<LocalRope>,
    local_raw: Option<Map<String, Value>>,
}

/// Field-checking helpers over one JSON object, each error naming file and field.
struct Fields<'a> {
    file: &'a Path,
    map: Map<String, Value>,
}

/// Whether two JSON values mean the same (numbers compared by value: 10000 == 10000.0).
fn same(a: &Value, b: &Value) -> bool {
    a == b || (a.is_number() && b.is_number() && a.as_f64() == b.as_f64())
}

/// Writes `key: new` into `m` for write-back: the original value when it means the same,
/// nothing when the key was absent and `new` is the default, else `new`.
fn put(m: &mut Map<String, Value>, orig: &Map<String, Value>, key: &str, new: Value, default: Option<Value>) {
    match orig.get(key) {
        Some(o) if same(o, &new) => {
            m.insert(key.into(), o.clone());
        }
        None if default.as_ref().is_some_and(|d| same(d, &new)) => {}
        _ => {
            m.insert(key.into(), new);
        }
    }
}

fn show(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 60 {
        format!("{}...", &s[..s.char_indices().nth(57).map_or(s.len(), |(i, _)| i)])
    } else {
        s
    }
}

fn positive_int(file: &Path, field: &str, v: &Value) -> Result<usize> {
    match v.as_u64() {
        Some(n) if n > 0 => Ok(n as usize),
        _ => Err(Error::config(file, field, format!("expected a positive integer, got {}", show(v)))),
    }
}

fn positive_float(file: &Path, field: &str, v: &Value) -> Result<f64> {
    match v.as_f64() {
        Some(x) if x > 0.0 && x.is_finite() => Ok(x),
        _ => Err(Error::config(file, field, format!("expected a positive number, got {}", show(v)))),
    }
}

impl<'a> Fields<'a> {
    /// Architecture: `model_type` decides; `architectures` must agree when present.
    fn architecture(&mut self) -> Result<(Arch, Option<Vec<String>>)> {
        let (file, f) = (self.file, self);
        let architectures = match f.take("architectures") {
            None => None,
            Some(Value::Array(a)) => {
                let mut names = Vec::with_capacity(a.len());
                for x in a {
                    match x {
                        Value::String(s) => names.push(s),
                        o => return Err(Error::config(file, "architectures", format!("expected a list of strings, got {}", show(&o)))),
                    }
                }
                Some(names)
            }
            Some(o) => return Err(Error::config(file, "architectures", format!("expected a list of strings, got {}", show(&o)))),
        };
        let from_archs = match &architectures {
            Some(names) => {
                let mut found = None;
                for n in names {
                    match Arch::from_architecture(n) {
                        Some(a) => found = Some(a),
                        None => {
                            return Err(Error::config(
                                file,
                                "architectures",
                                format!("unsupported architecture \"{n}\"; supported: {SUPPORTED}"),
                            ))
                        }
                    }
                }
                found
            }
            None => None,
        };
        let arch = match f.take("model_type") {
            Some(Value::String(s)) => match Arch::from_model_type(&s) {
                Some(a) => a,
                None => return Err(Error::config(file, "model_type", format!("unsupported model type \"{s}\"; supported: {SUPPORTED}"))),
            },
            Some(o) => return Err(Error::config(file, "model_type", format!("expected a string, got {}", show(&o)))),
            None => from_archs
                .ok_or_else(|| Error::config(file, "model_type", format!("missing (and no `architectures`); supported: {SUPPORTED}")))?,
        };
        if let Some(a) = from_archs {
            if a != arch {
                return Err(Error::config(
                    file,
                    "architectures",
                    format!("says {} but `model_type` is \"{}\"", a.model_type(), arch.model_type()),
                ));
            }
        }

        Ok((arch, architectures))
    }

    /// The sizes, with transformers' defaults (`num_key_value_heads`, `head_dim`) and checks.
    fn shape(&mut self, arch: Arch) -> Result<Shape> {
        let (file, f) = (self.file, self);
        let hidden_size = f.req_int("hidden_size")?;
        let intermediate_size = f.req_int("intermediate_size")?;
        let num_hidden_layers = f.req_int("num_hidden_layers")?;
        let num_attention_heads = f.req_int("num_attention_heads")?;
        let vocab_size = f.req_int("vocab_size")?;
        let num_key_value_heads = f.opt_int("num_key_value_heads")?.unwrap_or(num_attention_heads);
        let head_dim = match f.opt_int("head_dim")? {
            Some(d) => d,
            // Qwen3Config's own default (not hidden / heads).
            None if arch == Arch::Qwen3 => QWEN3_HEAD_DIM,
            None if arch == Arch::Gemma3 => GEMMA3_HEAD_DIM,
            None => {
                if hidden_size % num_attention_heads != 0 {
                    return Err(Error::config(
                        file,
                        "head_dim",
                        format!("missing, and hidden_size {hidden_size} is not divisible by num_attention_heads {num_attention_heads}"),
                    ));
                }
                hidden_size / num_attention_heads
            }
        };
        if num_attention_heads % num_key_value_heads != 0 {
            return Err(Error::config(
                file,
                "num_key_value_heads",
                format!("num_attention_heads {num_attention_heads} is not divisible by num_key_value_heads {num_key_value_heads}"),
            ));
        }
        if head_dim % 2 != 0 {
            return Err(Error::config(file, "head_dim", format!("expected an even number (RoPE rotates pairs), got {head_dim}")));
        }
        use crate::limits::{check_range, MAX_HEADS, MAX_LAYERS, MAX_VOCAB, MAX_WIDTH};
        for (key, v, hi) in [
            ("hidden_size", hidden_size, MAX_WIDTH),
            ("intermediate_size", intermediate_size, MAX_WIDTH),
            ("head_dim", head_dim, MAX_WIDTH),
            ("num_hidden_layers", num_hidden_layers, MAX_LAYERS),
            ("num_attention_heads", num_attention_heads, MAX_HEADS),
            ("num_key_value_heads", num_key_value_heads, MAX_HEADS),
            ("vocab_size", vocab_size, MAX_VOCAB),
        ] {
            check_range(file, key, v, 1, hi)?;
        }
        Ok(Shape { hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size })
    }

    /// RoPE: θ and scaling from `rope_theta` + `rope_scaling` or `rope_parameters`.
    fn rope(&mut self, max_position_embeddings: usize, head_dim: usize) -> Result<RopeFields> {
        let (file, f) = (self.file, self);
        // RoPE: transformers v4 writes `rope_theta` + `rope_scaling`, v5 one `rope_parameters`
        // dict holding `rope_theta` and the scaling keys. As in transformers, a non-null
        // `rope_scaling` wins over `rope_parameters`.
        let top_theta = f.opt_float("rope_theta")?;
        let theta_on_top = top_theta.is_some();
        let mut rope_raw = None;
        let mut rope_key = "rope_scaling";
        for key in ["rope_scaling", "rope_parameters"] {
            match f.take(key) {
                None => {}
                Some(Value::Object(o)) if rope_raw.is_none() && !o.is_empty() => {
                    rope_raw = Some(o);
                    rope_key = key;
                }
                Some(Value::Object(o)) => {
                    // The losing (or empty) dict is kept as it was.
                    f.map.insert(key.into(), Value::Object(o));
                }
                Some(o) => return Err(Error::config(file, key, format!("expected an object or null, got {}", show(&o)))),
            }
        }
        let (rope_scaling, rope_theta) = match &rope_raw {
            Some(o) => {
                if o.values().any(Value::is_object) {
                    return Err(Error::config(file, rope_key, "per-layer-type RoPE parameters are not supported"));
                }
                let theta = match o.get("rope_theta").filter(|v| !v.is_null()) {
                    Some(v) => positive_float(file, &format!("{rope_key}.rope_theta"), v)?,
                    None => top_theta.unwrap_or(10000.0),
                };
                (parse_rope_scaling(file, rope_key, o, max_position_embeddings, head_dim)?, theta)
            }
            None => (None, top_theta.unwrap_or(10000.0)),
        };
        Ok(RopeFields {
            theta: rope_theta,
            scaling: rope_scaling,
            theta_on_top,
            raw: rope_raw,
            key: rope_key,
            local: None,
            local_raw: None,
        })
    }

    /// Gemma 3's two RoPEs. transformers 5 writes `rope_parameters = { full_attention = {..},
    /// sliding_attention = {..} }`; transformers 4 (and Google's configs) `rope_theta` +
    /// `rope_scaling` for the full-attention layers and `rope_local_base_freq` for the
    /// sliding ones (kept in `extra`, written back as read). Defaults θ 1e6 and 1e4.
    fn gemma_rope(&mut self, max_pos: usize, head_dim: usize) -> Result<RopeFields> {
        let (file, f) = (self.file, self);
        let top_theta = f.opt_float("rope_theta")?;
        let local_base = f.peek("rope_local_base_freq").map(|v| positive_float(file, "rope_local_base_freq", v)).transpose()?;
        let params = match f.take("rope_parameters") {
            None => None,
            Some(Value::Object(o)) if o.is_empty() => {
                f.map.insert("rope_parameters".into(), Value::Object(o));
                None
            }
            Some(Value::Object(o)) => Some(o),
            Some(o) => return Err(Error::config(file, "rope_parameters", format!("expected an object or null, got {}", show(&o)))),
        };
        let Some(params) = params else {
            let mut v4 = f.rope(max_pos, head_dim)?;
            v4.theta = top_theta.unwrap_or(GEMMA3_THETA);
            v4.theta_on_top = top_theta.is_some();
            v4.local = Some(LocalRope { theta: local_base.unwrap_or(GEMMA3_LOCAL_THETA), scaling: None });
            return Ok(v4);
        };
        if f.peek("rope_scaling").is_some() {
            return Err(Error::config(
                file,
                "rope_scaling",
                "set together with rope_parameters; keep one (rope_parameters, as transformers 5 writes)",
            ));
        }
        let part = |kind: &str, theta_default: f64| -> Result<(Map<String, Value>, LocalRope)> {
            let field = format!("rope_parameters.{kind}");
            let o = match params.get(kind) {
                None | Some(Value::Null) => Map::new(),
                Some(Value::Object(o)) => o.clone(),
                Some(o) => return Err(Error::config(file, &field, format!("expected an object, got {}", show(o)))),
            };
            let theta = match o.get("rope_theta").filter(|v| !v.is_null()) {
                Some(v) => positive_float(file, &format!("{field}.rope_theta"), v)?,
                None => theta_default,
            };
            let scaling = parse_rope_scaling(file, &field, &o, max_pos, head_dim)?;
            Ok((o, LocalRope { theta, scaling }))
        };
        if let Some(k) = params.keys().find(|k| !matches!(k.as_str(), "full_attention" | "sliding_attention")) {
            return Err(Error::config(
                file,
                format!("rope_parameters.{k}"),
                "Gemma 3 takes one RoPE dict per layer type: expected only `full_attention` and `sliding_attention`",
            ));
        }
        let (full_raw, full) = part("full_attention", top_theta.unwrap_or(GEMMA3_THETA))?;
        let (local_raw, local) = part("sliding_attention", local_base.unwrap_or(GEMMA3_LOCAL_THETA))?;
        Ok(RopeFields {
            theta: full.theta,
            scaling: full.scaling,
            theta_on_top: top_theta.is_some(),
            raw: Some(full_raw),
            key: "rope_parameters",
            local: Some(local),
            local_raw: Some(local_raw),
        })
    }

    /// Gemma 3's own fields: the activation, no soft-capping, causal attention,
    /// `query_pre_attn_scalar`, and which layers slide (`layer_types`, else every layer
    /// but each `sliding_window_pattern`-th, 6 by default). Everything stays in `extra`.
    fn gemma_fields(&self, n_layers: usize) -> Result<Vec<bool>> {
        let file = self.file;
        if let Some(v) = self.peek("hidden_activation") {
            if v.as_str() != Some("gelu_pytorch_tanh") {
                return Err(Error::config(file, "hidden_activation", format!("only \"gelu_pytorch_tanh\" is supported, got {}", show(v))));
            }
        }
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if let Some(v) = self.peek(key) {
                return Err(Error::config(
                    file,
                    key,
                    format!(
                        "soft-capping ({}) is not supported by longctx's fused attention and loss kernels; \
                         set it to null (Gemma 3's default) or use another tool for this checkpoint",
                        show(v)
                    ),
                ));
            }
        }
        if self.peek("use_bidirectional_attention").is_some_and(|v| v.as_bool() != Some(false)) {
            return Err(Error::config(file, "use_bidirectional_attention", "longctx trains causal language models; expected false"));
        }
        if let Some(v) = self.peek("query_pre_attn_scalar") {
            positive_float(file, "query_pre_attn_scalar", v)?;
        }
        let Some(types) = self.peek("layer_types") else {
            let pattern = match self.peek("sliding_window_pattern").or_else(|| self.peek("_sliding_window_pattern")) {
                Some(v) => positive_int(file, "sliding_window_pattern", v)?,
                None => GEMMA3_PATTERN,
            };
            return Ok((0..n_layers).map(|i| (i + 1) % pattern != 0).collect());
        };
        let bad = || {
            Error::config(
                file,
                "layer_types",
                format!(
                    "expected a list of {n_layers} entries (num_hidden_layers), each \"sliding_attention\" or \"full_attention\", got {}",
                    show(types)
                ),
            )
        };
        let list = types.as_array().filter(|a| a.len() == n_layers).ok_or_else(bad)?;
        list.iter()
            .map(|t| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(bad()),
            })
            .collect()
    }

    /// Removes `key` (null counts as absent).
    fn take(&mut self, key: &str) -> Option<Value> {
        match self.map.remove(key) {
            Some(Value::Null) | None => None,
            Some(v) => Some(v),
        }
    }
    /// Like `take` but leaves the field in place (for fields kept in `extra`).
    fn peek(&self, key: &str) -> Option<&Value> {
        self.map.get(key).filter(|v| !v.is_null())
    }
    fn req_int(&mut self, key: &str) -> Result<usize> {
        match self.take(key) {
            Some(v) => positive_int(self.file, key, &v),
            None => Err(Error::config(self.file, key, "missing; expected a positive integer")),
        }
    }
    fn opt_int(&mut self, key: &str) -> Result<Option<usize>> {
        self.take(key).map(|v| positive_int(self.file, key, &v)).transpose()
    }
    fn opt_float(&mut self, key: &str) -> Result<Option<f64>> {
        self.take(key).map(|v| positive_float(self.file, key, &v)).transpose()
    }
    fn opt_bool(&mut self, key: &str) -> Result<Option<bool>> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(b)),
            Some(v) => Err(Error::config(self.file, key, format!("expected true or false, got {}", show(&v)))),
        }
    }
    fn opt_string(&mut self, key: &str) -> Result<Option<String>> {
        match self.take(key) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Error::config(self.file, key, format!("expected a string, got {}", show(&v)))),
        }
    }
}

/// `max_position_embeddings` of a config that does not set it (transformers' defaults).
fn default_max_pos(arch: Arch) -> usize {
    if arch == Arch::Gemma3 {
        GEMMA3_MAX_POS
    } else {
        2048
    }
}

/// Token ids (`bos_token_id`, `eos_token_id`, `pad_token_id`, `decoder_start_token_id`)
/// must be null, an integer in 0..=u32::MAX, or a list of such (eos): a larger id would be
/// truncated by the u32 token ids of the data pipeline. `pad_token_id = -1` (an old
/// convention for "none") is accepted.
fn check_token_ids(file: &Path, map: &Map<String, Value>) -> Result<()> {
    for key in ["bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"] {
        let Some(v) = map.get(key).filter(|v| !v.is_null()) else { continue };
        let ids: Vec<&Value> = match v {
            Value::Array(a) => a.iter().collect(),
            one => vec![one],
        };
        for id in ids {
            let fits = id.as_u64().is_some_and(|x| x <= u64::from(u32::MAX)) || (key == "pad_token_id" && id.as_i64() == Some(-1));
            if !fits {
                return Err(Error::config(
                    file,
                    key,
                    format!("expected a token id (an integer from 0 to {}) or a list of them, got {}; fix the config", u32::MAX, show(id)),
                ));
            }
        }
    }
    Ok(())
}

/// Parses the RoPE dictionary (`rope_scaling` of transformers v4, `rope_parameters` of v5,
/// named by `key`): `None` for the default (unscaled) RoPE.
/// (A top-level `original_max_position_embeddings` is left in `extra`: transformers 5.24
/// reads the dict's for the Llama family, checked.)
fn parse_rope_scaling(file: &Path, key: &str, obj: &Map<String, Value>, max_pos: usize, head_dim: usize) -> Result<Option<RopeScaling>> {
    let ty = match (obj.get("rope_type"), obj.get("type")) {
        (Some(Value::String(s)), _) | (None, Some(Value::String(s))) => s.as_str(),
        (Some(other), _) | (None, Some(other)) => {
            return Err(Error::config(file, format!("{key}.rope_type"), format!("expected a string, got {}", show(other))))
        }
        (None, None) if key == "rope_parameters" => "default",
        (None, None) => return Err(Error::config(file, format!("{key}.rope_type"), "missing (neither `rope_type` nor `type` is set)")),
    };
    let num = |k: &str| -> Result<Option<f64>> {
        obj.get(k).filter(|v| !v.is_null()).map(|v| positive_float(file, &format!("{key}.{k}"), v)).transpose()
    };
    let int = |k: &str| -> Result<Option<usize>> {
        obj.get(k).filter(|v| !v.is_null()).map(|v| positive_int(file, &format!("{key}.{k}"), v)).transpose()
    };
    let need = |k: &str, x: Option<f64>| -> Result<f64> {
        x.ok_or_else(|| Error::config(file, format!("{key}.{k}"), format!("missing; required by rope type \"{ty}\"")))
    };
    let factor = || need("factor", num("factor")?);
    Ok(Some(match ty {
        "default" => return Ok(None),
        "linear" => RopeScaling::Linear { factor: factor()? },
        "dynamic" => RopeScaling::Dynamic { factor: factor()? },
        "yarn" => RopeScaling::Yarn {
            factor: factor()?,
            original_max_position_embeddings: int("original_max_position_embeddings")?,
            beta_fast: num("beta_fast")?,
            beta_slow: num("beta_slow")?,
            mscale: num("mscale")?,
            mscale_all_dim: num("mscale_all_dim")?,
            attention_factor: num("attention_factor")?,
            truncate: match obj.get("truncate") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(o) => return Err(Error::config(file, format!("{key}.truncate"), format!("expected true or false, got {}", show(o)))),
            },
        },
        "longrope" => {
            let omax = int("original_max_position_embeddings")?.ok_or_else(|| {
                Error::config(file, format!("{key}.original_max_position_embeddings"), "missing; required by rope type \"longrope\"")
            })?;
            let list = |k: &str| -> Result<Vec<f64>> {
                let field = format!("{key}.{k}");
                let v = obj.get(k).filter(|v| !v.is_null());
                let Some(Value::Array(a)) = v else {
                    return Err(Error::config(
                        file,
                        field,
                        match v {
                            None => {
                                format!("missing; required by rope type \"longrope\" (a list of head_dim/2 = {} numbers)", head_dim / 2)
                            }
                            Some(o) => format!("expected a list of positive numbers, got {}", show(o)),
                        },
                    ));
                };
                let xs = a.iter().map(|x| positive_float(file, &field, x)).collect::<Result<Vec<f64>>>()?;
                if xs.len() != head_dim / 2 {
                    return Err(Error::config(
                        file,
                        field,
                        format!("has {} numbers; expected head_dim/2 = {} (one per rotated pair)", xs.len(), head_dim / 2),
                    ));
                }
                Ok(xs)
            };
            RopeScaling::LongRope {
                short_factor: list("short_factor")?,
                long_factor: list("long_factor")?,
                factor: num("factor")?.unwrap_or(max_pos as f64 / omax as f64),
                attention_factor: num("attention_factor")?,
                original_max_position_embeddings: omax,
            }
        }
        "llama3" => RopeScaling::Llama3 {
            factor: factor()?,
            low_freq_factor: need("low_freq_factor", num("low_freq_factor")?)?,
            high_freq_factor: need("high_freq_factor", num("high_freq_factor")?)?,
            // transformers fills it in from max_position_embeddings when absent.
            original_max_position_embeddings: int("original_max_position_embeddings")?.unwrap_or(max_pos),
        },
        other => {
            return Err(Error::config(
                file,
                format!("{key}.rope_type"),
                format!("unsupported rope scaling type \"{other}\"; supported: {ROPE_TYPES}"),
            ))
        }
    }))
}

impl LlamaConfig {
    /// Parameters of the model (biases included, a tied head counted once), with checked
    /// arithmetic: the count [`super::init::parameter_shapes`] lists, without listing.
    pub fn param_count(&self) -> Result<u64> {
        let what = "the parameter count";
        let (h, v) = (self.hidden_size as u64, self.vocab_size as u64);
        let layer = self.layer_param_count()?;
        let embed = crate::limits::mul(what, &[v, h])?;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        crate::limits::add(what, &[embed, crate::limits::mul(what, &[self.num_hidden_layers as u64, layer])?, h, head])
    }

    /// Parameters of one decoder layer (projections with their biases, two norms, four
    /// for Gemma 3, and the q/k norms).
    pub fn layer_param_count(&self) -> Result<u64> {
        let w = |x: usize| x as u64;
        let (h, i, d) = (w(self.hidden_size), w(self.intermediate_size), w(self.head_dim));
        let (hq, hkv) = (w(self.num_attention_heads), w(self.num_key_value_heads));
        let what = "the parameter count";
        let (q, kv) = (crate::limits::mul(what, &[hq, d])?, crate::limits::mul(what, &[hkv, d])?);
        let proj = |rows: u64, cols: u64, bias: bool| -> Result<u64> {
            crate::limits::add(what, &[crate::limits::mul(what, &[rows, cols])?, if bias { rows } else { 0 }])
        };
        crate::limits::add(
            what,
            &[
                proj(q, h, self.qkv_bias())?,
                proj(kv, h, self.qkv_bias())?,
                proj(kv, h, self.qkv_bias())?,
                proj(h, q, self.o_bias())?,
                proj(i, h, self.has_mlp_bias())?,
                proj(i, h, self.has_mlp_bias())?,
                proj(h, i, self.has_mlp_bias())?,
                crate::limits::mul(what, &[if self.gemma_block() { 4 } else { 2 }, h])?,
                if self.qk_norm() { 2 * d } else { 0 },
            ],
        )
    }

    /// Reads and validates `config.json`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        let value: Value = serde_json::from_str(&text).map_err(|e| Error::checkpoint(path, format!("not valid JSON: {e}")))?;
        Self::from_value(path, value)
    }

    /// Parses a config already read as JSON; `file` is only used in error messages.
    pub fn from_value(file: impl AsRef<Path>, value: Value) -> Result<Self> {
        let file = file.as_ref();
        let map = match value {
            Value::Object(m) => m,
            other => return Err(Error::config(file, "<root>", format!("expected a JSON object, got {}", show(&other)))),
        };
        let original = map.clone();
        let mut f = Fields { file, map };

        let (arch, architectures) = f.architecture()?;
        let Shape { hidden_size, intermediate_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size } =
            f.shape(arch)?;
        // transformers' defaults for the optional fields.
        let gemma = arch == Arch::Gemma3;
        let rms_norm_eps = f.opt_float("rms_norm_eps")?.unwrap_or(1e-6);
        let max_position_embeddings = f.opt_int("max_position_embeddings")?.unwrap_or(default_max_pos(arch));
        let tie_word_embeddings = f.opt_bool("tie_word_embeddings")?.unwrap_or(gemma);
        let attention_bias = f.opt_bool("attention_bias")?.unwrap_or(false);
        let mlp_bias = f.opt_bool("mlp_bias")?.unwrap_or(false);
        let (torch_dtype, dtype_key) = match f.opt_string("torch_dtype")? {
            Some(d) => (Some(d), "torch_dtype"),
            None => (f.opt_string("dtype")?, "dtype"),
        };
        // A partial rotary embedding (Phi-4-mini's 0.75, at the top level or in the RoPE
        // dict) rotates only part of each head: not implemented, refused rather than wrong.
        for dict in [None, Some("rope_parameters"), Some("rope_scaling")] {
            let v = match dict {
                None => f.peek("partial_rotary_factor"),
                Some(d) => f.peek(d).and_then(|r| r.get("partial_rotary_factor")),
            };
            if let Some(v) = v.filter(|v| v.as_f64() != Some(1.0)) {
                let field = dict.map_or("partial_rotary_factor".to_string(), |d| format!("{d}.partial_rotary_factor"));
                return Err(Error::config(
                    file,
                    &field,
                    format!("longctx rotates the whole head (1.0), got {}; partial rotary embeddings are not supported", show(v)),
                ));
            }
        }
        let rope = if gemma { f.gemma_rope(max_position_embeddings, head_dim)? } else { f.rope(max_position_embeddings, head_dim)? };
        check_token_ids(file, &f.map)?;
        let local_rope_layers = if gemma { f.gemma_fields(num_hidden_layers)? } else { Vec::new() };
        // Gemma 3 reads `hidden_activation` (checked above); a stray `hidden_act` is ignored there too.
        if let Some(v) = f.peek("hidden_act").filter(|v| !gemma && v.as_str() != Some("silu")) {
            return Err(Error::config(file, "hidden_act", format!("only \"silu\" is supported, got {}", show(v))));
        }
        let cfg = LlamaConfig {
            arch,
            architectures,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            rms_norm_eps,
            rope_theta: rope.theta,
            rope_scaling: rope.scaling,
            max_position_embeddings,
            vocab_size,
            tie_word_embeddings,
            attention_bias,
            mlp_bias,
            torch_dtype,
            rope_local: rope.local,
            local_rope_layers,
            extra: f.map,
            dtype_key,
            theta_on_top: rope.theta_on_top,
            rope_raw: rope.raw,
            rope_key: rope.key,
            rope_local_raw: rope.local_raw,
            source: file.to_path_buf(),
            original,
        };
        cfg.layer_windows()?; // sliding-window fields checked here, once
        let params = cfg.param_count().map_err(|e| Error::config(file, "num_hidden_layers", format!("{e}")))?;
        if params > crate::limits::MAX_PARAMS {
            return Err(Error::config(
                file,
                "num_hidden_layers",
                format!(
                    "the shape gives {params} parameters, more than the limit of {} (hidden_size {}, intermediate_size {}, \
                     {} layers, vocab_size {}); check the config",
                    crate::limits::MAX_PARAMS,
                    cfg.hidden_size,
                    cfg.intermediate_size,
                    cfg.num_hidden_layers,
                    cfg.vocab_size
                ),
            ));
        }
        Ok(cfg)
    }

    /// `eos_token_id` when it is one integer (a list gives `None`, as before), checked by
    /// [`Self::from_value`] to fit a u32.
    pub fn eos_token_id(&self) -> Option<u32> {
        self.extra.get("eos_token_id")?.as_u64().and_then(|x| u32::try_from(x).ok())
    }

    /// The file this config was read from (or the name given to [`Self::from_value`]).
    pub fn source(&self) -> &Path {
        &self.source
    }

    /// Whether q/k/v projections carry a bias: Qwen2 always, Llama when `attention_bias`,
    /// Mistral never (as transformers builds them).
    pub fn qkv_bias(&self) -> bool {
        match self.arch {
            Arch::Llama | Arch::Qwen3 | Arch::Gemma3 => self.attention_bias,
            Arch::Mistral | Arch::Phi3 => false,
            Arch::Qwen2 => true,
        }
    }

    /// Whether q and k go through a per-head RMSNorm before RoPE (Qwen3, Gemma 3).
    pub fn qk_norm(&self) -> bool {
        matches!(self.arch, Arch::Qwen3 | Arch::Gemma3)
    }

    /// Whether o_proj carries a bias (Llama, Qwen3, Gemma 3 with `attention_bias`).
    pub fn o_bias(&self) -> bool {
        matches!(self.arch, Arch::Llama | Arch::Qwen3 | Arch::Gemma3) && self.attention_bias
    }

    /// Gemma 3: every RMSNorm scales by `1 + w` (weights stored centred on 0) in f32, each
    /// layer has four of them (attention input and output, MLP input and output), the MLP
    /// is GeGLU with the tanh GELU, and the embedding output is scaled by `sqrt(hidden)`.
    pub fn gemma_block(&self) -> bool {
        self.arch == Arch::Gemma3
    }

    /// The factor on q·k: `query_pre_attn_scalar^-1/2` for Gemma 3 (256 by default),
    /// `head_dim^-1/2` otherwise.
    pub fn attention_scale(&self) -> f64 {
        if self.arch != Arch::Gemma3 {
            return 1.0 / (self.head_dim as f64).sqrt();
        }
        let s = self.extra.get("query_pre_attn_scalar").and_then(Value::as_f64).unwrap_or(GEMMA3_QUERY_PRE_ATTN_SCALAR);
        1.0 / s.sqrt()
    }

    /// The factor on the embedding output, `sqrt(hidden_size)` for Gemma 3 (transformers
    /// rounds it to the weights' dtype first; the caller does).
    pub fn embed_scale(&self) -> Option<f64> {
        self.gemma_block().then(|| (self.hidden_size as f64).sqrt())
    }

    /// Whether layer `l` takes the sliding layers' RoPE ([`Self::rope_local`]).
    pub fn layer_rope_is_local(&self, l: usize) -> bool {
        self.local_rope_layers.get(l).copied().unwrap_or(false)
    }

    /// Whether the MLP projections carry a bias (Llama with `mlp_bias` only).
    pub fn has_mlp_bias(&self) -> bool {
        self.arch == Arch::Llama && self.mlp_bias
    }

    /// The sliding attention window of every layer (`None`: full causal attention), as
    /// transformers 5 builds the model from this config:
    /// - Llama: none (`LlamaModel` reads no window);
    /// - Mistral, Phi-3: `sliding_window` on every layer when it is not null (their models
    ///   read no `layer_types`);
    /// - Qwen2, Qwen3: `sliding_window` only when `use_sliding_window` is true, on the layers
    ///   `layer_types` marks `"sliding_attention"`, or without `layer_types` on the layers
    ///   `i ≥ max_window_layers` (default 28).
    /// - Gemma 3: `sliding_window` (4096 when absent) on the layers that take the local RoPE
    ///   ([`Self::layer_rope_is_local`]: `layer_types`, or the `sliding_window_pattern`).
    ///
    /// Any other architecture with `layer_types` reads it the same way (`"sliding_attention"`
    /// or `"full_attention"`). Errors name config.json's field: a window of 0 or not a
    /// positive integer, `layer_types` of the wrong length or with an unknown entry.
    pub fn layer_windows(&self) -> Result<Vec<Option<usize>>> {
        let n = self.num_hidden_layers;
        let every = |w: Option<usize>| vec![w; n];
        let types = self.layer_types()?; // checked for every architecture
        match self.arch {
            Arch::Llama => Ok(every(None)),
            Arch::Mistral | Arch::Phi3 => Ok(every(self.window_field()?)),
            Arch::Qwen2 | Arch::Qwen3 => {
                let on = match self.extra.get("use_sliding_window") {
                    None | Some(Value::Null) => false,
                    Some(Value::Bool(b)) => *b,
                    Some(v) => return Err(self.field_err("use_sliding_window", format!("expected true or false, got {}", show(v)))),
                };
                let w = if on { self.window_field()? } else { None };
                let min_layer = self.opt_usize("max_window_layers")?.unwrap_or(28);
                Ok((0..n).map(|i| w.filter(|_| types.as_ref().map_or(i >= min_layer, |t| t[i]))).collect())
            }
            // Gemma 3: the layers that take the local RoPE slide (`layer_types`, or every
            // layer but each `sliding_window_pattern`-th); `sliding_window` absent is
            // transformers' default of 4096, null is no window.
            Arch::Gemma3 => {
                let w = match self.extra.get("sliding_window") {
                    None => Some(GEMMA3_SLIDING_WINDOW),
                    Some(_) => self.window_field()?,
                };
                Ok((0..n).map(|i| w.filter(|_| self.layer_rope_is_local(i))).collect())
            }
        }
    }

    /// Layer `index`'s sliding window ([`Self::layer_windows`]).
    pub fn layer_window(&self, index: usize) -> Result<Option<usize>> {
        Ok(self.layer_windows()?.get(index).copied().flatten())
    }

    /// `sliding_window`: a positive integer or null/absent.
    fn window_field(&self) -> Result<Option<usize>> {
        match self.extra.get("sliding_window") {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_u64().and_then(|w| usize::try_from(w).ok()) {
                Some(0) => Err(self.field_err("sliding_window", "a window of 0 tokens: expected a positive integer or null (no window)")),
                Some(w) => Ok(Some(w)),
                None => Err(self.field_err("sliding_window", format!("expected a positive integer or null, got {}", show(v)))),
            },
        }
    }

    /// An optional non-negative integer field of `extra`.
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.extra.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| self.field_err(key, format!("expected a non-negative integer, got {}", show(v)))),
        }
    }

    /// `layer_types` as "is a sliding layer" per layer (`None`: absent), checked to name
    /// one known type per layer.
    fn layer_types(&self) -> Result<Option<Vec<bool>>> {
        let list = match self.extra.get("layer_types") {
            None | Some(Value::Null) => return Ok(None),
            Some(Value::Array(a)) => a,
            Some(v) => return Err(self.field_err("layer_types", format!("expected a list of strings, got {}", show(v)))),
        };
        if list.len() != self.num_hidden_layers {
            return Err(self.field_err(
                "layer_types",
                format!("{} entries for num_hidden_layers = {} (one per layer expected)", list.len(), self.num_hidden_layers),
            ));
        }
        list.iter()
            .enumerate()
            .map(|(i, t)| match t.as_str() {
                Some("sliding_attention") => Ok(true),
                Some("full_attention") => Ok(false),
                _ => Err(self.field_err(
                    format!("layer_types[{i}]"),
                    format!("unsupported layer type {}; expected \"full_attention\" or \"sliding_attention\"", show(t)),
                )),
            })
            .collect::<Result<Vec<bool>>>()
            .map(Some)
    }

    fn field_err(&self, field: impl Into<String>, msg: impl Into<String>) -> Error {
        Error::config(&self.source, field, msg)
    }

    /// A copy with another RoPE base (context extension raises it stage by stage).
    pub fn with_rope_theta(&self, theta: f64) -> Self {
        LlamaConfig { rope_theta: theta, ..self.clone() }
    }

    /// A copy with another RoPE base and scaling method (`None`: plain RoPE), as a stage
    /// with its own `rope` table trains it; written back by [`Self::to_json_value`] in the
    /// config's own key (`rope_scaling` or `rope_parameters`).
    pub fn with_rope(&self, theta: f64, scaling: Option<RopeScaling>) -> Self {
        LlamaConfig { rope_theta: theta, rope_scaling: scaling, ..self.clone() }
    }

    pub fn set_max_position_embeddings(&mut self, n: usize) {
        self.max_position_embeddings = n;
    }

    /// The config as config.json: every field as it was read, known fields updated to
    /// their current values (a value that did not change keeps its original spelling,
    /// e.g. `10000` stays `10000`; an optional field left at its default is not added).
    pub fn to_json_value(&self) -> Value {
        let orig = &self.original;
        let mut m = self.extra.clone();
        let mut put = |key: &str, new: Value, default: Option<Value>| put(&mut m, orig, key, new, default);
        put("model_type", Value::from(self.arch.model_type()), None);
        if let Some(a) = &self.architectures {
            put("architectures", Value::from(a.clone()), None);
        }
        for (k, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("vocab_size", self.vocab_size),
        ] {
            put(k, Value::from(v), None);
        }
        put("num_key_value_heads", Value::from(self.num_key_value_heads), Some(Value::from(self.num_attention_heads)));
        let derived_head_dim = match self.arch {
            Arch::Qwen3 => QWEN3_HEAD_DIM,
            Arch::Gemma3 => GEMMA3_HEAD_DIM,
            _ => self.hidden_size / self.num_attention_heads,
        };
        put("head_dim", Value::from(self.head_dim), Some(Value::from(derived_head_dim)));
        put("max_position_embeddings", Value::from(self.max_position_embeddings), Some(Value::from(default_max_pos(self.arch))));
        put("rms_norm_eps", Value::from(self.rms_norm_eps), Some(Value::from(1e-6)));
        put("tie_word_embeddings", Value::from(self.tie_word_embeddings), Some(Value::from(self.gemma_block())));
        put("attention_bias", Value::from(self.attention_bias), Some(Value::from(false)));
        put("mlp_bias", Value::from(self.mlp_bias), Some(Value::from(false)));
        if let Some(d) = &self.torch_dtype {
            put(self.dtype_key, Value::from(d.clone()), None);
        }
        let theta = Value::from(self.rope_theta);
        if self.rope_key == "rope_parameters" {
            if self.theta_on_top {
                put("rope_theta", theta, None);
            }
            let dict = match &self.rope_local_raw {
                // Gemma 3 (transformers 5): the stage's RoPE is the full-attention layers'.
                Some(local) => serde_json::json!({ "full_attention": self.rope_dict(), "sliding_attention": local }),
                None => self.rope_dict(),
            };
            put("rope_parameters", dict, None);
        } else {
            let default_theta = if self.gemma_block() { GEMMA3_THETA } else { 10000.0 };
            put("rope_theta", theta, Some(Value::from(default_theta)));
            let rope = if self.rope_scaling.is_some() { self.rope_dict() } else { Value::Null };
            put("rope_scaling", rope, Some(Value::Null));
        }
        Value::Object(m)
    }

    /// The RoPE dict to write: the one read, with the current type, factors and (for the
    /// v5 `rope_parameters` form) `rope_theta`.
    fn rope_dict(&self) -> Value {
        let mut raw = self.rope_raw.clone().unwrap_or_default();
        // Another method than the one read (a stage's `rope`): the old method's own keys go.
        let now = self.rope_scaling.as_ref().map_or("default", RopeScaling::type_name);
        let was = raw.get("rope_type").or_else(|| raw.get("type")).and_then(Value::as_str).unwrap_or("default");
        if now != was {
            raw.retain(|k, _| matches!(k.as_str(), "rope_theta" | "partial_rotary_factor" | "rope_type" | "type"));
        }
        let mut o = raw.clone();
        let mut put = |k: &str, v: Value| put(&mut o, &raw, k, v, None);
        if self.rope_key == "rope_parameters" {
            put("rope_theta", Value::from(self.rope_theta));
        }
        let type_key = if raw.contains_key("type") && !raw.contains_key("rope_type") { "type" } else { "rope_type" };
        let Some(rs) = &self.rope_scaling else {
            put(type_key, Value::from("default"));
            return Value::Object(o);
        };
        put(type_key, Value::from(rs.type_name()));
        // LongRoPE without a `factor` (Phi-3's own configs) means max_position_embeddings /
        // original: left out when it is that, so a config read is written back as it was.
        let implied = match rs {
            RopeScaling::LongRope { factor, original_max_position_embeddings: omax, .. } => {
                !raw.contains_key("factor") && *omax > 0 && *factor == self.max_position_embeddings as f64 / *omax as f64
            }
            _ => false,
        };
        if !implied {
            put("factor", Value::from(rs.factor()));
        }
        let mut put_v = |k: &str, v: Option<Value>| {
            if let Some(x) = v {
                put(k, x);
            }
        };
        let f = |x: &Option<f64>| x.map(Value::from);
        match rs {
            RopeScaling::Linear { .. } | RopeScaling::Dynamic { .. } => {}
            RopeScaling::Yarn {
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                mscale,
                mscale_all_dim,
                attention_factor,
                truncate,
                ..
            } => {
                put_v("original_max_position_embeddings", original_max_position_embeddings.map(Value::from));
                put_v("beta_fast", f(beta_fast));
                put_v("beta_slow", f(beta_slow));
                put_v("mscale", f(mscale));
                put_v("mscale_all_dim", f(mscale_all_dim));
                put_v("attention_factor", f(attention_factor));
                put_v("truncate", truncate.map(Value::from));
            }
            RopeScaling::Llama3 { low_freq_factor, high_freq_factor, original_max_position_embeddings, .. } => {
                put_v("low_freq_factor", Some(Value::from(*low_freq_factor)));
                put_v("high_freq_factor", Some(Value::from(*high_freq_factor)));
                put_v("original_max_position_embeddings", Some(Value::from(*original_max_position_embeddings)));
            }
            RopeScaling::LongRope { short_factor, long_factor, attention_factor, original_max_position_embeddings, .. } => {
                put_v("attention_factor", f(attention_factor));
                put_v("original_max_position_embeddings", Some(Value::from(*original_max_position_embeddings)));
                put_v("short_factor", Some(Value::from(short_factor.clone())));
                put_v("long_factor", Some(Value::from(long_factor.clone())));
            }
        }
        Value::Object(o)
    }

    /// Writes the config as pretty JSON.
    pub fn write(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let text = serde_json::to_string_pretty(&self.to_json_value())
            .map_err(|e| Error::checkpoint(path, format!("cannot serialise config: {e}")))?;
        std::fs::write(path, text + "\n").map_err(|e| Error::io(path, e))
    }
}

impl Serialize for LlamaConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        let m = match self.to_json_value() {
            Value::Object(m) => m,
            other => return other.serialize(s),
        };
        let mut out = s.serialize_map(Some(m.len()))?;
        for (k, v) in &m {
            out.serialize_entry(k, v)?;
        }
        out.end()
    }
}

impl<'de> Deserialize<'de> for LlamaConfig {
    /// Same checks as [`LlamaConfig::from_value`]; errors name the file as `config.json`.
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        let v = Value::deserialize(d)?;
        LlamaConfig::from_value("config.json", v).map_err(serde::de::Error::custom)
    }
}

#[cfg(test)]
mod param_tests {
    #[test]
    fn param_count_matches_the_shapes_of_the_builtin_models() {
        for name in ["tiny", "tinyllama-1.1b-shape", "llama2-7b-shape"] {
            let cfg = crate::model::init::builtin_config(name).unwrap();
            let listed: u64 = crate::model::init::parameter_shapes(&cfg).iter().map(|(_, s)| s.iter().product::<usize>() as u64).sum();
            assert_eq!(cfg.param_count().unwrap(), listed, "{name}");
        }
    }
}
