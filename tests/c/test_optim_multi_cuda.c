/*
 * test_optim_multi_cuda.c - the multi-tensor optimiser ops on a GPU
 * (kernels/optim.cu): optim_multi_cases.h's cases on cuda:0 (the
 * multi-tensor AdamW bit for bit against one moe_adamw_step per entry, over
 * more tensors than one launch holds), the norm with the same bits as the
 * CPU's (both sum in the same fixed order), and a device mismatch naming the
 * entry. Needs a GPU (exit 77 without).
 */
#include "optim_multi_cases.h"

static const moe_device GPU = {MOE_DEVICE_CUDA, 0};

static void test_adamw_multi_cuda(moe_ctx *ctx) { om_case_adamw(ctx, GPU); }
static void test_grad_norm_multi_cuda(moe_ctx *ctx) { om_case_norm(ctx, GPU); }
static void test_scale_multi_cuda(moe_ctx *ctx) { om_case_scale(ctx, GPU); }

/* The same gradients on both devices: the same norm bits; and the multi
 * AdamW of both devices agrees (tolerance 0, as the single-tensor op). */
static void test_cuda_matches_cpu(moe_ctx *ctx) {
  om_set c, gset;
  om_set_init(ctx, &c, MOE_CPU);
  om_set_init(ctx, &gset, GPU);
  moe_tensor *gc[OM_COUNT], *gg[OM_COUNT];
  for (int k = 0; k < OM_COUNT; k++) {
    om_spec sp = om_specs(k);
    gc[k] = om_make(ctx, sp.n, sp.gdt, MOE_CPU, 7 + k, 0.3);
    gg[k] = om_make(ctx, sp.n, sp.gdt, GPU, 7 + k, 0.3);
  }
  moe_tensor *nc = om_scalar(ctx, 0, MOE_CPU), *ng = om_scalar(ctx, 0, GPU);
  moe_tensor *cc = om_scalar(ctx, 0, MOE_CPU), *cg = om_scalar(ctx, 0, GPU);
  EXPECT_OK(moe_grad_norm_multi(ctx, (const moe_tensor *const *)gc, OM_COUNT, 0.5, nc, cc, NULL));
  EXPECT_OK(moe_grad_norm_multi(ctx, (const moe_tensor *const *)gg, OM_COUNT, 0.5, ng, cg, NULL));
  EXPECT(om_same(ctx, nc, ng));
  EXPECT(om_same(ctx, cc, cg));
  moe_adamw_entry ec[OM_COUNT], eg[OM_COUNT];
  om_entries(&c, 0, gc, ec);
  om_entries(&gset, 0, gg, eg);
  for (int step = 1; step <= 3; step++) {
    moe_adamw_opts o = {1e-2, 0.9, 0.95, 1e-8, 0.0, step};
    EXPECT_OK(moe_adamw_step_multi(ctx, ec, OM_COUNT, &o, cc, NULL));
    EXPECT_OK(moe_adamw_step_multi(ctx, eg, OM_COUNT, &o, cg, NULL));
  }
  for (int k = 0; k < OM_COUNT; k++) {
    EXPECT(om_same(ctx, c.p[0][k], gset.p[0][k]));
    EXPECT(om_same(ctx, c.m[0][k], gset.m[0][k]));
    EXPECT(om_same(ctx, c.v[0][k], gset.v[0][k]));
    EXPECT(om_same(ctx, c.w[0][k], gset.w[0][k]));
    moe_tensor_release(gc[k]);
    moe_tensor_release(gg[k]);
  }
  moe_tensor *list[] = {nc, ng, cc, cg};
  for (size_t i = 0; i < 4; i++) moe_tensor_release(list[i]);
  om_set_free(&c);
  om_set_free(&gset);
}

static void test_cuda_device_errors(moe_ctx *ctx) {
  int64_t n = 3;
  moe_tensor *pc = NULL, *gc = NULL, *mc = NULL, *vc = NULL, *pg = NULL, *gg = NULL, *mg = NULL,
             *vg = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 1, MOE_F32, MOE_CPU, &pc));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 1, MOE_F32, MOE_CPU, &gc));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, MOE_F32, MOE_CPU, &mc));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, MOE_F32, MOE_CPU, &vc));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 1, MOE_F32, GPU, &pg));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 1, MOE_F32, GPU, &gg));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, MOE_F32, GPU, &mg));
  EXPECT_OK(moe_tensor_full(ctx, 1, &n, 0, MOE_F32, GPU, &vg));
  moe_adamw_opts o = moe_adamw_opts_default();
  moe_adamw_entry e[2] = {{pg, gg, mg, vg, NULL, 0}, {pc, gc, mc, vc, NULL, 0}};
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_DEVICE,
                 "adamw_step_multi: entry 1: param is on cpu but entry 0's param is on cuda:0");
  e[1] = (moe_adamw_entry){pg, gc, mg, vg, NULL, 0};
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 2, &o, NULL, NULL), MOE_ERR_DEVICE,
                 "entry 1: grad is on cpu but param is on cuda:0");
  moe_tensor *sc = om_scalar(ctx, 1, MOE_CPU);
  e[1] = e[0];
  EXPECT_ERR_MSG(moe_adamw_step_multi(ctx, e, 1, &o, sc, NULL), MOE_ERR_DEVICE,
                 "adamw_step_multi: grad_scale is on cpu");
  const moe_tensor *gl[2] = {gg, gc};
  moe_tensor *nrm = om_scalar(ctx, 0, GPU);
  EXPECT_ERR_MSG(moe_grad_norm_multi(ctx, gl, 2, 1.0, nrm, NULL, NULL), MOE_ERR_DEVICE,
                 "grad_norm_multi: grad 1:");
  EXPECT_VALUES(pg, 0, 1, 1, 1);
  moe_tensor *list[] = {pc, gc, mc, vc, pg, gg, mg, vg, sc, nrm};
  for (size_t i = 0; i < sizeof list / sizeof list[0]; i++) moe_tensor_release(list[i]);
}

int main(void) {
  SKIP_IF_NO_GPU(harness_start());
  RUN(test_adamw_multi_cuda);
  RUN(test_grad_norm_multi_cuda);
  RUN(test_scale_multi_cuda);
  RUN(test_cuda_matches_cpu);
  RUN(test_cuda_device_errors);
  return harness_end();
}
