#!/usr/bin/env bash
# FPDT-256K-6.7B: a 6.7B Llama at 256K tokens on 4 GPUs with FPDT (Ulysses-Offload):
# sequence-parallel 4, 65536-token chunks, kv chunks and activations in host memory.
# Settings: recipes/FPDT-256K-6.7B.toml.
#
# Needs the GPU build (scripts/build_cuda.sh, `--features cuda,nccl`: target-cuda/release/longctx)
# on PATH, or LONGCTX=target-cuda/release/longctx.
# Extra arguments go to `train` and override the TOML, e.g. --fpdt-chunk-size 32768.
set -euo pipefail
cd "$(dirname "$0")/.."
LONGCTX="${LONGCTX:-longctx}"

# Memory per GPU, and the largest chunk size that fits:
#   "$LONGCTX" plan --config recipes/FPDT-256K-6.7B.toml

"$LONGCTX" launch --nproc-per-node 4 -- \
    train --config recipes/FPDT-256K-6.7B.toml "$@"
