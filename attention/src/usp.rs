//! USP: Ulysses inside groups of `U` ranks, zigzag ring across the `R` groups.
//!
//! World `W = U·R`; world rank `= ring_idx·U + ulysses_idx`: the Ulysses group of a
//! rank is the `U` consecutive ranks `[ring_idx·U, (ring_idx+1)·U)`, its ring group the
//! `R` ranks `{ulysses_idx + k·U}` (see [`Usp::split`]).
//! Layout ([`crate::layout::usp_indices`]): zigzag over the ring dimension, then the
//! group's zigzag-local sequence `[chunk g ; chunk 2R-1-g]` split contiguously over its
//! `U` ranks. Shapes (`s` local tokens, `s·U` per group):
//! - this rank: `q [b, s, hq, d]`, `k`/`v [b, s, hkv, d]`, `o [b, s, hq, d]`, `lse [b, hq, s]`;
//! - after the Ulysses all-to-all: `[b, s·U, hq/U, d]` and `[b, s·U, hkv·rep/U, d]`,
//!   the group's zigzag-local tokens for this rank's heads, on which the zigzag ring
//!   runs over the ring group (kv heads replicated `rep` times when `U` > hkv).
//!
//! `lse` is returned for this rank's local tokens (all-to-all'd back like `o`); the
//! backward sends `do`, `o` and `lse` to head-sharded form again, runs the ring
//! backward and brings `dq`, `dk`, `dv` back by the inverse all-to-all (the gradients
//! of replicated kv heads are summed).

use crate::comm::Comm;
use crate::docs::Masking;
use crate::kernel::Saved;
use crate::mode::AttentionMode;
use crate::ring::ZigzagRing;
use crate::ulysses::{head_sharded_backward, head_sharded_forward};
use candle_core::{Result, Tensor};
use std::sync::Arc;

#[derive(Debug, Clone)]
pub struct Usp {
    /// The `U` ranks sharing a ring slot (heads are exchanged among them).
    pub ulysses: Arc<dyn Comm>,
    /// The `R` ranks with the same Ulysses index (kv blocks circulate among them).
    pub ring: Arc<dyn Comm>,
}

impl Usp {
    pub fn new(ulysses: Arc<dyn Comm>, ring: Arc<dyn Comm>) -> Self {
        Self { ulysses, ring }
    }

    /// Splits `world` (of `u·r` ranks) into this rank's Ulysses group (`u` consecutive
    /// ranks) and ring group (stride `u`). Collective over `world`.
    pub fn split(world: &Arc<dyn Comm>, u: usize, r: usize) -> Result<Self> {
        let w = world.world();
        if u == 0 || r == 0 || u * r != w {
            return crate::config_err!("USP: ulysses {u} × ring {r} must equal the world size {w}");
        }
        let rank = world.rank();
        let (ring_idx, uly_idx) = (rank / u, rank % u);
        let uly: Vec<usize> = (0..u).map(|i| ring_idx * u + i).collect();
        let ring: Vec<usize> = (0..r).map(|k| uly_idx + k * u).collect();
        // same call order on every rank, so the sub-group ids agree
        let ulysses = world.sub(&uly)?;
        let ring = world.sub(&ring)?;
        Ok(Self { ulysses, ring })
    }

    fn ring_mode(&self) -> ZigzagRing {
        ZigzagRing::new(self.ring.clone())
    }
}

impl AttentionMode for Usp {
    fn name(&self) -> &'static str {
        "usp"
    }

    fn forward_masked(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor)> {
        head_sharded_forward(self.ulysses.as_ref(), &self.ring_mode(), q, k, v, mask, scale)
    }

    fn backward_masked(&self, d_o: &Tensor, saved: Saved<'_>, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        head_sharded_backward(self.ulysses.as_ref(), &self.ring_mode(), d_o, saved, mask, scale)
    }
}
