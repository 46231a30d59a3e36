// Register-layout helpers shared by longctx's Hopper attention kernels (native_fwd_sm90.cu,
// native_bwd_sm90.cu): views of a wgmma accumulator fragment, a one-op exp2, named barriers.
#ifndef LONGCTX_NATIVE_COMMON_CUH
#define LONGCTX_NATIVE_COMMON_CUH

#include <cute/tensor.hpp>

#include <atomic>
#include <cstdint>

namespace longctx_native_common {
using namespace cute;

// The accumulator of a 64xN GMMA tile, per thread ((2 cols, 2 rows, N/8), MMA_M, MMA_N),
// as (rows, cols): ((2, MMA_M), (2, N/8, MMA_N)).
template <class Layout>
CUTE_HOST_DEVICE constexpr auto rowcol(Layout l) {
    static_assert(decltype(rank(l))::value == 3);
    static_assert(decltype(rank<0>(l))::value == 3);
    auto l0 = get<0>(l);
    return make_layout(make_layout(get<1>(l0), get<1>(l)), make_layout(get<0>(l0), get<2>(l0), get<2>(l)));
}

// The same registers as the A operand of a K=16 register-source GMMA: each pair of 8-column
// blocks of the accumulator is one 16-wide K slice, in the order wgmma wants its A values.
template <class Layout>
CUTE_HOST_DEVICE constexpr auto acc_as_a(Layout l) {
    auto l0 = get<0>(l);
    auto v = get<2>(l0);  // (N/8) : stride
    static_assert(decltype(size(v))::value % 2 == 0);
    static_assert(decltype(rank(v))::value == 1);
    constexpr int V = decltype(size(v))::value;
    auto pair = make_layout(_2{}, stride(v));                // the two 8-column blocks of one K slice
    auto slices = make_layout(Int<V / 2>{}, stride(v) * _2{});  // the K slices
    return make_layout(make_layout(get<0>(l0), get<1>(l0), pair), get<1>(l), make_layout(slices, get<2>(l)));
}

// 2^x in one instruction (MUFU.EX2); 2^-inf = 0.
__device__ __forceinline__ float ex2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Named barrier `id` (1..15; 0 is __syncthreads) over `threads` threads: sync waits for all
// of them, arrive counts this warp in without waiting.
__device__ __forceinline__ void bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// Host side: cudaFuncSetAttribute(kernel, max dynamic shared memory, bytes) once per kernel
// instantiation and device (the attribute is kept per device; `done` is the caller's static
// bit set over ordinals 0..63, larger ordinals set it on every call). Threads of ranks on other
// devices may race on a first call; both then set the same value.
template <class Kernel>
cudaError_t set_smem_once(std::atomic<uint64_t> &done, Kernel kernel, int bytes, int ordinal) {
    const uint64_t bit = ordinal >= 0 && ordinal < 64 ? uint64_t(1) << ordinal : 0;
    if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
    cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess && bit) done.fetch_or(bit, std::memory_order_release);
    return e;
}

// The order of a causal grid. Its CTAs form `slices` (a head of one batch entry; head
// fastest) of `blocks` each, block 0 the longest. Run slice by slice (block fastest), a
// grid of few waves ends on the last slices' longest blocks: the backward at 8K, 4 KV heads,
// d 64 (64 CTAs a slice, 132 SMs) took 1.51x its balanced time in a simulation and ran at
// 302 TFLOP/s against 413 banded (H200). All slices interleaved
// (block slowest) balance, but then each wave reads every head's operands and the L2 no
// longer holds them: the 64K forward at 32 x 128 fell from 610 to 550 TFLOP/s. So the slices
// go in bands of `width` interleaved slices, the narrowest that divides the slice count and
// holds two waves: band_width(32, 512, 132) = 1 (64K at 32 x 128: slice by slice),
// band_width(4, 64, 132) = 4 (8K, 4 KV heads: all interleaved).
inline int band_width(int slices, int blocks, int sms) {
    for (int w = 1; w < slices; ++w)
        if (slices % w == 0 && int64_t(w) * blocks >= 2 * int64_t(sms)) return w;
    return slices;
}
// Attribute A of device `ordinal`, asked of the driver once per device (ordinals 0..63;
// others are asked every time); -1, and asked again next time, if the driver cannot say.
template <cudaDeviceAttr A>
inline int cached_device_attr(int ordinal) {
    static std::atomic<int> values[64];  // 0: not asked yet
    const bool slot = ordinal >= 0 && ordinal < 64;
    int v = slot ? values[ordinal].load(std::memory_order_relaxed) : 0;
    if (v > 0) return v;
    if (cudaDeviceGetAttribute(&v, A, ordinal) != cudaSuccess || v <= 0) return -1;
    if (slot) values[ordinal].store(v, std::memory_order_relaxed);
    return v;
}
// Streaming multiprocessors of device `ordinal`; 132 (an H100/H200 SXM) if the driver cannot say.
inline int sm_count(int ordinal) {
    const int n = cached_device_attr<cudaDevAttrMultiProcessorCount>(ordinal);
    return n > 0 ? n : 132;
}
// Device side: CTA `l` of a banded grid -> (slice, block index; 0 the longest).
struct BandedCta {
    int slice, block;
};
__device__ __forceinline__ BandedCta banded_cta(int l, int blocks, int width) {
    const int per_band = width * blocks, r = l % per_band;
    return {l / per_band * width + r % width, r / width};
}

}  // namespace longctx_native_common

#endif
