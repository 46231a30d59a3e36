#!/usr/bin/env bash
# One H200: one training step of the TinyLlama-1.1B shape (bf16, activations offloaded,
# optimizer on the GPU) at long lengths, each beside `longctx plan`'s prediction of its
# device peak (the CUDA pool's high-water mark, from metrics.jsonl) and host need:
#   64K, 256K and 512K with all 22 layers; 1M with the shape cut to 2 layers (the
#   per-layer peak is what matters; 22 layers at 1M take about a quarter of an hour);
#   and `plan` alone for 22 layers at 1M.
# The check fails when a step fails or a prediction is off by more than 10 %.
# Usage: scripts/gpu_long_check.sh BINARY(.gz) OUTDIR [CASES]   CASES: e.g. "64k 256k 512k 1m2l"
set -uo pipefail
BIN=$1; OUTDIR=$2; CASES=${3:-"64k 256k 512k 1m2l"}; mkdir -p "$OUTDIR"
if [[ $BIN == *.gz ]]; then gunzip -c "$BIN" > /tmp/longctx-long && chmod +x /tmp/longctx-long && BIN=/tmp/longctx-long; fi
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=/tmp/glc; rm -rf $W; mkdir -p $W
M=builtin:tinyllama-1.1b-shape
COMMON=(--dtype bf16 --offload-activations --token-chunk 8192)
RES=$OUTDIR/long.jsonl; : > "$RES"
status=0
"$BIN" plan --model $M --seq-length 1048576 "${COMMON[@]}" --optimizer-on-device --json > "$OUTDIR/plan-1m-22l.json" 2>&1 || status=1
for c in $CASES; do
  case $c in
    64k) model=$M; seq=65536;; 256k) model=$M; seq=262144;; 512k) model=$M; seq=524288;;
    1m2l) model=$M@layers=2; seq=1048576;; *) echo "unknown case $c"; exit 2;;
  esac
  "$BIN" plan --model "$model" --seq-length $seq "${COMMON[@]}" --optimizer-on-device --json > "$W/plan-$c.json" 2>"$OUTDIR/plan-$c.err" || status=1
  t0=$(date +%s)
  timeout 420 "$BIN" train --model "$model" --dataset synthetic:passkey --seq-length $seq --rope-theta 1e7 --max-train-steps 1 \
    --batch-size 1 --learning-rate 1e-5 --device cuda "${COMMON[@]}" --output-dir $W/$c > "$OUTDIR/train-$c.log" 2>&1 \
    || { echo "train $c failed (see train-$c.log)"; status=1; }
  python3 - "$W/plan-$c.json" "$W/$c/metrics.jsonl" "$c" "$(( $(date +%s) - t0 ))" >>"$RES" <<'PY' || status=1
import json, sys
plan = json.load(open(sys.argv[1]))["estimate"]
try:
    row = [json.loads(l) for l in open(sys.argv[2])][-1]
except (OSError, IndexError, ValueError):
    row = {}
pred, meas = plan["device"]["peak"], row.get("device_peak_bytes")
err = (pred - meas) / meas if meas else None
print(json.dumps({"case": sys.argv[3], "wall_s": int(sys.argv[4]), "step_s": row.get("seconds"), "loss": row.get("loss"),
                  "tokens_per_s": row.get("tokens_per_s"), "mfu": row.get("mfu"), "predicted_peak_gb": pred / 1e9,
                  "measured_peak_gb": meas / 1e9 if meas else None, "error": err,
                  "host_need_gb": plan["host"]["per_rank"] / 1e9}))
sys.exit(0 if err is not None and abs(err) <= 0.10 and row.get("loss") == row.get("loss") else 1)
PY
  tail -1 "$RES"
done
exit $status
