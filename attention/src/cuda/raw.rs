//! Raw CUDA helpers, in one place for the crate's CUDA code (the cuDNN kernel in
//! [`crate::cuda`], the NCCL communicator, the pinned-memory [`crate::stash`]):
//!
//! - [`bind`]: the device's context bound to this thread, its (Candle's compute) stream;
//! - [`alloc`]: an uninitialised device buffer of a [`DType`], in a stream's order;
//!   [`tensor`]: a buffer as a Candle tensor;
//! - [`bytes`] / [`bytes_mut`]: the bytes of a contiguous tensor (start offset applied) or
//!   of a whole buffer, as cudarc views (for copies);
//! - [`with_ptrs`]: device addresses of tensors and buffers for a foreign call (cuDNN,
//!   NCCL), with cudarc's per-buffer read/write events waited for and recorded;
//! - [`Mark`]: work on one stream that another stream waits for (an event, no host wait);
//! - [`Pool`]: the 64-bit attributes of the device's default memory pool.
//!
//! Supported dtypes: those Candle stores natively on CUDA (u8, u32, i16, i32, i64, bf16,
//! f16, f32, f64); the others are an error.

use candle_core::backend::BackendStorage;
use candle_core::cuda::cudarc::driver::{sys, CudaEvent, CudaStream, CudaView, CudaViewMut, SyncOnDrop};
use candle_core::cuda::WrapErr;
use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Layout, Result, Shape, Storage, Tensor};
use std::ffi::c_void;
use std::sync::Arc;

/// Evaluates `$body` with the type `$T` bound to the element type of `$dt` (one arm per
/// dtype of [the module doc](self)).
macro_rules! with_elem {
    ($dt:expr, $T:ident => $body:expr) => {
        with_elem!(@arms $dt, $T, $body; U8 u8, U32 u32, I16 i16, I32 i32, I64 i64, BF16 half::bf16, F16 half::f16, F32 f32, F64 f64)
    };
    (@arms $dt:expr, $T:ident, $body:expr; $($variant:ident $elem:ty),*) => {
        match $dt {
            $(DType::$variant => {
                type $T = $elem;
                $body
            })*
            other => crate::config_err!("CUDA: dtype {other:?} is not supported here"),
        }
    };
}

/// Binds the device's context to this thread; returns the device's (Candle's) stream.
pub fn bind(dev: &CudaDevice) -> Result<Arc<CudaStream>> {
    let stream = dev.cuda_stream();
    stream.context().bind_to_thread().w()?;
    Ok(stream)
}

/// An uninitialised buffer of `n` elements of `dt` on `dev`, allocated in `stream`'s order
/// (the stream-ordered pool may reuse memory freed by work queued on `stream` before).
///
/// # Safety
/// Every element must be written (by work queued on `stream`, or ordered after it) before
/// anything reads it.
pub unsafe fn alloc(stream: &Arc<CudaStream>, dev: &CudaDevice, dt: DType, n: usize) -> Result<CudaStorage> {
    with_elem!(dt, T => {
        // SAFETY: the caller writes the buffer before any read (this function's contract).
        let slice = unsafe { stream.alloc::<T>(n) }.w()?;
        Ok(CudaStorage::wrap_cuda_slice(slice, dev.clone()))
    })
}

/// A tensor over `storage`, outside any graph.
pub fn tensor(storage: CudaStorage, shape: impl Into<Shape>) -> Tensor {
    Tensor::from_storage(Storage::Cuda(storage), shape, BackpropOp::none(), false)
}

/// The CUDA storage of a tensor's storage, or an error.
pub fn cuda(st: &Storage) -> Result<&CudaStorage> {
    match st {
        Storage::Cuda(c) => Ok(c),
        _ => crate::config_err!("expected a CUDA tensor"),
    }
}

/// The bytes of the elements a contiguous layout `l` addresses in `c` (its start offset
/// applied).
pub fn bytes<'a>(c: &'a CudaStorage, l: &Layout) -> Result<CudaView<'a, u8>> {
    if !l.is_contiguous() {
        return crate::config_err!("CUDA: a tensor handed over by address must be contiguous, got strides {:?}", l.stride());
    }
    let (start, len) = (l.start_offset(), l.shape().elem_count());
    let n = len * c.dtype().size_in_bytes();
    with_elem!(c.dtype(), T => {
        let Some(view) = c.as_cuda_slice::<T>()?.try_slice(start..start + len) else {
            return crate::config_err!("CUDA: layout {l:?} reaches past its buffer");
        };
        // SAFETY: any bytes are valid `u8`s; `n` bytes are exactly the `len` elements viewed.
        unsafe { view.transmute::<u8>(n) }.ok_or_else(|| candle_core::Error::Msg("CUDA: byte view out of range".into()))
    })
}

/// All bytes of the buffer `c`, for writing.
pub fn bytes_mut(c: &mut CudaStorage) -> Result<CudaViewMut<'_, u8>> {
    let dt = c.dtype();
    with_elem!(dt, T => {
        let slice = c.as_cuda_slice_mut::<T>()?;
        let n = slice.len() * dt.size_in_bytes();
        // SAFETY: any bytes are valid `u8`s and any bit pattern is a valid element of these
        // dtypes; `n` bytes are exactly the buffer.
        unsafe { slice.transmute_mut::<u8>(n) }.ok_or_else(|| candle_core::Error::Msg("CUDA: byte view out of range".into()))
    })
}

/// Runs `f` with the device addresses of `ins` (contiguous CUDA tensors, read; start offsets
/// applied) and of `outs` (whole buffers, written), for work that `f` queues on `stream`.
/// Before `f`, `stream` waits for the writes cudarc recorded on these buffers (and on
/// `outs`, their reads); after `f`, their use on `stream` is recorded, so that a buffer
/// freed meanwhile is not handed out while the work still runs. (Candle records no write
/// event for its own kernels' outputs: work on another stream must also wait for Candle's.)
pub fn with_ptrs<R>(stream: &CudaStream, ins: &[&Tensor], outs: &mut [&mut CudaStorage], f: impl FnOnce(&[u64], &[u64]) -> R) -> Result<R> {
    let held: Vec<_> = ins.iter().map(|t| t.storage_and_layout()).collect();
    let mut guards: Vec<SyncOnDrop<'_>> = Vec::with_capacity(ins.len() + outs.len());
    let mut src = Vec::with_capacity(ins.len());
    for (st, l) in &held {
        let (ptr, guard) = bytes(cuda(st)?, l)?.view_ptr(stream);
        src.push(ptr);
        guards.push(guard);
    }
    let mut dst = Vec::with_capacity(outs.len());
    for o in outs.iter_mut() {
        let (ptr, guard) = bytes_mut(o)?.view_ptr_mut(stream);
        dst.push(ptr);
        guards.push(guard);
    }
    let r = f(&src, &dst);
    drop(guards); // records the uses on `stream`, after `f` queued the work
    Ok(r)
}

/// The work queued so far on one stream, for another stream (`waiter`) to wait for: an
/// event, so the host never blocks.
pub struct Mark {
    event: CudaEvent,
    waiter: Arc<CudaStream>,
}

impl Mark {
    /// Records the work queued on `on` so far, for `waiter`.
    pub fn record(on: &CudaStream, waiter: Arc<CudaStream>) -> Result<Self> {
        Ok(Self { event: on.record_event(None).w()?, waiter })
    }

    /// Whether the recorded work has finished (a query, no wait).
    pub fn is_complete(&self) -> bool {
        self.event.is_complete()
    }

    /// Makes the waiter's later work wait for the recorded work.
    pub fn wait(self) -> Result<()> {
        self.waiter.wait(&self.event).w()
    }
}

/// The default memory pool of a device: the one stream-ordered allocations (so Candle's
/// tensors) come from.
pub struct Pool(sys::CUmemoryPool);

/// A memory-pool attribute.
pub type PoolAttr = sys::CUmemPool_attribute;

impl Pool {
    /// The default pool of `dev` (binds its context to this thread).
    pub fn of(dev: &CudaDevice) -> Result<Self> {
        let stream = bind(dev)?;
        let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
        // SAFETY: a plain driver query on the bound context's device, with a valid out-pointer.
        unsafe { sys::cuDeviceGetDefaultMemPool(&mut pool, stream.context().cu_device()) }.result().w()?;
        Ok(Pool(pool))
    }

    /// A 64-bit attribute (the release threshold, the reserved and used byte counters).
    pub fn get(&self, attr: PoolAttr) -> Result<u64> {
        let mut value: u64 = 0;
        // SAFETY: a live pool handle; the attributes this is used for are 64-bit values.
        unsafe { sys::cuMemPoolGetAttribute(self.0, attr, &mut value as *mut u64 as *mut c_void) }.result().w()?;
        Ok(value)
    }

    /// Sets a 64-bit attribute (see [`Pool::get`]).
    pub fn set(&self, attr: PoolAttr, mut value: u64) -> Result<()> {
        // SAFETY: as in `get`; the driver only reads `value`.
        unsafe { sys::cuMemPoolSetAttribute(self.0, attr, &mut value as *mut u64 as *mut c_void) }.result().w()
    }
}
