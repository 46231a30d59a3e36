//! What every op shares: the element trait of the CPU twins, argument checks that answer
//! with an error naming the op and the argument (never a panic), and the plumbing that
//! gives a Candle custom op more than one output.
//!
//! Shapes: none of its own; `n` elements of a flat slice.

use candle_core::op::BackpropOp;
use candle_core::{bail, CpuStorage, DType, Layout, Result, Shape, Storage, Tensor, WithDType};
use half::{bf16, f16};
use std::cell::RefCell;

/// An activation element: bf16, f16 or f32, computed in f32.
pub(crate) trait Elem: WithDType + Copy + Send + Sync + 'static {
    /// Kernel name suffix (`rmsnorm_fwd_bf16`, ...).
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    const SUFFIX: &'static str;
    fn to_f(self) -> f32;
    /// Round to nearest even, as CUDA's `__float2bfloat16_rn` / `__float2half_rn`.
    fn from_f(x: f32) -> Self;
    /// The elements of a CPU storage of this dtype, mutably.
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]>;
}

impl Elem for f32 {
    const SUFFIX: &'static str = "f32";
    fn to_f(self) -> f32 {
        self
    }
    fn from_f(x: f32) -> Self {
        x
    }
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::F32(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for bf16 {
    const SUFFIX: &'static str = "bf16";
    fn to_f(self) -> f32 {
        self.to_f32()
    }
    fn from_f(x: f32) -> Self {
        bf16::from_f32(x)
    }
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::BF16(v) => Some(v),
            _ => None,
        }
    }
}

impl Elem for f16 {
    const SUFFIX: &'static str = "f16";
    fn to_f(self) -> f32 {
        self.to_f32()
    }
    fn from_f(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn slice_mut(s: &mut CpuStorage) -> Option<&mut [Self]> {
        match s {
            CpuStorage::F16(v) => Some(v),
            _ => None,
        }
    }
}

/// `x` rounded to `T` and read back as f32 (the value a `T` tensor would hold).
#[inline]
pub(crate) fn round_to<T: Elem>(x: f32) -> f32 {
    T::from_f(x).to_f()
}

/// Runs `$body` with `$T` bound to the Rust type of the activation dtype `$dtype`
/// (bf16, f16, f32); any other dtype is an error naming `$op`.
macro_rules! dispatch_float {
    ($op:expr, $dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            candle_core::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            candle_core::DType::F16 => {
                type $T = half::f16;
                $body
            }
            candle_core::DType::F32 => {
                type $T = f32;
                $body
            }
            other => candle_core::bail!("{}: dtype {:?} is not supported (bf16, f16 or f32)", $op, other),
        }
    };
}
pub(crate) use dispatch_float;

/// Start and end offsets of a contiguous layout, or an error naming the argument.
pub(crate) fn contiguous(op: &str, name: &str, l: &Layout) -> Result<(usize, usize)> {
    match l.contiguous_offsets() {
        Some(o) => Ok(o),
        None => bail!("{op}: `{name}` must be contiguous (shape {:?}, stride {:?}); call .contiguous() first", l.dims(), l.stride()),
    }
}

/// Error unless `t` is contiguous.
pub(crate) fn check_contiguous(op: &str, name: &str, t: &Tensor) -> Result<()> {
    contiguous(op, name, t.layout()).map(|_| ())
}

/// Error unless `t` has dtype `dtype`.
pub(crate) fn check_dtype(op: &str, name: &str, t: &Tensor, dtype: DType) -> Result<()> {
    if t.dtype() != dtype {
        bail!("{op}: `{name}` must be {dtype:?}, got {:?}", t.dtype());
    }
    Ok(())
}

/// Error unless `t` has exactly the dims `dims`.
pub(crate) fn check_dims(op: &str, name: &str, t: &Tensor, dims: &[usize]) -> Result<()> {
    if t.dims() != dims {
        bail!("{op}: `{name}` must have shape {dims:?}, got {:?}", t.dims());
    }
    Ok(())
}

/// Error unless `t` lives on the same device as `like`.
pub(crate) fn check_device(op: &str, name: &str, t: &Tensor, like: &Tensor) -> Result<()> {
    if !t.device().same_device(like.device()) {
        bail!("{op}: `{name}` is on {:?}, the other arguments on {:?}", t.device().location(), like.device().location());
    }
    Ok(())
}

/// Error unless the activation dtype is bf16, f16 or f32.
pub(crate) fn check_float(op: &str, name: &str, t: &Tensor) -> Result<()> {
    match t.dtype() {
        DType::BF16 | DType::F16 | DType::F32 => Ok(()),
        other => bail!("{op}: `{name}` has dtype {other:?}; bf16, f16 or f32 expected"),
    }
}

/// The contiguous elements of a CPU storage as a `T` slice.
pub(crate) fn cpu_slice<'a, T: WithDType>(op: &str, name: &str, s: &'a CpuStorage, l: &Layout) -> Result<&'a [T]> {
    let (a, b) = contiguous(op, name, l)?;
    Ok(&s.as_slice::<T>()?[a..b])
}

/// The contiguous elements of a CPU storage as a mutable `T` slice.
pub(crate) fn cpu_slice_mut<'a, T: Elem>(op: &str, name: &str, s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [T]> {
    let (a, b) = contiguous(op, name, l)?;
    match T::slice_mut(s) {
        Some(v) => Ok(&mut v[a..b]),
        None => bail!("{op}: `{name}` is not {:?}", T::DTYPE),
    }
}

/// Same, for f32 state buffers (AdamW, accumulators).
pub(crate) fn cpu_f32_mut<'a>(op: &str, name: &str, s: &'a mut CpuStorage, l: &Layout) -> Result<&'a mut [f32]> {
    cpu_slice_mut::<f32>(op, name, s, l)
}

/// Runs `f` on the CPU storage of `t` (an input an op carries in its struct, beyond the
/// one to three that Candle's custom-op traits pass).
pub(crate) fn with_cpu<R>(op: &str, name: &str, t: &Tensor, f: impl FnOnce(&CpuStorage, &Layout) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cpu(c) => f(c, l),
        _ => bail!("{op}: `{name}` is not on the CPU like the other arguments"),
    }
}

/// Runs `f` on the CUDA storage of `t` (see [`with_cpu`]).
#[cfg(feature = "cuda")]
pub(crate) fn with_cuda<R>(op: &str, name: &str, t: &Tensor, f: impl FnOnce(&candle_core::CudaStorage, &Layout) -> Result<R>) -> Result<R> {
    let (s, l) = t.storage_and_layout();
    match &*s {
        Storage::Cuda(c) => f(c, l),
        _ => bail!("{op}: `{name}` is not on the GPU like the other arguments"),
    }
}

/// The outputs of a custom op beyond its first: the op's `*_fwd` pushes them here, the
/// caller wraps them as tensors once Candle's `apply_op*` returns.
#[derive(Default)]
pub(crate) struct Extras(RefCell<Vec<(Storage, Shape)>>);

impl Extras {
    pub(crate) fn push(&self, s: Storage, shape: impl Into<Shape>) {
        self.0.borrow_mut().push((s, shape.into()))
    }

    /// The pushed outputs as (graph-free) tensors, in push order; exactly `n` expected.
    pub(crate) fn take(&self, op: &str, n: usize) -> Result<Vec<Tensor>> {
        let v = std::mem::take(&mut *self.0.borrow_mut());
        if v.len() != n {
            bail!("{op}: internal error, {} extra outputs instead of {n}", v.len());
        }
        Ok(v.into_iter().map(|(s, shape)| Tensor::from_storage(s, shape, BackpropOp::none(), false)).collect())
    }
}

/// A CPU storage holding `v`.
pub(crate) fn cpu_storage<T: WithDType>(v: Vec<T>) -> Storage {
    Storage::Cpu(T::to_cpu_storage_owned(v))
}

/// Address of the storage behind `t` (equal for tensors that share an allocation).
pub(crate) fn storage_addr(t: &Tensor) -> usize {
    let (s, _) = t.storage_and_layout();
    &*s as *const Storage as usize
}

/// Error if two of `ts` share an allocation (an in-place op needs them distinct).
pub(crate) fn check_distinct(op: &str, ts: &[(&str, &Tensor)]) -> Result<()> {
    let addrs: Vec<usize> = ts.iter().map(|(_, t)| storage_addr(t)).collect();
    for i in 0..ts.len() {
        for j in i + 1..ts.len() {
            if addrs[i] == addrs[j] {
                bail!("{op}: `{}` and `{}` share storage; they must be distinct tensors", ts[i].0, ts[j].0);
            }
        }
    }
    Ok(())
}
