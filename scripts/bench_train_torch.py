#!/usr/bin/env python3
"""The PyTorch peer of `longctx train` on one GPU: Hugging Face transformers' Llama with
the TinyLlama-1.1B or Llama-2-7B shape (random init, nothing downloaded), bf16 weights,
SDPA attention, gradient checkpointing, fused AdamW on the GPU, batch 1, labels = input ids.

    bench_train_torch.py --seq 16384,65536 [--shape tinyllama|llama2-7b] [--steps 4] [--out results.jsonl]

Run it as a user does: in the environment PyTorch was installed into, nothing of longctx's
exported (scripts/bench_train_compare.sh sets LD_LIBRARY_PATH for the longctx binary only;
the system CUDA libraries on LD_LIBRARY_PATH once cost this side 26 % at 64K). Each line
records torch, CUDA, cuDNN and transformers versions, LD_LIBRARY_PATH as this process saw
it, and the SDPA backend that ran (the attention kernels seen by torch.profiler in the
first, untimed step: cudnn, flash or efficient).

Prints one JSON line per sequence length: tokens/s over the steps after the first (the
first pays for warm-up), MFU with longctx's formula (6·params + 6·layers·hidden·seq
FLOPs per token, 989 TFLOP/s peak), device peak memory (torch.cuda.max_memory_allocated
and reserved), per-step seconds and losses. An out-of-memory run is reported, not raised.
"""
import argparse
import json
import time

import os

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

PEAK_FLOPS = 989e12  # as src/train/metrics.rs

# What `builtin:tinyllama-1.1b-shape` and `builtin:llama2-7b-shape` mirror.
SHAPES = {
    "tinyllama": dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
    "llama2-7b": dict(
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    ),
}
SHAPE = SHAPES["tinyllama"]


def attention_backend(names) -> str:
    """The SDPA backend from the names of the kernels that ran."""
    found = set()
    for n in names:
        n = n.lower()
        if "cudnn" in n or "sm90_flash" in n or "fprop" in n and "attn" in n:
            found.add("cudnn")
        elif "flash" in n:
            found.add("flash")
        elif "fmha" in n or "efficient_attention" in n or "mem_eff" in n:
            found.add("efficient")
    return "+".join(sorted(found)) or "math (no fused attention kernel seen)"


def versions() -> dict:
    return {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "ld_library_path": os.environ.get("LD_LIBRARY_PATH"),
    }


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
    kernels = []
    for i in range(steps):
        ids = torch.randint(0, SHAPE["vocab_size"], (1, seq), generator=gen).cuda()
        torch.cuda.synchronize()
        prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) if i == 0 else None
        if prof:
            prof.__enter__()
        t = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(out.loss.item())  # synchronises
        times.append(time.perf_counter() - t)
        if prof:
            prof.__exit__(None, None, None)
            kernels = [e.key for e in prof.key_averages()]
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
        "sdpa_backend": attention_backend(kernels),
        "attention_kernels": sorted({k[:100] for k in kernels if any(w in k.lower() for w in ("attn", "attention", "fmha", "flash", "cudnn", "sdpa"))})[:8],
        **versions(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seq", default="16384,65536", help="comma-separated sequence lengths")
    ap.add_argument("--steps", type=int, default=4, help="optimizer steps per length (the first is not timed)")
    ap.add_argument("--rope-theta", type=float, default=1e6)
    ap.add_argument("--shape", default="tinyllama", choices=sorted(SHAPES))
    ap.add_argument("--label", default=None, help="a label recorded in each line (the row of a table)")
    ap.add_argument("--out", help="append the JSON lines to this file too")
    a = ap.parse_args()
    global SHAPE
    SHAPE = SHAPES[a.shape]
    for seq in (int(s) for s in a.seq.split(",")):
        try:
            r = run(seq, a.steps, a.rope_theta)
        except torch.OutOfMemoryError as e:
            r = {"side": "transformers", "seq": seq, "error": f"out of memory: {str(e).splitlines()[0]}", **versions()}
        r["shape"], r["label"] = a.shape, a.label
        torch.cuda.empty_cache()
        line = json.dumps(r)
        print(line, flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(line + "\n")


if __name__ == "__main__":
    main()
