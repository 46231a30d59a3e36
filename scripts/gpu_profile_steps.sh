#!/usr/bin/env bash
# Step profiles (train.profile = true: seconds per phase from CUDA events, metrics.jsonl's
# `profile`) of the two shapes the end-to-end comparisons run, with the comparison's flags:
#   7b    builtin:llama2-7b-shape, ZeRO-3, weights and optimizer on the host, attention saved,
#         --token-chunk 8192 (needs an H200: about 111 GiB on the device at 64K);
#   tiny  builtin:tinyllama-1.1b-shape, attention and MLP saved, --token-chunk 16384.
# Usage: scripts/gpu_profile_steps.sh [BINARY] [OUTDIR] [SEQ] [SHAPES]
#   BINARY default target-cuda/release/longctx (a .xz is unpacked first); OUTDIR default
#   $OUT; SEQ default 65536; SHAPES default "7b tiny". Writes LABEL.log,
#   LABEL-metrics.jsonl and a table of the steady steps' phases (profile.md).
# Env: TOKEN_CHUNK overrides both shapes' token chunk; EXTRA_FLAGS are appended to `train`
#   (e.g. "--save-mlp-layers 6"); TAG is appended to the shape in the output names; LAYERS
#   cuts both shapes to that many decoder layers (`@layers=N`: the 7B shape's per-layer
#   work and host traffic at 64K on an 80 GB GPU, e.g. LAYERS=16).
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-target-cuda/release/longctx}
OUTDIR=${2:-${OUT:-profile-out}}
SEQ=${3:-65536}
SHAPES=${4:-7b tiny}
mkdir -p "$OUTDIR"
if [[ $BIN == *.xz ]]; then xz -dc "$BIN" > /tmp/longctx-prof && chmod +x /tmp/longctx-prof && BIN=/tmp/longctx-prof; fi
OUR_LD=${LONGCTX_LD_LIBRARY_PATH:-/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
CFG=$(mktemp /tmp/profile-XXXX.toml)
printf '[train]\nprofile = true\n' > "$CFG"
status=0
for shape in $SHAPES; do
    case $shape in
        7b) model=builtin:llama2-7b-shape${LAYERS:+@layers=$LAYERS} steps=4 chunk=${TOKEN_CHUNK:-8192}
            flags=(--zero-stage 3 --offload-params --optimizer-on-host --skip-memory-check --save-attention);;
        tiny) model=builtin:tinyllama-1.1b-shape${LAYERS:+@layers=$LAYERS} steps=3 chunk=${TOKEN_CHUNK:-16384} flags=(--save-attention --save-mlp);;
        *) echo "SHAPES: expected 7b and/or tiny, got $shape" >&2; exit 2;;
    esac
    # shellcheck disable=SC2206
    flags+=(${EXTRA_FLAGS:-})
    name=$shape${TAG:-}
    run=/tmp/profile-$name; rm -rf "$run"
    LD_LIBRARY_PATH=$OUR_LD timeout 420 "$BIN" train --config "$CFG" --model "$model" --dataset synthetic:passkey \
        --seq-length "$SEQ" --rope-theta 1e6 --max-train-steps "$steps" --batch-size 1 --device cuda --dtype bf16 \
        --token-chunk "$chunk" --learning-rate 1e-5 --no-save --output-dir "$run" "${flags[@]}" \
        >"$OUTDIR/$name.log" 2>&1 || { echo "$name failed (see $name.log)"; status=1; }
    cp "$run/metrics.jsonl" "$OUTDIR/$name-metrics.jsonl" 2>/dev/null || status=1
done
python3 - "$OUTDIR" $(for s in $SHAPES; do echo "$s${TAG:-}"; done) <<'EOF' | tee -a "$OUTDIR/profile.md"
import json, os, sys
out = sys.argv[1]
for shape in sys.argv[2:]:
    p = os.path.join(out, f"{shape}-metrics.jsonl")
    if not os.path.exists(p):
        continue
    rows = [json.loads(l) for l in open(p)]
    steady = rows[1:] or rows  # the first step allocates and warms up
    phases = list(steady[0].get("profile", {}))
    print(f"{shape}: steps {[round(r['seconds'], 3) for r in rows]}")
    print("| phase | " + " | ".join(f"step {i + 2}" for i in range(len(steady))) + " |")
    print("|---|" + "---|" * len(steady))
    for ph in phases:
        print(f"| {ph} | " + " | ".join(f"{r['profile'][ph]:.3f}" for r in steady) + " |")
    print()
EOF
rm -f "$CFG"
exit $status
