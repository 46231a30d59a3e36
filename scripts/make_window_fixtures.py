#!/usr/bin/env python3
"""Golden fixtures for sliding-window attention (tests/all/golden_window.rs, issue #31).

Same layout and batch as scripts/make_fixtures.py (which this imports: two rows of 24
tokens): each folder is a tiny random HF checkpoint (float32, CPU, fixed seed, eager
attention) with reference.safetensors holding input_ids, position_ids, targets, logits,
per_token_loss, loss_sum, loss_mean, n_tokens, rope.cos, rope.sin and grad.<param>
(gradients of the SUM loss), all computed by transformers WITH its sliding window:

  mistral_window   Mistral, 2 layers, sliding_window = 5 on every layer
  qwen2_window     Qwen2, 2 layers, use_sliding_window, sliding_window = 4,
                   max_window_layers = 1: layer 0 full, layer 1 sliding
                   (transformers 5 writes layer_types into config.json)

Both windows are far below the 24 tokens, so full causal attention gives other logits
(checked here).

Usage: /tmp/py/bin/python scripts/make_window_fixtures.py [out_dir]   (default tests/fixtures)
Needs: torch, transformers 5.x (written with 5.24), tokenizers, safetensors.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file
from transformers import MistralConfig, MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402
from make_fixtures import make, small  # noqa: E402

FIXTURES = {
    "mistral_window": (MistralConfig, MistralForCausalLM, small(num_hidden_layers=2, sliding_window=5)),
    "qwen2_window": (Qwen2Config, Qwen2ForCausalLM,
                     small(num_hidden_layers=2, use_sliding_window=True, sliding_window=4, max_window_layers=1)),
}


def check_window_matters(out_root, name, cfg_cls, model_cls):
    """The same weights without the window give other logits: the fixture can fail."""
    d = os.path.join(out_root, name)
    ref = load_file(os.path.join(d, "reference.safetensors"))
    trained = model_cls.from_pretrained(d, dtype=torch.float32)
    with open(os.path.join(d, "config.json")) as f:
        kw = json.load(f)
    kw.update(sliding_window=None, use_sliding_window=False)
    if "layer_types" in kw:
        kw["layer_types"] = ["full_attention"] * len(kw["layer_types"])
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).to(torch.float32)
    model.load_state_dict(trained.state_dict())
    with torch.no_grad():
        full = model(input_ids=ref["input_ids"], position_ids=ref["position_ids"]).logits.float()
    diff = (full - ref["logits"]).abs().max().item()
    print(f"{name}: full causal differs from the windowed reference by {diff:.3e}")
    assert diff > 1e-3, name


def main():
    out_root, tok = make_fixtures.start()
    for i, (name, (cfg_cls, model_cls, kw)) in enumerate(FIXTURES.items()):
        make(name, cfg_cls, model_cls, dict(kw), tok, out_root, seed=8765 + i)
        check_window_matters(out_root, name, cfg_cls, model_cls)


if __name__ == "__main__":
    main()
