/*
 * nocuda.c - the CUDA entry points of internal.h for a build without CUDA
 * (-DMOE_CUDA=OFF or no toolkit). Every call that would touch a GPU fails
 * with MOE_ERR_NOT_SUPPORTED and says the build has no CUDA; the queries
 * answer "no GPU".
 */
#include "internal.h"

#define NO_CUDA(ctx) \
  moe_error((ctx), MOE_ERR_NOT_SUPPORTED, "this moe-lua was built without CUDA (configure with -DMOE_CUDA=ON on a machine with the CUDA toolkit)")

bool moe_cuda_built(void) { return false; }
int moe_cuda_device_count(moe_ctx *ctx) { return 0; }
moe_status moe_cuda_device_info(moe_ctx *ctx, int index, char *name, size_t len, int *cc,
                                size_t *mem) {
  return NO_CUDA(ctx);
}
void moe_cuda_versions(int *runtime, int *driver, int *cublas, int *nccl) {
  if (runtime) *runtime = 0;
  if (driver) *driver = 0;
  if (cublas) *cublas = 0;
  if (nccl) *nccl = 0;
}
moe_status moe_cuda_synchronize(moe_ctx *ctx, moe_device d) { return NO_CUDA(ctx); }

moe_status moe_cuda_alloc(moe_ctx *ctx, int device, size_t nbytes, void **ptr, size_t *block) {
  return NO_CUDA(ctx);
}
void moe_cuda_release(moe_ctx *ctx, int device, void *ptr, size_t block) {}
moe_status moe_cuda_stats(moe_ctx *ctx, int device, moe_memory_stats *out) { return NO_CUDA(ctx); }
moe_status moe_cuda_reset_peak(moe_ctx *ctx, int device) { return NO_CUDA(ctx); }
moe_status moe_cuda_empty_cache(moe_ctx *ctx, int device) { return NO_CUDA(ctx); }
moe_status moe_cuda_stream(moe_ctx *ctx, int device, void **stream) { return NO_CUDA(ctx); }
moe_status moe_cuda_cublas(moe_ctx *ctx, int device, void **handle) { return NO_CUDA(ctx); }
moe_status moe_cuda_memcpy(moe_ctx *ctx, void *dst, moe_device dd, const void *src,
                           moe_device sd, size_t nbytes) {
  return NO_CUDA(ctx);
}
void moe_cuda_state_free(moe_ctx *ctx) {}
moe_status moe_cuda_event_create(moe_ctx *ctx, int device, void **ev) { return NO_CUDA(ctx); }
moe_status moe_cuda_event_record(moe_ctx *ctx, int device, void *ev) { return NO_CUDA(ctx); }
moe_status moe_cuda_event_synchronize(moe_ctx *ctx, void *ev) { return NO_CUDA(ctx); }
moe_status moe_cuda_event_elapsed(moe_ctx *ctx, void *start, void *end, float *ms) {
  return NO_CUDA(ctx);
}
void moe_cuda_event_destroy(void *ev) {}

moe_status moe_cuda_copy(moe_ctx *ctx, int device, const moe_kview *dst, const moe_kview *src) {
  return NO_CUDA(ctx);
}
moe_status moe_cuda_fill(moe_ctx *ctx, int device, const moe_kview *dst, double value) {
  return NO_CUDA(ctx);
}
moe_status moe_cuda_arange(moe_ctx *ctx, int device, const moe_kview *dst, double start,
                           double step) {
  return NO_CUDA(ctx);
}
moe_status moe_cuda_random(moe_ctx *ctx, int device, const moe_kview *dst, moe_random_kind kind,
                           uint64_t seed, uint64_t call, double a, double b) {
  return NO_CUDA(ctx);
}
moe_status moe_cuda_binary(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                           const moe_kview *a, const moe_kview *b) {
  return NO_CUDA(ctx);
}
moe_status moe_cuda_binary_scalar(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                                  const moe_kview *a, double s, bool reverse) {
  return NO_CUDA(ctx);
}
moe_status moe_cuda_unary(moe_ctx *ctx, int device, moe_op op, const moe_kview *out,
                          const moe_kview *a) {
  return NO_CUDA(ctx);
}
