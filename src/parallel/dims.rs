//! Parallel dimensions and the rank layout.
//!
//! `world = dp × sp` ranks. Sequence parallelism (sp) splits one sequence over `sp`
//! ranks; data parallelism (dp) runs `dp` independent copies of that on different data.
//! Under USP the sp ranks form a `ring × ulysses` grid: Ulysses all-to-all inside a
//! group of `ulysses` ranks, zigzag ring across the `ring` groups.
//!
//! Rank layout (global rank `r`, fixed once here and used by everything else):
//! ```text
//! r      = dp_idx · sp + sp_idx                  dp_idx ∈ [0, dp),  sp_idx ∈ [0, sp)
//! sp_idx = ring_idx · ulysses + ulysses_idx      ring_idx ∈ [0, ring), ulysses_idx ∈ [0, ulysses)
//! ```
//! So the ranks of one Ulysses group are contiguous (the all-to-all heavy traffic stays
//! inside a node when `ulysses` ≤ GPUs per node), ring neighbours are `ulysses` apart,
//! and the ranks of one sp group are contiguous too. Example dp=2, ring=2, ulysses=2:
//! ```text
//! rank     0 1 2 3 | 4 5 6 7
//! dp_idx   0 0 0 0 | 1 1 1 1
//! ring_idx 0 0 1 1 | 0 0 1 1
//! uly_idx  0 1 0 1 | 0 1 0 1
//! ulysses groups {0,1} {2,3} {4,5} {6,7}; ring groups {0,2} {1,3} {4,6} {5,7};
//! sp groups {0..3} {4..7}; dp groups {0,4} {1,5} {2,6} {3,7}
//! ```

use crate::{Error, Result};
use longctx_attention::comm::Comm;
use std::sync::Arc;

pub use super::mode::ParallelMode;

/// What the user asked for; [`ParallelDims::new`] fills the defaults and checks it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DimsRequest {
    pub mode: ParallelMode,
    /// Total number of ranks (WORLD_SIZE).
    pub world: usize,
    /// Sequence-parallel degree; `None` = all ranks (1 for `data_parallel`).
    pub sp: Option<usize>,
    /// Ulysses degree; `None` = implied by the mode (required for `usp`).
    pub ulysses: Option<usize>,
    /// Query heads and key/value heads of the model (checked for the Ulysses split).
    pub hq: usize,
    pub hkv: usize,
}

/// The parallel layout, fixed at start-up. See the module doc for the rank layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelDims {
    pub world: usize,
    pub dp: usize,
    pub sp: usize,
    pub ulysses: usize,
    pub ring: usize,
    pub mode: ParallelMode,
}

/// Where one rank sits in the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Coords {
    pub dp_idx: usize,
    pub sp_idx: usize,
    pub ring_idx: usize,
    pub ulysses_idx: usize,
}

fn setting(msg: String) -> Error {
    Error::Setting(msg)
}

impl ParallelDims {
    /// Fill defaults and validate: `world = dp·sp`, `sp = ulysses·ring`, the mode's own
    /// constraints (data_parallel: sp = 1; zigzag ring: ulysses = 1; ulysses/fpdt:
    /// ring = 1) and, when ulysses > 1, the head split (`hq % ulysses == 0` and either
    /// `hkv % ulysses == 0` or `ulysses % hkv == 0`, the latter by replicating kv heads).
    pub fn new(req: &DimsRequest) -> Result<Self> {
        let DimsRequest { mode, world, sp, ulysses, hq, hkv } = req.clone();
        if world == 0 {
            return Err(setting("world size must be at least 1".into()));
        }
        let sp = match (mode, sp) {
            (ParallelMode::DataParallel, None) => 1,
            (ParallelMode::DataParallel, Some(1)) => 1,
            (ParallelMode::DataParallel, Some(n)) => {
                return Err(setting(format!(
                    "mode data_parallel has no sequence parallelism, but sp = {n} was given (use a sequence-parallel mode or sp = 1)"
                )))
            }
            (_, None) => world,
            (_, Some(0)) => return Err(setting(format!("mode {mode}: sp must be at least 1"))),
            (_, Some(n)) => n,
        };
        if !world.is_multiple_of(sp) {
            return Err(setting(format!("mode {mode}: world size {world} is not divisible by sp = {sp} (need world = dp × sp)")));
        }
        let dp = world / sp;
        let ulysses = mode.ulysses_degree(sp, ulysses)?;
        if !sp.is_multiple_of(ulysses) {
            return Err(setting(format!("mode {mode}: sp = {sp} is not divisible by ulysses = {ulysses} (need sp = ulysses × ring)")));
        }
        let ring = sp / ulysses;
        if ulysses > 1 {
            check_heads(mode, ulysses, hq, hkv)?;
        }
        Ok(Self { world, dp, sp, ulysses, ring, mode })
    }

    /// Error when this node runs more ranks than it has GPUs (each rank drives one GPU).
    pub fn check_devices(local_world: usize, gpus: usize) -> Result<()> {
        if local_world > gpus {
            return Err(setting(format!(
                "{local_world} ranks on this node but only {gpus} GPU(s) visible: each rank needs its own GPU (lower --nproc-per-node or check CUDA_VISIBLE_DEVICES)"
            )));
        }
        Ok(())
    }

    fn check_rank(&self, rank: usize) -> Result<()> {
        if rank >= self.world {
            return Err(setting(format!("rank {rank} out of range for world size {}", self.world)));
        }
        Ok(())
    }

    /// Coordinates of a global rank.
    pub fn coords(&self, rank: usize) -> Result<Coords> {
        self.check_rank(rank)?;
        let sp_idx = rank % self.sp;
        Ok(Coords { dp_idx: rank / self.sp, sp_idx, ring_idx: sp_idx / self.ulysses, ulysses_idx: sp_idx % self.ulysses })
    }

    /// Global rank of the given coordinates (inverse of [`Self::coords`]).
    pub fn rank_of(&self, dp_idx: usize, ring_idx: usize, ulysses_idx: usize) -> usize {
        dp_idx * self.sp + ring_idx * self.ulysses + ulysses_idx
    }

    /// Members (ascending global ranks) of `rank`'s sequence-parallel group.
    pub fn sp_group(&self, rank: usize) -> Result<Vec<usize>> {
        let c = self.coords(rank)?;
        Ok((0..self.sp).map(|j| c.dp_idx * self.sp + j).collect())
    }

    /// Members of `rank`'s data-parallel group (same sp position in every replica).
    pub fn dp_group(&self, rank: usize) -> Result<Vec<usize>> {
        let c = self.coords(rank)?;
        Ok((0..self.dp).map(|d| d * self.sp + c.sp_idx).collect())
    }

    /// Members of `rank`'s Ulysses group (contiguous ranks).
    pub fn ulysses_group(&self, rank: usize) -> Result<Vec<usize>> {
        let c = self.coords(rank)?;
        Ok((0..self.ulysses).map(|u| self.rank_of(c.dp_idx, c.ring_idx, u)).collect())
    }

    /// Members of `rank`'s ring group (stride `ulysses`).
    pub fn ring_group(&self, rank: usize) -> Result<Vec<usize>> {
        let c = self.coords(rank)?;
        Ok((0..self.ring).map(|r| self.rank_of(c.dp_idx, r, c.ulysses_idx)).collect())
    }
}

fn check_heads(mode: ParallelMode, ulysses: usize, hq: usize, hkv: usize) -> Result<()> {
    if hq == 0 || hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(setting(format!("mode {mode}: head counts hq = {hq}, hkv = {hkv} are invalid (need hkv ≥ 1 dividing hq)")));
    }
    if !hq.is_multiple_of(ulysses) {
        return Err(setting(format!(
            "mode {mode}: {hq} query heads cannot be split over ulysses = {ulysses} ranks (need hq % ulysses == 0)"
        )));
    }
    if !hkv.is_multiple_of(ulysses) && !ulysses.is_multiple_of(hkv) {
        return Err(setting(format!(
            "mode {mode}: {hkv} kv heads cannot be split over ulysses = {ulysses} ranks (need hkv % ulysses == 0, or ulysses % hkv == 0 to replicate kv heads)"
        )));
    }
    Ok(())
}

/// This rank's communicators. Each is a sub-communicator of the world whose rank is
/// this rank's index in the group (`sp`: sp_idx, `dp`: dp_idx, `ulysses`:
/// ulysses_idx, `ring`: ring_idx).
#[derive(Debug, Clone)]
pub struct Groups {
    pub sp: Arc<dyn Comm>,
    pub dp: Arc<dyn Comm>,
    pub ulysses: Arc<dyn Comm>,
    pub ring: Arc<dyn Comm>,
}

/// Build this rank's groups from the world communicator (whose ranks are the global
/// ranks). Every rank of the world must call this with the same `dims`.
///
/// Calls `world.sub` in the fixed order sp, dp, ulysses, ring on every rank. For
/// each kind the member lists of all ranks form a partition of the world, so this
/// works both for backends whose `sub` is collective over the members only (threads)
/// and for backends whose split is collective over the whole parent (NCCL's
/// `ncclCommSplit`, colour = smallest member). A group that is the whole world reuses
/// the world communicator (no new communicator, same on every rank since group sizes
/// are global).
pub fn build_groups(world: &Arc<dyn Comm>, dims: &ParallelDims) -> Result<Groups> {
    if world.world() != dims.world {
        return Err(setting(format!("the world communicator has {} ranks but the parallel layout expects {}", world.world(), dims.world)));
    }
    let rank = world.rank();
    let make = |members: Vec<usize>| -> Result<Arc<dyn Comm>> {
        if members.len() == dims.world {
            Ok(world.clone())
        } else {
            Ok(world.sub(&members)?)
        }
    };
    let sp = make(dims.sp_group(rank)?)?;
    let dp = make(dims.dp_group(rank)?)?;
    let ulysses = make(dims.ulysses_group(rank)?)?;
    let ring = make(dims.ring_group(rank)?)?;
    Ok(Groups { sp, dp, ulysses, ring })
}
