//! The explicit backward of one decoder layer (the llm.c way): every gradient written
//! out, no autograd graph. The engine calls it top layer first with the layer's saved
//! input; Candle autograd over the same layer ([`super::engine::LayerBackward::Autograd`])
//! stays as the reference the tests compare it with.
//!
//! Forward (recomputed from `x` unless the attention core was saved), then backward;
//! only the attention core (`q, k, v, o, lse`, `do, dq, dk, dv`) is whole-sequence,
//! every other line runs per token chunk `c`, writing its rows into `[b, s, ..]` buffers:
//! ```text
//! per c:  n1 = rms(x_c)·w1   q,k,v_c = n1·Wq,k,vᵀ (+b)   [Qwen3: q,k = rms_d(q,k)·wq,wk]
//!         then q,k = rope(q,k)
//!         o, lse = attn(q, k, v)
//! per c:  h_c = x_c + o_c·Woᵀ (+b)   n2 = rms(h_c)·w2   g = n2·Wgᵀ   u = n2·Wuᵀ
//!         m = silu(g)·u   y_c = h_c + m·Wdᵀ
//! per c:  dm = dy_c·Wd   dg = dm·u·silu'(g)   du = dm·silu(g)   dn2 = dg·Wg + du·Wu
//!         dh_c = dy_c + rms'(dn2)   (written over dy_c)   do_c = dh_c·Wo
//!         dq,dk,dv = attn'(do; q,k,v,o,lse)   dq,dk = rope⁻¹(dq,dk)
//! per c:  [Qwen3: dq,dk = rms_d'(dq,dk) on the recomputed projections]
//!         dx_c = dh_c + rms'(dq_c·Wq + dk_c·Wk + dv_c·Wv)   (written over dh_c)
//! ```
//! Gemma 3 (`LlamaConfig::gemma_block`) adds a norm on the attention output before its
//! residual add (`h_c = x_c + rms_a(o_c·Woᵀ)`) and one on the MLP output
//! (`y_c = h_c + rms_m(m·Wdᵀ)`), differentiated on the recomputed outputs; its norms scale
//! by `1 + w` in f32 and its MLP is GeGLU-tanh: those two come from
//! `longctx_kernels::{rms_norm_1p_*, geglu_tanh_*}`, composed from Candle ops (any
//! device), not fused kernels.
//!
//! Weight gradients `dW += dyᵀ·x` are accumulated in f32 by the GEMM itself into the
//! engine's gradient buffer (`longctx_kernels::matmul_acc_f32`, beta = 1). With one
//! sequence per micro-batch (b = 1) a chunk's rows are one block of each whole-sequence
//! buffer, and nothing is copied there: q, k, v and `do` are written by their GEMMs
//! (`longctx_kernels::matmul_into`), the sums `dn1`, `dn2` are made by the GEMMs (beta = 1,
//! one rounding each), and `dh_c`, `dx_c` by the norm's backward over `dy_c`
//! (`longctx_kernels::rms_norm_bwd_into`); with b > 1 they are computed apart and copied.
//! RMSNorm (its residual add fused into the backward), RoPE (in place), SwiGLU (its backward
//! giving the down projection's input too: `longctx_kernels::swiglu_bwd_fwd`) and the accumulation
//! are the fused kernels of `longctx-kernels` (CUDA, or their CPU twins); RMSNorm follows
//! transformers (f32 math, the normalised value rounded to the model dtype before the
//! weight), so its backward is the exact derivative of that.
//!
//! Shapes: `b` batch, `s` local tokens, `c` tokens of a chunk, `h` hidden, `i`
//! intermediate, `hq`/`hkv` heads, `d` head dim; `[n, k]` a flattened `[b, c, k]`.

use std::sync::Arc;

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;
use longctx_attention::kernel::Saved;
use longctx_attention::AttentionMode;
use longctx_attention::Masking;
use longctx_kernels as kernels;
use longctx_kernels::Rhs;

use crate::model::{DecoderLayer, RmsNorm, RopeTable, RopeTables};
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
    /// `post_attention_layernorm`: Llama's MLP-input norm, Gemma 3's attention-output norm.
    pub ln2: usize,
    /// Qwen3's and Gemma 3's per-head q/k norms, when the layer has them.
    pub q_norm: Option<usize>,
    pub k_norm: Option<usize>,
    /// Gemma 3's `pre_feedforward_layernorm` and `post_feedforward_layernorm`.
    pub ff: Option<(usize, usize)>,
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
            q_norm: at("self_attn.q_norm.weight").ok(),
            k_norm: at("self_attn.k_norm.weight").ok(),
            ff: at("pre_feedforward_layernorm.weight").ok().zip(at("post_feedforward_layernorm.weight").ok()),
        })
    }

    /// The slot of the MLP-input norm.
    fn mlp_norm(&self) -> usize {
        self.ff.map_or(self.ln2, |(pre, _)| pre)
    }
}

/// Adds `g` into the f32 gradient slot `i` (a view of the step's [`GradBuffer`]) in place.
///
/// [`GradBuffer`]: crate::train::zero::GradBuffer
pub(crate) fn accumulate(acc: &[Tensor], i: usize, g: &Tensor) -> Result<()> {
    Ok(kernels::accumulate_f32(&acc[i], &g.contiguous()?, 1.0)?)
}

/// RMSNorm forward keeping `rstd` f32: `y = w·round(x·rstd)` (fused kernel), or Gemma's
/// `round(x·rstd·(1 + w))` (composed).
pub(crate) fn rms_forward(norm: &RmsNorm, x: &Tensor) -> Result<(Tensor, Tensor)> {
    if norm.one_plus {
        return Ok(kernels::rms_norm_1p_fwd(x, &norm.weight, norm.eps)?);
    }
    let o = kernels::rms_norm_fwd(&x.contiguous()?, None, &norm.weight, norm.eps)?;
    Ok((o.y, o.rstd))
}

/// RMSNorm backward: `(dx + d_residual [.., h], dw [h] f32)` for `dy [.., h]` (fused
/// kernel, or Gemma's composed one). [`LayerPass::rms_backward_rows`] writes over the
/// residual gradient instead where it can.
pub(crate) fn rms_backward(
    norm: &RmsNorm,
    x: &Tensor,
    rstd: &Tensor,
    dy: &Tensor,
    d_residual: Option<&Tensor>,
) -> Result<(Tensor, Tensor)> {
    if norm.one_plus {
        return Ok(kernels::rms_norm_1p_bwd(dy, x, &norm.weight, rstd, d_residual)?);
    }
    let dres = d_residual.map(Tensor::contiguous).transpose()?;
    let g = kernels::rms_norm_bwd(&dy.contiguous()?, &x.contiguous()?, &norm.weight, rstd, dres.as_ref())?;
    Ok((g.dx, g.dweight))
}

/// The MLP's gated activation: SwiGLU (fused kernel) or Gemma's GeGLU-tanh (composed).
fn act_forward(layer: &DecoderLayer, g: &Tensor, u: &Tensor) -> Result<Tensor> {
    match layer.mlp.gelu_tanh {
        true => Ok(kernels::geglu_tanh_fwd(g, u)?),
        false => Ok(kernels::swiglu_fwd(g, u)?),
    }
}

/// The backward of [`act_forward`]: `(dgate, dup)`.
fn act_backward(layer: &DecoderLayer, dm: &Tensor, g: &Tensor, u: &Tensor) -> Result<(Tensor, Tensor)> {
    match layer.mlp.gelu_tanh {
        true => Ok(kernels::geglu_tanh_bwd(dm, g, u)?),
        false => Ok(kernels::swiglu_bwd(dm, g, u)?),
    }
}

/// Qwen3's per-head norm on projected rows `t [n, heads·d]`: each head's `d` features
/// normed (`norm.weight [d]`); `(normed [n, heads·d], rstd [n·heads] f32)`.
fn head_norm_forward(norm: &RmsNorm, t: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
    let (n, w) = t.dims2()?;
    let (y, rstd) = rms_forward(norm, &t.reshape((n * w / d, d))?)?;
    Ok((y.reshape((n, w))?, rstd))
}

/// The backward of [`head_norm_forward`]: `(dt [n, heads·d], dweight [d] f32)` for the
/// gradient `dy [n, heads·d]` of its output.
fn head_norm_backward(norm: &RmsNorm, t: &Tensor, rstd: &Tensor, dy: &Tensor, d: usize) -> Result<(Tensor, Tensor)> {
    let (n, w) = t.dims2()?;
    let rows = n * w / d;
    let (dt, dw) = rms_backward(norm, &t.reshape((rows, d))?, rstd, &dy.contiguous()?.reshape((rows, d))?, None)?;
    Ok((dt.reshape((n, w))?, dw))
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

/// What the forward may keep of a layer's MLP half so that the backward does not rerun
/// its gate and up projections (nor `o_proj` and the residual add): per token chunk, in
/// chunk order, the residual stream after the attention `h_c [n, h]` (Gemma 3: the
/// attention branch before its output norm, from which `h_c` is rebuilt without `o_proj`)
/// and the gate and up projections `g_c, u_c [n, i]` (memory `layers × tokens × (h + 2·i)`
/// elements).
pub struct SavedMlp {
    pub chunks: Vec<[Tensor; 3]>,
}

/// One layer's saved group as the engine's store holds it: the input `x`, then
/// `q, k, v, o, lse` when the attention is kept, then `h_c, g_c, u_c` of every token
/// chunk when the MLP half is kept.
pub struct SavedLayer {
    pub x: Tensor,
    pub attention: Option<SavedAttention>,
    pub mlp: Option<SavedMlp>,
}

impl SavedLayer {
    /// The group's tensors in store order.
    pub fn tensors(&self) -> Vec<&Tensor> {
        let mut out = vec![&self.x];
        if let Some(a) = &self.attention {
            out.extend([&a.q, &a.k, &a.v, &a.o, &a.lse]);
        }
        if let Some(m) = &self.mlp {
            out.extend(m.chunks.iter().flatten());
        }
        out
    }

    /// A group from the store, read with what the forward kept (`attention`, and `mlp`
    /// over `chunks` token chunks); a group of another length is an error.
    pub fn split(group: Vec<Tensor>, attention: bool, mlp: bool, chunks: usize) -> Result<Self> {
        let want = 1 + if attention { 5 } else { 0 } + if mlp { 3 * chunks } else { 0 };
        if group.len() != want {
            return Err(crate::Error::Setting(format!(
                "engine: a saved layer group of {} tensors, expected {want} (input{}{})",
                group.len(),
                if attention { ", attention" } else { "" },
                if mlp { ", MLP per chunk" } else { "" }
            )));
        }
        let mut it = group.into_iter();
        let mut next = || it.next().ok_or_else(|| crate::Error::Setting("engine: short saved group".into()));
        let x = next()?;
        let attention = match attention {
            true => Some(SavedAttention { q: next()?, k: next()?, v: next()?, o: next()?, lse: next()? }),
            false => None,
        };
        let mlp = match mlp {
            true => Some(SavedMlp { chunks: (0..chunks).map(|_| Ok([next()?, next()?, next()?])).collect::<Result<_>>()? }),
            false => None,
        };
        Ok(Self { x, attention, mlp })
    }
}

/// Rows `[st, st + len)` of `t [b, s, ..]` as a contiguous `[b·len, k]`, `k` the product
/// of the trailing dims (a view when `b = 1`, a copy of the chunk otherwise).
pub(crate) fn chunk_rows(t: &Tensor, ch: (usize, usize)) -> Result<Tensor> {
    if let Some(v) = rows_view(t, ch)? {
        return Ok(v);
    }
    let c = t.narrow(1, ch.0, ch.1)?.contiguous()?;
    let n = c.dims().iter().take(2).product::<usize>();
    Ok(c.reshape((n, c.elem_count() / n.max(1)))?)
}

/// A whole-sequence buffer that the chunk loop then fills row by row, left
/// uninitialised (no memset).
///
/// # Safety
/// Every element must be written before it is read: the callers write every chunk of
/// `[0, s)` (the chunks tile the sequence) before using the buffer.
pub(crate) unsafe fn row_buffer(shape: impl Into<candle_core::Shape>, dtype: DType, dev: &Device) -> Result<Tensor> {
    // SAFETY: forwarded to the caller (see above).
    Ok(unsafe { Tensor::empty(shape, dtype, dev) }?)
}

/// Rows `[st, st + len)` of `t [b, s, ..]` (contiguous) as a writable `[b·len, k]` view of
/// its storage when they are one contiguous block (b = 1), else `None`.
pub(crate) fn rows_view(t: &Tensor, (st, len): (usize, usize)) -> Result<Option<Tensor>> {
    let c = t.narrow(1, st, len)?;
    if !c.is_contiguous() {
        return Ok(None);
    }
    let n = c.dims().iter().take(2).product::<usize>();
    Ok(Some(c.reshape((n, c.elem_count() / n.max(1)))?))
}

/// Writes `rows [b·len, k]` into rows `[st, st + len)` of `dst [b, s, ..]` (contiguous).
pub(crate) fn put_rows(dst: &Tensor, rows: &Tensor, (st, len): (usize, usize)) -> Result<()> {
    let mut shape = dst.dims().to_vec();
    shape[1] = len;
    Ok(dst.slice_set(&rows.reshape(shape)?, 1, st)?)
}

/// One layer's forward or backward over this rank's tokens, every piece timed by phase.
///
/// Only the attention core works on the whole sequence at once: `q, k, v, o, lse` and,
/// in the backward, `do, dq, dk, dv` (model dtype, f32 LSE). Everything else — the
/// norms, the projections, the residual adds, the MLP — runs over token chunks
/// ([`Self::chunks`]), writing its rows into whole-sequence buffers; the backward writes
/// the gradient of the layer input over the incoming gradient, chunk by chunk. So the
/// layer's transient memory is the attention core plus two `[b, s, h]` tensors plus one
/// chunk's intermediates ([`LayerPass::transient_bytes`] counts it for the planner).
pub struct LayerPass<'a> {
    /// The layers' cos/sin (each layer takes its own: Gemma 3's sliding layers the local).
    pub rope: &'a RopeTables,
    pub attn: &'a Arc<dyn AttentionMode>,
    /// Token chunks `(start, len)` of the token-wise parts.
    pub chunks: &'a [(usize, usize)],
    pub prof: &'a Profiler,
    pub dev: &'a Device,
}

/// The sizes the engine's transient memory depends on; its byte counts are the ones the
/// engine reports ([`super::engine::MemoryReport`]) and the planner (`crate::plan`) adds
/// up, in u128 (the planner checks them against overflow).
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    pub batch: usize,
    /// Local tokens `s`.
    pub tokens: usize,
    /// Tokens per chunk `c`.
    pub chunk: usize,
    pub hidden: usize,
    pub intermediate: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub vocab: usize,
    /// Bytes per element of the model dtype.
    pub elem: usize,
}

impl LayerShape {
    fn n(&self) -> (u128, u128, u128) {
        (self.batch as u128, self.tokens as u128, self.elem as u128)
    }

    /// `(e_q, e_kv)`: elements of q (and o) and of k (and v).
    fn elems(&self) -> (u128, u128) {
        let (b, s, _) = self.n();
        (b * s * (self.heads * self.head_dim) as u128, b * s * (self.kv_heads * self.head_dim) as u128)
    }

    /// One layer's input (or any `[b, s, h]` tensor).
    pub fn input_bytes(&self) -> u128 {
        let (b, s, a) = self.n();
        b * s * self.hidden as u128 * a
    }

    /// The attention core a layer may save: `q, k, v, o` and the f32 LSE.
    pub fn core_bytes(&self) -> u128 {
        let (b, s, a) = self.n();
        let (eq, ekv) = self.elems();
        (2 * eq + 2 * ekv) * a + 4 * b * self.heads as u128 * s
    }

    /// The MLP half a layer may save ([`SavedMlp`]): its input `h` and the gate and up
    /// projections, every token chunk's.
    pub fn mlp_bytes(&self) -> u128 {
        let (b, s, a) = self.n();
        b * s * (self.hidden as u128 + 2 * self.intermediate as u128) * a
    }

    /// Bytes alive at once in [`LayerPass::backward`] besides the layer's saved input and
    /// what the attention kernel allocates inside: the incoming gradient `[b, s, h]`
    /// (overwritten with the outgoing one), the core, its gradients `do, dq, dk, dv`, and
    /// one chunk's intermediates ([`Self::chunk_bytes`]).
    pub fn backward_bytes(&self) -> u128 {
        let (_, _, a) = self.n();
        let (eq, ekv) = self.elems();
        self.input_bytes() + self.core_bytes() + (2 * eq + 2 * ekv) * a + self.chunk_bytes()
    }

    /// One chunk's intermediates at the MLP backward's widest point: gate, up, their
    /// product and its gradient, and the two branch gradients `[c, i]`; the chunk's
    /// residual stream, its norm, their gradients and partial sums `[c, h]` (model dtype),
    /// and the norms' f32 statistics.
    pub fn chunk_bytes(&self) -> u128 {
        let (b, s, a) = self.n();
        let n = b * (self.chunk as u128).min(s);
        n * (6 * self.intermediate as u128 + 6 * self.hidden as u128) * a + 8 * n
    }

    /// The fused attention backward's f32 accumulators (its workspace): `8·e_q` bytes,
    /// measured on an H200 with cuDNN 9 (the kernel allocates it, not the engine).
    pub fn attention_work_bytes(&self) -> u128 {
        8 * self.elems().0
    }

    /// The head's backward: the top hidden and its gradient `[b, s, h]`, one logits chunk
    /// `[n, V]` (its gradient written over it) and the chunk's hidden rows.
    pub fn head_bytes(&self) -> u128 {
        let (b, s, a) = self.n();
        let n = b * (self.chunk as u128).min(s);
        2 * self.input_bytes() + n * (self.vocab as u128 + 4 * self.hidden as u128) * a
    }
}

impl LayerPass<'_> {
    fn t<T>(&self, p: Phase, f: impl FnOnce() -> Result<T>) -> Result<T> {
        self.prof.time(p, self.dev, f)
    }

    /// `x·Wᵀ (+ b)` on rows.
    fn linear(&self, lin: &Linear, x: &Tensor) -> Result<Tensor> {
        self.t(Phase::Gemm, || Ok(lin.forward(x)?))
    }

    /// `x·Wᵀ` on rows `x [n, in]` written into rows `ch` of `dst [b, s, ..]`: by the GEMM
    /// itself when those rows are one block of `dst` (b = 1) and the layer has no bias,
    /// else computed apart and copied there.
    fn linear_into_rows(&self, lin: &Linear, x: &Tensor, dst: &Tensor, ch: (usize, usize)) -> Result<()> {
        match (lin.bias(), rows_view(dst, ch)?) {
            (None, Some(rows)) => self
                .t(Phase::Gemm, || Ok(kernels::matmul_into(&rows, &x.contiguous()?, &lin.weight().contiguous()?, Rhs::Transposed, false)?)),
            _ => self.put(dst, &self.linear(lin, x)?, ch),
        }
    }

    /// A linear layer's weight (and bias) gradients for rows `x [n, in]`, `dy [n, out]`,
    /// added into their slots.
    fn weight_grads(&self, slots: LinSlots, x: &Tensor, dy: &Tensor, acc: &[Tensor]) -> Result<()> {
        let (x, dy) = (x.contiguous()?, dy.contiguous()?);
        // dW [out, in] += dyᵀ·x, straight into the f32 slot (the GEMM's beta = 1).
        self.t(Phase::Gemm, || Ok(kernels::matmul_acc_f32(&acc[slots.w], &dy, &x, 1.0)?))?;
        if let Some(b) = slots.b {
            self.t(Phase::GradAccum, || accumulate(acc, b, &dy.to_dtype(DType::F32)?.sum(0)?))?;
        }
        Ok(())
    }

    /// A linear layer's backward on rows `x [n, in]`, `dy [n, out]`: weight (and bias)
    /// gradients into their slots, returns `dx [n, in] = dy · W`.
    fn linear_backward(&self, lin: &Linear, slots: LinSlots, x: &Tensor, dy: &Tensor, acc: &[Tensor]) -> Result<Tensor> {
        self.weight_grads(slots, x, dy, acc)?;
        self.t(Phase::Gemm, || Ok(dy.contiguous()?.matmul(lin.weight())?))
    }

    /// [`Self::linear_backward`] with `dy · W` written into `dst [n, in]` (a fresh buffer or
    /// rows of one), or with `accumulate` added to what `dst` holds: the sum of several
    /// projections' input gradients made by the GEMMs (one rounding each, no separate sum).
    fn linear_backward_into(
        &self,
        lin: &Linear,
        slots: LinSlots,
        x: &Tensor,
        dy: &Tensor,
        acc: &[Tensor],
        (dst, accumulate): (&Tensor, bool),
    ) -> Result<()> {
        self.weight_grads(slots, x, dy, acc)?;
        self.t(Phase::Gemm, || Ok(kernels::matmul_into(dst, &dy.contiguous()?, &lin.weight().contiguous()?, Rhs::AsIs, accumulate)?))
    }

    /// [`Self::linear_backward`] with `dy · W` written into rows `ch` of `dst [b, s, ..]`
    /// (straight into them when they are one block, b = 1; else copied there).
    fn linear_backward_rows(
        &self,
        lin: &Linear,
        slots: LinSlots,
        x: &Tensor,
        dy: &Tensor,
        acc: &[Tensor],
        (dst, ch): (&Tensor, (usize, usize)),
    ) -> Result<()> {
        match rows_view(dst, ch)? {
            Some(rows) => self.linear_backward_into(lin, slots, x, dy, acc, (&rows, false)),
            None => self.put(dst, &self.linear_backward(lin, slots, x, dy, acc)?, ch),
        }
    }

    /// The sum of the input gradients `Σ dy_j · W_j` of linear layers that share their
    /// input `x [n, in]` (q, k, v; gate and up), made by the GEMMs into one fresh `[n, in]`
    /// buffer; every layer's weight gradients into its slots.
    fn linear_backward_sum(&self, parts: &[(&Linear, LinSlots, &Tensor)], x: &Tensor, acc: &[Tensor]) -> Result<Tensor> {
        let (n, width) = x.dims2()?;
        // SAFETY: the first GEMM below writes every element (accumulate = false).
        let sum = unsafe { row_buffer((n, width), x.dtype(), x.device()) }?;
        for (j, &(lin, slots, dy)) in parts.iter().enumerate() {
            self.linear_backward_into(lin, slots, x, dy, acc, (&sum, j > 0))?;
        }
        Ok(sum)
    }

    /// The backward of the RMSNorm (forward input `x`, its `rstd`) whose input fed the
    /// residual stream, for the gradient `dy` of its output: the input gradient added to the
    /// residual gradient in rows `ch` of `d_res [b, s, h]`, in place (the fused kernel, when
    /// the rows are one block); else the sum computed apart and copied there. The weight
    /// gradient into slot `slot`.
    fn rms_backward_rows(
        &self,
        norm: &RmsNorm,
        (x, rstd): (&Tensor, &Tensor),
        dy: &Tensor,
        (d_res, ch): (&Tensor, (usize, usize)),
        slot: usize,
        acc: &[Tensor],
    ) -> Result<()> {
        let rows = match norm.one_plus {
            false => rows_view(d_res, ch)?,
            true => None,
        };
        let dw = match rows {
            Some(rows) => self.t(Phase::NormRopeAct, || {
                Ok(kernels::rms_norm_bwd_into(&rows, &dy.contiguous()?, &x.contiguous()?, &norm.weight, rstd)?)
            })?,
            None => {
                let dres = self.rows(d_res, ch)?;
                let (dx, dw) = self.t(Phase::NormRopeAct, || rms_backward(norm, x, rstd, dy, Some(&dres)))?;
                self.put(d_res, &dx, ch)?;
                dw
            }
        };
        self.t(Phase::GradAccum, || accumulate(acc, slot, &dw))
    }

    fn rope_of(&self, layer: &DecoderLayer) -> &RopeTable {
        self.rope.get(layer.rope_local)
    }

    fn rows(&self, t: &Tensor, ch: (usize, usize)) -> Result<Tensor> {
        self.t(Phase::Copies, || chunk_rows(t, ch))
    }

    fn put(&self, dst: &Tensor, rows: &Tensor, ch: (usize, usize)) -> Result<()> {
        self.t(Phase::Copies, || put_rows(dst, rows, ch))
    }

    /// The attention core from the layer input: `q, k, v` projected chunk by chunk from
    /// `rms(x)` into whole-sequence buffers, RoPE on q and k in place, the attention.
    fn attn_core(&self, layer: &DecoderLayer, x: &Tensor) -> Result<SavedAttention> {
        let a = &layer.self_attn;
        let (b, s, _) = x.dims3()?;
        let (hq, hkv, d) = (a.num_heads, a.num_kv_heads, a.head_dim);
        // SAFETY: the loop below writes every chunk's rows of q, k and v.
        let z = |h: usize| unsafe { row_buffer((b, s, h, d), x.dtype(), x.device()) };
        let (q, k, v) = (z(hq)?, z(hkv)?, z(hkv)?);
        for &ch in self.chunks {
            let (n1, _) = self.t(Phase::NormRopeAct, || rms_forward(&layer.input_layernorm, &self.rows(x, ch)?))?;
            match (&a.q_norm, &a.k_norm) {
                (Some(qn), Some(kn)) => {
                    let (qc, kc) = (self.linear(&a.q_proj, &n1)?, self.linear(&a.k_proj, &n1)?);
                    let (qc, kc) =
                        self.t(Phase::NormRopeAct, || Ok((head_norm_forward(qn, &qc, d)?.0, head_norm_forward(kn, &kc, d)?.0)))?;
                    self.put(&q, &qc, ch)?;
                    self.put(&k, &kc, ch)?;
                }
                _ => {
                    self.linear_into_rows(&a.q_proj, &n1, &q, ch)?;
                    self.linear_into_rows(&a.k_proj, &n1, &k, ch)?;
                }
            }
            self.linear_into_rows(&a.v_proj, &n1, &v, ch)?;
        }
        let rope = self.rope_of(layer);
        self.t(Phase::NormRopeAct, || {
            kernels::rope_fwd_inplace(&q, &rope.cos, &rope.sin)?;
            Ok(kernels::rope_fwd_inplace(&k, &rope.cos, &rope.sin)?)
        })?;
        let mask = Masking::window(a.window);
        let (o, lse) = self.t(Phase::Attention, || Ok(self.attn.forward_masked(&q, &k, &v, mask, a.scale)?))?;
        Ok(SavedAttention { q, k, v, o, lse })
    }

    /// `h_c = x_c + o_c·Woᵀ` for one chunk, rows `[n, h]` (Gemma 3: `x_c + rms_a(o_c·Woᵀ)`),
    /// and the branch before its norm with the norm's `rstd` (Gemma 3, for the backward).
    fn residual_chunk(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        o: &Tensor,
        ch: (usize, usize),
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let a_out = self.linear(&layer.self_attn.o_proj, &self.rows(o, ch)?)?;
        self.residual_add(layer, x, a_out, ch)
    }

    /// [`Self::residual_chunk`] from the chunk's `o_proj` output `a_out [n, h]`.
    fn residual_add(
        &self,
        layer: &DecoderLayer,
        x: &Tensor,
        a_out: Tensor,
        ch: (usize, usize),
    ) -> Result<(Tensor, Option<(Tensor, Tensor)>)> {
        let (a, pre) = match layer.attn_out_norm() {
            Some(norm) => {
                let (a, rstd) = self.t(Phase::NormRopeAct, || rms_forward(norm, &a_out))?;
                (a, Some((a_out, rstd)))
            }
            None => (a_out, None),
        };
        Ok((self.t(Phase::Adds, || Ok(kernels::add(&self.rows(x, ch)?, &a.contiguous()?, None)?))?, pre))
    }

    /// `y_c = h_c + down(act(gate(n2), up(n2)))`, `n2 = rms(h_c)·w2`, rows `[n, h]`
    /// (Gemma 3: the branch normed before the add), written into rows `ch` of `y`, and the
    /// gate and up projections `g, u [n, i]`.
    fn mlp_chunk(&self, layer: &DecoderLayer, hc: &Tensor, y_all: &Tensor, ch: (usize, usize)) -> Result<(Tensor, Tensor)> {
        let m = &layer.mlp;
        let (n2, _) = self.t(Phase::NormRopeAct, || rms_forward(layer.mlp_norm(), hc))?;
        let g = self.linear(&m.gate_proj, &n2)?;
        let u = self.linear(&m.up_proj, &n2)?;
        let gu = self.t(Phase::NormRopeAct, || act_forward(layer, &g, &u))?;
        let y = self.linear(&m.down_proj, &gu)?;
        let y = match layer.mlp_out_norm() {
            Some(norm) => self.t(Phase::NormRopeAct, || Ok(rms_forward(norm, &y)?.0))?,
            None => y,
        };
        // The sum straight into the output's rows when they are one block (b = 1), else
        // summed apart and copied there.
        let y = y.contiguous()?;
        match rows_view(y_all, ch)? {
            Some(dst) => self.t(Phase::Adds, || Ok(kernels::add_into(&dst, hc, &y)?))?,
            None => {
                let yc = self.t(Phase::Adds, || Ok(kernels::add(hc, &y, None)?))?;
                self.put(y_all, &yc, ch)?;
            }
        }
        Ok((g, u))
    }

    /// The layer's output `[b, s, h]` for its input `x [b, s, h]` (the model's
    /// [`DecoderLayer::forward`], written out so that each piece is timed and only the
    /// attention core is whole-sequence), the attention's tensors for the backward, and
    /// with `keep_mlp` the MLP half's chunk tensors ([`SavedMlp`]: kept as computed, no copy).
    pub fn forward(&self, layer: &DecoderLayer, x: &Tensor, keep_mlp: bool) -> Result<(Tensor, SavedAttention, Option<SavedMlp>)> {
        let core = self.attn_core(layer, x)?;
        // SAFETY: the loop below writes every chunk's rows of y.
        let y = unsafe { row_buffer(x.shape(), x.dtype(), x.device()) }?;
        let mut kept = Vec::with_capacity(if keep_mlp { self.chunks.len() } else { 0 });
        for &ch in self.chunks {
            let (hc, pre) = self.residual_chunk(layer, x, &core.o, ch)?;
            let (g, u) = self.mlp_chunk(layer, &hc, &y, ch)?;
            if keep_mlp {
                // The residual stream itself, or (Gemma 3) the branch before its norm, which
                // the backward's norm needs and rebuilds `h_c` from without `o_proj`.
                kept.push([pre.map_or(hc, |(a_out, _)| a_out), g, u]);
            }
        }
        Ok((y, core, keep_mlp.then_some(SavedMlp { chunks: kept })))
    }

    /// `dh_c` of one chunk of the MLP half for `dy_c` (rows `ch` of `dy [b, s, h]`): the
    /// residual plus the branch's gradient, written over `dy_c`. Weight gradients into their
    /// slots.
    /// `gu`: the chunk's gate and up projections when the forward kept them (else
    /// recomputed from `hc`).
    fn mlp_chunk_backward(
        &self,
        layer: &DecoderLayer,
        sl: &LayerSlots,
        hc: &Tensor,
        gu: Option<(Tensor, Tensor)>,
        (dy, ch): (&Tensor, (usize, usize)),
        acc: &[Tensor],
    ) -> Result<()> {
        let m = &layer.mlp;
        let dyc = &self.rows(dy, ch)?;
        let (n2, rstd2) = self.t(Phase::NormRopeAct, || rms_forward(layer.mlp_norm(), hc))?;
        let (g, u) = match gu {
            Some(gu) => gu,
            None => (self.linear(&m.gate_proj, &n2)?, self.linear(&m.up_proj, &n2)?), // [n, i] each
        };
        let (dg, du) = match (layer.mlp_out_norm(), sl.ff, layer.mlp.gelu_tanh) {
            // SwiGLU without an output norm: the down projection's input gradient first, then
            // one pass over gate and up gives their gradients and the down projection's
            // input, which its weight gradient needs.
            (None, _, false) => {
                let dm = self.t(Phase::Gemm, || Ok(dyc.contiguous()?.matmul(m.down_proj.weight())?))?; // [n, i]
                let (dg, du, gu) = self.t(Phase::NormRopeAct, || Ok(kernels::swiglu_bwd_fwd(&dm, &g, &u)?))?;
                drop((dm, g, u));
                self.weight_grads(sl.down, &gu, dyc, acc)?;
                (dg, du)
            }
            (out_norm, ff, _) => {
                let gu = self.t(Phase::NormRopeAct, || act_forward(layer, &g, &u))?;
                // Gemma 3: through the MLP-output norm, on the recomputed branch.
                let dbranch = match (out_norm, ff) {
                    (Some(norm), Some((_, slot))) => {
                        let y = self.linear(&m.down_proj, &gu)?;
                        self.t(Phase::NormRopeAct, || {
                            let (_, rstd) = rms_forward(norm, &y)?;
                            let (dbranch, dw) = rms_backward(norm, &y, &rstd, dyc, None)?;
                            accumulate(acc, slot, &dw)?;
                            Ok(dbranch)
                        })?
                    }
                    _ => dyc.clone(),
                };
                let dm = self.linear_backward(&m.down_proj, sl.down, &gu, &dbranch, acc)?; // [n, i]
                drop((gu, dbranch));
                let d = self.t(Phase::NormRopeAct, || act_backward(layer, &dm, &g, &u))?;
                drop((dm, g, u));
                d
            }
        };
        let dn2 = self.linear_backward_sum(&[(&m.gate_proj, sl.gate, &dg), (&m.up_proj, sl.up, &du)], &n2, acc)?;
        drop((dg, du));
        // dh_c = dy_c (the residual) + the norm's backward, in one kernel, over dy_c.
        self.rms_backward_rows(layer.mlp_norm(), (hc, &rstd2), &dn2, (dy, ch), sl.mlp_norm(), acc)
    }

    /// The gradient of the attention branch (o_proj's output) for `dh`, the gradient of the
    /// residual stream after it: `dh` itself, or (Gemma 3) through the attention-output norm
    /// at the branch `pre = (a_out, rstd)` that [`Self::residual_chunk`] recomputed.
    fn attn_out_backward(
        &self,
        layer: &DecoderLayer,
        sl: &LayerSlots,
        pre: Option<(Tensor, Tensor)>,
        dh: &Tensor,
        acc: &[Tensor],
    ) -> Result<Tensor> {
        let (Some(norm), Some((a_out, rstd))) = (layer.attn_out_norm(), pre) else { return Ok(dh.clone()) };
        self.t(Phase::NormRopeAct, || {
            let (da, dw) = rms_backward(norm, &a_out, &rstd, dh, None)?;
            accumulate(acc, sl.ln2, &dw)?;
            Ok(da)
        })
    }

    /// Gradient of the layer's input for the gradient of its output `dy [b, s, h]`, which
    /// it overwrites (first with the gradient after the attention half, then with the
    /// gradient of the input) and returns; every weight gradient of the layer is added
    /// into `acc` (f32). `saved` is what the forward kept: the layer's input as the forward
    /// saw it, its attention tensors (else the attention core is rerun) and its MLP half's
    /// chunk tensors (else `o_proj`, the residual add and the gate and up projections are
    /// rerun; they must come from the same token chunks as this pass's).
    pub fn backward(&self, layer: &DecoderLayer, sl: &LayerSlots, saved: SavedLayer, dy: Tensor, acc: &[Tensor]) -> Result<Tensor> {
        let SavedLayer { x, attention, mlp } = saved;
        let x = &x;
        let dy = self.t(Phase::Copies, || Ok(dy.contiguous()?))?;
        let core = match attention {
            Some(c) => c,
            None => self.attn_core(layer, x)?,
        };
        let mut mlp = match mlp {
            Some(m) if m.chunks.len() != self.chunks.len() => {
                return Err(crate::Error::Setting(format!(
                    "engine: the forward kept the MLP of {} token chunks, the backward runs {}",
                    m.chunks.len(),
                    self.chunks.len()
                )))
            }
            Some(m) => m.chunks.into_iter().map(Some).collect(),
            None => vec![None; self.chunks.len()],
        };
        let a = &layer.self_attn;
        // SAFETY: the loop below writes every chunk's rows of d_o.
        let d_o = unsafe { row_buffer(core.o.shape(), core.o.dtype(), core.o.device()) }?;
        // MLP half and o_proj, chunk by chunk: dy_c → dh_c (written over dy_c), d_o_c.
        for (i, &ch) in self.chunks.iter().enumerate() {
            let (hc, pre, gu) = match (mlp[i].take(), layer.attn_out_norm()) {
                (Some([hc, g, u]), None) => (hc, None, Some((g, u))),
                (Some([a_out, g, u]), Some(_)) => {
                    let (hc, pre) = self.residual_add(layer, x, a_out, ch)?;
                    (hc, pre, Some((g, u)))
                }
                (None, _) => {
                    let (hc, pre) = self.residual_chunk(layer, x, &core.o, ch)?;
                    (hc, pre, None)
                }
            };
            self.mlp_chunk_backward(layer, sl, &hc, gu, (&dy, ch), acc)?;
            drop(hc);
            let da = self.attn_out_backward(layer, sl, pre, &self.rows(&dy, ch)?, acc)?;
            self.linear_backward_rows(&a.o_proj, sl.o, &self.rows(&core.o, ch)?, &da, acc, (&d_o, ch))?;
        }
        let d = a.head_dim;
        let SavedAttention { q, k, v, o, lse } = core;
        let (saved, mask) = (Saved::new(&q, &k, &v, &o, &lse), Masking::window(a.window));
        let (dq, dk, dv) = self.t(Phase::Attention, || Ok(self.attn.backward_masked(&d_o, saved, mask, a.scale)?))?;
        drop((q, k, v, o, lse, d_o));
        let (dq, dk, dv) = self.t(Phase::Copies, || Ok((dq.contiguous()?, dk.contiguous()?, dv.contiguous()?)))?;
        let rope = self.rope_of(layer);
        self.t(Phase::NormRopeAct, || {
            kernels::rope_bwd_inplace(&dq, &rope.cos, &rope.sin)?;
            Ok(kernels::rope_bwd_inplace(&dk, &rope.cos, &rope.sin)?)
        })?;
        // q/k/v projections and the input norm, chunk by chunk: dh_c → dx_c (over dy_c).
        for &ch in self.chunks {
            let xc = self.rows(x, ch)?;
            let (n1, rstd1) = self.t(Phase::NormRopeAct, || rms_forward(&layer.input_layernorm, &xc))?;
            let (dqc, dkc) = (self.rows(&dq, ch)?, self.rows(&dk, ch)?);
            // Qwen3: through the per-head norms, on the projections recomputed from n1.
            let (dqc, dkc) = match (&a.q_norm, &a.k_norm, sl.q_norm, sl.k_norm) {
                (Some(qn), Some(kn), Some(sq), Some(sk)) => {
                    let (qc, kc) = (self.linear(&a.q_proj, &n1)?, self.linear(&a.k_proj, &n1)?);
                    self.t(Phase::NormRopeAct, || {
                        let (_, rq) = head_norm_forward(qn, &qc, d)?;
                        let (dqc, dwq) = head_norm_backward(qn, &qc, &rq, &dqc, d)?;
                        let (_, rk) = head_norm_forward(kn, &kc, d)?;
                        let (dkc, dwk) = head_norm_backward(kn, &kc, &rk, &dkc, d)?;
                        accumulate(acc, sq, &dwq)?;
                        accumulate(acc, sk, &dwk)?;
                        Ok((dqc, dkc))
                    })?
                }
                (None, None, _, _) => (dqc, dkc),
                _ => return Err(crate::Error::Setting("engine: q/k norm weights without gradient slots".into())),
            };
            let dvc = self.rows(&dv, ch)?;
            let parts = [(&a.q_proj, sl.q, &dqc), (&a.k_proj, sl.k, &dkc), (&a.v_proj, sl.v, &dvc)];
            let dn1 = self.linear_backward_sum(&parts, &n1, acc)?;
            // dx = dh (the residual) + the norm's backward, in one kernel, over dh.
            self.rms_backward_rows(&layer.input_layernorm, (&xc, &rstd1), &dn1, (&dy, ch), sl.ln1, acc)?;
        }
        Ok(dy)
    }
}
