#!/usr/bin/env bash
# tiny-cpu: the whole pipeline on a laptop CPU in well under a minute — two stages of
# growing length and rope_theta (zigzag ring, then Ulysses, over two in-process ranks),
# checkpoint, metrics and a Hugging Face export. CI runs exactly this.
# Settings: recipes/tiny-cpu.toml. Extra arguments go to `train`, e.g. --output-dir /tmp/t.
set -euo pipefail
cd "$(dirname "$0")/.."
LONGCTX="${LONGCTX:-cargo run --release --}"

# No launcher: the two ranks are threads of one process (parallel.world_size = 2).
$LONGCTX train --config recipes/tiny-cpu.toml "$@"

# Then, e.g.:  $LONGCTX inspect --model runs/tiny-cpu/export
