// Gradient accumulation into an f32 buffer, in place: acc ← acc + alpha·x.
//
// Shapes: acc [n] f32 (contiguous, updated), x [n] (T, contiguous).
#include "common.cuh"

template <typename T>
__device__ void accumulate(float* __restrict__ acc, const T* __restrict__ x, size_t n, float alpha) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        acc[i] = __fadd_rn(acc[i], __fmul_rn(alpha, to_f(x[i])));
}

#define ACC_KERNEL(T, S)                                                                      \
    extern "C" __global__ void accumulate_##S(float* acc, const T* x, size_t n, float alpha) { \
        accumulate<T>(acc, x, n, alpha);                                                      \
    }
FOR_EACH_DTYPE(ACC_KERNEL)
