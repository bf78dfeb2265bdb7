/*
 * attention_sm90.cu - the Hopper kernels of the fused attention ("tma", the
 * default on compute capability 9.x: H100, H200; sm_90a): warp-specialised,
 * TMA loads into an mbarrier-guarded ring, warpgroup MMAs (wgmma), on a
 * persistent grid; described below. kernels/attention.cu validates and
 * dispatches; the mma.sync kernels (attention_mma.cu) stand in where these
 * cannot run.
 */
#include <cuda_bf16.h>

#include "attention.cuh"
#include "mma.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace {

/* ------------------------- Hopper: warp-specialised TMA + wgmma kernels */

/* The default on compute capability 9.x (MOE_ATTN_WG=0 selects the
 * mma.sync kernels above). Three warpgroups per block (384 threads):
 * warpgroup 0 is the producer (one thread issues the TMA loads of the
 * tiles: 4-D boxes of 64 columns x R rows of the (B, H, T, D) operands,
 * any strides, rows past T zero-filled), warpgroups 1 and 2 consume them
 * through "full" / "empty" mbarriers, each owning 64 rows of the block's
 * tile, so neither waits for the other except where a product needs both.
 * Products are warpgroup MMAs (kernels/wgmma.cuh) reading operands from
 * shared memory in the layout of wgmma's 128-byte swizzle, which TMA
 * writes:
 *   a tile of R rows x D columns is D / 64 panels of R rows x 128 bytes,
 *   row r of a panel at r * 128, its 16-byte chunk c at chunk c ^ (r % 8).
 * The same bytes serve as a K-major operand (rows = m or n, columns = k:
 * Q, K, V, dO in S = Q K^T and its kin) and as an M/N-major one (rows = k:
 * V in O += P V, dO and Q in dV += P^T dO and dK += dS^T Q, K in dQ += dS
 * K) through wgmma's transpose bits.
 *
 * Forward: 128 queries per block, key blocks of 128: S = Q K^T (SS), the
 * online softmax in registers, O += P V with P from registers (RS: the f32
 * accumulator fragment is the A fragment once packed to bf16).
 *
 * Backward: 128 keys per block (dK, dV in registers), query blocks of 64:
 * S^T = K Q^T and dP^T = V dO^T (SS), P^T and dS^T in registers, dV +=
 * P^T dO and dK += dS^T Q (RS); dS^T goes to shared memory for dQ += dS K
 * (SS, both operands transposed), whose 64 x D partial each block adds
 * into an f32 buffer with bulk reductions (5 tile products per key/query
 * pair, as FlashAttention-2/3; the order of the additions varies, so dQ is
 * not bit-reproducible: MOE_ATTN_DETERMINISTIC=1 selects the deterministic
 * mma.sync backward). A last kernel scales the buffer into dQ (bf16). */

#ifdef MOE_WG_DEVICE
/* K-major operand: rows r0.. of an R-row tile, k columns 16 ks.. */
template <int R> __device__ __forceinline__ uint64_t wg_dk(uint32_t s, int r0, int ks) {
  return moe_wg_desc(s + (ks >> 2) * R * 128 + r0 * 128 + (ks & 3) * 32, 16, 1024);
}
/* M/N-major operand: k rows 16 ks.. of an R-row tile, m/n from panel pn
 * (64 columns each; an N of 128 spans two, LBO apart). */
template <int R> __device__ __forceinline__ uint64_t wg_dmn(uint32_t s, int pn, int ks) {
  return moe_wg_desc(s + pn * R * 128 + ks * 2048, R * 128, 1024);
}
/* The bf16 A fragments of a 64 x N f32 accumulator (k16 slice kk). */
template <int N>
__device__ __forceinline__ void wg_c2a(uint32_t (&a)[N / 16][4], const float (&c)[N / 2]) {
#pragma unroll
  for (int kk = 0; kk < N / 16; kk++) {
    a[kk][0] = attn_pack(c[8 * kk + 0], c[8 * kk + 1]);
    a[kk][1] = attn_pack(c[8 * kk + 2], c[8 * kk + 3]);
    a[kk][2] = attn_pack(c[8 * kk + 4], c[8 * kk + 5]);
    a[kk][3] = attn_pack(c[8 * kk + 6], c[8 * kk + 7]);
  }
}
#endif

#ifdef MOE_WG_DEVICE
/* The online softmax of one 64 x BN score tile of a warpgroup (rows
 * rbase, rbase + 8 of this thread) for key block n0: masks, updates the
 * running max m and sum l, leaves P (f32) in s and returns the factor
 * alpha by which O must be rescaled before P V is added. The caller packs
 * P into bf16 A fragments once the previous P V product (which reads the
 * old fragments) is done. */
template <int BN, bool MASK>
__device__ __forceinline__ void wg_softmax_t(const AttnParams &p, float (&s)[BN / 2], float (&m)[2],
                                             float (&l)[2], float (&alpha)[2], int rbase, int n0,
                                             int t4) {
  /* four partial maxima and sums per row: short dependency chains */
#pragma unroll
  for (int r = 0; r < 2; r++) {
    const int row = rbase + 8 * r;
    float mp[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
#pragma unroll
      for (int c = 0; c < 2; c++) {
        float x = s[4 * n + 2 * r + c] * p.scale_log2;
        if (MASK) { /* a select, no branch */
          const int col = n0 + n * 8 + 2 * t4 + c;
          x = (col >= p.T || (p.causal && col > row)) ? -INFINITY : x;
        }
        s[4 * n + 2 * r + c] = x;
        mp[(n & 1) * 2 + c] = fmaxf(mp[(n & 1) * 2 + c], x);
      }
    }
    float mx = fmaxf(fmaxf(mp[0], mp[1]), fmaxf(mp[2], mp[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, 2));
    const float mnew = fmaxf(m[r], mx);
    const float muse = mnew == -INFINITY ? 0.f : mnew;
    alpha[r] = attn_exp2(m[r] - muse);
    m[r] = mnew;
    float sp[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int n = 0; n < BN / 8; n++) {
#pragma unroll
      for (int c = 0; c < 2; c++) {
        const float e = attn_exp2(s[4 * n + 2 * r + c] - muse);
        s[4 * n + 2 * r + c] = e;
        sp[(n & 1) * 2 + c] += e;
      }
    }
    l[r] = l[r] * alpha[r] + ((sp[0] + sp[1]) + (sp[2] + sp[3]));
  }
}
/* One branch per tile on whether it needs the mask (the diagonal and the
 * last key block), not one per element. */
template <int BN>
__device__ __forceinline__ void wg_softmax(const AttnParams &p, float (&s)[BN / 2], float (&m)[2],
                                           float (&l)[2], float (&alpha)[2], int rbase, int n0,
                                           bool need_mask, int t4) {
  if (need_mask) wg_softmax_t<BN, true>(p, s, m, l, alpha, rbase, n0, t4);
  else wg_softmax_t<BN, false>(p, s, m, l, alpha, rbase, n0, t4);
}
#endif

constexpr int WS_THREADS = 384;

template <int D> struct WsFwd {
  static constexpr int BM = 128, BN = 128, KB = BN * D * 2, S = 3;
  /* Q; K and V S stages each; mbarriers */
  static constexpr size_t SMEM = (size_t)BM * D * 2 + 2 * S * (size_t)KB + 1024 + 16 * 8;
};

/* The persistent kernels' tile order: round r of the grid's G blocks
 * takes tiles [r G, r G + G), block c the c-th of them in even rounds and
 * the (G - 1 - c)-th in odd ones, so that over the tiles (sorted heaviest
 * first) every block gets about the same work. */
#ifdef MOE_WG_DEVICE
__device__ __forceinline__ int attn_tile(int r, int c, int G) {
  return r * G + ((r & 1) ? G - 1 - c : c);
}
/* Tile t's head bh and block rank y (0: the heaviest block of its head).
 * Head-major (p.head_major, the default): t = bh nblk + y, a head's blocks
 * together, so the blocks running at once share their head's K and V (Q
 * and dO, dQ's sums, backward) in L2. Block-major (MOE_ATTN_ORDER=block):
 * t = y BH + bh, every head's heaviest block first; at B*H = 128 heads the
 * blocks running at once then share nothing and f+b at T=1024 took 0.665
 * ms against head-major's 0.513 (H100, 2026-11-25). */
__device__ __forceinline__ void attn_tile_decode(const AttnParams &p, int t, int BH, int nblk,
                                                 int *bh, int *y) {
  if (p.head_major) {
    *bh = t / nblk;
    *y = t - *bh * nblk;
  } else {
    *y = t / BH;
    *bh = t - *y * BH;
  }
}
struct AttnTile {
  int bh, b, h, y; /* head (batch b, head h) and block rank */
};
/* This block's tile of round rt (of BH heads x nblk blocks); false past the last. */
__device__ __forceinline__ bool attn_round_tile(const AttnParams &p, int rt, int BH, int nblk,
                                                AttnTile *w) {
  const int t = attn_tile(rt, blockIdx.x, gridDim.x);
  if (t >= nblk * BH) return false;
  attn_tile_decode(p, t, BH, nblk, &w->bh, &w->y);
  w->b = w->bh / p.H;
  w->h = w->bh - w->b * p.H;
  return true;
}
/* Key blocks a forward tile of queries [m0, m0 + BM) visits. */
template <int BM, int BN>
__device__ __forceinline__ int ws_fwd_nkv(const AttnParams &p, int m0) {
  const int n = (p.T + BN - 1) / BN;
  return p.causal ? min(n, (m0 + BM + BN - 1) / BN) : n;
}
#endif

/* Forward, persistent: tiles of 128 queries, tile t of head bh and rank y
 * (attn_tile_decode) being query block nblk - 1 - y (heavier, i.e. later,
 * blocks first under the causal mask).
 * Software-pipelined within each warpgroup: step j issues S_j = Q K_j^T and
 * O += P_{j-1} V_{j-1} together, so the softmax of S_j runs while the
 * tensor cores do the P V product; O is rescaled by alpha_j once that
 * product is done. The producer keeps WsFwd::S key and value blocks in
 * flight across tiles and loads the next tile's Q once the consumers'
 * last S product of the current one is done (qempty), so the next tile's
 * loads overlap this one's last P V product and its output. */
template <int D>
__global__ void __launch_bounds__(WS_THREADS, 1)
    attn_ws_fwd_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                       const __grid_constant__ CUtensorMap mv, AttnParams p, int BH) {
#ifdef MOE_WG_DEVICE
  constexpr int BM = WsFwd<D>::BM, BN = WsFwd<D>::BN, KB = WsFwd<D>::KB, S = WsFwd<D>::S;
  extern __shared__ __align__(128) uint8_t attn_wsmem[];
  const uint32_t sQ = (moe_smem_u32(attn_wsmem) + 1023u) & ~1023u;
  const uint32_t sK = sQ + BM * D * 2, sV = sK + S * KB, bars = sV + S * KB;
  /* bars: qfull, kfull[S], vfull[S], kempty[S], vempty[S], qempty */
  const uint32_t qfull = bars, kfull = bars + 8, vfull = kfull + 8 * S, kempty = vfull + 8 * S,
                 vempty = kempty + 8 * S, qempty = vempty + 8 * S;
  /* wg from lane 0: warp-uniform to the compiler (descriptors in uniform registers) */
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int T = p.T, nblk = (T + BM - 1) / BM;
  if (tid == 0) {
    moe_mbar_init(qfull, 1);
    moe_mbar_init(qempty, 256);
    for (int i = 0; i < S; i++) {
      moe_mbar_init(kfull + 8 * i, 1);
      moe_mbar_init(vfull + 8 * i, 1);
      moe_mbar_init(kempty + 8 * i, 256);
      moe_mbar_init(vempty + 8 * i, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) { /* producer */
    asm volatile("setmaxnreg.dec.sync.aligned.u32 24;\n");
    if (tid == 0) {
      int kv = 0; /* key/value blocks loaded so far (the stage ring runs on across tiles) */
      AttnTile w;
      for (int rt = 0; attn_round_tile(p, rt, BH, nblk, &w); rt++) {
        const int b = w.b, h = w.h, m0 = (nblk - 1 - w.y) * BM, nkv = ws_fwd_nkv<BM, BN>(p, m0);
        if (rt > 0) moe_mbar_wait(qempty, (uint32_t)((rt - 1) & 1));
        moe_mbar_expect(qfull, BM * D * 2);
#pragma unroll
        for (int pn = 0; pn < D / 64; pn++) moe_tma4(sQ + pn * BM * 128, &mq, pn * 64, m0, h, b, qfull);
        for (int j = 0; j < nkv; j++, kv++) {
          const int st = kv % S;
          const uint32_t ph = (uint32_t)((kv / S - 1) & 1);
          if (kv >= S) moe_mbar_wait(kempty + 8 * st, ph);
          moe_mbar_expect(kfull + 8 * st, KB);
#pragma unroll
          for (int pn = 0; pn < D / 64; pn++)
            moe_tma4(sK + st * KB + pn * BN * 128, &mk, pn * 64, j * BN, h, b, kfull + 8 * st);
          if (kv >= S) moe_mbar_wait(vempty + 8 * st, ph);
          moe_mbar_expect(vfull + 8 * st, KB);
#pragma unroll
          for (int pn = 0; pn < D / 64; pn++)
            moe_tma4(sV + st * KB + pn * BN * 128, &mv, pn * 64, j * BN, h, b, vfull + 8 * st);
        }
      }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 240;\n");
  const int cw = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31, g = lane >> 2, t4 = lane & 3;
  int kv = 0; /* key/value blocks consumed before this tile */
  AttnTile w;
  for (int rt = 0; attn_round_tile(p, rt, BH, nblk, &w); rt++) {
  const int bh = w.bh, b = w.b, h = w.h, m0 = (nblk - 1 - w.y) * BM, nkv = ws_fwd_nkv<BM, BN>(p, m0);
  const int rbase = m0 + cw * 64 + warp * 16 + g; /* this thread's rows: rbase, rbase + 8 */
  const int wrow0 = m0 + cw * 64;

  float o[D / 2], s[BN / 2];
#pragma unroll
  for (int e = 0; e < D / 2; e++) o[e] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f}, alpha[2];
  uint32_t pa[BN / 16][4];

  /* step 0: S_0, P_0 */
  moe_mbar_wait(qfull, (uint32_t)(rt & 1));
  moe_mbar_wait(kfull + 8 * (kv % S), (uint32_t)((kv / S) & 1));
#pragma unroll
  for (int e = 0; e < BN / 2; e++) s[e] = 0.f;
  moe_wg_pin(s);
  moe_wg_fence();
#pragma unroll
  for (int ks = 0; ks < D / 16; ks++)
    moe_wg_ss<BN, 0, 0>(s, wg_dk<BM>(sQ, cw * 64, ks), wg_dk<BN>(sK + (kv % S) * KB, 0, ks));
  moe_wg_commit();
  moe_wg_wait<0>();
  moe_wg_pin(s);
  moe_mbar_arrive(kempty + 8 * (kv % S));
  if (nkv == 1) moe_mbar_arrive(qempty); /* Q read for the last time */
  wg_softmax<BN>(p, s, m, l, alpha, rbase, 0, BN > T || (p.causal && BN - 1 > wrow0), t4);
  wg_c2a<BN>(pa, s);

  /* Ping-pong (p.pingpong): the consumers issue their products in turn
   * (named barriers 1 and 2: consumer c waits at 1 + c for the other's
   * arrival), so one's softmax runs while the other's products do.
   * Consumer 1 opens the first turn to consumer 0. */
  const bool pp = p.pingpong && nkv > 1;
  if (pp && cw == 1) asm volatile("bar.arrive 1, 256;\n" ::: "memory");
  for (int j = 1; j < nkv; j++) {
    const int sk = (kv + j) % S, sv = (kv + j - 1) % S;
    moe_mbar_wait(kfull + 8 * sk, (uint32_t)(((kv + j) / S) & 1));
    moe_mbar_wait(vfull + 8 * sv, (uint32_t)(((kv + j - 1) / S) & 1));
#pragma unroll
    for (int e = 0; e < BN / 2; e++) s[e] = 0.f;
    moe_wg_pin(s);
    moe_wg_pin(o);
    moe_wg_pin(pa);
    if (pp) asm volatile("bar.sync %0, 256;\n" ::"r"(1 + cw) : "memory");
    moe_wg_fence();
#pragma unroll
    for (int ks = 0; ks < D / 16; ks++)
      moe_wg_ss<BN, 0, 0>(s, wg_dk<BM>(sQ, cw * 64, ks), wg_dk<BN>(sK + sk * KB, 0, ks));
    moe_wg_commit();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) moe_wg_rs<D, 1>(o, pa[kk], wg_dmn<BN>(sV + sv * KB, 0, kk));
    moe_wg_commit();
    /* the other's turn (nkv - 1 turns each: consumer 1's last arrival
     * would have no taker, so it is left out) */
    if (pp && !(cw == 1 && j == nkv - 1)) asm volatile("bar.arrive %0, 256;\n" ::"r"(2 - cw) : "memory");
    moe_wg_wait<1>(); /* S_j */
    moe_wg_pin(s);
    moe_mbar_arrive(kempty + 8 * sk);
    if (j == nkv - 1) moe_mbar_arrive(qempty); /* Q read for the last time */
    const int n0 = j * BN;
    wg_softmax<BN>(p, s, m, l, alpha, rbase, n0,
                   n0 + BN > T || (p.causal && n0 + BN - 1 > wrow0), t4);
    moe_wg_wait<0>(); /* O += P_{j-1} V_{j-1} */
    moe_wg_pin(o);
    moe_wg_pin(pa);
    moe_mbar_arrive(vempty + 8 * sv);
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      o[4 * n] *= alpha[0];
      o[4 * n + 1] *= alpha[0];
      o[4 * n + 2] *= alpha[1];
      o[4 * n + 3] *= alpha[1];
    }
    wg_c2a<BN>(pa, s);
  }
  /* O += P_last V_last */
  {
    const int sv = (kv + nkv - 1) % S;
    moe_mbar_wait(vfull + 8 * sv, (uint32_t)(((kv + nkv - 1) / S) & 1));
    moe_wg_pin(o);
    moe_wg_pin(pa);
    moe_wg_fence();
#pragma unroll
    for (int kk = 0; kk < BN / 16; kk++) moe_wg_rs<D, 1>(o, pa[kk], wg_dmn<BN>(sV + sv * KB, 0, kk));
    moe_wg_commit();
    moe_wg_wait<0>();
    moe_wg_pin(o);
    moe_wg_pin(pa);
    moe_mbar_arrive(vempty + 8 * sv);
  }

  /* O = acc / l, lse = (m + log2 l) ln 2 */
  uint16_t *og = p.out + b * p.o_sb + h * p.o_sh;
  float *lg = p.lse + (int64_t)bh * T;
#pragma unroll
  for (int r = 0; r < 2; r++) {
    float ls = l[r];
    ls += __shfl_xor_sync(0xffffffffu, ls, 1);
    ls += __shfl_xor_sync(0xffffffffu, ls, 2);
    const int row = rbase + 8 * r;
    const float inv = ls > 0 ? 1.f / ls : 0.f;
    if (row < T) {
      uint16_t *orow = og + (int64_t)row * p.o_st;
#pragma unroll
      for (int n = 0; n < D / 8; n++)
        *reinterpret_cast<uint32_t *>(orow + n * 8 + 2 * t4) =
            attn_pack(o[4 * n + 2 * r] * inv, o[4 * n + 2 * r + 1] * inv);
      if (t4 == 0) lg[row] = ls > 0 ? (m[r] + log2f(ls)) * kLn2 : -INFINITY;
    }
  }
  kv += nkv;
  }
#else
  (void)mq, (void)mk, (void)mv, (void)p, (void)BH;
#endif
}

template <int D> struct WsBwd {
  static constexpr int BN = 128, BQ = 64, QB = BQ * D * 2;
  /* dQ partials staged for the bulk reductions, one plane per warpgroup:
   * D 128 its 64 columns of all 128 keys, D 64 all columns of its 64 keys;
   * rows padded by 16 bytes against bank conflicts */
  static constexpr int SC = 64, PITCH = SC * 4 + 16;
  /* K, V; Q, dO two stages; dS^T two buffers; dQ staging (2 planes);
   * lse, delta two stages; mbarriers */
  static constexpr size_t SMEM = (size_t)2 * BN * D * 2 + 4 * (size_t)QB + 2 * (size_t)BN * BQ * 2 +
                                 2 * (size_t)BQ * PITCH + 4 * BQ * 4 + 1024 + 8 * 8;
};

/* Tried on an H100 (2026-11-25, A/B in one call, f+b ms) and left out:
 * - dQ partials straight to dq_acc by red.global.add.v2.f32 (atomicAdd of
 *   float2) instead of staging + bulk reductions: slower, 1.27 vs 1.22 at
 *   (2,16,4096,128), 0.544 vs 0.478 at (4,16,2048,64);
 * - that plus a third Q/dO stage in the freed staging memory: no better;
 * - dK issued after dQ so that dQ's staging overlaps it (the empty
 *   barrier then waits for dK): within noise at D 128, slower at D 64. */

/* dK, dV of keys [n0, n0 + 128) (n0 = 128 blockIdx.y: under the causal
 * mask, block 0 sees the most queries), and this block's share of dQ /
 * scale added into dq_acc (B*H, T, D) f32 by bulk reductions
 * (cp.reduce.async.bulk .add.f32) of staged rows. The producer's warp
 * loads Q, dO (TMA) and lse, delta (plain loads) of each query block; the
 * consumers compute as attn_wg_bwd_kernel, synchronising with each other
 * only where dQ = dS K needs both halves of dS^T (D 128). */
template <int D>
__global__ void __launch_bounds__(WS_THREADS, 1)
    attn_ws_bwd_kernel(const __grid_constant__ CUtensorMap mq, const __grid_constant__ CUtensorMap mk,
                       const __grid_constant__ CUtensorMap mv, const __grid_constant__ CUtensorMap mo,
                       AttnParams p, float *dq_acc, int BH) {
#ifdef MOE_WG_DEVICE
  constexpr int BN = WsBwd<D>::BN, BQ = WsBwd<D>::BQ, QB = WsBwd<D>::QB, PITCH = WsBwd<D>::PITCH;
  extern __shared__ __align__(128) uint8_t attn_wsmem[];
  const uint32_t raw = moe_smem_u32(attn_wsmem);
  const uint32_t sK = (raw + 1023u) & ~1023u;
  const uint32_t sV = sK + BN * D * 2, sQ = sV + BN * D * 2, sO = sQ + 2 * QB;
  const uint32_t sS = sO + 2 * QB;         /* dS^T: 2 x (BN key rows x BQ queries) */
  const uint32_t sDQ = sS + 2 * BN * BQ * 2; /* 2 planes x BQ rows x PITCH bytes, f32 */
  const uint32_t sLD = sDQ + 2 * BQ * PITCH; /* lse*log2e [2][BQ], delta [2][BQ] */
  const uint32_t bars = sLD + 4 * BQ * 4;
  /* bars: kvfull, full[2], empty[2], kvempty */
  const uint32_t kvfull = bars, full = bars + 8, empty = bars + 24, kvempty = bars + 40;
  float *sL = reinterpret_cast<float *>(attn_wsmem + (sLD - raw)), *sD = sL + 2 * BQ;
  /* wg from lane 0: warp-uniform to the compiler (descriptors in uniform registers) */
  const int tid = threadIdx.x, wg = __shfl_sync(0xffffffffu, tid >> 7, 0);
  const int T = p.T, nq = (T + BQ - 1) / BQ, nkb = (T + BN - 1) / BN;
  if (tid == 0) {
    moe_mbar_init(kvfull, 1);
    moe_mbar_init(kvempty, 256);
    for (int i = 0; i < 2; i++) {
      moe_mbar_init(full + 8 * i, 33); /* lane 0's expect-tx arrival + 32 lanes' lse/delta */
      moe_mbar_init(empty + 8 * i, 256);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  __syncthreads();

  if (wg == 0) { /* producer: warp 0 */
    /* 40 registers: with 24 this warp spilled (52 bytes at D 128) and the
     * backward ran 4-6% slower (H100, 2026-11-25) */
    asm volatile("setmaxnreg.dec.sync.aligned.u32 40;\n");
    if (tid >= 32) return;
    int u = 0; /* query blocks loaded so far (the stages run on across tiles) */
    AttnTile w;
    for (int rt = 0; attn_round_tile(p, rt, BH, nkb, &w); rt++) {
    const int b = w.b, h = w.h, n0 = w.y * BN, i0 = p.causal ? n0 / BQ : 0;
    const int64_t lo = (int64_t)w.bh * T; /* lse and delta rows of this head */
    if (tid == 0) {
      if (rt > 0) moe_mbar_wait(kvempty, (uint32_t)((rt - 1) & 1));
      moe_mbar_expect(kvfull, 2 * BN * D * 2);
#pragma unroll
      for (int pn = 0; pn < D / 64; pn++) {
        moe_tma4(sK + pn * BN * 128, &mk, pn * 64, n0, h, b, kvfull);
        moe_tma4(sV + pn * BN * 128, &mv, pn * 64, n0, h, b, kvfull);
      }
    }
    for (int i = i0; i < nq; i++, u++) {
      const int st = u & 1;
      /* this lane's lse and delta rows, loaded while the stage drains */
      float lr[BQ / 32], dr[BQ / 32];
#pragma unroll
      for (int x = 0; x < BQ / 32; x++) {
        const int row = i * BQ + tid + 32 * x;
        lr[x] = row < T ? p.lse[lo + row] * kLog2e : INFINITY; /* P = 0 past T */
        dr[x] = row < T ? p.delta[lo + row] : 0.f;
      }
      if (u >= 2) moe_mbar_wait(empty + 8 * st, (uint32_t)((u / 2 - 1) & 1));
      if (tid == 0) {
        moe_mbar_expect(full + 8 * st, 2 * QB);
#pragma unroll
        for (int pn = 0; pn < D / 64; pn++) {
          moe_tma4(sQ + st * QB + pn * BQ * 128, &mq, pn * 64, i * BQ, h, b, full + 8 * st);
          moe_tma4(sO + st * QB + pn * BQ * 128, &mo, pn * 64, i * BQ, h, b, full + 8 * st);
        }
      }
#pragma unroll
      for (int x = 0; x < BQ / 32; x++) {
        sL[st * BQ + tid + 32 * x] = lr[x];
        sL[2 * BQ + st * BQ + tid + 32 * x] = dr[x]; /* sD */
      }
      moe_mbar_arrive(full + 8 * st);
    }
    }
    return;
  }
  asm volatile("setmaxnreg.inc.sync.aligned.u32 232;\n"); /* 128 x 40 + 256 x 232 = 384 x 168 */
  const int cw = wg - 1, ct = tid - 128, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t4 = lane & 3;
  const int keyl = cw * 64 + warp * 16 + g; /* this thread's key rows: keyl, keyl + 8 (local) */
  /* the even threads of the warpgroup (16 per warp: the warps stay even)
   * each issue the reduction of staged row rr */
  const bool reducer = (ct & 1) == 0;
  const int rr = (ct & 127) >> 1;
  const uint32_t plane = sDQ + cw * BQ * PITCH;
  int u = 0; /* query blocks consumed before this tile */
  AttnTile w;
  for (int rt = 0; attn_round_tile(p, rt, BH, nkb, &w); rt++) {
  const int b = w.b, h = w.h, n0 = w.y * BN, i0 = p.causal ? n0 / BQ : 0;
  float *accg = dq_acc + (int64_t)w.bh * T * D;
  float dk[D / 2], dv[D / 2];
#pragma unroll
  for (int e = 0; e < D / 2; e++) dk[e] = dv[e] = 0.f;
  moe_mbar_wait(kvfull, (uint32_t)(rt & 1));

  for (int i = i0; i < nq; i++, u++) {
    const int st = u & 1;
    moe_mbar_wait(full + 8 * st, (uint32_t)((u / 2) & 1));
    const uint32_t qb = sQ + st * QB, ob = sO + st * QB, sb = sS + st * BN * BQ * 2;
    const float *L = sL + st * BQ, *Dl = sD + st * BQ;

    const int q0 = i * BQ;
    const bool need_mask = p.causal && q0 < n0 + BN;
    /* under the causal mask, every query of the block before every key of
     * this warpgroup: P = dS = 0, only dS^T's zeros are needed (for dQ) */
    const bool dead = p.causal && q0 + BQ - 1 < n0 + cw * 64;
    if (!dead) {
      /* S^T = K Q^T, dP^T = V dO^T (64 keys x BQ queries per warpgroup) */
      float stt[BQ / 2], dpt[BQ / 2];
#pragma unroll
      for (int e = 0; e < BQ / 2; e++) stt[e] = dpt[e] = 0.f;
      moe_wg_pin(stt);
      moe_wg_pin(dpt);
      moe_wg_fence();
#pragma unroll
      for (int ks = 0; ks < D / 16; ks++)
        moe_wg_ss<BQ, 0, 0>(stt, wg_dk<BN>(sK, cw * 64, ks), wg_dk<BQ>(qb, 0, ks));
      moe_wg_commit();
#pragma unroll
      for (int ks = 0; ks < D / 16; ks++)
        moe_wg_ss<BQ, 0, 0>(dpt, wg_dk<BN>(sV, cw * 64, ks), wg_dk<BQ>(ob, 0, ks));
      moe_wg_commit();
      /* this thread's lse and delta (columns 8 n + 2 t4 + {0, 1}), read
       * while the products run */
      float2 lv[BQ / 8], dlv[BQ / 8];
#pragma unroll
      for (int n = 0; n < BQ / 8; n++) lv[n] = *reinterpret_cast<const float2 *>(L + n * 8 + 2 * t4);
      moe_wg_wait<1>(); /* S^T */
      moe_wg_pin(stt);
#pragma unroll
      for (int n = 0; n < BQ / 8; n++) dlv[n] = *reinterpret_cast<const float2 *>(Dl + n * 8 + 2 * t4);

      /* P^T; dV += P^T dO */
#pragma unroll
      for (int n = 0; n < BQ / 8; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++) {
          const int qc = n * 8 + 2 * t4 + (e & 1), key = n0 + keyl + 8 * (e >> 1);
          float pr = attn_exp2(stt[4 * n + e] * p.scale_log2 - ((e & 1) ? lv[n].y : lv[n].x));
          if (need_mask && q0 + qc < key) pr = 0.f;
          stt[4 * n + e] = pr;
        }
      }
      uint32_t pa[BQ / 16][4];
      wg_c2a<BQ>(pa, stt);
      moe_wg_pin(pa);
      moe_wg_pin(dv);
      moe_wg_fence();
#pragma unroll
      for (int kk = 0; kk < BQ / 16; kk++) moe_wg_rs<D, 1>(dv, pa[kk], wg_dmn<BQ>(ob, 0, kk));
      moe_wg_commit();
      moe_wg_wait<1>(); /* dP^T */
      moe_wg_pin(dpt);

      /* dS^T = P^T (dP^T - delta), to shared memory too; dK += dS^T Q */
#pragma unroll
      for (int n = 0; n < BQ / 8; n++) {
#pragma unroll
        for (int e = 0; e < 4; e++)
          dpt[4 * n + e] = stt[4 * n + e] * (dpt[4 * n + e] - ((e & 1) ? dlv[n].y : dlv[n].x));
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          const int r = keyl + 8 * hh;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sb + r * 128 + ((n ^ (r & 7)) << 4) + t4 * 4),
                       "r"(attn_pack(dpt[4 * n + 2 * hh], dpt[4 * n + 2 * hh + 1]))
                       : "memory");
        }
      }
      uint32_t da[BQ / 16][4];
      wg_c2a<BQ>(da, dpt);
      moe_wg_pin(da);
      moe_wg_pin(dk);
      moe_wg_fence();
#pragma unroll
      for (int kk = 0; kk < BQ / 16; kk++) moe_wg_rs<D, 1>(dk, da[kk], wg_dmn<BQ>(qb, 0, kk));
      moe_wg_commit();
    } else {
#pragma unroll
      for (int n = 0; n < BQ / 8; n++)
#pragma unroll
        for (int hh = 0; hh < 2; hh++) {
          const int r = keyl + 8 * hh;
          asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(sb + r * 128 + ((n ^ (r & 7)) << 4) + t4 * 4),
                       "r"(0u)
                       : "memory");
        }
    }

    /* dQ (BQ x 64) = dS K: D 128 this warpgroup's 64 columns over all
     * 128 keys (both halves of dS^T: the two consumers meet at named
     * barrier 1), D 64 all columns over its own 64 keys */
    moe_fence_proxy();
    if constexpr (D == 128) asm volatile("bar.sync 1, 256;\n" ::: "memory");
    else asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
    float dqp[32];
#pragma unroll
    for (int e = 0; e < 32; e++) dqp[e] = 0.f;
    moe_wg_pin(dqp);
    moe_wg_fence();
    if constexpr (D == 128) {
#pragma unroll
      for (int ks = 0; ks < BN / 16; ks++)
        moe_wg_ss<64, 1, 1>(dqp, moe_wg_desc(sb + ks * 2048, BN * 128, 1024), wg_dmn<BN>(sK, cw, ks));
    } else {
#pragma unroll
      for (int ks = 0; ks < 4; ks++)
        moe_wg_ss<64, 1, 1>(dqp, moe_wg_desc(sb + cw * 8192 + ks * 2048, BN * 128, 1024),
                            wg_dmn<BN>(sK, 0, cw * 4 + ks));
    }
    moe_wg_commit();
    moe_wg_wait<0>();
    moe_wg_pin(dqp);
    moe_wg_pin(dv);
    moe_wg_pin(dk);
    moe_mbar_arrive(empty + 8 * st); /* Q, dO, lse, delta of this stage are read */

    /* stage the partial (after this warpgroup's last reductions read the
     * plane), then one bulk reduction per row */
    if (reducer) asm volatile("cp.async.bulk.wait_group.read 0;\n" ::: "memory");
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
#pragma unroll
    for (int hh = 0; hh < 2; hh++) {
      const int r = warp * 16 + g + 8 * hh;
#pragma unroll
      for (int n = 0; n < 8; n++)
        asm volatile("st.shared.v2.f32 [%0], {%1, %2};\n" ::"r"(plane + r * PITCH + (8 * n + 2 * t4) * 4),
                     "f"(dqp[4 * n + 2 * hh]), "f"(dqp[4 * n + 2 * hh + 1])
                     : "memory");
    }
    moe_fence_proxy();
    asm volatile("bar.sync %0, 128;\n" ::"r"(2 + cw) : "memory");
    if (reducer && q0 + rr < T) {
      float *dst = accg + (int64_t)(q0 + rr) * D + (D == 128 ? cw * 64 : 0);
      asm volatile("cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n"
                   "cp.async.bulk.commit_group;\n" ::"l"(dst),
                   "r"(plane + rr * PITCH), "n"(256)
                   : "memory");
    }
  }
  moe_mbar_arrive(kvempty); /* K and V read for the last time */
  /* dK (scaled) and dV rows */
#pragma unroll
  for (int hh = 0; hh < 2; hh++) {
    const int key = n0 + keyl + 8 * hh;
    if (key >= T) continue;
    uint16_t *dkr = p.dk + b * p.dk_sb + h * p.dk_sh + (int64_t)key * p.dk_st;
    uint16_t *dvr = p.dv + b * p.dv_sb + h * p.dv_sh + (int64_t)key * p.dv_st;
#pragma unroll
    for (int n = 0; n < D / 8; n++) {
      *reinterpret_cast<uint32_t *>(dkr + n * 8 + 2 * t4) =
          attn_pack(dk[4 * n + 2 * hh] * p.scale, dk[4 * n + 2 * hh + 1] * p.scale);
      *reinterpret_cast<uint32_t *>(dvr + n * 8 + 2 * t4) =
          attn_pack(dv[4 * n + 2 * hh], dv[4 * n + 2 * hh + 1]);
    }
  }
  }
  if (reducer) asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
#else
  (void)mq, (void)mk, (void)mv, (void)mo, (void)p, (void)dq_acc, (void)BH;
#endif
}

/* dQ (bf16, its strides) = scale * dq_acc; 8 elements per thread. */
template <int D>
__global__ void attn_dq_convert_kernel(AttnParams p, const float *dq_acc, int64_t n8) {
  const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n8) return;
  const int64_t e = i * 8, row = e / D, c = e % D, bh = row / p.T, t = row % p.T;
  const float4 a = *reinterpret_cast<const float4 *>(dq_acc + e);
  const float4 a2 = *reinterpret_cast<const float4 *>(dq_acc + e + 4);
  uint16_t *dst = p.dq + (bh / p.H) * p.dq_sb + (bh % p.H) * p.dq_sh + t * p.dq_st + c;
  uint4 v;
  v.x = attn_pack(a.x * p.scale, a.y * p.scale);
  v.y = attn_pack(a.z * p.scale, a.w * p.scale);
  v.z = attn_pack(a2.x * p.scale, a2.y * p.scale);
  v.w = attn_pack(a2.z * p.scale, a2.w * p.scale);
  *reinterpret_cast<uint4 *>(dst) = v;
}

/* A TMA map over a (B, H, T, D) bf16 operand with strides (sb, sh, st, 1):
 * dims (D, T, H, B) innermost first, boxes of 64 columns x rows rows, the
 * 128-byte swizzle, zero fill past T. False when the driver refuses it
 * (the caller then runs the cp.async kernels). */
bool attn_map(CUtensorMap *m, const void *data, int64_t sb, int64_t sh, int64_t st, int64_t B,
              int64_t H, int64_t T, int64_t D, int rows) {
  moe_tma_encode_fn enc = moe_tma_encoder();
  if (!enc) return false;
  int64_t s1 = T > 1 ? st * 2 : D * 2;
  int64_t s2 = H > 1 ? sh * 2 : s1 * T;
  int64_t s3 = B > 1 ? sb * 2 : s2 * H;
  cuuint64_t gd[4] = {(cuuint64_t)D, (cuuint64_t)T, (cuuint64_t)H, (cuuint64_t)B};
  cuuint64_t gs[3] = {(cuuint64_t)s1, (cuuint64_t)s2, (cuuint64_t)s3};
  cuuint32_t box[4] = {64, (cuuint32_t)rows, 1, 1}, es[4] = {1, 1, 1, 1};
  return enc(m, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, 4, (void *)data, gd, gs, box, es,
             CU_TENSOR_MAP_INTERLEAVE_NONE, CU_TENSOR_MAP_SWIZZLE_128B,
             CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
}

} // namespace

/* The warp-specialised forward; *ran false when a map was refused. */
template <int D>
moe_status attn_ws_fwd_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH,
                              int B, int nsm, bool *ran) {
  CUtensorMap mq, mk, mv;
  *ran = false;
  if (!attn_map(&mq, p.q, p.q_sb, p.q_sh, p.q_st, B, p.H, p.T, D, WsFwd<D>::BM) ||
      !attn_map(&mk, p.k, p.k_sb, p.k_sh, p.k_st, B, p.H, p.T, D, WsFwd<D>::BN) ||
      !attn_map(&mv, p.v, p.v_sb, p.v_sh, p.v_st, B, p.H, p.T, D, WsFwd<D>::BN))
    return MOE_OK;
  constexpr size_t smem = WsFwd<D>::SMEM;
  auto kern = attn_ws_fwd_kernel<D>;
  MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int64_t ntiles = (int64_t)BH * ((p.T + WsFwd<D>::BM - 1) / WsFwd<D>::BM);
  if (ntiles >= (1LL << 30)) return MOE_OK; /* tile numbers are ints */
  kern<<<(unsigned)(ntiles < nsm ? ntiles : nsm), WS_THREADS, smem, stream>>>(mq, mk, mv, p, BH);
  MOE_CUDA_CHECK_LAUNCH(ctx, "attention forward kernel (TMA + wgmma)");
  *ran = true;
  return MOE_OK;
}

template <int D>
moe_status attn_ws_bwd_launch(moe_ctx *ctx, cudaStream_t stream, const AttnParams &p, int BH,
                              int B, float *acc, int nsm, bool *ran) {
  CUtensorMap mq, mk, mv, mo;
  *ran = false;
  const int64_t ntiles = (int64_t)BH * ((p.T + WsBwd<D>::BN - 1) / WsBwd<D>::BN);
  if (ntiles >= (1LL << 30)) return MOE_OK; /* tile numbers are ints */
  if (!attn_map(&mq, p.q, p.q_sb, p.q_sh, p.q_st, B, p.H, p.T, D, WsBwd<D>::BQ) ||
      !attn_map(&mo, p.dout, p.do_sb, p.do_sh, p.do_st, B, p.H, p.T, D, WsBwd<D>::BQ) ||
      !attn_map(&mk, p.k, p.k_sb, p.k_sh, p.k_st, B, p.H, p.T, D, WsBwd<D>::BN) ||
      !attn_map(&mv, p.v, p.v_sb, p.v_sh, p.v_st, B, p.H, p.T, D, WsBwd<D>::BN))
    return MOE_OK;
  const int64_t rows = (int64_t)BH * p.T;
  MOE_CHECK(attn_delta_launch<D>(ctx, stream, p, rows, acc));
  constexpr size_t smem = WsBwd<D>::SMEM;
  auto kern = attn_ws_bwd_kernel<D>;
  MOE_CUDA_CHECK(ctx, cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  kern<<<(unsigned)(ntiles < nsm ? ntiles : nsm), WS_THREADS, smem, stream>>>(mq, mk, mv, mo, p, acc, BH);
  MOE_CUDA_CHECK_LAUNCH(ctx, "attention backward kernel (TMA + wgmma)");
  const int64_t n8 = rows * D / 8;
  attn_dq_convert_kernel<D><<<(unsigned)((n8 + 255) / 256), 256, 0, stream>>>(p, acc, n8);
  MOE_CUDA_CHECK_LAUNCH(ctx, "attention dq kernel");
  *ran = true;
  return MOE_OK;
}

template moe_status attn_ws_fwd_launch<64>(moe_ctx *, cudaStream_t, const AttnParams &, int, int,
                                           int, bool *);
template moe_status attn_ws_fwd_launch<128>(moe_ctx *, cudaStream_t, const AttnParams &, int, int,
                                            int, bool *);
template moe_status attn_ws_bwd_launch<64>(moe_ctx *, cudaStream_t, const AttnParams &, int, int,
                                           float *, int, bool *);
template moe_status attn_ws_bwd_launch<128>(moe_ctx *, cudaStream_t, const AttnParams &, int, int,
                                            float *, int, bool *);
