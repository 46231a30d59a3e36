#!/usr/bin/env bash
# One GPU, both sides one after the other in the same session: `longctx train` on a
# built-in shape (random weights, bf16) and the transformers peer
# (scripts/bench_train_torch.py: SDPA, gradient checkpointing, fused AdamW), then a table
# of tokens/s, MFU, device peak and the ratio longctx / transformers.
# Usage: scripts/bench_train_compare.sh [BINARY] [OUTDIR] [SEQS] [STEPS]   (BINARY may be a .gz)
#   SEQS default 16384,65536; STEPS default 4 (the first step of each side is not timed).
# Env: SHAPE tinyllama (default) or llama2-7b; LONGCTX_FLAGS="--save-attention ..." (appended
#   to `train`); TOKEN_CHUNK (default 8192) sets --token-chunk; LABEL names the rows;
#   PEER=0 skips the transformers side (a second longctx row against the same peer);
#   RUN_ROOT (default /tmp) holds the longctx run directories.
#
# longctx runs with --no-save: the timed steps are the same, and the 7B shape's final
# checkpoint (~94 GB) would not fit the GPU machine's 64 GiB disk.
# The peer runs as its users run it: with the environment this script was started in.
# The system CUDA libraries the longctx binary needs (LONGCTX_LD_LIBRARY_PATH, default
# CUDA 13.0's and the system's) are given to the longctx command alone; exported to the
# PyTorch side they once slowed transformers from 12.4K to 9.1K tok/s at 64K (docs/benchmarks.md).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-target-cuda/release/longctx}
OUTDIR=${2:-${OUT:-bench-out}}
SEQS=${3:-16384,65536}
STEPS=${4:-4}
SHAPE=${SHAPE:-tinyllama}
LABEL=${LABEL:-$SHAPE}
case $SHAPE in
    tinyllama) MODEL=builtin:tinyllama-1.1b-shape;;
    llama2-7b) MODEL=builtin:llama2-7b-shape;;
    *) echo "SHAPE: expected tinyllama or llama2-7b, got $SHAPE" >&2; exit 2;;
esac
mkdir -p "$OUTDIR"
if [[ $BIN == *.gz ]]; then gunzip -c "$BIN" > /tmp/longctx && chmod +x /tmp/longctx && BIN=/tmp/longctx; fi
OUR_LD=${LONGCTX_LD_LIBRARY_PATH:-/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=${RUN_ROOT:-/tmp}/btc-$LABEL; rm -rf "$W"; mkdir -p "$W"
RES=$OUTDIR/compare.jsonl; touch "$RES"
status=0
for S in ${SEQS//,/ }; do
    # shellcheck disable=SC2086
    LD_LIBRARY_PATH=$OUR_LD timeout 420 "$BIN" train --model "$MODEL" --dataset synthetic:passkey --seq-length "$S" --rope-theta 1e6 \
        --max-train-steps "$STEPS" --batch-size 1 --device cuda --dtype bf16 --token-chunk "${TOKEN_CHUNK:-8192}" --learning-rate 1e-5 \
        --no-save --output-dir "$W/l$S" ${LONGCTX_FLAGS:-} >"$OUTDIR/longctx-$LABEL-$S.log" 2>&1 || { echo "longctx $LABEL seq $S failed (see longctx-$LABEL-$S.log)"; status=1; }
    python3 - "$W/l$S/metrics.jsonl" "$S" "$LABEL" "${LONGCTX_FLAGS:-}" "$SHAPE" >>"$RES" <<'EOF' || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
t = rows[1:] or rows
tps = sum(r["tokens"] for r in t) / sum(r["seconds"] for r in t)
print(json.dumps({"side": "longctx", "seq": int(sys.argv[2]), "label": sys.argv[3], "flags": sys.argv[4], "shape": sys.argv[5], "tokens_per_s": tps, "mfu": t[-1].get("mfu"),
                  "peak_allocated_gib": max((r.get("device_peak_bytes") or 0) for r in rows) / 2**30,
                  "step_seconds": [round(r["seconds"], 3) for r in rows], "losses": [round(r["loss"], 5) for r in rows]}))
EOF
    if [[ ${PEER:-1} != 0 ]]; then
        timeout 420 python3 "$HERE/bench_train_torch.py" --shape "$SHAPE" --label "$LABEL" --seq "$S" --steps "$STEPS" --out "$RES" \
            >"$OUTDIR/torch-$LABEL-$S.log" 2>&1 || { echo "transformers $LABEL seq $S failed (see torch-$LABEL-$S.log)"; status=1; }
    fi
done
python3 "$HERE/bench_table.py" "$RES" | tee "$OUTDIR/compare.md"
exit $status
