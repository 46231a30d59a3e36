//! Numeric guards: whether tensors and optimizer state hold only finite numbers, so that
//! nothing non-finite is ever checkpointed or exported (see `docs/reliability.md`).

use crate::Result;
use candle_core::{DType, Tensor};

/// Whether every element of `t` is finite.
pub fn all_finite(t: &Tensor) -> Result<bool> {
    Ok(finite_flags(std::slice::from_ref(t))?[0])
}

/// [`all_finite`] of each tensor (integer tensors count as finite), with one transfer to
/// the host per device. bf16/f16/f32 are counted over the whole GPU
/// (`longctx_kernels::count_non_finite`: about a millisecond for 2 GB of weights); other
/// float dtypes by `x·0 + 0` summed (0 for finite values, NaN otherwise).
pub fn finite_flags(ts: &[Tensor]) -> Result<Vec<bool>> {
    let mut flags = vec![true; ts.len()];
    // The 16/32-bit floats by device (one count, one transfer each); other floats alone.
    let mut groups: Vec<(&candle_core::Device, Vec<usize>)> = Vec::new();
    for (i, t) in ts.iter().enumerate() {
        match t.dtype() {
            DType::BF16 | DType::F16 | DType::F32 => match groups.iter_mut().find(|g| g.0.same_device(t.device())) {
                Some(g) => g.1.push(i),
                None => groups.push((t.device(), vec![i])),
            },
            d if d.is_float() => flags[i] = t.affine(0.0, 0.0)?.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?.is_finite(),
            _ => {}
        }
    }
    for (_, idx) in groups {
        let tensors = idx.iter().map(|&i| ts[i].contiguous()).collect::<candle_core::Result<Vec<_>>>()?;
        for (i, c) in idx.into_iter().zip(longctx_kernels::count_non_finite(&tensors)?) {
            flags[i] = c == 0;
        }
    }
    Ok(flags)
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
