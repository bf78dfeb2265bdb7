/*
 * harness.h - a tiny test harness for the C unit tests (one executable per
 * file, registered with ctest). A test that needs a GPU and finds none calls
 * SKIP_IF_NO_GPU(ctx), which prints why and exits 77 (ctest: skipped).
 *
 *   static void test_views(moe_ctx *ctx) { ... EXPECT(cond); EXPECT_OK(call); }
 *   int main(void) { RUN(test_views); return harness_end(); }
 */
#ifndef MOE_TEST_HARNESS_H
#define MOE_TEST_HARNESS_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

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

#define RUN(fn)                                                                    \
  do {                                                                             \
    if (!harness_ctx && moe_ctx_init(&harness_ctx) != MOE_OK) {                    \
      fprintf(stderr, "moe_ctx_init failed\n");                                    \
      exit(1);                                                                     \
    }                                                                              \
    int before_ = harness_failures;                                                \
    harness_tests++;                                                               \
    fn(harness_ctx);                                                               \
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
