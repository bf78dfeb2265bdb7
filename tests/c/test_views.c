/*
 * test_views.c - every view op alone and in chains, checked against the
 * element values they must show (row-major), their strides where it
 * matters, view's refusal when a copy is needed, reshape's fallback and
 * contiguous.
 */
#include "harness.h"

/* 0, 1, ..., numel - 1 as f32 with the given shape. */
static moe_tensor *iota(moe_ctx *ctx, int ndim, const int64_t *shape) {
  int64_t n = 1;
  for (int d = 0; d < ndim; d++) n *= shape[d];
  moe_tensor *r = NULL, *t = NULL;
  EXPECT_OK(moe_arange(ctx, 0, (double)n, 1, MOE_F32, MOE_CPU, &r));
  EXPECT_OK(moe_view(ctx, r, ndim, shape, &t));
  moe_tensor_release(r);
  return t;
}

static bool has_shape(const moe_tensor *t, int ndim, const int64_t *shape) {
  if (!t || t->ndim != ndim) return false;
  for (int d = 0; d < ndim; d++)
    if (t->shape[d] != shape[d]) return false;
  return true;
}
#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static void test_view(moe_ctx *ctx) {
  moe_tensor *t = iota(ctx, SHAPE(2, 3, 4)), *v = NULL;
  EXPECT_OK(moe_view(ctx, t, SHAPE(4, -1), &v));
  EXPECT(has_shape(v, SHAPE(4, 6)) && v->stride[0] == 6 && v->storage == t->storage);
  EXPECT_VALUES(v, 0, 0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,
                21, 22, 23);
  moe_tensor_release(v);
  EXPECT_OK(moe_view(ctx, t, SHAPE(-1), &v));
  EXPECT(has_shape(v, SHAPE(24)));
  moe_tensor_release(v);
  EXPECT_OK(moe_view(ctx, t, SHAPE(1, 2, 1, 12, 1), &v));
  EXPECT(has_shape(v, SHAPE(1, 2, 1, 12, 1)) && moe_tensor_is_contiguous(v));
  moe_tensor_release(v);
  EXPECT_ERR_MSG(moe_view(ctx, t, SHAPE(5, 5), &v), MOE_ERR_SHAPE,
                 "view: shape [5, 5] is invalid for a tensor of 24 elements");
  EXPECT_ERR_MSG(moe_view(ctx, t, SHAPE(-1, 5), &v), MOE_ERR_SHAPE, "[-1, 5] is invalid");
  EXPECT_ERR_MSG(moe_view(ctx, t, SHAPE(-1, -1), &v), MOE_ERR_SHAPE, "more than one -1");
  EXPECT_ERR_MSG(moe_view(ctx, t, SHAPE(-2, 12), &v), MOE_ERR_SHAPE, "negative size -2");
  moe_tensor_release(t);

  /* a scalar views as [1, 1] and back */
  moe_tensor *s = NULL, *s2 = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 0, NULL, 7, MOE_I64, MOE_CPU, &s));
  EXPECT_OK(moe_view(ctx, s, SHAPE(1, 1), &v));
  EXPECT(has_shape(v, SHAPE(1, 1)));
  EXPECT_OK(moe_view(ctx, v, 0, NULL, &s2));
  EXPECT(s2 && s2->ndim == 0);
  EXPECT_VALUES(s2, 0, 7);
  moe_tensor_release(s2);
  moe_tensor_release(v);
  moe_tensor_release(s);

  /* empty: [0, 3] -> [3, 0, -1] is ambiguous, [0] fine */
  moe_tensor *e = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 3), MOE_F32, MOE_CPU, &e));
  EXPECT_OK(moe_view(ctx, e, SHAPE(0), &v));
  EXPECT(has_shape(v, SHAPE(0)));
  moe_tensor_release(v);
  EXPECT_OK(moe_view(ctx, e, SHAPE(3, 0, 5), &v));
  moe_tensor_release(v);
  EXPECT_ERR_MSG(moe_view(ctx, e, SHAPE(3, 0, -1), &v), MOE_ERR_SHAPE, "ambiguous");
  moe_tensor_release(e);
}

static void test_view_strided(moe_ctx *ctx) {
  /* a transposed [3, 2, 4]: dims 1 and 2 merge? no (strides 12 and 1),
   * but dim 2 splits and dims with stride 4 and 12 do not merge either */
  moe_tensor *t = iota(ctx, SHAPE(2, 3, 4)), *tr = NULL, *v = NULL;
  EXPECT_OK(moe_transpose(ctx, t, 0, 1, &tr));
  EXPECT(has_shape(tr, SHAPE(3, 2, 4)) && tr->stride[0] == 4 && tr->stride[1] == 12);
  EXPECT(!moe_tensor_is_contiguous(tr));
  EXPECT_ERR_MSG(moe_view(ctx, tr, SHAPE(3, 8), &v), MOE_ERR_SHAPE,
                 "view: shape [3, 8] cannot view a tensor of shape [3, 2, 4] and strides [4, 12, 1]");
  EXPECT_ERR(moe_view(ctx, tr, SHAPE(24), &v), MOE_ERR_SHAPE);
  EXPECT_OK(moe_view(ctx, tr, SHAPE(3, 2, 2, 2), &v)); /* splitting the last dim is fine */
  EXPECT(v && v->stride[0] == 4 && v->stride[1] == 12 && v->stride[2] == 2 && v->stride[3] == 1);
  EXPECT_VALUES(v, 0, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 16, 17, 18, 19, 8, 9, 10, 11, 20,
                21, 22, 23);
  moe_tensor_release(v);
  EXPECT_OK(moe_view(ctx, tr, SHAPE(1, 3, 2, 1, 4), &v)); /* size-1 dims anywhere */
  EXPECT_VALUES(v, 0, 0, 1, 2, 3, 12, 13, 14, 15, 4, 5, 6, 7, 16, 17, 18, 19, 8, 9, 10, 11, 20,
                21, 22, 23);
  moe_tensor_release(v);
  moe_tensor_release(tr);

  /* narrowed columns: rows stay separate, each row splits */
  moe_tensor *m = iota(ctx, SHAPE(4, 6)), *n = NULL;
  EXPECT_OK(moe_narrow(ctx, m, 1, 2, 4, &n));
  EXPECT_OK(moe_view(ctx, n, SHAPE(4, 2, 2), &v));
  EXPECT_VALUES(v, 0, 2, 3, 4, 5, 8, 9, 10, 11, 14, 15, 16, 17, 20, 21, 22, 23);
  moe_tensor_release(v);
  EXPECT_ERR(moe_view(ctx, n, SHAPE(16), &v), MOE_ERR_SHAPE);
  moe_tensor_release(n);
  /* narrowed rows are still contiguous: any view works */
  EXPECT_OK(moe_narrow(ctx, m, 0, 1, 2, &n));
  EXPECT(moe_tensor_is_contiguous(n) && n->offset == 6);
  EXPECT_OK(moe_view(ctx, n, SHAPE(3, 4), &v));
  EXPECT_VALUES(v, 0, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17);
  moe_tensor_release(v);
  moe_tensor_release(n);
  moe_tensor_release(m);

  /* an expanded tensor views when the stride-0 dim stays whole */
  moe_tensor *row = iota(ctx, SHAPE(1, 4)), *ex = NULL;
  EXPECT_OK(moe_expand(ctx, row, SHAPE(3, 4), &ex));
  EXPECT_OK(moe_view(ctx, ex, SHAPE(3, 2, 2), &v));
  EXPECT(v && v->stride[0] == 0);
  EXPECT_VALUES(v, 0, 0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3);
  moe_tensor_release(v);
  EXPECT_ERR(moe_view(ctx, ex, SHAPE(12), &v), MOE_ERR_SHAPE);
  moe_tensor_release(ex);
  moe_tensor_release(row);
  moe_tensor_release(t);
}

static void test_reshape_contiguous(moe_ctx *ctx) {
  moe_tensor *t = iota(ctx, SHAPE(2, 3)), *tr = NULL, *r = NULL, *c = NULL;
  EXPECT_OK(moe_reshape(ctx, t, SHAPE(3, 2), &r)); /* a view */
  EXPECT(r && r->storage == t->storage);
  moe_tensor_release(r);
  EXPECT_OK(moe_transpose(ctx, t, -1, -2, &tr));
  EXPECT_OK(moe_reshape(ctx, tr, SHAPE(-1), &r)); /* needs a copy */
  EXPECT(r && r->storage != t->storage && moe_tensor_is_contiguous(r));
  EXPECT_VALUES(r, 0, 0, 3, 1, 4, 2, 5);
  moe_tensor_release(r);
  EXPECT_ERR_MSG(moe_reshape(ctx, tr, SHAPE(4, 2), &r), MOE_ERR_SHAPE,
                 "reshape: shape [4, 2] is invalid for a tensor of 6 elements");
  EXPECT_OK(moe_contiguous(ctx, t, &c));
  EXPECT(c == t && t->refcount == 2);
  moe_tensor_release(c);
  EXPECT_OK(moe_contiguous(ctx, tr, &c));
  EXPECT(c != tr && moe_tensor_is_contiguous(c) && c->stride[0] == 2);
  EXPECT_VALUES(c, 0, 0, 3, 1, 4, 2, 5);
  moe_tensor_release(c);
  moe_tensor_release(tr);
  moe_tensor_release(t);
}

static void test_transpose_permute(moe_ctx *ctx) {
  moe_tensor *t = iota(ctx, SHAPE(2, 3, 4)), *p = NULL, *q = NULL;
  EXPECT_OK(moe_permute(ctx, t, 3, (int64_t[]){2, 0, 1}, &p));
  EXPECT(has_shape(p, SHAPE(4, 2, 3)) && p->stride[0] == 1 && p->stride[1] == 12);
  EXPECT_VALUES(p, 0, 0, 4, 8, 12, 16, 20, 1, 5, 9, 13, 17, 21, 2, 6, 10, 14, 18, 22, 3, 7, 11,
                15, 19, 23);
  EXPECT_OK(moe_permute(ctx, p, 3, (int64_t[]){-2, -1, -3}, &q)); /* the inverse */
  EXPECT(has_shape(q, SHAPE(2, 3, 4)) && moe_tensor_is_contiguous(q));
  moe_tensor_release(q);
  moe_tensor_release(p);
  EXPECT_OK(moe_transpose(ctx, t, 1, 1, &p)); /* same dim: identity */
  EXPECT(has_shape(p, SHAPE(2, 3, 4)));
  moe_tensor_release(p);
  EXPECT_OK(moe_transpose(ctx, t, 0, -1, &p));
  EXPECT(has_shape(p, SHAPE(4, 3, 2)));
  EXPECT_VALUES(p, 0, 0, 12, 4, 16, 8, 20, 1, 13, 5, 17, 9, 21, 2, 14, 6, 18, 10, 22, 3, 15, 7,
                19, 11, 23);
  moe_tensor_release(p);
  moe_tensor_release(t);
}

static void test_narrow_slice_select(moe_ctx *ctx) {
  moe_tensor *t = iota(ctx, SHAPE(3, 5)), *v = NULL, *w = NULL;
  EXPECT_OK(moe_narrow(ctx, t, -1, -3, 2, &v)); /* cols 2, 3 */
  EXPECT(has_shape(v, SHAPE(3, 2)));
  EXPECT_VALUES(v, 0, 2, 3, 7, 8, 12, 13);
  moe_tensor_release(v);
  EXPECT_OK(moe_narrow(ctx, t, 0, 3, 0, &v)); /* empty at the end is fine */
  EXPECT(has_shape(v, SHAPE(0, 5)));
  moe_tensor_release(v);
  EXPECT_OK(moe_slice(ctx, t, 1, 0, 5, 2, &v));
  EXPECT(has_shape(v, SHAPE(3, 3)) && v->stride[1] == 2);
  EXPECT_VALUES(v, 0, 0, 2, 4, 5, 7, 9, 10, 12, 14);
  moe_tensor_release(v);
  EXPECT_OK(moe_slice(ctx, t, 1, -4, -1, 2, &v)); /* 1, 3 */
  EXPECT_VALUES(v, 0, 1, 3, 6, 8, 11, 13);
  moe_tensor_release(v);
  EXPECT_OK(moe_slice(ctx, t, 1, -100, 100, 3, &v)); /* clamped: 0, 3 */
  EXPECT_VALUES(v, 0, 0, 3, 5, 8, 10, 13);
  moe_tensor_release(v);
  EXPECT_OK(moe_slice(ctx, t, 0, 2, 1, 1, &v)); /* stop before start: empty */
  EXPECT(has_shape(v, SHAPE(0, 5)));
  moe_tensor_release(v);
  EXPECT_OK(moe_slice(ctx, t, 0, 1, 3, 5, &v));
  EXPECT(has_shape(v, SHAPE(1, 5)));
  EXPECT_VALUES(v, 0, 5, 6, 7, 8, 9);
  moe_tensor_release(v);
  EXPECT_OK(moe_select(ctx, t, 1, -1, &v)); /* last column */
  EXPECT(has_shape(v, SHAPE(3)) && v->stride[0] == 5 && v->offset == 4);
  EXPECT_VALUES(v, 0, 4, 9, 14);
  EXPECT_OK(moe_select(ctx, v, 0, 2, &w)); /* down to a scalar */
  EXPECT(w && w->ndim == 0);
  EXPECT_VALUES(w, 0, 14);
  moe_tensor_release(w);
  moe_tensor_release(v);
  EXPECT_ERR_MSG(moe_narrow(ctx, t, 1, 3, 3, &v), MOE_ERR_INVALID_ARG,
                 "narrow: start 3 + length 3 exceeds size 5 of dim 1");
  EXPECT_ERR_MSG(moe_narrow(ctx, t, 1, 6, 0, &v), MOE_ERR_INVALID_ARG, "start 6 is out of range");
  EXPECT_ERR_MSG(moe_narrow(ctx, t, 0, 0, -1, &v), MOE_ERR_INVALID_ARG, "length -1 is negative");
  EXPECT_ERR_MSG(moe_select(ctx, t, 0, 3, &v), MOE_ERR_INVALID_ARG,
                 "select: index 3 is out of range for size 3 of dim 0");
  EXPECT_ERR(moe_select(ctx, t, 0, -4, &v), MOE_ERR_INVALID_ARG);
  EXPECT_ERR_MSG(moe_slice(ctx, t, 0, 0, 3, 0, &v), MOE_ERR_INVALID_ARG, "step 0 must be >= 1");
  EXPECT_ERR_MSG(moe_slice(ctx, t, 2, 0, 3, 1, &v), MOE_ERR_INVALID_ARG,
                 "slice: dim 2 is out of range for a tensor of 2 dims (expected -2 to 1)");
  moe_tensor_release(t);
}

static void test_expand_squeeze(moe_ctx *ctx) {
  moe_tensor *t = iota(ctx, SHAPE(3, 1)), *e = NULL, *s = NULL, *u = NULL;
  EXPECT_OK(moe_expand(ctx, t, SHAPE(2, -1, 4), &e));
  EXPECT(has_shape(e, SHAPE(2, 3, 4)) && e->stride[0] == 0 && e->stride[2] == 0);
  EXPECT_VALUES(e, 0, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2);
  moe_tensor_release(e);
  EXPECT_OK(moe_expand(ctx, t, SHAPE(3, 0), &e)); /* size 1 to 0 */
  EXPECT(has_shape(e, SHAPE(3, 0)));
  moe_tensor_release(e);
  EXPECT_ERR_MSG(moe_expand(ctx, t, SHAPE(4, 2), &e), MOE_ERR_SHAPE,
                 "expand: shape [3, 1] cannot be expanded to [4, 2]");
  EXPECT_ERR_MSG(moe_expand(ctx, t, SHAPE(3), &e), MOE_ERR_SHAPE, "fewer dims");
  EXPECT_ERR_MSG(moe_expand(ctx, t, SHAPE(-1, 3, 1), &e), MOE_ERR_SHAPE, "new leading dim 0");

  EXPECT_OK(moe_unsqueeze(ctx, t, 0, &u));
  EXPECT(has_shape(u, SHAPE(1, 3, 1)));
  EXPECT_OK(moe_squeeze(ctx, u, 0, true, &s));
  EXPECT(has_shape(s, SHAPE(3)));
  EXPECT_VALUES(s, 0, 0, 1, 2);
  moe_tensor_release(s);
  EXPECT_OK(moe_squeeze(ctx, u, -1, false, &s));
  EXPECT(has_shape(s, SHAPE(1, 3)));
  moe_tensor_release(s);
  EXPECT_OK(moe_squeeze(ctx, u, 1, false, &s)); /* size 3: left as is, like PyTorch */
  EXPECT(has_shape(s, SHAPE(1, 3, 1)));
  moe_tensor_release(s);
  moe_tensor_release(u);
  EXPECT_OK(moe_unsqueeze(ctx, t, -1, &u)); /* at the end */
  EXPECT(has_shape(u, SHAPE(3, 1, 1)) && u->stride[2] == 1);
  moe_tensor_release(u);
  EXPECT_OK(moe_unsqueeze(ctx, t, 1, &u));
  EXPECT(has_shape(u, SHAPE(3, 1, 1)) && moe_tensor_is_contiguous(u));
  moe_tensor_release(u);
  EXPECT_ERR(moe_unsqueeze(ctx, t, 3, &u), MOE_ERR_INVALID_ARG);
  moe_tensor_release(t);

  moe_tensor *big = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(1, 1, 1, 1, 1, 1, 1, 1), MOE_F32, MOE_CPU, &big));
  EXPECT_ERR_MSG(moe_unsqueeze(ctx, big, 0, &u), MOE_ERR_SHAPE, "ndim 9 exceeds the maximum of 8");
  EXPECT_OK(moe_squeeze(ctx, big, 0, true, &s));
  EXPECT(s && s->ndim == 0);
  moe_tensor_release(s);
  moe_tensor_release(big);
}

static void test_chains(moe_ctx *ctx) {
  /* transpose(narrow(expand(x))): x [1, 4] -> [3, 4] -> cols 1..2 -> [2, 3] */
  moe_tensor *x = iota(ctx, SHAPE(1, 4)), *e = NULL, *n = NULL, *t = NULL, *c = NULL;
  EXPECT_OK(moe_expand(ctx, x, SHAPE(3, 4), &e));
  EXPECT_OK(moe_narrow(ctx, e, 1, 1, 2, &n));
  EXPECT_OK(moe_transpose(ctx, n, 0, 1, &t));
  EXPECT(has_shape(t, SHAPE(2, 3)) && t->stride[0] == 1 && t->stride[1] == 0 && t->offset == 1);
  EXPECT_VALUES(t, 0, 1, 1, 1, 2, 2, 2);
  EXPECT_OK(moe_contiguous(ctx, t, &c));
  EXPECT_VALUES(c, 0, 1, 1, 1, 2, 2, 2);
  moe_tensor_release(c);
  moe_tensor_release(t);
  moe_tensor_release(n);
  moe_tensor_release(e);
  moe_tensor_release(x);

  /* select(slice(permute(view(arange)))) and releasing the base first */
  moe_tensor *a = iota(ctx, SHAPE(2, 3, 4)), *p = NULL, *s = NULL, *sel = NULL, *u = NULL;
  EXPECT_OK(moe_permute(ctx, a, 3, (int64_t[]){1, 2, 0}, &p)); /* [3, 4, 2] */
  moe_tensor_release(a);
  EXPECT_OK(moe_slice(ctx, p, 1, 1, 4, 2, &s)); /* [3, 2, 2]: k = 1, 3 */
  EXPECT_OK(moe_select(ctx, s, 2, 1, &sel));    /* [3, 2]: element (1, j, k) */
  EXPECT(has_shape(sel, SHAPE(3, 2)));
  EXPECT_VALUES(sel, 0, 13, 15, 17, 19, 21, 23);
  EXPECT_OK(moe_unsqueeze(ctx, sel, 1, &u));
  EXPECT(has_shape(u, SHAPE(3, 1, 2)));
  EXPECT_VALUES(u, 0, 13, 15, 17, 19, 21, 23);
  moe_tensor_release(u);
  moe_tensor_release(sel);
  moe_tensor_release(s);
  moe_tensor_release(p);
}

int main(void) {
  RUN(test_view);
  RUN(test_view_strided);
  RUN(test_reshape_contiguous);
  RUN(test_transpose_permute);
  RUN(test_narrow_slice_select);
  RUN(test_expand_squeeze);
  RUN(test_chains);
  return harness_end();
}
