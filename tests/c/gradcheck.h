/*
 * gradcheck.h - finite-difference gradient checks for the C tests
 * (Torch7's nn/Jacobian.lua, as a header).
 *
 * A test gives a function from its input tensors to one output tensor. The
 * check draws a fixed random cotangent R of the output's shape, computes the
 * analytic gradients of L = sum(out * R) with moe_backward(out, R), and
 * compares each input element's gradient with the central difference
 * (L(x + eps) - L(x - eps)) / (2 eps) evaluated with grad mode off. Inputs
 * must be f64 CPU tensors with requires_grad set; they may be non-contiguous
 * views (perturbed in place through their strides).
 *
 *   static moe_status f(moe_ctx *ctx, moe_tensor **in, void *ud, moe_tensor **out) {
 *     return moe_binary(ctx, MOE_OP_MUL, in[0], in[1], out);
 *   }
 *   EXPECT(gradcheck(ctx, f, 2, inputs, NULL, 1e-6, 1e-6));
 *
 * Tolerance: f64 central differences with eps 1e-6 are accurate to about
 * 1e-8 for smooth ops of O(1) values; 1e-6 (absolute + relative) leaves room.
 */
#ifndef MOE_TEST_GRADCHECK_H
#define MOE_TEST_GRADCHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "moe.h"

typedef moe_status (*gradcheck_fn)(moe_ctx *ctx, moe_tensor **inputs, void *ud, moe_tensor **out);

/* L = sum(out * R) in double, with grad mode off. */
static moe_status gradcheck_loss_(moe_ctx *ctx, gradcheck_fn f, moe_tensor **in, void *ud,
                                  const double *r, int64_t n, double *loss) {
  bool prev = moe_grad_set(ctx, false);
  moe_tensor *out = NULL;
  moe_status st = f(ctx, in, ud, &out);
  double *v = NULL;
  if (st == MOE_OK && moe_tensor_numel(out) != n) st = moe_error(ctx, MOE_ERR_SHAPE, "gradcheck: output size changed");
  if (st == MOE_OK) {
    v = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
    st = v ? moe_tensor_to_f64(ctx, out, v) : MOE_ERR_OUT_OF_MEMORY;
  }
  if (st == MOE_OK) {
    double s = 0;
    for (int64_t i = 0; i < n; i++) s += v[i] * r[i];
    *loss = s;
  }
  free(v);
  moe_tensor_release(out);
  moe_grad_set(ctx, prev);
  return st;
}

/* Address of the element with row-major index i of a CPU f64 tensor. */
static double *gradcheck_elem_(moe_tensor *t, int64_t i) {
  int64_t off = 0;
  for (int d = t->ndim - 1; d >= 0; d--) {
    int64_t k = i % t->shape[d];
    i /= t->shape[d];
    off += k * t->stride[d];
  }
  return (double *)moe_tensor_data(t) + off;
}

/* True when every input's analytic gradient matches the numeric one within
 * tol * (1 + |numeric|). Prints the first mismatches. Clears inputs' .grad
 * before and after. */
static bool gradcheck(moe_ctx *ctx, gradcheck_fn f, int n_inputs, moe_tensor **inputs, void *ud,
                      double eps, double tol) {
  bool ok = true;
  int shown = 0;
  moe_tensor *out = NULL, *rt = NULL;
  double *r = NULL, *g = NULL;
  for (int k = 0; k < n_inputs; k++) {
    if (inputs[k]->dtype != MOE_F64 || moe_tensor_device(inputs[k]).type != MOE_DEVICE_CPU) {
      fprintf(stderr, "gradcheck: input %d must be an f64 CPU tensor\n", k);
      return false;
    }
    moe_tensor_set_grad(ctx, inputs[k], NULL);
  }
  moe_status st = f(ctx, inputs, ud, &out);
  if (st != MOE_OK) {
    fprintf(stderr, "gradcheck: forward failed: %s\n", moe_ctx_error(ctx));
    return false;
  }
  int64_t n = moe_tensor_numel(out);
  r = (double *)malloc(sizeof(double) * (size_t)(n ? n : 1));
  for (int64_t i = 0; i < n; i++) r[i] = sin(0.7 * (double)i + 0.3) + 0.1; /* fixed, non-trivial */
  st = moe_tensor_from_f64(ctx, r, out->ndim, out->shape, out->dtype, MOE_CPU, &rt);
  if (st == MOE_OK) st = moe_backward(ctx, out, rt, false);
  if (st != MOE_OK) {
    fprintf(stderr, "gradcheck: backward failed: %s\n", moe_ctx_error(ctx));
    ok = false;
    goto done;
  }
  for (int k = 0; k < n_inputs && ok; k++) {
    moe_tensor *x = inputs[k];
    int64_t m = moe_tensor_numel(x);
    moe_tensor *gt = moe_tensor_grad(x);
    g = (double *)calloc((size_t)(m ? m : 1), sizeof(double));
    if (gt && moe_tensor_to_f64(ctx, gt, g) != MOE_OK) ok = false;
    for (int64_t i = 0; i < m; i++) {
      double *p = gradcheck_elem_(x, i), x0 = *p, lp = 0, lm = 0;
      *p = x0 + eps;
      st = gradcheck_loss_(ctx, f, inputs, ud, r, n, &lp);
      *p = x0 - eps;
      if (st == MOE_OK) st = gradcheck_loss_(ctx, f, inputs, ud, r, n, &lm);
      *p = x0;
      if (st != MOE_OK) {
        fprintf(stderr, "gradcheck: forward failed: %s\n", moe_ctx_error(ctx));
        ok = false;
        break;
      }
      double num = (lp - lm) / (2 * eps);
      if (!(fabs(num - g[i]) <= tol * (1 + fabs(num)))) {
        ok = false;
        if (shown++ < 5)
          fprintf(stderr, "gradcheck: input %d element %lld: analytic %.10g numeric %.10g\n", k,
                  (long long)i, g[i], num);
      }
    }
    free(g);
    g = NULL;
  }
done:
  for (int k = 0; k < n_inputs; k++) moe_tensor_set_grad(ctx, inputs[k], NULL);
  free(r);
  moe_tensor_release(rt);
  moe_tensor_release(out);
  return ok;
}

#endif /* MOE_TEST_GRADCHECK_H */
