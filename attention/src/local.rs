//! Single-device causal attention: one block kernel call each way (one per document
//! under a document mask, the pieces of a band under a sliding window).

use crate::docs::{self, Block, Masking};
use crate::kernel::{Mask, Saved};
use crate::mode::AttentionMode;
use candle_core::{Result, Tensor};

#[derive(Debug, Default, Clone)]
pub struct LocalAttention;

impl AttentionMode for LocalAttention {
    fn name(&self) -> &'static str {
        "local"
    }
    fn forward_masked(&self, q: &Tensor, k: &Tensor, v: &Tensor, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor)> {
        let all = [0..q.dim(1)?];
        let docs = docs::resolve(mask, all[0].end, "local attention")?;
        let blk = docs.as_deref().map(|d| Block { docs: d, q: &all, kv: &all });
        match docs::fwd(q, k, v, Mask::Causal, blk, scale)? {
            Some(r) => Ok(r),
            None => crate::config_err!("local attention: no query sees a key (empty sequence?)"),
        }
    }
    fn backward_masked(&self, d_o: &Tensor, saved: Saved<'_>, mask: Masking<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        let all = [0..saved.q.dim(1)?];
        let docs = docs::resolve(mask, all[0].end, "local attention backward")?;
        let blk = docs.as_deref().map(|d| Block { docs: d, q: &all, kv: &all });
        match docs::bwd(d_o, saved, Mask::Causal, blk, scale)? {
            Some(r) => Ok(r),
            None => crate::config_err!("local attention backward: no query sees a key (empty sequence?)"),
        }
    }
}
