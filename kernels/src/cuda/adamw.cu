// AdamW with decoupled weight decay over a flat f32 shard, in place, with exactly the f32
// operation order of `src/train/optim.rs` (explicit round-to-nearest intrinsics: no FMA
// contraction, IEEE division and square root), so it matches the CPU twin bit for bit:
//   g ← g·gscale;  m ← β1·m + (1−β1)·g;  v ← β2·v + ((1−β2)·g)·g;
//   denom ← √v / √bc2 + ε;  if decay: w ← w − (lr·wd)·w;  w ← w − (lr/bc1 · m) / denom;
//   copy ← w rounded to P (the model dtype), when a copy is asked for.
//
// Shapes: w, g, m, v [n] f32; decay [n] u8 (nonzero: decay; nullptr: decay everywhere);
//         copy [n] P or nullptr.
#include "common.cuh"

template <typename P>
__device__ void adamw(float* __restrict__ w, const float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                      const uint8_t* __restrict__ decay, P* __restrict__ copy, size_t n, float b1, float b2,
                      float step_size, float bc2_sqrt, float eps, float wd_lr, float gscale) {
    const float omb1 = __fsub_rn(1.0f, b1), omb2 = __fsub_rn(1.0f, b2);
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const float gi = __fmul_rn(g[i], gscale);
        const float mi = __fadd_rn(__fmul_rn(b1, m[i]), __fmul_rn(omb1, gi));
        const float vi = __fadd_rn(__fmul_rn(b2, v[i]), __fmul_rn(__fmul_rn(omb2, gi), gi));
        const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bc2_sqrt), eps);
        float wi = w[i];
        if (decay == nullptr || decay[i] != 0) wi = __fsub_rn(wi, __fmul_rn(wd_lr, wi));
        wi = __fsub_rn(wi, __fdiv_rn(__fmul_rn(step_size, mi), denom));
        m[i] = mi;
        v[i] = vi;
        w[i] = wi;
        if (copy != nullptr) copy[i] = from_f<P>(wi);
    }
}

#define ADAMW_KERNEL(P, S)                                                                                      \
    extern "C" __global__ void adamw_##S(float* w, const float* g, float* m, float* v, const uint8_t* decay,   \
                                         P* copy, size_t n, float b1, float b2, float step_size,               \
                                         float bc2_sqrt, float eps, float wd_lr, float gscale) {               \
        adamw<P>(w, g, m, v, decay, copy, n, b1, b2, step_size, bc2_sqrt, eps, wd_lr, gscale);                 \
    }
FOR_EACH_DTYPE(ADAMW_KERNEL)
