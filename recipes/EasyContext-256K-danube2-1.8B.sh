#!/usr/bin/env bash
# EasyContext-256K-danube2-1.8B: H2O Danube2 1.8B from 8K to 256K tokens in nine
# (length, rope_theta) stages as EasyContext's train_scripts/EasyContext-256K-danube2.sh:
# data parallel up to 32K, then zigzag ring attention over 8 GPUs of one node.
# Stages, data and optimizer: recipes/EasyContext-256K-danube2-1.8B.toml.
#
# Needs the GPU build (scripts/build_cuda.sh, `--features cuda,nccl`: target-cuda/release/longctx)
# on PATH, or LONGCTX=target-cuda/release/longctx.
# Extra arguments go to `train` and override the TOML.
set -euo pipefail
cd "$(dirname "$0")/.."
LONGCTX="${LONGCTX:-longctx}"
NPROC="${NPROC:-8}"

# Memory per GPU of every stage:
#   "$LONGCTX" plan --config recipes/EasyContext-256K-danube2-1.8B.toml

"$LONGCTX" launch --nproc-per-node "$NPROC" -- \
    train --config recipes/EasyContext-256K-danube2-1.8B.toml "$@"
