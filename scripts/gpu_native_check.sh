#!/usr/bin/env bash
# Issue #36 on the GPU machine: longctx's own Hopper attention (forward and backward) against
# cuDNN.
#   1. target-cuda/native_check (scripts/build_native_check.sh), when present: the kernels
#      alone against an f32 reference and cuDNN in one process;
#   2. `bench attention --check` with the three kernels (cudnn, native, auto: the CUDA kernel against the CPU kernel,
#      every parallel mode, document masks, windows);
#   3. `bench attention` side by side at 16K / 64K / 128K, 32×128 and 32/4×64 (the kernels taking turns call by call, two rounds);
#   4. a 10-step training comparison, TinyLlama-1.1B shape with 4 layers at 16K: cuDNN twice
#      and native twice (the noise floor between two runs of one kernel, for each), and
#      native against cuDNN.
# Usage: scripts/gpu_native_check.sh [BIN] (default target-cuda/release/longctx); results
# under $OUT (default /tmp/native-check), seven files (gpu, native_check, check, bench128,
# bench64, train.log with the four runs' logs, train.jsonl). Run where the system CUDA/cuDNN
# libraries are.
#
# gpu.txt also gets, per step, the SM clock and the power the GPU ran at while busy (nvidia-smi
# every 200 ms; samples above 300 W): the H200 runs these kernels at its 700 W cap, its clock
# then follows the power (and the chip's temperature), so absolute TFLOP/s move by a few
# percent between visits while the kernels' ratios, timed in turns, do not.
set -uo pipefail
BIN=${1:-target-cuda/release/longctx}
OUT=${OUT:-/tmp/native-check}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
runlog=$(mktemp) # one run's log, outside $OUT (a killed visit leaves no stray file there)
smi=$(mktemp); marks=$(mktemp)
nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active --format=csv,noheader,nounits \
    -lms 200 > "$smi" 2>/dev/null &
smi_pid=$!
trap 'kill $smi_pid 2>/dev/null; rm -f "$runlog" "$smi" "$marks"' EXIT
step() { echo "$(date +%Y/%m/%d\ %H:%M:%S.%N) $1" >> "$marks"; }
clocks() { # per step: busy samples, median SM clock, median power, hottest, clock event reasons
    kill $smi_pid 2>/dev/null; wait $smi_pid 2>/dev/null
    python3 - "$smi" "$marks" <<'PY'
import datetime, statistics, sys
parse = lambda s: datetime.datetime.strptime(s.strip()[:26], "%Y/%m/%d %H:%M:%S.%f")
marks = [(parse(l[:29]), l[30:].strip()) for l in open(sys.argv[2]) if l.strip()]
steps = {}
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        t, clk, pw, temp, why = parse(f[0]), float(f[1]), float(f[2]), float(f[3]), f[4]
    except (ValueError, IndexError):
        continue
    name = next((n for m, n in reversed(marks) if t >= m), None)
    if name and pw > 300:
        steps.setdefault(name, []).append((clk, pw, temp, why))
for name, v in steps.items():
    print(f"clock {name}: {len(v)} busy samples, SM {statistics.median(x[0] for x in v):.0f} MHz median "
          f"(min {min(x[0] for x in v):.0f}), power {statistics.median(x[1] for x in v):.0f} W median, "
          f"up to {max(x[2] for x in v):.0f} C, reasons {'/'.join(sorted(set(x[3] for x in v)))}")
PY
}
if [[ -x target-cuda/native_check ]]; then
    step native_check
    timeout 120 target-cuda/native_check 2>&1 | tee "$OUT/native_check.txt" | tail -8
fi
step check
timeout 300 "$BIN" bench attention --check 2>&1 | tee "$OUT/check.txt" | grep -E "FAIL|passed|failed" | head -20
step bench128
timeout 400 "$BIN" bench attention --seq 16384,65536,131072 2>&1 | tee "$OUT/bench128.txt" | grep -E "^\|"
step bench64
timeout 400 "$BIN" bench attention --seq 16384,65536,131072 --heads 32 --kv-heads 4 --head-dim 64 2>&1 | tee "$OUT/bench64.txt" | grep -E "^\|"
rm -f "$OUT/train.jsonl" "$OUT/train.log"
step train
for run in cudnn-a:cudnn cudnn-b:cudnn native-a:native native-b:native; do
    label=${run%%:*}; kern=${run##*:}
    timeout 120 "$BIN" train --model builtin:tinyllama-1.1b-shape@layers=4 --seq-length 16384 --rope-theta 1e6 --max-train-steps 10 \
        --batch-size 1 --device cuda --dtype bf16 --token-chunk 16384 --learning-rate 1e-4 --dataset synthetic:passkey \
        --attention-kernel "$kern" --no-save --output-dir "/tmp/native-check-$label" --overwrite -q > "$runlog" 2>&1
    rc=$?
    echo "train $label rc=$rc"
    # the four runs' logs in one file (the device tool returns at most eight files)
    { echo "== train $label rc=$rc"; cat "$runlog"; } >> "$OUT/train.log"
    python3 - "/tmp/native-check-$label/metrics.jsonl" "$label" >> "$OUT/train.jsonl" <<'PY'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if '"loss"' in l]
t = rows[1:] or rows
print(json.dumps({"label": sys.argv[2], "tokens_per_s": sum(r["tokens"] for r in t) / sum(r["seconds"] for r in t),
                  "losses": [r["loss"] for r in rows], "grad_norms": [r.get("grad_norm") for r in rows]}))
PY
    rm -rf "/tmp/native-check-$label"
done
python3 - "$OUT/train.jsonl" <<'PY'
import json, sys
r = {d["label"]: d for d in map(json.loads, open(sys.argv[1]))}
def rel(a, b, k):
    return max(abs(x - y) / abs(y) for x, y in zip(r[a][k], r[b][k]))
# two runs of one kernel differ by the order of the GPU's f32 additions (atomics, bulk
# reductions) alone: the noise floor of each kernel; native against cuDNN is the comparison
for a, b in [("cudnn-b", "cudnn-a"), ("native-b", "native-a"), ("native-a", "cudnn-a"), ("native-a", "cudnn-b"),
             ("native-b", "cudnn-a"), ("native-b", "cudnn-b")]:
    if a in r and b in r:
        print(f"{a} vs {b}: loss max rel {rel(a, b, 'losses'):.2e}, grad norm max rel {rel(a, b, 'grad_norms'):.2e}")
for k, d in r.items():
    print(f"{k}: {d['tokens_per_s']:.0f} tok/s")
PY
clocks | tee -a "$OUT/gpu.txt"
