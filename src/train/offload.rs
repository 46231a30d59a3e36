//! Where the engine keeps each layer's input between the forward and the backward.
//!
//! Protocol, used by [`crate::train::engine::Engine::step`]:
//! forward: [`ActivationStore::push`] each layer input `x_l [b, s, h]` in layer order, then
//! [`ActivationStore::end_forward`]; backward, top layer first: [`ActivationStore::take`]
//! `l`, then [`ActivationStore::prefetch`] `l - 1` before running layer `l`'s backward.
//!
//! Without offload the device tensors are kept as they are. With offload:
//! - **CUDA**: each input is copied into a page-locked (pinned) host buffer on a separate
//!   copy stream. The copy waits, through an event, only for the kernels that produced the
//!   input, so it runs while the next layer computes. The device tensor is released one
//!   layer later, after the compute stream has been told (an event wait, not a host sync)
//!   not to reuse its memory before the copy has finished. In the backward the input of the
//!   layer below is copied back on the copy stream while the current layer's backward runs;
//!   the compute stream waits for that copy only when the tensor is taken. Pinned buffers
//!   are kept and reused by the next step (page-locking is slow), one per layer.
//! - **CPU device**: inputs are deep-copied (they live in host memory already); this runs the
//!   same bookkeeping so that tests exercise it.
//! - **Other devices**: a synchronous copy to host memory and back.

use crate::{Error, Result};
use candle_core::{Device, Tensor};

/// One saved layer input.
enum Slot {
    /// Kept where it was computed (no offload, or a CPU copy).
    Kept(Tensor),
    /// A host copy of a tensor of another device (synchronous path).
    Host(Tensor),
    /// In this store's pinned buffer of the same index (CUDA).
    #[cfg(feature = "cuda")]
    Pinned { shape: candle_core::Shape, dtype: candle_core::DType },
    /// Being copied back to the device (CUDA): the tensor is valid once `done` has passed.
    #[cfg(feature = "cuda")]
    Incoming { t: Tensor, done: cudarc_event::Event },
    /// Handed back by `take`.
    Taken,
}

/// The engine's saved layer inputs; keeps its pinned buffers from one step to the next.
pub struct ActivationStore {
    offload: bool,
    slots: Vec<Slot>,
    saved_bytes: usize,
    host_bytes: usize,
    #[cfg(feature = "cuda")]
    gpu: Option<gpu::Offloader>,
}

fn bytes(t: &Tensor) -> usize {
    t.elem_count() * t.dtype().size_in_bytes()
}

impl ActivationStore {
    pub fn new(offload: bool) -> Self {
        Self {
            offload,
            slots: Vec::new(),
            saved_bytes: 0,
            host_bytes: 0,
            #[cfg(feature = "cuda")]
            gpu: None,
        }
    }

    /// Start a new step: forget the previous step's slots (buffers are kept).
    pub fn begin(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            g.release_pending()?;
            g.sync()?; // slots left by a failed step may still be written by a copy
        }
        self.slots.clear();
        self.saved_bytes = 0;
        self.host_bytes = 0;
        Ok(())
    }

    /// Bytes of the inputs saved this step, and of those the part in host memory.
    pub fn bytes(&self) -> (usize, usize) {
        (self.saved_bytes, self.host_bytes)
    }

    /// Number of slots saved this step.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Save the input of the next layer.
    pub fn push(&mut self, x: &Tensor) -> Result<()> {
        let n = bytes(x);
        self.saved_bytes += n;
        let slot = if !self.offload {
            Slot::Kept(x.clone())
        } else {
            self.host_bytes += n;
            match x.device() {
                Device::Cpu => Slot::Kept(x.copy()?),
                #[cfg(feature = "cuda")]
                Device::Cuda(dev) => {
                    let idx = self.slots.len();
                    if self.gpu.is_none() {
                        self.gpu = Some(gpu::Offloader::new(dev)?);
                    }
                    let g = self.gpu.as_mut().ok_or_else(|| Error::Setting("activation offload: no CUDA offloader".into()))?;
                    g.store(idx, x)?;
                    Slot::Pinned { shape: x.shape().clone(), dtype: x.dtype() }
                }
                _ => Slot::Host(x.to_device(&Device::Cpu)?),
            }
        };
        self.slots.push(slot);
        Ok(())
    }

    /// The forward is over: nothing more will be pushed this step.
    pub fn end_forward(&mut self) -> Result<()> {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            g.release_pending()?;
        }
        Ok(())
    }

    /// Start bringing slot `idx` back to `dev` (no-op unless it sits in pinned memory).
    pub fn prefetch(&mut self, idx: usize, dev: &Device) -> Result<()> {
        let _ = (idx, dev); // used only by the CUDA path
        #[cfg(feature = "cuda")]
        if let (Some(Slot::Pinned { shape, dtype }), Device::Cuda(cdev)) = (self.slots.get(idx), dev) {
            let (shape, dtype) = (shape.clone(), *dtype);
            let g = self.gpu.as_mut().ok_or_else(|| Error::Setting("activation offload: no CUDA offloader".into()))?;
            let (t, done) = g.load(idx, &shape, dtype, cdev)?;
            self.slots[idx] = Slot::Incoming { t, done };
        }
        Ok(())
    }

    /// Slot `idx` on `dev`, ready for the compute stream (prefetching first if needed).
    pub fn take(&mut self, idx: usize, dev: &Device) -> Result<Tensor> {
        self.prefetch(idx, dev)?;
        let slot = self
            .slots
            .get_mut(idx)
            .map(|s| std::mem::replace(s, Slot::Taken))
            .ok_or_else(|| Error::Setting(format!("activation store: no saved layer input {idx}")))?;
        match slot {
            Slot::Kept(t) => Ok(t),
            Slot::Host(t) => Ok(t.to_device(dev)?),
            #[cfg(feature = "cuda")]
            Slot::Incoming { t, done } => {
                let g = self.gpu.as_ref().ok_or_else(|| Error::Setting("activation offload: no CUDA offloader".into()))?;
                g.ready(&done)?;
                Ok(t)
            }
            #[cfg(feature = "cuda")]
            Slot::Pinned { .. } => Err(Error::Setting(format!("activation store: layer input {idx} was not brought back"))),
            Slot::Taken => Err(Error::Setting(format!("activation store: layer input {idx} taken twice"))),
        }
    }

    /// Bytes of pinned host memory held (CUDA offload), 0 otherwise.
    pub fn pinned_bytes(&self) -> usize {
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_ref() {
            return g.pinned_bytes();
        }
        0
    }
}

impl Drop for ActivationStore {
    fn drop(&mut self) {
        // Slots being copied back must outlive their copies.
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_ref() {
            let _ = g.sync();
        }
        self.slots.clear();
    }
}

#[cfg(feature = "cuda")]
mod cudarc_event {
    pub use candle_core::cuda::cudarc::driver::CudaEvent as Event;
}

#[cfg(feature = "cuda")]
mod gpu {
    use super::cudarc_event::Event;
    use crate::{Error, Result};
    use candle_core::cuda::cudarc::driver::{result, sys, CudaSlice, CudaStream, PinnedHostSlice};
    use candle_core::cuda::{CudaDType, WrapErr};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Shape, Storage, Tensor};
    use std::sync::Arc;

    /// Copy stream, pinned buffers and the one device tensor whose copy may still run.
    pub struct Offloader {
        compute: Arc<CudaStream>,
        /// A non-blocking stream created here (not through `CudaContext::new_stream`, which
        /// would switch cudarc to per-allocation event tracking for every Candle kernel).
        copy: Arc<CudaStream>,
        raw_copy: RawStream,
        buffers: Vec<Option<PinnedHostSlice<u8>>>,
        /// The last stored device tensor and the event its copy completes.
        pending: Option<(Tensor, Event)>,
    }

    /// The copy stream's handle, destroyed by `Offloader::drop`.
    struct RawStream(sys::CUstream);
    // SAFETY: a CUDA stream handle may be used from any thread of its context.
    unsafe impl Send for RawStream {}
    unsafe impl Sync for RawStream {}

    fn err(e: impl std::fmt::Display) -> Error {
        Error::Setting(format!("activation offload (CUDA): {e}"))
    }

    impl Offloader {
        pub fn new(dev: &CudaDevice) -> Result<Self> {
            let compute = dev.cuda_stream();
            let ctx = compute.context().clone();
            ctx.bind_to_thread().map_err(err)?;
            let raw = result::stream::create(result::stream::StreamKind::NonBlocking).map_err(err)?;
            // SAFETY: `raw` is a stream of this context; `Offloader` keeps it alive (it is
            // destroyed in `Drop`, after the copy stream has been synchronised and after
            // every use of `copy`, which never leaves this struct).
            let copy = unsafe { ctx.wrap_borrowed_stream(raw) };
            Ok(Self { compute, copy, raw_copy: RawStream(raw), buffers: Vec::new(), pending: None })
        }

        pub fn pinned_bytes(&self) -> usize {
            self.buffers.iter().flatten().map(|b| b.len()).sum()
        }

        /// Let the compute stream reuse the memory of the last stored tensor once its copy
        /// is done (an event wait enqueued on the compute stream; the host does not block).
        pub fn release_pending(&mut self) -> Result<()> {
            if let Some((t, done)) = self.pending.take() {
                self.compute.wait(&done).map_err(err)?;
                drop(t);
            }
            Ok(())
        }

        /// Copy `x` into pinned buffer `idx` on the copy stream.
        pub fn store(&mut self, idx: usize, x: &Tensor) -> Result<()> {
            self.release_pending()?;
            let x = x.contiguous()?;
            let n = x.elem_count() * x.dtype().size_in_bytes();
            if self.buffers.len() <= idx {
                self.buffers.resize_with(idx + 1, || None);
            }
            if self.buffers[idx].as_ref().map(|b| b.len()) != Some(n) {
                self.buffers[idx] = None; // free first: pinned memory is precious
                // SAFETY: the buffer is written entirely by the copy below before any read.
                // Flags 0: plain page-locked memory (not write-combined: it is read back by DMA).
                let b = unsafe { self.compute.context().alloc_pinned_with_flags::<u8>(n, 0) }.map_err(|e| {
                    err(format!("cannot page-lock {} MiB of host memory for layer input {idx} ({e}); lower the sequence length or turn off `offload_activations`", n >> 20))
                })?;
                self.buffers[idx] = Some(b);
            }
            let dst = self.buffers[idx].as_mut().ok_or_else(|| err("missing buffer"))?;
            let ready = self.compute.record_event(None).map_err(err)?;
            self.copy.wait(&ready).map_err(err)?;
            {
                let (st, l) = x.storage_and_layout();
                let Storage::Cuda(c) = &*st else { return Err(err("layer input is not a CUDA tensor")) };
                let (start, len) = (l.start_offset(), l.shape().elem_count());
                macro_rules! d2h {
                    ($t:ty) => {{
                        let view = c.as_cuda_slice::<$t>()?.slice(start..start + len);
                        // SAFETY: reinterpreting `len` elements as their `n` bytes.
                        let bytes = unsafe { view.transmute::<u8>(n) }.ok_or_else(|| err("byte view out of range"))?;
                        self.copy.memcpy_dtoh(&bytes, dst).map_err(err)?;
                    }};
                }
                match x.dtype() {
                    DType::BF16 => d2h!(half::bf16),
                    DType::F16 => d2h!(half::f16),
                    DType::F32 => d2h!(f32),
                    other => return Err(err(format!("cannot offload {other:?} activations (bf16, f16 or f32)"))),
                }
            }
            let done = self.copy.record_event(None).map_err(err)?;
            self.pending = Some((x, done));
            Ok(())
        }

        /// Copy pinned buffer `idx` back into a new device tensor; valid after `done`.
        pub fn load(&mut self, idx: usize, shape: &Shape, dtype: DType, dev: &CudaDevice) -> Result<(Tensor, Event)> {
            let src = self.buffers.get(idx).and_then(|b| b.as_ref()).ok_or_else(|| err(format!("no pinned buffer {idx}")))?;
            let n = shape.elem_count() * dtype.size_in_bytes();
            fn fill<T: CudaDType + candle_core::cuda::cudarc::driver::DeviceRepr>(
                o: &Offloader,
                src: &PinnedHostSlice<u8>,
                len: usize,
                n: usize,
                dev: &CudaDevice,
                shape: &Shape,
            ) -> Result<(Tensor, Event)> {
                // SAFETY: allocated in compute-stream order and written entirely by the copy
                // below, which the compute stream waits for before any kernel reads it.
                let mut dst: CudaSlice<T> = unsafe { o.compute.alloc::<T>(len) }.w()?;
                let ready = o.compute.record_event(None).map_err(err)?;
                o.copy.wait(&ready).map_err(err)?;
                {
                    // SAFETY: the `len` elements as their `n` bytes.
                    let mut bytes = unsafe { dst.transmute_mut::<u8>(n) }.ok_or_else(|| err("byte view out of range"))?;
                    o.copy.memcpy_htod(src, &mut bytes).map_err(err)?;
                }
                let done = o.copy.record_event(None).map_err(err)?;
                let t = Tensor::from_storage(Storage::Cuda(CudaStorage::wrap_cuda_slice(dst, dev.clone())), shape.clone(), BackpropOp::none(), false);
                Ok((t, done))
            }
            if src.len() != n {
                return Err(err(format!("pinned buffer {idx} holds {} bytes, expected {n}", src.len())));
            }
            let len = shape.elem_count();
            match dtype {
                DType::BF16 => fill::<half::bf16>(self, src, len, n, dev, shape),
                DType::F16 => fill::<half::f16>(self, src, len, n, dev, shape),
                DType::F32 => fill::<f32>(self, src, len, n, dev, shape),
                other => Err(err(format!("cannot restore {other:?} activations"))),
            }
        }

        /// Block until every copy has finished (before freeing what they touch).
        pub fn sync(&self) -> Result<()> {
            self.copy.synchronize().map_err(err)
        }

        /// Make the compute stream wait for a copy started by `load`.
        pub fn ready(&self, done: &Event) -> Result<()> {
            self.compute.wait(done).map_err(err)
        }
    }

    impl Drop for Offloader {
        fn drop(&mut self) {
            // Nothing may be freed while a copy still reads or writes it.
            let _ = self.copy.synchronize();
            let _ = self.compute.synchronize();
            self.pending = None;
            self.buffers.clear();
            let _ = self.compute.context().bind_to_thread();
            // SAFETY: the stream was created in `new`, is idle, and `copy` (which only
            // borrows it) is not used after this point.
            let _ = unsafe { result::stream::destroy(self.raw_copy.0) };
        }
    }
}
