#!/usr/bin/env python3
"""Check that a checkpoint exported by longctx loads in Hugging Face transformers with
no missing, unexpected or mismatched weights and computes the logits longctx computed.

Usage: check_export_logits.py EXPORTED BATCH.safetensors [--tol 1e-4]

EXPORTED  the directory `longctx export` (or a run's export) wrote.
BATCH     safetensors with input_ids [b, s] and position_ids [b, s] (integers) and
          logits [b, s, V] (f32): what longctx computed from the exported weights.
The tolerance is on max |ours - transformers| relative to max |transformers|.
Exits 1 if a check fails. Used by tests/all/golden_gemma3.rs (skipped without transformers).
"""

import argparse
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("exported")
    ap.add_argument("batch")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    model, info = AutoModelForCausalLM.from_pretrained(a.exported, dtype=torch.float32, output_loading_info=True)
    model.eval()
    failures = [f"{k}: {sorted(info[k])[:5]}" for k in ("missing_keys", "unexpected_keys", "mismatched_keys") if info.get(k)]
    b = load_file(a.batch)
    with torch.no_grad():
        got = model(input_ids=b["input_ids"].long(), position_ids=b["position_ids"].long()).logits.float()
    rel = ((got - b["logits"]).abs().max() / got.abs().max()).item()
    print(f"  {type(model).__name__}: logits vs longctx: max rel diff {rel:.3e} (tol {a.tol:g})")
    if not rel <= a.tol:
        failures.append(f"logits differ: {rel:.3e}")
    for f in failures:
        print("FAIL:", f)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
