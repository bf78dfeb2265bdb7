/*
 * quantize.cuh - the device helpers of the quantize fast path, shared by
 * kernels/quantize.cu (quantize / dequantize) and kernels/experts.cu (the
 * GLU activation that quantizes its saved pre-activations in the same pass).
 * Layout and rounding: core/moe_quantize.h; element math:
 * core/quantize_cuda.h (bit-identical to the CPU reference).
 *
 * A chunk is 8 consecutive elements of one row and one group, kept raw in
 * registers (4 registers for bf16 / f16, 8 for f32), loaded with 16-byte
 * loads from a 16-byte aligned address.
 */
#ifndef MOE_KERNELS_QUANTIZE_CUH
#define MOE_KERNELS_QUANTIZE_CUH

#include <cuda_runtime.h>

#include "common.cuh"
#include "quantize_cuda.h"

#define QZ_THREADS 256

template <moe_dtype DT> __device__ __forceinline__ float qz_ld(const moe_st_t<DT> *x, int64_t i) {
  if constexpr (DT == MOE_F32) return x[i];
  else if constexpr (DT == MOE_BF16) return moe_bf16_to_f32(moe_bf16{x[i]});
  else return moe_f16_to_f32(moe_f16{x[i]});
}

template <moe_dtype DT> __device__ __forceinline__ moe_st_t<DT> qz_st(float v) {
  if constexpr (DT == MOE_F32) return v;
  else if constexpr (DT == MOE_BF16) return moe_f32_to_bf16(v).bits;
  else return moe_f32_to_f16(v).bits;
}

/* The float of a 16-bit element's bits. */
template <moe_dtype DT> __device__ __forceinline__ float qz_half(uint16_t b) {
  if constexpr (DT == MOE_BF16) return moe_bf16_to_f32(moe_bf16{b});
  else return moe_f16_to_f32(moe_f16{b});
}

/* 8 elements kept raw in registers (16-bit types: a only, 4 registers;
 * f32: a and b): half the registers of 8 floats for bf16 / f16, so more
 * groups are in flight per SM. */
struct qz_chunk {
  uint4 a, b;
};

__device__ __forceinline__ uint32_t qz_word(const uint4 &u, int i) {
  return i == 0 ? u.x : (i == 1 ? u.y : (i == 2 ? u.z : u.w));
}

/* 8 elements from p (16-byte aligned). */
template <moe_dtype DT> __device__ __forceinline__ void qz_load8(const moe_st_t<DT> *p, qz_chunk &c) {
  c.a = __ldg((const uint4 *)p);
  if constexpr (DT == MOE_F32) c.b = __ldg((const uint4 *)p + 1);
}

/* Element e (0..7, a constant after unrolling) of a chunk as a float. */
template <moe_dtype DT> __device__ __forceinline__ float qz_elem(const qz_chunk &c, int e) {
  if constexpr (DT == MOE_F32) {
    return __uint_as_float(e < 4 ? qz_word(c.a, e) : qz_word(c.b, e - 4));
  } else {
    uint32_t w = qz_word(c.a, e / 2);
    return qz_half<DT>((uint16_t)(e & 1 ? w >> 16 : w & 0xffffu));
  }
}

/* 8 floats rounded to DT at p (16-byte aligned). */
template <moe_dtype DT> __device__ __forceinline__ void qz_store8(moe_st_t<DT> *p, const float v[8]) {
  if constexpr (DT == MOE_F32) {
    ((float4 *)p)[0] = make_float4(v[0], v[1], v[2], v[3]);
    ((float4 *)p)[1] = make_float4(v[4], v[5], v[6], v[7]);
  } else {
    uint32_t w[4];
#pragma unroll
    for (int i = 0; i < 4; i++)
      w[i] = (uint32_t)qz_st<DT>(v[2 * i]) | ((uint32_t)qz_st<DT>(v[2 * i + 1]) << 16);
    *(uint4 *)p = make_uint4(w[0], w[1], w[2], w[3]);
  }
}

/* Max over the TPG threads of one group: lanes of a warp (TPG <= 32, all 32
 * lanes call it) or the whole block (TPG = QZ_THREADS). */
template <int TPG> __device__ __forceinline__ float qz_group_max_vec(float m, float *shared) {
  constexpr int top = TPG < 32 ? TPG / 2 : 16;
#pragma unroll
  for (int o = top; o > 0; o >>= 1) m = moe_qz_absmax(m, __shfl_xor_sync(0xffffffffu, m, o));
  if constexpr (TPG > 32) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = m;
    __syncthreads();
    m = 0.0f;
#pragma unroll
    for (int w = 0; w < TPG / 32; w++) m = moe_qz_absmax(m, shared[w]);
  }
  return m;
}

/* Max over the TPG threads of one group for two values at once (the two
 * inputs of one group): as qz_group_max_vec, with one shared array per value;
 * groups of up to 1024 threads (a whole block beyond 32). */
template <int TPG>
__device__ __forceinline__ void qz_group_max2_vec(float &m1, float &m2, float (*shared)[32]) {
  constexpr int top = TPG < 32 ? TPG / 2 : 16;
#pragma unroll
  for (int o = top; o > 0; o >>= 1) {
    m1 = moe_qz_absmax(m1, __shfl_xor_sync(0xffffffffu, m1, o));
    m2 = moe_qz_absmax(m2, __shfl_xor_sync(0xffffffffu, m2, o));
  }
  if constexpr (TPG > 32) {
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
      shared[0][warp] = m1;
      shared[1][warp] = m2;
    }
    __syncthreads();
    m1 = 0.0f;
    m2 = 0.0f;
#pragma unroll
    for (int w = 0; w < TPG / 32; w++) {
      m1 = moe_qz_absmax(m1, shared[0][w]);
      m2 = moe_qz_absmax(m2, shared[1][w]);
    }
  }
}

/* Quantizes chunk v (elements c .. c + 7 of row r of a (rows, cols) tensor,
 * one group, scale s, inv = moe_qz_inv(s)) and stores its 8 codes: one 8-byte store (8 bits) or
 * one 4-byte store (4 bits; cols even). Stochastic rounding draws element
 * r * cols + c + e of (seed, call). */
template <moe_dtype DT, int BITS>
__device__ __forceinline__ void qz_put8(const qz_chunk &v, float s, float inv, bool stochastic, uint64_t seed,
                                        uint64_t call, int64_t r, int64_t cols, int64_t c,
                                        void *values) {
  constexpr int qmax = BITS == 8 ? 127 : 7;
  int q[8];
#pragma unroll
  for (int e = 0; e < 8; e++) {
    float u = stochastic ? moe_qz_uniform(seed, call, (uint64_t)(r * cols + c + e)) : 0.0f;
    q[e] = moe_qz_code(qz_elem<DT>(v, e), s, inv, qmax, stochastic, u);
  }
  if constexpr (BITS == 8) {
    uint32_t lo = 0, hi = 0;
#pragma unroll
    for (int e = 0; e < 4; e++) {
      lo |= ((uint32_t)(uint8_t)(int8_t)q[e]) << (8 * e);
      hi |= ((uint32_t)(uint8_t)(int8_t)q[e + 4]) << (8 * e);
    }
    *(uint2 *)((int8_t *)values + r * cols + c) = make_uint2(lo, hi);
  } else {
    uint32_t w = 0;
#pragma unroll
    for (int e = 0; e < 8; e++) w |= (uint32_t)(q[e] + 8) << (4 * e);
    *(uint32_t *)((uint8_t *)values + r * (cols / 2) + c / 2) = w;
  }
}

#endif /* MOE_KERNELS_QUANTIZE_CUH */
