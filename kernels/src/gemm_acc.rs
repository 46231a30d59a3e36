//! A weight gradient accumulated into its f32 buffer by the GEMM itself:
//! `acc ← acc + alpha · dyᵀ · x`, one cuBLAS `gemmEx` call with `beta = 1` (16-bit inputs,
//! f32 output and f32 math), so that no 16-bit `dW` is materialised, rounded, and then
//! added by a separate kernel.
//!
//! Shapes: `dy`: `[n, o]` (the gradient of a linear layer's output, rows = tokens), `x`:
//! `[n, i]` (its input), both bf16, f16 or f32 of one dtype, contiguous; `acc`: `[o, i]`
//! f32, contiguous (a view into a larger flat buffer is fine), updated in place.
//!
//! cuBLAS is column-major: the row-major `acc [o, i]` is the column-major `[i, o]` matrix
//! `xᵀ·dy` with `x` read as column-major `[i, n]` (no transpose) and `dy` as `[o, n]`
//! (transposed). The CPU twin computes `dyᵀ·x` in f32 with Candle's matmul and adds it.

use crate::common::*;
use candle_core::{bail, DType, Result, Tensor};

const OP: &str = "matmul_acc_f32";

/// `acc [o, i] f32 ← acc + alpha · dy [n, o]ᵀ · x [n, i]`, in place.
pub fn matmul_acc_f32(acc: &Tensor, dy: &Tensor, x: &Tensor, alpha: f64) -> Result<()> {
    check_dtype(OP, "acc", acc, DType::F32)?;
    check_float(OP, "dy", dy)?;
    if x.dtype() != dy.dtype() {
        bail!("{OP}: `x` must have the dtype of `dy` ({:?}), got {:?}", dy.dtype(), x.dtype());
    }
    let (n, o) = dy.dims2()?;
    let (n2, i) = x.dims2()?;
    if n != n2 {
        bail!("{OP}: `dy` [{n}, {o}] and `x` [{n2}, {i}] must have the same rows");
    }
    check_dims(OP, "acc", acc, &[o, i])?;
    check_contiguous(OP, "acc", acc)?;
    check_contiguous(OP, "dy", dy)?;
    check_contiguous(OP, "x", x)?;
    check_device(OP, "dy", dy, acc)?;
    check_device(OP, "x", x, acc)?;
    if n == 0 || o == 0 || i == 0 {
        return Ok(());
    }
    if acc.device().is_cpu() {
        let dw = dy.to_dtype(DType::F32)?.t()?.matmul(&x.to_dtype(DType::F32)?)?; // [o, i]
        return crate::accumulate_f32(acc, &dw, alpha);
    }
    #[cfg(feature = "cuda")]
    {
        acc.inplace_op3(dy, x, &cuda_op::GemmAcc { alpha: alpha as f32, dims: (n, o, i) })
    }
    #[cfg(not(feature = "cuda"))]
    bail!("{OP}: device {:?} is not supported (build with the `cuda` feature)", acc.device())
}

#[cfg(feature = "cuda")]
mod cuda_op {
    use super::OP;
    use crate::cuda::{view, view_mut};
    use candle_core::backend::BackendStorage;
    use candle_core::cuda::cudarc::cublas::{result, sys};
    use candle_core::cuda::cudarc::driver::{DevicePtr, DevicePtrMut, DeviceRepr};
    use candle_core::cuda::{CudaDType, WrapErr};
    use candle_core::{bail, CpuStorage, CudaStorage, DType, InplaceOp3, Layout, Result};
    use std::ffi::{c_int, c_void};

    pub(super) struct GemmAcc {
        pub alpha: f32,
        /// `(n, o, i)`: rows, output and input features.
        pub dims: (usize, usize, usize),
    }

    fn dims_i32(d: usize) -> Result<c_int> {
        c_int::try_from(d).map_err(|_| candle_core::Error::Msg(format!("{OP}: dimension {d} exceeds cuBLAS's 32-bit limit")))
    }

    impl InplaceOp3 for GemmAcc {
        fn name(&self) -> &'static str {
            OP
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            bail!("{OP}: internal error, the CPU path does not use the op")
        }

        fn cuda_fwd(&self, acc: &mut CudaStorage, la: &Layout, dy: &CudaStorage, ld: &Layout, x: &CudaStorage, lx: &Layout) -> Result<()> {
            let args = Args { dims: self.dims, alpha: self.alpha };
            match dy.dtype() {
                DType::BF16 => gemm::<half::bf16>(&args, sys::cudaDataType_t::CUDA_R_16BF, acc, la, (dy, ld), (x, lx)),
                DType::F16 => gemm::<half::f16>(&args, sys::cudaDataType_t::CUDA_R_16F, acc, la, (dy, ld), (x, lx)),
                DType::F32 => gemm::<f32>(&args, sys::cudaDataType_t::CUDA_R_32F, acc, la, (dy, ld), (x, lx)),
                other => bail!("{OP}: dtype {other:?} is not supported"),
            }
        }
    }

    struct Args {
        dims: (usize, usize, usize),
        alpha: f32,
    }

    /// The `gemmEx` call: column-major `C [i, o] += alpha · X [i, n] · DYᵀ`, with
    /// `X = x` (ld `i`), `DY = dy` (ld `o`), `C = acc` (ld `i`).
    fn gemm<E: CudaDType + DeviceRepr>(
        args: &Args,
        ty: sys::cudaDataType_t,
        acc: &mut CudaStorage,
        la: &Layout,
        (dy, ld): (&CudaStorage, &Layout),
        (x, lx): (&CudaStorage, &Layout),
    ) -> Result<()> {
        let (n, o, i) = args.dims;
        let (m_, n_, k_) = (dims_i32(i)?, dims_i32(o)?, dims_i32(n)?);
        let dev = acc.device().clone();
        let blas = dev.cublas_handle();
        let stream = dev.cuda_stream();
        let dyv = view::<E>(OP, "dy", dy, ld)?;
        let xv = view::<E>(OP, "x", x, lx)?;
        let mut c = view_mut::<f32>(OP, "acc", acc, la)?;
        let (dyp, _g1) = dyv.device_ptr(&stream);
        let (xp, _g2) = xv.device_ptr(&stream);
        let (cp, _g3) = c.device_ptr_mut(&stream);
        let (alpha, beta) = (args.alpha, 1.0f32);
        // SAFETY: the pointers address contiguous buffers of the checked shapes (`x` n·i,
        // `dy` n·o, `acc` o·i elements) on the stream the cuBLAS handle is bound to; the
        // guards order this call after their last writes and before later readers.
        unsafe {
            result::gemm_ex(
                *blas.handle(),
                sys::cublasOperation_t::CUBLAS_OP_N,
                sys::cublasOperation_t::CUBLAS_OP_T,
                m_,
                n_,
                k_,
                (&alpha) as *const f32 as *const c_void,
                xp as *const c_void,
                ty,
                m_,
                dyp as *const c_void,
                ty,
                n_,
                (&beta) as *const f32 as *const c_void,
                cp as *mut c_void,
                sys::cudaDataType_t::CUDA_R_32F,
                m_,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .w()
    }
}
