#!/usr/bin/env bash
# Reproducible CUDA build of `longctx` (features cuda,nccl) into target-cuda/.
#
# With a CUDA toolkit on the machine (nvcc on PATH or CUDA_ROOT/CUDA_HOME set), it only
# fetches the header-only cuDNN frontend (and cuDNN headers if the system has none) and
# builds. Without one (a CPU build machine), it installs a pinned toolchain from PyPI into
# a local prefix (default .cuda/, gitignored) and creates link stubs for the driver-side
# libraries, so that the binary links here and runs against the real libraries there:
#   - nvcc 13.0.88 + crt/nvvm/cccl/runtime headers (nvvm pinned: 13.5 emits PTX 9.5,
#     which ptxas 13.0 rejects), nvrtc.h (the cuDNN frontend includes it);
#   - CUTLASS 4.2 headers (nvidia-cutlass wheel) for the native Hopper attention kernel;
#   - cuDNN 9.14 headers only (the GPU machine's system cuDNN is 9.14; a newer header set
#     could name engine features that runtime lacks) and the cuDNN frontend 1.16 headers;
#   - stubs libcuda.so.1, libcublas.so.13, libcublasLt.so.13, libcurand.so.10,
#     libnvrtc.so.13, libnccl.so.2 exporting every symbol cudarc's sys modules declare;
#     libcudart is the real one from the runtime wheel (candle-kernels' libmoe needs it).
# The binary loads libcudnn.so.9 itself (dlopen) on the first CUDA attention call.
#
# Usage: scripts/build_cuda.sh [--setup-only] [extra cargo args]
# Env: LONGCTX_CUDA_PREFIX (default <repo>/.cuda), CUDA_COMPUTE_CAP (default 90).
# Output: target-cuda/release/longctx (stripped by the release profile).
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${LONGCTX_CUDA_PREFIX:-$ROOT/.cuda}
export CUDA_COMPUTE_CAP=${CUDA_COMPUTE_CAP:-90}
SETUP_ONLY=0
if [[ "${1:-}" == "--setup-only" ]]; then SETUP_ONLY=1; shift; fi

NVCC_PIN=13.0.88
CUDNN_PIN=9.14.0.64
FRONTEND_PIN=1.16.0
CUTLASS_PIN=4.2.0.0
PIP=(python3 -m pip)

log() { echo "[build_cuda] $*" >&2; }

# Download one wheel (no deps) into $PREFIX/wheels and unpack the paths matching $2 into $3.
unpack_wheel() {
    local spec=$1 pattern=$2 dest=$3
    mkdir -p "$PREFIX/wheels" "$dest"
    "${PIP[@]}" download -q --no-deps --only-binary=:all: \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$PREFIX/wheels" "$spec"
    local name=${spec%%==*}; name=${name//-/_}
    local ver=${spec##*==}
    local whl
    whl=$(ls "$PREFIX/wheels/${name}-${ver}"-*.whl | head -n1)
    python3 - "$whl" "$pattern" "$dest" <<'EOF'
import sys, zipfile, fnmatch
whl, pattern, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    names = [n for n in z.namelist() if fnmatch.fnmatch(n, pattern)]
    if not names:
        sys.exit(f"{whl}: nothing matches {pattern}")
    z.extractall(dest, names)
EOF
    rm -f "$whl" # only the unpacked part is kept (the cuDNN wheel is ~350 MB)
}

have_toolkit() {
    command -v nvcc >/dev/null 2>&1 || [[ -x "${CUDA_ROOT:-${CUDA_HOME:-/nonexistent}}/bin/nvcc" ]]
}

# ---------------------------------------------------------------- toolchain
if have_toolkit; then
    log "using the CUDA toolkit on this machine ($(command -v nvcc || echo "${CUDA_ROOT:-$CUDA_HOME}/bin/nvcc"))"
    export CUDA_ROOT=${CUDA_ROOT:-${CUDA_HOME:-$(dirname "$(dirname "$(command -v nvcc)")")}}
else
    CU=$PREFIX/py/nvidia/cu13
    if [[ ! -x "$CU/bin/nvcc" || ! -f "$PREFIX/py/.pins-$NVCC_PIN" ]]; then
        log "installing nvcc $NVCC_PIN from PyPI into $PREFIX/py"
        rm -rf "$PREFIX/py"
        "${PIP[@]}" install -q --no-deps --target "$PREFIX/py" \
            "nvidia-cuda-nvcc==$NVCC_PIN" "nvidia-cuda-crt==$NVCC_PIN" \
            "nvidia-cuda-runtime==13.0.96" "nvidia-cuda-cccl==13.0.85" \
            "nvidia-nvvm==$NVCC_PIN" "nvidia-cuda-nvrtc==$NVCC_PIN"
        touch "$PREFIX/py/.pins-$NVCC_PIN"
    fi
    # nvcc looks for cicc under ../nvvm/bin and for headers under ../include.
    [[ -x "$CU/nvvm/bin/cicc" ]] || { log "no cicc under $CU/nvvm/bin"; exit 1; }
    export CUDA_ROOT=$CU
    export PATH=$CU/bin:$PATH

    # Link stubs with the right sonames, plus the real libcudart from the runtime wheel.
    STUBS=$PREFIX/stubs/lib
    CUDARC_VER=$(awk '/^name = "cudarc"/{getline; gsub(/[" ]/,"",$0); sub("version=","",$0); print; exit}' "$ROOT/Cargo.lock")
    CUDARC_SRC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$CUDARC_VER" 2>/dev/null | head -n1 || true)
    if [[ -z "$CUDARC_SRC" ]]; then
        log "fetching crates (cudarc $CUDARC_VER source is needed for the stub symbol lists)"
        (cd "$ROOT" && cargo fetch -q)
        CUDARC_SRC=$(ls -d "${CARGO_HOME:-$HOME/.cargo}"/registry/src/*/"cudarc-$CUDARC_VER" | head -n1)
    fi
    if [[ ! -f "$STUBS/.cudarc-$CUDARC_VER" ]]; then
        log "generating link stubs from $CUDARC_SRC"
        rm -rf "$STUBS"; mkdir -p "$STUBS" "$PREFIX/stubs/src"
        # soname : cudarc sys module(s) whose extern "C" functions it must export
        for entry in "libcuda.so.1:driver" "libcublas.so.13:cublas" "libcublasLt.so.13:cublaslt" \
                     "libcurand.so.10:curand" "libnvrtc.so.13:nvrtc" "libnccl.so.2:nccl"; do
            soname=${entry%%:*}; module=${entry##*:}
            src=$PREFIX/stubs/src/${soname%%.so*}.c
            {
                echo "/* link stub for $soname: symbols declared by cudarc $CUDARC_VER src/$module/sys; never called */"
                # extern "C" blocks in cudarc list one `fn name(` per line
                grep -hoE '^\s+fn [A-Za-z_][A-Za-z0-9_]*\(' "$CUDARC_SRC/src/$module/sys/"*.rs \
                    | sed -E 's/^\s+fn ([A-Za-z0-9_]+)\(/\1/' | sort -u \
                    | sed 's/.*/void &(void) {}/'
            } >"$src"
            gcc -shared -fPIC -o "$STUBS/$soname" -Wl,-soname,"$soname" "$src"
            ln -sf "$soname" "$STUBS/${soname%%.so*}.so"
        done
        touch "$STUBS/.cudarc-$CUDARC_VER"
    fi
    ln -sf "$CU/lib/libcudart.so.13" "$STUBS/libcudart.so.13"
    ln -sf libcudart.so.13 "$STUBS/libcudart.so"
    # cudarc adds <root>/lib of every CUDA_* path variable to the link search path.
    export CUDA_TOOLKIT_ROOT_DIR=$PREFIX/stubs
    export LIBRARY_PATH=$STUBS${LIBRARY_PATH:+:$LIBRARY_PATH}
    export LD_LIBRARY_PATH=$STUBS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
fi

# ---------------------------------------------------------------- cuDNN + frontend headers
if [[ -z "${CUDNN_INCLUDE_DIR:-}" ]]; then
    if [[ -f /usr/include/cudnn.h || -f /usr/include/x86_64-linux-gnu/cudnn.h ]] && have_toolkit; then
        CUDNN_INCLUDE_DIR=$( [[ -f /usr/include/cudnn.h ]] && echo /usr/include || echo /usr/include/x86_64-linux-gnu )
    else
        if [[ ! -f "$PREFIX/cudnn/nvidia/cudnn/include/cudnn.h" || ! -f "$PREFIX/cudnn/.pin-$CUDNN_PIN" ]]; then
            log "fetching cuDNN $CUDNN_PIN headers"
            rm -rf "$PREFIX/cudnn"
            unpack_wheel "nvidia-cudnn-cu13==$CUDNN_PIN" 'nvidia/cudnn/include/*' "$PREFIX/cudnn"
            touch "$PREFIX/cudnn/.pin-$CUDNN_PIN"
        fi
        CUDNN_INCLUDE_DIR=$PREFIX/cudnn/nvidia/cudnn/include
    fi
fi
if [[ -z "${CUDNN_FRONTEND_INCLUDE_DIR:-}" ]]; then
    if [[ ! -f "$PREFIX/frontend/include/cudnn_frontend.h" || ! -f "$PREFIX/frontend/.pin-$FRONTEND_PIN" ]]; then
        log "fetching cuDNN frontend $FRONTEND_PIN headers"
        rm -rf "$PREFIX/frontend" "$PREFIX/frontend.tmp"
        unpack_wheel "nvidia-cudnn-frontend==$FRONTEND_PIN" '*include/*' "$PREFIX/frontend.tmp"
        inc=$(dirname "$(find "$PREFIX/frontend.tmp" -name cudnn_frontend.h | head -n1)")
        mkdir -p "$PREFIX/frontend"; mv "$inc" "$PREFIX/frontend/include"; rm -rf "$PREFIX/frontend.tmp"
        touch "$PREFIX/frontend/.pin-$FRONTEND_PIN"
    fi
    CUDNN_FRONTEND_INCLUDE_DIR=$PREFIX/frontend/include
fi
export CUDNN_INCLUDE_DIR CUDNN_FRONTEND_INCLUDE_DIR

# ---------------------------------------------------------------- CUTLASS/CuTe headers
# longctx's own Hopper attention kernel (attention/csrc/native_fwd_sm90.cu) is written on
# CuTe; the headers come from the nvidia-cutlass wheel (header-only use, pinned).
if [[ -z "${CUTLASS_INCLUDE_DIR:-}" ]]; then
    if [[ ! -f "$PREFIX/cutlass/include/cute/tensor.hpp" || ! -f "$PREFIX/cutlass/.pin-$CUTLASS_PIN" ]]; then
        log "fetching CUTLASS $CUTLASS_PIN headers"
        rm -rf "$PREFIX/cutlass" "$PREFIX/cutlass.tmp"
        unpack_wheel "nvidia-cutlass==$CUTLASS_PIN" 'cutlass_library/source/include/*' "$PREFIX/cutlass.tmp"
        mkdir -p "$PREFIX/cutlass"
        mv "$PREFIX/cutlass.tmp/cutlass_library/source/include" "$PREFIX/cutlass/include"
        rm -rf "$PREFIX/cutlass.tmp"
        touch "$PREFIX/cutlass/.pin-$CUTLASS_PIN"
    fi
    CUTLASS_INCLUDE_DIR=$PREFIX/cutlass/include
fi
export CUTLASS_INCLUDE_DIR
log "CUDA_ROOT=$CUDA_ROOT CUDNN_INCLUDE_DIR=$CUDNN_INCLUDE_DIR CUDNN_FRONTEND_INCLUDE_DIR=$CUDNN_FRONTEND_INCLUDE_DIR"

if [[ $SETUP_ONLY == 1 ]]; then
    # print the environment so that a shell can `eval "$(scripts/build_cuda.sh --setup-only)"`
    for v in CUDA_ROOT CUDA_TOOLKIT_ROOT_DIR CUDA_COMPUTE_CAP CUDNN_INCLUDE_DIR CUDNN_FRONTEND_INCLUDE_DIR CUTLASS_INCLUDE_DIR PATH LIBRARY_PATH LD_LIBRARY_PATH; do
        [[ -n "${!v:-}" ]] && printf 'export %s=%q\n' "$v" "${!v}"
    done
    exit 0
fi

# ---------------------------------------------------------------- build
cd "$ROOT"
start=$(date +%s)
cargo build --release --features cuda,nccl --target-dir target-cuda "$@"
bin=target-cuda/release/longctx
if [[ -f $bin ]]; then
    log "built $bin in $(( $(date +%s) - start )) s, $(du -h "$bin" | cut -f1)"
else
    log "build finished in $(( $(date +%s) - start )) s"
fi
