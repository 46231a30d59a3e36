#!/usr/bin/env python3
"""transformers' perplexity of a model on the windows `longctx eval ppl --method truncate`
scored, compared with longctx's figures.

Documents are tokenized as longctx does (`tokenizer(text)`: the tokenizer's own special
tokens, then config.json's eos_token_id after each document), read in file order until
--max-docs documents or --max-tokens tokens; for each length L, every document of at least
L + 1 tokens is cut to its first L + 1 and all its L targets are scored. The loss is
transformers' `AutoModelForCausalLM` forward (SDPA) in --dtype: the final hidden states
of the whole window, then the head and a float32 cross-entropy 8,192 rows at a time
(the same values as `model(ids, labels=...)`, without 128K x 49K logits at once).

Checks, per length in longctx's ppl.json for --name: the same number of scored tokens
(the same windows), and |ppl_hf / ppl_longctx - 1| <= --rtol. Writes --out (JSON) and
exits 1 when a check fails.

Usage:
  python3 scripts/ppl_transformers.py --model runs/X/export --dataset data/longdocs/eval.jsonl \
      --longctx-json results/ppl.json --name runs/X/export --out results/ppl_transformers.json
"""
import argparse
import json
import math
import sys
import time


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True)
    ap.add_argument("--dataset", required=True, help="a .jsonl file with a `text` field per line")
    ap.add_argument("--longctx-json", required=True, help="ppl.json written by longctx eval ppl --method truncate")
    ap.add_argument("--name", required=True, help="the model's name in ppl.json (the --model longctx was given)")
    ap.add_argument("--max-docs", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=None)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--rtol", type=float, default=1e-3)
    ap.add_argument("--device", default="cuda", help="cuda or cpu (tiny models, float32)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with open(a.longctx_json) as f:
        ours = [p for p in json.load(f)["points"] if p["model"] == a.name]
    if not ours:
        sys.exit(f"{a.longctx_json}: no point for model {a.name!r}")
    tok = AutoTokenizer.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_pretrained(a.model, dtype=getattr(torch, a.dtype), attn_implementation="sdpa").to(a.device).eval()
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos

    docs, total = [], 0
    with open(a.dataset) as f:
        for line in f:
            ids = tok(json.loads(line)["text"]).input_ids
            if eos is not None:
                ids.append(eos)
            docs.append(ids)
            total += len(ids)
            if len(docs) >= a.max_docs or (a.max_tokens is not None and total >= a.max_tokens):
                break

    results, ok = [], True
    for p in sorted(ours, key=lambda p: p["length"]):
        L = p["length"]
        t0 = time.time()
        loss_sum, n = 0.0, 0
        for d in docs:
            if len(d) < L + 1:
                continue
            ids = torch.tensor([d[: L + 1]], device=a.device)
            with torch.no_grad():
                h = model.model(input_ids=ids[:, :L]).last_hidden_state[0]
                tgt = ids[0, 1 : L + 1]
                for s in range(0, L, 8192):
                    logits = model.lm_head(h[s : s + 8192]).float()
                    loss_sum += torch.nn.functional.cross_entropy(logits, tgt[s : s + 8192], reduction="sum").item()
            n += L
        ppl = math.exp(loss_sum / n) if n else float("nan")
        rel = abs(ppl / p["ppl"] - 1) if n else float("inf")
        same = n == p["tokens"]
        good = same and rel <= a.rtol
        ok &= good
        results.append({"length": L, "ppl_transformers": ppl, "ppl_longctx": p["ppl"], "rel_diff": rel,
                         "tokens_transformers": n, "tokens_longctx": p["tokens"], "ok": good, "seconds": time.time() - t0})
        print(f"{L:>7}: transformers {ppl:.5f}  longctx {p['ppl']:.5f}  rel {rel:.2e}  tokens {n} vs {p['tokens']}  {'ok' if good else 'DIFFER'}", flush=True)
    out = {"model": a.model, "dtype": a.dtype, "rtol": a.rtol, "torch": torch.__version__, "transformers": transformers.__version__,
           "attn_implementation": "sdpa", "points": results, "ok": ok}
    with open(a.out + ".tmp", "w") as f:
        json.dump(out, f, indent=1)
    import os
    os.replace(a.out + ".tmp", a.out)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
