#!/usr/bin/env python3
"""Golden fixtures for Gemma 3 text (tests/all/golden_gemma3.rs): tiny random
Gemma3ForCausalLM checkpoints saved in HF layout under tests/fixtures/<name>/, with the
reference outputs of scripts/make_fixtures.py's batch (2 rows of 24 tokens, row 1 at
positions 1000..1023; logits, per-token loss, loss sum/mean, gradients of the SUM loss)
plus both RoPE tables:
  rope.cos, rope.sin              [2, 24, head_dim]  the full-attention layers' (global)
  rope_local.cos, rope_local.sin  [2, 24, head_dim]  the sliding-window layers'

Both: 3 layers (sliding, full, sliding), hidden 32, 4 query heads / 2 kv heads of
head_dim 16 (64 != hidden: head_dim from the config), query_pre_attn_scalar 24 (not
head_dim), global RoPE θ 1e6 with linear scaling factor 8 (as Gemma 3 4B+), local θ 1e4,
tied embeddings, norms centred on 0 (the model applies 1 + w).
  gemma3_text     sliding_window 32 >= the 24 tokens: the sliding layers attend to every
                  earlier token (full causal), so longctx without a window equals it.
                  config.json as transformers 5.24 writes it (rope_parameters per layer type).
  gemma3_window4  the same shape (another seed) with sliding_window 4: the sliding layers
                  see the last 4 positions only. config.json in the transformers 4 form
                  (rope_theta + rope_scaling + rope_local_base_freq + sliding_window_pattern,
                  as Google's hub configs), checked to give the same logits when reloaded.

Usage: /tmp/py/bin/python scripts/make_gemma3_fixtures.py [out_dir]   (default tests/fixtures)
Needs: torch, transformers 5.x (written with 5.24), tokenizers, safetensors.
"""

import json
import math
import os
import sys

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402
from make_fixtures import VOCAB  # noqa: E402

LAYERS = ["sliding_attention", "full_attention", "sliding_attention"]


def config(window):
    return dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, query_pre_attn_scalar=24,
        max_position_embeddings=2048, rms_norm_eps=1e-6, sliding_window=window, layer_types=LAYERS,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
    )


def gemma_randomize(model, seed):
    """make_fixtures' randomize, but the norm weights centred on 0 (Gemma applies 1 + w):
    w ~ N(0, 0.1); weights ~ N(0, 1/fan_in); the embedding ~ N(0, 1/hidden), which the
    model scales by sqrt(hidden)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(0.1 * r)
            else:  # the embedding too: its rows times sqrt(hidden) have unit scale
                p.copy_(r / math.sqrt(p.shape[1]))


def gemma_rope_tables(model, h, pos):
    """Both RoPE tables: the full-attention layers' and the sliding layers'."""
    ref = {}
    for key, kind in (("rope", "full_attention"), ("rope_local", "sliding_attention")):
        cos, sin = model.model.rotary_emb(h, pos, kind)
        ref[f"{key}.cos"], ref[f"{key}.sin"] = cos.float(), sin.float()
    return ref


def make(name, kw, tok, out_root, seed):
    """make_fixtures.make for Gemma 3: its own init, both RoPE tables."""
    return make_fixtures.make(name, Gemma3TextConfig, Gemma3ForCausalLM, kw, tok, out_root, seed,
                              init=gemma_randomize, rope_tables=gemma_rope_tables)


def to_v4_config(out):
    """Rewrites config.json in the transformers 4 form (Google's hub configs) and checks
    that transformers builds the same model from it."""
    path = os.path.join(out, "config.json")
    with open(path) as f:
        c = json.load(f)
    rp = c.pop("rope_parameters")
    full = dict(rp["full_attention"])
    c["rope_theta"] = full.pop("rope_theta")
    c["rope_scaling"] = full
    c["rope_local_base_freq"] = rp["sliding_attention"]["rope_theta"]
    c.pop("layer_types")
    c.pop("_sliding_window_pattern", None)
    c["sliding_window_pattern"] = 2  # layers 0, 2 slide; layer 1 global: LAYERS again
    with open(path, "w") as f:
        json.dump(c, f, indent=2, sort_keys=True)
        f.write("\n")
    again = Gemma3TextConfig.from_pretrained(out)
    assert again.layer_types == LAYERS, again.layer_types
    assert again.rope_parameters["full_attention"]["factor"] == 8.0, again.rope_parameters


def main():
    out_root, tok = make_fixtures.start()
    for name, window, seed in (("gemma3_text", 32, 4004), ("gemma3_window4", 4, 4005)):
        ref = make(name, config(window), tok, out_root, seed=seed)
        out = os.path.join(out_root, name)
        if name == "gemma3_window4":
            to_v4_config(out)
            again = Gemma3ForCausalLM.from_pretrained(out, dtype=torch.float32)
            with torch.no_grad():
                got = again(input_ids=ref["input_ids"], position_ids=ref["position_ids"]).logits
            assert (got - ref["logits"]).abs().max() < 1e-5, "the v4 config builds another model"
            # The window matters here: the same weights without it give other logits.
            again.config.sliding_window = 4096
            with torch.no_grad():
                full = again(input_ids=ref["input_ids"], position_ids=ref["position_ids"]).logits
            print(f"{name}: logits change by {float((full - ref['logits']).abs().max()):.3f} without the window")
            assert (full - ref["logits"]).abs().max() > 1e-2


if __name__ == "__main__":
    main()
