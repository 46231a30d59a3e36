//! Single-device causal attention: one block kernel call each way.

use crate::kernel::{self, Mask, Saved};
use crate::mode::AttentionMode;
use candle_core::{Result, Tensor};

#[derive(Debug, Default, Clone)]
pub struct LocalAttention;

impl AttentionMode for LocalAttention {
    fn name(&self) -> &'static str {
        "local"
    }
    fn forward(&self, q: &Tensor, k: &Tensor, v: &Tensor, scale: f64) -> Result<(Tensor, Tensor)> {
        kernel::fwd(q, k, v, Mask::Causal, scale)
    }
    fn backward(&self, d_o: &Tensor, saved: Saved<'_>, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        kernel::bwd(d_o, saved, Mask::Causal, scale)
    }
}
