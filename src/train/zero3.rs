//! ZeRO-2/3 and parameter offload: what a rank keeps of the weights and gradients, and
//! how the engine gets a layer's weights and gives back its gradients (DeepSpeed's
//! stage 2, stage 3 and `offload_param`).
//!
//! - **Gradients (stage ≥ 2)**: the engine writes a unit's gradients into a scratch
//!   buffer the size of one unit (`[W·L_u]` f32; the embedding has its own, since the
//!   tied head adds to it early); when the unit is done they are reduce-scattered and this
//!   rank's slice is added into its shard of the gradient (`[Σ L_u]` f32), then the scratch
//!   is zeroed for the next unit. No rank ever holds the whole model's gradient.
//! - **Weights (stage 3)**: each rank keeps only its slices of the weights (`[Σ L_u]` in
//!   the run dtype) on the device, or in host memory with `offload_param`; a unit's
//!   weights are all-gathered (after a host-to-device copy when offloaded) just before the
//!   engine runs it and dropped after, so at most a unit or two are whole on a device.
//!   The optimizer writes its new slices straight into the shard.
//!
//! Shapes: `W` ranks; unit `u` of `len_u` elements, `L_u = ⌈len_u/W⌉`; shard `[Σ L_u]`.

use crate::train::units::{ParamHooks, Partition};
use crate::{Error, Result};
use candle_core::{DType, Device, Shape, Tensor};
use longctx_attention::comm::Comm;
use std::collections::HashMap;
use std::sync::Arc;

/// This rank's slices of the weights (stage 3).
pub struct ParamStore {
    part: Partition,
    shapes: Vec<Shape>,
    /// `[Σ L_u]`, run dtype: on the device, or on the host (`offload_param`).
    shard: Tensor,
    /// Where the engine computes.
    dev: Device,
    comm: Arc<dyn Comm>,
}

impl ParamStore {
    /// This rank's slices of `weights` (every parameter, any device; converted to
    /// `dtype`), kept on `home` (the compute device, or the host to offload).
    pub fn new(
        part: Partition,
        params: &[(String, Shape)],
        weights: &HashMap<String, Tensor>,
        dtype: DType,
        (dev, home): (&Device, &Device),
        comm: Arc<dyn Comm>,
    ) -> Result<Self> {
        let mut pieces = Vec::new();
        let offs = part.param_offsets();
        for (u, unit) in part.units.iter().enumerate() {
            let r = part.piece(u, part.rank);
            for p in unit.params.clone() {
                let (a, b) = (r.start.max(offs[p]), r.end.min(offs[p] + part.sizes[p]));
                if a < b {
                    let name = &params[p].0;
                    let w = weights.get(name).ok_or_else(|| Error::Setting(format!("ZeRO-3: no start weights for `{name}`")))?;
                    pieces.push(w.flatten_all()?.narrow(0, a - offs[p], b - a)?.to_dtype(dtype)?.to_device(home)?);
                }
            }
            let pad = unit.shard - (r.end - r.start);
            if pad > 0 {
                pieces.push(Tensor::zeros(pad, dtype, home)?);
            }
        }
        let shard = if pieces.is_empty() { Tensor::zeros(0, dtype, home)? } else { Tensor::cat(&pieces, 0)? };
        let shapes = params.iter().map(|(_, s)| s.clone()).collect();
        Ok(Self { part, shapes, shard, dev: dev.clone(), comm })
    }

    /// The shard the optimizer writes its new slices into (`[Σ L_u]`, run dtype).
    pub fn shard(&self) -> &Tensor {
        &self.shard
    }

    /// Unit `u`'s parameters, whole, on the compute device (collective: every rank calls
    /// it for the same unit in the same order).
    pub fn fetch(&self, u: usize) -> Result<Vec<Tensor>> {
        let unit = &self.part.units[u];
        let mine = self.shard.narrow(0, unit.shard_off, unit.shard)?.to_device(&self.dev)?;
        let full = if self.part.world > 1 { Tensor::cat(&self.comm.all_gather(&mine)?, 0)? } else { mine };
        let offs = self.part.param_offsets();
        unit.params.clone().map(|p| Ok(full.narrow(0, offs[p] - unit.off, self.part.sizes[p])?.reshape(self.shapes[p].clone())?)).collect()
    }

    /// Every weight, whole, in host memory (collective), named as `names` (model order):
    /// for checkpoints and exports.
    pub fn gather_all(&self, names: &[String]) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(names.len());
        for (u, unit) in self.part.units.iter().enumerate() {
            for (p, t) in unit.params.clone().zip(self.fetch(u)?) {
                out.insert(names[p].clone(), t.to_device(&Device::Cpu)?);
            }
        }
        Ok(out)
    }

    /// Bytes of the shard (on the device or on the host, see [`Self::on_host`]).
    pub fn bytes(&self) -> usize {
        self.shard.elem_count() * self.shard.dtype().size_in_bytes()
    }

    /// The shard lives in host memory (`offload_param`).
    pub fn on_host(&self) -> bool {
        self.shard.device().is_cpu() && !self.dev.is_cpu()
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
    slots: Vec<Tensor>,
    /// `[Σ L_u]` f32: Σ over micro-batches of this rank's slices of the summed gradient.
    shard: Tensor,
    comm: Arc<dyn Comm>,
}

impl ShardedGrads {
    pub fn new(part: Partition, shapes: &[Shape], dev: &Device, comm: Arc<dyn Comm>) -> Result<Self> {
        let w = part.world;
        let embed_len = part.units.first().map_or(0, |u| u.shard * w);
        let other = part.units.iter().skip(1).map(|u| u.shard * w).max().unwrap_or(0);
        let embed_scratch = Tensor::zeros(embed_len, DType::F32, dev)?;
        let scratch = Tensor::zeros(other, DType::F32, dev)?;
        let offs = part.param_offsets();
        let unit_of = part.unit_of();
        let slots = (0..part.sizes.len())
            .map(|p| {
                let (u, unit) = (unit_of[p], &part.units[unit_of[p]]);
                let buf = if u == 0 { &embed_scratch } else { &scratch };
                Ok(buf.narrow(0, offs[p] - unit.off, part.sizes[p])?.reshape(shapes[p].clone())?)
            })
            .collect::<Result<_>>()?;
        let shard = Tensor::zeros(part.shard_len(), DType::F32, dev)?;
        Ok(Self { part, embed_scratch, scratch, slots, shard, comm })
    }

    /// `[Σ L_u]` f32, this rank's slices of the gradient summed over ranks and micro-batches.
    pub fn shard(&self) -> &Tensor {
        &self.shard
    }

    /// Zero the shard (the start of an optimizer step).
    pub fn zero(&self) -> Result<()> {
        Ok(self.shard.zero_set()?)
    }

    /// Bytes on the device: the shard and the two scratch buffers.
    pub fn bytes(&self) -> usize {
        4 * (self.shard.elem_count() + self.scratch.elem_count() + self.embed_scratch.elem_count())
    }

    /// Reduce-scatter unit `u`'s scratch, add this rank's slice into the shard, zero it.
    fn done(&self, u: usize) -> Result<()> {
        let unit = &self.part.units[u];
        let buf = if u == 0 { &self.embed_scratch } else { &self.scratch };
        let w = self.part.world;
        let mine = if w > 1 {
            let parts = (0..w).map(|i| buf.narrow(0, i * unit.shard, unit.shard)).collect::<candle_core::Result<Vec<_>>>()?;
            self.comm.reduce_scatter_sum(parts)?
        } else {
            buf.narrow(0, 0, unit.shard)?
        };
        let dst = self.shard.narrow(0, unit.shard_off, unit.shard)?;
        longctx_kernels::accumulate_f32(&dst, &mine, 1.0)?;
        buf.narrow(0, 0, unit.shard * w)?.zero_set()?;
        Ok(())
    }
}

/// The engine's hooks for stage 2 (`store` None: the model's own weights) and stage 3.
pub struct Zero3Hooks<'a> {
    pub store: Option<&'a ParamStore>,
    pub grads: &'a ShardedGrads,
}

impl ParamHooks for Zero3Hooks<'_> {
    fn weights(&self, u: usize) -> Result<Option<Vec<Tensor>>> {
        self.store.map(|s| s.fetch(u)).transpose()
    }
    fn grad_slots(&self) -> &[Tensor] {
        &self.grads.slots
    }
    fn grads_done(&self, u: usize) -> Result<()> {
        self.grads.done(u)
    }
}
