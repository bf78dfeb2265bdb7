/*
 * test_quantize_cuda.c - the quantize family on CUDA against the CPU
 * reference (moe_quantize.h): codes, scales and dequantized values
 * bit-identical for deterministic and stochastic rounding (same element math
 * without FMA, same Philox counters) at awkward sizes (one element, odd
 * rows, ragged groups, groups above 1024 that take the block-per-group
 * path, many rows; widths that are multiples of 8 for the vectorized
 * kernels: 4, 16 and 32 lanes a group, blocks with 1 to 8 chunks a thread,
 * rows past the largest block group), rows read in place from narrow views
 * (16-byte aligned or not), f32 / bf16 / f16, 8 and 4 bits; and the saved-tensor
 * hooks on CUDA (MLP gradients within the CPU test's bounds, and the bytes
 * kept for backward by moe_memory_stats: 8 bits about half of bf16, 4 bits
 * at least 3.5x smaller). Exits 77 without a GPU.
 */
#include "harness.h"
#include "moe_quantize.h"

static const moe_device GPU = {MOE_DEVICE_CUDA, 0};

/* Bytes of a tensor as a host buffer (caller frees). */
static void *host_bytes(moe_ctx *ctx, const moe_tensor *t, size_t *n) {
  moe_tensor *c = NULL;
  if (moe_to(ctx, (moe_tensor *)t, t->dtype, MOE_CPU, &c) != MOE_OK) return NULL;
  *n = (size_t)moe_tensor_numel(c) * moe_dtype_size(c->dtype);
  void *p = malloc(*n ? *n : 1);
  if (p) memcpy(p, moe_tensor_data(c), *n);
  moe_tensor_release(c);
  return p;
}

static bool same_bytes(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b) {
  size_t na = 0, nb = 0;
  void *pa = host_bytes(ctx, a, &na), *pb = host_bytes(ctx, b, &nb);
  bool same = pa && pb && na == nb && memcmp(pa, pb, na) == 0;
  free(pa), free(pb);
  return same;
}

/* Exact agreement: the CUDA kernels and the CPU reference share the element
 * math (quantize_cuda.h), so no tolerance: codes, scales and dequantized
 * values must match bit for bit. */
static void test_cuda_vs_cpu(moe_ctx *ctx) {
  const moe_dtype dts[] = {MOE_F32, MOE_BF16, MOE_F16};
  const int64_t shapes[][2] = {{1, 1},    {3, 7},    {37, 300}, {5, 4097}, {1000, 130},
                               {2, 3000}, {300, 24}, {33, 256}, {9, 4096}, {7, 14336},
                               {3, 17000}};
  const int64_t groups[] = {0, 128, 64, 2, 2048, 8, 1024};
  int cases = 0, bad = 0;
  moe_rng_seed(ctx, 21);
  for (size_t di = 0; di < 3; di++)
    for (size_t si = 0; si < sizeof shapes / sizeof shapes[0]; si++) {
      moe_tensor *xc = NULL, *xg = NULL;
      EXPECT_OK(moe_tensor_empty(ctx, 2, shapes[si], dts[di], MOE_CPU, &xc));
      if (xc) EXPECT_OK(moe_normal_(ctx, xc, 0.0, 2.0));
      if (xc) EXPECT_OK(moe_to(ctx, xc, dts[di], GPU, &xg));
      for (int b = 0; xg && b < 2; b++)
        for (size_t gi = 0; gi < sizeof groups / sizeof groups[0]; gi++)
          for (int stoch = 0; stoch < 2; stoch++) {
            moe_quant_opts o = {b ? 4 : 8, groups[gi], stoch != 0};
            moe_qtensor qc, qg;
            uint64_t seed, call;
            moe_rng_get_state(ctx, &seed, &call);
            EXPECT_OK(moe_quantize(ctx, xc, &o, &qc));
            moe_rng_set_state(ctx, seed, call);
            EXPECT_OK(moe_quantize(ctx, xg, &o, &qg));
            moe_tensor *yc = NULL, *yg = NULL;
            if (qc.values) EXPECT_OK(moe_dequantize(ctx, &qc, &yc));
            if (qg.values) EXPECT_OK(moe_dequantize(ctx, &qg, &yg));
            cases++;
            bool ok = yc && yg && same_bytes(ctx, qc.values, qg.values) &&
                      same_bytes(ctx, qc.scales, qg.scales) && same_bytes(ctx, yc, yg);
            if (!ok) {
              bad++;
              fprintf(stderr, "  mismatch: %s (%lld, %lld) bits %d group %lld stochastic %d\n",
                      moe_dtype_name(dts[di]), (long long)shapes[si][0], (long long)shapes[si][1],
                      o.bits, (long long)o.group_size, stoch);
            }
            moe_qtensor_clear(&qc), moe_qtensor_clear(&qg);
            moe_tensor_release(yc), moe_tensor_release(yg);
          }
      moe_tensor_release(xc), moe_tensor_release(xg);
    }
  printf("  %d CUDA vs CPU cases, %d mismatched\n", cases, bad);
  EXPECT(bad == 0);
}

/* Rows read in place on the GPU: narrow views of (n, 2f) (the gate / up
 * halves; offset f keeps 16-byte alignment when f % 8 == 0, offset 3 does
 * not and takes the scalar kernel) against the CPU reference of the same
 * view, bit for bit. */
static void test_cuda_strided(moe_ctx *ctx) {
  const int64_t n = 67, f = 776;
  int bad = 0;
  moe_rng_seed(ctx, 22);
  for (int di = 0; di < 2; di++) {
    moe_dtype dt = di ? MOE_BF16 : MOE_F32;
    moe_tensor *hc = NULL, *hg = NULL;
    EXPECT_OK(moe_tensor_empty(ctx, 2, (const int64_t[]){n, 2 * f}, dt, MOE_CPU, &hc));
    if (hc) EXPECT_OK(moe_normal_(ctx, hc, 0.0, 1.0));
    if (hc) EXPECT_OK(moe_to(ctx, hc, dt, GPU, &hg));
    const int64_t starts[] = {0, f, 3}, lens[] = {f, f, f - 8};
    for (int v = 0; hg && v < 3; v++)
      for (int b = 0; b < 2; b++)
        for (int stoch = 0; stoch < 2; stoch++) {
          moe_tensor *vc = NULL, *vg = NULL;
          EXPECT_OK(moe_narrow(ctx, hc, 1, starts[v], lens[v], &vc));
          EXPECT_OK(moe_narrow(ctx, hg, 1, starts[v], lens[v], &vg));
          moe_quant_opts o = {b ? 4 : 8, b ? 128 : 0, stoch != 0};
          moe_qtensor qc, qg;
          uint64_t seed, call;
          moe_rng_get_state(ctx, &seed, &call);
          EXPECT_OK(moe_quantize(ctx, vc, &o, &qc));
          moe_rng_set_state(ctx, seed, call);
          EXPECT_OK(moe_quantize(ctx, vg, &o, &qg));
          bool ok = qc.values && qg.values && same_bytes(ctx, qc.values, qg.values) &&
                    same_bytes(ctx, qc.scales, qg.scales);
          if (!ok) {
            bad++;
            fprintf(stderr, "  strided mismatch: %s start %lld bits %d stochastic %d\n",
                    moe_dtype_name(dt), (long long)starts[v], o.bits, stoch);
          }
          moe_qtensor_clear(&qc), moe_qtensor_clear(&qg);
          moe_tensor_release(vc), moe_tensor_release(vg);
        }
    moe_tensor_release(hc), moe_tensor_release(hg);
  }
  EXPECT(bad == 0);
}

/* Special values on the GPU: zero rows, NaN groups, empty tensors. */
static void test_cuda_special(moe_ctx *ctx) {
  moe_tensor *x = NULL, *y = NULL;
  EXPECT_OK(moe_tensor_from_f64(ctx, (const double[]){0, 0, 0, 1, NAN, 2}, 2,
                                (const int64_t[]){2, 3}, MOE_F32, GPU, &x));
  moe_quant_opts o = moe_quant_opts_default(4);
  moe_qtensor q;
  EXPECT_OK(moe_quantize(ctx, x, &o, &q));
  EXPECT_OK(moe_dequantize(ctx, &q, &y));
  EXPECT_VALUES(y, 0, 0, 0, 0, NAN, NAN, NAN);
  moe_qtensor_clear(&q);
  moe_tensor_release(y), moe_tensor_release(x);
  EXPECT_OK(moe_tensor_empty(ctx, 2, (const int64_t[]){0, 9}, MOE_BF16, GPU, &x));
  EXPECT_OK(moe_quantize(ctx, x, &o, &q));
  EXPECT_OK(moe_dequantize(ctx, &q, &y));
  EXPECT(y && moe_tensor_numel(y) == 0);
  moe_qtensor_clear(&q);
  moe_tensor_release(y), moe_tensor_release(x);
}

static moe_tensor *gpu_rand(moe_ctx *ctx, int64_t a, int64_t b, moe_dtype dt, double s, bool grad) {
  moe_tensor *t = NULL;
  if (moe_tensor_empty(ctx, 2, (const int64_t[]){a, b}, dt, GPU, &t) != MOE_OK) return NULL;
  moe_uniform_(ctx, t, -s, s);
  if (grad) moe_set_requires_grad(ctx, t, true);
  return t;
}

static double rel_err(moe_ctx *ctx, const moe_tensor *a, const moe_tensor *b) {
  if (!a || !b) return INFINITY;
  int64_t n = moe_tensor_numel(a);
  double *va = malloc(sizeof(double) * (size_t)n), *vb = malloc(sizeof(double) * (size_t)n);
  double num = 0, den = 0;
  if (va && vb && moe_tensor_to_f64(ctx, a, va) == MOE_OK && moe_tensor_to_f64(ctx, b, vb) == MOE_OK)
    for (int64_t i = 0; i < n; i++) {
      num += (va[i] - vb[i]) * (va[i] - vb[i]);
      den += vb[i] * vb[i];
    }
  else
    num = INFINITY;
  free(va), free(vb);
  return sqrt(num / (den > 0 ? den : 1));
}

/* The MLP of test_quantize.c on the GPU in bf16 (T = 512, d = 256, f =
 * 1024): bytes kept for backward from the CUDA allocator's counters, and
 * gradient errors (bounds as on the CPU: 2% at 8 bits, 25% at 4 bits, plus
 * bf16's own rounding of the gradients, which the reference shares). */
static void test_cuda_hooks(moe_ctx *ctx) {
  moe_rng_seed(ctx, 31);
  const int64_t T = 512, d = 256, f = 1024;
  moe_tensor *x = gpu_rand(ctx, T, d, MOE_BF16, 1, true);
  moe_tensor *w1 = gpu_rand(ctx, d, f, MOE_BF16, 1.0 / 16, true);
  moe_tensor *w2 = gpu_rand(ctx, f, d, MOE_BF16, 1.0 / 32, true);
  moe_tensor *gy = gpu_rand(ctx, T, d, MOE_BF16, 1, false);
  moe_tensor *ref[3] = {NULL, NULL, NULL}, *leaves[3] = {x, w1, w2};
  int64_t off_bytes = 0;
  /* pass 0 warms up (cuBLAS workspaces, allocator), 1 is the reference */
  for (int pass = 0; pass < 4; pass++) {
    int bits = pass == 2 ? 8 : 4;
    if (pass >= 2) {
      moe_quant_hooks_opts ho = moe_quant_hooks_opts_default(bits);
      ho.n_keep = 2;
      ho.keep = (moe_tensor *const[]){w1, w2};
      EXPECT_OK(moe_quantize_hooks_push(ctx, &ho));
    }
    moe_memory_stats s0, s1;
    EXPECT_OK(moe_cuda_synchronize(ctx, GPU));
    EXPECT_OK(moe_memory_stats_get(ctx, GPU, &s0));
    moe_tensor *xin = NULL, *h = NULL, *a = NULL, *y = NULL;
    EXPECT_OK(moe_binary_scalar(ctx, MOE_OP_MUL, x, 1.0, false, &xin));
    EXPECT_OK(moe_matmul(ctx, xin, w1, &h));
    EXPECT_OK(moe_gelu(ctx, h, &a));
    EXPECT_OK(moe_matmul(ctx, a, w2, &y));
    moe_tensor_release(xin), moe_tensor_release(h), moe_tensor_release(a);
    EXPECT_OK(moe_memory_stats_get(ctx, GPU, &s1));
    int64_t bytes = s1.allocated - s0.allocated - T * d * 2;
    if (pass >= 2) EXPECT_OK(moe_saved_hooks_pop(ctx));
    if (y) EXPECT_OK(moe_backward(ctx, y, gy, false));
    moe_tensor_release(y);
    if (pass == 0) {
      for (int i = 0; i < 3; i++) moe_tensor_set_grad(ctx, leaves[i], NULL);
      continue;
    }
    if (pass == 1) {
      off_bytes = bytes;
      for (int i = 0; i < 3; i++) {
        ref[i] = moe_tensor_grad(leaves[i]);
        moe_tensor_retain(ref[i]);
        moe_tensor_set_grad(ctx, leaves[i], NULL);
      }
      continue;
    }
    double e[3];
    for (int i = 0; i < 3; i++) {
      e[i] = rel_err(ctx, moe_tensor_grad(leaves[i]), ref[i]);
      moe_tensor_set_grad(ctx, leaves[i], NULL);
    }
    printf("  cuda bf16 %d bits: grad rel err x %.4f w1 %.4f w2 %.4f; saved %lld -> %lld bytes "
           "(%.2fx)\n",
           bits, e[0], e[1], e[2], (long long)off_bytes, (long long)bytes,
           bytes ? (double)off_bytes / (double)bytes : 0.0);
    double bound = bits == 8 ? 0.02 : 0.25;
    EXPECT(e[0] < bound && e[1] < bound && e[2] < bound);
    if (bits == 8) EXPECT(bytes * 2 <= off_bytes * 1.05 && bytes * 2 >= off_bytes * 0.95);
    else EXPECT(bytes * 3.5 <= off_bytes);
  }
  for (int i = 0; i < 3; i++) moe_tensor_release(ref[i]);
  moe_tensor_release(x), moe_tensor_release(w1), moe_tensor_release(w2), moe_tensor_release(gy);
}

int main(void) {
  moe_ctx *ctx = harness_start();
  SKIP_IF_NO_GPU(ctx);
  RUN(test_cuda_vs_cpu);
  RUN(test_cuda_strided);
  RUN(test_cuda_special);
  RUN(test_cuda_hooks);
  return harness_end();
}
