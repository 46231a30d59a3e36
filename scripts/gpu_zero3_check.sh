#!/usr/bin/env bash
# One H200: the Llama-2-7B shape trained as EasyContext's zero3_offload.json asks
# (ZeRO-3, weights and optimizer state in host memory), one case after another:
#   bench     `bench optimizer` on every core (the host AdamW pass, scaled to 7B)
#   64k       64K tokens, 5 steps (step 1 has no update to overlap; 2 allocates its pinned buffers), layer inputs on the GPU, attention recomputed
#   64k-again the same once more (run-to-run spread of the losses: see SAME_LOSSES)
#   64k-saved the same with the attention kept from the forward (--save-attention)
#   256k      256K tokens in one sequence, 1 step
#   64k-grads the 64k case with each layer's gradient in host memory (--offload-gradients;
#             its losses must equal 64k's: SAME_LOSSES="64k 64k-grads"); fits an 80 GB GPU
#   64k-grads-mlp14  --offload-gradients with the attention and 14 layers' MLP saved (H200)
# The cost of each offload, 64K, 3 steps each (step 3 is the steady state):
#   64k-weights-gpu   ZeRO-3 with the optimizer on the host, the weights kept on the GPU
#   64k-all-gpu       nothing of the model on the host (stage 0, AdamW on the GPU); the layer
#                     inputs go to the host instead (--offload-activations), else it does not fit
# For each training case: seconds from start to the first logged step, the start-up part
# of it (that minus the first step), every step's time, tokens/s, MFU and loss, the device
# peak, the process's peak RSS, and `plan`'s prediction. The process is stopped once its
# last step is logged (a 7B checkpoint is 95 GB; the machine's disk is 64 GB).
# Every 5 s the process CPU, RSS, GPU use and host MemAvailable go to OUTDIR/NAME.mon.
# Each result is appended to OUTDIR/summary.txt as soon as it exists.
# Usage: scripts/gpu_zero3_check.sh BINARY(.gz) OUTDIR [CASES]
# Env: RUN_LIMIT (default 400): seconds after which a training case is stopped, logged as such;
#      STEPS: steps of the 64k and 64k-again cases (default 5);
#      SAME_LOSSES (case names), LOSS_TOL: assert those cases' per-step losses agree (see the end).
# Exit status: 1 when the SAME_LOSSES check fails, else 0.
set -uo pipefail
BIN=$1; OUTDIR=$2; CASES=${3:-"bench 64k 64k-weights-gpu 256k"}; mkdir -p "$OUTDIR"
# By default the deferred update (64k) is checked against the update applied at once
# (64k-weights-gpu) whenever both run.
if [ -z "${SAME_LOSSES:-}" ] && [[ " $CASES " == *" 64k "* && " $CASES " == *" 64k-weights-gpu "* ]]; then
  SAME_LOSSES="64k 64k-weights-gpu"
fi
if [[ $BIN == *.gz ]]; then gunzip -c "$BIN" > /tmp/longctx-z3 && chmod +x /tmp/longctx-z3 && BIN=/tmp/longctx-z3; fi
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
S=$OUTDIR/summary.txt
echo "cores $(nproc); $(free -g | awk '/Mem:/ {print $2 " GiB host memory, " $7 " GiB available"}')" >> "$S"
# TRACE=1 adds train.trace (a line per layer and phase; it waits for the GPU at each, so
# the host update no longer overlaps the forward: for finding a stall, not for timing).
printf '[train]\nprofile = true\ntrace = %s\n' "$( [ "${TRACE:-0}" = 1 ] && echo true || echo false )" > /tmp/z3-prof.toml
M=builtin:llama2-7b-shape
ZERO=(--zero-stage 3 --offload-params --optimizer-on-host)
run7b() { # name seq steps flags... (the ZeRO flags included)
  local name=$1 seq=$2 steps=$3; shift 3
  local W=/tmp/z3-$name; rm -rf "$W"
  "$BIN" plan --model $M --seq-length "$seq" --dtype bf16 "$@" > "$OUTDIR/plan-$name.txt" 2>&1
  grep -E "^  peak  |^  host" "$OUTDIR/plan-$name.txt" | sed "s/^/$name plan: /" >> "$S"
  local t0; t0=$(date +%s.%N)
  "$BIN" train --config /tmp/z3-prof.toml --model $M --dataset synthetic:passkey --device cuda --dtype bf16 \
    --seq-length "$seq" --rope-theta 1e6 --max-train-steps "$steps" --batch-size 1 --learning-rate 1e-5 \
    --output-dir "$W" --skip-memory-check "$@" > "$OUTDIR/$name.log" 2>&1 &
  local pid=$! first="" hwm=0 n=0 ready=""
  while kill -0 $pid 2>/dev/null; do
    if [ "$(python3 -c "import time; print(int(time.time()-$t0))")" -ge "${RUN_LIMIT:-400}" ]; then
      echo "$name: stopped after RUN_LIMIT=${RUN_LIMIT:-400} s with $n step(s) logged" >> "$S"; kill $pid 2>/dev/null; break
    fi
    if [ -z "$ready" ] && grep -q "^stage 0:" "$OUTDIR/$name.log" 2>/dev/null; then
      ready=$(python3 -c "import time; print(round(time.time()-$t0, 1))"); echo "$name: stage header (start-up done) after $ready s" >> "$S"
    fi
    local h; h=$(awk '/VmHWM/ {print $2}' /proc/$pid/status 2>/dev/null || echo 0); [ -n "$h" ] && [ "$h" -gt "$hwm" ] && hwm=$h
    if [ -s "$W/metrics.jsonl" ]; then
      n=$(grep -c '"loss"' "$W/metrics.jsonl" || true)
      if [ -z "$first" ] && [ "$n" -ge 1 ]; then first=$(python3 -c "import time; print(round(time.time()-$t0, 1))"); fi
      if [ "$n" -ge "$steps" ]; then sleep 1; kill $pid 2>/dev/null; break; fi
    fi
    if [ $(( ${SECONDS} % 5 )) -eq 0 ]; then
      echo "t=$(python3 -c "import time; print(round(time.time()-$t0))") cpu=$(ps -o %cpu= -p $pid) rss_kb=$(ps -o rss= -p $pid) gpu=$(nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null) $(grep -E '^(MemAvailable|Dirty)' /proc/meminfo | tr -s ' ' | tr '\n' ' ')" >> "$OUTDIR/$name.mon"
    fi
    sleep 0.5
  done
  # The stop signal asks for a checkpoint (95 GB for 7B, more than this disk): a second
  # signal, then a kill, if it has not ended within 15 s.
  for _ in $(seq 30); do kill -0 $pid 2>/dev/null || break; sleep 0.5; done
  kill $pid 2>/dev/null; sleep 2; kill -9 $pid 2>/dev/null
  wait $pid 2>/dev/null
  cp "$W/metrics.jsonl" "$OUTDIR/$name.jsonl" 2>/dev/null
  echo "$name: first step logged ${first:-never} s after start; peak RSS $((hwm / 1024 / 1024)) GiB" >> "$S"
  grep -E "ZeRO stage|start-up|error|Error|panicked" "$OUTDIR/$name.log" | head -5 | sed "s/^/$name log: /" >> "$S"
  grep -E "^trace +[0-9]" "$OUTDIR/$name.log" | tail -4 | sed "s/^/$name last trace: /" >> "$S"
  python3 - "$W/metrics.jsonl" "$name" "${first:-0}" >> "$S" 2>&1 <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
for i, r in enumerate(rows):
    prof = r.get("profile") or {}
    print(sys.argv[2], "step", r["step"], "s", round(r["seconds"], 2), "engine s", round(r.get("engine_seconds", 0), 2),
          "tok/s", round(r.get("tokens_per_s") or 0), "mfu", r.get("mfu"), "loss", round(r["loss"], 4),
          "device peak GB", round((r.get("device_peak_bytes") or 0) / 1e9, 2),
          "profile", {k: round(v, 3) for k, v in prof.items() if isinstance(v, (int, float))})
if rows:
    print(sys.argv[2], "start-up s (first logged minus first step):", round(float(sys.argv[3]) - rows[0]["seconds"], 1))
PY
}
for c in $CASES; do
  case $c in
    bench) timeout 120 "$BIN" bench optimizer --params 2e9 --iters 2 >> "$S" 2>&1;;
    64k) run7b 64k 65536 "${STEPS:-5}" --token-chunk 8192 "${ZERO[@]}";;
    64k-again) run7b 64k-again 65536 "${STEPS:-5}" --token-chunk 8192 "${ZERO[@]}";;
    64k-saved) run7b 64k-saved 65536 5 --token-chunk 8192 --save-attention "${ZERO[@]}";;
    256k) run7b 256k 262144 1 --token-chunk 8192 "${ZERO[@]}";;
    64k-grads) run7b 64k-grads 65536 "${STEPS:-5}" --token-chunk 8192 "${ZERO[@]}" --offload-gradients;;
    64k-grads-mlp14) run7b 64k-grads-mlp14 65536 "${STEPS:-5}" --token-chunk 8192 --save-attention --save-mlp-layers 14 "${ZERO[@]}" --offload-gradients;;
    64k-weights-gpu) run7b 64k-weights-gpu 65536 3 --token-chunk 8192 --zero-stage 3 --optimizer-on-host;;
    64k-all-gpu) run7b 64k-all-gpu 65536 3 --token-chunk 8192 --zero-stage 0 --offload-activations;;
    *) echo "unknown case $c" >> "$S";;
  esac
done
# SAME_LOSSES="a b ...": these cases compute the same update (the host AdamW equals the
# device kernel bit for bit), so every step's loss must agree across them within LOSS_TOL
# (relative, default 5e-3). Not 0: two runs of one configuration on the H200 differ (8.5e-5
# at step 2, 7.4e-5 at step 3 of 64K; some GPU reduction runs in a varying order), while
# the race fixed in 31b4953 (gradient pieces read before their copy) moved them by 2.7e-2
# at step 2 and 5.7e-2 at step 3.
if [ -n "${SAME_LOSSES:-}" ]; then
  python3 - "$OUTDIR" "${LOSS_TOL:-5e-3}" $SAME_LOSSES >> "$S" 2>&1 <<'PY'
import json, sys, os
out, tol, names = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
runs = {}
for n in names:
    p = os.path.join(out, n + ".jsonl")
    runs[n] = {r["step"]: r["loss"] for r in (json.loads(l) for l in open(p)) if "loss" in r} if os.path.exists(p) else {}
steps = sorted(set.intersection(*(set(r) for r in runs.values()))) if runs else []
worst = 0.0
for s in steps:
    ls = [runs[n][s] for n in names]
    worst = max(worst, (max(ls) - min(ls)) / max(abs(min(ls)), 1e-30))
ok = len(steps) >= 2 and worst <= tol
print("same losses", " / ".join(names), ":", "ok" if ok else "FAIL", f"({len(steps)} common steps, worst relative difference {worst:.2e}, allowed {tol:.0e})")
for s in steps:
    print("  step", s, {n: runs[n][s] for n in names})
sys.exit(0 if ok else 1)
PY
  same=$?
fi
cat "$S"
exit "${same:-0}"
