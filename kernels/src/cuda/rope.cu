// Rotary position embedding in place, transformers' rotate_half convention: pairs are
// (i, i + d/2). Forward: y = x·cos + rotate_half(x)·sin. Backward (the transpose of the
// forward, a rotation by −θ when the two halves of the tables agree, as rope.rs builds them):
// dx_i = dy_i·cos_i + dy_{i+d/2}·sin_{i+d/2},  dx_{i+d/2} = dy_{i+d/2}·cos_{i+d/2} − dy_i·sin_i.
//
// Shapes: x [tokens, heads, d] (T, contiguous, updated in place);
//         cos, sin [tokens, d] (C: T or f32), one row per token (its own position).
// Each work item is 8 consecutive pairs (16-byte accesses) when d/2 is a multiple of 8 and
// the pointers are 16-byte aligned, else one pair.
#include "common.cuh"

__device__ __forceinline__ void rotate(float a, float b, float c0, float c1, float s0, float s1, int backward, float& y0,
                                       float& y1) {
    if (backward) {
        y0 = a * c0 + b * s1;
        y1 = b * c1 - a * s0;
    } else {
        y0 = a * c0 - b * s0;
        y1 = b * c1 + a * s1;
    }
}

template <typename T, typename C>
__device__ void rope(T* __restrict__ x, const C* __restrict__ cos, const C* __restrict__ sin, size_t tokens, int heads,
                     int d, int backward) {
    const int half = d / 2;
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    if (half % 8 == 0 && aligned16(x) && aligned16(cos) && aligned16(sin)) {
        const int per = half / 8;
        const size_t items = tokens * heads * per;
        for (size_t p = tid; p < items; p += stride) {
            const int i = (p % per) * 8;
            const size_t th = p / per;  // token * heads + head
            const size_t t = th / heads;
            T* row = x + th * d;
            float a[8], b[8], c0[8], c1[8], s0[8], s1[8];
            load8(row + i, a);
            load8(row + half + i, b);
            load8(cos + t * d + i, c0);
            load8(cos + t * d + half + i, c1);
            load8(sin + t * d + i, s0);
            load8(sin + t * d + half + i, s1);
#pragma unroll
            for (int k = 0; k < 8; ++k) rotate(a[k], b[k], c0[k], c1[k], s0[k], s1[k], backward, a[k], b[k]);
            store8(row + i, a);
            store8(row + half + i, b);
        }
        return;
    }
    const size_t pairs = tokens * heads * half;
    for (size_t p = tid; p < pairs; p += stride) {
        const int i = p % half;
        const size_t th = p / half;
        const size_t t = th / heads;
        T* row = x + th * d;
        const C* c = cos + t * d;
        const C* s = sin + t * d;
        float y0, y1;
        rotate(to_f(row[i]), to_f(row[i + half]), to_f(c[i]), to_f(c[i + half]), to_f(s[i]), to_f(s[i + half]), backward,
               y0, y1);
        row[i] = from_f<T>(y0);
        row[i + half] = from_f<T>(y1);
    }
}

#define ROPE_KERNEL(T, S, C, CS)                                                                                 \
    extern "C" __global__ void rope_##S##_##CS(T* x, const C* cos, const C* sin, size_t tokens, int heads, int d, \
                                               int backward) {                                                    \
        rope<T, C>(x, cos, sin, tokens, heads, d, backward);                                                      \
    }
ROPE_KERNEL(bf16, bf16, bf16, bf16)
ROPE_KERNEL(bf16, bf16, float, f32)
ROPE_KERNEL(f16, f16, f16, f16)
ROPE_KERNEL(f16, f16, float, f32)
ROPE_KERNEL(float, f32, float, f32)
