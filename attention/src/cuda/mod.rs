//! CUDA block kernel: cuDNN fused attention (flash-style SDPA with softmax stats)
//! through the C++ shim in `attention/csrc/` (cudnn-frontend, libcudnn opened at run time).
//!
//! Shapes (contract of [`crate::kernel`]):
//! `q [b,s,hq,d]`, `k`/`v [b,t,hkv,d]`, `o`/`do`/`dq [b,s,hq,d]`, `dk`/`dv [b,t,hkv,d]`,
//! `lse [b,hq,s]` f32. BSHD contiguous is exactly one of cuDNN's stride layouts, so the
//! device pointers go to cuDNN as they are; `lse` is cuDNN's `Stats [b,hq,s,1]`.
//!
//! Work is queued on the stream of the tensors' Candle device (the context is bound to
//! the calling thread first), so it is ordered with the Candle ops around it; outputs are
//! fresh Candle allocations on that stream.
//!
//! Supported: bf16 and f16, head dim a multiple of 8 up to 256, compute capability 8.0+,
//! causal (s == t) or unmasked, GQA. Anything else, or a missing libcudnn.so.9, is an
//! error naming the reason, unless the portable fallback is allowed: then the call runs
//! [`crate::naive`] (materialises the scores: slow, memory-hungry, for small shapes only)
//! and says so once on stderr. Allow it with [`set_fallback`]`(true)` or the environment
//! variable `LONGCTX_ATTN_FALLBACK=1`.

mod ffi;

use crate::error::AttnError;
use crate::kernel::{check_shapes, Mask};
use candle_core::cuda::cudarc::driver::{CudaSlice, CudaStream, CudaView, DevicePtr, DevicePtrMut, DeviceRepr};
use candle_core::cuda::{CudaDType, WrapErr};
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::Arc;

/// 0: not set (read the environment), 1: refuse, 2: allow.
static FALLBACK: AtomicU8 = AtomicU8::new(0);
static WARNED: AtomicBool = AtomicBool::new(false);

/// Allow (or forbid) the portable naive fallback when cuDNN cannot run a call.
/// Overrides `LONGCTX_ATTN_FALLBACK`.
pub fn set_fallback(allow: bool) {
    FALLBACK.store(if allow { 2 } else { 1 }, Ordering::Relaxed);
}

/// Whether unsupported calls fall back to the naive kernel ([`set_fallback`], else
/// `LONGCTX_ATTN_FALLBACK` in {1, true, yes}).
pub fn fallback_allowed() -> bool {
    match FALLBACK.load(Ordering::Relaxed) {
        1 => false,
        2 => true,
        _ => matches!(
            std::env::var("LONGCTX_ATTN_FALLBACK").as_deref().map(str::to_ascii_lowercase).as_deref(),
            Ok("1") | Ok("true") | Ok("yes")
        ),
    }
}

/// The loaded cuDNN version as `major*10000 + minor*100 + patch` (e.g. 91400).
pub fn cudnn_version() -> Result<i64> {
    let mut err = ErrBuf::new();
    let v = unsafe { ffi::longctx_sdpa_cudnn_version(err.ptr(), err.len()) };
    if v == 0 {
        return crate::config_err!("{}", err.text());
    }
    Ok(v)
}

/// Keep memory freed by stream-ordered allocations in the device's default memory pool
/// instead of handing it back to the driver at every synchronisation (the behaviour of
/// PyTorch's caching allocator). Candle's tensors and this kernel's workspace come from
/// that pool; with the default release threshold (0) a loop that synchronises every
/// step maps its buffers afresh every step. Call once per device (training engine,
/// benchmarks); the memory stays reserved for this process.
pub fn retain_pool_memory(dev: &CudaDevice) -> Result<()> {
    use candle_core::cuda::cudarc::driver::sys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: plain driver calls on the bound context's device with valid out-pointers.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().w()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            &mut threshold as *mut u64 as *mut c_void,
        )
        .result()
        .w()?;
    }
    Ok(())
}

/// Bytes of the device's default memory pool (the one Candle allocates from) in use now,
/// and the most in use since the last reset; resets the high-water mark when `reset`.
pub fn pool_memory(dev: &CudaDevice, reset: bool) -> Result<(u64, u64)> {
    use candle_core::cuda::cudarc::driver::sys;
    let ctx = dev.cuda_stream().context().clone();
    ctx.bind_to_thread().w()?;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let (mut used, mut high): (u64, u64) = (0, 0);
    // SAFETY: plain driver calls on the bound context's device with valid out-pointers.
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result().w()?;
        let get = |attr, out: &mut u64| sys::cuMemPoolGetAttribute(pool, attr, out as *mut u64 as *mut c_void).result().w();
        get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_CURRENT, &mut used)?;
        get(sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut high)?;
        if reset {
            let mut zero: u64 = 0;
            sys::cuMemPoolSetAttribute(pool, sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_USED_MEM_HIGH, &mut zero as *mut u64 as *mut c_void)
                .result()
                .w()?;
        }
    }
    Ok((used, high))
}

/// Why the fused kernel did not run.
enum Refusal {
    /// cuDNN cannot do this call here (dtype, head dim, GPU, library missing): the naive
    /// fallback may run it when allowed.
    Unsupported(String),
    /// A real failure (CUDA error, out of memory, bad input): always an error.
    Failed(candle_core::Error),
}

impl From<candle_core::Error> for Refusal {
    fn from(e: candle_core::Error) -> Self {
        Refusal::Failed(e)
    }
}

impl From<AttnError> for Refusal {
    fn from(e: AttnError) -> Self {
        Refusal::Failed(e.into())
    }
}

fn settle<T>(what: &str, r: std::result::Result<T, Refusal>, fallback: impl FnOnce() -> Result<T>) -> Result<T> {
    match r {
        Ok(x) => Ok(x),
        Err(Refusal::Failed(e)) => Err(e),
        Err(Refusal::Unsupported(why)) if fallback_allowed() => {
            if !WARNED.swap(true, Ordering::Relaxed) {
                eprintln!(
                    "longctx-attention: cuDNN attention {what} unavailable ({why}); using the slow naive kernel (LONGCTX_ATTN_FALLBACK)"
                );
            }
            fallback()
        }
        Err(Refusal::Unsupported(why)) => crate::config_err!(
            "CUDA attention {what}: {why}. Use bf16/f16 tensors, a head dim that is a multiple of 8 up to 256, \
             a GPU of compute capability 8.0+ and cuDNN 9 (libcudnn.so.9), or allow the slow naive fallback \
             with LONGCTX_ATTN_FALLBACK=1"
        ),
    }
}

/// Block forward on CUDA; see [`crate::kernel::fwd`].
pub fn fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> Result<(Tensor, Tensor)> {
    settle("forward", try_fwd(q, k, v, mask, scale), || crate::naive::fwd(q, k, v, mask, scale))
}

/// Block backward on CUDA with the global `o`/`lse`; see [`crate::kernel::bwd`].
#[allow(clippy::too_many_arguments)]
pub fn bwd(
    d_o: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    mask: Mask,
    scale: f64,
) -> Result<(Tensor, Tensor, Tensor)> {
    settle("backward", try_bwd(d_o, q, k, v, o, lse, mask, scale), || crate::naive::bwd(d_o, q, k, v, o, lse, mask, scale))
}

/// Shape, dtype and device checks shared by both directions.
fn describe(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> std::result::Result<(ffi::Desc, CudaDevice), Refusal> {
    let (b, s, t, hq, hkv, d) = check_shapes(q, k, v, mask)?;
    let dev = match q.device() {
        candle_core::Device::Cuda(dev) => dev.clone(),
        other => return Err(AttnError::Config(format!("CUDA attention called with q on {other:?}")).into()),
    };
    for (name, x) in [("k", k), ("v", v)] {
        if !x.device().same_device(q.device()) {
            return Err(AttnError::Config(format!("{name} is on another device than q")).into());
        }
        if x.dtype() != q.dtype() {
            return Err(AttnError::Config(format!("{name} is {:?}, q is {:?}", x.dtype(), q.dtype())).into());
        }
    }
    let dtype = match q.dtype() {
        DType::BF16 => ffi::BF16,
        DType::F16 => ffi::F16,
        other => return Err(Refusal::Unsupported(format!("dtype {other:?} (cuDNN fused attention takes bf16 or f16)"))),
    };
    if d == 0 || d > 256 || d % 8 != 0 {
        return Err(Refusal::Unsupported(format!("head dim {d} (cuDNN needs a multiple of 8, at most 256)")));
    }
    if b * s * t * hq == 0 {
        return Err(Refusal::Unsupported(format!("empty block b={b} s={s} t={t} hq={hq}")));
    }
    let ordinal = dev.cuda_stream().context().ordinal() as i32;
    let desc = ffi::Desc {
        ordinal,
        dtype,
        b: b as i64,
        s: s as i64,
        t: t as i64,
        hq: hq as i64,
        hkv: hkv as i64,
        d: d as i64,
        causal: (mask == Mask::Causal) as i32,
        scale: scale as f32,
    };
    Ok((desc, dev))
}

fn try_fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> std::result::Result<(Tensor, Tensor), Refusal> {
    let (desc, dev) = describe(q, k, v, mask, scale)?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    match q.dtype() {
        DType::BF16 => fwd_typed::<half::bf16>(&desc, &dev, &q, &k, &v),
        _ => fwd_typed::<half::f16>(&desc, &dev, &q, &k, &v),
    }
}

#[allow(clippy::too_many_arguments)]
fn try_bwd(
    d_o: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
    mask: Mask,
    scale: f64,
) -> std::result::Result<(Tensor, Tensor, Tensor), Refusal> {
    let (desc, dev) = describe(q, k, v, mask, scale)?;
    crate::kernel::check_bwd_shapes(d_o, q, k, v, o, lse, mask)?;
    let dt = q.dtype();
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let o = o.to_dtype(dt)?.contiguous()?;
    let d_o = d_o.to_dtype(dt)?.contiguous()?;
    let lse = lse.to_dtype(DType::F32)?.contiguous()?;
    match dt {
        DType::BF16 => bwd_typed::<half::bf16>(&desc, &dev, &d_o, &q, &k, &v, &o, &lse),
        _ => bwd_typed::<half::f16>(&desc, &dev, &d_o, &q, &k, &v, &o, &lse),
    }
}

/// The elements of a contiguous CUDA tensor as a view (its offset applied).
fn view<'a, T: CudaDType + DeviceRepr>(st: &'a Storage, l: &Layout, name: &str) -> Result<CudaView<'a, T>> {
    let Storage::Cuda(c) = st else {
        return crate::config_err!("{name} is not a CUDA tensor");
    };
    if !l.is_contiguous() {
        return crate::config_err!("{name} is not contiguous");
    }
    let start = l.start_offset();
    Ok(c.as_cuda_slice::<T>()?.slice(start..start + l.shape().elem_count()))
}

/// Uninitialised device buffer of `n` elements on `stream` (fully written by cuDNN).
fn alloc<T: DeviceRepr>(stream: &Arc<CudaStream>, n: usize) -> Result<CudaSlice<T>> {
    // SAFETY: the buffer is written entirely by the cuDNN call before anything reads it.
    unsafe { stream.alloc::<T>(n) }.w()
}

fn tensor<T: CudaDType>(slice: CudaSlice<T>, dev: &CudaDevice, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(slice, dev.clone())), shape, BackpropOp::none(), false)
}

/// Text buffer for the shim's error messages.
struct ErrBuf(Vec<u8>);

impl ErrBuf {
    fn new() -> Self {
        ErrBuf(vec![0u8; 2048])
    }
    fn ptr(&mut self) -> *mut c_char {
        self.0.as_mut_ptr() as *mut c_char
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn text(&self) -> String {
        CStr::from_bytes_until_nul(&self.0).map(|c| c.to_string_lossy().into_owned()).unwrap_or_default()
    }
}

fn check(rc: i32, err: &ErrBuf, what: &str) -> std::result::Result<(), Refusal> {
    match rc {
        ffi::OK => Ok(()),
        ffi::UNSUPPORTED | ffi::UNAVAILABLE => Err(Refusal::Unsupported(err.text())),
        ffi::FAILED => Err(Refusal::Failed(candle_core::Error::Msg(format!("cuDNN attention {what} failed: {}", err.text())))),
        code => Err(Refusal::Failed(candle_core::Error::Msg(format!("cuDNN attention {what}: unknown shim return code {code}")))),
    }
}

fn fwd_typed<T: CudaDType + DeviceRepr>(
    desc: &ffi::Desc,
    dev: &CudaDevice,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
) -> std::result::Result<(Tensor, Tensor), Refusal> {
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let (b, s, hq, d) = (desc.b as usize, desc.s as usize, desc.hq as usize, desc.d as usize);
    let mut o = alloc::<T>(&stream, b * s * hq * d)?;
    let mut lse = alloc::<f32>(&stream, b * hq * s)?;
    let mut err = ErrBuf::new();
    let rc = {
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (qv, kv, vv) = (view::<T>(&qs, ql, "q")?, view::<T>(&ks, kl, "k")?, view::<T>(&vs, vl, "v")?);
        let (qp, _rq) = qv.device_ptr(&stream);
        let (kp, _rk) = kv.device_ptr(&stream);
        let (vp, _rv) = vv.device_ptr(&stream);
        let (op, _wo) = o.device_ptr_mut(&stream);
        let (lp, _wl) = lse.device_ptr_mut(&stream);
        // SAFETY: every pointer addresses a live device buffer of the size `desc` implies,
        // all on `stream`'s device; the guards keep the buffers borrowed until queued.
        unsafe {
            ffi::longctx_sdpa_fwd(
                desc,
                qp as *const c_void,
                kp as *const c_void,
                vp as *const c_void,
                op as *mut c_void,
                lp as *mut f32,
                stream.cu_stream() as *mut c_void,
                err.ptr(),
                err.len(),
            )
        }
    };
    check(rc, &err, "forward")?;
    Ok((tensor(o, dev, (b, s, hq, d)), tensor(lse, dev, (b, hq, s))))
}

#[allow(clippy::too_many_arguments)]
fn bwd_typed<T: CudaDType + DeviceRepr>(
    desc: &ffi::Desc,
    dev: &CudaDevice,
    d_o: &Tensor,
    q: &Tensor,
    k: &Tensor,
    v: &Tensor,
    o: &Tensor,
    lse: &Tensor,
) -> std::result::Result<(Tensor, Tensor, Tensor), Refusal> {
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    let (b, s, t, hq, hkv, d) = (desc.b as usize, desc.s as usize, desc.t as usize, desc.hq as usize, desc.hkv as usize, desc.d as usize);
    let mut dq = alloc::<T>(&stream, b * s * hq * d)?;
    let mut dk = alloc::<T>(&stream, b * t * hkv * d)?;
    let mut dv = alloc::<T>(&stream, b * t * hkv * d)?;
    let mut err = ErrBuf::new();
    let rc = {
        let (qs, ql) = q.storage_and_layout();
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (os, ol) = o.storage_and_layout();
        let (gs, gl) = d_o.storage_and_layout();
        let (ls, ll) = lse.storage_and_layout();
        let (qv, kv, vv) = (view::<T>(&qs, ql, "q")?, view::<T>(&ks, kl, "k")?, view::<T>(&vs, vl, "v")?);
        let (ov, gv, lv) = (view::<T>(&os, ol, "o")?, view::<T>(&gs, gl, "do")?, view::<f32>(&ls, ll, "lse")?);
        let (qp, _rq) = qv.device_ptr(&stream);
        let (kp, _rk) = kv.device_ptr(&stream);
        let (vp, _rv) = vv.device_ptr(&stream);
        let (opp, _ro) = ov.device_ptr(&stream);
        let (gp, _rg) = gv.device_ptr(&stream);
        let (lp, _rl) = lv.device_ptr(&stream);
        let (dqp, _wq) = dq.device_ptr_mut(&stream);
        let (dkp, _wk) = dk.device_ptr_mut(&stream);
        let (dvp, _wv) = dv.device_ptr_mut(&stream);
        // SAFETY: as in `fwd_typed`.
        unsafe {
            ffi::longctx_sdpa_bwd(
                desc,
                qp as *const c_void,
                kp as *const c_void,
                vp as *const c_void,
                opp as *const c_void,
                gp as *const c_void,
                lp as *const f32,
                dqp as *mut c_void,
                dkp as *mut c_void,
                dvp as *mut c_void,
                stream.cu_stream() as *mut c_void,
                err.ptr(),
                err.len(),
            )
        }
    };
    check(rc, &err, "backward")?;
    Ok((tensor(dq, dev, (b, s, hq, d)), tensor(dk, dev, (b, t, hkv, d)), tensor(dv, dev, (b, t, hkv, d))))
}
