#!/usr/bin/env bash
# One H200: the host AdamW pass on every core (`bench optimizer`, scaled to 7B) and the
# Llama-2-7B shape's time to its first step and its step time at 8K tokens (optimizer on
# the GPU, layer inputs offloaded), then the same with `--optimizer-on-host`.
# Each result is appended to OUTDIR/summary.txt as soon as it exists (a run cut off by the
# device's time limit still returns what finished).
# Usage: scripts/gpu_host_optim_check.sh BINARY(.gz) OUTDIR [SEQ]
set -uo pipefail
BIN=$1; OUTDIR=$2; SEQ=${3:-8192}; mkdir -p "$OUTDIR"
if [[ $BIN == *.gz ]]; then gunzip -c "$BIN" > /tmp/longctx-ho && chmod +x /tmp/longctx-ho && BIN=/tmp/longctx-ho; fi
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
S=$OUTDIR/summary.txt
echo "cores $(nproc); $(free -g | awk '/Mem:/ {print $2 " GiB host memory"}')" >> "$S"
timeout 60 "$BIN" bench optimizer --params 2e9 --iters 2 >> "$S" 2>&1
run7b() { # name extra-flags...
  local name=$1; shift
  local W=/tmp/ho-$name; rm -rf "$W"
  local t0; t0=$(date +%s.%N)
  timeout 300 "$BIN" train --model builtin:llama2-7b-shape --dataset synthetic:passkey --device cuda --dtype bf16 \
    --seq-length "$SEQ" --rope-theta 1e6 --max-train-steps 3 --batch-size 1 --learning-rate 1e-5 --offload-activations \
    --token-chunk 4096 --output-dir "$W" "$@" > "$OUTDIR/$name.log" 2>&1 &
  local pid=$! first=""
  while kill -0 $pid 2>/dev/null; do
    if [ -z "$first" ] && [ -s "$W/metrics.jsonl" ]; then first=$(python3 -c "import time; print(round(time.time()-$t0, 1))"); fi
    sleep 0.5
  done
  echo "$name: first step logged after ${first:-none} s from start" >> "$S"
  python3 - "$W/metrics.jsonl" "$name" >> "$S" 2>&1 <<'PY'
import json, sys
for l in open(sys.argv[1]):
    r = json.loads(l)
    print(sys.argv[2], "step", r["step"], "s", round(r["seconds"], 2), "engine s", round(r.get("engine_seconds", 0), 2),
          "loss", round(r["loss"], 4), "device peak GB", round((r.get("device_peak_bytes") or 0) / 1e9, 2))
PY
}
run7b device-optimizer
run7b host-optimizer --optimizer-on-host
cat "$S"
