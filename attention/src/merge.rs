//! The one stable log-sum-exp merge of partial attention results, shared by every mode.
//!
//! Shapes: accumulator `o [b,s,h,d]` f32 and `lse [b,h,s]` f32; a block result
//! `o_b [b,s_b,h,d]` (any float dtype) and `lse_b [b,h,s_b]` f32 covering token rows
//! `offset..offset+s_b` of the accumulator.
//!
//! Per row, with `lse' = logaddexp(lse, lse_b) = max + log1p(exp(min - max))`:
//! `o' = o·exp(lse - lse') + o_b·exp(lse_b - lse')`. Both weights are ≤ 1, so nothing
//! overflows. A row where both sides are `-inf` (no key seen yet) stays `o = 0`,
//! `lse = -inf`: the arithmetic never subtracts two infinities, so no NaN appears.
//! On the CPU the merge runs over plain slices; elsewhere it uses Candle tensor ops.

use candle_core::{DType, Device, Result, Tensor, D};
use rayon::prelude::*;

/// Running partial result: `o` f32 `[b,s,h,d]`, `lse` f32 `[b,h,s]`.
#[derive(Clone, Debug)]
pub struct Acc {
    /// `[b,s,h,d]` f32, already normalised by `exp(lse)`.
    pub o: Tensor,
    /// `[b,h,s]` f32, `-inf` on rows that have seen no key.
    pub lse: Tensor,
}

impl Acc {
    /// An accumulator that has seen nothing: `o = 0`, `lse = -inf`.
    pub fn empty(b: usize, s: usize, h: usize, d: usize, device: &Device) -> Result<Acc> {
        Ok(Acc { o: Tensor::zeros((b, s, h, d), DType::F32, device)?, lse: Tensor::full(f32::NEG_INFINITY, (b, h, s), device)? })
    }

    /// The final `(o in dtype, lse f32)`.
    pub fn finish(self, dtype: DType) -> Result<(Tensor, Tensor)> {
        Ok((self.o.to_dtype(dtype)?, self.lse))
    }
}

/// Merge a full-length block result into the accumulator (`offset` 0).
pub fn merge(acc: Option<Acc>, o_b: &Tensor, lse_b: &Tensor) -> Result<Acc> {
    merge_at(acc, o_b, lse_b, 0)
}

/// Merge a block result (`o_b [b,s_b,h,d]` any float dtype, `lse_b [b,h,s_b]`) into token
/// rows `offset..offset+s_b` of the accumulator. `None` seeds the accumulator with the
/// block itself, which then must start at offset 0 (and defines the full length); to merge
/// partial rows into a fresh accumulator, start from [`Acc::empty`].
pub fn merge_at(acc: Option<Acc>, o_b: &Tensor, lse_b: &Tensor, offset: usize) -> Result<Acc> {
    merge_impl(acc, o_b, lse_b, offset, true)
}

/// [`merge_at`] that never takes the CPU fast path, so tests can compare the two.
#[doc(hidden)]
pub fn merge_at_tensor_ops(acc: Option<Acc>, o_b: &Tensor, lse_b: &Tensor, offset: usize) -> Result<Acc> {
    merge_impl(acc, o_b, lse_b, offset, false)
}

fn merge_impl(acc: Option<Acc>, o_b: &Tensor, lse_b: &Tensor, offset: usize, fast: bool) -> Result<Acc> {
    let (b, s_b, h, d) = o_b.dims4()?;
    if lse_b.dims() != [b, h, s_b] {
        return crate::shape_err!("merge: block lse {:?} must be [b,h,s_b] = {:?}", lse_b.dims(), [b, h, s_b]);
    }
    let Some(acc) = acc else {
        if offset != 0 {
            return crate::shape_err!("merge: seeding a fresh accumulator needs offset 0, got {offset} (use Acc::empty)");
        }
        return Ok(Acc { o: o_b.to_dtype(DType::F32)?, lse: lse_b.to_dtype(DType::F32)? });
    };
    let (ab, s, ah, ad) = acc.o.dims4()?;
    if (ab, ah, ad) != (b, h, d) || offset + s_b > s {
        return crate::shape_err!("merge: block o {:?} at offset {offset} does not fit accumulator o {:?}", o_b.dims(), acc.o.dims());
    }
    if acc.lse.dims() != [b, h, s] {
        return crate::shape_err!("merge: accumulator lse {:?} must be [b,h,s] = {:?}", acc.lse.dims(), [b, h, s]);
    }
    if s_b == 0 {
        return Ok(acc);
    }
    let all_cpu = acc.o.device().is_cpu() && o_b.device().is_cpu() && lse_b.device().is_cpu();
    if fast && all_cpu {
        merge_cpu(acc, o_b, lse_b, offset)
    } else {
        merge_tensor(acc, o_b, lse_b, offset)
    }
}

/// Weights `(w_a, w_b, lse')` of one row: `lse' = logaddexp(a, b)`, `w = exp(x - lse')`.
/// Both `-inf` gives `(0, 0, -inf)`.
#[inline]
fn row_weights(a: f32, b: f32) -> (f32, f32, f32) {
    let (mx, mn) = if a >= b { (a, b) } else { (b, a) };
    if mx == f32::NEG_INFINITY {
        return (0.0, 0.0, f32::NEG_INFINITY);
    }
    // mx is finite here; mn - mx is ≤ 0 or -inf, never inf - inf.
    let l = mx + (mn - mx).exp().ln_1p();
    ((a - l).exp(), (b - l).exp(), l)
}

/// Plain-Rust merge over f32 slices (CPU only).
fn merge_cpu(acc: Acc, o_b: &Tensor, lse_b: &Tensor, offset: usize) -> Result<Acc> {
    let (b, s, h, d) = acc.o.dims4()?;
    let s_b = o_b.dim(1)?;
    let mut o: Vec<f32> = acc.o.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let mut lse: Vec<f32> = acc.lse.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let ob: Vec<f32> = o_b.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let lb: Vec<f32> = lse_b.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    // Weights laid out like o's rows: index ((bi * s_b + i) * h + hi).
    let mut wa = vec![0f32; b * s_b * h];
    let mut wb = vec![0f32; b * s_b * h];
    for bi in 0..b {
        for hi in 0..h {
            for i in 0..s_b {
                let la = &mut lse[(bi * h + hi) * s + offset + i];
                let (x, y, l) = row_weights(*la, lb[(bi * h + hi) * s_b + i]);
                *la = l;
                let w = (bi * s_b + i) * h + hi;
                wa[w] = x;
                wb[w] = y;
            }
        }
    }
    // Token rows of o are contiguous [h*d] chunks; merge them in parallel.
    let row = h * d;
    o.par_chunks_mut(row).enumerate().for_each(|(r, dst)| {
        let (bi, si) = (r / s, r % s);
        if si < offset || si >= offset + s_b {
            return;
        }
        let i = si - offset;
        let src = &ob[(bi * s_b + i) * row..(bi * s_b + i + 1) * row];
        for hi in 0..h {
            let w = (bi * s_b + i) * h + hi;
            let (x, y) = (wa[w], wb[w]);
            let dd = &mut dst[hi * d..(hi + 1) * d];
            let ss = &src[hi * d..(hi + 1) * d];
            for (a, &c) in dd.iter_mut().zip(ss) {
                *a = *a * x + c * y;
            }
        }
    });
    let dev = acc.o.device().clone();
    Ok(Acc { o: Tensor::from_vec(o, (b, s, h, d), &dev)?, lse: Tensor::from_vec(lse, (b, h, s), &dev)? })
}

/// The same merge with Candle tensor ops (any device).
fn merge_tensor(acc: Acc, o_b: &Tensor, lse_b: &Tensor, offset: usize) -> Result<Acc> {
    let (_, s, _, _) = acc.o.dims4()?;
    let s_b = o_b.dim(1)?;
    let full = offset == 0 && s_b == s;
    let la = if full { acc.lse.clone() } else { acc.lse.narrow(2, offset, s_b)? };
    let oa = if full { acc.o.clone() } else { acc.o.narrow(1, offset, s_b)? };
    let lb = lse_b.to_dtype(DType::F32)?;
    let mx = la.maximum(&lb)?;
    let mn = la.minimum(&lb)?;
    let zero = mx.zeros_like()?;
    let neg_inf = Tensor::full(f32::NEG_INFINITY, mx.shape(), mx.device())?;
    let seen = mx.ge(f32::MIN as f64)?; // u8: 1 where at least one side is finite
    let mx_safe = seen.where_cond(&mx, &zero)?;
    // log1p(x) as log(1 + x) with x = exp(mn - mx) in [0, 1]: the lost low bits are below
    // f32 resolution of mx + log(...) whenever |mx| >= 1, and tiny in absolute terms otherwise.
    let l = (&mx_safe + ((&mn - &mx_safe)?.exp()? + 1.0)?.log()?)?;
    let l_safe = seen.where_cond(&l, &zero)?;
    let new_lse = seen.where_cond(&l, &neg_inf)?;
    // [b,h,s_b] -> [b,s_b,h,1] to scale the o rows.
    let w = |x: &Tensor| -> Result<Tensor> { (x - &l_safe)?.exp()?.transpose(1, 2)?.unsqueeze(D::Minus1) };
    let new_o = (oa.broadcast_mul(&w(&la)?)? + o_b.to_dtype(DType::F32)?.broadcast_mul(&w(&lb)?)?)?;
    if full {
        return Ok(Acc { o: new_o, lse: new_lse });
    }
    Ok(Acc { o: splice(&acc.o, 1, offset, &new_o)?, lse: splice(&acc.lse, 2, offset, &new_lse)? })
}

/// `x` with `[offset, offset + len)` along `dim` replaced by `part` (one copy, by `cat`;
/// Candle's `slice_assign` builds full-size zero padding and a mask first).
fn splice(x: &Tensor, dim: usize, offset: usize, part: &Tensor) -> Result<Tensor> {
    let (n, len) = (x.dim(dim)?, part.dim(dim)?);
    let mut pieces = Vec::with_capacity(3);
    if offset > 0 {
        pieces.push(x.narrow(dim, 0, offset)?);
    }
    pieces.push(part.clone());
    if offset + len < n {
        pieces.push(x.narrow(dim, offset + len, n - offset - len)?);
    }
    Tensor::cat(&pieces, dim)
}

/// `acc + x` in f32 (a new tensor; `None` starts the sum with `x` itself, no zeros).
pub(crate) fn add_f32(acc: Option<Tensor>, x: &Tensor) -> Result<Tensor> {
    let x = x.to_dtype(DType::F32)?;
    match acc {
        None => Ok(x),
        Some(a) => a + x,
    }
}
