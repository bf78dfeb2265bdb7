/*
 * half.h - bf16 and f16 storage types and their conversions to and from
 * float, shared by the CPU reference (C) and CUDA kernels (.cu), so both round
 * the same way: round to nearest even, NaN stays NaN, overflow goes to inf.
 */
#ifndef MOE_HALF_H
#define MOE_HALF_H

#include <stdint.h>
#include <string.h>

#if defined(__CUDACC__)
#define MOE_HALF_HD __host__ __device__ __forceinline__
#else
#define MOE_HALF_HD static inline
#endif

typedef struct moe_bf16 { uint16_t bits; } moe_bf16;
typedef struct moe_f16 { uint16_t bits; } moe_f16;

MOE_HALF_HD uint32_t moe_f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
MOE_HALF_HD float moe_bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

MOE_HALF_HD float moe_bf16_to_f32(moe_bf16 h) { return moe_bits_f32((uint32_t)h.bits << 16); }

MOE_HALF_HD moe_bf16 moe_f32_to_bf16(float f) {
  uint32_t u = moe_f32_bits(f);
  moe_bf16 h;
  if ((u & 0x7fffffffu) > 0x7f800000u) { /* NaN: keep it quiet */
    h.bits = (uint16_t)((u >> 16) | 0x40u);
    return h;
  }
  u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
  h.bits = (uint16_t)(u >> 16);
  return h;
}

MOE_HALF_HD float moe_f16_to_f32(moe_f16 h) {
  uint32_t sign = (uint32_t)(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  uint32_t u;
  if (exp == 0) {
    if (man == 0) {
      u = sign;
    } else { /* subnormal: normalise */
      int e = -1;
      do { man <<= 1; e++; } while ((man & 0x400u) == 0);
      u = sign | ((uint32_t)(127 - 15 - e) << 23) | ((man & 0x3ffu) << 13);
    }
  } else if (exp == 31) {
    u = sign | 0x7f800000u | (man << 13);
  } else {
    u = sign | ((exp + 127 - 15) << 23) | (man << 13);
  }
  return moe_bits_f32(u);
}

MOE_HALF_HD moe_f16 moe_f32_to_f16(float f) {
  uint32_t u = moe_f32_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
  moe_f16 h;
  if (a > 0x7f800000u) { h.bits = (uint16_t)(sign | 0x7e00u); return h; }       /* NaN */
  if (a >= 0x477ff000u) { h.bits = (uint16_t)(sign | 0x7c00u); return h; }      /* >= 65520: inf */
  if (a < 0x38800000u) {                                                        /* subnormal or 0 */
    if (a < 0x33000000u) { h.bits = (uint16_t)sign; return h; }                 /* < 2^-25: 0 */
    uint32_t e = a >> 23;
    uint32_t m = (a & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - e; /* 14..24 */
    uint32_t r = m >> shift;
    uint32_t rem = m & ((1u << shift) - 1u), half = 1u << (shift - 1);
    if (rem > half || (rem == half && (r & 1u))) r++;
    h.bits = (uint16_t)(sign | r);
    return h;
  }
  uint32_t r = a - 0x38000000u; /* rebias exponent 127 -> 15 (shifted by 13 below) */
  uint32_t lsb = (r >> 13) & 1u;
  r += 0xfffu + lsb;
  h.bits = (uint16_t)(sign | (r >> 13));
  return h;
}

#endif /* MOE_HALF_H */
