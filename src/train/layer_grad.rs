//! The explicit backward of one decoder layer (the llm.c way): every gradient written
//! out, no autograd graph. The engine calls it top layer first with the layer's saved
//! input; Candle autograd over the same layer ([`super::engine::LayerBackward::Autograd`])
//! stays as the reference the tests compare it with.
//!
//! Forward (recomputed from `x`), then backward:
//! ```text
//! n1 = rms(x)·w1            q,k,v = n1·Wq,k,vᵀ (+b)      q,k = rope(q,k)
//! o, lse = attn(q, k, v)    h = x + o·Woᵀ (+b)
//! per token chunk c:        n2 = rms(h_c)·w2   g = n2·Wgᵀ   u = n2·Wuᵀ   m = silu(g)·u
//!                           y_c = h_c + m·Wdᵀ
//! dh_c = dy_c + rms'(dn2)   dn2 = dg·Wg + du·Wu   dg = dm·u·silu'(g)   du = dm·silu(g)   dm = dy_c·Wd
//! do = dh·Wo                dq,dk,dv = attn'(do; q,k,v,o,lse)   dq,dk = rope⁻¹(dq,dk)
//! dx = dh + rms'(dq·Wq + dk·Wk + dv·Wv)
//! ```
//! Weight gradients `dW = dyᵀ·x` are accumulated in f32 into the engine's per-parameter
//! slots. RMSNorm follows transformers (f32 math, the normalised value rounded to the
//! model dtype before the weight), so its backward is the exact derivative of that.
//!
//! Shapes: `b` batch, `s` local tokens, `c` tokens of a chunk, `h` hidden, `i`
//! intermediate, `hq`/`hkv` heads, `d` head dim; `[n, k]` a flattened `[b, c, k]`.

use std::sync::Arc;

use candle_core::{DType, Tensor, D};
use candle_nn::Linear;
use longctx_attention::AttentionMode;

use crate::model::{DecoderLayer, RmsNorm, RopeTable};
use crate::Result;

/// Where each parameter of one layer sits in the engine's gradient slots.
#[derive(Clone, Debug)]
pub struct LayerSlots {
    pub q: LinSlots,
    pub k: LinSlots,
    pub v: LinSlots,
    pub o: LinSlots,
    pub gate: LinSlots,
    pub up: LinSlots,
    pub down: LinSlots,
    pub ln1: usize,
    pub ln2: usize,
}

/// A linear layer's weight slot and, when it has one, its bias slot.
#[derive(Clone, Copy, Debug)]
pub struct LinSlots {
    pub w: usize,
    pub b: Option<usize>,
}

impl LayerSlots {
    /// Slots of layer `l` from the engine's parameter names (`model.layers.{l}.…`).
    pub fn find(names: &[&str], l: usize) -> Result<Self> {
        let at = |n: &str| -> Result<usize> {
            let full = format!("model.layers.{l}.{n}");
            names.iter().position(|x| *x == full).ok_or_else(|| crate::Error::Setting(format!("engine: parameter `{full}` not found")))
        };
        let lin = |n: &str| -> Result<LinSlots> {
            let b = format!("model.layers.{l}.{n}.bias");
            Ok(LinSlots { w: at(&format!("{n}.weight"))?, b: names.iter().position(|x| *x == b) })
        };
        Ok(Self {
            q: lin("self_attn.q_proj")?,
            k: lin("self_attn.k_proj")?,
            v: lin("self_attn.v_proj")?,
            o: lin("self_attn.o_proj")?,
            gate: lin("mlp.gate_proj")?,
            up: lin("mlp.up_proj")?,
            down: lin("mlp.down_proj")?,
            ln1: at("input_layernorm.weight")?,
            ln2: at("post_attention_layernorm.weight")?,
        })
    }
}

/// Adds `g` (cast to f32) into gradient slot `i`.
pub(crate) fn accumulate(acc: &mut [Option<Tensor>], i: usize, g: Tensor) -> Result<()> {
    let g = g.to_dtype(DType::F32)?;
    acc[i] = Some(match acc[i].take() {
        Some(a) => a.add(&g)?,
        None => g,
    });
    Ok(())
}

/// RMSNorm forward keeping `rstd [.., 1]` f32: `y = round(x·rstd)·w`.
fn rms_forward(norm: &RmsNorm, x: &Tensor) -> Result<(Tensor, Tensor)> {
    let x32 = x.to_dtype(DType::F32)?;
    let rstd = (x32.sqr()?.mean_keepdim(D::Minus1)? + norm.eps)?.sqrt()?.recip()?;
    let y = x32.broadcast_mul(&rstd)?.to_dtype(x.dtype())?.broadcast_mul(&norm.weight)?;
    Ok((y, rstd))
}

/// RMSNorm backward: `(dx [.., h] in x's dtype, dw [h] f32)` for `dy [.., h]`.
/// `dx = rstd · (ĝ − x̂ · mean(ĝ · x̂))` with `ĝ = dy · w`, `x̂ = x · rstd` (f32).
fn rms_backward(norm: &RmsNorm, x: &Tensor, rstd: &Tensor, dy: &Tensor) -> Result<(Tensor, Tensor)> {
    let xhat = x.to_dtype(DType::F32)?.broadcast_mul(rstd)?;
    let dy32 = dy.to_dtype(DType::F32)?;
    let rows = dy32.elem_count() / dy32.dim(D::Minus1)?;
    let h = dy32.dim(D::Minus1)?;
    // The weight multiplies the *rounded* x̂, as in the forward.
    let xhat_r = xhat.to_dtype(x.dtype())?.to_dtype(DType::F32)?;
    let dw = dy32.mul(&xhat_r)?.reshape((rows, h))?.sum(0)?;
    let g = dy32.broadcast_mul(&norm.weight.to_dtype(DType::F32)?)?;
    let dot = g.mul(&xhat)?.mean_keepdim(D::Minus1)?;
    let dx = g.sub(&xhat.broadcast_mul(&dot)?)?.broadcast_mul(rstd)?;
    Ok((dx.to_dtype(x.dtype())?, dw))
}

/// A linear layer's backward on flattened rows: weight (and bias) gradients into their
/// slots, returns `dx [n, in] = dy · W`.
fn linear_backward(lin: &Linear, slots: LinSlots, x: &Tensor, dy: &Tensor, acc: &mut [Option<Tensor>]) -> Result<Tensor> {
    accumulate(acc, slots.w, dy.t()?.matmul(x)?)?; // [out, in]
    if let Some(b) = slots.b {
        accumulate(acc, b, dy.to_dtype(DType::F32)?.sum(0)?)?;
    }
    Ok(dy.matmul(lin.weight())?)
}

fn flat(t: &Tensor) -> Result<Tensor> {
    let k = t.dim(D::Minus1)?;
    Ok(t.reshape((t.elem_count() / k, k))?)
}

/// The attention half's forward, with what its backward needs.
struct AttnForward {
    n1: Tensor,   // [b, s, h]
    rstd1: Tensor, // [b, s, 1] f32
    q: Tensor,    // [b, s, hq, d] after RoPE
    k: Tensor,    // [b, s, hkv, d] after RoPE
    v: Tensor,    // [b, s, hkv, d]
    o: Tensor,    // [b, s, hq, d]
    lse: Tensor,  // [b, hq, s] f32
    h: Tensor,    // [b, s, h] = x + attention
}

fn attn_forward(layer: &DecoderLayer, x: &Tensor, rope: &RopeTable, attn: &Arc<dyn AttentionMode>) -> Result<AttnForward> {
    use candle_core::Module;
    let a = &layer.self_attn;
    let (b, s, _) = x.dims3()?;
    let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
    let (n1, rstd1) = rms_forward(&layer.input_layernorm, x)?;
    let q = rope.apply(&a.q_proj.forward(&n1)?.reshape((b, s, hq, d))?)?;
    let k = rope.apply(&a.k_proj.forward(&n1)?.reshape((b, s, hkv, d))?)?;
    let v = a.v_proj.forward(&n1)?.reshape((b, s, hkv, d))?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let (o, lse) = attn.forward(&q, &k, &v, scale(d))?;
    let h = x.add(&a.o_proj.forward(&o.reshape((b, s, hq * d))?)?)?;
    Ok(AttnForward { n1, rstd1, q, k, v, o, lse, h })
}

fn scale(d: usize) -> f64 {
    1.0 / (d as f64).sqrt()
}

/// `dh_c` of one token chunk of the MLP half `y = h + down(silu(gate(n2))·up(n2))`,
/// `n2 = rms(h)·w2`, for `dy_c`: the residual plus the branch's gradient. Weight
/// gradients into their slots.
fn mlp_chunk_backward(layer: &DecoderLayer, sl: &LayerSlots, hc: &Tensor, dyc: &Tensor, acc: &mut [Option<Tensor>]) -> Result<Tensor> {
    use candle_core::Module;
    let m = &layer.mlp;
    let (n2, rstd2) = rms_forward(&layer.post_attention_layernorm, hc)?;
    let n2f = flat(&n2)?; // [n, h]
    let g = m.gate_proj.forward(&n2f)?; // [n, i]
    let u = m.up_proj.forward(&n2f)?; // [n, i]
    let sg = g.silu()?;
    let dy = flat(dyc)?; // [n, h]
    let dm = linear_backward(&m.down_proj, sl.down, &sg.mul(&u)?, &dy, acc)?; // [n, i]
    // silu'(g) = σ(g)·(1 + g·(1 − σ(g)))
    let sig = candle_nn::ops::sigmoid(&g)?;
    let dsilu = sig.mul(&(g.mul(&sig.affine(-1.0, 1.0)?)? + 1.0)?)?;
    let dg = dm.mul(&u)?.mul(&dsilu)?;
    let du = dm.mul(&sg)?;
    let dn2 = (linear_backward(&m.gate_proj, sl.gate, &n2f, &dg, acc)? + linear_backward(&m.up_proj, sl.up, &n2f, &du, acc)?)?;
    let (dh, dw2) = rms_backward(&layer.post_attention_layernorm, hc, &rstd2, &dn2.reshape(hc.shape())?)?;
    accumulate(acc, sl.ln2, dw2)?;
    Ok(dyc.add(&dh)?)
}

/// Gradient of the layer's input `dx [b, s, h]` for the gradient of its output `dy`;
/// every weight gradient of the layer is added into `acc` (f32). `x` is the layer's
/// input as the forward saw it; `chunks` the token chunks of the MLP half.
pub fn layer_backward(
    layer: &DecoderLayer,
    sl: &LayerSlots,
    x: &Tensor,
    dy: &Tensor,
    rope: &RopeTable,
    attn: &Arc<dyn AttentionMode>,
    chunks: &[(usize, usize)],
    acc: &mut [Option<Tensor>],
) -> Result<Tensor> {
    let f = attn_forward(layer, x, rope, attn)?;
    let mut dh_chunks = Vec::with_capacity(chunks.len());
    for &(st, len) in chunks {
        let hc = f.h.narrow(1, st, len)?;
        dh_chunks.push(mlp_chunk_backward(layer, sl, &hc, &dy.narrow(1, st, len)?, acc)?);
    }
    let dh = if dh_chunks.len() == 1 { dh_chunks.remove(0) } else { Tensor::cat(&dh_chunks, 1)? }; // [b, s, h]
    let a = &layer.self_attn;
    let (b, s, hdim) = x.dims3()?;
    let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
    let o = f.o.reshape((b * s, hq * d))?;
    let d_o = linear_backward(&a.o_proj, sl.o, &o, &flat(&dh)?, acc)?.reshape((b, s, hq, d))?;
    let (dq, dk, dv) = attn.backward(&d_o, &f.q, &f.k, &f.v, &f.o, &f.lse, scale(d))?;
    let dq = rope.apply_inverse(&dq)?.reshape((b * s, hq * d))?;
    let dk = rope.apply_inverse(&dk)?.reshape((b * s, hkv * d))?;
    let dv = dv.reshape((b * s, hkv * d))?;
    let n1 = flat(&f.n1)?;
    let dn1 = (linear_backward(&a.q_proj, sl.q, &n1, &dq, acc)?
        + linear_backward(&a.k_proj, sl.k, &n1, &dk, acc)?
        + linear_backward(&a.v_proj, sl.v, &n1, &dv, acc)?)?;
    let (dx, dw1) = rms_backward(&layer.input_layernorm, x, &f.rstd1, &dn1.reshape((b, s, hdim))?)?;
    accumulate(acc, sl.ln1, dw1)?;
    Ok(dh.add(&dx)?)
}
