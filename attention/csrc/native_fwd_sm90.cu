// longctx's own attention forward for Hopper (sm_90a), on CuTe primitives: TMA tile loads
// into 128-byte-swizzled shared memory, an mbarrier pipeline of K/V stages, and warpgroup
// MMAs (wgmma) for both products (S = Q·Kᵀ from shared memory, O += P·V with P in
// registers), a producer warpgroup apart from the consumers. Each consumer issues the next
// block's S with the current block's P·V and computes the softmax while P·V runs; the
// consumers take turns to issue (ping-pong). Issue #36; the backward is native_bwd_sm90.cu.
//
// Shape legend (the contract of csrc/cudnn_sdpa.h, every tensor contiguous, row-major):
//   q, o   [b, s, hq, d]   k, v [b, t, hkv, d]   lse [b, hq, s] f32, natural log
//   one CTA = one (query block, head, batch): a producer warpgroup and kBlockM/64 consumer
//   warpgroups of 64 query rows (kBlockM 128 at d 128, 192 at d 64)
//   KV blocks of 128 keys, visited from the last (the masked diagonal) to the first.
//
// Covered: d ∈ {64, 128}; bf16 and f16; GQA (hq % hkv == 0); no mask, or top-left causal
// with s == t. Anything else answers LONGCTX_SDPA_UNSUPPORTED (the caller falls back to
// cuDNN).

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/arch/reg_reconfig.h>
#include <cutlass/cutlass.h>
#include <cutlass/numeric_types.h>

#include <cmath>
#include <cstdint>
#include <cstdio>

#include "native_common.cuh"
#include "native_fmha.h"

namespace longctx_native {
using namespace cute;
using namespace longctx_native_common;

template <class Element_, int kHeadDim_>
struct FwdTraits {
    using Element = Element_;
    static constexpr int kHeadDim = kHeadDim_;
    // head dim 64: three consumer warpgroups (192 query rows) keep the tensor cores busier
    // through the softmax of a product that is only 64 deep
    static constexpr int kBlockM = kHeadDim == 64 ? 192 : 128;
    static constexpr int kBlockN = 128;
    // K/V stages, a tunable for timing variants (scripts/build_native_check.sh --variant): a
    // third gained nothing (H200, 64K causal fwd, two rounds in one visit: 32 × 128 641.5 /
    // 640.3 against 640.9 / 634.9, 32/4 × 64 527.1 / 531.3 against 527.1 / 531.5), so the
    // consumers do not wait on the loads
#ifndef LONGCTX_FWD_STAGES
#define LONGCTX_FWD_STAGES 2
#endif
    static constexpr int kStages = LONGCTX_FWD_STAGES;
    static constexpr int kWarpGroups = kBlockM / 64;          // consumers
    static constexpr int kThreads = 128 * (kWarpGroups + 1);  // + the producer warpgroup
    static constexpr int kConsumerRegs = kWarpGroups == 2 ? 240 : 160;
    static constexpr int kProducerRegs = 24;
    // consumer warpgroups take turns to issue their products (H200, 64K causal: 625 against
    // 622 TFLOP/s without at d 128, 515 against 506 at d 64)
    static constexpr bool kPingPong = kWarpGroups > 1;
    // The row maximum and row sum of a block over this many independent partial chains of a
    // thread's 32 columns of a row, combined at the end (H200, causal, fwd TFLOP/s, two rounds
    // against one chain in one visit: 32 × 128 at 64K 621.1 / 621.0 against 613.5 / 616.5, at
    // 16K 663.2 / 665.8 against 652.0 / 648.9; 32/4 × 64 at 16K 472.2 / 480.0 against
    // 458.5 / 465.3, at 64K 504.2 / 513.0 against 510.6 / 510.0; four chains 612 / 612 at
    // 64K d 128 and 502 / 503 at 64K d 64)
#ifndef LONGCTX_FWD_CHAINS
#define LONGCTX_FWD_CHAINS 2
#endif
    static constexpr int kChains = LONGCTX_FWD_CHAINS;
    // The row sums from the tensor cores: P·1 by a second product in each P·V batch, P against
    // eight columns of ones (m64n8), in place of the softmax's 64 additions a thread and block;
    // the sums' accumulator takes O's rescale (bit 0: d 128, bit 1: d 64). H200, causal, fwd
    // TFLOP/s, two rounds against the additions in one visit: 32/4 × 64 at 64K 523.7 / 522.1
    // against 516.1 / 515.6, at 16K 490.2 / 488.7 against 482.2 / 490.5 (a later visit: 64K
    // 522.8 / 523.0 against 515.0 / 516.0, 128K 521.2 / 522.3 against 518.7 / 516.5, 16K
    // 492.4 / 492.4 against 469.9 / 489.0); at 32 × 128, where the extra product costs more
    // than the additions, 607.6 / 613.0 against 629.4 / 629.7 (64K)
#ifndef LONGCTX_FWD_ONES
#define LONGCTX_FWD_ONES 2
#endif
    static constexpr bool kOnesSum = (LONGCTX_FWD_ONES >> (kHeadDim == 128 ? 0 : 1)) & 1;

    using SmemLayoutQ =
        decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{}, Shape<Int<kBlockM>, Int<kHeadDim>>{}));
    using SmemLayoutK = decltype(tile_to_shape(GMMA::Layout_K_SW128_Atom<Element>{},
                                               Shape<Int<kBlockN>, Int<kHeadDim>, Int<kStages>>{}));
    // V is stored like K, [keys, d] with d contiguous; the second product reads it as the
    // (d, keys) B operand, d-major (MN-major in GMMA's terms).
    using SmemLayoutVt = decltype(composition(
        SmemLayoutK{}, make_ordered_layout(Shape<Int<kHeadDim>, Int<kBlockN>, Int<kStages>>{}, Step<_2, _1, _3>{})));

    using MmaS = decltype(make_tiled_mma(
        GMMA::ss_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kBlockN>, Int<kHeadDim>>>(),
        Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
    using MmaO = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, Int<kHeadDim>, Int<kBlockN>>,
                             GMMA::Major::K, GMMA::Major::MN>(),
        Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));
    // P·1: eight columns of ones, K-major, no swizzle (every element is 1, so the layout only
    // has to be one wgmma accepts). One 8 × 16 tile read by every k-slice saves the loop 15
    // instructions of descriptor arithmetic but is slower (H200, 64K causal fwd 32/4 × 64:
    // 510.0 / 513.9 against 522.8 / 523.0 with a tile per k-slice)
    using SmemLayoutOnes = decltype(tile_to_shape(GMMA::Layout_K_INTER_Atom<Element>{}, Shape<_8, Int<kBlockN>>{}));
    using MmaL = decltype(make_tiled_mma(
        GMMA::rs_op_selector<Element, Element, float, Shape<Int<kBlockM>, _8, Int<kBlockN>>, GMMA::Major::K,
                             GMMA::Major::K>(),
        Layout<Shape<Int<kWarpGroups>, _1, _1>>{}));

    struct Smem {
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutQ>> q;
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutK>> k;
        alignas(1024) cute::ArrayEngine<Element, cosize_v<SmemLayoutK>> v;
        alignas(128) cute::ArrayEngine<Element, kOnesSum ? cosize_v<SmemLayoutOnes> : 8> ones;
        alignas(8) uint64_t bar_q;
        uint64_t bar_k[kStages];
        uint64_t bar_v[kStages];
        // K and V stages are freed apart: K_i once S_i is done, V_i one iteration later
        uint64_t bar_k_empty[kStages];
        uint64_t bar_v_empty[kStages];
    };
};

template <class TmaQ, class TmaK, class TmaV, class Element>
struct FwdParams {
    TmaQ tma_q;
    TmaK tma_k;
    TmaV tma_v;
    Element *o;
    float *lse;
    int b, s, t, hq, hkv;
    float scale, scale_log2;
    int band;  // causal: heads per band of the grid (band_width)
};

// Warp specialisation: warpgroup 0 is the producer (one thread issues every TMA load and
// waits for the consumers to free a stage); warpgroups 1.. are the consumers, 64 query rows
// each. The producer gives its registers to the consumers (setmaxnreg).
template <class T, bool kCausal, class Params>
__global__ void __launch_bounds__(T::kThreads, 1) fwd_kernel(CUTE_GRID_CONSTANT Params const p) {
    using Element = typename T::Element;
    constexpr int D = T::kHeadDim, BM = T::kBlockM, BN = T::kBlockN, ST = T::kStages;
    using TBar = cutlass::arch::ClusterTransactionBarrier;
    using Bar = cutlass::arch::ClusterBarrier;

    extern __shared__ __align__(1024) char smem_raw[];
    auto &sm = *reinterpret_cast<typename T::Smem *>(smem_raw);
    const int tid = threadIdx.x;
    // Causal: a one-dimensional grid of query blocks in bands of heads, the longest blocks
    // first (band_width in native_common.cuh)
    int m_block, h, bi;
    if constexpr (kCausal) {
        const int m_blocks = (p.s + BM - 1) / BM;
        const BandedCta c = banded_cta(int(blockIdx.x), m_blocks, p.band);
        m_block = m_blocks - 1 - c.block;
        h = c.slice % p.hq;
        bi = c.slice / p.hq;
    } else {
        m_block = int(gridDim.x) - 1 - int(blockIdx.x);
        h = blockIdx.y;
        bi = blockIdx.z;
    }
    const int hk = h / (p.hq / p.hkv);
    int n_blocks = (p.t + BN - 1) / BN;
    if constexpr (kCausal) n_blocks = min(n_blocks, ((m_block + 1) * BM + BN - 1) / BN);

    Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.s, Int<D>{}, p.hq, p.b));
    Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.t, Int<D>{}, p.hkv, p.b));
    Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.t, Int<D>{}, p.hkv, p.b));
    Tensor gQ = local_tile(mQ(_, _, h, bi), Shape<Int<BM>, Int<D>>{}, make_coord(m_block, 0));  // (BM, D)
    Tensor gK = local_tile(mK(_, _, hk, bi), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0));       // (BN, D, n)
    Tensor gV = local_tile(mV(_, _, hk, bi), Shape<Int<BN>, Int<D>>{}, make_coord(_, 0));       // (BN, D, n)

    Tensor sQ = make_tensor(make_smem_ptr(sm.q.begin()), typename T::SmemLayoutQ{});
    Tensor sK = make_tensor(make_smem_ptr(sm.k.begin()), typename T::SmemLayoutK{});
    Tensor sV = make_tensor(make_smem_ptr(sm.v.begin()), typename T::SmemLayoutK{});
    Tensor sVt = make_tensor(make_smem_ptr(sm.v.begin()), typename T::SmemLayoutVt{});

    auto part_q = tma_partition(p.tma_q, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sQ), group_modes<0, 2>(gQ));
    auto tQgQ = get<0>(part_q);
    auto tQsQ = get<1>(part_q);
    auto part_k = tma_partition(p.tma_k, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sK), group_modes<0, 2>(gK));
    auto tKgK = get<0>(part_k);
    auto tKsK = get<1>(part_k);
    auto part_v = tma_partition(p.tma_v, Int<0>{}, Layout<_1>{}, group_modes<0, 2>(sV), group_modes<0, 2>(gV));
    auto tVgV = get<0>(part_v);
    auto tVsV = get<1>(part_v);
    constexpr uint32_t kBytesQ = BM * D * sizeof(Element);
    constexpr uint32_t kBytesKV = BN * D * sizeof(Element);

    if (tid == 0) {
        TBar::init(&sm.bar_q, 1);
        for (int st = 0; st < ST; ++st) {
            TBar::init(&sm.bar_k[st], 1);
            TBar::init(&sm.bar_v[st], 1);
            Bar::init(&sm.bar_k_empty[st], T::kThreads - 128);
            Bar::init(&sm.bar_v_empty[st], T::kThreads - 128);
        }
        cutlass::arch::fence_barrier_init();
    }
    // kOnesSum: the tile of ones for the row sums, written by every thread and made visible
    // to the tensor cores' (async) reads before the CTA's one barrier
    if constexpr (T::kOnesSum) {
        for (int i = tid; i < int(cosize_v<typename T::SmemLayoutOnes>); i += T::kThreads)
            sm.ones.begin()[i] = Element(1.f);
        cutlass::arch::fence_view_async_shared();
    }
    __syncthreads();

    if (tid < 128) {
        cutlass::arch::warpgroup_reg_dealloc<T::kProducerRegs>();
        if (tid == 0) {
            // iteration i reads KV block n_blocks-1-i from stage i % ST
            TBar::arrive_and_expect_tx(&sm.bar_q, kBytesQ);
            copy(p.tma_q.with(sm.bar_q), tQgQ, tQsQ);
            for (int i = 0; i < n_blocks; ++i) {
                const int st = i % ST, n = n_blocks - 1 - i, free_phase = ((i / ST) - 1) & 1;
                if (i >= ST) Bar::wait(&sm.bar_k_empty[st], free_phase);
                TBar::arrive_and_expect_tx(&sm.bar_k[st], kBytesKV);
                copy(p.tma_k.with(sm.bar_k[st]), tKgK(_, n), tKsK(_, st));
                if (i >= ST) Bar::wait(&sm.bar_v_empty[st], free_phase);
                TBar::arrive_and_expect_tx(&sm.bar_v[st], kBytesKV);
                copy(p.tma_v.with(sm.bar_v[st]), tVgV(_, n), tVsV(_, st));
            }
        }
        return;
    }
    cutlass::arch::warpgroup_reg_alloc<T::kConsumerRegs>();
    const int ctid = tid - 128;

    typename T::MmaS mma_s;
    typename T::MmaO mma_o;
    auto thr_s = mma_s.get_thread_slice(ctid);
    auto thr_o = mma_o.get_thread_slice(ctid);
    Tensor tSrQ = thr_s.partition_fragment_A(sQ);   // (MMA, MMA_M, MMA_K)
    Tensor tSrK = thr_s.partition_fragment_B(sK);   // (MMA, MMA_N, MMA_K, ST)
    Tensor tOrV = thr_o.partition_fragment_B(sVt);  // (MMA, MMA_N, MMA_K, ST)
    Tensor tSrS = partition_fragment_C(mma_s, Shape<Int<BM>, Int<BN>>{});
    Tensor tOrO = partition_fragment_C(mma_o, Shape<Int<BM>, Int<D>>{});
    clear(tOrO);
    Tensor tScS = thr_s.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
    Tensor tOcO = thr_o.partition_C(make_identity_tensor(Shape<Int<BM>, Int<D>>{}));
    // kOnesSum: the row sums' accumulator (every column holds the row's sum)
    typename T::MmaL mma_l;
    auto thr_l = mma_l.get_thread_slice(ctid);
    Tensor sOnes = make_tensor(make_smem_ptr(sm.ones.begin()), typename T::SmemLayoutOnes{});
    Tensor tLrOnes = thr_l.partition_fragment_B(sOnes);  // (MMA, 1, BN/16)
    Tensor tLrL = partition_fragment_C(mma_l, Shape<Int<BM>, _8>{});
    Tensor L = make_tensor(tLrL.data(), rowcol(tLrL.layout()));
    if constexpr (T::kOnesSum) {
        clear(tLrL);
        static_assert(decltype(size<0>(L))::value == decltype(size<0>(rowcol(tOrO.layout())))::value);
    }

    Tensor S = make_tensor(tSrS.data(), rowcol(tSrS.layout()));
    Tensor cS = make_tensor(tScS.data(), rowcol(tScS.layout()));
    Tensor O = make_tensor(tOrO.data(), rowcol(tOrO.layout()));
    Tensor cO = make_tensor(tOcO.data(), rowcol(tOcO.layout()));
    constexpr int R = decltype(size<0>(S))::value;
    static_assert(R == decltype(size<0>(O))::value);
    float row_max[R], row_sum[R];
    CUTE_UNROLL
    for (int r = 0; r < R; ++r) {
        row_max[r] = -INFINITY;
        row_sum[r] = 0.f;
    }
    Tensor tOrP = make_tensor<Element>(tSrS.layout());
    Tensor tOrPa = make_tensor(tOrP.data(), acc_as_a(tSrS.layout()));

    // Iteration i issues S_i = Q·K_iᵀ and O += P_{i-1}·V_{i-1} together, then computes the
    // softmax of S_i while the second product runs (both are waited for within the
    // iteration: nothing is in flight across the loop's back edge). With kPingPong the
    // consumer warpgroups take turns to issue (named barrier 1 + wg, round robin), so one
    // warpgroup's softmax overlaps the others' products.
    const int wg = ctid / 128;
    auto turn_wait = [&] {
        if constexpr (T::kPingPong) bar_sync(1 + wg, 256);
    };
    auto turn_pass = [&] {
        if constexpr (T::kPingPong) bar_arrive(1 + (wg + 1) % T::kWarpGroups, 256);
    };
    float row_scale[R];
    // softmax of S_i (KV block n) in place: P_i in S's registers, row_scale the factor the
    // accumulated O and row sums take for the new row maxima
    auto softmax = [&](int n) {
        const bool masked = (kCausal && (n + 1) * BN > m_block * BM + 1) || (n + 1) * BN > p.t;
        if (masked) {
            CUTE_UNROLL
            for (int r = 0; r < R; ++r) {
                CUTE_UNROLL
                for (int c = 0; c < size<1>(S); ++c) {
                    const int row = m_block * BM + get<0>(cS(r, c));
                    const int col = n * BN + get<1>(cS(r, c));
                    if (col >= p.t || (kCausal && col > row)) S(r, c) = -INFINITY;
                }
            }
        }
        CUTE_UNROLL
        for (int r = 0; r < R; ++r) {
            constexpr int NC = T::kChains, C = decltype(size<1>(S))::value;
            static_assert(C % NC == 0);
            float mxc[NC];
            CUTE_UNROLL
            for (int j = 0; j < NC; ++j) mxc[j] = j == 0 ? row_max[r] : -INFINITY;
            CUTE_UNROLL
            for (int c = 0; c < C; ++c) mxc[c % NC] = fmaxf(mxc[c % NC], S(r, c));
            float mx = mxc[0];
            CUTE_UNROLL
            for (int j = 1; j < NC; ++j) mx = fmaxf(mx, mxc[j]);
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
            mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
            row_scale[r] = mx == -INFINITY ? 1.f : ex2((row_max[r] - mx) * p.scale_log2);
            const float mxs = mx == -INFINITY ? 0.f : mx * p.scale_log2;
            row_max[r] = mx;
            float sc[NC];
            CUTE_UNROLL
            for (int j = 0; j < NC; ++j) sc[j] = 0.f;
            CUTE_UNROLL
            for (int c = 0; c < C; ++c) {
                const float e = ex2(fmaf(S(r, c), p.scale_log2, -mxs));
                S(r, c) = e;
                if constexpr (!T::kOnesSum) sc[c % NC] += e;
            }
            if constexpr (!T::kOnesSum) {
                float sum = sc[0];
                CUTE_UNROLL
                for (int j = 1; j < NC; ++j) sum += sc[j];
                row_sum[r] = row_sum[r] * row_scale[r] + sum;
            }
        }
    };
    auto issue_s = [&](int st) {
        warpgroup_fence_operand(tSrS);
        warpgroup_arrive();
        mma_s.accumulate_ = GMMA::ScaleOut::Zero;
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tSrQ); ++k) {
            cute::gemm(mma_s, tSrQ(_, _, k), tSrK(_, _, k, st), tSrS);
            mma_s.accumulate_ = GMMA::ScaleOut::One;
        }
        warpgroup_commit_batch();
    };
    // O·row_scale: the accumulated O for the new row maxima, once the product before is done
    // (outside the turn, so the warpgroup issues its products as soon as its turn comes; H200,
    // causal, fwd TFLOP/s, two rounds against the rescale inside the turn in one visit: 64K
    // 32 × 128 628.6 / 628.6 against 621.2 / 621.0, 32/4 × 64 511.9 / 511.4 against 505.6 /
    // 510.2; 16K 32/4 × 64 474.4 / 469.3 against 465.6 / 456.5)
    auto rescale_o = [&] {
        CUTE_UNROLL
        for (int r = 0; r < R; ++r) {
            CUTE_UNROLL
            for (int c = 0; c < size<1>(O); ++c) O(r, c) *= row_scale[r];
            if constexpr (T::kOnesSum) {
                CUTE_UNROLL
                for (int c = 0; c < size<1>(L); ++c) L(r, c) *= row_scale[r];
            }
        }
    };
    // O += P·V from stage st
    auto issue_o = [&](int st, int phase) {
        TBar::wait(&sm.bar_v[st], phase);
        warpgroup_fence_operand(tOrPa);
        warpgroup_fence_operand(tOrO);
        warpgroup_arrive();
        CUTE_UNROLL
        for (int k = 0; k < size<2>(tOrPa); ++k) cute::gemm(mma_o, tOrPa(_, _, k), tOrV(_, _, k, st), tOrO);
        if constexpr (T::kOnesSum) {
            warpgroup_fence_operand(tLrL);
            CUTE_UNROLL
            for (int k = 0; k < size<2>(tOrPa); ++k) cute::gemm(mma_l, tOrPa(_, _, k), tLrOnes(_, _, k), tLrL);
        }
        warpgroup_commit_batch();
    };
    auto to_p = [&] {
        CUTE_UNROLL
        for (int j = 0; j < size(tSrS); ++j) tOrP(j) = static_cast<Element>(tSrS(j));
    };

    TBar::wait(&sm.bar_q, 0);
    if constexpr (T::kPingPong) {
        if (wg == T::kWarpGroups - 1) bar_arrive(1, 256);  // warpgroup 0 issues first
    }
    // iteration 0: S_0 alone
    TBar::wait(&sm.bar_k[0], 0);
    turn_wait();
    issue_s(0);
    if (!(T::kPingPong && wg == T::kWarpGroups - 1 && n_blocks == 1)) turn_pass();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    Bar::arrive(&sm.bar_k_empty[0]);
    softmax(n_blocks - 1);
    to_p();
    for (int i = 1; i < n_blocks; ++i) {
        const int st = i % ST, phase = (i / ST) & 1, pst = (i - 1) % ST, pphase = ((i - 1) / ST) & 1;
        TBar::wait(&sm.bar_k[st], phase);
        turn_wait();
        issue_s(st);
        issue_o(pst, pphase);
        // the last warpgroup's last pass would have no waiter
        if (!(T::kPingPong && wg == T::kWarpGroups - 1 && i == n_blocks - 1)) turn_pass();
        warpgroup_wait<1>();
        warpgroup_fence_operand(tSrS);
        Bar::arrive(&sm.bar_k_empty[st]);
        softmax(n_blocks - 1 - i);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        if constexpr (T::kOnesSum) warpgroup_fence_operand(tLrL);
        Bar::arrive(&sm.bar_v_empty[pst]);
        rescale_o();
        to_p();
    }
    {
        const int last = n_blocks - 1;
        issue_o(last % ST, (last / ST) & 1);
        warpgroup_wait<0>();
        warpgroup_fence_operand(tOrO);
        if constexpr (T::kOnesSum) warpgroup_fence_operand(tLrL);
    }

    // Epilogue: O / l into o, m·scale + ln l into lse.
    CUTE_UNROLL
    for (int r = 0; r < R; ++r) {
        float sum;
        if constexpr (T::kOnesSum) {
            sum = L(r, 0);  // the whole row's, from the tensor cores
        } else {
            sum = row_sum[r];
            sum += __shfl_xor_sync(0xffffffff, sum, 1);
            sum += __shfl_xor_sync(0xffffffff, sum, 2);
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;
        const int row = m_block * BM + get<0>(cO(r, 0));
        CUTE_UNROLL
        for (int c = 0; c < size<1>(O); ++c) {
            const int col = get<1>(cO(r, c));
            if (row < p.s) {
                p.o[((int64_t(bi) * p.s + row) * p.hq + h) * D + col] = static_cast<Element>(O(r, c) * inv);
            }
        }
        if ((ctid & 3) == 0 && row < p.s) {
            p.lse[(int64_t(bi) * p.hq + h) * p.s + row] = sum > 0.f ? row_max[r] * p.scale + logf(sum) : -INFINITY;
        }
    }
}

template <class Element, int D, bool kCausal>
int launch_fwd(const longctx_sdpa_desc &d, const void *q, const void *k, const void *v, void *o, float *lse,
               cudaStream_t stream, char *err, size_t err_len) {
    using T = FwdTraits<Element, D>;
    const int b = int(d.b), s = int(d.s), t = int(d.t), hq = int(d.hq), hkv = int(d.hkv);
    auto mQ = make_tensor(make_gmem_ptr(reinterpret_cast<Element const *>(q)), make_shape(s, Int<D>{}, hq, b),
                          make_stride(int64_t(hq) * D, _1{}, int64_t(D), int64_t(s) * hq * D));
    auto mK = make_tensor(make_gmem_ptr(reinterpret_cast<Element const *>(k)), make_shape(t, Int<D>{}, hkv, b),
                          make_stride(int64_t(hkv) * D, _1{}, int64_t(D), int64_t(t) * hkv * D));
    auto mV = make_tensor(make_gmem_ptr(reinterpret_cast<Element const *>(v)), make_shape(t, Int<D>{}, hkv, b),
                          make_stride(int64_t(hkv) * D, _1{}, int64_t(D), int64_t(t) * hkv * D));
    auto tma_q = make_tma_atom(SM90_TMA_LOAD{}, mQ, typename T::SmemLayoutQ{}, Shape<Int<T::kBlockM>, Int<D>>{});
    auto tma_k = make_tma_atom(SM90_TMA_LOAD{}, mK, typename T::SmemLayoutK{}(_, _, 0), Shape<Int<T::kBlockN>, Int<D>>{});
    auto tma_v = make_tma_atom(SM90_TMA_LOAD{}, mV, typename T::SmemLayoutK{}(_, _, 0), Shape<Int<T::kBlockN>, Int<D>>{});
    using P = FwdParams<decltype(tma_q), decltype(tma_k), decltype(tma_v), Element>;
    const int m_blocks = (s + T::kBlockM - 1) / T::kBlockM;
    P params{tma_q, tma_k, tma_v, reinterpret_cast<Element *>(o), lse, b, s, t, hq, hkv, d.scale,
             float(d.scale * M_LOG2E), band_width(hq * b, m_blocks, sm_count(d.ordinal))};
    auto kernel = fwd_kernel<T, kCausal, P>;
    const int smem = int(sizeof(typename T::Smem));
    static std::atomic<uint64_t> smem_set{0};
    cudaError_t e = set_smem_once(smem_set, kernel, smem, d.ordinal);
    if (e == cudaSuccess) {
        const dim3 grid = kCausal ? dim3(unsigned(m_blocks * hq * b)) : dim3(m_blocks, hq, b);
        kernel<<<grid, T::kThreads, smem, stream>>>(params);
        e = cudaGetLastError();
    }
    if (e != cudaSuccess) {
        snprintf(err, err_len, "native attention forward (d %d): %s", D, cudaGetErrorString(e));
        return LONGCTX_SDPA_FAILED;
    }
    return LONGCTX_SDPA_OK;
}

}  // namespace longctx_native

extern "C" const char *longctx_native_uncovered(const longctx_sdpa_desc *d, const void *q, const void *k,
                                                const void *v) {
    if (d->d != 64 && d->d != 128) return "head dim is not 64 or 128";
    if (d->hkv <= 0 || d->hq % d->hkv != 0) return "query heads are not a multiple of key/value heads";
    if (d->causal && d->s != d->t) return "causal with s != t";
    if (d->band_left > 0) return "a sliding-window band";
    if (d->dtype != LONGCTX_SDPA_BF16 && d->dtype != LONGCTX_SDPA_F16) return "dtype";
    if (d->s <= 0 || d->t <= 0 || d->b <= 0 || d->s > (1LL << 30) || d->t > (1LL << 30)) return "sizes";
    // the causal grids are one-dimensional: every (block of 64 rows, head, batch) must fit an int
    if (int64_t(d->b) * d->hq * ((int64_t(d->s) + 63) / 64) > INT32_MAX ||
        int64_t(d->b) * d->hkv * ((int64_t(d->t) + 63) / 64) > INT32_MAX)
        return "sizes (more than 2^31 - 1 thread blocks)";
    if ((reinterpret_cast<uintptr_t>(q) | reinterpret_cast<uintptr_t>(k) | reinterpret_cast<uintptr_t>(v)) & 15)
        return "q/k/v not 16-byte aligned";
    // the compute capability, asked once per device
    const int major = longctx_native_common::cached_device_attr<cudaDevAttrComputeCapabilityMajor>(d->ordinal);
    if (major != 9) return "the GPU is not a Hopper (compute capability 9.x; the kernel is built for sm_90a)";
    return nullptr;
}

extern "C" int longctx_native_fwd(const longctx_sdpa_desc *d, const void *q, const void *k, const void *v, void *o,
                                  float *lse, void *stream, char *err, size_t err_len) {
    using namespace longctx_native;
    if (err && err_len) err[0] = 0;
    const char *why = longctx_native_uncovered(d, q, k, v);
    if (why) {
        if (err && err_len) snprintf(err, err_len, "native attention: not covered: %s", why);
        return LONGCTX_SDPA_UNSUPPORTED;
    }
    auto st = reinterpret_cast<cudaStream_t>(stream);
    const bool bf = d->dtype == LONGCTX_SDPA_BF16;
#define LONGCTX_DISPATCH(E, D)                                                               \
    return d->causal ? launch_fwd<E, D, true>(*d, q, k, v, o, lse, st, err, err_len)         \
                     : launch_fwd<E, D, false>(*d, q, k, v, o, lse, st, err, err_len)
    if (bf && d->d == 64) LONGCTX_DISPATCH(cutlass::bfloat16_t, 64);
    if (bf) LONGCTX_DISPATCH(cutlass::bfloat16_t, 128);
    if (d->d == 64) LONGCTX_DISPATCH(cutlass::half_t, 64);
    LONGCTX_DISPATCH(cutlass::half_t, 128);
#undef LONGCTX_DISPATCH
}
