#!/usr/bin/env bash
# One GPU: the explicit layer backward (fused kernels, GEMM-accumulated weight gradients)
# against the autograd reference, within bf16's own noise, measured by two reference runs
# (autograd in bf16 and autograd in f32) on the same weights and data.
#   1. gradients of one step: `longctx bench engine --check-grads` (TinyLlama-1.1B shape cut
#      to 2 layers, 1K tokens: the f32 reference runs the naive attention, cuDNN being
#      16-bit only), bf16 recomputing, with saved attention and with saved attention and MLP,
#      and f32 (explicit within 1e-4, recomputing and with both saved);
#   2. losses of 10 training steps of the tiny model and of the 2-layer 1.1B shape (1K
#      tokens): explicit bf16 vs f32 within twice autograd bf16 vs f32.
# Env: MODEL (default builtin:tinyllama-1.1b-shape@layers=2), SEQ (default 1024); ONLY=train
#   runs part 2 alone.
# Usage: scripts/gpu_engine_check.sh BINARY(.gz) OUTDIR
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=$1; OUTDIR=$2; mkdir -p "$OUTDIR"
if [[ $BIN == *.gz ]]; then gunzip -c "$BIN" > /tmp/longctx-check && chmod +x /tmp/longctx-check && BIN=/tmp/longctx-check; fi
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# cuDNN attention takes bf16/f16 only: the f32 reference runs use the naive attention.
export LONGCTX_ATTN_FALLBACK=1
MODEL=${MODEL:-builtin:tinyllama-1.1b-shape@layers=2}; SEQ=${SEQ:-1024}
W=/tmp/gec; rm -rf $W; mkdir -p $W
status=0
# ONLY=train skips the gradient checks (part 1) and runs the training comparison alone.
if [[ ${ONLY:-} != train ]]; then
for extra in "" "--save-attention" "--save-attention --save-mlp"; do
  timeout 120 "$BIN" bench engine --check-grads --model "$MODEL" --seq "$SEQ" --token-chunk 256 $extra \
    >>"$OUTDIR/check_grads.jsonl" 2>>"$OUTDIR/check_grads.log" || { echo "check-grads $extra FAILED"; status=1; }
done
# f32 on the GPU: autograd is the reference itself, so the explicit path (GEMM-accumulated
# f32 weight gradients, fused kernels) must be within 1e-4 of it outright.
for extra in "" "--save-attention --save-mlp"; do
  timeout 120 "$BIN" bench engine --check-grads --model "$MODEL" --dtype f32 --seq "$SEQ" --token-chunk 256 --tolerance 1e-4 $extra \
    >>"$OUTDIR/check_grads.jsonl" 2>>"$OUTDIR/check_grads.log" || { echo "check-grads f32 $extra FAILED"; status=1; }
done
grep -E "^seq" "$OUTDIR/check_grads.log"
fi
train() { # name dtype layer_backward model seq steps batch lr
  printf '[train]\nlayer_backward = "%s"\n' "$3" > $W/$1.toml
  timeout 120 "$BIN" train --config $W/$1.toml --model "$4" --dataset synthetic:passkey --seq-length "$5" --rope-theta 1e6 \
    --max-train-steps "$6" --batch-size "$7" --learning-rate "$8" --device cuda --dtype "$2" --output-dir $W/$1 \
    >"$OUTDIR/train-$1.log" 2>&1 || { echo "train $1 failed"; status=1; }
}
for dt in bf16 f32; do
  train tiny-auto-$dt $dt autograd builtin:tiny 256 10 2 3e-3
  train big-auto-$dt $dt autograd "$MODEL" "$SEQ" 10 1 1e-5
done
train tiny-expl-bf16 bf16 explicit builtin:tiny 256 10 2 3e-3
train big-expl-bf16 bf16 explicit "$MODEL" "$SEQ" 10 1 1e-5
for m in tiny big; do
  python3 "$HERE/metrics_summary.py" --within-noise $W/$m-expl-bf16/metrics.jsonl $W/$m-auto-bf16/metrics.jsonl \
    $W/$m-auto-f32/metrics.jsonl "$m: explicit bf16 losses vs f32" >>"$OUTDIR/losses.txt" || status=1
done
cat "$OUTDIR/losses.txt"
exit $status
