//! Naive reference attention with Candle tensor ops: it materialises the full score
//! matrix, so it is only for tests and for devices without a fused kernel.
//!
//! Shapes: `q [b,s,hq,d]`, `k`/`v [b,t,hkv,d]`, `o [b,s,hq,d]`, `lse [b,hq,s]` f32.
//! Internally everything is head-major: `[b,hq,s,d]`, scores `[b,hq,s,t]`.
//! Arithmetic runs in the dtype of `q` (tests pass F64 tensors to get a high-precision
//! reference); `lse` is returned in f32, `o` and the gradients in the dtype of `q`.
//! GQA repeats each kv head over its `hq / hkv` query heads (query head `h` reads kv
//! head `h / (hq / hkv)`); in the backward the gradients of a group are summed.
//! Masked scores are `-inf` and become probability exactly 0: no arithmetic ever
//! subtracts two infinities.

use crate::kernel::{check_shapes, Mask, Saved};
use candle_core::{DType, Device, Result, Tensor, D};

/// `[b,n,h,d]` token-major -> `[b,h,n,d]` head-major, contiguous, in `dtype`.
fn heads_first(x: &Tensor, dtype: DType) -> Result<Tensor> {
    x.to_dtype(dtype)?.transpose(1, 2)?.contiguous()
}

/// Repeat kv heads `[b,hkv,t,d]` -> `[b,hkv*g,t,d]` (kv head j serves query heads j*g..(j+1)*g).
fn repeat_kv(x: &Tensor, g: usize) -> Result<Tensor> {
    if g == 1 {
        return Ok(x.clone());
    }
    let (b, hkv, t, d) = x.dims4()?;
    x.unsqueeze(2)?.broadcast_as((b, hkv, g, t, d))?.reshape((b, hkv * g, t, d))
}

/// Sum query-head gradients `[b,hkv*g,t,d]` back onto their kv heads `[b,hkv,t,d]`.
fn sum_groups(x: &Tensor, g: usize) -> Result<Tensor> {
    if g == 1 {
        return Ok(x.clone());
    }
    let (b, hq, t, d) = x.dims4()?;
    x.reshape((b, hq / g, g, t, d))?.sum(2)
}

/// Keep-mask `[s,t]` (u8): 1 where query i sees key j under `mask` ([`Mask::keys`]).
fn keep_mask(mask: Mask, s: usize, t: usize, device: &Device) -> Result<Tensor> {
    let keep: Vec<u8> = (0..s)
        .flat_map(|i| {
            let (lo, hi) = mask.keys(i, t);
            (0..t).map(move |j| u8::from(lo <= j && j < hi))
        })
        .collect();
    Tensor::from_vec(keep, (s, t), device)
}

/// Scaled scores `[b,hq,s,t]` with masked entries set to `-inf`.
fn scores(q: &Tensor, k: &Tensor, mask: Mask, scale: f64) -> Result<Tensor> {
    let sc = (q.matmul(&k.t()?)? * scale)?;
    match mask {
        Mask::None => Ok(sc),
        Mask::Causal | Mask::Band { .. } => {
            let (_, _, s, t) = sc.dims4()?;
            let keep = keep_mask(mask, s, t, sc.device())?.broadcast_as(sc.shape())?;
            let neg = Tensor::full(f64::NEG_INFINITY, sc.shape(), sc.device())?.to_dtype(sc.dtype())?;
            keep.where_cond(&sc, &neg)
        }
    }
}

/// Reference forward: `(o [b,s,hq,d] dtype of q, lse [b,hq,s] f32)`.
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor)> {
    let (b, s, t, hq, hkv, _d) = check_shapes(q, k, v, mask)?;
    let dt = q.dtype();
    if t == 0 {
        // No keys at all: empty softmax, o = 0 and lse = -inf.
        let lse = Tensor::full(f32::NEG_INFINITY, (b, hq, s), q.device())?;
        return Ok((q.zeros_like()?, lse));
    }
    let g = hq / hkv;
    let qh = heads_first(q, dt)?;
    let kh = repeat_kv(&heads_first(k, dt)?, g)?;
    let vh = repeat_kv(&heads_first(v, dt)?, g)?;
    let sc = scores(&qh, &kh, mask, scale)?;
    // A band row may keep no key: its max is -inf, shifted by 0 instead (so exp gives 0,
    // never exp(-inf - -inf)); its sum is 0, divided by 1 (o = 0), and lse = log 0 = -inf.
    let m = sc.max_keepdim(D::Minus1)?;
    let m = m.ge(f32::MIN as f64)?.where_cond(&m, &m.zeros_like()?)?;
    let e = sc.broadcast_sub(&m)?.exp()?;
    let l = e.sum_keepdim(D::Minus1)?;
    let l_div = l.gt(0.0)?.where_cond(&l, &l.ones_like()?)?;
    let o = e.broadcast_div(&l_div)?.matmul(&vh.contiguous()?)?;
    let lse = (m + l.log()?)?.squeeze(D::Minus1)?;
    Ok((o.transpose(1, 2)?.contiguous()?, lse.to_dtype(DType::F32)?))
}

/// Reference backward with the given (global) `o` and `lse`:
/// `P = exp(S - lse)`, `dV = Pᵀ dO`, `dP = dO Vᵀ`, `D = rowsum(dO∘O)`,
/// `dS = P∘(dP - D)`, `dQ = scale·dS K`, `dK = scale·dSᵀ Q`. Returns `(dq, dk, dv)` in q's dtype.
pub fn bwd(d_o: &Tensor, saved: Saved<'_>, mask: Mask, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    let (_b, _s, _t, hq, hkv, _d) = saved.check(d_o, mask)?;
    let Saved { q, k, v, o, lse } = saved;
    let dt = q.dtype();
    let g = hq / hkv;
    let qh = heads_first(q, dt)?;
    let kh = repeat_kv(&heads_first(k, dt)?, g)?.contiguous()?;
    let vh = repeat_kv(&heads_first(v, dt)?, g)?.contiguous()?;
    let doh = heads_first(d_o, dt)?;
    let oh = heads_first(o, dt)?;
    // A row with lse = -inf received no probability anywhere: use +inf so that
    // S - lse = -inf (never -inf - -inf) and P = 0 on that row.
    let lse = lse.to_dtype(DType::F32)?;
    let finite = lse.ge(f32::MIN as f64)?;
    let pos_inf = Tensor::full(f32::INFINITY, lse.shape(), lse.device())?;
    let lse = finite.where_cond(&lse, &pos_inf)?.to_dtype(dt)?.unsqueeze(D::Minus1)?;

    let sc = scores(&qh, &kh, mask, scale)?;
    let p = sc.broadcast_sub(&lse)?.exp()?; // [b,hq,s,t]
    let dv = p.t()?.matmul(&doh)?; // [b,hq,t,d]
    let dp = doh.matmul(&vh.t()?)?; // [b,hq,s,t]
    let dd = (&doh * &oh)?.sum_keepdim(D::Minus1)?; // [b,hq,s,1]
    let ds = (p * dp.broadcast_sub(&dd)?)?;
    let dq = (ds.matmul(&kh)? * scale)?;
    let dk = (ds.t()?.matmul(&qh)? * scale)?;
    let dk = sum_groups(&dk, g)?;
    let dv = sum_groups(&dv, g)?;
    Ok((dq.transpose(1, 2)?.contiguous()?, dk.transpose(1, 2)?.contiguous()?, dv.transpose(1, 2)?.contiguous()?))
}
