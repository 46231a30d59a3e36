#!/usr/bin/env bash
# Runs on a machine with 2 (or more) GPUs: training over NCCL, one process per GPU,
# against one GPU.
#
# Usage: scripts/gpu_multi_check.sh [BINARY] [OUTDIR] [PHASES]   (BINARY may be a .gz)
# PHASES (comma separated, default correct,long):
#   probe    the NCCL self-test of longctx-dist-probe (collectives, stream ordering,
#            bandwidth), BINARY's directory must hold longctx-dist-probe(.gz) too;
#   correct  tiny model, 10 steps, every mode over NCCL on 2 GPUs: data_parallel (dp 2 ×
#            sp 1), zigzag ring (dp 1 × sp 2), Ulysses, USP, FPDT with offload, against
#            one GPU (sequence-parallel modes: one rank; data parallel: two in-process
#            ranks on one GPU): f32 (portable attention) within 1e-5 relative per step,
#            bf16 within 2e-3; plus a launch of more ranks than GPUs, which must fail
#            naming the rank;
#   long     TinyLlama-1.1B shape at 128K, 3 steps per mode over 2 GPUs (ring, Ulysses,
#            USP, FPDT) and one GPU: tokens/s (steps 2..), device peak;
#   scale256 the same at 256K (2 steps; layer inputs offloaded on one GPU);
#   zero     tiny model, 10 steps, f32, ZeRO stages over NCCL (data_parallel and zigzag ring,
#            stages 0, 2, 3, 3 with the weights and optimizer offloaded) against stage 1
#            as two ranks on one GPU / one GPU: within 1e-5 relative per step;
#   liveness a rank that stops taking part (LONGCTX_TEST_STALL=1@2) with --collective-timeout 10:
#            the job must fail within 60 s naming the collective (NCCL watchdog, issue 16).
# Env: NGPU (default 2); for long/scale256: MODES (default "zigzag_ring_attn ulysses_attn usp
#      fpdt"; MODE@compute runs NCCL on the compute stream, i.e. without overlap), ONE=0 skips
#      the one-GPU run (then ONE_JSONL names its metrics.jsonl from an earlier visit).
# Each big run's metrics.jsonl is copied to OUTDIR/<mode>-<seq>.jsonl.
set -uo pipefail
BIN=${1:-target-cuda/release/longctx}
OUTDIR=${2:-${OUT:-gpu-out}}
PHASES=${3:-correct,long}
NGPU=${NGPU:-2}
HERE=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$OUTDIR"
unpack() { # path -> executable path
    if [[ $1 == *.gz ]]; then local o=/tmp/$(basename "${1%.gz}"); gunzip -c "$1" >"$o" && chmod +x "$o" && echo "$o"; else echo "$1"; fi
}
PROBE=$(dirname "$BIN")/longctx-dist-probe
[[ $BIN == *.gz ]] && PROBE=$PROBE.gz
BIN=$(unpack "$BIN")
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=/tmp/gmc; mkdir -p $W
status=0
LOG=$OUTDIR/multi.txt
say() { echo "$*" | tee -a "$LOG"; }
summary() { python3 "$HERE/metrics_summary.py" "$1/metrics.jsonl" "$2" 2>&1 | tee -a "$LOG"; }
cmp() { # run ref rtol label
    python3 "$HERE/metrics_summary.py" --compare "$W/$1/metrics.jsonl" "$W/$2/metrics.jsonl" "$3" "$4" | tee -a "$LOG"
    return "${PIPESTATUS[0]}"
}
has() { [[ ",$PHASES," == *",$1,"* ]]; }
LAUNCH=("$BIN" launch --nproc-per-node "$NGPU" --master-port 0 --)

if has probe; then
    say "== probe: NCCL self-test"
    P=$(unpack "$PROBE")
    timeout 300 "$P" launch --nproc-per-node "$NGPU" --master-port 0 -- run --nccl-selftest >>"$LOG" 2>&1 || { say "FAILED: probe"; status=1; }
    grep -E "ordering|checks passed|bandwidth|GB/s|error" "$LOG" | tail -n 12
fi

if has liveness; then
    say "== liveness: a stalled rank, collective timeout 10 s"
    t0=$(date +%s)
    LONGCTX_TEST_STALL=1@2 timeout 120 "${LAUNCH[@]}" train --model builtin:tiny --dataset synthetic:passkey --seq-length 256 \
        --rope-theta 1e5 --max-train-steps 50 --batch-size 2 --device cuda --dtype bf16 --collective-timeout 10 \
        --output-dir $W/liveness >$W/liveness.txt 2>&1 && { say "FAILED: liveness: the job went on without rank 1"; status=1; }
    took=$(( $(date +%s) - t0 ))
    grep -E "did not complete within 10 s|timed out after" $W/liveness.txt | head -n 3 | tee -a "$LOG"
    if ! grep -q "did not complete within 10 s" $W/liveness.txt || (( took > 60 )); then
        say "FAILED: liveness (took ${took} s; see $W/liveness.txt)"; status=1
    else
        say "liveness: stopped after ${took} s"
    fi
fi

if has correct; then
    say "== correct: every mode over NCCL against one GPU (tiny model, 10 steps)"
    for DT in f32 bf16; do
        TOL=$([[ $DT == f32 ]] && echo 1e-5 || echo 2e-3)
        [[ $DT == f32 ]] && export LONGCTX_ATTN_FALLBACK=1 || unset LONGCTX_ATTN_FALLBACK
        TINY=(train --model builtin:tiny --dataset synthetic:passkey --seq-length 256 --rope-theta 1e5 --max-train-steps 10
              --batch-size 2 --learning-rate 1e-3 --clip-grad 1.0 --device cuda --dtype $DT)
        one() { local n=$1; shift; timeout 300 "$BIN" "${TINY[@]}" --output-dir $W/$n-$DT "$@" >>"$LOG" 2>&1 || { say "FAILED: $n $DT"; status=1; }; }
        multi() { local n=$1; shift; timeout 300 "${LAUNCH[@]}" "${TINY[@]}" --output-dir $W/$n-$DT "$@" >>"$LOG" 2>&1 || { say "FAILED: $n $DT"; status=1; }; }
        one single
        one dp-threads --world-size "$NGPU"
        multi dp-nccl
        multi ring-nccl --parallel-mode zigzag_ring_attn
        multi ulysses-nccl --parallel-mode ulysses_attn
        multi usp-nccl --parallel-mode usp
        multi usp-u2-nccl --parallel-mode usp --ulysses-size 2
        multi fpdt-nccl --parallel-mode fpdt --fpdt-chunk-size 64 --fpdt-offload
        say "-- $DT, allowed relative difference per step $TOL"
        for m in ring ulysses usp usp-u2 fpdt; do cmp $m-nccl-$DT single-$DT $TOL "$m over NCCL vs one GPU ($DT)" || status=1; done
        cmp dp-nccl-$DT dp-threads-$DT $TOL "data_parallel over NCCL vs $NGPU ranks on one GPU ($DT)" || status=1
        for r in single dp-threads dp-nccl ring-nccl usp-nccl; do say "$r $DT losses: $(python3 "$HERE/metrics_summary.py" $W/$r-$DT/metrics.jsonl --losses 2>&1)"; done
    done
    unset LONGCTX_ATTN_FALLBACK
    say "-- more ranks than GPUs"
    N=$((NGPU + 1))
    start=$(date +%s)
    if timeout 120 "$BIN" launch --nproc-per-node $N --master-port 0 -- train --model builtin:tiny --dataset synthetic:passkey \
        --seq-length 64 --max-train-steps 2 --device cuda --output-dir $W/toomany >$W/toomany.txt 2>&1; then
        say "FAILED: $N ranks on $NGPU GPUs succeeded"; status=1
    else
        say "$N ranks on $NGPU GPUs: exit after $(( $(date +%s) - start )) s: $(grep -m1 -E "cannot open cuda" $W/toomany.txt | cut -c1-300)"
        grep -q "cannot open cuda:$NGPU" $W/toomany.txt || { say "FAILED: the error does not name the missing GPU"; status=1; }
        [[ -e $W/toomany/export ]] && { say "FAILED: an export was written"; status=1; }
    fi
fi

if has zero; then
    say "== zero: ZeRO stages over NCCL against stage 1 (tiny model, 10 steps, f32)"
    export LONGCTX_ATTN_FALLBACK=1
    ZT=(train --model builtin:tiny@layers=4 --dataset synthetic:passkey --seq-length 256 --rope-theta 1e5 --max-train-steps 10
        --batch-size 2 --learning-rate 1e-3 --clip-grad 0.5 --device cuda --dtype f32)
    timeout 300 "$BIN" "${ZT[@]}" --world-size "$NGPU" --output-dir $W/z-ref-dp >>"$LOG" 2>&1 || { say "FAILED: z-ref-dp"; status=1; }
    timeout 300 "$BIN" "${ZT[@]}" --output-dir $W/z-ref-one >>"$LOG" 2>&1 || { say "FAILED: z-ref-one"; status=1; }
    for v in "0" "2" "3" "3 --offload-params --optimizer-on-host"; do
        n=z$(echo "$v" | tr -d ' -' | cut -c1-24)
        timeout 300 "${LAUNCH[@]}" "${ZT[@]}" --zero-stage $v --output-dir $W/$n-dp >>"$LOG" 2>&1 || { say "FAILED: $n dp"; status=1; }
        cmp $n-dp z-ref-dp 1e-5 "data_parallel, stage $v over NCCL vs stage 1 as $NGPU ranks on one GPU" || status=1
        timeout 300 "${LAUNCH[@]}" "${ZT[@]}" --zero-stage $v --parallel-mode zigzag_ring_attn --output-dir $W/$n-ring >>"$LOG" 2>&1 || { say "FAILED: $n ring"; status=1; }
        cmp $n-ring z-ref-one 1e-5 "zigzag ring, stage $v over NCCL vs one GPU" || status=1
    done
    grep -E "ZeRO stage [0-3] over" "$LOG" | sort | uniq -c | head -8 | tee -a "$LOG"
    unset LONGCTX_ATTN_FALLBACK
fi

big() { # phase seq steps
    local S=$2 STEPS=$3
    local COMMON=(train --model builtin:tinyllama-1.1b-shape --dataset synthetic:passkey --seq-length $S --rope-theta 1e6
                  --max-train-steps $STEPS --batch-size 1 --device cuda --dtype bf16 --token-chunk 8192 --learning-rate 1e-5)
    say "== $1: TinyLlama-1.1B shape at $S tokens, $STEPS steps"
    local OFF=()
    [[ $S -ge 262144 ]] && OFF=(--offload-activations)
    if [[ ${ONE:-1} == 1 ]]; then
        timeout 590 "$BIN" "${COMMON[@]}" "${OFF[@]}" --output-dir $W/one-$S >>"$LOG" 2>&1 || { say "FAILED: one GPU $S"; status=1; }
        summary $W/one-$S "one GPU $S"
        cp $W/one-$S/metrics.jsonl "$OUTDIR/one-$S.jsonl" 2>/dev/null
        rm -rf $W/one-$S/checkpoint $W/one-$S/export # ~15 GB each at this size: the disk fills up
    fi
    # the one-GPU reference: this run's, or ONE_JSONL (a metrics.jsonl from an earlier visit)
    local REF=$W/one-$S/metrics.jsonl
    [[ -f $REF ]] || REF=${ONE_JSONL:-$REF}
    for spec in ${MODES:-zigzag_ring_attn ulysses_attn usp fpdt}; do
        # MODE@compute: NCCL on the compute stream (nothing overlaps: what overlap hides)
        local m=${spec%@*} name=${spec/@/-} X=() E=()
        [[ $m == fpdt ]] && X=(--fpdt-chunk-size 65536 --fpdt-offload)
        [[ $spec == *@compute ]] && E=(env LONGCTX_NCCL_STREAM=compute)
        timeout 590 "${E[@]}" "${LAUNCH[@]}" "${COMMON[@]}" --parallel-mode $m "${X[@]}" --output-dir $W/$name-$S >>"$LOG" 2>&1 || { say "FAILED: $name $S"; status=1; }
        summary $W/$name-$S "$name on $NGPU GPUs $S"
        cp $W/$name-$S/metrics.jsonl "$OUTDIR/$name-$S.jsonl" 2>/dev/null
        rm -rf $W/$name-$S/checkpoint $W/$name-$S/export
        python3 - "$REF" "$W/$name-$S/metrics.jsonl" "$name" "$NGPU" <<'EOF' | tee -a "$LOG"
import json, math, sys
def rows(p):
    try: return [json.loads(l) for l in open(p)]
    except OSError: return []
one, multi, m, n = rows(sys.argv[1]), rows(sys.argv[2]), sys.argv[3], int(sys.argv[4])
tps = lambda r: sum(x["tokens"] for x in r[1:]) / max(sum(x["seconds"] for x in r[1:]), 1e-9) if len(r) > 1 else float("nan")
finite = all(math.isfinite(x["loss"]) and x.get("grad_norm") is not None and math.isfinite(x["grad_norm"]) for x in multi) and len(multi) > 0
t1, tm = tps(one), tps(multi)
print(f"{m}: {tm:.0f} tok/s on {n} GPUs vs {t1:.0f} on one: {tm / (n * t1) * 100:.0f}% of ideal ({n}x one GPU); "
      f"loss and grad norm finite on every step: {finite}")
sys.exit(0 if finite else 1)
EOF
        [[ ${PIPESTATUS[0]} == 0 ]] || status=1
    done
}
has long && big long 131072 3
has scale256 && big scale256 262144 2
nvidia-smi --query-gpu=memory.used,memory.total --format=csv >>"$LOG" 2>&1
exit $status
