//! Export in the Hugging Face layout, loadable by `AutoModelForCausalLM.from_pretrained`.
//!
//! ```text
//! out_dir/
//!   config.json                      the caller's config (torch_dtype set to the weights' dtype)
//!   model.safetensors                when everything fits in one shard, else
//!   model-00001-of-0000N.safetensors shards, tensors in natural name order
//!   model.safetensors.index.json     {"metadata": {"total_size": bytes}, "weight_map": {name: shard}}
//!   tokenizer.json, chat_template.jinja, ...  every side file of the source model directory ([`side_files`])
//! ```
//! Safetensors metadata is `{"format": "pt"}` (transformers refuses files without it).
//!
//! Nothing non-finite is exported: a NaN or infinite value (also one produced by the
//! conversion to the export dtype) is an error before anything is written.
//!
//! Atomicity: everything is written into a hidden sibling directory, synced, then renamed
//! into place. An existing `out_dir` is renamed aside first and deleted only once the new
//! one is in place, so a crash or error never leaves a half-written checkpoint at `out_dir`.
//!
//! What to write: [`ModelExport`] (weights, the source's config.json and the fields to
//! change). The trainer's final export and `longctx export` of a training checkpoint both
//! set it up with `ModelExport::for_run` (`train::export`: the run's side lives with the
//! trainer), so a run's export is the same either way.

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

use super::config::{read_config, set_context_fields, set_torch_dtype, CONFIG_FILE};
use super::load::{load_stored, INDEX_FILE, SINGLE_FILE};
use super::st_file::dtype_name;
use crate::{Error, Result};

/// A training checkpoint's state (next to its `model.safetensors`): never a side file.
pub const STATE_FILE: &str = "state.json";

/// The tokenizer, chat and generation files a hub model may have beside its weights
/// (fetched with a hub model when the repository has them). An export copies these and
/// any other side file of the source directory ([`side_files`]).
pub const TOKENIZER_FILES: [&str; 10] = [
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
];

/// Extensions of weight files: never copied as side files (the export writes its own).
const WEIGHT_EXTENSIONS: [&str; 11] = ["safetensors", "bin", "pt", "pth", "ckpt", "gguf", "h5", "msgpack", "onnx", "npz", "ot"];

/// The files of a model directory that an export copies unchanged: every file (links
/// followed; a dangling link is kept, and its copy fails) at its top level except what the export writes itself (`config.json`,
/// weights and their index), other weight formats, a training checkpoint's `state.json`,
/// the model card (`README.md`, which describes the source model) and hidden files. So
/// the tokenizer, `chat_template.jinja` and any file transformers' tokenizer classes
/// read (`vocab.json`, `merges.txt`, `tokenizer.model`, ...) travel with the weights.
pub fn side_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))? {
        let path = entry.map_err(|e| Error::io(dir, e))?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else { continue };
        let ext = Path::new(name).extension().and_then(|e| e.to_str()).unwrap_or("");
        let skip = name.starts_with('.')
            || matches!(name, CONFIG_FILE | STATE_FILE | "README.md")
            || name.ends_with(".index.json")
            || WEIGHT_EXTENSIONS.contains(&ext);
        // Directories are left out; a link whose target is missing (a hub cache's blob
        // deleted) stays in, so that copying it fails with the file named.
        if !skip && !path.is_dir() {
            out.push(path);
        }
    }
    out.sort();
    Ok(out)
}

/// How to write the checkpoint.
#[derive(Debug, Clone)]
pub struct ExportOptions {
    /// Largest shard in bytes of tensor data (transformers' default is 5 GB). A tensor
    /// larger than this goes alone into its own shard.
    pub max_shard_bytes: u64,
    /// Dtype of the written weights; `None` keeps each tensor's dtype.
    pub dtype: Option<DType>,
}

impl Default for ExportOptions {
    fn default() -> Self {
        Self { max_shard_bytes: 5_000_000_000, dtype: None }
    }
}

/// What [`export`] wrote.
#[derive(Debug, Clone)]
pub struct ExportReport {
    pub dir: PathBuf,
    /// Weight file names, in shard order.
    pub weight_files: Vec<String>,
    /// Bytes of tensor data over all shards (the index's `total_size`).
    pub total_size: u64,
}

/// Writes `tensors` and `config` as a Hugging Face checkpoint at `out_dir` (see module
/// docs), copying the tokenizer/generation files of `source_dir` when given.
pub fn export(
    out_dir: impl AsRef<Path>,
    tensors: &[(String, Tensor)],
    config: &Value,
    source_dir: Option<&Path>,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    let out_dir = out_dir.as_ref();
    // Everything that can be checked before writing is checked here.
    if opts.max_shard_bytes == 0 {
        return Err(Error::Setting("export: max_shard_bytes must be > 0".into()));
    }
    if out_dir.exists() && !out_dir.is_dir() {
        return Err(Error::checkpoint(out_dir, "export target exists and is not a directory; choose another path"));
    }
    let mut config = config.clone();
    if !config.is_object() {
        return Err(Error::Setting("export: the model config must be a JSON object".into()));
    }
    let fused = fuse_projections(tensors, &config)?;
    let items = export_items(fused.as_deref().unwrap_or(tensors), opts)?;
    check_finite(&items, out_dir)?;
    let dtypes: Vec<DType> = items.iter().map(|it| it.dtype).collect();
    if let Some(&first) = dtypes.first() {
        if dtypes.iter().all(|&d| d == first) {
            set_torch_dtype(&mut config, first)?;
        }
    }

    let shards = plan_shards(&items, opts.max_shard_bytes);
    let n = shards.len();
    let names: Vec<String> =
        if n <= 1 { vec![SINGLE_FILE.to_string()] } else { (1..=n).map(|i| format!("model-{i:05}-of-{n:05}.safetensors")).collect() };

    let (parent, base) = split_target(out_dir)?;
    std::fs::create_dir_all(&parent).map_err(|e| Error::io(&parent, e))?;
    let tmp = parent.join(format!(".{base}.tmp-{}", unique_suffix()));
    std::fs::create_dir(&tmp).map_err(|e| Error::io(&tmp, e))?;

    let written = (|| -> Result<u64> {
        let mut total = 0u64;
        let mut weight_map = BTreeMap::new();
        for (shard, file) in shards.iter().zip(&names) {
            let members: Vec<&Item> = shard.iter().map(|&i| &items[i]).collect();
            total += write_safetensors(&tmp.join(file), &members)?;
            for it in members {
                weight_map.insert(it.name.clone(), file.clone());
            }
        }
        if n > 1 {
            let index = serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
            write_json(&tmp.join(INDEX_FILE), &index)?;
        }
        write_json(&tmp.join(CONFIG_FILE), &config)?;
        if let Some(src) = source_dir {
            for from in side_files(src)? {
                let to = tmp.join(from.file_name().unwrap_or_default());
                std::fs::copy(&from, &to).map_err(|e| Error::io(&from, e))?;
                sync_file(&to)?;
            }
        }
        sync_dir(&tmp);
        Ok(total)
    })();
    let total_size = match written {
        Ok(t) => t,
        Err(e) => {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
    };
    swap_into_place(&tmp, out_dir, &parent, &base)?;
    Ok(ExportReport { dir: out_dir.to_path_buf(), weight_files: names, total_size })
}

/// A Phi-3 checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj`
/// (what transformers' Phi3ForCausalLM loads): the split projections longctx trains are
/// concatenated back, rows in the order `crate::hub::Checkpoint` split them. `None` for
/// every other family (nothing to fuse).
fn fuse_projections(tensors: &[(String, Tensor)], config: &Value) -> Result<Option<Vec<(String, Tensor)>>> {
    if config.get("model_type").and_then(Value::as_str) != Some("phi3") {
        return Ok(None);
    }
    let groups: [(&str, &[&str]); 2] = [
        ("self_attn.qkv_proj.weight", &["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
        ("mlp.gate_up_proj.weight", &["mlp.gate_proj.weight", "mlp.up_proj.weight"]),
    ];
    let by_name: HashMap<&str, &Tensor> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let mut taken = std::collections::HashSet::new();
    let mut out = Vec::with_capacity(tensors.len());
    for (name, _) in tensors {
        for (fused, parts) in groups {
            let Some(prefix) = name.strip_suffix(parts[0]) else { continue };
            let mut pieces = Vec::with_capacity(parts.len());
            for p in parts {
                let full = format!("{prefix}{p}");
                let t = by_name.get(full.as_str()).ok_or_else(|| {
                    Error::Setting(format!("export: Phi-3 fuses `{prefix}{}` from {parts:?}, but `{full}` is missing", fused))
                })?;
                pieces.push((*t).clone());
                taken.insert(full);
            }
            out.push((format!("{prefix}{fused}"), Tensor::cat(&pieces, 0)?));
        }
    }
    out.extend(tensors.iter().filter(|(n, _)| !taken.contains(n)).cloned());
    Ok(Some(out))
}

/// The tensors in natural name order with their written dtype and size; errors for
/// duplicate or invalid names and non-float dtypes.
fn export_items<'a>(tensors: &'a [(String, Tensor)], opts: &ExportOptions) -> Result<Vec<Item<'a>>> {
    let mut order: Vec<usize> = (0..tensors.len()).collect();
    order.sort_by(|&a, &b| natural_cmp(&tensors[a].0, &tensors[b].0));
    for w in order.windows(2) {
        if tensors[w[0]].0 == tensors[w[1]].0 {
            return Err(Error::Setting(format!("export: tensor name `{}` appears twice", tensors[w[0]].0)));
        }
    }
    let mut items = Vec::with_capacity(tensors.len());
    for &i in &order {
        let (name, t) = &tensors[i];
        if name.is_empty() || name == "__metadata__" {
            return Err(Error::Setting(format!("export: invalid tensor name `{name}`")));
        }
        let dtype = opts.dtype.unwrap_or(t.dtype());
        if !matches!(dtype, DType::F32 | DType::F16 | DType::BF16 | DType::F64) {
            return Err(Error::Setting(format!(
                "export: tensor `{name}` would be written as {dtype:?}; export writes floating-point weights only (f32, f16, bf16)"
            )));
        }
        let bytes = (t.elem_count() * dtype.size_in_bytes()) as u64;
        items.push(Item { name, tensor: t, dtype, bytes });
    }
    Ok(items)
}

/// Nothing non-finite is exported: every tensor, in the dtype it is written in (f32 → f16
/// overflows beyond ±65504), must hold finite values only.
fn check_finite(items: &[Item], out_dir: &Path) -> Result<()> {
    for it in items {
        let converted = it.tensor.dtype() != it.dtype;
        let t = if converted { it.tensor.to_dtype(it.dtype)? } else { it.tensor.clone() };
        if !crate::guard::all_finite(&t)? {
            let how = if converted && crate::guard::all_finite(it.tensor)? {
                format!(" once converted to {:?} (values beyond its range); export in a wider dtype", it.dtype)
            } else {
                "; the weights are broken (export an earlier checkpoint)".to_string()
            };
            return Err(Error::checkpoint(out_dir, format!("not exported: tensor `{}` holds NaN or infinite values{how}", it.name)));
        }
    }
    Ok(())
}

/// [`export`] from a map (e.g. the result of `load_weights` or a VarMap's data).
pub fn export_map(
    out_dir: impl AsRef<Path>,
    tensors: &std::collections::HashMap<String, Tensor>,
    config: &Value,
    source_dir: Option<&Path>,
    opts: &ExportOptions,
) -> Result<ExportReport> {
    let list: Vec<(String, Tensor)> = tensors.iter().map(|(k, v)| (k.clone(), v.clone())).collect();
    export(out_dir, &list, config, source_dir, opts)
}

// ------------------------------------------------------------------ what an export writes

/// A model to write as a Hugging Face checkpoint: its weights, the config.json it came
/// with and what to change in it. The trainer's final export and `longctx export` both
/// write through this (see `train::export`, which sets it up for a run).
#[derive(Debug, Clone)]
pub struct ModelExport {
    pub tensors: Vec<(String, Tensor)>,
    /// config.json of the model the weights came from, as read.
    pub config: Value,
    /// Where tokenizer and generation files are copied from.
    pub tokenizer_dir: Option<PathBuf>,
    /// `rope_theta` and `max_position_embeddings` to write; `None` keeps the config's.
    pub context: Option<(f64, usize)>,
    pub options: ExportOptions,
}

impl ModelExport {
    /// The weights and config as they are (each tensor's dtype kept, 5 GB shards).
    pub fn new(tensors: Vec<(String, Tensor)>, config: Value, tokenizer_dir: Option<PathBuf>) -> Self {
        Self { tensors, config, tokenizer_dir, context: None, options: ExportOptions::default() }
    }

    /// Every tensor (in its stored dtype), the config.json and the tokenizer files of a
    /// model directory.
    pub fn from_model_dir(dir: &Path) -> Result<Self> {
        Ok(Self::new(load_stored(dir)?, read_config(dir)?, Some(dir.to_path_buf())))
    }

    /// The config.json to write (the weights' dtype is recorded by [`export`]).
    pub fn final_config(&self) -> Result<Value> {
        // A sliding window is kept as the checkpoint has it: training honours it.
        let mut config = self.config.clone();
        if let Some((theta, max_pos)) = self.context {
            set_context_fields(&mut config, theta, max_pos)?;
        }
        Ok(config)
    }

    /// Writes the checkpoint at `out_dir` (see [`export`]).
    pub fn write(&self, out_dir: &Path) -> Result<ExportReport> {
        export(out_dir, &self.tensors, &self.final_config()?, self.tokenizer_dir.as_deref(), &self.options)
    }
}

struct Item<'a> {
    name: &'a String,
    tensor: &'a Tensor,
    dtype: DType,
    bytes: u64,
}

/// Greedy sharding in name order, as transformers does: start a new shard when the next
/// tensor would push the current one past `max`; a tensor larger than `max` sits alone.
fn plan_shards(items: &[Item], max: u64) -> Vec<Vec<usize>> {
    let mut shards: Vec<Vec<usize>> = Vec::new();
    let mut cur: Vec<usize> = Vec::new();
    let mut cur_bytes = 0u64;
    for (i, it) in items.iter().enumerate() {
        if !cur.is_empty() && (cur_bytes + it.bytes > max || it.bytes > max) {
            shards.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
        cur.push(i);
        cur_bytes += it.bytes;
        if it.bytes > max {
            shards.push(std::mem::take(&mut cur));
            cur_bytes = 0;
        }
    }
    if !cur.is_empty() || shards.is_empty() {
        shards.push(cur);
    }
    shards
}

/// Writes one safetensors file, converting and copying one tensor at a time (memory
/// stays at one tensor). Larger elements first so every tensor is aligned to its
/// element size (the header is padded to 8 bytes). Returns the data bytes written.
fn write_safetensors(path: &Path, members: &[&Item]) -> Result<u64> {
    let mut members: Vec<&Item> = members.to_vec();
    members.sort_by(|a, b| b.dtype.size_in_bytes().cmp(&a.dtype.size_in_bytes()).then(natural_cmp(a.name, b.name)));
    let mut header = serde_json::Map::new();
    header.insert("__metadata__".into(), serde_json::json!({ "format": "pt" }));
    let mut offset = 0u64;
    for it in &members {
        header.insert(
            it.name.clone(),
            serde_json::json!({
                "dtype": dtype_name(it.dtype),
                "shape": it.tensor.dims(),
                "data_offsets": [offset, offset + it.bytes],
            }),
        );
        offset += it.bytes;
    }
    let mut head = serde_json::to_vec(&Value::Object(header)).map_err(|e| Error::checkpoint(path, e.to_string()))?;
    head.resize(head.len().next_multiple_of(8), b' ');

    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    let io = |e| Error::io(path, e);
    w.write_all(&(head.len() as u64).to_le_bytes()).map_err(io)?;
    w.write_all(&head).map_err(io)?;
    for it in &members {
        let bytes = tensor_le_bytes(it.tensor, it.dtype)?;
        debug_assert_eq!(bytes.len() as u64, it.bytes);
        w.write_all(&bytes).map_err(io)?;
    }
    let file = w.into_inner().map_err(|e| Error::io(path, e.into_error()))?;
    file.sync_all().map_err(io)?;
    Ok(offset)
}

/// The little-endian bytes of `t` converted to `dtype`, in row-major order.
fn tensor_le_bytes(t: &Tensor, dtype: DType) -> Result<Vec<u8>> {
    let t = t.to_device(&Device::Cpu)?.to_dtype(dtype)?.flatten_all()?;
    Ok(match dtype {
        DType::F32 => t.to_vec1::<f32>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F16 => t.to_vec1::<half::f16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::BF16 => t.to_vec1::<half::bf16>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        DType::F64 => t.to_vec1::<f64>()?.iter().flat_map(|x| x.to_le_bytes()).collect(),
        other => return Err(Error::Setting(format!("export: cannot write dtype {other:?}"))),
    })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let mut text = serde_json::to_string_pretty(v).map_err(|e| Error::checkpoint(path, e.to_string()))?;
    text.push('\n');
    std::fs::write(path, text).map_err(|e| Error::io(path, e))?;
    sync_file(path)
}

fn sync_file(path: &Path) -> Result<()> {
    let f = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
    f.sync_all().map_err(|e| Error::io(path, e))
}

/// Best effort: persists the directory entries (renames, new files) on Unix.
fn sync_dir(dir: &Path) {
    if let Ok(f) = std::fs::File::open(dir) {
        let _ = f.sync_all();
    }
}

/// (parent directory, final component) of the export target.
fn split_target(out_dir: &Path) -> Result<(PathBuf, String)> {
    let base = out_dir
        .file_name()
        .and_then(|s| s.to_str())
        .ok_or_else(|| Error::Setting(format!("export: `{}` does not end in a directory name", out_dir.display())))?
        .to_string();
    let parent = match out_dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    Ok((parent, base))
}

fn unique_suffix() -> String {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.subsec_nanos()).unwrap_or(0);
    format!("{}-{}-{}", std::process::id(), COUNTER.fetch_add(1, AtomicOrdering::Relaxed), nanos)
}

/// Moves the finished `tmp` to `out_dir`: an existing `out_dir` is renamed aside, the new
/// one renamed in, then the old one deleted. If the second rename fails, the old one is
/// put back.
fn swap_into_place(tmp: &Path, out_dir: &Path, parent: &Path, base: &str) -> Result<()> {
    if !out_dir.exists() {
        return match std::fs::rename(tmp, out_dir) {
            Ok(()) => {
                sync_dir(parent);
                Ok(())
            }
            Err(e) => {
                let _ = std::fs::remove_dir_all(tmp);
                Err(Error::io(out_dir, e))
            }
        };
    }
    let old = parent.join(format!(".{base}.old-{}", unique_suffix()));
    if let Err(e) = std::fs::rename(out_dir, &old) {
        let _ = std::fs::remove_dir_all(tmp);
        return Err(Error::io(out_dir, e));
    }
    if let Err(e) = std::fs::rename(tmp, out_dir) {
        let restored = std::fs::rename(&old, out_dir);
        let _ = std::fs::remove_dir_all(tmp);
        return Err(match restored {
            Ok(()) => Error::io(out_dir, e),
            Err(_) => Error::checkpoint(
                out_dir,
                format!("could not move the new checkpoint in ({e}) nor the old one back: the old one is at {}", old.display()),
            ),
        });
    }
    sync_dir(parent);
    // The new checkpoint is complete and in place; a leftover old copy only wastes space.
    if let Err(e) = std::fs::remove_dir_all(&old) {
        eprintln!("warning: could not delete the previous checkpoint at {} ({e}); remove it by hand", old.display());
    }
    Ok(())
}

/// Orders names with digit runs compared as numbers, so `layers.2` < `layers.10`:
/// shards then hold consecutive layers.
pub fn natural_cmp(a: &str, b: &str) -> Ordering {
    let (mut a, mut b) = (a.as_bytes(), b.as_bytes());
    loop {
        match (a.first(), b.first()) {
            (None, None) => return Ordering::Equal,
            (None, Some(_)) => return Ordering::Less,
            (Some(_), None) => return Ordering::Greater,
            (Some(x), Some(y)) if x.is_ascii_digit() && y.is_ascii_digit() => {
                let la = a.iter().take_while(|c| c.is_ascii_digit()).count();
                let lb = b.iter().take_while(|c| c.is_ascii_digit()).count();
                let (da, db) = (&a[..la], &b[..lb]);
                // Compare numerically without overflow: strip leading zeros, then length, then digits.
                let ta = &da[da.iter().take_while(|&&c| c == b'0').count()..];
                let tb = &db[db.iter().take_while(|&&c| c == b'0').count()..];
                let ord = ta.len().cmp(&tb.len()).then(ta.cmp(tb)).then(la.cmp(&lb));
                if ord != Ordering::Equal {
                    return ord;
                }
                a = &a[la..];
                b = &b[lb..];
            }
            (Some(x), Some(y)) => {
                if x != y {
                    return x.cmp(y);
                }
                a = &a[1..];
                b = &b[1..];
            }
        }
    }
}
