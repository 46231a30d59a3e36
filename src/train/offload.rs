//! Where the engine keeps each layer's input (and, with selective recomputation, its
//! attention's q, k, v, o and LSE) between the forward and the backward.
//!
//! Protocol, used by [`crate::train::engine::Engine::step`]:
//! forward: [`ActivationStore::push`] each layer's group (`x_l [b, s, h]` first) in layer order, then
//! [`ActivationStore::end_forward`] and [`ActivationStore::prefetch`] the top layer (its
//! copy runs under the head and loss); backward, top layer first: [`ActivationStore::take`]
//! `l`, then [`ActivationStore::prefetch`] `l - 1` before running layer `l`'s backward.
//!
//! What goes to host memory is the store's [`Offload`]: nothing, each group's first tensor
//! (the layer input), or the whole group.
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

/// One saved tensor.
enum Item {
    /// Kept where it was computed (no offload, or a CPU copy).
    Kept(Tensor),
    /// In host memory.
    Parked(Parked),
    /// On its way back to the device.
    Coming(Fetched),
}

/// What of each layer's saved group an [`ActivationStore`] keeps in host memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Offload {
    /// Nothing: every saved tensor stays where it was computed.
    #[default]
    Off,
    /// The layer's input (a group's first tensor) only; the attention's and MLP's saved
    /// tensors stay on the device (`parallel.offload_layer_inputs`).
    Inputs,
    /// The whole group (`parallel.offload_activations`).
    All,
}

impl Offload {
    /// From the two settings (`all` wins).
    pub fn of(all: bool, inputs: bool) -> Self {
        match (all, inputs) {
            (true, _) => Self::All,
            (false, true) => Self::Inputs,
            (false, false) => Self::Off,
        }
    }

    /// The layer inputs go to host memory.
    pub fn inputs(self) -> bool {
        self != Self::Off
    }

    /// The attention's and MLP's saved tensors go there too.
    pub fn all(self) -> bool {
        self == Self::All
    }

    /// Tensor `i` of a group goes to host memory.
    fn parks(self, i: usize) -> bool {
        match self {
            Self::Off => false,
            Self::Inputs => i == 0,
            Self::All => true,
        }
    }

    /// Tensors of a group of `n` that go to host memory.
    fn parked_of(self, n: usize) -> usize {
        (0..n).filter(|&i| self.parks(i)).count()
    }
}

/// The engine's saved tensors, one group per layer (its input, and with selective
/// recomputation its attention's q, k, v, o and LSE); keeps its stash (and pinned
/// buffers) across steps.
pub struct ActivationStore {
    offload: Offload,
    slots: Vec<Vec<Item>>,
    saved_bytes: usize,
    host_bytes: usize,
    stash: Stash,
    /// Bytes parked of the first group in the last step (a change frees the old-size
    /// buffers).
    group_bytes: usize,
    /// Tensors parked of the largest group pushed this step.
    group_len: usize,
}

use crate::train::engine::bytes;

impl ActivationStore {
    pub fn new(offload: Offload) -> Self {
        Self { offload, slots: Vec::new(), saved_bytes: 0, host_bytes: 0, stash: Stash::new(), group_bytes: 0, group_len: 0 }
    }

    /// Start a new step: forget the previous step's slots (buffers are kept).
    pub fn begin(&mut self) -> Result<()> {
        self.slots.clear();
        self.stash.settle()?;
        self.saved_bytes = 0;
        self.host_bytes = 0;
        Ok(())
    }

    /// Bytes saved this step, and of those the part in host memory.
    pub fn bytes(&self) -> (usize, usize) {
        (self.saved_bytes, self.host_bytes)
    }

    /// Number of groups saved this step.
    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Save the next layer's group of tensors (at least its input).
    pub fn push(&mut self, group: &[&Tensor]) -> Result<()> {
        self.saved_bytes += group.iter().map(|t| bytes(t)).sum::<usize>();
        let parked: usize = group.iter().enumerate().filter(|&(i, _)| self.offload.parks(i)).map(|(_, t)| bytes(t)).sum();
        let n_parked = self.offload.parked_of(group.len());
        if n_parked > 0 {
            self.host_bytes += parked;
            if self.slots.is_empty() && parked != self.group_bytes {
                self.stash.trim(); // a new length (stage): buffers of the old size go
                self.group_bytes = parked;
            }
            // Copies in flight before the compute stream waits: two layers' worth, of the
            // largest group so far (the top layers may keep more: `save_mlp_layers`).
            if self.slots.is_empty() || n_parked > self.group_len {
                self.group_len = n_parked;
                self.stash.set_max_pending(2 * n_parked);
            }
        }
        let mut items = Vec::with_capacity(group.len());
        for (i, t) in group.iter().enumerate() {
            items.push(match (self.offload.parks(i), t.device()) {
                (false, _) => Item::Kept((*t).clone()),
                (true, Device::Cpu) => Item::Kept(t.copy()?),
                (true, _) => Item::Parked(self.stash.park(t).map_err(offload_err)?),
            });
        }
        self.slots.push(items);
        Ok(())
    }

    /// The forward is over: nothing more will be pushed this step.
    pub fn end_forward(&mut self) -> Result<()> {
        self.stash.settle().map_err(offload_err)
    }

    /// Start bringing group `idx` back to `dev` (no-op for what is not parked).
    pub fn prefetch(&mut self, idx: usize, dev: &Device) -> Result<()> {
        let Some(items) = self.slots.get_mut(idx) else { return Ok(()) };
        for item in items.iter_mut() {
            if let Item::Parked(p) = item {
                let f = self.stash.fetch(p, dev).map_err(offload_err)?;
                *item = Item::Coming(f);
            }
        }
        Ok(())
    }

    /// Group `idx` on `dev`, ready for the compute stream (fetched now if not prefetched).
    pub fn take(&mut self, idx: usize, dev: &Device) -> Result<Vec<Tensor>> {
        self.prefetch(idx, dev)?;
        let items = self
            .slots
            .get_mut(idx)
            .map(std::mem::take)
            .ok_or_else(|| Error::Setting(format!("activation store: no saved layer group {idx}")))?;
        if items.is_empty() {
            return Err(Error::Setting(format!("activation store: layer group {idx} taken twice")));
        }
        items
            .into_iter()
            .map(|item| match item {
                Item::Kept(t) => Ok(t),
                Item::Coming(f) => f.ready().map_err(offload_err),
                Item::Parked(_) => Err(Error::Setting(format!("activation store: layer group {idx} was not brought back"))),
            })
            .collect()
    }

    /// Bytes of pinned host memory held (CUDA offload), 0 otherwise.
    pub fn pinned_bytes(&self) -> usize {
        self.stash.pinned_bytes()
    }
}

fn offload_err(e: candle_core::Error) -> Error {
    Error::Setting(format!("activation offload: {e}; or turn `offload_activations` / `offload_layer_inputs` off"))
}
