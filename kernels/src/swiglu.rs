//! SwiGLU, the activation of the Llama MLP: `out = silu(gate)·up` with
//! `silu(g) = g/(1 + e^−g)`, and its backward
//! `dgate = dout·up·σ(g)·(1 + g·(1 − σ(g)))`, `dup = dout·silu(g)`. [`swiglu_bwd_fwd`] is the
//! backward that also gives the forward's output (one pass over `gate` and `up` where a
//! recomputing backward needs both).
//!
//! Shapes: `..` any dims (`[b, s, i]` or `[tokens, i]`, `i` intermediate); `gate`, `up`,
//! `out`, `dout`, `dgate`, `dup`: `[..]` (T ∈ {bf16, f16, f32}, contiguous, all the same shape).

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const FWD: &str = "swiglu_fwd";
const BWD: &str = "swiglu_bwd";

fn check(op: &str, names: &[&str], ts: &[&Tensor]) -> Result<()> {
    check_float(op, names[0], ts[0])?;
    for (name, t) in names.iter().zip(ts) {
        check_dims(op, name, t, ts[0].dims())?;
        check_dtype(op, name, t, ts[0].dtype())?;
        check_contiguous(op, name, t)?;
    }
    Ok(())
}

/// `silu(gate)·up`: `gate [..]`, `up [..]` -> `[..]`, all T.
pub fn swiglu_fwd(gate: &Tensor, up: &Tensor) -> Result<Tensor> {
    check(FWD, &["gate", "up"], &[gate, up])?;
    gate.apply_op2_no_bwd(up, &FwdOp)
}

/// Backward of [`swiglu_fwd`]: `dout [..]`, `gate [..]`, `up [..]` -> `(dgate [..], dup [..])`, all T.
pub fn swiglu_bwd(dout: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
    check(BWD, &["dout", "gate", "up"], &[dout, gate, up])?;
    let op = BwdOp { with_out: false, extras: Extras::default() };
    let dgate = dout.apply_op3_no_bwd(gate, up, &op)?;
    let dup = op.extras.take(BWD, 1)?.remove(0);
    Ok((dgate, dup))
}

/// [`swiglu_bwd`] and [`swiglu_fwd`] in one pass: `dout [..]`, `gate [..]`, `up [..]` ->
/// `(dgate [..], dup [..], silu(gate)·up [..])`, all T, each value as the two ops give it.
pub fn swiglu_bwd_fwd(dout: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
    check(BWD, &["dout", "gate", "up"], &[dout, gate, up])?;
    let op = BwdOp { with_out: true, extras: Extras::default() };
    let dgate = dout.apply_op3_no_bwd(gate, up, &op)?;
    let mut ex = op.extras.take(BWD, 2)?.into_iter();
    let (Some(dup), Some(out)) = (ex.next(), ex.next()) else { candle_core::bail!("{BWD}: internal error, missing outputs") };
    Ok((dgate, dup, out))
}

#[inline]
fn sigmoid(g: f32) -> f32 {
    1.0 / (1.0 + (-g).exp())
}

/// The forward's value, `silu(g)·u` rounded to T (the CPU twins of both ops).
#[inline]
fn silu_mul<T: Elem>(g: T, u: T) -> T {
    let g = g.to_f();
    T::from_f(g / (1.0 + (-g).exp()) * u.to_f())
}

struct FwdOp;

impl CustomOp2 for FwdOp {
    fn name(&self) -> &'static str {
        FWD
    }

    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        dispatch_float!(FWD, s1.dtype(), T => {
            let (g, u) = (cpu_slice::<T>(FWD, "gate", s1, l1)?, cpu_slice::<T>(FWD, "up", s2, l2)?);
            let out: Vec<T> = g.par_iter().zip(u).map(|(&g, &u)| silu_mul(g, u)).collect();
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(out), l1.shape().clone()))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{alloc, elementwise, launch, view, Module};
        let dev = s1.device().clone();
        let n = l1.shape().elem_count();
        dispatch_float!(FWD, s1.dtype(), T => {
            let (g, u) = (view::<T>(FWD, "gate", s1, l1)?, view::<T>(FWD, "up", s2, l2)?);
            let mut out = alloc::<T>(&dev, n)?;
            if n > 0 {
                launch!(dev, Module::SwiGlu, format!("swiglu_fwd_{}", T::SUFFIX), elementwise(&dev, n)?, &g, &u, &mut out, &n);
            }
            Ok((candle_core::CudaStorage::wrap_cuda_slice(out, dev), l1.shape().clone()))
        })
    }
}

/// Outputs beyond `dgate` in `extras`: `dup`, then (`with_out`) the forward's output.
struct BwdOp {
    with_out: bool,
    extras: Extras,
}

impl CustomOp3 for BwdOp {
    fn name(&self) -> &'static str {
        BWD
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
        let shape = l1.shape().clone();
        dispatch_float!(BWD, s1.dtype(), T => {
            let d = cpu_slice::<T>(BWD, "dout", s1, l1)?;
            let g = cpu_slice::<T>(BWD, "gate", s2, l2)?;
            let u = cpu_slice::<T>(BWD, "up", s3, l3)?;
            let zero = T::from_f(0.0);
            let (mut dg, mut du) = (vec![zero; d.len()], vec![zero; d.len()]);
            dg.par_iter_mut().zip(du.par_iter_mut()).enumerate().for_each(|(i, (dgi, dui))| {
                let (g, u, d) = (g[i].to_f(), u[i].to_f(), d[i].to_f());
                let sg = sigmoid(g);
                *dgi = T::from_f(d * u * sg * (1.0 + g * (1.0 - sg)));
                *dui = T::from_f(d * g * sg);
            });
            self.extras.push(cpu_storage(du), shape.clone());
            if self.with_out {
                let out: Vec<T> = g.par_iter().zip(u).map(|(&g, &u)| silu_mul(g, u)).collect();
                self.extras.push(cpu_storage(out), shape.clone());
            }
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(dg), shape))
        })
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
        use crate::cuda::{alloc, elementwise, launch, view, Module, NULL};
        use candle_core::{CudaStorage, Storage};
        let dev = s1.device().clone();
        let shape = l1.shape().clone();
        let n = shape.elem_count();
        dispatch_float!(BWD, s1.dtype(), T => {
            let d = view::<T>(BWD, "dout", s1, l1)?;
            let g = view::<T>(BWD, "gate", s2, l2)?;
            let u = view::<T>(BWD, "up", s3, l3)?;
            let (mut dg, mut du) = (alloc::<T>(&dev, n)?, alloc::<T>(&dev, n)?);
            let mut out = if self.with_out { Some(alloc::<T>(&dev, n)?) } else { None };
            if n > 0 {
                let (name, cfg) = (format!("swiglu_bwd_{}", T::SUFFIX), elementwise(&dev, n)?);
                match &mut out {
                    Some(o) => launch!(dev, Module::SwiGlu, name, cfg, &d, &g, &u, &mut dg, &mut du, o, &n),
                    None => launch!(dev, Module::SwiGlu, name, cfg, &d, &g, &u, &mut dg, &mut du, &NULL, &n),
                }
            }
            self.extras.push(Storage::Cuda(CudaStorage::wrap_cuda_slice(du, dev.clone())), shape.clone());
            if let Some(o) = out {
                self.extras.push(Storage::Cuda(CudaStorage::wrap_cuda_slice(o, dev.clone())), shape.clone());
            }
            Ok((CudaStorage::wrap_cuda_slice(dg, dev), shape))
        })
    }
}
