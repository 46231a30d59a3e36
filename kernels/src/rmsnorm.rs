//! RMSNorm with the residual add fused, forward and backward, as transformers'
//! `LlamaRMSNorm` computes it: `s = x + residual` (rounded to the activation dtype, as the
//! separate add would), `r = 1/√(mean(s²) + eps)` in f32, `y = w · T(s·r)`.
//!
//! Shapes: `h` hidden; `..` any leading dims (`[b, s]` for hidden states), flattened to
//! rows. `x`, `residual`, `y`, `x_sum`, `dy`, `d_residual`, `dx`: `[.., h]` (T);
//! `weight`: `[h]` (T); `rstd`: `[..]` f32; `dweight`: `[h]` f32. T ∈ {bf16, f16, f32}.
//!
//! Backward (`n = s·r`, `g = dy·w`): `ds = r·(g − n·mean(g·n)) + d_residual`,
//! `dw = Σ_rows dy·T(n)`. In a pre-norm block `s` feeds both the norm and the next
//! residual, so `d_residual` is the gradient arriving on the residual stream and `ds` is
//! the gradient of both `x` and `residual`.

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, CustomOp2, CustomOp3, InplaceOp3, Layout, Result, Shape, Tensor};
use rayon::prelude::*;

const FWD: &str = "rms_norm_fwd";
const BWD: &str = "rms_norm_bwd";
const BWD_INTO: &str = "rms_norm_bwd_into";

/// Outputs of [`rms_norm_fwd`].
#[derive(Debug, Clone)]
pub struct RmsNormOut {
    /// `[.., h]` (T): the normalised, weighted rows.
    pub y: Tensor,
    /// `[.., h]` (T): `x + residual` (the next residual stream), or `x` itself without one.
    pub x_sum: Tensor,
    /// `[..]` f32: `1/√(mean(x_sum²) + eps)` per row, for the backward.
    pub rstd: Tensor,
}

/// Outputs of [`rms_norm_bwd`].
#[derive(Debug, Clone)]
pub struct RmsNormGrads {
    /// `[.., h]` (T, dy's dtype): gradient of `x_sum`, hence of `x` and of `residual`.
    pub dx: Tensor,
    /// `[h]` f32: gradient of the weight summed over all rows of the call.
    pub dweight: Tensor,
}

fn hidden(op: &str, x: &Tensor, weight: &Tensor) -> Result<(usize, usize)> {
    let h = match x.dims().last() {
        Some(&h) if h > 0 => h,
        _ => bail!("{op}: `x` must have a non-empty last (hidden) dim, got shape {:?}", x.dims()),
    };
    check_dims(op, "weight", weight, &[h])?;
    Ok((x.elem_count() / h, h))
}

/// Fused `x_sum = x + residual; y = RMSNorm(x_sum)·weight`.
/// `x [.., h]`, `residual [.., h]` (optional, same dtype), `weight [h]` (same dtype),
/// all contiguous. Returns `y [.., h]`, `x_sum [.., h]`, `rstd [..]` f32.
pub fn rms_norm_fwd(x: &Tensor, residual: Option<&Tensor>, weight: &Tensor, eps: f64) -> Result<RmsNormOut> {
    check_float(FWD, "x", x)?;
    let (_rows, h) = hidden(FWD, x, weight)?;
    check_dtype(FWD, "weight", weight, x.dtype())?;
    check_contiguous(FWD, "x", x)?;
    check_contiguous(FWD, "weight", weight)?;
    if let Some(r) = residual {
        check_dims(FWD, "residual", r, x.dims())?;
        check_dtype(FWD, "residual", r, x.dtype())?;
        check_contiguous(FWD, "residual", r)?;
    }
    let op = FwdOp { eps: eps as f32, h, extras: Extras::default() };
    match residual {
        Some(r) => {
            let y = x.apply_op3_no_bwd(r, weight, &op)?;
            let mut ex = op.extras.take(FWD, 2)?.into_iter();
            let (x_sum, rstd) = (ex.next().unwrap(), ex.next().unwrap());
            Ok(RmsNormOut { y, x_sum, rstd })
        }
        None => {
            let y = x.apply_op2_no_bwd(weight, &op)?;
            let rstd = op.extras.take(FWD, 1)?.remove(0);
            Ok(RmsNormOut { y, x_sum: x.clone(), rstd })
        }
    }
}

/// Backward of [`rms_norm_fwd`]: `dy [.., h]`, `x_sum [.., h]`, `weight [h]` (all T),
/// `rstd [..]` f32 from the forward, `d_residual [.., h]` (T, optional): the gradient
/// already arriving on the residual stream, added to `dx`. All contiguous.
pub fn rms_norm_bwd(dy: &Tensor, x_sum: &Tensor, weight: &Tensor, rstd: &Tensor, d_residual: Option<&Tensor>) -> Result<RmsNormGrads> {
    let (_, h) = check_bwd_args(BWD, dy, x_sum, weight, rstd, d_residual)?;
    let op = BwdOp { h, rstd: rstd.clone(), d_residual: d_residual.cloned(), extras: Extras::default() };
    let dx = dy.apply_op3_no_bwd(x_sum, weight, &op)?;
    let dweight = op.extras.take(BWD, 1)?.remove(0);
    Ok(RmsNormGrads { dx, dweight })
}

/// [`rms_norm_bwd`] with the residual gradient updated in place: `d_residual ← d_residual +
/// (the norm's input gradient)`, so that the gradient of `x_sum` lands where the residual
/// gradient was (rows of a whole-sequence buffer: no copy after it). Returns `dweight [h]`
/// f32. `d_residual` must not share storage with `dy` or `x_sum`.
pub fn rms_norm_bwd_into(d_residual: &Tensor, dy: &Tensor, x_sum: &Tensor, weight: &Tensor, rstd: &Tensor) -> Result<Tensor> {
    let (_, h) = check_bwd_args(BWD_INTO, dy, x_sum, weight, rstd, Some(d_residual))?;
    check_distinct(BWD_INTO, &[("d_residual", d_residual), ("dy", dy), ("x_sum", x_sum)])?;
    let op = BwdOp { h, rstd: rstd.clone(), d_residual: None, extras: Extras::default() };
    d_residual.inplace_op3(dy, x_sum, &InPlace { op: &op, weight: weight.clone() })?;
    Ok(op.extras.take(BWD_INTO, 1)?.remove(0))
}

/// The checks both backward entry points make; `(rows, h)`.
fn check_bwd_args(
    op: &str,
    dy: &Tensor,
    x_sum: &Tensor,
    weight: &Tensor,
    rstd: &Tensor,
    d_residual: Option<&Tensor>,
) -> Result<(usize, usize)> {
    check_float(op, "dy", dy)?;
    let (rows, h) = hidden(op, dy, weight)?;
    for (name, t) in [("x_sum", x_sum), ("weight", weight)].into_iter().chain(d_residual.map(|t| ("d_residual", t))) {
        check_dtype(op, name, t, dy.dtype())?;
        check_contiguous(op, name, t)?;
        check_device(op, name, t, dy)?;
        if name != "weight" {
            check_dims(op, name, t, dy.dims())?;
        }
    }
    check_contiguous(op, "dy", dy)?;
    check_dtype(op, "rstd", rstd, candle_core::DType::F32)?;
    check_contiguous(op, "rstd", rstd)?;
    check_device(op, "rstd", rstd, dy)?;
    if rstd.elem_count() != rows {
        bail!("{op}: `rstd` must hold one value per row ({rows}), got shape {:?}", rstd.dims());
    }
    Ok((rows, h))
}

// ---------------------------------------------------------------- CPU twins

fn fwd_cpu<T: Elem>(x: &[T], res: Option<&[T]>, w: &[T], h: usize, eps: f32) -> (Vec<T>, Option<Vec<T>>, Vec<f32>) {
    let xs: Option<Vec<T>> = res.map(|r| x.par_iter().zip(r).map(|(&a, &b)| T::from_f(a.to_f() + b.to_f())).collect());
    let src: &[T] = xs.as_deref().unwrap_or(x);
    let mut y = vec![T::from_f(0.0); src.len()];
    let mut rstd = vec![0f32; src.len() / h];
    y.par_chunks_mut(h).zip(rstd.par_iter_mut()).zip(src.par_chunks(h)).for_each(|((yr, rs), xr)| {
        let ss: f32 = xr.iter().map(|v| v.to_f() * v.to_f()).sum();
        let r = 1.0 / (ss / h as f32 + eps).sqrt();
        for ((o, v), wj) in yr.iter_mut().zip(xr).zip(w) {
            *o = T::from_f(round_to::<T>(v.to_f() * r) * wj.to_f());
        }
        *rs = r;
    });
    (y, xs, rstd)
}

/// Rows per block of the weight-gradient sum: blocks are summed in parallel, then their
/// partial sums in block order, so the result does not depend on thread scheduling (a
/// resumed run must reproduce a straight one bit for bit).
const DW_BLOCK_ROWS: usize = 64;

/// Where the backward's residual gradient comes from.
#[derive(Clone, Copy)]
enum Res<'a, T> {
    None,
    From(&'a [T]),
    /// The output buffer holds it (updated in place).
    InPlace,
}

/// Writes the gradient of `x_sum` into `dx` (plus the residual gradient), returns `dw`.
fn bwd_cpu<T: Elem>(dy: &[T], xs: &[T], w: &[T], rstd: &[f32], dres: Res<T>, dx: &mut [T], h: usize) -> Vec<f32> {
    let inv_h = 1.0 / h as f32;
    let partials: Vec<Vec<f32>> = dx
        .par_chunks_mut(h * DW_BLOCK_ROWS)
        .enumerate()
        .map(|(blk, dxb)| {
            let mut acc = vec![0f32; h];
            for (k, dxr) in dxb.chunks_mut(h).enumerate() {
                let row = blk * DW_BLOCK_ROWS + k;
                let (base, r) = (row * h, rstd[row]);
                let (dyr, xr) = (&dy[base..base + h], &xs[base..base + h]);
                let mut dot = 0f32;
                for j in 0..h {
                    let (d, n) = (dyr[j].to_f(), xr[j].to_f() * r);
                    dot += d * w[j].to_f() * n;
                    acc[j] += d * round_to::<T>(n);
                }
                dot *= inv_h;
                for j in 0..h {
                    let n = xr[j].to_f() * r;
                    let mut o = r * (dyr[j].to_f() * w[j].to_f() - n * dot);
                    match dres {
                        Res::None => {}
                        Res::From(dr) => o += dr[base + j].to_f(),
                        Res::InPlace => o += dxr[j].to_f(),
                    }
                    dxr[j] = T::from_f(o);
                }
            }
            acc
        })
        .collect();
    let mut dw = vec![0f32; h];
    for p in &partials {
        dw.iter_mut().zip(p).for_each(|(x, y)| *x += y);
    }
    dw
}

// ---------------------------------------------------------------- forward op

struct FwdOp {
    eps: f32,
    h: usize,
    extras: Extras,
}

type Arg<'a, S> = (&'a S, &'a Layout);

impl FwdOp {
    fn cpu(&self, x: Arg<CpuStorage>, res: Option<Arg<CpuStorage>>, w: Arg<CpuStorage>) -> Result<(CpuStorage, Shape)> {
        let shape = x.1.shape().clone();
        let rows_shape = Shape::from(&shape.dims()[..shape.rank() - 1]);
        dispatch_float!(FWD, x.0.dtype(), T => {
            let xv = cpu_slice::<T>(FWD, "x", x.0, x.1)?;
            let rv = res.map(|(s, l)| cpu_slice::<T>(FWD, "residual", s, l)).transpose()?;
            let wv = cpu_slice::<T>(FWD, "weight", w.0, w.1)?;
            let (y, xs, rstd) = fwd_cpu(xv, rv, wv, self.h, self.eps);
            if let Some(xs) = xs {
                self.extras.push(cpu_storage(xs), shape.clone());
            }
            self.extras.push(cpu_storage(rstd), rows_shape);
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(y), shape))
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda(
        &self,
        x: Arg<candle_core::CudaStorage>,
        res: Option<Arg<candle_core::CudaStorage>>,
        w: Arg<candle_core::CudaStorage>,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::cuda::{alloc, launch, row_threads, view, Module, NULL};
        use candle_core::cuda::cudarc::driver::LaunchConfig;
        use candle_core::{CudaStorage, Storage};
        let dev = x.0.device().clone();
        let shape = x.1.shape().clone();
        let rows_shape = Shape::from(&shape.dims()[..shape.rank() - 1]);
        let n = shape.elem_count();
        let rows = n / self.h;
        dispatch_float!(FWD, x.0.dtype(), T => {
            let xv = view::<T>(FWD, "x", x.0, x.1)?;
            let rv = res.map(|(s, l)| view::<T>(FWD, "residual", s, l)).transpose()?;
            let wv = view::<T>(FWD, "weight", w.0, w.1)?;
            let mut y = alloc::<T>(&dev, n)?;
            let mut rstd = alloc::<f32>(&dev, rows)?;
            let mut xsum = match rv { Some(_) => Some(alloc::<T>(&dev, n)?), None => None };
            if rows > 0 {
                let cfg = LaunchConfig { grid_dim: (rows as u32, 1, 1), block_dim: (row_threads(self.h, 8, 1024), 1, 1), shared_mem_bytes: 0 };
                let name = format!("rmsnorm_fwd_{}", T::SUFFIX);
                let (h, eps) = (self.h as i32, self.eps);
                match (&rv, &mut xsum) {
                    (Some(rv), Some(xs)) => launch!(dev, Module::RmsNorm, name, cfg, &xv, rv, &wv, &mut y, xs, &mut rstd, &h, &eps),
                    _ => launch!(dev, Module::RmsNorm, name, cfg, &xv, &NULL, &wv, &mut y, &NULL, &mut rstd, &h, &eps),
                }
            }
            if let Some(xs) = xsum {
                self.extras.push(Storage::Cuda(CudaStorage::wrap_cuda_slice(xs, dev.clone())), shape.clone());
            }
            self.extras.push(Storage::Cuda(CudaStorage::wrap_cuda_slice(rstd, dev.clone())), rows_shape);
            Ok((CudaStorage::wrap_cuda_slice(y, dev), shape))
        })
    }
}

impl CustomOp2 for FwdOp {
    fn name(&self) -> &'static str {
        FWD
    }
    fn cpu_fwd(&self, s1: &CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu((s1, l1), None, (s2, l2))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s1: &candle_core::CudaStorage,
        l1: &Layout,
        s2: &candle_core::CudaStorage,
        l2: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda((s1, l1), None, (s2, l2))
    }
}

impl CustomOp3 for FwdOp {
    fn name(&self) -> &'static str {
        FWD
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
        self.cpu((s1, l1), Some((s2, l2)), (s3, l3))
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
        self.cuda((s1, l1), Some((s2, l2)), (s3, l3))
    }
}

// ---------------------------------------------------------------- backward op

/// `(dy, x_sum, weight)` through Candle's three op inputs; `rstd` and `d_residual` ride
/// in the struct.
struct BwdOp {
    h: usize,
    rstd: Tensor,
    d_residual: Option<Tensor>,
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
            let dy = cpu_slice::<T>(BWD, "dy", s1, l1)?;
            let xs = cpu_slice::<T>(BWD, "x_sum", s2, l2)?;
            let w = cpu_slice::<T>(BWD, "weight", s3, l3)?;
            let mut dx = vec![T::from_f(0.0); dy.len()];
            let dw = with_cpu(BWD, "rstd", &self.rstd, |rs, rl| {
                let rstd = cpu_slice::<f32>(BWD, "rstd", rs, rl)?;
                match &self.d_residual {
                    Some(t) => with_cpu(BWD, "d_residual", t, |ds, dl| {
                        Ok(bwd_cpu(dy, xs, w, rstd, Res::From(cpu_slice::<T>(BWD, "d_residual", ds, dl)?), &mut dx, self.h))
                    }),
                    None => Ok(bwd_cpu(dy, xs, w, rstd, Res::None, &mut dx, self.h)),
                }
            })?;
            self.extras.push(cpu_storage(dw), self.h);
            Ok((<T as candle_core::WithDType>::to_cpu_storage_owned(dx), shape))
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
        use crate::cuda::{alloc, view, NULL};
        use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
        let dev = s1.device().clone();
        let stream = dev.cuda_stream();
        let shape = l1.shape().clone();
        let n = shape.elem_count();
        dispatch_float!(BWD, s1.dtype(), T => {
            let (dyv, xsv, wv) = (view::<T>(BWD, "dy", s1, l1)?, view::<T>(BWD, "x_sum", s2, l2)?, view::<T>(BWD, "weight", s3, l3)?);
            let mut dx = alloc::<T>(&dev, n)?;
            {
                let ((dyp, _g1), (xsp, _g2), (wp, _g3)) = (dyv.device_ptr(&stream), xsv.device_ptr(&stream), wv.device_ptr(&stream));
                let (dxp, _g4) = dx.device_ptr_mut(&stream);
                match &self.d_residual {
                    Some(t) => with_cuda(BWD, "d_residual", t, |ds, dl| {
                        let dv = view::<T>(BWD, "d_residual", ds, dl)?;
                        let (dp, _g5) = dv.device_ptr(&stream);
                        self.launch::<T>(BWD, &dev, n / self.h, [dyp, xsp, wp, dp, dxp])
                    })?,
                    None => self.launch::<T>(BWD, &dev, n / self.h, [dyp, xsp, wp, NULL, dxp])?,
                }
            }
            Ok((candle_core::CudaStorage::wrap_cuda_slice(dx, dev), shape))
        })
    }
}

#[cfg(feature = "cuda")]
impl BwdOp {
    /// Launches the backward over `rows` rows and pushes `dweight [h]` f32. The buffers
    /// `[dy, x_sum, weight, d_residual, dx]` come as device addresses (the callers hold
    /// their views and guards); `d_residual` 0 for none, or equal to `dx` (in place: the
    /// kernel reads each residual element before it writes the same element, in the same
    /// thread).
    fn launch<T: Elem>(&self, op: &str, dev: &candle_core::CudaDevice, rows: usize, [dy, xs, w, dres, dx]: [u64; 5]) -> Result<()> {
        use crate::cuda::{alloc, launch, row_threads, sm_count, view, Module};
        use candle_core::cuda::cudarc::driver::LaunchConfig;
        use candle_core::{CudaStorage, Storage};
        let h = self.h;
        let smem = h * 4;
        if smem > 48 * 1024 {
            bail!("{op}: hidden size {h} is above the CUDA kernel's limit of 12288 (its weight-gradient sum lives in shared memory)");
        }
        let parts = rows.clamp(1, 2 * sm_count(dev)?);
        let mut part = alloc::<f32>(dev, parts * h)?;
        let mut dw = alloc::<f32>(dev, h)?;
        let (rows_arg, h_arg) = (rows, h as i32);
        if rows > 0 {
            with_cuda(op, "rstd", &self.rstd, |rs, rl| {
                let rstd = view::<f32>(op, "rstd", rs, rl)?;
                let name = format!("rmsnorm_bwd_{}", T::SUFFIX);
                let cfg = LaunchConfig {
                    grid_dim: (parts as u32, 1, 1),
                    block_dim: (row_threads(h, 8, 512), 1, 1),
                    shared_mem_bytes: smem as u32,
                };
                launch!(dev, Module::RmsNorm, name, cfg, &dy, &xs, &w, &rstd, &dres, &dx, &mut part, &rows_arg, &h_arg);
                Ok(())
            })?;
        }
        let cfg = LaunchConfig { grid_dim: (h.div_ceil(256) as u32, 1, 1), block_dim: (256, 1, 1), shared_mem_bytes: 0 };
        let parts_arg = if rows == 0 { 0i32 } else { parts as i32 };
        launch!(dev, Module::RmsNorm, "rmsnorm_dw_reduce", cfg, &part, &mut dw, &parts_arg, &h_arg);
        self.extras.push(Storage::Cuda(CudaStorage::wrap_cuda_slice(dw, dev.clone())), h);
        Ok(())
    }
}

/// [`rms_norm_bwd_into`]'s op: `d_residual` is the in-place buffer, `(dy, x_sum)` Candle's
/// two other inputs, `weight` (and the backward's `rstd`) ride in the structs.
struct InPlace<'a> {
    op: &'a BwdOp,
    weight: Tensor,
}

impl InplaceOp3 for InPlace<'_> {
    fn name(&self) -> &'static str {
        BWD_INTO
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout, s3: &CpuStorage, l3: &Layout) -> Result<()> {
        dispatch_float!(BWD_INTO, s2.dtype(), T => {
            let dy = cpu_slice::<T>(BWD_INTO, "dy", s2, l2)?;
            let xs = cpu_slice::<T>(BWD_INTO, "x_sum", s3, l3)?;
            let dx = cpu_slice_mut::<T>(BWD_INTO, "d_residual", s1, l1)?;
            let dw = with_cpu(BWD_INTO, "weight", &self.weight, |ws, wl| {
                let w = cpu_slice::<T>(BWD_INTO, "weight", ws, wl)?;
                with_cpu(BWD_INTO, "rstd", &self.op.rstd, |rs, rl| {
                    Ok(bwd_cpu(dy, xs, w, cpu_slice::<f32>(BWD_INTO, "rstd", rs, rl)?, Res::InPlace, dx, self.op.h))
                })
            })?;
            self.op.extras.push(cpu_storage(dw), self.op.h);
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
        use crate::cuda::{view, view_mut};
        use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut};
        let dev = s1.device().clone();
        let stream = dev.cuda_stream();
        let rows = l1.shape().elem_count() / self.op.h;
        dispatch_float!(BWD_INTO, s2.dtype(), T => {
            let (dyv, xsv) = (view::<T>(BWD_INTO, "dy", s2, l2)?, view::<T>(BWD_INTO, "x_sum", s3, l3)?);
            let mut dx = view_mut::<T>(BWD_INTO, "d_residual", s1, l1)?;
            with_cuda(BWD_INTO, "weight", &self.weight, |ws, wl| {
                let wv = view::<T>(BWD_INTO, "weight", ws, wl)?;
                let ((dyp, _g1), (xsp, _g2), (wp, _g3)) = (dyv.device_ptr(&stream), xsv.device_ptr(&stream), wv.device_ptr(&stream));
                let (dxp, _g4) = dx.device_ptr_mut(&stream);
                self.op.launch::<T>(BWD_INTO, &dev, rows, [dyp, xsp, wp, dxp, dxp])
            })
        })
    }
}
