#!/usr/bin/env python3
"""Check that a checkpoint exported by `longctx::hub::export` loads in Hugging Face
transformers and computes the same logits as the original.

Usage:
  check_export_transformers.py --case EXPORTED FIXTURE ROPE_THETA MAX_POS [--case ...] [--tol 1e-5]

EXPORTED  the directory our exporter wrote (sharded or not).
FIXTURE   the tests/fixtures/<name> directory it was made from (HF checkpoint +
          reference.safetensors with input_ids, position_ids, logits).
ROPE_THETA, MAX_POS
          what the export was asked to set, or `same` for an unchanged config.

For each case:
  1. AutoModelForCausalLM.from_pretrained(EXPORTED) loads with no missing, unexpected
     or mismatched weights, and its config reports ROPE_THETA / MAX_POS.
  2. Logits on the fixture's batch (input_ids, position_ids) match
     - the fixture's reference logits when the config is unchanged, or
     - the FIXTURE model loaded with the same rope_theta / max_position_embeddings
       override applied in Python otherwise; in that case they must also differ
       from the reference logits (the override took effect).
  3. The tokenizer saved next to it encodes a sentence like the fixture's tokenizer.
Exits 1 if any check fails; the tolerance is the max absolute logit difference.
"""

import argparse
import sys

import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

SENTENCE = "Long context training splits one sequence across many devices."


def rope_theta_of(config):
    """rope_theta as transformers uses it: rope_parameters (v5) or the top level (v4)."""
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict):
        if "rope_theta" in rp:
            return float(rp["rope_theta"])
        nested = [v for v in rp.values() if isinstance(v, dict) and "rope_theta" in v]
        if nested:
            return float(nested[0]["rope_theta"])
    return float(config.rope_theta)


def set_rope_theta(config, theta):
    rp = getattr(config, "rope_parameters", None)
    if isinstance(rp, dict) and "rope_theta" in rp:
        rp["rope_theta"] = theta
    elif isinstance(rp, dict):
        for v in rp.values():
            if isinstance(v, dict):
                v["rope_theta"] = theta
    else:
        config.rope_theta = theta


@torch.no_grad()
def logits_of(model, ref):
    return model(input_ids=ref["input_ids"], position_ids=ref["position_ids"]).logits.float()


def check_case(exported, fixture, theta, max_pos, tol):
    failures = []
    model, info = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, output_loading_info=True)
    model.eval()
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys"):
        if info.get(key):
            failures.append(f"{key}: {sorted(info[key])[:5]}")

    ref = load_file(f"{fixture}/reference.safetensors")
    got = logits_of(model, ref)
    ref_logits = ref["logits"].float()

    if theta == "same":
        diff = (got - ref_logits).abs().max().item()
        print(f"  logits vs fixture reference: max |diff| = {diff:.3e} (tol {tol:g})")
        if not diff <= tol:
            failures.append(f"logits differ from the reference by {diff:.3e} > {tol:g}")
    else:
        want_theta, want_max = float(theta), int(max_pos)
        seen_theta = rope_theta_of(model.config)
        if seen_theta != want_theta:
            failures.append(f"transformers sees rope_theta {seen_theta}, expected {want_theta}")
        if model.config.max_position_embeddings != want_max:
            failures.append(
                f"transformers sees max_position_embeddings {model.config.max_position_embeddings}, expected {want_max}"
            )
        cfg = AutoConfig.from_pretrained(fixture)
        set_rope_theta(cfg, want_theta)
        cfg.max_position_embeddings = want_max
        orig = AutoModelForCausalLM.from_pretrained(fixture, config=cfg, dtype=torch.float32)
        orig.eval()
        want = logits_of(orig, ref)
        diff = (got - want).abs().max().item()
        moved = (got - ref_logits).abs().max().item()
        print(f"  logits vs fixture with the same override: max |diff| = {diff:.3e} (tol {tol:g});"
              f" vs unchanged reference: {moved:.3e}")
        if not diff <= tol:
            failures.append(f"logits differ from the overridden original by {diff:.3e} > {tol:g}")
        if not moved > 1e-3:
            failures.append(f"rope_theta change had no visible effect (max |diff| {moved:.3e} vs reference)")

    tok_out = AutoTokenizer.from_pretrained(exported)
    tok_src = AutoTokenizer.from_pretrained(fixture)
    if tok_out(SENTENCE)["input_ids"] != tok_src(SENTENCE)["input_ids"]:
        failures.append("exported tokenizer encodes differently from the fixture's")
    return failures


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--case", nargs=4, action="append", required=True,
                    metavar=("EXPORTED", "FIXTURE", "ROPE_THETA", "MAX_POS"))
    ap.add_argument("--tol", type=float, default=1e-5)
    args = ap.parse_args()
    torch.manual_seed(0)
    bad = 0
    for exported, fixture, theta, max_pos in args.case:
        print(f"{exported} (from {fixture}, rope_theta={theta}, max_position_embeddings={max_pos})")
        failures = check_case(exported, fixture, theta, max_pos, args.tol)
        for f in failures:
            print(f"  FAIL: {f}")
        bad += bool(failures)
    print(f"cases ok: {len(args.case) - bad}, cases failed: {bad}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
