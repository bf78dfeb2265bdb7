/*
 * harness.h - a tiny test harness for the C unit tests (one executable per
 * file, registered with ctest). A test that needs a GPU and finds none calls
 * SKIP_IF_NO_GPU(ctx), which prints why and exits 77 (ctest: skipped).
 *
 *   static void test_views(moe_ctx *ctx) { ... EXPECT(cond); EXPECT_OK(call); }
 *   int main(void) { RUN(test_views); return harness_end(); }
 *
 * harness_start() gives the shared context before the first RUN (for
 * SKIP_IF_NO_GPU in main). RUN also checks that a test leaves as many live
 * host storages as it found: a test that leaks a tensor fails.
 */
#ifndef MOE_TEST_HARNESS_H
#define MOE_TEST_HARNESS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

static int harness_failures = 0, harness_checks = 0, harness_tests = 0;
static moe_ctx *harness_ctx = NULL;

#define EXPECT(cond)                                                               \
  do {                                                                             \
    harness_checks++;                                                              \
    if (!(cond)) {                                                                 \
      harness_failures++;                                                          \
      fprintf(stderr, "%s:%d: FAILED: %s\n", __FILE__, __LINE__, #cond);           \
    }                                                                              \
  } while (0)

/* The call must succeed; on failure prints the context's message. */
#define EXPECT_OK(call)                                                            \
  do {                                                                             \
    harness_checks++;                                                              \
    moe_status s_ = (call);                                                        \
    if (s_ != MOE_OK) {                                                            \
      harness_failures++;                                                          \
      fprintf(stderr, "%s:%d: FAILED: %s -> %s: %s\n", __FILE__, __LINE__, #call,  \
              moe_status_name(s_), moe_ctx_error(harness_ctx));                    \
    }                                                                              \
  } while (0)

/* The call must fail with status st and a non-empty message. */
#define EXPECT_ERR(call, st)                                                       \
  do {                                                                             \
    harness_checks++;                                                              \
    moe_status s_ = (call);                                                        \
    if (s_ != (st) || moe_ctx_error(harness_ctx)[0] == 0) {                        \
      harness_failures++;                                                          \
      fprintf(stderr, "%s:%d: FAILED: %s -> %s (wanted %s)\n", __FILE__, __LINE__, \
              #call, moe_status_name(s_), moe_status_name(st));                    \
    }                                                                              \
  } while (0)

/* Like EXPECT_ERR, and the message must contain the string part. */
#define EXPECT_ERR_MSG(call, st, part)                                             \
  do {                                                                             \
    harness_checks++;                                                              \
    moe_status s_ = (call);                                                        \
    if (s_ != (st) || !strstr(moe_ctx_error(harness_ctx), (part))) {               \
      harness_failures++;                                                          \
      fprintf(stderr, "%s:%d: FAILED: %s -> %s \"%s\" (wanted %s with \"%s\")\n",  \
              __FILE__, __LINE__, #call, moe_status_name(s_),                      \
              moe_ctx_error(harness_ctx), moe_status_name(st), (part));            \
    }                                                                              \
  } while (0)

#define EXPECT_STR(a, b)                                                           \
  do {                                                                             \
    harness_checks++;                                                              \
    const char *a_ = (a), *b_ = (b);                                               \
    if (!a_ || !b_ || strcmp(a_, b_) != 0) {                                       \
      harness_failures++;                                                          \
      fprintf(stderr, "%s:%d: FAILED: %s\n  got:    \"%s\"\n  wanted: \"%s\"\n", __FILE__, \
              __LINE__, #a, a_ ? a_ : "(null)", b_ ? b_ : "(null)");               \
    }                                                                              \
  } while (0)

#define EXPECT_NEAR(a, b, tol)                                                     \
  do {                                                                             \
    harness_checks++;                                                              \
    double a_ = (a), b_ = (b);                                                     \
    if (!(fabs(a_ - b_) <= (tol))) {                                               \
      harness_failures++;                                                          \
      fprintf(stderr, "%s:%d: FAILED: %s = %.9g, %s = %.9g (tol %g)\n", __FILE__,  \
              __LINE__, #a, a_, #b, b_, (double)(tol));                            \
    }                                                                              \
  } while (0)

/* Whether t holds the n row-major values of want within tol (NaN matches
 * NaN); prints the first mismatch. */
static inline int harness_values(const moe_tensor *t, const double *want, int64_t n, double tol,
                                 const char *file, int line) {
  if (moe_tensor_numel(t) != n) {
    fprintf(stderr, "%s:%d: FAILED: %lld elements, wanted %lld\n", file, line,
            (long long)moe_tensor_numel(t), (long long)n);
    return 0;
  }
  double *got = (double *)malloc((size_t)(n > 0 ? n : 1) * sizeof(double));
  if (!got || moe_tensor_to_f64(harness_ctx, t, got) != MOE_OK) {
    fprintf(stderr, "%s:%d: FAILED: to_f64: %s\n", file, line, moe_ctx_error(harness_ctx));
    free(got);
    return 0;
  }
  for (int64_t i = 0; i < n; i++) {
    int same = (isnan(got[i]) && isnan(want[i])) || got[i] == want[i] ||
               fabs(got[i] - want[i]) <= tol;
    if (!same) {
      fprintf(stderr, "%s:%d: FAILED: element %lld is %.9g, wanted %.9g (tol %g)\n", file, line,
              (long long)i, got[i], want[i], tol);
      free(got);
      return 0;
    }
  }
  free(got);
  return 1;
}

/* EXPECT_VALUES(t, tol, v0, v1, ...): t's elements in row-major order. */
#define EXPECT_VALUES(t, tol, ...)                                                 \
  do {                                                                             \
    const double w_[] = {__VA_ARGS__};                                             \
    harness_checks++;                                                              \
    if (!harness_values((t), w_, (int64_t)(sizeof(w_) / sizeof(w_[0])), (tol),    \
                        __FILE__, __LINE__))                                       \
      harness_failures++;                                                          \
  } while (0)

static inline moe_ctx *harness_start(void) {
  if (!harness_ctx && moe_ctx_init(&harness_ctx) != MOE_OK) {
    fprintf(stderr, "moe_ctx_init failed\n");
    exit(1);
  }
  return harness_ctx;
}

static inline int64_t harness_live_storages(void) {
  moe_memory_stats st;
  if (moe_memory_stats_get(harness_ctx, MOE_CPU, &st) != MOE_OK) return -1;
  return st.live_storages;
}

#define RUN(fn)                                                                    \
  do {                                                                             \
    harness_start();                                                               \
    int before_ = harness_failures;                                                \
    int64_t live_ = harness_live_storages();                                       \
    harness_tests++;                                                               \
    fn(harness_ctx);                                                               \
    if (harness_live_storages() != live_) {                                        \
      harness_failures++;                                                          \
      fprintf(stderr, "%s: leaked %lld host storage(s)\n", #fn,                    \
              (long long)(harness_live_storages() - live_));                       \
    }                                                                              \
    printf("%s %s\n", harness_failures == before_ ? "ok  " : "FAIL", #fn);         \
  } while (0)

#define SKIP_IF_NO_GPU(ctx)                                                        \
  do {                                                                             \
    if (moe_cuda_device_count(ctx) == 0) {                                         \
      printf("SKIPPED: this test needs a CUDA GPU (%s)\n",                         \
             moe_cuda_built() ? "none visible" : "built without CUDA");            \
      moe_ctx_free(ctx);                                                           \
      exit(77);                                                                    \
    }                                                                              \
  } while (0)

static int harness_end(void) {
  if (harness_ctx) moe_ctx_free(harness_ctx);
  printf("%d tests, %d checks, %d failed\n", harness_tests, harness_checks, harness_failures);
  return harness_failures ? 1 : 0;
}

#endif
