/*
 * test_errors.c - bad calls, one per error path: each must return the right
 * status with a message naming the function and the offending values, write
 * no output, and leak nothing (RUN checks the live host storages; the ASan
 * build checks the rest).
 */
#include "harness.h"
#include "internal.h"

#define SHAPE(...) (sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

/* An output that must stay untouched by a failed call. */
static moe_tensor *const UNTOUCHED = (moe_tensor *)&harness_failures;

#define EXPECT_FAILS(call, st, part) \
  do {                               \
    out = UNTOUCHED;                 \
    EXPECT_ERR_MSG(call, st, part);  \
    EXPECT(out == UNTOUCHED);        \
  } while (0)

static void test_create_errors(moe_ctx *ctx) {
  moe_tensor *out;
  const moe_device cuda0 = {MOE_DEVICE_CUDA, 0};
  EXPECT_FAILS(moe_tensor_empty(ctx, 9, (int64_t[9]){1}, MOE_F32, MOE_CPU, &out),
               MOE_ERR_INVALID_ARG, "empty: ndim 9 exceeds the maximum of 8");
  EXPECT_FAILS(moe_tensor_empty(ctx, -1, NULL, MOE_F32, MOE_CPU, &out), MOE_ERR_INVALID_ARG,
               "empty: ndim -1 is negative");
  EXPECT_FAILS(moe_tensor_empty(ctx, SHAPE(2, 3, -1), MOE_F32, MOE_CPU, &out),
               MOE_ERR_INVALID_ARG, "empty: dim 2 has negative size -1");
  EXPECT_FAILS(moe_tensor_empty(ctx, 2, NULL, MOE_F32, MOE_CPU, &out), MOE_ERR_INVALID_ARG,
               "empty: shape is NULL");
  EXPECT_FAILS(moe_tensor_empty(ctx, SHAPE(2), (moe_dtype)-1, MOE_CPU, &out), MOE_ERR_DTYPE,
               "empty: unknown dtype -1");
  EXPECT_FAILS(moe_tensor_empty(ctx, SHAPE(INT64_C(1) << 40, INT64_C(1) << 40), MOE_F32, MOE_CPU,
                                &out),
               MOE_ERR_INVALID_ARG, "empty: shape [1099511627776, 1099511627776] has more than 2^63");
  EXPECT_FAILS(moe_tensor_empty(ctx, SHAPE(INT64_C(1) << 61), MOE_F64, MOE_CPU, &out),
               MOE_ERR_INVALID_ARG, "needs more than 2^63 bytes");
#if !defined(__SANITIZE_ADDRESS__)
  /* 2^60 bytes: a clean out-of-memory (ASan would report the huge request) */
  EXPECT_FAILS(moe_tensor_empty(ctx, SHAPE(INT64_C(1) << 57), MOE_F64, MOE_CPU, &out),
               MOE_ERR_OUT_OF_MEMORY, "out of host memory allocating 1152921504606846976 bytes");
#endif
  if (moe_cuda_device_count(ctx) == 0)
    EXPECT_FAILS(moe_tensor_empty(ctx, SHAPE(2), MOE_F32, cuda0, &out),
                 moe_cuda_built() ? MOE_ERR_DEVICE : MOE_ERR_NOT_SUPPORTED, "cuda:0 requested");
  EXPECT_ERR_MSG(moe_tensor_full(ctx, SHAPE(2), 1, MOE_F32, MOE_CPU, NULL), MOE_ERR_INVALID_ARG,
                 "full: out is NULL");
  EXPECT_FAILS(moe_tensor_from_f64(ctx, NULL, SHAPE(2), MOE_F32, MOE_CPU, &out),
               MOE_ERR_INVALID_ARG, "from_f64: values is NULL");
  EXPECT_FAILS(moe_tensor_from_f64(ctx, (double[]){1}, SHAPE(-3), MOE_F32, MOE_CPU, &out),
               MOE_ERR_INVALID_ARG, "from_f64: dim 0 has negative size -3");
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 1, MOE_F32, MOE_CPU, &t));
  EXPECT_ERR_MSG(moe_tensor_to_f64(ctx, t, NULL), MOE_ERR_INVALID_ARG, "to_f64: values is NULL");
  int64_t iv[2];
  EXPECT_ERR_MSG(moe_tensor_to_i64(ctx, NULL, iv), MOE_ERR_INVALID_ARG, "to_i64: tensor is NULL");
  moe_tensor_release(t);
  EXPECT_FAILS(moe_arange(ctx, 0, 1, 0, MOE_F32, MOE_CPU, &out), MOE_ERR_INVALID_ARG,
               "arange: step must be nonzero");
  EXPECT_FAILS(moe_arange(ctx, 5, 0, 1, MOE_F32, MOE_CPU, &out), MOE_ERR_INVALID_ARG,
               "arange: step 1 goes away from end 0 starting at 5");
  EXPECT_FAILS(moe_arange(ctx, 0, 5, 1, (moe_dtype)12, MOE_CPU, &out), MOE_ERR_DTYPE,
               "arange: unknown dtype 12");
  EXPECT_FAILS(moe_linspace(ctx, 0, 1, -2, MOE_F32, MOE_CPU, &out), MOE_ERR_INVALID_ARG,
               "linspace: steps -2 is negative");
  EXPECT_FAILS(moe_linspace(ctx, 0, INFINITY, 2, MOE_F32, MOE_CPU, &out), MOE_ERR_INVALID_ARG,
               "linspace: start 0 and end inf must be finite");
  /* a NULL context cannot carry a message, but must not crash */
  EXPECT(moe_tensor_empty(NULL, SHAPE(2), MOE_F32, MOE_CPU, &out) == MOE_ERR_INVALID_ARG);
  EXPECT(moe_binary(NULL, MOE_OP_ADD, NULL, NULL, &out) == MOE_ERR_INVALID_ARG);
  EXPECT(moe_device_check(NULL, MOE_CPU) == MOE_ERR_INVALID_ARG);
}

static void test_view_errors(moe_ctx *ctx) {
  moe_tensor *out, *t = NULL, *r = NULL, *tr = NULL;
  EXPECT_OK(moe_arange(ctx, 0, 30, 1, MOE_F32, MOE_CPU, &r));
  EXPECT_OK(moe_view(ctx, r, SHAPE(5, 6), &t));
  EXPECT_OK(moe_transpose(ctx, t, 0, 1, &tr));
  EXPECT_FAILS(moe_view(ctx, t, SHAPE(4, 7), &out), MOE_ERR_SHAPE,
               "view: shape [4, 7] is invalid for a tensor of 30 elements");
  EXPECT_FAILS(moe_view(ctx, tr, SHAPE(30), &out), MOE_ERR_SHAPE,
               "view: shape [30] cannot view a tensor of shape [6, 5] and strides [1, 6] without a "
               "copy (use reshape, or contiguous first)");
  EXPECT_FAILS(moe_view(ctx, t, SHAPE(-1, -1), &out), MOE_ERR_SHAPE,
               "view: shape [-1, -1] has more than one -1");
  EXPECT_FAILS(moe_view(ctx, NULL, SHAPE(30), &out), MOE_ERR_INVALID_ARG, "view: tensor is NULL");
  EXPECT_ERR_MSG(moe_view(ctx, t, SHAPE(30), NULL), MOE_ERR_INVALID_ARG, "view: out is NULL");
  EXPECT_FAILS(moe_reshape(ctx, tr, SHAPE(7, -1), &out), MOE_ERR_SHAPE,
               "reshape: shape [7, -1] is invalid for a tensor of 30 elements");
  EXPECT_FAILS(moe_reshape(ctx, t, 9, (int64_t[9]){1}, &out), MOE_ERR_INVALID_ARG,
               "reshape: ndim 9 exceeds the maximum of 8");
  EXPECT_FAILS(moe_transpose(ctx, t, 0, 2, &out), MOE_ERR_INVALID_ARG,
               "transpose: dim 2 is out of range for a tensor of 2 dims (expected -2 to 1)");
  EXPECT_FAILS(moe_transpose(ctx, t, -3, 0, &out), MOE_ERR_INVALID_ARG, "transpose: dim -3");
  EXPECT_FAILS(moe_permute(ctx, t, 1, (int64_t[]){0}, &out), MOE_ERR_SHAPE,
               "permute: 1 dims given for a tensor of 2 dims");
  EXPECT_FAILS(moe_permute(ctx, t, 2, (int64_t[]){1, -1}, &out), MOE_ERR_INVALID_ARG,
               "permute: dim 1 appears twice in the permutation");
  EXPECT_FAILS(moe_narrow(ctx, tr, 1, 3, 3, &out), MOE_ERR_INVALID_ARG,
               "narrow: start 3 + length 3 exceeds size 5 of dim 1");
  EXPECT_FAILS(moe_narrow(ctx, t, 1, -7, 1, &out), MOE_ERR_INVALID_ARG,
               "narrow: start -7 is out of range for size 6 of dim 1");
  EXPECT_FAILS(moe_narrow(ctx, t, 0, 0, -2, &out), MOE_ERR_INVALID_ARG,
               "narrow: length -2 is negative");
  EXPECT_FAILS(moe_slice(ctx, t, 0, 0, 5, -1, &out), MOE_ERR_INVALID_ARG,
               "slice: step -1 must be >= 1");
  EXPECT_FAILS(moe_select(ctx, t, 1, 6, &out), MOE_ERR_INVALID_ARG,
               "select: index 6 is out of range for size 6 of dim 1");
  EXPECT_FAILS(moe_select(ctx, r, 1, 0, &out), MOE_ERR_INVALID_ARG,
               "select: dim 1 is out of range for a tensor of 1 dim (expected -1 to 0)");
  EXPECT_FAILS(moe_expand(ctx, t, SHAPE(5, 7), &out), MOE_ERR_SHAPE,
               "expand: shape [5, 6] cannot be expanded to [5, 7] (dim 1 has size 6, only size-1 "
               "dims expand)");
  EXPECT_FAILS(moe_expand(ctx, t, SHAPE(6), &out), MOE_ERR_SHAPE,
               "expand: target shape [6] has fewer dims than the tensor's shape [5, 6]");
  EXPECT_FAILS(moe_expand(ctx, t, SHAPE(5, -3), &out), MOE_ERR_SHAPE,
               "expand: dim 1 has negative size -3");
  EXPECT_FAILS(moe_squeeze(ctx, t, 5, false, &out), MOE_ERR_INVALID_ARG, "squeeze: dim 5");
  EXPECT_FAILS(moe_unsqueeze(ctx, t, -4, &out), MOE_ERR_INVALID_ARG,
               "unsqueeze: dim -4 is out of range for a tensor of 2 dims (expected -3 to 2)");
  EXPECT_FAILS(moe_contiguous(ctx, NULL, &out), MOE_ERR_INVALID_ARG, "contiguous: tensor is NULL");
  moe_tensor *s = NULL;
  EXPECT_OK(moe_select(ctx, r, 0, 0, &s)); /* a scalar has no dims to name */
  EXPECT_FAILS(moe_transpose(ctx, s, 0, 0, &out), MOE_ERR_INVALID_ARG,
               "transpose: dim 0 given for a tensor with no dims");
  moe_tensor_release(s);
  int d = 77;
  EXPECT_ERR_MSG(moe_dim_normalize(ctx, 9, 2, true, &d), MOE_ERR_INVALID_ARG,
                 "dim 9 is out of range for a tensor of 2 dims (expected -3 to 2)");
  EXPECT(d == 77);
  moe_tensor_release(tr);
  moe_tensor_release(t);
  moe_tensor_release(r);
}

static void test_write_errors(moe_ctx *ctx) {
  moe_tensor *out, *a = NULL, *b = NULL, *one = NULL, *ex = NULL, *i = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1, MOE_F32, MOE_CPU, &a));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(4), 2, MOE_F32, MOE_CPU, &b));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(1), 3, MOE_F32, MOE_CPU, &one));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 3, MOE_I32, MOE_CPU, &i));
  EXPECT_OK(moe_expand(ctx, one, SHAPE(2, 3), &ex));
  EXPECT_ERR_MSG(moe_copy_(ctx, a, b), MOE_ERR_SHAPE,
                 "copy_: source shape [4] cannot be broadcast to destination shape [2, 3]");
  EXPECT_ERR_MSG(moe_copy_(ctx, ex, a), MOE_ERR_INVALID_ARG,
                 "copy_: cannot write into a tensor whose elements overlap (dim 0 has size 2 and "
                 "stride 0, as after expand); clone it first");
  EXPECT_ERR_MSG(moe_copy_(ctx, a, NULL), MOE_ERR_INVALID_ARG, "copy_: source is NULL");
  EXPECT_ERR_MSG(moe_copy_(ctx, NULL, a), MOE_ERR_INVALID_ARG, "copy_: destination is NULL");
  EXPECT_VALUES(one, 0, 3);
  EXPECT_FAILS(moe_to(ctx, a, MOE_DTYPE_COUNT, MOE_CPU, &out), MOE_ERR_DTYPE, "to: unknown dtype 9");
  EXPECT_FAILS(moe_to(ctx, NULL, MOE_F32, MOE_CPU, &out), MOE_ERR_INVALID_ARG, "to: tensor is NULL");
  EXPECT_ERR_MSG(moe_clone(ctx, a, NULL), MOE_ERR_INVALID_ARG, "clone: out is NULL");
  EXPECT_ERR_MSG(moe_fill_(ctx, NULL, 1), MOE_ERR_INVALID_ARG, "fill_: tensor is NULL");
  EXPECT_ERR_MSG(moe_fill_(ctx, ex, 1), MOE_ERR_INVALID_ARG, "fill_: cannot write");
  EXPECT_ERR_MSG(moe_uniform_(ctx, i, 0, 1), MOE_ERR_DTYPE,
                 "uniform_: needs a float tensor, got i32 (use randint_ for integers)");
  EXPECT_ERR_MSG(moe_normal_(ctx, a, 0, -1), MOE_ERR_INVALID_ARG,
                 "normal_: needs a finite mean and std >= 0, got mean 0 and std -1");
  EXPECT_ERR_MSG(moe_randint_(ctx, i, 3, 2), MOE_ERR_INVALID_ARG,
                 "randint_: high 2 must be greater than low 3");
  EXPECT_ERR_MSG(moe_randint_(ctx, a, 0, INT64_C(1) << 30), MOE_ERR_INVALID_ARG,
                 "randint_: [0, 1073741824) does not fit dtype f32 (which holds -16777216 to "
                 "16777216 exactly)");
  EXPECT_ERR_MSG(moe_normal_(ctx, ex, 0, 1), MOE_ERR_INVALID_ARG, "normal_: cannot write");
  moe_tensor_release(ex);
  moe_tensor_release(i);
  moe_tensor_release(one);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

static void test_op_errors(moe_ctx *ctx) {
  moe_tensor *out, *a = NULL, *b = NULL, *flag = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), 1, MOE_F32, MOE_CPU, &a));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(4), 2, MOE_F32, MOE_CPU, &b));
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(3), 1, MOE_BOOL, MOE_CPU, &flag));
  EXPECT_FAILS(moe_binary(ctx, MOE_OP_ADD, a, b, &out), MOE_ERR_SHAPE,
               "add: shapes [2, 3] and [4] cannot be broadcast");
  EXPECT_FAILS(moe_binary(ctx, MOE_OP_DIV, b, a, &out), MOE_ERR_SHAPE,
               "div: shapes [4] and [2, 3] cannot be broadcast");
  EXPECT_FAILS(moe_binary(ctx, MOE_OP_NEG, a, a, &out), MOE_ERR_INVALID_ARG,
               "binary: neg (op 4) is not a binary op");
  EXPECT_FAILS(moe_binary(ctx, (moe_op)177, a, a, &out), MOE_ERR_INVALID_ARG,
               "binary: op? (op 177) is not a binary op");
  EXPECT_FAILS(moe_binary(ctx, MOE_OP_MUL, a, NULL, &out), MOE_ERR_INVALID_ARG,
               "mul: second operand is NULL");
  EXPECT_FAILS(moe_binary(ctx, MOE_OP_SUB, flag, flag, &out), MOE_ERR_DTYPE,
               "sub: subtracting two bool tensors is not supported");
  EXPECT_FAILS(moe_unary(ctx, MOE_OP_NEG, flag, &out), MOE_ERR_DTYPE,
               "neg: negating a bool tensor is not supported");
  EXPECT_FAILS(moe_unary(ctx, MOE_OP_MUL, a, &out), MOE_ERR_INVALID_ARG,
               "unary: mul (op 2) is not a unary op");
  EXPECT_FAILS(moe_unary(ctx, MOE_OP_NEG, NULL, &out), MOE_ERR_INVALID_ARG,
               "neg: first operand is NULL");
  EXPECT_ERR_MSG(moe_binary_scalar(ctx, MOE_OP_ADD, a, 1, false, NULL), MOE_ERR_INVALID_ARG,
                 "add: out is NULL");
  /* a tensor that claims to live on cuda:0 (never dereferenced) */
  moe_storage fake_storage = *a->storage;
  fake_storage.device = (moe_device){MOE_DEVICE_CUDA, 0};
  moe_tensor fake = *a;
  fake.storage = &fake_storage;
  EXPECT_FAILS(moe_binary(ctx, MOE_OP_ADD, a, &fake, &out), MOE_ERR_DEVICE,
               "add: a is on cpu but b is on cuda:0");
  EXPECT_FAILS(moe_binary(ctx, MOE_OP_MUL, &fake, a, &out), MOE_ERR_DEVICE,
               "mul: a is on cuda:0 but b is on cpu");
  if (moe_cuda_device_count(ctx) == 0) {
    moe_status st = moe_cuda_built() ? MOE_ERR_DEVICE : MOE_ERR_NOT_SUPPORTED;
    EXPECT_ERR_MSG(moe_copy_(ctx, a, &fake), st, "cuda:0 requested");
    EXPECT_FAILS(moe_unary(ctx, MOE_OP_NEG, &fake, &out), st, "cuda:0 requested");
  }
  moe_tensor_release(flag);
  moe_tensor_release(b);
  moe_tensor_release(a);
}

static void test_misc_errors(moe_ctx *ctx) {
  moe_device d = MOE_CPU;
  EXPECT_ERR_MSG(moe_device_parse(ctx, "cuda:zero", &d), MOE_ERR_INVALID_ARG,
                 "device: unknown device \"cuda:zero\" (expected \"cpu\", \"cuda\", \"cuda:N\" or "
                 "\"gpu\")");
  EXPECT_ERR_MSG(moe_device_parse(ctx, "cpu", NULL), MOE_ERR_INVALID_ARG, "device: out is NULL");
  EXPECT_ERR_MSG(moe_memory_stats_get(ctx, MOE_CPU, NULL), MOE_ERR_INVALID_ARG,
                 "memory_stats: out is NULL");
  EXPECT_ERR_MSG(moe_memory_reset_peak(ctx, (moe_device){MOE_DEVICE_CUDA, -1}), MOE_ERR_INVALID_ARG,
                 "cuda:-1 is not a device");
  moe_storage *s = (moe_storage *)&harness_failures;
  EXPECT_ERR_MSG(moe_storage_new(ctx, MOE_CPU, 16, NULL), MOE_ERR_INVALID_ARG,
                 "storage_new: out is NULL");
  EXPECT(s == (moe_storage *)&harness_failures);
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 1, MOE_F32, MOE_CPU, &t));
  moe_print_options o = moe_print_options_default();
  o.edgeitems = -1;
  char *str = NULL;
  EXPECT_ERR_MSG(moe_tensor_format(ctx, t, &o, &str), MOE_ERR_INVALID_ARG,
                 "format: bad print options");
  EXPECT(str == NULL);
  moe_tensor_release(t);
  /* after an error, the next success does not clear the message, clear does */
  EXPECT(moe_ctx_status(ctx) == MOE_ERR_INVALID_ARG);
  moe_ctx_clear(ctx);
  EXPECT(moe_ctx_status(ctx) == MOE_OK && moe_ctx_error(ctx)[0] == 0);
}

int main(void) {
  RUN(test_create_errors);
  RUN(test_view_errors);
  RUN(test_write_errors);
  RUN(test_op_errors);
  RUN(test_misc_errors);
  return harness_end();
}
