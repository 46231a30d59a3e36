// Rotary position embedding in place, transformers' rotate_half convention: pairs are
// (i, i + d/2). Forward: y = x·cos + rotate_half(x)·sin. Backward (the transpose of the
// forward, a rotation by −θ when the two halves of the tables agree, as rope.rs builds them):
// dx_i = dy_i·cos_i + dy_{i+d/2}·sin_{i+d/2},  dx_{i+d/2} = dy_{i+d/2}·cos_{i+d/2} − dy_i·sin_i.
//
// Shapes: x [tokens, heads, d] (T, contiguous, updated in place);
//         cos, sin [tokens, d] (C: T or f32), one row per token (its own position).
#include "common.cuh"

template <typename T, typename C>
__device__ void rope(T* __restrict__ x, const C* __restrict__ cos, const C* __restrict__ sin, size_t tokens, int heads,
                     int d, int backward) {
    const int half = d / 2;
    const size_t pairs = tokens * heads * half;
    for (size_t p = (size_t)blockIdx.x * blockDim.x + threadIdx.x; p < pairs; p += (size_t)gridDim.x * blockDim.x) {
        const int i = p % half;
        const size_t th = p / half;  // token * heads + head
        const size_t t = th / heads;
        T* row = x + th * d;
        const C* c = cos + t * d;
        const C* s = sin + t * d;
        const float a = to_f(row[i]), b = to_f(row[i + half]);
        const float c0 = to_f(c[i]), c1 = to_f(c[i + half]), s0 = to_f(s[i]), s1 = to_f(s[i + half]);
        float y0, y1;
        if (backward) {
            y0 = a * c0 + b * s1;
            y1 = b * c1 - a * s0;
        } else {
            y0 = a * c0 - b * s0;
            y1 = b * c1 + a * s1;
        }
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
