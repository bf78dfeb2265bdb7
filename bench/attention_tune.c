/*
 * attention_tune.c - times the tile configurations of the fused CUDA
 * attention kernels (moe_cuda_attention_tune in core/attention_cuda.h) at
 * the benchmark shapes, after checking each against the default
 * configuration. Not part of the build: compile against a CUDA build of
 * moe_core, e.g.
 *   cc -O2 -Icore -Ikernels bench/attention_tune.c -Lbuild -lmoe_core -Wl,-rpath,$PWD/build -lm
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#include "attention_cuda.h"

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

#define CHECK(call)                                                             \
  do {                                                                          \
    if ((call) != MOE_OK) {                                                     \
      fprintf(stderr, "%s:%d: %s\n", __FILE__, __LINE__, moe_ctx_error(ctx));  \
      exit(1);                                                                  \
    }                                                                           \
  } while (0)

static double max_diff(moe_ctx *ctx, moe_tensor *a, moe_tensor *b) {
  int64_t n = moe_tensor_numel(a);
  double *x = malloc(sizeof(double) * (size_t)n), *y = malloc(sizeof(double) * (size_t)n), m = 0;
  CHECK(moe_tensor_to_f64(ctx, a, x));
  CHECK(moe_tensor_to_f64(ctx, b, y));
  for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i] - y[i]));
  free(x), free(y);
  return m;
}

int main(void) {
  moe_ctx *ctx;
  if (moe_ctx_init(&ctx) != MOE_OK) return 1;
  moe_device g = {MOE_DEVICE_CUDA, 0};
  const int64_t shapes[4][4] = {{8, 16, 1024, 128}, {4, 16, 2048, 128}, {2, 16, 4096, 128}, {4, 16, 2048, 64}};
  printf("%-18s %4s %10s %10s %12s %12s\n", "B,H,T,D", "var", "fwd ms", "bwd ms", "fwd maxdiff", "dq maxdiff");
  for (int s = 0; s < 4; s++) {
    moe_tensor *x[4];
    for (int i = 0; i < 4; i++) {
      CHECK(moe_tensor_empty(ctx, 4, shapes[s], MOE_BF16, g, &x[i]));
      CHECK(moe_normal_(ctx, x[i], 0, 1));
    }
    moe_tensor *o0 = NULL, *l0 = NULL, *q0 = NULL, *k0 = NULL, *v0 = NULL;
    moe_cuda_attention_tune(0, 0);
    CHECK(moe_attention_forward(ctx, x[0], x[1], x[2], true, 0, &o0, &l0));
    CHECK(moe_attention_backward(ctx, x[0], x[1], x[2], o0, l0, x[3], true, 0, &q0, &k0, &v0));
    for (int var = 0; var < 3; var++) {
      moe_cuda_attention_tune(var, var);
      double tf[15], tb[15];
      moe_tensor *o = NULL, *l = NULL, *dq = NULL, *dk = NULL, *dv = NULL;
      CHECK(moe_attention_forward(ctx, x[0], x[1], x[2], true, 0, &o, &l));
      CHECK(moe_attention_backward(ctx, x[0], x[1], x[2], o0, l0, x[3], true, 0, &dq, &dk, &dv));
      double df = max_diff(ctx, o, o0), dd = max_diff(ctx, dq, q0);
      moe_tensor_release(o), moe_tensor_release(l), moe_tensor_release(dq), moe_tensor_release(dk),
          moe_tensor_release(dv);
      for (int r = -3; r < 15; r++) {
        CHECK(moe_cuda_synchronize(ctx, g));
        double t0 = now();
        for (int it = 0; it < 5; it++) {
          CHECK(moe_attention_forward(ctx, x[0], x[1], x[2], true, 0, &o, &l));
          moe_tensor_release(o), moe_tensor_release(l);
        }
        CHECK(moe_cuda_synchronize(ctx, g));
        double t1 = now();
        for (int it = 0; it < 5; it++) {
          CHECK(moe_attention_backward(ctx, x[0], x[1], x[2], o0, l0, x[3], true, 0, &dq, &dk, &dv));
          moe_tensor_release(dq), moe_tensor_release(dk), moe_tensor_release(dv);
        }
        CHECK(moe_cuda_synchronize(ctx, g));
        if (r >= 0) tf[r] = (t1 - t0) / 5 * 1e3, tb[r] = (now() - t1) / 5 * 1e3;
      }
      qsort(tf, 15, sizeof(double), cmp);
      qsort(tb, 15, sizeof(double), cmp);
      printf("%lld,%lld,%lld,%-8lld %4d %10.3f %10.3f %12.3g %12.3g\n", (long long)shapes[s][0],
             (long long)shapes[s][1], (long long)shapes[s][2], (long long)shapes[s][3], var, tf[7],
             tb[7], df, dd);
    }
    moe_cuda_attention_tune(0, 0);
    moe_tensor *t[] = {x[0], x[1], x[2], x[3], o0, l0, q0, k0, v0};
    for (int i = 0; i < 9; i++) moe_tensor_release(t[i]);
  }
  moe_ctx_free(ctx);
  return 0;
}
