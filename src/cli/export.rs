//! `longctx export`: a training checkpoint (or a run's output directory holding one), a
//! Hugging Face model directory or a hub id → a Hugging Face checkpoint, with the flags
//! over what the source implies. The export itself is the one the trainer writes at the
//! end of a run ([`longctx::hub::ModelExport`]).

use super::{human_bytes, parse_dtype, positive_theta, size_arg, FLAGS};
use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use longctx::hub::{HubOptions, ModelExport};
use longctx::model::LlamaConfig;
use longctx::train::export::TrainingCheckpoint;
use std::path::{Path, PathBuf};

#[derive(Args, Debug)]
pub struct ExportArgs {
    /// What to export: a training output directory (holding checkpoint/), a checkpoint
    /// directory (holding state.json), a Hugging Face model directory, or a hub id.
    pub source: String,
    /// Directory to write the Hugging Face checkpoint to (replaced atomically if it exists).
    #[arg(long, short = 'o')]
    pub output_dir: PathBuf,
    /// rope_theta written into config.json [default: a training checkpoint's final theta
    /// (export.final_rope_theta, else its last trained stage's); an HF model's own].
    #[arg(long, allow_negative_numbers = true)]
    pub rope_theta: Option<f64>,
    /// max_position_embeddings written into config.json [default: the trained length, at
    /// least the model's; an HF model's own].
    #[arg(long)]
    pub max_position_embeddings: Option<usize>,
    /// Largest weight shard: bytes or a size such as 5GB, 500MB, 2GiB [default: the run's
    /// export.max_shard_bytes, else 5GB].
    #[arg(long, value_parser = size_arg)]
    pub max_shard_size: Option<u64>,
    /// dtype of the written weights: f32, bf16, f16 [default: as stored].
    #[arg(long)]
    pub dtype: Option<String>,
}

/// What an export starts from, with what the summary line says about it.
struct Source {
    export: ModelExport,
    /// Directories the export must not replace (the source, the model it came from).
    dirs: Vec<PathBuf>,
    what: String,
}

pub fn export(a: ExportArgs) -> Result<()> {
    if let Some(t) = a.rope_theta {
        positive_theta(t, "--rope-theta")?;
    }
    if a.max_position_embeddings == Some(0) {
        return Err(longctx::Error::config(FLAGS, "--max-position-embeddings", "must be at least 1").into());
    }
    let flag_dtype = a.dtype.as_deref().map(|d| parse_dtype(d, "--dtype")).transpose()?;
    let opts = HubOptions::from_env();
    let mut src = match TrainingCheckpoint::find(Path::new(&a.source)) {
        Some(dir) => {
            // `-o <run dir>` would replace the run (checkpoint included) by the export.
            if let Some(run_dir) = dir.parent() {
                refuse_overwrite(&[run_dir.to_path_buf()], &a.output_dir)?;
            }
            training_source(&dir, &opts)?
        }
        None => hf_source(&a.source, &opts)?,
    };
    refuse_overwrite(&src.dirs, &a.output_dir)?;
    let e = &mut src.export;
    apply_context_flags(e, a.rope_theta, a.max_position_embeddings)?;
    if flag_dtype.is_some() {
        e.options.dtype = flag_dtype;
    }
    if let Some(s) = a.max_shard_size {
        e.options.max_shard_bytes = s;
    }
    let rep = e.write(&a.output_dir).context("writing the export")?;
    let after = LlamaConfig::from_value("config.json", e.final_config()?).ok();
    println!(
        "exported {} tensors ({}) in {} file(s) to {} from {}; rope_theta {}, max_position_embeddings {}",
        e.tensors.len(),
        human_bytes(rep.total_size),
        rep.weight_files.len(),
        rep.dir.display(),
        src.what,
        after.as_ref().map_or("?".into(), |c| c.rope_theta.to_string()),
        after.as_ref().map_or("?".into(), |c| c.max_position_embeddings.to_string()),
    );
    Ok(())
}

/// A training checkpoint, exported as the trainer's own export would be.
fn training_source(dir: &Path, opts: &HubOptions) -> Result<Source> {
    let ck = TrainingCheckpoint::open(dir, opts)?;
    let n = ck.run.stages.len();
    let what = if ck.progress.is_finished(&ck.run) {
        format!("finished run ({n} stage(s), {} steps)", ck.global_step)
    } else {
        format!("mid-run checkpoint (stage {} step {} of {n} stage(s))", ck.progress.stage, ck.progress.stage_step)
    };
    let mut dirs = vec![dir.to_path_buf()];
    dirs.extend(ck.model_dir.clone());
    Ok(Source { export: ck.export, dirs, what })
}

/// A Hugging Face model directory or hub id: everything as stored unless flags say otherwise.
fn hf_source(spec: &str, opts: &HubOptions) -> Result<Source> {
    let dir = longctx::hub::resolve_model(spec, opts)?.dir;
    Ok(Source { export: ModelExport::from_model_dir(&dir)?, what: format!("Hugging Face model {}", dir.display()), dirs: vec![dir] })
}

/// `--rope-theta` / `--max-position-embeddings` over the source's context; one given
/// alone keeps the other (the source's, else config.json's).
fn apply_context_flags(e: &mut ModelExport, theta: Option<f64>, max_pos: Option<usize>) -> Result<()> {
    let theta = theta.or(e.context.map(|c| c.0));
    let max_pos = max_pos.or(e.context.map(|c| c.1));
    if theta.is_none() && max_pos.is_none() {
        return Ok(());
    }
    let cur = LlamaConfig::from_value("config.json", e.config.clone()).ok();
    let t =
        theta.or(cur.as_ref().map(|c| c.rope_theta)).ok_or_else(|| anyhow!("config.json has no readable rope_theta; pass --rope-theta"))?;
    let m = max_pos
        .or(cur.as_ref().map(|c| c.max_position_embeddings))
        .ok_or_else(|| anyhow!("config.json has no readable max_position_embeddings; pass --max-position-embeddings"))?;
    e.context = Some((t, m));
    Ok(())
}

/// Error when writing `out` would replace one of `dirs` or a directory holding one.
fn refuse_overwrite(dirs: &[PathBuf], out: &Path) -> Result<()> {
    let Ok(o) = out.canonicalize() else { return Ok(()) }; // does not exist yet
    for d in dirs {
        if let Ok(d) = d.canonicalize() {
            if d.starts_with(&o) {
                bail!("--output-dir {} would replace the source {}; export to another directory", out.display(), d.display());
            }
        }
    }
    Ok(())
}
