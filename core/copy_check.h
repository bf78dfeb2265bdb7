/*
 * copy_check.h - the checks every writer into an existing tensor runs before
 * it writes (core/copy.c: copy_, fill_; core/random.c: the random fills).
 * Private to core/.
 */
#ifndef MOE_COPY_CHECK_H
#define MOE_COPY_CHECK_H

#include "internal.h"

/* Refuses a destination in which two elements share memory (a stride-0 dim
 * of size > 1, as after expand). */
moe_status moe_check_writable(moe_ctx *ctx, const char *fn, const moe_tensor *t);

/* Refuses an in-place write that autograd cannot see: into a leaf that
 * requires grad, or into a tensor that is part of a recorded graph, while
 * grad mode is on (as PyTorch refuses the first; it tracks the second with
 * version counters, which moe-lua does not have). */
moe_status moe_check_inplace(moe_ctx *ctx, const char *fn, const moe_tensor *t);

#endif /* MOE_COPY_CHECK_H */
