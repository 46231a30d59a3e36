//! Resumable training checkpoints, written atomically (temporary directory, then rename).
//!
//! Layout of `<output_dir>/checkpoint/`:
//! - `model.safetensors`: the model weights in the run dtype (names as in HF checkpoints);
//! - `optimizer-shard{d}.safetensors`: rank `d`'s shard of the f32 `master`, `m`, `v`
//!   (ZeRO-1 over all ranks; shards concatenate to the flat parameter vector, zero-padded
//!   at the end; checkpoints of earlier versions named them `optimizer-dp{d}`);
//! - `state.json`: [`TrainState`] (stage, steps, optimizer step, data cursor, RNG, config).

use crate::{Error, Result};
use candle_core::{Device, Tensor};
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Everything besides tensors that a resumed run needs to continue exactly.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct TrainState {
    /// Index of the stage in progress.
    pub stage: usize,
    /// Optimizer steps done within that stage.
    pub stage_step: u64,
    /// Optimizer steps done over the whole run.
    pub global_step: u64,
    /// The AdamW step counter (bias correction).
    pub adam_step: u64,
    /// Data cursor (opaque to the checkpoint: the data layer's own state).
    pub data: serde_json::Value,
    /// RNG state, if the run draws random numbers after start-up.
    pub rng: u64,
    /// Number of optimizer shard files (the world size of the run that wrote them).
    #[serde(alias = "dp_shards")]
    pub optimizer_shards: usize,
    /// The run config at the time of writing (to warn about changed settings on resume).
    pub config: serde_json::Value,
}

pub const CHECKPOINT_DIR: &str = "checkpoint";

pub fn checkpoint_dir(output_dir: &Path) -> PathBuf {
    output_dir.join(CHECKPOINT_DIR)
}

/// Optimizer shard tensors for one data-parallel rank.
pub struct OptimShard<'a> {
    pub master: &'a [f32],
    pub m: &'a [f32],
    pub v: &'a [f32],
}

fn st_write(path: &Path, tensors: &HashMap<String, Tensor>) -> Result<()> {
    candle_core::safetensors::save(tensors, path).map_err(|e| Error::checkpoint(path, format!("cannot write: {e}")))
}

/// Write a checkpoint atomically. `shards` holds one entry per rank, in rank order (the
/// trainer gathers them on rank 0, which writes everything).
pub fn save(output_dir: &Path, weights: &HashMap<String, Tensor>, shards: &[OptimShard<'_>], state: &TrainState) -> Result<()> {
    std::fs::create_dir_all(output_dir).map_err(|e| Error::io(output_dir, e))?;
    let final_dir = checkpoint_dir(output_dir);
    let tmp = output_dir.join(format!(".{CHECKPOINT_DIR}.tmp-{}", std::process::id()));
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    st_write(&tmp.join("model.safetensors"), weights)?;
    for (d, s) in shards.iter().enumerate() {
        let mut t = HashMap::new();
        for (name, data) in [("master", s.master), ("m", s.m), ("v", s.v)] {
            t.insert(name.to_string(), Tensor::from_slice(data, data.len(), &Device::Cpu)?);
        }
        st_write(&tmp.join(format!("optimizer-shard{d}.safetensors")), &t)?;
    }
    let json = serde_json::to_string_pretty(state).map_err(|e| Error::checkpoint(&tmp, e.to_string()))?;
    let sp = tmp.join("state.json");
    std::fs::write(&sp, json).map_err(|e| Error::io(&sp, e))?;
    // Swap in: old aside, new in, old removed. A crash leaves either the old or the new.
    let old = output_dir.join(format!(".{CHECKPOINT_DIR}.old-{}", std::process::id()));
    if final_dir.exists() {
        std::fs::rename(&final_dir, &old).map_err(|e| Error::io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(())
}

/// A loaded checkpoint.
pub struct Loaded {
    pub weights: HashMap<String, Tensor>,
    /// Per data-parallel shard: (master, m, v).
    pub shards: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)>,
    pub state: TrainState,
}

pub fn load(output_dir: &Path) -> Result<Loaded> {
    let dir = checkpoint_dir(output_dir);
    let sp = dir.join("state.json");
    let text = std::fs::read_to_string(&sp).map_err(|e| {
        Error::checkpoint(&sp, format!("cannot resume: {e}; run without --resume or point --output-dir at a run that wrote a checkpoint"))
    })?;
    let state: TrainState = serde_json::from_str(&text).map_err(|e| Error::checkpoint(&sp, format!("corrupt state: {e}")))?;
    let mp = dir.join("model.safetensors");
    let weights = candle_core::safetensors::load(&mp, &Device::Cpu).map_err(|e| Error::checkpoint(&mp, format!("cannot read: {e}")))?;
    let mut shards = Vec::new();
    for d in 0..state.optimizer_shards {
        let mut p = dir.join(format!("optimizer-shard{d}.safetensors"));
        let old = dir.join(format!("optimizer-dp{d}.safetensors"));
        if !p.exists() && old.exists() {
            p = old;
        }
        let t = candle_core::safetensors::load(&p, &Device::Cpu).map_err(|e| Error::checkpoint(&p, format!("cannot read: {e}")))?;
        let get = |n: &str| -> Result<Vec<f32>> {
            let x = t.get(n).ok_or_else(|| Error::checkpoint(&p, format!("tensor `{n}` missing")))?;
            Ok(x.to_vec1::<f32>()?)
        };
        shards.push((get("master")?, get("m")?, get("v")?));
    }
    Ok(Loaded { weights, shards, state })
}
