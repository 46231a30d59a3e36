//! Sliding-window band blocks ([`Mask::Band`]) cut into calls every device kernel takes.
//!
//! A band block `q [b, s, hq, d]` × `k`/`v [b, t, hkv, d]` with `offset` and `window`
//! (query `x` sees keys `(x + offset − window, x + offset]`) is
//! 1. trimmed: query rows that see no key are left out (`o = 0`, `lse = −inf`), and each
//!    call gets only the keys its rows see, from the first row's first key to the last
//!    row's last key;
//! 2. cut in halves along the query rows while a call has more rows than keys: cuDNN's
//!    sliding window needs `s_q ≤ s_kv` (cudnn-frontend 1.16, "Sliding window attention is
//!    only supported with max_s_q <= max_s_kv").
//!
//! Each call's offset (its first query minus its first key) then lies in `[0, window)`,
//! so its band is `right_bound = offset ≥ 0` keys right of the diagonal and
//! `left_bound = window − offset ≥ 1` keys left of it (cuDNN's top-left diagonal band).
//! The work is the band's area (∝ rows · window), never `s · t`.
//!
//! The calls hold disjoint query rows: forward results are laid side by side; in the
//! backward `dq` is too, and `dk`/`dv` of overlapping key ranges are summed in f32.

use crate::kernel::{device_bwd, device_fwd, Mask, Saved};
use candle_core::{DType, Result, Tensor};
use std::ops::Range;

/// One kernel call of a band block: its query rows, key rows and band offset.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Call {
    pub q: Range<usize>,
    pub kv: Range<usize>,
    pub offset: usize,
}

/// The calls of a band block of `s` rows and `t` keys, in ascending query order.
pub fn plan(s: usize, t: usize, offset: usize, window: usize) -> Vec<Call> {
    let mut out = Vec::new();
    plan_rows(0..s, t, Mask::Band { offset, window }, &mut out);
    out
}

fn plan_rows(rows: Range<usize>, t: usize, mask: Mask, out: &mut Vec<Call>) {
    let Mask::Band { offset, window } = mask else { return };
    // Row x sees keys (x + offset − window, x + offset] ∩ [0, t): some iff
    // x + offset + 1 − window < t, so the rows that see any key are a prefix.
    let end = rows.end.min(t.saturating_add(window.saturating_sub(1)).saturating_sub(offset));
    if rows.start >= end {
        return;
    }
    let (x0, x1) = (rows.start, end - 1);
    let (k0, _) = mask.keys(x0, t);
    let (_, k1) = mask.keys(x1, t);
    let (n, m) = (x1 + 1 - x0, k1 - k0);
    if n <= m || n == 1 {
        out.push(Call { q: x0..x1 + 1, kv: k0..k1, offset: offset + x0 - k0 });
        return;
    }
    let mid = x0 + n / 2;
    plan_rows(x0..mid, t, mask, out);
    plan_rows(mid..x1 + 1, t, mask, out);
}

/// The band of one call as the kernel's mask.
fn band(c: &Call, window: usize) -> Mask {
    Mask::Band { offset: c.offset, window }
}

/// Band forward: `(o [b, s, hq, d], lse [b, hq, s])`, rows that see no key `0` / `−inf`.
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, offset: usize, window: usize, scale: f64) -> Result<(Tensor, Tensor)> {
    let (b, s, hq, d) = q.dims4()?;
    let t = k.dim(1)?;
    let calls = plan(s, t, offset, window);
    if let [c] = calls.as_slice() {
        if c.q == (0..s) && c.kv == (0..t) {
            return device_fwd(q, k, v, band(c, window), scale);
        }
    }
    let (mut os, mut lses, mut at) = (Vec::new(), Vec::new(), 0);
    let fill = |n: usize, os: &mut Vec<Tensor>, lses: &mut Vec<Tensor>| -> Result<()> {
        if n > 0 {
            os.push(Tensor::zeros((b, n, hq, d), q.dtype(), q.device())?);
            lses.push(Tensor::full(f32::NEG_INFINITY, (b, hq, n), q.device())?);
        }
        Ok(())
    };
    for c in &calls {
        fill(c.q.start - at, &mut os, &mut lses)?;
        let (qc, kc, vc) = (rows(q, &c.q)?, rows(k, &c.kv)?, rows(v, &c.kv)?);
        let (o, lse) = device_fwd(&qc, &kc, &vc, band(c, window), scale)?;
        os.push(o);
        lses.push(lse);
        at = c.q.end;
    }
    fill(s - at, &mut os, &mut lses)?;
    Ok((Tensor::cat(&os, 1)?, Tensor::cat(&lses, 2)?))
}

/// Rows `r` of `x [b, n, h, d]`, contiguous.
fn rows(x: &Tensor, r: &Range<usize>) -> Result<Tensor> {
    x.narrow(1, r.start, r.len())?.contiguous()
}

/// Band backward with the global `o`/`lse`: `(dq, dk, dv)` in the dtypes of q, k, v.
pub fn bwd(d_o: &Tensor, saved: Saved<'_>, offset: usize, window: usize, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    let Saved { q, k, v, o, lse } = saved;
    let (b, s, hq, d) = q.dims4()?;
    let (_, t, hkv, _) = k.dims4()?;
    let calls = plan(s, t, offset, window);
    if let [c] = calls.as_slice() {
        if c.q == (0..s) && c.kv == (0..t) {
            return device_bwd(d_o, saved, band(c, window), scale);
        }
    }
    let mut dqs = Vec::new();
    let mut dk = Tensor::zeros((b, t, hkv, d), DType::F32, q.device())?;
    let mut dv = dk.clone();
    let mut at = 0;
    for c in &calls {
        if c.q.start > at {
            dqs.push(Tensor::zeros((b, c.q.start - at, hq, d), q.dtype(), q.device())?);
        }
        let (qc, oc, doc) = (rows(q, &c.q)?, rows(o, &c.q)?, rows(d_o, &c.q)?);
        let lc = lse.narrow(2, c.q.start, c.q.len())?.contiguous()?;
        let (kc, vc) = (rows(k, &c.kv)?, rows(v, &c.kv)?);
        let (g_q, g_k, g_v) = device_bwd(&doc, Saved::new(&qc, &kc, &vc, &oc, &lc), band(c, window), scale)?;
        let pad = |g: Tensor| g.to_dtype(DType::F32)?.pad_with_zeros(1, c.kv.start, t - c.kv.end);
        dk = (dk + pad(g_k)?)?;
        dv = (dv + pad(g_v)?)?;
        dqs.push(g_q);
        at = c.q.end;
    }
    if s > at {
        dqs.push(Tensor::zeros((b, s - at, hq, d), q.dtype(), q.device())?);
    }
    Ok((Tensor::cat(&dqs, 1)?.to_dtype(q.dtype())?, dk.to_dtype(k.dtype())?, dv.to_dtype(v.dtype())?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every call has s ≤ t (or one row), an offset inside the window, and together the
    /// calls cover exactly the visible (row, key) pairs of the block.
    #[test]
    fn plans_cover_the_band_exactly() {
        for (s, t) in [(1, 1), (5, 3), (16, 16), (7, 20), (33, 4), (64, 2)] {
            for offset in [0, 1, 3, 10, 40] {
                for window in [1, 2, 3, 8, 100] {
                    let m = Mask::Band { offset, window };
                    let calls = plan(s, t, offset, window);
                    let mut seen = vec![vec![false; t]; s];
                    for c in &calls {
                        assert!(c.q.len() <= c.kv.len() || c.q.len() == 1, "{s}x{t} off {offset} w {window}: {c:?}");
                        assert!(c.offset < window, "{c:?}");
                        let cm = Mask::Band { offset: c.offset, window };
                        for x in c.q.clone() {
                            let (lo, hi) = cm.keys(x - c.q.start, c.kv.len());
                            for y in lo..hi {
                                assert!(!seen[x][c.kv.start + y]);
                                seen[x][c.kv.start + y] = true;
                            }
                        }
                    }
                    for (x, row) in seen.iter().enumerate() {
                        let (lo, hi) = m.keys(x, t);
                        for (y, &v) in row.iter().enumerate() {
                            assert_eq!(v, lo <= y && y < hi, "{s}x{t} off {offset} w {window}: row {x} key {y}");
                        }
                    }
                }
            }
        }
    }
}
