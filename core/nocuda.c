/*
 * nocuda.c - the CUDA entry points of internal.h for a build without CUDA
 * (-DMOE_CUDA=OFF or no toolkit). Every call that would touch a GPU fails
 * with MOE_ERR_NOT_SUPPORTED and says the build has no CUDA; the queries
 * answer "no GPU". The declarations are unconditional (internal.h and the
 * families' core/<family>_cuda.h), so dispatch code calls a launcher
 * without #ifdef and this file is the one place that says "no CUDA".
 */
#include "host_pin.h"
#include "internal.h"
#include "dist_internal.h"
#include "attention_cuda.h"
#include "blocksparse_cuda.h"
#include "experts_cuda.h"
#include "grouped_cuda.h"
#include "index_cuda.h"
#include "matmul_cuda.h"
#include "optim_cuda.h"
#include "pointwise_cuda.h"
#include "quantize_cuda.h"
#include "reduce_cuda.h"
#include "routing_cuda.h"

#define NO_CUDA(ctx)                                                                               \
  moe_error((ctx), MOE_ERR_NOT_SUPPORTED,                                                          \
            "this moe-lua was built without CUDA (configure with -DMOE_CUDA=ON on a machine with " \
            "the CUDA toolkit)")
/* A family's launcher: unreachable in practice (no tensor can live on a GPU
 * without CUDA), named in case a caller forgets to check the device. */
#define NO_CUDA_FN(ctx, fn)                                                                       \
  moe_error((ctx), MOE_ERR_NOT_SUPPORTED,                                                         \
            "%s: this moe-lua was built without CUDA (configure with -DMOE_CUDA=ON on a machine " \
            "with the CUDA toolkit)",                                                             \
            (fn))

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
moe_status moe_cuda_memcpy(moe_ctx *ctx, void *dst, moe_device dd, const void *src, moe_device sd,
                           size_t nbytes) {
  return NO_CUDA(ctx);
}
moe_status moe_cuda_host_register(moe_ctx *ctx, void *p, size_t nbytes) { return NO_CUDA(ctx); }
void moe_cuda_host_unregister(void *p) {}
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

/* ------------------------------------------- the families' launchers */
/* attention_cuda.h */
void moe_cuda_attention_tune(int fwd_variant, int bwd_variant) {}
const char *moe_cuda_attention_last(bool backward) { return "none"; }
bool moe_cuda_attention_rows_ok(const moe_kview *v) { return false; }
moe_status moe_cuda_attention_fwd(moe_ctx *ctx, int device, const moe_kview *q, const moe_kview *k,
                                  const moe_kview *v, const moe_kview *o, const moe_kview *lse,
                                  bool causal, double scale) {
  return NO_CUDA_FN(ctx, "moe_cuda_attention_fwd");
}
bool moe_cuda_attention_bwd_atomic(const moe_ctx *ctx, int device) { return false; }
moe_status moe_cuda_attention_bwd(moe_ctx *ctx, int device, const moe_kview *q, const moe_kview *k,
                                  const moe_kview *v, const moe_kview *o, const moe_kview *lse,
                                  const moe_kview *dout, const moe_kview *delta,
                                  const moe_kview *dq, const moe_kview *dk, const moe_kview *dv,
                                  const moe_kview *dq_acc, bool causal, double scale) {
  return NO_CUDA_FN(ctx, "moe_cuda_attention_bwd");
}

/* blocksparse_cuda.h */
moe_status moe_cuda_bsmm_sdd(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *x, const void *w, int64_t K, bool trans_w, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_sdd");
}
moe_status moe_cuda_bsmm_dsd(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *s, const void *w, int64_t K, bool trans_w, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_dsd");
}
moe_status moe_cuda_bsmm_dsd_t(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                               const void *s, const void *y, int64_t K, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_dsd_t");
}
moe_status moe_cuda_bsmm_dds(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                             const void *x, const void *s, int64_t K, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_dds");
}
moe_status moe_cuda_bsmm_dsd2(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                              const void *s, const void *w, const void *s2, const void *w2,
                              int64_t K, bool trans_w, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_dsd2");
}
moe_status moe_cuda_bsmm_sdd_glu(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                                 const void *x, const void *w1, const void *w3, int64_t K, int act,
                                 void *h1, void *h3, void *a) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_sdd_glu");
}
moe_status moe_cuda_wg_grouped_mm(moe_ctx *ctx, int device, const void *x, const void *w,
                                  const int64_t *offs, int64_t G, int64_t R, int64_t K, int64_t N,
                                  bool trans_w, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_wg_grouped_mm");
}
moe_status moe_cuda_wg_grouped_wgrad(moe_ctx *ctx, int device, const void *a, const void *b,
                                     const int64_t *offs, int64_t G, int64_t R, int64_t K,
                                     int64_t N, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_wg_grouped_wgrad");
}
moe_status moe_cuda_wg_grouped_mm2(moe_ctx *ctx, int device, const void *x, const void *w,
                                   const void *x2, const void *w2, const int64_t *offs, int64_t G,
                                   int64_t R, int64_t K, int64_t N, bool trans_w, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_wg_grouped_mm2");
}
moe_status moe_cuda_wg_grouped_mm_gather(moe_ctx *ctx, int device, const void *x, const void *w,
                                         const void *x2, const void *w2, const int64_t *offs,
                                         const moe_wg_gather *gt, const moe_wg_scatter *sc, int64_t G,
                                         int64_t R, int64_t K, int64_t N, bool trans_w, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_wg_grouped_mm_gather");
}
moe_status moe_cuda_wg_grouped_wgrad_gather(moe_ctx *ctx, int device, const void *a, const void *b,
                                            const int64_t *offs, const moe_wg_gather *gt, int64_t G,
                                            int64_t R, int64_t K, int64_t N, void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_wg_grouped_wgrad_gather");
}
moe_status moe_cuda_wg_grouped_glu(moe_ctx *ctx, int device, const void *x, const void *w1,
                                   const void *w3, const int64_t *offs, int64_t G, int64_t R,
                                   int64_t K, int64_t N, int act, void *h1, void *h3, void *a) {
  return NO_CUDA_FN(ctx, "moe_cuda_wg_grouped_glu");
}
moe_status moe_cuda_wg_grouped_glu_bwd(moe_ctx *ctx, int device, const void *dy, const void *w2,
                                       const int64_t *offs, int64_t G, int64_t R, int64_t K,
                                       int64_t N, int act, const void *h1, const void *h3,
                                       const float *g_rows, void *dh1, void *dh3, void *ga,
                                       float *dgate_rows) {
  return NO_CUDA_FN(ctx, "moe_cuda_wg_grouped_glu_bwd");
}
bool moe_cuda_wg_grouped(moe_ctx *ctx, int device) {
  (void)ctx, (void)device;
  return false;
}
bool moe_cuda_bsmm_wgmma(moe_ctx *ctx, int device, moe_dtype dt) {
  (void)ctx, (void)device, (void)dt;
  return false;
}
moe_status moe_cuda_bsmm_to_dense(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                                  const void *s, void *dense) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_to_dense");
}
moe_status moe_cuda_bsmm_from_dense(moe_ctx *ctx, int device, moe_dtype dt, const moe_bs_topo *tp,
                                    const void *dense, void *s) {
  return NO_CUDA_FN(ctx, "moe_cuda_bsmm_from_dense");
}

/* experts_cuda.h */
moe_status moe_cuda_experts_glu_fwd(moe_ctx *ctx, int device, moe_dtype dt, int act, int64_t n,
                                    const void *h1, const void *h3, void *a) {
  return NO_CUDA_FN(ctx, "moe_cuda_experts_glu_fwd");
}
moe_status moe_cuda_experts_glu_bwd(moe_ctx *ctx, int device, moe_dtype dt, int act, int64_t R,
                                    int64_t f, int64_t bs, void *dA0, const void *h1,
                                    const void *h3, const float *g_rows, void *dh3, void *ga,
                                    float *dgate_rows) {
  return NO_CUDA_FN(ctx, "moe_cuda_experts_glu_bwd");
}
moe_status moe_cuda_experts_gate_rows(moe_ctx *ctx, int device, moe_dtype dt, int64_t R, int64_t K,
                                      int64_t bs, void *dX0, const void *xs, const int64_t *src,
                                      int64_t k, const float *g_rows, void *gxs, void *ys, int64_t N,
                                      float *dgate_rows) {
  return NO_CUDA_FN(ctx, "moe_cuda_experts_gate_rows");
}
moe_status moe_cuda_experts_glu_fwd_quant(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                          int64_t rows, const moe_ex_qhidden *qh, bool stochastic,
                                          uint64_t seed, uint64_t call1, uint64_t call3,
                                          const void *h1, const void *h3, void *a, bool *done) {
  return NO_CUDA_FN(ctx, "moe_cuda_experts_glu_fwd_quant");
}
moe_status moe_cuda_experts_glu_bwd_quant(moe_ctx *ctx, int device, moe_dtype dt, int act,
                                          int64_t R, int64_t f, int64_t bs, void *dA0,
                                          const moe_ex_qhidden *qh, const float *g_rows, void *dh3,
                                          void *ga, float *dgate_rows) {
  return NO_CUDA_FN(ctx, "moe_cuda_experts_glu_bwd_quant");
}
moe_status moe_cuda_experts_take(moe_ctx *ctx, int device, int64_t n, const int64_t *idx,
                                 const void *in, moe_dtype in_dt, void *out, moe_dtype out_dt) {
  return NO_CUDA_FN(ctx, "moe_cuda_experts_take");
}

/* grouped_cuda.h */
moe_status moe_cuda_gemm_grouped(moe_ctx *ctx, int device, const moe_gemm *g, int64_t count) {
  return NO_CUDA_FN(ctx, "moe_cuda_gemm_grouped");
}
moe_status moe_cuda_gemm_streams(moe_ctx *ctx, int device, const moe_gemm *g, int64_t count) {
  return NO_CUDA_FN(ctx, "moe_cuda_gemm_streams");
}

/* index_cuda.h */
moe_status moe_cuda_gather(moe_ctx *ctx, int device, const char *fn, const moe_kview *out,
                           const moe_kview *x, int dim, const moe_kview *index) {
  return NO_CUDA_FN(ctx, "moe_cuda_gather");
}
moe_status moe_cuda_scatter(moe_ctx *ctx, int device, const char *fn, moe_scatter_mode mode,
                            const moe_kview *out, int dim, const moe_kview *index,
                            const moe_kview *src) {
  return NO_CUDA_FN(ctx, "moe_cuda_scatter");
}
moe_status moe_cuda_index_add(moe_ctx *ctx, int device, const char *fn, void *out, const void *src,
                              moe_dtype dt, const void *index, moe_dtype index_dt, int64_t outer,
                              int64_t X, int64_t n, int64_t inner) {
  return NO_CUDA_FN(ctx, "moe_cuda_index_add");
}
moe_status moe_cuda_one_hot(moe_ctx *ctx, int device, const char *fn, int64_t *out, const void *ids,
                            moe_dtype ids_dt, int64_t m, int64_t num_classes) {
  return NO_CUDA_FN(ctx, "moe_cuda_one_hot");
}
moe_status moe_cuda_bincount(moe_ctx *ctx, int device, const char *fn, int64_t *out,
                             const void *ids, moe_dtype ids_dt, int64_t n, int64_t E) {
  return NO_CUDA_FN(ctx, "moe_cuda_bincount");
}
moe_status moe_cuda_sort_rows(moe_ctx *ctx, int device, void *values, int64_t *indices,
                              const void *x, moe_dtype dt, int64_t rows, int64_t cols,
                              bool descending) {
  return NO_CUDA_FN(ctx, "moe_cuda_sort_rows");
}
moe_status moe_cuda_topk_rows(moe_ctx *ctx, int device, void *values, int64_t *indices,
                              const void *x, moe_dtype dt, int64_t rows, int64_t cols, int64_t k,
                              bool largest) {
  return NO_CUDA_FN(ctx, "moe_cuda_topk_rows");
}
moe_status moe_cuda_rope(moe_ctx *ctx, int device, const moe_kview *out, const moe_kview *x,
                         const moe_kview *cos, const moe_kview *sin, int tdim, bool inverse) {
  return NO_CUDA_FN(ctx, "moe_cuda_rope");
}
moe_status moe_cuda_multinomial(moe_ctx *ctx, int device, int64_t *out, const moe_kview *probs,
                                int64_t num_samples, bool replacement, uint64_t seed,
                                uint64_t call) {
  return NO_CUDA_FN(ctx, "moe_cuda_multinomial");
}

/* matmul_cuda.h */
moe_status moe_cuda_gemm(moe_ctx *ctx, int device, const moe_gemm *g) {
  return NO_CUDA_FN(ctx, "moe_cuda_gemm");
}
moe_status moe_cuda_colsum(moe_ctx *ctx, int device, moe_dtype dtype, const void *src, int64_t rows,
                           int64_t cols, int64_t ld, void *dst) {
  return NO_CUDA_FN(ctx, "moe_cuda_colsum");
}

/* optim_cuda.h */
moe_status moe_cuda_adamw_step(moe_ctx *ctx, int device, int64_t n, void *param, moe_dtype pdt,
                               const void *grad, moe_dtype gdt, void *m, void *v, void *master,
                               const moe_optim_scalars *s) {
  return NO_CUDA_FN(ctx, "moe_cuda_adamw_step");
}
moe_status moe_cuda_sgd_step(moe_ctx *ctx, int device, int64_t n, void *param, moe_dtype pdt,
                             const void *grad, moe_dtype gdt, void *buf, void *master,
                             const moe_optim_scalars *s) {
  return NO_CUDA_FN(ctx, "moe_cuda_sgd_step");
}
moe_status moe_cuda_adamw_multi(moe_ctx *ctx, int device, const moe_optim_item *items, int64_t n,
                                const moe_optim_scalars *s, const float *grad_scale,
                                const float *skip) {
  return NO_CUDA_FN(ctx, "moe_cuda_adamw_multi");
}
moe_status moe_cuda_grad_norm_multi(moe_ctx *ctx, int device, const moe_optim_item *items,
                                    int64_t n, float max_norm, float *norm, float *coef,
                                    float *found_inf) {
  return NO_CUDA_FN(ctx, "moe_cuda_grad_norm_multi");
}
moe_status moe_cuda_scale_multi(moe_ctx *ctx, int device, const moe_optim_item *items, int64_t n,
                                const float *scale) {
  return NO_CUDA_FN(ctx, "moe_cuda_scale_multi");
}

/* pointwise_cuda.h */
moe_status moe_cuda_pw_unary(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *out,
                             const moe_kview *x, double p0, double p1, int64_t i0, int64_t i1) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_unary");
}
moe_status moe_cuda_pw_unary_grad(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *gin,
                                  const moe_kview *g, const moe_kview *x, double p0, double p1) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_unary_grad");
}
moe_status moe_cuda_pw_binary(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *out,
                              const moe_kview *a, const moe_kview *b) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_binary");
}
moe_status moe_cuda_pw_binary_grad(moe_ctx *ctx, int device, moe_pw_kop op, const moe_kview *ga,
                                   const moe_kview *gb, const moe_kview *g, const moe_kview *a,
                                   const moe_kview *b) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_binary_grad");
}
moe_status moe_cuda_pw_compare(moe_ctx *ctx, int device, moe_op op, moe_dtype cdt,
                               const moe_kview *out, const moe_kview *a, const moe_kview *b,
                               double s) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_compare");
}
moe_status moe_cuda_pw_where(moe_ctx *ctx, int device, const moe_kview *out, const moe_kview *cond,
                             const moe_kview *a, const moe_kview *b) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_where");
}
moe_status moe_cuda_pw_swiglu(moe_ctx *ctx, int device, const moe_kview *out, const moe_kview *gate,
                              const moe_kview *up) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_swiglu");
}
moe_status moe_cuda_pw_swiglu_grad(moe_ctx *ctx, int device, const moe_kview *dgate,
                                   const moe_kview *dup, const moe_kview *g, const moe_kview *gate,
                                   const moe_kview *up) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_swiglu_grad");
}
moe_status moe_cuda_pw_dropout(moe_ctx *ctx, int device, const moe_kview *out, const moe_kview *x,
                               uint64_t seed, uint64_t call, uint32_t thr, double scale) {
  return NO_CUDA_FN(ctx, "moe_cuda_pw_dropout");
}

/* quantize_cuda.h */
moe_status moe_cuda_quantize(moe_ctx *ctx, int device, moe_dtype dt, const void *x, int64_t ld,
                             int64_t rows, int64_t cols, int bits, int64_t G, bool stochastic,
                             uint64_t seed, uint64_t call, void *values, float *scales) {
  return NO_CUDA_FN(ctx, "moe_cuda_quantize");
}
moe_status moe_cuda_dequantize(moe_ctx *ctx, int device, moe_dtype dt, const void *values,
                               const float *scales, int64_t rows, int64_t cols, int bits, int64_t G,
                               void *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_dequantize");
}

/* reduce_cuda.h */
moe_status moe_cuda_reduce(moe_ctx *ctx, int device, moe_red_kind kind, const moe_red_geom *g,
                           double arg, void *out, moe_dtype odt, int64_t *idx) {
  return NO_CUDA_FN(ctx, "moe_cuda_reduce");
}
moe_status moe_cuda_reduce_backward(moe_ctx *ctx, int device, moe_red_kind kind,
                                    const moe_kview *gin, const moe_kview *x, const moe_kview *g,
                                    const moe_kview *y, const moe_kview *aux, double scale,
                                    double arg) {
  return NO_CUDA_FN(ctx, "moe_cuda_reduce_backward");
}
moe_status moe_cuda_red_scatter(moe_ctx *ctx, int device, void *gin, const void *g,
                                const int64_t *idx, moe_dtype dt, int64_t outer, int64_t nd,
                                int64_t post) {
  return NO_CUDA_FN(ctx, "moe_cuda_red_scatter");
}
moe_status moe_cuda_softmax(moe_ctx *ctx, int device, bool log, const void *x, void *y,
                            moe_dtype dt, int64_t rows, int64_t n) {
  return NO_CUDA_FN(ctx, "moe_cuda_softmax");
}
moe_status moe_cuda_softmax_backward(moe_ctx *ctx, int device, bool log, const void *y,
                                     const void *g, void *gx, moe_dtype dt, int64_t rows,
                                     int64_t n) {
  return NO_CUDA_FN(ctx, "moe_cuda_softmax_backward");
}
moe_status moe_cuda_cumsum(moe_ctx *ctx, int device, bool reverse, const void *x, void *y,
                           moe_dtype dt, int64_t rows, int64_t n) {
  return NO_CUDA_FN(ctx, "moe_cuda_cumsum");
}
moe_status moe_cuda_norm_forward(moe_ctx *ctx, int device, bool rms, const void *x, const void *w,
                                 const void *b, void *y, float *mean, float *rstd, moe_dtype dt,
                                 int64_t rows, int64_t n, double eps) {
  return NO_CUDA_FN(ctx, "moe_cuda_norm_forward");
}
moe_status moe_cuda_norm_backward(moe_ctx *ctx, int device, bool rms, const void *x, const void *w,
                                  const void *g, const float *mean, const float *rstd, void *gx,
                                  void *gw, void *gb, moe_dtype dt, int64_t rows, int64_t n) {
  return NO_CUDA_FN(ctx, "moe_cuda_norm_backward");
}
moe_status moe_cuda_cross_entropy(moe_ctx *ctx, int device, const void *logits,
                                  const int64_t *target, float *loss, float *lse, moe_dtype dt,
                                  int64_t rows, int64_t n, int64_t ignore_index, double smoothing) {
  return NO_CUDA_FN(ctx, "moe_cuda_cross_entropy");
}
moe_status moe_cuda_cross_entropy_reduce(moe_ctx *ctx, int device, const float *loss,
                                         const int64_t *target, int64_t rows, int64_t ignore_index,
                                         bool mean, void *out, moe_dtype odt, float *count) {
  return NO_CUDA_FN(ctx, "moe_cuda_cross_entropy_reduce");
}
moe_status moe_cuda_cross_entropy_backward(moe_ctx *ctx, int device, const void *logits,
                                           const int64_t *target, const float *lse, const void *g,
                                           moe_dtype gdt, bool per_row, const float *count,
                                           void *gx, moe_dtype dt, int64_t rows, int64_t n,
                                           int64_t ignore_index, double smoothing) {
  return NO_CUDA_FN(ctx, "moe_cuda_cross_entropy_backward");
}

/* routing_cuda.h */
moe_status moe_cuda_routing_sort(moe_ctx *ctx, int device, const moe_kview *ids,
                                 const moe_kview *scores, int64_t E, int32_t *sorted_keys,
                                 int64_t *perm, int64_t *inv, int64_t *offsets, int64_t *counts) {
  return NO_CUDA_FN(ctx, "moe_cuda_routing_sort");
}
moe_status moe_cuda_routing_layout(moe_ctx *ctx, int device, int64_t N, int64_t E, int64_t e0,
                                   int64_t e1, int64_t capacity, int64_t block_size, int64_t R,
                                   const int32_t *sorted_keys, const int64_t *perm,
                                   const int64_t *offsets, const int64_t *counts, int64_t *kept,
                                   int64_t *row_offsets, int64_t *dest, int64_t *src) {
  return NO_CUDA_FN(ctx, "moe_cuda_routing_layout");
}
moe_status moe_cuda_routing_topology(moe_ctx *ctx, int device, const int64_t *row_offsets,
                                     int64_t e0, int64_t e1, int64_t block_size, int64_t F,
                                     int64_t Rb, int64_t *row_indices, int64_t *column_indices,
                                     int64_t *offsets, int64_t *column_indices_t,
                                     int64_t *offsets_t, int64_t *block_offsets_t) {
  return NO_CUDA_FN(ctx, "moe_cuda_routing_topology");
}
moe_status moe_cuda_routing_rank_counts(moe_ctx *ctx, int device, const int64_t *offsets, int64_t E,
                                        int64_t n_ranks, int64_t *out) {
  return NO_CUDA_FN(ctx, "moe_cuda_routing_rank_counts");
}
moe_status moe_cuda_routing_gather(moe_ctx *ctx, int device, const moe_kview *out,
                                   const moe_kview *x, const int64_t *src, const int64_t *dest,
                                   const moe_kview *gates, int64_t k, bool padded) {
  return NO_CUDA_FN(ctx, "moe_cuda_routing_gather");
}
moe_status moe_cuda_routing_combine(moe_ctx *ctx, int device, const moe_kview *out,
                                    const moe_kview *y, const int64_t *dest, const moe_kview *gates,
                                    int64_t k) {
  return NO_CUDA_FN(ctx, "moe_cuda_routing_combine");
}
moe_status moe_cuda_routing_gate_grad(moe_ctx *ctx, int device, const moe_kview *dgates,
                                      const moe_kview *dout, const moe_kview *y,
                                      const int64_t *dest, int64_t k) {
  return NO_CUDA_FN(ctx, "moe_cuda_routing_gate_grad");
}

/* dist_internal.h: NCCL's half of the collectives. dist.c hands over only
 * tensors on a GPU, which this build cannot make; a split, a free and the
 * finalize have no NCCL communicator to touch and succeed. */
#define NO_NCCL(ctx, fn)                                                                      \
  moe_error((ctx), MOE_ERR_NOT_SUPPORTED,                                                     \
            "%s: GPU tensors need a build with CUDA (configure with -DMOE_CUDA=ON on a "      \
            "machine with the CUDA toolkit and NCCL)",                                        \
            (fn))
moe_status moe_nccl_all_reduce(moe_ctx *ctx, moe_comm *c, moe_tensor *t, moe_reduce_op op,
                               moe_work *w) {
  return NO_NCCL(ctx, "all_reduce");
}
moe_status moe_nccl_reduce_scatter(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                                   moe_reduce_op op, moe_work *w) {
  return NO_NCCL(ctx, "reduce_scatter");
}
moe_status moe_nccl_all_gather(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                               moe_work *w) {
  return NO_NCCL(ctx, "all_gather");
}
moe_status moe_nccl_broadcast(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int root, moe_work *w) {
  return NO_NCCL(ctx, "broadcast");
}
moe_status moe_nccl_all_to_all(moe_ctx *ctx, moe_comm *c, moe_tensor *out, moe_tensor *in,
                               const int64_t *send, const int64_t *recv, moe_work *w) {
  return NO_NCCL(ctx, "all_to_all");
}
moe_status moe_nccl_send(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work *w) {
  return NO_NCCL(ctx, "send");
}
moe_status moe_nccl_recv(moe_ctx *ctx, moe_comm *c, moe_tensor *t, int peer, moe_work *w) {
  return NO_NCCL(ctx, "recv");
}
moe_status moe_nccl_work_wait(moe_ctx *ctx, moe_work *w) { return NO_NCCL(ctx, "wait"); }
bool moe_nccl_work_done(moe_work *w) { return true; }
void moe_nccl_work_release(moe_work *w) {}
moe_status moe_nccl_comm_split(moe_ctx *ctx, moe_comm *parent, moe_comm *child, int color,
                               int key) {
  return MOE_OK;
}
void moe_nccl_comm_free(moe_comm *c) {}
void moe_nccl_finalize(void) {}
moe_status moe_nccl_timing_collect(moe_ctx *ctx, double *ms) { return MOE_OK; }
void moe_nccl_timing_clear(void) {}
