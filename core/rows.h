/*
 * rows.h - the row machinery that the reductions (reduce.c), the norms
 * (norm.c) and the losses (loss.c) share: argument checks with one
 * wording, the geometry of a tensor seen as (outer, reduced) or as rows
 * along one dim, and contiguous row copies for the GPU launchers of
 * reduce_cuda.h. Private to those three files.
 */
#ifndef MOE_ROWS_H
#define MOE_ROWS_H

#include <string.h>

#include "internal.h"
#include "reduce_cuda.h"

static inline bool is_float(moe_dtype dt) { return moe_dtype_is_float(dt); }

/* "fn: what is NULL", or the device's check. */
moe_status moe_rows_check_tensor(moe_ctx *ctx, const char *fn, const moe_tensor *t,
                                 const char *what);
/* A float dtype, and not f64 on CUDA. */
moe_status moe_rows_check_float(moe_ctx *ctx, const char *fn, const moe_tensor *t);
/* "fn: out is NULL". */
moe_status moe_rows_check_out(moe_ctx *ctx, const char *fn, void *out);
/* "op backward: gradient of dtype g for an output of o" (MOE_ERR_DTYPE). */
moe_status moe_rows_grad_dtype_error(moe_ctx *ctx, const moe_node *n, moe_dtype g, moe_dtype o);
/* t (or t with dim `dim` swapped to the end) as a contiguous tensor, made
 * with grad mode off so the internal copy records nothing. */
moe_status moe_rows_contig(moe_ctx *ctx, moe_tensor *t, int dim, moe_tensor **out);

/* Appends dim (n, s) to a row-major dim list, merging with the previous dim
 * when contiguous with it and dropping size 1. */
static inline void geom_push(int *nd, int64_t *shape, int64_t *stride, int64_t n, int64_t s) {
  if (n == 1) return;
  if (*nd > 0 && stride[*nd - 1] == s * n) {
    shape[*nd - 1] *= n;
    stride[*nd - 1] = s;
    return;
  }
  shape[*nd] = n;
  stride[*nd] = s;
  (*nd)++;
}

static inline void red_geom_build(const moe_tensor *t, unsigned mask, moe_red_geom *g) {
  memset(g, 0, sizeof(*g));
  g->data = moe_tensor_data(t);
  g->dtype = t->dtype;
  g->outer = g->inner = 1;
  for (int d = 0; d < t->ndim; d++) {
    if (mask & (1u << d)) {
      g->inner *= t->shape[d];
      geom_push(&g->indim, g->ishape, g->istride, t->shape[d], t->stride[d]);
    } else {
      g->outer *= t->shape[d];
      geom_push(&g->ondim, g->oshape, g->ostride, t->shape[d], t->stride[d]);
    }
  }
}

/* Offset of row-major index i over (nd, shape, stride). */
static inline int64_t geom_offset(int nd, const int64_t *shape, const int64_t *stride, int64_t i) {
  int64_t off = 0;
  for (int d = nd - 1; d >= 0 && i > 0; d--) {
    int64_t q = i / shape[d];
    off += (i - q * shape[d]) * stride[d];
    i = q;
  }
  return off;
}

/* A tensor seen as rows along dim d: outer geometry, row length and stride. */
typedef struct row_geom {
  moe_red_geom g;
  int64_t n, s; /* elements per row, their stride */
  char *data;
  int64_t es;
} row_geom;

static inline void row_geom_of(const moe_tensor *t, int d, row_geom *r) {
  red_geom_build(t, 1u << d, &r->g);
  r->n = t->shape[d];
  r->s = t->stride[d];
  r->data = (char *)moe_tensor_data(t);
  r->es = (int64_t)moe_dtype_size(t->dtype);
}

static inline char *row_at(const row_geom *r, int64_t o) {
  return r->data + geom_offset(r->g.ondim, r->g.oshape, r->g.ostride, o) * r->es;
}

#endif /* MOE_ROWS_H */
