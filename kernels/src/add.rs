//! Element-wise sums of activations, `a + b (+ c)` with f32 math and one rounding to the
//! activation dtype: the residual adds of a decoder layer and the sums of its input
//! gradients (q, k, v; gate and up). 16-byte accesses on the GPU, so a sum runs at the
//! memory's speed; [`add_into`] writes rows of a larger buffer in place (the layer output),
//! so that no copy follows the sum.
//!
//! Shapes: `a`, `b`, `c`, `out`/`dst`: `[..]` (T ∈ {bf16, f16, f32}, contiguous, all the same
//! shape and dtype); `dst` may be a view (rows of a larger tensor) and must not share
//! storage with `a` or `b`.

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, InplaceOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const OP: &str = "add";
const INTO: &str = "add_into";

fn check(op: &str, ts: &[(&str, &Tensor)]) -> Result<()> {
    let first = ts[0].1;
    check_float(op, ts[0].0, first)?;
    for (name, t) in ts {
        check_dims(op, name, t, first.dims())?;
        check_dtype(op, name, t, first.dtype())?;
        check_contiguous(op, name, t)?;
        check_device(op, name, t, first)?;
    }
    Ok(())
}

/// `a + b (+ c)` as a fresh tensor (f32 sum, rounded once to T).
pub fn add(a: &Tensor, b: &Tensor, c: Option<&Tensor>) -> Result<Tensor> {
    match c {
        None => {
            check(OP, &[("a", a), ("b", b)])?;
            a.apply_op2_no_bwd(b, &SumOp)
        }
        Some(c) => {
            check(OP, &[("a", a), ("b", b), ("c", c)])?;
            a.apply_op3_no_bwd(b, c, &SumOp)
        }
    }
}

/// `dst ← a + b` in place (f32 sum, rounded once to T); `dst` may be rows of a larger buffer.
pub fn add_into(dst: &Tensor, a: &Tensor, b: &Tensor) -> Result<()> {
    check(INTO, &[("dst", dst), ("a", a), ("b", b)])?;
    check_distinct(INTO, &[("dst", dst), ("a", a)])?;
    check_distinct(INTO, &[("dst", dst), ("b", b)])?;
    dst.inplace_op3(a, b, &SumOp)
}

struct SumOp;

fn sum_cpu<T: Elem>(out: &mut [T], a: &[T], b: &[T], c: Option<&[T]>) {
    out.par_iter_mut().enumerate().for_each(|(i, o)| {
        let s = a[i].to_f() + b[i].to_f();
        *o = T::from_f(c.map_or(s, |c| s + c[i].to_f()));
    });
}

type Arg<'a, S> = (&'a S, &'a Layout);

impl SumOp {
    fn cpu_new(&self, a: Arg<CpuStorage>, b: Arg<CpuStorage>, c: Option<Arg<CpuStorage>>) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(OP, a.0.dtype(), T => {
            let (av, bv) = (cpu_slice::<T>(OP, "a", a.0, a.1)?, cpu_slice::<T>(OP, "b", b.0, b.1)?);
            let cv = c.map(|(s, l)| cpu_slice::<T>(OP, "c", s, l)).transpose()?;
            let mut out = vec![T::from_f(0.0); av.len()];
            sum_cpu(&mut out, av, bv, cv);
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(out), a.1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_new(
        &self,
        a: Arg<candle_core::CudaStorage>,
        b: Arg<candle_core::CudaStorage>,
        c: Option<Arg<candle_core::CudaStorage>>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{alloc, elementwise, launch, view, Module, NULL};
        let dev = a.0.device().clone();
        let n = a.1.shape().elem_count();
        dispatch_float!(OP, a.0.dtype(), T => {
            let (av, bv) = (view::<T>(OP, "a", a.0, a.1)?, view::<T>(OP, "b", b.0, b.1)?);
            let cv = c.map(|(s, l)| view::<T>(OP, "c", s, l)).transpose()?;
            let mut out = alloc::<T>(&dev, n)?;
            if n > 0 {
                let (name, cfg) = (format!("add_{}", T::SUFFIX), elementwise(&dev, n.div_ceil(8))?);
                match &cv {
                    Some(cv) => launch!(dev, Module::Add, name, cfg, &av, &bv, cv, &mut out, &n),
                    None => launch!(dev, Module::Add, name, cfg, &av, &bv, &NULL, &mut out, &n),
                }
            }
            Ok((candle_core::CudaStorage::wrap_cuda_slice(out, dev), a.1.shape().clone()))
        })
    }
}

impl CustomOp2 for SumOp {
    fn name(&self) -> &'static str {
        OP
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu_new((s1, l1), (s2, l2), None)
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_new((s1, l1), (s2, l2), None)
    }
}

impl CustomOp3 for SumOp {
    fn name(&self) -> &'static str {
        OP
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
        s3: &CpuStorage,
        l3: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu_new((s1, l1), (s2, l2), Some((s3, l3)))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda_new((s1, l1), (s2, l2), Some((s3, l3)))
    }
}

impl InplaceOp3 for SumOp {
    fn name(&self) -> &'static str {
        INTO
    }
    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<()> {
        dispatch_float!(INTO, s2.dtype(), T => {
            let (av, bv) = (cpu_slice::<T>(INTO, "a", s2, l2)?, cpu_slice::<T>(INTO, "b", s3, l3)?);
            let out = cpu_slice_mut::<T>(INTO, "dst", s1, l1)?;
            sum_cpu(out, av, bv, None);
            Ok(())
        })
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &mut candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
        s3: &candle_core::CudaStorage,
        l3: &Layout,
    ) -> Result<()> {
        use crate::cuda::{elementwise, launch, view, view_mut, Module, NULL};
        let dev = s1.device().clone();
        let n = l1.shape().elem_count();
        if n == 0 {
            return Ok(());
        }
        dispatch_float!(INTO, s2.dtype(), T => {
            let (av, bv) = (view::<T>(INTO, "a", s2, l2)?, view::<T>(INTO, "b", s3, l3)?);
            let mut out = view_mut::<T>(INTO, "dst", s1, l1)?;
            launch!(dev, Module::Add, format!("add_{}", T::SUFFIX), elementwise(&dev, n.div_ceil(8))?, &av, &bv, &NULL, &mut out, &n);
            Ok(())
        })
    }
}
