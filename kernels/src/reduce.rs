//! Whole-tensor reductions spread over the whole GPU (Candle's `sum_all` reduces in a
//! single thread block, which takes tens of milliseconds over a billion elements):
//! the sum of squares of a gradient buffer (the global norm) and the count of
//! non-finite values in a list of tensors (the numeric guards), each ending in one
//! transfer to the host.
//!
//! Shapes: `x [..]` bf16/f16/f32, contiguous, read as `n` flat elements.
//!
//! Determinism: the sum of squares is accumulated in f64, per block on the GPU (a
//! grid-stride loop with a grid fixed by `n` and the device) and over blocks on the host
//! in block order, so a run gives the same bits every time on one device. The CPU twin
//! adds fixed-size slices in f64, in order.

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{Result, Tensor};
use rayon::prelude::*;

const SUMSQ: &str = "sum_squares";
const NONFINITE: &str = "count_non_finite";

/// `Σ x²` over every element of `x`, in f64.
pub fn sum_squares(x: &Tensor) -> Result<f64> {
    check_float(SUMSQ, "x", x)?;
    check_contiguous(SUMSQ, "x", x)?;
    if x.elem_count() == 0 {
        return Ok(0.0);
    }
    match x.device() {
        candle_core::Device::Cpu => with_cpu(SUMSQ, "x", x, |s, l| {
            dispatch_float!(SUMSQ, s.dtype(), T => {
                let v = cpu_slice::<T>(SUMSQ, "x", s, l)?;
                Ok(sum_squares_cpu(v))
            })
        }),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => with_cuda(SUMSQ, "x", x, |s, l| sum_squares_cuda(s, l)),
        #[allow(unreachable_patterns)]
        d => candle_core::bail!("{SUMSQ}: device {d:?} is not supported (CPU or CUDA)"),
    }
}

/// [`sum_squares`] without waiting for it: `[k]` f64 partial sums on `x`'s device (one
/// per block on CUDA, one on the CPU) whose sum in order is `sum_squares(x)`, bit for bit.
/// For sums taken while the device works on (a gradient slice per layer), read later
/// with one transfer.
pub fn sum_squares_partials(x: &Tensor) -> Result<Tensor> {
    check_float(SUMSQ, "x", x)?;
    check_contiguous(SUMSQ, "x", x)?;
    if x.elem_count() == 0 {
        return Tensor::zeros(1, candle_core::DType::F64, x.device());
    }
    match x.device() {
        candle_core::Device::Cpu => Tensor::new(&[sum_squares(x)?], x.device()),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => {
            let (st, l) = x.storage_and_layout();
            let candle_core::Storage::Cuda(s) = &*st else { candle_core::bail!("{SUMSQ}: x is not on a CUDA device") };
            let (partials, dev) = sum_squares_cuda_partials(s, l)?;
            let k = partials.len();
            Ok(Tensor::from_storage(
                candle_core::Storage::Cuda(candle_core::CudaStorage::wrap_cuda_slice(partials, dev)),
                k,
                candle_core::op::BackpropOp::none(),
                false,
            ))
        }
        #[allow(unreachable_patterns)]
        d => candle_core::bail!("{SUMSQ}: device {d:?} is not supported (CPU or CUDA)"),
    }
}

/// The number of NaN and ±∞ elements of each of `xs` (all on one device), with one
/// transfer to the host for all of them.
pub fn count_non_finite(xs: &[Tensor]) -> Result<Vec<u64>> {
    for x in xs {
        check_float(NONFINITE, "x", x)?;
        check_contiguous(NONFINITE, "x", x)?;
    }
    let Some(first) = xs.first() else { return Ok(Vec::new()) };
    match first.device() {
        candle_core::Device::Cpu => xs
            .iter()
            .map(|x| {
                with_cpu(NONFINITE, "x", x, |s, l| {
                    dispatch_float!(NONFINITE, s.dtype(), T => {
                        let v = cpu_slice::<T>(NONFINITE, "x", s, l)?;
                        Ok(v.par_iter().filter(|e| !e.to_f().is_finite()).count() as u64)
                    })
                })
            })
            .collect(),
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(_) => count_non_finite_cuda(xs),
        #[allow(unreachable_patterns)]
        d => candle_core::bail!("{NONFINITE}: device {d:?} is not supported (CPU or CUDA)"),
    }
}

fn sum_squares_cpu<T: Elem>(v: &[T]) -> f64 {
    const CHUNK: usize = 1 << 16;
    let parts: Vec<f64> = v.par_chunks(CHUNK).map(|c| c.iter().map(|e| (e.to_f() as f64).powi(2)).sum::<f64>()).collect();
    parts.iter().sum()
}

#[cfg(feature = "cuda")]
fn grid(dev: &candle_core::CudaDevice, n: usize) -> Result<candle_core::cuda::cudarc::driver::LaunchConfig> {
    // 256 threads, at least 16 elements per thread, at most 8 blocks per SM.
    let threads = 256usize;
    let blocks = n.div_ceil(threads * 16).clamp(1, 8 * crate::cuda::sm_count(dev)?);
    Ok(candle_core::cuda::cudarc::driver::LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    })
}

#[cfg(feature = "cuda")]
fn sum_squares_cuda(s: &candle_core::CudaStorage, l: &candle_core::Layout) -> Result<f64> {
    use candle_core::cuda::WrapErr;
    let (partials, dev) = sum_squares_cuda_partials(s, l)?;
    let host = dev.cuda_stream().clone_dtoh(&partials).w()?;
    Ok(host.iter().sum())
}

/// The per-block f64 partial sums of [`sum_squares_cuda`], left on the device.
#[cfg(feature = "cuda")]
fn sum_squares_cuda_partials(
    s: &candle_core::CudaStorage,
    l: &candle_core::Layout,
) -> Result<(candle_core::cuda::cudarc::driver::CudaSlice<f64>, candle_core::CudaDevice)> {
    use crate::cuda::{alloc, launch, view, Module};
    let dev = s.device().clone();
    let n = l.shape().elem_count();
    let cfg = grid(&dev, n)?;
    let mut partials = alloc::<f64>(&dev, cfg.grid_dim.0 as usize)?;
    dispatch_float!(SUMSQ, s.dtype(), T => {
        let x = view::<T>(SUMSQ, "x", s, l)?;
        launch!(dev, Module::Reduce, format!("sum_squares_{}", T::SUFFIX), cfg, &x, &n, &mut partials);
        Ok::<(), candle_core::Error>(())
    })?;
    Ok((partials, dev))
}

#[cfg(feature = "cuda")]
fn count_non_finite_cuda(xs: &[Tensor]) -> Result<Vec<u64>> {
    use crate::cuda::{launch, view, Module};
    use candle_core::cuda::WrapErr;
    let dev = match xs[0].device() {
        candle_core::Device::Cuda(d) => d.clone(),
        _ => candle_core::bail!("{NONFINITE}: tensors on different devices"),
    };
    let mut counts = dev.cuda_stream().alloc_zeros::<u32>(xs.len()).w()?;
    for (slot, x) in xs.iter().enumerate() {
        if !x.device().same_device(xs[0].device()) {
            candle_core::bail!("{NONFINITE}: tensor {slot} is on {:?}, the first on {:?}", x.device(), xs[0].device());
        }
        let n = x.elem_count();
        if n == 0 {
            continue;
        }
        let slot = slot as u32;
        with_cuda(NONFINITE, "x", x, |s, l| {
            let cfg = grid(&dev, n)?;
            dispatch_float!(NONFINITE, s.dtype(), T => {
                let v = view::<T>(NONFINITE, "x", s, l)?;
                launch!(dev, Module::Reduce, format!("count_non_finite_{}", T::SUFFIX), cfg, &v, &n, &mut counts, &slot);
                Ok(())
            })
        })?;
    }
    // Counts saturate at u32::MAX per tensor; any count above zero is what matters.
    Ok(dev.cuda_stream().clone_dtoh(&counts).w()?.into_iter().map(u64::from).collect())
}
