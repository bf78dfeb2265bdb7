/*
 * attention.cu - fused scaled-dot-product attention, bf16 in and out, fp32
 * accumulation, head dims 64 and 128, causal or not, never materialising
 * the (T, T) scores. Two kernel families:
 *
 *   "tma" (the default on compute capability 9.x: H100, H200):
 *     warp-specialised Hopper kernels, TMA loads into an mbarrier-guarded
 *     ring, warpgroup MMAs (wgmma): kernels/attention_sm90.cu.
 *   "mma" (other GPUs, MOE_ATTN_WG=0, the deterministic backward, and
 *     the fallback on 9.x should the driver refuse a tensor map):
 *     the FlashAttention-2 algorithm on mma.sync m16n8k16 with ldmatrix:
 *     kernels/attention_mma.cu.
 *
 * This file validates the operands, builds the launch parameters
 * (AttnParams, kernels/attention.cuh) with the context's knobs, picks the
 * family per call and runs the kernel both backwards share (delta).
 */
#include <stdlib.h>
#include <string.h>

#include "attention.cuh"
#include "attention_cuda.h"

namespace {

/* ------------------------------------------------------------ backward */

/* delta[bh, i] = sum_d dO[i, d] O[i, d]: D / 8 threads per row, 16 bytes
 * of O and of dO each; where acc is given (the Hopper backward's dQ sums,
 * (rows, D) f32) the same threads zero the row's D floats of it. */
template <int D> __global__ void attn_delta_kernel(AttnParams p, int64_t rows, float *acc) {
  constexpr int R = D / 8; /* threads per row, a power of two dividing 32 */
  const int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / R;
  const int c = (threadIdx.x & (R - 1)) * 8;
  if (row >= rows) return; /* whole rows leave together: the shuffles below stay within R lanes */
  const int64_t bh = row / p.T, i = row % p.T, b = bh / p.H, h = bh % p.H;
  const uint4 x = *reinterpret_cast<const uint4 *>(p.o + b * p.o_sb + h * p.o_sh + i * p.o_st + c);
  const uint4 y = *reinterpret_cast<const uint4 *>(p.dout + b * p.do_sb + h * p.do_sh + i * p.do_st + c);
  if (acc) {
    float4 *a = reinterpret_cast<float4 *>(acc + row * D + c);
    a[0] = a[1] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  const uint32_t xs[4] = {x.x, x.y, x.z, x.w}, ys[4] = {y.x, y.y, y.z, y.w};
  float s = 0;
#pragma unroll
  for (int e = 0; e < 4; e++) {
    const float2 xf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&xs[e]));
    const float2 yf = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162 *>(&ys[e]));
    s += xf.x * yf.x + xf.y * yf.y;
  }
  const unsigned mask = R == 32 ? 0xffffffffu : ((1u << R) - 1u) << (threadIdx.x & 31 & ~(R - 1));
#pragma unroll
  for (int m = R / 2; m > 0; m >>= 1) s += __shfl_xor_sync(mask, s, m);
  if (c == 0) p.delta[row] = s;
}

/* The kernel family the last launches ran (moe_cuda_attention_last). */
const char *attn_last_fwd = "none", *attn_last_bwd = "none";

/* The Hopper kernels: on compute capability 9.x unless MOE_ATTN_WG=0
 * (the knob attn_wg: the mma.sync kernels). */
bool attn_hopper_ok(const moe_ctx *ctx, int device) {
  if (!ctx->knobs.attn_wg) return false;
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
             cudaSuccess &&
         major == 9;
}

/* The persistent kernels' grid: one block per multiprocessor (the knob
 * attn_persistent, MOE_ATTN_PERSISTENT=0: one block per tile, as a plain
 * grid; =n > 0: at most n blocks, which the tests use to give each block
 * many tiles). */
int attn_nsm(const moe_ctx *ctx, int device) {
  const int n_set = ctx->knobs.attn_persistent;
  if (n_set == 0) return 1 << 30;
  if (n_set > 0) return n_set;
  static int cached[64];
  if (device >= 0 && device < 64 && cached[device] > 0) return cached[device];
  int n = 0;
  if (cudaDeviceGetAttribute(&n, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || n <= 0)
    n = 132;
  if (device >= 0 && device < 64) cached[device] = n;
  return n;
}

void attn_strides(const moe_kview *v, int64_t *sb, int64_t *sh, int64_t *st) {
  *sb = v->stride[0];
  *sh = v->stride[1];
  *st = v->stride[2];
}

moe_status attn_params(moe_ctx *ctx, const char *fn, const moe_kview *q, double scale,
                       bool causal, AttnParams *p, int *BH) {
  memset(p, 0, sizeof(*p));
  const int64_t B = q->shape[0], H = q->shape[1], T = q->shape[2], D = q->shape[3];
  if (q->ndim != 4 || (D != 64 && D != 128) || q->dtype != MOE_BF16)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "%s: bf16 (B, H, T, D) with D 64 or 128 only",
                     fn);
  if (B * H > 2147483647LL || T > 2147483647LL / 2 || (T + 63) / 64 * 2 > 65535)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "%s: B*H = %lld, T = %lld exceed the launch grid (B*H < 2^31, T <= 2^21)",
                     fn, (long long)(B * H), (long long)T);
  p->H = (int)H;
  p->T = (int)T;
  p->scale = (float)scale;
  p->scale_log2 = (float)(scale * 1.4426950408889634);
  p->causal = causal;
  p->pingpong = ctx->knobs.attn_pingpong;
  p->head_major = ctx->knobs.attn_order != MOE_KNOB_ATTN_ORDER_BLOCK;
  *BH = (int)(B * H);
  return MOE_OK;
}
} // namespace

template <int D>
moe_status attn_delta_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int64_t rows,
                             float *acc) {
  attn_delta_kernel<D><<<(unsigned)((rows * (D / 8) + 255) / 256), 256, 0, stream>>>(p, rows, acc);
  MOE_CUDA_CHECK_LAUNCH(ctx, "attention delta kernel");
  return MOE_OK;
}
template moe_status attn_delta_launch<64>(moe_ctx *, cudaStream_t, const AttnParams &, int64_t,
                                          float *);
template moe_status attn_delta_launch<128>(moe_ctx *, cudaStream_t, const AttnParams &, int64_t,
                                           float *);

extern "C" const char *moe_cuda_attention_last(bool backward) {
  return backward ? attn_last_bwd : attn_last_fwd;
}

extern "C" bool moe_cuda_attention_bwd_atomic(const moe_ctx *ctx, int device) {
  if (ctx->knobs.attn_deterministic) return false;
  return attn_hopper_ok(ctx, device);
}

extern "C" bool moe_cuda_attention_rows_ok(const moe_kview *v) {
  if (v->ndim != 4 || v->stride[3] != 1) return false;
  for (int d = 0; d < 3; d++)
    if (v->shape[d] > 1 && v->stride[d] % 8 != 0) return false;
  return ((uintptr_t)v->data & 15) == 0;
}

extern "C" moe_status moe_cuda_attention_fwd(moe_ctx *ctx, int device, const moe_kview *q,
                                             const moe_kview *k, const moe_kview *v,
                                             const moe_kview *o, const moe_kview *lse,
                                             bool causal, double scale) {
  const char *fn = "cuda attention forward";
  AttnParams p;
  int BH = 0;
  MOE_CHECK(attn_params(ctx, fn, q, scale, causal, &p, &BH));
  const moe_kview *rows[4] = {q, k, v, o};
  for (int i = 0; i < 4; i++)
    if (!moe_cuda_attention_rows_ok(rows[i]))
      return moe_error(ctx, MOE_ERR_INTERNAL, "%s: operand %d rows are not aligned", fn, i);
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  p.q = (const uint16_t *)q->data;
  p.k = (const uint16_t *)k->data;
  p.v = (const uint16_t *)v->data;
  p.out = (uint16_t *)o->data;
  p.lse = (float *)lse->data;
  attn_strides(q, &p.q_sb, &p.q_sh, &p.q_st);
  attn_strides(k, &p.k_sb, &p.k_sh, &p.k_st);
  attn_strides(v, &p.v_sb, &p.v_sh, &p.v_st);
  attn_strides(o, &p.o_sb, &p.o_sh, &p.o_st);
  if (attn_hopper_ok(ctx, device)) { /* where the driver refuses a map: the mma.sync kernels */
    const int B = (int)q->shape[0];
    bool ran = false;
    if (q->shape[3] == 64) MOE_CHECK(attn_ws_fwd_launch<64>(ctx, (cudaStream_t)stream, p, BH, B, attn_nsm(ctx, device), &ran));
    else MOE_CHECK(attn_ws_fwd_launch<128>(ctx, (cudaStream_t)stream, p, BH, B, attn_nsm(ctx, device), &ran));
    if (ran) {
      attn_last_fwd = "tma";
      return MOE_OK;
    }
  }
  attn_last_fwd = "mma";
  if (q->shape[3] == 64) return attn_fwd_run<64>(ctx, (cudaStream_t)stream, p, BH);
  return attn_fwd_run<128>(ctx, (cudaStream_t)stream, p, BH);
}

extern "C" moe_status moe_cuda_attention_bwd(moe_ctx *ctx, int device, const moe_kview *q,
                                             const moe_kview *k, const moe_kview *v,
                                             const moe_kview *o, const moe_kview *lse,
                                             const moe_kview *dout, const moe_kview *delta,
                                             const moe_kview *dq, const moe_kview *dk,
                                             const moe_kview *dv, const moe_kview *dq_acc,
                                             bool causal, double scale) {
  const char *fn = "cuda attention backward";
  AttnParams p;
  int BH = 0;
  MOE_CHECK(attn_params(ctx, fn, q, scale, causal, &p, &BH));
  const moe_kview *rows[8] = {q, k, v, o, dout, dq, dk, dv};
  for (int i = 0; i < 8; i++)
    if (!moe_cuda_attention_rows_ok(rows[i]))
      return moe_error(ctx, MOE_ERR_INTERNAL, "%s: operand %d rows are not aligned", fn, i);
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  p.q = (const uint16_t *)q->data;
  p.k = (const uint16_t *)k->data;
  p.v = (const uint16_t *)v->data;
  p.o = (const uint16_t *)o->data;
  p.dout = (const uint16_t *)dout->data;
  p.dq = (uint16_t *)dq->data;
  p.dk = (uint16_t *)dk->data;
  p.dv = (uint16_t *)dv->data;
  p.lse = (float *)lse->data;
  p.delta = (float *)delta->data;
  attn_strides(q, &p.q_sb, &p.q_sh, &p.q_st);
  attn_strides(k, &p.k_sb, &p.k_sh, &p.k_st);
  attn_strides(v, &p.v_sb, &p.v_sh, &p.v_st);
  attn_strides(o, &p.o_sb, &p.o_sh, &p.o_st);
  attn_strides(dout, &p.do_sb, &p.do_sh, &p.do_st);
  attn_strides(dq, &p.dq_sb, &p.dq_sh, &p.dq_st);
  attn_strides(dk, &p.dk_sb, &p.dk_sh, &p.dk_st);
  attn_strides(dv, &p.dv_sb, &p.dv_sh, &p.dv_st);
  if (dq_acc) { /* where the driver refuses a map: the mma.sync kernels (dq_acc unused) */
    if (dq_acc->dtype != MOE_F32 || !attn_hopper_ok(ctx, device))
      return moe_error(ctx, MOE_ERR_INTERNAL, "%s: dq_acc needs f32 and the wgmma kernels", fn);
    float *acc = (float *)dq_acc->data;
    const int B = (int)q->shape[0];
    bool ran = false;
    if (q->shape[3] == 64) MOE_CHECK(attn_ws_bwd_launch<64>(ctx, (cudaStream_t)stream, p, BH, B, acc, attn_nsm(ctx, device), &ran));
    else MOE_CHECK(attn_ws_bwd_launch<128>(ctx, (cudaStream_t)stream, p, BH, B, acc, attn_nsm(ctx, device), &ran));
    if (ran) {
      attn_last_bwd = "tma";
      return MOE_OK;
    }
  }
  attn_last_bwd = "mma";
  if (q->shape[3] == 64) return attn_bwd_run<64>(ctx, (cudaStream_t)stream, p, BH);
  return attn_bwd_run<128>(ctx, (cudaStream_t)stream, p, BH);
}
