/*
 * moe_attention.h - scaled-dot-product attention, causal or not
 * (core/attention.c: validation, the CPU reference and autograd;
 * kernels/attention.cu: the fused kernels for CUDA).
 * Included by moe.h. Conventions of moe.h hold: ctx first, outputs last,
 * 0-based dims, a new reference per returned tensor, differentiable ops
 * record autograd nodes (moe_autograd.h).
 *
 * Shapes: q, k, v are (B, H, T, D): batch, heads, sequence, head dim; all
 * three have the same shape, dtype and device. Any strides are accepted (a
 * transposed (B, T, H, D) buffer viewed as (B, H, T, D) is fine). The CUDA
 * kernels read rows with a contiguous last dim, 16-byte aligned: other
 * layouts are first copied to a contiguous buffer (a copy, not an error).
 *
 *   out[b,h,i,:] = sum_j softmax_j(scale * q[b,h,i,:] . k[b,h,j,:] + mask) v[b,h,j,:]
 *
 * with mask = -inf where j > i when causal (top-left aligned, as PyTorch's
 * is_causal), 0 otherwise. scale = 1/sqrt(D) when 0 or NaN is passed; any
 * other finite value is used as given; an infinite scale is an error.
 *
 * dtypes and devices:
 *   CPU: f32, f64 and bf16. The reference computes in double and rounds the
 *        result to the dtype once (more accurate than "bf16 computed in f32").
 *   CUDA: bf16 with head dim 64 or 128, fused kernels with fp32 accumulation
 *        that never materialise the (T, T) scores: on compute capability
 *        9.x (H100, H200) warp-specialised TMA + wgmma kernels, elsewhere
 *        FlashAttention-2-style mma.sync ones. Environment (read per call):
 *        MOE_ATTN_WG=0 the mma.sync kernels on 9.x too,
 *        MOE_ATTN_DETERMINISTIC=1 the deterministic
 *        backward (see below), MOE_ATTN_PINGPONG=0 no turn-taking between
 *        the forward's consumer warpgroups, MOE_ATTN_PERSISTENT=0 one
 *        block per tile instead of the persistent grid (one block per
 *        multiprocessor looping over tiles; =n, at most n blocks),
 *        MOE_ATTN_ORDER=block every head's heaviest block first instead of
 *        the default head-major order (the tiles of one head together, so
 *        that concurrent blocks share K and V in L2). Other dtypes or head dims
 *        on CUDA: MOE_ERR_NOT_SUPPORTED naming the op, dtype and head dim
 *        (there is no slower non-fused path; cast to bf16 or use the CPU).
 *
 * Saved for backward: q, k, v, out (detached) and the per-row logsumexp of
 * the scaled, masked scores, lse (B, H, T): f64 for f64 inputs, f32 else.
 */
#ifndef MOE_ATTENTION_H
#define MOE_ATTENTION_H

#ifdef __cplusplus
extern "C" {
#endif

/* out (B, H, T, D) contiguous, dtype and device of q. Differentiable in q,
 * k and v. */
moe_status moe_attention(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v, bool causal,
                         double scale, moe_tensor **out);

/* The two halves without autograd (for tests, benchmarks and Lua-defined
 * functions). forward: out (B, H, T, D) and lse (B, H, T) as documented
 * above. backward: dout (B, H, T, D) of q's dtype, any strides; out and lse
 * as the forward returned them; writes the new tensors dq, dk, dv of q's
 * shape, dtype and device (activation gradients: fresh, never accumulated).
 * On CUDA 9.x the backward sums dQ over key blocks with f32 atomics (bulk
 * reductions), so dQ can differ in the last bf16 bit from run to run (dK
 * and dV do not); with MOE_ATTN_DETERMINISTIC=1, or on other GPUs, dQ has
 * its own pass over the key blocks without atomics and every run is
 * bit-identical. */
moe_status moe_attention_forward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                 bool causal, double scale, moe_tensor **out, moe_tensor **lse);
moe_status moe_attention_backward(moe_ctx *ctx, moe_tensor *q, moe_tensor *k, moe_tensor *v,
                                  moe_tensor *out, moe_tensor *lse, moe_tensor *dout, bool causal,
                                  double scale, moe_tensor **dq, moe_tensor **dk,
                                  moe_tensor **dv);

#ifdef __cplusplus
}
#endif
#endif /* MOE_ATTENTION_H */
