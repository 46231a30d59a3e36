//! The block-kernel contract, dispatched per device.
//!
//! `fwd(q [b,s,hq,d], k [b,t,hkv,d], v [b,t,hkv,d], mask, scale) -> (o [b,s,hq,d] dtype of q, lse [b,hq,s] f32)`
//! `bwd(do, q, k, v, o, lse, mask, scale) -> (dq, dk, dv)` in the dtype of q, where `o`/`lse`
//! are the *final* (global) output and log-sum-exp: the kernel recomputes
//! `P = exp(S - lse)` and `D = rowsum(do * o)` from them, so block backwards of a
//! split attention sum to the exact gradient.
//! `Mask::Causal` is the diagonal block (s == t, query i sees keys 0..=i).

use candle_core::{Result, Tensor};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Mask {
    None,
    Causal,
}

/// Check shapes of a block call; returns (b, s, t, hq, hkv, d).
pub fn check_shapes(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask) -> Result<(usize, usize, usize, usize, usize, usize)> {
    let (b, s, hq, d) = q.dims4()?;
    let (bk, t, hkv, dk) = k.dims4()?;
    if k.dims() != v.dims() {
        return crate::shape_err!("k {:?} and v {:?} differ", k.dims(), v.dims());
    }
    if bk != b || dk != d {
        return crate::shape_err!("q {:?} and k {:?} disagree on batch or head dim", q.dims(), k.dims());
    }
    if hkv == 0 || hq % hkv != 0 {
        return crate::shape_err!("query heads {hq} not a multiple of kv heads {hkv}");
    }
    if mask == Mask::Causal && s != t {
        return crate::shape_err!("causal block needs equal q/kv lengths, got {s} vs {t}");
    }
    Ok((b, s, t, hq, hkv, d))
}

/// [`check_shapes`] plus the backward's extra inputs: `do` and `o` shaped like `q`,
/// `lse [b, hq, s]`. Returns (b, s, t, hq, hkv, d).
#[allow(clippy::too_many_arguments)]
pub fn check_bwd_shapes(
    d_o: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    mask: Mask,
) -> Result<(usize, usize, usize, usize, usize, usize)> {
    let dims = check_shapes(q, k, v, mask)?;
    let (b, s, _, hq, _, _) = dims;
    if d_o.dims() != q.dims() || o.dims() != q.dims() {
        return crate::shape_err!("attention backward: do {:?} and o {:?} must match q {:?}", d_o.dims(), o.dims(), q.dims());
    }
    if lse.dims() != [b, hq, s] {
        return crate::shape_err!("attention backward: lse {:?} must be [b, hq, s] = {:?}", lse.dims(), [b, hq, s]);
    }
    Ok(dims)
}

/// Block forward on whatever device the inputs live on.
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor)> {
    check_shapes(q, k, v, mask)?;
    match q.device() {
        candle_core::Device::Cpu => crate::cpu::fwd(q, k, v, mask, scale),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => crate::cuda::fwd(q, k, v, mask, scale),
        _ => crate::naive::fwd(q, k, v, mask, scale),
    }
}

/// Block backward with the global `o` and `lse`.
#[allow(clippy::too_many_arguments)]
pub fn bwd(
    d_o: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    mask: Mask,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    check_bwd_shapes(d_o, q, k, v, o, lse, mask)?;
    match q.device() {
        candle_core::Device::Cpu => crate::cpu::bwd(d_o, q, k, v, o, lse, mask, scale),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => crate::cuda::bwd(d_o, q, k, v, o, lse, mask, scale),
        _ => crate::naive::bwd(d_o, q, k, v, o, lse, mask, scale),
    }
}
