#!/usr/bin/env bash
# Builds target-cuda/native_check: the device check and benchmark of longctx's own Hopper
# attention kernels (attention/csrc/native_{fwd,bwd}_sm90.cu) against a naive f32 reference and
# against cuDNN through the shim (attention/csrc/cudnn_sdpa.cpp), side by side in one process.
#
# The CUTLASS/CuTe headers come from the `nvidia-cutlass` PyPI wheel, which
# scripts/build_cuda.sh fetches like the cuDNN frontend (and sets up nvcc).
# Usage: scripts/build_native_check.sh        then on the GPU machine: target-cuda/native_check
#        scripts/build_native_check.sh --profile   target-cuda/native_check_prof instead: the
#        backward's phase clock (LONGCTX_NATIVE_PROFILE, in native_bwd_sm90.cu) on; its ptxas
#        report is not gated (the clock's registers may spill where the plain kernel does not)
#        scripts/build_native_check.sh --variant NAME -DMACRO=VALUE...   target-cuda/native_check_NAME:
#        the kernels built with the backward's tunables changed (LONGCTX_BWD_D128_STAGES,
#        LONGCTX_BWD_D128_DQ_BUFS; see BwdTraits), gated like the plain build, to time beside it
#        ... --variant NAME --allow-spills -D...   the same, with spills reported but not fatal (a
#        few loop-invariant LDL a step may cost little); serialised wgmma still fails the build
set -euo pipefail
PROFILE=0
ALLOW_SPILLS=0
VARIANT=""
DEFINES=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --profile) PROFILE=1;;
        --allow-spills) ALLOW_SPILLS=1;;
        --variant)
            [[ $# -ge 2 && $2 =~ ^[A-Za-z0-9_]+$ ]] || { echo "--variant: expected a name of letters, digits and _ (got '${2:-}')" >&2; exit 2; }
            VARIANT=$2; shift;;
        -D*=*) DEFINES+=("$1");;
        *) echo "usage: $0 [--profile] [--variant NAME [--allow-spills] -DMACRO=VALUE...] (got '$1')" >&2; exit 2;;
    esac
    shift
done
if [[ ${#DEFINES[@]} -gt 0 && -z $VARIANT ]]; then echo "-D...: give the build a name with --variant NAME" >&2; exit 2; fi
if [[ $ALLOW_SPILLS == 1 && -z $VARIANT ]]; then echo "--allow-spills: only for a --variant build (the plain build stays gated)" >&2; exit 2; fi
ROOT=$(cd "$(dirname "$0")/.." && pwd)
eval "$("$ROOT/scripts/build_cuda.sh" --setup-only)"   # nvcc, cuDNN frontend and CUTLASS headers
OUT=$ROOT/target-cuda/native_check.d
NAME=native_check
CSRC=$ROOT/attention/csrc
NVFLAGS=(-std=c++17 -O3 -arch=sm_90a --expt-relaxed-constexpr -I "$CUTLASS_INCLUDE_DIR" -I "$CSRC")
if [[ -n $VARIANT ]]; then OUT=$ROOT/target-cuda/native_check_$VARIANT.d NAME=native_check_$VARIANT NVFLAGS+=("${DEFINES[@]}"); fi
if [[ $PROFILE == 1 ]]; then OUT=$OUT-prof NAME=${NAME}_prof NVFLAGS+=(-DLONGCTX_NATIVE_PROFILE=1); fi
mkdir -p "$OUT"
start=$(date +%s)
rm -f "$OUT"/native_*.o
# ptxas reports (-v) kept per kernel file: checked below for serialised wgmma and spills
nvcc "${NVFLAGS[@]}" -Xptxas -v -c "$CSRC/native_fwd_sm90.cu" -o "$OUT/native_fwd_sm90.o" 2>"$OUT/native_fwd_sm90.ptxas" & p1=$!
nvcc "${NVFLAGS[@]}" -Xptxas -v -c "$CSRC/native_bwd_sm90.cu" -o "$OUT/native_bwd_sm90.o" 2>"$OUT/native_bwd_sm90.ptxas" & p3=$!
nvcc "${NVFLAGS[@]}" -c "$CSRC/native_check.cu" -o "$OUT/native_check.o" & p2=$!
pids=($p1 $p2 $p3)
# the cuDNN shim (two minutes of the frontend's headers) only when its sources changed; a
# variant or profile build takes the plain build's when that one is current
PLAIN_SHIM=$ROOT/target-cuda/native_check.d/cudnn_sdpa.o
if [[ $OUT != "$ROOT/target-cuda/native_check.d" && "$PLAIN_SHIM" -nt "$CSRC/cudnn_sdpa.cpp" && "$PLAIN_SHIM" -nt "$CSRC/cudnn_sdpa.h" ]]; then
    cp -p "$PLAIN_SHIM" "$OUT/cudnn_sdpa.o"
fi
if [[ ! "$OUT/cudnn_sdpa.o" -nt "$CSRC/cudnn_sdpa.cpp" || ! "$OUT/cudnn_sdpa.o" -nt "$CSRC/cudnn_sdpa.h" ]]; then
    rm -f "$OUT/cudnn_sdpa.o"
    g++ -std=c++17 -O2 -DNV_CUDNN_FRONTEND_USE_DYNAMIC_LOADING -I "$CSRC" -I "$CUDNN_FRONTEND_INCLUDE_DIR" \
        -I "$CUDNN_INCLUDE_DIR" -I "$CUDA_ROOT/include" -c "$CSRC/cudnn_sdpa.cpp" -o "$OUT/cudnn_sdpa.o" & pids+=($!)
fi
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
if [[ $ok == 0 ]]; then
    cat "$OUT"/*.ptxas >&2
    echo "[native_check] compilation failed" >&2; exit 1
fi
# ptxas only informs when it serialises the wgmma pipeline (C7510-C7518), ignores setmaxnreg
# (C7504-C7509) or spills; each halves a kernel's speed or worse, so they fail this build
# (C7519, an injected warpgroup.arrive, is allowed)
for f in "$OUT"/native_fwd_sm90.ptxas "$OUT"/native_bwd_sm90.ptxas; do
    [[ $PROFILE == 1 ]] && break
    bad=$(grep -E "\(C75(0[4-9]|1[0-8])\)" "$f" | cut -c1-160 | sort -u || true)
    spills=$(grep -E "[1-9][0-9]* bytes spill stores" "$f" | sort -u || true)
    if [[ $ALLOW_SPILLS == 1 && -n $spills ]]; then
        printf '[native_check] spills allowed in %s:\n%s\n' "$(basename "$f" .ptxas).cu" "$spills" >&2
        spills=""
    fi
    if [[ -n $bad || -n $spills ]]; then
        printf '%s\n%s\n' "$bad" "$spills" >&2
        echo "[native_check] ptxas serialised or spilled in $(basename "$f" .ptxas).cu (full report: $f)" >&2; exit 1
    fi
done
# the runtime linked statically: the binary needs only the driver (and libcudnn, dlopen-ed) there
g++ "$OUT"/native_fwd_sm90.o "$OUT"/native_bwd_sm90.o "$OUT"/native_check.o "$OUT"/cudnn_sdpa.o -o "$ROOT/target-cuda/$NAME" \
    -L"$CUDA_ROOT/lib" -l:libcudart_static.a -ldl -lpthread -lrt
echo "[native_check] built target-cuda/$NAME in $(( $(date +%s) - start )) s" >&2
