//! The distributed optimizer step: ZeRO over every rank of the world (data- and
//! sequence-parallel alike, as DeepSpeed shards over its sequence-data-parallel group).
//!
//! The parameters form one flat f32 vector cut by a [`Partition`] into units, each unit
//! into `W` slices; rank `r` keeps only its slice of every unit of the f32 master weights
//! and AdamW moments ([`AdamW`] on the host, or [`DeviceAdamW`] on a GPU), `[Σ L_u]`. One
//! step, every rank in lockstep:
//! 1. this rank's slice of the summed gradient: reduce-scattered here, unit by unit, from
//!    the engine's padded flat [`GradBuffer`] (ZeRO-1), or already reduce-scattered layer by
//!    layer during the backward (ZeRO-2/3, `super::stage3`);
//! 2. gradient norm over the world: √(all-reduce Σ slice²), in f64;
//! 3. clip (scale the slice), AdamW on the slice;
//! 4. the new slice in the run dtype: all-gathered unit by unit into the model's weights
//!    (ZeRO-1/2), or written into this rank's parameter shard (ZeRO-3).
//!
//! With ZeRO-3 and both the weights and the state in host memory, steps 3–4 are deferred
//! ([`ShardedAdamW::begin_deferred`], [`ShardedAdamW::advance`]): unit by unit, during the
//! next step's forward, just ahead of the unit the engine runs, so the host pass overlaps
//! the GPU's work instead of stalling it. Same result, bit for bit.

use super::grads::GradBuffer;
use super::stage3::GradSource;
use super::units::Partition;
use super::weights::{HostWeightsMut, Out};
use crate::train::checkpoint::{Loaded, OptimShard};
use crate::train::optim::{AdamW, AdamWConfig, DeviceAdamW, HostElem, Segment, StepConsts};
use crate::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor, Var};
use longctx_attention::comm::Comm;
use longctx_attention::stash::Stash;
use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

/// This rank's part of the optimizer.
pub struct ShardedAdamW {
    /// The slice's state on the host (authoritative unless `device` is set; then it is
    /// refreshed by [`Self::sync_to_host`] for checkpoints).
    pub host: AdamW,
    /// The state of the first [`Self::device_units`] units on a device (all of them, or a
    /// prefix of the shard: a split placement, the host keeping the rest).
    device: Option<DeviceAdamW>,
    /// Units whose state is on the device (`part.units.len()` when all of it is; 0 without
    /// a device part).
    dev_units: usize,
    /// The units and slices.
    pub part: Partition,
    /// `Σ L_u`, the slice length.
    pub shard_len: usize,
    /// Parameters of rank ≥ 2 (weight decay applies).
    decays: Vec<bool>,
    /// The host update's gradient pieces on their way to pinned host memory (its buffers
    /// are reused step after step).
    stash: Stash,
}

/// What one step measured.
#[derive(Debug, Clone, Copy)]
pub struct StepStats {
    /// Global L2 norm of the summed gradient, before clipping.
    pub grad_norm: f64,
    /// The norm was not finite: the update was skipped (weights, moments and the step
    /// counter unchanged). The norm is all-reduced, so every rank skips together.
    pub skipped: bool,
}

impl ShardedAdamW {
    /// This rank's slices of `part` (built for `params`, `(name, shape)` in the model's
    /// order). Masters start from `start` (f32 host copies of the start weights, every
    /// parameter), or, when `resume` is given, from that checkpoint's optimizer state
    /// (whatever its layout and world size were). `device`: keep and update the state of
    /// the first `units` units there ([`ALL_UNITS`]: the whole state) and the rest on the
    /// host; `None`: all of it on the host.
    pub fn new(
        cfg: AdamWConfig,
        params: &[(String, Shape)],
        start: &HashMap<String, Tensor>,
        part: Partition,
        device: Option<(&Device, usize)>,
        resume: Option<(u64, &Loaded)>,
    ) -> Result<Self> {
        let device = device.filter(|&(_, units)| units > 0);
        let dev_units = device.map_or(0, |(_, units)| units.min(part.units.len()));
        let shard_len = part.shard_len();
        let decays: Vec<bool> = params.iter().map(|(_, s)| s.rank() >= 2).collect();
        let rank = part.rank;
        let mut master = vec![0f32; shard_len]; // zeroed pages: the padding
        if resume.is_none() {
            let host: Vec<&Tensor> = params
                .iter()
                .map(|(name, _)| start.get(name).ok_or_else(|| Error::Setting(format!("optimizer start: no weights for `{name}`"))))
                .collect::<Result<_>>()?;
            for (u, unit) in part.units.iter().enumerate() {
                let r = part.piece(u, rank);
                flat_range_into(&host, r.start, r.end, &mut master[unit.shard_off..unit.shard_off + (r.end - r.start)])?;
            }
        }
        // Decay runs over the shard (a run per parameter part; the padding decays not).
        let mut decay: Vec<(usize, bool)> = Vec::new();
        for (u, unit) in part.units.iter().enumerate() {
            decay.extend(part.parts(u, rank).map(|(p, _, at)| (at, decays[p])));
            let r = part.piece(u, rank);
            if r.end - r.start < unit.shard {
                decay.push((unit.shard_off + r.end - r.start, false));
            }
        }
        let mut st = AdamW::with_runs(cfg, master, decay);
        if let Some((step, loaded)) = resume {
            // Only this rank's slices, from whichever shard files hold them.
            let n = part.n();
            let (mut w, mut m, mut v) = (vec![0f32; shard_len], vec![0f32; shard_len], vec![0f32; shard_len]);
            for (u, unit) in part.units.iter().enumerate() {
                let r = part.piece(u, rank);
                let (lw, lm, lv) = loaded.optimizer_range(n, r.start, r.end)?;
                let at = unit.shard_off;
                w[at..at + lw.len()].copy_from_slice(&lw);
                m[at..at + lm.len()].copy_from_slice(&lm);
                v[at..at + lv.len()].copy_from_slice(&lv);
            }
            (st.master, st.m, st.v) = (w, m, v);
            st.step = step;
        }
        let dev_len = part.prefix_len(dev_units);
        let device = device.map(|(d, _)| DeviceAdamW::from_host_prefix(&st, dev_len, d)).transpose()?;
        if dev_len < shard_len && resume.is_none() {
            // The moments stay here: touch their (lazily zeroed) pages now, on every core,
            // rather than one page fault at a time inside the first update (54 GB for 7B).
            use rayon::prelude::*;
            st.m.par_chunks_mut(1 << 20).for_each(|c| c.fill(0.0));
            st.v.par_chunks_mut(1 << 20).for_each(|c| c.fill(0.0));
        }
        let mut me = Self { host: st, device, dev_units, part, shard_len, decays, stash: Stash::new() };
        me.release_host();
        Ok(me)
    }

    /// Units whose state lives on the device: the first ones (all, or none).
    pub fn device_units(&self) -> usize {
        self.dev_units
    }

    /// Elements of the shard whose state is on the device (a prefix: the first units').
    fn dev_len(&self) -> usize {
        self.part.prefix_len(self.dev_units)
    }

    /// The whole state is on the device.
    fn whole_on_device(&self) -> bool {
        self.device.is_some() && self.dev_units >= self.part.units.len()
    }

    /// With the whole state on the device, drop its host copy (refilled by
    /// [`Self::sync_to_host`] for a checkpoint): 12 bytes per parameter of this rank's
    /// slice, 81 GB for a 7B model on one GPU. A split state keeps its host vectors whole
    /// (the device part's stretch is what a checkpoint refreshes).
    pub fn release_host(&mut self) {
        if self.whole_on_device() {
            self.host.master = Vec::new();
            self.host.m = Vec::new();
            self.host.v = Vec::new();
        }
    }

    /// The flat length the (ZeRO-1) gradient buffer must have: `Σ W·L_u`.
    pub fn padded_len(&self) -> usize {
        self.part.padded_len()
    }

    /// Bytes of optimizer state this rank holds on the device and on the host.
    pub fn resident_bytes(&self) -> (usize, usize) {
        let host = 4 * (self.host.master.len() + self.host.m.len() + self.host.v.len());
        (if self.device.is_some() { 12 * self.dev_len() } else { 0 }, host)
    }

    /// This rank's slice of the summed gradient from a padded flat buffer (ZeRO-1):
    /// reduce-scattered unit by unit.
    pub fn reduce(&self, comm: &Arc<dyn Comm>, grads: &GradBuffer) -> Result<Tensor> {
        self.check(comm)?;
        if grads.flat().elem_count() != self.padded_len() {
            return Err(Error::Setting(format!(
                "gradient buffer of {} elements for an optimizer over {} (make it with `padded_len`)",
                grads.flat().elem_count(),
                self.padded_len()
            )));
        }
        let (w, flat) = (self.part.world, grads.flat());
        if w == 1 {
            return Ok(flat.clone());
        }
        let mut mine = Vec::with_capacity(self.part.units.len());
        for unit in &self.part.units {
            let parts =
                (0..w).map(|i| flat.narrow(0, unit.padded_off + i * unit.shard, unit.shard)).collect::<candle_core::Result<Vec<_>>>()?;
            mine.push(comm.reduce_scatter_sum(parts)?);
        }
        Ok(if mine.len() == 1 { mine.remove(0) } else { Tensor::cat(&mine, 0)? })
    }

    /// One optimizer step over this rank's gradient slice `gshard [Σ L_u]` f32 — see the
    /// module doc. `clip <= 0` disables clipping. The new weights go to `out` (in `dtype`;
    /// the model's on `device`).
    pub fn step(
        &mut self,
        comm: &Arc<dyn Comm>,
        src: &GradSource<'_>,
        out: Out<'_>,
        lr: f64,
        clip: f64,
        (dtype, device): (DType, &Device),
    ) -> Result<StepStats> {
        self.check_source(comm, src)?;
        let gshard = src.device_part();
        if let Out::Params(p) = &out {
            if p.len() != self.part.sizes.len() {
                return Err(Error::Setting(format!("{} parameters for an optimizer over {}", p.len(), self.part.sizes.len())));
            }
        }
        let (grad_norm, coef) = self.norm_and_clip_src(comm, src, clip)?;
        let Some(coef) = coef else {
            return Ok(StepStats { grad_norm, skipped: true });
        };
        // 3. Clip and update; 4. the new weights in the run dtype.
        if self.whole_on_device() {
            self.host.step += 1;
            let mut out = out;
            let buf = self.device_update(gshard, &mut out, (lr, coef, self.host.step), dtype)?;
            self.gather_device_units(comm, buf, &out)?;
        } else {
            // The host's units (and first the device's, where the state is split).
            let k = self.host.begin_step(lr, coef as f32);
            self.host_update(comm, src, out, (k, lr, coef), (dtype, device))?;
        }
        Ok(StepStats { grad_norm, skipped: false })
    }

    /// Step 2: the global norm of the gradient slices, and the clip factor. `None`: the
    /// norm is not finite, the same value on every rank, so all skip this update together
    /// (the trainer counts it and aborts after too many in a row).
    fn norm_and_clip(&self, comm: &Arc<dyn Comm>, gshard: &Tensor, clip: f64) -> Result<(f64, Option<f64>)> {
        self.norm_and_clip_of(comm, sum_sq(gshard)?, gshard.device(), clip)
    }

    /// [`Self::norm_and_clip`] of a gradient source (with the gradients in host memory:
    /// the device units' prefix and the host units' sums of squares).
    fn norm_and_clip_src(&self, comm: &Arc<dyn Comm>, src: &GradSource<'_>, clip: f64) -> Result<(f64, Option<f64>)> {
        match src {
            GradSource::Device(g) => self.norm_and_clip(comm, g, clip),
            GradSource::Host { prefix, grads } => self.norm_and_clip_of(comm, sum_sq(prefix)? + grads.host_sumsq()?, prefix.device(), clip),
        }
    }

    /// [`Self::norm_and_clip`] from this rank's `Σ x²` (`local`).
    fn norm_and_clip_of(&self, comm: &Arc<dyn Comm>, local: f64, device: &Device, clip: f64) -> Result<(f64, Option<f64>)> {
        let grad_norm = if self.part.world > 1 { all_reduce_scalar(comm, local, device)? } else { local }.sqrt();
        if !grad_norm.is_finite() {
            return Ok((grad_norm, None));
        }
        Ok((grad_norm, Some(if clip > 0.0 && grad_norm > clip { clip / (grad_norm + 1e-6) } else { 1.0 })))
    }

    /// Steps 1–2 of a host update whose AdamW pass runs later, unit by unit
    /// ([`Self::advance`]): ZeRO-3 with the weights and the optimizer state both in host
    /// memory, where nothing of the update goes back to the GPU. The trainer applies unit
    /// `u` just before the next step's forward needs its weights, so the pass runs while
    /// the GPU computes the layers before it. The result is exactly [`Self::step`]'s.
    /// `None` with the stats: the update is skipped (non-finite norm).
    pub fn begin_deferred(
        &mut self,
        comm: &Arc<dyn Comm>,
        src: &GradSource<'_>,
        lr: f64,
        clip: f64,
    ) -> Result<(StepStats, Option<Deferred>)> {
        self.check_source(comm, src)?;
        if self.whole_on_device() {
            return Err(Error::Setting("a deferred update needs the optimizer state in host memory".into()));
        }
        let (grad_norm, coef) = self.norm_and_clip_src(comm, src, clip)?;
        let Some(coef) = coef else {
            return Ok((StepStats { grad_norm, skipped: true }, None));
        };
        let k = self.host.begin_step(lr, coef as f32);
        let d = Deferred::new(k, (lr, coef, self.host.step));
        Ok((StepStats { grad_norm, skipped: false }, Some(d)))
    }

    /// Apply a deferred update ([`Self::begin_deferred`]) to every unit up to `upto`
    /// (inclusive; units before it that are not yet applied first), writing the new weights
    /// into this rank's host shard `out`. The gradient pieces of the next
    /// [`DEFER_LOOKAHEAD`] units start their copies to host memory first, so they arrive
    /// while this unit is updated; `unit_done(u)` is called once unit `u`'s gradient has
    /// been read (its slice may then be overwritten).
    ///
    /// A split state's device units are applied all at once, first, on the device: their
    /// new weights into `resident` (the store's prefix of them kept on the device, in
    /// place), or without one into `out`.
    pub fn advance(
        &mut self,
        d: &mut Deferred,
        upto: usize,
        src: &GradSource<'_>,
        (mut out, resident): (HostWeightsMut<'_>, Option<&Tensor>),
        mut unit_done: impl FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let gshard = src.device_part();
        if self.device.is_some() && d.next < self.dev_units {
            // The units whose state is on the device, all at once (a few milliseconds), their
            // new weights checked where they were written (one reduction).
            if d.poison {
                // Fault injection: this update's first weight goes NaN.
                if let Some(dv) = &self.device {
                    dv.master.slice_set(&Tensor::new(&[f32::NAN], dv.master.device())?, 0, 0)?;
                }
            }
            let (n, dtype) = (self.dev_len(), out.dtype());
            let mut target = match resident {
                Some(t) if t.elem_count() == n => Out::Shard(t),
                Some(t) => {
                    return Err(Error::Setting(format!(
                        "split optimizer: {} device weights for {n} elements of device state",
                        t.elem_count()
                    )))
                }
                None => Out::HostShard(out.reborrow()),
            };
            let written = self.device_update(gshard, &mut target, d.hp, dtype)?;
            d.finite &= written.map_or(Ok(true), |b| crate::guard::finite_flags(&[b]).map(|f| f.iter().all(|ok| *ok)))?;
            for u in d.next..self.dev_units {
                unit_done(u)?;
            }
            d.next = self.dev_units;
            d.parked_to = d.parked_to.max(self.dev_units);
        }
        match &mut out {
            HostWeightsMut::BF16(v) => self.advance_as(d, upto, src, v, &mut unit_done),
            HostWeightsMut::F16(v) => self.advance_as(d, upto, src, v, &mut unit_done),
            HostWeightsMut::F32(v) => self.advance_as(d, upto, src, v, &mut unit_done),
        }
    }

    fn advance_as<P: HostElem>(
        &mut self,
        d: &mut Deferred,
        upto: usize,
        src: &GradSource<'_>,
        out: &mut [P],
        unit_done: &mut dyn FnMut(usize) -> Result<()>,
    ) -> Result<()> {
        let units = self.part.units.len();
        if out.len() != self.shard_len {
            return Err(Error::Setting(format!(
                "host weight shard of {} elements for an optimizer shard of {}",
                out.len(),
                self.shard_len
            )));
        }
        // Copies outrun the update by a few units: the views stay valid (the gradient is
        // not touched until `unit_done`), so nothing needs the compute stream to wait.
        self.stash.set_max_pending(usize::MAX);
        if d.poison && d.next == 0 && self.device.is_none() {
            if let Some(w) = self.host.master.first_mut() {
                *w = f32::NAN; // fault injection: this update's first weight goes NaN
            }
        }
        let gshard = match src {
            GradSource::Device(g) => *g,
            GradSource::Host { grads: take, .. } => {
                // Each unit's slice is in host memory already: read in place, whole.
                while d.next <= upto.min(units.saturating_sub(1)) && d.next < units {
                    let u = d.next;
                    let unit = &self.part.units[u];
                    let g = take.take_unit(u)?;
                    let (lo, host, k) = (unit.shard_off, &mut self.host, &d.k);
                    d.finite &= g.with_host_f32(|g| host.apply_range(k, lo, g, Some(&mut out[lo..lo + g.len()])))?;
                    drop(g); // its pinned buffer back to the pool
                    unit_done(u)?;
                    d.next += 1;
                }
                return Ok(());
            }
        };
        while d.next <= upto.min(units.saturating_sub(1)) && d.next < units {
            let u = d.next;
            while d.parked_to < units && d.parked_to <= u + DEFER_LOOKAHEAD {
                let unit = &self.part.units[d.parked_to];
                for (at, len) in host_pieces(unit.shard) {
                    let piece = self.stash.park(&gshard.narrow(0, unit.shard_off + at, len)?)?;
                    d.parked.push_back((d.parked_to, unit.shard_off + at, len, piece));
                }
                d.parked_to += 1;
            }
            while d.parked.front().is_some_and(|p| p.0 == u) {
                let (_, lo, len, piece) = d.parked.pop_front().ok_or_else(|| Error::Setting("deferred update: piece missing".into()))?;
                let host = &mut self.host;
                let k = &d.k;
                d.finite &= piece.with_host_f32(|g| host.apply_range(k, lo, g, Some(&mut out[lo..lo + len])))?;
            }
            unit_done(u)?;
            d.next += 1;
        }
        Ok(())
    }

    /// This rank's communicator and a gradient source of this shard's layout: the whole
    /// slice, or (gradients in host memory) the device units' prefix.
    fn check_source(&self, comm: &Arc<dyn Comm>, src: &GradSource<'_>) -> Result<()> {
        match src {
            GradSource::Device(g) => self.check_slice(comm, g),
            GradSource::Host { prefix, .. } => {
                self.check(comm)?;
                if prefix.elem_count() != self.dev_len() {
                    return Err(Error::Setting(format!(
                        "gradients in host memory from unit {}, but the optimizer keeps {} unit(s) on the device ({} elements, got {})",
                        self.dev_units,
                        self.dev_units,
                        self.dev_len(),
                        prefix.elem_count()
                    )));
                }
                Ok(())
            }
        }
    }

    /// This rank's communicator and a gradient slice of this shard's length.
    fn check_slice(&self, comm: &Arc<dyn Comm>, gshard: &Tensor) -> Result<()> {
        self.check(comm)?;
        if gshard.elem_count() != self.shard_len {
            return Err(Error::Setting(format!("gradient slice of {} elements for a shard of {}", gshard.elem_count(), self.shard_len)));
        }
        Ok(())
    }

    fn check(&self, comm: &Arc<dyn Comm>) -> Result<()> {
        if self.part.world == 1 {
            return Ok(()); // one rank, or every rank the whole state (stage 0)
        }
        if comm.world() != self.part.world || comm.rank() != self.part.rank {
            return Err(Error::Setting(format!(
                "optimizer sharded for rank {} of {} used with rank {} of {}",
                self.part.rank,
                self.part.world,
                comm.rank(),
                comm.world()
            )));
        }
        Ok(())
    }

    /// The device update of the units whose state is on the device (all of them, or the
    /// first ones of a split state): one kernel per parameter's part of the shard, each
    /// writing its new weights straight into the model (one rank), into the parameter shard
    /// (ZeRO-3), or into a buffer that is then all-gathered (several ranks) or copied to
    /// the host shard. `step`: the step number, already counted. Returns the buffer the new
    /// weights went to (`[prefix]` on the device; `None`: the model's own weights, one
    /// rank); with several ranks and the model's weights as the output the caller
    /// all-gathers it ([`gather_into`]).
    fn device_update(
        &mut self,
        gshard: &Tensor,
        out: &mut Out<'_>,
        (lr, coef, step): (f64, f64, u64),
        dtype: DType,
    ) -> Result<Option<Tensor>> {
        let n = self.dev_len();
        let part = &self.part;
        let (rank, w) = (part.rank, part.world);
        let buf = match (&*out, w) {
            (Out::Params(_), 1) => None,
            (Out::Params(_), _) => Some(Tensor::zeros(n, dtype, gshard.device())?),
            // Written in place, or (a shard in host memory) through a device buffer.
            (Out::Shard(s), _) if s.device().same_device(gshard.device()) => Some(s.narrow(0, 0, n)?),
            (Out::Shard(_) | Out::HostShard(_), _) => Some(Tensor::zeros(n, dtype, gshard.device())?),
        };
        let mut segs = Vec::new();
        for u in 0..self.dev_units {
            for (p, x, start) in part.parts(u, rank) {
                let copy = match (&buf, &*out) {
                    (Some(buf), _) => buf.narrow(0, start, x.len())?,
                    // A view: writes reach the model.
                    (None, Out::Params(params)) => params[p].1.as_tensor().flatten_all()?.narrow(0, x.start - part.offsets[p], x.len())?,
                    (None, Out::Shard(_) | Out::HostShard(_)) => unreachable!("a shard output always has a buffer"),
                };
                segs.push(Segment { start, len: x.len(), decay: self.decays[p], copy: Some(copy) });
            }
        }
        let d = self.device.as_mut().ok_or_else(|| Error::Setting("device optimizer missing".into()))?;
        d.update_at(&self.host.cfg, step, &gshard.narrow(0, 0, n)?, lr, coef, &segs)?;
        match (&buf, out) {
            (Some(buf), Out::Shard(s)) if !s.device().same_device(buf.device()) => s.slice_set(&buf.to_device(s.device())?, 0, 0)?,
            (Some(buf), Out::HostShard(h)) => {
                let dev = buf.device().clone();
                match h {
                    HostWeightsMut::BF16(v) => self.stash.download(buf, &mut v[..n], &dev)?,
                    HostWeightsMut::F16(v) => self.stash.download(buf, &mut v[..n], &dev)?,
                    HostWeightsMut::F32(v) => self.stash.download(buf, &mut v[..n], &dev)?,
                }
            }
            _ => {}
        }
        Ok(buf)
    }

    /// The model's weights of the device units from every rank's new slices `buf` (several
    /// ranks; one rank's were written in place).
    fn gather_device_units(&self, comm: &Arc<dyn Comm>, buf: Option<Tensor>, out: &Out<'_>) -> Result<()> {
        match (buf, out) {
            (Some(buf), Out::Params(params)) => gather_into(comm, &self.part, self.dev_units, &buf, params),
            _ => Ok(()),
        }
    }

    /// The host update, piece by piece (at most [`HOST_PIECE`] elements, within a unit):
    /// each gradient piece copied into pinned host memory while the piece before is
    /// updated, AdamW over it on every core with the new weights written in the run dtype
    /// in the same pass, straight into the parameter shard in host memory (ZeRO-3 with
    /// `offload_params`: nothing goes back to the device), or from a reused buffer into the
    /// shard on the device, the model's weights (one rank), or a unit buffer all-gathered
    /// when the unit is done. Host memory beyond the state: two gradient pieces and one of
    /// weights, never a copy of the whole gradient.
    ///
    /// A split state's device units are updated first, on the device ([`Self::device_update`]),
    /// the host pass then starts at the first unit of the host's part. `k`: the step's
    /// scalars (the step already counted), with its `lr` and clip factor `coef`.
    fn host_update(
        &mut self,
        comm: &Arc<dyn Comm>,
        src: &GradSource<'_>,
        mut out: Out<'_>,
        (k, lr, coef): (StepConsts, f64, f64),
        (dtype, device): (DType, &Device),
    ) -> Result<()> {
        if let Out::HostShard(h) = out {
            // Weights and state both on the host: the deferred pass, applied at once.
            let mut d = Deferred::new(k, (lr, coef, self.host.step));
            return self.advance(&mut d, usize::MAX, src, (h, None), |_| Ok(()));
        }
        if self.device.is_some() {
            let buf = self.device_update(src.device_part(), &mut out, (lr, coef, self.host.step), dtype)?;
            self.gather_device_units(comm, buf, &out)?;
        }
        match dtype {
            DType::BF16 => self.host_pass::<half::bf16>(comm, src, out, &k, device),
            DType::F16 => self.host_pass::<half::f16>(comm, src, out, &k, device),
            DType::F32 => self.host_pass::<f32>(comm, src, out, &k, device),
            other => Err(Error::Setting(format!("host optimizer: weights of dtype {other:?} are not supported"))),
        }
    }

    /// The host's units (from [`Self::device_units`] on), piece by piece; with the
    /// gradients in host memory already, unit by unit, each read in place.
    fn host_pass<P: HostElem>(
        &mut self,
        comm: &Arc<dyn Comm>,
        src: &GradSource<'_>,
        out: Out<'_>,
        k: &StepConsts,
        device: &Device,
    ) -> Result<()> {
        let part = self.part.clone();
        let host_grads = match src {
            GradSource::Device(_) => None,
            GradSource::Host { grads, .. } => Some(*grads),
        };
        // (unit, offset in the unit's slice, length), in order.
        let pieces: Vec<(usize, usize, usize)> = part
            .units
            .iter()
            .enumerate()
            .skip(self.dev_units)
            .flat_map(|(u, unit)| {
                match host_grads {
                    None => host_pieces(unit.shard).collect::<Vec<_>>(),
                    Some(_) => vec![(0, unit.shard)],
                }
                .into_iter()
                .map(move |(at, len)| (u, at, len))
            })
            .collect();
        let mut stash = std::mem::take(&mut self.stash);
        stash.set_max_pending(2);
        let gshard = src.device_part();
        let park = |stash: &mut Stash, (u, at, len): (usize, usize, usize)| -> Result<_> {
            match host_grads {
                None => Ok(stash.park(&gshard.narrow(0, part.units[u].shard_off + at, len)?)?),
                Some(g) => g.take_unit(u),
            }
        };
        let mut buf: Vec<P> = Vec::new(); // the new weights of a piece bound for the device
        let mut gather_buf: Option<Tensor> = None;
        let mut next = pieces.first().map(|&p| park(&mut stash, p)).transpose()?;
        for (i, &(u, at, len)) in pieces.iter().enumerate() {
            let cur = next.take().ok_or_else(|| Error::Setting("host optimizer: piece missing".into()))?;
            if let Some(&p) = pieces.get(i + 1) {
                next = Some(park(&mut stash, p)?); // its copy runs while this piece is updated
            }
            let unit = &part.units[u];
            let lo = unit.shard_off + at;
            let host = &mut self.host;
            buf.resize(len, P::from_f32(0.0));
            cur.with_host_f32(|g| host.apply_range(k, lo, g, Some(&mut buf[..len])))?;
            match &out {
                Out::Shard(s) => s.slice_set(&Tensor::from_slice(&buf[..len], len, s.device())?, 0, lo)?,
                Out::Params(_) if part.world > 1 => {
                    if at == 0 {
                        gather_buf = Some(Tensor::zeros(unit.shard, P::DTYPE, device)?);
                    }
                    let g = gather_buf.as_ref().ok_or_else(|| Error::Setting("host optimizer: gather buffer".into()))?;
                    g.slice_set(&Tensor::from_slice(&buf[..len], len, device)?, 0, at)?;
                    if at + len == unit.shard {
                        // The unit is complete: all-gather it into the weights.
                        if let Out::Params(params) = &out {
                            gather_unit(comm, &part, u, g, params)?;
                        }
                        gather_buf = None;
                    }
                }
                Out::Params(params) => {
                    // One rank: the piece's weights straight into the parameters it covers.
                    let new = Tensor::from_slice(&buf[..len], len, device)?;
                    for (p, x, start) in part.parts(u, part.rank) {
                        let (a, b) = (start.max(lo), (start + x.len()).min(lo + len));
                        if a < b {
                            let flat = params[p].1.as_tensor().flatten_all()?; // a view of the weight
                            flat.slice_set(&new.narrow(0, a - lo, b - a)?, 0, x.start - part.offsets[p] + (a - start))?;
                        }
                    }
                }
                Out::HostShard(_) => unreachable!("handled by `host_update`"),
            }
        }
        self.stash = stash;
        Ok(())
    }

    /// Page-lock ahead, in `dev`'s stash pool, the host buffers the host update's gradient
    /// pieces will take at its peak ([`Self::pinned_piece_bytes`]), so the first update
    /// does not pay for page-locking (about 0.85 s of the 7B shape's second step, 2.9 GB).
    /// Nothing to do with the state on the device or off CUDA.
    pub fn reserve_pinned(&mut self, dev: &Device, deferred: bool) -> Result<()> {
        if self.whole_on_device() || !dev.is_cuda() {
            return Ok(());
        }
        Ok(self.stash.reserve(dev, &self.pinned_piece_bytes(deferred))?)
    }

    /// Byte sizes of the f32 gradient pieces the host update holds in host memory at once,
    /// at most ([`peak_pieces`] of this rank's unit slices whose state is on the host).
    pub fn pinned_piece_bytes(&self, deferred: bool) -> Vec<usize> {
        let shards: Vec<usize> = self.part.units.iter().skip(self.dev_units).map(|u| u.shard).collect();
        let pieces = peak_pieces(&shards, HOST_PIECE, deferred);
        pieces.into_iter().flat_map(|(len, k)| std::iter::repeat_n(len * std::mem::size_of::<f32>(), k)).collect()
    }

    /// Refresh the host copy of a device-resident state (before a checkpoint).
    pub fn sync_to_host(&mut self) -> Result<()> {
        if let Some(d) = &self.device {
            d.to_host(&mut self.host)?;
        }
        Ok(())
    }

    /// The host state of this rank's slice, as a checkpoint writes it (call
    /// [`Self::sync_to_host`] first).
    pub fn shard(&self) -> OptimShard<'_> {
        OptimShard { master: &self.host.master, m: &self.host.m, v: &self.host.v }
    }

    /// Fresh AdamW state: moments zero, step counter 0; the f32 master weights are kept
    /// (a stage with `reset_optimizer`, like a new optimizer over the same weights).
    pub fn reset(&mut self) -> Result<()> {
        self.sync_to_host()?;
        self.host.m.fill(0.0);
        self.host.v.fill(0.0);
        self.host.step = 0;
        if let Some(d) = &self.device {
            let dev = d.master.device().clone();
            self.device = Some(DeviceAdamW::from_host_prefix(&self.host, self.dev_len(), &dev)?);
        }
        self.release_host();
        Ok(())
    }

    /// The state lives in host memory (the host update), all of it or (a split state)
    /// all but the first units'.
    pub fn on_host(&self) -> bool {
        !self.whole_on_device()
    }

    /// AdamW steps taken.
    pub fn steps(&self) -> u64 {
        self.host.step
    }
}

/// [`ShardedAdamW::new`]'s `units` for a state wholly on the device.
pub const ALL_UNITS: usize = usize::MAX;

/// Elements the host optimizer updates at a time (64 Mi: 256 MiB of gradient).
pub const HOST_PIECE: usize = 1 << 26;

/// A unit slice of `len` elements as the host update's pieces: `(offset, length)`, each at
/// most [`HOST_PIECE`], in order.
fn host_pieces(len: usize) -> impl Iterator<Item = (usize, usize)> {
    pieces_of(len, HOST_PIECE)
}

fn pieces_of(len: usize, piece: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len).step_by(piece.max(1)).map(move |at| (at, piece.min(len - at)))
}

/// The gradient pieces (at most `piece` elements, cut per unit slice of `shards`) a host
/// update holds in host memory at once, at most, as `(length, how many)` sorted by length:
/// a deferred update ([`ShardedAdamW::advance`]) parks the pieces of units
/// `u ..= u + DEFER_LOOKAHEAD` before it applies unit `u`; the whole update
/// ([`ShardedAdamW::host_update`]) holds a piece and the next. Per length, the most of it any
/// such window holds. Counted from each slice's full pieces and rest, never piece by piece
/// (the planner asks about any size).
pub fn peak_pieces(shards: &[usize], piece: usize, deferred: bool) -> Vec<(usize, usize)> {
    let piece = piece.max(1);
    // A slice's pieces as runs `(length, count)`: the full ones, then the rest.
    let runs = |s: usize| [(piece, s / piece), (s % piece, 1)].into_iter().filter(|&(len, k)| len > 0 && k > 0);
    let mut most = std::collections::BTreeMap::<usize, usize>::new();
    let mut keep = |window: &mut dyn Iterator<Item = (usize, usize)>| {
        let mut here = std::collections::BTreeMap::<usize, usize>::new();
        for (len, k) in window {
            *here.entry(len).or_default() += k;
        }
        for (len, k) in here {
            let m = most.entry(len).or_default();
            *m = (*m).max(k);
        }
    };
    if deferred {
        for u in 0..shards.len() {
            keep(&mut shards[u..=(u + DEFER_LOOKAHEAD).min(shards.len() - 1)].iter().flat_map(|&s| runs(s)));
        }
    } else {
        let all: Vec<(usize, usize)> = shards.iter().flat_map(|&s| runs(s)).collect();
        match all.as_slice() {
            [(len, 1)] => keep(&mut std::iter::once((*len, 1))), // one piece in all
            _ => {
                // Two in a row: inside a run, or the last of one run and the first of the next.
                for &(len, k) in all.iter().filter(|r| r.1 >= 2) {
                    keep(&mut std::iter::once((len, 2.min(k))));
                }
                for w in all.windows(2) {
                    keep(&mut [(w[0].0, 1), (w[1].0, 1)].into_iter());
                }
            }
        }
    }
    most.into_iter().collect()
}

/// Units whose gradient copies a deferred update starts ahead of the one it applies
/// (a 7B layer is 0.8 GB of f32 gradient: three units in flight hold 2.4 GB of pinned
/// memory). Two: the copy of a unit waits for the compute queued before it, so one unit
/// ahead would make the update wait for the GPU's previous layer.
pub const DEFER_LOOKAHEAD: usize = 2;

/// A host update begun by [`ShardedAdamW::begin_deferred`] and applied unit by unit by
/// [`ShardedAdamW::advance`].
pub struct Deferred {
    k: crate::train::optim::StepConsts,
    /// Learning rate, clip factor and step number (counted): what a split state's device
    /// part is updated with.
    hp: (f64, f64, u64),
    /// Units `< next` are applied.
    next: usize,
    /// Units `< parked_to` have their gradient pieces parked (or applied).
    parked_to: usize,
    /// (unit, offset in the shard, length, the piece on its way to host memory), in order.
    parked: VecDeque<(usize, usize, usize, longctx_attention::stash::Parked)>,
    /// Every new weight written so far is finite.
    finite: bool,
    /// Fault injection: make this rank's first master weight NaN before the first unit.
    poison: bool,
}

impl Deferred {
    fn new(k: crate::train::optim::StepConsts, hp: (f64, f64, u64)) -> Self {
        Self { k, hp, next: 0, parked_to: 0, parked: VecDeque::new(), finite: true, poison: false }
    }

    /// Every unit is applied.
    pub fn is_done(&self, units: usize) -> bool {
        self.next >= units
    }

    /// Unit `u` holds its new weights.
    pub fn applied(&self, u: usize) -> bool {
        u < self.next
    }

    /// Every new weight written was finite (the guard of an applied update).
    pub fn all_finite(&self) -> bool {
        self.finite
    }

    /// Fault injection (the trainer's `Fault::NanWeights`): this update writes a NaN weight.
    pub fn poison(&mut self) {
        self.poison = true;
    }
}

/// All-gather every rank's new slice `shard` (run dtype; `[Σ L_u]` of the first `units`
/// units at least) unit by unit and write the weights of those units into the parameters.
fn gather_into(comm: &Arc<dyn Comm>, part: &Partition, units: usize, shard: &Tensor, params: &[(String, Var)]) -> Result<()> {
    for (u, unit) in part.units.iter().enumerate().take(units) {
        gather_unit(comm, part, u, &shard.narrow(0, unit.shard_off, unit.shard)?, params)?;
    }
    Ok(())
}

/// All-gather unit `u` from every rank's new slice `mine [L_u]` and write its weights.
fn gather_unit(comm: &Arc<dyn Comm>, part: &Partition, u: usize, mine: &Tensor, params: &[(String, Var)]) -> Result<()> {
    let full = if part.world > 1 { Tensor::cat(&comm.all_gather(mine)?, 0)? } else { mine.clone() };
    for (p, t) in part.split_unit(u, &full)? {
        let v = &params[p].1;
        v.set(&t.reshape(v.as_tensor().shape())?)?;
    }
    Ok(())
}

/// `Σ x²` of a flat f32 tensor, in f64, over the whole GPU and without a temporary
/// (`longctx_kernels::sum_squares`; deterministic run to run).
fn sum_sq(t: &Tensor) -> Result<f64> {
    Ok(longctx_kernels::sum_squares(&t.contiguous()?)?)
}

/// Elements `[lo, hi)` of `params` flattened in order, as f32, into `out` (`hi - lo`
/// long). Converts only the parameters that overlap the range (no full flat copy).
fn flat_range_into(params: &[&Tensor], lo: usize, hi: usize, out: &mut [f32]) -> Result<()> {
    use rayon::prelude::*;
    let mut off = 0;
    let mut rest = out;
    for t in params {
        let n = t.elem_count();
        let (a, b) = (lo.max(off), hi.min(off + n));
        if a < b {
            let (dst, tail) = rest.split_at_mut(b - a);
            rest = tail;
            let t = t.flatten_all()?.narrow(0, a - off, b - a)?.to_dtype(DType::F32)?.to_device(&Device::Cpu)?.contiguous()?;
            let (st, layout) = t.storage_and_layout();
            match &*st {
                // Straight from the host tensor, in parallel (no intermediate vector).
                candle_core::Storage::Cpu(cs) => {
                    let src = &cs.as_slice::<f32>()?[layout.start_offset()..layout.start_offset() + (b - a)];
                    dst.par_chunks_mut(1 << 20).zip(src.par_chunks(1 << 20)).for_each(|(d, s)| d.copy_from_slice(s));
                }
                _ => return Err(Error::Setting("optimizer start: a host tensor was expected".into())),
            }
        }
        off += n;
    }
    Ok(())
}

/// Sum of a scalar over ranks, in f64, through a one-element tensor on `device` (NCCL
/// needs device memory).
pub fn all_reduce_scalar(comm: &Arc<dyn Comm>, x: f64, device: &Device) -> Result<f64> {
    if comm.world() == 1 {
        return Ok(x);
    }
    let t = Tensor::new(&[x], device)?;
    Ok(comm.all_reduce_sum(&t)?.to_device(&Device::Cpu)?.to_vec1::<f64>()?[0])
}

/// How many ranks raise `mine`, all-reduced, for a check every rank makes at once (a
/// non-finite shard, an output directory it cannot see). A rank that raises it answers at
/// least 1 even when the all-reduce fails, so that it reports its own finding: another rank
/// that saw the count first may already have aborted the world, and the all-reduce then
/// errors with that rank's reason instead of this one's.
pub fn ranks_flagging(comm: &Arc<dyn Comm>, mine: bool, device: &Device) -> Result<f64> {
    match all_reduce_scalar(comm, f64::from(u8::from(mine)), device) {
        Ok(n) => Ok(n),
        Err(_) if mine => Ok(1.0),
        Err(e) => Err(e),
    }
}

/// Reading optimizer state back for a partition: the zero side of a checkpoint (the
/// checkpoint module knows the files, this one the partition that cut them).
impl Loaded {
    /// Elements `[lo, hi)` of the flat f32 `(master, m, v)` over `n_params` parameters, read
    /// from the shard files that hold them, whatever partition and world size wrote them
    /// (shard `d` holds slice `d` of every unit); zero past `n_params`.
    pub fn optimizer_range(&self, n_params: usize, lo: usize, hi: usize) -> Result<(Vec<f32>, Vec<f32>, Vec<f32>)> {
        let shards = self.state.optimizer_shards.max(1);
        let lens = if self.state.optimizer_units.is_empty() { vec![n_params] } else { self.state.optimizer_units.clone() };
        let part = Partition::from_lens(&lens, shards)?;
        if part.n() != n_params {
            return Err(Error::checkpoint(
                self.dir.join("state.json"),
                format!("optimizer state over {} parameters, the model has {n_params}: this checkpoint is of another model", part.n()),
            ));
        }
        let shard_len = part.shard_len();
        let (mut w, mut m, mut v) = (Vec::with_capacity(hi - lo), Vec::with_capacity(hi - lo), Vec::with_capacity(hi - lo));
        let end = hi.min(n_params);
        // Pieces in increasing flat order: unit by unit, shard by shard.
        let mut files: std::collections::HashMap<usize, crate::hub::st_file::SafetensorsFile> = HashMap::new();
        for (u, unit) in part.units.iter().enumerate() {
            for d in 0..shards {
                let piece = part.piece(u, d);
                let (a, b) = (piece.start.max(lo), piece.end.min(end));
                if a >= b {
                    continue;
                }
                if let std::collections::hash_map::Entry::Vacant(slot) = files.entry(d) {
                    let mut p = self.dir.join(crate::train::checkpoint::shard_name(d));
                    let older = self.dir.join(format!("optimizer-dp{d}.safetensors"));
                    if !p.exists() && older.exists() {
                        p = older;
                    }
                    // Memory-mapped: only the range's bytes are read, not the whole shard.
                    slot.insert(crate::hub::st_file::SafetensorsFile::open(&p)?);
                }
                let f = &files[&d];
                let p = self.dir.join(crate::train::checkpoint::shard_name(d));
                let at = unit.shard_off + (a - piece.start);
                for (name, out) in [("master", &mut w), ("m", &mut m), ("v", &mut v)] {
                    let e = f.entry(name).ok_or_else(|| Error::checkpoint(&p, format!("tensor `{name}` missing")))?;
                    if e.dtype != "F32" || e.shape != [shard_len] {
                        return Err(Error::checkpoint(
                            &p,
                            format!(
                                "`{name}` is {} {:?}, expected F32 [{shard_len}] ({n_params} parameters in {shards} shards)",
                                e.dtype, e.shape
                            ),
                        ));
                    }
                    let bytes = f.bytes(name).ok_or_else(|| Error::checkpoint(&p, format!("tensor `{name}` missing")))?;
                    let from = out.len();
                    out.extend(bytes[at * 4..(at + b - a) * 4].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])));
                    check_optimizer_values(&p, name, &out[from..], at)?;
                }
            }
        }
        for x in [&mut w, &mut m, &mut v] {
            x.resize(hi - lo, 0.0);
        }
        Ok((w, m, v))
    }
}

/// Values of optimizer tensor `name` read from `file` (from element `at` of its shard):
/// finite, and a second moment never negative; else the checkpoint is damaged.
fn check_optimizer_values(file: &std::path::Path, name: &str, xs: &[f32], at: usize) -> Result<()> {
    let bad = xs.iter().position(|x| !x.is_finite() || (name == "v" && *x < 0.0));
    match bad {
        None => Ok(()),
        Some(i) => Err(crate::train::checkpoint::damaged(file, &format!("element {} of the optimizer's `{name}` is {}", at + i, xs[i]))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use longctx_attention::comm::thread::run_ranks;

    /// A rank's own finding survives another rank's abort: with the world aborted first, the
    /// flagging rank still counts itself and the other gets the abort's error.
    #[test]
    fn a_flagging_rank_counts_itself_after_an_abort() {
        // a world that runs: every rank gets the count
        let counts =
            run_ranks(3, |c| ranks_flagging(&c, c.rank() != 1, &Device::Cpu).map_err(|e| candle_core::Error::Msg(e.to_string()))).unwrap();
        assert_eq!(counts, [2.0, 2.0, 2.0]);
        // rank 0 aborted the world on its own finding before the others all-reduced
        let comms = longctx_attention::comm::thread::ThreadComm::world(2);
        comms[0].abort("rank 0: its optimizer shard is not finite");
        assert_eq!(ranks_flagging(&comms[1], true, &Device::Cpu).unwrap(), 1.0);
        let err = ranks_flagging(&comms[1], false, &Device::Cpu).unwrap_err().to_string();
        assert!(err.contains("rank 0: its optimizer shard is not finite"), "{err}");
    }

    /// A unit's slice cut into host pieces: in order, none longer than `HOST_PIECE`, the
    /// last one the rest (the tests' units are all shorter than one piece).
    #[test]
    fn host_pieces_cover_a_slice_in_order() {
        assert_eq!(host_pieces(0).count(), 0);
        assert_eq!(host_pieces(5).collect::<Vec<_>>(), [(0, 5)]);
        assert_eq!(host_pieces(HOST_PIECE).collect::<Vec<_>>(), [(0, HOST_PIECE)]);
        let n = 2 * HOST_PIECE + 3;
        assert_eq!(host_pieces(n).collect::<Vec<_>>(), [(0, HOST_PIECE), (HOST_PIECE, HOST_PIECE), (2 * HOST_PIECE, 3)]);
    }

    /// The pinned buffers a host update takes at its peak, by hand: pieces of at most 4
    /// elements; deferred, three consecutive units' pieces at once; otherwise two pieces.
    #[test]
    fn peak_pieces_by_hand() {
        assert_eq!(DEFER_LOOKAHEAD, 2, "the cases below count three units in flight");
        // units of 9, 9, 2, 9 elements: pieces [4,4,1] [4,4,1] [2] [4,4,1]; windows of three
        // units hold 4 fours and 2 ones (units 0-2), one 2 at most, and (units 1-3) 4 fours.
        assert_eq!(peak_pieces(&[9, 9, 2, 9], 4, true), [(1, 2), (2, 1), (4, 4)]);
        // two pieces at once: (4,4) or (4,1) or (1,4), (1,2), (2,4)
        assert_eq!(peak_pieces(&[9, 9, 2, 9], 4, false), [(1, 1), (2, 1), (4, 2)]);
        // the same against every window listed piece by piece
        for shards in [&[9usize, 9, 2, 9][..], &[4, 4], &[1, 1, 1], &[8], &[0, 5, 0, 3], &[13, 2, 2, 7, 16]] {
            for deferred in [true, false] {
                assert_eq!(peak_pieces(shards, 4, deferred), by_windows(shards, 4, deferred), "{shards:?} {deferred}");
            }
        }
        // one unit, one piece; empty slices (a rank's share of a tiny unit) take nothing
        assert_eq!(peak_pieces(&[3], 4, true), [(3, 1)]);
        assert_eq!(peak_pieces(&[3], 4, false), [(3, 1)]);
        assert_eq!(peak_pieces(&[0, 0], 4, true), []);
        assert_eq!(peak_pieces(&[], 4, false), []);
        // the 7B shape's layer slice at one rank (202,383,360 elements), HOST_PIECE pieces:
        // three layers in flight, 9 full pieces and 3 of the rest.
        let layer = 202_383_360usize;
        assert_eq!(peak_pieces(&[layer; 32], HOST_PIECE, true), [(layer - 3 * HOST_PIECE, 3), (HOST_PIECE, 9)]);
        // a slice of 2^60 elements is counted, not cut (the planner asks about any size)
        assert_eq!(peak_pieces(&[1 << 60], HOST_PIECE, false), [(HOST_PIECE, 2)]);
    }

    /// [`peak_pieces`] the long way: every window's pieces listed one by one.
    fn by_windows(shards: &[usize], piece: usize, deferred: bool) -> Vec<(usize, usize)> {
        let of = |us: &[usize]| -> Vec<usize> { us.iter().flat_map(|&s| pieces_of(s, piece).map(|(_, len)| len)).collect() };
        let windows: Vec<Vec<usize>> = if deferred {
            (0..shards.len()).map(|u| of(&shards[u..=(u + DEFER_LOOKAHEAD).min(shards.len() - 1)])).collect()
        } else {
            let all = of(shards);
            all.windows(all.len().clamp(1, 2)).map(<[usize]>::to_vec).collect()
        };
        let mut most = std::collections::BTreeMap::<usize, usize>::new();
        for w in &windows {
            for &len in w {
                let k = w.iter().filter(|&&l| l == len).count();
                let m = most.entry(len).or_default();
                *m = (*m).max(k);
            }
        }
        most.into_iter().collect()
    }

    /// A deferred update applied unit by unit: the units reached so far hold their new
    /// weights and the rest their old ones, `unit_done` comes once per unit in order, and
    /// the finished update equals the optimizer-on-device step bit for bit (the same f32
    /// operations in the same order). A poisoned update reports a non-finite weight.
    #[test]
    fn a_deferred_update_applies_unit_by_unit_and_equals_the_step() {
        let sizes = [6usize, 10, 4];
        let meta: Vec<(String, Shape)> =
            vec![("a".into(), Shape::from((2, 3))), ("b".into(), Shape::from((2, 5))), ("c".into(), Shape::from(4))];
        let start: HashMap<String, Tensor> = meta
            .iter()
            .enumerate()
            .map(|(p, (n, sh))| {
                let v: Vec<f32> = (0..sh.elem_count()).map(|i| 0.1 * (p as f32 + 1.0) - 0.01 * i as f32).collect();
                (n.clone(), Tensor::from_vec(v, sh.clone(), &Device::Cpu).unwrap())
            })
            .collect();
        run_ranks(1, |comm| {
            deferred_case(&comm, &sizes, &meta, &start);
            Ok(())
        })
        .unwrap();
    }

    fn deferred_case(comm: &Arc<dyn Comm>, sizes: &[usize], meta: &[(String, Shape)], start: &HashMap<String, Tensor>) {
        let part = || Partition::new(sizes, vec![0..1, 1..2, 2..3], (0, 1)).unwrap();
        let grad: Vec<f32> = (0..20).map(|i| g(0, i % 3, i, 0)).collect();
        let gshard = Tensor::from_vec(grad, 20, &Device::Cpu).unwrap();
        let first: Vec<f32> = meta.iter().flat_map(|(n, _)| start[n].flatten_all().unwrap().to_vec1::<f32>().unwrap()).collect();
        let (lr, clip) = (1e-2, 0.5); // clipping active

        let mut host = ShardedAdamW::new(AdamWConfig::default(), meta, start, part(), None, None).unwrap();
        let mut out = first.clone();
        let (stats, d) = host.begin_deferred(comm, &GradSource::Device(&gshard), lr, clip).unwrap();
        let mut d = d.expect("a finite norm");
        assert!(!stats.skipped && stats.grad_norm > clip);
        let mut done = Vec::new();
        host.advance(&mut d, 1, &GradSource::Device(&gshard), (HostWeightsMut::F32(&mut out), None), |u| {
            done.push(u);
            Ok(())
        })
        .unwrap();
        assert_eq!(done, [0, 1]);
        assert!(out[..16].iter().zip(&first).all(|(a, b)| a != b), "units 0 and 1 are updated");
        assert_eq!(out[16..], first[16..], "unit 2 is not updated yet");
        assert!(!d.is_done(3));
        host.advance(&mut d, usize::MAX, &GradSource::Device(&gshard), (HostWeightsMut::F32(&mut out), None), |u| {
            done.push(u);
            Ok(())
        })
        .unwrap();
        assert_eq!(done, [0, 1, 2]);
        assert!(d.is_done(3) && d.all_finite());

        let mut dev = ShardedAdamW::new(AdamWConfig::default(), meta, start, part(), Some((&Device::Cpu, ALL_UNITS)), None).unwrap();
        let shard = Tensor::zeros(20, DType::F32, &Device::Cpu).unwrap();
        let st = dev.step(comm, &GradSource::Device(&gshard), Out::Shard(&shard), lr, clip, (DType::F32, &Device::Cpu)).unwrap();
        assert_eq!(st.grad_norm, stats.grad_norm);
        let want = shard.to_vec1::<f32>().unwrap();
        for (i, (a, b)) in out.iter().zip(&want).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "element {i}: deferred {a} vs step {b}");
        }

        for units in [1, 2] {
            // A split state: the first units' AdamW on the device (its CPU twin), all at once
            // when the forward first asks, their gradients then released; the same bits.
            let mut split = ShardedAdamW::new(AdamWConfig::default(), meta, start, part(), Some((&Device::Cpu, units)), None).unwrap();
            let mut got = first.clone();
            let (st, d) = split.begin_deferred(comm, &GradSource::Device(&gshard), lr, clip).unwrap();
            let mut d = d.expect("a finite norm");
            assert_eq!(st.grad_norm, stats.grad_norm);
            let mut done = Vec::new();
            split
                .advance(&mut d, 0, &GradSource::Device(&gshard), (HostWeightsMut::F32(&mut got), None), |u| {
                    done.push(u);
                    Ok(())
                })
                .unwrap();
            assert_eq!(done, (0..units).collect::<Vec<_>>(), "{units} unit(s) on the device, applied together");
            split.advance(&mut d, usize::MAX, &GradSource::Device(&gshard), (HostWeightsMut::F32(&mut got), None), |_| Ok(())).unwrap();
            assert!(d.is_done(3) && d.all_finite());
            for (i, (a, b)) in got.iter().zip(&out).enumerate() {
                assert_eq!(a.to_bits(), b.to_bits(), "{units} unit(s) on the device, element {i}: {a} vs the host's {b}");
            }
            // A checkpoint's copy of the state is the host run's.
            split.sync_to_host().unwrap();
            assert_eq!(
                (split.host.master.clone(), split.host.m.clone(), split.host.v.clone()),
                (host.host.master.clone(), host.host.m.clone(), host.host.v.clone())
            );
            assert_eq!(split.steps(), host.steps());
            // Fault injection reaches the device part too.
            let mut bad = ShardedAdamW::new(AdamWConfig::default(), meta, start, part(), Some((&Device::Cpu, units)), None).unwrap();
            let mut out = first.clone();
            let mut d = bad.begin_deferred(comm, &GradSource::Device(&gshard), lr, clip).unwrap().1.unwrap();
            d.poison();
            bad.advance(&mut d, usize::MAX, &GradSource::Device(&gshard), (HostWeightsMut::F32(&mut out), None), |_| Ok(())).unwrap();
            assert!(!d.all_finite() && out[0].is_nan(), "{units} unit(s) on the device");
        }

        let mut bad = ShardedAdamW::new(AdamWConfig::default(), meta, start, part(), None, None).unwrap();
        let mut out = first.clone();
        let mut d = bad.begin_deferred(comm, &GradSource::Device(&gshard), lr, clip).unwrap().1.unwrap();
        d.poison();
        bad.advance(&mut d, usize::MAX, &GradSource::Device(&gshard), (HostWeightsMut::F32(&mut out), None), |_| Ok(())).unwrap();
        assert!(!d.all_finite() && out[0].is_nan());
    }

    /// Rank `r`'s gradient of parameter `p`, element `i`, step `s` (deterministic, signed).
    fn g(r: usize, p: usize, i: usize, s: usize) -> f32 {
        ((r * 31 + p * 17 + i * 7 + s * 13) as f32 * 0.37).sin() * (1.0 + p as f32)
    }

    /// Three ranks, two parameters (a 5×7 matrix with weight decay and a 4-vector without:
    /// 39 elements in slices of 13, the last padded), two steps with clipping active:
    /// every rank's weights equal a naive f64 AdamW over the summed gradient.
    #[test]
    fn sharded_step_matches_a_naive_adamw_on_the_summed_gradient() {
        sharded_step_case(false); // host AdamW
        sharded_step_case(true); // DeviceAdamW (its CPU twin): per-parameter segments, all-gather buffer
    }

    fn sharded_step_case(on_device: bool) {
        for layout in [Layout::Whole, Layout::PerUnitShard] {
            sharded_step_layout(on_device.then_some(ALL_UNITS), layout);
        }
    }

    /// A split state (`train.optimizer_device_units`): the first unit's AdamW on the
    /// device (its CPU twin), the second's on the host, into the parameter shard (ZeRO-3,
    /// the shard on the device) and into the model's weights (ZeRO-1/2, all-gathered unit
    /// by unit); the same naive AdamW as the whole state in one place.
    #[test]
    fn a_split_state_steps_like_the_whole_state_in_one_place() {
        sharded_step_layout(Some(1), Layout::PerUnitShard);
        sharded_step_layout(Some(1), Layout::PerUnitParams);
    }

    /// How the test's two parameters are cut and where the new weights go.
    #[derive(Clone, Copy, PartialEq)]
    enum Layout {
        /// One unit, into the model's weights.
        Whole,
        /// Each parameter its own unit (ZeRO-3's layout), into a parameter shard.
        PerUnitShard,
        /// Each parameter its own unit, into the model's weights.
        PerUnitParams,
    }

    /// This rank's slice of the summed gradients `grads`, reduce-scattered unit by unit as
    /// the ZeRO-2/3 backward does (each parameter its own unit).
    fn reduce_per_unit(comm: &Arc<dyn Comm>, part: &Partition, grads: &[Tensor]) -> candle_core::Result<Tensor> {
        let world = part.world;
        let mut mine = Vec::new();
        for (u, gr) in grads.iter().enumerate() {
            let l = part.units[u].shard;
            let padded = Tensor::cat(&[gr.flatten_all()?, Tensor::zeros(l * world - gr.elem_count(), DType::F32, &Device::Cpu)?], 0)?;
            mine.push(comm.reduce_scatter_sum((0..world).map(|i| padded.narrow(0, i * l, l)).collect::<candle_core::Result<_>>()?)?);
        }
        Tensor::cat(&mine, 0)
    }

    /// `on_device`: the units whose state is on the device (its CPU twin; `None`: the host).
    fn sharded_step_layout(on_device: Option<usize>, layout: Layout) {
        let per_unit = layout != Layout::Whole;
        let shapes: [&[usize]; 2] = [&[5, 7], &[4]];
        let init = |p: usize, i: usize| (p as f32 + 1.0) * 0.1 + i as f32 * 0.01;
        let (world, lr, clip) = (3usize, 1e-2, 2.0);
        let cfg = AdamWConfig::default();
        let out = run_ranks(world, |comm| {
            let e = |e: Error| candle_core::Error::Msg(e.to_string());
            let params: Vec<(String, Var)> = shapes
                .iter()
                .enumerate()
                .map(|(p, sh)| {
                    let n: usize = sh.iter().product();
                    let v: Vec<f32> = (0..n).map(|i| init(p, i)).collect();
                    Ok((format!("p{p}"), Var::from_tensor(&Tensor::from_vec(v, *sh, &Device::Cpu)?)?))
                })
                .collect::<candle_core::Result<_>>()?;
            let meta: Vec<(String, Shape)> = params.iter().map(|(n, v)| (n.clone(), v.as_tensor().shape().clone())).collect();
            let start: HashMap<String, Tensor> = params.iter().map(|(n, v)| (n.clone(), v.as_tensor().clone())).collect();
            let sizes = [35, 4];
            let rw = (comm.rank(), comm.world());
            let part = if per_unit { Partition::new(&sizes, vec![0..1, 1..2], rw) } else { Partition::whole(&sizes, rw) }.map_err(e)?;
            let mut opt =
                ShardedAdamW::new(cfg.clone(), &meta, &start, part.clone(), on_device.map(|u| (&Device::Cpu, u)), None).map_err(e)?;
            // ZeRO-3's parameter shard: this rank's slices of the start weights.
            let pshard = Tensor::zeros(opt.shard_len, DType::F32, &Device::Cpu)?;
            let mut norms = Vec::new();
            for s in 0..2 {
                let grads = shapes
                    .iter()
                    .enumerate()
                    .map(|(p, sh)| {
                        let n: usize = sh.iter().product();
                        Tensor::from_vec((0..n).map(|i| g(comm.rank(), p, i, s)).collect::<Vec<_>>(), *sh, &Device::Cpu)
                    })
                    .collect::<candle_core::Result<Vec<_>>>()?;
                let gshard = if per_unit {
                    reduce_per_unit(&comm, &part, &grads)?
                } else {
                    let buf = GradBuffer::new(&params, opt.padded_len(), &Device::Cpu).map_err(e)?;
                    for (view, g) in buf.views().iter().zip(&grads) {
                        view.slice_set(g, 0, 0)?;
                    }
                    opt.reduce(&comm, &buf).map_err(e)?
                };
                let target = if layout == Layout::PerUnitShard { Out::Shard(&pshard) } else { Out::Params(&params) };
                let st = opt.step(&comm, &GradSource::Device(&gshard), target, lr, clip, (DType::F32, &Device::Cpu)).map_err(e)?;
                norms.push(st.grad_norm);
            }
            assert_eq!(opt.steps(), 2, "one count a step, whichever part updates");
            if layout == Layout::PerUnitShard {
                // The model's weights are the all-gathered shards.
                for (u, (_, v)) in params.iter().enumerate() {
                    let unit = &part.units[u];
                    let full = Tensor::cat(&comm.all_gather(&pshard.narrow(0, unit.shard_off, unit.shard)?)?, 0)?;
                    v.set(&full.narrow(0, 0, unit.len)?.reshape(v.as_tensor().shape())?)?;
                }
            }
            // A device-resident state keeps no host copy until a checkpoint asks for one
            // (12 bytes per parameter of the slice otherwise), and drops it again after.
            let held = |o: &ShardedAdamW| o.host.master.len() + o.host.m.len() + o.host.v.len();
            let (dev, host) = opt.resident_bytes();
            if on_device == Some(ALL_UNITS) {
                assert_eq!((dev, host), (12 * opt.shard_len, 0));
                assert_eq!(held(&opt), 0, "host copy of a device-resident state");
                opt.sync_to_host().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                assert_eq!(held(&opt), 3 * opt.shard_len, "sync_to_host refills the whole slice");
                opt.release_host();
                assert_eq!(held(&opt), 0);
            } else {
                // A split state keeps its host vectors whole; the device holds its units'.
                let first = if on_device.is_some() { part.units[1].shard_off } else { 0 };
                assert_eq!((dev, host), (12 * first, 12 * opt.shard_len));
                assert_eq!(held(&opt), 3 * opt.shard_len);
            }
            let w: Vec<Vec<f32>> =
                params.iter().map(|(_, v)| v.as_tensor().flatten_all()?.to_vec1::<f32>()).collect::<candle_core::Result<_>>()?;
            Ok((w, norms))
        })
        .unwrap();
        check_naive(&out, &shapes, &init, (world, lr, clip), &cfg);
    }

    /// Every rank's weights and norms (`out`, after two steps) against a naive f64 AdamW
    /// over the summed gradient.
    fn check_naive(
        out: &[(Vec<Vec<f32>>, Vec<f64>)],
        shapes: &[&[usize]],
        init: &dyn Fn(usize, usize) -> f32,
        (world, lr, clip): (usize, f64, f64),
        cfg: &AdamWConfig,
    ) {
        let (b1, b2, eps, wd) = (cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay);
        for (p, sh) in shapes.iter().enumerate() {
            let n: usize = sh.iter().product();
            let decays = sh.len() >= 2;
            for i in 0..n {
                let (mut w, mut m, mut v) = (init(p, i) as f64, 0f64, 0f64);
                for s in 0..2 {
                    let total = |q: usize, j: usize| (0..world).map(|r| g(r, q, j, s) as f64).sum::<f64>();
                    let norm = shapes
                        .iter()
                        .enumerate()
                        .flat_map(|(q, shq)| (0..shq.iter().product::<usize>()).map(move |j| (q, j)))
                        .map(|(q, j)| total(q, j).powi(2))
                        .sum::<f64>()
                        .sqrt();
                    for (r, (_, norms)) in out.iter().enumerate() {
                        assert!((norms[s] - norm).abs() <= 1e-5 * norm, "rank {r} step {s}: norm {} vs {norm}", norms[s]);
                    }
                    let coef = if norm > clip { clip / (norm + 1e-6) } else { 1.0 };
                    assert!(s > 0 || coef < 1.0, "the test must clip");
                    let gi = total(p, i) * coef;
                    m = b1 * m + (1.0 - b1) * gi;
                    v = b2 * v + (1.0 - b2) * gi * gi;
                    let t = (s + 1) as i32;
                    let update = (m / (1.0 - b1.powi(t))) / ((v / (1.0 - b2.powi(t))).sqrt() + eps);
                    w -= lr * (update + if decays { wd * w } else { 0.0 });
                }
                for (r, (ws, _)) in out.iter().enumerate() {
                    let got = ws[p][i] as f64;
                    assert!((got - w).abs() <= 1e-5 * w.abs().max(1e-2), "rank {r} param {p}[{i}]: {got} vs {w}");
                }
            }
        }
    }
}
