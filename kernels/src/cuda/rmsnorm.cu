// RMSNorm with the residual add fused, forward and backward (transformers' LlamaRMSNorm:
// f32 math, normalised value rounded to the activation dtype, then times the weight).
//
// Shapes: `rows` tokens of `h` features, all contiguous row-major.
//   x, res, y, xsum, dy, dres, dx : [rows, h] (T)     w : [h] (T)
//   rstd : [rows] f32               dw_part : [gridDim.x, h] f32     dw : [h] f32
// blockDim.x is a multiple of 32. When h is a multiple of 8 and every pointer 16-byte
// aligned, each thread walks packs of 8 columns j = 8·(threadIdx.x + k·blockDim.x)
// (16-byte accesses); otherwise single columns j ≡ threadIdx.x.
#include "common.cuh"

// One block per row. res == nullptr: no residual (xsum is not written).
template <typename T>
__device__ void rmsnorm_fwd(const T* __restrict__ x, const T* __restrict__ res, const T* __restrict__ w,
                            T* __restrict__ y, T* __restrict__ xsum, float* __restrict__ rstd, int h, float eps) {
    __shared__ float scratch[32];
    const size_t base = (size_t)blockIdx.x * h;
    const bool vec = h % 8 == 0 && aligned16(x) && aligned16(res) && aligned16(w) && aligned16(y) && aligned16(xsum);
    float ss = 0.0f;
    if (vec) {
        for (int j = 8 * threadIdx.x; j < h; j += 8 * blockDim.x) {
            float a[8];
            load8(x + base + j, a);
            if (res != nullptr) {
                float b[8];
                load8(res + base + j, b);
#pragma unroll
                for (int k = 0; k < 8; ++k) a[k] = round_to<T>(a[k] + b[k]);
                store8(xsum + base + j, a);
            }
#pragma unroll
            for (int k = 0; k < 8; ++k) ss += a[k] * a[k];
        }
    } else {
        for (int j = threadIdx.x; j < h; j += blockDim.x) {
            float a = to_f(x[base + j]);
            if (res != nullptr) {
                a = round_to<T>(a + to_f(res[base + j]));  // the sum as stored: the backward reads it back
                xsum[base + j] = from_f<T>(a);
            }
            ss += a * a;
        }
    }
    ss = block_sum(ss, scratch);
    const float r = 1.0f / sqrtf(ss / (float)h + eps);
    const T* src = res != nullptr ? xsum : x;  // same thread, same columns: its own writes
    if (vec) {
        for (int j = 8 * threadIdx.x; j < h; j += 8 * blockDim.x) {
            float a[8], wv[8];
            load8(src + base + j, a);
            load8(w + j, wv);
#pragma unroll
            for (int k = 0; k < 8; ++k) a[k] = round_to<T>(a[k] * r) * wv[k];
            store8(y + base + j, a);
        }
    } else {
        for (int j = threadIdx.x; j < h; j += blockDim.x)
            y[base + j] = from_f<T>(round_to<T>(to_f(src[base + j]) * r) * to_f(w[j]));
    }
    if (threadIdx.x == 0) rstd[blockIdx.x] = r;
}

// Rows blockIdx.x, blockIdx.x + gridDim.x, ...; each block sums its weight gradient in
// shared memory (h floats, dynamic; each column owned by one thread) and leaves it in
// dw_part[blockIdx.x]. dres == nullptr: no incoming residual gradient; dres == dx: in place
// (each thread reads its residual elements before it writes the same elements).
template <typename T>
__device__ void rmsnorm_bwd(const T* __restrict__ dy, const T* __restrict__ xs, const T* __restrict__ w,
                            const float* __restrict__ rstd, const T* dres, T* dx,
                            float* __restrict__ dw_part, size_t rows, int h) {
    __shared__ float scratch[32];
    extern __shared__ float dw_acc[];  // [h]
    const bool vec = h % 8 == 0 && aligned16(dy) && aligned16(xs) && aligned16(w) && aligned16(dres) && aligned16(dx);
    for (int j = threadIdx.x; j < h; j += blockDim.x) dw_acc[j] = 0.0f;
    __syncthreads();
    const float inv_h = 1.0f / (float)h;
    for (size_t row = blockIdx.x; row < rows; row += gridDim.x) {
        const size_t base = row * h;
        const float r = rstd[row];
        float dot = 0.0f;
        if (vec) {
            for (int j = 8 * threadIdx.x; j < h; j += 8 * blockDim.x) {
                float d[8], xv[8], wv[8];
                load8(dy + base + j, d);
                load8(xs + base + j, xv);
                load8(w + j, wv);
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float n = xv[k] * r;
                    dot += d[k] * wv[k] * n;
                    dw_acc[j + k] += d[k] * round_to<T>(n);
                }
            }
        } else {
            for (int j = threadIdx.x; j < h; j += blockDim.x) {
                const float d = to_f(dy[base + j]);
                const float n = to_f(xs[base + j]) * r;
                dot += d * to_f(w[j]) * n;
                dw_acc[j] += d * round_to<T>(n);
            }
        }
        dot = block_sum(dot, scratch) * inv_h;
        if (vec) {
            for (int j = 8 * threadIdx.x; j < h; j += 8 * blockDim.x) {
                float d[8], xv[8], wv[8], o[8];
                load8(dy + base + j, d);
                load8(xs + base + j, xv);
                load8(w + j, wv);
                if (dres != nullptr) {
                    load8(dres + base + j, o);
                } else {
#pragma unroll
                    for (int k = 0; k < 8; ++k) o[k] = 0.0f;
                }
#pragma unroll
                for (int k = 0; k < 8; ++k) {
                    const float n = xv[k] * r;
                    o[k] += r * (d[k] * wv[k] - n * dot);
                }
                store8(dx + base + j, o);
            }
        } else {
            for (int j = threadIdx.x; j < h; j += blockDim.x) {
                const float n = to_f(xs[base + j]) * r;
                float o = r * (to_f(dy[base + j]) * to_f(w[j]) - n * dot);
                if (dres != nullptr) o += to_f(dres[base + j]);
                dx[base + j] = from_f<T>(o);
            }
        }
    }
    __syncthreads();
    for (int j = threadIdx.x; j < h; j += blockDim.x) dw_part[(size_t)blockIdx.x * h + j] = dw_acc[j];
}

#define RMS_KERNELS(T, S)                                                                                           \
    extern "C" __global__ void rmsnorm_fwd_##S(const T* x, const T* res, const T* w, T* y, T* xsum, float* rstd,     \
                                               int h, float eps) {                                                   \
        rmsnorm_fwd<T>(x, res, w, y, xsum, rstd, h, eps);                                                           \
    }                                                                                                               \
    extern "C" __global__ void rmsnorm_bwd_##S(const T* dy, const T* xs, const T* w, const float* rstd, const T* dres, \
                                               T* dx, float* dw_part, size_t rows, int h) {                          \
        rmsnorm_bwd<T>(dy, xs, w, rstd, dres, dx, dw_part, rows, h);                                                \
    }
FOR_EACH_DTYPE(RMS_KERNELS)

// dw[j] = sum over parts of dw_part[p, j].
extern "C" __global__ void rmsnorm_dw_reduce(const float* __restrict__ dw_part, float* __restrict__ dw, int parts, int h) {
    const int j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= h) return;
    float s = 0.0f;
    for (int p = 0; p < parts; ++p) s += dw_part[(size_t)p * h + j];
    dw[j] = s;
}
