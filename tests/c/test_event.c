/*
 * test_event.c - events (moe.h "events"): recording, elapsed time, errors,
 * and that the context destroys events a caller left. The CUDA part runs
 * where a GPU is visible and says so when it does not.
 */
#include "harness.h"

static void busy_cpu(moe_ctx *ctx) {
  moe_tensor *x = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 2, (int64_t[]){512, 512}, 1.5, MOE_F32, MOE_CPU, &x));
  for (int i = 0; i < 20; i++) {
    EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &y));
    moe_tensor_release(y);
  }
  moe_tensor_release(x);
}

static void test_cpu_events(moe_ctx *ctx) {
  moe_event *a = NULL, *b = NULL;
  EXPECT_OK(moe_event_new(ctx, MOE_CPU, &a));
  EXPECT_OK(moe_event_new(ctx, MOE_CPU, &b));
  double ms = -1;
  EXPECT_ERR_MSG(moe_event_elapsed(ctx, a, b, &ms), MOE_ERR_INVALID_ARG, "must be recorded");
  EXPECT_ERR_MSG(moe_event_synchronize(ctx, a), MOE_ERR_INVALID_ARG, "never recorded");
  EXPECT_OK(moe_event_record(ctx, a));
  busy_cpu(ctx);
  EXPECT_OK(moe_event_record(ctx, b));
  EXPECT_OK(moe_event_synchronize(ctx, b));
  EXPECT_OK(moe_event_elapsed(ctx, a, b, &ms));
  EXPECT(ms > 0 && ms < 60000);
  double back = 0;
  EXPECT_OK(moe_event_elapsed(ctx, b, a, &back));
  EXPECT_NEAR(back, -ms, 1e-9);
  moe_event_free(ctx, a);
  moe_event_free(ctx, b);
  moe_event_free(ctx, NULL); /* a no-op */
}

static void test_bad_device(moe_ctx *ctx) {
  moe_event *e = (moe_event *)0x1;
  moe_status st = moe_event_new(ctx, (moe_device){MOE_DEVICE_CUDA, 99}, &e);
  EXPECT(st != MOE_OK && moe_ctx_error(ctx)[0] != 0);
  EXPECT(e == (moe_event *)0x1); /* output untouched on failure */
}

/* Events left alive are destroyed by moe_ctx_free (ASan/LSan would see a leak). */
static void test_left_to_context(moe_ctx *unused) {
  moe_ctx *ctx = NULL;
  EXPECT(moe_ctx_init(&ctx) == MOE_OK);
  moe_event *e[3];
  for (int i = 0; i < 3; i++) EXPECT(moe_event_new(ctx, MOE_CPU, &e[i]) == MOE_OK);
  moe_event_free(ctx, e[1]); /* one from the middle of the list */
  moe_ctx_free(ctx);
}

static void test_cuda_events(moe_ctx *ctx) {
  if (moe_cuda_device_count(ctx) == 0) {
    printf("SKIPPED (no CUDA GPU): CUDA events\n");
    return;
  }
  moe_device g = {MOE_DEVICE_CUDA, 0};
  moe_event *a = NULL, *b = NULL, *c = NULL;
  EXPECT_OK(moe_event_new(ctx, g, &a));
  EXPECT_OK(moe_event_new(ctx, g, &b));
  EXPECT_OK(moe_event_new(ctx, MOE_CPU, &c));
  moe_tensor *x = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_full(ctx, 1, (int64_t[]){1 << 24}, 2.0, MOE_F32, g, &x));
  EXPECT_OK(moe_event_record(ctx, a));
  for (int i = 0; i < 10; i++) {
    EXPECT_OK(moe_binary(ctx, MOE_OP_MUL, x, x, &y));
    moe_tensor_release(y);
  }
  EXPECT_OK(moe_event_record(ctx, b));
  EXPECT_OK(moe_event_synchronize(ctx, b));
  double ms = 0;
  EXPECT_OK(moe_event_elapsed(ctx, a, b, &ms));
  EXPECT(ms > 0 && ms < 10000);
  EXPECT_OK(moe_event_record(ctx, c));
  EXPECT_ERR_MSG(moe_event_elapsed(ctx, a, c, &ms), MOE_ERR_DEVICE, "elapsed: the start event is on cuda:0 but the end event is on cpu");
  moe_tensor_release(x);
  moe_event_free(ctx, a);
  moe_event_free(ctx, b);
  moe_event_free(ctx, c);
}

int main(void) {
  RUN(test_cpu_events);
  RUN(test_bad_device);
  RUN(test_left_to_context);
  RUN(test_cuda_events);
  return harness_end();
}
