//! With the `cuda` feature: compiles the cuDNN fused-attention shim (csrc/cudnn_sdpa.cpp)
//! with the host C++ compiler. It needs three header sets, looked up in this order:
//! - cudnn-frontend: `CUDNN_FRONTEND_INCLUDE_DIR`, `<workspace>/.cuda/frontend/include`, /usr/include;
//! - cuDNN 9: `CUDNN_INCLUDE_DIR`, `<workspace>/.cuda/cudnn/nvidia/cudnn/include`, the CUDA
//!   include dir, /usr/include, /usr/include/x86_64-linux-gnu;
//! - CUDA runtime + nvrtc.h: `CUDA_ROOT`/`CUDA_HOME`/`CUDA_PATH` + include,
//!   `<workspace>/.cuda/py/nvidia/cu13/include`, /usr/local/cuda/include.
//!
//! `scripts/build_cuda.sh` provides all three on a machine without CUDA.
//! Without the feature it does nothing, so the CPU build never needs CUDA.

use std::path::{Path, PathBuf};

fn first_with(candidates: &[PathBuf], file: &str) -> Option<PathBuf> {
    candidates.iter().find(|d| d.join(file).is_file()).cloned()
}

fn env_dir(var: &str) -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed={var}");
    std::env::var_os(var).filter(|v| !v.is_empty()).map(PathBuf::from)
}

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo::rustc-check-cfg=cfg(longctx_native)");
    if std::env::var_os("CARGO_FEATURE_CUDA").is_none() {
        return;
    }
    println!("cargo:rerun-if-changed=csrc/cudnn_sdpa.cpp");
    println!("cargo:rerun-if-changed=csrc/cudnn_sdpa.h");

    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_else(|_| ".".into()));
    let prefix = env_dir("LONGCTX_CUDA_PREFIX").unwrap_or_else(|| manifest.join("..").join(".cuda"));

    let cuda_roots: Vec<PathBuf> = ["CUDA_ROOT", "CUDA_HOME", "CUDA_PATH"]
        .iter()
        .filter_map(|v| env_dir(v))
        .chain([prefix.join("py/nvidia/cu13"), PathBuf::from("/usr/local/cuda")])
        .collect();
    let cuda_incs: Vec<PathBuf> = cuda_roots.iter().flat_map(|r| [r.join("include"), r.join("targets/x86_64-linux/include")]).collect();
    let cuda_inc = first_with(&cuda_incs, "cuda_runtime_api.h");
    let nvrtc_inc = first_with(&cuda_incs, "nvrtc.h");

    let mut cudnn_cands: Vec<PathBuf> = env_dir("CUDNN_INCLUDE_DIR").into_iter().collect();
    cudnn_cands.push(prefix.join("cudnn/nvidia/cudnn/include"));
    cudnn_cands.extend(cuda_incs.iter().cloned());
    cudnn_cands.extend([PathBuf::from("/usr/include"), PathBuf::from("/usr/include/x86_64-linux-gnu")]);
    let cudnn_inc = first_with(&cudnn_cands, "cudnn.h");

    let mut fe_cands: Vec<PathBuf> = env_dir("CUDNN_FRONTEND_INCLUDE_DIR").into_iter().collect();
    fe_cands.extend([prefix.join("frontend/include"), PathBuf::from("/usr/include")]);
    let fe_inc = first_with(&fe_cands, "cudnn_frontend.h");

    let missing: Vec<String> = [
        ("cudnn_frontend.h (cudnn-frontend; set CUDNN_FRONTEND_INCLUDE_DIR)", &fe_inc, &fe_cands),
        ("cudnn.h (cuDNN 9; set CUDNN_INCLUDE_DIR)", &cudnn_inc, &cudnn_cands),
        ("cuda_runtime_api.h (CUDA toolkit; set CUDA_ROOT)", &cuda_inc, &cuda_incs),
        ("nvrtc.h (CUDA nvrtc headers; set CUDA_ROOT)", &nvrtc_inc, &cuda_incs),
    ]
    .iter()
    .filter(|(_, found, _)| found.is_none())
    .map(|(what, _, looked)| {
        format!("  {what}; looked in {}", looked.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))
    })
    .collect();
    if !missing.is_empty() {
        panic!(
            "longctx-attention (feature cuda) cannot find the headers of the cuDNN attention shim:\n{}\n\
             Run scripts/build_cuda.sh, which installs them under .cuda/ and builds.",
            missing.join("\n")
        );
    }

    let mut build = cc::Build::new();
    build
        .cpp(true)
        .std("c++17")
        .define("NV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING", None)
        .warnings(false)
        .file("csrc/cudnn_sdpa.cpp")
        .include("csrc");
    let mut seen: Vec<&Path> = Vec::new();
    for inc in [&fe_inc, &cudnn_inc, &cuda_inc, &nvrtc_inc].into_iter().flatten() {
        if !seen.contains(&inc.as_path()) {
            build.include(inc);
            seen.push(inc);
        }
    }
    build.compile("longctx_cudnn_sdpa");

    // longctx's own Hopper kernels (csrc/native_{fwd,bwd}_sm90.cu): CuTe/CUTLASS headers from the
    // nvidia-cutlass wheel (scripts/build_cuda.sh unpacks them under .cuda/cutlass), sm_90a
    // only. Without them, or for another compute capability, the build has no native kernel
    // and `attention.kernel = "native"` runs cuDNN, saying why.
    println!("cargo:rerun-if-changed=csrc/native_fwd_sm90.cu");
    println!("cargo:rerun-if-changed=csrc/native_bwd_sm90.cu");
    println!("cargo:rerun-if-changed=csrc/native_fmha.h");
    println!("cargo:rerun-if-changed=csrc/native_common.cuh");
    println!("cargo:rerun-if-env-changed=CUDA_COMPUTE_CAP");
    let mut cutlass_cands: Vec<PathBuf> = env_dir("CUTLASS_INCLUDE_DIR").into_iter().collect();
    cutlass_cands.push(prefix.join("cutlass/include"));
    let cutlass_inc = first_with(&cutlass_cands, "cute/tensor.hpp");
    let cap = std::env::var("CUDA_COMPUTE_CAP").unwrap_or_default();
    match (&cutlass_inc, cap.trim()) {
        (Some(inc), "90") => {
            // one library per file: cc compiles several CUDA files of one build as relocatable
            // device code (--device-c), under which ptxas ignores setmaxnreg and the consumer
            // warpgroups lose the registers their wgmma pipelines need
            // (the backward first: it calls the forward's coverage check)
            for (file, lib) in [("csrc/native_bwd_sm90.cu", "longctx_native_bwd"), ("csrc/native_fwd_sm90.cu", "longctx_native_fwd")] {
                let mut nv = cc::Build::new();
                nv.cuda(true)
                    .flag("-std=c++17")
                    .flag("-O3")
                    .flag("-arch=sm_90a")
                    .flag("--expt-relaxed-constexpr")
                    // a register spill fails the build ("ptxas error: Registers are spilled to
                    // local memory in function ..."): it halves the kernel's speed or worse, and
                    // would otherwise ship silently (the flags change no machine code;
                    // scripts/build_native_check.sh also refuses serialised wgmma)
                    .flag("-Xptxas=--warn-on-spills,--warning-as-error")
                    .warnings(false)
                    .include(inc)
                    .include("csrc")
                    .file(file);
                nv.compile(lib);
            }
            println!("cargo:rustc-cfg=longctx_native");
        }
        (None, _) => println!(
            "cargo:warning=no CUTLASS headers (looked in {}): built without the native attention kernel",
            cutlass_cands.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", ")
        ),
        (_, other) => println!("cargo:warning=CUDA_COMPUTE_CAP={other} (not 90): built without the native attention kernel (sm_90a)"),
    }

    // the shim calls the CUDA runtime (device attributes, stream-ordered workspace) and dlopen
    for root in &cuda_roots {
        for lib in ["lib64", "lib", "targets/x86_64-linux/lib"] {
            let dir = root.join(lib);
            if dir.join("libcudart.so").exists() {
                println!("cargo:rustc-link-search=native={}", dir.display());
            }
        }
    }
    let stubs = prefix.join("stubs/lib");
    if stubs.join("libcudart.so").exists() {
        println!("cargo:rustc-link-search=native={}", stubs.display());
    }
    println!("cargo:rustc-link-lib=dylib=cudart");
    println!("cargo:rustc-link-lib=dylib=dl");
}
