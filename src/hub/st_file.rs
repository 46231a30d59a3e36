//! One safetensors file, memory-mapped, with its header checked before any tensor is read.
//!
//! Layout of a safetensors file:
//! `[u64 little-endian n][n bytes of JSON header][data]`, the header maps each tensor name
//! to `{"dtype": "F32", "shape": [..], "data_offsets": [start, end]}` (offsets relative to
//! the data section) plus an optional `"__metadata__"` string map.
//!
//! We parse the header ourselves (instead of `safetensors::SafeTensors::deserialize`) so
//! that a truncated download, a corrupt header or a wrong byte count is reported with
//! the file name, the numbers, and what to do about it.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};

use crate::{Error, Result};

/// The safetensors format caps the JSON header at 100 MB; anything larger is garbage.
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// Where one tensor lives inside the data section of its file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorEntry {
    /// The dtype string as written in the header ("F32", "BF16", "I64", ...).
    pub dtype: String,
    pub shape: Vec<usize>,
    /// Byte range relative to the start of the data section.
    pub start: usize,
    pub end: usize,
}

/// A memory-mapped safetensors file whose header has been validated.
pub struct SafetensorsFile {
    path: PathBuf,
    mmap: memmap2::Mmap,
    /// Absolute offset of the data section (8 + header length).
    data_start: usize,
    tensors: HashMap<String, TensorEntry>,
    metadata: BTreeMap<String, String>,
}

#[derive(serde::Deserialize)]
struct RawEntry {
    dtype: String,
    shape: Vec<usize>,
    data_offsets: (usize, usize),
}

/// Bytes per element of a safetensors dtype string, `None` for sub-byte or unknown dtypes.
pub fn dtype_size(dtype: &str) -> Option<usize> {
    Some(match dtype {
        "BOOL" | "U8" | "I8" | "F8_E4M3" | "F8_E5M2" | "F8_E8M0" => 1,
        "U16" | "I16" | "F16" | "BF16" => 2,
        "U32" | "I32" | "F32" => 4,
        "U64" | "I64" | "F64" => 8,
        _ => return None,
    })
}

/// The candle dtype of a floating-point weight dtype; other dtypes are not model weights.
pub fn float_dtype(dtype: &str) -> Option<DType> {
    Some(match dtype {
        "F32" => DType::F32,
        "F16" => DType::F16,
        "BF16" => DType::BF16,
        "F64" => DType::F64,
        _ => return None,
    })
}

/// The safetensors dtype string of a candle dtype we export.
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "F32",
        DType::F16 => "F16",
        DType::BF16 => "BF16",
        DType::F64 => "F64",
        DType::U8 => "U8",
        DType::U32 => "U32",
        DType::I16 => "I16",
        DType::I32 => "I32",
        DType::I64 => "I64",
        _ => "unsupported",
    }
}

fn corrupt(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::checkpoint(
        path,
        format!(
            "corrupt safetensors header: {what}; the file is not a valid safetensors file \
             (interrupted write or wrong file?), re-download or re-export it"
        ),
    )
}

impl SafetensorsFile {
    /// Maps `path` and validates its header: size fields, dtypes, byte counts, offsets.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; a checkpoint file modified while we read it is a
        // user error that at worst yields wrong numbers, as with any reader.
        let mmap = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(|e| Error::io(path, e))?;
        let file_len = mmap.len() as u64;
        if file_len < 8 {
            return Err(Error::checkpoint(
                path,
                format!(
                    "file is truncated: it has {file_len} bytes, a safetensors file starts with an \
                     8-byte header length; re-download it"
                ),
            ));
        }
        let mut n_bytes = [0u8; 8];
        n_bytes.copy_from_slice(&mmap[..8]);
        let n = u64::from_le_bytes(n_bytes);
        if n > MAX_HEADER_BYTES {
            return Err(corrupt(path, format!("header length field is {n} bytes (limit {MAX_HEADER_BYTES})")));
        }
        if 8 + n > file_len {
            return Err(Error::checkpoint(
                path,
                format!("file is truncated: header says at least {} bytes, file has {file_len}; re-download it", 8 + n),
            ));
        }
        let data_start = 8 + n as usize;
        let header = std::str::from_utf8(&mmap[8..data_start]).map_err(|e| corrupt(path, format!("header is not UTF-8 ({e})")))?;
        let raw: serde_json::Map<String, serde_json::Value> =
            serde_json::from_str(header.trim_end()).map_err(|e| corrupt(path, format!("header is not a JSON object ({e})")))?;

        let mut tensors = HashMap::new();
        let mut metadata = BTreeMap::new();
        let mut data_needed = 0usize;
        for (name, value) in raw {
            if name == "__metadata__" {
                metadata = serde_json::from_value(value).map_err(|e| corrupt(path, format!("`__metadata__` is not a string map ({e})")))?;
                continue;
            }
            let e: RawEntry = serde_json::from_value(value).map_err(|e| corrupt(path, format!("entry `{name}` ({e})")))?;
            let Some(size) = dtype_size(&e.dtype) else {
                return Err(corrupt(path, format!("tensor `{name}` has unknown dtype `{}`", e.dtype)));
            };
            let numel = e.shape.iter().try_fold(1usize, |a, &d| a.checked_mul(d));
            let nbytes = numel.and_then(|n| n.checked_mul(size));
            let (start, end) = e.data_offsets;
            if end < start || nbytes != Some(end - start) {
                return Err(corrupt(
                    path,
                    format!(
                        "tensor `{name}`: dtype {} shape {:?} needs {} bytes but data_offsets [{start}, {end}] span {}",
                        e.dtype,
                        e.shape,
                        nbytes.map_or("too many".to_string(), |b| b.to_string()),
                        end.wrapping_sub(start) as isize
                    ),
                ));
            }
            data_needed = data_needed.max(end);
            tensors.insert(name, TensorEntry { dtype: e.dtype, shape: e.shape, start, end });
        }
        let expected = data_start as u64 + data_needed as u64;
        if expected > file_len {
            return Err(Error::checkpoint(
                path,
                format!("file is truncated: header says {expected} bytes, file has {file_len}; re-download it"),
            ));
        }
        Ok(Self { path: path.to_path_buf(), mmap, data_start, tensors, metadata })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn entry(&self, name: &str) -> Option<&TensorEntry> {
        self.tensors.get(name)
    }

    /// Tensor names in this file, sorted.
    pub fn names(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.tensors.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// The `__metadata__` map (e.g. `{"format": "pt"}`).
    pub fn metadata(&self) -> &BTreeMap<String, String> {
        &self.metadata
    }

    /// The raw little-endian bytes of tensor `name`.
    pub fn bytes(&self, name: &str) -> Option<&[u8]> {
        let e = self.tensors.get(name)?;
        Some(&self.mmap[self.data_start + e.start..self.data_start + e.end])
    }

    /// Reads tensor `name` onto `device` converted to `dtype`. Only floating-point tensors
    /// (F32, F16, BF16, F64) are weights; any other dtype is an error naming the tensor.
    pub fn load(&self, name: &str, dtype: DType, device: &Device) -> Result<Tensor> {
        let e = self.tensors.get(name).ok_or_else(|| Error::checkpoint(&self.path, format!("tensor `{name}` is not in this file")))?;
        let Some(disk) = float_dtype(&e.dtype) else {
            return Err(Error::checkpoint(
                &self.path,
                format!(
                    "tensor `{name}` has dtype {}; longctx loads floating-point weights only \
                     (F32, F16, BF16, F64): convert or drop this tensor",
                    e.dtype
                ),
            ));
        };
        let bytes = &self.mmap[self.data_start + e.start..self.data_start + e.end];
        // Copy the on-disk dtype to the device first (fewer bytes to move), convert there.
        let t = Tensor::from_raw_buffer(bytes, disk, &e.shape, device)?;
        Ok(if disk == dtype { t } else { t.to_dtype(dtype)? })
    }
}
