#!/usr/bin/env python3
"""Golden fixture for the Phi-3 family (tests/all/golden_rope.rs, `golden_phi3_longrope`): a tiny random
Phi3ForCausalLM (fused `qkv_proj` and `gate_up_proj` in the checkpoint, LongRoPE with
short/long factors and a top-level `original_max_position_embeddings`, GQA 4/2, two
layers), saved in HF layout under tests/fixtures/phi3_longrope/, with the reference
outputs of scripts/make_fixtures.py's batch (logits, per-token loss, loss sum/mean, RoPE
cos/sin, gradients of the SUM loss).

longctx splits the fused weights at load into q/k/v and gate/up (and fuses them back at
export), so the gradients are stored under the split names too:
  grad.model.layers.N.self_attn.{q,k,v}_proj.weight  rows of qkv_proj's gradient
  grad.model.layers.N.mlp.{gate,up}_proj.weight      halves of gate_up_proj's gradient
(the fused grad.* entries are kept as well).

Usage: /tmp/py/bin/python scripts/make_phi3_fixture.py [out_dir]   (default tests/fixtures)
Needs: torch, transformers 5.x (written with 5.24), tokenizers, safetensors.
"""

import os
import sys

from safetensors.torch import load_file, save_file
from transformers import Phi3Config, Phi3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402
from make_fixtures import common, make  # noqa: E402

SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6]
LONG = [1.0, 1.3, 1.9, 2.8, 4.1, 6.0, 8.5, 12.0]
NAME = "phi3_longrope"


def main():
    out_root, tok = make_fixtures.start()
    kw = common(num_key_value_heads=2, max_position_embeddings=1024, original_max_position_embeddings=256,
                rope_scaling={"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG}, pad_token_id=0)
    kw.pop("head_dim")  # Phi-3 derives it (hidden / heads = 16)
    make(NAME, Phi3Config, Phi3ForCausalLM, kw, tok, out_root, seed=3003)
    out = os.path.join(out_root, NAME)
    ref = load_file(os.path.join(out, "reference.safetensors"))
    hq, hkv, hd, inter = kw["num_attention_heads"], kw["num_key_value_heads"], 16, kw["intermediate_size"]
    for l in range(kw["num_hidden_layers"]):
        p = f"grad.model.layers.{l}."
        qkv = ref[p + "self_attn.qkv_proj.weight"]
        ref[p + "self_attn.q_proj.weight"] = qkv[: hq * hd].clone()
        ref[p + "self_attn.k_proj.weight"] = qkv[hq * hd:(hq + hkv) * hd].clone()
        ref[p + "self_attn.v_proj.weight"] = qkv[(hq + hkv) * hd:].clone()
        gu = ref[p + "mlp.gate_up_proj.weight"]
        ref[p + "mlp.gate_proj.weight"] = gu[:inter].clone()
        ref[p + "mlp.up_proj.weight"] = gu[inter:].clone()
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))


if __name__ == "__main__":
    main()
