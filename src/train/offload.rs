//! Where the engine keeps each layer's input between the forward and the backward.
//!
//! Protocol, used by [`crate::train::engine::Engine::step`]:
//! forward: [`ActivationStore::push`] each layer input `x_l [b, s, h]` in layer order, then
//! [`ActivationStore::end_forward`] and [`ActivationStore::prefetch`] the top layer (its
//! copy runs under the head and loss); backward, top layer first: [`ActivationStore::take`]
//! `l`, then [`ActivationStore::prefetch`] `l - 1` before running layer `l`'s backward.
//!
//! Without offload the device tensors are kept as they are. With offload they are parked
//! in host memory through a [`Stash`] (on CUDA: page-locked buffers, copies on their own
//! stream ordered by events, so a layer input's copy runs while the next layer computes
//! and the input of the layer below comes back while the current layer's backward runs;
//! see `longctx_attention::stash`). The stash and its buffer pool live as long as the
//! store, so later steps reuse the pinned buffers. On the CPU device inputs are
//! deep-copied instead (they are in host memory already); this runs the same bookkeeping
//! so that tests exercise it.

use crate::{Error, Result};
use candle_core::{Device, Tensor};
use longctx_attention::stash::{Fetched, Parked, Stash};

/// One saved layer input.
enum Slot {
    /// Kept where it was computed (no offload, or a CPU copy).
    Kept(Tensor),
    /// In host memory.
    Parked(Parked),
    /// On its way back to the device.
    Coming(Fetched),
    /// Handed back by `take`.
    Taken,
}

/// The engine's saved layer inputs; keeps its stash (and pinned buffers) across steps.
pub struct ActivationStore {
    offload: bool,
    slots: Vec<Slot>,
    saved_bytes: usize,
    host_bytes: usize,
    stash: Stash,
    /// Bytes of one layer input in the last step (a change frees the old-size buffers).
    input_bytes: usize,
}

use crate::train::engine::bytes;

impl ActivationStore {
    pub fn new(offload: bool) -> Self {
        Self { offload, slots: Vec::new(), saved_bytes: 0, host_bytes: 0, stash: Stash::new(), input_bytes: 0 }
    }

    /// Start a new step: forget the previous step's slots (buffers are kept).
    pub fn begin(&mut self) -> Result<()> {
        self.slots.clear();
        self.stash.settle()?;
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
            if self.slots.is_empty() && n != self.input_bytes {
                self.stash.trim(); // a new length (stage): buffers of the old size go
                self.input_bytes = n;
            }
            match x.device() {
                Device::Cpu => Slot::Kept(x.copy()?),
                _ => Slot::Parked(self.stash.park(x).map_err(offload_err)?),
            }
        };
        self.slots.push(slot);
        Ok(())
    }

    /// The forward is over: nothing more will be pushed this step.
    pub fn end_forward(&mut self) -> Result<()> {
        self.stash.settle().map_err(offload_err)
    }

    /// Start bringing slot `idx` back to `dev` (no-op unless it is parked).
    pub fn prefetch(&mut self, idx: usize, dev: &Device) -> Result<()> {
        if let Some(Slot::Parked(p)) = self.slots.get(idx) {
            let f = self.stash.fetch(p, dev).map_err(offload_err)?;
            self.slots[idx] = Slot::Coming(f);
        }
        Ok(())
    }

    /// Slot `idx` on `dev`, ready for the compute stream (fetched now if not prefetched).
    pub fn take(&mut self, idx: usize, dev: &Device) -> Result<Tensor> {
        self.prefetch(idx, dev)?;
        let slot = self
            .slots
            .get_mut(idx)
            .map(|s| std::mem::replace(s, Slot::Taken))
            .ok_or_else(|| Error::Setting(format!("activation store: no saved layer input {idx}")))?;
        match slot {
            Slot::Kept(t) => Ok(t),
            Slot::Coming(f) => f.ready().map_err(offload_err),
            Slot::Parked(_) => Err(Error::Setting(format!("activation store: layer input {idx} was not brought back"))),
            Slot::Taken => Err(Error::Setting(format!("activation store: layer input {idx} taken twice"))),
        }
    }

    /// Bytes of pinned host memory held (CUDA offload), 0 otherwise.
    pub fn pinned_bytes(&self) -> usize {
        self.stash.pinned_bytes()
    }
}

fn offload_err(e: candle_core::Error) -> Error {
    Error::Setting(format!("activation offload: {e}; or turn `offload_activations` off"))
}
