#!/usr/bin/env bash
# EasyContext-1M-Llama-2-7B: Llama-2-7B from 4K to 512K tokens of training context in
# seven (length, rope_theta) stages on one node of 8 GPUs, about 1M tokens per optimizer
# step in every stage as EasyContext's train_scripts/EasyContext-1M-Llama-2-7B.sh, exported
# with rope_theta 1e9 for 1M-token inference. Stages, data and optimizer: recipes/EasyContext-1M-Llama-2-7B.toml.
#
# Needs the GPU build (scripts/build_cuda.sh, `--features cuda,nccl`: target-cuda/release/longctx)
# on PATH, or LONGCTX=target-cuda/release/longctx.
# Extra arguments go to `train` and override the TOML, e.g.
#   recipes/EasyContext-1M-Llama-2-7B.sh --output-dir /data/runs/1m --resume
set -euo pipefail
cd "$(dirname "$0")/.."
LONGCTX="${LONGCTX:-longctx}"
NPROC="${NPROC:-8}"    # GPUs of this node (the TOML's world_size is 8)

# Memory per GPU of every stage, before spending GPU hours (needs only config.json):
#   "$LONGCTX" plan --config recipes/EasyContext-1M-Llama-2-7B.toml --gpu-memory 141GB

# All stages in one run: each stage starts from the previous one's weights, the
# checkpoint (every 50 steps) makes the whole run resumable (each stage starts with a
# fresh optimizer, as EasyContext's separate jobs do), and the final export
# lands in <output_dir>/export with rope_theta 1e9.
"$LONGCTX" launch --nproc-per-node "$NPROC" -- \
    train --config recipes/EasyContext-1M-Llama-2-7B.toml "$@"

# Re-export a checkpoint with another theta at any time:
#   "$LONGCTX" export runs/EasyContext-1M-Llama-2-7B -o runs/1m-theta2e9 --rope-theta 2e9
