/*
 * moe_grouped.h - grouped GEMM over variable-size groups of contiguous rows
 * in core/grouped.c (CPU reference on OpenBLAS, autograd),
 * kernels/grouped.cu (CUDA). Included by moe.h.
 *
 * Terms. x (R, K): R rows; group g (g = 0..G-1) is the rows
 * [offs[g], offs[g+1]), offs a HOST array of G + 1 int64 with
 * 0 <= offs[0] <= offs[1] <= ... <= offs[G] <= R. A routing plan gives them:
 * plan->row_offsets_host + e0 with G = e1 - e0 (moe_routing_plan_counts_to_host
 * is the layer's one host synchronisation). Groups of zero rows are normal:
 * nothing is computed for them and their weight gradient is zero. Rows
 * outside [offs[0], offs[G]) get zero output rows and zero gradient.
 *
 * dtypes: f32 and f64 (CPU only) and bf16 (f32 accumulation, bf16 output);
 * x and w of one dtype and device. 64-bit offsets throughout: G * K * N and
 * R * K may pass 2^31. x may be any 2-D view whose rows have unit stride
 * along K (other layouts are copied first); w must be contiguous per group
 * (any 3-D view with unit inner stride and its own leading stride).
 */
#ifndef MOE_GROUPED_H
#define MOE_GROUPED_H

#ifdef __cplusplus
extern "C" {
#endif

/*
 * out (R, N), contiguous, x's dtype:
 *   trans_w false: w (G, K, N), out[rows of g] = x[rows of g] @ w[g]
 *   trans_w true:  w (G, N, K), out[rows of g] = x[rows of g] @ w[g]^T
 * Differentiable in x and w:
 *   dx = moe_grouped_mm(dout, w, offs, G, !trans_w)
 *   dw = moe_grouped_mm_wgrad(x, dout, offs, G, trans_w)
 * The node keeps its own copy of offs. Errors: shapes (naming both), groups
 * < 1, offsets out of order or past R, dtype, device.
 */
moe_status moe_grouped_mm(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, const int64_t *offs,
                          int64_t groups, bool trans_w, moe_tensor **out);

/*
 * The per-group weight gradient, not differentiable: a (R, K), b (R, N):
 *   trans_out false: out (G, K, N), out[g] = a[rows of g]^T @ b[rows of g]
 *   trans_out true:  out (G, N, K), out[g] = b[rows of g]^T @ a[rows of g]
 * (a variable inner dimension per group); zero for empty groups.
 */
moe_status moe_grouped_mm_wgrad(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, const int64_t *offs,
                                int64_t groups, bool trans_out, moe_tensor **out);

/*
 * The CUDA implementation used by the two functions above, per context
 * (for benchmarks and tests; like torch.backends settings): "auto" (the
 * default: chosen per call from the shapes), or one of the names that
 * moe_grouped_backends lists (e.g. "loop": one cuBLASLt GEMM per group;
 * "cublas_grouped": cublasGemmGroupedBatchedEx; "wgmma": as auto here, and
 * the sm_90a kernel of the device-offset functions below, which auto also
 * picks where it runs). Unknown names give
 * MOE_ERR_INVALID_ARG listing the valid ones.
 */
moe_status moe_grouped_set_backend(moe_ctx *ctx, const char *name);
/*
 * The same two products with the offsets in a tensor on the operands'
 * device (offs: (G + 1) i64), so nothing is copied to the host: on CUDA
 * in bf16 (compute capability 9.x, K and N multiples of 8, fewer than 4094
 * groups; moe_grouped_offsets_on_device) an sm_90a kernel of our own
 * (TMA + wgmma, a persistent grid over every group's tiles) reads the
 * offsets where they are. Offsets on the device are not checked (that
 * would need the copy): out of order or past R they are clamped, so a
 * wrong offset gives wrong rows, never an access outside the tensors.
 * Elsewhere, or with the backend set to loop, cublas_grouped or streams,
 * the offsets are copied to the host once per call (and once for the
 * backward of a moe_grouped_mm_dev), checked, and the functions above run.
 * moe_grouped_mm_dev is differentiable in x and w; its node keeps offs.
 */
moe_status moe_grouped_mm_dev(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_tensor *offs,
                              bool trans_w, moe_tensor **out);
moe_status moe_grouped_mm_wgrad_dev(moe_ctx *ctx, moe_tensor *a, moe_tensor *b, moe_tensor *offs,
                                    bool trans_out, moe_tensor **out);
/* out (R, N) = x @ w + x2 @ w2 per group, with the device offsets: x2 and
 * w2 of x's and w's shapes (the GLU experts' input gradient, dh1 W1^T +
 * dh3 W3^T). Where moe_grouped_offsets_on_device, one kernel sums both into
 * the same accumulators; elsewhere two products and an add. Not
 * differentiable: an operand that requires grad under grad mode is an error. */
moe_status moe_grouped_mm_sum_dev(moe_ctx *ctx, moe_tensor *x, moe_tensor *w, moe_tensor *x2,
                                  moe_tensor *w2, moe_tensor *offs, bool trans_w, moe_tensor **out);
/* Whether the device-offset functions run without a host copy for operands
 * of dtype dt on dev, G groups, depth K and N output columns (and the same
 * sizes swapped, as the backward needs: check both). */
bool moe_grouped_offsets_on_device(moe_ctx *ctx, moe_device dev, moe_dtype dt, int64_t groups,
                                   int64_t K, int64_t N);
/* The context's backend (the knob grouped_backend, knobs.h; "auto" for NULL). */
const char *moe_grouped_backend(const moe_ctx *ctx);
/* A static, comma-separated list of the backend names, "auto" first. */
const char *moe_grouped_backends(void);

#ifdef __cplusplus
}
#endif
#endif /* MOE_GROUPED_H */
