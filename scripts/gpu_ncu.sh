#!/usr/bin/env bash
# Hardware counters of the attention kernels, native and cuDNN, on the GPU machine: Nsight
# Compute (ncu, in the device image; it reads the counters on the Firecracker machines, not
# under gVisor) over one warm call of each kernel of native_check's speed cases
# (`native_check --ncu`: the calls inside cudaProfilerStart/Stop).
# Usage: scripts/gpu_ncu.sh [BIN [native_check ARGS...]]
#        (default target-cuda/native_check --len 65536 --normal)
# Results under $OUT (default /tmp/ncu):
#   attn.ncu-rep.xz  the report (ncu -i to read it; ncu-ui shows it)
#   details.txt      every section of every profiled kernel (throughputs, pipes, stalls, ...)
#   metrics.csv      the chosen counters, a row per kernel (the table printed last)
#   sass_*.csv       per-instruction SASS with sampled warp stalls, for the native kernels
# The clocks are left as the GPU sets them (--clock-control none), as the timed runs see them.
set -uo pipefail
OUT=${OUT:-/tmp/ncu}
mkdir -p "$OUT"
BIN=${1:-target-cuda/native_check}
shift || true
ARGS=("$@")
[[ ${#ARGS[@]} -gt 0 ]] || ARGS=(--len 65536 --normal)
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda*/bin/ncu 2>/dev/null | head -n1)
if [[ -z $NCU || ! -x $NCU ]]; then echo "gpu_ncu: no ncu on this machine" >&2; exit 2; fi
if [[ ! -x $BIN ]]; then echo "gpu_ncu: $BIN missing: build it with scripts/build_native_check.sh" >&2; exit 2; fi
"$NCU" --version | tail -n1 | tee "$OUT/ncu_version.txt"
nvidia-smi --query-gpu=name,driver_version,power.limit --format=csv,noheader | tee -a "$OUT/ncu_version.txt"
rep=$OUT/attn
"$NCU" --clock-control none --profile-from-start off --set full --import-source no -f -o "$rep" \
    "$BIN" "${ARGS[@]}" --ncu > "$OUT/run.txt" 2>&1
rc=$?
tail -n 30 "$OUT/run.txt"
[[ -f $rep.ncu-rep ]] || { echo "gpu_ncu: ncu wrote no report (exit $rc)" >&2; exit 1; }
"$NCU" -i "$rep.ncu-rep" --page details --print-units base > "$OUT/details.txt" 2>&1
# one row per kernel: time, SM and tensor-pipe activity, shared-memory traffic of ordinary
# loads and stores (wgmma's operand reads are not in l1tex__data_pipe_lsu), issue picture,
# L2 traffic (bytes, reduction sectors, throughput as a share of peak) and DRAM bytes
METRICS=gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__throughput.avg.pct_of_peak_sustained_elapsed
METRICS+=,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active
METRICS+=,sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active
METRICS+=,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum.pct_of_peak_sustained_elapsed
METRICS+=,l1tex__data_bank_conflicts_pipe_lsu_mem_shared.sum
METRICS+=,sm__inst_executed_pipe_xu.avg.pct_of_peak_sustained_active
METRICS+=,sm__inst_executed_pipe_fma.avg.pct_of_peak_sustained_active
METRICS+=,sm__inst_executed_pipe_alu.avg.pct_of_peak_sustained_active
METRICS+=,sm__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.per_cycle_active
METRICS+=,lts__t_sectors_op_red.sum,dram__bytes.sum.per_second,lts__t_bytes.sum.per_second
METRICS+=,lts__throughput.avg.pct_of_peak_sustained_elapsed,lts__t_sectors.avg.pct_of_peak_sustained_elapsed
"$NCU" -i "$rep.ncu-rep" --page raw --csv --metrics "$METRICS" > "$OUT/metrics.csv" 2>&1
for k in bwd_kernel fwd_kernel; do
    "$NCU" -i "$rep.ncu-rep" --page source --csv --print-source sass -k "regex:$k" > "$OUT/sass_$k.csv" 2>&1 ||
        echo "gpu_ncu: no source page for $k (see sass_$k.csv)"
done
xz -T0 -6 -f "$rep.ncu-rep"
ls -la "$OUT"
python3 - "$OUT/metrics.csv" <<'EOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
hdr = next((i for i, r in enumerate(rows) if "Kernel Name" in r), None)
if hdr is None:
    print(open(sys.argv[1]).read()[:3000]); sys.exit()
names = rows[hdr]
for r in rows[hdr + 2:]:
    d = dict(zip(names, r))
    print("==", d.get("Kernel Name", "?")[:110], "grid", d.get("Grid Size", "?"))
    for n in names:
        if "__" in n:
            print(f"   {n}: {d.get(n)}")
EOF
exit $rc
