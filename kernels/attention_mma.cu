/*
 * attention_mma.cu - the mma.sync kernels of the fused attention ("mma":
 * GPUs other than compute capability 9.x, MOE_ATTN_WG=0, the deterministic
 * backward, and the fallback on 9.x should the driver refuse a tensor map);
 * kernels/attention.cu validates and dispatches.
 *
 * mma.sync forward (attn_fwd_kernel): one block per (BM query rows, head); each warp
 * owns WM m16 tiles of rows. K/V tiles of BN keys stream through shared
 * memory (cp.async, double-buffered); online softmax in the log2 domain;
 * writes O (bf16) and lse (f32, natural log) per row.
 *
 * mma.sync backward: attn_delta_kernel computes delta = rowsum(dO * O) (f32); then
 * one launch of attn_bwd_kernel runs two kinds of blocks, interleaved
 * heaviest-first:
 *   dK/dV blocks: BN keys resident, loop over query blocks, recompute
 *     P^T = exp2(K Q^T * c - lse), dV += P^T dO, dP^T = V dO^T,
 *     dS^T = P^T (dP^T - delta), dK += dS^T Q;
 *   dQ blocks: BM queries resident, loop over key blocks, recompute
 *     P and dS the same way, dQ += dS K.
 * dQ is thus computed without atomics (deterministic, bit-reproducible) at
 * the price of recomputing Q K^T and dO V^T once more (7 tile products per
 * key/query pair instead of FlashAttention-2's 5 with atomic dQ). The
 * Hopper backwards take the 5-product route: dQ partials are summed in an
 * f32 buffer by atomics / bulk reductions, then scaled into dQ.
 *
 * Shared-memory tiles of the mma.sync kernels are rows of D bf16 whose 16-byte chunks are XOR
 * swizzled by (row % 8), so ldmatrix reads 8 rows without bank conflicts.
 * Rows past T are zero-filled by cp.async and masked. Index math that can
 * pass 2^31 (batch/head/row offsets) is int64.
 */
#include <cuda_bf16.h>

#include "attention.cuh"
#include "attention_cuda.h"
#include "mma.cuh"

namespace {

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
  MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  dim3 grid((unsigned)BH, (unsigned)((p.T + BM - 1) / BM));
  kern<<<grid, NW * 32, smem, stream>>>(p);
  MOE_CUDA_CHECK_LAUNCH(ctx, "attention forward kernel");
  return MOE_OK;
}

template <int D, int NW, int BI>
moe_status attn_bwd_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH) {
  constexpr size_t B = 16 * NW;
  constexpr size_t dkdv = (2 * B + 4 * BI) * D * 2 + 4 * BI * sizeof(float);
  constexpr size_t dq = (2 * B + 4 * BI) * D * 2;
  constexpr size_t smem = dkdv > dq ? dkdv : dq;
  auto kern = attn_bwd_kernel<D, NW, BI>;
  MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int nblk = (int)((p.T + B - 1) / B);
  dim3 grid((unsigned)BH, (unsigned)(2 * nblk));
  kern<<<grid, NW * 32, smem, stream>>>(p, nblk);
  MOE_CUDA_CHECK_LAUNCH(ctx, "attention backward kernel");
  return MOE_OK;
}

} // namespace

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

template <int D>
moe_status attn_bwd_run(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH) {
  const int64_t rows = (int64_t)BH * p.T;
  MOE_CHECK(attn_delta_launch<D>(ctx, stream, p, rows, nullptr));
  switch (attn_bwd_variant) {
    case 1: return attn_bwd_launch<D, 4, 64>(ctx, stream, p, BH);
    case 2: return attn_bwd_launch<D, 8, 32>(ctx, stream, p, BH);
    default:
      if constexpr (D == 64) return attn_bwd_launch<D, 4, 64>(ctx, stream, p, BH);
      else return attn_bwd_launch<D, 4, 32>(ctx, stream, p, BH);
  }
}

template moe_status attn_fwd_run<64>(moe_ctx *, cudaStream_t, const AttnParams &, int);
template moe_status attn_fwd_run<128>(moe_ctx *, cudaStream_t, const AttnParams &, int);
template moe_status attn_bwd_run<64>(moe_ctx *, cudaStream_t, const AttnParams &, int);
template moe_status attn_bwd_run<128>(moe_ctx *, cudaStream_t, const AttnParams &, int);

extern "C" void moe_cuda_attention_tune(int fwd_variant, int bwd_variant) {
  attn_fwd_variant = fwd_variant;
  attn_bwd_variant = bwd_variant;
}
