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
        return Err(Error::checkpoint(
            &path,
            "missing: a model directory needs config.json (the Hugging Face model config, \
             saved by `save_pretrained` next to the weights)",
        ));
    }
    Ok(path)
}

/// Reads `dir/config.json` as a JSON object.
pub fn read_config(dir: impl AsRef<Path>) -> Result<Value> {
    let path = config_path(dir)?;
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
    let v: Value = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(&path, format!("not valid JSON ({e}); re-download or fix the file")))?;
    if !v.is_object() {
        return Err(Error::checkpoint(&path, "expected a JSON object at the top level"));
    }
    Ok(v)
}

/// Sets the two fields a context extension changes: `rope_theta` (the RoPE base) and
/// `max_position_embeddings` (the trained context length).
pub fn set_context_fields(config: &mut Value, rope_theta: f64, max_position_embeddings: usize) -> Result<()> {
    let obj = config
        .as_object_mut()
        .ok_or_else(|| Error::Setting("model config must be a JSON object".into()))?;
    obj.insert("rope_theta".into(), Value::from(rope_theta));
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

/// Sets `torch_dtype` to the dtype the weights are stored in (and `dtype`, the name
/// transformers >= 4.56 writes, when the config already has it).
pub fn set_torch_dtype(config: &mut Value, dtype: DType) -> Result<()> {
    let name = torch_dtype_name(dtype)
        .ok_or_else(|| Error::Setting(format!("dtype {dtype:?} is not a weight dtype (use f32, f16 or bf16)")))?;
    let obj = config
        .as_object_mut()
        .ok_or_else(|| Error::Setting("model config must be a JSON object".into()))?;
    obj.insert("torch_dtype".into(), Value::from(name));
    if obj.contains_key("dtype") {
        obj.insert("dtype".into(), Value::from(name));
    }
    Ok(())
}
