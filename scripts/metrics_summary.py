#!/usr/bin/env python3
"""One line summarising a training run's metrics.jsonl (used by the GPU check scripts).

    metrics_summary.py METRICS_JSONL LABEL   -> "LABEL: N tok/s (steps 2..), step s [...], ..."
    metrics_summary.py METRICS_JSONL --losses -> the per-step losses, space separated
    metrics_summary.py METRICS_JSONL --stages -> a line per stage: steps, first and last
           loss, tokens/s over its steps after the first, mean MFU
    metrics_summary.py --compare A_JSONL B_JSONL RTOL LABEL
        -> "LABEL: ok/DIFFER ..."; exit status 1 when the runs logged different step counts
           or any step's loss differs by more than RTOL relative (0: bit-identical)

    metrics_summary.py --within-noise CAND LOWP F32 LABEL
        -> exit status 1 unless CAND's losses are as close to F32's as twice LOWP's are
           (worst relative difference per step; LOWP: the reference path in the same
           low-precision dtype as CAND, F32: the same reference in f32)

tokens/s is over the steps after the first (the first pays for warm-up: kernel
selection, page-locking of offload buffers).
"""
import json
import sys


def read(path):
    """Every line of metrics.jsonl: (step lines, event lines such as "eval")."""
    rows = [json.loads(line) for line in open(path) if line.strip()]
    return [r for r in rows if "event" not in r], [r for r in rows if "event" in r]


def losses(path):
    return [r["loss"] for r in read(path)[0]]


def compare(a_path, b_path, rtol, label) -> int:
    try:
        a, b = losses(a_path), losses(b_path)
    except (OSError, ValueError, KeyError) as e:
        print(f"{label}: DIFFER (cannot read the logs: {e})")
        return 1
    worst = max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, b)), default=0.0)
    ok = len(a) == len(b) and len(a) > 0 and worst <= rtol
    print(f"{label}: {'ok' if ok else 'DIFFER'} ({len(a)} vs {len(b)} steps, worst relative difference {worst:.2e}, allowed {rtol:.0e})")
    return 0 if ok else 1


def within_noise(cand, lowp, ref, label) -> int:
    try:
        c, lo, r = losses(cand), losses(lowp), losses(ref)
    except (OSError, ValueError, KeyError) as e:
        print(f"{label}: DIFFER (cannot read the logs: {e})")
        return 1
    def worst(a):
        return max((abs(x - y) / max(abs(y), 1e-12) for x, y in zip(a, r)), default=0.0)
    got, noise = worst(c), worst(lo)
    ok = len(c) == len(lo) == len(r) > 0 and got <= 2 * noise
    print(f"{label}: {'ok' if ok else 'DIFFER'} ({len(c)} steps; candidate vs f32 {got:.2e}, "
          f"reference in low precision vs f32 {noise:.2e}: allowed {2 * noise:.2e})")
    return 0 if ok else 1


def stages(rows, events) -> int:
    by = {}
    for r in rows:
        by.setdefault(r.get("stage") or 0, []).append(r)
    for stage, rs in sorted(by.items()):
        steady = rs[1:] or rs
        tps = sum(r["tokens"] for r in steady) / sum(r["seconds"] for r in steady)
        mfu = [r["mfu"] for r in steady if r.get("mfu") is not None]
        mfu_s = f"{100 * sum(mfu) / len(mfu):.1f} %" if mfu else "-"
        print(f"stage {stage} ({rs[0]['seq_len']} tokens): {len(rs)} steps, loss {rs[0]['loss']:.3f} -> {rs[-1]['loss']:.3f}, "
              f"{tps:,.0f} tok/s (steps 2..), MFU {mfu_s}")
    for e in events:
        if e.get("event") != "eval":
            continue
        ppl = ", ".join(f"{p['ppl']:.3f} at {p['length']}" for p in e.get("ppl", []))
        right = sum(c["right"] for c in e.get("passkey", []))
        trials = sum(c["trials"] for c in e.get("passkey", []))
        print(f"  eval after stage {e.get('stage')} step {e.get('step')}: ppl {ppl}; passkey {right}/{trials}")
    return 0


def main() -> int:
    if sys.argv[1] == "--within-noise":
        return within_noise(sys.argv[2], sys.argv[3], sys.argv[4], sys.argv[5])
    if sys.argv[1] == "--compare":
        return compare(sys.argv[2], sys.argv[3], float(sys.argv[4]), sys.argv[5])
    path, label = sys.argv[1], sys.argv[2]
    rows, events = read(path)
    if label == "--stages":
        return stages(rows, events)
    if label == "--losses":
        print(" ".join("%.7f" % r["loss"] for r in rows))
        return 0
    last = rows[1:] or rows
    tps = sum(r["tokens"] for r in last) / sum(r["seconds"] for r in last)
    peak = max((r.get("device_peak_bytes") or 0) for r in rows) / 2**30
    print(
        f"{label}: {tps:.0f} tok/s (steps 2..{len(rows)}), step s {[round(r['seconds'], 2) for r in rows]}, "
        f"fwd+bwd s {[round(r.get('engine_seconds', 0), 2) for r in rows]}, device peak {peak:.2f} GiB, "
        f"saved act {rows[-1]['saved_activation_bytes'] / 2**30:.2f} GiB, losses {[round(r['loss'], 6) for r in rows]}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
