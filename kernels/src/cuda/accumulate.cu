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

// The embedding's weight gradient, in place: slot[ids[r], :] += scale · g[r, :] for every
// row r (rows with the same id add up: f32 atomics, in no fixed order).
//
// Shapes: slot [vocab, h] f32 (contiguous, updated), ids [rows] u32, g [rows, h] (T,
// contiguous). One block per row at a time (grid-stride), threads over consecutive columns
// (each warp's atomics cover 128 contiguous bytes). An id ≥ vocab adds nothing (the CPU
// twin refuses it).
template <typename T>
__device__ void embed_grad_add(float* slot, const unsigned* __restrict__ ids, const T* __restrict__ g, size_t rows, int h,
                               unsigned vocab, float scale) {
    for (size_t r = blockIdx.x; r < rows; r += gridDim.x) {
        const unsigned id = ids[r];
        if (id >= vocab) continue;
        float* dst = slot + (size_t)id * h;
        const T* src = g + r * h;
        for (int j = threadIdx.x; j < h; j += blockDim.x) atomicAdd(dst + j, __fmul_rn(scale, to_f(src[j])));
    }
}

#define EMBED_KERNEL(T, S)                                                                                            \
    extern "C" __global__ void embed_grad_add_##S(float* slot, const unsigned* ids, const T* g, size_t rows, int h,   \
                                                  unsigned vocab, float scale) {                                      \
        embed_grad_add<T>(slot, ids, g, rows, h, vocab, scale);                                                       \
    }
FOR_EACH_DTYPE(EMBED_KERNEL)
