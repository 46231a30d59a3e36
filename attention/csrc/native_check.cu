// Device check and benchmark of the native Hopper attention kernels (native_fwd_sm90.cu,
// native_bwd_sm90.cu), built by scripts/build_native_check.sh and run on the GPU machine:
//
//   native_check            correctness against a naive f32 reference on the GPU, then
//                           TFLOP/s of the native kernels and of cuDNN (the shim) side by side
//   native_check_prof       the same with the backward's phase clock (built by
//                           scripts/build_native_check.sh --profile): cycles per step by phase
//
// Correctness: o as max|o - ref| / max|ref| ≤ 2e-2, lse max absolute difference ≤ 5e-3,
// dq, dk, dv as max|x - ref| / max|ref| ≤ 5e-2 (the tolerances of `longctx bench attention
// --check`); the reference computes every score, probability and gradient in f32 from the
// same bf16/f16 inputs (the backward from the native forward's o and lse, as training runs
// it). Timing: CUDA events, median of 10 after 3 warm-ups; FLOP = 4·b·h·s·t·d (halved when
// causal) forward, 2.5 times that backward, as `bench attention` counts them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <vector>

#include "native_fmha.h"

// cuda_profiler_api.h's two functions (libcudart has them; the runtime wheel the build takes
// its headers from ships no cuda_profiler_api.h)
extern "C" cudaError_t cudaProfilerStart(void);
extern "C" cudaError_t cudaProfilerStop(void);

#if LONGCTX_NATIVE_PROFILE
// native_bwd_sm90.cu's phase clock (scripts/build_native_check.sh --profile)
extern "C" int longctx_native_bwd_profile(unsigned long long *out);
extern "C" const char *const *longctx_native_bwd_phase_names(int d);
#endif

#define CK(x)                                                                        \
    do {                                                                             \
        cudaError_t e_ = (x);                                                        \
        if (e_ != cudaSuccess) {                                                     \
            fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e_)); \
            exit(2);                                                                 \
        }                                                                            \
    } while (0)

template <class T>
__device__ float to_f(T x);
template <>
__device__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <>
__device__ float to_f(__half x) { return __half2float(x); }

__device__ uint32_t mix(uint32_t h) {
    h ^= h >> 15; h *= 2246822519u; h ^= h >> 13; h *= 3266489917u; h ^= h >> 16;
    return h;
}

// Inputs: uniform on [-1, 1), or (normal) standard normal by Box-Muller, the distribution of
// `longctx bench attention`'s randn inputs
template <class T>
__global__ void fill(T *x, size_t n, uint32_t seed, int normal) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
        uint32_t h = mix(uint32_t(i) * 2654435761u ^ seed);
        float u = (h >> 8) * (1.0f / 16777216.0f);
        if (normal) {
            float u2 = (mix(h ^ 0x9e3779b9u) >> 8) * (1.0f / 16777216.0f);
            x[i] = T(sqrtf(-2.f * logf(1.f - u)) * cospif(2.f * u2));
        } else {
            x[i] = T(u * 2.f - 1.f);
        }
    }
}

// One warp per (row, head, batch): two passes over the keys in f32.
template <class T>
__global__ void reference(const T *q, const T *k, const T *v, float *o, float *lse, int b, int s, int t, int hq,
                          int hkv, int d, float scale, int causal) {
    int warp = (blockIdx.x * blockDim.x + threadIdx.x) / 32, lane = threadIdx.x % 32;
    if (warp >= b * hq * s) return;
    int row = warp % s, h = (warp / s) % hq, bi = warp / (s * hq), hk = h / (hq / hkv);
    const T *qr = q + ((size_t(bi) * s + row) * hq + h) * d;
    int last = causal ? row : t - 1;
    float mx = -INFINITY;
    for (int c = lane; c <= last; c += 32) {
        const T *kr = k + ((size_t(bi) * t + c) * hkv + hk) * d;
        float acc = 0.f;
        for (int j = 0; j < d; ++j) acc += to_f(qr[j]) * to_f(kr[j]);
        mx = fmaxf(mx, acc * scale);
    }
    for (int off = 16; off; off >>= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, off));
    float sum = 0.f;
    float acc_o[4] = {0, 0, 0, 0};  // lane owns columns lane + 32·i of o (d ≤ 128)
    for (int c = 0; c <= last; ++c) {
        const T *kr = k + ((size_t(bi) * t + c) * hkv + hk) * d;
        float part = 0.f;
        for (int j = lane; j < d; j += 32) part += to_f(qr[j]) * to_f(kr[j]);
        for (int off = 16; off; off >>= 1) part += __shfl_xor_sync(0xffffffff, part, off);
        float pexp = expf(part * scale - mx);
        sum += pexp;
        const T *vr = v + ((size_t(bi) * t + c) * hkv + hk) * d;
        for (int i = 0; i * 32 + lane < d; ++i) acc_o[i] += pexp * to_f(vr[i * 32 + lane]);
    }
    float *orow = o + ((size_t(bi) * s + row) * hq + h) * d;
    for (int i = 0; i * 32 + lane < d; ++i) orow[i * 32 + lane] = acc_o[i] / sum;
    if (lane == 0) lse[(size_t(bi) * hq + h) * s + row] = mx + logf(sum);
}

template <class T>
__global__ void to_f32(const T *x, float *y, size_t n) {
    for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x)
        y[i] = to_f(x[i]);
}

// Backward reference, materialised [b, hq, s, t] in f32: P from the reference lse, dP = dO·V,
// Dr = Σ_d dO·O_ref, dS = P ∘ (dP − Dr).
template <class T>
__global__ void ref_p_ds(const T *q, const T *k, const T *v, const T *d_o, const float *lse, const float *dr,
                         float *P, float *dS, int b, int s, int t, int hq, int hkv, int d, float scale, int causal) {
    size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
    if (idx >= size_t(b) * hq * s * t) return;
    int j = idx % t, i = (idx / t) % s, h = (idx / (size_t(t) * s)) % hq, bi = idx / (size_t(t) * s * hq);
    int hk = h / (hq / hkv);
    const T *qr = q + ((size_t(bi) * s + i) * hq + h) * d, *dor = d_o + ((size_t(bi) * s + i) * hq + h) * d;
    const T *kr = k + ((size_t(bi) * t + j) * hkv + hk) * d, *vr = v + ((size_t(bi) * t + j) * hkv + hk) * d;
    float sc = 0.f, dp = 0.f;
    for (int c = 0; c < d; ++c) {
        sc += to_f(qr[c]) * to_f(kr[c]);
        dp += to_f(dor[c]) * to_f(vr[c]);
    }
    size_t row = (size_t(bi) * hq + h) * s + i;
    float p = (causal && j > i) ? 0.f : expf(sc * scale - lse[row]);
    P[idx] = p;
    dS[idx] = p * (dp - dr[row]);
}
template <class T>
__global__ void ref_dr(const T *d_o, const float *o, float *dr, int b, int s, int hq, int d) {
    size_t row = blockIdx.x * size_t(blockDim.x) + threadIdx.x;  // (bi, h, i)
    if (row >= size_t(b) * hq * s) return;
    int i = row % s, h = (row / s) % hq, bi = row / (size_t(s) * hq);
    size_t base = ((size_t(bi) * s + i) * hq + h) * d;
    float acc = 0.f;
    for (int c = 0; c < d; ++c) acc += to_f(d_o[base + c]) * o[base + c];
    dr[row] = acc;
}
// dq[bi, i, h, c] = scale Σ_j dS·k
template <class T>
__global__ void ref_dq(const T *k, const float *dS, float *dq, int b, int s, int t, int hq, int hkv, int d,
                       float scale) {
    size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
    if (idx >= size_t(b) * s * hq * d) return;
    int c = idx % d, h = (idx / d) % hq, i = (idx / (size_t(d) * hq)) % s, bi = idx / (size_t(d) * hq * s);
    int hk = h / (hq / hkv);
    const float *ds = dS + ((size_t(bi) * hq + h) * s + i) * t;
    float acc = 0.f;
    for (int j = 0; j < t; ++j) acc += ds[j] * to_f(k[((size_t(bi) * t + j) * hkv + hk) * d + c]);
    dq[idx] = acc * scale;
}
// dk[bi, j, hk, c] = scale Σ_{h in group, i} dS·q,  dv = Σ P·dO
template <class T>
__global__ void ref_dkv(const T *q, const T *d_o, const float *P, const float *dS, float *dk, float *dv, int b,
                        int s, int t, int hq, int hkv, int d, float scale) {
    size_t idx = blockIdx.x * size_t(blockDim.x) + threadIdx.x;
    if (idx >= size_t(b) * t * hkv * d) return;
    int c = idx % d, hk = (idx / d) % hkv, j = (idx / (size_t(d) * hkv)) % t, bi = idx / (size_t(d) * hkv * t);
    int g = hq / hkv;
    float ak = 0.f, av = 0.f;
    for (int h = hk * g; h < hk * g + g; ++h)
        for (int i = 0; i < s; ++i) {
            size_t pi = ((size_t(bi) * hq + h) * s + i) * t + j, qi = ((size_t(bi) * s + i) * hq + h) * d + c;
            ak += dS[pi] * to_f(q[qi]);
            av += P[pi] * to_f(d_o[qi]);
        }
    dk[idx] = ak * scale;
    dv[idx] = av;
}

// max|x - ref| / max|ref| of a device element array against a device f32 array
template <class T>
static double rel_diff(const T *x, const float *ref, size_t n) {
    float *xf;
    CK(cudaMalloc(&xf, n * sizeof(float)));
    to_f32<<<1024, 256>>>(x, xf, n);
    CK(cudaDeviceSynchronize());
    std::vector<float> hx(n), hr(n);
    CK(cudaMemcpy(hx.data(), xf, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hr.data(), ref, n * 4, cudaMemcpyDeviceToHost));
    CK(cudaFree(xf));
    double maxref = 0, maxdiff = 0;
    for (size_t i = 0; i < n; ++i) {
        maxref = std::max(maxref, double(std::fabs(hr[i])));
        double dd = std::fabs(double(hx[i]) - hr[i]);
        if (!(dd <= maxdiff)) maxdiff = dd;
    }
    return maxdiff / std::max(maxref, 1e-30);
}

struct Case {
    int b, s, t, hq, hkv, d, causal, f16;
    int normal = 0;  // inputs standard normal instead of uniform on [-1, 1)
};

static float median(std::vector<float> x) {
    std::sort(x.begin(), x.end());
    return x[x.size() / 2];
}

// --sustain: each kernel of a speed case also runs back to back for `seconds` on its own, so
// that the GPU's power and clock settle on that kernel's draw (the H200 runs these kernels at
// its 700 W cap); `marks`, when given, gets a line `YYYY/MM/DD HH:MM:SS.NNNNNNNNN NAME` as
// each such run starts, in local time as nvidia-smi stamps its samples, for
// scripts/gpu_clocks.py.
// --ncu: after a speed case's timing, each of its kernels (native and cuDNN, forward and
// backward) runs once more between cudaProfilerStart and cudaProfilerStop, so that
// `ncu --profile-from-start off` profiles exactly those warm calls (scripts/gpu_ncu.sh).
struct Sustain {
    int seconds = 0;
    FILE *marks = nullptr;
    bool ncu = false;
};

static void mark(FILE *f, const char *name) {
    if (!f) return;
    const auto now = std::chrono::system_clock::now();
    const std::time_t secs = std::chrono::system_clock::to_time_t(now);
    const long ns = long(std::chrono::duration_cast<std::chrono::nanoseconds>(now.time_since_epoch()).count() %
                         1000000000LL);
    std::tm tm{};
    localtime_r(&secs, &tm);
    char stamp[32];
    std::strftime(stamp, sizeof stamp, "%Y/%m/%d %H:%M:%S", &tm);
    fprintf(f, "%s.%09ld %s\n", stamp, ns, name);
    fflush(f);
}

template <class T>
static int run_case(const Case &c, bool check, bool bench, bool cudnn, const Sustain &sus) {
    size_t nq = size_t(c.b) * c.s * c.hq * c.d, nk = size_t(c.b) * c.t * c.hkv * c.d, nl = size_t(c.b) * c.hq * c.s;
    T *q, *k, *v, *o, *d_o, *dq, *dk, *dv;
    float *lse;
    CK(cudaMalloc(&d_o, nq * sizeof(T)));
    CK(cudaMalloc(&dq, nq * sizeof(T)));
    CK(cudaMalloc(&dk, nk * sizeof(T)));
    CK(cudaMalloc(&dv, nk * sizeof(T)));
    CK(cudaMalloc(&q, nq * sizeof(T)));
    CK(cudaMalloc(&k, nk * sizeof(T)));
    CK(cudaMalloc(&v, nk * sizeof(T)));
    CK(cudaMalloc(&o, nq * sizeof(T)));
    CK(cudaMalloc(&lse, nl * sizeof(float)));
    fill<<<1024, 256>>>(q, nq, 1u, c.normal);
    fill<<<1024, 256>>>(k, nk, 2u, c.normal);
    fill<<<1024, 256>>>(v, nk, 3u, c.normal);
    fill<<<1024, 256>>>(d_o, nq, 4u, c.normal);
    CK(cudaMemset(o, 0, nq * sizeof(T)));
    longctx_sdpa_desc desc{};
    desc.ordinal = 0;
    desc.dtype = c.f16 ? LONGCTX_SDPA_F16 : LONGCTX_SDPA_BF16;
    desc.b = c.b; desc.s = c.s; desc.t = c.t; desc.hq = c.hq; desc.hkv = c.hkv; desc.d = c.d;
    desc.causal = c.causal;
    desc.scale = 1.f / sqrtf(float(c.d));
    char err[512];
    int rc = longctx_native_fwd(&desc, q, k, v, o, lse, nullptr, err, sizeof err);
    CK(cudaDeviceSynchronize());
    printf("case b%d s%d t%d hq%d hkv%d d%d %s %s:", c.b, c.s, c.t, c.hq, c.hkv, c.d, c.causal ? "causal" : "full",
           c.f16 ? "f16" : "bf16");
    if (rc != LONGCTX_SDPA_OK) {
        printf(" native rc %d (%s)\n", rc, err);
        return rc == LONGCTX_SDPA_UNSUPPORTED ? 0 : 1;
    }
    int bad = 0;
    if (check) {
        float *ro, *rl, *of;
        CK(cudaMalloc(&ro, nq * sizeof(float)));
        CK(cudaMalloc(&rl, nl * sizeof(float)));
        CK(cudaMalloc(&of, nq * sizeof(float)));
        int warps = c.b * c.hq * c.s;
        reference<T><<<(warps * 32 + 255) / 256, 256>>>(q, k, v, ro, rl, c.b, c.s, c.t, c.hq, c.hkv, c.d, desc.scale,
                                                        c.causal);
        to_f32<<<1024, 256>>>(o, of, nq);
        CK(cudaDeviceSynchronize());
        std::vector<float> ho(nq), hr(nq), hl(nl), hrl(nl);
        CK(cudaMemcpy(ho.data(), of, nq * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hr.data(), ro, nq * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hl.data(), lse, nl * 4, cudaMemcpyDeviceToHost));
        CK(cudaMemcpy(hrl.data(), rl, nl * 4, cudaMemcpyDeviceToHost));
        double maxref = 0, maxdiff = 0, maxl = 0;
        size_t worst = 0;
        for (size_t i = 0; i < nq; ++i) {
            maxref = std::max(maxref, double(std::fabs(hr[i])));
            double dd = std::fabs(double(ho[i]) - hr[i]);
            if (!(dd <= maxdiff)) { maxdiff = dd; worst = i; }
        }
        for (size_t i = 0; i < nl; ++i) maxl = std::max(maxl, std::fabs(double(hl[i]) - hrl[i]));
        double rel = maxdiff / std::max(maxref, 1e-30);
        bad = !(rel <= 2e-2) || !(maxl <= 5e-3);
        printf(" o %.2e (worst at %zu: %.5f vs %.5f) lse %.2e %s", rel, worst, ho[worst], hr[worst], maxl,
               bad ? "FAIL" : "ok");
        // backward from the native forward's o and lse, against the f32 reference
        int rcb = longctx_native_bwd(&desc, q, k, v, o, d_o, lse, dq, dk, dv, nullptr, err, sizeof err);
        CK(cudaDeviceSynchronize());
        if (rcb != LONGCTX_SDPA_OK) {
            printf(" | bwd rc %d (%s) FAIL", rcb, err);
            bad = 1;
        } else {
            size_t np = size_t(c.b) * c.hq * c.s * c.t;
            float *P, *dS, *dr, *rdq, *rdk, *rdv;
            CK(cudaMalloc(&P, np * 4));
            CK(cudaMalloc(&dS, np * 4));
            CK(cudaMalloc(&dr, nl * 4));
            CK(cudaMalloc(&rdq, nq * 4));
            CK(cudaMalloc(&rdk, nk * 4));
            CK(cudaMalloc(&rdv, nk * 4));
            ref_dr<T><<<(nl + 255) / 256, 256>>>(d_o, ro, dr, c.b, c.s, c.hq, c.d);
            ref_p_ds<T><<<(np + 255) / 256, 256>>>(q, k, v, d_o, rl, dr, P, dS, c.b, c.s, c.t, c.hq, c.hkv, c.d,
                                                   desc.scale, c.causal);
            ref_dq<T><<<(nq + 255) / 256, 256>>>(k, dS, rdq, c.b, c.s, c.t, c.hq, c.hkv, c.d, desc.scale);
            ref_dkv<T><<<(nk + 255) / 256, 256>>>(q, d_o, P, dS, rdk, rdv, c.b, c.s, c.t, c.hq, c.hkv, c.d,
                                                  desc.scale);
            CK(cudaDeviceSynchronize());
            double edq = rel_diff(dq, rdq, nq), edk = rel_diff(dk, rdk, nk), edv = rel_diff(dv, rdv, nk);
            int badb = !(edq <= 5e-2) || !(edk <= 5e-2) || !(edv <= 5e-2);
            printf(" | dq %.2e dk %.2e dv %.2e %s", edq, edk, edv, badb ? "FAIL" : "ok");
            bad |= badb;
            for (float *x : {P, dS, dr, rdq, rdk, rdv}) CK(cudaFree(x));
        }
        CK(cudaFree(ro));
        CK(cudaFree(rl));
        CK(cudaFree(of));
    }
    if (bench) {
        double flop = 4.0 * c.b * c.hq * double(c.s) * c.t * c.d * (c.causal ? 0.5 : 1.0);
        cudaEvent_t e0, e1;
        CK(cudaEventCreate(&e0));
        CK(cudaEventCreate(&e1));
        auto time = [&](auto &&f) {
            std::vector<float> ms;
            for (int i = 0; i < 13; ++i) {
                CK(cudaEventRecord(e0));
                f();
                CK(cudaEventRecord(e1));
                CK(cudaEventSynchronize(e1));
                float x;
                CK(cudaEventElapsedTime(&x, e0, e1));
                if (i >= 3) ms.push_back(x);
            }
            return median(ms);
        };
        // the four calls a speed case times (and --ncu, --sustain repeat)
        auto native_fwd = [&] { longctx_native_fwd(&desc, q, k, v, o, lse, nullptr, err, sizeof err); };
        auto cudnn_fwd = [&] { longctx_sdpa_fwd(&desc, q, k, v, o, lse, nullptr, err, sizeof err); };
        auto native_bwd = [&] { longctx_native_bwd(&desc, q, k, v, o, d_o, lse, dq, dk, dv, nullptr, err, sizeof err); };
        auto cudnn_bwd = [&] { longctx_sdpa_bwd(&desc, q, k, v, o, d_o, lse, dq, dk, dv, nullptr, err, sizeof err); };
        // which of the timed kernels ran (--ncu and --sustain repeat only those)
        bool cudnn_fwd_ok = false, native_bwd_ok = false, cudnn_bwd_ok = false;
        float tn = time(native_fwd);
        printf(" | native %.3f ms %.1f TFLOP/s", tn, flop / tn / 1e9);
        if (cudnn) {
            int rc2 = longctx_sdpa_fwd(&desc, q, k, v, o, lse, nullptr, err, sizeof err);
            CK(cudaDeviceSynchronize());
            if (rc2 == LONGCTX_SDPA_OK) {
                cudnn_fwd_ok = true;
                float tc = time(cudnn_fwd);
                printf(" | cudnn %.3f ms %.1f TFLOP/s | native/cudnn %.3f", tc, flop / tc / 1e9, tc / tn);
            } else {
                printf(" | cudnn rc %d (%s)", rc2, err);
            }
        }
        // backward: 2.5x the forward's FLOP
        int rcb = longctx_native_bwd(&desc, q, k, v, o, d_o, lse, dq, dk, dv, nullptr, err, sizeof err);
        CK(cudaDeviceSynchronize());
        if (rcb != LONGCTX_SDPA_OK) {
            printf(" | bwd native rc %d (%s)", rcb, err);
        } else {
            native_bwd_ok = true;
#if LONGCTX_NATIVE_PROFILE
            unsigned long long phases[2][10];
            CK(cudaDeviceSynchronize());
            if (longctx_native_bwd_profile(&phases[0][0])) exit(2);  // clears the warm-up call's sums
#endif
            float tb = time(native_bwd);
            printf(" || bwd native %.3f ms %.1f TFLOP/s", tb, 2.5 * flop / tb / 1e9);
#if LONGCTX_NATIVE_PROFILE
            // SM cycles per consumer step, by phase (the 13 timed calls), per consumer warpgroup
            CK(cudaDeviceSynchronize());
            if (longctx_native_bwd_profile(&phases[0][0])) exit(2);
            const char *const *names = longctx_native_bwd_phase_names(int(desc.d));
            for (int w = 0; w < 2; ++w) {
                const double steps = double(phases[w][9] ? phases[w][9] : 1);
                double total = 0;
                for (int i = 0; i < 9; ++i) total += double(phases[w][i]);
                printf("\n  phases wg%d, cycles per step %.0f:", w, total / steps);
                for (int i = 0; i < 9; ++i) printf(" %s %.0f", names[i], double(phases[w][i]) / steps);
            }
#endif
            if (cudnn) {
                int rc3 = longctx_sdpa_bwd(&desc, q, k, v, o, d_o, lse, dq, dk, dv, nullptr, err, sizeof err);
                CK(cudaDeviceSynchronize());
                if (rc3 == LONGCTX_SDPA_OK) {
                    cudnn_bwd_ok = true;
                    float tc = time(cudnn_bwd);
                    printf(" | bwd cudnn %.3f ms %.1f TFLOP/s | native/cudnn %.3f", tc, 2.5 * flop / tc / 1e9, tc / tb);
                } else {
                    printf(" | bwd cudnn rc %d (%s)", rc3, err);
                }
            }
        }
        printf("\n");
        fflush(stdout);
        if (sus.ncu) {
            CK(cudaDeviceSynchronize());
            CK(cudaProfilerStart());
            native_fwd();
            if (cudnn_fwd_ok) cudnn_fwd();
            if (native_bwd_ok) native_bwd();
            if (cudnn_bwd_ok) cudnn_bwd();
            CK(cudaDeviceSynchronize());
            CK(cudaProfilerStop());
        }
        if (sus.seconds > 0) {
            // each kernel alone, back to back, in batches of 4 calls between two events, until
            // `seconds` have passed: TFLOP/s at the power and clock that kernel settles on
            auto sustain = [&](const char *what, double work, auto &&f) {
                char name[160];
                snprintf(name, sizeof name, "%s s%d t%d hq%d hkv%d d%d %s", what, c.s, c.t, c.hq, c.hkv, c.d,
                         c.causal ? "causal" : "full");
                mark(sus.marks, name);
                double total_ms = 0;
                long calls = 0;
                while (total_ms < 1e3 * sus.seconds) {
                    CK(cudaEventRecord(e0));
                    for (int i = 0; i < 4; ++i) f();
                    CK(cudaEventRecord(e1));
                    CK(cudaEventSynchronize(e1));
                    float x;
                    CK(cudaEventElapsedTime(&x, e0, e1));
                    total_ms += x;
                    calls += 4;
                }
                printf("  sustain %s: %ld calls in %.1f s, %.3f ms a call, %.1f TFLOP/s\n", name, calls, total_ms / 1e3,
                       total_ms / calls, work * calls / total_ms / 1e9);
                fflush(stdout);
            };
            sustain("native fwd", flop, native_fwd);
            if (cudnn_fwd_ok) sustain("cudnn fwd", flop, cudnn_fwd);
            if (native_bwd_ok) sustain("native bwd", 2.5 * flop, native_bwd);
            if (cudnn_bwd_ok) sustain("cudnn bwd", 2.5 * flop, cudnn_bwd);
            mark(sus.marks, "idle");
        }
        CK(cudaEventDestroy(e0));
        CK(cudaEventDestroy(e1));
    } else {
        printf("\n");
        fflush(stdout);
    }
    CK(cudaFree(q));
    CK(cudaFree(k));
    CK(cudaFree(v));
    CK(cudaFree(o));
    CK(cudaFree(lse));
    for (T *x : {d_o, dq, dk, dv}) CK(cudaFree(x));
    return bad;
}

static int run(const Case &c, bool check, bool bench, bool cudnn, const Sustain &sus = Sustain{}) {
    return c.f16 ? run_case<__half>(c, check, bench, cudnn, sus) : run_case<__nv_bfloat16>(c, check, bench, cudnn, sus);
}

int main(int argc, char **argv) {
    // native_check [--no-cudnn] [--full [--kv-len T]] [--normal] [--len N]...
    //   speed at 16K, 64K and 128K unless --len is given; causal with t = s, or with --full
    //   no mask and t = --kv-len (default s): the off-diagonal blocks of the ring modes;
    //   --normal: the speed cases' inputs standard normal (as `bench attention` draws them)
    //   instead of uniform on [-1, 1)
    // native_check ... --sustain SECONDS [--marks FILE]: each speed case's kernels also run
    //   alone for SECONDS each (see Sustain), e.g. with nvidia-smi sampling beside it:
    //     scripts/gpu_clocks.py sample smi.csv 100 &
    //     target-cuda/native_check --len 65536 --sustain 5 --marks marks.txt; kill %1
    //     scripts/gpu_clocks.py report smi.csv marks.txt
    // native_check ... --ncu: each speed case's kernels once more inside a profiler range
    //   (see Sustain; scripts/gpu_ncu.sh runs it under `ncu --profile-from-start off`)
    bool cudnn = true, full = false, normal = false;
    Sustain sus;
    int kv_len = 0;
    std::vector<int> lens;
    for (int i = 1; i < argc; ++i) {
        if (strcmp(argv[i], "--no-cudnn") == 0) {
            cudnn = false;
        } else if (strcmp(argv[i], "--full") == 0) {
            full = true;
        } else if (strcmp(argv[i], "--normal") == 0) {
            normal = true;
        } else if (strcmp(argv[i], "--ncu") == 0) {
            sus.ncu = true;
        } else if (strcmp(argv[i], "--sustain") == 0 && i + 1 < argc && atoi(argv[i + 1]) > 0) {
            sus.seconds = atoi(argv[++i]);
        } else if (strcmp(argv[i], "--marks") == 0 && i + 1 < argc) {
            const char *path = argv[++i];
            sus.marks = fopen(path, "w");
            if (!sus.marks) {
                fprintf(stderr, "native_check: --marks %s: cannot open it for writing\n", path);
                return 2;
            }
        } else if (strcmp(argv[i], "--len") == 0 && i + 1 < argc && atoi(argv[i + 1]) > 0) {
            lens.push_back(atoi(argv[++i]));
        } else if (strcmp(argv[i], "--kv-len") == 0 && i + 1 < argc && atoi(argv[i + 1]) > 0) {
            kv_len = atoi(argv[++i]);
        } else {
            fprintf(stderr,
                    "native_check: unknown argument '%s' (expected --no-cudnn, --full, --normal, --kv-len T, --len N, "
                    "--sustain SECONDS, --marks FILE or --ncu; N, T, SECONDS > 0)\n",
                    argv[i]);
            return 2;
        }
    }
    if (kv_len && !full) {
        fprintf(stderr, "native_check: --kv-len needs --full (causal blocks here have t = s)\n");
        return 2;
    }
    if (sus.marks && !sus.seconds) {
        fprintf(stderr, "native_check: --marks needs --sustain SECONDS (the marks are those runs' starts)\n");
        return 2;
    }
    if (lens.empty()) lens = {16384, 65536, 131072};
    int failures = 0;
    // correctness: both head dims, both masks, GQA, ragged lengths, f16, banded grids
    const Case checks[] = {
        {1, 256, 256, 2, 2, 64, 1, 0},    {1, 256, 256, 2, 2, 128, 1, 0},  {2, 1000, 1000, 4, 2, 64, 1, 0},
        {1, 1000, 1000, 4, 1, 128, 1, 0}, {1, 777, 1300, 4, 4, 64, 0, 0},  {1, 300, 200, 2, 1, 128, 0, 0},
        {1, 2048, 2048, 8, 2, 128, 1, 1}, {1, 2048, 2048, 8, 8, 64, 0, 1}, {1, 4096, 4096, 4, 4, 128, 1, 0},
        // causal grids in bands narrower than the grid (band_width in native_common.cuh):
        // 18 batch entries x 2 KV heads / 4 heads, bands of 18 slices (bwd; fwd 18 at d 128, 24 at 64)
        {18, 2048, 2048, 4, 2, 64, 1, 0}, {18, 2048, 2048, 4, 2, 128, 1, 0},
        {1, 256, 256, 2, 2, 96, 1, 0},  // not covered: must answer UNSUPPORTED
    };
    for (const Case &c : checks) failures += run(c, true, false, false);
    printf("correctness: %d failing case(s)\n", failures);
    // speed at 16K / 64K / 128K: the shapes of issue #36 (32×128, and 32/4×64)
    for (int len : lens) {
        const int t = kv_len ? kv_len : len, causal = full ? 0 : 1;
        failures += run({1, len, t, 32, 32, 128, causal, 0, int(normal)}, false, true, cudnn, sus);
        failures += run({1, len, t, 32, 4, 64, causal, 0, int(normal)}, false, true, cudnn, sus);
    }
    if (sus.marks) fclose(sus.marks);
    return failures ? 1 : 0;
}
