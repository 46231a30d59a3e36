//! Opening the device a run computes on: the one place that turns `model.device`
//! (`cpu`, `cuda`, `cuda:N`) or a launcher's local rank into a Candle device.

use std::path::Path;

use candle_core::Device;

use crate::{Error, Result};

/// `model.device` as written in `file`: `None` for `cpu`, the GPU index for `cuda` / `cuda:N`.
fn device_index(s: &str, file: &Path) -> Result<Option<usize>> {
    let bad = || Error::config(file, "model.device", format!("expected cpu, cuda or cuda:N, got `{s}`"));
    match s {
        "cpu" => Ok(None),
        "cuda" => Ok(Some(0)),
        _ => Ok(Some(s.strip_prefix("cuda:").ok_or_else(bad)?.parse::<usize>().map_err(|_| bad())?)),
    }
}

/// Opens `model.device` as written in `file` (`cpu`, `cuda`, `cuda:N`).
pub fn parse_device(s: &str, file: &Path) -> Result<Device> {
    match device_index(s, file)? {
        None => Ok(Device::Cpu),
        Some(idx) => open_cuda(idx).map_err(|e| Error::config(file, "model.device", format!("cannot open `{s}`: {e}"))),
    }
}

/// Opens GPU `index` on Candle's per-thread stream and keeps freed memory in the pool:
/// each step synchronises, and with the default release threshold the pool would hand
/// memory back and map it again every step. The error (first line only, no backtrace)
/// says how many GPUs there are, or that this build has no CUDA.
pub fn open_cuda(index: usize) -> Result<Device> {
    let dev = Device::new_cuda(index).map_err(|e| {
        let e = e.to_string();
        let first = e.lines().next().unwrap_or_default();
        Error::Setting(format!("cannot open cuda:{index} ({first}); {}", gpu_hint()))
    })?;
    #[cfg(feature = "cuda")]
    longctx_attention::cuda::retain_pool_memory(dev.as_cuda_device()?)?;
    Ok(dev)
}

/// Total memory of the GPU `model.device` names, read from the driver without creating
/// a context on it; `None` for the CPU, or when this build or machine cannot tell (the
/// trainer then reports why it cannot open the device).
pub fn gpu_memory(s: &str, file: &Path) -> Result<Option<u64>> {
    Ok(device_index(s, file)?.and_then(total_memory))
}

/// Total memory of GPU `index`, read from the driver without creating a context on it;
/// `None` when this build or machine cannot tell.
pub fn gpu_total_memory(index: usize) -> Option<u64> {
    total_memory(index)
}

/// The name of the GPU `model.device` names (e.g. `NVIDIA H200`), from the driver; `None`
/// for the CPU, a bad device string, or when this build or machine cannot tell.
pub fn gpu_name(s: &str) -> Option<String> {
    device_index(s, Path::new("<run config>")).ok().flatten().and_then(device_name)
}

#[cfg(feature = "cuda")]
fn device_name(idx: usize) -> Option<String> {
    use candle_core::cuda::cudarc::driver::result;
    result::init().ok()?;
    let dev = result::device::get(i32::try_from(idx).ok()?).ok()?;
    result::device::get_name(dev).ok()
}

#[cfg(not(feature = "cuda"))]
fn device_name(_idx: usize) -> Option<String> {
    None
}

#[cfg(feature = "cuda")]
fn total_memory(idx: usize) -> Option<u64> {
    use candle_core::cuda::cudarc::driver::result;
    result::init().ok()?;
    let dev = result::device::get(i32::try_from(idx).ok()?).ok()?;
    // SAFETY: `dev` is a device handle the driver just returned; the call only reads its size.
    Some(unsafe { result::device::total_mem(dev) }.ok()? as u64)
}

#[cfg(not(feature = "cuda"))]
fn total_memory(_idx: usize) -> Option<u64> {
    None
}

/// Bytes free to an unprivileged writer on the filesystem that holds `path` (or would
/// hold it: the nearest existing ancestor, the working directory for a relative path with
/// none), `None` where unknown.
pub fn disk_free(path: &Path) -> Option<u64> {
    let mut p = path;
    while !p.as_os_str().is_empty() && !p.exists() {
        p = p.parent()?;
    }
    let p = if p.as_os_str().is_empty() { Path::new(".") } else { p };
    statvfs_free(p)
}

#[cfg(unix)]
fn statvfs_free(p: &Path) -> Option<u64> {
    use std::os::unix::ffi::OsStrExt;
    let c = std::ffi::CString::new(p.as_os_str().as_bytes()).ok()?;
    // SAFETY: an all-zero `statvfs` is a valid value of that plain C struct, which the
    // call fills; `c` is a NUL-terminated path that outlives it.
    let mut st: libc::statvfs = unsafe { std::mem::zeroed() };
    if unsafe { libc::statvfs(c.as_ptr(), &mut st) } != 0 {
        return None;
    }
    #[allow(clippy::unnecessary_cast)] // the field types differ between platforms
    (st.f_bavail as u64).checked_mul(st.f_frsize as u64)
}

#[cfg(not(unix))]
fn statvfs_free(_p: &Path) -> Option<u64> {
    None
}

/// Host memory available now (`MemAvailable` of /proc/meminfo), `None` where unknown.
pub fn host_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    let line = text.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kb.checked_mul(1024)
}

#[cfg(feature = "cuda")]
fn gpu_hint() -> String {
    let n = candle_core::cuda::cudarc::driver::CudaContext::device_count().unwrap_or(0);
    format!("this node has {n} GPU(s)")
}

#[cfg(not(feature = "cuda"))]
fn gpu_hint() -> String {
    "this build has no CUDA: build with scripts/build_cuda.sh (see README, GPU build)".into()
}

/// A dtype name (`f32`/`float32`, `bf16`/`bfloat16`, `f16`/`float16`); errors name
/// `file` and `field`.
pub fn parse_dtype(s: &str, file: &Path, field: &str) -> Result<candle_core::DType> {
    match s {
        "f32" | "float32" => Ok(candle_core::DType::F32),
        "bf16" | "bfloat16" => Ok(candle_core::DType::BF16),
        "f16" | "float16" => Ok(candle_core::DType::F16),
        _ => Err(Error::config(file, field, format!("expected f32, bf16 or f16, got `{s}`"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory not made yet is measured on its nearest existing ancestor's
    /// filesystem (the same one here: equal within 1 GB of concurrent writes), a relative
    /// one from the working directory.
    #[test]
    fn disk_free_of_a_path_not_yet_made() {
        let tmp = std::env::temp_dir();
        let there = disk_free(&tmp).expect("free space of the temp directory");
        let below = disk_free(&tmp.join("longctx-no-such-dir/a/b")).expect("measured on the ancestor");
        assert!(there.abs_diff(below) < 1 << 30, "{there} vs {below}");
        assert!(disk_free(Path::new("longctx-no-such-dir/a")).is_some());
    }

    #[test]
    fn device_settings() {
        let f = Path::new("run.toml");
        assert!(parse_device("cpu", f).unwrap().is_cpu());
        for bad in ["gpu", "cuda:x", "cuda1", ""] {
            let e = parse_device(bad, f).unwrap_err().to_string();
            assert!(e.contains("model.device") && e.contains("expected cpu, cuda or cuda:N"), "{bad}: {e}");
        }
        #[cfg(not(feature = "cuda"))]
        {
            let e = parse_device("cuda:0", f).unwrap_err().to_string();
            assert!(e.contains("scripts/build_cuda.sh"), "{e}");
        }
    }
}
