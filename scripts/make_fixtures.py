#!/usr/bin/env python3
"""Golden fixtures for the Llama-family model of `longctx` (tests/all/golden.rs).

Builds tiny random checkpoints with Hugging Face transformers (CPU, float32, fixed
seeds), saves each in HF layout (config.json, model.safetensors, tokenizer.json,
tokenizer_config.json) under tests/fixtures/<name>/, and records, for one fixed batch,
the reference outputs in tests/fixtures/<name>/reference.safetensors:

  input_ids      [2, 24] i64   token ids
  position_ids   [2, 24] i64   global positions: row 0 starts at 0, row 1 at 1000
  targets        [2, 24] i64   next-token targets, -100 = ignored
  logits         [2, 24, V] f32
  per_token_loss [2, 24] f32   cross-entropy per token, 0 where ignored
  loss_sum       []      f32   sum of per_token_loss
  loss_mean      []      f32   loss_sum / number of counted tokens
  n_tokens       []      i64   number of counted tokens
  rope.cos, rope.sin [2, 24, head_dim] f32   the model's rotary cos/sin for position_ids
  grad.<param>   gradient of loss_SUM w.r.t. every parameter (safetensors names;
                 tied lm_head is not listed: its gradient is in the embedding's)

Usage: python3 scripts/make_fixtures.py [out_dir]   (default tests/fixtures)
Needs: torch (CPU is enough), transformers (written with 5.x), tokenizers, safetensors.
"""

import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

SENTENCES = [
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm sun.",
    "Long context training splits one sequence across many devices and sums the loss.",
    "Rotary position embeddings rotate pairs of query and key features by an angle.",
    "A ring of workers passes key and value blocks around so every query sees every key.",
    "Candle is a minimalist machine learning framework for Rust with autograd support.",
    "Grouped query attention shares one key value head among several query heads.",
    "Numbers like 12345 and 67890 and symbols like {}, [], () also appear in code.",
    "The loss is a sum over tokens divided by the global count of unmasked targets.",
]

B, S = 2, 24
ROW1_START = 1000  # row 1 positions are 1000..1023: global positions of a shard
VOCAB = 128  # a Llama-2-style (sentencepiece-like) BPE; small to keep the fixtures small


def train_tokenizer():
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    tok.train_from_iterator(SENTENCES * 4, trainer=trainer)
    return tok


def batch(tok):
    """Two rows of 24 tokens with next-token targets; some targets ignored."""
    rows, tgts = [], []
    for text in (SENTENCES[0] + " " + SENTENCES[1], SENTENCES[2] + " " + SENTENCES[3]):
        ids = tok.encode(text).ids
        assert len(ids) >= S + 1, len(ids)
        rows.append(ids[:S])
        tgts.append(ids[1 : S + 1])
    ids = torch.tensor(rows, dtype=torch.int64)
    targets = torch.tensor(tgts, dtype=torch.int64)
    targets[0, :3] = -100  # e.g. a prompt that is not trained on
    targets[1, 10:13] = -100
    targets[1, S - 1] = -100
    pos = torch.stack([torch.arange(S), torch.arange(ROW1_START, ROW1_START + S)]).to(torch.int64)
    return ids, pos, targets


def randomize(model, seed):
    """Replace HF's init (zero biases, unit norms, tiny weights) by values that make
    every parameter matter: weights ~ N(0, 1/fan_in),
    embeddings ~ N(0, 4/hidden) (tied heads give logits of std ~2),
    norm weights ~ 1 + N(0, 0.1), biases ~ N(0, 0.1)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("bias"):
                p.copy_(0.1 * r)
            elif "embed_tokens" in name:
                p.copy_(2.0 * r / math.sqrt(p.shape[1]))
            else:
                p.copy_(r / math.sqrt(p.shape[1]))


def common(**kw):
    base = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=16,
        max_position_embeddings=2048,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    base.update(kw)
    return base


def small(**kw):
    """One layer, hidden 32, 2 heads / 1 kv head, tied: for the RoPE variants (keeps the folder small)."""
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=1, tie_word_embeddings=True)
    base.update(kw)
    return common(**base)


# name -> (config class, model class, config kwargs)
FIXTURES = {
    # (a) plain multi-head Llama, default RoPE
    "llama_mha": (LlamaConfig, LlamaForCausalLM, common()),
    # (b) GQA Llama with attention and MLP biases, another theta
    "llama_gqa_bias": (LlamaConfig, LlamaForCausalLM,
                       common(num_key_value_heads=2, attention_bias=True, mlp_bias=True, rope_theta=500000.0)),
    # (c) + (d) Qwen2: q/k/v bias, no o bias, tied embeddings (as Qwen2-0.5B)
    "qwen2_tied": (Qwen2Config, Qwen2ForCausalLM,
                   common(num_key_value_heads=2, tie_word_embeddings=True, rope_theta=1000000.0)),
    # (e) Llama 3 rope scaling (tied, like Llama 3.2 1B), 2 layers
    "llama3_rope": (LlamaConfig, LlamaForCausalLM,
                    small(num_hidden_layers=2, max_position_embeddings=2048,
                           rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
    # Mistral, and head_dim (32) != hidden / heads (16), linear scaling
    "mistral_linear": (MistralConfig, MistralForCausalLM,
                       small(head_dim=32, rope_scaling={"rope_type": "linear", "factor": 4.0})),
    # dynamic NTK: max(position)+1 = 1024 > max_position_embeddings = 256 -> base rescaled
    "llama_dynamic": (LlamaConfig, LlamaForCausalLM,
                      small(max_position_embeddings=256, rope_scaling={"rope_type": "dynamic", "factor": 2.0})),
    # YaRN with attention_factor from mscale
    "llama_yarn": (LlamaConfig, LlamaForCausalLM,
                   small(max_position_embeddings=1024,
                         rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256})),
}


def rope_table(model, h, pos):
    """The reference's RoPE table: one, shared by every layer."""
    cos, sin = model.model.rotary_emb(h, pos)
    return {"rope.cos": cos.float(), "rope.sin": sin.float()}


def make(name, cfg_cls, model_cls, kw, tok, out_root, seed, init=None, rope_tables=rope_table):
    """One fixture: the model (weights by `init`, default `randomize`), its tokenizer,
    and reference.safetensors (inputs, logits, losses, `rope_tables`, every gradient of
    the SUM loss); returns the reference tensors."""
    out = os.path.join(out_root, name)
    os.makedirs(out, exist_ok=True)
    torch.manual_seed(seed)
    cfg = cfg_cls(**kw)
    cfg._attn_implementation = "eager"
    model = model_cls(cfg).to(torch.float32)
    (init or randomize)(model, seed)
    model.train()  # dropout is 0; train mode is the path that training takes
    model.save_pretrained(out, safe_serialization=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>").save_pretrained(out)

    ids, pos, targets = batch(tok)
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos).logits.float()  # [B, S, V]
    per_tok = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1),
                              ignore_index=-100, reduction="none").reshape(B, S)
    n = int((targets != -100).sum())
    loss_sum = per_tok.sum()
    loss_sum.backward()  # gradients of the SUM loss

    ref = {
        "input_ids": ids,
        "position_ids": pos,
        "targets": targets,
        "logits": logits.detach(),
        "per_token_loss": per_tok.detach(),
        "loss_sum": loss_sum.detach(),
        "loss_mean": (loss_sum / n).detach(),
        "n_tokens": torch.tensor(n, dtype=torch.int64),
    }
    with torch.no_grad():
        ref.update(rope_tables(model, model.model.embed_tokens(ids), pos))
    for pname, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().max() > 0, f"{name}: {pname} has no gradient"
        ref[f"grad.{pname}"] = p.grad.detach().clone()
    save_file({k: v.contiguous() for k, v in ref.items()}, os.path.join(out, "reference.safetensors"))
    print(f"{name}: loss_mean {float(loss_sum.detach() / n):.6f}, {n} tokens, "
          f"{sum(p.numel() for p in model.parameters())} params")
    return ref


def start():
    """What every fixture script starts from: the output root (argv[1], default
    tests/fixtures), deterministic torch, and the shared tokenizer."""
    out_root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures")
    torch.use_deterministic_algorithms(True)
    tok = train_tokenizer()
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return out_root, tok


def main():
    out_root, tok = start()
    for i, (name, (cfg_cls, model_cls, kw)) in enumerate(FIXTURES.items()):
        make(name, cfg_cls, model_cls, dict(kw), tok, out_root, seed=1234 + i)
    with open(os.path.join(out_root, "README.md"), "w") as f:
        f.write("Generated by scripts/make_fixtures.py (transformers, CPU, float32); do not edit.\n"
                "Each folder: an HF checkpoint + reference.safetensors (see the script's docstring).\n")


if __name__ == "__main__":
    main()
