//! The raw `config.json` of a model directory, read and edited as JSON.
//!
//! The typed Llama config lives in `model`; here we only need the file to exist, to be
//! a JSON object, and to update the fields a context extension changes, keeping every
//! other field (architectures, token ids, rope_scaling, ...) as the source wrote it.

use std::path::{Path, PathBuf};

use candle_core::DType;
use serde_json::Value;

use crate::{Error, Result};

pub const CONFIG_FILE: &str = "config.json";

/// `dir/config.json`, or an error saying the model directory needs it.
pub fn config_path(dir: impl AsRef<Path>) -> Result<PathBuf> {
    let path = dir.as_ref().join(CONFIG_FILE);
    if !path.is_file() {
        let dir = dir.as_ref();
        // A run's output directory: its model is the export (or, before the end, the checkpoint).
        let hint = if dir.join("export").join(CONFIG_FILE).is_file() {
            format!("; {} is a run's output directory: its model is {}", dir.display(), dir.join("export").display())
        } else if dir.join("checkpoint").join("state.json").is_file() {
            format!(
                "; {} is a run's output directory without an export yet: export its checkpoint with `longctx export {}`",
                dir.display(),
                dir.join("checkpoint").display()
            )
        } else {
            String::new()
        };
        return Err(Error::checkpoint(
            &path,
            format!(
                "missing: a model directory needs config.json (the Hugging Face model config, saved by `save_pretrained` next \
                 to the weights){hint}"
            ),
        ));
    }
    Ok(path)
}

/// Reads `dir/config.json` as a JSON object.
pub fn read_config(dir: impl AsRef<Path>) -> Result<Value> {
    let path = config_path(dir)?;
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| Error::checkpoint(&path, format!("not valid JSON ({e}); re-download or fix the file")))?;
    if !v.is_object() {
        return Err(Error::checkpoint(&path, "expected a JSON object at the top level"));
    }
    Ok(v)
}

/// RoPE types whose frequencies depend on `original_max_position_embeddings`; transformers
/// falls back to `max_position_embeddings` when that key is absent.
const ROPE_TYPES_WITH_ORIGINAL_MAX: [&str; 3] = ["llama3", "yarn", "longrope"];

/// Sets the two fields a context extension changes: the RoPE base `rope_theta` and the
/// trained context length `max_position_embeddings`, in every place transformers reads them:
/// - transformers < 5: top-level `rope_theta` (next to an optional `rope_scaling` dict);
/// - transformers >= 5: `rope_parameters.rope_theta`, which takes priority over the top
///   level (or one dict per layer type, e.g. `rope_parameters.full_attention`; for Gemma 3
///   that one only: its `sliding_attention` base stays; in the transformers 4 form its
///   `rope_local_base_freq` is not touched either).
///
/// For llama3 / yarn / longrope scaling without an explicit
/// `original_max_position_embeddings`, the old `max_position_embeddings` is pinned there
/// first, so raising the context length does not silently change the RoPE frequencies.
pub fn set_context_fields(config: &mut Value, rope_theta: f64, max_position_embeddings: usize) -> Result<()> {
    let obj = config.as_object_mut().ok_or_else(|| Error::Setting("model config must be a JSON object".into()))?;
    let old_max = obj.get("max_position_embeddings").and_then(Value::as_u64);
    let top_level_original = obj.contains_key("original_max_position_embeddings");
    let gemma = obj.get("model_type").and_then(Value::as_str) == Some("gemma3_text");

    let fix_rope_dict = |d: &mut serde_json::Map<String, Value>, set_theta: bool| {
        if set_theta || d.contains_key("rope_theta") {
            d.insert("rope_theta".into(), Value::from(rope_theta));
        }
        let kind = d.get("rope_type").or_else(|| d.get("type")).and_then(Value::as_str).unwrap_or("default");
        if ROPE_TYPES_WITH_ORIGINAL_MAX.contains(&kind) && !d.contains_key("original_max_position_embeddings") && !top_level_original {
            if let Some(old) = old_max {
                d.insert("original_max_position_embeddings".into(), Value::from(old));
            }
        }
    };
    let has_rope_parameters = matches!(obj.get("rope_parameters"), Some(Value::Object(_)));
    if let Some(Value::Object(rp)) = obj.get_mut("rope_parameters") {
        let flat = rp.contains_key("rope_type") || rp.contains_key("rope_theta") || rp.contains_key("type");
        if flat {
            fix_rope_dict(rp, true);
        } else if let (Some(Value::Object(d)), true) = (rp.get_mut("full_attention"), gemma) {
            // Gemma 3: a context extension is the full-attention layers' (the sliding
            // layers keep their base, as longctx trains them).
            fix_rope_dict(d, true);
        } else {
            for nested in rp.values_mut() {
                if let Value::Object(d) = nested {
                    fix_rope_dict(d, true);
                }
            }
        }
    }
    if let Some(Value::Object(rs)) = obj.get_mut("rope_scaling") {
        fix_rope_dict(rs, false);
    }
    if obj.contains_key("rope_theta") || !has_rope_parameters {
        obj.insert("rope_theta".into(), Value::from(rope_theta));
    }
    obj.insert("max_position_embeddings".into(), Value::from(max_position_embeddings));
    Ok(())
}

/// The transformers name of a dtype ("float32", "float16", "bfloat16").
pub fn torch_dtype_name(dtype: DType) -> Option<&'static str> {
    Some(match dtype {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        _ => return None,
    })
}

/// Records the dtype the weights are stored in: `dtype` (transformers >= 5) and/or
/// `torch_dtype` (older), updating whichever the config has, `torch_dtype` if neither
/// (transformers 5 still reads it).
pub fn set_torch_dtype(config: &mut Value, dtype: DType) -> Result<()> {
    let name =
        torch_dtype_name(dtype).ok_or_else(|| Error::Setting(format!("dtype {dtype:?} is not a weight dtype (use f32, f16 or bf16)")))?;
    let obj = config.as_object_mut().ok_or_else(|| Error::Setting("model config must be a JSON object".into()))?;
    let has_new = obj.contains_key("dtype");
    if obj.contains_key("torch_dtype") || !has_new {
        obj.insert("torch_dtype".into(), Value::from(name));
    }
    if has_new {
        obj.insert("dtype".into(), Value::from(name));
    }
    Ok(())
}
