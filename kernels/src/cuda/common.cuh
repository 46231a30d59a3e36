// Shared helpers of the longctx kernels: element conversions (f32 math inside, one
// round-to-nearest-even on the way out, as the CPU twins do with the `half` crate) and
// block reductions.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

typedef __nv_bfloat16 bf16;
typedef __half f16;

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(bf16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(f16 x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ bf16 from_f<bf16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ f16 from_f<f16>(float x) { return __float2half_rn(x); }

// x rounded to T and back (the value a tensor of dtype T would hold).
template <typename T> __device__ __forceinline__ float round_to(float x) { return to_f(from_f<T>(x)); }

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over the block, returned to every thread. blockDim.x must be a multiple of 32
// (at most 1024); `scratch` holds 32 floats. Safe to call repeatedly (syncs on entry).
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

__device__ __forceinline__ float block_max(float v, float* scratch) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nw ? scratch[lane] : -INFINITY;
    return warp_max(v);
}

// Vector access: 8 consecutive elements (16 bytes of bf16/f16, 32 of f32) through 16-byte
// loads and stores. The pointer must be 16-byte aligned (see `aligned16`).
template <typename T> struct alignas(16) Pack16 { T v[16 / sizeof(T)]; };

__device__ __forceinline__ bool aligned16(const void* p) { return p == nullptr || ((uintptr_t)p & 15u) == 0; }

template <typename T> __device__ __forceinline__ void load8(const T* __restrict__ p, float* out) {
    constexpr int N = 16 / sizeof(T);
#pragma unroll
    for (int q = 0; q < 8 / N; ++q) {
        const Pack16<T> pk = reinterpret_cast<const Pack16<T>*>(p)[q];
#pragma unroll
        for (int k = 0; k < N; ++k) out[q * N + k] = to_f(pk.v[k]);
    }
}

template <typename T> __device__ __forceinline__ void store8(T* __restrict__ p, const float* in) {
    constexpr int N = 16 / sizeof(T);
#pragma unroll
    for (int q = 0; q < 8 / N; ++q) {
        Pack16<T> pk;
#pragma unroll
        for (int k = 0; k < N; ++k) pk.v[k] = from_f<T>(in[q * N + k]);
        reinterpret_cast<Pack16<T>*>(p)[q] = pk;
    }
}

// One instantiation per activation dtype, named `<name>_<suffix>`.
#define FOR_EACH_DTYPE(M) M(bf16, bf16) M(f16, f16) M(float, f32)
