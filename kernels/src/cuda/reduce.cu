// Whole-tensor reductions that use the whole GPU (Candle's `sum_all` runs one block):
//   sum_squares: per-block partial sums of x² in f64 (x read as f32), grid-stride over n;
//                the caller adds the partials on the host in block order, so the result
//                depends only on n and the grid size (deterministic run to run).
//   count_non_finite: NaN and ±∞ elements of x, added (integer atomics: exact, order-free)
//                into counts[slot].
//
// Shapes: x [n] (T, contiguous); partials [gridDim.x] f64; counts [slots] u32.
#include "common.cuh"

__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

template <typename T>
__device__ void sum_squares(const T* __restrict__ x, size_t n, double* __restrict__ partials) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const double v = (double)to_f(x[i]);
        acc += v * v;
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    acc = warp_sum_d(acc);
    if (lane == 0) scratch[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < nw ? scratch[lane] : 0.0;
        acc = warp_sum_d(acc);
        if (lane == 0) partials[blockIdx.x] = acc;
    }
}

template <typename T>
__device__ void count_non_finite(const T* __restrict__ x, size_t n, unsigned int* __restrict__ counts, unsigned int slot) {
    unsigned int bad = 0;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        bad += isfinite(to_f(x[i])) ? 0u : 1u;
    bad = __reduce_add_sync(0xffffffffu, bad);
    if ((threadIdx.x & 31) == 0 && bad != 0) atomicAdd(&counts[slot], bad);
}

#define REDUCE_KERNELS(T, S)                                                                                   \
    extern "C" __global__ void sum_squares_##S(const T* x, size_t n, double* partials) {                       \
        sum_squares<T>(x, n, partials);                                                                         \
    }                                                                                                          \
    extern "C" __global__ void count_non_finite_##S(const T* x, size_t n, unsigned int* counts, unsigned int slot) { \
        count_non_finite<T>(x, n, counts, slot);                                                                \
    }
FOR_EACH_DTYPE(REDUCE_KERNELS)
