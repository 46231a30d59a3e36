#!/usr/bin/env python3
"""Golden fixtures for Qwen3 and LongRoPE (tests/all/golden_rope.rs), and transformers'
RoPE for the config that a YaRN stage exports (tests/all/stage_rope.rs).

Same layout and batch as scripts/make_fixtures.py (which this imports): each folder is
a tiny random HF checkpoint (float32, CPU, fixed seed) with reference.safetensors
holding input_ids, position_ids, targets, logits, per_token_loss, loss_sum, loss_mean,
n_tokens, rope.cos, rope.sin and grad.<param> (gradients of the SUM loss). Extra here:

  llama_longrope/reference.safetensors
    rope_short.cos, rope_short.sin [1, 24, head_dim]   cos/sin for positions 0..23
        (max position + 1 <= original_max_position_embeddings: the SHORT factors; the
        fixture batch reaches position 1023 > 256, so rope.cos/sin use the LONG ones)
  yarn_export/config.json      the config.json a stage `rope = {type = "yarn",
        factor = 4, original_max_position_embeddings = 256}` at rope_theta 5e5, length 1024, exports
        from tests/fixtures/llama_mha (written by longctx: the ignored test write_yarn_export_fixture in
        tests/all/stage_rope.rs)
  yarn_export/rope.safetensors  inv_freq [d/2], attention_scaling [], cos/sin
        [1, 8, d] for positions (0, 1, 255, 256, 1000, 4095, 8191, 16383), as
        transformers builds them from that config.json

Usage: /tmp/py/bin/python scripts/make_rope_fixtures.py [out_dir]   (default tests/fixtures)
Needs: torch, transformers 5.x (written with 5.24), tokenizers, safetensors.
"""

import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_fixtures  # noqa: E402
from make_fixtures import S, common, make, small  # noqa: E402

HEAD_DIM = 16
# LongRoPE divisors, one per rotated pair (head_dim/2 = 8): short ~1 (the pretrained
# context), long growing towards the low frequencies, as Phi-3's lists do.
SHORT = [1.0, 1.02, 1.05, 1.1, 1.2, 1.3, 1.45, 1.6]
LONG = [1.0, 1.3, 1.9, 2.8, 4.1, 6.0, 8.5, 12.0]

FIXTURES = {
    # Qwen3: q_norm/k_norm per head, head_dim 12 != hidden/heads = 8, GQA, tied
    # embeddings, no biases, two layers.
    "qwen3_tied": (Qwen3Config, Qwen3ForCausalLM,
                   common(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=12, tie_word_embeddings=True, rope_theta=1000000.0, max_position_embeddings=4096)),
    # LongRoPE (Phi-3 semantics) on a Llama, attention factor from `factor`.
    "llama_longrope": (LlamaConfig, LlamaForCausalLM,
                       small(max_position_embeddings=1024,
                             rope_scaling={"rope_type": "longrope", "factor": 4.0, "original_max_position_embeddings": 256,
                                           "short_factor": SHORT, "long_factor": LONG})),
}

EXPORT_POSITIONS = [0, 1, 255, 256, 1000, 4095, 8191, 16383]


def longrope_short(out_root):
    """Adds the short-factor cos/sin to llama_longrope's reference."""
    d = os.path.join(out_root, "llama_longrope")
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.float32)
    pos = torch.arange(S, dtype=torch.int64).unsqueeze(0)
    with torch.no_grad():
        h = model.model.embed_tokens(torch.zeros_like(pos))
        cos, sin = model.model.rotary_emb(h, pos)
    ref = load_file(os.path.join(d, "reference.safetensors"))
    assert not torch.allclose(ref["rope.cos"][0], cos[0]), "short and long factors must differ"
    ref["rope_short.cos"], ref["rope_short.sin"] = cos.float().contiguous(), sin.float().contiguous()
    save_file(ref, os.path.join(d, "reference.safetensors"))


def yarn_export(out_root):
    """transformers' RoPE for the config.json a YaRN stage exported (if it is there)."""
    d = os.path.join(out_root, "yarn_export")
    if not os.path.isfile(os.path.join(d, "config.json")):
        print("yarn_export/config.json missing: run the ignored test in tests/all/stage_rope.rs first")
        return
    cfg = AutoConfig.from_pretrained(d)
    print("yarn_export: transformers reads", json.dumps(cfg.rope_parameters))
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    rot = LlamaRotaryEmbedding(cfg)
    pos = torch.tensor([EXPORT_POSITIONS], dtype=torch.int64)
    x = torch.zeros(1, len(EXPORT_POSITIONS), cfg.hidden_size)
    with torch.no_grad():
        cos, sin = rot(x, pos)
    save_file({"inv_freq": rot.inv_freq.float().contiguous(),
               "attention_scaling": torch.tensor(float(rot.attention_scaling)),
               "position_ids": pos, "cos": cos.float().contiguous(), "sin": sin.float().contiguous()},
              os.path.join(d, "rope.safetensors"))


def main():
    out_root, tok = make_fixtures.start()
    for i, (name, (cfg_cls, model_cls, kw)) in enumerate(FIXTURES.items()):
        make(name, cfg_cls, model_cls, dict(kw), tok, out_root, seed=4321 + i)
    longrope_short(out_root)
    yarn_export(out_root)


if __name__ == "__main__":
    main()
