/*
 * blocksparse.cu - CUDA kernels of the block-sparse family
 * (core/blocksparse_cuda.h): MegaBlocks' SDD, DSD, DSD^T and DDS products
 * with 128 x 128 blocks over a routing plan's topology, and the dense
 * conversions.
 *
 * One main loop serves the four products. Every CTA owns one 128 x BN
 * output tile (BN = 256: two adjacent column blocks, or 256 columns of K)
 * and walks a sequence of BK-deep k-chunks; a product only says, per chunk,
 * where the A (128 x BK) and B (BK x BN, two 128-row halves) tiles start,
 * their leading dimension and how many rows / k are valid:
 *   SDD    tile = blocks (rb, c0..)   chunks over K (x row block, w columns)
 *   DSD    tile = (rb, K-tile)        chunks = the row's F blocks x 128 / BK
 *   DSD^T  tile = (column, K-tile)    chunks = the column's blocks x 128 / BK (S^T)
 *   DDS    tile = (K-tile, columns)   chunks = the columns' blocks x 128 / BK (x^T)
 * Whether A / B are k-contiguous or m/n-contiguous in memory is a template
 * parameter; ldmatrix (.trans where the tile is m/n-contiguous) turns either
 * into mma.sync m16n8k16 fragments (bf16 in, f32 accumulate). Shared memory
 * holds a multi-stage cp.async pipeline of padded tiles (row pitch + 8
 * elements: conflict-free ldmatrix); 8 warps as 2 x 4, each 64 x BN/4 of the
 * tile. CTAs are ordered in groups of 8 tile rows for L2 reuse. Variants
 * (MOE_BSMM_TILE, see bs_variant): 128 x 128 / BK 32, 128 x 256 / BK 32 and
 * 128 x 256 / BK 64. f32 uses a plain shared-memory tiled kernel (128 x 128)
 * with the same chunk walk.
 *
 * Hopper (sm_90a, the default "wg" variant; see "Hopper: TMA + wgmma main
 * loop" below): the same tiles and chunk walk (bs_cta), each chunk's
 * operands loaded by TMA boxes with the 128-byte swizzle into a 3-stage
 * mbarrier pipeline by a producer warpgroup, consumed by two warpgroups
 * with wgmma m64n256k16 (M/N-major operands through the transpose bits);
 * 2.1-2.3x the mma.sync kernels on an H100. With a gather (topo.gather_src:
 * SDD, DSD^T and DDS) the dense R-row operand is read in token order by the
 * plan, its rows copied by the whole producer warpgroup with cp.async
 * (bs_wg_gather_tile), so the permuted copy of the tokens is never made.
 *
 * The consumers' epilogue stages each half tile in shared memory and one
 * thread stores it by TMA (bs_wg_store_tma) while they go on to the next
 * tile. The same kernel runs the grouped GEMM with offsets on the device
 * (BS_GG, BS_GW: moe_cuda_wg_grouped_mm / _wgrad, for core/grouped.c), and
 * for the GLU experts the grouped GEMM with their elementwise passes in the
 * epilogue, done by epilogue warps while the consumers go on (BsArgs::fuse,
 * at BS_EW_STAGES: moe_cuda_wg_grouped_glu / _glu_bwd).
 *
 * Determinism: each output element is accumulated by one thread over the
 * chunks in the topology's order; no atomics. Sizes: K % 8 == 0 for bf16
 * (16-byte cp.async); all offsets are int64.
 */
#include <cub/block/block_scan.cuh>
#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "blocksparse_cuda.h"
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"
#include "common.cuh"
#include "glu_act.cuh"

namespace {

constexpr int BS_B = 128;      /* block size */
constexpr int BS_BK = 32;      /* k-chunk of the f32 kernel and the default bf16 one */
constexpr int BS_THREADS = 256;
constexpr int BS_GROUP = 8;       /* tile rows per rasterisation group (MOE_BSMM_GROUP) */

/* The four block-sparse products, and the grouped GEMM's two (sm_90a kernel
 * only; moe_cuda_wg_grouped_mm / _wgrad): GG out rows of group g = x rows of
 * g @ w[g] (or w[g]^T), GW out[g] = a rows of g ^T @ b rows of g. */
enum BsKind { BS_SDD = 0, BS_DSD = 1, BS_DSD_T = 2, BS_DDS = 3, BS_GG = 4, BS_GW = 5 };

/* One operand's chunk: element (mn, k) of the first 128 rows (mn < 128)
 * sits at p[mn * ld + k] when k-contiguous, else at p[k * ld + mn]; rows
 * 128.. (the second half of a 256-wide B tile) likewise from p2 with
 * mn - 128. Rows mn >= mn_valid and k >= k_valid read as zeros. */
template <typename T> struct BsTile {
  const T *p, *p2;
  int64_t ld;
  int mn_valid, k_valid;
};

struct BsArgs {
  moe_bs_topo tp;
  const void *a; /* first operand (x or s) */
  const void *c; /* second operand (w, y or s) */
  /* DSD only, or NULL: a second pair summed into the same output (s2 @ w2
   * after s @ w over the same topology; the sm_90a kernel) */
  const void *a2, *c2;
  void *out;
  int64_t K;
  int group; /* tile rows per rasterisation group (bs_raster) */
  /* SDD on the sm_90a kernel only: the GLU pair (moe_cuda_bsmm_sdd_glu).
   * act >= 0 (a moe_glu_activation): c2 is w3, and each tile is one block
   * of h1 = x w (out) and of h3 = x w3 (out2), with a = act(h1) * h3 (out3)
   * made in the epilogue from the rounded h1 and h3; -1: a plain product. */
  int act;
  void *out2, *out3;
  /* The grouped kinds: G groups over R rows, N columns of the output (K:
   * GG's depth, GW's output rows). GG walks gtab (bs_gg_table_kernel: G + 3
   * segment starts, then G + 3 prefix sums of their 128-row tiles, then the
   * segment of each tile as int32); GW reads the G + 1 group offsets goffs.
   * Both on the device. */
  const int64_t *gtab, *goffs;
  int64_t G, R, N;
  /* GW with a gather (tp.gather_src): true gathers b's rows, false a's */
  bool gather_b;
  /* GG only (BsFuse): the GLU experts' elementwise work in the epilogue.
   * BS_FUSE_GLU: c2 is w3 and a tile is 128 columns of h1 = x w (out)
   * beside the same of h3 = x w3 (out2), with a = act(h1) * h3 (out3).
   * BS_FUSE_GLU_BWD: the product is dA0 = dy w^T, and the epilogue is the
   * GLU's backward pass over it: h1 = eh1 and h3 = eh3 (read), per-row gates
   * grow (NULL: ones); dh1 to out, dh3 to out2, ga = g a to out3 (NULL:
   * none), each row's partial gate gradient <dA0, a> over the tile's
   * columns to gpart[row * column tiles + column tile] (NULL: none). */
  int fuse;
  const void *eh1, *eh3;
  const float *grow;
  float *gpart;
};
enum BsFuse { BS_FUSE_NONE = 0, BS_FUSE_GLU = 1, BS_FUSE_GLU_BWD = 2 };

/* The output tile (BS_B x BN) and chunk walk of a CTA. Output element
 * (row, col) of the tile is out[out_off + row * ldo + (col / 128) * cbs +
 * col % 128]. */
struct BsCta {
  int64_t i0;       /* SDD: first block; DSD: row block; DSD_T / DDS: first it of the column */
  int64_t col;      /* DSD_T / DDS: the (first) column block */
  int64_t t0;       /* offset of the tile along K (DSD, DSD_T: n0; DDS: m0) */
  int nq;           /* chunks */
  int64_t out_off, ldo, cbs;
  int m_valid, n_valid;
  int64_t n0;  /* GW: the tile's first output column */
  int kv_last; /* GW: valid rows of the last chunk */
};

__device__ __forceinline__ int bs_min(int64_t a, int64_t b) { return (int)(a < b ? a : b); }

/* Tile coordinates of linear CTA id over (Mt x Nt) tiles, grouped by G
 * tile rows. */
__device__ __forceinline__ void bs_raster(int64_t id, int64_t Mt, int64_t Nt, int64_t G,
                                          int64_t *mt, int64_t *nt) {
  if (Mt * Nt <= INT32_MAX && G * Nt <= INT32_MAX && id <= INT32_MAX) {
    /* in 32 bits (the usual case): 64-bit divisions are long sequences */
    const uint32_t per = (uint32_t)(G * Nt), g = (uint32_t)id / per, local = (uint32_t)id - g * per;
    const uint32_t rows = (uint32_t)(Mt - (int64_t)g * G < G ? Mt - (int64_t)g * G : G);
    *mt = (int64_t)g * G + local % rows;
    *nt = local / rows;
    return;
  }
  int64_t per = G * Nt, g = id / per, local = id - g * per;
  int64_t rows = Mt - g * G < G ? Mt - g * G : G;
  *mt = g * G + local % rows;
  *nt = local / rows;
}

/* Tiles of a product with tile width BN (host and device). */
__host__ __device__ inline int64_t bs_tiles(int kind, const moe_bs_topo &tp, int64_t K, int BN) {
  int64_t cpt = BN / BS_B; /* column blocks per tile */
  switch (kind) {
  case BS_SDD: return tp.Rb * ((tp.F + cpt - 1) / cpt);
  case BS_DSD: return tp.Rb * ((K + BN - 1) / BN);
  case BS_DSD_T: return tp.EL * tp.F * ((K + BN - 1) / BN);
  default: return tp.EL * ((tp.F + cpt - 1) / cpt) * ((K + BS_B - 1) / BS_B);
  }
}

/* GG's tile width over the output's N columns: BN, or 128 for the GLU
 * pair (128 columns of h1 beside the same of h3). */
__host__ __device__ inline int bs_gg_width(const BsArgs &g, int BN) {
  return g.fuse == BS_FUSE_GLU ? BS_B : BN;
}

template <int KIND, int BN, int BK>
__device__ __forceinline__ BsCta bs_cta(const BsArgs &g, int64_t id) {
  const moe_bs_topo &tp = g.tp;
  constexpr int CPT = BN / BS_B;
  int64_t K = g.K, F = tp.F, N = F * BS_B;
  BsCta c;
  int64_t mt, nt;
  c.col = 0;
  if (KIND == BS_SDD) { /* tile = blocks (rb, c0 .. c0 + CPT - 1); GLU: block (rb, c0) of h1 | h3 */
    const int64_t cpt = g.act >= 0 ? 1 : CPT;
    int64_t Fp = (F + cpt - 1) / cpt;
    bs_raster(id, tp.Rb, Fp, g.group, &mt, &nt);
    int64_t c0 = nt * cpt;
    c.i0 = mt * F + c0;
    c.t0 = 0;
    c.nq = (int)((K + BK - 1) / BK);
    c.out_off = c.i0 * BS_B * BS_B;
    c.ldo = BS_B, c.cbs = BS_B * BS_B;
    c.m_valid = BS_B, c.n_valid = g.act >= 0 ? BN : bs_min(BN, (F - c0) * BS_B);
  } else if (KIND == BS_DSD) {
    bs_raster(id, tp.Rb, (K + BN - 1) / BN, g.group, &mt, &nt);
    c.i0 = mt;
    c.t0 = nt * BN;
    c.nq = (int)(F * (BS_B / BK)) * (g.a2 ? 2 : 1); /* a second pair: its chunks follow */
    c.out_off = mt * BS_B * K + c.t0;
    c.ldo = K, c.cbs = BS_B;
    c.m_valid = BS_B, c.n_valid = bs_min(BN, K - c.t0);
  } else if (KIND == BS_DSD_T) { /* out (EL, N, K): rows = the column block, cols t0.. */
    bs_raster(id, tp.EL * F, (K + BN - 1) / BN, g.group, &mt, &nt);
    int64_t el = mt / F, cc = mt % F;
    c.col = mt;
    c.i0 = tp.offsets_t[mt];
    c.t0 = nt * BN;
    c.nq = (int)((tp.offsets_t[mt + 1] - c.i0) * (BS_B / BK));
    c.out_off = (el * N + cc * BS_B) * K + c.t0;
    c.ldo = K, c.cbs = BS_B;
    c.m_valid = BS_B, c.n_valid = bs_min(BN, K - c.t0);
  } else if (KIND == BS_GG) { /* 128 rows of a segment (bs_gg_table_kernel) x BN columns */
    const int64_t S = g.G + 2, *start = g.gtab, *pre = g.gtab + S + 1;
    const int bw = bs_gg_width(g, BN), NT = (int)((g.N + bw - 1) / bw);
    bs_raster(id, pre[S], NT, g.group, &mt, &nt);
    /* the segment: pre[lo] <= mt < pre[lo + 1] (the table has it) */
    const int64_t lo = ((const int32_t *)(pre + S + 1))[mt];
    int64_t row0 = start[lo] + (mt - pre[lo]) * BS_B;
    c.i0 = row0;
    c.col = lo - 1; /* the group; the first and last segments are rows outside every group */
    c.t0 = nt * bw;
    c.nq = lo == 0 || lo == S - 1 ? 0 : (int)((K + BK - 1) / BK) * (g.a2 ? 2 : 1); /* a2: its chunks follow */
    c.out_off = row0 * g.N + c.t0;
    c.ldo = g.N, c.cbs = BS_B;
    c.m_valid = bs_min(BS_B, start[lo + 1] - row0), c.n_valid = bs_min(bw, g.N - c.t0);
  } else if (KIND == BS_GW) { /* out[e] (K, N): rows t0.., columns n0.. over the group's rows */
    const int64_t KT = (K + BS_B - 1) / BS_B, NT = (g.N + BN - 1) / BN;
    bs_raster(id, g.G * KT, NT, g.group, &mt, &nt);
    int64_t e = mt / KT, r0 = g.goffs[e], r1 = g.goffs[e + 1];
    r0 = r0 < 0 ? 0 : r0 > g.R ? g.R : r0; /* offsets clamped: never a read outside x */
    r1 = r1 < r0 ? r0 : r1 > g.R ? g.R : r1;
    c.col = e, c.i0 = r0;
    c.t0 = (mt % KT) * BS_B, c.n0 = nt * BN;
    c.nq = (int)((r1 - r0 + BK - 1) / BK);
    c.kv_last = (int)(r1 - r0 - (int64_t)(c.nq - 1) * BK);
    c.out_off = (e * K + c.t0) * g.N + c.n0;
    c.ldo = g.N, c.cbs = BS_B;
    c.m_valid = bs_min(BS_B, K - c.t0), c.n_valid = bs_min(BN, g.N - c.n0);
  } else { /* DDS: out (EL, K, N): rows t0.. of K, cols = column blocks c0 .. c0 + CPT - 1 */
    int64_t Fp = (F + CPT - 1) / CPT;
    bs_raster(id, tp.EL * Fp, (K + BS_B - 1) / BS_B, g.group, &mt, &nt);
    int64_t el = mt / Fp, c0 = (mt % Fp) * CPT;
    c.col = el * F + c0;
    c.i0 = tp.offsets_t[c.col];
    c.t0 = nt * BS_B;
    c.nq = (int)((tp.offsets_t[c.col + 1] - c.i0) * (BS_B / BK));
    c.out_off = (el * K + c.t0) * N + c0 * BS_B;
    c.ldo = N, c.cbs = BS_B;
    c.m_valid = bs_min(BS_B, K - c.t0), c.n_valid = bs_min(BN, (F - c0) * BS_B);
  }
  return c;
}

/* Where chunk q of the CTA's walk reads A (128 x BK) and B (BK x BN). */
template <int KIND, bool TRANS, typename T, int BK>
__device__ __forceinline__ void bs_chunk(const BsArgs &g, const BsCta &c, int q, BsTile<T> &A,
                                         BsTile<T> &B) {
  const moe_bs_topo &tp = g.tp;
  const T *a = (const T *)g.a, *w = (const T *)g.c;
  int64_t K = g.K, F = tp.F, N = F * BS_B;
  constexpr int QB = BS_B / BK; /* chunks per block */
  if (KIND == BS_SDD) {
    int64_t i = c.i0, rb = tp.row_indices[i], cb = tp.column_indices[i];
    int64_t el = cb / F, cc = cb % F, kk = (int64_t)q * BK;
    int kv = bs_min(BK, K - kk);
    const T *pa = a + rb * BS_B * K + kk;
    A = BsTile<T>{pa, pa, K, BS_B, kv};
    if (!TRANS) { /* w[el] (K, N): B[k][n] = w[el][kk + k][cc * 128 + n] */
      const T *pb = w + (el * K + kk) * N + cc * BS_B;
      B = BsTile<T>{pb, pb + BS_B, N, c.n_valid, kv};
    } else { /* w[el] (N, K): B[k][n] = w[el][cc * 128 + n][kk + k] */
      const T *pb = w + (el * N + cc * BS_B) * K + kk;
      B = BsTile<T>{pb, pb + BS_B * K, K, c.n_valid, kv};
    }
  } else if (KIND == BS_DSD) {
    int64_t i = c.i0 * F + q / QB, cb = tp.column_indices[i];
    int64_t el = cb / F, cc = cb % F, kk = (int64_t)(q % QB) * BK;
    const T *pa = a + i * BS_B * BS_B + kk;
    A = BsTile<T>{pa, pa, BS_B, BS_B, BK};
    if (!TRANS) { /* w[el] (N, K): B[k][n] = w[el][cc * 128 + kk + k][t0 + n] */
      const T *pb = w + (el * N + cc * BS_B + kk) * K + c.t0;
      B = BsTile<T>{pb, pb + BS_B, K, c.n_valid, BK};
    } else { /* w[el] (K, N): B[k][n] = w[el][t0 + n][cc * 128 + kk + k] */
      const T *pb = w + (el * K + c.t0) * N + cc * BS_B + kk;
      B = BsTile<T>{pb, pb + BS_B * N, N, c.n_valid, BK};
    }
  } else {
    int64_t it = c.i0 + q / QB, i = tp.block_offsets_t[it], rb = tp.column_indices_t[it];
    int64_t kk = (int64_t)(q % QB) * BK;
    if (KIND == BS_DSD_T) { /* A = S_i^T (m-contiguous), B = y rows (n-contiguous) */
      const T *pa = a + i * BS_B * BS_B + kk * BS_B;
      A = BsTile<T>{pa, pa, BS_B, BS_B, BK};
      const T *pb = w + (rb * BS_B + kk) * K + c.t0;
      B = BsTile<T>{pb, pb + BS_B, K, c.n_valid, BK};
    } else { /* DDS: A = x^T (m-contiguous), B = S_i | S_i+1 (n-contiguous); a = x, w = s */
      const T *pa = a + (rb * BS_B + kk) * K + c.t0;
      A = BsTile<T>{pa, pa, K, c.m_valid, BK};
      const T *pb = w + i * BS_B * BS_B + kk * BS_B;
      B = BsTile<T>{pb, pb + BS_B * BS_B, BS_B, c.n_valid, BK};
    }
  }
}

template <int KIND, bool TRANS> struct BsLayout {
  /* A k-contiguous: SDD, DSD, GG; B k-contiguous: those with trans_w */
  static constexpr bool A_KC = KIND == BS_SDD || KIND == BS_DSD || KIND == BS_GG;
  static constexpr bool B_KC = A_KC && TRANS;
};

/* Shared-memory geometry for tile width BN, k-chunk BK and STAGES stages
 * (A is 128 x BK). Pitches of 8 extra elements keep ldmatrix conflict-free. */
template <int BN, int BK, int STAGES> struct BsSmem {
  static constexpr int PK = BK + 8;     /* pitch of a k-contiguous row (128 or BN rows) */
  static constexpr int PMA = BS_B + 8;  /* pitch of an m-contiguous A row (BK rows) */
  static constexpr int PMB = BN + 8;    /* pitch of an n-contiguous B row (BK rows) */
  static constexpr int A_ELEMS = BS_B * PK > BK * PMA ? BS_B * PK : BK * PMA;
  static constexpr int B_ELEMS = BN * PK > BK * PMB ? BN * PK : BK * PMB;
  static constexpr int STAGE = A_ELEMS + B_ELEMS;
  static constexpr size_t BYTES = sizeof(uint16_t) * (size_t)STAGES * STAGE;
};

/* ------------------------------------------------------ bf16 tensor cores */

/* Issues the cp.async copies of one operand's chunk (ROWS x BK) into a
 * stage tile: k-contiguous (ROWS rows of pitch BK + 8) or m/n-contiguous
 * (BK rows of pitch PM). */
template <bool KC, int ROWS, int PM, int BK>
__device__ __forceinline__ void bs_load_tile(uint16_t *sm, const BsTile<uint16_t> &t) {
  constexpr int PER = ROWS * BK / 8 / BS_THREADS; /* 16-byte copies per thread */
#pragma unroll
  for (int r = 0; r < PER; r++) {
    int idx = threadIdx.x + r * BS_THREADS;
    if (KC) {
      int row = idx / (BK / 8), kc = (idx % (BK / 8)) * 8;
      bool v = row < t.mn_valid && kc < t.k_valid;
      const uint16_t *base = row < BS_B ? t.p : t.p2;
      const uint16_t *src = v ? base + (int64_t)(row & (BS_B - 1)) * t.ld + kc : t.p;
      moe_cp16(moe_smem_u32(sm + row * (BK + 8) + kc), src, v);
    } else {
      int kr = idx / (ROWS / 8), mc = (idx % (ROWS / 8)) * 8;
      bool v = kr < t.k_valid && mc < t.mn_valid;
      const uint16_t *base = mc < BS_B ? t.p : t.p2;
      const uint16_t *src = v ? base + (int64_t)kr * t.ld + (mc & (BS_B - 1)) : t.p;
      moe_cp16(moe_smem_u32(sm + kr * PM + mc), src, v);
    }
  }
}

/* The tensor-core kernel: tile 128 x BN, k-chunks of BK in a STAGES-deep
 * pipeline, 8 warps as 2 x 4, each 64 x BN/4. */
template <int KIND, bool TRANS, int BN, int BK, int STAGES>
__global__ void __launch_bounds__(BS_THREADS, BN == 128 ? 2 : 1) bs_mma_kernel(BsArgs g) {
  using L = BsLayout<KIND, TRANS>;
  using SM = BsSmem<BN, BK, STAGES>;
  constexpr int NI = BN / 32; /* n8 tiles per warp */
  constexpr int NP = BN / 64; /* ldmatrix.x4 of B per k16 (16 n each) */
  extern __shared__ __align__(16) uint16_t bs_smem[];
  BsCta c = bs_cta<KIND, BN, BK>(g, blockIdx.x);
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int wm = warp >> 2, wn = warp & 3; /* warp tile rows wm*64.., cols wn*(BN/4).. */
  float acc[4][NI][4];
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++)
#pragma unroll
      for (int e = 0; e < 4; e++) acc[mi][ni][e] = 0.f;

  auto issue = [&](int q) {
    BsTile<uint16_t> A, B;
    bs_chunk<KIND, TRANS, uint16_t, BK>(g, c, q, A, B);
    uint16_t *st = bs_smem + (q % STAGES) * SM::STAGE;
    bs_load_tile<L::A_KC, BS_B, SM::PMA, BK>(st, A);
    bs_load_tile<L::B_KC, BN, SM::PMB, BK>(st + SM::A_ELEMS, B);
  };
#pragma unroll
  for (int s = 0; s < STAGES - 1; s++) {
    if (s < c.nq) issue(s);
    moe_cp_commit();
  }
  for (int q = 0; q < c.nq; q++) {
    moe_cp_wait<STAGES - 2>();
    __syncthreads();
    if (q + STAGES - 1 < c.nq) issue(q + STAGES - 1);
    moe_cp_commit();
    const uint16_t *sa = bs_smem + (q % STAGES) * SM::STAGE, *sb = sa + SM::A_ELEMS;
#pragma unroll
    for (int ks = 0; ks < BK / 16; ks++) {
      uint32_t af[4][4], bfr[NP][4];
#pragma unroll
      for (int mi = 0; mi < 4; mi++) {
        int m0 = wm * 64 + mi * 16;
        if (L::A_KC) {
          int row = m0 + (lane & 15), k = ks * 16 + (lane >> 4) * 8;
          moe_ldm_x4(af[mi], moe_smem_u32(sa + row * SM::PK + k));
        } else {
          int j = lane >> 3, k = ks * 16 + (lane & 7) + (j >> 1) * 8, m = m0 + (j & 1) * 8;
          moe_ldm_x4_t(af[mi], moe_smem_u32(sa + k * SM::PMA + m));
        }
      }
#pragma unroll
      for (int p = 0; p < NP; p++) {
        int n0 = wn * (BN / 4) + p * 16, j = lane >> 3;
        if (L::B_KC) {
          int n = n0 + (lane & 7) + (j >> 1) * 8, k = ks * 16 + (j & 1) * 8;
          moe_ldm_x4(bfr[p], moe_smem_u32(sb + n * SM::PK + k));
        } else {
          int k = ks * 16 + (lane & 7) + (j & 1) * 8, n = n0 + (j >> 1) * 8;
          moe_ldm_x4_t(bfr[p], moe_smem_u32(sb + k * SM::PMB + n));
        }
      }
#pragma unroll
      for (int mi = 0; mi < 4; mi++)
#pragma unroll
        for (int ni = 0; ni < NI; ni++)
          moe_mma_bf16(acc[mi][ni], af[mi], bfr[ni >> 1][(ni & 1) * 2], bfr[ni >> 1][(ni & 1) * 2 + 1]);
    }
  }
  moe_cp_wait<0>();
  /* epilogue: bf16 pairs, predicated on the tile's valid rows / columns */
  __nv_bfloat16 *out = (__nv_bfloat16 *)g.out + c.out_off;
  const int gq = lane >> 2, tq = lane & 3;
#pragma unroll
  for (int mi = 0; mi < 4; mi++)
#pragma unroll
    for (int ni = 0; ni < NI; ni++) {
      int col = wn * (BN / 4) + ni * 8 + tq * 2;
      int64_t coff = (int64_t)(col >> 7) * c.cbs + (col & (BS_B - 1));
#pragma unroll
      for (int h = 0; h < 2; h++) {
        int row = wm * 64 + mi * 16 + gq + h * 8;
        if (row < c.m_valid && col < c.n_valid) {
          __nv_bfloat162 v = __floats2bfloat162_rn(acc[mi][ni][2 * h], acc[mi][ni][2 * h + 1]);
          *(__nv_bfloat162 *)(out + (int64_t)row * c.ldo + coff) = v;
        }
      }
    }
}

/* ------------------------------------------------------------ f32 path */

/* Each thread owns an 8 x 8 patch of the tile; chunks staged in shared
 * memory k-major. Plain FMAs in f32, summed over k in order. */
template <int KIND, bool TRANS>
__global__ void __launch_bounds__(BS_THREADS) bs_f32_kernel(BsArgs g) {
  using L = BsLayout<KIND, TRANS>;
  __shared__ float sa[BS_BK][BS_B + 4], sb[BS_BK][BS_B + 4];
  BsCta c = bs_cta<KIND, BS_B, BS_BK>(g, blockIdx.x);
  const int tx = threadIdx.x & 15, ty = threadIdx.x >> 4;
  float acc[8][8];
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) acc[i][j] = 0.f;
  for (int q = 0; q < c.nq; q++) {
    BsTile<float> A, B;
    bs_chunk<KIND, TRANS, float, BS_BK>(g, c, q, A, B);
    for (int e = threadIdx.x; e < BS_B * BS_BK; e += BS_THREADS) {
      int mn, k;
      if (L::A_KC) mn = e >> 5, k = e & 31;
      else k = e >> 7, mn = e & 127;
      sa[k][mn] = mn < A.mn_valid && k < A.k_valid
                      ? (L::A_KC ? A.p[(int64_t)mn * A.ld + k] : A.p[(int64_t)k * A.ld + mn])
                      : 0.f;
      if (L::B_KC) mn = e >> 5, k = e & 31;
      else k = e >> 7, mn = e & 127;
      sb[k][mn] = mn < B.mn_valid && k < B.k_valid
                      ? (L::B_KC ? B.p[(int64_t)mn * B.ld + k] : B.p[(int64_t)k * B.ld + mn])
                      : 0.f;
    }
    __syncthreads();
#pragma unroll 4
    for (int k = 0; k < BS_BK; k++) {
      float av[8], bv[8];
#pragma unroll
      for (int i = 0; i < 8; i++) av[i] = sa[k][ty * 8 + i], bv[i] = sb[k][tx * 8 + i];
#pragma unroll
      for (int i = 0; i < 8; i++)
#pragma unroll
        for (int j = 0; j < 8; j++) acc[i][j] = fmaf(av[i], bv[j], acc[i][j]);
    }
    __syncthreads();
  }
  float *out = (float *)g.out + c.out_off;
#pragma unroll
  for (int i = 0; i < 8; i++)
#pragma unroll
    for (int j = 0; j < 8; j++) {
      int row = ty * 8 + i, col = tx * 8 + j;
      if (row < c.m_valid && col < c.n_valid) out[(int64_t)row * c.ldo + col] = acc[i][j];
    }
}

/* ------------------------------------------- Hopper: TMA + wgmma main loop */

/* The sm_90a path (MOE_BSMM_TILE=wg). CTA tile 128 x 256, k-chunks of 64,
 * BS_WG_STAGES-deep pipeline in shared memory, 3 warpgroups: warpgroup 0
 * is the producer (one thread issues the TMA copies of each chunk, waiting
 * on the stage's "empty" mbarrier), warpgroups 1 and 2 are consumers (rows
 * 0-63 and 64-127 of the tile: wgmma m64n256k16, f32 accumulators in
 * registers), each waiting on the stage's "full" mbarrier (TMA transaction
 * bytes) and releasing it once the wgmma that read it has completed.
 *
 * Every chunk operand is a plain 2-D (or 3-D, per expert) box of a tensor,
 * so TMA loads it with the 128-byte swizzle wgmma expects; no gather:
 *   K-major tile (k-contiguous rows): one box of 64 k x ROWS rows, row r at
 *     r * 128 bytes (SW128 K-major: 8-row groups 1024 bytes apart);
 *   M/N-major tile: boxes of 64 m/n x 64 k, box j (m/n 64j..) at j * 8192
 *     bytes, k row at k * 128 (SW128 MN-major: 64-wide atoms 8192 bytes
 *     apart, 8-k groups 1024 apart); wgmma reads it with its transpose bit.
 * Out-of-bounds box elements (K tails, the column block after the last)
 * are zero-filled by TMA; the epilogue writes only valid rows / columns. */
constexpr int BS_WG_BK = 64;
constexpr int BS_WG_BN = 256;
constexpr int BS_WG_STAGES = 3;
constexpr int BS_WG_THREADS = 384;
constexpr int BS_WG_A_BYTES = BS_B * BS_WG_BK * 2;     /* 16 KB */
constexpr int BS_WG_B_BYTES = BS_WG_BN * BS_WG_BK * 2; /* 32 KB */
constexpr int BS_WG_STAGE = BS_WG_A_BYTES + BS_WG_B_BYTES;
/* The staged epilogues' buffer: per consumer warpgroup 32 KB, its whole
 * 64 x 256 tile of bf16 for the TMA epilogue (two 16 KB halves of 128
 * columns, so that it writes both before one wait for the last tile's
 * stores), the first 16 KB a half at a time for the others; 16-byte chunks
 * XOR-swizzled by row % 8 so that both the fragment writes and the row reads
 * are free of bank conflicts. Separate from the stages, so a persistent CTA's
 * producer can fill them for the next tile meanwhile. */
constexpr int BS_WG_EPI_BYTES = 2 * 64 * 256 * 2; /* 64 KB */
/* The epilogues (the kernel's epi): from registers, staged through shared
 * memory and stored by the warpgroup, or staged and stored by TMA. */
enum { BS_EPI_DIRECT = 0, BS_EPI_STAGED = 1, BS_EPI_TMA = 2 };
/* The gathering producer's plan rows (bs_wg_gather_tile): BS_WG_RING slots of
 * 64 i64 src entries of a DDS / DSD^T chunk, or the SDD tile's 128 tokens. */
constexpr int BS_WG_RING = 3;
constexpr int BS_WG_RING_BYTES = BS_WG_RING * 64 * 8; /* 1536 */
/* stages + epilogue buffer + mbarriers + 1024 bytes for aligning the base
 * (SW128 atoms) + the gather's ring: 214064 bytes (the H100 has 232448 per
 * block). Three stages, not four: on an H200 the mixtral layer's grouped
 * GEMMs ran 1.9 % faster and the fine-grained layers the same
 * (bench/results/wg_stages.md). */
constexpr size_t BS_WG_SMEM = (size_t)BS_WG_STAGES * BS_WG_STAGE + BS_WG_EPI_BYTES + 1024 +
                              2 * BS_WG_STAGES * 8 + BS_WG_RING_BYTES;
/* The fused epilogues (BsArgs::fuse, GG only) overlap the next tile's
 * products: the consumers leave the whole 128 x 256 tile in shared memory
 * as bf16 (rows of 512 bytes, 16-byte pieces XOR-swizzled by row % 8, so
 * that both the fragment writes and the row reads are free of bank
 * conflicts) and go on, while warps 1-3 of the producer warpgroup (the
 * epilogue warps; warp 0 issues the TMA copies) read it, do the GLU's
 * elementwise work and store the results. BS_EW_STAGES stages, and the
 * backward's read-ahead ring after the barriers. Two mbarriers after the stages' hand the buffer
 * over: "tile full" (the 256 consumer threads arrive once they have written
 * it) and "tile empty" (the 96 epilogue threads arrive once they have read
 * it), each completing one phase per tile. */
constexpr int BS_EW_STAGES = 3;
constexpr int BS_WG_TILE_BYTES = 128 * 256 * 2; /* 64 KB */
/* The backward's epilogue reads h1, h3 and the gate of BS_EW_DEPTH rows
 * ahead with cp.async, into a ring of slots after the barriers: per slot,
 * 16 bytes of h1, 16 of h3 and 4 of the gate for each of the 96 threads. */
constexpr int BS_EW_DEPTH = 4;
constexpr int BS_EW_SLOT = 96 * (16 + 16 + 4);
constexpr size_t BS_EW_SMEM = (size_t)BS_EW_STAGES * BS_WG_STAGE + BS_WG_TILE_BYTES + 1024 +
                              2 * BS_EW_STAGES * 8 + 16 + BS_EW_DEPTH * BS_EW_SLOT;

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BS_WG_DEVICE 1
#endif

#ifdef BS_WG_DEVICE
/* What the producer's copies need beyond the tile's BsCta: its loads from
 * the topology and their divisions, done off the pipeline's critical path.
 * Between a stage's release and its refill the producer thread's work
 * delays the refill: with per-chunk index loads and 64-bit divisions there,
 * the SDD and DSD products took 6-16 % more cycles than the grouped ones on
 * the same shapes. So the tile's part (SDD: x's row, the expert, the first
 * weight column) is worked out once a tile (bs_wg_prep), and a chunk's part
 * (DSD: its block's expert and weight row; DSD^T and DDS: its block and row
 * block) before the producer waits for the chunk's stage (bs_wg_chunk).
 * Column blocks fit 32 bits. */
struct BsIssue {
  int row, el, n0; /* SDD (the tile): x's row, the expert, its first weight column;
                      DSD (the chunk): the block's expert and first weight row (el, n0) */
  int64_t i, rb;   /* DSD: the block; DSD^T / DDS: the block and its row block */
};
template <int KIND>
__device__ __forceinline__ BsIssue bs_wg_prep(const BsArgs &g, const BsCta &c) {
  BsIssue p{0, 0, 0, 0, 0};
  if (KIND == BS_SDD) {
    const uint32_t cb = (uint32_t)g.tp.column_indices[c.i0], F = (uint32_t)g.tp.F;
    p.row = (int)(g.tp.row_indices[c.i0] * BS_B);
    p.el = (int)(cb / F);
    p.n0 = (int)(cb - (uint32_t)p.el * F) * BS_B;
  }
  return p;
}
template <int KIND>
__device__ __forceinline__ void bs_wg_chunk(const BsArgs &g, const BsCta &c, int q, BsIssue *p) {
  const moe_bs_topo &tp = g.tp;
  if (KIND == BS_DSD) {
    const int64_t F = tp.F, qq = q >= F * 2 ? q - F * 2 : q; /* the second pair: the same walk */
    p->i = c.i0 * F + qq / 2;
    const uint32_t cb = (uint32_t)tp.column_indices[p->i], Fu = (uint32_t)F, eu = cb / Fu;
    p->el = (int)eu;
    p->n0 = (int)(cb - eu * Fu) * BS_B;
  } else if (KIND == BS_DSD_T || KIND == BS_DDS) {
    const int64_t it = c.i0 + q / 2;
    p->i = tp.block_offsets_t[it];
    p->rb = tp.column_indices_t[it];
  }
}

/* Producer: TMA copies of chunk q of the CTA's walk into stage st (A at
 * sa, B at sb), completing on mbarrier bar. Maps: ma / mb as made by
 * bs_wg_maps (the box shapes listed there); p from bs_wg_prep and
 * bs_wg_chunk. */
template <int KIND, bool TRANS>
__device__ __forceinline__ void bs_wg_issue(const BsArgs &g, const BsCta &c, const BsIssue &p, int q,
                                            const CUtensorMap *ma, const CUtensorMap *mb,
                                            const CUtensorMap *ma2, const CUtensorMap *mb2,
                                            uint32_t sa, uint32_t sb, uint32_t bar) {
  const moe_bs_topo &tp = g.tp;
  int64_t F = tp.F;
  if (KIND == BS_DSD && q >= F * 2) { /* the second pair (g.a2): the same walk */
    q -= (int)(F * 2);
    ma = ma2, mb = mb2;
  }
  if (KIND == BS_SDD) {
    const int el = p.el, n0 = p.n0, kk = q * BS_WG_BK;
    moe_tma2(sa, ma, kk, p.row, bar);            /* x (K | R): 64 x 128 */
    if (!TRANS && g.act >= 0)                   /* GLU: w1 and w3 (N | K | EL): 2 x 2 x (64 x 64 x 1) */
      for (int j = 0; j < 4; j++) moe_tma3(sb + j * 8192, j < 2 ? mb : mb2, n0 + (j & 1) * 64, kk, el, bar);
    else if (!TRANS)                            /* w (N | K | EL): 4 x (64 x 64 x 1) */
      for (int j = 0; j < 4; j++) moe_tma3(sb + j * 8192, mb, n0 + j * 64, kk, el, bar);
    else /* w (K | N | EL): 64 x 256 x 1 */
      moe_tma3(sb, mb, kk, n0, el, bar);
  } else if (KIND == BS_DSD) {
    const int64_t i = p.i;
    const int el = p.el, r0 = p.n0 + (q % 2) * BS_WG_BK, t0 = (int)c.t0;
    moe_tma2(sa, ma, (q % 2) * BS_WG_BK, (int)(i * BS_B), bar); /* s (128 | nnz*128): 64 x 128 */
    if (!TRANS) /* w (K | N | EL): 4 x (64 x 64 x 1) */
      for (int j = 0; j < 4; j++) moe_tma3(sb + j * 8192, mb, t0 + j * 64, r0, el, bar);
    else /* w (N | K | EL): 64 x 256 x 1 */
      moe_tma3(sb, mb, r0, t0, el, bar);
  } else if (KIND == BS_GG) {
    const int nk = (int)((g.K + BS_WG_BK - 1) / BS_WG_BK);
    if (q >= nk) { /* the second pair (g.a2): the same walk */
      q -= nk;
      ma = ma2, mb = mb2;
    }
    int kk = q * BS_WG_BK, n0 = (int)c.t0, e = (int)c.col;
    moe_tma2(sa, ma, kk, (int)c.i0, bar); /* x (K | R): 64 x 128 */
    if (!TRANS && g.fuse == BS_FUSE_GLU)  /* w1 and w3 (N | K | G): 2 x 2 x (64 x 64 x 1) */
      for (int j = 0; j < 4; j++) moe_tma3(sb + j * 8192, j < 2 ? mb : mb2, n0 + (j & 1) * 64, kk, e, bar);
    else if (!TRANS)                      /* w (N | K | G): 4 x (64 x 64 x 1) */
      for (int j = 0; j < 4; j++) moe_tma3(sb + j * 8192, mb, n0 + j * 64, kk, e, bar);
    else /* w (K | N | G): 64 x 256 x 1 */
      moe_tma3(sb, mb, kk, n0, e, bar);
  } else if (KIND == BS_GW) { /* A = a^T: a (K | R) 2 x (64 x 64); B = b (N | R) 4 x (64 x 64) */
    int row = (int)c.i0 + q * BS_WG_BK, t0 = (int)c.t0, n0 = (int)c.n0;
    for (int j = 0; j < 2; j++) moe_tma2(sa + j * 8192, ma, t0 + j * 64, row, bar);
    for (int j = 0; j < 4; j++) moe_tma2(sb + j * 8192, mb, n0 + j * 64, row, bar);
  } else {
    const int64_t i = p.i, rb = p.rb;
    int kk = (q % 2) * BS_WG_BK, t0 = (int)c.t0;
    if (KIND == BS_DSD_T) { /* A = S_i^T: s (128 | nnz*128) 2 x (64 x 64); B = y (K | R) 4 x */
      for (int j = 0; j < 2; j++) moe_tma2(sa + j * 8192, ma, j * 64, (int)(i * BS_B) + kk, bar);
      for (int j = 0; j < 4; j++)
        moe_tma2(sb + j * 8192, mb, t0 + j * 64, (int)(rb * BS_B) + kk, bar);
    } else { /* DDS: A = x^T: x (K | R) 2 x (64 x 64); B = S_i | S_i+1: s 4 x (64 x 64) */
      for (int j = 0; j < 2; j++)
        moe_tma2(sa + j * 8192, ma, t0 + j * 64, (int)(rb * BS_B) + kk, bar);
      for (int j = 0; j < 4; j++)
        moe_tma2(sb + j * 8192, mb, (j & 1) * 64, (int)((i + (j >> 1)) * BS_B) + kk, bar);
    }
  }
}

/* The gathered operand's part of chunk q (topo.gather_src set): the dense
 * R-row operand is (T, K) in token order, and its rows are copied with
 * cp.async by the producer warpgroup's 128 threads, each 128-byte row
 * segment by 8 consecutive threads (16 bytes each: a warp reads 4 whole
 * segments per instruction), placed by the 128-byte swizzle TMA would apply
 * (piece p of row i of an atom at i * 128 + ((p ^ (i % 8)) * 16)). A padding
 * row (gather_src < 0) and columns at or past K are zero-filled. Thread 0
 * also loads the other operand by TMA (bs_wg_issue_other); each thread's
 * copies then arrive on the stage's full barrier
 * (cp.async.mbarrier.arrive.noinc: its init count has the 128).
 * Thread t copies piece t % 8 of rows t / 8 + 16 u:
 *   SDD: A (K-major, 128 rows x 64 k), rows u = 0..7 of the tile;
 *   DDS: A = x^T (M-major boxes j = 0, 1 of 64 m x 64 k-rows): k-rows
 *        u = 0..3 of both boxes;
 *   DSD^T: B = y (N-major boxes j = 0..3): k-rows u = 0..3 of all four.
 * The rows' tokens come from shared memory (bs_wg_gather_tile). */
__device__ __forceinline__ int bs_tok(int64_t a, int k) { return a >= 0 ? (int)a / k : -1; }
/* Piece p (16 bytes at k0 + 8 p) of token tok's row into row i of the atoms at dst. */
__device__ __forceinline__ void bs_gather_piece(uint32_t dst, int i, int p, const uint16_t *d,
                                                int tok, int64_t k0, int64_t K) {
  int64_t k = k0 + p * 8;
  bool v = tok >= 0 && k < K;
  moe_cp16(dst + i * 128 + ((p ^ (i & 7)) << 4), v ? (const void *)(d + (int64_t)tok * K + k) : (const void *)d, v);
}
__device__ __forceinline__ void bs_cp_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int N> __device__ __forceinline__ void bs_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
/* The producer warpgroup's own barrier (named barrier 3; the consumers use 1
 * and 2). */
__device__ __forceinline__ void bs_producer_sync() { asm volatile("bar.sync 3, 128;\n" ::: "memory"); }

/* With a gather: thread 0's TMA copies of the operand that is not gathered,
 * arriving on bar with the bytes they bring; p from bs_wg_prep (SDD) and
 * bs_wg_chunk (DSD^T, DDS), worked out before the stage's wait as in the
 * TMA walk (unused by the grouped kinds). */
template <int KIND, bool TRANS>
__device__ __forceinline__ void bs_wg_issue_other(const BsArgs &g, const BsCta &c, const BsIssue &p, int q,
                                                  const CUtensorMap *ma, const CUtensorMap *mb,
                                                  uint32_t sa, uint32_t sb, uint32_t bar) {
  if (KIND == BS_GG) { /* B = w, as bs_wg_issue */
    int kk = q * BS_WG_BK, n0 = (int)c.t0, e = (int)c.col;
    moe_mbar_expect(bar, BS_WG_B_BYTES);
    if (!TRANS)
      for (int j = 0; j < 4; j++) moe_tma3(sb + j * 8192, mb, n0 + j * 64, kk, e, bar);
    else
      moe_tma3(sb, mb, kk, n0, e, bar);
  } else if (KIND == BS_GW) { /* the operand that is not gathered, as bs_wg_issue */
    int row = (int)c.i0 + q * BS_WG_BK;
    moe_mbar_expect(bar, g.gather_b ? BS_WG_A_BYTES : BS_WG_B_BYTES);
    if (g.gather_b)
      for (int j = 0; j < 2; j++) moe_tma2(sa + j * 8192, ma, (int)c.t0 + j * 64, row, bar);
    else
      for (int j = 0; j < 4; j++) moe_tma2(sb + j * 8192, mb, (int)c.n0 + j * 64, row, bar);
  } else if (KIND == BS_SDD) { /* B = w, as bs_wg_issue */
    const int el = p.el, n0 = p.n0, kk = q * BS_WG_BK;
    moe_mbar_expect(bar, BS_WG_B_BYTES);
    if (!TRANS)
      for (int j = 0; j < 4; j++) moe_tma3(sb + j * 8192, mb, n0 + j * 64, kk, el, bar);
    else
      moe_tma3(sb, mb, kk, n0, el, bar);
  } else {
    const int64_t i = p.i;
    int kk = (q % 2) * BS_WG_BK;
    if (KIND == BS_DSD_T) { /* A = S_i^T */
      moe_mbar_expect(bar, BS_WG_A_BYTES);
      for (int j = 0; j < 2; j++) moe_tma2(sa + j * 8192, ma, j * 64, (int)(i * BS_B) + kk, bar);
    } else { /* DDS: B = S_i | S_i+1 */
      moe_mbar_expect(bar, BS_WG_B_BYTES);
      for (int j = 0; j < 4; j++)
        moe_tma2(sb + j * 8192, mb, (j & 1) * 64, (int)((i + (j >> 1)) * BS_B) + kk, bar);
    }
  }
}
/* One tile's walk of the gathering producer warpgroup. The rows' plan
 * entries (gather_src) reach shared memory ahead of their copies, so that no
 * global load of the producer waits in the walk:
 *   SDD: the tile's 128 rows' tokens, once (a table in ring);
 *   DDS / DSD^T: the k-rows of chunk q are the buffer rows r0 + 64 q + i
 *   (i < 64; r0 the first row block of the column's blocks, which are the
 *   row blocks of one expert's segment, consecutive: moe_routing.h). Their
 *   gather_src entries are copied by cp.async BS_WG_RING - 1 chunks ahead
 *   into ring slot q % BS_WG_RING (threads 0..31, 16 bytes each; per chunk
 *   one cp.async group of entries and one of data copies), read back after
 *   cp.async.wait_group and the producer barrier. A slot is refilled only
 *   after every producer thread passed the barrier of the chunk after its
 *   last read.
 * This walk is correct and sanitizer-clean but slower than the TMA walk over
 * a permuted copy on an H100 (bench/results/moe_gather.md): the rows come by
 * 16-byte cp.async through L1 where TMA moves whole boxes. */
template <int KIND, bool TRANS>
__device__ __forceinline__ void bs_wg_gather_tile(const BsArgs &g, const BsCta &c, int64_t &it,
                                                  const CUtensorMap *ma, const CUtensorMap *mb,
                                                  uint32_t base, uint32_t bars, uint32_t ring) {
  const int t = threadIdx.x, p = t & 7, rs = t >> 3, k = (int)g.tp.gather_k;
  const uint16_t *d = (const uint16_t *)(KIND == BS_DSD_T ? g.c : g.a);
  const int64_t *src = g.tp.gather_src;
  bs_producer_sync(); /* every thread is done with the ring of the last tile */
  int64_t r0 = 0;
  BsIssue ip{0, 0, 0, 0, 0}; /* thread 0's: the other operand's coordinates */
  if (t == 0 && KIND == BS_SDD) ip = bs_wg_prep<KIND>(g, c);
  if (KIND == BS_SDD) {
    int tok = bs_tok(src[g.tp.row_indices[c.i0] * BS_B + t], k);
    asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(ring + t * 4), "r"(tok) : "memory");
    bs_producer_sync();
  } else if (c.nq > 0) {
    r0 = g.tp.column_indices_t[c.i0] * BS_B;
    for (int q = 0; q < BS_WG_RING - 1; q++) { /* the first chunks' entries */
      if (q < c.nq && t < 32) moe_cp16(ring + q * 512 + t * 16, src + r0 + q * 64 + 2 * t, true);
      bs_cp_commit();
      bs_cp_commit(); /* (no data copies yet: the group pattern of the walk, below) */
    }
  }
  for (int q = 0; q < c.nq; q++, it++) {
    int tok[8];
    if (KIND == BS_SDD) {
#pragma unroll
      for (int u = 0; u < 8; u++)
        asm volatile("ld.shared.b32 %0, [%1];\n" : "=r"(tok[u]) : "r"(ring + (rs + 16 * u) * 4) : "memory");
    } else {
      /* this thread's copies of chunk q's entries: per chunk one group of
       * entries, then one of data copies; those of chunk q came
       * 2 (BS_WG_RING - 1) - 1 groups ago */
      bs_cp_wait<2 * (BS_WG_RING - 1) - 1>();
      bs_producer_sync();           /* ... and every thread's */
      const uint32_t slot = ring + (q % BS_WG_RING) * 512;
#pragma unroll
      for (int u = 0; u < 4; u++) {
        int64_t a;
        asm volatile("ld.shared.b64 %0, [%1];\n" : "=l"(a) : "r"(slot + (rs + 16 * u) * 8) : "memory");
        tok[u] = bs_tok(a, k);
      }
      /* chunk q + RING - 1's entries into the slot read at chunk q - 1 */
      const int qn = q + BS_WG_RING - 1;
      if (qn < c.nq && t < 32)
        moe_cp16(ring + (qn % BS_WG_RING) * 512 + t * 16, src + r0 + (int64_t)qn * 64 + 2 * t, true);
      bs_cp_commit();
    }
    if (t == 0 && KIND != BS_SDD) bs_wg_chunk<KIND>(g, c, q, &ip); /* before the wait */
    int s = (int)(it % BS_WG_STAGES);
    if (it >= BS_WG_STAGES)
      moe_mbar_wait(bars + 8 * (BS_WG_STAGES + s), (uint32_t)((it / BS_WG_STAGES - 1) & 1));
    uint32_t full = bars + 8 * s, sa = base + s * BS_WG_STAGE, sb = sa + BS_WG_A_BYTES;
    if (t == 0) bs_wg_issue_other<KIND, TRANS>(g, c, ip, q, ma, mb, sa, sb, full);
    if (KIND == BS_SDD) {
#pragma unroll
      for (int u = 0; u < 8; u++) bs_gather_piece(sa, rs + 16 * u, p, d, tok[u], (int64_t)q * BS_WG_BK, g.K);
    } else {
#pragma unroll
      for (int u = 0; u < 4; u++) {
#pragma unroll
        for (int j = 0; j < (KIND == BS_DDS ? 2 : 4); j++)
          bs_gather_piece((KIND == BS_DDS ? sa : sb) + j * 8192, rs + 16 * u, p, d, tok[u], c.t0 + j * 64, g.K);
      }
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
    if (KIND != BS_SDD) bs_cp_commit();
  }
}

/* The grouped kinds' gathering walk (GG, GW with tp.gather_src): as
 * bs_wg_gather_tile's, the producer warpgroup's 128 threads copy the
 * gathered operand's rows with 16-byte cp.async (piece t % 8 of rows
 * t / 8 + 16 u) and thread 0 loads the other operand by TMA; but each
 * thread loads its rows' plan entries itself, a chunk ahead into registers
 * (the rows of a GW chunk start at any group offset, so no aligned 16-byte
 * copy of them exists). A row past its group's end reads as zeros:
 *   GG: A (K-major, 128 rows x 64 k), rows u < 8 of the tile (entries read
 *       once per tile);
 *   GW gathering a: A = a^T (boxes j = 0, 1 of 64 columns x 64 k-rows), or
 *   gathering b: B (boxes j = 0..3), k-rows u < 4 of chunk q. */
__device__ __forceinline__ int bs_gtok(const BsArgs &g, int64_t r, bool valid) {
  return valid ? bs_tok(g.tp.gather_src[r], (int)g.tp.gather_k) : -1;
}
/* GW: this thread's rows' plan entries for chunk q, loaded a chunk ahead of
 * their use and only divided into tokens there (bs_gw_toks): the loads are
 * in flight while the producer waits for its stage, where dividing at once
 * would wait for them every chunk. A row past the group's end loads the
 * last row's entry (unused). The entries are int64 below 2^31 (-1 for none):
 * their low words, little-endian, are the values. */
__device__ __forceinline__ void bs_gw_srcs(const BsArgs &g, const BsCta &c, int q, int rs, int *s) {
  const int64_t r0 = c.i0 + (int64_t)q * BS_WG_BK, last = c.i0 + (int64_t)(c.nq - 1) * BS_WG_BK + c.kv_last - 1;
  const int *lo = (const int *)g.tp.gather_src;
#pragma unroll
  for (int u = 0; u < 4; u++) {
    const int64_t r = r0 + rs + 16 * u;
    s[u] = __ldg(lo + 2 * (r < last ? r : last));
  }
}
__device__ __forceinline__ void bs_gw_toks(const BsArgs &g, const BsCta &c, int q, int rs, const int *s, int *t) {
  const int64_t r0 = c.i0 + (int64_t)q * BS_WG_BK, end = c.i0 + (int64_t)(c.nq - 1) * BS_WG_BK + c.kv_last;
#pragma unroll
  for (int u = 0; u < 4; u++) t[u] = r0 + rs + 16 * u < end ? bs_tok(s[u], (int)g.tp.gather_k) : -1;
}
template <int KIND, bool TRANS>
__device__ __forceinline__ void bs_wg_gather_grouped(const BsArgs &g, const BsCta &c, int64_t &it,
                                                     const CUtensorMap *ma, const CUtensorMap *mb,
                                                     uint32_t base, uint32_t bars) {
  const int t = threadIdx.x, p = t & 7, rs = t >> 3;
  const bool gb = KIND == BS_GW && g.gather_b;
  const uint16_t *d = (const uint16_t *)(gb ? g.c : g.a);
  const int64_t width = gb ? g.N : g.K;
  int tok[8], nxt[4];
  if (KIND == BS_GG) {
#pragma unroll
    for (int u = 0; u < 8; u++) tok[u] = bs_gtok(g, c.i0 + rs + 16 * u, rs + 16 * u < c.m_valid);
  } else if (c.nq > 0) {
    bs_gw_srcs(g, c, 0, rs, nxt);
  }
  for (int q = 0; q < c.nq; q++, it++) {
    if (KIND == BS_GW) {
      bs_gw_toks(g, c, q, rs, nxt, tok);
      if (q + 1 < c.nq) bs_gw_srcs(g, c, q + 1, rs, nxt);
    }
    const int s = (int)(it % BS_WG_STAGES);
    if (it >= BS_WG_STAGES)
      moe_mbar_wait(bars + 8 * (BS_WG_STAGES + s), (uint32_t)((it / BS_WG_STAGES - 1) & 1));
    const uint32_t full = bars + 8 * s, sa = base + s * BS_WG_STAGE, sb = sa + BS_WG_A_BYTES;
    if (t == 0) bs_wg_issue_other<KIND, TRANS>(g, c, BsIssue{0, 0, 0, 0, 0}, q, ma, mb, sa, sb, full);
    if (KIND == BS_GG) {
#pragma unroll
      for (int u = 0; u < 8; u++) bs_gather_piece(sa, rs + 16 * u, p, d, tok[u], (int64_t)q * BS_WG_BK, width);
    } else {
      const uint32_t dst = gb ? sb : sa;
      const int64_t c0 = gb ? c.n0 : c.t0;
#pragma unroll
      for (int u = 0; u < 4; u++)
#pragma unroll
        for (int j = 0; j < 4; j++)
          if (gb || j < 2) bs_gather_piece(dst + j * 8192, rs + 16 * u, p, d, tok[u], c0 + j * 64, width);
    }
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];\n" ::"r"(full) : "memory");
  }
}

#endif /* BS_WG_DEVICE */

#ifdef BS_WG_DEVICE
/* 16 bytes of shared memory at a. */
__device__ __forceinline__ uint4 bs_lds16(uint32_t a) {
  uint4 v;
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(a)
               : "memory");
  return v;
}

/* The TMA epilogues' staging: the bf16 pair v of the thread's row r and
 * 16-byte piece jj of a 128-column half (two 64 x 64 boxes of 8 pieces a
 * row) into buf in the 128-byte swizzle, at the lane's 4 bytes of it. */
__device__ __forceinline__ void bs_stage_pair(uint32_t buf, int jj, int r, int lane, __nv_bfloat162 v) {
  uint32_t bits;
  memcpy(&bits, &v, 4);
  asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(buf + (jj >> 3) * 8192 + r * 128 +
                                                  (((jj & 7) ^ (r & 7)) << 4) + (lane & 3) * 4),
               "r"(bits)
               : "memory");
}

/* Around a warpgroup's writes to its staging buffer buf: before, the last
 * TMA store from it has read it (its thread 0 waits; the barrier passes that
 * on); after, the writes are visible to TMA's async proxy and done across
 * the warpgroup, so that thread 0 can store. */
__device__ __forceinline__ void bs_stage_acquire(int cw) {
  if ((threadIdx.x & 127) == 0) moe_bulk_wait_read<0>();
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
}
__device__ __forceinline__ void bs_stage_release(int cw) {
  moe_fence_proxy();
  asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
}

/* The TMA epilogue: each half (128 columns) of the consumer warpgroup's
 * 64 x 256 goes to its 16 KB half of buf as bf16, two 64 x 64 boxes in the
 * 128-byte swizzle (row r at r * 128, 16-byte piece p at (p ^ r % 8) * 16;
 * the fragment writes are free of bank conflicts), and one thread stores
 * the boxes with TMA (map mo, made by bs_wg_out_map). The warpgroup goes on
 * to its next tile while the stores run; the buffer is written again once
 * they have read it (one wait a tile, before both halves). The tensor's
 * bounds clip the tile's invalid rows and columns, except SDD's second block
 * past the row's last, which is skipped, and GG's rows past its group (the
 * group's last tile, stored in 8-row slices by map mo8). */
template <int KIND>
__device__ __forceinline__ void bs_wg_store_tma(const BsArgs &g, const BsCta &c, const CUtensorMap *mo,
                                                const CUtensorMap *mo8, const float (&acc)[128], uint32_t buf,
                                                int cw) {
  const int tid = threadIdx.x & 127, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
  bs_stage_acquire(cw);
#pragma unroll
  for (int half = 0; half < 2; half++) {
    if (half * 128 >= c.n_valid) break; /* uniform over the warpgroup */
#pragma unroll
    for (int jj = 0; jj < 16; jj++) {
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int j = half * 16 + jj, r = wq * 16 + (lane >> 2) + h * 8;
        bs_stage_pair(buf + half * 16384, jj, r, lane,
                      __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]));
      }
    }
  }
  bs_stage_release(cw);
  if (KIND == BS_GG && c.m_valid < BS_B) {
    /* the group's last tile, whose rows past m_valid are the next group's:
     * the whole 8-row slices of the valid rows by TMA (map mo8, 64 x 8
     * boxes: a slice is 1 KB of a staged box, in the same swizzle), the
     * remaining rows by the threads, 16 bytes each */
    const int v = c.m_valid - cw * 64 < 0 ? 0 : c.m_valid - cw * 64 > 64 ? 64 : c.m_valid - cw * 64;
    const int v8 = v & ~7;
    if (tid == 0 && v8 > 0) {
      for (int col = 0; col < c.n_valid && col < BS_WG_BN; col += 64) {
        const uint32_t box = buf + (col >> 7) * 16384 + ((col >> 6) & 1) * 8192;
        for (int j = 0; j < v8; j += 8)
          moe_tma_store2(mo8, box + j * 128, (int)c.t0 + col, (int)c.i0 + cw * 64 + j);
      }
      moe_bulk_commit();
    }
    for (int idx = tid; idx < (v - v8) * 32; idx += 128) {
      const int r = v8 + (idx >> 5), ch = idx & 31, col = ch * 8, p = ch & 7;
      if (col >= c.n_valid) continue;
      uint4 val = bs_lds16(buf + (ch >> 4) * 16384 + ((ch >> 3) & 1) * 8192 + r * 128 + ((p ^ (r & 7)) << 4));
      *(uint4 *)((__nv_bfloat16 *)g.out + (c.i0 + cw * 64 + r) * g.N + c.t0 + col) = val;
    }
    return;
  }
#pragma unroll
  for (int half = 0; half < 2; half++) {
    if (half * 128 >= c.n_valid) break;
    if (tid == 0) {
      const int64_t F = g.tp.F;
#pragma unroll
      for (int b = 0; b < 2; b++) {
        const int col = half * 128 + b * 64;
        if (col >= c.n_valid) break;
        const uint32_t src = buf + half * 16384 + b * 8192;
        if (KIND == BS_SDD) /* blocks (nnz * 128 rows of 128): block i0 + half */
          moe_tma_store2(mo, src, b * 64, (int)((c.i0 + half) * BS_B) + cw * 64);
        else if (KIND == BS_DSD) /* (R rows of K): row block i0 */
          moe_tma_store2(mo, src, (int)c.t0 + col, (int)(c.i0 * BS_B) + cw * 64);
        else if (KIND == BS_DSD_T) /* (EL * N rows of K): rows col * 128.. */
          moe_tma_store2(mo, src, (int)c.t0 + col, (int)(c.col * BS_B) + cw * 64);
        else if (KIND == BS_GG) /* (R, N): rows i0.. (a whole tile), columns t0.. */
          moe_tma_store2(mo, src, (int)c.t0 + col, (int)c.i0 + cw * 64);
        else if (KIND == BS_GW) /* (G, K, N): group col, rows t0.., columns n0.. */
          moe_tma_store3(mo, src, (int)c.n0 + col, (int)c.t0 + cw * 64, (int)c.col);
        else /* DDS: (EL, K, N): expert col / F, rows t0.., columns (col % F) * 128 + .. */
          moe_tma_store3(mo, src, (int)((c.col % F) * BS_B) + col, (int)c.t0 + cw * 64,
                         (int)(c.col / F));
      }
      moe_bulk_commit();
    }
  }
}

/* The GLU pair's epilogue (BsArgs::act): the warpgroup's 64 x 256 is h1's
 * block (columns 0..127) beside h3's (128..255), so a thread holds h1 and h3
 * of the same elements: h1, h3 and a = act(h1) * h3 (computed from the
 * bf16-rounded h1 and h3, as the separate activation pass does) go out in
 * turn through buf, each as two 64 x 64 boxes by TMA (maps mo, mo2, mo3 over
 * the three (nnz * 128, 128) block tensors). */
__device__ __forceinline__ void bs_wg_store_glu(const BsArgs &g, const BsCta &c, const CUtensorMap *mo,
                                                const CUtensorMap *mo2, const CUtensorMap *mo3,
                                                const float (&acc)[128], uint32_t buf, int cw) {
  const int tid = threadIdx.x & 127, lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
#pragma unroll 1
  for (int part = 0; part < 3; part++) {
    bs_stage_acquire(cw);
#pragma unroll
    for (int jj = 0; jj < 16; jj++) {
#pragma unroll
      for (int h = 0; h < 2; h++) {
        const int r = wq * 16 + (lane >> 2) + h * 8, e1 = 4 * jj + 2 * h, e3 = e1 + 64;
        __nv_bfloat162 v1 = __floats2bfloat162_rn(acc[e1], acc[e1 + 1]), v;
        if (part == 0) {
          v = v1;
        } else {
          __nv_bfloat162 v3 = __floats2bfloat162_rn(acc[e3], acc[e3 + 1]);
          if (part == 1) {
            v = v3;
          } else {
            float f0, f1, d;
            ex_act(g.act, __low2float(v1), &f0, &d);
            ex_act(g.act, __high2float(v1), &f1, &d);
            v = __floats2bfloat162_rn(f0 * __low2float(v3), f1 * __high2float(v3));
          }
        }
        bs_stage_pair(buf, jj, r, lane, v);
      }
    }
    bs_stage_release(cw);
    if (tid == 0) {
      const CUtensorMap *m = part == 0 ? mo : part == 1 ? mo2 : mo3;
      for (int b = 0; b < 2; b++) moe_tma_store2(m, buf + b * 8192, b * 64, (int)(c.i0 * BS_B) + cw * 64);
      moe_bulk_commit();
    }
  }
}
#endif /* BS_WG_DEVICE */

#ifdef BS_WG_DEVICE
/* The fused epilogues (BsArgs::fuse; layout and barriers at BS_EW_STAGES).
 * Piece p (16 bytes: columns 8p..8p+7) of row r of the tile buffer tb. */
__device__ __forceinline__ uint32_t bs_ew_piece(uint32_t tb, int r, int p) {
  return tb + r * 512 + ((p ^ (r & 7)) << 4);
}

/* A consumer warpgroup's 64 x 256 (acc as in the kernel's epilogue) into
 * the tile buffer as bf16, once the epilogue warps have read the last one
 * (tn: the CTA's tiles so far; tbar: the tile full and tile empty
 * mbarriers); then the tile is announced to them. */
__device__ __forceinline__ void bs_ew_stage(const float (&acc)[128], uint32_t tb, int cw, int64_t tn,
                                            uint32_t tbar) {
  const int lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
  if (tn > 0) moe_mbar_wait(tbar + 8, (uint32_t)((tn - 1) & 1));
#pragma unroll
  for (int j = 0; j < 32; j++) {
#pragma unroll
    for (int h = 0; h < 2; h++) {
      const int r = cw * 64 + wq * 16 + (lane >> 2) + h * 8;
      __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
      uint32_t bits;
      memcpy(&bits, &v, 4);
      asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(bs_ew_piece(tb, r, j) + (lane & 3) * 4), "r"(bits)
                   : "memory");
    }
  }
  moe_mbar_arrive(tbar);
}

/* BS_FUSE_GLU: the tile is h1 (pieces 0-15) beside h3 (16-31) of the same
 * 128 columns. Epilogue warp ew's lanes 0-15 take its rows ew * 2 + 6 i,
 * lanes 16-31 the next ones; lane l % 16 piece l of h1 and of h3. h1, h3
 * and a = act(h1) * h3 (from the rounded h1 and h3, in f32, as the
 * separate activation pass) go out as 16-byte stores. */
__device__ __forceinline__ void bs_ew_glu(const BsArgs &g, const BsCta &c, uint32_t tb, int ew,
                                          int lane) {
  const int l = lane & 15;
  if (l * 8 >= c.n_valid) return;
  for (int r = ew * 2 + (lane >> 4); r < c.m_valid; r += 6) {
    uint4 v1 = bs_lds16(bs_ew_piece(tb, r, l)), v3 = bs_lds16(bs_ew_piece(tb, r, l + 16)), va;
    const __nv_bfloat162 *p1 = reinterpret_cast<const __nv_bfloat162 *>(&v1),
                         *p3 = reinterpret_cast<const __nv_bfloat162 *>(&v3);
    __nv_bfloat162 *pa = reinterpret_cast<__nv_bfloat162 *>(&va);
#pragma unroll
    for (int i = 0; i < 4; i++) {
      float2 x1 = __bfloat1622float2(p1[i]), x3 = __bfloat1622float2(p3[i]);
      float f0, f1, d;
      ex_act(g.act, x1.x, &f0, &d);
      ex_act(g.act, x1.y, &f1, &d);
      pa[i] = __floats2bfloat162_rn(f0 * x3.x, f1 * x3.y);
    }
    const int64_t off = (c.i0 + r) * g.N + c.t0 + l * 8;
    *(uint4 *)((__nv_bfloat16 *)g.out + off) = v1;
    *(uint4 *)((__nv_bfloat16 *)g.out2 + off) = v3;
    *(uint4 *)((__nv_bfloat16 *)g.out3 + off) = va;
  }
}

/* BS_FUSE_GLU_BWD: the tile is dA0's. Epilogue warp ew takes rows
 * ew + 3 i, lane l piece l (columns 8l..8l+7); each thread copies its
 * pieces of h1 and h3 and the row's gate BS_EW_DEPTH rows ahead into its
 * own places of the ring (cp.async: no registers held while they come).
 * Per element the arithmetic of the separate backward pass
 * (ex_glu_bwd_kernel in kernels/experts.cu), so dh1, dh3 and ga have its
 * bits. h1 and h3 may be ga's and dh3's buffers: each element is read (by
 * the copy that precedes its row) before it is written, by the same thread.
 * The row's partial gate gradient: the lane's 8 products in order, then the
 * warp's 32 lanes reduced in a fixed order. */
__device__ __forceinline__ void bs_ew_glu_bwd(const BsArgs &g, const BsCta &c, uint32_t tb,
                                              uint32_t ring, int ew, int lane) {
  const int t = (int)threadIdx.x - 32; /* 0..95 */
  const bool on = lane * 8 < c.n_valid;
  const int64_t NT = (g.N + BS_WG_BN - 1) / BS_WG_BN, nt = c.t0 / BS_WG_BN;
  const __nv_bfloat16 *h1 = (const __nv_bfloat16 *)g.eh1, *h3 = (const __nv_bfloat16 *)g.eh3;
  __nv_bfloat16 *dh1 = (__nv_bfloat16 *)g.out, *dh3 = (__nv_bfloat16 *)g.out2,
                *ga = (__nv_bfloat16 *)g.out3;
  const int rows = c.m_valid > ew ? (c.m_valid - ew + 2) / 3 : 0;
  auto fetch = [&](int i) { /* row i of the warp's into slot i % depth (an empty group past the last) */
    const int r = ew + 3 * i;
    const uint32_t slot = ring + (i % BS_EW_DEPTH) * BS_EW_SLOT;
    if (i < rows && on) {
      const int64_t off = (c.i0 + r) * g.N + c.t0 + lane * 8;
      moe_cp16(slot + t * 16, h1 + off, true);
      moe_cp16(slot + 96 * 16 + t * 16, h3 + off, true);
      if (g.grow)
        asm volatile("cp.async.ca.shared.global [%0], [%1], 4;\n" ::"r"(slot + 96 * 32 + t * 4),
                     "l"(g.grow + c.i0 + r)
                     : "memory");
    }
    bs_cp_commit();
  };
#pragma unroll
  for (int i = 0; i < BS_EW_DEPTH; i++) fetch(i);
  for (int i = 0; i < rows; i++) {
    bs_cp_wait<BS_EW_DEPTH - 1>();
    const int r = ew + 3 * i;
    const uint32_t slot = ring + (i % BS_EW_DEPTH) * BS_EW_SLOT;
    float dot = 0.f;
    if (on) {
      uint4 v1 = bs_lds16(slot + t * 16), v3 = bs_lds16(slot + 96 * 16 + t * 16),
            v0 = bs_lds16(bs_ew_piece(tb, r, lane));
      float gs = 1.0f;
      if (g.grow) asm volatile("ld.shared.f32 %0, [%1];\n" : "=f"(gs) : "r"(slot + 96 * 32 + t * 4) : "memory");
      const __nv_bfloat162 *p1 = reinterpret_cast<const __nv_bfloat162 *>(&v1),
                           *p3 = reinterpret_cast<const __nv_bfloat162 *>(&v3),
                           *p0 = reinterpret_cast<const __nv_bfloat162 *>(&v0);
      uint4 o1, o3, og;
      __nv_bfloat162 *q1 = reinterpret_cast<__nv_bfloat162 *>(&o1),
                     *q3 = reinterpret_cast<__nv_bfloat162 *>(&o3),
                     *qg = reinterpret_cast<__nv_bfloat162 *>(&og);
#pragma unroll
      for (int j = 0; j < 4; j++) {
        const float2 x1 = __bfloat1622float2(p1[j]), x3 = __bfloat1622float2(p3[j]),
                     dd = __bfloat1622float2(p0[j]);
        float o[2][3];
#pragma unroll
        for (int e = 0; e < 2; e++) {
          const float a1 = e ? x1.y : x1.x, a3 = e ? x3.y : x3.x, d0 = e ? dd.y : dd.x;
          float fa, dfa;
          ex_act(g.act, a1, &fa, &dfa);
          const float av = __bfloat162float(__float2bfloat16_rn(fa * a3));
          dot += d0 * av;
          const float da = gs * d0;
          o[e][0] = da * a3 * dfa, o[e][1] = da * fa, o[e][2] = gs * av;
        }
        q1[j] = __floats2bfloat162_rn(o[0][0], o[1][0]);
        q3[j] = __floats2bfloat162_rn(o[0][1], o[1][1]);
        qg[j] = __floats2bfloat162_rn(o[0][2], o[1][2]);
      }
      const int64_t off = (c.i0 + r) * g.N + c.t0 + lane * 8;
      *(uint4 *)(dh1 + off) = o1;
      *(uint4 *)(dh3 + off) = o3;
      if (ga) *(uint4 *)(ga + off) = og;
    }
    if (g.gpart) {
      for (int o = 16; o > 0; o >>= 1) dot += __shfl_down_sync(0xffffffffu, dot, o);
      if (lane == 0) g.gpart[(c.i0 + r) * NT + nt] = dot;
    }
    fetch(i + BS_EW_DEPTH);
  }
  bs_cp_wait<0>(); /* the ring is the next tile's */
}

/* The epilogue warps (warps 1-3 of the producer warpgroup): the CTA's
 * tiles in the consumers' order, each once the consumers have staged it. */
template <int FUSE>
__device__ __forceinline__ void bs_ew_loop(const BsArgs &g, int64_t ntiles, uint32_t tb, uint32_t tbar,
                                           uint32_t ring) {
  const int ew = (int)(threadIdx.x >> 5) - 1, lane = threadIdx.x & 31;
  int64_t tn = 0;
  for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x, tn++) {
    BsCta c = bs_cta<BS_GG, BS_WG_BN, BS_WG_BK>(g, tile);
    moe_mbar_wait(tbar, (uint32_t)(tn & 1));
    if (FUSE == BS_FUSE_GLU) bs_ew_glu(g, c, tb, ew, lane);
    else bs_ew_glu_bwd(g, c, tb, ring, ew, lane);
    moe_mbar_arrive(tbar + 8); /* the consumers' next tile may be staged */
  }
}
#endif /* BS_WG_DEVICE */

#ifdef BS_WG_DEVICE
/* A scattered row's 8 bf16 values as moe_routing_combine makes a token's
 * row from its one assignment: bf16(0 + s * v) in f32 (so that the fused
 * scatter gives the combine's bits). */
__device__ __forceinline__ uint4 bs_scatter8(uint4 v, float s) {
  __nv_bfloat162 *e = reinterpret_cast<__nv_bfloat162 *>(&v);
#pragma unroll
  for (int i = 0; i < 4; i++) {
    float2 f = __bfloat1622float2(e[i]);
    e[i] = __floats2bfloat162_rn(__fadd_rn(0.f, __fmul_rn(s, f.x)), __fadd_rn(0.f, __fmul_rn(s, f.y)));
  }
  return v;
}
#endif

/* mn_swap: 1 swaps the LBO / SBO fields of the M/N-major descriptors (a
 * diagnostic, MOE_BSMM_WG_MNSWAP=1; 0 is the PTX ISA's canonical form).
 * The CTA walks tiles blockIdx.x, blockIdx.x + gridDim.x, ... < ntiles: one
 * tile per CTA when the grid covers them all, a persistent grid otherwise
 * (MOE_BSMM_PERSIST; the producer then loads the next tile's first chunks
 * while the consumers store the previous one). Stage / phase counters run
 * on across tiles (it = the CTA's chunk count so far). */
template <int KIND, bool TRANS, bool GATHER, bool SCATTER, int FUSE>
__global__ void __launch_bounds__(BS_WG_THREADS, 1)
    bs_wg_kernel(const __grid_constant__ CUtensorMap ma, const __grid_constant__ CUtensorMap mb,
                 const __grid_constant__ CUtensorMap ma2, const __grid_constant__ CUtensorMap mb2,
                 const __grid_constant__ CUtensorMap mo, const __grid_constant__ CUtensorMap mo2,
                 const __grid_constant__ CUtensorMap mo3, BsArgs g, int64_t ntiles, int mn_swap,
                 int epi) {
#ifdef BS_WG_DEVICE
  using L = BsLayout<KIND, TRANS>;
  constexpr int ST = FUSE ? BS_EW_STAGES : BS_WG_STAGES; /* stages */
  extern __shared__ __align__(16) uint8_t bs_wsmem[];
  const uint32_t raw = moe_smem_u32(bs_wsmem);
  const uint32_t base = (raw + 1023u) & ~1023u;
  const uint32_t epi_buf = base + ST * BS_WG_STAGE;
  const uint32_t bars = epi_buf + (FUSE ? BS_WG_TILE_BYTES : BS_WG_EPI_BYTES); /* full[S], empty[S] */
  const int wg = threadIdx.x / 128;
  if (KIND == BS_GG) { /* the grid covers an upper bound; the table has the count */
    const int bw = bs_gg_width(g, BS_WG_BN);
    ntiles = g.gtab[2 * (g.G + 2) + 1] * ((g.N + bw - 1) / bw);
  }
  if (threadIdx.x == 0) {
    for (int s = 0; s < ST; s++) {
      /* full: the TMA thread's arrival (+ the 128 gathering threads' copies) */
      moe_mbar_init(bars + 8 * s, GATHER ? 1 + 128 : 1);
      moe_mbar_init(bars + 8 * (ST + s), 256);
    }
    if (FUSE != BS_FUSE_NONE) { /* the tile buffer's: full (consumers), empty (epilogue warps) */
      moe_mbar_init(bars + 2 * ST * 8, 256);
      moe_mbar_init(bars + 2 * ST * 8 + 8, 96);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();
  if (wg == 0) { /* producer */
    /* the fused epilogues' warps get a few more registers than the copies
     * need: 72 here against the consumers' 216 (65536 in all) */
    if constexpr (FUSE != BS_FUSE_NONE) asm volatile("setmaxnreg.dec.sync.aligned.u32 72;\n");
    else asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (FUSE != BS_FUSE_NONE && threadIdx.x >= 32) { /* the epilogue warps */
      bs_ew_loop<FUSE>(g, ntiles, epi_buf, bars + 2 * ST * 8, bars + 2 * ST * 8 + 16);
    } else if constexpr (GATHER && KIND >= BS_GG) { /* the grouped kinds' gathering walk */
      int64_t it = 0;
      for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        BsCta c = bs_cta<KIND, BS_WG_BN, BS_WG_BK>(g, tile);
        bs_wg_gather_grouped<KIND, TRANS>(g, c, it, &ma, &mb, base, bars);
      }
    } else if constexpr (GATHER) { /* the whole warpgroup copies the gathered operand */
      const uint32_t ring = bars + 2 * ST * 8;
      int64_t it = 0;
      for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        BsCta c = bs_cta<KIND, BS_WG_BN, BS_WG_BK>(g, tile);
        bs_wg_gather_tile<KIND, TRANS>(g, c, it, &ma, &mb, base, bars, ring);
      }
    } else if (threadIdx.x == 0) {
      /* the next chunk's stage s and phase ph; once every stage has been
       * filled, each waits for the consumers to have read its last chunk */
      int s = 0;
      uint32_t ph = 0;
      bool reuse = false;
      for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
        BsCta c = bs_cta<KIND, BS_WG_BN, BS_WG_BK>(g, tile);
        BsIssue p = bs_wg_prep<KIND>(g, c);
        for (int q = 0; q < c.nq; q++) {
          bs_wg_chunk<KIND>(g, c, q, &p);
          if (reuse) moe_mbar_wait(bars + 8 * (ST + s), ph ^ 1u);
          uint32_t full = bars + 8 * s, sa = base + s * BS_WG_STAGE;
          moe_mbar_expect(full, BS_WG_STAGE);
          bs_wg_issue<KIND, TRANS>(g, c, p, q, &ma, &mb, &ma2, &mb2, sa, sa + BS_WG_A_BYTES, full);
          if (++s == ST) s = 0, ph ^= 1u, reuse = true;
        }
      }
    }
  } else { /* consumers: rows (wg - 1) * 64 .. of the tile */
    if constexpr (FUSE != BS_FUSE_NONE) asm volatile("setmaxnreg.inc.sync.aligned.u32 216;\n");
    else asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n");
    const int cw = wg - 1;
    const uint32_t lbo = mn_swap ? 1024u : 8192u, sbo = mn_swap ? 8192u : 1024u;
    const int lane = threadIdx.x & 31, wq = (threadIdx.x >> 5) & 3;
    /* the next chunk's stage s and its phase ph, the last chunk's stage sp
     * (they run on across tiles) */
    int s = 0, sp = 0;
    uint32_t ph = 0;
    [[maybe_unused]] int64_t tn = 0; /* the CTA's tiles so far: the tile buffer's phases */
    /* c: this tile's walk; cn: the next tile's, worked out while the first
     * chunk's products run (done between tiles, with its loads from the
     * segment table and its divisions, it held the tensor cores idle) */
    BsCta c{}, cn{};
    if ((int64_t)blockIdx.x < ntiles) c = bs_cta<KIND, BS_WG_BN, BS_WG_BK>(g, blockIdx.x);
    for (int64_t tile = blockIdx.x; tile < ntiles; tile += gridDim.x, c = cn) {
      const int64_t next = tile + gridDim.x; /* past the last: cn is not read */
      float acc[128];
#pragma unroll
      for (int e = 0; e < 128; e++) acc[e] = 0.f;
      for (int q = 0; q < c.nq; q++) {
        moe_mbar_wait(bars + 8 * s, ph);
        uint32_t sa = base + s * BS_WG_STAGE + cw * 8192, sb = base + s * BS_WG_STAGE + BS_WG_A_BYTES;
        /* the gathered rows came by cp.async (the generic proxy); wgmma reads
         * through the async proxy */
        if (GATHER) moe_fence_proxy();
        if (KIND == BS_GW && q == c.nq - 1 && c.kv_last < BS_WG_BK) {
          /* the group's last rows: the chunk's rows past them belong to the
           * next group (or are TMA's zeros past R). This warpgroup zeroes
           * them in its own A box and in all of B (k-row r is the 128 bytes
           * at r * 128 of each box; the other warpgroup writes the same
           * zeros), so not even an infinity of the next group's leaks in. */
          for (int i = (threadIdx.x & 127) + c.kv_last * 8; i < BS_WG_BK * 8; i += 128)
#pragma unroll
            for (int j = 0; j < 5; j++)
              asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(
                               (j == 0 ? sa : sb + (j - 1) * 8192) + i * 16),
                           "r"(0)
                           : "memory");
          moe_fence_proxy();
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
        }
        moe_wg_fence();
#pragma unroll
        for (int ks = 0; ks < BS_WG_BK / 16; ks++) {
          uint64_t da =
              L::A_KC ? moe_wg_desc(sa + ks * 32, 16, 1024) : moe_wg_desc(sa + ks * 2048, lbo, sbo);
          uint64_t db =
              L::B_KC ? moe_wg_desc(sb + ks * 32, 16, 1024) : moe_wg_desc(sb + ks * 2048, lbo, sbo);
          moe_wg_ss<256, L::A_KC ? 0 : 1, L::B_KC ? 0 : 1>(acc, da, db);
        }
        moe_wg_commit();
        if (!GATHER && q == 0 && next < ntiles) cn = bs_cta<KIND, BS_WG_BN, BS_WG_BK>(g, next);
        moe_wg_wait<1>();
        if (q > 0) moe_mbar_arrive(bars + 8 * (ST + sp));
        sp = s;
        if (++s == ST) s = 0, ph ^= 1u;
      }
      /* (the gathering kernels have no registers to spare for it meanwhile) */
      if ((GATHER || c.nq == 0) && next < ntiles) cn = bs_cta<KIND, BS_WG_BN, BS_WG_BK>(g, next);
      moe_wg_wait<0>();
      /* the tile's last stage is free for the producer's next tile */
      if (c.nq > 0) moe_mbar_arrive(bars + 8 * (ST + sp));
      /* epilogue: acc[4 j + 2 h + e] = tile (row, col), row = cw * 64 + warp * 16
       * + lane / 4 + 8 h, col = 8 j + 2 (lane % 4) + e */
      if constexpr (FUSE != BS_FUSE_NONE) { /* to the epilogue warps */
        bs_ew_stage(acc, epi_buf, cw, tn++, bars + 2 * ST * 8);
        continue;
      }
      if (KIND == BS_SDD && g.act >= 0) {
        bs_wg_store_glu(g, c, &mo, &mo2, &mo3, acc, epi_buf + cw * (BS_WG_EPI_BYTES / 2), cw);
        continue;
      }
      if (epi == BS_EPI_TMA) {
        bs_wg_store_tma<KIND>(g, c, &mo, &mo2, acc, epi_buf + cw * (BS_WG_EPI_BYTES / 2), cw);
        continue;
      }
      __nv_bfloat16 *out = (__nv_bfloat16 *)g.out + c.out_off;
      if (epi && c.ldo % 8 == 0 && c.cbs % 8 == 0 && ((uintptr_t)out & 15) == 0) {
        /* Staged: each half (128 columns) of the warpgroup's 64 x 256 goes to
         * shared memory as bf16, then out as whole 16-byte chunks, a warp
         * writing two 256-byte row segments per instruction (the direct
         * stores below touch 8 rows per instruction). */
        const uint32_t buf = epi_buf + cw * (BS_WG_EPI_BYTES / 2);
        const int tid = threadIdx.x & 127;
        /* the scatter (DSD, GG; tp.scatter_dst; a kernel of its own, so
         * that the others' epilogue is not touched): the thread's rows
         * tid / 16 + 8 k of the warpgroup's 64 go to rows srow[k] of out
         * (none where < 0), scaled by ssc[k] as bs_scatter8 */
        constexpr bool scat = SCATTER && (KIND == BS_DSD || KIND == BS_GG);
        int64_t srow[8];
        float ssc[8];
        if (scat) {
          const int64_t r0 = (KIND == BS_GG ? c.i0 : c.i0 * BS_B) + cw * 64 + (tid >> 4);
#pragma unroll
          for (int k = 0; k < 8; k++) {
            const bool v = cw * 64 + (tid >> 4) + 8 * k < c.m_valid;
            srow[k] = v ? g.tp.scatter_dst[r0 + 8 * k] : -1;
            ssc[k] = srow[k] >= 0 && g.tp.scatter_scale ? g.tp.scatter_scale[srow[k]] : 1.f;
          }
        }
#pragma unroll
        for (int half = 0; half < 2; half++) {
          /* the buffer's previous readers (the other half, the last tile, or
           * with the TMA epilogue an earlier tile's stores) are done */
          if (epi == BS_EPI_TMA && tid == 0) moe_bulk_wait_read<0>();
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
          for (int jj = 0; jj < 16; jj++) {
#pragma unroll
            for (int h = 0; h < 2; h++) {
              const int j = half * 16 + jj, r = wq * 16 + (lane >> 2) + h * 8;
              __nv_bfloat162 v = __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
              uint32_t bits;
              memcpy(&bits, &v, 4);
              asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(buf + r * 256 + ((jj ^ (r & 7)) << 4) +
                                                            (lane & 3) * 4),
                           "r"(bits)
                           : "memory");
            }
          }
          asm volatile("bar.sync %0, 128;\n" ::"r"(1 + cw) : "memory");
#pragma unroll
          for (int k = 0; k < 8; k++) {
            const int idx = tid + k * 128, r = idx >> 4, ch = idx & 15;
            const int row = cw * 64 + r, col = half * 128 + ch * 8;
            uint4 v;
            asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];\n"
                         : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                         : "r"(buf + r * 256 + ((ch ^ (r & 7)) << 4))
                         : "memory");
            if (row < c.m_valid && col < c.n_valid && (!scat || srow[k] >= 0)) {
              __nv_bfloat16 *dst = out + (int64_t)row * c.ldo + (int64_t)(col >> 7) * c.cbs + (col & (BS_B - 1));
              if (scat) { /* (column blocks are adjacent: cbs is 128 for DSD and GG) */
                dst = (__nv_bfloat16 *)g.out + srow[k] * c.ldo + c.t0 + col;
                v = bs_scatter8(v, ssc[k]);
              }
              if (col + 8 <= c.n_valid) {
                *(uint4 *)dst = v;
              } else {
                __nv_bfloat16 e[8];
                memcpy(e, &v, 16);
                for (int q = 0; col + q < c.n_valid; q++) dst[q] = e[q];
              }
            }
          }
        }
        continue;
      }
#pragma unroll
      for (int j = 0; j < 32; j++) {
        int col = j * 8 + (lane & 3) * 2;
        int64_t coff = (int64_t)(col >> 7) * c.cbs + (col & (BS_B - 1));
#pragma unroll
        for (int h = 0; h < 2; h++) {
          int row = cw * 64 + wq * 16 + (lane >> 2) + h * 8;
          if (row < c.m_valid && col < c.n_valid)
            *(__nv_bfloat162 *)(out + (int64_t)row * c.ldo + coff) =
                __floats2bfloat162_rn(acc[4 * j + 2 * h], acc[4 * j + 2 * h + 1]);
        }
      }
    }
    /* the shared memory stays until the last stores have read it */
    if (!FUSE && (epi == BS_EPI_TMA || g.act >= 0) && (threadIdx.x & 127) == 0) moe_bulk_wait<0>();
  }
#else
  (void)ma, (void)mb, (void)ma2, (void)mb2, (void)mo, (void)mo2, (void)mo3, (void)g, (void)ntiles, (void)mn_swap, (void)epi;
#endif
}

/* cuTensorMapEncodeTiled through the runtime's driver entry point (no link
 * against libcuda). */
/* A bf16 tensor map over a row-major tensor: dims innermost first (elements),
 * box in elements (innermost 64 = 128 bytes, the swizzle span). */
moe_status bs_map(moe_ctx *ctx, CUtensorMap *m, const void *p, int rank, const int64_t *dims,
                  const uint32_t *box) {
  moe_tma_encode_fn enc = moe_tma_encoder();
  if (!enc) return moe_error(ctx, MOE_ERR_CUDA, "bsmm: cuTensorMapEncodeTiled is not available");
  cuuint64_t gd[3], gs[2];
  cuuint32_t bx[3], es[3] = {1, 1, 1};
  int64_t stride = 2;
  for (int d = 0; d < rank; d++) {
    gd[d] = (cuuint64_t)dims[d], bx[d] = box[d];
    if (d > 0) gs[d - 1] = (cuuint64_t)stride;
    stride *= dims[d];
  }
  CUresult r = enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, (cuuint32_t)rank, (void *)p, gd, gs, bx,
                   es, CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
                   CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS)
    return moe_error(ctx, MOE_ERR_CUDA,
                     "bsmm: cuTensorMapEncodeTiled failed (%d) on a bf16 tensor of dims [%lld, %lld, %lld] "
                     "(innermost first; rank %d) at address %p (%s 16-byte aligned)",
                     (int)r, (long long)dims[0], rank > 1 ? (long long)dims[1] : 0LL,
                     rank > 2 ? (long long)dims[2] : 0LL, rank, p,
                     ((uintptr_t)p & 15) ? "not" : "");
  return MOE_OK;
}

/* The maps of a k-contiguous A of dims da (64 x 128 boxes) and a per-expert
 * weight of dims dw (64 x 256 x 1 boxes with trans_w, else 64 x 64 x 1), and
 * of the second pair g.a2, g.c2 when there is one (DSD, GG). */
template <bool TRANS>
moe_status bs_wg_pair_maps(moe_ctx *ctx, const BsArgs &g, const int64_t *da, const int64_t *dw,
                           CUtensorMap *ma, CUtensorMap *mb, CUtensorMap *ma2, CUtensorMap *mb2) {
  const uint32_t b64x128[2] = {64, 128}, b3_64[3] = {64, 64, 1}, b3_256[3] = {64, 256, 1};
  const uint32_t *bw = TRANS ? b3_256 : b3_64;
  MOE_CHECK(bs_map(ctx, ma, g.a, 2, da, b64x128));
  MOE_CHECK(bs_map(ctx, mb, g.c, 3, dw, bw));
  if (!g.a2) return MOE_OK;
  MOE_CHECK(bs_map(ctx, ma2, g.a2, 2, da, b64x128));
  return bs_map(ctx, mb2, g.c2, 3, dw, bw);
}

/* The two tensor maps of a product (see bs_wg_issue for the boxes). A
 * gathered operand has no map (the producer warpgroup copies its rows). */
template <int KIND, bool TRANS>
moe_status bs_wg_maps(moe_ctx *ctx, const BsArgs &g, CUtensorMap *ma, CUtensorMap *mb,
                      CUtensorMap *ma2, CUtensorMap *mb2) {
  const moe_bs_topo &tp = g.tp;
  int64_t K = g.K, N = tp.F * BS_B, R = tp.Rb * BS_B, S = tp.nnz * BS_B, EL = tp.EL;
  const uint32_t b64x128[2] = {64, 128}, b64x64[2] = {64, 64};
  const uint32_t b3_64[3] = {64, 64, 1}, b3_256[3] = {64, 256, 1};
  const bool gather = tp.gather_src != nullptr;
  memset(ma, 0, sizeof *ma);
  memset(mb, 0, sizeof *mb);
  memset(ma2, 0, sizeof *ma2);
  memset(mb2, 0, sizeof *mb2);
  if (KIND == BS_SDD) {
    const int64_t dx[2] = {K, R}, dw[3] = {N, K, EL}, dwt[3] = {K, N, EL};
    if (!gather) MOE_CHECK(bs_map(ctx, ma, g.a, 2, dx, b64x128));
    if (g.act >= 0) MOE_CHECK(bs_map(ctx, mb2, g.c2, 3, dw, b3_64)); /* w3 of the GLU pair */
    return TRANS ? bs_map(ctx, mb, g.c, 3, dwt, b3_256) : bs_map(ctx, mb, g.c, 3, dw, b3_64);
  }
  if (KIND == BS_DSD) {
    const int64_t ds[2] = {BS_B, S}, dw[3] = {K, N, EL}, dwt[3] = {N, K, EL};
    return bs_wg_pair_maps<TRANS>(ctx, g, ds, TRANS ? dwt : dw, ma, mb, ma2, mb2);
  }
  if (KIND == BS_GG) {
    const int64_t dx[2] = {K, g.R}, dw[3] = {g.N, K, g.G}, dwt[3] = {K, g.N, g.G};
    if (gather) return bs_map(ctx, mb, g.c, 3, TRANS ? dwt : dw, TRANS ? b3_256 : b3_64);
    if (g.fuse == BS_FUSE_GLU) MOE_CHECK(bs_map(ctx, mb2, g.c2, 3, dw, b3_64)); /* w3 of the pair */
    return bs_wg_pair_maps<TRANS>(ctx, g, dx, TRANS ? dwt : dw, ma, mb, ma2, mb2);
  }
  if (KIND == BS_GW) {
    const int64_t da[2] = {K, g.R}, db[2] = {g.N, g.R};
    if (!(gather && !g.gather_b)) MOE_CHECK(bs_map(ctx, ma, g.a, 2, da, b64x64));
    return gather && g.gather_b ? MOE_OK : bs_map(ctx, mb, g.c, 2, db, b64x64);
  }
  const int64_t ds[2] = {BS_B, S}, dy[2] = {K, R};
  const bool dds = KIND == BS_DDS; /* DSD^T: a = s, c = y; DDS: a = x, c = s */
  if (!(gather && dds)) MOE_CHECK(bs_map(ctx, ma, g.a, 2, dds ? dy : ds, b64x64));
  if (gather && !dds) return MOE_OK;
  return bs_map(ctx, mb, g.c, 2, dds ? ds : dy, b64x64);
}

/* The output's tensor map of the TMA epilogue (bs_wg_store_tma): 64 x 64
 * boxes of SDD's blocks (nnz * 128 rows of 128), DSD's (R, K), DSD^T's
 * (EL * N, K), GW's (G, K, N), GG's (R, N) or DDS's (EL, K, N). */
template <int KIND> moe_status bs_wg_out_map(moe_ctx *ctx, const BsArgs &g, CUtensorMap *mo) {
  const moe_bs_topo &tp = g.tp;
  int64_t K = g.K, N = tp.F * BS_B;
  const uint32_t b2[2] = {64, 64}, b3[3] = {64, 64, 1};
  if (KIND == BS_SDD) {
    const int64_t d[2] = {BS_B, tp.nnz * BS_B};
    return bs_map(ctx, mo, g.out, 2, d, b2);
  }
  if (KIND == BS_DSD) {
    const int64_t d[2] = {K, tp.Rb * BS_B};
    return bs_map(ctx, mo, g.out, 2, d, b2);
  }
  if (KIND == BS_DSD_T) {
    const int64_t d[2] = {K, tp.EL * N};
    return bs_map(ctx, mo, g.out, 2, d, b2);
  }
  if (KIND == BS_GW) {
    const int64_t d[3] = {g.N, K, g.G};
    return bs_map(ctx, mo, g.out, 3, d, b3);
  }
  if (KIND == BS_GG) {
    const int64_t d[2] = {g.N, g.R};
    return bs_map(ctx, mo, g.out, 2, d, b2);
  }
  const int64_t d[3] = {N, K, tp.EL};
  return bs_map(ctx, mo, g.out, 3, d, b3);
}

template <int KIND, bool TRANS>
moe_status bs_launch_wg(moe_ctx *ctx, const BsArgs &g, cudaStream_t stream, int64_t ctas) {
  CUtensorMap ma, mb, ma2, mb2, mo, mo2, mo3;
  MOE_CHECK((bs_wg_maps<KIND, TRANS>(ctx, g, &ma, &mb, &ma2, &mb2)));
  int swap = ctx->knobs.bsmm_wg_mnswap; /* MOE_BSMM_WG_MNSWAP=1 */
  constexpr bool CAN_GATHER = KIND != BS_DSD; /* DSD has no dense R-row operand */
  if (g.tp.gather_src && !CAN_GATHER)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm: dsd has no row operand to gather");
  if (g.tp.gather_src && g.a2)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm: a gather with a summed second pair");
  if (g.tp.gather_src && g.tp.scatter_dst)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm: a gather and a scatter in one product");
  if (g.tp.gather_src && (g.tp.gather_k < 1 || g.tp.gather_k > INT32_MAX))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm: gather k = %lld", (long long)g.tp.gather_k);
  constexpr bool CAN_SCATTER = KIND == BS_DSD || KIND == BS_GG;
  auto kern = g.tp.gather_src    ? bs_wg_kernel<KIND, TRANS, CAN_GATHER, false, BS_FUSE_NONE>
              : g.tp.scatter_dst ? bs_wg_kernel<KIND, TRANS, false, CAN_SCATTER, BS_FUSE_NONE>
                                 : bs_wg_kernel<KIND, TRANS, false, false, BS_FUSE_NONE>;
  size_t smem = BS_WG_SMEM;
  if (g.fuse != BS_FUSE_NONE) {
    if (KIND != BS_GG || g.tp.gather_src || g.tp.scatter_dst || g.a2 || g.act < 0 || g.act > 2 ||
        TRANS != (g.fuse == BS_FUSE_GLU_BWD))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "bsmm: a fused GLU epilogue is the grouped gemm's alone, with activation "
                       "0..2, no gather, scatter or second pair, and trans_w for the backward");
    constexpr int F = TRANS ? BS_FUSE_GLU_BWD : BS_FUSE_GLU;
    if constexpr (KIND == BS_GG) kern = bs_wg_kernel<KIND, TRANS, false, false, F>;
    smem = BS_EW_SMEM;
  }
  MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  /* the knob bsmm_persist: 1 (the default), a persistent grid of one CTA per
   * multiprocessor (the producer loads a CTA's next tile while its consumers
   * store the last: the short tiles of fine-grained experts gain most); n >=
   * 2: n CTAs (tests use a few to walk many tiles per CTA); 0: one CTA per
   * tile */
  int64_t grid = ctas, want = ctx->knobs.bsmm_persist;
  if (want == 1) {
    int dev = 0, sms = 0;
    MOE_CUDA_CHECK(ctx, cudaGetDevice(&dev));
    MOE_CUDA_CHECK(ctx, cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, dev));
    want = sms;
  }
  if (want >= 1 && want < grid) grid = want;
  /* The epilogue: staged through shared memory and stored by TMA (the
   * default), staged and stored by the warpgroup ("smem"), or stored from
   * registers ("direct"). On an H100 (bench/results/blocksparse.md) the
   * staged stores beat the direct ones on every product with the persistent
   * grid, and TMA's beat both: the warpgroup's own global stores held it for
   * most of the epilogue. MOE_BSMM_EPI (the knob bsmm_epi) overrides, for
   * tests and tuning. TMA needs a 16-byte aligned output (K % 8 == 0 holds
   * already: the operands' maps need it). */
  int epi = BS_EPI_TMA;
  if (ctx->knobs.bsmm_epi == MOE_KNOB_BSMM_EPI_DIRECT) epi = BS_EPI_DIRECT;
  if (ctx->knobs.bsmm_epi == MOE_KNOB_BSMM_EPI_SMEM) epi = BS_EPI_STAGED;
  if (epi == BS_EPI_TMA && ((uintptr_t)g.out & 15)) epi = BS_EPI_STAGED;
  /* only the staged stores scatter rows (whatever MOE_BSMM_EPI says) */
  if (g.tp.scatter_dst) epi = BS_EPI_STAGED;
  if (g.tp.scatter_dst && (((uintptr_t)g.out & 15) || (KIND != BS_DSD && KIND != BS_GG)))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "bsmm: a scatter needs dsd or the grouped gemm and a 16-byte aligned output");
  memset(&mo, 0, sizeof mo);
  memset(&mo2, 0, sizeof mo2);
  memset(&mo3, 0, sizeof mo3);
  if (KIND == BS_SDD && g.act >= 0) { /* the GLU pair's three block tensors (TMA only) */
    if (TRANS || g.tp.gather_src || ((uintptr_t)g.out | (uintptr_t)g.out2 | (uintptr_t)g.out3) & 15)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "bsmm sdd_glu: needs untransposed weights, no gather and 16-byte aligned outputs");
    BsArgs g2 = g, g3 = g;
    g2.out = g.out2, g3.out = g.out3;
    MOE_CHECK(bs_wg_out_map<KIND>(ctx, g, &mo));
    MOE_CHECK(bs_wg_out_map<KIND>(ctx, g2, &mo2));
    MOE_CHECK(bs_wg_out_map<KIND>(ctx, g3, &mo3));
  } else if (epi == BS_EPI_TMA && g.fuse == BS_FUSE_NONE) {
    MOE_CHECK(bs_wg_out_map<KIND>(ctx, g, &mo));
    if (KIND == BS_GG) { /* a group's last tile: 8-row boxes (bs_wg_store_tma) */
      const int64_t d[2] = {g.N, g.R};
      const uint32_t b8[2] = {64, 8};
      MOE_CHECK(bs_map(ctx, &mo2, g.out, 2, d, b8));
    }
  }
  kern<<<(unsigned)grid, BS_WG_THREADS, smem, stream>>>(ma, mb, ma2, mb2, mo, mo2, mo3, g, ctas,
                                                              swap, epi);
  MOE_CUDA_CHECK_LAUNCH(ctx, "bsmm (bf16 wgmma kernel)");
  return MOE_OK;
}

/* Whether device can run the sm_90a kernel (compute capability 9.x). */
bool bs_wg_supported(int device) {
  int major = 0;
  return cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
             cudaSuccess &&
         major == 9;
}

/* -------------------------------------------------------------- launch */

/* The bf16 kernel variant, the knob bsmm_tile (MOE_BSMM_TILE):
 * "wg" (the default: TMA + wgmma, 128 x 256, BK 64, 3 stages, sm_90a; on a
 * GPU other than compute capability 9.x it falls back to 256k64), or the
 * mma.sync kernels: "128" (tile 128 x 128, BK 32, 4 stages, 2 CTAs per SM),
 * "256" (128 x 256, BK 32, 4 stages), "256k64" (128 x 256, BK 64, 3 stages).
 * All are tested (tests/c/test_blocksparse_cuda.c) and benchmarked. */
enum BsVariant {
  BS_V128 = MOE_KNOB_BSMM_TILE_128,
  BS_V256 = MOE_KNOB_BSMM_TILE_256,
  BS_V256K64 = MOE_KNOB_BSMM_TILE_256K64,
  BS_VWG = MOE_KNOB_BSMM_TILE_WG /* the default, the fastest on an H100 (bench/results/blocksparse.md) */
};
BsVariant bs_variant(const moe_ctx *ctx) { return (BsVariant)ctx->knobs.bsmm_tile; }

template <int KIND, bool TRANS, int BN, int BK, int STAGES>
moe_status bs_launch_mma(moe_ctx *ctx, const BsArgs &g, cudaStream_t stream, int64_t ctas) {
  size_t smem = BsSmem<BN, BK, STAGES>::BYTES;
  auto kern = bs_mma_kernel<KIND, TRANS, BN, BK, STAGES>;
  MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kern<<<(unsigned)ctas, BS_THREADS, smem, stream>>>(g);
  MOE_CUDA_CHECK_LAUNCH(ctx, "bsmm (bf16 tensor-core kernel)");
  return MOE_OK;
}

template <int KIND, bool TRANS>
moe_status bs_launch(moe_ctx *ctx, int device, moe_dtype dt, const BsArgs &g) {
  BsVariant v = bs_variant(ctx);
  int BN = dt == MOE_BF16 && v != BS_V128 ? 256 : BS_B;
  if (g.act >= 0) BN = BS_B; /* the GLU pair: a tile per block */
  int64_t ctas = bs_tiles(KIND, g.tp, g.K, BN);
  if (ctas == 0) return MOE_OK;
  if (ctas > INT32_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "bsmm: %lld tiles exceed the grid limit",
                     (long long)ctas);
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t cs = (cudaStream_t)stream;
  if ((g.tp.gather_src || g.tp.scatter_dst || g.a2 || g.act >= 0) &&
      !(dt == MOE_BF16 && v == BS_VWG && bs_wg_supported(device)))
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "bsmm: %s needs bf16 and the wgmma kernel on compute capability 9.x",
                     g.a2 ? "a summed second pair" : g.act >= 0 ? "the GLU pair" :
                     g.tp.gather_src ? "gathering rows" : "scattering rows");
  if (dt == MOE_BF16 && v == BS_VWG && bs_wg_supported(device))
    return bs_launch_wg<KIND, TRANS>(ctx, g, cs, ctas);
  if (dt == MOE_BF16 && (v == BS_V256K64 || v == BS_VWG)) return bs_launch_mma<KIND, TRANS, 256, 64, 3>(ctx, g, cs, ctas);
  if (dt == MOE_BF16 && v == BS_V256) return bs_launch_mma<KIND, TRANS, 256, 32, 4>(ctx, g, cs, ctas);
  if (dt == MOE_BF16) return bs_launch_mma<KIND, TRANS, 128, 32, 4>(ctx, g, cs, ctas);
  bs_f32_kernel<KIND, TRANS><<<(unsigned)ctas, BS_THREADS, 0, (cudaStream_t)stream>>>(g);
  MOE_CUDA_CHECK_LAUNCH(ctx, "bsmm (f32 kernel)");
  return MOE_OK;
}

BsArgs bs_args(const moe_ctx *ctx, const moe_bs_topo *tp, const void *a, const void *c, void *out,
               int64_t K) {
  BsArgs g;
  g.tp = *tp;
  g.a = a, g.c = c, g.out = out, g.K = K;
  g.a2 = g.c2 = nullptr;
  g.act = -1;
  g.out2 = g.out3 = nullptr;
  g.gtab = g.goffs = nullptr;
  g.G = g.R = g.N = 0;
  g.gather_b = false;
  g.fuse = BS_FUSE_NONE;
  g.eh1 = g.eh3 = nullptr;
  g.grow = nullptr;
  g.gpart = nullptr;
  /* the knob bsmm_group, MOE_BSMM_GROUP (1..64), overrides the
   * rasterisation group, for tuning */
  const int v = ctx->knobs.bsmm_group;
  g.group = v >= 1 && v <= 64 ? v : BS_GROUP;
  return g;
}

/* ------------------------------------------------------ grouped GEMM */

/* GG's segment table from the G + 1 group offsets, on the device: G + 2
 * segments (the rows before the first group, the groups, the rows after the
 * last) as G + 3 starts (offsets clamped into [0, R] and made monotone, so
 * bad offsets cannot send a tile outside x), then the prefix sums of their
 * 128-row tiles, then each tile's segment as int32 (at most R / 128 + G + 2
 * tiles: bs_gg_table_bytes), so that a CTA finds its tile's group with one
 * load. One block of BS_GG_TT threads, each BS_GG_ITEMS consecutive
 * segments: a max-scan makes the starts monotone, a sum-scan counts the
 * tiles (G + 2 <= BS_GG_MAX_SEG), and all search the prefix sums for the
 * tiles' segments. */
constexpr int BS_GG_TT = 256, BS_GG_ITEMS = 16;
constexpr int BS_GG_MAX_SEG = BS_GG_TT * BS_GG_ITEMS; /* 4096 */
__host__ __device__ inline size_t bs_gg_table_bytes(int64_t G, int64_t R) {
  return sizeof(int64_t) * (size_t)(2 * (G + 3)) + sizeof(int32_t) * (size_t)(R / BS_B + G + 3);
}
struct BsMax {
  __device__ int64_t operator()(int64_t a, int64_t b) const { return a > b ? a : b; }
};
__global__ void __launch_bounds__(BS_GG_TT) bs_gg_table_kernel(const int64_t *offs, int64_t G, int64_t R,
                                                               int64_t *tab) {
  using Scan = cub::BlockScan<int64_t, BS_GG_TT>;
  __shared__ typename Scan::TempStorage tmp;
  __shared__ int64_t o[BS_GG_MAX_SEG + 1]; /* the starts, then the prefix sums */
  const int64_t S = G + 2;
  int64_t *start = tab, *pre = tab + S + 1;
  int64_t v[BS_GG_ITEMS];
  /* start[s] for s = 1 + item: the running max of the offsets clamped to
   * [0, R] (offs[s - 1] for s <= G + 1; R for s = S) */
#pragma unroll
  for (int i = 0; i < BS_GG_ITEMS; i++) {
    const int64_t s = 1 + (int64_t)threadIdx.x * BS_GG_ITEMS + i;
    int64_t x = s <= G + 1 ? offs[s - 1] : R;
    v[i] = x < 0 ? 0 : x > R ? R : x;
  }
  Scan(tmp).InclusiveScan(v, v, BsMax());
#pragma unroll
  for (int i = 0; i < BS_GG_ITEMS; i++) {
    const int64_t s = 1 + (int64_t)threadIdx.x * BS_GG_ITEMS + i;
    if (s <= S) o[s] = start[s] = s == S ? R : v[i];
  }
  if (threadIdx.x == 0) o[0] = start[0] = 0;
  __syncthreads();
  /* tiles of segment s = item, then their exclusive sums */
#pragma unroll
  for (int i = 0; i < BS_GG_ITEMS; i++) {
    const int64_t s = (int64_t)threadIdx.x * BS_GG_ITEMS + i;
    v[i] = s < S ? (o[s + 1] - o[s] + BS_B - 1) / BS_B : 0;
  }
  int64_t total;
  __syncthreads(); /* o and tmp are reused */
  Scan(tmp).ExclusiveSum(v, v, total);
#pragma unroll
  for (int i = 0; i < BS_GG_ITEMS; i++) {
    const int64_t s = (int64_t)threadIdx.x * BS_GG_ITEMS + i;
    if (s < S) o[s] = v[i];
  }
  if (threadIdx.x == 0) o[S] = total;
  __syncthreads();
  for (int64_t s = threadIdx.x; s <= S; s += blockDim.x) pre[s] = o[s];
  int32_t *seg = (int32_t *)(pre + S + 1);
  for (int64_t m = threadIdx.x; m < o[S]; m += blockDim.x) {
    int64_t lo = 0, hi = S; /* o[lo] <= m < o[hi] */
    while (hi - lo > 1) {
      const int64_t mid = (lo + hi) / 2;
      if (o[mid] <= m) lo = mid;
      else hi = mid;
    }
    seg[m] = (int32_t)lo;
  }
}

/* Whether the grouped kinds run for these sizes and pointers: the TMA maps
 * need 16-byte rows and addresses, and int32 coordinates. */
bool bs_wg_grouped_ok(int64_t G, int64_t R, int64_t K, int64_t N, const void *const *ptrs, int n) {
  if (G < 1 || G + 2 >= BS_GG_MAX_SEG || K % 8 || N % 8 || R > INT32_MAX || K > INT32_MAX ||
      N > INT32_MAX)
    return false;
  for (int i = 0; i < n; i++)
    if ((uintptr_t)ptrs[i] & 15) return false;
  return true;
}

/* ------------------------------------------------------ dense conversions */

template <typename T>
__global__ void bs_convert_kernel(moe_bs_topo tp, const T *src, T *dst, bool to_dense) {
  int64_t i = blockIdx.x, rb = tp.row_indices[i], cb = tp.column_indices[i];
  int64_t ld = tp.EL * tp.F * BS_B;
  for (int e = threadIdx.x; e < BS_B * BS_B; e += blockDim.x) {
    int r = e / BS_B, j = e % BS_B;
    int64_t d = (rb * BS_B + r) * ld + cb * BS_B + j, s = i * BS_B * BS_B + e;
    if (to_dense) dst[d] = src[s];
    else dst[s] = src[d];
  }
}

moe_status bs_convert(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                      const void *src, void *dst, bool to_dense) {
  if (tp->nnz == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  if (dt == MOE_BF16)
    bs_convert_kernel<uint16_t><<<(unsigned)tp->nnz, 256, 0, (cudaStream_t)stream>>>(
        *tp, (const uint16_t *)src, (uint16_t *)dst, to_dense);
  else
    bs_convert_kernel<float><<<(unsigned)tp->nnz, 256, 0, (cudaStream_t)stream>>>(
        *tp, (const float *)src, (float *)dst, to_dense);
  MOE_CUDA_CHECK_LAUNCH(ctx, to_dense ? "bsmm_to_dense" : "bsmm_from_dense");
  return MOE_OK;
}

} // namespace

extern "C" {

moe_status moe_cuda_bsmm_sdd(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *x, const void *w, int64_t K, bool trans_w, void *out) {
  BsArgs g = bs_args(ctx, tp, x, w, out, K);
  if (trans_w) return bs_launch<BS_SDD, true>(ctx, device, dt, g);
  return bs_launch<BS_SDD, false>(ctx, device, dt, g);
}

moe_status moe_cuda_bsmm_dsd(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *s, const void *w, int64_t K, bool trans_w, void *out) {
  BsArgs g = bs_args(ctx, tp, s, w, out, K);
  if (trans_w) return bs_launch<BS_DSD, true>(ctx, device, dt, g);
  return bs_launch<BS_DSD, false>(ctx, device, dt, g);
}

moe_status moe_cuda_bsmm_dsd_t(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                               const void *s, const void *y, int64_t K, void *out) {
  BsArgs g = bs_args(ctx, tp, s, y, out, K);
  return bs_launch<BS_DSD_T, false>(ctx, device, dt, g);
}

moe_status moe_cuda_bsmm_dds(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *x, const void *s, int64_t K, void *out) {
  BsArgs g = bs_args(ctx, tp, x, s, out, K);
  return bs_launch<BS_DDS, false>(ctx, device, dt, g);
}

moe_status moe_cuda_bsmm_dsd2(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                              const void *s, const void *w, const void *s2, const void *w2,
                              int64_t K, bool trans_w, void *out) {
  BsArgs g = bs_args(ctx, tp, s, w, out, K);
  g.a2 = s2, g.c2 = w2;
  if (trans_w) return bs_launch<BS_DSD, true>(ctx, device, dt, g);
  return bs_launch<BS_DSD, false>(ctx, device, dt, g);
}

moe_status moe_cuda_bsmm_sdd_glu(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                                 const void *x, const void *w1, const void *w3, int64_t K, int act,
                                 void *h1, void *h3, void *a) {
  if (act < 0 || act > 2) return moe_error(ctx, MOE_ERR_INVALID_ARG, "bsmm sdd_glu: activation %d", act);
  BsArgs g = bs_args(ctx, tp, x, w1, h1, K);
  g.c2 = w3, g.act = act, g.out2 = h3, g.out3 = a;
  return bs_launch<BS_SDD, false>(ctx, device, dt, g);
}

/* The row gather of the grouped kinds (NULL: none) into g's topology. */
moe_status bs_gg_gather(moe_ctx *ctx, BsArgs &g, const moe_wg_gather *gt) {
  if (!gt) return MOE_OK;
  if (!gt->src || gt->k < 1 || gt->k > INT32_MAX)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "grouped gemm gather: src %p, k %lld",
                     (const void *)gt->src, (long long)gt->k);
  g.tp.gather_src = gt->src, g.tp.gather_k = gt->k;
  g.gather_b = gt->b_rows;
  return MOE_OK;
}

/* MOE_OK where the grouped GEMM's sm_90a kernel runs these sizes and
 * pointers on device, else the error naming fn. */
static moe_status bs_gg_check(moe_ctx *ctx, int device, const char *fn, int64_t G, int64_t R,
                              int64_t K, int64_t N, const void *const *ptrs, int n) {
  if (bs_wg_supported(device) && bs_variant(ctx) == BS_VWG && bs_wg_grouped_ok(G, R, K, N, ptrs, n))
    return MOE_OK;
  return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                   "%s (sm_90a kernel): needs compute capability 9.x, K and N multiples of 8 (got "
                   "%lld, %lld), 16-byte aligned tensors and fewer than %d groups",
                   fn, (long long)K, (long long)N, BS_GG_MAX_SEG - 2);
}

/* GG's segment table of the G + 1 offsets into tab, on stream cs. */
static moe_status bs_gg_table(moe_ctx *ctx, cudaStream_t cs, const int64_t *offs, int64_t G, int64_t R,
                              MoeScratch &tab) {
  MOE_CHECK(tab.alloc(bs_gg_table_bytes(G, R)));
  bs_gg_table_kernel<<<1, BS_GG_TT, 0, cs>>>(offs, G, R, (int64_t *)tab.ptr);
  MOE_CUDA_CHECK_LAUNCH(ctx, "grouped gemm segment table");
  return MOE_OK;
}

moe_status moe_cuda_wg_grouped_mm(moe_ctx *ctx, int device, const void *x, const void *w,
                                  const int64_t *offs, int64_t G, int64_t R, int64_t K, int64_t N,
                                  bool trans_w, void *out) {
  return moe_cuda_wg_grouped_mm_gather(ctx, device, x, w, NULL, NULL, offs, NULL, NULL, G, R, K, N, trans_w, out);
}

moe_status moe_cuda_wg_grouped_mm2(moe_ctx *ctx, int device, const void *x, const void *w,
                                   const void *x2, const void *w2, const int64_t *offs, int64_t G,
                                   int64_t R, int64_t K, int64_t N, bool trans_w, void *out) {
  return moe_cuda_wg_grouped_mm_gather(ctx, device, x, w, x2, w2, offs, NULL, NULL, G, R, K, N, trans_w, out);
}

moe_status moe_cuda_wg_grouped_mm_gather(moe_ctx *ctx, int device, const void *x, const void *w,
                                         const void *x2, const void *w2, const int64_t *offs,
                                         const moe_wg_gather *gt, const moe_wg_scatter *sc, int64_t G,
                                         int64_t R, int64_t K, int64_t N, bool trans_w, void *out) {
  const void *ptrs[5] = {x, w, out, x2 ? x2 : x, w2 ? w2 : w};
  MOE_CHECK(bs_gg_check(ctx, device, "grouped gemm", G, R, K, N, ptrs, 5));
  if (gt && x2)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "grouped gemm: a gather with a summed second pair");
  if (R == 0 || N == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t cs = (cudaStream_t)stream;
  MoeScratch tab(ctx, device);
  MOE_CHECK(bs_gg_table(ctx, cs, offs, G, R, tab));
  moe_bs_topo tp;
  memset(&tp, 0, sizeof tp);
  BsArgs g = bs_args(ctx, &tp, x, w, out, K);
  g.gtab = (const int64_t *)tab.ptr, g.G = G, g.R = R, g.N = N;
  g.a2 = x2, g.c2 = x2 ? w2 : nullptr;
  MOE_CHECK(bs_gg_gather(ctx, g, gt));
  if (sc) g.tp.scatter_dst = sc->dst, g.tp.scatter_scale = sc->scale;
  /* at most R / 128 + G + 2 row tiles; the kernel reads the count */
  int64_t ctas = (R / BS_B + G + 2) * ((N + BS_WG_BN - 1) / BS_WG_BN);
  if (trans_w) return bs_launch_wg<BS_GG, true>(ctx, g, cs, ctas);
  return bs_launch_wg<BS_GG, false>(ctx, g, cs, ctas);
}

/* Row r's gate gradient from its column tiles' partials, in order. */
__global__ void bs_gg_rowsum_kernel(const float *part, int64_t R, int64_t NT, float *out) {
  for (int64_t r = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; r < R;
       r += (int64_t)gridDim.x * blockDim.x) {
    float s = 0.0f;
    for (int64_t t = 0; t < NT; t++) s += part[r * NT + t];
    out[r] = s;
  }
}

/* The grouped GEMM with a fused GLU epilogue (fuse, the arguments as
 * BsArgs says): the segment table, the launch, and for the backward's gate
 * gradient the partials' sum. */
static moe_status bs_gg_fused(moe_ctx *ctx, int device, BsArgs &g, const int64_t *offs,
                              const void *const *ptrs, int n, float *dgate_rows) {
  const char *fn = g.fuse == BS_FUSE_GLU ? "grouped gemm glu" : "grouped gemm glu backward";
  MOE_CHECK(bs_gg_check(ctx, device, fn, g.G, g.R, g.K, g.N, ptrs, n));
  if (g.act < 0 || g.act > 2) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: activation %d", fn, g.act);
  if (g.R == 0 || g.N == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  cudaStream_t cs = (cudaStream_t)stream;
  MoeScratch tab(ctx, device), part(ctx, device);
  MOE_CHECK(bs_gg_table(ctx, cs, offs, g.G, g.R, tab));
  g.gtab = (const int64_t *)tab.ptr;
  const int bw = bs_gg_width(g, BS_WG_BN);
  const int64_t NT = (g.N + bw - 1) / bw;
  if (dgate_rows) {
    MOE_CHECK(part.alloc(sizeof(float) * (size_t)(g.R * NT)));
    g.gpart = (float *)part.ptr;
  }
  int64_t ctas = (g.R / BS_B + g.G + 2) * NT;
  if (g.fuse == BS_FUSE_GLU_BWD) MOE_CHECK((bs_launch_wg<BS_GG, true>(ctx, g, cs, ctas)));
  else MOE_CHECK((bs_launch_wg<BS_GG, false>(ctx, g, cs, ctas)));
  if (dgate_rows) {
    bs_gg_rowsum_kernel<<<(unsigned)((g.R + 255) / 256 < 65535 ? (g.R + 255) / 256 : 65535), 256, 0, cs>>>(
        g.gpart, g.R, NT, dgate_rows);
    MOE_CUDA_CHECK_LAUNCH(ctx, "grouped gemm glu backward gate sums");
  }
  return MOE_OK;
}

moe_status moe_cuda_wg_grouped_glu(moe_ctx *ctx, int device, const void *x, const void *w1,
                                   const void *w3, const int64_t *offs, int64_t G, int64_t R,
                                   int64_t K, int64_t N, int act, void *h1, void *h3, void *a) {
  moe_bs_topo tp;
  memset(&tp, 0, sizeof tp);
  BsArgs g = bs_args(ctx, &tp, x, w1, h1, K);
  g.c2 = w3, g.out2 = h3, g.out3 = a, g.act = act, g.fuse = BS_FUSE_GLU;
  g.G = G, g.R = R, g.N = N;
  const void *ptrs[6] = {x, w1, w3, h1, h3, a};
  return bs_gg_fused(ctx, device, g, offs, ptrs, 6, NULL);
}

moe_status moe_cuda_wg_grouped_glu_bwd(moe_ctx *ctx, int device, const void *dy, const void *w2,
                                       const int64_t *offs, int64_t G, int64_t R, int64_t K,
                                       int64_t N, int act, const void *h1, const void *h3,
                                       const float *g_rows, void *dh1, void *dh3, void *ga,
                                       float *dgate_rows) {
  moe_bs_topo tp;
  memset(&tp, 0, sizeof tp);
  BsArgs g = bs_args(ctx, &tp, dy, w2, dh1, K);
  g.eh1 = h1, g.eh3 = h3, g.grow = g_rows, g.out2 = dh3, g.out3 = ga, g.act = act;
  g.fuse = BS_FUSE_GLU_BWD, g.G = G, g.R = R, g.N = N;
  const void *ptrs[7] = {dy, w2, h1, h3, dh1, dh3, ga ? ga : dh1};
  return bs_gg_fused(ctx, device, g, offs, ptrs, 7, dgate_rows);
}

moe_status moe_cuda_wg_grouped_wgrad(moe_ctx *ctx, int device, const void *a, const void *b,
                                     const int64_t *offs, int64_t G, int64_t R, int64_t K,
                                     int64_t N, void *out) {
  return moe_cuda_wg_grouped_wgrad_gather(ctx, device, a, b, offs, NULL, G, R, K, N, out);
}

moe_status moe_cuda_wg_grouped_wgrad_gather(moe_ctx *ctx, int device, const void *a, const void *b,
                                            const int64_t *offs, const moe_wg_gather *gt, int64_t G,
                                            int64_t R, int64_t K, int64_t N, void *out) {
  const void *ptrs[3] = {a, b, out};
  if (!bs_wg_supported(device) || bs_variant(ctx) != BS_VWG || !bs_wg_grouped_ok(G, R, K, N, ptrs, 3))
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED,
                     "grouped gemm wgrad (sm_90a kernel): needs compute capability 9.x, K and N "
                     "multiples of 8 (got %lld, %lld) and 16-byte aligned tensors",
                     (long long)K, (long long)N);
  if (K == 0 || N == 0) return MOE_OK;
  void *stream;
  MOE_CHECK(moe_cuda_stream(ctx, device, &stream));
  moe_bs_topo tp;
  memset(&tp, 0, sizeof tp);
  BsArgs g = bs_args(ctx, &tp, a, b, out, K);
  g.goffs = offs, g.G = G, g.R = R, g.N = N;
  MOE_CHECK(bs_gg_gather(ctx, g, gt));
  int64_t ctas = G * ((K + BS_B - 1) / BS_B) * ((N + BS_WG_BN - 1) / BS_WG_BN);
  return bs_launch_wg<BS_GW, false>(ctx, g, (cudaStream_t)stream, ctas);
}

bool moe_cuda_wg_grouped(moe_ctx *ctx, int device) {
  return bs_variant(ctx) == BS_VWG && bs_wg_supported(device);
}

bool moe_cuda_bsmm_wgmma(moe_ctx *ctx, int device, moe_dtype dt) {
  return dt == MOE_BF16 && bs_variant(ctx) == BS_VWG && bs_wg_supported(device);
}

moe_status moe_cuda_bsmm_to_dense(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                                  const void *s, void *dense) {
  return bs_convert(ctx, device, dt, tp, s, dense, true);
}

moe_status moe_cuda_bsmm_from_dense(moe_ctx *ctx, int device, moe_dtype dt,
                                    const moe_bs_topo *tp, const void *dense, void *s) {
  return bs_convert(ctx, device, dt, tp, dense, s, false);
}

} /* extern "C" */
