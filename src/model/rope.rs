//! Rotary position embedding, computed as Hugging Face transformers computes it.
//!
//! Shapes: `b` batch, `s` tokens, `h` heads, `d` head dim, `f = d/2` frequencies.
//! - `inv_freq [f]` f32, one per rotated pair, per rope type (default, linear, dynamic NTK,
//!   YaRN, Llama 3, LongRoPE), reproducing transformers' f32 arithmetic step by step.
//! - [`RopeTable`]: `cos`/`sin [b, s, 1, d]` for explicit GLOBAL position ids, so a shard
//!   of a long sequence gets the angles of its true positions.
//! - [`RopeTable::apply`]: `x·cos + rotate_half(x)·sin` on `x [b, s, h, d]` with plain
//!   differentiable tensor ops (half-split convention: pairs are `(i, i + d/2)`).
//!
//! Angles are `f32(position) · inv_freq` in f32 as transformers does, so positions must
//! stay below 2^24 to be exact in f32.

use super::config::{LlamaConfig, RopeScaling};
use candle_core::{DType, Result, Tensor, D};
use std::f64::consts::PI;

/// The RoPE of one model: enough to compute `inv_freq` for any sequence length.
#[derive(Debug, Clone, PartialEq)]
pub struct Rope {
    theta: f64,
    /// Rotated dims (= head_dim; partial rotary is not used by the Llama family).
    dim: usize,
    max_position_embeddings: usize,
    scaling: Option<RopeScaling>,
}

/// `theta^(2i/dim)` for `i < dim/2` as torch computes `base ** (arange(0, dim, 2).float() / dim)`:
/// exponent in f32, base rounded to f32, the power rounded once to f32.
fn pos_freqs(base: f32, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            (base as f64).powf(e as f64) as f32
        })
        .collect()
}

fn default_inv_freq(base: f32, dim: usize) -> Vec<f32> {
    pos_freqs(base, dim).into_iter().map(|p| 1.0f32 / p).collect()
}

impl Rope {
    pub fn new(cfg: &LlamaConfig) -> Self {
        Rope {
            theta: cfg.rope_theta,
            dim: cfg.head_dim,
            max_position_embeddings: cfg.max_position_embeddings,
            scaling: cfg.rope_scaling.clone(),
        }
    }

    /// Gemma 3: the RoPE of the sliding-window layers (their own base, and scaling where
    /// `rope_parameters.sliding_attention` sets one); `None` for the other families.
    pub fn local(cfg: &LlamaConfig) -> Option<Self> {
        let l = cfg.rope_local.as_ref()?;
        Some(Rope { theta: l.theta, dim: cfg.head_dim, max_position_embeddings: cfg.max_position_embeddings, scaling: l.scaling.clone() })
    }

    pub fn head_dim(&self) -> usize {
        self.dim
    }

    /// `(inv_freq [d/2], attention_scaling)` for a forward whose largest position id is
    /// `seq_len - 1`. Only LongRoPE (short or long factors past the original length) and
    /// dynamic NTK depend on `seq_len`: transformers rescales the base when
    /// `max(position_ids) + 1 > max_position_embeddings` (here stateless: transformers
    /// also keeps the largest length seen so far until a short batch resets it).
    pub fn inv_freq(&self, seq_len: usize) -> (Vec<f32>, f32) {
        let dim = self.dim;
        let theta = self.theta as f32;
        match &self.scaling {
            None => (default_inv_freq(theta, dim), 1.0),
            Some(RopeScaling::Linear { factor }) => {
                let f = *factor as f32;
                (default_inv_freq(theta, dim).into_iter().map(|x| x / f).collect(), 1.0)
            }
            Some(RopeScaling::Dynamic { factor }) => {
                if seq_len <= self.max_position_embeddings {
                    // transformers evaluates the formula in f64 with seq_len = max_pos: base unchanged.
                    return (default_inv_freq(theta, dim), 1.0);
                }
                // Past max_pos transformers evaluates the base as f32 tensors:
                // base · ((factor·seq_len / max_pos) − (factor − 1)) ^ (dim / (dim − 2)).
                let a = (*factor as f32) * (seq_len as f32) / (self.max_position_embeddings as f32) - (*factor - 1.0) as f32;
                let p = (dim as f64 / (dim as f64 - 2.0)) as f32;
                let scaled = ((a as f64).powf(p as f64) as f32) * theta;
                (default_inv_freq(scaled, dim), 1.0)
            }
            Some(y @ RopeScaling::Yarn { .. }) => self.yarn_inv_freq(y),
            Some(l @ RopeScaling::Llama3 { .. }) => (self.llama3_inv_freq(l), 1.0),
            Some(RopeScaling::LongRope { factor, short_factor, long_factor, attention_factor, original_max_position_embeddings }) => {
                let omax = *original_max_position_embeddings;
                // One set for the whole forward: long once the sequence passes the
                // pretrained length (transformers: max(position_ids) + 1 > original).
                let ext = if seq_len > omax { long_factor } else { short_factor };
                let att = attention_factor.unwrap_or(if *factor <= 1.0 { 1.0 } else { (1.0 + factor.ln() / (omax as f64).ln()).sqrt() });
                // transformers: 1 / (f32(ext) · base^(2i/d)), all in f32.
                let inv = pos_freqs(theta, dim).iter().zip(ext).map(|(&p, &e)| 1.0f32 / ((e as f32) * p)).collect();
                (inv, att as f32)
            }
        }
    }

    /// YaRN: high frequencies kept, low ones divided by `factor`, a linear ramp between
    /// (bounds from `beta_fast`/`beta_slow` rotations over the original context); the
    /// attention factor beside. The scaling given is this table's.
    fn yarn_inv_freq(&self, scaling: &RopeScaling) -> (Vec<f32>, f32) {
        let (dim, theta) = (self.dim, self.theta as f32);
        let RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            attention_factor,
            truncate,
        } = scaling
        else {
            return (default_inv_freq(theta, dim), 1.0);
        };
        let factor = *factor;
        let omax = original_max_position_embeddings.unwrap_or(self.max_position_embeddings) as f64;
        let get_mscale = |scale: f64, m: f64| if scale <= 1.0 { 1.0 } else { 0.1 * m * scale.ln() + 1.0 };
        let att = match (attention_factor, mscale, mscale_all_dim) {
            (Some(a), _, _) => *a,
            (None, Some(m), Some(ma)) => get_mscale(factor, *m) / get_mscale(factor, *ma),
            _ => get_mscale(factor, 1.0),
        };
        let beta_fast = beta_fast.unwrap_or(32.0);
        let beta_slow = beta_slow.unwrap_or(1.0);
        let base = self.theta;
        let corr = |rot: f64| (dim as f64 * (omax / (rot * 2.0 * PI)).ln()) / (2.0 * base.ln());
        let (mut low, mut high) = (corr(beta_fast), corr(beta_slow));
        if truncate.unwrap_or(true) {
            low = low.floor();
            high = high.ceil();
        }
        let low = low.max(0.0);
        let mut high = high.min((dim - 1) as f64);
        if low == high {
            high += 0.001;
        }
        let span = (high - low) as f32;
        let pos = pos_freqs(theta, dim);
        let fac = factor as f32;
        let inv = pos
            .iter()
            .enumerate()
            .map(|(i, &p)| {
                let extrap = 1.0f32 / p;
                let interp = 1.0f32 / (fac * p);
                let ramp = ((i as f32 - low as f32) / span).clamp(0.0, 1.0);
                let ef = 1.0f32 - ramp;
                interp * (1.0 - ef) + extrap * ef
            })
            .collect();
        (inv, att as f32)
    }

    /// Llama 3.1: wavelengths longer than original/low divided by `factor`, shorter than
    /// original/high kept, smoothed between. The scaling given is this table's.
    fn llama3_inv_freq(&self, scaling: &RopeScaling) -> Vec<f32> {
        let (dim, theta) = (self.dim, self.theta as f32);
        let RopeScaling::Llama3 { factor, low_freq_factor, high_freq_factor, original_max_position_embeddings } = scaling else {
            return default_inv_freq(theta, dim);
        };
        let old = *original_max_position_embeddings as f64;
        let low_wl = (old / low_freq_factor) as f32;
        let high_wl = (old / high_freq_factor) as f32;
        let fac = *factor as f32;
        let two_pi = (2.0 * PI) as f32;
        default_inv_freq(theta, dim)
            .into_iter()
            .map(|f| {
                let wl = two_pi / f;
                let scaled = if wl > low_wl { f / fac } else { f };
                let smooth = (old as f32 / wl - *low_freq_factor as f32) / (high_freq_factor - low_freq_factor) as f32;
                let smoothed = (1.0f32 - smooth) * scaled / fac + smooth * scaled;
                // transformers: ~(wl < high) * ~(wl > low); wl is finite, so:
                let medium = wl >= high_wl && wl <= low_wl;
                if medium {
                    smoothed
                } else {
                    scaled
                }
            })
            .collect()
    }

    /// Whether the table depends on the sequence length (dynamic NTK, LongRoPE).
    pub fn depends_on_length(&self) -> bool {
        matches!(self.scaling, Some(RopeScaling::Dynamic { .. } | RopeScaling::LongRope { .. }))
    }

    /// cos/sin for `positions [b, s]` (u32, global ids) in `dtype`.
    /// `seq_len`: the global sequence length, used only by dynamic NTK; `None` takes
    /// `max(positions) + 1` as transformers does (a shard must pass the global length).
    pub fn table(&self, positions: &Tensor, seq_len: Option<usize>, dtype: DType) -> Result<RopeTable> {
        let (b, s) = positions.dims2()?;
        let seq_len = match seq_len {
            Some(n) => n,
            None if self.depends_on_length() => positions.max_all()?.to_dtype(DType::U32)?.to_scalar::<u32>()? as usize + 1,
            None => 0,
        };
        let (inv, att) = self.inv_freq(seq_len);
        let f = inv.len();
        let inv = Tensor::from_vec(inv, (1, 1, f), positions.device())?;
        // freqs[b, s, i] = f32(pos) · inv_freq[i], one f32 product as in transformers.
        let freqs = positions.to_dtype(DType::F32)?.reshape((b, s, 1))?.broadcast_mul(&inv)?;
        let emb = Tensor::cat(&[&freqs, &freqs], D::Minus1)?;
        let (mut cos, mut sin) = (emb.cos()?, emb.sin()?);
        if att != 1.0 {
            let a = Tensor::new(att, positions.device())?;
            cos = cos.broadcast_mul(&a)?;
            sin = sin.broadcast_mul(&a)?;
        }
        Ok(RopeTable { cos: cos.to_dtype(dtype)?.unsqueeze(2)?.contiguous()?, sin: sin.to_dtype(dtype)?.unsqueeze(2)?.contiguous()? })
    }
}

/// cos/sin for a set of tokens; broadcast over heads.
#[derive(Debug, Clone)]
pub struct RopeTable {
    pub cos: Tensor, // [b, s, 1, d]
    pub sin: Tensor, // [b, s, 1, d]
}

/// The cos/sin tables of every layer: the model's, and (Gemma 3) the sliding layers' own.
#[derive(Debug, Clone)]
pub struct RopeTables {
    pub global: RopeTable,
    pub local: Option<RopeTable>,
}

impl RopeTables {
    /// The table of a layer that takes the local RoPE (`local`) or the global one.
    pub fn get(&self, local: bool) -> &RopeTable {
        match (&self.local, local) {
            (Some(t), true) => t,
            _ => &self.global,
        }
    }
}

/// `cat(−x2, x1)` over the last dim, where `x1`, `x2` are its two halves.
pub fn rotate_half(x: &Tensor) -> Result<Tensor> {
    let d = x.dim(D::Minus1)?;
    let x1 = x.narrow(D::Minus1, 0, d / 2)?;
    let x2 = x.narrow(D::Minus1, d / 2, d - d / 2)?;
    Tensor::cat(&[&x2.neg()?, &x1], D::Minus1)
}

impl RopeTable {
    /// `x [b, s, h, d]` rotated: `x·cos + rotate_half(x)·sin` (differentiable).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        x.broadcast_mul(&self.cos)?.add(&rotate_half(x)?.broadcast_mul(&self.sin)?)
    }

    pub fn tokens(&self) -> Result<usize> {
        self.cos.dim(1)
    }
}
