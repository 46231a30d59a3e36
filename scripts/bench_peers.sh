#!/usr/bin/env bash
# Every longctx / transformers ratio that docs/benchmarks.md and the README publish, in one
# command on one GPU (both sides measured in the same session, the peer in the environment
# this script was started in; scripts/bench_train_compare.sh). Rows:
#   tiny16k, tiny128k    TinyLlama-1.1B shape, --save-attention
#   tiny64k              TinyLlama-1.1B shape at 64K, --save-attention, --token-chunk 16384
#   tiny64k-mlp          the same with --save-mlp (the MLP's tensors kept too)
#   7b64k                Llama-2-7B shape at 64K, ZeRO-3, weights and optimizer on the host
#   7b64k-saved          the same with --save-attention
#   7b64k-mlp6           the same with --save-mlp-layers 6 (the top 6 layers' MLP kept; what
#                        `longctx plan` suggests on an H200)
#   7b64k-dev3           the same with --optimizer-device-units 3 (the embedding's, layer 0's
#                        and layer 1's AdamW state and weights on the GPU, so that the next
#                        forward should wait for no host update; not measured at 32 layers:
#                        session 38's first form, 2 units, gave 1.33× as 7b64k-mlp6; at 16
#                        layers on an H100, session 42, the optimizer wait 0.17 -> 0.09 s)
#   7b64k-in10           --offload-layer-inputs (the layer inputs in host memory, 17 GB of the
#                        GPU freed) spent on --save-mlp-layers 10 and --optimizer-device-units 3
#                        (`longctx plan`: 148.9 of 150.8 GB; not measured at 32 layers yet; at
#                        16 layers on an H100, session 42: 0.13 s a step less than mlp2 alone,
#                        docs/benchmarks.md)
#   7b64k-g14            --offload-gradients (each layer's f32 gradient in host memory once
#                        the backward is done with it: 24 GB of the GPU freed) spent on
#                        --save-mlp-layers 14 (`longctx plan`: 147.2 of 150.8 GB; not yet run
#                        on a GPU)
#   7b64k-g12d3          --offload-gradients with --save-mlp-layers 12 and
#                        --optimizer-device-units 3 (plan: 149.4 of 150.8 GB; not yet run)
# transformers runs once per shape and length: with the first row of that shape and length
# in ROWS; the later rows are compared with it.
# Usage: scripts/bench_peers.sh [BINARY] [OUTDIR] [ROWS]    ROWS: comma-separated of the
#   rows above (default all). STEPS (default 3: the first is not timed); STEPS_7B (default
#   STEPS) for the Llama-2-7B rows, whose step 2 is longer than the next ones.
# Result: OUTDIR/compare.md (the table and the peer's versions and SDPA backend), compare.jsonl, logs.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-target-cuda/release/longctx}
OUTDIR=${2:-${OUT:-bench-out}}
ROWS=${3:-tiny16k,tiny64k,tiny64k-mlp,tiny128k,7b64k,7b64k-saved,7b64k-mlp6,7b64k-dev3,7b64k-in10,7b64k-g14,7b64k-g12d3}
STEPS=${STEPS:-3}
STEPS_7B=${STEPS_7B:-$STEPS}
# --skip-memory-check: the planner's GPU and host estimates may not refuse a 7B row (its
# host figure, 124 GB, is close to a 128 GiB machine's); the rows record the measured peaks.
ZERO="--zero-stage 3 --offload-params --optimizer-on-host --skip-memory-check"
mkdir -p "$OUTDIR"
declare -A peer_done
# row SHAPE SEQ TOKEN_CHUNK STEPS LABEL FLAGS
row() {
    local key="$1/$2" peer=1
    [[ -n ${peer_done[$key]:-} ]] && peer=0
    peer_done[$key]=1
    PEER=$peer SHAPE=$1 LABEL=$5 TOKEN_CHUNK=$3 LONGCTX_FLAGS="$6" "$HERE/bench_train_compare.sh" "$BIN" "$OUTDIR" "$2" "$4"
}
status=0
for r in ${ROWS//,/ }; do
    case $r in
        tiny16k) row tinyllama 16384 8192 "$STEPS" tinyllama "--save-attention";;
        tiny64k) row tinyllama 65536 16384 "$STEPS" tinyllama "--save-attention";;
        tiny64k-mlp) row tinyllama 65536 16384 "$STEPS" tinyllama-mlp "--save-attention --save-mlp";;
        tiny128k) row tinyllama 131072 8192 "$STEPS" tinyllama "--save-attention";;
        7b64k) row llama2-7b 65536 8192 "$STEPS_7B" llama2-7b "$ZERO";;
        7b64k-saved) row llama2-7b 65536 8192 "$STEPS_7B" llama2-7b-saved "$ZERO --save-attention";;
        7b64k-mlp6) row llama2-7b 65536 8192 "$STEPS_7B" llama2-7b-mlp6 "$ZERO --save-attention --save-mlp-layers 6";;
        7b64k-dev3) row llama2-7b 65536 8192 "$STEPS_7B" llama2-7b-dev3 "$ZERO --save-attention --save-mlp-layers 6 --optimizer-device-units 3";;
        7b64k-in10) row llama2-7b 65536 8192 "$STEPS_7B" llama2-7b-in10 "$ZERO --save-attention --offload-layer-inputs --save-mlp-layers 10 --optimizer-device-units 3";;
        7b64k-g14) row llama2-7b 65536 8192 "$STEPS_7B" llama2-7b-g14 "$ZERO --save-attention --offload-gradients --save-mlp-layers 14";;
        7b64k-g12d3) row llama2-7b 65536 8192 "$STEPS_7B" llama2-7b-g12d3 "$ZERO --save-attention --offload-gradients --save-mlp-layers 12 --optimizer-device-units 3";;
        *) echo "unknown row $r (tiny16k, tiny64k, tiny64k-mlp, tiny128k, 7b64k, 7b64k-saved, 7b64k-mlp6, 7b64k-dev3, 7b64k-in10, 7b64k-g14, 7b64k-g12d3)" >&2; exit 2;;
    esac || status=1
done
python3 "$HERE/bench_table.py" "$OUTDIR/compare.jsonl" | tee "$OUTDIR/compare.md"
exit $status
