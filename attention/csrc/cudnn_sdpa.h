/* C interface of the cuDNN fused-attention shim (see cudnn_sdpa.cpp).
 *
 * Layout (every tensor contiguous, row-major):
 *   q, o, do, dq   [b, s, hq, d]   (BSHD)
 *   k, v, dk, dv   [b, t, hkv, d]
 *   lse            [b, hq, s] f32  natural-log sum of exp of the scaled scores
 * All pointers are device pointers of the device `ordinal`; work is queued on `stream`
 * (a CUstream / cudaStream_t, may be the per-thread or legacy default stream).
 */
#ifndef LONGCTX_CUDNN_SDPA_H
#define LONGCTX_CUDNN_SDPA_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* element type of q/k/v/o and the gradients */
enum { LONGCTX_SDPA_BF16 = 0, LONGCTX_SDPA_F16 = 1 };

/* return codes */
enum {
    LONGCTX_SDPA_OK = 0,
    LONGCTX_SDPA_FAILED = 1,      /* a CUDA or cuDNN call failed at run time */
    LONGCTX_SDPA_UNSUPPORTED = 2, /* this shape / dtype / GPU is not supported by cuDNN here */
    LONGCTX_SDPA_UNAVAILABLE = 3  /* libcudnn.so.9 could not be loaded */
};

typedef struct {
    int32_t ordinal; /* CUDA device ordinal */
    int32_t dtype;   /* LONGCTX_SDPA_BF16 or LONGCTX_SDPA_F16 */
    int64_t b, s, t, hq, hkv, d;
    int32_t causal; /* 1: top-left aligned causal mask (s == t), 0: no mask */
    float scale;    /* softmax scale applied to q.k */
    /* Sliding-window band (used when band_left > 0, causal must be 0): top-left aligned
     * diagonal band, query row x sees key y iff y <= x + band_right and
     * y > x - band_left (cudnn-frontend's right/left bounds). Needs s <= t. */
    int64_t band_left;  /* >= 1, or 0: no band */
    int64_t band_right; /* >= 0 */
} longctx_sdpa_desc;

/* o, lse <- attention(q, k, v). `err` receives a message when the result is not OK. */
int longctx_sdpa_fwd(const longctx_sdpa_desc *desc, const void *q, const void *k, const void *v, void *o,
                     float *lse, void *stream, char *err, size_t err_len);

/* dq, dk, dv <- backward, from the final o and lse of the forward. */
int longctx_sdpa_bwd(const longctx_sdpa_desc *desc, const void *q, const void *k, const void *v, const void *o,
                     const void *d_o, const float *lse, void *dq, void *dk, void *dv, void *stream, char *err,
                     size_t err_len);

/* Loaded cuDNN version (e.g. 91400) or 0 when libcudnn cannot be loaded (message in err). */
int64_t longctx_sdpa_cudnn_version(char *err, size_t err_len);

#ifdef __cplusplus
}
#endif

#endif
