// SwiGLU: out = silu(gate) · up, silu(g) = g / (1 + e^−g), and its backward:
// dgate = dout · up · σ(g) · (1 + g·(1 − σ(g))),  dup = dout · silu(g).
//
// Shapes: gate, up, out, dout, dgate, dup: [n] (T, contiguous; any leading shape flattened).
#include "common.cuh"

template <typename T>
__device__ void swiglu_fwd(const T* __restrict__ gate, const T* __restrict__ up, T* __restrict__ out, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = to_f(gate[i]);
        out[i] = from_f<T>(g / (1.0f + expf(-g)) * to_f(up[i]));
    }
}

template <typename T>
__device__ void swiglu_bwd(const T* __restrict__ dout, const T* __restrict__ gate, const T* __restrict__ up,
                           T* __restrict__ dgate, T* __restrict__ dup, size_t n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float g = to_f(gate[i]), u = to_f(up[i]), d = to_f(dout[i]);
        const float sg = 1.0f / (1.0f + expf(-g));
        dgate[i] = from_f<T>(d * u * sg * (1.0f + g * (1.0f - sg)));
        dup[i] = from_f<T>(d * g * sg);
    }
}

#define SWIGLU_KERNELS(T, S)                                                                                   \
    extern "C" __global__ void swiglu_fwd_##S(const T* gate, const T* up, T* out, size_t n) {                  \
        swiglu_fwd<T>(gate, up, out, n);                                                                       \
    }                                                                                                          \
    extern "C" __global__ void swiglu_bwd_##S(const T* dout, const T* gate, const T* up, T* dgate, T* dup,     \
                                              size_t n) {                                                      \
        swiglu_bwd<T>(dout, gate, up, dgate, dup, n);                                                          \
    }
FOR_EACH_DTYPE(SWIGLU_KERNELS)
