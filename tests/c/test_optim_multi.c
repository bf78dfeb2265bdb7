/*
 * test_optim_multi.c - the multi-tensor optimiser ops (core/moe_optim.h) on
 * the CPU: moe_adamw_step_multi bit for bit against moe_adamw_step over 60
 * entries of mixed sizes, dtypes and decay groups for 10 steps, with the
 * device grad scale and skip flag; moe_grad_norm_multi against a double
 * reference; moe_scale_multi; and the errors, which name the entry and
 * leave every tensor untouched. The cases are in optim_multi_cases.h
 * (test_optim_multi_cuda.c runs them on a GPU).
 */
#include "optim_multi_cases.h"

static void test_adamw_multi_cpu(moe_ctx *ctx) { om_case_adamw(ctx, MOE_CPU); }
static void test_grad_norm_multi_cpu(moe_ctx *ctx) { om_case_norm(ctx, MOE_CPU); }
static void test_scale_multi_cpu(moe_ctx *ctx) { om_case_scale(ctx, MOE_CPU); }

static moe_tensor *full(moe_ctx *ctx, int64_t n, double v, moe_dtype dt) {
  moe_tensor *t = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, v, dt, MOE_CPU, &t));
  return t;
}

static void test_multi_errors(moe_ctx *ctx) {
  moe_tensor *p = full(ctx, 3, 1, MOE_F32), *g = full(ctx, 3, 1, MOE_F32),
             *g4 = full(ctx, 4, 1, MOE_F32), *m = full(ctx, 3, 0, MOE_F32),
             *v = full(ctx, 3, 0, MOE_F32), *m64 = full(ctx, 3, 0, MOE_F64),
             *p2 = full(ctx, 3, 1, MOE_F32), *m2 = full(ctx, 3, 0, MOE_F32),
             *v2 = full(ctx, 3, 0, MOE_F32), *pb = full(ctx, 3, 1, MOE_BF16),
             *gi = full(ctx, 3, 1, MOE_I32), *two = full(ctx, 2, 1, MOE_F32),
             *s64 = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 0, NULL, 1, MOE_F64, MOE_CPU, &s64));
  moe_adamw_opts o = moe_adamw_opts_default();
  moe_adamw_entry e[2] = {{p2, g, m2, v2, NULL, 0.1}, {p, g4, m, v, NULL, 0.1}};
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_SHAPE,
                 "adamw_step_multi: entry 1: grad has shape [4] but param has shape [3]");
  e[1].grad = g;
  e[1].exp_avg = m64;
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_DTYPE,
                 "adamw_step_multi: entry 1: exp_avg must be f32 for a f32 param, got f64");
  e[1].exp_avg = m;
  e[1].param = pb;
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_INVALID_ARG,
                 "entry 1: a bf16 param needs an f32 master copy");
  e[1].param = p;
  e[1].grad = gi;
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_DTYPE,
                 "entry 1: grad must be f32, f64, bf16 or f16, got i32");
  e[1].grad = g;
  e[1].weight_decay = -1;
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_INVALID_ARG,
                 "entry 1: weight_decay must be >= 0");
  e[1].weight_decay = 0.1;
  e[1].exp_avg_sq = NULL;
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_INVALID_ARG,
                 "entry 1: param, grad, exp_avg and exp_avg_sq are required");
  e[1].exp_avg_sq = v;
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, two, NULL), MOE_ERR_SHAPE,
                 "adamw_step_multi: grad_scale must have one element, got shape [2]");
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, s64), MOE_ERR_DTYPE,
                 "adamw_step_multi: skip must be f32, got f64");
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, -1, &o, NULL, NULL), MOE_ERR_INVALID_ARG, "n >= 0");
  EXPECT_ERR(moe_adamw_step_multi(ctx, e, 2, NULL, NULL, NULL), MOE_ERR_INVALID_ARG);
  moe_adamw_opts bad = o;
  bad.step = 0;
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &bad, NULL, NULL), MOE_ERR_INVALID_ARG, "step >= 1");
  /* entry 0 was valid every time: nothing was written before the error */
  EXPECT_VALUES(p2, 0, 1, 1, 1);
  EXPECT_VALUES(m2, 0, 0, 0, 0);
  EXPECT_OK(moe_adamw_step_multi(ctx, e, 0, &o, NULL, NULL));

  moe_tensor *nrm = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 0, NULL, 0, MOE_F32, MOE_CPU, &nrm));
  const moe_tensor *gl[2] = {g, gi};
  EXPECT_ERR_MSG(moe_grad_norm_multi(ctx, gl, 2, 1.0, nrm, NULL, NULL), MOE_ERR_DTYPE,
                 "grad_norm_multi: grad 1: must be f32, f64, bf16 or f16, got i32");
  EXPECT_ERR_MSG(moe_grad_norm_multi(ctx, gl, 1, 0.0, nrm, NULL, NULL), MOE_ERR_INVALID_ARG,
                 "max_norm must be > 0");
  EXPECT_ERR_MSG(moe_grad_norm_multi(ctx, gl, 1, 1.0, two, NULL, NULL), MOE_ERR_SHAPE,
                 "grad_norm_multi: norm must have one element");
  EXPECT_ERR_MSG(moe_grad_norm_multi(ctx, gl, 1, 1.0, nrm, s64, NULL), MOE_ERR_DTYPE,
                 "grad_norm_multi: coef must be f32, got f64");
  EXPECT_ERR(moe_grad_norm_multi(ctx, gl, 1, 1.0, NULL, NULL, NULL), MOE_ERR_INVALID_ARG);
  moe_tensor *sl[2] = {p, gi};
  EXPECT_ERR_MSG(moe_scale_multi(ctx, sl, 2, nrm), MOE_ERR_DTYPE, "scale_multi: tensor 1: must be");
  EXPECT_ERR_MSG(moe_scale_multi(ctx, sl, 1, s64), MOE_ERR_DTYPE, "scale_multi: scale must be f32");
  EXPECT_VALUES(p, 0, 1, 1, 1);
  moe_tensor *list[] = {p, g, g4, m, v, m64, p2, m2, v2, pb, gi, two, s64, nrm};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) moe_tensor_release(list[i]);
}

int main(void) {
  RUN(test_adamw_multi_cpu);
  RUN(test_grad_norm_multi_cpu);
  RUN(test_scale_multi_cpu);
  RUN(test_multi_errors);
  return harness_end();
}
