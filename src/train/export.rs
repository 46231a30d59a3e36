//! A run's export: [`ModelExport::for_run`] turns the weights a run trained into the
//! Hugging Face checkpoint it means (the context and RoPE method of its last trained
//! stage, `[export]`'s settings), and [`TrainingCheckpoint`] opens a training checkpoint
//! for `longctx export`. The writing itself is `hub::export`'s; this is the run's side,
//! kept here so that the hub layer knows nothing of runs.

use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::hub::cache::{resolve_model_config, HubOptions};
use crate::hub::config::CONFIG_FILE;
use crate::hub::export::{ExportOptions, ModelExport, STATE_FILE};
use crate::hub::load::{load_stored, SINGLE_FILE};
use crate::train::checkpoint;
use crate::train::config::{RunConfig, Stage};
use crate::train::trainer::parse_dtype;
use crate::{Error, Result};

/// How far a run got: the stage in progress and the optimizer steps done in it
/// (`stage == stages.len()` once the run is finished).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RunProgress {
    pub stage: usize,
    pub stage_step: u64,
}

impl RunProgress {
    /// Every stage done.
    pub fn finished(run: &RunConfig) -> Self {
        Self { stage: run.stages.len(), stage_step: 0 }
    }

    pub fn is_finished(&self, run: &RunConfig) -> bool {
        self.stage >= run.stages.len()
    }

    /// The last stage that trained: the one in progress, or the one before when it has
    /// not started (the first stage when none has).
    fn trained_stage<'a>(&self, run: &'a RunConfig) -> Option<&'a Stage> {
        let trained = if self.stage_step > 0 { self.stage } else { self.stage.saturating_sub(1) };
        run.stages.get(trained.min(run.stages.len().saturating_sub(1)))
    }
}

impl ModelExport {
    /// As a run exports the weights it trained up to `progress`: `rope_theta` and
    /// `max_position_embeddings` of the last stage that trained (the latter at least the
    /// start model's `model_max_pos`) or, once finished, `[export]`'s when set; that
    /// stage's `rope` method, when it has one, as the RoPE dict of config.json (in the
    /// key the checkpoint used, `rope_scaling` or `rope_parameters`; transformers reads
    /// both back), with a dynamic NTK stage's threshold kept as `max_position_embeddings`; a
    /// sliding window as the checkpoint has it (training honours it); `[export]` dtype and shard size. `file` names the run config in
    /// errors.
    pub fn for_run(mut self, run: &RunConfig, progress: RunProgress, model_max_pos: usize, file: &Path) -> Result<Self> {
        let st = progress.trained_stage(run).ok_or_else(|| Error::config(file, "stage", "the run config has no stage"))?;
        let finished = progress.is_finished(run);
        let theta = match (finished, run.export.final_rope_theta) {
            (true, Some(t)) => t,
            _ => st.rope_theta,
        };
        let mut max_pos = match (finished, run.export.max_position_embeddings) {
            (true, Some(m)) => m,
            _ => st.seq_length.max(model_max_pos),
        };
        if st.rope.is_some() {
            let index = run.stages.iter().position(|s| std::ptr::eq(s, st)).unwrap_or(0);
            let (config, dynamic_threshold) = stage_rope_config(&self.config, st, index, file)?;
            self.config = config;
            if let (Some(t), false) = (dynamic_threshold, finished && run.export.max_position_embeddings.is_some()) {
                // transformers grows a dynamic NTK base past max_position_embeddings: keep
                // the threshold the stage trained with.
                max_pos = t;
            }
        }
        self.context = Some((theta, max_pos));
        self.options.max_shard_bytes = run.export.max_shard_bytes.unwrap_or(ExportOptions::default().max_shard_bytes);
        self.options.dtype = run.export.dtype.as_deref().map(|d| parse_dtype(d, file, "export.dtype")).transpose()?;
        Ok(self)
    }
}

/// config.json with stage `st`'s `rope` method written in (its RoPE dict as
/// [`crate::model::LlamaConfig::to_json_value`] writes it), and, for dynamic NTK, the
/// `max_position_embeddings` its base grows past.
fn stage_rope_config(config: &Value, st: &Stage, index: usize, file: &Path) -> Result<(Value, Option<usize>)> {
    let model = crate::model::LlamaConfig::from_value(Path::new(CONFIG_FILE), config.clone())?;
    let staged = st.model_config(&model, index, file)?;
    let dynamic = matches!(staged.rope_scaling, Some(crate::model::RopeScaling::Dynamic { .. }));
    let mut out = staged.to_json_value();
    // A top-level original_max_position_embeddings (Phi-3 style; some families read it
    // over the dict's) is kept equal to the stage's.
    if let (Some(o), Some(top)) = (
        staged.rope_scaling.as_ref().and_then(crate::model::RopeScaling::original_max_position_embeddings),
        out.get_mut("original_max_position_embeddings").filter(|v| !v.is_null()),
    ) {
        *top = Value::from(o);
    }
    Ok((out, dynamic.then_some(staged.max_position_embeddings)))
}

/// A training checkpoint opened for export.
pub struct TrainingCheckpoint {
    /// Its weights, exported as the trainer's own export would be at this point.
    pub export: ModelExport,
    /// The run config saved with it.
    pub run: RunConfig,
    pub progress: RunProgress,
    pub global_step: u64,
    /// The directory of the model the run started from (`None`: a built-in model).
    pub model_dir: Option<PathBuf>,
}

impl TrainingCheckpoint {
    /// The checkpoint `source` names, if any: a checkpoint directory (`state.json` and
    /// `model.safetensors`) or a run's output directory holding one.
    pub fn find(source: &Path) -> Option<PathBuf> {
        if source.join(STATE_FILE).is_file() && source.join(SINGLE_FILE).is_file() {
            return Some(source.to_path_buf());
        }
        let c = checkpoint::checkpoint_dir(source);
        c.join(STATE_FILE).is_file().then_some(c)
    }

    /// Reads the checkpoint in `dir`: the weights as stored, the saved run config, and
    /// the config of the model the run started from (resolved as the trainer does).
    pub fn open(dir: &Path, opts: &HubOptions) -> Result<Self> {
        let sp = dir.join(STATE_FILE);
        let state = checkpoint::read_state(dir)?;
        let run: RunConfig = serde_json::from_value(state.config.clone())
            .map_err(|e| Error::checkpoint(&sp, format!("field `config` is not a run config: {e}")))?;
        let model = resolve_model_config(&run.model.source, opts)
            .map_err(|e| Error::checkpoint(&sp, format!("the run's model `{}`: {e}", run.model.source)))?;
        let progress = RunProgress { stage: state.stage, stage_step: state.stage_step };
        let export = ModelExport::new(load_stored(dir)?, model.json, model.dir.clone()).for_run(
            &run,
            progress,
            model.cfg.max_position_embeddings,
            &sp,
        )?;
        Ok(Self { export, run, progress, global_step: state.global_step, model_dir: model.dir })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::DType;
    use serde_json::json;

    fn at(run: &RunConfig, stage: usize, stage_step: u64, model_max_pos: usize) -> ModelExport {
        let config = json!({"rope_theta": 1e4, "max_position_embeddings": 64, "sliding_window": 32});
        ModelExport::new(Vec::new(), config, None)
            .for_run(run, RunProgress { stage, stage_step }, model_max_pos, Path::new("run.toml"))
            .unwrap()
    }

    /// Two stages: 32 tokens at θ 1e4, then 1024 at θ 1e5.
    #[test]
    fn a_run_exports_the_context_of_its_last_trained_stage() {
        let stage = crate::train::config::Stage::new;
        let mut run = RunConfig { stages: vec![stage(32, 1e4, 200), stage(1024, 1e5, 60)], ..Default::default() };
        assert_eq!(at(&run, 2, 0, 64).context, Some((1e5, 1024)), "finished");
        assert_eq!(at(&run, 1, 5, 64).context, Some((1e5, 1024)), "inside stage 1");
        assert_eq!(at(&run, 1, 0, 64).context, Some((1e4, 64)), "stage 1 not started: stage 0's, the model's length if longer");
        assert_eq!(at(&run, 0, 0, 16).context, Some((1e4, 32)), "nothing trained yet");
        run.export = crate::train::config::ExportSection {
            final_rope_theta: Some(5e5),
            max_position_embeddings: Some(4096),
            max_shard_bytes: Some(1000),
            dtype: Some("bf16".into()),
        };
        let done = at(&run, 2, 0, 64);
        assert_eq!(done.context, Some((5e5, 4096)), "[export] once finished");
        assert_eq!((done.options.max_shard_bytes, done.options.dtype), (1000, Some(DType::BF16)));
        assert_eq!(at(&run, 1, 5, 64).context, Some((1e5, 1024)), "[export] context only once finished");
        let config = done.final_config().unwrap();
        assert_eq!(config, json!({"rope_theta": 5e5, "max_position_embeddings": 4096, "sliding_window": 32}), "the window kept");
    }

    #[test]
    fn a_model_as_stored_keeps_its_config() {
        let e = ModelExport::new(Vec::new(), json!({"rope_theta": 1e4, "sliding_window": 32}), None);
        assert_eq!(e.final_config().unwrap(), json!({"rope_theta": 1e4, "sliding_window": 32}));
        let mut run = RunConfig::default();
        run.stages.clear();
        let err = e.for_run(&run, RunProgress::finished(&run), 64, Path::new("run.toml")).unwrap_err().to_string();
        assert!(err.contains("run.toml") && err.contains("no stage"), "{err}");
    }
}
