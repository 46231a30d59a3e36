//! Numeric guards: whether tensors and optimizer state hold only finite numbers, so that
//! nothing non-finite is ever checkpointed or exported (see `docs/reliability.md`).

use crate::Result;
use candle_core::{DType, Tensor};

/// Whether every element of `t` is finite. `x·0 + 0` is 0 for a finite `x` and NaN for
/// NaN or ±∞, so one sum tells (no overflow whatever the magnitudes or the dtype).
pub fn all_finite(t: &Tensor) -> Result<bool> {
    Ok(finite_flags(std::slice::from_ref(t))?[0])
}

/// [`all_finite`] of each tensor, with one transfer to the host for all of them.
pub fn finite_flags(ts: &[Tensor]) -> Result<Vec<bool>> {
    if ts.is_empty() {
        return Ok(Vec::new());
    }
    let sums = ts.iter().map(|t| t.affine(0.0, 0.0)?.sum_all()?.to_dtype(DType::F32)).collect::<candle_core::Result<Vec<_>>>()?;
    let host = Tensor::stack(&sums, 0)?.to_device(&candle_core::Device::Cpu)?.to_vec1::<f32>()?;
    Ok(host.into_iter().map(f32::is_finite).collect())
}

/// Index of the first non-finite value of `xs`, if any.
pub fn first_non_finite(xs: &[f32]) -> Option<usize> {
    xs.iter().position(|x| !x.is_finite())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    #[test]
    fn finite_flags_tell_nan_and_infinity_in_every_float_dtype() {
        for dt in [DType::F32, DType::BF16, DType::F16, DType::F64] {
            let ok = Tensor::new(&[1.0f32, -2.0, 3e4], &Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let nan = Tensor::new(&[1.0f32, f32::NAN], &Device::Cpu).unwrap().to_dtype(dt).unwrap();
            let inf = Tensor::new(&[f32::NEG_INFINITY, 0.0], &Device::Cpu).unwrap().to_dtype(dt).unwrap();
            assert_eq!(finite_flags(&[ok, nan, inf]).unwrap(), vec![true, false, false], "{dt:?}");
        }
        // Large finite values whose plain sum would overflow f32 still count as finite.
        let big = Tensor::new(&[3e38f32, 3e38, 3e38], &Device::Cpu).unwrap();
        assert!(all_finite(&big).unwrap());
        assert_eq!(first_non_finite(&[0.0, 1.0, f32::INFINITY]), Some(2));
        assert_eq!(first_non_finite(&[0.0]), None);
    }
}
