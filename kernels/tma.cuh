/*
 * tma.cuh - Hopper (sm_90a) asynchronous-copy helpers shared by the
 * warp-specialised kernels: mbarrier init / wait / arrive / expect-tx, TMA
 * tile loads (cp.async.bulk.tensor) into shared memory, and a host getter
 * for cuTensorMapEncodeTiled through the runtime's driver entry point (no
 * link against libcuda).
 */
#ifndef MOE_KERNELS_TMA_CUH
#define MOE_KERNELS_TMA_CUH

#include <cuda.h>
#include <cuda_runtime.h>
#include <stdint.h>

typedef CUresult (*moe_tma_encode_fn)(CUtensorMap *, CUtensorMapDataType, cuuint32_t, void *,
                                      const cuuint64_t *, const cuuint64_t *, const cuuint32_t *,
                                      const cuuint32_t *, CUtensorMapInterleave,
                                      CUtensorMapSwizzle, CUtensorMapL2promotion,
                                      CUtensorMapFloatOOBfill);

/* cuTensorMapEncodeTiled, or NULL when the driver lacks it. */
static inline moe_tma_encode_fn moe_tma_encoder(void) {
  static moe_tma_encode_fn fn = NULL;
  if (!fn) {
    void *p = NULL;
    cudaDriverEntryPointQueryResult q;
    if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault,
                                         &q) == cudaSuccess &&
        q == cudaDriverEntryPointSuccess)
      fn = (moe_tma_encode_fn)p;
  }
  return fn;
}

#if defined(__CUDA_ARCH__) && defined(__CUDA_ARCH_FEAT_SM90_ALL)
__device__ __forceinline__ void moe_mbar_init(uint32_t bar, int count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;\n" ::"r"(bar), "r"(count));
}
__device__ __forceinline__ void moe_mbar_wait(uint32_t bar, uint32_t parity) {
  asm volatile(
      "{\n"
      ".reg .pred p;\n"
      "MOE_MBAR_WAIT:\n"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra MOE_MBAR_WAIT;\n"
      "}\n" ::"r"(bar),
      "r"(parity)
      : "memory");
}
__device__ __forceinline__ void moe_mbar_arrive(uint32_t bar) {
  asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.shared::cta.b64 st, [%0];\n}\n" ::"r"(bar)
               : "memory");
}
/* Arrives and adds `bytes` to the transaction count the phase waits for. */
__device__ __forceinline__ void moe_mbar_expect(uint32_t bar, uint32_t bytes) {
  asm volatile(
      "{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.shared::cta.b64 st, [%0], %1;\n}\n" ::"r"(bar),
      "r"(bytes)
      : "memory");
}
/* 2-, 3- and 4-D TMA boxes at coordinates (c0 innermost ..) into dst,
 * completing on mbarrier bar. */
__device__ __forceinline__ void moe_tma2(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                         uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[%0], [%1, {%2, %3}], [%4];\n" ::"r"(dst),
               "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void moe_tma3(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                         int c2, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[%0], [%1, {%2, %3, %4}], [%5];\n" ::"r"(dst),
               "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(bar)
               : "memory");
}
__device__ __forceinline__ void moe_tma4(uint32_t dst, const CUtensorMap *map, int c0, int c1,
                                         int c2, int c3, uint32_t bar) {
  asm volatile("cp.async.bulk.tensor.4d.shared::cluster.global.mbarrier::complete_tx::bytes "
               "[%0], [%1, {%2, %3, %4, %5}], [%6];\n" ::"r"(dst),
               "l"((uint64_t)map), "r"(c0), "r"(c1), "r"(c2), "r"(c3), "r"(bar)
               : "memory");
}
/* TMA stores of a 2- or 3-D box from shared memory at src (the 128-byte
 * swizzle of the map) to coordinates (c0 innermost ..), in the calling
 * thread's bulk async-group; out-of-bounds elements are not written. The
 * writers of src make their stores visible to the async proxy first
 * (moe_fence_proxy) and a barrier orders them before the issuing thread. */
__device__ __forceinline__ void moe_tma_store2(const CUtensorMap *map, uint32_t src, int c0, int c1) {
  asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%2, %3}], [%1];\n" ::"l"(
                   (uint64_t)map),
               "r"(src), "r"(c0), "r"(c1)
               : "memory");
}
__device__ __forceinline__ void moe_tma_store3(const CUtensorMap *map, uint32_t src, int c0, int c1,
                                               int c2) {
  asm volatile("cp.async.bulk.tensor.3d.global.shared::cta.bulk_group [%0, {%2, %3, %4}], [%1];\n" ::"l"(
                   (uint64_t)map),
               "r"(src), "r"(c0), "r"(c1), "r"(c2)
               : "memory");
}
/* Closes the thread's bulk async-group; waits until at most N of its groups
 * are still reading shared memory (_read) or still in flight at all. */
__device__ __forceinline__ void moe_bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;\n" ::: "memory");
}
template <int N> __device__ __forceinline__ void moe_bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;\n" ::"n"(N) : "memory");
}
template <int N> __device__ __forceinline__ void moe_bulk_wait() {
  asm volatile("cp.async.bulk.wait_group %0;\n" ::"n"(N) : "memory");
}
#endif

#endif /* MOE_KERNELS_TMA_CUH */
