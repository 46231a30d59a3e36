//! ZeRO-2/3 and parameter offload: what a rank keeps of the weights and gradients, and
//! how the engine gets a layer's weights and gives back its gradients (DeepSpeed's
//! stage 2, stage 3 and `offload_param`).
//!
//! - **Gradients (stage ≥ 2)**: the engine writes a unit's gradients into a scratch
//!   buffer the size of one unit (`[W·L_u]` f32; the embedding has its own, since the
//!   tied head adds to it early); when the unit is done they are reduce-scattered and this
//!   rank's slice is added into its shard of the gradient (`[Σ L_u]` f32), then the scratch
//!   is zeroed for the next unit. No rank ever holds the whole model's gradient. With one
//!   rank the slice is the whole gradient: the engine writes the shard itself (no scratch,
//!   nothing reduced, added or zeroed per unit).
//! - **Weights (stage 3)**: each rank keeps only its slices of the weights (`[Σ L_u]` in
//!   the run dtype) on the device, or in host memory with `offload_param`; a unit's
//!   weights are all-gathered (after a host-to-device copy when offloaded) just before the
//!   engine runs it and dropped after, so at most a unit or two are whole on a device.
//!   The optimizer writes its new slices straight into the shard.
//!
//! Shapes: `W` ranks; unit `u` of `len_u` elements, `L_u = ⌈len_u/W⌉`; shard `[Σ L_u]`.

use super::units::Partition;
use super::weights::{HostWeights, HostWeightsMut, Out};
use crate::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor};
use longctx_attention::comm::Comm;
use longctx_attention::stash::{Fetched, Parked, Stash};
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::sync::Arc;

/// This rank's slices of `weights` (every parameter, host tensors of any float dtype),
/// `[Σ L_u]` in `P`, zero-padded; converted in parallel.
fn host_slices<P: crate::train::optim::HostElem>(
    part: &Partition,
    params: &[(String, Shape)],
    weights: &HashMap<String, Tensor>,
) -> Result<Vec<P>> {
    use rayon::prelude::*;
    let mut out: Vec<P> = Vec::with_capacity(part.shard_len());
    out.par_extend(rayon::iter::repeat_n(P::from_f32(0.0), part.shard_len()));
    for u in 0..part.units.len() {
        for (p, x, at) in part.parts(u, part.rank) {
            let (a, b) = (x.start, x.end);
            let name = &params[p].0;
            let w = weights.get(name).ok_or_else(|| Error::Setting(format!("ZeRO-3: no start weights for `{name}`")))?;
            let w = w.flatten_all()?.narrow(0, a - part.offsets[p], b - a)?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?;
            let (st, layout) = w.storage_and_layout();
            let candle_core::Storage::Cpu(candle_core::CpuStorage::F32(src)) = &*st else {
                return Err(Error::Setting(format!("ZeRO-3: start weights of `{name}` are not in host memory")));
            };
            let src = &src[layout.start_offset()..layout.start_offset() + (b - a)];
            out[at..at + (b - a)].par_chunks_mut(1 << 16).zip(src.par_chunks(1 << 16)).for_each(|(d, s)| {
                for (d, &x) in d.iter_mut().zip(s) {
                    *d = P::from_f32(x);
                }
            });
        }
    }
    Ok(out)
}

/// Where a rank's slice of the weights lives.
enum ShardHome {
    Device(Tensor),
    /// In a cell: a deferred optimizer update writes one unit while the engine reads
    /// another (`ParamStore::with_host_mut`, one thread).
    Host(RefCell<HostWeights>),
}

/// This rank's slices of the weights (stage 3).
pub struct ParamStore {
    part: Partition,
    shapes: Vec<Shape>,
    /// The unit the engine will ask for next, on its way to the device (host shard only):
    /// copied on the stash's copy stream while the current unit computes. Declared before
    /// the stash and the shard: dropped (waited for) before either goes.
    ahead: RefCell<Option<(usize, Fetched)>>,
    stash: RefCell<Stash>,
    /// The layer or head unit fetched last (which way the engine walks the units).
    last: Cell<Option<usize>>,
    /// The host shard page-locked in place (CUDA): each layer's copy to the GPU runs at
    /// DMA speed. Declared before `shard`, so it is released before the memory is freed.
    /// A copy from page-locked memory is asynchronous (on the compute stream, or on the
    /// stash's copy stream when made ahead, which the compute stream waits for before
    /// use); the optimizer writes a unit only after it has waited for that unit's gradient
    /// copy, which is ordered after the compute that used the weights (`zero::advance`).
    _pin: Option<longctx_attention::stash::HostPin>,
    /// `[Σ L_u]`, run dtype: on the device, or in host memory (`offload_params`).
    shard: ShardHome,
    /// With the shard in host memory, the first units' slices kept on the device instead
    /// (`[prefix]`, run dtype): the units whose optimizer state is there too
    /// (`train.optimizer_device_units`), updated in place, never copied. Their stretch of
    /// the host shard is then stale.
    resident: Option<(usize, Tensor)>,
    /// Where the engine computes.
    dev: Device,
    comm: Arc<dyn Comm>,
}

impl ParamStore {
    /// This rank's slices of `weights` (every parameter, any device; converted to
    /// `dtype`), kept on the compute device `dev`, or in host memory (`offload`).
    /// With `offload`, the first `resident_units` units' slices stay on `dev` (0: none).
    pub fn new(
        part: Partition,
        params: &[(String, Shape)],
        weights: &HashMap<String, Tensor>,
        dtype: DType,
        (dev, offload, resident_units): (&Device, bool, usize),
        comm: Arc<dyn Comm>,
    ) -> Result<Self> {
        // Rounded to the run dtype on the host, every core at once, straight into the
        // shard's vector; then kept there (offload) or copied to the device in one piece.
        let host = match dtype {
            DType::BF16 => HostWeights::BF16(host_slices(&part, params, weights)?),
            DType::F16 => HostWeights::F16(host_slices(&part, params, weights)?),
            DType::F32 => HostWeights::F32(host_slices(&part, params, weights)?),
            other => return Err(Error::Setting(format!("ZeRO-3: weights of dtype {other:?} are not supported"))),
        };
        let units = resident_units.min(part.units.len());
        let resident = if offload && units > 0 { Some((units, host.to_tensor(0, part.prefix_len(units), dev)?)) } else { None };
        let mut shard =
            if offload { ShardHome::Host(RefCell::new(host)) } else { ShardHome::Device(host.to_tensor(0, part.shard_len(), dev)?) };
        let _pin = match &mut shard {
            ShardHome::Host(h) => {
                let (ptr, len) = h.get_mut().raw_bytes();
                // SAFETY: the vector is never resized and outlives the guard (field order).
                match unsafe { longctx_attention::stash::HostPin::register(dev, ptr, len) } {
                    Ok(pin) => pin,
                    Err(e) => {
                        eprintln!("warning: {e}; offloaded weights go to the GPU through staging copies (slower)");
                        None
                    }
                }
            }
            ShardHome::Device(_) => None,
        };
        let shapes = params.iter().map(|(_, s)| s.clone()).collect();
        Ok(Self {
            part,
            shapes,
            ahead: RefCell::new(None),
            stash: RefCell::new(Stash::new()),
            last: Cell::new(None),
            _pin,
            shard,
            resident,
            dev: dev.clone(),
            comm,
        })
    }

    /// Where the optimizer writes its new slices (`[Σ L_u]`, run dtype).
    pub fn out(&mut self) -> Out<'_> {
        self.drop_prefetch(); // the weights change
        match &mut self.shard {
            ShardHome::Device(t) => Out::Shard(t),
            ShardHome::Host(h) => Out::HostShard(h.get_mut().as_mut()),
        }
    }

    /// The host shard lent to `f` (a deferred optimizer update writing units the engine
    /// does not read meanwhile); an error when the shard is on the device or already lent.
    pub fn with_host_mut<R>(&self, f: impl FnOnce(HostWeightsMut<'_>) -> Result<R>) -> Result<R> {
        match &self.shard {
            ShardHome::Host(h) => {
                let mut h = h.try_borrow_mut().map_err(|_| Error::Setting("ZeRO-3: the host weight shard is already lent".into()))?;
                f(h.as_mut())
            }
            ShardHome::Device(_) => Err(Error::Setting("ZeRO-3: a host update of weights that live on the device".into())),
        }
    }

    /// The first units' slices kept on the device (`[prefix]`), when the shard is on the
    /// host: where a split optimizer writes their new weights.
    pub fn resident_prefix(&self) -> Option<&Tensor> {
        self.resident.as_ref().map(|(_, t)| t)
    }

    /// Bytes of the first units' slices kept on the device beside a host shard.
    pub fn resident_bytes(&self) -> usize {
        self.resident.as_ref().map_or(0, |(_, t)| t.elem_count() * t.dtype().size_in_bytes())
    }

    /// Some weight of this rank's slice is NaN or infinite.
    pub fn any_non_finite(&self) -> Result<bool> {
        let resident_bad = match &self.resident {
            Some((_, t)) => !crate::guard::finite_flags(std::slice::from_ref(t))?.iter().all(|ok| *ok),
            None => false,
        };
        let skip = self.resident.as_ref().map_or(0, |(_, t)| t.elem_count()); // stale on the host
        match &self.shard {
            ShardHome::Device(t) => Ok(!crate::guard::finite_flags(std::slice::from_ref(t))?.iter().all(|ok| *ok)),
            ShardHome::Host(h) => Ok(resident_bad || h.borrow().any_non_finite_from(skip)),
        }
    }

    /// Make this rank's first weight NaN (fault injection in tests).
    pub fn poison(&mut self) -> Result<()> {
        if let Some((_, t)) = &self.resident {
            return Ok(t.slice_set(&t.narrow(0, 0, 1)?.affine(f64::NAN, 0.0)?, 0, 0)?);
        }
        match &mut self.shard {
            ShardHome::Device(t) => t.slice_set(&t.narrow(0, 0, 1)?.affine(f64::NAN, 0.0)?, 0, 0)?,
            ShardHome::Host(h) => match h.get_mut() {
                HostWeights::BF16(v) => v[0] = half::bf16::NAN,
                HostWeights::F16(v) => v[0] = half::f16::NAN,
                HostWeights::F32(v) => v[0] = f32::NAN,
            },
        }
        Ok(())
    }

    /// Unit `u`'s parameters, whole, on the compute device (collective: every rank calls
    /// it for the same unit in the same order).
    pub fn fetch(&self, u: usize) -> Result<Vec<Tensor>> {
        let unit = &self.part.units[u];
        let resident = self.resident.as_ref().filter(|(k, _)| u < *k).map(|(_, t)| t);
        let mine = match (&self.shard, resident) {
            (ShardHome::Device(t), _) | (ShardHome::Host(_), Some(t)) => t.narrow(0, unit.shard_off, unit.shard)?,
            (ShardHome::Host(h), None) => match self.ahead.borrow_mut().take() {
                Some((v, copy)) if v == u => copy.ready()?,
                _ => h.borrow().to_tensor(unit.shard_off, unit.shard, &self.dev)?,
            },
        };
        if u > 0 {
            self.last.set(Some(u)); // (a tied head's embedding, fetched at the loss, says nothing of the walk)
        }
        let full = if self.part.world > 1 { Tensor::cat(&self.comm.all_gather(&mine)?, 0)? } else { mine };
        self.part.split_unit(u, &full)?.into_iter().map(|(p, t)| Ok(t.reshape(self.shapes[p].clone())?)).collect()
    }

    /// Start copying unit `u`'s slice to the device ahead of its [`Self::fetch`] (host shard
    /// only; one unit ahead at most). The slice must hold its final weights for the step:
    /// nothing writes it before that fetch (the caller's word; [`Self::out`] and
    /// [`Self::drop_prefetch`] discard a copy made before an update).
    pub fn prefetch(&self, u: usize) -> Result<()> {
        let ShardHome::Host(h) = &self.shard else { return Ok(()) };
        let Some(unit) = self.part.units.get(u) else { return Ok(()) };
        if self.resident.as_ref().is_some_and(|(k, _)| u < *k) {
            return Ok(()); // on the device already
        }
        if self.ahead.borrow().as_ref().is_some_and(|(v, _)| *v == u) {
            return Ok(());
        }
        let h = h.try_borrow().map_err(|_| Error::Setting("ZeRO-3: the host weight shard is lent out".into()))?;
        let (a, n) = (unit.shard_off, unit.shard);
        let mut stash = self.stash.borrow_mut();
        // SAFETY: the shard's vector lives as long as `self` (and `ahead` is dropped first);
        // its slice of unit `u` is not written before the fetch that waits for this copy
        // (the deferred update writes only units not yet applied, the optimizer's `out`
        // drops the copy first).
        let copy = unsafe {
            match &*h {
                HostWeights::BF16(v) => stash.upload(&v[a..a + n], &self.dev),
                HostWeights::F16(v) => stash.upload(&v[a..a + n], &self.dev),
                HostWeights::F32(v) => stash.upload(&v[a..a + n], &self.dev),
            }
        }?;
        *self.ahead.borrow_mut() = Some((u, copy));
        Ok(())
    }

    /// Discard a unit copied ahead (its weights are about to change).
    pub fn drop_prefetch(&self) {
        self.ahead.borrow_mut().take();
    }

    /// The unit the engine most likely asks for after `u`, from the way it walks: the
    /// forward goes up from the embedding to the head, the backward down from the head to
    /// the first layer (it never fetches the embedding).
    pub fn next_after(&self, u: usize) -> Option<usize> {
        let n = self.part.units.len();
        let down = u + 1 == n || (u > 0 && self.last.get() == Some(u + 1));
        match down {
            true => (u > 1).then(|| u - 1),
            false => (u + 1 < n).then_some(u + 1),
        }
    }

    /// Every weight, whole, in host memory (collective), named as `names` (model order):
    /// for checkpoints and exports.
    pub fn gather_all(&self, names: &[String]) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(names.len());
        for (u, unit) in self.part.units.iter().enumerate() {
            for (p, t) in unit.params.clone().zip(self.fetch(u)?) {
                out.insert(names[p].clone(), t.force_contiguous()?.to_device(&Device::Cpu)?);
            }
        }
        Ok(out)
    }

    /// Bytes of the shard (on the device or on the host, see [`Self::on_host`]).
    pub fn bytes(&self) -> usize {
        match &self.shard {
            ShardHome::Device(t) => t.elem_count() * t.dtype().size_in_bytes(),
            ShardHome::Host(h) => h.borrow().bytes(),
        }
    }

    /// The shard lives in host memory (`offload_params`).
    pub fn on_host(&self) -> bool {
        matches!(self.shard, ShardHome::Host(_))
    }
}

/// This rank's shard of the gradient, filled unit by unit during the backward (stage ≥ 2).
pub struct ShardedGrads {
    part: Partition,
    /// The embedding unit's scratch `[W·L_0]` and the one every other unit uses in turn
    /// (`[max W·L_u]`), f32 on the device.
    embed_scratch: Tensor,
    scratch: Tensor,
    /// Every parameter's slot: a view of its unit's scratch, shaped like the parameter.
    pub(super) slots: Vec<Tensor>,
    /// `[Σ L_u]` f32: Σ over micro-batches of this rank's slices of the summed gradient
    /// (with [`HostSide`], of the device units' slices only).
    shard: Tensor,
    /// `train.offload_gradients`: the slices of the units from `first` on in host memory.
    host: Option<Box<HostSide>>,
    comm: Arc<dyn Comm>,
}

/// The gradient slices of the units from `first` on, in host memory
/// (`train.offload_gradients`): each unit's slice is copied there when the backward is
/// done with it, its `Σ x²` taken on the device first, and the device memory reused, so
/// the device holds two units' scratch instead of the whole shard. The copies run on the
/// stash's copy stream under the next unit's backward; each park makes the compute stream
/// wait for the previous park's copy, after which that buffer is zeroed for the unit after
/// next (one rank: the units write two buffers in turn; several ranks: the reduced slice is
/// a fresh tensor and the shared scratch is zeroed as without offload). A later
/// micro-batch of the same step brings the unit's slice back and adds its own.
struct HostSide {
    /// The first unit whose slice lives here (the units before: a split optimizer's
    /// device units, in the device shard).
    first: usize,
    /// One rank: the two buffers the host units after the embedding write in turn
    /// (`u % 2`), `[max L_u]` f32 (empty with several ranks).
    turns: [Tensor; 2],
    /// Each unit's slice, parked in host memory (`None`: not written this step, or read).
    parked: RefCell<Vec<Option<Parked>>>,
    /// Each unit's `Σ x²` of its slice as parked last: f64 partial sums left on the
    /// device (read once, for the norm, not per unit).
    sumsq: RefCell<Vec<Option<Tensor>>>,
    stash: RefCell<Stash>,
    /// One rank: the buffer parked last, zeroed after the next park (the compute stream
    /// then waits for its copy).
    last: RefCell<Option<Tensor>>,
    /// Fault injection: the gradient's norm reads NaN.
    poisoned: Cell<bool>,
    /// A later micro-batch: the next unit's slice on its way back to the device, fetched
    /// when the unit before it was parked (so its copy runs under that unit's backward).
    ahead: RefCell<Option<(usize, Fetched)>>,
    /// The host buffers are page-locked at the first park (when every rank is past its
    /// start-up and the start weights are gone), not at start-up.
    reserved: Cell<bool>,
}

impl ShardedGrads {
    /// `host_from`: keep the slices of the units from this one on in host memory
    /// (`train.offload_gradients`; the units before it: a split optimizer's device units).
    pub fn new(part: Partition, shapes: &[Shape], dev: &Device, comm: Arc<dyn Comm>, host_from: Option<usize>) -> Result<Self> {
        let w = part.world;
        let direct = w == 1;
        let n_units = part.units.len();
        let first = host_from.map(|f| f.min(n_units));
        let on_host = |u: usize| first.is_some_and(|f| u >= f);
        let scratch_len = |len: usize| if direct { 0 } else { len };
        let embed_len = match (direct, on_host(0)) {
            (true, true) => part.units.first().map_or(0, |u| u.shard),
            _ => scratch_len(part.units.first().map_or(0, |u| u.shard * w)),
        };
        let other = scratch_len(part.units.iter().skip(1).map(|u| u.shard * w).max().unwrap_or(0));
        let embed_scratch = Tensor::zeros(embed_len, DType::F32, dev)?;
        let scratch = Tensor::zeros(other, DType::F32, dev)?;
        let shard_len = match first {
            Some(f) => part.prefix_len(f),
            None => part.shard_len(),
        };
        let shard = Tensor::zeros(shard_len, DType::F32, dev)?;
        // Each turn as long as the largest host unit of its parity (the head's turn may be
        // longer than the layers' other one).
        let turn_len = |parity: usize| match (direct, first) {
            (true, Some(f)) => {
                part.units.iter().enumerate().skip(f.max(1)).filter(|(u, _)| u % 2 == parity).map(|(_, u)| u.shard).max().unwrap_or(0)
            }
            _ => 0,
        };
        let turns = [Tensor::zeros(turn_len(0), DType::F32, dev)?, Tensor::zeros(turn_len(1), DType::F32, dev)?];
        // Each unit's parameters as views of its scratch buffer, or (one rank) of its part
        // of the shard, which then holds the unit whole in the same order; one rank's host
        // units write the embedding's buffer or one of the two turns.
        let mut slots: Vec<Option<Tensor>> = vec![None; part.sizes.len()];
        for (u, unit) in part.units.iter().enumerate() {
            let buf = match (direct, on_host(u), u) {
                (true, false, _) => shard.narrow(0, unit.shard_off, unit.shard)?,
                (true, true, 0) => embed_scratch.clone(),
                (true, true, _) => turns[u % 2].narrow(0, 0, unit.shard)?,
                (false, _, 0) => embed_scratch.clone(),
                (false, _, _) => scratch.clone(),
            };
            for (p, t) in part.split_unit(u, &buf)? {
                slots[p] = Some(t.reshape(shapes[p].clone())?);
            }
        }
        let slots = slots
            .into_iter()
            .map(|t| t.ok_or_else(|| Error::Setting("ZeRO: a parameter outside every unit".into())))
            .collect::<Result<_>>()?;
        let host = first.map(|first| {
            let mut stash = Stash::new();
            stash.set_max_pending(0);
            Box::new(HostSide {
                first,
                turns,
                parked: RefCell::new((0..n_units).map(|_| None).collect()),
                sumsq: RefCell::new(vec![None; n_units]),
                stash: RefCell::new(stash),
                last: RefCell::new(None),
                poisoned: Cell::new(false),
                ahead: RefCell::new(None),
                reserved: Cell::new(false),
            })
        });
        Ok(Self { part, embed_scratch, scratch, slots, shard, host, comm })
    }

    /// `[Σ L_u]` f32, this rank's slices of the gradient summed over ranks and micro-batches
    /// (with the gradients in host memory: the device units' only, `[Σ L_u]` of them).
    pub fn shard(&self) -> &Tensor {
        &self.shard
    }

    /// Where the optimizer reads this step's gradient: the device shard, or its device
    /// part and the units in host memory (each handed over once by [`Self::take_unit`]).
    pub fn source(&self) -> GradSource<'_> {
        match &self.host {
            None => GradSource::Device(&self.shard),
            Some(_) => GradSource::Host { prefix: &self.shard, grads: self },
        }
    }

    /// `Σ x²` of the slices in host memory (this rank's), from the partial sums taken on
    /// the device as each was parked: one transfer. NaN after [`Self::poison`].
    pub fn host_sumsq(&self) -> Result<f64> {
        let Some(h) = &self.host else { return Ok(0.0) };
        if h.poisoned.get() {
            return Ok(f64::NAN);
        }
        let sums = h.sumsq.borrow();
        if let Some(u) = (h.first..sums.len()).find(|&u| sums[u].is_none()) {
            return Err(Error::Setting(format!(
                "gradient norm: unit {u}'s gradient was not parked in host memory this step (offload_gradients)"
            )));
        }
        let parts: Vec<Tensor> = sums.iter().skip(h.first).flatten().cloned().collect();
        if parts.is_empty() {
            return Ok(0.0);
        }
        Ok(Tensor::cat(&parts, 0)?.to_vec1::<f64>()?.iter().sum())
    }

    /// Unit `u`'s slice in host memory, handed over once (its buffer goes back to the pool
    /// when dropped); an error for a unit on the device or not parked this step.
    pub fn take_unit(&self, u: usize) -> Result<Parked> {
        self.host
            .as_ref()
            .and_then(|h| h.parked.borrow_mut().get_mut(u).and_then(Option::take))
            .ok_or_else(|| Error::Setting(format!("optimizer: no gradient of unit {u} in host memory (offload_gradients)")))
    }

    /// Zero the shard (the start of an optimizer step); host slices are forgotten.
    pub fn zero(&self) -> Result<()> {
        if let Some(h) = &self.host {
            h.stash.borrow_mut().settle()?;
            h.parked.borrow_mut().iter_mut().for_each(|p| *p = None);
            h.sumsq.borrow_mut().iter_mut().for_each(|p| *p = None);
            h.poisoned.set(false);
            h.last.borrow_mut().take();
            h.ahead.borrow_mut().take();
            for t in h.turns.iter().chain([&self.embed_scratch]) {
                if t.elem_count() > 0 {
                    t.zero_set()?;
                }
            }
        }
        super::grads::zero_flat(&self.shard)
    }

    /// Zero unit `u`'s slice of the shard (a deferred update has read it).
    pub fn zero_unit(&self, u: usize) -> Result<()> {
        if let Some(h) = self.host.as_ref().filter(|h| u >= h.first) {
            h.parked.borrow_mut()[u] = None;
            return Ok(());
        }
        let unit = &self.part.units[u];
        super::grads::zero_flat(&self.shard.narrow(0, unit.shard_off, unit.shard)?)
    }

    /// Fault injection: this rank's gradient made NaN where the optimizer reads it.
    pub fn poison(&self) -> Result<()> {
        match &self.host {
            Some(h) if self.shard.elem_count() == 0 => h.poisoned.set(true),
            _ => self.shard.slice_set(&self.shard.narrow(0, 0, 1)?.affine(f64::NAN, 0.0)?, 0, 0)?,
        }
        Ok(())
    }

    /// Units of the partition.
    pub fn units(&self) -> usize {
        self.part.units.len()
    }

    /// Bytes on the device: the shard and the scratch buffers.
    pub fn bytes(&self) -> usize {
        let turns = self.host.as_ref().map_or(0, |h| h.turns.iter().map(|t| t.elem_count()).sum());
        4 * (self.shard.elem_count() + self.scratch.elem_count() + self.embed_scratch.elem_count() + turns)
    }

    /// Bytes of the slices in host memory (`offload_gradients`; 0 otherwise): this rank's
    /// slices of the host units, as a step holds them at its end.
    pub fn host_bytes(&self) -> usize {
        self.host.as_ref().map_or(0, |h| 4 * (self.part.shard_len() - self.part.prefix_len(h.first)))
    }

    /// Page-lock the host buffers the units' slices will be parked in (CUDA; one per host
    /// unit), all at once at the first park rather than one unit at a time.
    fn reserve_pinned(&self, h: &HostSide) -> Result<()> {
        if h.reserved.replace(true) {
            return Ok(());
        }
        let dev = self.shard.device();
        let sizes: Vec<usize> = self.part.units.iter().skip(h.first).map(|u| 4 * u.shard).collect();
        Ok(h.stash.borrow_mut().reserve(dev, &sizes)?)
    }

    /// Reduce-scatter unit `u`'s scratch, add this rank's slice into the shard, zero it
    /// (one rank: nothing, the engine wrote the shard); a host unit's slice goes to host
    /// memory instead.
    pub(super) fn done(&self, u: usize) -> Result<()> {
        let unit = &self.part.units[u];
        let w = self.part.world;
        if let Some(h) = self.host.as_ref().filter(|h| u >= h.first) {
            if w > 1 {
                self.park(h, u, &self.reduced(u)?)?;
            } else {
                let buf = if u == 0 { self.embed_scratch.clone() } else { h.turns[u % 2].clone() };
                self.park(h, u, &buf.narrow(0, 0, unit.shard)?)?;
                // The park made the compute stream wait for the previous park's copy: that
                // buffer may be zeroed now, for the unit after next.
                if let Some(prev) = h.last.borrow_mut().replace(buf) {
                    prev.zero_set()?;
                }
            }
            if u == 0 {
                self.flush(h)?;
            }
            return Ok(());
        }
        if let Some(h) = &self.host {
            self.flush(h)?; // a device unit: the host units are all done
        }
        if w == 1 {
            return Ok(());
        }
        let mine = self.reduced(u)?;
        let dst = self.shard.narrow(0, unit.shard_off, unit.shard)?;
        longctx_kernels::accumulate_f32(&dst, &mine, 1.0)?;
        Ok(())
    }

    /// Several ranks: unit `u`'s slice of this rank, reduce-scattered from its scratch
    /// (a fresh tensor), the scratch zeroed for the next unit.
    fn reduced(&self, u: usize) -> Result<Tensor> {
        let unit = &self.part.units[u];
        let buf = if u == 0 { &self.embed_scratch } else { &self.scratch };
        let w = self.part.world;
        let parts = (0..w).map(|i| buf.narrow(0, i * unit.shard, unit.shard)).collect::<candle_core::Result<Vec<_>>>()?;
        let mine = self.comm.reduce_scatter_sum(parts)?;
        buf.narrow(0, 0, unit.shard * w)?.zero_set()?;
        Ok(mine)
    }

    /// Unit `u`'s slice `mine` (on the device) to host memory: added to what an earlier
    /// micro-batch of the step parked, its `Σ x²` taken, then parked.
    fn park(&self, h: &HostSide, u: usize, mine: &Tensor) -> Result<()> {
        self.reserve_pinned(h)?;
        let dev = self.shard.device();
        let mut stash = h.stash.borrow_mut();
        // A later micro-batch: add what the earlier ones parked (fetched ahead, or now).
        let ahead = h.ahead.borrow_mut().take();
        let back = match (ahead, h.parked.borrow_mut()[u].take()) {
            (Some((v, f)), _) if v == u => Some(f),
            (_, Some(prev)) => Some(stash.fetch(&prev, dev)?),
            (_, None) => None,
        };
        if let Some(back) = back {
            longctx_kernels::accumulate_f32(mine, &back.ready()?, 1.0)?;
        }
        h.sumsq.borrow_mut()[u] = Some(longctx_kernels::sum_squares_partials(mine)?);
        // Off CUDA a park keeps the tensor itself: copy it, the buffer is reused.
        let p = if dev.is_cuda() { stash.park(mine)? } else { stash.park(&mine.copy()?)? };
        h.parked.borrow_mut()[u] = Some(p);
        // The unit the backward finishes next (the one below), if an earlier micro-batch
        // parked it: its copy back starts now, under that unit's backward.
        if let Some(v) = u.checked_sub(1).filter(|&v| v >= h.first) {
            if let Some(prev) = h.parked.borrow_mut()[v].take() {
                *h.ahead.borrow_mut() = Some((v, stash.fetch(&prev, dev)?));
            }
        }
        Ok(())
    }

    /// Every host unit of this backward is done: the compute stream waits for their
    /// copies and the buffers are zeroed for the next micro-batch or step.
    fn flush(&self, h: &HostSide) -> Result<()> {
        h.stash.borrow_mut().settle()?;
        if let Some(prev) = h.last.borrow_mut().take() {
            prev.zero_set()?;
        }
        Ok(())
    }
}

/// Where the optimizer reads this rank's gradient slice `[Σ L_u]` f32.
pub enum GradSource<'a> {
    /// All of it on the device (or the CPU device).
    Device(&'a Tensor),
    /// `train.offload_gradients`: the device units' slices in `prefix` (`[Σ L_u]` of the
    /// first units, as many as the optimizer keeps on the device), every later unit's in
    /// host memory (handed over by [`ShardedGrads::take_unit`]; their `Σ x²`:
    /// [`ShardedGrads::host_sumsq`]).
    Host { prefix: &'a Tensor, grads: &'a ShardedGrads },
}

impl<'a> GradSource<'a> {
    /// The part on the device: the whole slice, or the device units' prefix.
    pub fn device_part(&self) -> &'a Tensor {
        match self {
            Self::Device(t) => t,
            Self::Host { prefix, .. } => prefix,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use longctx_attention::comm::thread::run_ranks;

    const NAMES: [&str; 4] = ["model.embed_tokens.weight", "model.layers.0.w", "model.layers.1.w", "lm_head.weight"];

    /// Embedding, two layers and the head, one 3-vector each, unit `p` all `p`.
    fn four_units() -> (Vec<(String, Shape)>, HashMap<String, Tensor>) {
        let meta = NAMES.iter().map(|n| (n.to_string(), Shape::from(3))).collect();
        let weights =
            NAMES.iter().enumerate().map(|(p, n)| (n.to_string(), Tensor::from_vec(vec![p as f32; 3], 3, &Device::Cpu).unwrap())).collect();
        (meta, weights)
    }

    /// A unit copied ahead is what the next fetch of it returns, the weights as they were
    /// at the copy; `drop_prefetch` and the optimizer's `out` discard it, so a fetch after
    /// an update sees the new weights.
    #[test]
    fn a_unit_copied_ahead_is_fetched_until_an_update_discards_it() {
        let (names, (meta, weights)) = (NAMES, four_units());
        run_ranks(1, |comm| {
            let e = |e: Error| candle_core::Error::Msg(e.to_string());
            let part = Partition::per_layer(&names, &[3, 3, 3, 3], (0, 1)).map_err(e)?;
            let mut store = ParamStore::new(part.clone(), &meta, &weights, DType::F32, (&Device::Cpu, true, 0), comm).map_err(e)?;
            let unit = |s: &ParamStore, u: usize| -> Vec<f32> { s.fetch(u).unwrap()[0].to_vec1::<f32>().unwrap() };
            let write = |s: &ParamStore, u: usize, x: f32| {
                let at = part.units[u].shard_off;
                s.with_host_mut(|h| {
                    if let HostWeightsMut::F32(v) = h {
                        v[at..at + 3].fill(x);
                    }
                    Ok(())
                })
                .unwrap()
            };
            store.prefetch(1).map_err(e)?;
            assert_eq!(unit(&store, 1), [1.0; 3]);
            store.prefetch(2).map_err(e)?;
            write(&store, 2, 9.0);
            assert_eq!(unit(&store, 2), [2.0; 3], "the copy made ahead");
            store.prefetch(2).map_err(e)?;
            store.drop_prefetch();
            assert_eq!(unit(&store, 2), [9.0; 3], "dropped: fetched anew");
            store.prefetch(1).map_err(e)?;
            if let Out::HostShard(HostWeightsMut::F32(v)) = store.out() {
                v[part.units[1].shard_off] = 7.0;
            }
            assert_eq!(unit(&store, 1), [7.0, 1.0, 1.0], "the optimizer's `out` discards the copy");
            Ok(())
        })
        .unwrap();
    }

    /// The first units kept on the device beside a host shard (a split optimizer state):
    /// fetched from there, never copied ahead, written in place; the host's stretch of
    /// them is not read (not by a fetch, not by the finite check); the fault injection
    /// reaches them.
    #[test]
    fn resident_units_are_fetched_from_the_device_copy() {
        let (names, (meta, weights)) = (NAMES, four_units());
        run_ranks(1, |comm| {
            let e = |e: Error| candle_core::Error::Msg(e.to_string());
            let part = Partition::per_layer(&names, &[3, 3, 3, 3], (0, 1)).map_err(e)?;
            let mut store = ParamStore::new(part.clone(), &meta, &weights, DType::F32, (&Device::Cpu, true, 2), comm).map_err(e)?;
            let unit = |s: &ParamStore, u: usize| -> Vec<f32> { s.fetch(u).unwrap()[0].to_vec1::<f32>().unwrap() };
            assert_eq!(store.resident_bytes(), 6 * 4, "units 0 and 1, f32");
            let res = store.resident_prefix().expect("a resident prefix").clone();
            assert_eq!(res.to_vec1::<f32>()?, [0.0, 0.0, 0.0, 1.0, 1.0, 1.0]);
            res.slice_set(&Tensor::new(&[5f32, 5., 5.], &Device::Cpu)?, 0, 3)?; // the optimizer, in place
            store
                .with_host_mut(|h| {
                    if let HostWeightsMut::F32(v) = h {
                        v[..6].fill(f32::NAN); // the host's stale stretch
                    }
                    Ok(())
                })
                .map_err(e)?;
            store.prefetch(1).map_err(e)?;
            assert_eq!(unit(&store, 1), [5.0; 3], "from the device copy");
            assert_eq!(unit(&store, 2), [2.0; 3], "from the host shard");
            assert!(!store.any_non_finite().map_err(e)?, "the host's stretch of resident units is not checked");
            store.poison().map_err(e)?;
            assert!(store.any_non_finite().map_err(e)?);
            assert!(unit(&store, 0)[0].is_nan(), "poisoned where it is read");
            Ok(())
        })
        .unwrap();
    }
}
