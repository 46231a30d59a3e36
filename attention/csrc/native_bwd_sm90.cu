// longctx's own attention backward for Hopper (sm_90a), on CuTe primitives, beside the
// forward of native_fwd_sm90.cu (issue #36). Three launches on the caller's stream:
//   1. prep:  D = rowsum(dO ∘ O) and lse·log2(e) per query row into a padded f32 workspace
//             (+inf for padding rows and rows without keys: their P is 0), dQ's f32
//             accumulator zeroed;
//   2. main:  one CTA per (KV block of 128 keys, KV head, batch) keeps K and V in shared
//             memory and walks every query block of every query head of its group that the
//             mask lets see its keys. Per query block of BM rows (64 at d 128, 128 at
//             d 64), with the keys as the M
//             dimension of every product (S and dP come out transposed, so P and dS are in
//             registers as the A operand of the dV and dK products):
//               Sᵀ = K·Qᵀ, dPᵀ = V·dOᵀ        (wgmma, both operands in shared memory)
//               Pᵀ = exp2(Sᵀ·scale·log2e − lse·log2e), dSᵀ = Pᵀ ∘ (dPᵀ − D)
//               dV += Pᵀ·dO, dK += dSᵀ·Q     (wgmma, Pᵀ / dSᵀ from registers)
//               dQ_part = dS·K                (wgmma from shared memory, dSᵀ stored there)
//             and dQ_part is added to the f32 accumulator by a bulk asynchronous reduction
//             (cp.reduce.async.bulk .add.f32) from shared memory, so CTAs of other key
//             blocks add theirs without atomics per element. dK (·scale) and dV are written
//             once at the end: a KV head's gradient sums its group's query heads in
//             registers, so GQA needs no reduction across CTAs. dQ_part needs both consumer
//             warpgroups' dSᵀ, so they meet once per step.
//   3. post:  dQ = scale · accumulator, converted to the element type.
//
// Shape legend (the contract of csrc/cudnn_sdpa.h, every tensor contiguous, row-major):
//   q, o, do, dq [b, s, hq, d]   k, v, dk, dv [b, t, hkv, d]   lse [b, hq, s] f32, natural log
//   workspace: lse2, D [b, hq, s_pad] f32 (s_pad = s rounded up to BM); dq_acc
//   [b, hq, s_pad/64, 64·d] f32 in the order the main kernel's threads hold it, in 64x64
//   tiles (post reads it back with the same MMA partition)
//   main CTA: two consumer warpgroups of 64 keys each and a producer warpgroup (one thread
//   issues the TMA loads of Q, dO per query block and bulk loads of lse2 and D, two stages).
//
// Covered: d ∈ {64, 128}; bf16 and f16; GQA; no mask, or top-left causal with s == t.
// Anything else answers LONGCTX_SDPA_UNSUPPORTED (the caller falls back to cuDNN).

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdio>

#include "native_common.cuh"
#include "native_fmha.h"

// Phase clock of the main kernel's consumer steps, for tuning: built only with
// -DLONGCTX_NATIVE_PROFILE=1 (scripts/build_native_check.sh --profile), where thread 0 of
// each consumer warpgroup adds the SM cycles of each phase of each step to shared memory and
// the CTA's sums to a device array; longctx_native_bwd_profile reads and clears it. Without
// the macro the phase marks are empty and the machine code is that of the plain kernel.
#if LONGCTX_NATIVE_PROFILE
#define LONGCTX_BWD_PHASES 9
__device__ unsigned long long longctx_bwd_phase_cycles[2][LONGCTX_BWD_PHASES + 1];
extern "C" int longctx_native_bwd_profile(unsigned long long *out) {
    static const unsigned long long zero[2][LONGCTX_BWD_PHASES + 1] = {};
    cudaError_t e = cudaMemcpyFromSymbol(out, longctx_bwd_phase_cycles, sizeof(zero));
    if (e == cudaSuccess) e = cudaMemcpyToSymbol(longctx_bwd_phase_cycles, zero, sizeof(zero));
    return e == cudaSuccess ? 0 : 1;
}
#define BWD_PHASE(i)                                \
    do {                                            \
        const unsigned now_ = clock();              \
        if (wtid == 0) phase_sum[wg][i] += now_ - phase_t0; \
        phase_t0 = now_;                            \
    } while (0)
#else
#define BWD_PHASE(i) \
    do {             \
    } while (0)
#endif

namespace longctx_nbwd {
using namespace cute;
using namespace longctx_native_common;

template <class Element_, int kHeadDim_>
struct BwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    // query rows per step: 64 at d 128 (Sᵀ, dPᵀ, dK and dV fill the registers), 128 at d 64,
    // where Sᵀ and dPᵀ are then 64x128 per warpgroup: an N of 128 halves the shared-memory
    // reads per FLOP of those two products and halves the steps
    static constexpr int kBlockM = kHeadDim == 64 ? 128 : 64;
    static constexpr int kBlockN = 128;  // keys per CTA, 64 per consumer warpgroup
    // Tunables of the d 128 kernel, for timing variants (scripts/build_native_check.sh
    // --variant; on the H200 neither a third stage nor a second dQ buffer gained: the step is
    // bound by shared-memory bandwidth, docs/benchmarks.md); d 64 keeps 2 and 1 (a third
    // stage does not fit its shared memory, and a second dQ buffer made ptxas spill at d 64
    // causal).
#ifndef LONGCTX_BWD_D128_STAGES
#define LONGCTX_BWD_D128_STAGES 2
#endif
#ifndef LONGCTX_BWD_D128_DQ_BUFS
#define LONGCTX_BWD_D128_DQ_BUFS 1
#endif
    // Q, dO, lse2, D stages
    static constexpr int kStages = kHeadDim == 128 ? LONGCTX_BWD_D128_STAGES : 2;
    // dQ_part buffers per consumer warpgroup: with two, a step's store need not wait for the
    // previous step's bulk reduction to have read its buffer
    static constexpr int kDqBufs = kHeadDim == 128 ? LONGCTX_BWD_D128_DQ_BUFS : 1;
    static_assert(kDqBufs == 1 || kDqBufs == 2);
    // Issue the next step's Sᵀ as soon as this step's dQ_part has left the registers (behind
    // this step's dK), so that it runs under the dQ store instead of at the head of the next
    // step, where the warpgroups had nothing to do but wait for it (bit 0: d 128, bit 1:
    // d 64). H200, causal, bwd TFLOP/s at 32 × 128, two rounds against the plain build in
    // one visit: 64K 562.4 / 562.8 against 541.7 / 545.4, 16K 524.1 / 521.8 against 505.8 /
    // 505.4. At d 64 (Sᵀ is 64 × 128 there) ptxas spills 48 bytes and serialises the wgmma
    // (C7512), so d 64 keeps the plain order.
#ifndef LONGCTX_BWD_EARLY_S
#define LONGCTX_BWD_EARLY_S 1
#endif
    static constexpr bool kEarlyS = (LONGCTX_BWD_EARLY_S >> (kHeadDim == 128 ? 0 : 1)) & 1;
    static_assert(!kEarlyS || kStages >= 2, "the next step's Sᵀ reads the next stage");
    // two consumer warpgroups (threads 0-255) and a producer warpgroup, which hands its
    // registers to the consumers (setmaxnreg: 240 each for dK, dV, Sᵀ, dPᵀ and dQ; without
    // it 384 threads are capped at 168, and nine warps cannot hold more than that either:
    // one scheduler would carry three of them)
    static constexpr int kConsumers = 256;
    static constexpr int kThreads = kConsumers + 128;
    // dQ_part = dS·K: each consumer warpgroup computes one 64-row x 64-column tile of it over
    // all 128 keys (so it needs both warpgroups' dSᵀ). At d 128 (one 64-row query block) the
    // warpgroups split the head dim (kDqSplitD); at d 64 each takes 64 of the 128 query rows.
    static constexpr bool kDqSplitD = kBlockM == 64;
    static constexpr int kDqCols = kDqSplitD ? kHeadDim / 2 : kHeadDim;
    static_assert(kDqCols == 64 && kBlockM / (kDqSplitD ? 1 : 2) == 64);
    // K and V in 128-byte swizzle atoms (64 head-dim columns wide), so that dQ's B operand
    // (Kᵀ, or one head-dim half of it at d 128) is a plain sub-tile of K's shared memory
    using AtomKV = GMMA::Layout_K_SW128_Atom<Element>;
    using AtomKVt = GMMA::Layout_MN_SW128_Atom<Element>;
    using SmemLayoutKV = decltype(tile_to_shape(AtomKV{}, Shape<Int<kBlockN>, Int<kHeadDim>>{}));
    // 64 head-dim columns of K, as dQ's (d, keys) B operand, d-major
    using SmemLayoutKt = decltype(tile_to_shape(AtomKVt{}, Shape<Int<kDqCols>, Int<kBlockN>>{}));
    using SmemLayoutQ = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               Shape<Int<kBlockM>, Int<kHeadDim>, Int<kStages>>{}));
    // Q and dO read as the (d, query) B operand of dK and dV, d-major
    using SmemLayoutQt = decltype(composition(
        SmemLayoutQ{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockM>, Int<kStages>>{}, Step<_2, _1, _3>{})));
    // dS as dQ's (query, key) A operand, query-major, in tiles of 64 queries x 128 keys: index
    // buffer · (kBlockM / 64) + query tile; two buffers. Written from the Sᵀ accumulator.
    static constexpr int kDsTiles = kBlockM / 64;
    using SmemLayoutdS = decltype(tile_to_shape(GMMA::Layout_MN_SW128_Atom<Element>{},
                                                Shape<_64, Int<kBlockN>, Int<2 * kDsTiles>>{}));

    using MmaSdP = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kBlockM>, Int<kHeadDim>>>(),
        Layout<Shape<_2, _1, _1>>{}));
    using MmaDKV = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockN>, Int<kHeadDim>, Int<kBlockM>>,
                             GMMA::Major::K, GMMA::Major::MN>(),
        Layout<Shape<_2, _1, _1>>{}));
    using MmaDQ = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<_64, Int<kDqCols>, Int<kBlockN>>, GMMA::Major::MN,
                             GMMA::Major::MN>(),
        Layout<Shape<_1, _1, _1>>{}));
    static constexpr int kDqPerThread = 64 * kDqCols / 128;  // f32 values of dQ_part per thread
    static_assert(kDqPerThread % 4 == 0);

    struct Smem {
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutKV>> k;
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutKV>> v;
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutQ>> q;
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutQ>> d_o;
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutdS>> ds;
        alignas(128) float dq[2][kDqBufs][64 * kDqCols];  // dQ_part buffers per consumer warpgroup
        alignas(16) float lse2[kStages][kBlockM];
        alignas(16) float dd[kStages][kBlockM];
        alignas(8) uint64_t bar_kv;
        uint64_t bar_full[kStages];
        uint64_t bar_empty[kStages];
    };
    static_assert(sizeof(Smem) <= 232448, "more than the 227 KiB of shared memory a CTA may have on sm_90");
};

template <class TmaQ, class TmaDO, class TmaK, class TmaV, class Element>
struct BwdParams {
    TmaQ tma_q;
    TmaDO tma_do;
    TmaK tma_k;
    TmaV tma_v;
    const float *lse2, *dd;  // workspace [b, hq, s_pad]
    float *dq_acc;           // workspace [b, hq, s_pad / 64, 64·d]
    Element *dk, *dv;
    int b, s, t, hq, hkv, s_pad;
    float scale, scale_log2;
    int band;  // causal: KV heads per band of the grid (band_width)
};

// shared -> global f32 add of `bytes` (a multiple of 16, both 16-byte aligned), asynchronous
__device__ __forceinline__ void bulk_reduce_add(float *gmem, const float *smem, int bytes) {
    asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;" ::"l"(gmem),
                 "r"(cast_smem_ptr_to_uint(smem)), "r"(bytes)
                 : "memory");
}
__device__ __forceinline__ void bulk_load(void *smem, const void *gmem, int bytes, uint64_t *bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     cast_smem_ptr_to_uint(smem)),
                 "l"(gmem), "r"(bytes), "r"(cast_smem_ptr_to_uint(bar))
                 : "memory");
}

// One warp per padded query row: lse2 = lse·log2(e) (+inf where the row has no keys or is
// padding), D = Σ_d dO·O.
template <class Element, int D>
__global__ void prep_kernel(const Element *o, const Element *d_o, const float *lse, float *lse2, float *dd, int b,
                            int s, int hq, int s_pad) {
    const int64_t warp = (int64_t(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
    const int lane = threadIdx.x % 32;
    if (warp >= int64_t(b) * hq * s_pad) return;
    const int row = int(warp % s_pad);
    const int64_t bh = warp / s_pad;  // bi * hq + h
    const int h = int(bh % hq), bi = int(bh / hq);
    float acc = 0.f;
    if (row < s) {
        const int64_t base = ((int64_t(bi) * s + row) * hq + h) * D;
        CUTE_UNROLL
        for (int j = lane; j < D; j += 32) acc += float(o[base + j]) * float(d_o[base + j]);
    }
    CUTE_UNROLL
    for (int off = 16; off; off >>= 1) acc += __shfl_xor_sync(0xffffffff, acc, off);
    if (lane == 0) {
        float l = row < s ? lse[bh * s + row] : -INFINITY;
        lse2[warp] = l == -INFINITY ? INFINITY : l * float(M_LOG2E);
        dd[warp] = acc;
    }
}

template <class T, bool kCausal, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) bwd_kernel(CUTE_GRID_CONSTANT Params const p) {
    using Element = typename T::Element;
    constexpr int D = T::kHeadDim, BM = T::kBlockM, BN = T::kBlockN, ST = T::kStages, DQC = T::kDqCols;
    using TBar = cutlass::arch::ClusterTransactionBarrier;
    using Bar = cutlass::arch::ClusterBarrier;

    extern __shared__ __align__(1024) char smem_raw[];
    auto &sm = *reinterpret_cast<typename T::Smem *>(smem_raw);
    const int tid = threadIdx.x;
    // Causal: the first key blocks have the most query blocks; a one-dimensional grid in bands
    // of KV heads, the longest CTAs first (band_width in native_common.cuh)
    int n_block, hk, bi;
    if constexpr (kCausal) {
        const BandedCta c = banded_cta(int(blockIdx.x), (p.t + BN - 1) / BN, p.band);
        n_block = c.block;
        hk = c.slice % p.hkv;
        bi = c.slice / p.hkv;
    } else {
        n_block = blockIdx.x;
        hk = blockIdx.y;
        bi = blockIdx.z;
    }
    const int group = p.hq / p.hkv;
    const int m_blocks = p.s_pad / BM;  // s_pad = s rounded up to BM
    const int m_first = kCausal ? (n_block * BN) / BM : 0;
    // Without a mask every CTA walks all query blocks. Started together at block 0, the CTAs
    // of one head would add their dQ_part into the same accumulator rows at the same time
    // (the bulk reductions of up to 64 CTAs meeting on one 16 KB tile in L2), so each starts
    // at its own rotation: query block (m_rot + j) % m_blocks at step j of a head, m_rot spread
    // over the key blocks. (Causal CTAs already start at different blocks: m_first.)
    const int m_rot = kCausal ? 0 : int(int64_t(n_block) * m_blocks / ((p.t + BN - 1) / BN));
    auto q_block = [&](int j) {  // the query block of step j of a head
        if constexpr (kCausal) return m_first + j;
        else return m_rot + j < m_blocks ? m_rot + j : m_rot + j - m_blocks;  // j < m_blocks
    };

    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.s, Int<D>{}, p.hq, p.b));
    Tensor mdO = p.tma_do.get_tma_tensor(make_shape(p.s, Int<D>{}, p.hq, p.b));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.t, Int<D>{}, p.hkv, p.b));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.t, Int<D>{}, p.hkv, p.b));

    Tensor sK = make_tensor(make_smem_ptr(sm.k.begin()), typename T::SmemLayoutKV{});
    Tensor sV = make_tensor(make_smem_ptr(sm.v.begin()), typename T::SmemLayoutKV{});
    Tensor sQ = make_tensor(make_smem_ptr(sm.q.begin()), typename T::SmemLayoutQ{});
    Tensor sdO = make_tensor(make_smem_ptr(sm.d_o.begin()), typename T::SmemLayoutQ{});
    Tensor sQt = make_tensor(make_smem_ptr(sm.q.begin()), typename T::SmemLayoutQt{});
    Tensor sdOt = make_tensor(make_smem_ptr(sm.d_o.begin()), typename T::SmemLayoutQt{});
    Tensor sdS = make_tensor(make_smem_ptr(sm.ds.begin()), typename T::SmemLayoutdS{});

    constexpr uint32_t kBytesKV = BN * D * sizeof(Element);
    constexpr uint32_t kBytesStep = 2 * BM * D * sizeof(Element) + 2 * BM * sizeof(float);

    if (tid == 0) {
        TBar::init(&sm.bar_kv, 1);
        for (int st = 0; st < ST; ++st) {
            TBar::init(&sm.bar_full[st], 1);
            Bar::init(&sm.bar_empty[st], T::kConsumers);
        }
        cutlass::arch::fence_barrier_init();
    }
    __syncthreads();

    if (tid >= T::kConsumers) {
        cutlass::arch::warpgroup_reg_dealloc<24>();
        if (tid == T::kConsumers) {
            Tensor gK = local_tile(mK(_, _, hk, bi), Shape<Int<BN>, Int<D>>{}, make_coord(n_block, 0));
            Tensor gV = local_tile(mV(_, _, hk, bi), Shape<Int<BN>, Int<D>>{}, make_coord(n_block, 0));
            auto pk = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
            auto pv = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
            TBar::arrive_and_expect_tx(&sm.bar_kv, 2 * kBytesKV);
            copy(p.tma_k.with(sm.bar_kv), get<0>(pk), get<1>(pk));
            copy(p.tma_v.with(sm.bar_kv), get<0>(pv), get<1>(pv));
            int it = 0;
            for (int g = 0; g < group; ++g) {
                const int h = hk * group + g;
                Tensor gQ = local_tile(mQ(_, _, h, bi), Shape<Int<BM>, Int<D>>{}, make_coord(_, 0));
                Tensor gdO = local_tile(mdO(_, _, h, bi), Shape<Int<BM>, Int<D>>{}, make_coord(_, 0));
                auto pq = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
                auto pdo =
                    tma_partition(p.tma_do, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sdO), group_modes<0, 2>(gdO));
                const int64_t row0 = (int64_t(bi) * p.hq + h) * p.s_pad;
                for (int j = 0; j < m_blocks - m_first; ++j, ++it) {
                    const int m = q_block(j);
                    const int st = it % ST;
                    if (it >= ST) Bar::wait(&sm.bar_empty[st], ((it / ST) - 1) & 1);
                    TBar::arrive_and_expect_tx(&sm.bar_full[st], kBytesStep);
                    copy(p.tma_q.with(sm.bar_full[st]), get<0>(pq)(_, m), get<1>(pq)(_, st));
                    copy(p.tma_do.with(sm.bar_full[st]), get<0>(pdo)(_, m), get<1>(pdo)(_, st));
                    bulk_load(sm.lse2[st], p.lse2 + row0 + m * BM, BM * 4, &sm.bar_full[st]);
                    bulk_load(sm.dd[st], p.dd + row0 + m * BM, BM * 4, &sm.bar_full[st]);
                }
            }
        }
        return;
    }
    cutlass::arch::warpgroup_reg_alloc<240>();
    const int ctid = tid;              // 0..255
    const int wg = ctid / 128;         // consumer warpgroup: keys wg*64 .. wg*64+63
    const int wtid = ctid % 128;       // thread within it
    const int warp = wtid / 32, lane = wtid % 32;

    typename T::MmaSdP mma_sdp;
    typename T::MmaDKV mma_dkv;
    typename T::MmaDQ mma_dq;
    auto thr_sdp = mma_sdp.get_thread_slice(ctid);
    auto thr_dkv = mma_dkv.get_thread_slice(ctid);
    auto thr_dq = mma_dq.get_thread_slice(wtid);

    Tensor tSrK = thr_sdp.partition_fragment_A(sK);    // (MMA, 1, D/16)
    Tensor tSrV = thr_sdp.partition_fragment_A(sV);
    Tensor tSrQ = thr_sdp.partition_fragment_B(sQ);    // (MMA, 1, D/16, ST)
    Tensor tSrdO = thr_sdp.partition_fragment_B(sdO);
    Tensor tdVrdO = thr_dkv.partition_fragment_B(sdOt);  // (MMA, 1, BM/16, ST)
    Tensor tdKrQ = thr_dkv.partition_fragment_B(sQt);
    // dQ's B operand: this warpgroup's head-dim half of K at d 128, all of it at d 64
    Tensor sKt = make_tensor(make_smem_ptr(sm.k.begin() + (T::kDqSplitD ? wg * BN * DQC : 0)),
                             typename T::SmemLayoutKt{});
    Tensor tdQrdS = thr_dq.partition_fragment_A(sdS);  // (MMA, 1, BN/16, 2·kDsTiles)
    Tensor tdQrKt = thr_dq.partition_fragment_B(sKt);  // (MMA, 1, BN/16)

    Tensor tSrS = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
    Tensor tSrdP = partition_fragment_C(mma_sdp, Shape<Int<BN>, Int<BM>>{});
    Tensor tdVrdV = partition_fragment_C(mma_dkv, Shape<Int<BN>, Int<D>>{});
    Tensor tdKrdK = partition_fragment_C(mma_dkv, Shape<Int<BN>, Int<D>>{});
    Tensor tdQrdQ = partition_fragment_C(mma_dq, Shape<_64, Int<DQC>>{});
    static_assert(decltype(size(tdQrdQ))::value == T::kDqPerThread);
    clear(tdVrdV);
    clear(tdKrdK);

    Tensor tScS = thr_sdp.partition_C(make_identity_tensor(Shape<Int<BN>, Int<BM>>{}));  // (key, query)
    Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
    Tensor dP = make_tensor(tSrdP.data(), rowcol(tSrdP.layout()));
    Tensor cS = make_tensor(tScS.data(), rowcol(tScS.layout()));
    Tensor tP = make_tensor<Element>(tSrS.layout());
    Tensor tdS = make_tensor<Element>(tSrS.layout());
    Tensor tPa = make_tensor(tP.data(), acc_as_a(tSrS.layout()));
    Tensor tdSa = make_tensor(tdS.data(), acc_as_a(tSrS.layout()));

    // Shared-memory addresses of this thread's dSᵀ pairs (two adjacent queries) in tile 0.
    // Fragment element e = v0 + 2·v1 + 4·c8 holds key k0 + 8·v1 and query q0 + v0 + 8·c8
    // (q0 < 8). A dS tile is query-major with a 128-byte row (64 queries) per key in 128-byte
    // swizzle atoms of 8 keys (16-byte chunk index XOR key % 8), and k % 8 is the same for
    // all of a thread's keys, so pair (v1, c8) lies in tile c8 / 8 at base[v1] with its chunk
    // index XOR c8 % 8: two registers instead of one per pair, one XOR per store.
    static_assert(sizeof(Element) == 2, "dS rows of 128 bytes: one swizzle atom row per key");
    static_assert(decltype(size(tdS))::value == 4 * (BM / 8), "one 64-key x BM-query accumulator tile per thread");
    constexpr uint32_t kDsTileBytes = 64 * BN * sizeof(Element);
    uint32_t ds_base[2];
    CUTE_UNROLL
    for (int v1 = 0; v1 < 2; ++v1) {
        auto c = tScS(2 * v1);  // (key, query)
        ds_base[v1] = cast_smem_ptr_to_uint(&sdS(get<1>(c), get<0>(c), 0));
    }
    TBar::wait(&sm.bar_kv, 0);
    // Steps `it` run over (head g of the group, query block m). Every wgmma of a step is
    // waited for within it: issuing the next step's Sᵀ/dPᵀ across the loop's back edge made
    // ptxas serialise the wgmma pipeline (C7514) and spill at d 128.
    const int per_head = m_blocks - m_first, steps = group * per_head;
    // Sᵀ and dPᵀ in two commit groups: Pᵀ is computed while dPᵀ runs
    auto issue_s = [&](int st) {
        warpgroup_fence_operand(tSrS);
        warpgroup_arrive();
        mma_sdp.accumulate_ = GMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tSrK); ++k) {
            cute::gemm(mma_sdp, tSrK(_, _, k), tSrQ(_, _, k, st), tSrS);
            mma_sdp.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
    };
    auto issue_dp = [&](int st) {
        warpgroup_fence_operand(tSrdP);
        warpgroup_arrive();
        mma_sdp.accumulate_ = GMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tSrV); ++k) {
            cute::gemm(mma_sdp, tSrV(_, _, k), tSrdO(_, _, k, st), tSrdP);
            mma_sdp.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
    };
    // Pᵀ in place of Sᵀ (then as the A operand tP); keys past t and (causal) keys after the
    // query get 0. Two copies of the loop, so that blocks off the diagonal carry no mask tests.
    auto compute_p = [&](int m, int st) {
        const bool masked = (kCausal && m * BM < n_block * BN + BN - 1) || (n_block + 1) * BN > p.t;
        if (masked) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(S); ++c) {
                const int qc = get<1>(cS(0, c));
                const float l2 = sm.lse2[st][qc];
                CUTE_UNROLL
                for (int r = 0; r < size<0>(S); ++r) {
                    const int key = n_block * BN + get<0>(cS(r, c));
                    const bool off = key >= p.t || (kCausal && m * BM + qc < key);
                    S(r, c) = off ? 0.f : ex2(fmaf(S(r, c), p.scale_log2, -l2));
                }
            }
        } else {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(S); ++c) {
                const float l2 = sm.lse2[st][get<1>(cS(0, c))];
                CUTE_UNROLL
                for (int r = 0; r < size<0>(S); ++r) S(r, c) = ex2(fmaf(S(r, c), p.scale_log2, -l2));
            }
        }
        CUTE_UNROLL
        for (int j = 0; j < size(tSrS); ++j) tP(j) = static_cast<Element>(tSrS(j));
    };
    // dSᵀ = Pᵀ ∘ (dPᵀ − D) in place of dPᵀ, then as the A operand tdS
    auto compute_ds = [&](int st) {
        CUTE_UNROLL
        for (int c = 0; c < size<1>(S); ++c) {
            const float dd = sm.dd[st][get<1>(cS(0, c))];
            CUTE_UNROLL
            for (int r = 0; r < size<0>(S); ++r) dP(r, c) = S(r, c) * (dP(r, c) - dd);
        }
        CUTE_UNROLL
        for (int j = 0; j < size(tSrdP); ++j) tdS(j) = static_cast<Element>(tSrdP(j));
    };
    // acc += a·b with a from registers (dV += Pᵀ·dO, dK += dSᵀ·Q), b of stage st
    auto issue_dkv = [&](auto &acc, auto &a, auto &b, int st) {
        warpgroup_fence_operand(acc);
        warpgroup_fence_operand(a);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int k = 0; k < size<2>(a); ++k) cute::gemm(mma_dkv, a(_, _, k), b(_, _, k, st), acc);
        warpgroup_commit_batch();
    };
    auto issue_dv = [&](int st) { issue_dkv(tdVrdV, tPa, tdVrdO, st); };
    auto issue_dk = [&](int st) { issue_dkv(tdKrdK, tdSa, tdKrQ, st); };
    // dSᵀ into shared memory buffer `buf`, two adjacent queries per 4-byte store
    auto store_ds = [&](int buf) {
        CUTE_UNROLL
        for (int j = 0; j < size(tdS); j += 2) {
            const uint32_t pair = uint32_t(tdS(j).raw()) | (uint32_t(tdS(j + 1).raw()) << 16);
            const int c8 = j / 4, tile = buf * T::kDsTiles + c8 / 8;
            const uint32_t addr = (ds_base[(j / 2) % 2] + tile * kDsTileBytes) ^ uint32_t((c8 % 8) * 16);
            asm volatile("st.shared.b32 [%0], %1;" ::"r"(addr), "r"(pair) : "memory");
        }
        cutlass::arch::fence_view_async_shared();
    };
    // dQ_part = dS·K over all 128 keys (both warpgroups' dS): this warpgroup's head-dim half
    // at d 128, its 64 of the 128 query rows at d 64
    auto issue_dq = [&](int buf) {
        const int tile = T::kDqSplitD ? buf : buf * T::kDsTiles + wg;
        warpgroup_fence_operand(tdQrdQ);
        warpgroup_arrive();
        mma_dq.accumulate_ = GMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tdQrdS); ++k) {
            cute::gemm(mma_dq, tdQrdS(_, _, k, tile), tdQrKt(_, _, k), tdQrdQ);
            mma_dq.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
    };
    // dQ_part -> shared (each thread's values as float4s, conflict-free) -> bulk add into the
    // accumulator of query block m of head h: 64-row block r, column part `part` of it
    const int bar_wg = 3 + wg;  // this warpgroup's own named barrier
    // (in two halves: the registers are free after the first)
    auto store_dq_smem = [&](int buf) {
        float *dq_smem = sm.dq[wg][buf % T::kDqBufs];  // buf: the step's parity
        // the reduction that last read this buffer (kDqBufs steps ago) is done reading it
        if (wtid == 0) tma_store_wait<T::kDqBufs - 1>();
        bar_sync(bar_wg, 128);
        CUTE_UNROLL
        for (int v4 = 0; v4 < T::kDqPerThread / 4; ++v4) {
            float4 x = make_float4(tdQrdQ(4 * v4), tdQrdQ(4 * v4 + 1), tdQrdQ(4 * v4 + 2), tdQrdQ(4 * v4 + 3));
            reinterpret_cast<float4 *>(dq_smem)[(warp * (T::kDqPerThread / 4) + v4) * 32 + lane] = x;
        }
    };
    auto store_dq_reduce = [&](int h, int m, int buf) {
        float *dq_smem = sm.dq[wg][buf % T::kDqBufs];
        cutlass::arch::fence_view_async_shared();
        bar_sync(bar_wg, 128);
        if (wtid == 0) {
            const int r = T::kDqSplitD ? m : m * 2 + wg, part = T::kDqSplitD ? wg : 0;
            float *dst = p.dq_acc + ((int64_t(bi) * p.hq + h) * (p.s_pad / 64) + r) * (64 * D) + part * (64 * DQC);
            bulk_reduce_add(dst, dq_smem, 64 * DQC * 4);
            tma_store_arrive();
        }
    };
    // Both warpgroups meet once per step (barrier 1): dQ_part needs both one's dSᵀ. dQ is
    // issued before dK, so that its result goes to shared memory and on to the accumulator
    // while dK still runs (H200, 64K causal: 541 against 530 TFLOP/s at 32×128 and, with
    // 128-query steps, 486 against 453 at 32/4×64). Issuing a step's dQ in the next step,
    // beside Sᵀ and dPᵀ, needs more than 240 registers at both head dims (ptxas spills and
    // serialises the wgmma).
#if LONGCTX_NATIVE_PROFILE
    __shared__ unsigned long long phase_sum[2][LONGCTX_BWD_PHASES + 1];
    if (wtid == 0)
        for (int i = 0; i <= LONGCTX_BWD_PHASES; ++i) phase_sum[wg][i] = 0;
    unsigned phase_t0 = clock();
#endif
    if constexpr (T::kEarlyS) {  // step 0's Sᵀ (steps ≥ 1: every CTA has a query block)
        TBar::wait(&sm.bar_full[0], 0);
        issue_s(0);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tSrS);
    }
    for (int it = 0; it < steps; ++it) {
        const int g = it / per_head, m = q_block(it % per_head), h = hk * group + g;
        const int st = it % ST, buf = it & 1;
        if constexpr (T::kEarlyS) {
            // Sᵀ of this step is done (waited for at the end of the last one)
            BWD_PHASE(0);
            issue_dp(st);
            BWD_PHASE(1);
        } else {
            TBar::wait(&sm.bar_full[st], (it / ST) & 1);
            BWD_PHASE(0);  // waiting for this step's Q, dO, lse2, D
            issue_s(st);
            issue_dp(st);
            warpgroup_wait<1>();  // Sᵀ (dPᵀ may run)
            warpgroup_fence_operand(tSrS);
            BWD_PHASE(1);
        }
        compute_p(m, st);
        BWD_PHASE(2);
        issue_dv(st);
        warpgroup_wait<1>();  // dPᵀ (dV may run)
        warpgroup_fence_operand(tSrdP);
        BWD_PHASE(3);
        compute_ds(st);
        // dSᵀ in buffer `buf`: the other one may still feed the other warpgroup's dQ of the
        // previous step (it passed this step's barrier only after that dQ was done)
        store_ds(buf);
        BWD_PHASE(4);
        bar_sync(1, 256);
        BWD_PHASE(5);
        issue_dq(buf);
        issue_dk(st);
        warpgroup_wait<1>();  // dV and dQ (dK may run)
        warpgroup_fence_operand(tdQrdQ);
        BWD_PHASE(6);
        store_dq_smem(buf);
        if constexpr (T::kEarlyS) {
            // the next step's Sᵀ, behind dK, once dQ_part is out of the registers; waited for at
            // the end of this step (nothing is in flight across the loop's back edge). The
            // last step issues one too, on its own stage, and drops it: with the product
            // issued on a condition ptxas serialises the wgmma pipeline (C7515).
            if (it + 1 < steps) TBar::wait(&sm.bar_full[(it + 1) % ST], ((it + 1) / ST) & 1);
            issue_s(it + 1 < steps ? (it + 1) % ST : st);
        }
        store_dq_reduce(h, m, buf);
        BWD_PHASE(7);
        warpgroup_wait<T::kEarlyS ? 1 : 0>();  // dK (the next Sᵀ may run)
        warpgroup_fence_operand(tdVrdV);
        warpgroup_fence_operand(tdKrdK);
        Bar::arrive(&sm.bar_empty[st]);  // Q, dO, lse2, D of this stage are no longer read
        if constexpr (T::kEarlyS) {
            warpgroup_wait<0>();
            warpgroup_fence_operand(tSrS);
        }
        BWD_PHASE(8);
    }
#if LONGCTX_NATIVE_PROFILE
    if (wtid == 0) {
        phase_sum[wg][LONGCTX_BWD_PHASES] += steps;
        for (int i = 0; i <= LONGCTX_BWD_PHASES; ++i) atomicAdd(&longctx_bwd_phase_cycles[wg][i], phase_sum[wg][i]);
    }
#endif
    if (wtid == 0) tma_store_wait<0>();

    // dK·scale and dV for this CTA's keys
    Tensor tdKcdK = thr_dkv.partition_C(make_identity_tensor(Shape<Int<BN>, Int<D>>{}));
    CUTE_UNROLL
    for (int j = 0; j < size(tdKrdK); ++j) {
        auto c = tdKcdK(j);
        const int key = n_block * BN + get<0>(c);
        if (key < p.t) {
            const int64_t at = ((int64_t(bi) * p.t + key) * p.hkv + hk) * D + get<1>(c);
            p.dk[at] = static_cast<Element>(tdKrdK(j) * p.scale);
            p.dv[at] = static_cast<Element>(tdVrdV(j));
        }
    }
}

// dq = scale · accumulator: per 64-row block (blockIdx.x) of a head, one warpgroup per column
// part of the main kernel's dQ tiles, each thread reading back the values its twin there
// stored (same MMA partition, same order; coalesced float4s) into a 64 x d tile in shared
// memory, which the CTA then writes out as rows of 16-byte vectors of 8 elements. (Storing
// each element from its fragment position wrote 2 of every 32 bytes a sector carries:
// 2.30 ms at 64K, 32 x 128 on an H100, against 0.59 ms for cuDNN's conversion.)
template <class T>
__global__ void __launch_bounds__(T::kHeadDim / T::kDqCols * 128) post_kernel(const float *dq_acc,
                                                                               typename T::Element *dq, int s, int hq,
                                                                               float scale) {
    using Element = typename T::Element;
    constexpr int D = T::kHeadDim, DQC = T::kDqCols, NV = T::kDqPerThread, kThreads = D / DQC * 128;
    // floats per staged row: 8 of padding put the 4 rows of a half-warp's float2 stores in
    // different banks
    constexpr int kStride = D + 8;
    __shared__ __align__(16) float tile[64 * kStride];
    const int r = blockIdx.x, h = blockIdx.y, bi = blockIdx.z, r_blocks = gridDim.x;
    const int part = threadIdx.x / 128, wtid = threadIdx.x % 128, warp = wtid / 32, lane = wtid % 32;
    typename T::MmaDQ mma_dq;
    auto thr_dq = mma_dq.get_thread_slice(wtid);
    Tensor tc = thr_dq.partition_C(make_identity_tensor(Shape<_64, Int<DQC>>{}));
    static_assert(decltype(size(tc))::value == NV && NV % 4 == 0);
    const float4 *src = reinterpret_cast<const float4 *>(
        dq_acc + ((int64_t(bi) * hq + h) * r_blocks + r) * (64 * D) + part * (64 * DQC));
    CUTE_UNROLL
    for (int v4 = 0; v4 < NV / 4; ++v4) {
        const float4 x = src[(warp * (NV / 4) + v4) * 32 + lane];
        // a float4 holds columns c, c + 1 of rows y and y + 8 (the accumulator's 2 x 2 atom)
        auto c0 = tc(4 * v4), c2 = tc(4 * v4 + 2);
        *reinterpret_cast<float2 *>(&tile[get<0>(c0) * kStride + part * DQC + get<1>(c0)]) = make_float2(x.x, x.y);
        *reinterpret_cast<float2 *>(&tile[get<0>(c2) * kStride + part * DQC + get<1>(c2)]) = make_float2(x.z, x.w);
    }
    __syncthreads();
    constexpr int kChunks = D / 8;  // 8 elements (16 bytes) a chunk, kChunks a row
    CUTE_UNROLL
    for (int i = threadIdx.x; i < 64 * kChunks; i += kThreads) {
        const int row = i / kChunks, ch = i % kChunks, grow = r * 64 + row;
        if (grow >= s) continue;
        const float4 a = *reinterpret_cast<const float4 *>(&tile[row * kStride + ch * 8]);
        const float4 b = *reinterpret_cast<const float4 *>(&tile[row * kStride + ch * 8 + 4]);
        const float xs[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
        alignas(16) Element out[8];
        CUTE_UNROLL
        for (int e = 0; e < 8; ++e) out[e] = static_cast<Element>(xs[e] * scale);
        *reinterpret_cast<uint4 *>(dq + ((int64_t(bi) * s + grow) * hq + h) * D + ch * 8) =
            *reinterpret_cast<const uint4 *>(out);
    }
}

template <class Element, int D, bool kCausal>
int launch_bwd(const longctx_sdpa_desc &d, const void *q, const void *k, const void *v, const void *o,
               const void *d_o, const float *lse, void *dq, void *dk, void *dv, cudaStream_t stream, char *err,
               size_t err_len) {
    using T = BwdTraits<Element, D>;
    constexpr int BM = T::kBlockM, BN = T::kBlockN;
    const int b = int(d.b), s = int(d.s), t = int(d.t), hq = int(d.hq), hkv = int(d.hkv);
    const int m_blocks = (s + BM - 1) / BM, s_pad = m_blocks * BM;
    const size_t rows = size_t(b) * hq * s_pad;
    const size_t ws_floats = rows * 2 + rows * D;
    float *ws = nullptr;
    cudaError_t e = cudaMallocAsync(reinterpret_cast<void **>(&ws), ws_floats * sizeof(float), stream);
    auto fail = [&](const char *what) {
        snprintf(err, err_len, "native attention backward (d %d): %s: %s", D, what, cudaGetErrorString(e));
        if (ws) cudaFreeAsync(ws, stream);
        return LONGCTX_SDPA_FAILED;
    };
    if (e != cudaSuccess) {
        ws = nullptr;
        return fail("workspace allocation");
    }
    float *lse2 = ws, *dd = ws + rows, *dq_acc = ws + 2 * rows;
    if ((e = cudaMemsetAsync(dq_acc, 0, rows * D * sizeof(float), stream)) != cudaSuccess) return fail("memset");
    {
        const int threads = 256;
        const int64_t blocks = (int64_t(rows) * 32 + threads - 1) / threads;
        prep_kernel<Element, D><<<dim3(unsigned(blocks)), threads, 0, stream>>>(
            reinterpret_cast<const Element *>(o), reinterpret_cast<const Element *>(d_o), lse, lse2, dd, b, s, hq,
            s_pad);
        if ((e = cudaGetLastError()) != cudaSuccess) return fail("prep launch");
    }
    auto strided = [](const void *x, int len, int heads, int b) {
        return make_tensor(make_gmem_ptr(reinterpret_cast<Element const *>(x)), make_shape(len, Int<D>{}, heads, b),
                           make_stride(int64_t(heads) * D, _1{}, int64_t(D), int64_t(len) * heads * D));
    };
    auto mQ = strided(q, s, hq, b), mdO = strided(d_o, s, hq, b);
    auto mK = strided(k, t, hkv, b), mV = strided(v, t, hkv, b);
    auto tma_q = make_tma_atom(SM90_TMA_LOAD{}, mQ, typename T::SmemLayoutQ{}(_, _, 0), Shape<Int<BM>, Int<D>>{});
    auto tma_do = make_tma_atom(SM90_TMA_LOAD{}, mdO, typename T::SmemLayoutQ{}(_, _, 0), Shape<Int<BM>, Int<D>>{});
    auto tma_k = make_tma_atom(SM90_TMA_LOAD{}, mK, typename T::SmemLayoutKV{}, Shape<Int<BN>, Int<D>>{});
    auto tma_v = make_tma_atom(SM90_TMA_LOAD{}, mV, typename T::SmemLayoutKV{}, Shape<Int<BN>, Int<D>>{});
    using P = BwdParams<decltype(tma_q), decltype(tma_do), decltype(tma_k), decltype(tma_v), Element>;
    P params{tma_q, tma_do, tma_k, tma_v, lse2, dd, dq_acc, reinterpret_cast<Element *>(dk),
             reinterpret_cast<Element *>(dv), b, s, t, hq, hkv, s_pad, d.scale, float(d.scale * M_LOG2E),
             band_width(hkv * b, (t + BN - 1) / BN, sm_count(d.ordinal))};
    auto kernel = bwd_kernel<T, kCausal, P>;
    const int smem = int(sizeof(typename T::Smem));
    static std::atomic<uint64_t> smem_set{0};
    if ((e = set_smem_once(smem_set, kernel, smem, d.ordinal)) != cudaSuccess)
        return fail("shared memory attribute");
    const int n_blocks = (t + BN - 1) / BN;
    const dim3 grid = kCausal ? dim3(unsigned(n_blocks * hkv * b)) : dim3(n_blocks, hkv, b);
    kernel<<<grid, T::kThreads, smem, stream>>>(params);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("main launch");
    post_kernel<T><<<dim3(s_pad / 64, hq, b), D / T::kDqCols * 128, 0, stream>>>(
        dq_acc, reinterpret_cast<Element *>(dq), s, hq, d.scale);
    if ((e = cudaGetLastError()) != cudaSuccess) return fail("post launch");
    if ((e = cudaFreeAsync(ws, stream)) != cudaSuccess) {
        ws = nullptr;
        return fail("workspace free");
    }
    return LONGCTX_SDPA_OK;
}

}  // namespace longctx_nbwd

extern "C" int longctx_native_bwd(const longctx_sdpa_desc *d, const void *q, const void *k, const void *v,
                                  const void *o, const void *d_o, const float *lse, void *dq, void *dk, void *dv,
                                  void *stream, char *err, size_t err_len) {
    using namespace longctx_nbwd;
    if (err && err_len) err[0] = 0;
    const char *why = longctx_native_uncovered(d, q, k, v);
    if (!why && ((reinterpret_cast<uintptr_t>(d_o) | reinterpret_cast<uintptr_t>(o) | reinterpret_cast<uintptr_t>(dq)) & 15))
        why = "o/do/dq not 16-byte aligned";
    if (why) {
        if (err && err_len) snprintf(err, err_len, "native attention backward: not covered: %s", why);
        return LONGCTX_SDPA_UNSUPPORTED;
    }
    auto st = reinterpret_cast<cudaStream_t>(stream);
    const bool bf = d->dtype == LONGCTX_SDPA_BF16;
#define LONGCTX_DISPATCH(E, D)                                                                               \
    return d->causal ? launch_bwd<E, D, true>(*d, q, k, v, o, d_o, lse, dq, dk, dv, st, err, err_len)       \
                     : launch_bwd<E, D, false>(*d, q, k, v, o, d_o, lse, dq, dk, dv, st, err, err_len)
    if (bf && d->d == 64) LONGCTX_DISPATCH(cutlass::bfloat16_t, 64);
    if (bf) LONGCTX_DISPATCH(cutlass::bfloat16_t, 128);
    if (d->d == 64) LONGCTX_DISPATCH(cutlass::half_t, 64);
    LONGCTX_DISPATCH(cutlass::half_t, 128);
#undef LONGCTX_DISPATCH
}

#if LONGCTX_NATIVE_PROFILE
// The names of the phase clock's phases at head dim d (BWD_PHASE(0..8) in the main loop):
// with the next step's Sᵀ issued early (kEarlyS) phases 0, 1, 7 and 8 time other work.
extern "C" const char *const *longctx_native_bwd_phase_names(int d) {
    static const char *const plain[LONGCTX_BWD_PHASES] = {"wait Q/dO", "S", "exp", "dP", "dS+store",
                                                          "barrier", "dQ", "store dQ", "dK"};
    static const char *const early[LONGCTX_BWD_PHASES] = {"step start", "issue dP", "exp", "dP", "dS+store",
                                                          "barrier", "dQ", "store dQ+issue next S", "dK+next S"};
    using namespace longctx_nbwd;
    using T64 = BwdTraits<cutlass::bfloat16_t, 64>;
    using T128 = BwdTraits<cutlass::bfloat16_t, 128>;
    const bool e = d == 64 ? T64::kEarlyS : T128::kEarlyS;
    return e ? early : plain;
}
#endif
