//! Naive reference attention (materialises scores). (Being written.)
use crate::kernel::Mask;
use candle_core::{Result, Tensor};
pub fn fwd(_q: &Tensor, _k: &Tensor, _v: &Tensor, _mask: Mask, _scale: f64) -> Result<(Tensor, Tensor)> {
    candle_core::bail!("naive::fwd not written yet")
}
#[allow(clippy::too_many_arguments)]
pub fn bwd(_d_o: &Tensor, _q: &Tensor, _k: &Tensor, _v: &Tensor, _o: &Tensor, _lse: &Tensor, _mask: Mask, _scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    candle_core::bail!("naive::bwd not written yet")
}
