#!/usr/bin/env bash
# Document-masked attention and training on one GPU (issue #30), all in one visit:
#   1. `bench attention --check`: the CUDA kernel against the CPU kernel, then every mode
#      at W = 2 and 4 (threads on one GPU) plain and under a document mask, the masked ones
#      against each document run alone through the CUDA kernel;
#   2. `bench attention --docs 1,16,64` at 64K with TinyLlama-1.1B's attention (32/4 heads
#      × 64): time of 16 × 4K and 64 × 1K documents against one 64K document;
#   3. `train` of the TinyLlama-1.1B shape at 64K (bf16, saved attention, token chunk
#      16384), one document per sample (synthetic:passkey, the path of every earlier
#      figure) and packed documents of 4K and 1K tokens (--packing documents): tokens/s.
# Results under $OUT_DIR (default $OUT or bench-docs): check.txt, attention.txt, train-*.log,
# train.jsonl (one line per run) and summary.txt.
# Usage: scripts/bench_docs.sh [BINARY]   (default target-cuda/release/longctx; .xz is unpacked)
set -uo pipefail
BIN=${1:-target-cuda/release/longctx}
OUT_DIR=${OUT_DIR:-${OUT:-bench-docs}}
STEPS=${STEPS:-3}
mkdir -p "$OUT_DIR"
if [[ $BIN == *.xz ]]; then xz -dc "$BIN" > /tmp/longctx && chmod +x /tmp/longctx && BIN=/tmp/longctx; fi
export LD_LIBRARY_PATH=${LONGCTX_LD_LIBRARY_PATH:-/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
S=65536
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | head -1 | tee "$OUT_DIR/summary.txt"

timeout 120 "$BIN" bench attention --check > "$OUT_DIR/check.txt" 2>&1; echo "check rc=$?" | tee -a "$OUT_DIR/summary.txt"
timeout 120 "$BIN" bench attention --seq $S --heads 32 --kv-heads 4 --head-dim 64 --docs 1,16,64 --iters 5 --warmup 2 \
    > "$OUT_DIR/attention.txt" 2>&1; echo "attention rc=$?" | tee -a "$OUT_DIR/summary.txt"

# Packed documents of L tokens (random ids of the 32,000-token vocabulary), enough for the steps.
make_docs() {
    python3 - "$1" "$2" "$(( (STEPS + 1) * (S + 1) ))" <<'PY'
import json, random, sys
path, length, total = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
random.seed(length)
with open(path, "w") as f:
    for _ in range(total // length + 2):
        f.write(json.dumps({"input_ids": [random.randrange(3, 32000) for _ in range(length)]}) + "\n")
PY
}
train() { # label, extra flags...
    local label=$1; shift
    rm -rf "/tmp/bd-$label" # --overwrite would too, but only after the disk check counted the old run
    timeout 150 "$BIN" train --model builtin:tinyllama-1.1b-shape --seq-length $S --rope-theta 1e6 --max-train-steps "$STEPS" \
        --batch-size 1 --device cuda --dtype bf16 --token-chunk 16384 --learning-rate 1e-5 --save-attention \
        --output-dir "/tmp/bd-$label" --overwrite "$@" > "$OUT_DIR/train-$label.log" 2>&1
    local rc=$?
    echo "train $label rc=$rc" | tee -a "$OUT_DIR/summary.txt"
    if [[ $rc != 0 ]]; then tail -3 "$OUT_DIR/train-$label.log" | tee -a "$OUT_DIR/summary.txt"; return; fi
    python3 - "/tmp/bd-$label/metrics.jsonl" "$label" >> "$OUT_DIR/train.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
t = rows[1:] or rows
print(json.dumps({"label": sys.argv[2], "tokens_per_s": sum(r["tokens"] for r in t) / sum(r["seconds"] for r in t),
                  "step_seconds": [round(r["seconds"], 3) for r in rows], "losses": [round(r["loss"], 4) for r in rows]}))
PY
    rm -rf "/tmp/bd-$label" # 17.6 GB of checkpoint and export per run
}
train one-doc --dataset synthetic:passkey
make_docs /tmp/docs4k.jsonl 4095 && train docs-16x4K --dataset /tmp/docs4k.jsonl --packing documents
make_docs /tmp/docs1k.jsonl 1023 && train docs-64x1K --dataset /tmp/docs1k.jsonl --packing documents
cat "$OUT_DIR/train.jsonl" | tee -a "$OUT_DIR/summary.txt"
grep -A8 "document-masked" "$OUT_DIR/attention.txt" | tee -a "$OUT_DIR/summary.txt"
grep -E "FAIL|passed" "$OUT_DIR/check.txt" | tail -3 | tee -a "$OUT_DIR/summary.txt"
