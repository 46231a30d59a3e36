//! With the `cuda` feature: compiles every `src/cuda/*.cu` to PTX with nvcc for
//! `CUDA_COMPUTE_CAP` (default 90) into `OUT_DIR/<name>.ptx`, which `src/cuda.rs`
//! embeds with `include_str!` and loads at run time through Candle's
//! `CudaDevice::get_or_load_custom_func`. Without the feature it does nothing, so the
//! CPU build never needs CUDA.
//!
//! nvcc is looked up in this order: `NVCC`, `CUDA_ROOT`/`CUDA_HOME`/`CUDA_PATH` + `bin/nvcc`,
//! `<workspace>/.cuda/py/nvidia/cu13/bin/nvcc` (the pinned toolchain that
//! `scripts/build_cuda.sh` installs; `LONGCTX_CUDA_PREFIX` moves it), `nvcc` on `PATH`,
//! /usr/local/cuda/bin/nvcc.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The kernel sources; each becomes one PTX module of the same name.
const SOURCES: &[&str] = &["rmsnorm", "rope", "swiglu", "cross_entropy", "adamw", "accumulate", "add", "reduce"];

fn env_path(var: &str) -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed={var}");
    std::env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from)
}

fn on_path(exe: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path).map(|d| d.join(exe)).find(|p| p.is_file())
}

fn find_nvcc(manifest: &Path) -> Option<PathBuf> {
    if let Some(p) = env_path("NVCC") {
        return Some(p);
    }
    let prefix = env_path("LONGCTX_CUDA_PREFIX").unwrap_or_else(|| manifest.join("..").join(".cuda"));
    let roots = ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"].iter().filter_map(|v| env_path(v));
    let mut cands: Vec<PathBuf> = roots.map(|r| r.join("bin").join("nvcc")).collect();
    cands.push(prefix.join("py/nvidia/cu13/bin/nvcc"));
    if let Some(p) = on_path("nvcc") {
        cands.push(p);
    }
    cands.push(PathBuf::from("/usr/local/cuda/bin/nvcc"));
    cands.into_iter().find(|p| p.is_file())
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let cap = env_path("CUDA_COMPUTE_CAP").map(|p| p.to_string_lossy().into_owned()).unwrap_or_else(|| "90".into());
    let cap: u32 = cap.trim().parse().unwrap_or_else(|_| panic!("CUDA_COMPUTE_CAP must be a number like 90, got `{cap}`"));
    let nvcc = find_nvcc(&manifest).unwrap_or_else(|| {
        panic!(
            "longctx-kernels (feature cuda) needs nvcc: set NVCC or CUDA_ROOT, or run scripts/build_cuda.sh \
             (it installs a pinned toolchain under .cuda/)"
        )
    });
    let cuda_dir = manifest.join("src").join("cuda");
    println!("cargo:rerun-if-changed={}", cuda_dir.join("common.cuh").display());
    for name in SOURCES {
        let src = cuda_dir.join(format!("{name}.cu"));
        println!("cargo:rerun-if-changed={}", src.display());
        let ptx = out.join(format!("{name}.ptx"));
        let status = Command::new(&nvcc)
            .arg("--ptx")
            .arg(format!("--gpu-architecture=sm_{cap}"))
            .args(["-O3", "--std=c++17", "-lineinfo"])
            // IEEE division and square root (nvcc's default, stated: AdamW must match its CPU twin)
            .args(["-prec-div=true", "-prec-sqrt=true"])
            .arg("-I")
            .arg(&cuda_dir)
            .arg("-o")
            .arg(&ptx)
            .arg(&src)
            .status()
            .unwrap_or_else(|e| panic!("cannot run {}: {e}", nvcc.display()));
        if !status.success() {
            panic!("nvcc failed on {} ({status})", src.display());
        }
    }
}
