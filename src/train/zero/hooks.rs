//! The engine's hooks under ZeRO-2/3: a unit's weights from the [`ParamStore`], its
//! gradients into [`ShardedGrads`], and the previous step's deferred host update applied
//! unit by unit just ahead of the forward.

use super::grads::GradBuffer;
use super::stage12::{Deferred, ShardedAdamW};
use super::stage3::{ParamStore, ShardedGrads};
use super::units::ParamHooks;
use crate::{Error, Result};
use candle_core::Tensor;
use std::cell::RefCell;

/// Apply the deferred update `d` to every unit up to `upto` (see
/// [`ShardedAdamW::advance`]): the new weights into the host shard of
/// `store`, each unit's gradient slice in `grads` zeroed once it has been read.
pub fn apply_deferred(optim: &mut ShardedAdamW, d: &mut Deferred, upto: usize, store: &ParamStore, grads: &ShardedGrads) -> Result<()> {
    if d.is_done(grads.units()) {
        return Ok(());
    }
    store.with_host_mut(|h| optim.advance(d, upto, &grads.source(), (h, store.resident_prefix()), |v| grads.zero_unit(v)))
}

/// The engine's hooks for stage 2 (`store` None: the model's own weights) and stage 3.
pub struct Zero3Hooks<'a> {
    pub store: Option<&'a ParamStore>,
    pub grads: &'a ShardedGrads,
    /// The previous step's host update, still to apply (weights and optimizer state in
    /// host memory): unit `u` is applied when the forward first asks for it
    /// ([`ParamHooks::prepare`]), and its gradient slice zeroed then.
    pub update: Option<RefCell<(&'a mut ShardedAdamW, &'a mut Deferred)>>,
}

impl Zero3Hooks<'_> {
    /// Apply the pending update to every unit up to `u`.
    pub fn apply_upto(&self, u: usize) -> Result<()> {
        let (Some(cell), Some(store)) = (&self.update, self.store) else { return Ok(()) };
        let mut lent = cell.try_borrow_mut().map_err(|_| Error::Setting("ZeRO-3: the deferred update is already running".into()))?;
        let (optim, d) = &mut *lent;
        apply_deferred(optim, d, u, store, self.grads)
    }

    /// Unit `u` holds this step's weights (no update of it still pending).
    fn applied(&self, u: usize) -> bool {
        self.update.as_ref().is_none_or(|c| c.try_borrow().is_ok_and(|lent| lent.1.applied(u)))
    }
}

impl ParamHooks for Zero3Hooks<'_> {
    fn prepare(&self, u: usize) -> Result<()> {
        // One unit further than asked: the next unit is then ready to be copied ahead.
        self.apply_upto(u.saturating_add(1))
    }
    fn weights(&self, u: usize) -> Result<Option<Vec<Tensor>>> {
        let Some(store) = self.store else { return Ok(None) };
        let next = store.next_after(u);
        let w = store.fetch(u)?;
        if let Some(v) = next.filter(|&v| self.applied(v)) {
            store.prefetch(v)?; // copied while unit `u` computes
        }
        Ok(Some(w))
    }
    fn grad_slots(&self) -> &[Tensor] {
        &self.grads.slots
    }
    fn grads_done(&self, u: usize) -> Result<()> {
        // The backward adds into the shard: every unit's update must have read it first.
        self.apply_upto(usize::MAX)?;
        self.grads.done(u)
    }
}

/// The hooks of one step, as [`super::ZeroState::hooks`] hands them out: the model's own
/// weights and the flat gradient buffer (stages 0–1), or [`Zero3Hooks`] (stages 2–3).
pub enum Hooks<'a> {
    Full(&'a GradBuffer),
    Sharded(Zero3Hooks<'a>),
}

impl Hooks<'_> {
    fn get(&self) -> &dyn ParamHooks {
        match self {
            Self::Full(b) => *b,
            Self::Sharded(h) => h,
        }
    }
}

impl ParamHooks for Hooks<'_> {
    fn prepare(&self, u: usize) -> Result<()> {
        self.get().prepare(u)
    }
    fn weights(&self, u: usize) -> Result<Option<Vec<Tensor>>> {
        self.get().weights(u)
    }
    fn grad_slots(&self) -> &[Tensor] {
        self.get().grad_slots()
    }
    fn grads_done(&self, u: usize) -> Result<()> {
        self.get().grads_done(u)
    }
}
