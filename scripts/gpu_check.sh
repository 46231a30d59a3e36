#!/usr/bin/env bash
# Runs on the GPU machine: environment report, the attention correctness checks, our
# kernel's throughput (system cuDNN, then the cuDNN bundled with PyTorch when present),
# and PyTorch SDPA (cuDNN and FlashAttention-2 backends) on the same shapes.
#
# Usage: scripts/gpu_check.sh [BINARY] [OUTDIR]
#   BINARY: target-cuda/release/longctx (default; runs `longctx bench attention`), or any
#           binary that takes the `bench attention` arguments directly.
#   OUTDIR: where the logs go (default $OUT, else ./gpu-out).
# Env: SEQS (default 16384,65536,131072), ITERS (default 10), SKIP_TORCH=1,
#      POOL_COMPARE=1 (also time ours with --release-pool),
#      CHECK_TIMEOUT / BENCH_TIMEOUT / TORCH_TIMEOUT seconds per step (150 / 120 / 180).
set -uo pipefail

BIN=${1:-target-cuda/release/longctx}
OUTDIR=${2:-${OUT:-gpu-out}}
SEQS=${SEQS:-16384,65536,131072}
ITERS=${ITERS:-10}
mkdir -p "$OUTDIR"
export PYTHONUNBUFFERED=1
# PyTorch must not see the system cuDNN (9.14): it refuses any but its bundled 9.19.
TORCH_LD=${LD_LIBRARY_PATH:-}
SYS_LD=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

if [[ $(basename "$BIN") == longctx ]]; then CMD=("$BIN" bench attention); else CMD=("$BIN"); fi
status=0

{
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
    ls /usr/lib/x86_64-linux-gnu/libcudnn.so.9* 2>/dev/null | head -n 3
    echo "missing libraries:"; LD_LIBRARY_PATH=$SYS_LD ldd "$BIN" | grep "not found" || echo "  none"
} 2>&1 | tee "$OUTDIR/env.txt"

echo "== correctness" | tee "$OUTDIR/check.txt"
LD_LIBRARY_PATH=$SYS_LD timeout "${CHECK_TIMEOUT:-150}" "${CMD[@]}" --check 2>&1 | tee -a "$OUTDIR/check.txt" || status=1

bench() { # label, LD_LIBRARY_PATH, extra env/args...
    local label=$1 ld=$2; shift 2
    echo "== ours, $label" | tee -a "$OUTDIR/bench_ours.txt"
    env LD_LIBRARY_PATH="$ld" "$@" 2>&1 | tee -a "$OUTDIR/bench_ours.txt" || status=1
}
: >"$OUTDIR/bench_ours.txt"
T=(timeout "${BENCH_TIMEOUT:-120}")
bench "system cuDNN" "$SYS_LD" "${T[@]}" "${CMD[@]}" --seq "$SEQS" --iters "$ITERS"
if [[ -n "${POOL_COMPARE:-}" ]]; then
    bench "system cuDNN, --release-pool" "$SYS_LD" "${T[@]}" "${CMD[@]}" --seq "$SEQS" --iters "$ITERS" --release-pool
fi
# the cuDNN that PyTorch bundles (pip wheel), to compare like with like; its directory
# goes first so that libcudnn.so.9 finds its own sub-libraries
TORCH_CUDNN_DIR=$(LD_LIBRARY_PATH=$TORCH_LD python3 -c 'import nvidia.cudnn, os; print(os.path.join(list(nvidia.cudnn.__path__)[0], "lib"))' 2>/dev/null)
if [[ -n "$TORCH_CUDNN_DIR" && -f "$TORCH_CUDNN_DIR/libcudnn.so.9" ]]; then
    bench "PyTorch's cuDNN ($TORCH_CUDNN_DIR)" "$TORCH_CUDNN_DIR:$SYS_LD" \
        LONGCTX_CUDNN_LIB="$TORCH_CUDNN_DIR/libcudnn.so.9" "${T[@]}" "${CMD[@]}" --seq "$SEQS" --iters "$ITERS"
fi

if [[ -z "${SKIP_TORCH:-}" ]]; then
    echo "== PyTorch SDPA" | tee "$OUTDIR/bench_torch.txt"
    LD_LIBRARY_PATH=$TORCH_LD timeout "${TORCH_TIMEOUT:-180}" python3 scripts/bench_torch_sdpa.py --seq "$SEQS" --iters "$ITERS" 2>&1 \
        | tee -a "$OUTDIR/bench_torch.txt" || status=1
fi
exit $status
