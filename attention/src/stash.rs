//! Parking device tensors in host memory and bringing them back, with the copies off the
//! compute stream where the device allows it.
//!
//! - [`Stash::park`] starts a copy of a device tensor to host memory and returns a
//!   [`Parked`] handle; [`Stash::fetch`] starts the copy back and returns a [`Fetched`]
//!   whose [`Fetched::ready`] gives the device tensor once the compute stream may use it.
//!   Fetch early, call `ready` late: the copy then runs under the work queued in between.
//! - **CUDA**: copies run on a copy stream of the stash, into and out of page-locked
//!   (pinned) host buffers kept in a pool by size (page-locking is slow; the same sizes
//!   recur every layer and step). Ordering is by events; the host waits only to read a
//!   parked tensor in place ([`Parked::with_host_f32`], on that copy's own event). A park
//!   waits for the kernels that produced the tensor; the stash holds the parked device
//!   tensor until its copy has finished (checked at later parks), and beyond the newest few
//!   parks ([`Stash::set_max_pending`], two by default) tells the compute stream to wait
//!   for the copy before the memory may be reused,
//!   so copies overlap the computation queued after them; a fetched tensor is allocated in
//!   compute-stream order and the compute stream waits for its copy at `ready`.
//! - **Other devices**: a synchronous `to_device` each way (a no-op clone on the CPU).
//!
//! A stash belongs to one thread (it uses that thread's view of the device's stream).

use candle_core::{Device, Result, Tensor};

/// A tensor parked in host memory (or, off CUDA, a host tensor).
pub struct Parked {
    inner: ParkedInner,
}

enum ParkedInner {
    Host(Tensor),
    #[cfg(feature = "cuda")]
    Pinned(gpu::PinnedTensor),
}

impl Parked {
    /// The parked f32 elements in host memory, once the copy there is done (waits for it):
    /// read in place, without another copy.
    pub fn with_host_f32<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
        match &self.inner {
            ParkedInner::Host(t) => {
                let t = t.contiguous()?;
                let (st, layout) = t.storage_and_layout();
                match &*st {
                    candle_core::Storage::Cpu(candle_core::CpuStorage::F32(v)) => {
                        Ok(f(&v[layout.start_offset()..layout.start_offset() + t.elem_count()]))
                    }
                    _ => Err(candle_core::Error::Msg("stash: with_host_f32 on a tensor that is not f32".into())),
                }
            }
            #[cfg(feature = "cuda")]
            ParkedInner::Pinned(pt) => pt.with_f32(f),
        }
    }
}

/// Host memory page-locked in place for the lifetime of this guard (CUDA's
/// `cuMemHostRegister`), so that copies from and to it run at full DMA speed without a
/// staging buffer. Dropped (unregistered) before the memory is freed.
pub struct HostPin {
    #[cfg(feature = "cuda")]
    ptr: usize,
}

impl HostPin {
    /// Page-lock `len` bytes at `ptr` for `dev`'s copies; `None` off CUDA.
    ///
    /// # Safety
    /// `ptr..ptr + len` must stay allocated, and not move, until the guard is dropped.
    pub unsafe fn register(dev: &Device, ptr: *mut u8, len: usize) -> Result<Option<Self>> {
        if len == 0 {
            return Ok(None);
        }
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(d) => {
                crate::cuda::raw::bind(d)?;
                // SAFETY: the caller keeps the range allocated and in place (this function's contract).
                let r = unsafe { candle_core::cuda::cudarc::driver::sys::cuMemHostRegister_v2(ptr.cast(), len, 0) };
                if r != candle_core::cuda::cudarc::driver::sys::CUresult::CUDA_SUCCESS {
                    return Err(candle_core::Error::Msg(format!("cannot page-lock {} MiB of host memory: {r:?}", len >> 20)));
                }
                Ok(Some(Self { ptr: ptr as usize }))
            }
            _ => {
                let _ = (ptr, len);
                Ok(None)
            }
        }
    }
}

impl Drop for HostPin {
    fn drop(&mut self) {
        #[cfg(feature = "cuda")]
        // SAFETY: registered in `register`, still allocated (its contract).
        unsafe {
            let _ = candle_core::cuda::cudarc::driver::sys::cuMemHostUnregister(self.ptr as *mut std::ffi::c_void);
        }
    }
}

/// A tensor on its way back to the device.
pub struct Fetched {
    t: Option<Tensor>,
    /// The copy the compute stream must wait for before using `t`.
    #[cfg(feature = "cuda")]
    wait: Option<crate::cuda::raw::Mark>,
}

impl Fetched {
    /// The tensor, usable by work queued on the compute stream from now on.
    pub fn ready(mut self) -> Result<Tensor> {
        #[cfg(feature = "cuda")]
        if let Some(copied) = self.wait.take() {
            copied.wait()?;
        }
        self.t.take().ok_or_else(|| candle_core::Error::Msg("stash: fetched tensor taken twice".into()))
    }
}

impl Drop for Fetched {
    fn drop(&mut self) {
        // Dropped without `ready`: its memory must not be reused before the copy is done.
        #[cfg(feature = "cuda")]
        if let Some(copied) = self.wait.take() {
            let _ = copied.wait();
        }
    }
}

/// Host parking for one thread's device (see the module doc).
pub struct Stash {
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::PinnedStash>,
    max_pending: usize,
}

impl Default for Stash {
    fn default() -> Self {
        Self {
            #[cfg(feature = "cuda")]
            gpu: None,
            max_pending: 2,
        }
    }
}

impl Stash {
    pub fn new() -> Self {
        Self::default()
    }

    /// The CUDA state, made on first use.
    #[cfg(feature = "cuda")]
    fn gpu_for(&mut self, dev: &candle_core::CudaDevice) -> Result<&mut gpu::PinnedStash> {
        if self.gpu.is_none() {
            let mut g = gpu::PinnedStash::new(dev)?;
            g.max_pending = self.max_pending;
            self.gpu = Some(g);
        }
        self.gpu.as_mut().ok_or_else(|| candle_core::Error::Msg("stash: no CUDA state".into()))
    }

    /// Start copying `t` to host memory.
    pub fn park(&mut self, t: &Tensor) -> Result<Parked> {
        match t.device() {
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => Ok(Parked { inner: ParkedInner::Pinned(self.gpu_for(dev)?.park(t)?) }),
            _ => Ok(Parked { inner: ParkedInner::Host(t.to_device(&Device::Cpu)?) }),
        }
    }

    /// Start copying `p` back to `dev`.
    pub fn fetch(&mut self, p: &Parked, dev: &Device) -> Result<Fetched> {
        match &p.inner {
            ParkedInner::Host(t) => Ok(Fetched {
                t: Some(t.to_device(dev)?),
                #[cfg(feature = "cuda")]
                wait: None,
            }),
            #[cfg(feature = "cuda")]
            ParkedInner::Pinned(pt) => {
                let Device::Cuda(cdev) = dev else {
                    return Err(candle_core::Error::Msg("stash: a tensor parked from CUDA can only come back to CUDA".into()));
                };
                let g = self.gpu.as_mut().ok_or_else(|| candle_core::Error::Msg("stash: no CUDA state".into()))?;
                let (t, copied) = g.fetch(pt, cdev)?;
                Ok(Fetched { t: Some(t), wait: Some(copied) })
            }
        }
    }

    /// Start copying host elements `src` to `dev` as a tensor `[src.len()]`: on CUDA on the
    /// copy stream (asynchronous when `src` is page-locked, e.g. by a [`HostPin`]), so it
    /// runs under the compute queued before [`Fetched::ready`]; elsewhere a plain copy.
    ///
    /// # Safety
    /// `src` must stay allocated and unchanged until the copy has run: until the host has
    /// waited for work the compute stream queued after `ready` (or after dropping the
    /// `Fetched`).
    pub unsafe fn upload<T: candle_core::WithDType>(&mut self, src: &[T], dev: &Device) -> Result<Fetched> {
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(cdev) => {
                let g = self.gpu_for(cdev)?;
                // SAFETY: plain bytes of `src` (any `WithDType` is plain old data); the
                // caller keeps them unchanged until the copy has run.
                let bytes = unsafe { std::slice::from_raw_parts(src.as_ptr().cast::<u8>(), std::mem::size_of_val(src)) };
                let (t, copied) = g.to_device(bytes, T::DTYPE, candle_core::Shape::from(src.len()), cdev)?;
                Ok(Fetched { t: Some(t), wait: Some(copied) })
            }
            _ => Ok(Fetched {
                t: Some(Tensor::from_slice(src, src.len(), dev)?),
                #[cfg(feature = "cuda")]
                wait: None,
            }),
        }
    }

    /// Copy `t` (`[dst.len()]` elements of `T`, on `dev`) into host memory `dst` and wait
    /// for it: on CUDA one DMA copy on the copy stream after the compute queued so far (at
    /// full speed when `dst` is page-locked, e.g. by a [`HostPin`]); elsewhere a plain copy.
    pub fn download<T: candle_core::WithDType>(&mut self, t: &Tensor, dst: &mut [T], dev: &Device) -> Result<()> {
        if t.elem_count() != dst.len() || t.dtype() != T::DTYPE {
            return Err(candle_core::Error::Msg(format!(
                "stash: download of a {:?} tensor of {} elements into {} host elements of {:?}",
                t.dtype(),
                t.elem_count(),
                dst.len(),
                T::DTYPE
            )));
        }
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(cdev) => {
                // SAFETY: plain bytes of `dst` (any `WithDType` is plain old data), written
                // by the copy, which is waited for before this returns.
                let bytes = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(dst)) };
                self.gpu_for(cdev)?.download(t, bytes)
            }
            _ => {
                dst.copy_from_slice(&t.flatten_all()?.to_vec1::<T>()?);
                Ok(())
            }
        }
    }

    /// Page-lock host buffers of these byte sizes into the pool ahead of the parks that
    /// will take them (CUDA; elsewhere nothing to do). Page-locking runs at a few GB/s: a
    /// caller that knows its sizes (the host optimizer's gradient pieces) pays for it at
    /// start-up instead of inside its first step.
    pub fn reserve(&mut self, dev: &Device, sizes: &[usize]) -> Result<()> {
        match dev {
            #[cfg(feature = "cuda")]
            Device::Cuda(cdev) => self.gpu_for(cdev)?.reserve(sizes),
            _ => {
                let _ = sizes;
                Ok(())
            }
        }
    }

    /// Hand every parked tensor's device memory back (the compute stream waits for the
    /// copies first); call when no more parks follow for a while.
    pub fn settle(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            g.settle()?;
        }
        Ok(())
    }

    /// Free the pooled pinned buffers not in use (call when the tensor sizes change, e.g.
    /// a new training stage, so buffers of the old sizes are not held on).
    pub fn trim(&mut self) {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            g.trim();
        }
    }

    /// How many parks may still be copying before the compute stream waits for the
    /// oldest (2 by default; raise it when a step parks several tensors at once). 0: each
    /// park first makes the compute stream wait for every earlier park's copy, so a caller
    /// that parks from two buffers in turn may reuse the other one after its next park.
    pub fn set_max_pending(&mut self, n: usize) {
        self.max_pending = n;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            g.max_pending = self.max_pending;
        }
    }

    /// Pinned host bytes held (in use or pooled).
    pub fn pinned_bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_ref() {
            return g.pinned_bytes();
        }
        0
    }
}

#[cfg(feature = "cuda")]
mod gpu {
    use crate::cuda::raw::{self, Mark};
    use candle_core::cuda::cudarc::driver::{result, sys, CudaEvent, CudaStream, HostSlice, PinnedHostSlice};
    use candle_core::cuda::WrapErr;
    use candle_core::{CudaDevice, DType, Error, Result, Shape, Tensor};
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Mutex};

    fn err(e: impl std::fmt::Display) -> Error {
        Error::Msg(format!("host offload (CUDA): {e}"))
    }

    /// Free pinned buffers by byte size, and the bytes allocated in all.
    #[derive(Default)]
    struct Pool {
        free: Mutex<HashMap<usize, Vec<PinnedHostSlice<u8>>>>,
        allocated: AtomicUsize,
    }

    /// A pinned buffer that returns to its pool when dropped. Reuse is safe without a
    /// host wait: every copy into or out of a pool buffer runs on the one copy stream.
    struct PooledBuf {
        buf: Option<PinnedHostSlice<u8>>,
        pool: Arc<Pool>,
    }

    impl Drop for PooledBuf {
        fn drop(&mut self) {
            if let Some(b) = self.buf.take() {
                let mut free = self.pool.free.lock().unwrap_or_else(|p| p.into_inner());
                free.entry(b.len()).or_default().push(b);
            }
        }
    }

    pub struct PinnedTensor {
        buf: PooledBuf,
        shape: Shape,
        dtype: DType,
        /// The end of the copy into `buf`, for a host thread to wait on. (cudarc's own
        /// event in a `PinnedHostSlice` is recorded only when the context tracks events
        /// across streams, which ours does not: `as_slice` would not wait.)
        copied: CudaEvent,
    }

    impl PinnedTensor {
        /// Its f32 elements once the copy into the buffer is done (the host waits for it).
        pub fn with_f32<R>(&self, f: impl FnOnce(&[f32]) -> R) -> Result<R> {
            if self.dtype != DType::F32 {
                return Err(err("with_f32 on a tensor that is not f32"));
            }
            self.copied.synchronize().w()?;
            let bytes = self.buf.buf.as_ref().ok_or_else(|| err("empty buffer"))?.as_slice().w()?;
            // SAFETY: page-locked buffers are page-aligned and hold `elem_count` f32 values
            // written by the copy just waited for.
            let (pre, xs, _) = unsafe { bytes.align_to::<f32>() };
            if !pre.is_empty() {
                return Err(err("pinned buffer not aligned for f32"));
            }
            Ok(f(&xs[..self.shape.elem_count()]))
        }
    }

    /// The copy stream's handle, destroyed with the stash.
    struct RawStream(sys::CUstream);
    // SAFETY: a CUDA stream handle may be used from any thread of its context.
    unsafe impl Send for RawStream {}
    unsafe impl Sync for RawStream {}

    pub struct PinnedStash {
        compute: Arc<CudaStream>,
        /// Created here rather than by `CudaContext::new_stream`, which would switch cudarc
        /// to recording events on every buffer use of every Candle kernel.
        copy: Arc<CudaStream>,
        raw: RawStream,
        pool: Arc<Pool>,
        /// Device tensors whose copy to the host may still run, with its end.
        pending: Vec<(Tensor, Mark)>,
        /// Copies allowed in flight before the compute stream waits for the oldest.
        pub(super) max_pending: usize,
    }

    impl PinnedStash {
        pub fn new(dev: &CudaDevice) -> Result<Self> {
            let compute = raw::bind(dev)?;
            let ctx = compute.context().clone();
            let handle = result::stream::create(result::stream::StreamKind::NonBlocking).w()?;
            // SAFETY: `handle` is a stream of this context, kept alive until `Drop` destroys it
            // after synchronising; `copy` only borrows it and never leaves this struct.
            let copy = unsafe { ctx.wrap_borrowed_stream(handle) };
            Ok(Self { compute, copy, raw: RawStream(handle), pool: Arc::default(), pending: Vec::new(), max_pending: 2 })
        }

        pub fn pinned_bytes(&self) -> usize {
            self.pool.allocated.load(Ordering::Relaxed)
        }

        pub fn settle(&mut self) -> Result<()> {
            for (t, done) in self.pending.drain(..) {
                done.wait()?;
                drop(t);
            }
            Ok(())
        }

        pub fn trim(&mut self) {
            // A pooled buffer's last copy may still run (its own event is not recorded:
            // see `PinnedTensor::copied`), so the copy stream finishes before any is freed.
            let _ = self.copy.synchronize();
            let freed: Vec<PinnedHostSlice<u8>> =
                self.pool.free.lock().unwrap_or_else(|p| p.into_inner()).drain().flat_map(|(_, v)| v).collect();
            self.pool.allocated.fetch_sub(freed.iter().map(|b| b.len()).sum(), Ordering::Relaxed);
        }

        /// A new page-locked buffer of `n` bytes, counted in the pool's total.
        fn alloc(&self, n: usize) -> Result<PinnedHostSlice<u8>> {
            // SAFETY: every user writes a pooled buffer entirely (by a copy) before reading it.
            // Flags 0: plain page-locked memory (read back by DMA, not write-combined).
            let b = unsafe { self.compute.context().alloc_pinned_with_flags::<u8>(n, 0) }.map_err(|e| {
                err(format!(
                    "cannot page-lock {} MiB of host memory ({e}; {} MiB already held); shorten the sequence or turn the offload off",
                    n >> 20,
                    self.pinned_bytes() >> 20
                ))
            })?;
            self.pool.allocated.fetch_add(n, Ordering::Relaxed);
            Ok(b)
        }

        fn take_buf(&self, n: usize) -> Result<PooledBuf> {
            let reuse = self.pool.free.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&n).and_then(|v| v.pop());
            let buf = match reuse {
                Some(b) => b,
                None => self.alloc(n)?,
            };
            Ok(PooledBuf { buf: Some(buf), pool: self.pool.clone() })
        }

        /// Buffers of `sizes` bytes put in the pool (free), for parks to come.
        pub fn reserve(&self, sizes: &[usize]) -> Result<()> {
            for &n in sizes.iter().filter(|&&n| n > 0) {
                let b = self.alloc(n)?;
                self.pool.free.lock().unwrap_or_else(|p| p.into_inner()).entry(n).or_default().push(b);
            }
            Ok(())
        }

        pub fn park(&mut self, t: &Tensor) -> Result<PinnedTensor> {
            // Release device memory of finished copies; beyond the newest two, make the
            // compute stream wait for the oldest (bounded device memory, some overlap kept).
            self.pending.retain(|(_, done)| !done.is_complete());
            while self.pending.len() > self.max_pending {
                let (t, done) = self.pending.remove(0);
                done.wait()?;
                drop(t);
            }
            let t = t.contiguous()?;
            let n = t.elem_count() * t.dtype().size_in_bytes();
            let mut pooled = self.take_buf(n)?;
            let dst = pooled.buf.as_mut().ok_or_else(|| err("empty buffer"))?;
            self.copy.join(&self.compute).w()?;
            {
                let (st, l) = t.storage_and_layout();
                self.copy.memcpy_dtoh(&raw::bytes(raw::cuda(&st)?, l)?, dst).w()?;
            }
            let done = Mark::record(&self.copy, self.compute.clone())?;
            let copied = self.copy.record_event(None).w()?;
            let (shape, dtype) = (t.shape().clone(), t.dtype());
            self.pending.push((t, done));
            Ok(PinnedTensor { buf: pooled, shape, dtype, copied })
        }

        /// `t` (contiguous or not, made so) into `dst`, its bytes, after the compute queued so
        /// far; waited for.
        pub fn download(&mut self, t: &Tensor, dst: &mut [u8]) -> Result<()> {
            let t = t.contiguous()?;
            self.copy.join(&self.compute).w()?;
            {
                let (st, l) = t.storage_and_layout();
                self.copy.memcpy_dtoh(&raw::bytes(raw::cuda(&st)?, l)?, dst).w()?;
            }
            self.copy.synchronize().w()?;
            Ok(())
        }

        /// Starts the copy of `p` back to `dev`: the tensor, and the copy the compute stream
        /// must wait for before using it.
        pub fn fetch(&mut self, p: &PinnedTensor, dev: &CudaDevice) -> Result<(Tensor, Mark)> {
            if !Arc::ptr_eq(&p.buf.pool, &self.pool) {
                return Err(err("a tensor parked by another stash (its copies are ordered on another stream)"));
            }
            let src = p.buf.buf.as_ref().ok_or_else(|| err("empty buffer"))?;
            self.to_device(src, p.dtype, p.shape.clone(), dev)
        }

        /// A new tensor on `dev` filled from the host bytes `src` by the copy stream, after
        /// the compute queued so far (its memory is allocated in compute-stream order), and
        /// the copy the compute stream must wait for before using it.
        pub(super) fn to_device<S: HostSlice<u8> + ?Sized>(
            &self,
            src: &S,
            dt: DType,
            shape: Shape,
            dev: &CudaDevice,
        ) -> Result<(Tensor, Mark)> {
            // SAFETY: allocated in compute-stream order and written entirely by the copy
            // below, which the compute stream waits for (`Fetched::ready`) before use.
            let mut dst = unsafe { raw::alloc(&self.compute, dev, dt, shape.elem_count()) }?;
            self.copy.join(&self.compute).w()?;
            self.copy.memcpy_htod(src, &mut raw::bytes_mut(&mut dst)?).w()?;
            let done = Mark::record(&self.copy, self.compute.clone())?;
            Ok((raw::tensor(dst, shape), done))
        }
    }

    impl Drop for PinnedStash {
        fn drop(&mut self) {
            // Nothing may be freed while a copy still reads or writes it.
            let _ = self.copy.synchronize();
            self.pending.clear();
            let _ = self.compute.context().bind_to_thread();
            // SAFETY: created in `new`, idle after the synchronisation, and `copy` (which
            // only borrows it) is not used after this point.
            let _ = unsafe { result::stream::destroy(self.raw.0) };
        }
    }
}
