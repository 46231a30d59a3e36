#!/usr/bin/env bash
# Runs on the GPU machine: activation offload (pinned host buffers, copies on a separate
# stream) against layer inputs kept on the device.
#  1. `bench engine`, TinyLlama-1.1B shape: gradients offloaded vs kept (must not differ
#     beyond two identical runs), step time and device-memory peak at each length;
#  2. `train` of the tiny model, every mode with in-process ranks, offload on vs off:
#     per-step losses must be identical;
#  3. `train` of the TinyLlama-1.1B shape at 64K, offload off/on, tokens/s and peak; with
#     OLD_BINARY (a build before pinned offload) the same two runs for the before figure.
# Usage: scripts/gpu_offload_check.sh BINARY [OLD_BINARY|-] [OUTDIR] [SEQS] [RUNS]
#   binaries may be .gz; SEQS for part 1 (default 16384,65536); RUNS of part 3 (default
#   "new-kept new-offload old-kept old-offload"; the old ones only with OLD_BINARY).
set -uo pipefail
unz() { if [[ $1 == *.gz ]]; then gunzip -c "$1" > "/tmp/$2" && chmod +x "/tmp/$2" && echo "/tmp/$2"; else echo "$1"; fi; }
BIN=$(unz "${1:-target-cuda/release/longctx}" longctx)
OLD=${2:--}; [[ $OLD != - ]] && OLD=$(unz "$OLD" longctx-old)
OUTDIR=${3:-${OUT:-gpu-out}}
SEQS=${4:-16384,65536}
RUNS=${5:-new-kept new-offload old-kept old-offload}
mkdir -p "$OUTDIR"
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=/tmp/goc; rm -rf $W; mkdir -p $W
status=0

echo "== 1. bench engine, gradients and step time" | tee "$OUTDIR/offload.txt"
timeout 420 "$BIN" bench engine --model builtin:tinyllama-1.1b-shape --seq "$SEQS" --offload both --iters 3 \
    >"$OUTDIR/bench_engine.jsonl" 2>>"$OUTDIR/offload.txt" || status=1
tail -n 20 "$OUTDIR/offload.txt"

echo "== 2. tiny model, every mode, offload on vs off" | tee -a "$OUTDIR/offload.txt"
TINY=(train --model builtin:tiny --dataset synthetic:passkey --seq-length 256 --rope-theta 1e5 --max-train-steps 3 --batch-size 2 --device cuda --dtype bf16)
pair() { # name, args...
    local name=$1; shift
    timeout 120 "$BIN" "${TINY[@]}" --output-dir $W/$name-off "$@" >>"$OUTDIR/train_log.txt" 2>&1 || status=1
    timeout 120 "$BIN" "${TINY[@]}" --output-dir $W/$name-on --offload-activations "$@" >>"$OUTDIR/train_log.txt" 2>&1 || status=1
    # bit-identical losses (status set outside the pipe, which runs in a subshell)
    python3 "$(dirname "$0")/metrics_summary.py" --compare "$W/$name-on/metrics.jsonl" "$W/$name-off/metrics.jsonl" 0 "$name offload on vs off" \
        | tee -a "$OUTDIR/offload.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || status=1
}
pair single
pair ring2 --parallel-mode zigzag_ring_attn --world-size 2
pair ulysses2 --parallel-mode ulysses_attn --world-size 2
pair fpdt2 --parallel-mode fpdt --world-size 2 --fpdt-chunk-size 64 --fpdt-offload
pair usp4 --parallel-mode usp --world-size 4 --ulysses-size 2

echo "== 3. TinyLlama-1.1B shape training at 64K" | tee -a "$OUTDIR/offload.txt"
perf() { # label, binary, args...
    local label=$1 bin=$2; shift 2
    timeout 200 "$bin" train --model builtin:tinyllama-1.1b-shape --dataset synthetic:passkey --seq-length 65536 --rope-theta 1e6 \
        --max-train-steps 3 --batch-size 1 --device cuda --dtype bf16 --token-chunk 8192 --learning-rate 1e-5 \
        --output-dir $W/$label "$@" >>"$OUTDIR/train_log.txt" 2>&1 || { echo "FAILED: $label" | tee -a "$OUTDIR/offload.txt"; status=1; return; }
    python3 "$(dirname "$0")/metrics_summary.py" "$W/$label/metrics.jsonl" "$label" | tee -a "$OUTDIR/offload.txt"
    rm -rf "$W/$label" # checkpoints and exports of the 1.1B model fill the disk
}
want() { [[ " $RUNS " == *" $1 "* ]]; }
want new-kept && perf new-kept "$BIN"
want new-offload && perf new-offload "$BIN" --offload-activations
if [[ $OLD != - ]]; then
    want old-kept && perf old-kept "$OLD"
    want old-offload && perf old-offload "$OLD" --offload-activations
fi
exit $status
