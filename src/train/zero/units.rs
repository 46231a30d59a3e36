//! How the parameters are cut into units and shards (ZeRO), and the engine's view of
//! where a unit's weights come from and where its gradients go.
//!
//! The parameters, in the model's order (`model.embed_tokens`, every `model.layers.{l}`,
//! then `model.norm` and `lm_head`), are one flat vector of `n` elements. A [`Partition`]
//! cuts it into *units* of consecutive parameters and each unit `u` of `len_u` elements
//! into `W` equal slices of `L_u = ⌈len_u / W⌉` (the last one zero-padded): rank `r` owns
//! slice `r` of every unit. ZeRO-1 uses one unit (the whole model, as before); ZeRO-2/3
//! use one unit per decoder layer plus the embedding and the head, so a layer's
//! gradients can be reduce-scattered, and its weights all-gathered, on their own.
//!
//! Shapes: `n` parameters' elements; `W` ranks; per unit `len_u`, `L_u`; this rank's
//! shard `[Σ L_u]`; the padded flat buffer `[Σ W·L_u]` (unit `u` at `Σ_{u'<u} W·L_u'`).

use super::grads::GradBuffer;
use crate::{Error, Result};
use candle_core::Tensor;
use std::ops::Range;

/// One unit of a [`Partition`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Unit {
    /// Indices of its parameters (in the model's order).
    pub params: Range<usize>,
    /// Offset of its first element in the flat (unpadded) parameter vector, and its length.
    pub off: usize,
    pub len: usize,
    /// `L_u`: elements per rank.
    pub shard: usize,
    /// Where this unit's slice starts in a rank's shard (`Σ_{u'<u} L_u'`).
    pub shard_off: usize,
    /// Where the unit starts in the padded flat buffer (`Σ_{u'<u} W·L_u'`).
    pub padded_off: usize,
}

/// The units and this rank's slice of each (see the module doc).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    pub units: Vec<Unit>,
    /// Elements of each parameter, and where each starts in the flat vector.
    pub sizes: Vec<usize>,
    pub offsets: Vec<usize>,
    pub rank: usize,
    pub world: usize,
}

impl Partition {
    /// Units made of the parameter index ranges `groups` (consecutive, covering all of
    /// `sizes`), sliced over `world` ranks.
    pub fn new(sizes: &[usize], groups: Vec<Range<usize>>, (rank, world): (usize, usize)) -> Result<Self> {
        let world = world.max(1);
        let mut at = 0;
        let (mut off, mut shard_off, mut padded_off) = (0, 0, 0);
        let mut units = Vec::with_capacity(groups.len());
        for g in groups {
            if g.start != at || g.end > sizes.len() {
                return Err(Error::Setting(format!("partition: unit {g:?} does not follow parameter {at}")));
            }
            at = g.end;
            let len: usize = sizes[g.clone()].iter().sum();
            let shard = len.div_ceil(world);
            units.push(Unit { params: g, off, len, shard, shard_off, padded_off });
            off += len;
            shard_off += shard;
            padded_off += shard * world;
        }
        if at != sizes.len() {
            return Err(Error::Setting(format!("partition: units cover {at} of {} parameters", sizes.len())));
        }
        let offsets = sizes
            .iter()
            .scan(0, |at, &n| {
                *at += n;
                Some(*at - n)
            })
            .collect();
        Ok(Self { units, sizes: sizes.to_vec(), offsets, rank, world })
    }

    /// One unit: the whole model (ZeRO-1's flat slices).
    pub fn whole(sizes: &[usize], rank_world: (usize, usize)) -> Result<Self> {
        Self::new(sizes, std::iter::once(0..sizes.len()).collect(), rank_world)
    }

    /// A unit per decoder layer, one for the embedding and one for what follows the layers
    /// (final norm, `lm_head`), from the parameters' names in the model's order.
    pub fn per_layer(names: &[&str], sizes: &[usize], rank_world: (usize, usize)) -> Result<Self> {
        Self::new(sizes, layer_groups(names)?, rank_world)
    }

    /// A partition over the same units with unit lengths `lens` (as a checkpoint records
    /// them) for `world` ranks: only the geometry is meaningful (sizes are the lengths).
    pub fn from_lens(lens: &[usize], world: usize) -> Result<Self> {
        Self::new(lens, (0..lens.len()).map(|i| i..i + 1).collect(), (0, world))
    }

    /// Elements of all parameters.
    pub fn n(&self) -> usize {
        self.units.iter().map(|u| u.len).sum()
    }

    /// Elements of one rank's shard (`Σ L_u`).
    pub fn shard_len(&self) -> usize {
        self.units.iter().map(|u| u.shard).sum()
    }

    /// Elements of a rank's slice that its first `units` units take (a prefix; all of it
    /// from the unit count on).
    pub fn prefix_len(&self, units: usize) -> usize {
        self.units.get(units).map_or(self.shard_len(), |u| u.shard_off)
    }

    /// Elements of the padded flat buffer (`Σ W·L_u`).
    pub fn padded_len(&self) -> usize {
        self.shard_len() * self.world
    }

    /// The unit lengths (what a checkpoint records to be read back under another layout).
    pub fn lens(&self) -> Vec<usize> {
        self.units.iter().map(|u| u.len).collect()
    }

    /// Rank `r`'s slice of unit `u`, in flat (unpadded) coordinates: at most `L_u`
    /// elements, fewer (or none) where it reaches the padding.
    pub fn piece(&self, u: usize, r: usize) -> Range<usize> {
        let unit = &self.units[u];
        let a = (unit.off + r * unit.shard).min(unit.off + unit.len);
        let b = (unit.off + (r + 1) * unit.shard).min(unit.off + unit.len);
        a..b
    }

    /// Rank `r`'s part of each parameter of unit `u`: `(parameter, its elements in flat
    /// coordinates, where they start in the rank's shard)`, in order; parameters outside
    /// the rank's slice are left out.
    pub fn parts(&self, u: usize, r: usize) -> impl Iterator<Item = (usize, Range<usize>, usize)> + '_ {
        let (unit, piece) = (&self.units[u], self.piece(u, r));
        unit.params.clone().filter_map(move |p| {
            let (a, b) = (piece.start.max(self.offsets[p]), piece.end.min(self.offsets[p] + self.sizes[p]));
            (a < b).then(|| (p, a..b, unit.shard_off + a - piece.start))
        })
    }

    /// Unit `u`'s parameters as flat views of `full`, the unit's whole elements (`[≥ len_u]`,
    /// e.g. its all-gathered slices), with their indices.
    pub fn split_unit(&self, u: usize, full: &Tensor) -> Result<Vec<(usize, Tensor)>> {
        let unit = &self.units[u];
        unit.params.clone().map(|p| Ok((p, full.narrow(0, self.offsets[p] - unit.off, self.sizes[p])?))).collect()
    }
}

/// Parameter index ranges: the embedding, each decoder layer, the rest (norm and head),
/// from names in the model's order. A model whose names are not in that order is an error.
pub fn layer_groups(names: &[&str]) -> Result<Vec<Range<usize>>> {
    let key = |n: &str| -> usize {
        if n.starts_with("model.embed_tokens.") {
            return 0;
        }
        match n.strip_prefix("model.layers.").and_then(|r| r.split('.').next()).and_then(|i| i.parse::<usize>().ok()) {
            Some(l) => 1 + l,
            None => usize::MAX,
        }
    };
    let mut groups: Vec<Range<usize>> = Vec::new();
    let mut last = None;
    for (i, n) in names.iter().enumerate() {
        let k = key(n);
        match (last, groups.last_mut()) {
            (Some(prev), Some(g)) if prev == k => g.end = i + 1,
            (Some(prev), _) if k < prev => {
                return Err(Error::Setting(format!("partition: parameter `{n}` comes after a later layer's")));
            }
            _ => groups.push(i..i + 1),
        }
        last = Some(k);
    }
    Ok(groups)
}

/// Unit indices the engine uses: the embedding is unit 0, decoder layer `l` unit `1 + l`,
/// the final norm and (untied) `lm_head` unit `layers + 1`.
pub fn layer_unit(l: usize) -> usize {
    1 + l
}

/// Where the engine gets a unit's weights and puts its gradients.
///
/// The engine asks for unit `u`'s weights just before it runs it (`weights`), writes every gradient of the step into `grad_slots`
/// (shaped like the parameters, added into with `beta = 1`), and calls `grads_done(u)`
/// once unit `u`'s gradients of this micro-batch are complete (top layer first; the
/// embedding last). The model's own weights and a [`GradBuffer`] are the plain case.
pub trait ParamHooks {
    /// Make unit `u`'s weights current before the forward first uses them (ZeRO-3 with the
    /// weights and optimizer on the host applies the previous step's update here, unit by
    /// unit, while the GPU runs the units before). The engine times it as the optimizer.
    fn prepare(&self, _u: usize) -> Result<()> {
        Ok(())
    }
    /// Unit `u`'s parameters on the device, in parameter order; `None`: the model's own.
    fn weights(&self, _u: usize) -> Result<Option<Vec<Tensor>>> {
        Ok(None)
    }
    /// Every parameter's gradient slot, in parameter order.
    fn grad_slots(&self) -> &[Tensor];
    /// Unit `u`'s slots hold its complete gradients of this micro-batch.
    fn grads_done(&self, _u: usize) -> Result<()> {
        Ok(())
    }
}

impl ParamHooks for GradBuffer {
    fn grad_slots(&self) -> &[Tensor] {
        self.views()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_follow_the_layers_and_slices_cover_each_unit_once() {
        let names = [
            "model.embed_tokens.weight",
            "model.layers.0.a",
            "model.layers.0.b",
            "model.layers.1.a",
            "model.layers.10.a",
            "model.norm.weight",
            "lm_head.weight",
        ];
        let sizes = [10, 3, 4, 7, 5, 2, 9];
        assert_eq!(layer_groups(&names).unwrap(), vec![0..1, 1..3, 3..4, 4..5, 5..7]);
        for world in 1..5 {
            let parts: Vec<Partition> = (0..world).map(|r| Partition::per_layer(&names, &sizes, (r, world)).unwrap()).collect();
            let p = &parts[0];
            assert_eq!(p.n(), 40);
            let mut covered = [0u8; 40];
            for (u, unit) in p.units.iter().enumerate() {
                assert_eq!(unit.shard, unit.len.div_ceil(world));
                for r in 0..world {
                    for i in p.piece(u, r) {
                        covered[i] += 1;
                    }
                }
            }
            assert!(covered.iter().all(|&c| c == 1), "world {world}: every element in exactly one slice");
            assert_eq!(p.padded_len(), p.shard_len() * world);
            // Each rank's parts cover its slice, in shard order.
            for r in 0..world {
                let part = Partition::per_layer(&names, &sizes, (r, world)).unwrap();
                for (u, unit) in part.units.iter().enumerate() {
                    let parts: Vec<_> = part.parts(u, r).collect();
                    let covered: usize = parts.iter().map(|(_, x, _)| x.len()).sum();
                    assert_eq!(covered, part.piece(u, r).len(), "world {world} rank {r} unit {u}");
                    if let Some((_, x, at)) = parts.first() {
                        assert_eq!((x.start, *at), (part.piece(u, r).start, unit.shard_off));
                    }
                }
            }
        }
        let bad = ["model.layers.1.a", "model.layers.0.a"];
        assert!(layer_groups(&bad).is_err());
        assert_eq!(Partition::whole(&sizes, (1, 3)).unwrap().piece(0, 1), 14..28);
    }
}
