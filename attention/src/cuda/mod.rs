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
//! causal (s == t), unmasked, or a sliding-window band ([`Mask::Band`], cut by
//! [`crate::band`] so that `s ≤ t` and `0 ≤ offset < window`: cuDNN's top-left diagonal
//! band with `right_bound = offset`, `left_bound = window − offset`), GQA. Anything else, or a missing libcudnn.so.9, is an
//! error naming the reason, unless the portable fallback is allowed: then the call runs
//! [`crate::naive`] (materialises the scores: slow, memory-hungry, for small shapes only)
//! and says so once on stderr. Allow it with [`set_fallback`]`(true)` or the environment
//! variable `LONGCTX_ATTN_FALLBACK=1`.

mod ffi;
pub(crate) mod raw;

use crate::error::AttnError;
use crate::kernel::{check_shapes, Mask, Saved};
use candle_core::cuda::cudarc::driver::CudaStream;
use candle_core::{CudaDevice, CudaStorage, DType, Result, Tensor};
use raw::PoolAttr;
use std::ffi::{c_char, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;

/// 0: not set (read the environment), 1: refuse, 2: allow.
static FALLBACK: AtomicU8 = AtomicU8::new(0);
static WARNED: AtomicBool = AtomicBool::new(false);
/// The block kernel of this process: 0 auto, 1 native, 2 cuDNN ([`set_kernel`]).
static KERNEL: AtomicU8 = AtomicU8::new(0);
static NATIVE_NOTED: [AtomicBool; 2] = [AtomicBool::new(false), AtomicBool::new(false)];
/// Forwards and backwards the native kernel ran (not those it handed to cuDNN), for
/// [`native_runs`].
static NATIVE_RUNS: [AtomicU64; 2] = [AtomicU64::new(0), AtomicU64::new(0)];

/// Choose the CUDA block kernel (forward and backward) for this process (a run config's `attention.kernel`,
/// `bench attention --kernel`). Like [`set_fallback`], a process-wide setting read at each
/// call: the modes and the model call the block kernel without knowing which one runs.
pub fn set_kernel(k: crate::kernel::CudaKernel) {
    use crate::kernel::CudaKernel;
    let code = match k {
        CudaKernel::Auto => 0,
        CudaKernel::Native => 1,
        CudaKernel::Cudnn => 2,
    };
    KERNEL.store(code, Ordering::Relaxed);
}

/// The CUDA block kernel chosen by [`set_kernel`] (auto unless set).
pub fn kernel() -> crate::kernel::CudaKernel {
    use crate::kernel::CudaKernel;
    match KERNEL.load(Ordering::Relaxed) {
        1 => CudaKernel::Native,
        2 => CudaKernel::Cudnn,
        _ => CudaKernel::Auto,
    }
}

/// Whether this call of `pass` goes to the native kernel first ([`CudaKernel::uses_native`]
/// of the process's kernel). Under `auto` a build without the kernel goes to cuDNN at once
/// (a `native` by name still tries, to say why not).
///
/// [`CudaKernel::uses_native`]: crate::kernel::CudaKernel::uses_native
fn native_first(pass: crate::kernel::Pass, desc: &ffi::Desc) -> bool {
    let k = kernel();
    (native_built() || k == crate::kernel::CudaKernel::Native)
        && k.uses_native(pass, desc.d as usize, desc.causal != 0, desc.s as usize, desc.t as usize)
}

/// Whether this build holds the native Hopper kernel (build.rs compiles it for sm_90 when
/// it finds the CUTLASS headers; scripts/build_cuda.sh fetches them).
pub fn native_built() -> bool {
    cfg!(longctx_native)
}

/// Block forwards and block backwards the native kernel has run in this process. A check or
/// benchmark of the native kernel compares them before and after, so that calls which all
/// fell back to cuDNN (a build without the kernel, another GPU, a shape it does not cover)
/// are not reported as the native kernel's.
pub fn native_runs() -> crate::kernel::NativeRuns {
    crate::kernel::NativeRuns { fwd: NATIVE_RUNS[0].load(Ordering::Relaxed), bwd: NATIVE_RUNS[1].load(Ordering::Relaxed) }
}

/// Says once per direction why the native kernel did not take a call, so that a run which
/// asked for it knows cuDNN ran instead.
fn native_refused(pass: crate::kernel::Pass, why: &str) {
    // said only to whoever asked for the native kernel by name: `auto` means "either"
    if kernel() == crate::kernel::CudaKernel::Native && !NATIVE_NOTED[pass as usize].swap(true, Ordering::Relaxed) {
        let what = ["forward", "backward"][pass as usize];
        eprintln!("longctx-attention: the native kernel does not cover a {what} here ({why}); cuDNN runs it (said once)");
    }
}

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
    // SAFETY: the shim writes at most `err.len()` bytes (a NUL-terminated message) to `err`.
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
    raw::Pool::of(dev)?.set(PoolAttr::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD, u64::MAX)
}

/// Bytes of the device's default memory pool (the one Candle allocates from) in use now,
/// and the most in use since the last reset; resets the high-water mark when `reset`.
pub fn pool_memory(dev: &CudaDevice, reset: bool) -> Result<(u64, u64)> {
    let pool = raw::Pool::of(dev)?;
    let used = pool.get(PoolAttr::CU_MEMPOOL_ATTR_USED_MEM_CURRENT)?;
    let high = pool.get(PoolAttr::CU_MEMPOOL_ATTR_USED_MEM_HIGH)?;
    if reset {
        pool.set(PoolAttr::CU_MEMPOOL_ATTR_USED_MEM_HIGH, 0)?;
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
pub fn bwd(d_o: &Tensor, saved: Saved<'_>, mask: Mask, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
    settle("backward", try_bwd(d_o, saved, mask, scale), || crate::naive::bwd(d_o, saved, mask, scale))
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
    let (band_left, band_right) = band_bounds(mask, s, t)?;
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
        band_left,
        band_right,
    };
    Ok((desc, dev))
}

/// cuDNN's `(left_bound, right_bound)` of a band block (`(0, 0)`: not a band). Query `x`
/// sees key `y` iff `y ≤ x + offset` and `x + offset − y < window`, i.e. `y ≤ x + right`
/// and `y > x − left` with `right = offset`, `left = window − offset`. Bounds past the
/// block are clamped (they mask nothing more). A band cuDNN cannot express (`offset ≥
/// window`, `s > t`) is refused naming the shape; [`crate::band`] never makes one.
fn band_bounds(mask: Mask, s: usize, t: usize) -> std::result::Result<(i64, i64), Refusal> {
    let Mask::Band { offset, window } = mask else { return Ok((0, 0)) };
    if offset >= window || s > t {
        return Err(Refusal::Unsupported(format!(
            "sliding-window band block s_q {s} × s_kv {t}, offset {offset}, window {window}: cuDNN needs s_q ≤ s_kv and offset < window"
        )));
    }
    let cap = (s + t) as i64;
    Ok((((window - offset) as i64).min(cap), (offset as i64).min(cap)))
}

/// Fresh outputs for cuDNN: uninitialised buffers of `n` elements of `dt` each.
fn outputs<const N: usize>(stream: &Arc<CudaStream>, dev: &CudaDevice, dt: [DType; N], n: [usize; N]) -> Result<[CudaStorage; N]> {
    let mut out = Vec::with_capacity(N);
    for (dt, n) in dt.into_iter().zip(n) {
        // SAFETY: every output buffer is written entirely by the cuDNN call before anything reads it.
        out.push(unsafe { raw::alloc(stream, dev, dt, n) }?);
    }
    out.try_into().map_err(|_| candle_core::Error::Msg("cuDNN attention: output count".into()))
}

fn try_fwd(q: &Tensor, k: &Tensor, v: &Tensor, mask: Mask, scale: f64) -> std::result::Result<(Tensor, Tensor), Refusal> {
    let (desc, dev) = describe(q, k, v, mask, scale)?;
    let (q, k, v) = (q.contiguous()?, k.contiguous()?, v.contiguous()?);
    let stream = raw::bind(&dev)?;
    let (b, s, hq, d) = (desc.b as usize, desc.s as usize, desc.hq as usize, desc.d as usize);
    let [mut o, mut lse] = outputs(&stream, &dev, [q.dtype(), DType::F32], [b * s * hq * d, b * hq * s])?;
    if native_first(crate::kernel::Pass::Fwd, &desc) {
        match native_fwd(&desc, &stream, [&q, &k, &v], [&mut o, &mut lse]) {
            Ok(()) => {
                NATIVE_RUNS[crate::kernel::Pass::Fwd as usize].fetch_add(1, Ordering::Relaxed);
                return Ok((raw::tensor(o, (b, s, hq, d)), raw::tensor(lse, (b, hq, s))));
            }
            Err(Refusal::Unsupported(why)) => native_refused(crate::kernel::Pass::Fwd, &why),
            Err(e) => return Err(e),
        }
    }
    shim("forward", &stream, &[&q, &k, &v], &mut [&mut o, &mut lse], |i, o, st, err| {
        // SAFETY: see `shim`; q, k, v, o and lse in the order of the shim's parameters.
        unsafe { ffi::longctx_sdpa_fwd(&desc, i[0], i[1], i[2], o[0], o[1] as *mut f32, st, err.ptr(), err.len()) }
    })?;
    Ok((raw::tensor(o, (b, s, hq, d)), raw::tensor(lse, (b, hq, s))))
}

/// The native Hopper forward into `o`, `lse` (allocated by the caller), or why not.
#[cfg(longctx_native)]
fn native_fwd(
    desc: &ffi::Desc,
    stream: &Arc<CudaStream>,
    ins: [&Tensor; 3],
    outs: [&mut CudaStorage; 2],
) -> std::result::Result<(), Refusal> {
    let [o, lse] = outs;
    shim("forward (native)", stream, &ins, &mut [o, lse], |i, o, st, err| {
        // SAFETY: see `shim`; q, k, v, o and lse in the order of the kernel's parameters.
        unsafe { ffi::longctx_native_fwd(desc, i[0], i[1], i[2], o[0], o[1] as *mut f32, st, err.ptr(), err.len()) }
    })
}

#[cfg(not(longctx_native))]
fn native_fwd(_: &ffi::Desc, _: &Arc<CudaStream>, _: [&Tensor; 3], _: [&mut CudaStorage; 2]) -> std::result::Result<(), Refusal> {
    Err(no_native())
}

/// The native Hopper backward into `dq`, `dk`, `dv` (allocated by the caller), or why not.
#[cfg(longctx_native)]
fn native_bwd(
    desc: &ffi::Desc,
    stream: &Arc<CudaStream>,
    ins: [&Tensor; 6],
    outs: [&mut CudaStorage; 3],
) -> std::result::Result<(), Refusal> {
    let [dq, dk, dv] = outs;
    shim("backward (native)", stream, &ins, &mut [dq, dk, dv], |i, o, st, err| {
        let lse = i[5] as *const f32;
        // SAFETY: see `shim`; q, k, v, o, do, lse, dq, dk, dv in the order of the kernel's parameters.
        unsafe { ffi::longctx_native_bwd(desc, i[0], i[1], i[2], i[3], i[4], lse, o[0], o[1], o[2], st, err.ptr(), err.len()) }
    })
}

#[cfg(not(longctx_native))]
fn native_bwd(_: &ffi::Desc, _: &Arc<CudaStream>, _: [&Tensor; 6], _: [&mut CudaStorage; 3]) -> std::result::Result<(), Refusal> {
    Err(no_native())
}

#[cfg(not(longctx_native))]
fn no_native() -> Refusal {
    Refusal::Unsupported(
        "this build has no native kernel (it is compiled for CUDA_COMPUTE_CAP=90 with the CUTLASS headers; run scripts/build_cuda.sh)"
            .into(),
    )
}

fn try_bwd(d_o: &Tensor, saved: Saved<'_>, mask: Mask, scale: f64) -> std::result::Result<(Tensor, Tensor, Tensor), Refusal> {
    let (desc, dev) = describe(saved.q, saved.k, saved.v, mask, scale)?;
    saved.check(d_o, mask)?;
    let dt = saved.q.dtype();
    let (q, k, v) = (saved.q.contiguous()?, saved.k.contiguous()?, saved.v.contiguous()?);
    let (o, d_o) = (saved.o.to_dtype(dt)?.contiguous()?, d_o.to_dtype(dt)?.contiguous()?);
    let lse = saved.lse.to_dtype(DType::F32)?.contiguous()?;
    let stream = raw::bind(&dev)?;
    let (b, s, t, hq, hkv, d) = (desc.b as usize, desc.s as usize, desc.t as usize, desc.hq as usize, desc.hkv as usize, desc.d as usize);
    let [mut dq, mut dk, mut dv] = outputs(&stream, &dev, [dt; 3], [b * s * hq * d, b * t * hkv * d, b * t * hkv * d])?;
    let grads = |dq, dk, dv| (raw::tensor(dq, (b, s, hq, d)), raw::tensor(dk, (b, t, hkv, d)), raw::tensor(dv, (b, t, hkv, d)));
    if native_first(crate::kernel::Pass::Bwd, &desc) {
        match native_bwd(&desc, &stream, [&q, &k, &v, &o, &d_o, &lse], [&mut dq, &mut dk, &mut dv]) {
            Ok(()) => {
                NATIVE_RUNS[crate::kernel::Pass::Bwd as usize].fetch_add(1, Ordering::Relaxed);
                return Ok(grads(dq, dk, dv));
            }
            Err(Refusal::Unsupported(why)) => native_refused(crate::kernel::Pass::Bwd, &why),
            Err(e) => return Err(e),
        }
    }
    shim("backward", &stream, &[&q, &k, &v, &o, &d_o, &lse], &mut [&mut dq, &mut dk, &mut dv], |i, o, st, err| {
        let lse = i[5] as *const f32;
        // SAFETY: see `shim`; q, k, v, o, do, lse, dq, dk, dv in the order of the shim's parameters.
        unsafe { ffi::longctx_sdpa_bwd(&desc, i[0], i[1], i[2], i[3], i[4], lse, o[0], o[1], o[2], st, err.ptr(), err.len()) }
    })?;
    Ok(grads(dq, dk, dv))
}

/// One call of the shim on `stream`: `call(ins, outs, stream, err)` gets the device
/// addresses of `ins` (read) and `outs` (written) and returns the shim's code.
/// For its unsafe block: every address is a live device buffer on `stream`'s device, of
/// the size the call's `Desc` implies (shapes checked by `describe`, inputs contiguous,
/// outputs allocated for those shapes), borrowed by [`raw::with_ptrs`] until the call has
/// queued its work on `stream`.
fn shim(
    what: &str,
    stream: &CudaStream,
    ins: &[&Tensor],
    outs: &mut [&mut CudaStorage],
    call: impl FnOnce(&[*const c_void], &[*mut c_void], *mut c_void, &mut ErrBuf) -> i32,
) -> std::result::Result<(), Refusal> {
    let mut err = ErrBuf::new();
    let rc = raw::with_ptrs(stream, ins, outs, |i, o| {
        let i: Vec<*const c_void> = i.iter().map(|&p| p as *const c_void).collect();
        let o: Vec<*mut c_void> = o.iter().map(|&p| p as *mut c_void).collect();
        call(&i, &o, stream.cu_stream() as *mut c_void, &mut err)
    })?;
    check(rc, &err, what)
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
        ffi::FAILED => Err(Refusal::Failed(candle_core::Error::Msg(format!("CUDA attention {what} failed: {}", err.text())))),
        code => Err(Refusal::Failed(candle_core::Error::Msg(format!("CUDA attention {what}: unknown shim return code {code}")))),
    }
}
