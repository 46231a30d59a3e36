/* C interface of longctx's own Hopper attention kernels (native_fwd_sm90.cu, native_bwd_sm90.cu).
 *
 * The descriptor, layouts and return codes are those of the cuDNN shim (cudnn_sdpa.h), so a
 * caller picks either kernel with the same arguments. A shape the native kernel does not
 * cover answers LONGCTX_SDPA_UNSUPPORTED with the reason in `err` (the caller then uses
 * cuDNN); it never runs a partial result.
 */
#ifndef LONGCTX_NATIVE_FMHA_H
#define LONGCTX_NATIVE_FMHA_H

#include "cudnn_sdpa.h"

#ifdef __cplusplus
extern "C" {
#endif

/* o, lse <- attention(q, k, v) on sm_90a. */
int longctx_native_fwd(const longctx_sdpa_desc *desc, const void *q, const void *k, const void *v, void *o,
                       float *lse, void *stream, char *err, size_t err_len);

/* dq, dk, dv <- backward from the forward's o and lse (same arguments as longctx_sdpa_bwd).
 * Queues three kernels and a stream-ordered f32 workspace of b*hq*ceil(s/64)*64*(d+2) values. */
int longctx_native_bwd(const longctx_sdpa_desc *desc, const void *q, const void *k, const void *v, const void *o,
                       const void *d_o, const float *lse, void *dq, void *dk, void *dv, void *stream, char *err,
                       size_t err_len);

/* Why the native kernels do not cover this call (a static string), or NULL when they do. */
const char *longctx_native_uncovered(const longctx_sdpa_desc *desc, const void *q, const void *k, const void *v);

#ifdef __cplusplus
}
#endif

#endif
