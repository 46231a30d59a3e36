#!/usr/bin/env python3
"""Packed-document fixture for tests/all/packed_docs.rs (issue #30).

Takes the tiny random checkpoint tests/fixtures/llama_gqa_bias (made by
scripts/make_fixtures.py) and a packed batch of 2 rows x 24 tokens, each row several
documents with position ids restarting at 0 per document, and records what transformers
computes in its packed-sequence path: with `position_ids` given and no attention mask,
transformers 5 (masking_utils.find_packed_sequence_indices) finds the documents from
the position resets and masks attention block-diagonally (its varlen semantics, on every
attention backend). The script also runs every document on its own and asserts that the
per-token losses agree (so the fixture is the "documents one by one" reference too).

tests/fixtures/packed_docs/reference.safetensors:
  input_ids      [2, 24] i64
  position_ids   [2, 24] i64   0.. at every document start
  doc_starts     [2, 24] i64   document starts of each row, padded with -1
  targets        [2, 24] i64   next token within the document, -100 at each document's
                               last token (its next token starts another document)
  per_token_loss [2, 24] f32   0 where ignored
  loss_sum       []      f32
  n_tokens       []      i64
  grad.<param>   gradient of loss_sum w.r.t. every parameter

Usage: python3 scripts/make_packed_fixture.py   (torch + transformers 5, CPU; ATTN=eager
chooses the eager attention instead of sdpa: the same fixture)
"""

import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM

ROOT = os.path.join(os.path.dirname(__file__), "..")
SRC = os.path.join(ROOT, "tests/fixtures/llama_gqa_bias")
OUT = os.path.join(ROOT, "tests/fixtures/packed_docs")
S = 24
# Row 0: documents of 9, 1, 3 and 11 tokens; row 1: 2, 14 and 8.
STARTS = [[0, 9, 10, 13], [0, 2, 16]]


def main():
    model = AutoModelForCausalLM.from_pretrained(SRC, dtype=torch.float32, attn_implementation=os.environ.get("ATTN", "sdpa"))
    model.train()
    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(30)
    ids = torch.randint(3, vocab, (len(STARTS), S), generator=g)
    pos = torch.zeros_like(ids)
    targets = torch.full_like(ids, -100)
    for r, starts in enumerate(STARTS):
        ends = starts[1:] + [S]
        for a, b in zip(starts, ends):
            pos[r, a:b] = torch.arange(b - a)
            targets[r, a:b - 1] = ids[r, a + 1:b]
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits.float()  # no cache: the packed path
    per_tok = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1), ignore_index=-100, reduction="none").reshape(ids.shape)
    loss_sum = per_tok.sum()
    loss_sum.backward()
    # Every document alone gives the same per-token losses.
    with torch.no_grad():
        for r, starts in enumerate(STARTS):
            for a, b in zip(starts, starts[1:] + [S]):
                one = model(input_ids=ids[r:r + 1, a:b]).logits.float()[0]
                t = targets[r, a:b]
                lone = F.cross_entropy(one, t, ignore_index=-100, reduction="none")
                err = (lone - per_tok[r, a:b]).abs().max().item()
                assert err < 1e-5, f"row {r} document {a}..{b}: packed and alone differ by {err}"
        # And without the position resets the packed forward differs (the mask is real).
        plain = model(input_ids=ids, use_cache=False).logits.float()
        assert (plain - logits).abs().max().item() > 1e-3
    doc_starts = torch.full_like(ids, -1)
    for r, starts in enumerate(STARTS):
        doc_starts[r, :len(starts)] = torch.tensor(starts)
    ref = {
        "input_ids": ids,
        "position_ids": pos,
        "doc_starts": doc_starts,
        "targets": targets,
        "per_token_loss": per_tok.detach(),
        "loss_sum": loss_sum.detach(),
        "n_tokens": torch.tensor(int((targets != -100).sum()), dtype=torch.int64),
    }
    for name, p in model.named_parameters():
        ref[f"grad.{name}"] = p.grad.detach().clone()
    os.makedirs(OUT, exist_ok=True)
    tmp = os.path.join(OUT, "reference.safetensors.tmp")
    save_file({k: v.contiguous() for k, v in ref.items()}, tmp)
    os.replace(tmp, os.path.join(OUT, "reference.safetensors"))
    import transformers
    print(f"packed_docs: loss_sum {loss_sum.item():.6f}, {int(ref['n_tokens'])} tokens, transformers {transformers.__version__}", file=sys.stderr)


if __name__ == "__main__":
    main()
