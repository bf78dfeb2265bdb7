/*
 * format.c - a tensor as text, after PyTorch's _tensor_str:
 *
 *   tensor([[ 0.1234, -1.5000,  2.0000],
 *           [ 3.0000,  4.0000,  5.0000]], shape=[2, 3], dtype=f32, device=cpu)
 *
 * Every printed element is right-aligned to the widest; floats get
 * `precision` digits, or scientific notation when the nonzero finite
 * magnitudes span more than 1000x, exceed 1e8 or go below 1e-4; integers
 * print plainly, bools as true/false, NaN and infinities as nan/inf/-inf.
 * Past `threshold` elements each dim keeps `edgeitems` at each end around
 * "...", and the formatting is decided from the printed elements only. Rows
 * wrap at `linewidth`; so do the shape/dtype/device suffixes. Unlike
 * PyTorch, floats holding whole numbers still print all their digits
 * ("1.0000", not "1.").
 * CUDA tensors are copied to the host first.
 */
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define ELEM_BUF 64

moe_print_options moe_print_options_default(void) {
  moe_print_options o = {.precision = 4, .threshold = 1000, .edgeitems = 3, .linewidth = 80};
  return o;
}

/* A growing string; a failed allocation sets oom and stops appending. */
typedef struct strbuf {
  char *p;
  size_t len, cap;
  bool oom;
} strbuf;

static void sb_put(strbuf *b, const char *s, size_t n) {
  if (b->oom) return;
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    char *p = realloc(b->p, cap);
    if (!p) {
      b->oom = true;
      return;
    }
    b->p = p;
    b->cap = cap;
  }
  memcpy(b->p + b->len, s, n);
  b->len += n;
  b->p[b->len] = 0;
}

static void sb_str(strbuf *b, const char *s) { sb_put(b, s, strlen(s)); }

static void sb_spaces(strbuf *b, int n) {
  for (int i = 0; i < n; i++) sb_put(b, " ", 1);
}

typedef struct printer {
  const moe_tensor *t; /* on the host */
  const char *base;    /* storage data of t */
  moe_print_options opt;
  bool summarize;
  bool sci;
  int width;                    /* of the widest printed element */
  double abs_min, abs_max;      /* of the nonzero finite printed floats */
  bool any_finite;
  strbuf out;
} printer;

static int elem_format(const printer *pr, int64_t off, char *buf) {
  const moe_tensor *t = pr->t;
  const char *p = pr->base + off * (int64_t)moe_dtype_size(t->dtype);
  if (t->dtype == MOE_BOOL) return snprintf(buf, ELEM_BUF, "%s", *p ? "true" : "false");
  if (!moe_dtype_is_float(t->dtype))
    return snprintf(buf, ELEM_BUF, "%lld", (long long)moe_load_i64(p, t->dtype));
  double v = moe_load_f64(p, t->dtype);
  if (isnan(v)) return snprintf(buf, ELEM_BUF, "nan");
  if (isinf(v)) return snprintf(buf, ELEM_BUF, v > 0 ? "inf" : "-inf");
  return snprintf(buf, ELEM_BUF, pr->sci ? "%.*e" : "%.*f", pr->opt.precision, v);
}

/* Whether dim d of t prints summarised ("..." between the edges). */
static bool dim_cut(const printer *pr, int d) {
  return pr->summarize && pr->t->shape[d] > 2 * (int64_t)pr->opt.edgeitems;
}

/* Calls fn on every printed element at or below (dim, off). */
static void visit(printer *pr, int dim, int64_t off, void (*fn)(printer *, int64_t)) {
  const moe_tensor *t = pr->t;
  if (dim == t->ndim) {
    fn(pr, off);
    return;
  }
  int64_t n = t->shape[dim], e = pr->opt.edgeitems;
  for (int64_t i = 0; i < n; i++) {
    if (dim_cut(pr, dim) && i == e) i = n - e;
    if (i >= n) break;
    visit(pr, dim + 1, off + i * t->stride[dim], fn);
  }
}

static void visit_range(printer *pr, int64_t off) {
  double v = moe_load_f64(pr->base + off * (int64_t)moe_dtype_size(pr->t->dtype), pr->t->dtype);
  if (!isfinite(v) || v == 0) return;
  v = fabs(v);
  if (!pr->any_finite || v < pr->abs_min) pr->abs_min = v;
  if (!pr->any_finite || v > pr->abs_max) pr->abs_max = v;
  pr->any_finite = true;
}

static void visit_width(printer *pr, int64_t off) {
  char buf[ELEM_BUF];
  int n = elem_format(pr, off, buf);
  if (n > pr->width) pr->width = n;
}

static void put_elem(printer *pr, int64_t off) {
  char buf[ELEM_BUF];
  int n = elem_format(pr, off, buf);
  sb_spaces(&pr->out, pr->width - n);
  sb_put(&pr->out, buf, (size_t)n);
}

/* The last dim: items joined by ", ", wrapped to linewidth. */
static void print_row(printer *pr, int dim, int64_t off, int indent) {
  const moe_tensor *t = pr->t;
  int64_t n = t->shape[dim], e = pr->opt.edgeitems;
  int per_line = (pr->opt.linewidth - indent) / (pr->width + 2);
  if (per_line < 1) per_line = 1;
  sb_str(&pr->out, "[");
  if (pr->summarize && e == 0) {
    sb_str(&pr->out, "...]");
    return;
  }
  int64_t item = 0;
  for (int64_t i = 0; i < n; i++, item++) {
    bool cut = dim_cut(pr, dim) && i == e;
    if (item > 0) {
      if (item % per_line == 0) {
        sb_str(&pr->out, ",\n");
        sb_spaces(&pr->out, indent + 1);
      } else {
        sb_str(&pr->out, ", ");
      }
    }
    if (cut) {
      sb_str(&pr->out, " ...");
      i = n - e - 1;
      continue;
    }
    put_elem(pr, off + i * t->stride[dim]);
  }
  sb_str(&pr->out, "]");
}

static void print_dim(printer *pr, int dim, int64_t off, int indent) {
  const moe_tensor *t = pr->t;
  if (dim == t->ndim) {
    put_elem(pr, off);
    return;
  }
  if (dim == t->ndim - 1) {
    print_row(pr, dim, off, indent);
    return;
  }
  int64_t n = t->shape[dim], e = pr->opt.edgeitems;
  sb_str(&pr->out, "[");
  for (int64_t i = 0; i < n; i++) {
    bool cut = dim_cut(pr, dim) && i == e;
    if (i > 0) { /* "," then one newline per remaining dim, then the indent */
      sb_str(&pr->out, ",");
      for (int k = dim + 1; k < t->ndim; k++) sb_str(&pr->out, "\n");
      sb_spaces(&pr->out, indent + 1);
    }
    if (cut) {
      sb_str(&pr->out, "...");
      i = n - e - 1;
      continue;
    }
    print_dim(pr, dim + 1, off + i * t->stride[dim], indent + 1);
  }
  sb_str(&pr->out, "]");
}

/* ", suffix" or ",\n<indent>suffix" past linewidth (PyTorch's _add_suffixes). */
static void put_suffix(printer *pr, const char *suffix, int indent, int64_t *line_len) {
  int64_t n = (int64_t)strlen(suffix);
  if (*line_len + n + 2 > pr->opt.linewidth) {
    sb_str(&pr->out, ",\n");
    sb_spaces(&pr->out, indent);
    *line_len = indent + n;
  } else {
    sb_str(&pr->out, ", ");
    *line_len += n + 2;
  }
  sb_str(&pr->out, suffix);
}

moe_status moe_tensor_format(moe_ctx *ctx, const moe_tensor *t, const moe_print_options *opt,
                             char **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "format: tensor is NULL");
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "format: out is NULL");
  printer pr;
  memset(&pr, 0, sizeof(pr));
  pr.opt = opt ? *opt : moe_print_options_default();
  if (pr.opt.precision < 0 || pr.opt.precision > 30 || pr.opt.threshold < 0 ||
      pr.opt.edgeitems < 0 || pr.opt.linewidth < 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "format: bad print options (precision %d must be in [0, 30], threshold %lld "
                     ">= 0, edgeitems %d >= 0, linewidth %d >= 1)",
                     pr.opt.precision, (long long)pr.opt.threshold, pr.opt.edgeitems,
                     pr.opt.linewidth);
  moe_tensor *h = (moe_tensor *)t; /* only retained and released */
  if (t->storage->device.type != MOE_DEVICE_CPU)
    MOE_CHECK(moe_to(ctx, h, t->dtype, MOE_CPU, &h));
  else
    moe_tensor_retain(h);
  const int indent = 7; /* strlen("tensor(") */
  pr.t = h;
  pr.base = h->storage->data;
  pr.width = 1;
  sb_str(&pr.out, "tensor(");
  int64_t numel = moe_tensor_numel(h);
  if (numel == 0) {
    sb_str(&pr.out, "[]");
  } else {
    pr.summarize = numel > pr.opt.threshold;
    if (moe_dtype_is_float(h->dtype)) {
      visit(&pr, 0, h->offset, visit_range);
      pr.sci = pr.any_finite && (pr.abs_max / pr.abs_min > 1000.0 || pr.abs_max > 1.0e8 ||
                                 pr.abs_min < 1.0e-4);
    }
    visit(&pr, 0, h->offset, visit_width);
    print_dim(&pr, 0, h->offset, indent);
  }
  char suffix[256];
  const char *nl = pr.out.p ? strrchr(pr.out.p, '\n') : NULL;
  /* as PyTorch counts it: two more than the characters after the newline */
  int64_t line_len = (int64_t)pr.out.len - (nl ? (int64_t)(nl - pr.out.p) : -1) + 1;
  snprintf(suffix, sizeof(suffix), "shape=%s", MOE_SHAPE(h));
  put_suffix(&pr, suffix, indent, &line_len);
  snprintf(suffix, sizeof(suffix), "dtype=%s", moe_dtype_name(h->dtype));
  put_suffix(&pr, suffix, indent, &line_len);
  snprintf(suffix, sizeof(suffix), "device=%s", MOE_DEVICE(t->storage->device));
  put_suffix(&pr, suffix, indent, &line_len);
  sb_str(&pr.out, ")");
  moe_tensor_release(h);
  if (pr.out.oom) {
    free(pr.out.p);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "format: out of host memory");
  }
  *out = pr.out.p;
  return MOE_OK;
}
