/*
 * test_dist.c - moe_dist.h in one process: a world of one rank started
 * without a launcher (no MPI), where every collective is a local copy; the
 * argument checks every rank makes (shapes, dtypes, splits, peers, roots,
 * reduce ops, contiguity); reduce op names; works; splits; timeouts; and
 * finalize. tests/dist/ runs the collectives over MPI with 2 and 4 ranks.
 */
#define _POSIX_C_SOURCE 200809L /* setenv, unsetenv */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "moe_dist.h"

static const char *const launcher_vars[] = {
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
    "MOE_DIST_TIMEOUT", "MOE_DIST_DEBUG", NULL};

static moe_tensor *vec(moe_ctx *ctx, moe_dtype dt, int64_t n, double base) {
  double v[64];
  for (int64_t i = 0; i < n; i++) v[i] = base + (double)i;
  moe_tensor *t = NULL;
  moe_tensor_from_f64(ctx, v, 1, &n, dt, MOE_CPU, &t);
  return t;
}

static moe_tensor *mat(moe_ctx *ctx, moe_dtype dt, int64_t rows, int64_t cols, double base) {
  double v[64];
  for (int64_t i = 0; i < rows * cols; i++) v[i] = base + (double)i;
  int64_t shape[2] = {rows, cols};
  moe_tensor *t = NULL;
  moe_tensor_from_f64(ctx, v, 2, shape, dt, MOE_CPU, &t);
  return t;
}

static void test_reduce_op_names(moe_ctx *ctx) {
  const char *names[] = {"sum", "avg", "max", "min"};
  for (int i = 0; i < MOE_REDUCE_COUNT; i++) {
    EXPECT_STR(moe_reduce_op_name((moe_reduce_op)i), names[i]);
    moe_reduce_op op = MOE_REDUCE_COUNT;
    EXPECT(moe_reduce_op_parse(names[i], &op) && op == (moe_reduce_op)i);
  }
  moe_reduce_op op = MOE_REDUCE_SUM;
  EXPECT(!moe_reduce_op_parse("mean", &op));
  EXPECT(!moe_reduce_op_parse(NULL, &op));
  EXPECT_STR(moe_reduce_op_name(MOE_REDUCE_COUNT), "unknown");
}

static void test_world_of_one(moe_ctx *ctx) {
  moe_comm *w = NULL, *w2 = NULL;
  EXPECT(!moe_dist_initialized());
  EXPECT_OK(moe_dist_init(ctx, &w));
  EXPECT(moe_dist_initialized());
  EXPECT_OK(moe_dist_init(ctx, &w2));
  EXPECT(w == w2); /* one world per process */
  EXPECT(moe_comm_rank(w) == 0 && moe_comm_size(w) == 1);
  EXPECT_STR(moe_comm_name(w), "world");
  EXPECT(moe_comm_world_rank(w, 0) == 0 && moe_comm_world_rank(w, 1) == -1);
  EXPECT(moe_comm_timeout(w) == 600.0);
  EXPECT_OK(moe_comm_barrier(ctx, w));
  moe_comm_free(w); /* the world is finalize's: a no-op */
  EXPECT(moe_comm_size(w) == 1);
}

static void test_collectives_copy(moe_ctx *ctx) {
  moe_comm *w = NULL;
  EXPECT_OK(moe_dist_init(ctx, &w));
  const moe_dtype dts[] = {MOE_F32, MOE_F64, MOE_BF16, MOE_F16, MOE_I32, MOE_I64};
  for (size_t k = 0; k < sizeof dts / sizeof dts[0]; k++) {
    moe_dtype dt = dts[k];
    moe_tensor *t = vec(ctx, dt, 4, 1);
    for (int op = 0; op < MOE_REDUCE_COUNT; op++) {
      if (op == MOE_REDUCE_AVG && !moe_dtype_is_float(dt)) continue;
      EXPECT_OK(moe_all_reduce(ctx, w, t, (moe_reduce_op)op, NULL));
      EXPECT_VALUES(t, 0, 1, 2, 3, 4);
    }
    EXPECT_OK(moe_broadcast(ctx, w, t, 0, NULL));
    EXPECT_VALUES(t, 0, 1, 2, 3, 4);

    moe_tensor *out = vec(ctx, dt, 4, 0);
    EXPECT_OK(moe_all_gather(ctx, w, out, t, NULL));
    EXPECT_VALUES(out, 0, 1, 2, 3, 4);
    moe_tensor_release(out);

    moe_tensor *in2 = mat(ctx, dt, 2, 3, 10), *out2 = mat(ctx, dt, 2, 3, 0);
    EXPECT_OK(moe_reduce_scatter(ctx, w, out2, in2, MOE_REDUCE_SUM, NULL));
    EXPECT_VALUES(out2, 0, 10, 11, 12, 13, 14, 15);

    /* all_to_all with one rank: the rows it sends are the rows it gets */
    moe_tensor *in3 = mat(ctx, dt, 3, 2, 20), *out3 = mat(ctx, dt, 4, 2, 0);
    int64_t send[1] = {2}, recv[1] = {2};
    EXPECT_OK(moe_all_to_all(ctx, w, out3, in3, send, recv, NULL));
    EXPECT_VALUES(out3, 0, 20, 21, 22, 23, 4, 5, 6, 7);
    moe_tensor_release(in2);
    moe_tensor_release(out2);
    moe_tensor_release(in3);
    moe_tensor_release(out3);
    moe_tensor_release(t);
  }
}

static void test_works(moe_ctx *ctx) {
  moe_comm *w = NULL;
  EXPECT_OK(moe_dist_init(ctx, &w));
  moe_tensor *t = vec(ctx, MOE_F32, 3, 1), *out = vec(ctx, MOE_F32, 3, 0);
  moe_work *wk = NULL;
  EXPECT_OK(moe_all_reduce(ctx, w, t, MOE_REDUCE_AVG, &wk));
  EXPECT(wk != NULL);
  EXPECT(moe_work_done(ctx, wk));
  EXPECT_OK(moe_work_wait(ctx, wk));
  EXPECT_OK(moe_work_wait(ctx, wk)); /* twice is allowed */
  moe_work_free(ctx, wk);
  EXPECT_VALUES(t, 0, 1, 2, 3);
  /* freed unwaited */
  EXPECT_OK(moe_all_gather(ctx, w, out, t, &wk));
  moe_work_free(ctx, wk);
  EXPECT_VALUES(out, 0, 1, 2, 3);
  moe_work_free(ctx, NULL);
  EXPECT_ERR(moe_work_wait(ctx, NULL), MOE_ERR_INVALID_ARG);
  moe_tensor_release(t);
  moe_tensor_release(out);
}

static void test_argument_errors(moe_ctx *ctx) {
  moe_comm *w = NULL;
  EXPECT_OK(moe_dist_init(ctx, &w));
  moe_tensor *f = vec(ctx, MOE_F32, 4, 1), *d = vec(ctx, MOE_F64, 4, 1);
  moe_tensor *i64 = vec(ctx, MOE_I64, 4, 1), *b = vec(ctx, MOE_BOOL, 4, 0);
  moe_tensor *m = mat(ctx, MOE_F32, 2, 3, 0), *mt = NULL;
  EXPECT_OK(moe_transpose(ctx, m, 0, 1, &mt));
  moe_work *wk = (moe_work *)&wk;

  EXPECT_ERR_MSG(moe_all_reduce(ctx, NULL, f, MOE_REDUCE_SUM, NULL), MOE_ERR_INVALID_ARG,
                 "all_reduce: the communicator is NULL");
  EXPECT_ERR_MSG(moe_all_reduce(ctx, w, NULL, MOE_REDUCE_SUM, &wk), MOE_ERR_INVALID_ARG,
                 "all_reduce: tensor is NULL");
  EXPECT(wk == NULL); /* failure writes no work */
  EXPECT_ERR_MSG(moe_all_reduce(ctx, w, mt, MOE_REDUCE_SUM, NULL), MOE_ERR_INVALID_ARG,
                 "all_reduce: tensor [3, 2] must be contiguous");
  EXPECT_ERR_MSG(moe_all_reduce(ctx, w, i64, MOE_REDUCE_AVG, NULL), MOE_ERR_DTYPE,
                 "avg needs a float tensor (f32, f64, bf16, f16), got i64");
  EXPECT_ERR_MSG(moe_all_reduce(ctx, w, b, MOE_REDUCE_SUM, NULL), MOE_ERR_DTYPE,
                 "sum of bool tensors");
  EXPECT_OK(moe_all_reduce(ctx, w, b, MOE_REDUCE_MAX, NULL));
  EXPECT_ERR_MSG(moe_all_reduce(ctx, w, f, (moe_reduce_op)7, NULL), MOE_ERR_INVALID_ARG,
                 "unknown reduce op 7");

  EXPECT_ERR_MSG(moe_all_gather(ctx, w, f, d, NULL), MOE_ERR_DTYPE, "all_gather: output is f32 but input is f64");
  moe_tensor *f5 = vec(ctx, MOE_F32, 5, 0);
  EXPECT_ERR_MSG(moe_all_gather(ctx, w, f5, f, NULL), MOE_ERR_SHAPE,
                 "all_gather: output [5] has 5 elements but group 'world' of 1 ranks gathers 1 x 4 = 4");
  EXPECT_ERR_MSG(moe_all_gather(ctx, w, f, f, NULL), MOE_ERR_INVALID_ARG, "overlap");

  moe_tensor *m33 = mat(ctx, MOE_F32, 3, 3, 0);
  EXPECT_ERR_MSG(moe_reduce_scatter(ctx, w, m, m33, MOE_REDUCE_SUM, NULL), MOE_ERR_SHAPE,
                 "reduce_scatter: input [3, 3] must be (size * n, ...) for output [2, 3]");
  moe_tensor *i0 = vec(ctx, MOE_I32, 0, 0), *i1 = vec(ctx, MOE_I32, 0, 0);
  EXPECT_ERR_MSG(moe_reduce_scatter(ctx, w, i0, i1, MOE_REDUCE_AVG, NULL), MOE_ERR_DTYPE,
                 "reduce_scatter: avg needs a float tensor");

  EXPECT_ERR_MSG(moe_broadcast(ctx, w, f, 1, NULL), MOE_ERR_INVALID_ARG,
                 "broadcast: root 1 is not a rank of group 'world' (0..0)");
  EXPECT_ERR_MSG(moe_broadcast(ctx, w, f, -1, NULL), MOE_ERR_INVALID_ARG, "root -1");

  int64_t s1[1] = {2}, r1[1] = {3}, neg[1] = {-1}, big[1] = {5};
  moe_tensor *a = mat(ctx, MOE_F32, 4, 3, 0), *a2 = mat(ctx, MOE_F32, 4, 2, 0);
  EXPECT_ERR_MSG(moe_all_to_all(ctx, w, a, m, s1, r1, NULL), MOE_ERR_SHAPE,
                 "one rank, so it receives what it sends: send[0] = 2 but recv[0] = 3");
  EXPECT_ERR_MSG(moe_all_to_all(ctx, w, a, m, neg, r1, NULL), MOE_ERR_INVALID_ARG,
                 "send splits must be non-negative, got -1 rows for rank 0");
  EXPECT_ERR_MSG(moe_all_to_all(ctx, w, a, m, s1, big, NULL), MOE_ERR_SHAPE,
                 "the recv splits add up to 5 rows but output [4, 3] has 4");
  EXPECT_ERR_MSG(moe_all_to_all(ctx, w, a2, m, s1, s1, NULL), MOE_ERR_SHAPE,
                 "output [4, 2] and input [2, 3] must have rows of one shape");
  EXPECT_ERR_MSG(moe_all_to_all(ctx, w, a, m, NULL, s1, NULL), MOE_ERR_INVALID_ARG,
                 "send splits are NULL");

  EXPECT_ERR_MSG(moe_send(ctx, w, f, 0, NULL), MOE_ERR_INVALID_ARG,
                 "send: peer 0 is this rank of group 'world': a rank cannot send to itself");
  EXPECT_ERR_MSG(moe_recv(ctx, w, f, 0, NULL), MOE_ERR_INVALID_ARG, "cannot receive from itself");
  EXPECT_ERR_MSG(moe_send(ctx, w, f, 3, NULL), MOE_ERR_INVALID_ARG,
                 "send: peer 3 is not a rank of group 'world' (0..0)");

  EXPECT_ERR_MSG(moe_comm_set_timeout(ctx, w, 0), MOE_ERR_INVALID_ARG, "positive number of seconds");
  EXPECT_ERR_MSG(moe_comm_set_timeout(ctx, w, -1), MOE_ERR_INVALID_ARG, "got -1");
  EXPECT_OK(moe_comm_set_timeout(ctx, w, 2.5));
  EXPECT(moe_comm_timeout(w) == 2.5);
  EXPECT_OK(moe_comm_set_timeout(ctx, w, 600));

  moe_tensor *objs[] = {f, d, i64, b, m, mt, f5, m33, a, a2, i0, i1};
  for (size_t k = 0; k < sizeof objs / sizeof objs[0]; k++) moe_tensor_release(objs[k]);
}

static void test_split(moe_ctx *ctx) {
  moe_comm *w = NULL, *g = NULL;
  EXPECT_OK(moe_dist_init(ctx, &w));
  EXPECT_OK(moe_comm_split(ctx, w, 0, 0, "ep", &g));
  EXPECT(moe_comm_size(g) == 1 && moe_comm_rank(g) == 0);
  EXPECT_STR(moe_comm_name(g), "ep");
  EXPECT(moe_comm_world_rank(g, 0) == 0);
  moe_tensor *t = vec(ctx, MOE_F32, 2, 5);
  EXPECT_OK(moe_all_reduce(ctx, g, t, MOE_REDUCE_SUM, NULL));
  EXPECT_VALUES(t, 0, 5, 6);
  moe_tensor_release(t);
  moe_comm_free(g);
  moe_comm *h = NULL;
  EXPECT_ERR_MSG(moe_comm_split(ctx, w, -1, 0, "x", &h), MOE_ERR_INVALID_ARG, "color must be >= 0");
  EXPECT(h == NULL);
  EXPECT_ERR_MSG(moe_comm_split(ctx, w, 0, 0, "", &h), MOE_ERR_INVALID_ARG, "the name must have");
  EXPECT_ERR(moe_comm_split(ctx, w, 0, 0, "x", NULL), MOE_ERR_INVALID_ARG);
  moe_comm_free(NULL);
}

static void test_env_knobs(moe_ctx *ctx) {
  moe_dist_finalize(); /* a world without MPI can start again */
  EXPECT(!moe_dist_initialized());
  setenv("MOE_DIST_TIMEOUT", "soon", 1);
  moe_comm *w = NULL;
  EXPECT_ERR_MSG(moe_dist_init(ctx, &w), MOE_ERR_INVALID_ARG,
                 "MOE_DIST_TIMEOUT must be a positive number of seconds, got 'soon'");
  setenv("MOE_DIST_TIMEOUT", "7.5", 1);
  setenv("MOE_DIST_DEBUG", "yes", 1);
  EXPECT_ERR_MSG(moe_dist_init(ctx, &w), MOE_ERR_INVALID_ARG, "MOE_DIST_DEBUG must be 0 or 1");
  setenv("MOE_DIST_DEBUG", "1", 1);
  EXPECT_OK(moe_dist_init(ctx, &w));
  EXPECT(moe_comm_timeout(w) == 7.5);
  moe_tensor *t = vec(ctx, MOE_F32, 2, 1);
  EXPECT_OK(moe_all_reduce(ctx, w, t, MOE_REDUCE_SUM, NULL)); /* one rank: nothing to check */
  moe_tensor_release(t);
  unsetenv("MOE_DIST_TIMEOUT");
  unsetenv("MOE_DIST_DEBUG");
  moe_dist_finalize();
  moe_dist_finalize(); /* twice is safe */
  moe_dist_abort(3);   /* returns without MPI */
}

/* Collective timing in a world of one: off by default, reading while off
 * fails, a group of one is not counted, on/off/reset; op names. */
static void test_comm_timing(moe_ctx *ctx) {
  const char *names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast",
                         "all_to_all", "send", "recv"};
  for (int i = 0; i < MOE_COMM_OP_COUNT; i++) {
    EXPECT_STR(moe_comm_op_name((moe_comm_op)i), names[i]);
    moe_comm_op op = MOE_COMM_OP_COUNT;
    EXPECT(moe_comm_op_parse(names[i], &op) && op == (moe_comm_op)i);
  }
  EXPECT(!moe_comm_op_parse("barrier", NULL) && !moe_comm_op_parse(NULL, NULL));
  moe_comm_time t[MOE_COMM_OP_COUNT];
  EXPECT(!moe_comm_timing_enabled());
  EXPECT_ERR(moe_comm_timing_read(ctx, t, false), MOE_ERR_INVALID_ARG);
  moe_comm_timing_set(true);
  EXPECT(moe_comm_timing_enabled());
  EXPECT_ERR(moe_comm_timing_read(ctx, NULL, false), MOE_ERR_INVALID_ARG);
  moe_comm *w = NULL;
  EXPECT_OK(moe_dist_init(ctx, &w));
  moe_tensor *x = vec(ctx, MOE_F32, 4, 1), *out = vec(ctx, MOE_F32, 4, 0);
  EXPECT_OK(moe_all_reduce(ctx, w, x, MOE_REDUCE_SUM, NULL));
  EXPECT_OK(moe_all_gather(ctx, w, out, x, NULL));
  EXPECT_OK(moe_comm_timing_read(ctx, t, true));
  for (int i = 0; i < MOE_COMM_OP_COUNT; i++) /* local copies: not communication */
    EXPECT(t[i].calls == 0 && t[i].bytes == 0 && t[i].ms == 0);
  moe_comm_timing_set(true); /* already on: unchanged */
  moe_comm_timing_set(false);
  EXPECT(!moe_comm_timing_enabled());
  EXPECT_ERR(moe_comm_timing_read(ctx, t, false), MOE_ERR_INVALID_ARG);
  moe_tensor_release(x);
  moe_tensor_release(out);
}

int main(void) {
  for (int i = 0; launcher_vars[i]; i++) unsetenv(launcher_vars[i]);
  harness_start();
  RUN(test_reduce_op_names);
  RUN(test_world_of_one);
  RUN(test_collectives_copy);
  RUN(test_works);
  RUN(test_argument_errors);
  RUN(test_split);
  RUN(test_env_knobs);
  RUN(test_comm_timing);
  return harness_end();
}
