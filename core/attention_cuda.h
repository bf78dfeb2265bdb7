/*
 * attention_cuda.h - the CUDA entry points of the attention family
 * (implemented in kernels/attention.cu, called by core/attention.c; core/nocuda.c
 * stubs them without CUDA). Private to core/ and kernels/.
 *
 * All views live on `device`, are 4-D (B, H, T, D) (lse and delta 3-D
 * (B, H, T)), bf16 except lse and delta (f32, contiguous). q, k, v, o, dout,
 * dq, dk, dv must have a last-dim stride of 1, row strides that are
 * multiples of 8 elements and 16-byte aligned data; core/attention.c makes
 * sure of that (moe_cuda_attention_rows_ok tells). D must be 64 or 128.
 * scale is already resolved (finite). Launches go on the context's stream.
 */
#ifndef MOE_ATTENTION_CUDA_H
#define MOE_ATTENTION_CUDA_H

#include "internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Selects tile configurations for bench/attention_tune.c: 0 is the default
 * per head dim; forward 1 = (4 warps, 2 m-tiles, 64 keys), 2 = (8, 1, 64);
 * backward 1 = (4 warps, inner 64), 2 = (8 warps, inner 32). Not thread
 * safe; the library never calls it. */
void moe_cuda_attention_tune(int fwd_variant, int bwd_variant);

/* The kernel family the last forward / backward launch ran: "tma" (the
 * warp-specialised TMA + wgmma kernels, the default on compute capability
 * 9.x), "mma" (mma.sync: other GPUs, MOE_ATTN_WG=0, the deterministic
 * backward, or where the driver refuses a tensor map), "none". For tests;
 * not thread safe. */
const char *moe_cuda_attention_last(bool backward);

/* True when a view satisfies the kernels' row layout (see above). */
bool moe_cuda_attention_rows_ok(const moe_kview *v);

/* o = attention(q, k, v); lse (B, H, T) f32 natural-log logsumexp per row. */
moe_status moe_cuda_attention_fwd(moe_ctx *ctx, int device, const moe_kview *q,
                                  const moe_kview *k, const moe_kview *v, const moe_kview *o,
                                  const moe_kview *lse, bool causal, double scale);

/* True when the backward on `device` takes dq_acc (the wgmma kernels of
 * compute capability 9.x: dQ summed with f32 atomics, not bit-reproducible),
 * false when the context's knobs attn_deterministic (MOE_ATTN_DETERMINISTIC=1)
 * or !attn_wg (MOE_ATTN_WG=0) say so or the GPU is not 9.x (the
 * deterministic mma.sync backward). */
bool moe_cuda_attention_bwd_atomic(const moe_ctx *ctx, int device);

/* dq, dk, dv from dout; delta (B, H, T) f32 is scratch (rowsum(dout * o));
 * dq_acc (B, H, T, D) f32 contiguous is scratch when
 * moe_cuda_attention_bwd_atomic(ctx, device), else NULL. */
moe_status moe_cuda_attention_bwd(moe_ctx *ctx, int device, const moe_kview *q,
                                  const moe_kview *k, const moe_kview *v, const moe_kview *o,
                                  const moe_kview *lse, const moe_kview *dout,
                                  const moe_kview *delta, const moe_kview *dq,
                                  const moe_kview *dk, const moe_kview *dv,
                                  const moe_kview *dq_acc, bool causal, double scale);

#ifdef __cplusplus
}
#endif
#endif /* MOE_ATTENTION_CUDA_H */
