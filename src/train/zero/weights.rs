//! Where weights live and where an optimizer step writes them: the model's own
//! parameters, this rank's parameter shard on the device, or that shard in host memory.

use crate::Result;
use candle_core::{Device, Tensor, Var};

/// Where a step's new weights go.
pub enum Out<'a> {
    /// Into the model's weights (all-gathered over the ranks first).
    Params(&'a [(String, Var)]),
    /// Into this rank's parameter shard `[Σ L_u]` in the run dtype (ZeRO-3) on the device.
    Shard(&'a Tensor),
    /// Into this rank's parameter shard in host memory (ZeRO-3 with `offload_params`).
    HostShard(HostWeightsMut<'a>),
}

/// Weights in host memory, in the run dtype (a plain vector: the optimizer writes its
/// new values straight into it, and a unit goes to the device from a slice of it).
pub enum HostWeights {
    BF16(Vec<half::bf16>),
    F16(Vec<half::f16>),
    F32(Vec<f32>),
}

/// [`HostWeights`] lent to the optimizer for one step.
pub enum HostWeightsMut<'a> {
    BF16(&'a mut [half::bf16]),
    F16(&'a mut [half::f16]),
    F32(&'a mut [f32]),
}

impl HostWeightsMut<'_> {
    /// The same weights lent again, for a shorter while.
    pub fn reborrow(&mut self) -> HostWeightsMut<'_> {
        match self {
            Self::BF16(v) => HostWeightsMut::BF16(v),
            Self::F16(v) => HostWeightsMut::F16(v),
            Self::F32(v) => HostWeightsMut::F32(v),
        }
    }

    pub fn dtype(&self) -> candle_core::DType {
        match self {
            Self::BF16(_) => candle_core::DType::BF16,
            Self::F16(_) => candle_core::DType::F16,
            Self::F32(_) => candle_core::DType::F32,
        }
    }
}

impl HostWeights {
    /// Address and length in bytes of the elements.
    pub(super) fn raw_bytes(&mut self) -> (*mut u8, usize) {
        let len = self.bytes();
        let ptr = match self {
            Self::BF16(v) => v.as_mut_ptr().cast(),
            Self::F16(v) => v.as_mut_ptr().cast(),
            Self::F32(v) => v.as_mut_ptr().cast(),
        };
        (ptr, len)
    }

    pub(super) fn bytes(&self) -> usize {
        match self {
            Self::BF16(v) => v.len() * 2,
            Self::F16(v) => v.len() * 2,
            Self::F32(v) => v.len() * 4,
        }
    }

    /// Elements `[a, a + len)` as a tensor on `dev` (copied from the slice, nothing else).
    pub(super) fn to_tensor(&self, a: usize, len: usize, dev: &Device) -> Result<Tensor> {
        Ok(match self {
            Self::BF16(v) => Tensor::from_slice(&v[a..a + len], len, dev)?,
            Self::F16(v) => Tensor::from_slice(&v[a..a + len], len, dev)?,
            Self::F32(v) => Tensor::from_slice(&v[a..a + len], len, dev)?,
        })
    }

    /// Some element from `skip` on is NaN or infinite (all cores).
    pub(super) fn any_non_finite_from(&self, skip: usize) -> bool {
        use rayon::prelude::*;
        match self {
            Self::BF16(v) => v.get(skip..).is_some_and(|v| v.par_iter().any(|x| !x.is_finite())),
            Self::F16(v) => v.get(skip..).is_some_and(|v| v.par_iter().any(|x| !x.is_finite())),
            Self::F32(v) => v.get(skip..).is_some_and(|v| v.par_iter().any(|x| !x.is_finite())),
        }
    }

    pub fn as_mut(&mut self) -> HostWeightsMut<'_> {
        match self {
            Self::BF16(v) => HostWeightsMut::BF16(v),
            Self::F16(v) => HostWeightsMut::F16(v),
            Self::F32(v) => HostWeightsMut::F32(v),
        }
    }
}
