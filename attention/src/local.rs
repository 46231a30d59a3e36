//! Single-device causal attention: one block kernel call each way (one per document
//! under a document mask).

use crate::docs::{self, Block, Docs};
use crate::kernel::{Mask, Saved};
use crate::mode::{effective, AttentionMode};
use candle_core::{Result, Tensor};

#[derive(Debug, Default, Clone)]
pub struct LocalAttention;

impl AttentionMode for LocalAttention {
    fn name(&self) -> &'static str {
        "local"
    }
    fn forward_docs(&self, q: &Tensor, k: &Tensor, v: &Tensor, docs: Option<&Docs>, scale: f64) -> Result<(Tensor, Tensor)> {
        let all = [0..q.dim(1)?];
        docs::check_len(docs, all[0].end, "local attention")?;
        let blk = effective(docs).map(|d| Block { docs: d, q: &all, kv: &all });
        match docs::fwd(q, k, v, Mask::Causal, blk, scale)? {
            Some(r) => Ok(r),
            None => crate::config_err!("local attention: no query sees a key (empty sequence?)"),
        }
    }
    fn backward_docs(&self, d_o: &Tensor, saved: Saved<'_>, docs: Option<&Docs>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        let all = [0..saved.q.dim(1)?];
        docs::check_len(docs, all[0].end, "local attention backward")?;
        let blk = effective(docs).map(|d| Block { docs: d, q: &all, kv: &all });
        match docs::bwd(d_o, saved, Mask::Causal, blk, scale)? {
            Some(r) => Ok(r),
            None => crate::config_err!("local attention backward: no query sees a key (empty sequence?)"),
        }
    }
}
