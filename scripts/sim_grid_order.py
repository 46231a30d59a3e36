#!/usr/bin/env python3
"""List-scheduling model of the native attention kernels' causal grids (docs/benchmarks.md,
"The blocks of the sequence-parallel modes"): one CTA per SM, each SM takes the next CTA of
the launch order when it frees, a CTA lasts as many steps as it has work. Prints, per shape,
the makespan over the balanced time (total work / SMs) for three launch orders:
slice by slice (block fastest: the kernels before session 23), every slice interleaved
(block slowest), and the bands of `band_width` (attention/csrc/native_common.cuh).

Usage: scripts/sim_grid_order.py [--sms 132]
"""
import argparse
import heapq


def makespan(works, sms):
    free = [0.0] * sms
    for w in works:
        heapq.heappush(free, heapq.heappop(free) + w)
    return max(free)


def band_width(slices, blocks, sms):
    for w in range(1, slices):
        if slices % w == 0 and w * blocks >= 2 * sms:
            return w
    return slices


def order(slices, blocks, work, width):
    """Work of each CTA in launch order: bands of `width` slices, block slowest in a band."""
    return [work(i) for _ in range(0, slices, width) for i in range(blocks) for _ in range(width)]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sms", type=int, default=132, help="streaming multiprocessors (H100/H200 SXM: 132)")
    sms = ap.parse_args().sms
    k = 1024
    shapes = []
    for s in (8 * k, 16 * k, 32 * k, 64 * k):
        # backward: a CTA per 128 keys of a KV head, walking every query block (64 rows at
        # d 128, 128 at d 64) from its diagonal down, for each query head of its group
        nb = s // 128
        shapes.append((f"bwd 32/4 x 64, {s // k}K", 4, nb, lambda n, mb=s // 128: (mb - n) * 8))
        shapes.append((f"bwd 32 x 128, {s // k}K", 32, nb, lambda n, mb=s // 64: mb - 2 * n))
        # forward: a CTA per query block (192 rows at d 64, 128 at d 128), its keys up to the diagonal
        m64, m128 = -(-s // 192), s // 128
        shapes.append((f"fwd 32/4 x 64, {s // k}K", 32, m64, lambda i, m=m64, s=s: min(s, (m - i) * 192) / 128))
        shapes.append((f"fwd 32 x 128, {s // k}K", 32, m128, lambda i, m=m128: m - i))
    print(f"{'shape':24} {'slice by slice':>15} {'interleaved':>12} {'banded':>8} {'band':>5}")
    for name, slices, blocks, work in shapes:
        ideal = sum(work(i) for i in range(blocks)) * slices / sms
        w = band_width(slices, blocks, sms)
        r = [makespan(order(slices, blocks, work, x), sms) / ideal for x in (1, slices, w)]
        print(f"{name:24} {r[0]:15.3f} {r[1]:12.3f} {r[2]:8.3f} {w:5d}")


if __name__ == "__main__":
    main()
