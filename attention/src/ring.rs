//! Zigzag ring attention over `W` ranks.
//!
//! Layout ([`crate::layout::zigzag_indices`]): the global sequence is cut into `2W`
//! chunks of `B` tokens; rank `r` holds chunk `r` then chunk `2W-1-r`, so its local
//! `q`, `k`, `v` have `2B` tokens: `q [b, 2B, hq, d]`, `k`/`v [b, 2B, hkv, d]`.
//!
//! Forward, step `s = 0..W`, with the kv block of rank `j = (r - s) mod W`:
//! - `s = 0`: the local block against itself, causal over the whole `2B x 2B`;
//! - `j < r`: both q chunks come after kv chunk `j` and before kv chunk `2W-1-j`:
//!   all of q against the first kv half, no mask;
//! - `j > r`: q chunk `r` precedes both kv chunks, q chunk `2W-1-r` follows both:
//!   the second q half against all of kv, no mask.
//!
//! The next kv exchange (send to `r+1`, receive from `r-1`) is posted before the
//! current block is computed and waited after, so communication overlaps compute.
//! Partial results are merged in f32 with [`crate::merge`]. Only kv heads travel.
//!
//! Under a document mask ([`crate::docs`]) each case is cut into per-document pieces by
//! the global ranges of its chunks (chunk `c` is tokens `[cB, (c+1)B)`); a kv block that
//! shares no document with the q rows it meets is skipped (no kernel call, no merge);
//! under a sliding window likewise a block wholly outside the window.
//!
//! Backward: the same three cases with the global `o`/`lse`. `dq` accumulates locally
//! in f32. The f32 `dk`/`dv` accumulators of a kv block travel with it: at step `s`
//! this rank adds its contribution to the accumulator of block `j` (received from
//! `r-1`, which added its own at step `s-1`) and passes it to `r+1`; after `W` hops
//! (the last one after step `W-1`) each accumulator is back on its owner with the
//! contributions of every rank.

use crate::comm::{Comm, Pending};
use crate::docs::{self, Block, Masking};
use crate::kernel::{self, Mask, Saved};
use crate::merge::{self, add_f32};
use crate::mode::AttentionMode;
use candle_core::{Result, Tensor};
use std::ops::Range;
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct ZigzagRing {
    pub comm: Arc<dyn Comm>,
}

impl ZigzagRing {
    pub fn new(comm: Arc<dyn Comm>) -> Self {
        Self { comm }
    }

    /// Checks local shapes; returns the chunk length `B` (half the local length).
    fn half(&self, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<usize> {
        kernel::check_shapes(q, k, v, Mask::Causal)?;
        let s = q.dim(1)?;
        if s % 2 != 0 || s == 0 {
            return crate::shape_err!(
                "zigzag ring: local length {s} must be even and non-zero (two chunks of the zigzag layout, \
                 global length a multiple of 2·world = {})",
                2 * self.comm.world()
            );
        }
        Ok(s / 2)
    }

    /// The global ranges of rank `j`'s chunks `j` and `2W-1-j` of `half` tokens: (both, lo, hi).
    fn chunks(&self, j: usize, half: usize) -> [Vec<Range<usize>>; 3] {
        let w = self.comm.world();
        let (lo, hi) = (j * half..(j + 1) * half, (2 * w - 1 - j) * half..(2 * w - j) * half);
        [vec![lo.clone(), hi.clone()], vec![lo], vec![hi]]
    }

    /// Posts the exchange of `ts` around the ring (to next, from prev).
    fn pass(&self, ts: &[Tensor]) -> Result<Pending> {
        self.comm.sendrecv_start(ts.to_vec(), self.comm.next(), self.comm.prev())
    }
}

/// Unpacks a received `[k, v]` (or `[dk_lo, dk_hi, dv_lo, dv_hi]`) message.
fn expect<const N: usize>(ts: Vec<Tensor>, what: &str) -> Result<[Tensor; N]> {
    let n = ts.len();
    ts.try_into().map_err(|_| crate::error::AttnError::Comm(format!("zigzag ring: expected {N} tensors ({what}), received {n}")).into())
}

impl AttentionMode for ZigzagRing {
    fn name(&self) -> &'static str {
        "zigzag-ring"
    }

    fn forward_masked(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor)> {
        let half = self.half(q, k, v)?;
        let (w, r) = (self.comm.world(), self.comm.rank());
        let docs = docs::resolve(mask, 2 * w * half, "zigzag ring")?;
        let docs = docs.as_deref();
        let [q_both, _, q_hi_r] = self.chunks(r, half);

        let q_hi = q.narrow(1, half, half)?;
        let mut acc: Option<merge::Acc> = None;
        let (mut k_j, mut v_j) = (k.clone(), v.clone());
        for s in 0..w {
            let j = (r + w - s) % w;
            let next = if s + 1 < w { Some(self.pass(&[k_j.clone(), v_j.clone()])?) } else { None };
            let [kv_both, kv_lo, _] = self.chunks(j, half);
            if s == 0 {
                if let Some((o, lse)) =
                    docs::fwd(q, &k_j, &v_j, Mask::Causal, docs.map(|d| Block { docs: d, q: &q_both, kv: &kv_both }), scale)?
                {
                    acc = Some(merge::merge(acc, &o, &lse)?);
                }
            } else if j < r {
                let (k_lo, v_lo) = (k_j.narrow(1, 0, half)?, v_j.narrow(1, 0, half)?);
                if let Some((o, lse)) =
                    docs::fwd(q, &k_lo, &v_lo, Mask::None, docs.map(|d| Block { docs: d, q: &q_both, kv: &kv_lo }), scale)?
                {
                    acc = Some(merge::merge(acc, &o, &lse)?);
                }
            } else if let Some((o, lse)) =
                docs::fwd(&q_hi, &k_j, &v_j, Mask::None, docs.map(|d| Block { docs: d, q: &q_hi_r, kv: &kv_both }), scale)?
            {
                acc = Some(merge::merge_at(acc, &o, &lse, half)?);
            }
            if let Some(p) = next {
                [k_j, v_j] = expect::<2>(p.wait()?, "k, v")?;
            }
        }
        match acc {
            Some(acc) => acc.finish(q.dtype()),
            None => crate::config_err!("zigzag ring: world size is 0"),
        }
    }

    fn backward_masked(&self, d_o: &Tensor, saved: Saved<'_>, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        let Saved { q, k, v, o, lse } = saved;
        let half = self.half(q, k, v)?;
        let (w, r) = (self.comm.world(), self.comm.rank());
        saved.check_do(d_o, "zigzag ring backward")?;
        let docs = docs::resolve(mask, 2 * w * half, "zigzag ring backward")?;
        let docs = docs.as_deref();
        let [q_both, _, q_hi_r] = self.chunks(r, half);
        let hi = |x: &Tensor, dim: usize| x.narrow(dim, half, half);
        let lo = |x: &Tensor, dim: usize| x.narrow(dim, 0, half);
        let (do_hi, q_hi, o_hi, lse_hi) = (hi(d_o, 1)?, hi(q, 1)?, hi(o, 1)?, hi(lse, 2)?);
        // dq halves, f32 [b, B, hq, d] (both start at s = 0)
        let (mut dq_lo, mut dq_hi): (Option<Tensor>, Option<Tensor>) = (None, None);
        // kv block j and, travelling with it, its f32 dk/dv accumulator halves [b, B, hkv, d]
        let (mut k_j, mut v_j) = (k.clone(), v.clone());
        let mut dkv_in: Option<Pending> = None;
        for s in 0..w {
            let j = (r + w - s) % w;
            let next_kv = if s + 1 < w { Some(self.pass(&[k_j.clone(), v_j.clone()])?) } else { None };
            // this rank's contribution to dq and to block j's dk/dv, as (lo, hi) halves
            let [kv_both, kv_lo, _] = self.chunks(j, half);
            let none = ((None, None), (None, None), (None, None));
            let (dq_c, dk_c, dv_c) = if s == 0 {
                let blk = docs.map(|d| Block { docs: d, q: &q_both, kv: &kv_both });
                match docs::bwd(d_o, Saved { k: &k_j, v: &v_j, ..saved }, Mask::Causal, blk, scale)? {
                    Some((dq, dk, dv)) => (
                        (Some(lo(&dq, 1)?), Some(hi(&dq, 1)?)),
                        (Some(lo(&dk, 1)?), Some(hi(&dk, 1)?)),
                        (Some(lo(&dv, 1)?), Some(hi(&dv, 1)?)),
                    ),
                    None => none,
                }
            } else if j < r {
                let (k_lo, v_lo) = (lo(&k_j, 1)?, lo(&v_j, 1)?);
                let blk = docs.map(|d| Block { docs: d, q: &q_both, kv: &kv_lo });
                match docs::bwd(d_o, Saved { k: &k_lo, v: &v_lo, ..saved }, Mask::None, blk, scale)? {
                    Some((dq, dk, dv)) => ((Some(lo(&dq, 1)?), Some(hi(&dq, 1)?)), (Some(dk), None), (Some(dv), None)),
                    None => none,
                }
            } else {
                let blk = docs.map(|d| Block { docs: d, q: &q_hi_r, kv: &kv_both });
                match docs::bwd(&do_hi, Saved::new(&q_hi, &k_j, &v_j, &o_hi, &lse_hi), Mask::None, blk, scale)? {
                    Some((dq, dk, dv)) => {
                        ((None, Some(dq)), (Some(lo(&dk, 1)?), Some(hi(&dk, 1)?)), (Some(lo(&dv, 1)?), Some(hi(&dv, 1)?)))
                    }
                    None => none,
                }
            };
            if let Some(x) = &dq_c.0 {
                dq_lo = Some(add_f32(dq_lo.take(), x)?);
            }
            if let Some(x) = &dq_c.1 {
                dq_hi = Some(add_f32(dq_hi.take(), x)?);
            }
            // the accumulator of block j: what ranks j..r-1 added (started here at s = 0,
            // where all four halves get a contribution)
            let mut dkv: [Option<Tensor>; 4] = match dkv_in.take() {
                Some(p) => expect::<4>(p.wait()?, "dk, dv accumulators")?.map(Some),
                None => [None, None, None, None],
            };
            for (slot, c) in [dk_c.0, dk_c.1, dv_c.0, dv_c.1].into_iter().enumerate() {
                if let Some(c) = c {
                    dkv[slot] = Some(add_f32(dkv[slot].take(), &c)?);
                }
            }
            let dkv = dkv
                .into_iter()
                .map(|x| x.ok_or_else(|| candle_core::Error::Msg("zigzag ring: a dk/dv half got no contribution".into())))
                .collect::<Result<Vec<_>>>()?;
            dkv_in = Some(self.pass(&dkv)?);
            if let Some(p) = next_kv {
                [k_j, v_j] = expect::<2>(p.wait()?, "k, v")?;
            }
        }
        let [dk_lo, dk_hi, dv_lo, dv_hi] = match dkv_in {
            Some(p) => expect::<4>(p.wait()?, "dk, dv accumulators")?,
            None => return crate::config_err!("zigzag ring: world size is 0"),
        };
        let (Some(dq_lo), Some(dq_hi)) = (dq_lo, dq_hi) else { return crate::config_err!("zigzag ring: world size is 0") };
        let dq = Tensor::cat(&[dq_lo, dq_hi], 1)?.to_dtype(q.dtype())?;
        let dk = Tensor::cat(&[dk_lo, dk_hi], 1)?.to_dtype(k.dtype())?;
        let dv = Tensor::cat(&[dv_lo, dv_hi], 1)?.to_dtype(v.dtype())?;
        Ok((dq, dk, dv))
    }
}
