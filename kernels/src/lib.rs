//! Fused training kernels for longctx, each a plain function on `candle_core::Tensor`
//! with a CUDA kernel (feature `cuda`, PTX built from `src/cuda/*.cu`) and a CPU twin
//! (straightforward Rust with rayon) that runs on CPU tensors.
//!
//! Shapes: `b` batch, `s` tokens, `h` hidden, `i` intermediate, `H` heads, `d` head dim,
//! `V` vocabulary, `n` flat elements; `..` any leading dims (flattened to rows).
//! Activations are bf16, f16 or f32 (T) with f32 math inside; statistics and optimizer
//! state are f32. Every tensor argument must be contiguous: otherwise the call returns an
//! error naming the op and the argument (no op panics on bad input).
//!
//! None of these ops records a graph: they are the pieces of an explicit (llm.c-style)
//! decoder-layer backward, not autograd ops. The ops are Candle custom ops
//! (`CustomOp2/3`, `InplaceOp1/2/3`); outputs beyond the first travel in the op struct.
//!
//! # How the engine is meant to call them
//! One pre-norm decoder layer, forward (`x` the layer input `[b, s, h]`, `a`/`m_out` the
//! attention and MLP outputs of the previous layer when the residual add is deferred):
//! 1. [`rms_norm_fwd`]`(x, residual, w_in, eps)` → `y1, x_sum, rstd1`: the previous
//!    layer's last residual add and this layer's input norm in one pass; keep `x_sum`
//!    (the residual stream) and `rstd1 [b, s]` for the backward.
//! 2. q, k, v = GEMMs of `y1`; [`rope_fwd_inplace`] on q `[b, s, hq, d]` and on k
//!    `[b, s, hkv, d]` with the `RopeTable` cos/sin `[b, s, 1, d]`; attention.
//! 3. `o_proj` GEMM → `a`; [`rms_norm_fwd`]`(x_sum, Some(a), w_post, eps)` → `y2, h_sum, rstd2`.
//! 4. gate, up = GEMMs of `y2`; [`swiglu_fwd`]`(gate, up)`; `down_proj` GEMM.
//!
//! Backward, top down (`g` the gradient on the residual stream):
//! 1. `dgu` = `down_projᵀ` GEMM of `g`; recompute gate/up (or keep them);
//!    [`swiglu_bwd`]`(dgu, gate, up)` → `dgate, dup`; the two input GEMMs give `dy2`.
//! 2. [`rms_norm_bwd`]`(dy2, h_sum, w_post, rstd2, Some(g))` → `dh` (gradient of the
//!    residual stream after attention) and `dw_post [h]` f32.
//! 3. `o_proj`ᵀ GEMM, attention backward → dq, dk, dv; [`rope_bwd_inplace`] on dq and dk.
//! 4. q/k/v input GEMMs → `dy1`; [`rms_norm_bwd`]`(dy1, x_sum, w_in, rstd1, Some(dh))` →
//!    gradient of the layer input and `dw_in`.
//!
//! Weight gradients from GEMMs in bf16 go into f32 accumulators with
//! [`accumulate_f32`] (no f32 copy, no new tensor), or straight from the GEMM with
//! [`matmul_acc_f32`]. Where a token chunk's rows are one block of a whole-sequence buffer,
//! [`matmul_into`] writes a projection there (or sums the input gradients of q, k, v, and
//! of gate and up, onto it: beta = 1) and [`rms_norm_bwd_into`] writes the norm's input
//! gradient over the residual gradient, so nothing is copied after them;
//! [`swiglu_bwd_fwd`] gives a recomputing backward the down projection's input with the
//! gate and up gradients in one pass; [`embedding_grad_add`] adds `dL/dx_0` into the
//! embedding's rows. The head: [`rms_norm_fwd`] (final
//! norm) then [`linear_cross_entropy`]`(hidden, lm_head, targets, 1/global_count,
//! chunk, Some(dw_lm_head))`, whose `dhidden` feeds [`rms_norm_bwd`] of the final norm; the
//! chunked logits `[c, V]` exist once (their gradient is written over them). The
//! optimizer: [`adamw_step`] on this rank's flat f32 shard (`grad_scale` = the clip
//! factor, `param_copy` = the model-dtype shard that the all-gather then spreads).

//!
//! # Limits
//! CUDA: RMSNorm backward needs `h ≤ 12288` (its weight-gradient sum lives in shared
//! memory); row kernels launch one block per row (fewer than 2³¹ rows). A target ≥ V gives
//! a NaN loss on the GPU (an error on the CPU). The fast paths use 16-byte accesses when
//! the row length is a multiple of 8 and the buffers are 16-byte aligned (always true for
//! fresh Candle tensors), else one element at a time.

mod accumulate;
mod adamw;
mod add;
mod common;
mod cross_entropy;
#[cfg(feature = "cuda")]
mod cuda;
mod gemm_acc;
mod gemma;
mod multi;
mod reduce;
mod rmsnorm;
mod rope;
mod swiglu;

pub use accumulate::{accumulate_f32, embedding_grad_add};
pub use adamw::{adamw_step, AdamWStep, Scalars as AdamWScalars};
pub use add::{add, add_into};
pub use cross_entropy::{cross_entropy_inplace, linear_cross_entropy, LinearCe};
pub use gemm_acc::{matmul_acc_f32, matmul_into, Rhs};
pub use gemma::{geglu_tanh_bwd, geglu_tanh_fwd, rms_norm_1p_bwd, rms_norm_1p_fwd};
pub use reduce::{count_non_finite, sum_squares, sum_squares_partials};
pub use rmsnorm::{rms_norm_bwd, rms_norm_bwd_into, rms_norm_fwd, RmsNormGrads, RmsNormOut};
pub use rope::{rope_bwd_inplace, rope_fwd_inplace};
pub use swiglu::{swiglu_bwd, swiglu_bwd_fwd, swiglu_fwd};
