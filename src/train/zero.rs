//! The distributed optimizer step, ZeRO-1 over every rank of the world (data- and
//! sequence-parallel alike, as DeepSpeed shards over its sequence-data-parallel group).
//!
//! The parameters, in `Engine::params` order, form one flat f32 vector of `n` elements
//! padded to `W·L`, `L = ⌈n/W⌉`; rank `r` owns `[r·L, (r+1)·L)` and keeps only that
//! slice of the f32 master weights and AdamW moments ([`AdamW`], on the host, or
//! [`DeviceAdamW`] on a GPU). One step, every rank in lockstep:
//! 1. reduce-scatter this rank's gradients (the engine's flat `[W·L]` f32
//!    [`GradBuffer`]): rank `r`
//!    gets the sum over ranks of its slice (sp ranks hold partial gradients of their
//!    tokens, dp ranks those of their samples);
//! 2. gradient norm over the world: √(all-reduce Σ slice²), in f64;
//! 3. clip (scale the slice), AdamW on the slice;
//! 4. all-gather the new slices in the run dtype and write them into the weights.

use crate::train::checkpoint::{Loaded, OptimShard};
use crate::train::grads::GradBuffer;
use crate::train::optim::{AdamW, AdamWConfig, DeviceAdamW, HostElem, Segment};
use crate::{Error, Result};
use candle_core::{DType, Device, Tensor, Var};
use longctx_attention::comm::Comm;
use std::collections::HashMap;
use std::sync::Arc;

/// This rank's part of the optimizer.
pub struct ShardedAdamW {
    /// The slice's state on the host (authoritative unless `device` is set; then it is
    /// refreshed by [`Self::sync_to_host`] for checkpoints).
    pub host: AdamW,
    device: Option<DeviceAdamW>,
    /// Elements of each parameter, in order.
    sizes: Vec<usize>,
    /// `L`, the slice length.
    pub shard_len: usize,
    rank: usize,
    world: usize,
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
    /// The slice of rank `rank` of `world`. Masters start from `start` (the f32 host
    /// copies of the start weights; a parameter missing there is read from its Var),
    /// or, when `resume` is given, from that checkpoint's optimizer state (whatever its
    /// world size was). `device`: keep and update the state there instead of the host.
    pub fn new(
        cfg: AdamWConfig,
        params: &[(String, Var)],
        start: &HashMap<String, Tensor>,
        (rank, world): (usize, usize),
        device: Option<&Device>,
        resume: Option<(u64, &Loaded)>,
    ) -> Result<Self> {
        let sizes: Vec<usize> = params.iter().map(|(_, v)| v.as_tensor().elem_count()).collect();
        let n: usize = sizes.iter().sum();
        let shard_len = n.div_ceil(world);
        let (lo, hi) = (rank * shard_len, (rank + 1) * shard_len);
        let host: Vec<Tensor> = params
            .iter()
            .map(|(name, v)| match start.get(name) {
                Some(t) => Ok(t.to_dtype(DType::F32)?),
                None => Ok(v.as_tensor().to_dtype(DType::F32)?.to_device(&Device::Cpu)?),
            })
            .collect::<Result<_>>()?;
        let master = flat_range(&host, lo, hi)?;
        drop(host);
        // Decay runs over the shard (a run per parameter part; the padding decays not).
        let mut decay: Vec<(usize, bool)> = Vec::new();
        let mut off = 0;
        for ((_, v), &len) in params.iter().zip(&sizes) {
            let (a, b) = (lo.max(off), hi.min(off + len));
            if a < b {
                decay.push((a - lo, v.as_tensor().rank() >= 2));
            }
            off += len;
        }
        if off < hi {
            decay.push((off.max(lo) - lo, false));
        }
        let mut st = AdamW::with_runs(cfg, master, decay);
        if let Some((step, loaded)) = resume {
            // Only this rank's range, from whichever shard files hold it.
            (st.master, st.m, st.v) = loaded.optimizer_range(n, lo, hi)?;
            st.step = step;
        }
        let device = device.map(|d| DeviceAdamW::from_host(&st, d)).transpose()?;
        let mut me = Self { host: st, device, sizes, shard_len, rank, world };
        me.release_host();
        Ok(me)
    }

    /// With the state on the device, drop its host copy (refilled by
    /// [`Self::sync_to_host`] for a checkpoint): 12 bytes per parameter of this rank's
    /// slice, 81 GB for a 7B model on one GPU.
    pub fn release_host(&mut self) {
        if self.device.is_some() {
            self.host.master = Vec::new();
            self.host.m = Vec::new();
            self.host.v = Vec::new();
        }
    }

    /// The flat length the gradient buffer must have: `W·L`.
    pub fn padded_len(&self) -> usize {
        self.shard_len * self.world
    }

    /// One optimizer step over `grads` (this rank's, the buffer the engine filled) — see
    /// the module doc. `clip <= 0` disables clipping. Writes the new weights into `params`
    /// (in `dtype` on `device`).
    pub fn step(
        &mut self,
        comm: &Arc<dyn Comm>,
        grads: &GradBuffer,
        params: &[(String, Var)],
        lr: f64,
        clip: f64,
        (dtype, device): (DType, &Device),
    ) -> Result<StepStats> {
        self.check(comm, grads, params)?;
        let (l, w) = (self.shard_len, self.world);
        let flat = grads.flat();
        // 1. Reduce-scatter: this rank's slice of the summed gradient.
        let gshard = if w > 1 {
            let parts = (0..w).map(|i| flat.narrow(0, i * l, l)).collect::<candle_core::Result<Vec<_>>>()?;
            comm.reduce_scatter_sum(parts)?
        } else {
            flat.clone()
        };
        // 2. Global norm.
        let grad_norm = all_reduce_scalar(comm, sum_sq(&gshard)?, gshard.device())?.sqrt();
        if !grad_norm.is_finite() {
            // The same value on every rank: all skip this update together (the trainer
            // counts it and aborts after too many in a row).
            return Ok(StepStats { grad_norm, skipped: true });
        }
        // 3. Clip and update; 4. the new weights in the run dtype, all-gathered.
        let coef = if clip > 0.0 && grad_norm > clip { clip / (grad_norm + 1e-6) } else { 1.0 };
        if self.device.is_some() {
            self.device_update(comm, &gshard, params, lr, coef, dtype)?;
        } else {
            self.host_update(comm, &gshard, params, lr, coef, (dtype, device))?;
        }
        Ok(StepStats { grad_norm, skipped: false })
    }

    fn check(&self, comm: &Arc<dyn Comm>, grads: &GradBuffer, params: &[(String, Var)]) -> Result<()> {
        if comm.world() != self.world || comm.rank() != self.rank {
            return Err(Error::Setting(format!(
                "optimizer sharded for rank {} of {} used with rank {} of {}",
                self.rank,
                self.world,
                comm.rank(),
                comm.world()
            )));
        }
        if params.len() != self.sizes.len() || grads.views().len() != self.sizes.len() {
            return Err(Error::Setting(format!("{} gradients for {} parameters", grads.views().len(), self.sizes.len())));
        }
        if grads.flat().elem_count() != self.padded_len() {
            return Err(Error::Setting(format!(
                "gradient buffer of {} elements for an optimizer over {} (make it with `padded_len`)",
                grads.flat().elem_count(),
                self.padded_len()
            )));
        }
        Ok(())
    }

    /// The device update: one kernel per parameter's part of the shard, each writing its
    /// new weights straight into the model (one rank) or into the shard's buffer that is
    /// then all-gathered (several ranks).
    fn device_update(
        &mut self,
        comm: &Arc<dyn Comm>,
        gshard: &Tensor,
        params: &[(String, Var)],
        lr: f64,
        coef: f64,
        dtype: DType,
    ) -> Result<()> {
        let (l, w) = (self.shard_len, self.world);
        let (lo, hi) = (self.rank * l, (self.rank + 1) * l);
        let buf = if w > 1 { Some(Tensor::zeros(l, dtype, gshard.device())?) } else { None };
        let mut segs = Vec::new();
        let mut off = 0;
        for ((_, v), &len) in params.iter().zip(&self.sizes) {
            let (a, b) = (lo.max(off), hi.min(off + len));
            if a < b {
                let copy = match &buf {
                    Some(buf) => buf.narrow(0, a - lo, b - a)?,
                    None => v.as_tensor().flatten_all()?.narrow(0, a - off, b - a)?, // a view: writes reach the model
                };
                segs.push(Segment { start: a - lo, len: b - a, decay: v.as_tensor().rank() >= 2, copy: Some(copy) });
            }
            off += len;
        }
        let d = self.device.as_mut().ok_or_else(|| Error::Setting("device optimizer missing".into()))?;
        d.update(&mut self.host, gshard, lr, coef, &segs)?;
        if let Some(buf) = buf {
            write_back(params, &self.sizes, &Tensor::cat(&comm.all_gather(&buf)?, 0)?)?;
        }
        Ok(())
    }

    /// The host update (rayon over the shard, the gradient read in place from its one
    /// device-to-host copy, the new weights written in the run dtype in the same pass),
    /// then the all-gather of the new weights.
    fn host_update(
        &mut self,
        comm: &Arc<dyn Comm>,
        gshard: &Tensor,
        params: &[(String, Var)],
        lr: f64,
        coef: f64,
        (dtype, device): (DType, &Device),
    ) -> Result<()> {
        let g_host = gshard.to_device(&Device::Cpu)?.contiguous()?;
        let n = self.host.master.len();
        let shard = {
            let (st, layout) = g_host.storage_and_layout();
            let candle_core::Storage::Cpu(cs) = &*st else {
                return Err(Error::Setting("host optimizer: gradient not on the host".into()));
            };
            let off = layout.start_offset();
            let g = &cs.as_slice::<f32>()?[off..off + n];
            let h = &mut self.host;
            fn run<P: HostElem>(h: &mut AdamW, g: &[f32], coef: f64, lr: f64) -> Result<Tensor> {
                use rayon::prelude::*;
                let mut out: Vec<P> = Vec::with_capacity(g.len());
                out.par_extend(rayon::iter::repeat_n(P::from_f32(0.0), g.len())); // filled in parallel
                h.update_into(g, coef as f32, lr, Some(&mut out));
                let len = out.len();
                Ok(Tensor::from_vec(out, len, &Device::Cpu)?)
            }
            match dtype {
                DType::BF16 => run::<half::bf16>(h, g, coef, lr)?,
                DType::F16 => run::<half::f16>(h, g, coef, lr)?,
                DType::F32 => run::<f32>(h, g, coef, lr)?,
                other => run::<f32>(h, g, coef, lr)?.to_dtype(other)?,
            }
        };
        let shard = shard.to_device(device)?;
        let full = if self.world > 1 { Tensor::cat(&comm.all_gather(&shard)?, 0)? } else { shard };
        write_back(params, &self.sizes, &full)
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
            self.device = Some(DeviceAdamW::from_host(&self.host, &dev)?);
        }
        self.release_host();
        Ok(())
    }

    /// AdamW steps taken.
    pub fn steps(&self) -> u64 {
        self.host.step
    }
}

/// Flat f32 copy of all parameters' gradients, zero-padded to `padded` elements.
/// Write the flat new weights `full [≥ n]` (run dtype) into the parameters, in order.
fn write_back(params: &[(String, Var)], sizes: &[usize], full: &Tensor) -> Result<()> {
    let mut off = 0;
    for ((_, v), &n) in params.iter().zip(sizes) {
        v.set(&full.narrow(0, off, n)?.reshape(v.as_tensor().shape())?)?;
        off += n;
    }
    Ok(())
}

/// `Σ x²` of a flat f32 tensor, in f64, over the whole GPU and without a temporary
/// (`longctx_kernels::sum_squares`; deterministic run to run).
fn sum_sq(t: &Tensor) -> Result<f64> {
    Ok(longctx_kernels::sum_squares(&t.contiguous()?)?)
}

/// Elements `[lo, hi)` of `params` flattened in order, as f32; zero past their end.
/// Converts only the parameters that overlap the range (no full flat copy).
fn flat_range(params: &[Tensor], lo: usize, hi: usize) -> Result<Vec<f32>> {
    use rayon::prelude::*;
    let mut out = vec![0f32; hi.saturating_sub(lo)]; // zeroed pages from the allocator: the padding
    let mut off = 0;
    let mut rest = &mut out[..];
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
    Ok(out)
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

#[cfg(test)]
mod tests {
    use super::*;
    use longctx_attention::comm::thread::run_ranks;

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
        let shapes: [&[usize]; 2] = [&[5, 7], &[4]];
        let init = |p: usize, i: usize| (p as f32 + 1.0) * 0.1 + i as f32 * 0.01;
        let (world, lr, clip) = (3usize, 1e-2, 2.0);
        let cfg = AdamWConfig::default();
        let out = run_ranks(world, |comm| {
            let params: Vec<(String, Var)> = shapes
                .iter()
                .enumerate()
                .map(|(p, sh)| {
                    let n: usize = sh.iter().product();
                    let v: Vec<f32> = (0..n).map(|i| init(p, i)).collect();
                    Ok((format!("p{p}"), Var::from_tensor(&Tensor::from_vec(v, *sh, &Device::Cpu)?)?))
                })
                .collect::<candle_core::Result<_>>()?;
            let mut opt = ShardedAdamW::new(
                cfg.clone(),
                &params,
                &HashMap::new(),
                (comm.rank(), comm.world()),
                on_device.then_some(&Device::Cpu),
                None,
            )
            .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
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
                let buf = GradBuffer::new(&params, opt.padded_len(), &Device::Cpu).map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                for (view, g) in buf.views().iter().zip(&grads) {
                    view.slice_set(g, 0, 0)?;
                }
                let st = opt
                    .step(&comm, &buf, &params, lr, clip, (DType::F32, &Device::Cpu))
                    .map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                norms.push(st.grad_norm);
            }
            // A device-resident state keeps no host copy until a checkpoint asks for one
            // (12 bytes per parameter of the slice otherwise), and drops it again after.
            let held = |o: &ShardedAdamW| o.host.master.len() + o.host.m.len() + o.host.v.len();
            if on_device {
                assert_eq!(held(&opt), 0, "host copy of a device-resident state");
                opt.sync_to_host().map_err(|e| candle_core::Error::Msg(e.to_string()))?;
                assert_eq!(held(&opt), 3 * opt.shard_len, "sync_to_host refills the whole slice");
                opt.release_host();
                assert_eq!(held(&opt), 0);
            } else {
                assert_eq!(held(&opt), 3 * opt.shard_len);
            }
            let w: Vec<Vec<f32>> =
                params.iter().map(|(_, v)| v.as_tensor().flatten_all()?.to_vec1::<f32>()).collect::<candle_core::Result<_>>()?;
            Ok((w, norms))
        })
        .unwrap();
        // The naive reference, in f64.
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
