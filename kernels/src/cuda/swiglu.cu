// SwiGLU: out = silu(gate) · up, silu(g) = g / (1 + e^−g), and its backward:
// dgate = dout · up · σ(g) · (1 + g·(1 − σ(g))),  dup = dout · silu(g); the backward also
// writes the forward's output when `out` is not null (the engine's down-projection weight
// gradient needs it: one pass over gate and up instead of two).
//
// Shapes: gate, up, out, dout, dgate, dup: [n] (T, contiguous; any leading shape flattened).
// Grid-stride over packs of 8 elements (16-byte accesses) when every pointer is 16-byte
// aligned, then the tail (or everything, when not aligned) one element at a time.
#include "common.cuh"

__device__ __forceinline__ float silu_mul(float g, float u) { return g / (1.0f + expf(-g)) * u; }

__device__ __forceinline__ void swiglu_grad(float d, float g, float u, float& dg, float& du) {
    const float sg = 1.0f / (1.0f + expf(-g));
    dg = d * u * sg * (1.0f + g * (1.0f - sg));
    du = d * g * sg;
}

template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, size_t n) {
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (aligned16(gate) && aligned16(up) && aligned16(out)) {
        const size_t packs = n / 8;
        for (size_t p = tid; p < packs; p += stride) {
            float g[8], u[8];
            load8(gate + 8 * p, g);
            load8(up + 8 * p, u);
#pragma unroll
            for (int k = 0; k < 8; ++k) g[k] = silu_mul(g[k], u[k]);
            store8(out + 8 * p, g);
        }
        done = packs * 8;
    }
    for (size_t i = done + tid; i < n; i += stride) out[i] = from_f<T>(silu_mul(to_f(gate[i]), to_f(up[i])));
}

template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ dout, const T* __restrict__ gate, const T* __restrict__ up,
                           T* __restrict__ dgate, T* __restrict__ dup, T* __restrict__ out, size_t n) {
    const size_t tid = (size_t)blockIdx.x * blockDim.x + threadIdx.x, stride = (size_t)gridDim.x * blockDim.x;
    size_t done = 0;
    if (aligned16(dout) && aligned16(gate) && aligned16(up) && aligned16(dgate) && aligned16(dup) && aligned16(out)) {
        const size_t packs = n / 8;
        for (size_t p = tid; p < packs; p += stride) {
            float d[8], g[8], u[8], dg[8], du[8];
            load8(dout + 8 * p, d);
            load8(gate + 8 * p, g);
            load8(up + 8 * p, u);
#pragma unroll
            for (int k = 0; k < 8; ++k) swiglu_grad(d[k], g[k], u[k], dg[k], du[k]);
            store8(dgate + 8 * p, dg);
            store8(dup + 8 * p, du);
            if (out != nullptr) {
#pragma unroll
                for (int k = 0; k < 8; ++k) g[k] = silu_mul(g[k], u[k]);
                store8(out + 8 * p, g);
            }
        }
        done = packs * 8;
    }
    for (size_t i = done + tid; i < n; i += stride) {
        float dg, du;
        const float g = to_f(gate[i]), u = to_f(up[i]);
        swiglu_grad(to_f(dout[i]), g, u, dg, du);
        dgate[i] = from_f<T>(dg);
        dup[i] = from_f<T>(du);
        if (out != nullptr) out[i] = from_f<T>(silu_mul(g, u));
    }
}

#define SWIGLU_KERNELS(T, S)                                                                                   \
    extern "C" __global__ void swiglu_fwd_##S(const T* gate, const T* up, T* out, size_t n) {                  \
        swiglu_fwd<T>(gate, up, out, n);                                                                       \
    }                                                                                                          \
    extern "C" __global__ void swiglu_bwd_##S(const T* dout, const T* gate, const T* up, T* dgate, T* dup,     \
                                              T* out, size_t n) {                                              \
        swiglu_bwd<T>(dout, gate, up, dgate, dup, out, n);                                                     \
    }
FOR_EACH_DTYPE(SWIGLU_KERNELS)
