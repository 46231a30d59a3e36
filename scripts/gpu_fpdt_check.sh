#!/usr/bin/env bash
# Runs on the GPU machine: the attention checks (incl. the host stash and FPDT with
# offload), the engine's offload comparison at one length, and FPDT training with and
# without offload (TinyLlama-1.1B shape, one GPU, world 1), optionally also on an older
# binary for the before figure.
# Usage: scripts/gpu_fpdt_check.sh BINARY [OLD_BINARY|-] [OUTDIR]   (binaries may be .gz)
set -uo pipefail
unz() { if [[ $1 == *.gz ]]; then gunzip -c "$1" > "/tmp/$2" && chmod +x "/tmp/$2" && echo "/tmp/$2"; else echo "$1"; fi; }
BIN=$(unz "${1:-target-cuda/release/longctx}" longctx)
OLD=${2:--}; [[ $OLD != - ]] && OLD=$(unz "$OLD" longctx-old)
OUTDIR=${3:-${OUT:-gpu-out}}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=/tmp/gfc; rm -rf $W; mkdir -p $W
status=0
echo "== attention checks" | tee "$OUTDIR/fpdt.txt"
timeout 150 "$BIN" bench attention --check > "$OUTDIR/attention_check.txt" 2>&1 || status=1
grep -E "stash|fpdt|all attention|FAIL" "$OUTDIR/attention_check.txt" | tee -a "$OUTDIR/fpdt.txt"
echo "== engine offload at 64K" | tee -a "$OUTDIR/fpdt.txt"
timeout 200 "$BIN" bench engine --seq 65536 --iters 2 > "$OUTDIR/bench_engine.jsonl" 2>> "$OUTDIR/fpdt.txt" || status=1
echo "== FPDT training, TinyLlama-1.1B shape, 64K, chunk 16K, world 1" | tee -a "$OUTDIR/fpdt.txt"
perf() { # label, binary, args...
    local label=$1 bin=$2; shift 2
    timeout 200 "$bin" train --model builtin:tinyllama-1.1b-shape --dataset synthetic:passkey --seq-length 65536 --rope-theta 1e6 \
        --max-train-steps 3 --batch-size 1 --device cuda --dtype bf16 --token-chunk 8192 --learning-rate 1e-5 \
        --parallel-mode fpdt --world-size 1 --fpdt-chunk-size 16384 --output-dir $W/$label "$@" >>"$OUTDIR/train_log.txt" 2>&1 || { echo "FAILED: $label" | tee -a "$OUTDIR/fpdt.txt"; status=1; return; }
    python3 "$(dirname "$0")/metrics_summary.py" "$W/$label/metrics.jsonl" "$label" | tee -a "$OUTDIR/fpdt.txt"
    rm -rf "$W/$label"
}
perf fpdt-kept "$BIN"
perf fpdt-offload "$BIN" --fpdt-offload
[[ $OLD != - ]] && perf old-fpdt-offload "$OLD" --fpdt-offload
exit $status
