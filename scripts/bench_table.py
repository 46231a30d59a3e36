#!/usr/bin/env python3
"""The table of scripts/bench_train_compare.sh's compare.jsonl: one row per (label, length)
of longctx, against the transformers line of the same shape and length (a label run with
PEER=0 is compared with the peer of its shape), and the peer's versions and backend.

Two ratios: of the mean tokens/s over the timed steps (every step after the first, one-off
costs such as a first deferred update's pinned buffers included), and of the median timed
step (the steady state; the Llama-2-7B shape's step 2 is 0.9 s longer than the next ones).

    bench_table.py compare.jsonl
"""
import json
import sys

rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
peers = {}
for r in rows:
    if r["side"] == "transformers":
        peers[(r.get("shape", "tinyllama"), r["seq"])] = r


def cell(r):
    if r is None:
        return "-"
    if "error" in r:
        return r["error"]
    mfu = f"{100 * r['mfu']:.1f} %" if r.get("mfu") is not None else "-"
    return f"{r['tokens_per_s']:,.0f} ({mfu}, {r['peak_allocated_gib']:.1f} GiB)"


def median_step(r):
    """The median of the timed steps' seconds (every step after the first), or None."""
    t = sorted((r.get("step_seconds") or [])[1:])
    if not t:
        return None
    n = len(t)
    return t[n // 2] if n % 2 else (t[n // 2 - 1] + t[n // 2]) / 2


print("| row | seq | longctx tok/s (MFU, peak) | transformers tok/s (MFU, peak) | ratio | ratio of the median step |")
print("| --- | --- | --- | --- | --- | --- |")
for r in rows:
    if r["side"] != "longctx":
        continue
    label = r.get("label") or "tinyllama"
    # the row's shape (rows written before it was recorded: from the label, as the script
    # names rows by default)
    shape = r.get("shape") or ("llama2-7b" if label.startswith("llama2-7b") else "tinyllama")
    t = peers.get((shape, r["seq"]))
    ratio = f"{r['tokens_per_s'] / t['tokens_per_s']:.2f}×" if t and "tokens_per_s" in t and "tokens_per_s" in r else "-"
    ms, mt = median_step(r), median_step(t) if t else None
    steady = f"{mt / ms:.2f}× ({ms:.2f} s against {mt:.2f} s)" if ms and mt else "-"
    flags = f" `{r['flags']}`" if r.get("flags") else ""
    print(f"| {label}{flags} | {r['seq']} | {cell(r)} | {cell(t)} | {ratio} | {steady} |")
seen = set()
for t in peers.values():
    v = (t.get("torch"), t.get("cuda"), t.get("cudnn"), t.get("transformers"), t.get("sdpa_backend"), t.get("ld_library_path"))
    if v in seen:
        continue
    seen.add(v)
    print(f"\ntransformers side: torch {v[0]} (CUDA {v[1]}, cuDNN {v[2]}), transformers {v[3]}, SDPA backend {v[4]}, "
          f"LD_LIBRARY_PATH {v[5]!r}; GPU {t.get('gpu')}")
