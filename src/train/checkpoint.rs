//! Resumable training checkpoints, written atomically (temporary directory, then rename).
//!
//! Layout of `<output_dir>/checkpoint/`:
//! - `model.safetensors`: the model weights in the run dtype (names as in HF checkpoints);
//! - `optimizer-shard{d}.safetensors`: rank `d`'s shard of the f32 `master`, `m`, `v`
//!   (its slice of every unit of the partition that `state.json` records; with ZeRO-1 one
//!   unit, so the shards concatenate to the flat parameter vector, zero-padded at the end;
//!   checkpoints of earlier versions named them `optimizer-dp{d}`);
//! - `state.json`: [`TrainState`] (stage, steps, optimizer step, data cursor, RNG, config).
//!
//! Every file and the directory are fsynced before the swap (as exports are), and nothing
//! non-finite is written: a NaN or infinite weight or optimizer value is an error that
//! leaves the previous checkpoint in place.

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
    /// Number of optimizer shard files (the world size of the run that wrote them).
    #[serde(alias = "dp_shards")]
    pub optimizer_shards: usize,
    /// The run config at the time of writing (compared with the new one on resume:
    /// `train::resume_check`).
    pub config: serde_json::Value,
    /// Optimizer steps skipped over the run because their gradient norm (or loss) was
    /// not finite, and how many of the last steps were (absent in older checkpoints).
    #[serde(default)]
    pub skipped_steps: u64,
    #[serde(default)]
    pub skipped_in_row: u64,
    /// The global step at which the AdamW state last started fresh: 0 for the run's
    /// start, else the first step of the latest stage with `reset_optimizer` (absent in
    /// older checkpoints: 0).
    #[serde(default)]
    pub optimizer_since_step: u64,
    /// Elements of each unit the optimizer shards were cut by (`train::zero::units`): each
    /// shard file holds its slice of every unit, in order. Empty (older checkpoints, and
    /// ZeRO-1): one unit, the whole model.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub optimizer_units: Vec<usize>,
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

impl OptimShard<'_> {
    /// `master[i]`, `m[i]` or `v[i]` when one of them holds a NaN or an infinity.
    pub fn first_non_finite(&self) -> Option<String> {
        [("master weight", self.master), ("first moment", self.m), ("second moment", self.v)]
            .into_iter()
            .find_map(|(what, xs)| crate::guard::first_non_finite(xs).map(|i| format!("{what} {i} of this shard ({})", xs[i])))
    }
}

/// Writes a safetensors file and flushes it to the disk (as exports are).
fn st_write(path: &Path, tensors: &HashMap<String, Tensor>) -> Result<()> {
    candle_core::safetensors::save(tensors, path).map_err(|e| Error::checkpoint(path, format!("cannot write: {e}")))?;
    sync_file(path)
}

fn sync_file(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

/// Persists a directory's entries (new files, renames).
fn sync_dir(dir: &Path) -> Result<()> {
    let f = std::fs::File::open(dir).map_err(|e| Error::io(dir, e))?;
    f.sync_all().map_err(|e| Error::io(dir, e))
}

/// The first tensor of `weights` (by name) holding a NaN or an infinity.
pub fn first_non_finite(weights: &HashMap<String, Tensor>) -> Result<Option<String>> {
    let mut names: Vec<&String> = weights.keys().collect();
    names.sort();
    let tensors: Vec<Tensor> = names.iter().map(|n| weights[*n].clone()).collect();
    let flags = crate::guard::finite_flags(&tensors)?;
    Ok(names.into_iter().zip(flags).find(|(_, ok)| !ok).map(|(n, _)| n.clone()))
}

/// The temporary directory a checkpoint is assembled in (same name on every rank).
pub fn tmp_dir(output_dir: &Path) -> PathBuf {
    output_dir.join(format!(".{CHECKPOINT_DIR}.tmp"))
}

/// Step 1 of a checkpoint (rank 0): an empty temporary directory.
pub fn begin(output_dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(output_dir).map_err(|e| Error::io(output_dir, e))?;
    let tmp = tmp_dir(output_dir);
    if tmp.exists() {
        std::fs::remove_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    }
    std::fs::create_dir_all(&tmp).map_err(|e| Error::io(&tmp, e))?;
    Ok(tmp)
}

pub(crate) fn shard_name(d: usize) -> String {
    format!("optimizer-shard{d}.safetensors")
}

/// Step 2 (every rank, once step 1 is done): this rank's optimizer shard.
pub fn write_shard(tmp: &Path, index: usize, s: &OptimShard<'_>) -> Result<()> {
    if let Some(what) = s.first_non_finite() {
        return Err(Error::checkpoint(tmp.join(shard_name(index)), format!("not written: the optimizer {what} is not finite")));
    }
    // Written straight from the slices (no tensor copies: 12 bytes per parameter of the
    // slice would be doubled in host memory while the file is written).
    let path = tmp.join(shard_name(index));
    let views = [("master", F32Slice::new(s.master)), ("m", F32Slice::new(s.m)), ("v", F32Slice::new(s.v))];
    safetensors::serialize_to_file(views, None, &path).map_err(|e| Error::checkpoint(&path, format!("cannot write: {e}")))?;
    sync_file(&path)
}

/// A flat f32 slice as a safetensors tensor `[n]`, borrowed (little-endian bytes, as the
/// format stores them).
struct F32Slice<'a> {
    data: &'a [f32],
    shape: [usize; 1],
}

impl<'a> F32Slice<'a> {
    fn new(data: &'a [f32]) -> Self {
        Self { data, shape: [data.len()] }
    }
}

impl safetensors::View for F32Slice<'_> {
    fn dtype(&self) -> safetensors::Dtype {
        safetensors::Dtype::F32
    }
    fn shape(&self) -> &[usize] {
        &self.shape
    }
    fn data(&self) -> std::borrow::Cow<'_, [u8]> {
        if cfg!(target_endian = "little") {
            // SAFETY: an f32 slice is valid as bytes (size 4·len, alignment 1 ≤ 4), and on a
            // little-endian host these are the bytes the format stores.
            std::borrow::Cow::Borrowed(unsafe {
                std::slice::from_raw_parts(self.data.as_ptr().cast::<u8>(), std::mem::size_of_val(self.data))
            })
        } else {
            std::borrow::Cow::Owned(self.data.iter().flat_map(|x| x.to_le_bytes()).collect())
        }
    }
    fn data_len(&self) -> usize {
        std::mem::size_of_val(self.data)
    }
}

/// Step 3 (rank 0, once every rank has done step 2): the weights and state, then the
/// swap into `<output_dir>/checkpoint`. A crash leaves the old or the new checkpoint in
/// place, or (between the two renames) the old one aside, which [`load`] then uses.
pub fn finish(output_dir: &Path, weights: &HashMap<String, Tensor>, state: &TrainState) -> Result<()> {
    let tmp = tmp_dir(output_dir);
    for d in 0..state.optimizer_shards {
        let p = tmp.join(shard_name(d));
        if !p.is_file() {
            return Err(Error::checkpoint(
                &p,
                "missing: every rank writes its optimizer shard here; the output directory must be on a filesystem all nodes share",
            ));
        }
    }
    // The trainer checks (on every rank, agreed) before it starts a checkpoint; this is
    // the last line: a non-finite weight never replaces the previous checkpoint.
    if let Some(name) = first_non_finite(weights)? {
        return Err(Error::checkpoint(
            tmp.join("model.safetensors"),
            format!("not written: tensor `{name}` holds NaN or infinite values; the previous checkpoint is kept"),
        ));
    }
    st_write(&tmp.join("model.safetensors"), weights)?;
    let json = serde_json::to_string_pretty(state).map_err(|e| Error::checkpoint(&tmp, e.to_string()))?;
    let sp = tmp.join("state.json");
    std::fs::write(&sp, json).map_err(|e| Error::io(&sp, e))?;
    sync_file(&sp)?;
    same_mode_as(&sp, &tmp)?;
    sync_dir(&tmp)?;
    let final_dir = checkpoint_dir(output_dir);
    let old = old_dir(output_dir);
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    if final_dir.exists() {
        std::fs::rename(&final_dir, &old).map_err(|e| Error::io(&final_dir, e))?;
    }
    std::fs::rename(&tmp, &final_dir).map_err(|e| Error::io(&final_dir, e))?;
    sync_dir(output_dir)?;
    if old.exists() {
        std::fs::remove_dir_all(&old).map_err(|e| Error::io(&old, e))?;
    }
    Ok(())
}

/// Gives every `.safetensors` file in `dir` the permissions of `reference` (a file made
/// under the process's umask, as the export's files are): the safetensors writer creates
/// its files readable by their owner only, which made checkpoints 0600 next to 0644 exports.
fn same_mode_as(reference: &Path, dir: &Path) -> Result<()> {
    let perms = std::fs::metadata(reference).map_err(|e| Error::io(reference, e))?.permissions();
    for e in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let p = e.map_err(|e| Error::io(dir, e))?.path();
        if p.extension().is_some_and(|x| x == "safetensors") {
            std::fs::set_permissions(&p, perms.clone()).map_err(|e| Error::io(&p, e))?;
        }
    }
    Ok(())
}

fn old_dir(output_dir: &Path) -> PathBuf {
    output_dir.join(format!(".{CHECKPOINT_DIR}.old"))
}

/// A loaded checkpoint: weights and state; the optimizer is read per rank with
/// `Loaded::optimizer_range` (in `zero/stage12.rs`, which owns the partition).
pub struct Loaded {
    pub weights: HashMap<String, Tensor>,
    pub state: TrainState,
    /// The directory it was read from.
    pub dir: PathBuf,
}

/// Read the weights and state of `<output_dir>/checkpoint` (or, after a crash between
/// the two renames of [`finish`], of the previous checkpoint set aside).
pub fn load(output_dir: &Path) -> Result<Loaded> {
    let dir = resume_dir(output_dir);
    if dir == old_dir(output_dir) {
        eprintln!("note: resuming from {} (the run stopped while replacing its checkpoint)", dir.display());
    }
    let state = read_state(&dir).map_err(cannot_resume)?;
    let mp = dir.join("model.safetensors");
    let weights = candle_core::safetensors::load(&mp, &Device::Cpu).map_err(|e| Error::checkpoint(&mp, format!("cannot read: {e}")))?;
    if let Some(name) = first_non_finite(&weights)? {
        return Err(damaged(&mp, &format!("tensor `{name}` holds NaN or infinite values")));
    }
    Ok(Loaded { weights, state, dir })
}

/// A checkpoint file whose values longctx never writes (non-finite, a negative second
/// moment): damage or an edit, not a divergence of the run, so not the learning rate's fault.
pub(crate) fn damaged(file: &Path, what: &str) -> Error {
    Error::checkpoint(
        file,
        format!(
            "cannot resume: {what}; longctx never writes such a checkpoint (it checks every value first), so the file was \
             damaged or altered after it was written, not by a divergence of the run: restore an intact copy of the \
             checkpoint, or start over with --overwrite"
        ),
    )
}

/// The checkpoint directory a resume reads: `<output_dir>/checkpoint`, or the previous
/// checkpoint set aside when a run stopped between the two renames of [`finish`].
pub fn resume_dir(output_dir: &Path) -> PathBuf {
    let dir = checkpoint_dir(output_dir);
    let old = old_dir(output_dir);
    if !dir.join("state.json").is_file() && old.join("state.json").is_file() {
        return old;
    }
    dir
}

/// A missing `state.json` said as a resume error, with the fix.
pub fn cannot_resume(e: Error) -> Error {
    match e {
        Error::Io { path, err: source } => Error::checkpoint(
            path,
            format!("cannot resume: {source}; run without --resume or point --output-dir at a run that wrote a checkpoint"),
        ),
        other => other,
    }
}

/// The `state.json` of a checkpoint directory.
pub fn read_state(dir: &Path) -> Result<TrainState> {
    let sp = dir.join("state.json");
    let text = std::fs::read_to_string(&sp).map_err(|e| Error::io(&sp, e))?;
    serde_json::from_str(&text).map_err(|e| Error::checkpoint(&sp, format!("corrupt state: {e}")))
}
