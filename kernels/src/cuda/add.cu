// Element-wise sums of activations: out = a + b (+ c), f32 math, one rounding to T.
// The residual adds and the sums of a layer's input gradients (q, k, v; gate and up);
// `out` may be rows of a larger buffer (the layer output written in place).
//
// Shapes: a, b, c (optional: null), out: [n] (T, contiguous; any leading shape flattened).
// Grid-stride over packs of 8 elements (16-byte accesses) when every pointer is 16-byte
// aligned, then the tail (or everything, when not aligned) one element at a time.
#include "common.cuh"

template <typename T>
__device__ void add_n(const T* __restrict__ a, const T* __restrict__ b, const T* __restrict__ c, T* __restrict__ out,
                      size_t n) {
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (aligned16(a) && aligned16(b) && aligned16(c) && aligned16(out)) {
        const size_t packs = n / 8;
        for (size_t p = tid; p < packs; p += stride) {
            float x[8], y[8];
            load8(a + 8 * p, x);
            load8(b + 8 * p, y);
#pragma unroll
            for (int k = 0; k < 8; ++k) x[k] += y[k];
            if (c != nullptr) {
                load8(c + 8 * p, y);
#pragma unroll
                for (int k = 0; k < 8; ++k) x[k] += y[k];
            }
            store8(out + 8 * p, x);
        }
        done = packs * 8;
    }
    for (size_t i = done + tid; i < n; i += stride) {
        float s = to_f(a[i]) + to_f(b[i]);
        if (c != nullptr) s += to_f(c[i]);
        out[i] = from_f<T>(s);
    }
}

#define ADD_KERNEL(T, S)                                                                        \
    extern "C" __global__ void add_##S(const T* a, const T* b, const T* c, T* out, size_t n) { \
        add_n<T>(a, b, c, out, n);                                                              \
    }
FOR_EACH_DTYPE(ADD_KERNEL)
