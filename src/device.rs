//! Opening the device a run computes on: the one place that turns `model.device`
//! (`cpu`, `cuda`, `cuda:N`) or a launcher's local rank into a Candle device.

use std::path::Path;

use candle_core::Device;

use crate::{Error, Result};

/// Opens `model.device` as written in `file` (`cpu`, `cuda`, `cuda:N`).
pub fn parse_device(s: &str, file: &Path) -> Result<Device> {
    let bad = || Error::config(file, "model.device", format!("expected cpu, cuda or cuda:N, got `{s}`"));
    match s {
        "cpu" => Ok(Device::Cpu),
        "cuda" => open_cuda(0).map_err(|e| Error::config(file, "model.device", format!("cannot open `{s}`: {e}"))),
        _ => {
            let idx = s.strip_prefix("cuda:").ok_or_else(bad)?.parse::<usize>().map_err(|_| bad())?;
            open_cuda(idx).map_err(|e| Error::config(file, "model.device", format!("cannot open `{s}`: {e}")))
        }
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

/// Total memory of the GPU `model.device` names (`None` for the CPU), read from the
/// driver without creating a context on it.
pub fn gpu_memory(s: &str, file: &Path) -> Result<Option<u64>> {
    let bad = || Error::config(file, "model.device", format!("expected cpu, cuda or cuda:N, got `{s}`"));
    let idx = match s {
        "cpu" => return Ok(None),
        "cuda" => 0,
        _ => s.strip_prefix("cuda:").ok_or_else(bad)?.parse::<usize>().map_err(|_| bad())?,
    };
    total_memory(idx).map(Some)
}

#[cfg(feature = "cuda")]
fn total_memory(idx: usize) -> Result<u64> {
    use candle_core::cuda::cudarc::driver::result;
    let err = |e: candle_core::cuda::cudarc::driver::DriverError| Error::Setting(format!("cannot query cuda:{idx}: {e}; {}", gpu_hint()));
    result::init().map_err(err)?;
    let ordinal = i32::try_from(idx).map_err(|_| Error::Setting(format!("cuda:{idx}: no such GPU; {}", gpu_hint())))?;
    let dev = result::device::get(ordinal).map_err(err)?;
    // SAFETY: `dev` is a device handle the driver just returned; the call only reads its size.
    Ok(unsafe { result::device::total_mem(dev) }.map_err(err)? as u64)
}

#[cfg(not(feature = "cuda"))]
fn total_memory(idx: usize) -> Result<u64> {
    Err(Error::Setting(format!("cannot open cuda:{idx}; {}", gpu_hint())))
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

#[cfg(test)]
mod tests {
    use super::*;

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
