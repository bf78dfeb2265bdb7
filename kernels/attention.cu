/*
 * attention.cu - fused scaled-dot-product attention for Hopper (sm_90),
 * bf16 in and out, fp32 accumulation, head dims 64 and 128, causal or not:
 * the FlashAttention-2 algorithm on tensor cores (mma.sync m16n8k16 bf16
 * with ldmatrix), never materialising the (T, T) scores.
 *
 * Forward (attn_fwd_kernel): one block per (BM query rows, head); each warp
 * owns WM m16 tiles of rows. K/V tiles of BN keys stream through shared
 * memory (cp.async, double-buffered); online softmax in the log2 domain;
 * writes O (bf16) and lse (f32, natural log) per row.
 *
 * Backward: attn_delta_kernel computes delta = rowsum(dO * O) (f32); then
 * one launch of attn_bwd_kernel runs two kinds of blocks, interleaved
 * heaviest-first:
 *   dK/dV blocks: BN keys resident, loop over query blocks, recompute
 *     P^T = exp2(K Q^T * c - lse), dV += P^T dO, dP^T = V dO^T,
 *     dS^T = P^T (dP^T - delta), dK += dS^T Q;
 *   dQ blocks: BM queries resident, loop over key blocks, recompute
 *     P and dS the same way, dQ += dS K.
 * dQ is thus computed without atomics (deterministic, bit-reproducible) at
 * the price of recomputing Q K^T and dO V^T once more (7 tile products per
 * key/query pair instead of FlashAttention-2's 5 with atomic dQ).
 *
 * Shared-memory tiles are rows of D bf16 whose 16-byte chunks are XOR
 * swizzled by (row % 8), so ldmatrix reads 8 rows without bank conflicts.
 * Rows past T are zero-filled by cp.async and masked. Index math that can
 * pass 2^31 (batch/head/row offsets) is int64.
 */
#include <cuda_bf16.h>

#include "attention_cuda.h"
#include "common.cuh"
#include "mma.cuh"

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

/* The A fragment (16x16) made of two adjacent 16x8 accumulator tiles. */
__device__ __forceinline__ void attn_c2a(uint32_t (&a)[4], const float (&c0)[4],
                                         const float (&c1)[4]) {
  a[0] = attn_pack(c0[0], c0[1]);
  a[1] = attn_pack(c0[2], c0[3]);
  a[2] = attn_pack(c1[0], c1[1]);
  a[3] = attn_pack(c1[2], c1[3]);
}

/* --------------------------------------------------------- smem tiles */

/* Element offset of (row, 16-byte chunk) in a swizzled tile of D columns. */
template <int D> __device__ __forceinline__ int attn_sw(int row, int chunk) {
  return row * D + ((chunk ^ (row & 7)) << 3);
}

/* Address for ldmatrix of the A operand (rows r0.., cols chunk c0..) or of
 * the B operand with .trans (stored rows = k): row r0 + (lane & 15), chunk
 * c0 + (lane >> 4). */
template <int D>
__device__ __forceinline__ uint32_t attn_addr_a(uint32_t base, int r0, int c0, int lane) {
  return base + 2 * attn_sw<D>(r0 + (lane & 15), c0 + (lane >> 4));
}
/* Address for ldmatrix of the B operand without .trans (stored rows = n,
 * two n8 tiles): row r0 + (lane & 7) + 8 (lane >> 4), chunk c0 + (lane >> 3 & 1). */
template <int D>
__device__ __forceinline__ uint32_t attn_addr_b(uint32_t base, int r0, int c0, int lane) {
  return base + 2 * attn_sw<D>(r0 + (lane & 7) + ((lane >> 4) << 3), c0 + ((lane >> 3) & 1));
}

/* Loads rows [row0, row0 + R) of a (T, D) matrix with row stride ld into a
 * swizzled tile; rows >= T are zero-filled. */
template <int D, int R, int NT>
__device__ __forceinline__ void attn_load_tile(uint16_t *tile, const uint16_t *g, int64_t ld,
                                               int row0, int T, int tid) {
  constexpr int CH = D / 8;
  static_assert(R * CH % NT == 0, "tile chunks must divide among the threads");
  uint32_t base = moe_smem_u32(tile);
#pragma unroll
  for (int it = 0; it < R * CH / NT; it++) {
    const int idx = tid + it * NT, r = idx / CH, c = idx % CH;
    bool ok = row0 + r < T;
    const uint16_t *src = g + (ok ? (int64_t)(row0 + r) * ld : 0) + c * 8;
    moe_cp16(base + 2 * attn_sw<D>(r, c), src, ok);
  }
}

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
};

/* ------------------------------------------------------------- forward */

template <int D, int NW, int WM, int BN>
__global__ void __launch_bounds__(NW * 32) attn_fwd_kernel(AttnParams p) {
  constexpr int BM = 16 * WM * NW, NT = NW * 32;
  extern __shared__ __align__(128) uint16_t attn_smem[];
  uint16_t *sQ = attn_smem, *sK = sQ + BM * D, *sV = sK + 2 * BN * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int bh = blockIdx.x, b = bh / p.H, h = bh % p.H;
  const int m0 = (gridDim.y - 1 - blockIdx.y) * BM; /* heaviest (last) query blocks first */
  const int T = p.T;
  const uint16_t *qg = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t *kg = p.k + b * p.k_sb + h * p.k_sh;
  const uint16_t *vg = p.v + b * p.v_sb + h * p.v_sh;
  int nkv = (T + BN - 1) / BN;
  if (p.causal) nkv = min(nkv, (m0 + BM + BN - 1) / BN);

  attn_load_tile<D, BM, NT>(sQ, qg, p.q_st, m0, T, tid);
  moe_cp_commit();
  attn_load_tile<D, BN, NT>(sK, kg, p.k_st, 0, T, tid);
  attn_load_tile<D, BN, NT>(sV, vg, p.v_st, 0, T, tid);
  moe_cp_commit();

  float acc[WM][D / 8][4];
  float mrow[WM][2], lrow[WM][2];
#pragma unroll
  for (int w = 0; w < WM; w++) {
#pragma unroll
    for (int n = 0; n < D / 8; n++) acc[w][n][0] = acc[w][n][1] = acc[w][n][2] = acc[w][n][3] = 0;
    mrow[w][0] = mrow[w][1] = -INFINITY;
    lrow[w][0] = lrow[w][1] = 0;
  }
  const uint32_t qbase = moe_smem_u32(sQ);

  for (int j = 0; j < nkv; j++) {
    const int buf = j & 1;
    if (j + 1 < nkv) {
      attn_load_tile<D, BN, NT>(sK + (buf ^ 1) * BN * D, kg, p.k_st, (j + 1) * BN, T, tid);
      attn_load_tile<D, BN, NT>(sV + (buf ^ 1) * BN * D, vg, p.v_st, (j + 1) * BN, T, tid);
      moe_cp_commit();
      moe_cp_wait<1>();
    } else {
      moe_cp_wait<0>();
    }
    __syncthreads();
    const uint32_t kbase = moe_smem_u32(sK + buf * BN * D), vbase = moe_smem_u32(sV + buf * BN * D);

    /* S = Q K^T */
    float s[WM][BN / 8][4];
#pragma unroll
    for (int w = 0; w < WM; w++)
#pragma unroll
      for (int n = 0; n < BN / 8; n++) s[w][n][0] = s[w][n][1] = s[w][n][2] = s[w][n][3] = 0;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      uint32_t a[WM][4];
#pragma unroll
      for (int w = 0; w < WM; w++)
        moe_ldm_x4(a[w], attn_addr_a<D>(qbase, (warp * WM + w) * 16, 2 * kk, lane));
#pragma unroll
      for (int nn = 0; nn < BN / 16; nn++) {
        uint32_t bb[4];
        moe_ldm_x4(bb, attn_addr_b<D>(kbase, nn * 16, 2 * kk, lane));
#pragma unroll
        for (int w = 0; w < WM; w++) {
          moe_mma_bf16(s[w][2 * nn], a[w], bb[0], bb[1]);
          moe_mma_bf16(s[w][2 * nn + 1], a[w], bb[2], bb[3]);
        }
      }
    }

    /* mask, online softmax (log2 domain) */
    const int n0 = j * BN;
    const bool need_mask = n0 + BN > T || (p.causal && n0 + BN - 1 > m0);
#pragma unroll
    for (int w = 0; w < WM; w++) {
#pragma unroll
      for (int r = 0; r < 2; r++) {
        const int row = m0 + (warp * WM + w) * 16 + g + 8 * r;
        float mx = -INFINITY;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
#pragma unroll
          for (int c = 0; c < 2; c++) {
            float x = s[w][n][2 * r + c] * p.scale_log2;
            if (need_mask) {
              const int col = n0 + n * 8 + 2 * t4 + c;
              if (col >= T || (p.causal && col > row)) x = -INFINITY;
            }
            s[w][n][2 * r + c] = x;
            mx = fmaxf(mx, x);
          }
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
        const float mnew = fmaxf(mrow[w][r], mx);
        const float muse = mnew == -INFINITY ? 0.f : mnew;
        const float alpha = attn_exp2(mrow[w][r] - muse);
        mrow[w][r] = mnew;
        float sum = 0;
#pragma unroll
        for (int n = 0; n < BN / 8; n++) {
#pragma unroll
          for (int c = 0; c < 2; c++) {
            float e = attn_exp2(s[w][n][2 * r + c] - muse);
            s[w][n][2 * r + c] = e;
            sum += e;
          }
        }
        lrow[w][r] = lrow[w][r] * alpha + sum;
#pragma unroll
        for (int n = 0; n < D / 8; n++) {
          acc[w][n][2 * r] *= alpha;
          acc[w][n][2 * r + 1] *= alpha;
        }
      }
    }

    /* O += P V */
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) {
      uint32_t pa[WM][4];
#pragma unroll
      for (int w = 0; w < WM; w++) attn_c2a(pa[w], s[w][2 * kk], s[w][2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; dn++) {
        uint32_t bb[4];
        moe_ldm_x4_t(bb, attn_addr_a<D>(vbase, kk * 16, 2 * dn, lane));
#pragma unroll
        for (int w = 0; w < WM; w++) {
          moe_mma_bf16(acc[w][2 * dn], pa[w], bb[0], bb[1]);
          moe_mma_bf16(acc[w][2 * dn + 1], pa[w], bb[2], bb[3]);
        }
      }
    }
    __syncthreads();
  }

  /* O = acc / l, lse = (m + log2 l) ln 2 */
  uint16_t *og = p.out + b * p.o_sb + h * p.o_sh;
  float *lg = p.lse + (int64_t)bh * T;
#pragma unroll
  for (int w = 0; w < WM; w++) {
#pragma unroll
    for (int r = 0; r < 2; r++) {
      float l = lrow[w][r];
      l += __shfl_xor_sync(0xffffffffu, l, 1);
      l += __shfl_xor_sync(0xffffffffu, l, 2);
      const int row = m0 + (warp * WM + w) * 16 + g + 8 * r;
      const float inv = l > 0 ? 1.f / l : 0.f;
      if (row < T) {
        uint16_t *orow = og + (int64_t)row * p.o_st;
#pragma unroll
        for (int n = 0; n < D / 8; n++)
          *reinterpret_cast<uint32_t *>(orow + n * 8 + 2 * t4) =
              attn_pack(acc[w][n][2 * r] * inv, acc[w][n][2 * r + 1] * inv);
        if (t4 == 0) lg[row] = l > 0 ? (mrow[w][r] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
  }
}

/* ------------------------------------------------------------ backward */

/* delta[bh, i] = sum_d dO[i, d] O[i, d]; one warp per row. */
template <int D> __global__ void attn_delta_kernel(AttnParams p, int64_t rows) {
  const int64_t row = (int64_t)blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5);
  const int lane = threadIdx.x & 31;
  if (row >= rows) return;
  const int64_t bh = row / p.T, i = row % p.T, b = bh / p.H, h = bh % p.H;
  const uint16_t *o = p.o + b * p.o_sb + h * p.o_sh + i * p.o_st;
  const uint16_t *d = p.dout + b * p.do_sb + h * p.do_sh + i * p.do_st;
  float s = 0;
#pragma unroll
  for (int c = lane * 2; c < D; c += 64) {
    const __nv_bfloat162 x = *reinterpret_cast<const __nv_bfloat162 *>(o + c);
    const __nv_bfloat162 y = *reinterpret_cast<const __nv_bfloat162 *>(d + c);
    s += __bfloat162float(x.x) * __bfloat162float(y.x) + __bfloat162float(x.y) * __bfloat162float(y.y);
  }
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) s += __shfl_xor_sync(0xffffffffu, s, m);
  if (lane == 0) p.delta[row] = s;
}

/* Writes a (16, D) f32 accumulator of one warp (rows row0..) as bf16 rows. */
template <int D>
__device__ __forceinline__ void attn_store_rows(uint16_t *g, int64_t ld, int row0, int T,
                                                const float (&acc)[D / 8][4], float mul,
                                                int lane) {
  const int gr = lane >> 2, t4 = lane & 3;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = row0 + gr + 8 * r;
    if (row >= T) continue;
    uint16_t *dst = g + (int64_t)row * ld;
#pragma unroll
    for (int n = 0; n < D / 8; n++)
      *reinterpret_cast<uint32_t *>(dst + n * 8 + 2 * t4) =
          attn_pack(acc[n][2 * r] * mul, acc[n][2 * r + 1] * mul);
  }
}

/* dK, dV for keys [n0, n0 + BN), BN = 16 NW (a warp owns 16 keys); query
 * blocks of BQ rows stream through shared memory. */
template <int D, int NW, int BQ>
__device__ __forceinline__ void attn_bwd_dkdv(const AttnParams &p, uint16_t *smem, int bh,
                                              int n0) {
  constexpr int BN = 16 * NW, NT = NW * 32;
  uint16_t *sK = smem, *sV = sK + BN * D, *sQ = sV + BN * D, *sO = sQ + 2 * BQ * D;
  float *sL = reinterpret_cast<float *>(sO + 2 * BQ * D), *sD = sL + 2 * BQ;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int b = bh / p.H, h = bh % p.H, T = p.T;
  const uint16_t *qg = p.q + b * p.q_sb + h * p.q_sh, *dog = p.dout + b * p.do_sb + h * p.do_sh;
  const float *lg = p.lse + (int64_t)bh * T, *dg = p.delta + (int64_t)bh * T;
  const int i0 = p.causal ? n0 / BQ : 0, nq = (T + BQ - 1) / BQ;

  attn_load_tile<D, BN, NT>(sK, p.k + b * p.k_sb + h * p.k_sh, p.k_st, n0, T, tid);
  attn_load_tile<D, BN, NT>(sV, p.v + b * p.v_sb + h * p.v_sh, p.v_st, n0, T, tid);
  auto load_q = [&](int i, int buf) {
    attn_load_tile<D, BQ, NT>(sQ + buf * BQ * D, qg, p.q_st, i * BQ, T, tid);
    attn_load_tile<D, BQ, NT>(sO + buf * BQ * D, dog, p.do_st, i * BQ, T, tid);
    for (int x = tid; x < BQ; x += NT) {
      const int row = i * BQ + x;
      sL[buf * BQ + x] = row < T ? lg[row] * kLog2e : INFINITY; /* P = 0 past T */
      sD[buf * BQ + x] = row < T ? dg[row] : 0.f;
    }
  };
  load_q(i0, 0);
  moe_cp_commit();

  float dk[D / 8][4], dv[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++)
#pragma unroll
    for (int c = 0; c < 4; c++) dk[n][c] = dv[n][c] = 0;
  const uint32_t kbase = moe_smem_u32(sK), vbase = moe_smem_u32(sV);
  const int key0 = n0 + warp * 16;

  for (int i = i0; i < nq; i++) {
    const int buf = (i - i0) & 1;
    if (i + 1 < nq) {
      load_q(i + 1, buf ^ 1);
      moe_cp_commit();
      moe_cp_wait<1>();
    } else {
      moe_cp_wait<0>();
    }
    __syncthreads();
    const uint32_t qbase = moe_smem_u32(sQ + buf * BQ * D), obase = moe_smem_u32(sO + buf * BQ * D);
    const float *L = sL + buf * BQ, *Dl = sD + buf * BQ;

    /* S^T = K Q^T, dP^T = V dO^T (16 keys x BQ queries per warp) */
    float st[BQ / 8][4], dpt[BQ / 8][4];
#pragma unroll
    for (int n = 0; n < BQ / 8; n++)
#pragma unroll
      for (int c = 0; c < 4; c++) st[n][c] = dpt[n][c] = 0;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      uint32_t ak[4], av[4];
      moe_ldm_x4(ak, attn_addr_a<D>(kbase, warp * 16, 2 * kk, lane));
      moe_ldm_x4(av, attn_addr_a<D>(vbase, warp * 16, 2 * kk, lane));
#pragma unroll
      for (int nn = 0; nn < BQ / 16; nn++) {
        uint32_t bq[4], bo[4];
        moe_ldm_x4(bq, attn_addr_b<D>(qbase, nn * 16, 2 * kk, lane));
        moe_ldm_x4(bo, attn_addr_b<D>(obase, nn * 16, 2 * kk, lane));
        moe_mma_bf16(st[2 * nn], ak, bq[0], bq[1]);
        moe_mma_bf16(st[2 * nn + 1], ak, bq[2], bq[3]);
        moe_mma_bf16(dpt[2 * nn], av, bo[0], bo[1]);
        moe_mma_bf16(dpt[2 * nn + 1], av, bo[2], bo[3]);
      }
    }
    /* P^T and dS^T in place */
    const int q0 = i * BQ;
    const bool need_mask = p.causal && q0 < n0 + BN;
#pragma unroll
    for (int n = 0; n < BQ / 8; n++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int qc = n * 8 + 2 * t4 + (e & 1), key = key0 + g + 8 * (e >> 1);
        float pr = attn_exp2(st[n][e] * p.scale_log2 - L[qc]);
        if (need_mask && q0 + qc < key) pr = 0.f;
        st[n][e] = pr;
        dpt[n][e] = pr * (dpt[n][e] - Dl[qc]);
      }
    }
    /* dV += P^T dO, dK += dS^T Q */
#pragma unroll
    for (int kk = 0; kk < BQ / 16; kk++) {
      uint32_t pa[4], da[4];
      attn_c2a(pa, st[2 * kk], st[2 * kk + 1]);
      attn_c2a(da, dpt[2 * kk], dpt[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; dn++) {
        uint32_t bo[4], bq[4];
        moe_ldm_x4_t(bo, attn_addr_a<D>(obase, kk * 16, 2 * dn, lane));
        moe_ldm_x4_t(bq, attn_addr_a<D>(qbase, kk * 16, 2 * dn, lane));
        moe_mma_bf16(dv[2 * dn], pa, bo[0], bo[1]);
        moe_mma_bf16(dv[2 * dn + 1], pa, bo[2], bo[3]);
        moe_mma_bf16(dk[2 * dn], da, bq[0], bq[1]);
        moe_mma_bf16(dk[2 * dn + 1], da, bq[2], bq[3]);
      }
    }
    __syncthreads();
  }
  attn_store_rows<D>(p.dk + b * p.dk_sb + h * p.dk_sh, p.dk_st, key0, T, dk, p.scale, lane);
  attn_store_rows<D>(p.dv + b * p.dv_sb + h * p.dv_sh, p.dv_st, key0, T, dv, 1.f, lane);
}

/* dQ for queries [m0, m0 + BM), BM = 16 NW (a warp owns 16 queries); key
 * blocks of BK rows stream through shared memory. */
template <int D, int NW, int BK>
__device__ __forceinline__ void attn_bwd_dq(const AttnParams &p, uint16_t *smem, int bh, int m0) {
  constexpr int BM = 16 * NW, NT = NW * 32;
  uint16_t *sQ = smem, *sO = sQ + BM * D, *sK = sO + BM * D, *sV = sK + 2 * BK * D;
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  const int b = bh / p.H, h = bh % p.H, T = p.T;
  const uint16_t *kg = p.k + b * p.k_sb + h * p.k_sh, *vg = p.v + b * p.v_sb + h * p.v_sh;
  int nkv = (T + BK - 1) / BK;
  if (p.causal) nkv = min(nkv, (m0 + BM + BK - 1) / BK);

  attn_load_tile<D, BM, NT>(sQ, p.q + b * p.q_sb + h * p.q_sh, p.q_st, m0, T, tid);
  attn_load_tile<D, BM, NT>(sO, p.dout + b * p.do_sb + h * p.do_sh, p.do_st, m0, T, tid);
  attn_load_tile<D, BK, NT>(sK, kg, p.k_st, 0, T, tid);
  attn_load_tile<D, BK, NT>(sV, vg, p.v_st, 0, T, tid);
  moe_cp_commit();

  const int row0 = m0 + warp * 16;
  float L[2], Dl[2];
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = row0 + g + 8 * r;
    L[r] = row < T ? p.lse[(int64_t)bh * T + row] * kLog2e : INFINITY;
    Dl[r] = row < T ? p.delta[(int64_t)bh * T + row] : 0.f;
  }
  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; n++) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0;
  const uint32_t qbase = moe_smem_u32(sQ), obase = moe_smem_u32(sO);

  for (int j = 0; j < nkv; j++) {
    const int buf = j & 1;
    if (j + 1 < nkv) {
      attn_load_tile<D, BK, NT>(sK + (buf ^ 1) * BK * D, kg, p.k_st, (j + 1) * BK, T, tid);
      attn_load_tile<D, BK, NT>(sV + (buf ^ 1) * BK * D, vg, p.v_st, (j + 1) * BK, T, tid);
      moe_cp_commit();
      moe_cp_wait<1>();
    } else {
      moe_cp_wait<0>();
    }
    __syncthreads();
    const uint32_t kbase = moe_smem_u32(sK + buf * BK * D), vbase = moe_smem_u32(sV + buf * BK * D);
    float s[BK / 8][4], dp[BK / 8][4];
#pragma unroll
    for (int n = 0; n < BK / 8; n++)
#pragma unroll
      for (int c = 0; c < 4; c++) s[n][c] = dp[n][c] = 0;
#pragma unroll
    for (int kk = 0; kk < D / 16; kk++) {
      uint32_t aq[4], ao[4];
      moe_ldm_x4(aq, attn_addr_a<D>(qbase, warp * 16, 2 * kk, lane));
      moe_ldm_x4(ao, attn_addr_a<D>(obase, warp * 16, 2 * kk, lane));
#pragma unroll
      for (int nn = 0; nn < BK / 16; nn++) {
        uint32_t bk[4], bv[4];
        moe_ldm_x4(bk, attn_addr_b<D>(kbase, nn * 16, 2 * kk, lane));
        moe_ldm_x4(bv, attn_addr_b<D>(vbase, nn * 16, 2 * kk, lane));
        moe_mma_bf16(s[2 * nn], aq, bk[0], bk[1]);
        moe_mma_bf16(s[2 * nn + 1], aq, bk[2], bk[3]);
        moe_mma_bf16(dp[2 * nn], ao, bv[0], bv[1]);
        moe_mma_bf16(dp[2 * nn + 1], ao, bv[2], bv[3]);
      }
    }
    const int n0 = j * BK;
    const bool need_mask = n0 + BK > T || (p.causal && n0 + BK - 1 > m0);
#pragma unroll
    for (int n = 0; n < BK / 8; n++) {
#pragma unroll
      for (int e = 0; e < 4; e++) {
        const int col = n0 + n * 8 + 2 * t4 + (e & 1), row = row0 + g + 8 * (e >> 1);
        float pr = attn_exp2(s[n][e] * p.scale_log2 - L[e >> 1]);
        if (need_mask && (col >= T || (p.causal && col > row))) pr = 0.f;
        s[n][e] = pr * (dp[n][e] - Dl[e >> 1]);
      }
    }
    /* dQ += dS K */
#pragma unroll
    for (int kk = 0; kk < BK / 16; kk++) {
      uint32_t da[4];
      attn_c2a(da, s[2 * kk], s[2 * kk + 1]);
#pragma unroll
      for (int dn = 0; dn < D / 16; dn++) {
        uint32_t bk[4];
        moe_ldm_x4_t(bk, attn_addr_a<D>(kbase, kk * 16, 2 * dn, lane));
        moe_mma_bf16(dq[2 * dn], da, bk[0], bk[1]);
        moe_mma_bf16(dq[2 * dn + 1], da, bk[2], bk[3]);
      }
    }
    __syncthreads();
  }
  attn_store_rows<D>(p.dq + b * p.dq_sb + h * p.dq_sh, p.dq_st, row0, T, dq, p.scale, lane);
}

/* Blocks y = 0, 2, 4, ...: dK/dV of key block y/2 (block 0 sees the most
 * queries under the causal mask); y = 1, 3, ...: dQ of query block
 * nblk - 1 - y/2 (the last sees the most keys). Heaviest first. */
template <int D, int NW, int BI>
__global__ void __launch_bounds__(NW * 32) attn_bwd_kernel(AttnParams p, int nblk) {
  extern __shared__ __align__(128) uint16_t attn_smem[];
  constexpr int B = 16 * NW;
  static_assert(B % BI == 0, "the inner tile must divide the block");
  const int y = blockIdx.y, idx = y >> 1;
  if (y & 1)
    attn_bwd_dq<D, NW, BI>(p, attn_smem, blockIdx.x, (nblk - 1 - idx) * B);
  else
    attn_bwd_dkdv<D, NW, BI>(p, attn_smem, blockIdx.x, idx * B);
}

/* ----------------------------------------------------------- launchers */

/* Tile configurations per head dim (chosen by measurement on an H100,
 * bench/results/attention.md): forward warps, m16 tiles per warp, keys per
 * step; backward warps (16 keys or queries each) and inner tile. Variants 1
 * and 2 exist for bench/attention_tune.c (moe_cuda_attention_tune). */
struct AttnFwdCfg {
  int nw, wm, bn;
};
struct AttnBwdCfg {
  int nw, bi;
};

int attn_fwd_variant = 0, attn_bwd_variant = 0;

template <int D, int NW, int WM, int BN>
moe_status attn_fwd_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH) {
  constexpr int BM = 16 * WM * NW;
  constexpr size_t smem = (size_t)(BM + 4 * BN) * D * 2;
  auto kern = attn_fwd_kernel<D, NW, WM, BN>;
  MOE_KCUDA(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)BH, (unsigned)((p.T + BM - 1) / BM));
  kern<<<grid, NW * 32, smem, stream>>>(p);
  MOE_KCHECK(ctx, "attention forward kernel");
  return MOE_OK;
}

template <int D>
moe_status attn_fwd_run(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH) {
  switch (attn_fwd_variant) {
    case 1: return attn_fwd_launch<D, 4, 2, 64>(ctx, stream, p, BH);
    case 2: return attn_fwd_launch<D, 8, 1, 64>(ctx, stream, p, BH);
    default:
      if constexpr (D == 64) return attn_fwd_launch<D, 4, 2, 64>(ctx, stream, p, BH);
      else return attn_fwd_launch<D, 4, 2, 32>(ctx, stream, p, BH);
  }
}

template <int D, int NW, int BI>
moe_status attn_bwd_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH) {
  constexpr size_t B = 16 * NW;
  constexpr size_t dkdv = (2 * B + 4 * BI) * D * 2 + 4 * BI * sizeof(float);
  constexpr size_t dq = (2 * B + 4 * BI) * D * 2;
  constexpr size_t smem = dkdv > dq ? dkdv : dq;
  auto kern = attn_bwd_kernel<D, NW, BI>;
  MOE_KCUDA(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int nblk = (int)((p.T + B - 1) / B);
  dim3 grid((unsigned)BH, (unsigned)(2 * nblk));
  kern<<<grid, NW * 32, smem, stream>>>(p, nblk);
  MOE_KCHECK(ctx, "attention backward kernel");
  return MOE_OK;
}

template <int D>
moe_status attn_bwd_run(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH) {
  const int64_t rows = (int64_t)BH * p.T;
  attn_delta_kernel<D><<<(unsigned)((rows + 7) / 8), 256, 0, stream>>>(p, rows);
  MOE_KCHECK(ctx, "attention delta kernel");
  switch (attn_bwd_variant) {
    case 1: return attn_bwd_launch<D, 4, 64>(ctx, stream, p, BH);
    case 2: return attn_bwd_launch<D, 8, 32>(ctx, stream, p, BH);
    default:
      if constexpr (D == 64) return attn_bwd_launch<D, 4, 64>(ctx, stream, p, BH);
      else return attn_bwd_launch<D, 4, 32>(ctx, stream, p, BH);
  }
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
  *BH = (int)(B * H);
  return MOE_OK;
}

} // namespace

extern "C" void moe_cuda_attention_tune(int fwd_variant, int bwd_variant) {
  attn_fwd_variant = fwd_variant;
  attn_bwd_variant = bwd_variant;
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
  int BH;
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
  if (q->shape[3] == 64) return attn_fwd_run<64>(ctx, (cudaStream_t)stream, p, BH);
  return attn_fwd_run<128>(ctx, (cudaStream_t)stream, p, BH);
}

extern "C" moe_status moe_cuda_attention_bwd(moe_ctx *ctx, int device, const moe_kview *q,
                                             const moe_kview *k, const moe_kview *v,
                                             const moe_kview *o, const moe_kview *lse,
                                             const moe_kview *dout, const moe_kview *delta,
                                             const moe_kview *dq, const moe_kview *dk,
                                             const moe_kview *dv, bool causal, double scale) {
  const char *fn = "cuda attention backward";
  AttnParams p;
  int BH;
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
  if (q->shape[3] == 64) return attn_bwd_run<64>(ctx, (cudaStream_t)stream, p, BH);
  return attn_bwd_run<128>(ctx, (cudaStream_t)stream, p, BH);
}
