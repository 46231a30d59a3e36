#!/usr/bin/env python3
"""The PyTorch peer of `longctx train` on one GPU: Hugging Face transformers' Llama with
the TinyLlama-1.1B shape (random init, nothing downloaded), bf16 weights, SDPA attention
(cuDNN on Hopper), gradient checkpointing, fused AdamW, batch 1, labels = input ids.

    bench_train_torch.py --seq 16384,65536 [--steps 4] [--out results.jsonl]

Prints one JSON line per sequence length: tokens/s over the steps after the first (the
first pays for warm-up), MFU with longctx's formula (6·params + 6·layers·hidden·seq
FLOPs per token, 989 TFLOP/s peak), device peak memory (torch.cuda.max_memory_allocated
and reserved), per-step seconds and losses. An out-of-memory run is reported, not raised.
"""
import argparse
import json
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

PEAK_FLOPS = 989e12  # as src/train/metrics.rs

# TinyLlama-1.1B (what `builtin:tinyllama-1.1b-shape` mirrors).
SHAPE = dict(
    vocab_size=32000,
    hidden_size=2048,
    intermediate_size=5632,
    num_hidden_layers=22,
    num_attention_heads=32,
    num_key_value_heads=4,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
)


def run(seq: int, steps: int, theta: float) -> dict:
    torch.manual_seed(0)
    cfg = LlamaConfig(**SHAPE, max_position_embeddings=seq, rope_theta=theta)
    cfg._attn_implementation = "sdpa"
    model = LlamaForCausalLM(cfg).to(device="cuda", dtype=torch.bfloat16)
    model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train()
    params = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    gen = torch.Generator(device="cpu").manual_seed(1)
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for _ in range(steps):
        ids = torch.randint(0, SHAPE["vocab_size"], (1, seq), generator=gen).cuda()
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # synchronises
        times.append(time.perf_counter() - t)
    timed = times[1:] or times
    tok_s = seq * len(timed) / sum(timed)
    flops_tok = 6 * params + 6 * SHAPE["num_hidden_layers"] * SHAPE["hidden_size"] * seq
    return {
        "side": "transformers",
        "seq": seq,
        "tokens_per_s": tok_s,
        "mfu": tok_s * flops_tok / PEAK_FLOPS,
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "step_seconds": [round(x, 3) for x in times],
        "losses": [round(x, 5) for x in losses],
        "params": params,
        "torch": torch.__version__,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", default="16384,65536", help="comma-separated sequence lengths")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per length (the first is not timed)")
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--out", help="append the JSON lines to this file too")
    a = ap.parse_args()
    for seq in (int(s) for s in a.seq.split(",")):
        try:
            r = run(seq, a.steps, a.rope_theta)
        except torch.OutOfMemoryError as e:
            r = {"side": "transformers", "seq": seq, "error": f"out of memory: {str(e).splitlines()[0]}"}
        torch.cuda.empty_cache()
        line = json.dumps(r)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
