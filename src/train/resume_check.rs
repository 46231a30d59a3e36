//! Before a run resumes: is the saved state consistent, and can the new config continue
//! it exactly?
//!
//! The checkpoint's `state.json` holds the run config it was written under. The new
//! config is compared with it key by key:
//! - **refused** (the run would not continue the same computation): `seed`, the model
//!   (`model.source`, `model.dtype` on a GPU), the data (`data.*`), and the length, θ
//!   and data (`stage[i].seq_length`, `rope_theta`, `rope`, `seed`, `dataset`, `column`) of
//!   every stage already started;
//! - **refused unless `--allow-layout-change`** (the optimizer state is re-cut and the
//!   sums are rounded in another order: the run continues within rounding, not bit for
//!   bit): `parallel.world_size`, `mode`, `sp_size`, `ulysses_size`, `fpdt_chunk_size`,
//!   `train.batch_size`, `train.gradient_accumulate_every`, a started stage's
//!   `parallel_mode` / `fpdt_chunk_size` / `batch_size` / `gradient_accumulate_every`. Even then the samples per optimizer step
//!   (batch × accumulation × data-parallel ranks) must stay, or the data order changes;
//! - **reported** (allowed): everything else (learning rate and schedule, steps,
//!   clipping, AdamW, checkpoint cadence, device, chunking, offload, export settings,
//!   stages not started yet).
//!
//! The saved state itself is checked against the saved config: a stage past the last, a
//! step count past its stage, optimizer steps beyond the run's steps are errors (not a
//! "finished" run).

use crate::train::checkpoint::TrainState;
use crate::train::config::RunConfig;
use crate::{Error, Result};
use serde_json::Value;
use std::collections::BTreeMap;
use std::path::Path;

/// How a changed key counts (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Class {
    Identity,
    Layout,
    Free,
}

/// The settings a resume changes, as `key: old -> new`, for the log.
pub type Notes = Vec<String>;

/// Checks `state` (read from `state_file`) against its saved config and `cfg`; returns
/// the allowed changes. See the module doc.
pub fn check(state: &TrainState, state_file: &Path, cfg: &RunConfig, allow_layout_change: bool) -> Result<Notes> {
    let saved: RunConfig = serde_json::from_value(state.config.clone()).map_err(|e| {
        Error::checkpoint(
            state_file,
            format!("field `config` is not a run config of this version ({e}); resume with the longctx that wrote it"),
        )
    })?;
    validate_state(state, &saved, state_file)?;
    fits_new_config(state, cfg, state_file)?;
    compare(&saved, cfg, state, allow_layout_change, state_file)
}

fn inconsistent(state_file: &Path, what: String) -> Error {
    Error::checkpoint(
        state_file,
        format!(
            "inconsistent checkpoint state: {what}; the file was edited or damaged: resume from another copy, or start a new run \
             with --overwrite"
        ),
    )
}

/// The saved state against the config it was written with.
fn validate_state(s: &TrainState, saved: &RunConfig, file: &Path) -> Result<()> {
    let n = saved.stages.len();
    if s.optimizer_shards == 0 {
        return Err(inconsistent(file, "`optimizer_shards` is 0".into()));
    }
    if s.stage > n || (s.stage == n && s.stage_step != 0) {
        return Err(inconsistent(file, format!("stage {} step {} is past the last stage (the run has {n} stages)", s.stage, s.stage_step)));
    }
    if let Some(st) = saved.stages.get(s.stage) {
        if s.stage_step >= st.steps {
            return Err(inconsistent(file, format!("stage {} records {} steps done of its {}", s.stage, s.stage_step, st.steps)));
        }
    }
    if s.stage_step > s.global_step || s.adam_step > s.global_step {
        return Err(inconsistent(
            file,
            format!("{} steps in the stage and {} optimizer updates but {} steps in the run", s.stage_step, s.adam_step, s.global_step),
        ));
    }
    if s.optimizer_since_step > s.global_step || s.adam_step > s.global_step - s.optimizer_since_step.min(s.global_step) {
        return Err(inconsistent(
            file,
            format!(
                "{} optimizer updates since the optimizer was reset at global step {}, but {} steps in the run",
                s.adam_step, s.optimizer_since_step, s.global_step
            ),
        ));
    }
    if s.skipped_in_row > s.skipped_steps || s.skipped_steps > s.global_step {
        return Err(inconsistent(
            file,
            format!("{} skipped steps ({} in a row) in {} steps", s.skipped_steps, s.skipped_in_row, s.global_step),
        ));
    }
    // The run's steps against its stages: each finished stage did at least 1 and at most
    // `MAX_STEPS` steps (the limit of `stage[i].steps`). Not an equality with the saved
    // stages' `steps`: a finished stage's `steps` may be changed on a resume.
    let done = s.stage as u64;
    let max = crate::limits::MAX_STEPS.saturating_mul(done).saturating_add(s.stage_step);
    let min = done.saturating_add(s.stage_step);
    if s.global_step < min || s.global_step > max {
        return Err(inconsistent(
            file,
            format!(
                "field `global_step` is {} but the run is at stage {} step {} (fields `stage`, `stage_step`): with {done} \
                 finished stage(s) of 1 to {} steps each, expected {min} to {max}",
                s.global_step,
                s.stage,
                s.stage_step,
                crate::limits::MAX_STEPS
            ),
        ));
    }
    validate_cursor(s, saved, file)?;
    // Every step since the optimizer's last reset updated it unless it was skipped: fewer
    // updates than that would resume with a wrong bias correction.
    let since = s.global_step - s.optimizer_since_step;
    if s.adam_step < since.saturating_sub(s.skipped_steps) {
        return Err(inconsistent(
            file,
            format!(
                "field `adam_step` is {} but {since} steps were done since the optimizer started at global step {} (field \
                 `optimizer_since_step`) and at most {} of them skipped (field `skipped_steps`): expected {} to {since}",
                s.adam_step,
                s.optimizer_since_step,
                s.skipped_steps,
                since.saturating_sub(s.skipped_steps)
            ),
        ));
    }
    Ok(())
}

/// The data cursor against the steps: a stage `stage_step` steps in has drawn
/// `stage_step` × samples per step global samples (all in epoch 0, or `position` of them
/// in the current epoch after `epoch` earlier ones of at least one sample each).
fn validate_cursor(s: &TrainState, saved: &RunConfig, file: &Path) -> Result<()> {
    let cursor = match serde_json::from_value::<Option<crate::data::loader::DataState>>(s.data.clone()) {
        Ok(c) => c,
        Err(e) => return Err(inconsistent(file, format!("field `data` is not a data cursor ({e})"))),
    };
    let Some(c) = cursor else {
        if s.stage_step > 0 {
            return Err(inconsistent(
                file,
                format!("stage {} is {} steps in but field `data` holds no data cursor", s.stage, s.stage_step),
            ));
        }
        return Ok(());
    };
    let Some(sps) = samples_per_step(saved, s.stage) else { return Ok(()) };
    let drawn = s.stage_step.saturating_mul(sps);
    let fits = if c.epoch == 0 { c.position == drawn } else { c.position.saturating_add(c.epoch) <= drawn };
    if !fits {
        return Err(inconsistent(
            file,
            format!(
                "the data cursor (field `data`) is at epoch {} sample {}, but stage {} step {} (fields `stage`, `stage_step`) \
                 at {sps} samples per step has drawn {drawn} samples",
                c.epoch, c.position, s.stage, s.stage_step
            ),
        ));
    }
    Ok(())
}

/// The saved position exists in the new config's stages.
fn fits_new_config(s: &TrainState, cfg: &RunConfig, file: &Path) -> Result<()> {
    let n = cfg.stages.len();
    if s.stage > n || (s.stage == n && s.stage_step > 0) {
        return Err(Error::checkpoint(
            file,
            format!(
                "the checkpoint is at stage {} step {} but the config has {n} stage(s); keep the stages the run was started with",
                s.stage, s.stage_step
            ),
        ));
    }
    if let Some(st) = cfg.stages.get(s.stage) {
        if s.stage_step >= st.steps {
            return Err(Error::config(
                file,
                format!("stage[{}].steps", s.stage),
                format!(
                    "stage {} already did {} steps but the config now gives it {}; give it more than {}",
                    s.stage, s.stage_step, st.steps, s.stage_step
                ),
            ));
        }
    }
    Ok(())
}

/// `key → value` of every leaf of a run config (`stage[i].field` for the stages).
fn flatten(prefix: &str, v: &Value, out: &mut BTreeMap<String, Value>) {
    match v {
        Value::Object(m) => {
            for (k, x) in m {
                let key = if prefix.is_empty() { k.clone() } else { format!("{prefix}.{k}") };
                flatten(&key, x, out);
            }
        }
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate() {
                flatten(&format!("{prefix}[{i}]"), x, out);
            }
        }
        leaf => {
            out.insert(prefix.to_string(), leaf.clone());
        }
    }
}

/// How a change of `key` counts when resuming at stage `stage`, step `stage_step`.
fn class(key: &str, stage: usize, stage_step: u64, cpu: bool) -> Class {
    if let Some(rest) = key.strip_prefix("stage[") {
        let (idx, field) = rest.split_once("].").unwrap_or((rest, ""));
        let started = idx.parse::<usize>().is_ok_and(|i| i < stage || (i == stage && stage_step > 0));
        return match field {
            _ if !started => Class::Free,
            "seq_length" | "rope_theta" | "seed" | "dataset" | "column" => Class::Identity,
            f if f == "rope" || f.starts_with("rope.") => Class::Identity, // the RoPE method it trains with
            "parallel_mode" | "fpdt_chunk_size" | "batch_size" | "gradient_accumulate_every" => Class::Layout,
            _ => Class::Free,
        };
    }
    match key {
        "model.dtype" if cpu => Class::Free, // CPU runs compute in f32 whatever it says
        "seed" | "model.source" | "model.dtype" => Class::Identity,
        k if k.starts_with("data.") => Class::Identity,
        "parallel.mode"
        | "parallel.world_size"
        | "parallel.sp_size"
        | "parallel.ulysses_size"
        | "parallel.fpdt_chunk_size"
        | "train.batch_size"
        | "train.gradient_accumulate_every" => Class::Layout,
        _ => Class::Free,
    }
}

/// Samples per optimizer step in stage `si`: batch × accumulation × data-parallel ranks.
fn samples_per_step(c: &RunConfig, si: usize) -> Option<u64> {
    c.stages.get(si)?;
    Some(c.stage_settings(si).samples_per_step())
}

/// The key-by-key comparison; errors list every refused change with its fix.
fn compare(saved: &RunConfig, cfg: &RunConfig, s: &TrainState, allow_layout: bool, file: &Path) -> Result<Notes> {
    let (mut a, mut b) = (BTreeMap::new(), BTreeMap::new());
    let to_json = |c: &RunConfig| serde_json::to_value(c).map_err(|e| Error::Setting(format!("run config as JSON: {e}")));
    flatten("", &to_json(saved)?, &mut a);
    flatten("", &to_json(cfg)?, &mut b);
    let cpu = saved.model.device == "cpu" && cfg.model.device == "cpu";
    let unset = Value::String("(unset)".into());
    let (mut refused, mut notes) = (Vec::new(), Vec::new());
    let keys: std::collections::BTreeSet<&String> = a.keys().chain(b.keys()).collect();
    for key in keys {
        let (old, new) = (a.get(key).unwrap_or(&unset), b.get(key).unwrap_or(&unset));
        if old == new || key == "output_dir" {
            continue;
        }
        let change = format!("`{key}` changed from {old} to {new}");
        match class(key, s.stage, s.stage_step, cpu) {
            Class::Identity => refused.push(format!("{change}: set it back to {old} (a resumed run must keep it to continue exactly)")),
            Class::Layout if !allow_layout => refused.push(format!(
                "{change}: set it back to {old}, or pass --allow-layout-change to re-shard (the run then continues within rounding, \
                 not bit for bit)"
            )),
            Class::Layout | Class::Free => notes.push(format!("{key}: {old} -> {new}")),
        }
    }
    if refused.is_empty() {
        if let (Some(x), Some(y)) = (samples_per_step(saved, s.stage), samples_per_step(cfg, s.stage)) {
            if x != y {
                refused.push(format!(
                    "samples per optimizer step (batch_size × gradient_accumulate_every × data-parallel ranks) changed from {x} to {y}: \
                     choose a batch size that keeps {x}"
                ));
            }
        }
    }
    if !refused.is_empty() {
        return Err(Error::checkpoint(
            file,
            format!("cannot resume: {}; or start a new run with --overwrite (or another --output-dir)", refused.join("; ")),
        ));
    }
    Ok(notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_are_classified_by_what_they_change() {
        assert_eq!(class("seed", 0, 1, true), Class::Identity);
        assert_eq!(class("data.dataset", 0, 1, true), Class::Identity);
        assert_eq!(class("model.dtype", 0, 1, true), Class::Free);
        assert_eq!(class("model.dtype", 0, 1, false), Class::Identity);
        assert_eq!(class("parallel.world_size", 0, 1, true), Class::Layout);
        assert_eq!(class("train.learning_rate", 0, 1, true), Class::Free);
        assert_eq!(class("stage[0].seq_length", 0, 1, true), Class::Identity);
        assert_eq!(class("stage[0].seq_length", 0, 0, true), Class::Free, "a stage not started yet");
        assert_eq!(class("stage[1].rope_theta", 0, 5, true), Class::Free);
        assert_eq!(class("stage[0].steps", 1, 0, true), Class::Free);
        assert_eq!(class("stage[0].parallel_mode", 1, 0, true), Class::Layout);
        assert_eq!(class("stage[0].seed", 0, 1, true), Class::Identity);
        assert_eq!(class("stage[0].rope.factor", 0, 1, true), Class::Identity, "a started stage's RoPE method");
        assert_eq!(class("stage[0].rope.type", 0, 1, true), Class::Identity);
        assert_eq!(class("stage[1].rope.type", 0, 1, true), Class::Free, "a stage not started yet");
        assert_eq!(class("stage[1].dataset", 0, 1, true), Class::Free, "a stage not started yet");
        assert_eq!(class("stage[0].batch_size", 0, 1, true), Class::Layout);
        assert_eq!(class("stage[0].reset_optimizer", 0, 1, true), Class::Free, "its reset is done or not, the checkpoint says which");
    }
}
