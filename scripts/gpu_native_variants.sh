#!/usr/bin/env bash
# Times builds of the native attention kernels side by side on the GPU machine, in one
# process each, alternating (two rounds, so that a variant's figure is not an order effect):
# target-cuda/native_check and every target-cuda/native_check_* built by
# `scripts/build_native_check.sh --variant NAME -D...` or `--profile` (the phase clock).
# Usage: scripts/gpu_native_variants.sh [native_check ARGS...]   (default: --len 65536)
# Results under $OUT (default /tmp/native-variants), three files whatever the number of
# builds (the device tool returns at most eight): runs.txt, every run's whole output under
# a "== BUILD round N" line; summary.txt, each build's forward and backward TFLOP/s (native /
# cuDNN) per case and round, its correctness line, and the phase clock's lines of a --profile
# build; gpu.txt, with the SM clock and power each build and round ran at (scripts/gpu_clocks.py:
# these kernels run at the GPU's power cap, so a variant that draws less power runs faster). Run where the system CUDA/cuDNN libraries are (as
# scripts/gpu_native_check.sh).
set -uo pipefail
OUT=${OUT:-/tmp/native-variants}
mkdir -p "$OUT"
ARGS=("$@")
[[ ${#ARGS[@]} -gt 0 ]] || ARGS=(--len 65536)
bins=()
for b in target-cuda/native_check target-cuda/native_check_*; do
    [[ -x $b && -f $b ]] && bins+=("$b")
done
if [[ ${#bins[@]} -eq 0 ]]; then
    echo "no target-cuda/native_check*: build them with scripts/build_native_check.sh" >&2
    exit 2
fi
HERE=$(cd "$(dirname "$0")" && pwd)
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader > "$OUT/gpu.txt" 2>&1
: > "$OUT/summary.txt"
: > "$OUT/runs.txt"
run=$(mktemp); smi=$(mktemp); marks=$(mktemp)
python3 "$HERE/gpu_clocks.py" sample "$smi" 2>/dev/null &
smi_pid=$!
trap 'kill $smi_pid 2>/dev/null; rm -f "$run" "$smi" "$marks"' EXIT
status=0
for round in 1 2; do
    for b in "${bins[@]}"; do
        name=$(basename "$b")
        echo "$(date +%Y/%m/%d\ %H:%M:%S.%N) $name round $round" >> "$marks"
        timeout 200 "$b" "${ARGS[@]}" > "$run" 2>&1 || { echo "$name round $round failed (see runs.txt)" | tee -a "$OUT/summary.txt"; status=1; }
        { echo "== $name round $round"; cat "$run"; } >> "$OUT/runs.txt"
        # one line per speed case: shape, forward and backward TFLOP/s of native / cuDNN
        grep -E "^case .*TFLOP" "$run" | sed -E \
            's/^case b[0-9]+ (s[0-9]+ t[0-9]+ hq[0-9]+ hkv[0-9]+ d[0-9]+ [a-z]+) [a-z0-9]+: \| native [0-9.]+ ms ([0-9.]+) TFLOP\/s( \| cudnn [0-9.]+ ms ([0-9.]+) TFLOP\/s)?.*bwd native [0-9.]+ ms ([0-9.]+) TFLOP\/s( \| bwd cudnn [0-9.]+ ms ([0-9.]+))?.*/\1 fwd \2\/\4 bwd \5\/\7/' |
            sed "s/^/$name round $round: /" >> "$OUT/summary.txt"
        grep -E "^  phases" "$run" | sed "s/^/$name round $round:/" >> "$OUT/summary.txt"
        grep -E "^correctness" "$run" | sed "s/^/$name round $round: /" >> "$OUT/summary.txt"
    done
done
kill $smi_pid 2>/dev/null; wait $smi_pid 2>/dev/null
python3 "$HERE/gpu_clocks.py" report "$smi" "$marks" | tee -a "$OUT/gpu.txt" >> "$OUT/summary.txt"
cat "$OUT/summary.txt"
exit $status
