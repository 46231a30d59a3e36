// Cross-entropy over the vocabulary with the gradient written in place of the logits:
// loss_r = logsumexp(x_r) − x_r[t_r];  x_r ← scale · (softmax(x_r) − onehot(t_r)).
// A negative target (transformers' −100) ignores the row: loss 0, gradient 0. A target
// ≥ V (the caller checks targets on the host first) gives a NaN loss and a zero gradient.
//
// Shapes: logits [rows, V] (T, contiguous, overwritten), targets [rows] i64, loss [rows] f32.
// One block per row.
#include "common.cuh"

template <typename T>
__device__ void ce_fwd_bwd(T* __restrict__ logits, const int64_t* __restrict__ targets, float* __restrict__ loss, int V,
                           float scale) {
    __shared__ float scratch[32];
    const int64_t t = targets[blockIdx.x];
    T* row = logits + (size_t)blockIdx.x * V;
    if (t < 0 || t >= V) {
        for (int j = threadIdx.x; j < V; j += blockDim.x) row[j] = from_f<T>(0.0f);
        if (threadIdx.x == 0) loss[blockIdx.x] = t < 0 ? 0.0f : __int_as_float(0x7fc00000);
        return;
    }
    const float xt = to_f(row[t]);  // read before any thread overwrites the row (block syncs below)
    // Pass 1: per-thread online max and sum of exp, then merged over the block.
    float m = -INFINITY, s = 0.0f;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        const float v = to_f(row[j]);
        if (v == -INFINITY) continue;
        if (v > m) {
            s = s * expf(m - v) + 1.0f;
            m = v;
        } else {
            s += expf(v - m);
        }
    }
    const float M = block_max(m, scratch);
    const float S = block_sum(m == -INFINITY ? 0.0f : s * expf(m - M), scratch);
    if (threadIdx.x == 0) loss[blockIdx.x] = M + logf(S) - xt;
    // Pass 2: the gradient, in place.
    const float inv = 1.0f / S;
    for (int j = threadIdx.x; j < V; j += blockDim.x) {
        float p = expf(to_f(row[j]) - M) * inv;
        if (j == t) p -= 1.0f;
        row[j] = from_f<T>(p * scale);
    }
}

#define CE_KERNEL(T, S)                                                                                           \
    extern "C" __global__ void ce_fwd_bwd_##S(T* logits, const int64_t* targets, float* loss, int V, float scale) { \
        ce_fwd_bwd<T>(logits, targets, loss, V, scale);                                                           \
    }
FOR_EACH_DTYPE(CE_KERNEL)
