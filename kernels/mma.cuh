/*
 * mma.cuh - the PTX wrappers the mma.sync tensor-core kernels share (private
 * to kernels/attention_mma.cu, attention_sm90.cu and blocksparse.cu):
 * cp.async copies into shared memory, ldmatrix loads (plain and transposed)
 * and the bf16 m16n8k16 MMA with f32 accumulators. sm_80 and newer.
 */
#ifndef MOE_KERNELS_MMA_CUH
#define MOE_KERNELS_MMA_CUH

#include <cuda_runtime.h>
#include <stdint.h>

__device__ __forceinline__ uint32_t moe_smem_u32(const void *p) {
  return (uint32_t)__cvta_generic_to_shared(p);
}

/* 16 bytes global -> shared; zero-filled when !valid (src is not read). */
__device__ __forceinline__ void moe_cp16(uint32_t dst, const void *src, bool valid) {
  int n = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src), "r"(n));
}
__device__ __forceinline__ void moe_cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void moe_cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}

/* Four 8x8 b16 matrices from shared memory (each lane gives one row address). */
__device__ __forceinline__ void moe_ldm_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void moe_ldm_x4_t(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

/* c (16x8 f32) += a (16x16 bf16, row) * b (16x8 bf16, col). */
__device__ __forceinline__ void moe_mma_bf16(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

#endif /* MOE_KERNELS_MMA_CUH */
