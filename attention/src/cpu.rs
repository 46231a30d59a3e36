//! CPU block kernel. (Being written; delegates to the naive reference for now.)
use crate::kernel::Mask;
use candle_core::{Result, Tensor};
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor)> {
    crate::naive::fwd(q, k, v, mask, scale)
}
#[allow(clippy::too_many_arguments)]
pub fn bwd(d_o: &Tensor, q: &Tensor, k: &Tensor, v: &Tensor, o: &Tensor, lse: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    crate::naive::bwd(d_o, q, k, v, o, lse, mask, scale)
}
