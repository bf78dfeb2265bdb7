/*
 * test_ops.c - the op table and the elementwise ops: broadcasting against
 * hand-computed results, dtype promotion of results, scalars on either
 * side, integer division to float, empty tensors, non-contiguous inputs,
 * integer wrap-around, and a few million floats through the fast path.
 */
#include <time.h>

#include "harness.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static moe_tensor *vals(moe_ctx *ctx, moe_dtype dt, int ndim, const int64_t *shape,
                        const double *v) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, v, ndim, shape, dt, MOE_CPU, &t));
  return t;
}

static void test_op_names(moe_ctx *ctx) {
  EXPECT_STR(moe_op_name(MOE_OP_ADD), "add");
  EXPECT_STR(moe_op_name(MOE_OP_SUB), "sub");
  EXPECT_STR(moe_op_name(MOE_OP_MUL), "mul");
  EXPECT_STR(moe_op_name(MOE_OP_DIV), "div");
  EXPECT_STR(moe_op_name(MOE_OP_NEG), "neg");
  EXPECT_STR(moe_op_name(MOE_OP_COUNT), "op?");
  EXPECT_STR(moe_op_name(MOE_OP_GLU_EXPERTS), "glu_experts");
  /* every op has a name of its own (a gap in the table reads "op?") */
  for (int op = 0; op < MOE_OP_COUNT; op++) {
    EXPECT(strcmp(moe_op_name((moe_op)op), "op?") != 0);
    for (int k = 0; k < op; k++) EXPECT(strcmp(moe_op_name((moe_op)op), moe_op_name((moe_op)k)) != 0);
  }
}

static void test_broadcast(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
  moe_tensor *row = vals(ctx, MOE_F32, SHAPE(3), (double[]){10, 20, 30});
  moe_tensor *col = vals(ctx, MOE_F32, SHAPE(2, 1), (double[]){100, 200});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, a, row, &r));
  EXPECT(r && r->ndim == 2 && r->shape[0] == 2 && r->shape[1] == 3 && r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 11, 22, 33, 14, 25, 36);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_SUB, row, a, &r));
  EXPECT_VALUES(r, 0, 9, 18, 27, 6, 15, 24);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, col, row, &r)); /* outer product [2, 3] */
  EXPECT(r && r->shape[0] == 2 && r->shape[1] == 3);
  EXPECT_VALUES(r, 0, 1000, 2000, 3000, 2000, 4000, 6000);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_DIV, a, col, &r));
  EXPECT_VALUES(r, 1e-9, 0.01, 0.02, 0.03, 0.02, 0.025, 0.03);
  moe_tensor_release(r);
  /* rank-3 against rank-1 and a 0-d scalar tensor */
  moe_tensor *c3 = vals(ctx, MOE_F64, SHAPE(2, 1, 2), (double[]){1, 2, 3, 4});
  moe_tensor *s = vals(ctx, MOE_F64, 0, NULL, (double[]){0.5});
  r = NULL;
  EXPECT_ERR_MSG(moe_binary(ctx, MOE_OP_ADD, c3, row, &r), MOE_ERR_SHAPE,
                 "add: shapes [2, 1, 2] and [3] cannot be broadcast");
  EXPECT(r == NULL); /* outputs are not written on failure */
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, c3, s, &r));
  EXPECT(r && r->ndim == 3 && r->dtype == MOE_F64);
  EXPECT_VALUES(r, 0, 0.5, 1, 1.5, 2);
  moe_tensor_release(r);
  moe_tensor *c2 = vals(ctx, MOE_F64, SHAPE(3, 1), (double[]){1, 2, 3});
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, c3, c2, &r)); /* [2,1,2] + [3,1] -> [2,3,2] */
  EXPECT(r && r->ndim == 3 && r->shape[0] == 2 && r->shape[1] == 3 && r->shape[2] == 2);
  EXPECT_VALUES(r, 0, 2, 3, 3, 4, 4, 5, 4, 5, 5, 6, 6, 7);
  moe_tensor_release(r);
  moe_tensor_release(c2);
  moe_tensor_release(s);
  moe_tensor_release(c3);
  moe_tensor_release(col);
  moe_tensor_release(row);
  moe_tensor_release(a);
}

static void test_promotion(moe_ctx *ctx) {
  moe_tensor *i32 = vals(ctx, MOE_I32, SHAPE(3), (double[]){7, -7, 2});
  moe_tensor *i64 = vals(ctx, MOE_I64, SHAPE(3), (double[]){2, 2, -4});
  moe_tensor *u8 = vals(ctx, MOE_U8, SHAPE(3), (double[]){200, 100, 1});
  moe_tensor *i8 = vals(ctx, MOE_I8, SHAPE(3), (double[]){100, -100, 1});
  moe_tensor *b = vals(ctx, MOE_BOOL, SHAPE(3), (double[]){1, 0, 1});
  moe_tensor *bf = vals(ctx, MOE_BF16, SHAPE(3), (double[]){0.5, 1.5, 2});
  moe_tensor *hf = vals(ctx, MOE_F16, SHAPE(3), (double[]){0.25, 0.25, 0.25});
  moe_tensor *f64 = vals(ctx, MOE_F64, SHAPE(3), (double[]){0.1, 0.2, 0.3});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, i32, i64, &r));
  EXPECT(r->dtype == MOE_I64);
  EXPECT_VALUES(r, 0, 9, -5, -2);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_DIV, i32, i64, &r)); /* integer division gives f32 */
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 3.5, -3.5, -0.5);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, u8, i8, &r)); /* i32: no wrap */
  EXPECT(r->dtype == MOE_I32);
  EXPECT_VALUES(r, 0, 300, 0, 2);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, u8, u8, &r)); /* u8 wraps */
  EXPECT(r->dtype == MOE_U8);
  EXPECT_VALUES(r, 0, 144, 200, 2);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, b, i8, &r));
  EXPECT(r->dtype == MOE_I8);
  EXPECT_VALUES(r, 0, 100, 0, 1);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, b, b, &r)); /* bool + bool stays bool (or) */
  EXPECT(r->dtype == MOE_BOOL);
  EXPECT_VALUES(r, 0, 1, 0, 1);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_DIV, b, b, &r));
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 1, NAN, 1);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, bf, hf, &r)); /* bf16 with f16 meets at f32 */
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 0.75, 1.75, 2.25);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, bf, i32, &r));
  EXPECT(r->dtype == MOE_BF16);
  EXPECT_VALUES(r, 0, 3.5, -10.5, 4);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_SUB, f64, bf, &r));
  EXPECT(r->dtype == MOE_F64);
  EXPECT_VALUES(r, 1e-15, -0.4, -1.3, -1.7);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_DIV, i64, hf, &r));
  EXPECT(r->dtype == MOE_F16);
  EXPECT_VALUES(r, 0, 8, 8, -16);
  moe_tensor_release(r);
  /* a float computed in f32 then rounded once to bf16: 1/3 */
  moe_tensor *one = vals(ctx, MOE_BF16, SHAPE(1), (double[]){1});
  moe_tensor *three = vals(ctx, MOE_BF16, SHAPE(1), (double[]){3});
  EXPECT_OK(moe_binary(ctx, MOE_OP_DIV, one, three, &r));
  EXPECT_VALUES(r, 0, 0.333984375);
  moe_tensor_release(r);
  moe_tensor_release(one);
  moe_tensor_release(three);
  EXPECT_ERR_MSG(moe_binary(ctx, MOE_OP_SUB, b, b, &r), MOE_ERR_DTYPE, "sub: subtracting two bool");
  moe_tensor_release(i32);
  moe_tensor_release(i64);
  moe_tensor_release(u8);
  moe_tensor_release(i8);
  moe_tensor_release(b);
  moe_tensor_release(bf);
  moe_tensor_release(hf);
  moe_tensor_release(f64);
}

static void test_scalar(moe_ctx *ctx) {
  moe_tensor *f = vals(ctx, MOE_F32, SHAPE(2, 2), (double[]){1, 2, 3, 4});
  moe_tensor *h = vals(ctx, MOE_F16, SHAPE(2), (double[]){1, 2});
  moe_tensor *i = vals(ctx, MOE_I32, SHAPE(3), (double[]){7, -7, 0});
  moe_tensor *b = vals(ctx, MOE_BOOL, SHAPE(2), (double[]){1, 0});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_SUB, f, 0.5, false, &r));
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 0.5, 1.5, 2.5, 3.5);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_SUB, f, 0.5, true, &r)); /* 0.5 - f */
  EXPECT_VALUES(r, 0, -0.5, -1.5, -2.5, -3.5);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_DIV, f, 1, true, &r)); /* 1 / f */
  EXPECT_VALUES(r, 1e-7, 1, 0.5, 1.0 / 3, 0.25);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, h, 1e6, false, &r)); /* no widening: inf */
  EXPECT(r->dtype == MOE_F16);
  EXPECT_VALUES(r, 0, INFINITY, INFINITY);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_ADD, i, 3, false, &r)); /* stays i32 */
  EXPECT(r->dtype == MOE_I32);
  EXPECT_VALUES(r, 0, 10, -4, 3);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_ADD, i, 0.5, false, &r)); /* non-integer: f32 */
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 7.5, -6.5, 0.5);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_DIV, i, 2, false, &r)); /* DIV: f32 */
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 3.5, -3.5, 0);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_DIV, i, 14, true, &r)); /* 14 / i */
  EXPECT_VALUES(r, 0, 2, -2, INFINITY);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_SUB, i, 10, true, &r)); /* 10 - i */
  EXPECT_VALUES(r, 0, 3, 17, 10);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, i, INFINITY, false, &r));
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, INFINITY, -INFINITY, NAN);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_ADD, b, 2, false, &r)); /* bool + int: i64 */
  EXPECT(r->dtype == MOE_I64);
  EXPECT_VALUES(r, 0, 3, 2);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, b, 2.5, false, &r));
  EXPECT(r->dtype == MOE_F32);
  EXPECT_VALUES(r, 0, 2.5, 0);
  moe_tensor_release(r);
  EXPECT_ERR_MSG(moe_binary_scalar(ctx, MOE_OP_NEG, f, 1, false, &r), MOE_ERR_INVALID_ARG,
                 "binary_scalar: neg (op 4) is not a binary op");
  moe_tensor_release(f);
  moe_tensor_release(h);
  moe_tensor_release(i);
  moe_tensor_release(b);
}

static void test_unary(moe_ctx *ctx) {
  moe_tensor *f = vals(ctx, MOE_F32, SHAPE(3), (double[]){1.5, -2, 0});
  moe_tensor *i = vals(ctx, MOE_I64, SHAPE(2), (double[]){5, 0});
  moe_tensor *u = vals(ctx, MOE_U8, SHAPE(2), (double[]){1, 0});
  moe_tensor *b = vals(ctx, MOE_BOOL, SHAPE(2), (double[]){1, 0});
  moe_tensor *r = NULL;
  EXPECT_OK(moe_unary(ctx, MOE_OP_NEG, f, &r));
  EXPECT_VALUES(r, 0, -1.5, 2, -0.0);
  moe_tensor_release(r);
  EXPECT_OK(moe_unary(ctx, MOE_OP_NEG, i, &r));
  EXPECT(r->dtype == MOE_I64);
  EXPECT_VALUES(r, 0, -5, 0);
  moe_tensor_release(r);
  EXPECT_OK(moe_unary(ctx, MOE_OP_NEG, u, &r)); /* wraps like PyTorch */
  EXPECT_VALUES(r, 0, 255, 0);
  moe_tensor_release(r);
  EXPECT_ERR_MSG(moe_unary(ctx, MOE_OP_NEG, b, &r), MOE_ERR_DTYPE, "neg: negating a bool tensor");
  EXPECT_ERR_MSG(moe_unary(ctx, MOE_OP_ADD, f, &r), MOE_ERR_INVALID_ARG, "add (op 0) is not a unary op");
  /* int64 overflow wraps instead of trapping */
  moe_tensor *big = NULL;
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(1), MOE_I64, MOE_CPU, &big));
  *(int64_t *)moe_tensor_data(big) = INT64_MIN;
  EXPECT_OK(moe_unary(ctx, MOE_OP_NEG, big, &r));
  int64_t got;
  EXPECT_OK(moe_tensor_to_i64(ctx, r, &got));
  EXPECT(got == INT64_MIN);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary(ctx, MOE_OP_SUB, big, i, &r));
  int64_t g2[2];
  EXPECT_OK(moe_tensor_to_i64(ctx, r, g2));
  EXPECT(g2[0] == INT64_MAX - 4 && g2[1] == INT64_MIN);
  moe_tensor_release(r);
  moe_tensor_release(big);
  moe_tensor_release(f);
  moe_tensor_release(i);
  moe_tensor_release(u);
  moe_tensor_release(b);
}

static void test_strided_and_empty(moe_ctx *ctx) {
  moe_tensor *a = vals(ctx, MOE_F32, SHAPE(2, 3), (double[]){1, 2, 3, 4, 5, 6});
  moe_tensor *at = NULL, *r = NULL, *sl = NULL, *e = NULL, *row = NULL;
  EXPECT_OK(moe_transpose(ctx, a, 0, 1, &at)); /* [3, 2] */
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, at, at, &r));
  EXPECT(moe_tensor_is_contiguous(r));
  EXPECT_VALUES(r, 0, 1, 16, 4, 25, 9, 36);
  moe_tensor_release(r);
  EXPECT_OK(moe_slice(ctx, a, 1, 0, 3, 2, &sl)); /* [2, 2]: 1 3 / 4 6 */
  EXPECT_ERR(moe_binary(ctx, MOE_OP_SUB, sl, at, &r), MOE_ERR_SHAPE);
  EXPECT_OK(moe_unary(ctx, MOE_OP_NEG, sl, &r));
  EXPECT_VALUES(r, 0, -1, -3, -4, -6);
  moe_tensor_release(r);
  /* [0, 3] with [3]: a [0, 3] result */
  EXPECT_OK(moe_tensor_empty(ctx, SHAPE(0, 3), MOE_F32, MOE_CPU, &e));
  EXPECT_OK(moe_select(ctx, a, 0, 1, &row));
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, e, row, &r));
  EXPECT(r && r->ndim == 2 && r->shape[0] == 0 && r->shape[1] == 3);
  moe_tensor_release(r);
  EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_DIV, e, 2, true, &r));
  EXPECT(r && moe_tensor_numel(r) == 0);
  moe_tensor_release(r);
  EXPECT_OK(moe_unary(ctx, MOE_OP_NEG, e, &r));
  moe_tensor_release(r);
  moe_tensor *col = vals(ctx, MOE_F32, SHAPE(2, 1), (double[]){1, 2});
  EXPECT_ERR(moe_binary(ctx, MOE_OP_ADD, e, col, &r), MOE_ERR_SHAPE); /* 0 vs 2 */
  moe_tensor_release(col);
  moe_tensor_release(row);
  moe_tensor_release(e);
  moe_tensor_release(sl);
  moe_tensor_release(at);
  moe_tensor_release(a);
}

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static void test_large(moe_ctx *ctx) {
  /* 4M floats: contiguous fast path, broadcast row, and a transposed input */
  const int64_t n = 2048, m = 2048;
  moe_tensor *a = NULL, *b = NULL, *r = NULL, *row = NULL, *at = NULL;
  EXPECT_OK(moe_arange(ctx, 0, (double)(n * m), 1, MOE_F32, MOE_CPU, &r));
  EXPECT_OK(moe_view(ctx, r, SHAPE(n, m), &a));
  moe_tensor_release(r);
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(n, m), 2, MOE_F32, MOE_CPU, &b));
  double t0 = now();
  EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, a, b, &r));
  double t1 = now();
  printf("  mul of %lld contiguous f32: %.2f ms\n", (long long)(n * m), 1e3 * (t1 - t0));
  const float *p = moe_tensor_data(r);
  int bad = 0;
  for (int64_t i = 0; i < n * m; i += 977) bad += p[i] != 2.0f * (float)i;
  EXPECT(bad == 0);
  moe_tensor_release(r);
  EXPECT_OK(moe_arange(ctx, 0, (double)m, 1, MOE_F32, MOE_CPU, &row));
  EXPECT_OK(moe_binary(ctx, MOE_OP_SUB, a, row, &r)); /* a[i][j] - j = i * m */
  p = moe_tensor_data(r);
  bad = 0;
  for (int64_t i = 0; i < n * m; i += 977) bad += p[i] != (float)((i / m) * m);
  EXPECT(bad == 0);
  moe_tensor_release(r);
  EXPECT_OK(moe_transpose(ctx, a, 0, 1, &at));
  t0 = now();
  EXPECT_OK(moe_binary(ctx, MOE_OP_ADD, at, a, &r)); /* a[j][i] + a[i][j] */
  t1 = now();
  printf("  add of a transposed and a contiguous f32: %.2f ms\n", 1e3 * (t1 - t0));
  p = moe_tensor_data(r);
  bad = 0;
  for (int64_t i = 0; i < n; i += 31)
    for (int64_t j = 0; j < m; j += 37) bad += p[i * m + j] != (float)(j * m + i) + (float)(i * m + j);
  EXPECT(bad == 0);
  moe_tensor_release(r);
  moe_tensor_release(at);
  moe_tensor_release(row);
  moe_tensor_release(a);
  moe_tensor_release(b);
}

int main(void) {
  RUN(test_op_names);
  RUN(test_broadcast);
  RUN(test_promotion);
  RUN(test_scalar);
  RUN(test_unary);
  RUN(test_strided_and_empty);
  RUN(test_large);
  return harness_end();
}
