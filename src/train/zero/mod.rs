//! ZeRO in one owner: [`ZeroState`] holds what a rank keeps of the model's training state
//! (DeepSpeed's stages 0–3, `offload_param`, the optimizer state on the host) and is the
//! only thing the trainer asks about it: the engine's layer hooks for a step, the
//! optimizer update (deferred under ZeRO-3 with everything on the host), the whole
//! weights for an export, a checkpoint or an evaluation, its shards of a checkpoint, the
//! numeric guards.
//!
//! The settle rule: a deferred host update is applied unit by unit during the next
//! forward, and must be finished ("settled", its guard included) before anything reads
//! the weights or the optimizer state. Every method of [`ZeroState`] that reads them
//! settles first, so no caller has to remember it.
//!
//! Files, from the bottom up: `units.rs` (how the parameters are cut into units and
//! slices, the engine's [`ParamHooks`]), `grads.rs` (the flat gradient buffer of stages
//! 0–1), `weights.rs` (where an update writes its new weights), `stage12.rs` (the sharded
//! optimizer step), `stage3.rs` (the weight store and sharded gradients of stages 2–3),
//! `hooks.rs` (the engine's hooks over them), this file (the owner). The rest of the
//! crate uses what this file exports; a new stage or offload variant changes only this
//! folder (and the config fields that select it).

pub mod grads;
mod hooks;
pub mod stage12;
pub mod stage3;
pub mod units;
pub mod weights;

pub use grads::GradBuffer;
pub use hooks::{apply_deferred, Hooks, Zero3Hooks};
pub use stage12::{all_reduce_scalar, peak_pieces, ranks_flagging, Deferred, ShardedAdamW, StepStats, DEFER_LOOKAHEAD, HOST_PIECE};
pub use stage3::{GradSource, ParamStore, ShardedGrads};
pub use units::{layer_groups, layer_unit, ParamHooks, Partition};
pub use weights::{HostWeights, HostWeightsMut, Out};

use crate::train::checkpoint::{self, Loaded};
use crate::train::optim::AdamWConfig;
use crate::train::profile::{Phase, Profiler};
use crate::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor, Var};
use longctx_attention::comm::Comm;
use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

/// How ZeRO runs (`[train]`): the stage, where the weights and the optimizer state live,
/// the optimizer and its clipping.
#[derive(Clone, Debug)]
pub struct ZeroConfig {
    /// 0: every rank the whole state; 1: the optimizer state sharded; 2: the gradients
    /// too; 3: the weights too.
    pub stage: u8,
    /// Stage 3: this rank's slice of the weights in host memory.
    pub offload_params: bool,
    /// The optimizer state in host memory (always on a CPU device).
    pub optimizer_on_host: bool,
    /// With `optimizer_on_host`: the first units whose state stays on the device (0: none).
    pub optimizer_device_units: usize,
    /// Stage 3 with the weights and the optimizer state in host memory: each unit's
    /// gradient slice goes there too once the backward is done with it (the device units'
    /// stay on the device).
    pub offload_gradients: bool,
    pub adamw: AdamWConfig,
    /// Clip the gradient's global norm to this (`<= 0`: no clipping).
    pub clip_grad: f64,
}

impl ZeroConfig {
    /// No rank holds the whole weights (stage 3): the engine is built from their shapes
    /// and gets each unit's weights through the hooks.
    pub fn shards_weights(&self) -> bool {
        self.stage == 3
    }
}

/// What the owner's guards need from the run: the profiler its optimizer work is timed
/// on, and where the last good checkpoint is (an abort's message says it).
pub struct Guard<'a> {
    pub prof: &'a Profiler,
    pub kept: String,
}

/// What a [`ZeroState`] starts from.
pub struct Start<'a> {
    /// The engine's parameters, `(name, shape)` in the model's order.
    pub meta: &'a [(String, Shape)],
    /// The engine's own weights (stages 0–2; none under stage 3).
    pub params: &'a [(String, Var)],
    /// f32 host copies of the start weights: the optimizer's masters on a fresh run
    /// (shared by in-process ranks; this rank's hold is let go once its optimizer is built).
    pub masters: Arc<HashMap<String, Tensor>>,
    /// Stage 3: the weights this rank keeps its slices of (the checkpoint's on a resume).
    pub sliced: Option<HashMap<String, Tensor>>,
    /// The checkpoint a resumed run continues from (its optimizer state).
    pub resume: Option<&'a Loaded>,
}

/// One optimizer update, as the trainer asks for it.
pub struct Update {
    pub lr: f64,
    /// Skip it (the loss is not finite, the same on every rank).
    pub skip: bool,
    /// "stage s step k/n (global step g)", for the guard's message of a deferred update.
    pub at: String,
    /// Fault injection: a deferred update writes a NaN weight.
    pub poison: bool,
}

/// Bytes one rank holds of the model's training state, and where (ZeRO and offload
/// shrink them: stage 1 the optimizer state, 2 the gradients, 3 the weights).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Resident {
    /// The 16-bit (run dtype) weights: the whole model, or this rank's slice (stage 3).
    pub weights: usize,
    /// Of them kept in host memory by `offload_params` (whatever the device).
    pub weights_host: usize,
    /// The f32 gradient buffers (the whole padded model below stage 2; this rank's slice
    /// and one unit's scratch from stage 2).
    pub grads: usize,
    /// Of them in host memory (`offload_gradients`: the slices of the units whose
    /// optimizer state is there).
    pub grads_host: usize,
    /// The f32 master weights and AdamW moments of this rank.
    pub optimizer: usize,
    /// Of them in host memory (`optimizer_on_host`, and always on a CPU device).
    pub optimizer_host: usize,
}

impl std::fmt::Display for Resident {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let size = |b: usize| if b >= 1_000_000_000 { format!("{:.3} GB", b as f64 / 1e9) } else { format!("{:.3} MB", b as f64 / 1e6) };
        write!(
            f,
            "weights {} ({} on the host), gradients {} ({} on the host), optimizer {} ({} on the host)",
            size(self.weights),
            size(self.weights_host),
            size(self.grads),
            size(self.grads_host),
            size(self.optimizer),
            size(self.optimizer_host)
        )
    }
}

/// Where the engine's gradients go.
enum Grads {
    /// The whole model's, `[Σ W·L_u]` f32 (stages 0 and 1).
    Full(GradBuffer),
    /// This rank's slices, reduce-scattered unit by unit during the backward (stage ≥ 2).
    Sharded(ShardedGrads),
}

/// Where the weights are.
enum Weights {
    /// The model's own (stages 0–2): the engine's parameters, the same storage.
    Model(Vec<(String, Var)>),
    /// This rank's slices (stage 3; the engine has none), and every parameter's name in
    /// the model's order.
    Sharded { store: Box<ParamStore>, names: Vec<String> },
}

/// A host update begun at the end of a step, and what its guard's message needs.
struct PendingUpdate {
    d: Deferred,
    /// "stage s step k/n (global step g)".
    at: String,
    grad_norm: f64,
    lr: f64,
}

/// This rank's part of ZeRO: the optimizer slice, the gradients, the weights (the
/// model's or this rank's slices) and the deferred update still to settle.
pub struct ZeroState {
    cfg: ZeroConfig,
    world: Arc<dyn Comm>,
    device: Device,
    dtype: DType,
    optim: ShardedAdamW,
    grads: Grads,
    weights: Weights,
    /// Elements of every parameter.
    n_params: usize,
    /// ZeRO-3 with weights and optimizer state in host memory: the last step's update,
    /// applied unit by unit during the next forward ([`ParamHooks::prepare`]) and settled
    /// (its numeric guard included) before anything reads the weights or the state.
    pending: Option<PendingUpdate>,
}

impl ZeroState {
    /// ZeRO over every rank of `world`. On a GPU (unless `optimizer_on_host`) the state
    /// lives and updates on the device. Masters start from the f32 host copy of the start
    /// weights (not from weights already rounded to the run dtype), or from the
    /// checkpoint's optimizer state when resuming.
    pub fn new(cfg: ZeroConfig, start: Start<'_>, world: Arc<dyn Comm>, (device, dtype): (&Device, DType)) -> Result<Self> {
        let (rank, wsize) = (world.rank(), world.world());
        let names: Vec<&str> = start.meta.iter().map(|(n, _)| n.as_str()).collect();
        let sizes: Vec<usize> = start.meta.iter().map(|(_, s)| s.elem_count()).collect();
        let part = match cfg.stage {
            0 => Partition::whole(&sizes, (0, 1))?, // every rank the whole state
            1 => Partition::whole(&sizes, (rank, wsize))?,
            _ => Partition::per_layer(&names, &sizes, (rank, wsize))?,
        };
        // The whole state on the GPU, or (a split placement) its first units' there. On a CPU
        // device the split runs the same way, both parts in host memory.
        let units = part.units.len();
        let on_device = if !device.is_cpu() && !cfg.optimizer_on_host {
            Some((device, stage12::ALL_UNITS))
        } else if cfg.optimizer_device_units > 0 {
            if cfg.optimizer_device_units > units {
                return Err(Error::Setting(format!(
                    "train.optimizer_device_units = {} (--optimizer-device-units), but this model has {units} ZeRO unit(s) under \
                     stage {} (the embedding, one per decoder layer, the norm with the head; stages 0-1: one); give at most {units}",
                    cfg.optimizer_device_units, cfg.stage
                )));
            }
            Some((device, cfg.optimizer_device_units))
        } else {
            None
        };
        // A split state keeps those units' weights beside it on the device too (with the
        // weights on the host: updated in place, never copied there and back).
        let resident = match on_device {
            Some((_, n)) if n < units && cfg.optimizer_on_host => n,
            _ => 0,
        };
        let weights = match &start.sliced {
            Some(w) => Weights::Sharded {
                store: Box::new(ParamStore::new(
                    part.clone(),
                    start.meta,
                    w,
                    dtype,
                    (device, cfg.offload_params, resident),
                    world.clone(),
                )?),
                names: names.iter().map(|n| n.to_string()).collect(),
            },
            None => Weights::Model(start.params.to_vec()),
        };
        drop(start.sliced);
        let resume = start.resume.map(|l| (l.state.adam_step, l));
        let optim = ShardedAdamW::new(cfg.adamw.clone(), start.meta, &start.masters, part.clone(), on_device, resume)?;
        drop(start.masters);
        let grads = if cfg.stage >= 2 {
            let shapes: Vec<Shape> = start.meta.iter().map(|(_, s)| s.clone()).collect();
            // Gradients in host memory from the first unit whose optimizer state is there.
            let host_from = cfg.offload_gradients.then(|| optim.device_units());
            Grads::Sharded(ShardedGrads::new(part, &shapes, device, world.clone(), host_from)?)
        } else {
            Grads::Full(GradBuffer::new(start.params, optim.padded_len(), device)?)
        };
        if cfg.offload_gradients && !(cfg.stage >= 2 && cfg.optimizer_on_host) {
            return Err(Error::Setting(
                "train.offload_gradients needs ZeRO stage 2 or 3 (gradients reduced unit by unit) and `optimizer_on_host` (the \
                 update that reads them in host memory); set them, or turn the gradient offload off"
                    .into(),
            ));
        }
        let n_params = sizes.iter().sum();
        let mut me = Self { cfg, world, device: device.clone(), dtype, optim, grads, weights, n_params, pending: None };
        // The host update's pinned gradient buffers, page-locked now rather than in step 2.
        let defers = me.defers();
        if !me.cfg.offload_gradients {
            me.optim.reserve_pinned(device, defers)?; // (with the gradients on the host it parks no pieces)
        }
        Ok(me)
    }

    /// What this rank holds.
    pub fn resident(&self) -> Resident {
        let (opt_dev, opt_host) = self.optim.resident_bytes();
        let (weights, weights_host) = match &self.weights {
            Weights::Model(_) => (self.n_params * self.dtype.size_in_bytes(), 0),
            Weights::Sharded { store, .. } => (store.bytes() + store.resident_bytes(), if store.on_host() { store.bytes() } else { 0 }),
        };
        let (grads, grads_host) = match &self.grads {
            Grads::Full(b) => (b.bytes(), 0),
            Grads::Sharded(g) => (g.bytes() + g.host_bytes(), g.host_bytes()),
        };
        Resident { weights, weights_host, grads, grads_host, optimizer: opt_dev + opt_host, optimizer_host: opt_host }
    }

    /// The engine's hooks for one step (every micro-batch of it), the step's gradients
    /// zeroed first: the model's weights and the flat buffer (stages 0–1), or each unit's
    /// weights and gradient slots, the pending update applied as the forward reaches it.
    pub fn hooks(&mut self) -> Result<Hooks<'_>> {
        match &self.grads {
            Grads::Full(b) => {
                b.zero()?;
                Ok(Hooks::Full(b))
            }
            Grads::Sharded(g) => {
                if self.pending.is_none() {
                    g.zero()?; // else each unit's slice is zeroed once the pending update read it
                }
                let update = self.pending.as_mut().map(|p| std::cell::RefCell::new((&mut self.optim, &mut p.d)));
                let store = match &self.weights {
                    Weights::Sharded { store, .. } => Some(&**store),
                    Weights::Model(_) => None,
                };
                Ok(Hooks::Sharded(Zero3Hooks { store, grads: g, update }))
            }
        }
    }

    /// Finish the pending deferred update (the units the forward did not reach, if any)
    /// and apply its guard: a non-finite new weight on any rank aborts the run before
    /// anything is written, as [`Self::check_weights`] does for an update applied at once.
    pub fn settle(&mut self, g: &Guard<'_>) -> Result<()> {
        let Some(mut p) = self.pending.take() else { return Ok(()) };
        if let (Grads::Sharded(gr), Weights::Sharded { store, .. }) = (&self.grads, &self.weights) {
            let optim = &mut self.optim;
            g.prof.time(Phase::Optimizer, &self.device, || apply_deferred(optim, &mut p.d, usize::MAX, store, gr))?;
        }
        let bad = ranks_flagging(&self.world, !p.d.all_finite(), &self.device)?;
        if bad > 0.0 {
            return Err(Error::Diverged(format!(
                "the update of {} made the weights non-finite (first: {bad} rank(s)' slice of the weights (ZeRO-3); gradient norm {}, \
                 lr {:.3e}); nothing was written: {}; lower the learning rate or raise clipping, then --resume",
                p.at, p.grad_norm, p.lr, g.kept
            )));
        }
        Ok(())
    }

    /// The optimizer step over this step's gradients (all ranks in lockstep): norm, clip,
    /// AdamW, the new weights where they live; under ZeRO-3 with the weights and the
    /// state in host memory, the norm and clip now and the AdamW pass during the next
    /// forward (pending until settled). Timed as the optimizer.
    pub fn update(&mut self, prof: &Profiler, u: Update) -> Result<StepStats> {
        if u.skip {
            return Ok(StepStats { grad_norm: f64::NAN, skipped: true });
        }
        let device = self.device.clone();
        let (stats, deferred) = prof.time(Phase::Optimizer, &device, || self.optimizer_step(u.lr))?;
        if let Some(mut d) = deferred {
            if let Weights::Sharded { store, .. } = &self.weights {
                store.drop_prefetch(); // a unit copied ahead in the backward holds the old weights
            }
            if u.poison {
                d.poison();
            }
            self.pending = Some(PendingUpdate { d, at: u.at, grad_norm: stats.grad_norm, lr: u.lr });
        }
        Ok(stats)
    }

    /// The update is deferred into the next forward: weights and optimizer state both on
    /// the host (ZeRO-3 with `offload_params` and `optimizer_on_host`).
    fn defers(&self) -> bool {
        matches!(&self.weights, Weights::Sharded { store, .. } if store.on_host()) && self.optim.on_host()
    }

    fn optimizer_step(&mut self, lr: f64) -> Result<(StepStats, Option<Deferred>)> {
        let clip = self.cfg.clip_grad;
        if let (true, Grads::Sharded(g)) = (self.defers(), &self.grads) {
            // Norm and clip now; the AdamW pass during the next step's forward.
            return self.optim.begin_deferred(&self.world, &g.source(), lr, clip);
        }
        let full: Tensor;
        let src = match &self.grads {
            // Stage 0: every rank sums the whole gradient and updates the whole state.
            Grads::Full(b) if self.cfg.stage == 0 && self.world.world() > 1 => {
                full = self.world.all_reduce_sum(b.flat())?;
                GradSource::Device(&full)
            }
            Grads::Full(b) => {
                full = self.optim.reduce(&self.world, b)?;
                GradSource::Device(&full)
            }
            Grads::Sharded(g) => g.source(),
        };
        let out = match &mut self.weights {
            // A resident prefix exists only with the deferred update (split state, weights on
            // the host); written through the host shard, it would go stale.
            Weights::Sharded { store, .. } if store.resident_bytes() > 0 => {
                return Err(Error::Setting("ZeRO-3: an update at once of a shard with units kept on the device".into()))
            }
            Weights::Sharded { store, .. } => store.out(),
            Weights::Model(params) => Out::Params(params),
        };
        let stats = self.optim.step(&self.world, &src, out, lr, clip, (self.dtype, &self.device))?;
        Ok((stats, None))
    }

    /// After an update applied at once: the first weight that is NaN or infinite (the same
    /// verdict on every rank), `None` also while a deferred update is pending (it is
    /// guarded when settled). `poison`: fault injection, the first weight made NaN first.
    pub fn check_weights(&mut self, poison: bool) -> Result<Option<String>> {
        if self.pending.is_some() {
            return Ok(None);
        }
        if poison {
            match &mut self.weights {
                Weights::Sharded { store, .. } => store.poison()?,
                Weights::Model(params) => {
                    if let Some((_, v)) = params.first() {
                        v.set(&v.as_tensor().affine(f64::NAN, 0.0)?)?;
                    }
                }
            }
        }
        self.first_non_finite_weight()
    }

    /// The first weight this rank holds that is NaN or infinite (by name, or this rank's
    /// slice under ZeRO-3); the same verdict on every rank (all-reduced under ZeRO-3).
    fn first_non_finite_weight(&self) -> Result<Option<String>> {
        match &self.weights {
            Weights::Model(params) => {
                let tensors: Vec<Tensor> = params.iter().map(|(_, v)| v.as_tensor().clone()).collect();
                let flags = crate::guard::finite_flags(&tensors)?;
                Ok(flags.iter().position(|ok| !ok).map(|i| format!("`{}`", params[i].0)))
            }
            Weights::Sharded { store, .. } => {
                let mine = store.any_non_finite()?;
                let bad = ranks_flagging(&self.world, mine, &self.device)?;
                Ok((bad > 0.0).then(|| format!("{bad} rank(s)' slice of the weights (ZeRO-3)")))
            }
        }
    }

    /// Every weight, whole, on the host or where it lives (collective under ZeRO-3: every
    /// rank calls it), settled first: for checkpoints, the export and evaluations.
    pub fn whole_weights(&mut self, g: &Guard<'_>) -> Result<Vec<(String, Tensor)>> {
        self.settle(g)?;
        match &self.weights {
            Weights::Model(params) => Ok(params.iter().map(|(n, v)| (n.clone(), v.as_tensor().detach())).collect()),
            Weights::Sharded { store, names } => {
                let mut all = store.gather_all(names)?;
                names
                    .iter()
                    .map(|n| Ok((n.clone(), all.remove(n).ok_or_else(|| Error::Setting(format!("ZeRO-3: `{n}` not gathered")))?)))
                    .collect()
            }
        }
    }

    /// Fresh AdamW state (a stage with `reset_optimizer`), settled first.
    pub fn reset_optimizer(&mut self, g: &Guard<'_>) -> Result<()> {
        self.settle(g)?;
        self.optim.reset()
    }

    /// Before a checkpoint, settled first and the host copy of the state brought up to
    /// date: the first non-finite weight (the same on every rank) and this rank's first
    /// non-finite optimizer value.
    pub fn checkpoint_check(&mut self, g: &Guard<'_>) -> Result<(Option<String>, Option<String>)> {
        self.settle(g)?;
        self.optim.sync_to_host()?;
        let weight = self.first_non_finite_weight()?;
        Ok((weight, self.optim.shard().first_non_finite()))
    }

    /// Write this rank's optimizer shard into the checkpoint's temporary directory `tmp`
    /// (stage 0: rank 0 writes the whole state as one shard), then drop the host copy of
    /// a device-resident state. After [`Self::checkpoint_check`].
    pub fn write_shard(&mut self, tmp: &Path) -> Result<()> {
        let rank = self.world.rank();
        if rank < self.optimizer_shards() {
            checkpoint::write_shard(tmp, rank, &self.optim.shard())?;
        }
        self.optim.release_host(); // a device-resident state keeps no host copy between checkpoints
        Ok(())
    }

    /// Optimizer shard files a checkpoint holds.
    pub fn optimizer_shards(&self) -> usize {
        self.optim.part.world
    }

    /// The unit lengths the optimizer shards are cut by (empty: one unit, the whole model).
    pub fn optimizer_units(&self) -> Vec<usize> {
        if self.optim.part.units.len() > 1 {
            self.optim.part.lens()
        } else {
            Vec::new()
        }
    }

    /// AdamW steps taken.
    pub fn adam_step(&self) -> u64 {
        self.optim.steps()
    }

    /// Fault injection: this rank's first gradient made NaN, in place (the buffer is what
    /// the optimizer reads).
    pub fn poison_gradient(&self) -> Result<()> {
        let first = match &self.grads {
            Grads::Full(b) => b.views().first().cloned(),
            Grads::Sharded(g) => return g.poison(),
        };
        if let Some(t) = first {
            t.slice_set(&t.affine(f64::NAN, 0.0)?, 0, 0)?;
        }
        Ok(())
    }
}
