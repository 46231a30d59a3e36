//! Loading the weights of a Hugging Face model directory.
//!
//! A directory holds either one `model.safetensors` or shards listed by
//! `model.safetensors.index.json` (`{"metadata": {..}, "weight_map": {name: shard file}}`).
//! Like transformers, a single `model.safetensors` wins when both exist.
//! Files are memory-mapped; a tensor is read (and converted to the run dtype) only when
//! asked for, so [`Checkpoint::var_builder`] streams weights straight into the model.
//! Every tensor read is checked for NaN and infinities (`eval`, `generate`, `train` and
//! `export` all refuse such a model at load, naming the file and the tensor).

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Shape, Tensor};
use candle_nn::{VarBuilder, VarMap};

use super::st_file::{dtype_size, float_dtype, SafetensorsFile};
use crate::{Error, Result};

pub const SINGLE_FILE: &str = "model.safetensors";
pub const INDEX_FILE: &str = "model.safetensors.index.json";

/// The weights of one model directory: its safetensors files (mapped, headers checked)
/// and which file holds which tensor.
pub struct Checkpoint {
    dir: PathBuf,
    /// `Some(path)` for a sharded checkpoint.
    index: Option<PathBuf>,
    files: Vec<SafetensorsFile>,
    /// tensor name -> position in `files`.
    routing: BTreeMap<String, usize>,
    /// Tensors a file stores fused (Phi-3's `qkv_proj`, `gate_up_proj`), by the split
    /// names the model uses: rows `start..start + shape[0]` of `fused`.
    parts: BTreeMap<String, Part>,
}

/// Rows of a fused tensor, under the name of the projection they are.
#[derive(Debug, Clone)]
struct Part {
    fused: String,
    start: usize,
    shape: Vec<usize>,
}

/// The fused projections a checkpoint may store, and how they split: (suffix of the
/// fused tensor, the split names' suffixes). Row counts come from config.json.
const FUSED: [(&str, [&str; 3]); 2] = [
    ("self_attn.qkv_proj.weight", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
    ("mlp.gate_up_proj.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight", ""]),
];

/// Row counts of the split projections of `FUSED[i]`, from the model directory's config.json.
fn fused_rows(dir: &Path) -> Result<[[usize; 3]; 2]> {
    let file = dir.join("config.json");
    let text = std::fs::read_to_string(&file).map_err(|e| Error::io(&file, e))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| Error::checkpoint(&file, format!("not valid JSON ({e}); the fused weights need it to split")))?;
    let int = |k: &str| v.get(k).and_then(serde_json::Value::as_u64).map(|x| x as usize);
    let need = |k: &str| int(k).ok_or_else(|| Error::config(&file, k, "missing: needed to split the checkpoint's fused projections"));
    let (hidden, hq, inter) = (need("hidden_size")?, need("num_attention_heads")?, need("intermediate_size")?);
    let hkv = int("num_key_value_heads").unwrap_or(hq);
    let hd = match int("head_dim") {
        Some(d) => d,
        None if hq > 0 => hidden / hq,
        None => return Err(Error::config(&file, "num_attention_heads", "must be positive")),
    };
    Ok([[hq * hd, hkv * hd, hkv * hd], [inter, inter, 0]])
}

#[derive(serde::Deserialize)]
struct IndexJson {
    weight_map: BTreeMap<String, String>,
}

impl Checkpoint {
    /// Opens the weights of `dir`, checking every file header and (for a sharded
    /// checkpoint) that every shard and every indexed tensor is present.
    pub fn open(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        if !dir.is_dir() {
            return Err(Error::checkpoint(dir, "model directory not found (expected a directory with config.json and model.safetensors)"));
        }
        let single = dir.join(SINGLE_FILE);
        if single.is_file() {
            let file = SafetensorsFile::open(&single)?;
            let routing = file.names().into_iter().map(|n| (n.to_string(), 0)).collect();
            return Self { dir: dir.to_path_buf(), index: None, files: vec![file], routing, parts: BTreeMap::new() }.split_fused();
        }
        let index = dir.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_sharded(dir, &index);
        }
        let hint = if dir.join("pytorch_model.bin").exists() || dir.join("pytorch_model.bin.index.json").exists() {
            " (only PyTorch .bin weights found: convert them to safetensors, e.g. load with transformers and `save_pretrained(dir, safe_serialization=True)`)"
        } else {
            ""
        };
        Err(Error::checkpoint(dir, format!("no weights: the model directory needs {SINGLE_FILE} or {INDEX_FILE} with its shards{hint}")))
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
        let parsed: IndexJson = serde_json::from_str(&text).map_err(|e| {
            Error::checkpoint(
                index,
                format!("not a valid index ({e}); expected {{\"metadata\": {{..}}, \"weight_map\": {{tensor: shard file}}}}"),
            )
        })?;
        if parsed.weight_map.is_empty() {
            return Err(Error::checkpoint(index, "`weight_map` is empty: the index lists no tensors"));
        }
        // Open each shard once, in sorted order.
        let mut shard_pos: BTreeMap<&str, usize> = BTreeMap::new();
        for shard in parsed.weight_map.values() {
            shard_pos.entry(shard.as_str()).or_insert(0);
        }
        let mut files = Vec::with_capacity(shard_pos.len());
        for (i, (shard, pos)) in shard_pos.iter_mut().enumerate() {
            if shard.contains("..") || Path::new(shard).is_absolute() {
                return Err(Error::checkpoint(index, format!("shard name `{shard}` must be a file name inside the model directory")));
            }
            let path = dir.join(shard);
            if !path.is_file() {
                return Err(Error::checkpoint(
                    index,
                    format!(
                        "shard `{shard}` named in the weight_map is missing ({}); re-download the checkpoint with all its shards",
                        path.display()
                    ),
                ));
            }
            files.push(SafetensorsFile::open(&path)?);
            *pos = i;
        }
        let mut routing = BTreeMap::new();
        for (name, shard) in &parsed.weight_map {
            let pos = shard_pos[shard.as_str()];
            if files[pos].entry(name).is_none() {
                return Err(Error::checkpoint(
                    files[pos].path(),
                    format!(
                        "tensor `{name}` is listed in {} but absent from this shard; the index and shards disagree, re-download or re-export the checkpoint",
                        index.display()
                    ),
                ));
            }
            routing.insert(name.clone(), pos);
        }
        Self { dir: dir.to_path_buf(), index: Some(index.to_path_buf()), files, routing, parts: BTreeMap::new() }.split_fused()
    }

    /// Registers the split names of every fused projection (Phi-3), checking the fused
    /// tensor's rows against config.json; a checkpoint without fused tensors is unchanged.
    fn split_fused(mut self) -> Result<Self> {
        let fused: Vec<(String, usize)> = self
            .routing
            .keys()
            .filter_map(|n| FUSED.iter().position(|(suffix, _)| n.ends_with(&format!(".{suffix}"))).map(|i| (n.clone(), i)))
            .collect();
        if fused.is_empty() {
            return Ok(self);
        }
        let rows = fused_rows(&self.dir)?;
        for (name, i) in fused {
            let (suffix, parts) = FUSED[i];
            let prefix = &name[..name.len() - suffix.len()];
            let f = &self.files[self.routing[&name]];
            let shape = f.entry(&name).map(|e| e.shape.clone()).unwrap_or_default();
            let want: usize = rows[i].iter().sum();
            if shape.len() != 2 || shape[0] != want {
                return Err(Error::checkpoint(
                    f.path(),
                    format!("fused tensor `{name}` has shape {shape:?}, config.json implies {want} rows ({:?}); do config.json and the weights belong together?", rows[i]),
                ));
            }
            let mut start = 0;
            for (part, &n) in parts.iter().zip(&rows[i]).filter(|(p, _)| !p.is_empty()) {
                let split = format!("{prefix}{part}");
                if self.routing.contains_key(&split) {
                    return Err(Error::checkpoint(
                        f.path(),
                        format!("holds both `{name}` and `{split}`: a checkpoint stores a projection once"),
                    ));
                }
                self.parts.insert(split, Part { fused: name.clone(), start, shape: vec![n, shape[1]] });
                start += n;
            }
        }
        Ok(self)
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The index file of a sharded checkpoint.
    pub fn index_file(&self) -> Option<&Path> {
        self.index.as_deref()
    }

    /// The safetensors files, in the order shards are numbered.
    pub fn files(&self) -> Vec<&Path> {
        self.files.iter().map(|f| f.path()).collect()
    }

    /// All tensor names as the model names them, sorted: a fused projection appears as
    /// its parts (`q_proj`, `k_proj`, `v_proj`; `gate_proj`, `up_proj`).
    pub fn names(&self) -> Vec<&str> {
        let split: std::collections::BTreeSet<&str> = self.parts.values().map(|p| p.fused.as_str()).collect();
        let mut v: Vec<&str> =
            self.routing.keys().map(String::as_str).filter(|n| !split.contains(n)).chain(self.parts.keys().map(String::as_str)).collect();
        v.sort_unstable();
        v
    }

    /// The file that holds tensor `name` (its fused tensor's, for a part); the directory
    /// when there is none.
    pub fn file_of(&self, name: &str) -> &Path {
        let fused = self.parts.get(name).map_or(name, |p| p.fused.as_str());
        self.routing.get(fused).map_or(self.dir.as_path(), |&i| self.files[i].path())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.parts.contains_key(name) || (self.routing.contains_key(name) && !self.parts.values().any(|p| p.fused == name))
    }

    /// On-disk dtype string and shape of tensor `name` (a part: its rows of the fused one).
    pub fn info(&self, name: &str) -> Option<(&str, &[usize])> {
        if let Some(p) = self.parts.get(name) {
            let f = &self.files[*self.routing.get(&p.fused)?];
            return f.entry(&p.fused).map(|e| (e.dtype.as_str(), p.shape.as_slice()));
        }
        let f = &self.files[*self.routing.get(name)?];
        f.entry(name).map(|e| (e.dtype.as_str(), e.shape.as_slice()))
    }

    /// Reads one tensor converted to `dtype` on `device`; a tensor holding NaN or an
    /// infinity (as stored, or after the conversion) is an error naming the file and it.
    pub fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        if let Some(p) = self.parts.get(name) {
            let fused = self.load(&p.fused, dtype, device)?; // read and checked as stored
            return Ok(fused.narrow(0, p.start, p.shape[0])?.contiguous()?);
        }
        let Some(&pos) = self.routing.get(name) else {
            let at = self.index.as_deref().unwrap_or_else(|| self.files[0].path());
            return Err(Error::checkpoint(at, format!("tensor `{name}` not found in the checkpoint")));
        };
        let file = &self.files[pos];
        let t = file.load(name, dtype, device)?;
        // Every weight is checked as it is read: a NaN or infinite weight would make
        // `generate` print padding and `eval` score 0 % without an error.
        if !crate::guard::all_finite(&t)? {
            let stored = file.entry(name).and_then(|e| float_dtype(&e.dtype)).filter(|&d| d != dtype);
            let why = match stored {
                Some(sd) if crate::guard::all_finite(&file.load(name, sd, &Device::Cpu)?)? => format!(
                    "tensor `{name}` is finite as stored ({sd:?}) but overflows to infinity in {dtype:?}; load it in a wider dtype (--dtype f32 or bf16)"
                ),
                _ => format!("tensor `{name}` holds NaN or infinite values; the file is damaged or was written by a run that diverged: re-download or re-export the model"),
            };
            return Err(Error::checkpoint(file.path(), why));
        }
        Ok(t)
    }

    /// Reads every tensor converted to `dtype` on `device`.
    pub fn load_all(&self, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
        let mut out = HashMap::with_capacity(self.routing.len());
        for name in self.names() {
            out.insert(name.to_string(), self.load(name, dtype, device)?);
        }
        Ok(out)
    }

    /// A `VarBuilder` that reads each weight from the mapped files when the model asks
    /// for it (no full copy of the checkpoint in memory), checking its shape.
    pub fn var_builder(self, dtype: DType, device: &Device) -> VarBuilder<'static> {
        let backend: Box<dyn candle_nn::var_builder::SimpleBackend> = Box::new(self);
        VarBuilder::from_backend(backend, dtype, device.clone())
    }
}

impl candle_nn::var_builder::SimpleBackend for Checkpoint {
    fn get(&self, s: Shape, name: &str, _h: candle_nn::Init, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        let t = self.get_unchecked(name, dtype, dev)?;
        if t.shape() != &s {
            let file = self.file_of(name);
            return Err(candle_core::Error::Msg(format!(
                "{}: tensor `{name}` has shape {:?} but the model expects {:?}; does config.json match these weights?",
                file.display(),
                t.dims(),
                s.dims()
            )));
        }
        Ok(t)
    }

    fn get_unchecked(&self, name: &str, dtype: DType, dev: &Device) -> candle_core::Result<Tensor> {
        match self.load(name, dtype, dev) {
            Ok(t) => Ok(t),
            Err(Error::Candle(e)) => Err(e),
            Err(e) => Err(candle_core::Error::Msg(e.to_string())),
        }
    }

    fn contains_tensor(&self, name: &str) -> bool {
        self.contains(name)
    }
}

/// Loads every weight of the model directory `dir` (single or sharded safetensors,
/// F32/F16/BF16/F64 on disk) converted to `dtype` on `device`.
pub fn load_weights(dir: impl AsRef<Path>, dtype: DType, device: &Device) -> Result<HashMap<String, Tensor>> {
    Checkpoint::open(dir)?.load_all(dtype, device)
}

/// Fills `varmap` with every weight of `dir` as trainable `Var`s (dtype `dtype`, on
/// `device`), replacing the value of a Var that already has that name. A model built
/// afterwards with `VarBuilder::from_varmap(varmap, ..)` then starts from these weights.
/// Returns the number of tensors loaded.
pub fn load_into_varmap(dir: impl AsRef<Path>, varmap: &VarMap, dtype: DType, device: &Device) -> Result<usize> {
    let ckpt = Checkpoint::open(dir)?;
    let names: Vec<String> = ckpt.names().into_iter().map(str::to_string).collect();
    for name in &names {
        let t = ckpt.load(name, dtype, device)?;
        let mut data = varmap.data().lock().map_err(|_| Error::Setting("VarMap mutex poisoned by a panic in another thread".into()))?;
        match data.get(name) {
            Some(var) => {
                if var.shape() != t.shape() {
                    return Err(Error::checkpoint(
                        ckpt.file_of(name),
                        format!("tensor `{name}` has shape {:?} but the VarMap already holds {:?}", t.dims(), var.dims()),
                    ));
                }
                var.set(&t.to_dtype(var.dtype())?)?;
            }
            None => {
                data.insert(name.clone(), candle_core::Var::from_tensor(&t)?);
            }
        }
    }
    Ok(names.len())
}

/// Loads every tensor of the model directory `dir` in its stored dtype, on the CPU, in
/// name order (what an export re-writes).
pub fn load_stored(dir: impl AsRef<Path>) -> Result<Vec<(String, Tensor)>> {
    let dir = dir.as_ref();
    let ck = Checkpoint::open(dir)?;
    let mut out = Vec::new();
    for name in ck.names() {
        let (dt, _) = ck.info(name).ok_or_else(|| Error::checkpoint(dir, format!("tensor `{name}` is listed but has no header entry")))?;
        let dtype =
            float_dtype(dt).ok_or_else(|| Error::checkpoint(dir, format!("tensor `{name}` is {dt}, not a floating-point weight")))?;
        out.push((name.to_string(), ck.load(name, dtype, &Device::Cpu)?));
    }
    Ok(out)
}

/// What the weight files of a model directory hold (`longctx inspect`).
#[derive(Debug, Clone, serde::Serialize)]
pub struct StoredWeights {
    pub files: usize,
    pub tensors: usize,
    pub parameters: u64,
    pub bytes: u64,
    /// dtype → parameters stored in it.
    pub dtypes: BTreeMap<String, u64>,
}

/// The weight files of `dir` summed up from their headers; `None` when it has none.
/// `rotary_emb.inv_freq`, a buffer some old checkpoints store, is not a parameter.
pub fn stored_weights(dir: impl AsRef<Path>) -> Result<Option<StoredWeights>> {
    let dir = dir.as_ref();
    if !dir.join(SINGLE_FILE).is_file() && !dir.join(INDEX_FILE).is_file() {
        return Ok(None);
    }
    let ck = Checkpoint::open(dir)?;
    let mut w = StoredWeights { files: ck.files().len(), tensors: 0, parameters: 0, bytes: 0, dtypes: BTreeMap::new() };
    for name in ck.names() {
        if name.ends_with("rotary_emb.inv_freq") {
            continue;
        }
        let Some((dt, shape)) = ck.info(name) else { continue };
        // Checked: header shapes are bounded by the file sizes, but the sums say so too.
        let what = format!("the element count of `{name}` in {}", dir.display());
        let n = crate::limits::mul(&what, &shape.iter().map(|&x| x as u64).collect::<Vec<_>>())?;
        w.tensors += 1;
        w.parameters = crate::limits::add("the parameter count", &[w.parameters, n])?;
        w.bytes = crate::limits::add("the weight bytes", &[w.bytes, crate::limits::mul(&what, &[n, dtype_size(dt).unwrap_or(0) as u64])?])?;
        let e = w.dtypes.entry(dt.to_string()).or_default();
        *e = crate::limits::add("the parameter count", &[*e, n])?;
    }
    Ok(Some(w))
}
