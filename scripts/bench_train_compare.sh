#!/usr/bin/env bash
# One GPU, both sides one after the other in the same session: `longctx train` on the
# TinyLlama-1.1B shape (random weights, bf16) and the transformers peer
# (scripts/bench_train_torch.py: SDPA, gradient checkpointing, fused AdamW), then a table
# of tokens/s, MFU, device peak and the ratio longctx / transformers.
# Usage: scripts/bench_train_compare.sh [BINARY] [OUTDIR] [SEQS] [STEPS]   (BINARY may be a .gz)
#   SEQS default 16384,65536; STEPS default 4 (the first step of each side is not timed).
# Extra longctx flags: LONGCTX_FLAGS="--config x.toml ..." (appended to `train`); TOKEN_CHUNK
# (default 8192) sets --token-chunk.
set -uo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
BIN=${1:-target-cuda/release/longctx}
OUTDIR=${2:-${OUT:-bench-out}}
SEQS=${3:-16384,65536}
STEPS=${4:-4}
mkdir -p "$OUTDIR"
if [[ $BIN == *.gz ]]; then gunzip -c "$BIN" > /tmp/longctx && chmod +x /tmp/longctx && BIN=/tmp/longctx; fi
export LD_LIBRARY_PATH=/usr/local/cuda-13.0/targets/x86_64-linux/lib:/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
W=/tmp/btc; rm -rf $W; mkdir -p $W
RES=$OUTDIR/compare.jsonl; : > "$RES"
status=0
for S in ${SEQS//,/ }; do
    # shellcheck disable=SC2086
    timeout 420 "$BIN" train --model builtin:tinyllama-1.1b-shape --dataset synthetic:passkey --seq-length "$S" --rope-theta 1e6 \
        --max-train-steps "$STEPS" --batch-size 1 --device cuda --dtype bf16 --token-chunk "${TOKEN_CHUNK:-8192}" --learning-rate 1e-5 \
        --output-dir $W/l$S ${LONGCTX_FLAGS:-} >"$OUTDIR/longctx-$S.log" 2>&1 || { echo "longctx seq $S failed (see longctx-$S.log)"; status=1; }
    python3 - "$W/l$S/metrics.jsonl" "$S" >>"$RES" <<'EOF' || status=1
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
t = rows[1:] or rows
tps = sum(r["tokens"] for r in t) / sum(r["seconds"] for r in t)
print(json.dumps({"side": "longctx", "seq": int(sys.argv[2]), "tokens_per_s": tps, "mfu": t[-1].get("mfu"),
                  "peak_allocated_gib": max((r.get("device_peak_bytes") or 0) for r in rows) / 2**30,
                  "step_seconds": [round(r["seconds"], 3) for r in rows], "losses": [round(r["loss"], 5) for r in rows]}))
EOF
    timeout 420 python3 "$HERE/bench_train_torch.py" --seq "$S" --steps "$STEPS" --out "$RES" >"$OUTDIR/torch-$S.log" 2>&1 \
        || { echo "transformers seq $S failed (see torch-$S.log)"; status=1; }
done
python3 - "$RES" <<'EOF' | tee "$OUTDIR/compare.md"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
print("| seq | longctx tok/s (MFU, peak GiB) | transformers tok/s (MFU, peak GiB) | ratio |")
print("| --- | --- | --- | --- |")
for s in sorted({r["seq"] for r in rows}):
    side = {r["side"]: r for r in rows if r["seq"] == s}
    def cell(r):
        if r is None or "error" in r:
            return r.get("error", "-") if r else "-"
        mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "-"
        return f"{r['tokens_per_s']:,.0f} ({mfu}, {r['peak_allocated_gib']:.1f})"
    l, t = side.get("longctx"), side.get("transformers")
    ratio = f"{l['tokens_per_s'] / t['tokens_per_s']:.2f}×" if l and t and "tokens_per_s" in l and "tokens_per_s" in t else "-"
    print(f"| {s} | {cell(l)} | {cell(t)} | {ratio} |")
EOF
exit $status
