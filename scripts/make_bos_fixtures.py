#!/usr/bin/env python3
"""Fixtures for BOS handling on a real tokenizer (tests/all/bos_real_tokenizer.rs).

SmolLM2's tokenizer (49,152 tokens; its post-processor adds nothing) with a tiny random
Llama of that vocabulary (transformers, CPU, float32 compute, weights stored in f16),
in three variants that differ only in the special tokens transformers' `tokenizer(text)`
adds:
  plain          SmolLM2's tokenizer.json and tokenizer_config.json as saved: no BOS;
  bos_template   tokenizer.json's post-processor a TemplateProcessing "<|im_start|> $A":
                 a BOS-adding post-processor (as Llama 2's and 3's tokenizers have);
  add_bos_flag   tokenizer_config.json with add_bos_token true (transformers rebuilds the
                 post-processor from it), the post-processor of `plain`.
For each variant and prompt: `tokenizer(prompt).input_ids` and the ids of greedy
`model.generate(max_new_tokens=8)` (prompt included), and the ids of one document.

Written to tests/fixtures/bos_smollm2/: tokenizer.json.gz (the plain tokenizer,
compressed), tokenizer_config.json, model.safetensors, config.json, cases.json.

Usage: python3 scripts/make_bos_fixtures.py TOKENIZER_DIR [out_dir]
  TOKENIZER_DIR: a directory with SmolLM2's tokenizer.json and tokenizer_config.json
  (scripts/smollm2_hf.py writes one).
Needs: torch, transformers (5.x), tokenizers, safetensors.
"""
import copy
import gzip
import json
import os
import shutil
import sys
import tempfile

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "  Leading spaces, a tab\tand ünïcödé.",
]
DOCUMENT = "Rotary position embeddings rotate pairs of query and key features.\n\nA second paragraph."
BOS = "<|im_start|>"


def main():
    src = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) > 2 else "tests/fixtures/bos_smollm2"
    os.makedirs(out, exist_ok=True)
    tok_json = json.load(open(os.path.join(src, "tokenizer.json")))
    tok_cfg = json.load(open(os.path.join(src, "tokenizer_config.json")))
    bos_id = tok_json["model"]["vocab"][BOS]

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, max_position_embeddings=256, rope_theta=10000.0, tie_word_embeddings=True,
                      bos_token_id=bos_id, eos_token_id=2, pad_token_id=2)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5)
    model = model.half().float()  # values exactly representable in the stored f16
    model.eval()
    model.half().save_pretrained(out, safe_serialization=True)
    model = model.float()
    for f in ("generation_config.json",):
        if os.path.exists(os.path.join(out, f)):
            os.remove(os.path.join(out, f))

    template = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": BOS, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"SpecialToken": {"id": BOS, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {BOS: {"id": BOS, "ids": [bos_id], "tokens": [BOS]}},
    }
    variants = {
        "plain": (tok_json, tok_cfg),
        "bos_template": (dict(tok_json, post_processor=template), tok_cfg),
        "add_bos_flag": (tok_json, dict(tok_cfg, add_bos_token=True)),
    }
    cases = {"bos_id": bos_id, "max_new_tokens": 8, "variants": {}}
    for name, (tj, tc) in variants.items():
        d = tempfile.mkdtemp()
        try:
            json.dump(tj, open(os.path.join(d, "tokenizer.json"), "w"))
            json.dump(tc, open(os.path.join(d, "tokenizer_config.json"), "w"))
            tok = AutoTokenizer.from_pretrained(d)
            v = {"post_processor": tj.get("post_processor"), "tokenizer_config": tc, "prompts": []}
            for p in PROMPTS:
                ids = tok(p).input_ids
                with torch.no_grad():
                    g = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=2)
                v["prompts"].append({"prompt": p, "input_ids": ids, "generated": g[0].tolist()})
            v["document"] = {"text": DOCUMENT, "input_ids": tok(DOCUMENT).input_ids}
            cases["variants"][name] = v
            print(name, [c["input_ids"][:3] for c in v["prompts"]])
        finally:
            shutil.rmtree(d)
    with gzip.open(os.path.join(out, "tokenizer.json.gz"), "wt") as f:
        json.dump(tok_json, f, separators=(",", ":"))
    json.dump(tok_cfg, open(os.path.join(out, "tokenizer_config.json"), "w"), indent=1)
    json.dump(cases, open(os.path.join(out, "cases.json"), "w"), indent=1, ensure_ascii=False)


if __name__ == "__main__":
    main()
