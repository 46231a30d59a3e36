#!/usr/bin/env bash
# Builds target-cuda/native_check: the device check and benchmark of longctx's own Hopper
# attention kernel (attention/csrc/native_fwd_sm90.cu) against a naive f32 reference and
# against cuDNN through the shim (attention/csrc/cudnn_sdpa.cpp), side by side in one process.
#
# The CUTLASS/CuTe headers come from the `nvidia-cutlass` PyPI wheel (pinned below), unpacked
# under .cuda/cutlass/include like the cuDNN frontend (scripts/build_cuda.sh sets up nvcc).
# Usage: scripts/build_native_check.sh        then on the GPU machine: target-cuda/native_check
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
PREFIX=${LONGCTX_CUDA_PREFIX:-$ROOT/.cuda}
CUTLASS_PIN=4.2.0.0
eval "$("$ROOT/scripts/build_cuda.sh" --setup-only)"
if [[ ! -f "$PREFIX/cutlass/include/cute/tensor.hpp" || ! -f "$PREFIX/cutlass/.pin-$CUTLASS_PIN" ]]; then
    echo "[native_check] fetching CUTLASS $CUTLASS_PIN headers" >&2
    rm -rf "$PREFIX/cutlass" "$PREFIX/cutlass.tmp"
    mkdir -p "$PREFIX/wheels" "$PREFIX/cutlass.tmp"
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$PREFIX/wheels" "nvidia-cutlass==$CUTLASS_PIN"
    whl=$(ls "$PREFIX"/wheels/nvidia_cutlass-"$CUTLASS_PIN"-*.whl | head -n1)
    python3 - "$whl" "$PREFIX/cutlass.tmp" <<'PY'
import sys, zipfile
whl, dest = sys.argv[1:]
with zipfile.ZipFile(whl) as z:
    z.extractall(dest, [n for n in z.namelist() if n.startswith("cutlass_library/source/include/")])
PY
    mkdir -p "$PREFIX/cutlass"
    mv "$PREFIX/cutlass.tmp/cutlass_library/source/include" "$PREFIX/cutlass/include"
    rm -rf "$PREFIX/cutlass.tmp" "$whl"
    touch "$PREFIX/cutlass/.pin-$CUTLASS_PIN"
fi
OUT=$ROOT/target-cuda/native_check.d
mkdir -p "$OUT"
CSRC=$ROOT/attention/csrc
NVFLAGS=(-std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I "$PREFIX/cutlass/include" -I "$CSRC")
start=$(date +%s)
rm -f "$OUT"/*.o
nvcc "${NVFLAGS[@]}" -c "$CSRC/native_fwd_sm90.cu" -o "$OUT/native_fwd_sm90.o" & p1=$!
nvcc "${NVFLAGS[@]}" -c "$CSRC/native_check.cu" -o "$OUT/native_check.o" & p2=$!
g++ -std=c++17 -O2 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -I "$CSRC" -I "$CUDNN_FRONTEND_INCLUDE_DIR" \
    -I "$CUDNN_INCLUDE_DIR" -I "$CUDA_ROOT/include" -c "$CSRC/cudnn_sdpa.cpp" -o "$OUT/cudnn_sdpa.o" & p3=$!
ok=1
for p in $p1 $p2 $p3; do wait "$p" || ok=0; done
if [[ $ok == 0 ]]; then echo "[native_check] compilation failed" >&2; exit 1; fi
# the runtime linked statically: the binary needs only the driver (and libcudnn, dlopen-ed) there
g++ "$OUT"/native_fwd_sm90.o "$OUT"/native_check.o "$OUT"/cudnn_sdpa.o -o "$ROOT/target-cuda/native_check" \
    -L"$CUDA_ROOT/lib" -l:libcudart_static.a -ldl -lpthread -lrt
echo "[native_check] built target-cuda/native_check in $(( $(date +%s) - start )) s" >&2
