/*
 * attention.cuh - what the fused attention's files share (private to
 * kernels/attention.cu, attention_mma.cu and attention_sm90.cu): the launch
 * parameters every kernel takes by value (AttnParams), the device helpers
 * both kernel families use, and the launchers one file calls in another
 * (defined and instantiated for D = 64 and 128 in the file named beside
 * each). Kernels and the helpers of one family stay in that family's file,
 * in its anonymous namespace.
 */
#ifndef MOE_KERNELS_ATTENTION_CUH
#define MOE_KERNELS_ATTENTION_CUH

#include <cuda_bf16.h>
#include <stdint.h>

#include "common.cuh"

/* ----------------------------------------------------------- parameters */

struct AttnParams {
  const uint16_t *q, *k, *v, *o, *dout; /* (B, H, T, D) bf16 rows */
  uint16_t *out, *dq, *dk, *dv;
  float *lse;   /* (B, H, T) contiguous */
  float *delta; /* (B, H, T) contiguous */
  int64_t q_sb, q_sh, q_st, k_sb, k_sh, k_st, v_sb, v_sh, v_st;
  int64_t o_sb, o_sh, o_st, do_sb, do_sh, do_st;
  int64_t dq_sb, dq_sh, dq_st, dk_sb, dk_sh, dk_st, dv_sb, dv_sh, dv_st;
  int H, T;
  float scale;      /* softmax scale */
  float scale_log2; /* scale * log2(e) */
  bool causal;
  bool pingpong; /* warp-specialised forward: the consumers take turns issuing products */
  bool head_major; /* TMA kernels' tile order: a head's blocks together (default; MOE_ATTN_ORDER=block: off) */
};

namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

/* 2^x by the special-function unit (ex2.approx: about 2 ulp; -inf gives 0;
 * subnormal results flush to 0, which softmax weights do not miss). */
__device__ __forceinline__ float attn_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

/* Two floats as a bf16x2 register (lo in the low half). */
__device__ __forceinline__ uint32_t attn_pack(float lo, float hi) {
  __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t *>(&h);
}

} // namespace

/* ------------------------------------------------ launchers across files */

/* attention.cu: delta = rowsum(dO * O) into p.delta for rows = B H T rows;
 * where acc is given (the Hopper backward's (rows, D) f32 dQ sums) the same
 * kernel zeroes it. */
template <int D>
moe_status attn_delta_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int64_t rows,
                             float *acc);

/* attention_mma.cu: the mma.sync forward and backward (delta included), in
 * the tile configuration moe_cuda_attention_tune chose. */
template <int D>
moe_status attn_fwd_run(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH);
template <int D>
moe_status attn_bwd_run(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH);

/* attention_sm90.cu: the warp-specialised TMA + wgmma forward and backward
 * on at most nsm persistent blocks; *ran false when the driver refused a
 * tensor map (the caller then runs the mma.sync kernels). */
template <int D>
moe_status attn_ws_fwd_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH,
                              int B, int nsm, bool *ran);
template <int D>
moe_status attn_ws_bwd_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH,
                              int B, float *acc, int nsm, bool *ran);

#endif /* MOE_KERNELS_ATTENTION_CUH */
