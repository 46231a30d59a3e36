#!/usr/bin/env python3
"""PyTorch SDPA on the shapes of `longctx bench attention`, for a same-session comparison.

Causal attention, q/k/v laid out [b, s, h, d] in memory (BSHD, as longctx stores them)
and passed to SDPA as [b, h, s, d] views; backends: FlashAttention-2 (SDPBackend.FLASH_ATTENTION)
and cuDNN (SDPBackend.CUDNN_ATTENTION). Each timing is the median of --iters single calls
(CUDA events around each call) after --warmup calls.
FLOP counts as in longctx: causal fwd = 4*b*h*s^2*d/2, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd.

Usage: python3 scripts/bench_torch_sdpa.py [--seq 16384,65536,131072] [--heads 32] [--head-dim 128]
"""
import argparse
import statistics

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
import torch.nn.functional as F


def timed(fn, warmup, iters):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        ts.append(start.elapsed_time(end) / 1e3)
    return statistics.median(ts)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", default="16384,65536,131072")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--backends", default="cudnn,flash")
    a = p.parse_args()

    b, h, d = a.batch, a.heads, a.head_dim
    dev = torch.device("cuda")
    backends = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION}
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    print(f"causal attention, bf16, b={b}, heads {h} x {d}; median of {a.iters} after {a.warmup} warmup")
    print("FLOP: fwd = 4*b*h*s^2*d/2, bwd = 2.5*fwd, fwd+bwd = 3.5*fwd\n")
    print("| backend | seq | fwd ms | fwd TFLOP/s | bwd ms | bwd TFLOP/s | fwd+bwd ms | fwd+bwd TFLOP/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in a.backends.split(","):
        for s in (int(x) for x in a.seq.split(",")):
            # BSHD storage, BHSD view
            mk = lambda: torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
            q, k, v = mk(), mk(), mk()
            g = torch.randn(b, s, h, d, device=dev, dtype=torch.bfloat16).transpose(1, 2)
            scale = d ** -0.5
            try:
                with sdpa_kernel([backends[name]]):
                    fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
                    t_f = timed(lambda: fwd().detach(), a.warmup, a.iters)
                    out = fwd()
                    t_b = timed(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True), a.warmup, a.iters)
                    t_fb = timed(lambda: torch.autograd.grad(fwd(), (q, k, v), g), a.warmup, a.iters)
                    del out
            except RuntimeError as e:
                print(f"| {name} | {s} | failed: {str(e).splitlines()[0]} | | | | | |")
                continue
            f = 4 * b * h * s * s * d / 2
            tf = lambda flop, t: flop / t / 1e12
            print(f"| {name} | {s} | {t_f*1e3:.2f} | {tf(f, t_f):.0f} | {t_b*1e3:.2f} | {tf(2.5*f, t_b):.0f} "
                  f"| {t_fb*1e3:.2f} | {tf(3.5*f, t_fb):.0f} |", flush=True)
            del q, k, v, g
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
