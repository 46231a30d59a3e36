//! GEMMs that write into a buffer they are given, one cuBLAS `gemmEx` call each (f32 math):
//! - [`matmul_acc_f32`]: a weight gradient accumulated into its f32 buffer by the GEMM
//!   itself, `acc ← acc + alpha · dyᵀ · x` (`beta = 1`), so that no 16-bit `dW` is
//!   materialised, rounded, and then added by a separate kernel;
//! - [`matmul_into`]: `dst ← a · op(b)` or `dst ← dst + a · op(b)` in the activation dtype,
//!   one rounding: a projection written straight into the rows of a whole-sequence buffer
//!   (no copy after it), or summed onto the gradient already there (no sum after it).
//!
//! Shapes: `dy`: `[n, o]` (the gradient of a linear layer's output, rows = tokens), `x`:
//! `[n, i]` (its input), both bf16, f16 or f32 of one dtype, contiguous; `acc`: `[o, i]`
//! f32, contiguous (a view into a larger flat buffer is fine), updated in place.
//! [`matmul_into`]: `a [n, k]`, `b [o, k]` ([`Rhs::Transposed`]) or `[k, o]` ([`Rhs::AsIs`]),
//! `dst [n, o]` (a view is fine), all of one dtype, contiguous.
//!
//! cuBLAS is column-major: the row-major `acc [o, i]` is the column-major `[i, o]` matrix
//! `xᵀ·dy` with `x` read as column-major `[i, n]` (no transpose) and `dy` as `[o, n]`
//! (transposed); the row-major `dst [n, o]` is the column-major `[o, n]` matrix
//! `op(b)ᵀ · aᵀ`, `aᵀ` being `a` read as column-major `[k, n]`. The CPU twins compute in f32
//! with Candle's matmul, then add (and round once).

use crate::common::*;
use candle_core::backend::BackendStorage;
use candle_core::{bail, CpuStorage, DType, InplaceOp2, Layout, Result, Tensor};
use rayon::prelude::*;

const OP: &str = "matmul_acc_f32";
const INTO: &str = "matmul_into";

/// How `b` enters [`matmul_into`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Rhs {
    /// `b [o, k]` transposed, `a · bᵀ`: a linear layer's forward (`b` its weight `[out, in]`).
    Transposed,
    /// `b [k, o]` as is, `a · b`: a linear layer's input gradient (`b` its weight).
    AsIs,
}

/// `dst [n, o] ← a [n, k] · op(b)`, or with `accumulate` `dst ← dst + a · op(b)`: f32 math,
/// rounded once to the dtype of `a`, `b` and `dst` (bf16, f16 or f32, all one dtype,
/// contiguous). `dst` may be rows of a larger buffer; it must not share storage with `a` or
/// `b`.
pub fn matmul_into(dst: &Tensor, a: &Tensor, b: &Tensor, rhs: Rhs, accumulate: bool) -> Result<()> {
    check_float(INTO, "a", a)?;
    for (name, t) in [("dst", dst), ("a", a), ("b", b)] {
        check_dtype(INTO, name, t, a.dtype())?;
        check_contiguous(INTO, name, t)?;
        check_device(INTO, name, t, a)?;
    }
    let (n, k) = a.dims2()?;
    let (b0, b1) = b.dims2()?;
    let o = match rhs {
        Rhs::Transposed if b1 == k => b0,
        Rhs::AsIs if b0 == k => b1,
        _ => bail!(
            "{INTO}: `a` [{n}, {k}] and `b` [{b0}, {b1}] do not multiply ({rhs:?}: `b` must have {k} {})",
            match rhs {
                Rhs::Transposed => "columns",
                Rhs::AsIs => "rows",
            }
        ),
    };
    check_dims(INTO, "dst", dst, &[n, o])?;
    check_distinct(INTO, &[("dst", dst), ("a", a), ("b", b)])?;
    if n == 0 || o == 0 {
        return Ok(());
    }
    if a.device().is_cpu() {
        let f = |t: &Tensor| t.to_dtype(DType::F32);
        let p = match rhs {
            Rhs::Transposed => f(a)?.matmul(&f(b)?.t()?)?,
            Rhs::AsIs => f(a)?.matmul(&f(b)?)?,
        };
        return dst.inplace_op2(&p, &StoreOp { accumulate });
    }
    #[cfg(feature = "cuda")]
    {
        dst.inplace_op3(a, b, &cuda_op::GemmInto { dims: (n, k, o), rhs, accumulate })
    }
    #[cfg(not(feature = "cuda"))]
    bail!("{INTO}: device {:?} is not supported (build with the `cuda` feature)", dst.device())
}

/// The CPU twin's write: `dst ← T(p + dst)` or `T(p)` for the f32 product `p`.
struct StoreOp {
    accumulate: bool,
}

impl InplaceOp2 for StoreOp {
    fn name(&self) -> &'static str {
        INTO
    }

    fn cpu_fwd(&self, s1: &mut CpuStorage, l1: &Layout, s2: &CpuStorage, l2: &Layout) -> Result<()> {
        let p = cpu_slice::<f32>(INTO, "product", s2, l2)?;
        dispatch_float!(INTO, s1.dtype(), T => {
            let out = cpu_slice_mut::<T>(INTO, "dst", s1, l1)?;
            let acc = self.accumulate;
            out.par_iter_mut().zip(p).for_each(|(o, &v)| *o = T::from_f(if acc { v + o.to_f() } else { v }));
            Ok(())
        })
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(&self, _: &mut candle_core::CudaStorage, _: &Layout, _: &candle_core::CudaStorage, _: &Layout) -> Result<()> {
        bail!("{INTO}: internal error, the GPU path does not use the CPU store")
    }
}

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
    use super::{Rhs, INTO, OP};
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

    fn dims_i32(op: &str, d: usize) -> Result<c_int> {
        c_int::try_from(d).map_err(|_| candle_core::Error::Msg(format!("{op}: dimension {d} exceeds cuBLAS's 32-bit limit")))
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
        let (m_, n_, k_) = (dims_i32(OP, i)?, dims_i32(OP, o)?, dims_i32(OP, n)?);
        let dev = acc.device().clone();
        let blas = dev.cublas_handle();
        let stream = dev.cuda_stream();
        let dyv = view::<E>(OP, "dy", dy, ld)?;
        let xv = view::<E>(OP, "x", x, lx)?;
        let mut c = view_mut::<f32>(OP, "acc", acc, la)?;
        let (dyp, _g1) = dyv.device_ptr(&stream);
        let (xp, _g2) = xv.device_ptr(&stream);
        let (cp, _g3) = c.device_ptr_mut(&stream);
        // SAFETY: the pointers address contiguous buffers of the checked shapes (`x` n·i,
        // `dy` n·o, `acc` o·i elements) on the stream the cuBLAS handle is bound to; the
        // guards order this call after their last writes and before later readers.
        unsafe {
            gemm_ex(
                *blas.handle(),
                (sys::cublasOperation_t::CUBLAS_OP_N, sys::cublasOperation_t::CUBLAS_OP_T),
                (m_, n_, k_),
                (args.alpha, 1.0),
                (xp as *const c_void, m_),
                (dyp as *const c_void, n_),
                ty,
                (cp as *mut c_void, m_, sys::cudaDataType_t::CUDA_R_32F),
            )
        }
    }

    /// One `cublasGemmEx` with f32 compute and scalars: column-major
    /// `C [m, n] = alpha · op_a(A) · op_b(B) + beta · C`, A and B of type `ty`.
    ///
    /// # Safety
    /// The pointers must address device buffers of the shapes the arguments describe, on
    /// the stream `handle` is bound to, C distinct from A and B.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm_ex(
        handle: sys::cublasHandle_t,
        (op_a, op_b): (sys::cublasOperation_t, sys::cublasOperation_t),
        (m, n, k): (c_int, c_int, c_int),
        (alpha, beta): (f32, f32),
        (a, lda): (*const c_void, c_int),
        (b, ldb): (*const c_void, c_int),
        ty: sys::cudaDataType_t,
        (c, ldc, c_ty): (*mut c_void, c_int, sys::cudaDataType_t),
    ) -> Result<()> {
        result::gemm_ex(
            handle,
            op_a,
            op_b,
            m,
            n,
            k,
            (&alpha) as *const f32 as *const c_void,
            a,
            ty,
            lda,
            b,
            ty,
            ldb,
            (&beta) as *const f32 as *const c_void,
            c,
            c_ty,
            ldc,
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
        .w()
    }

    pub(super) struct GemmInto {
        /// `(n, k, o)`: rows of `a`, the inner dimension, columns of `dst`.
        pub dims: (usize, usize, usize),
        pub rhs: Rhs,
        pub accumulate: bool,
    }

    impl InplaceOp3 for GemmInto {
        fn name(&self) -> &'static str {
            INTO
        }

        fn cpu_fwd(&self, _: &mut CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout, _: &CpuStorage, _: &Layout) -> Result<()> {
            bail!("{INTO}: internal error, the CPU path does not use the op")
        }

        fn cuda_fwd(&self, dst: &mut CudaStorage, ld: &Layout, a: &CudaStorage, la: &Layout, b: &CudaStorage, lb: &Layout) -> Result<()> {
            match a.dtype() {
                DType::BF16 => self.gemm::<half::bf16>(sys::cudaDataType_t::CUDA_R_16BF, (dst, ld), (a, la), (b, lb)),
                DType::F16 => self.gemm::<half::f16>(sys::cudaDataType_t::CUDA_R_16F, (dst, ld), (a, la), (b, lb)),
                DType::F32 => self.gemm::<f32>(sys::cudaDataType_t::CUDA_R_32F, (dst, ld), (a, la), (b, lb)),
                other => bail!("{INTO}: dtype {other:?} is not supported"),
            }
        }
    }

    impl GemmInto {
        /// Column-major `D [o, n] = op(B) [o, k] · A [k, n] (+ D)`, `A = a` (ld `k`), `B = b`
        /// (`[k, o]` ld `k` transposed, or `[o, k]` ld `o` as is), `D = dst` (ld `o`).
        fn gemm<E: CudaDType + DeviceRepr>(
            &self,
            ty: sys::cudaDataType_t,
            (dst, ld): (&mut CudaStorage, &Layout),
            (a, la): (&CudaStorage, &Layout),
            (b, lb): (&CudaStorage, &Layout),
        ) -> Result<()> {
            let (n, k, o) = self.dims;
            let (m_, n_, k_) = (dims_i32(INTO, o)?, dims_i32(INTO, n)?, dims_i32(INTO, k)?);
            let (op_b, ld_b) = match self.rhs {
                Rhs::Transposed => (sys::cublasOperation_t::CUBLAS_OP_T, k_),
                Rhs::AsIs => (sys::cublasOperation_t::CUBLAS_OP_N, m_),
            };
            let dev = dst.device().clone();
            let blas = dev.cublas_handle();
            let stream = dev.cuda_stream();
            let av = view::<E>(INTO, "a", a, la)?;
            let bv = view::<E>(INTO, "b", b, lb)?;
            let mut d = view_mut::<E>(INTO, "dst", dst, ld)?;
            let (ap, _g1) = av.device_ptr(&stream);
            let (bp, _g2) = bv.device_ptr(&stream);
            let (dp, _g3) = d.device_ptr_mut(&stream);
            let beta = if self.accumulate { 1.0f32 } else { 0.0 };
            // SAFETY: the pointers address contiguous buffers of the checked shapes (`a` n·k,
            // `b` k·o, `dst` n·o elements, `dst` distinct from both) on the stream the
            // cuBLAS handle is bound to; the guards order this call after their last writes
            // and before later readers. With beta = 0 cuBLAS does not read `dst`.
            unsafe {
                gemm_ex(
                    *blas.handle(),
                    (op_b, sys::cublasOperation_t::CUBLAS_OP_N),
                    (m_, n_, k_),
                    (1.0, beta),
                    (bp as *const c_void, ld_b),
                    (ap as *const c_void, k_),
                    ty,
                    (dp as *mut c_void, m_, ty),
                )
            }
        }
    }
}
