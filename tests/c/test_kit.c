/*
 * test_kit.c - the op kit of core/internal.h that every family records,
 * checks and names with: moe_record (nothing without grad; the node's
 * inputs, saved slots, arguments, payload and outputs; the one failure
 * contract: outputs released and NULLed, the payload freed),
 * moe_node_zeros_input / moe_node_zero_grads, the one wording of a device or
 * dtype mismatch, and MOE_SHAPE holding an eight-dim shape of the largest
 * sizes. CPU only.
 */
#include <string.h>

#include "harness.h"
#include "internal.h"

#define SHAPE(...) (int)(sizeof((int64_t[]){__VA_ARGS__}) / sizeof(int64_t)), (int64_t[]){__VA_ARGS__}

static int payload_frees = 0;
static void payload_free(void *p) {
  payload_frees++;
  free(p);
}

/* d out / d in = 1 for input 0 (the test op is an identity on it). */
static moe_status ident_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                 moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  moe_tensor_retain(gout[0]);
  gin[0] = gout[0];
  return MOE_OK;
}

static int64_t live(moe_ctx *ctx) {
  moe_memory_stats s;
  EXPECT_OK(moe_memory_stats_get(ctx, MOE_CPU, &s));
  return s.live_storages;
}

static moe_tensor *full(moe_ctx *ctx, double v, bool requires_grad) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2, 3), v, MOE_F32, MOE_CPU, &t));
  if (requires_grad) EXPECT_OK(moe_set_requires_grad(ctx, t, true));
  return t;
}

static void test_record_without_grad(moe_ctx *ctx) {
  moe_tensor *x = full(ctx, 1, false), *out = full(ctx, 1, false);
  payload_frees = 0;
  int *p = malloc(sizeof *p);
  EXPECT_OK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_CUSTOM, .backward = ident_backward,
                                                .n_in = 1, .in = {x}, .user = p,
                                                .user_free = payload_free},
                       1, &out));
  EXPECT(out != NULL);                 /* untouched */
  EXPECT(moe_tensor_grad_fn(out) == NULL);
  EXPECT(payload_frees == 1);          /* the payload is the callee's either way */
  /* grad mode off: the same with an input that requires grad */
  moe_tensor *y = full(ctx, 1, true);
  bool prev = moe_grad_set(ctx, false);
  EXPECT_OK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_CUSTOM, .backward = ident_backward,
                                                .n_in = 1, .in = {y}},
                       1, &out));
  moe_grad_set(ctx, prev);
  EXPECT(moe_tensor_grad_fn(out) == NULL);
  moe_tensor_release(x);
  moe_tensor_release(y);
  moe_tensor_release(out);
}

static void test_record_node(moe_ctx *ctx) {
  int64_t before = live(ctx);
  moe_tensor *x = full(ctx, 2, true), *w = full(ctx, 3, false), *out = full(ctx, 0, false);
  payload_frees = 0;
  int *p = malloc(sizeof *p);
  EXPECT_OK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_CUSTOM, .backward = ident_backward,
                                                .n_in = 3, .in = {x, NULL, w}, .n_save = 2,
                                                .save = {NULL, w}, .iargs = {7, -1},
                                                .dargs = {0.5}, .user = p,
                                                .user_free = payload_free, .name = "kit_op"},
                       1, &out));
  moe_node *n = moe_tensor_grad_fn(out);
  EXPECT(n != NULL);
  if (n) {
    EXPECT(n->n_inputs == 3 && n->n_saved == 2 && n->n_outputs == 1);
    EXPECT(moe_node_needs_grad(n, 0) && !moe_node_needs_grad(n, 1) && !moe_node_needs_grad(n, 2));
    EXPECT(n->iargs[0] == 7 && n->iargs[1] == -1 && n->dargs[0] == 0.5);
    EXPECT(n->user == p && payload_frees == 0);
    EXPECT_STR(moe_node_name(n), "kit_op");
    moe_tensor *s0 = (moe_tensor *)1, *s1 = NULL;
    EXPECT_OK(moe_node_saved(ctx, n, 0, &s0));
    EXPECT(s0 == NULL); /* an empty slot reads back as NULL */
    EXPECT_OK(moe_node_saved(ctx, n, 1, &s1));
    EXPECT(s1 != NULL && s1->storage == w->storage);
    moe_tensor_release(s1);
  }
  moe_tensor *ones = full(ctx, 1, false);
  EXPECT_OK(moe_backward(ctx, out, ones, false));
  EXPECT(moe_tensor_grad(x) != NULL);
  EXPECT(payload_frees == 0); /* the output still holds its node */
  moe_tensor_release(ones);
  moe_tensor_release(out);
  EXPECT(payload_frees == 1); /* the node went with its last output, and its payload */
  moe_tensor_release(x);
  moe_tensor_release(w);
  EXPECT(live(ctx) == before);
}

static void test_record_failure(moe_ctx *ctx) {
  int64_t before = live(ctx);
  moe_tensor *x = full(ctx, 1, true);
  moe_tensor *outs[2] = {full(ctx, 0, false), full(ctx, 0, false)};
  payload_frees = 0;
  /* too many saved tensors: fails before the node exists */
  EXPECT_ERR_MSG(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_CUSTOM,
                                                    .backward = ident_backward, .n_in = 1,
                                                    .in = {x}, .n_save = MOE_NODE_MAX_SAVED + 1,
                                                    .user = malloc(4), .user_free = payload_free},
                           2, outs),
                 MOE_ERR_INVALID_ARG, "saved tensors");
  EXPECT(outs[0] == NULL && outs[1] == NULL && payload_frees == 1);
  /* an integer output cannot carry a gradient: fails after the node exists */
  moe_tensor *f = full(ctx, 0, false), *i = NULL;
  EXPECT_OK(moe_tensor_full(ctx, SHAPE(2), 0, MOE_I64, MOE_CPU, &i));
  moe_tensor *outs2[2] = {f, i};
  EXPECT_ERR(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_CUSTOM, .backward = ident_backward,
                                                 .n_in = 1, .in = {x}, .n_save = 1, .save = {x},
                                                 .user = malloc(4), .user_free = payload_free},
                        2, outs2),
             MOE_ERR_DTYPE);
  EXPECT(outs2[0] == NULL && outs2[1] == NULL && payload_frees == 2);
  moe_tensor_release(x);
  EXPECT(live(ctx) == before); /* nothing leaked: outputs, node and saved x all gone */
}

static void test_zero_grads(moe_ctx *ctx) {
  moe_tensor *x = full(ctx, 1, true), *w = full(ctx, 1, false), *out = full(ctx, 0, false);
  EXPECT_OK(moe_record(ctx, &(moe_record_spec){.op = MOE_OP_CUSTOM, .backward = ident_backward,
                                                .n_in = 2, .in = {w, x}},
                       1, &out));
  moe_node *n = moe_tensor_grad_fn(out);
  moe_tensor *gin[2] = {NULL, NULL};
  EXPECT_OK(moe_node_zero_grads(ctx, n, gin));
  EXPECT(gin[0] == NULL); /* w needs no gradient */
  EXPECT(gin[1] != NULL && gin[1]->ndim == 2 && gin[1]->shape[1] == 3 && gin[1]->dtype == MOE_F32);
  if (gin[1]) {
    double v[6];
    EXPECT_OK(moe_tensor_to_f64(ctx, gin[1], v));
    EXPECT(v[0] == 0 && v[5] == 0);
  }
  moe_tensor_release(gin[1]);
  moe_tensor_release(out);
  moe_tensor_release(x);
  moe_tensor_release(w);
}

static void test_mismatch_and_shapes(moe_ctx *ctx) {
  EXPECT_OK(moe_check_same_device(ctx, "f", "a", MOE_CPU, "b", MOE_CPU));
  moe_device gpu = {MOE_DEVICE_CUDA, 1};
  EXPECT_ERR_MSG(moe_check_same_device(ctx, "matmul", "a", gpu, "b", MOE_CPU), MOE_ERR_DEVICE,
                 "matmul: a is on cuda:1 but b is on cpu");
  EXPECT_OK(moe_check_same_dtype(ctx, "f", "a", MOE_BF16, "b", MOE_BF16));
  EXPECT_ERR_MSG(moe_check_same_dtype(ctx, "bsmm_sdd", "x", MOE_F64, "w", MOE_F32), MOE_ERR_DTYPE,
                 "bsmm_sdd: x is f64 but w is f32");
  int64_t big[MOE_MAX_DIMS];
  for (int d = 0; d < MOE_MAX_DIMS; d++) big[d] = INT64_MIN; /* the longest number there is */
  const char *s = MOE_SHAPE_OF(MOE_MAX_DIMS, big);
  EXPECT(strlen(s) == (size_t)MOE_MAX_DIMS * 20 + (MOE_MAX_DIMS - 1) * 2 + 2);
  EXPECT(s[strlen(s) - 1] == ']');
  moe_tensor *t = full(ctx, 0, false);
  EXPECT_STR(MOE_SHAPE(t), "[2, 3]");
  EXPECT_STR(MOE_DEVICE(gpu), "cuda:1");
  moe_tensor_release(t);
}

int main(void) {
  RUN(test_record_without_grad);
  RUN(test_record_node);
  RUN(test_record_failure);
  RUN(test_zero_grads);
  RUN(test_mismatch_and_shapes);
  return harness_end();
}
