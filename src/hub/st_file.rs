//! One safetensors file, memory-mapped, its header parsed and checked by the
//! `safetensors` crate before any tensor is read.
//!
//! Layout of a safetensors file:
//! `[u64 little-endian n][n bytes of JSON header][data]`, the header maps each tensor name
//! to `{"dtype": "F32", "shape": [..], "data_offsets": [start, end]}` (offsets relative to
//! the data section) plus an optional `"__metadata__"` string map.
//!
//! The crate's errors say what is wrong but not with which file or what to do; [`explain`]
//! turns each into a message with the file, the byte counts (a truncated download is the
//! usual cause) and the fix.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use safetensors::tensor::{Metadata, SafeTensorError, SafeTensors};

use crate::{Error, Result};

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

fn truncated(path: &Path, what: String) -> Error {
    Error::checkpoint(path, format!("file is truncated: {what}; re-download it"))
}

/// A file-naming, fix-saying error for what `SafeTensors::read_metadata` refused in `buf`.
fn explain(path: &Path, buf: &[u8], e: SafeTensorError) -> Error {
    let len = buf.len();
    let n = buf.get(..8).map(|b| u64::from_le_bytes(b.try_into().unwrap_or([0; 8])));
    match (e, n) {
        (SafeTensorError::HeaderTooSmall, _) | (_, None) => {
            truncated(path, format!("it has {len} bytes, a safetensors file starts with an 8-byte header length"))
        }
        (SafeTensorError::HeaderTooLarge, Some(n)) => corrupt(path, format!("header length field is {n} bytes (limit 100 MB)")),
        (SafeTensorError::InvalidHeaderLength, Some(n)) => {
            truncated(path, format!("header says at least {} bytes, file has {len}", n.saturating_add(8)))
        }
        (SafeTensorError::MetadataIncompleteBuffer, Some(n)) => {
            // The header parsed: compare the size it describes with the file's.
            let header = &buf[8..8 + n as usize];
            let data = serde_json::from_slice::<Metadata>(header).map(|m| m.data_len()).unwrap_or(0);
            let expected = 8 + n as usize + data;
            if expected > len {
                truncated(path, format!("header says {expected} bytes, file has {len}"))
            } else {
                corrupt(path, format!("the file has {} bytes after the last tensor the header lists", len - expected))
            }
        }
        (e, _) => corrupt(path, e),
    }
}

/// The data ranges of `tensors` must be ordered, within the `data_len` bytes of the data
/// section and disjoint: two tensors sharing bytes would alias each other's weights. (The
/// `safetensors` crate checks this too; this keeps the guarantee whatever its version.)
fn check_layout(path: &Path, tensors: &HashMap<String, TensorEntry>, data_len: usize) -> Result<()> {
    let mut by_start: Vec<(&String, &TensorEntry)> = tensors.iter().collect();
    by_start.sort_by_key(|(name, e)| (e.start, e.end, *name));
    let mut prev: Option<(&String, usize)> = None;
    for (name, e) in by_start {
        if e.end < e.start || e.end > data_len {
            return Err(corrupt(
                path,
                format!("tensor `{name}` has data offsets [{}, {}] outside the {data_len} data bytes", e.start, e.end),
            ));
        }
        if let Some((p, end)) = prev.filter(|(_, end)| e.start < *end && e.end > e.start) {
            return Err(corrupt(path, format!("tensors `{p}` and `{name}` overlap (bytes {}..{end})", e.start)));
        }
        prev = Some((name, e.end.max(prev.map_or(0, |p| p.1))));
    }
    Ok(())
}

impl SafetensorsFile {
    /// Maps `path` and validates its header: size fields, dtypes, byte counts, offsets.
    pub fn open(path: &Path) -> Result<Self> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; a checkpoint file modified while we read it is a
        // user error that at worst yields wrong numbers, as with any reader.
        let mmap = unsafe { memmap2::MmapOptions::new().map(&file) }.map_err(|e| Error::io(path, e))?;
        let (n, header) = SafeTensors::read_metadata(&mmap).map_err(|e| explain(path, &mmap, e))?;
        let mut tensors = HashMap::new();
        for (name, info) in header.tensors() {
            let Some(_) = dtype_size(&format!("{:?}", info.dtype)) else {
                return Err(corrupt(path, format!("tensor `{name}` has dtype {:?}, which longctx does not read", info.dtype)));
            };
            let (start, end) = info.data_offsets;
            tensors.insert(name, TensorEntry { dtype: format!("{:?}", info.dtype), shape: info.shape.clone(), start, end });
        }
        check_layout(path, &tensors, mmap.len().saturating_sub(8 + n))?;
        let metadata = header.metadata().clone().unwrap_or_default().into_iter().collect();
        Ok(Self { path: path.to_path_buf(), mmap, data_start: 8 + n, tensors, metadata })
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

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(start: usize, end: usize) -> TensorEntry {
        TensorEntry { dtype: "U8".into(), shape: vec![end - start], start, end }
    }

    /// Our own check, independent of the `safetensors` crate's: ranges in any order are
    /// fine when disjoint and inside the data; overlap, aliasing and out-of-range are not.
    #[test]
    fn data_ranges_must_be_disjoint_and_inside_the_data() {
        let p = Path::new("x.safetensors");
        let map = |v: &[(&str, usize, usize)]| v.iter().map(|(n, a, b)| (n.to_string(), entry(*a, *b))).collect::<HashMap<_, _>>();
        check_layout(p, &map(&[("b", 8, 16), ("a", 0, 8), ("z", 16, 16), ("y", 16, 16)]), 16).unwrap();
        let e = check_layout(p, &map(&[("a", 0, 8), ("b", 4, 12)]), 12).unwrap_err().to_string();
        assert!(e.contains("`a` and `b` overlap"), "{e}");
        let e = check_layout(p, &map(&[("a", 0, 8), ("b", 0, 8)]), 8).unwrap_err().to_string();
        assert!(e.contains("overlap"), "{e}");
        let e = check_layout(p, &map(&[("a", 0, 8), ("b", 8, 24)]), 16).unwrap_err().to_string();
        assert!(e.contains("`b`") && e.contains("outside the 16 data bytes"), "{e}");
    }
}
