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
//! slots, in place. RMSNorm (its residual add fused into the backward), RoPE (in place),
//! SwiGLU and the accumulation are the fused kernels of `longctx-kernels` (CUDA, or their
//! CPU twins); RMSNorm follows transformers (f32 math, the normalised value rounded to the
//! model dtype before the weight), so its backward is the exact derivative of that.
//!
//! Shapes: `b` batch, `s` local tokens, `c` tokens of a chunk, `h` hidden, `i`
//! intermediate, `hq`/`hkv` heads, `d` head dim; `[n, k]` a flattened `[b, c, k]`.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor, D};
use candle_nn::Linear;
use longctx_attention::kernel::Saved;
use longctx_attention::AttentionMode;
use longctx_kernels as kernels;

use crate::model::{DecoderLayer, RmsNorm, RopeTable};
use crate::train::profile::{Phase, Profiler};
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

/// Adds `g` into the f32 gradient slot `i` (a view of the step's [`GradBuffer`]) in place.
///
/// [`GradBuffer`]: crate::train::grads::GradBuffer
pub(crate) fn accumulate(acc: &[Tensor], i: usize, g: &Tensor) -> Result<()> {
    Ok(kernels::accumulate_f32(&acc[i], &g.contiguous()?, 1.0)?)
}

/// RMSNorm forward keeping `rstd [..]` f32: `y = w·round(x·rstd)` (fused kernel).
fn rms_forward(norm: &RmsNorm, x: &Tensor) -> Result<(Tensor, Tensor)> {
    let o = kernels::rms_norm_fwd(&x.contiguous()?, None, &norm.weight, norm.eps)?;
    Ok((o.y, o.rstd))
}

/// RMSNorm backward: `(dx + d_residual [.., h], dw [h] f32)` for `dy [.., h]` (fused kernel).
fn rms_backward(norm: &RmsNorm, x: &Tensor, rstd: &Tensor, dy: &Tensor, d_residual: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let dres = d_residual.map(Tensor::contiguous).transpose()?;
    let g = kernels::rms_norm_bwd(&dy.contiguous()?, &x.contiguous()?, &norm.weight, rstd, dres.as_ref())?;
    Ok((g.dx, g.dweight))
}

/// `[.., k]` as rows `[n, k]`.
fn flat(t: &Tensor) -> Result<Tensor> {
    let k = t.dim(D::Minus1)?;
    Ok(t.reshape((t.elem_count() / k, k))?)
}

fn scale(d: usize) -> f64 {
    1.0 / (d as f64).sqrt()
}

/// What the forward may keep of a layer's attention so that the backward does not rerun
/// it (selective recomputation): `q`, `k` (after RoPE), `v`, `o` and `lse`.
pub struct SavedAttention {
    pub q: Tensor,   // [b, s, hq, d]
    pub k: Tensor,   // [b, s, hkv, d]
    pub v: Tensor,   // [b, s, hkv, d]
    pub o: Tensor,   // [b, s, hq, d]
    pub lse: Tensor, // [b, hq, s] f32
}

impl SavedAttention {
    /// A layer's saved group `[x]` or `[x, q, k, v, o, lse]` (the engine's store order)
    /// as the input and, when kept, the attention's tensors.
    pub fn split(group: Vec<Tensor>) -> Result<(Tensor, Option<Self>)> {
        let mut it = group.into_iter();
        let (x, rest) = (it.next(), it.collect::<Vec<_>>());
        let x = x.ok_or_else(|| crate::Error::Setting("engine: empty saved group".into()))?;
        match <[Tensor; 5]>::try_from(rest) {
            Ok([q, k, v, o, lse]) => Ok((x, Some(Self { q, k, v, o, lse }))),
            Err(rest) if rest.is_empty() => Ok((x, None)),
            Err(rest) => Err(crate::Error::Setting(format!("engine: a saved group of {} tensors", rest.len() + 1))),
        }
    }
}

/// The attention half's forward, with what its backward needs.
struct AttnForward {
    n1: Tensor,    // [b, s, h]
    rstd1: Tensor, // [b, s] f32
    q: Tensor,     // [b, s, hq, d] after RoPE
    k: Tensor,     // [b, s, hkv, d] after RoPE
    v: Tensor,     // [b, s, hkv, d]
    o: Tensor,     // [b, s, hq, d]
    lse: Tensor,   // [b, hq, s] f32
    h: Tensor,     // [b, s, h] = x + attention
}

/// One layer's forward or backward over this rank's tokens, every piece timed by phase.
pub struct LayerPass<'a> {
    pub rope: &'a RopeTable,
    pub attn: &'a Arc<dyn AttentionMode>,
    /// Token chunks `(start, len)` of the MLP half.
    pub chunks: &'a [(usize, usize)],
    pub prof: &'a Profiler,
    pub dev: &'a Device,
}

impl LayerPass<'_> {
    fn t<T>(&self, p: Phase, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.prof.time(p, self.dev, f)
    }

    /// `x·Wᵀ (+ b)` on rows.
    fn linear(&self, lin: &Linear, x: &Tensor) -> Result<Tensor> {
        self.t(Phase::Gemm, || Ok(lin.forward(x)?))
    }

    /// A linear layer's backward on rows `x [n, in]`, `dy [n, out]`: weight (and bias)
    /// gradients into their slots, returns `dx [n, in] = dy · W`.
    fn linear_backward(&self, lin: &Linear, slots: LinSlots, x: &Tensor, dy: &Tensor, acc: &[Tensor]) -> Result<Tensor> {
        let (x, dy) = (x.contiguous()?, dy.contiguous()?);
        // dW [out, in] += dyᵀ·x, straight into the f32 slot (the GEMM's beta = 1).
        self.t(Phase::Gemm, || Ok(kernels::matmul_acc_f32(&acc[slots.w], &dy, &x, 1.0)?))?;
        if let Some(b) = slots.b {
            self.t(Phase::GradAccum, || accumulate(acc, b, &dy.to_dtype(DType::F32)?.sum(0)?))?;
        }
        self.t(Phase::Gemm, || Ok(dy.matmul(lin.weight())?))
    }

    /// The attention half from `x`; with `saved`, only the norm and `o_proj` are rerun.
    fn attn_forward(&self, layer: &DecoderLayer, x: &Tensor, saved: Option<SavedAttention>) -> Result<AttnForward> {
        let a = &layer.self_attn;
        let (b, s, _) = x.dims3()?;
        let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
        let (n1, rstd1) = self.t(Phase::NormRopeAct, || rms_forward(&layer.input_layernorm, x))?;
        if let Some(SavedAttention { q, k, v, o, lse }) = saved {
            let a_out = self.linear(&a.o_proj, &o.reshape((b, s, hq * d))?)?;
            let h = self.t(Phase::Copies, || Ok(x.add(&a_out)?))?;
            return Ok(AttnForward { n1, rstd1, q, k, v, o, lse, h });
        }
        let q = self.linear(&a.q_proj, &n1)?.reshape((b, s, hq, d))?;
        let k = self.linear(&a.k_proj, &n1)?.reshape((b, s, hkv, d))?;
        let v = self.linear(&a.v_proj, &n1)?.reshape((b, s, hkv, d))?;
        self.t(Phase::NormRopeAct, || {
            kernels::rope_fwd_inplace(&q, &self.rope.cos, &self.rope.sin)?;
            Ok(kernels::rope_fwd_inplace(&k, &self.rope.cos, &self.rope.sin)?)
        })?;
        let (o, lse) = self.t(Phase::Attention, || Ok(self.attn.forward(&q, &k, &v, scale(d))?))?;
        let a_out = self.linear(&a.o_proj, &o.reshape((b, s, hq * d))?)?;
        let h = self.t(Phase::Copies, || Ok(x.add(&a_out)?))?;
        Ok(AttnForward { n1, rstd1, q, k, v, o, lse, h })
    }

    /// `y_c = h_c + down(silu(gate(n2))·up(n2))`, `n2 = rms(h_c)·w2`, for one token chunk.
    fn mlp_chunk(&self, layer: &DecoderLayer, hc: &Tensor) -> Result<Tensor> {
        let m = &layer.mlp;
        let (n2, _) = self.t(Phase::NormRopeAct, || rms_forward(&layer.post_attention_layernorm, hc))?;
        let g = self.linear(&m.gate_proj, &n2)?;
        let u = self.linear(&m.up_proj, &n2)?;
        let gu = self.t(Phase::NormRopeAct, || Ok(kernels::swiglu_fwd(&g, &u)?))?;
        let y = self.linear(&m.down_proj, &gu)?;
        self.t(Phase::Copies, || Ok(hc.add(&y)?))
    }

    /// The layer's output `[b, s, h]` for its input `x [b, s, h]` (the model's
    /// [`DecoderLayer::forward`], written out so that each piece is timed), and the
    /// attention's tensors for the backward.
    pub fn forward(&self, layer: &DecoderLayer, x: &Tensor) -> Result<(Tensor, SavedAttention)> {
        let f = self.attn_forward(layer, x, None)?;
        let mut outs = Vec::with_capacity(self.chunks.len());
        for &(st, len) in self.chunks {
            outs.push(self.mlp_chunk(layer, &f.h.narrow(1, st, len)?)?);
        }
        let y = self.t(Phase::Copies, || Ok(if outs.len() == 1 { outs.remove(0) } else { Tensor::cat(&outs, 1)? }))?;
        Ok((y, SavedAttention { q: f.q, k: f.k, v: f.v, o: f.o, lse: f.lse }))
    }

    /// `dh_c` of one token chunk of the MLP half for `dy_c`: the residual plus the
    /// branch's gradient. Weight gradients into their slots.
    fn mlp_chunk_backward(&self, layer: &DecoderLayer, sl: &LayerSlots, hc: &Tensor, dyc: &Tensor, acc: &[Tensor]) -> Result<Tensor> {
        let m = &layer.mlp;
        let (n2, rstd2) = self.t(Phase::NormRopeAct, || rms_forward(&layer.post_attention_layernorm, hc))?;
        let n2f = flat(&n2)?; // [n, h]
        let g = self.linear(&m.gate_proj, &n2f)?; // [n, i]
        let u = self.linear(&m.up_proj, &n2f)?; // [n, i]
        let gu = self.t(Phase::NormRopeAct, || Ok(kernels::swiglu_fwd(&g, &u)?))?;
        let dy = self.t(Phase::Copies, || flat(&dyc.contiguous()?))?; // [n, h]
        let dm = self.linear_backward(&m.down_proj, sl.down, &gu, &dy, acc)?; // [n, i]
        let (dg, du) = self.t(Phase::NormRopeAct, || Ok(kernels::swiglu_bwd(&dm, &g, &u)?))?;
        let dn2g = self.linear_backward(&m.gate_proj, sl.gate, &n2f, &dg, acc)?;
        let dn2u = self.linear_backward(&m.up_proj, sl.up, &n2f, &du, acc)?;
        let dn2 = self.t(Phase::Copies, || Ok((dn2g + dn2u)?.reshape(hc.shape())?))?;
        // dh_c = dy_c (the residual) + the norm's backward, in one kernel.
        let (dh, dw2) = self.t(Phase::NormRopeAct, || rms_backward(&layer.post_attention_layernorm, hc, &rstd2, &dn2, Some(dyc)))?;
        self.t(Phase::GradAccum, || accumulate(acc, sl.ln2, &dw2))?;
        Ok(dh)
    }

    /// Gradient of the layer's input `dx [b, s, h]` for the gradient of its output `dy`;
    /// every weight gradient of the layer is added into `acc` (f32). `x` is the layer's
    /// input as the forward saw it; `saved` its attention tensors when the forward kept
    /// them (else the attention forward is rerun).
    pub fn backward(
        &self,
        layer: &DecoderLayer,
        sl: &LayerSlots,
        x: &Tensor,
        saved: Option<SavedAttention>,
        dy: &Tensor,
        acc: &[Tensor],
    ) -> Result<Tensor> {
        let f = self.attn_forward(layer, x, saved)?;
        let mut dh_chunks = Vec::with_capacity(self.chunks.len());
        for &(st, len) in self.chunks {
            let hc = f.h.narrow(1, st, len)?;
            dh_chunks.push(self.mlp_chunk_backward(layer, sl, &hc, &dy.narrow(1, st, len)?, acc)?);
        }
        let dh = self.t(Phase::Copies, || Ok(if dh_chunks.len() == 1 { dh_chunks.remove(0) } else { Tensor::cat(&dh_chunks, 1)? }))?;
        let a = &layer.self_attn;
        let (b, s, hdim) = x.dims3()?;
        let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
        let o = f.o.reshape((b * s, hq * d))?;
        let d_o = self.linear_backward(&a.o_proj, sl.o, &o, &flat(&dh)?, acc)?.reshape((b, s, hq, d))?;
        let (dq, dk, dv) =
            self.t(Phase::Attention, || Ok(self.attn.backward(&d_o, Saved::new(&f.q, &f.k, &f.v, &f.o, &f.lse), scale(d))?))?;
        let (dq, dk) = (dq.contiguous()?, dk.contiguous()?);
        self.t(Phase::NormRopeAct, || {
            kernels::rope_bwd_inplace(&dq, &self.rope.cos, &self.rope.sin)?;
            Ok(kernels::rope_bwd_inplace(&dk, &self.rope.cos, &self.rope.sin)?)
        })?;
        let (dq, dk, dv) = (dq.reshape((b * s, hq * d))?, dk.reshape((b * s, hkv * d))?, dv.reshape((b * s, hkv * d))?);
        let n1 = flat(&f.n1)?;
        let dn1q = self.linear_backward(&a.q_proj, sl.q, &n1, &dq, acc)?;
        let dn1k = self.linear_backward(&a.k_proj, sl.k, &n1, &dk, acc)?;
        let dn1v = self.linear_backward(&a.v_proj, sl.v, &n1, &dv, acc)?;
        let dn1 = self.t(Phase::Copies, || Ok((dn1q + dn1k + dn1v)?.reshape((b, s, hdim))?))?;
        // dx = dh (the residual) + the norm's backward, in one kernel.
        let (dx, dw1) = self.t(Phase::NormRopeAct, || rms_backward(&layer.input_layernorm, x, &f.rstd1, &dn1, Some(&dh)))?;
        self.t(Phase::GradAccum, || accumulate(acc, sl.ln1, &dw1))?;
        Ok(dx)
    }
}
