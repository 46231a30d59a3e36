//! Gradient accumulation into an f32 buffer in place: `acc ← acc + alpha·x`, with `x` in
//! any activation dtype (the bf16 output of a weight-gradient GEMM, say), so that no f32
//! copy of `x` and no fresh sum are allocated.
//!
//! Shapes: `acc`: `[..]` f32 (contiguous, updated); `x`: the same shape (T ∈ {bf16, f16,
//! f32}, contiguous).

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

const OP: &str = "accumulate_f32";

/// `acc [..] f32 ← acc + alpha · x [..]`, in place.
pub fn accumulate_f32(acc: &Tensor, x: &Tensor, alpha: f64) -> Result<()> {
    check_dtype(OP, "acc", acc, DType::F32)?;
    check_float(OP, "x", x)?;
    check_dims(OP, "x", x, acc.dims())?;
    check_contiguous(OP, "acc", acc)?;
    check_contiguous(OP, "x", x)?;
    acc.inplace_op2(x, &AccOp { alpha: alpha as f32 })
}

struct AccOp {
    alpha: f32,
}

impl InplaceOp2 for AccOp {
    fn name(&self) -> &'static str {
        OP
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        let acc = cpu_f32_mut(OP, "acc", s1, l1)?;
        let alpha = self.alpha;
        dispatch_float!(OP, s2.dtype(), T => {
            let x = cpu_slice::<T>(OP, "x", s2, l2)?;
            acc.par_iter_mut().zip(x).for_each(|(a, v)| *a += alpha * v.to_f());
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, s1: &mut candle_core::CudaStorage, l1: &Layout, s2: &candle_core::CudaStorage, l2: &Layout) -> Result<()> {
        use crate::cuda::{elementwise, launch, view, view_mut, Module};
        let dev = s1.device().clone();
        let n = l1.shape().elem_count();
        if n == 0 {
            return Ok(());
        }
        let cfg = elementwise(&dev, n)?;
        let alpha = self.alpha;
        let mut acc = view_mut::<f32>(OP, "acc", s1, l1)?;
        dispatch_float!(OP, s2.dtype(), T => {
            let x = view::<T>(OP, "x", s2, l2)?;
            launch!(dev, Module::Accumulate, format!("accumulate_{}", T::SUFFIX), cfg, &mut acc, &x, &n, &alpha);
            Ok(())
        })
    }
}
