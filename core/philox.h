/*
 * philox.h - Philox-4x32-10 counter-based random numbers, shared verbatim by
 * the CPU reference (C) and the CUDA kernels (included from .cu files), so
 * that the same (seed, call, element) gives the same number on both.
 *
 * Layout (see moe.h "random"): key = seed, counter = (block, call) where block
 * is the element's index divided by the number of values one Philox block
 * yields for that distribution:
 *   uniform f32/f16/bf16: 4 values a block, 24 random bits each
 *   uniform f64:          2 values a block, 53 random bits each
 *   normal:               4 values a block, Box-Muller on lane pairs (0,1), (2,3)
 *   integers:             2 values a block, 64 random bits each
 * All arithmetic after the integer part is in double with explicit
 * rounding-mode-free operations (no fused multiply-add: the CUDA side uses
 * __dmul_rn/__dadd_rn through MOE_DMUL/MOE_DADD), so uniform and integer
 * results are bit-identical across devices; normal goes through log/sincos
 * whose last bit may differ between libm and CUDA.
 */
#ifndef MOE_PHILOX_H
#define MOE_PHILOX_H

#include <stdint.h>
#include <math.h>

#if defined(__CUDACC__)
#define MOE_HD __host__ __device__ __forceinline__
#if defined(__CUDA_ARCH__)
#define MOE_DMUL(a, b) __dmul_rn((a), (b))
#define MOE_DADD(a, b) __dadd_rn((a), (b))
#else
#define MOE_DMUL(a, b) ((a) * (b))
#define MOE_DADD(a, b) ((a) + (b))
#endif
#else
#define MOE_HD static inline
#define MOE_DMUL(a, b) ((a) * (b))
#define MOE_DADD(a, b) ((a) + (b))
#endif

typedef struct moe_philox4 {
  uint32_t v[4];
} moe_philox4;

/* The high 32 bits of a * b; the low ones are the plain 32-bit product. On
 * the GPU through __umulhi: a 64-bit product there makes NVVM carry the
 * whole Philox state in 64-bit registers (measured: dropout went from 64% to
 * 79% of copy bandwidth on an H100 with this form). */
MOE_HD uint32_t moe_mulhi32(uint32_t a, uint32_t b) {
#if defined(__CUDA_ARCH__)
  return __umulhi(a, b);
#else
  return (uint32_t)(((uint64_t)a * (uint64_t)b) >> 32);
#endif
}

/* Ten rounds of Philox-4x32 (Salmon et al., SC'11). */
MOE_HD moe_philox4 moe_philox(uint64_t seed, uint64_t block, uint64_t call) {
  uint32_t c0 = (uint32_t)block, c1 = (uint32_t)(block >> 32);
  uint32_t c2 = (uint32_t)call, c3 = (uint32_t)(call >> 32);
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
#if defined(__CUDA_ARCH__)
#pragma unroll
#endif
  for (int r = 0; r < 10; r++) {
    uint32_t hi0 = moe_mulhi32(0xD2511F53u, c0), lo0 = 0xD2511F53u * c0;
    uint32_t hi1 = moe_mulhi32(0xCD9E8D57u, c2), lo1 = 0xCD9E8D57u * c2;
    uint32_t n0 = hi1 ^ c1 ^ k0, n2 = hi0 ^ c3 ^ k1;
    c0 = n0; c1 = lo1; c2 = n2; c3 = lo0;
    k0 += 0x9E3779B9u;
    k1 += 0xBB67AE85u;
  }
  moe_philox4 out;
  out.v[0] = c0; out.v[1] = c1; out.v[2] = c2; out.v[3] = c3;
  return out;
}

/* Uniform in [0, 1) with 24 random bits (exact in f32). */
MOE_HD double moe_philox_uniform24(uint64_t seed, uint64_t call, uint64_t i) {
  moe_philox4 r = moe_philox(seed, i >> 2, call);
  return (double)(r.v[i & 3] >> 8) * (1.0 / 16777216.0);
}

/* Uniform in [0, 1) with 53 random bits (exact in f64). */
MOE_HD double moe_philox_uniform53(uint64_t seed, uint64_t call, uint64_t i) {
  moe_philox4 r = moe_philox(seed, i >> 1, call);
  unsigned l = (unsigned)(i & 1) * 2;
  uint64_t x = ((uint64_t)r.v[l + 1] << 32) | r.v[l];
  return (double)(x >> 11) * (1.0 / 9007199254740992.0);
}

/* 64 random bits. */
MOE_HD uint64_t moe_philox_bits64(uint64_t seed, uint64_t call, uint64_t i) {
  moe_philox4 r = moe_philox(seed, i >> 1, call);
  unsigned l = (unsigned)(i & 1) * 2;
  return ((uint64_t)r.v[l + 1] << 32) | r.v[l];
}

/* Standard normal by Box-Muller on the lane pair holding element i. */
MOE_HD double moe_philox_normal(uint64_t seed, uint64_t call, uint64_t i) {
  moe_philox4 r = moe_philox(seed, i >> 2, call);
  unsigned l = (unsigned)(i & 3) & ~1u;
  /* u1 in (0, 1] so that log(u1) is finite; u2 in [0, 1). */
  double u1 = (double)((r.v[l] >> 8) + 1) * (1.0 / 16777216.0);
  double u2 = (double)(r.v[l + 1] >> 8) * (1.0 / 16777216.0);
  double rad = sqrt(MOE_DMUL(-2.0, log(u1)));
  double th = MOE_DMUL(6.283185307179586, u2);
  return MOE_DMUL(rad, (i & 1) ? sin(th) : cos(th));
}

#endif /* MOE_PHILOX_H */
