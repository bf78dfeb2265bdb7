/*
 * cpu_loop.h - the strided N-d loop of the CPU reference (private to core/).
 *
 * Also moe_kview_broadcast, which dispatch uses to hand CPU loops and CUDA
 * kernels views of one shape.
 *
 * Up to five views of one shape are walked together in row-major logical
 * order. Dims of size 1 are dropped and neighbouring dims that are contiguous
 * for every view are merged (order is kept), so a contiguous tensor becomes
 * one long row. The rows are cut into tasks of at most MOE_LOOP_CHUNK
 * elements; a task knows its first element's offset in each view and its
 * row-major index, so tasks run in any order and in parallel:
 *
 *   moe_loop l; moe_loop_init(&l, 2, (const moe_kview *[]){&dst, &src});
 *   #pragma omp parallel for if (l.numel >= MOE_LOOP_PAR_MIN)
 *   for (int64_t k = 0; k < l.tasks; k++) {
 *     int64_t off[MOE_LOOP_MAX_OPS], first;
 *     int64_t n = moe_loop_task(&l, k, off, &first);
 *     ... n elements at off[v] + j * l.inner_stride[v], j < n ...
 *   }
 */
#ifndef MOE_CPU_LOOP_H
#define MOE_CPU_LOOP_H

#include "internal.h"

#define MOE_LOOP_MAX_OPS 5        /* views walked together (pointwise backward needs 5) */
#define MOE_LOOP_CHUNK 16384     /* elements per task at most */
#define MOE_LOOP_PAR_MIN 32768   /* run tasks in parallel from this many elements */

typedef struct moe_loop {
  int nops;
  int ndim;                                       /* >= 1 after merging */
  int64_t shape[MOE_MAX_DIMS];                    /* (ndim) */
  int64_t stride[MOE_LOOP_MAX_OPS][MOE_MAX_DIMS]; /* (nops, ndim) in elements */
  int64_t inner_stride[MOE_LOOP_MAX_OPS];         /* stride of the last dim per view */
  int64_t numel, inner, rows;   /* inner = shape[ndim - 1], rows = numel / inner */
  int64_t chunks;               /* tasks per row */
  int64_t tasks;                /* rows * chunks; 0 when numel is 0 */
} moe_loop;

/* All views must have v[0]'s shape (broadcast dims have stride 0). */
static inline void moe_loop_init(moe_loop *l, int nops, const moe_kview *const *v) {
  MOE_ASSERT(nops >= 1 && nops <= MOE_LOOP_MAX_OPS);
  l->nops = nops;
  l->ndim = 0;
  l->numel = 1;
  for (int d = 0; d < v[0]->ndim; d++) {
    int64_t n = v[0]->shape[d];
    for (int k = 1; k < nops; k++) MOE_ASSERT(v[k]->ndim == v[0]->ndim && v[k]->shape[d] == n);
    l->numel *= n;
    if (n == 1) continue;
    int last = l->ndim - 1;
    bool merge = last >= 0;
    for (int k = 0; k < nops && merge; k++)
      merge = l->stride[k][last] == v[k]->stride[d] * n;
    if (merge) {
      l->shape[last] *= n;
      for (int k = 0; k < nops; k++) l->stride[k][last] = v[k]->stride[d];
    } else {
      l->shape[l->ndim] = n;
      for (int k = 0; k < nops; k++) l->stride[k][l->ndim] = v[k]->stride[d];
      l->ndim++;
    }
  }
  if (l->ndim == 0) { /* a scalar or all sizes 1 */
    l->shape[0] = 1;
    for (int k = 0; k < nops; k++) l->stride[k][0] = 0;
    l->ndim = 1;
  }
  for (int k = 0; k < nops; k++) l->inner_stride[k] = l->stride[k][l->ndim - 1];
  l->inner = l->shape[l->ndim - 1];
  if (l->numel == 0) {
    l->rows = l->chunks = l->tasks = 0;
    return;
  }
  l->rows = l->numel / l->inner;
  l->chunks = (l->inner + MOE_LOOP_CHUNK - 1) / MOE_LOOP_CHUNK;
  l->tasks = l->rows * l->chunks;
}

/* Task k: writes the offsets of its first element and that element's
 * row-major index, returns its element count. */
static inline int64_t moe_loop_task(const moe_loop *l, int64_t k, int64_t *off, int64_t *first) {
  int64_t row = k / l->chunks, j0 = (k % l->chunks) * MOE_LOOP_CHUNK;
  for (int v = 0; v < l->nops; v++) off[v] = j0 * l->inner_stride[v];
  int64_t r = row;
  for (int d = l->ndim - 2; d >= 0 && r > 0; d--) {
    int64_t i = r % l->shape[d];
    r /= l->shape[d];
    for (int v = 0; v < l->nops; v++) off[v] += i * l->stride[v][d];
  }
  *first = row * l->inner + j0;
  int64_t n = l->inner - j0;
  return n < MOE_LOOP_CHUNK ? n : MOE_LOOP_CHUNK;
}

/* t's kview broadcast to shape (t's shape must broadcast to it): leading
 * dims and expanded size-1 dims get stride 0. */
static inline moe_kview moe_kview_broadcast(const moe_tensor *t, int ndim, const int64_t *shape) {
  moe_kview v = moe_kview_of(t);
  int lead = ndim - t->ndim;
  MOE_ASSERT(lead >= 0);
  v.ndim = ndim;
  for (int d = ndim - 1; d >= 0; d--) {
    int64_t have = d >= lead ? t->shape[d - lead] : 1;
    v.stride[d] = d >= lead && have == shape[d] ? t->stride[d - lead] : 0;
    MOE_ASSERT(have == shape[d] || have == 1);
    v.shape[d] = shape[d];
  }
  return v;
}

#endif /* MOE_CPU_LOOP_H */
