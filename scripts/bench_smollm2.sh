#!/usr/bin/env bash
# A real pretrained model extended end to end on one GPU, and base vs extended evaluated:
# SmolLM2-135M-Instruct (8K) -> 64K with recipes/SmolLM2-135M-64K.toml on documentation
# written by people (scripts/make_longdocs.py), then
#   - perplexity against length (2K..128K) of both models on the held-out documents
#     (eval ppl --method truncate: every document of at least L+1 tokens, cut to L+1);
#   - passkey retrieval, depth x length, both models (eval needle --passkey, greedy);
#   - tokens/s and MFU of every stage (metrics.jsonl);
#   - transformers' perplexity of the export on the same windows (scripts/ppl_transformers.py:
#     the same token counts, and within RTOL of longctx's).
# Results: $OUT_DIR/{summary.txt, ppl.{csv,json,png}, needle_*, ppl_transformers.json, metrics.jsonl}.
#
# Usage: scripts/bench_smollm2.sh            (one H200: ~10 minutes)
# Env:   LONGCTX (binary, default target-cuda/release/longctx), MODEL (default
#        models/SmolLM2-135M-Instruct, made by scripts/smollm2_hf.py when missing),
#        DATA (default data/longdocs, made by scripts/make_longdocs.py when missing),
#        RUN (default runs/SmolLM2-135M-64K), OUT_DIR (default runs/bench-smollm2),
#        LENGTHS (default 2K,4K,8K,16K,32K,64K,128K), NEEDLE_LENGTHS (default 2K,4K,8K,16K,32K,64K),
#        TRIALS (passkey trials per cell, default 3), RTOL (default 1e-3), PYTHON (default python3),
#        SKIP_TRAIN=1 (evaluate an existing $RUN/export), RECIPE (default recipes/SmolLM2-135M-64K.toml).
set -euo pipefail
cd "$(dirname "$0")/.."
LONGCTX=${LONGCTX:-target-cuda/release/longctx}
MODEL=${MODEL:-models/SmolLM2-135M-Instruct}
DATA=${DATA:-data/longdocs}
RUN=${RUN:-runs/SmolLM2-135M-64K}
OUT_DIR=${OUT_DIR:-runs/bench-smollm2}
LENGTHS=${LENGTHS:-2K,4K,8K,16K,32K,64K,128K}
NEEDLE_LENGTHS=${NEEDLE_LENGTHS:-2K,4K,8K,16K,32K,64K}
TRIALS=${TRIALS:-3}
RTOL=${RTOL:-1e-3}
PYTHON=${PYTHON:-python3}
RECIPE=${RECIPE:-recipes/SmolLM2-135M-64K.toml}
mkdir -p "$OUT_DIR"
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
say() { echo "$*" | tee -a "$SUMMARY"; }

[[ -x "$LONGCTX" ]] || { echo "no longctx binary at $LONGCTX (scripts/build_cuda.sh, or set LONGCTX)" >&2; exit 2; }
if [[ ! -f "$MODEL/config.json" ]]; then
    "$PYTHON" scripts/smollm2_hf.py --out "$MODEL" 2>&1 | grep -v -E "it/s\]|Warning" | tee -a "$SUMMARY"
fi
if [[ ! -f "$DATA/eval.jsonl" ]]; then
    "$PYTHON" scripts/make_longdocs.py --out "$DATA" --tokenizer "$MODEL/tokenizer.json" | tee -a "$SUMMARY"
fi
say "longctx: $("$LONGCTX" --version 2>/dev/null || echo unknown); GPU: $(nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | head -1)"

if [[ "${SKIP_TRAIN:-0}" != 1 ]]; then
    t0=$SECONDS
    "$LONGCTX" train --config "$RECIPE" --model "$MODEL" --dataset "$DATA/train.jsonl" \
        --eval-dataset "$DATA/eval.jsonl" --output-dir "$RUN" --overwrite 2>&1 | tr '\r' '\n' | grep -v -E "^\s*$" | tail -n 40 | tee "$OUT_DIR/train.log"
    say "train: $((SECONDS - t0)) s wall, start-up and export included"
fi
cp "$RUN/metrics.jsonl" "$OUT_DIR/metrics.jsonl"
"$PYTHON" scripts/metrics_summary.py "$RUN/metrics.jsonl" --stages | tee -a "$SUMMARY"

EXPORT="$RUN/export"
# Passkey first (the cheapest measure, and the one a visit must not lose), then perplexity.
for m in "$MODEL" "$EXPORT"; do
    tag=$(basename "$(dirname "$m")")_$(basename "$m")
    t0=$SECONDS
    "$LONGCTX" eval needle --model "$m" --passkey --lengths "$NEEDLE_LENGTHS" --depths 0,0.25,0.5,0.75,1 --trials "$TRIALS" \
        --device cuda --dtype bf16 --allow-extrapolation --output-dir "$OUT_DIR/needle_$tag" 2>&1 | grep -v -E "^\s*$" | tail -n 20 | tee -a "$SUMMARY"
    say "eval needle $m: $((SECONDS - t0)) s"
done
t0=$SECONDS
"$LONGCTX" eval ppl --model "$MODEL" --model "$EXPORT" --dataset "$DATA/eval.jsonl" --dataset-split '*' --method truncate \
    --lengths "$LENGTHS" --max-docs 16 --device cuda --dtype bf16 --allow-extrapolation --token-chunk 16384 \
    --output-dir "$OUT_DIR" 2>&1 | grep -v -E "^\s*$" | tee "$OUT_DIR/ppl.log"
say "eval ppl: $((SECONDS - t0)) s"
grep -E "length" "$OUT_DIR/ppl.log" >>"$SUMMARY" || true

"$PYTHON" scripts/ppl_transformers.py --model "$EXPORT" --dataset "$DATA/eval.jsonl" --longctx-json "$OUT_DIR/ppl.json" \
    --name "$EXPORT" --max-docs 16 --rtol "$RTOL" --out "$OUT_DIR/ppl_transformers.json" 2>&1 | grep -v -E "Warning|it/s\]" | tee -a "$SUMMARY"

say "done: $OUT_DIR"
