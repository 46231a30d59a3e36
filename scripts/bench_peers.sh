#!/usr/bin/env bash
# Every longctx / transformers ratio that docs/benchmarks.md and the README publish, in one
# command on one GPU (both sides measured in the same session, the peer in the environment
# this script was started in; scripts/bench_train_compare.sh):
#   TinyLlama-1.1B shape: 16K and 128K with --save-attention, 64K with --save-attention and
#   --token-chunk 16384; Llama-2-7B shape at 64K with ZeRO-3, weights and optimizer on the
#   host, without and with --save-attention (one transformers run for both).
# Usage: scripts/bench_peers.sh [BINARY] [OUTDIR] [ROWS]    ROWS: comma-separated of
#   tiny16k,tiny64k,tiny128k,7b64k,7b64k-saved (default all). STEPS (default 3: 2 timed).
# Result: OUTDIR/compare.md (the table and the peer's versions and SDPA backend), compare.jsonl, logs.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-target-cuda/release/longctx}
OUTDIR=${2:-${OUT:-bench-out}}
ROWS=${3:-tiny16k,tiny64k,tiny128k,7b64k,7b64k-saved}
STEPS=${STEPS:-3}
# The 7B rows skip the up-front disk check: a 7B checkpoint is 95 GB, more than a 64 GB
# GPU machine's disk, so those runs end with a disk error after their timed steps (give
# RUN_ROOT a small filesystem to make that quick); their step times are unaffected.
ZERO="--zero-stage 3 --offload-params --optimizer-on-host --skip-memory-check"
mkdir -p "$OUTDIR"
status=0
for row in ${ROWS//,/ }; do
    case $row in
        tiny16k) SHAPE=tinyllama LABEL=tinyllama LONGCTX_FLAGS="--save-attention" TOKEN_CHUNK=8192 "$HERE/bench_train_compare.sh" "$BIN" "$OUTDIR" 16384 "$STEPS";;
        tiny64k) SHAPE=tinyllama LABEL=tinyllama LONGCTX_FLAGS="--save-attention" TOKEN_CHUNK=16384 "$HERE/bench_train_compare.sh" "$BIN" "$OUTDIR" 65536 "$STEPS";;
        tiny128k) SHAPE=tinyllama LABEL=tinyllama LONGCTX_FLAGS="--save-attention" TOKEN_CHUNK=8192 "$HERE/bench_train_compare.sh" "$BIN" "$OUTDIR" 131072 "$STEPS";;
        7b64k) SHAPE=llama2-7b LABEL=llama2-7b LONGCTX_FLAGS="$ZERO" TOKEN_CHUNK=8192 "$HERE/bench_train_compare.sh" "$BIN" "$OUTDIR" 65536 "$STEPS";;
        7b64k-saved) PEER=0 SHAPE=llama2-7b LABEL=llama2-7b-saved LONGCTX_FLAGS="$ZERO --save-attention" TOKEN_CHUNK=8192 "$HERE/bench_train_compare.sh" "$BIN" "$OUTDIR" 65536 "$STEPS";;
        *) echo "unknown row $row (tiny16k, tiny64k, tiny128k, 7b64k, 7b64k-saved)" >&2; exit 2;;
    esac || status=1
done
python3 "$HERE/bench_table.py" "$OUTDIR/compare.jsonl" | tee "$OUTDIR/compare.md"
exit $status
