#!/usr/bin/env bash
# Issue #36 on the GPU machine: longctx's own Hopper attention (forward and backward) against
# cuDNN.
#   1. target-cuda/native_check (scripts/build_native_check.sh), when present: the kernels
#      alone against an f32 reference and cuDNN in one process;
#   2. `bench attention --check` with the three kernels (cudnn, native, auto: the CUDA kernel against the CPU kernel,
#      every parallel mode, document masks, windows);
#   3. `bench attention` side by side at 16K / 64K / 128K (env SEQS, comma-separated), 32×128 and 32/4×64 (the kernels taking turns call by call, two rounds);
#   4. a 10-step training comparison, TinyLlama-1.1B shape with 4 layers at 16K: cuDNN twice
#      and native twice (the noise floor between two runs of one kernel, for each), and
#      native against cuDNN: for the losses and for the gradient norms, the median over the
#      four native/cuDNN pairs of their largest relative difference over the steps must be at
#      most twice the larger of the two floors (floors below 1e-4 count as 1e-4: two
#      bit-identical runs do not make bf16 rounding a failure). With two runs per kernel a
#      floor is one draw of the run-to-run noise, so the median pair, not the worst of four,
#      stands against it.
# Exit status 1 when a step fails (native_check, the checks, a benchmark or a training run
# exiting non-zero, or the training comparison outside the noise).
# Usage: scripts/gpu_native_check.sh [BIN] (default target-cuda/release/longctx); results
# under $OUT (default /tmp/native-check), seven files (gpu, native_check, check, bench128,
# bench64, train.log with the four runs' logs, train.jsonl). Run where the system CUDA/cuDNN
# libraries are.
#
# gpu.txt also gets, per step, the SM clock and the power the GPU ran at while busy (nvidia-smi
# every 200 ms; samples above 300 W; scripts/gpu_clocks.py): the H200 runs these kernels at its 700 W cap, its clock
# then follows the power (and the chip's temperature), so absolute TFLOP/s move by a few
# percent between visits while the kernels' ratios, timed in turns, do not.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-target-cuda/release/longctx}
OUT=${OUT:-/tmp/native-check}
SEQS=${SEQS:-16384,65536,131072}  # the benches' sequence lengths (a shorter visit: SEQS=65536)
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee "$OUT/gpu.txt"
runlog=$(mktemp) # one run's log, outside $OUT (a killed visit leaves no stray file there)
smi=$(mktemp); marks=$(mktemp)
python3 "$HERE/gpu_clocks.py" sample "$smi" 2>/dev/null &
smi_pid=$!
trap 'kill $smi_pid 2>/dev/null; rm -f "$runlog" "$smi" "$marks"' EXIT
step() { echo "$(date +%Y/%m/%d\ %H:%M:%S.%N) $1" >> "$marks"; }
clocks() { # per step: busy samples, median SM clock, median power, hottest, clock event reasons
    kill $smi_pid 2>/dev/null; wait $smi_pid 2>/dev/null
    python3 "$HERE/gpu_clocks.py" report "$smi" "$marks"
}
status=0
# run NAME OUTFILE FILTER CMD...: the command's output into OUTFILE, the lines matching FILTER
# shown, a non-zero exit recorded
run() {
    local name=$1 file=$2 filter=$3; shift 3
    step "$name"
    "$@" > "$file" 2>&1
    local rc=$?
    grep -E "$filter" "$file" | head -40
    if [[ $rc -ne 0 ]]; then echo "$name FAILED (exit $rc, see $(basename "$file"))"; status=1; fi
}
if [[ -x target-cuda/native_check ]]; then
    run native_check "$OUT/native_check.txt" "correctness|FAIL|TFLOP" timeout 120 target-cuda/native_check
fi
run check "$OUT/check.txt" "FAIL|passed|failed" timeout 300 "$BIN" bench attention --check
run bench128 "$OUT/bench128.txt" "^\|" timeout 400 "$BIN" bench attention --seq "$SEQS"
run bench64 "$OUT/bench64.txt" "^\|" timeout 400 "$BIN" bench attention --seq "$SEQS" --heads 32 --kv-heads 4 --head-dim 64
rm -f "$OUT/train.jsonl" "$OUT/train.log"
step train
for pair in cudnn-a:cudnn cudnn-b:cudnn native-a:native native-b:native; do
    label=${pair%%:*}; kern=${pair##*:}
    timeout 120 "$BIN" train --model builtin:tinyllama-1.1b-shape@layers=4 --seq-length 16384 --rope-theta 1e6 --max-train-steps 10 \
        --batch-size 1 --device cuda --dtype bf16 --token-chunk 16384 --learning-rate 1e-4 --dataset synthetic:passkey \
        --attention-kernel "$kern" --no-save --output-dir "/tmp/native-check-$label" --overwrite -q > "$runlog" 2>&1
    rc=$?
    echo "train $label rc=$rc"
    [[ $rc -eq 0 ]] || status=1
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
python3 - "$OUT/train.jsonl" <<'PY' || status=1
import json, statistics, sys
r = {d["label"]: d for d in map(json.loads, open(sys.argv[1]))}
def rel(a, b, k):
    return max(abs(x - y) / abs(y) for x, y in zip(r[a][k], r[b][k]))
# two runs of one kernel differ by the order of the GPU's f32 additions (atomics, bulk
# reductions) alone: the noise floor of each kernel; native against cuDNN is the comparison
floors, cross = [("cudnn-b", "cudnn-a"), ("native-b", "native-a")], [("native-a", "cudnn-a"), ("native-a", "cudnn-b"),
                                                                     ("native-b", "cudnn-a"), ("native-b", "cudnn-b")]
for a, b in floors + cross:
    if a in r and b in r:
        print(f"{a} vs {b}: loss max rel {rel(a, b, 'losses'):.2e}, grad norm max rel {rel(a, b, 'grad_norms'):.2e}")
for k, d in r.items():
    print(f"{k}: {d['tokens_per_s']:.0f} tok/s")
missing = sorted({x for pair in floors + cross for x in pair} - r.keys())
if missing:
    sys.exit(f"training comparison: FAIL, no result for {', '.join(missing)}")
ok = True
for k, what in [("losses", "loss"), ("grad_norms", "grad norm")]:
    floor = max(1e-4, *(rel(a, b, k) for a, b in floors))
    mid = statistics.median(rel(a, b, k) for a, b in cross)
    good = mid <= 2 * floor
    ok &= good
    print(f"training comparison, {what}: native against cuDNN {mid:.2e} (median pair) against twice the larger floor "
          f"{2 * floor:.2e}: {'ok' if good else 'FAIL'}")
sys.exit(0 if ok else 1)
PY
clocks | tee -a "$OUT/gpu.txt"
[[ $status -eq 0 ]] && echo "gpu_native_check: every step passed" || echo "gpu_native_check: FAILED (see above)"
exit $status
