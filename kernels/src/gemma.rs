//! Gemma's two pieces that differ from Llama's, forward and backward, composed from Candle
//! tensor ops (so they run on any device, CPU or CUDA, with no kernel of their own; f32
//! math inside, the result cast to the activation dtype T ∈ {bf16, f16, f32}):
//! - RMSNorm with the weight applied as `1 + w`, in f32, cast after (transformers'
//!   `Gemma3RMSNorm`): `r = 1/√(mean(x²) + eps)`, `n = x·r`, `y = T(n·(1 + w))`.
//!   Backward (`g = dy·(1 + w)`): `dx = r·(g − n·mean(g·n)) + d_residual`, `dw = Σ_rows dy·n`.
//! - GeGLU with the tanh GELU (`gelu_pytorch_tanh`): `out = gelu(gate)·up`,
//!   `gelu(g) = g/2·(1 + t)`, `t = tanh(k·(g + c·g³))`, `k = √(2/π)`, `c = 0.044715`.
//!   Backward: `dgate = dout·up·gelu'(g)`, `gelu'(g) = (1 + t)/2 + g/2·(1 − t²)·k·(1 + 3c·g²)`,
//!   `dup = dout·gelu(g)`.
//!
//! Shapes: `x`, `y`, `dy`, `dx`, `d_residual`: `[.., h]` (T); `weight`: `[h]` (T);
//! `rstd`: `[.., 1]` f32; `dweight`: `[h]` f32; `gate`, `up`, `dout`: `[..]` (T).
//! Unlike the fused kernels these allocate their f32 intermediates (a few `[.., h]`
//! tensors per call); the norms and the activation are a small share of a step.

use candle_core::{DType, Result, Tensor, D};

/// `(y [.., h] (T), rstd [.., 1] f32)` of the `1 + w` RMSNorm of `x`.
pub fn rms_norm_1p_fwd(x: &Tensor, weight: &Tensor, eps: f64) -> Result<(Tensor, Tensor)> {
    let x32 = x.to_dtype(DType::F32)?;
    let rstd = (x32.sqr()?.mean_keepdim(D::Minus1)? + eps)?.sqrt()?.recip()?;
    let w1 = (weight.to_dtype(DType::F32)? + 1.0)?;
    let y = x32.broadcast_mul(&rstd)?.broadcast_mul(&w1)?.to_dtype(x.dtype())?;
    Ok((y, rstd))
}

/// Backward of [`rms_norm_1p_fwd`]: `(dx [.., h] (T, plus `d_residual` when given),
/// dweight [h] f32)` for the gradient `dy` of `y`.
pub fn rms_norm_1p_bwd(dy: &Tensor, x: &Tensor, weight: &Tensor, rstd: &Tensor, d_residual: Option<&Tensor>) -> Result<(Tensor, Tensor)> {
    let h = x.dim(D::Minus1)?;
    let dy32 = dy.to_dtype(DType::F32)?;
    let n = x.to_dtype(DType::F32)?.broadcast_mul(rstd)?; // [.., h]
    let dweight = dy32.mul(&n)?.reshape(((), h))?.sum(0)?; // [h]
    let g = dy32.broadcast_mul(&(weight.to_dtype(DType::F32)? + 1.0)?)?;
    let mean_gn = g.mul(&n)?.mean_keepdim(D::Minus1)?; // [.., 1]
    let mut dx = g.sub(&n.broadcast_mul(&mean_gn)?)?.broadcast_mul(rstd)?;
    if let Some(r) = d_residual {
        dx = dx.add(&r.to_dtype(DType::F32)?)?;
    }
    Ok((dx.to_dtype(dy.dtype())?, dweight))
}

const K: f64 = 0.797_884_560_802_865_4; // √(2/π)
const C: f64 = 0.044_715;

/// `t = tanh(k·(g + c·g³))` of f32 `g`.
fn tanh_inner(g: &Tensor) -> Result<Tensor> {
    (g.add(&(g.powf(3.0)? * C)?)? * K)?.tanh()
}

/// `gelu_tanh(gate)·up` (T).
pub fn geglu_tanh_fwd(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    let g = gate.to_dtype(DType::F32)?;
    let gelu = (g.mul(&(tanh_inner(&g)? + 1.0)?)? * 0.5)?;
    gelu.mul(&up.to_dtype(DType::F32)?)?.to_dtype(gate.dtype())
}

/// Backward of [`geglu_tanh_fwd`]: `(dgate, dup)` (T) for `dout`.
pub fn geglu_tanh_bwd(dout: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    let (g, u, d) = (gate.to_dtype(DType::F32)?, up.to_dtype(DType::F32)?, dout.to_dtype(DType::F32)?);
    let t = tanh_inner(&g)?;
    let one_t = (&t + 1.0)?;
    let gelu = (g.mul(&one_t)? * 0.5)?;
    // (1 − t²)·k·(1 + 3c·g²)
    let inner = ((t.sqr()?.neg()? + 1.0)?.mul(&((g.sqr()? * (3.0 * C))? + 1.0)?)? * K)?;
    let dgelu = ((one_t + g.mul(&inner)?)? * 0.5)?;
    let dgate = d.mul(&u)?.mul(&dgelu)?.to_dtype(gate.dtype())?;
    let dup = d.mul(&gelu)?.to_dtype(up.dtype())?;
    Ok((dgate, dup))
}
