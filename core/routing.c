/*
 * routing.c - the routing family (moe_routing.h): the routing plan (sort of
 * the top-k assignments by expert, counts, offsets, the permuted buffer's
 * layout for the dropless, padded, capacity and local variants, the
 * block-sparse topology), the one counted host copy of the counts, per-rank
 * counts, and the differentiable permute and combine with their backward.
 *
 * Every stage has a CPU reference here and a CUDA launcher in
 * kernels/routing.cu (routing_cuda.h) computing the same integers, so a
 * plan is bit-identical on both devices. Nodes of permute and combine
 * (MOE_OP_ROUTING_PERMUTE / MOE_OP_ROUTING_COMBINE) hold a reference to the
 * plan (node->user).
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "moe_routing.h"
#include "routing_cuda.h"

/* ------------------------------------------------------------ helpers */

static bool rt_cuda(const moe_tensor *t) { return t->storage->device.type == MOE_DEVICE_CUDA; }

static moe_status rt_i64(moe_ctx *ctx, int64_t n, moe_device d, moe_tensor **out) {
  return moe_tensor_empty(ctx, 1, (int64_t[]){n}, MOE_I64, d, out);
}

static int64_t *rt_p(moe_tensor *t) { return (int64_t *)moe_tensor_data(t); }

static int64_t rt_round_up(int64_t v, int64_t b) { return b > 0 ? (v + b - 1) / b * b : v; }

static bool rt_float(moe_dtype dt) {
  return dt == MOE_F32 || dt == MOE_F64 || dt == MOE_BF16 || dt == MOE_F16;
}

static moe_status rt_check_float(moe_ctx *ctx, const char *fn, const char *what,
                                 const moe_tensor *t) {
  if (rt_float(t->dtype)) return MOE_OK;
  return moe_error(ctx, MOE_ERR_DTYPE, "%s: %s must be f32, f64, bf16 or f16, got %s", fn, what,
                   moe_dtype_name(t->dtype));
}

static moe_status rt_check_device(moe_ctx *ctx, const char *fn, const char *what,
                                  const moe_tensor *t, moe_device d) {
  return moe_check_same_device(ctx, fn, what, t->storage->device, "the plan", d);
}

/* A 2-D tensor of shape (rows, cols); cols < 0: any. */
static moe_status rt_check_2d(moe_ctx *ctx, const char *fn, const char *what, const moe_tensor *t,
                              int64_t rows, int64_t cols, const char *want) {
  if (t->ndim == 2 && t->shape[0] == rows && (cols < 0 || t->shape[1] == cols)) return MOE_OK;
  return moe_error(ctx, MOE_ERR_SHAPE, "%s: %s has shape %s, expected %s", fn, what, MOE_SHAPE(t),
                   want);
}

/* Score key: larger score -> larger key; -0 == +0; NaN lowest (loses). */
static uint64_t rt_score_key(double v) {
  if (v != v) return 0;
  if (v == 0) v = 0.0;
  uint64_t u;
  memcpy(&u, &v, sizeof u);
  return (u >> 63) ? ~u : (u | 0x8000000000000000ull);
}

/* ----------------------------------------------------- plan lifecycle */

moe_routing_opts moe_routing_opts_default(void) {
  moe_routing_opts o;
  memset(&o, 0, sizeof o);
  o.drop_policy = MOE_ROUTING_DROP_POSITION;
  return o;
}

void moe_routing_plan_retain(moe_routing_plan *p) {
  if (p) p->refcount++;
}

void moe_routing_plan_release(moe_routing_plan *p) {
  if (!p || --p->refcount > 0) return;
  moe_tensor *ts[] = {p->counts, p->kept, p->offsets, p->row_offsets, p->sort_perm, p->sort_inv,
                      p->dest, p->src, p->bs_row_indices, p->bs_column_indices, p->bs_offsets,
                      p->bs_column_indices_t, p->bs_offsets_t, p->bs_block_offsets_t};
  for (size_t i = 0; i < sizeof ts / sizeof ts[0]; i++) moe_tensor_release(ts[i]);
  free(p->counts_host);
  free(p->row_offsets_host);
  free(p);
}

static void rt_plan_release_void(void *p) { moe_routing_plan_release((moe_routing_plan *)p); }

/* Global segment starts gpo (E + 1) from counts: the layout rule shared by
 * the CPU stage and the host copy (kernels/routing.cu repeats it). */
static void rt_segments(const int64_t *counts, int64_t E, int64_t capacity, int64_t bs,
                        int64_t *gpo) {
  gpo[0] = 0;
  for (int64_t e = 0; e < E; e++)
    gpo[e + 1] = gpo[e] + (capacity > 0 ? capacity : rt_round_up(counts[e], bs));
}

static int64_t rt_clamp(int64_t v, int64_t lo, int64_t hi) { return v < lo ? lo : v > hi ? hi : v; }

/* ------------------------------------------------------- CPU stages */

/* Stage 1 on the CPU: ids checked (an error names the first bad one). */
static moe_status rt_cpu_sort(moe_ctx *ctx, const moe_tensor *ids, const moe_tensor *scores,
                              int64_t E, int32_t *keys, int64_t *perm, int64_t *inv,
                              int64_t *offsets, int64_t *counts) {
  int64_t T = ids->shape[0], k = ids->shape[1], N = T * k;
  const char *pi = (const char *)moe_tensor_data(ids);
  size_t is = moe_dtype_size(ids->dtype);
  int64_t *e_of = (int64_t *)malloc(sizeof(int64_t) * (size_t)(N ? N : 1));
  uint64_t *sk = scores ? (uint64_t *)malloc(sizeof(uint64_t) * (size_t)(N ? N : 1)) : NULL;
  if (!e_of || (scores && !sk)) {
    free(e_of);
    free(sk);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "routing_plan: no host memory for %lld ids",
                     (long long)N);
  }
  for (int64_t t = 0; t < T; t++)
    for (int64_t j = 0; j < k; j++) {
      int64_t v = moe_load_i64(pi + (t * ids->stride[0] + j * ids->stride[1]) * (int64_t)is,
                               ids->dtype);
      if (v < 0 || v >= E) {
        free(e_of);
        free(sk);
        return moe_error(ctx, MOE_ERR_INVALID_ARG,
                         "routing_plan: ids[%lld][%lld] = %lld is not an expert in [0, %lld)",
                         (long long)t, (long long)j, (long long)v, (long long)E);
      }
      e_of[t * k + j] = v;
      counts[v]++;
      if (sk) {
        const char *ps = (const char *)moe_tensor_data(scores);
        size_t ss = moe_dtype_size(scores->dtype);
        sk[t * k + j] = rt_score_key(moe_load_f64(
            ps + (t * scores->stride[0] + j * scores->stride[1]) * (int64_t)ss, scores->dtype));
      }
    }
  offsets[0] = 0; /* counts (zeroed by the caller) is the histogram */
  for (int64_t e = 0; e < E; e++) offsets[e + 1] = offsets[e] + counts[e];
  /* stable counting sort: assignments in increasing a within each expert */
  int64_t *cur = (int64_t *)malloc(sizeof(int64_t) * (size_t)E);
  if (!cur) {
    free(e_of);
    free(sk);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "routing_plan: no host memory");
  }
  memcpy(cur, offsets, sizeof(int64_t) * (size_t)E);
  for (int64_t a = 0; a < N; a++) perm[cur[e_of[a]]++] = a;
  free(cur);
  if (sk) { /* within each expert: score descending, ties a ascending (stable merge sort) */
    int64_t *tmp = (int64_t *)malloc(sizeof(int64_t) * (size_t)(N ? N : 1));
    if (!tmp) {
      free(e_of);
      free(sk);
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "routing_plan: no host memory");
    }
    for (int64_t e = 0; e < E; e++) {
      int64_t lo = offsets[e], n = offsets[e + 1] - lo;
      /* bottom-up merge sort of perm[lo, lo + n) by sk descending (stable) */
      for (int64_t w = 1; w < n; w *= 2) {
        for (int64_t s = 0; s < n; s += 2 * w) {
          int64_t m = s + w < n ? s + w : n, h = s + 2 * w < n ? s + 2 * w : n;
          int64_t i = s, j = m, o = s;
          while (i < m && j < h)
            tmp[lo + o++] = sk[perm[lo + j]] > sk[perm[lo + i]] ? perm[lo + j++] : perm[lo + i++];
          while (i < m) tmp[lo + o++] = perm[lo + i++];
          while (j < h) tmp[lo + o++] = perm[lo + j++];
        }
        memcpy(perm + lo, tmp + lo, sizeof(int64_t) * (size_t)n);
      }
    }
    free(tmp);
  }
  for (int64_t p = 0; p < N; p++) {
    inv[perm[p]] = p;
    keys[p] = (int32_t)e_of[perm[p]];
  }
  free(e_of);
  free(sk);
  return MOE_OK;
}

/* Stage 2 on the CPU (same rule as moe_cuda_routing_layout). */
static moe_status rt_cpu_layout(moe_ctx *ctx, int64_t N, int64_t E, int64_t e0, int64_t e1,
                                int64_t capacity, int64_t bs, int64_t R, const int32_t *keys,
                                const int64_t *perm, const int64_t *offsets, const int64_t *counts,
                                int64_t *kept, int64_t *row_offsets, int64_t *dest, int64_t *src) {
  int64_t *gpo = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));
  if (!gpo) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "routing_plan: no host memory");
  rt_segments(counts, E, capacity, bs, gpo);
  for (int64_t e = 0; e <= E; e++) row_offsets[e] = rt_clamp(gpo[e], gpo[e0], gpo[e1]) - gpo[e0];
  for (int64_t e = 0; e < E; e++)
    kept[e] = e < e0 || e >= e1 ? 0 : capacity > 0 && counts[e] > capacity ? capacity : counts[e];
  for (int64_t r = 0; r < R; r++) src[r] = -1;
  for (int64_t p = 0; p < N; p++) {
    int64_t a = perm[p], e = keys[p];
    dest[a] = -1;
    if (e < e0 || e >= e1) continue;
    int64_t rank = p - offsets[e];
    if (capacity > 0 && rank >= capacity) continue;
    int64_t row = gpo[e] - gpo[e0] + rank;
    if (row >= R) continue; /* cannot happen when R fits the layout */
    dest[a] = row;
    src[row] = a;
  }
  free(gpo);
  return MOE_OK;
}

/* Stage 3 on the CPU: closed forms of docs/ROUTING.md. */
static void rt_cpu_topology(const int64_t *row_offsets, int64_t e0, int64_t e1, int64_t bs,
                            int64_t F, int64_t Rb, int64_t *ri, int64_t *ci, int64_t *off,
                            int64_t *ci_t, int64_t *off_t, int64_t *bo_t) {
  int64_t EL = e1 - e0;
  for (int64_t rb = 0; rb <= Rb; rb++) off[rb] = rb * F;
  for (int64_t col = 0; col <= EL * F; col++) {
    int64_t el = col / F, c = col % F;
    if (col == EL * F) {
      off_t[col] = Rb * F;
      continue;
    }
    int64_t rs = row_offsets[e0 + el] / bs, nb = (row_offsets[e0 + el + 1] - row_offsets[e0 + el]) / bs;
    off_t[col] = F * rs + c * nb;
  }
  int64_t el = 0;
  for (int64_t rb = 0; rb < Rb; rb++) {
    while (el < EL - 1 && row_offsets[e0 + el + 1] / bs <= rb) el++;
    int64_t rs = row_offsets[e0 + el] / bs, nb = (row_offsets[e0 + el + 1] - row_offsets[e0 + el]) / bs;
    for (int64_t c = 0; c < F; c++) {
      int64_t i = rb * F + c, it = F * rs + c * nb + (rb - rs);
      ri[i] = rb;
      ci[i] = el * F + c;
      ci_t[it] = rb;
      bo_t[it] = i;
    }
  }
}

/* -------------------------------------------------------- host copy */

/* Sets the host counts and row offsets from the (E + 1) exclusive scan of the
 * counts; off[E] must be N. synced: whether off came from a device copy
 * (counted in host_syncs). */
static moe_status rt_set_host(moe_ctx *ctx, moe_routing_plan *p, int64_t *off, bool synced);

moe_status moe_routing_plan_counts_to_host(moe_ctx *ctx, moe_routing_plan *p) {
  if (!p) return moe_error(ctx, MOE_ERR_INVALID_ARG, "routing_plan_counts_to_host: plan is NULL");
  if (p->counts_host) return MOE_OK; /* the one copy is already made */
  int64_t E = p->E;
  int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));
  if (!off) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "routing_plan_counts_to_host: no host memory");
  /* the offsets carry both the counts and the number of valid ids */
  if (rt_cuda(p->offsets)) {
    moe_status st = moe_cuda_memcpy(ctx, off, MOE_CPU, moe_tensor_data(p->offsets), p->device,
                                    sizeof(int64_t) * (size_t)(E + 1));
    if (st != MOE_OK) {
      free(off);
      return st;
    }
  } else {
    memcpy(off, moe_tensor_data(p->offsets), sizeof(int64_t) * (size_t)(E + 1));
    moe_host_read_note(ctx); /* counted as on a GPU (moe_host_reads) */
  }
  return rt_set_host(ctx, p, off, true);
}

/* The host counts from opts.known_counts (no device copy): checked as the
 * header says. */
static moe_status rt_known_counts(moe_ctx *ctx, moe_routing_plan *p, const int64_t *known) {
  int64_t E = p->E;
  int64_t *off = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));
  if (!off) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "routing_plan: no host memory");
  off[0] = 0;
  for (int64_t e = 0; e < E; e++) {
    if (known[e] < 0) {
      free(off);
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "routing_plan: known_counts[%lld] = %lld is negative",
                       (long long)e, (long long)known[e]);
    }
    off[e + 1] = off[e] + known[e];
  }
  if (off[E] != p->N) {
    moe_status st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                              "routing_plan: known_counts sum to %lld but there are %lld assignments",
                              (long long)off[E], (long long)p->N);
    free(off);
    return st;
  }
  if (!rt_cuda(p->counts)) {
    const int64_t *c = (const int64_t *)moe_tensor_data(p->counts);
    for (int64_t e = 0; e < E; e++) {
      if (c[e] != known[e]) {
        moe_status st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                                  "routing_plan: known_counts[%lld] = %lld but the ids give %lld",
                                  (long long)e, (long long)known[e], (long long)c[e]);
        free(off);
        return st;
      }
    }
  }
  return rt_set_host(ctx, p, off, false);
}

static moe_status rt_set_host(moe_ctx *ctx, moe_routing_plan *p, int64_t *off, bool synced) {
  int64_t E = p->E;
  int64_t *counts = (int64_t *)calloc((size_t)E, sizeof(int64_t));
  int64_t *ro = (int64_t *)malloc(sizeof(int64_t) * (size_t)(E + 1));
  moe_status st = MOE_OK;
  if (!counts || !ro) {
    st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "routing_plan_counts_to_host: no host memory");
    goto fail;
  }
  if (synced) p->host_syncs++;
  if (off[E] != p->N) {
    st = moe_error(ctx, MOE_ERR_INVALID_ARG,
                   "routing_plan: %lld of the %lld ids are not experts in [0, %lld) (CUDA plans "
                   "drop them; found at the counts copy)",
                   (long long)(p->N - off[E]), (long long)p->N, (long long)E);
    goto fail;
  }
  for (int64_t e = 0; e < E; e++) counts[e] = off[e + 1] - off[e];
  rt_segments(counts, E, p->capacity, p->block_size, off); /* off now = gpo */
  for (int64_t e = 0; e <= E; e++) ro[e] = rt_clamp(off[e], off[p->e0], off[p->e1]) - off[p->e0];
  free(off);
  p->counts_host = counts;
  p->row_offsets_host = ro;
  return MOE_OK;
fail:
  free(off);
  free(counts);
  free(ro);
  return st;
}

/* ----------------------------------------------------------- the plan */

static moe_status rt_validate_opts(moe_ctx *ctx, const moe_tensor *ids, int64_t E,
                                   const moe_routing_opts *o) {
  const char *fn = "routing_plan";
  if (ids->dtype != MOE_I64 && ids->dtype != MOE_I32)
    return moe_error(ctx, MOE_ERR_DTYPE, "%s: ids must be i64 or i32, got %s", fn,
                     moe_dtype_name(ids->dtype));
  if (ids->ndim != 2)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: ids must be (T, k), got shape %s", fn, MOE_SHAPE(ids));
  if (ids->shape[1] < 1)
    return moe_error(ctx, MOE_ERR_SHAPE, "%s: ids (T, k) needs k >= 1, got shape %s", fn,
                     MOE_SHAPE(ids));
  if (E < 1 || E > INT32_MAX - 1)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: number of experts E = %lld must be in [1, 2^31 - 2]",
                     fn, (long long)E);
  if (o->block_size < 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: block_size = %lld must be >= 0", fn,
                     (long long)o->block_size);
  if (o->ffn_hidden < 0 || (o->ffn_hidden > 0 && o->block_size == 0) ||
      (o->ffn_hidden > 0 && o->ffn_hidden % o->block_size != 0))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: ffn_hidden = %lld must be a positive multiple of block_size = %lld", fn,
                     (long long)o->ffn_hidden, (long long)o->block_size);
  if (!(o->capacity_factor >= 0) || isinf(o->capacity_factor))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: capacity_factor = %g must be finite and >= 0",
                     fn, o->capacity_factor);
  if (o->drop_policy != MOE_ROUTING_DROP_POSITION && o->drop_policy != MOE_ROUTING_DROP_SCORE)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: unknown drop_policy %d", fn, (int)o->drop_policy);
  if (o->drop_policy == MOE_ROUTING_DROP_SCORE) {
    if (o->capacity_factor == 0)
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s: drop_policy 'score' needs a capacity_factor > 0", fn);
    if (!o->scores)
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: drop_policy 'score' needs scores (T, k)", fn);
    MOE_CHECK(rt_check_float(ctx, fn, "scores", o->scores));
    MOE_CHECK(rt_check_2d(ctx, fn, "scores", o->scores, ids->shape[0], ids->shape[1], "ids' shape (T, k)"));
    MOE_CHECK(rt_check_device(ctx, fn, "scores", o->scores, ids->storage->device));
  }
  int64_t b = o->expert_begin, e = o->expert_end;
  if (!(b == 0 && e == 0) && !(0 <= b && b < e && e <= E))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: local experts [%lld, %lld) must be a non-empty range inside [0, %lld)", fn,
                     (long long)b, (long long)e, (long long)E);
  return MOE_OK;
}

moe_status moe_routing_plan_new(moe_ctx *ctx, const moe_tensor *ids, int64_t E,
                                const moe_routing_opts *opts, moe_routing_plan **out) {
  const char *fn = "routing_plan";
  if (!ids || !out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: ids or out is NULL", fn);
  moe_routing_opts o = opts ? *opts : moe_routing_opts_default();
  MOE_CHECK(rt_validate_opts(ctx, ids, E, &o));
  bool score = o.drop_policy == MOE_ROUTING_DROP_SCORE;
  moe_device d = ids->storage->device;
  int64_t T = ids->shape[0], k = ids->shape[1];
  if (k > 0 && T > INT64_MAX / 4 / k) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: T * k overflows", fn);
  int64_t N = T * k;
  if (d.type == MOE_DEVICE_CUDA && N > INT32_MAX)
    return moe_error(ctx, MOE_ERR_NOT_SUPPORTED, "%s: T * k = %lld assignments; CUDA takes at most 2^31 - 1",
                     fn, (long long)N);
  moe_routing_plan *p = (moe_routing_plan *)calloc(1, sizeof *p);
  if (!p) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: no host memory", fn);
  p->refcount = 1;
  p->device = d;
  p->T = T;
  p->k = k;
  p->E = E;
  p->N = N;
  p->e0 = o.expert_end > 0 ? o.expert_begin : 0;
  p->e1 = o.expert_end > 0 ? o.expert_end : E;
  p->block_size = o.block_size;
  p->drop_policy = o.drop_policy;
  if (o.capacity_factor > 0) {
    double c = ceil(o.capacity_factor * (double)N / (double)E);
    if (c > (double)(INT64_MAX / 4) / (double)E) {
      moe_routing_plan_release(p);
      return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: capacity_factor %g gives too many rows", fn,
                       o.capacity_factor);
    }
    p->capacity = rt_round_up((int64_t)c, o.block_size);
    if (p->capacity == 0) p->capacity = o.block_size > 0 ? o.block_size : 1;
  }
  moe_tensor *keys = NULL;
  moe_status st;
  MOE_CHECK_GOTO(rt_i64(ctx, E, d, &p->counts), st, fail);
  MOE_CHECK_GOTO(rt_i64(ctx, E, d, &p->kept), st, fail);
  MOE_CHECK_GOTO(rt_i64(ctx, E + 1, d, &p->offsets), st, fail);
  MOE_CHECK_GOTO(rt_i64(ctx, E + 1, d, &p->row_offsets), st, fail);
  MOE_CHECK_GOTO(rt_i64(ctx, N, d, &p->sort_perm), st, fail);
  MOE_CHECK_GOTO(rt_i64(ctx, N, d, &p->sort_inv), st, fail);
  MOE_CHECK_GOTO(rt_i64(ctx, N, d, &p->dest), st, fail);
  MOE_CHECK_GOTO(moe_tensor_empty(ctx, 1, (int64_t[]){N}, MOE_I32, d, &keys), st, fail);

  /* stage 1: sort by expert */
  const moe_tensor *scores = score ? o.scores : NULL;
  if (d.type == MOE_DEVICE_CUDA) {
    moe_kview vi = moe_kview_of(ids), vs;
    if (scores) vs = moe_kview_of(scores);
    st = moe_cuda_routing_sort(ctx, d.index, &vi, scores ? &vs : NULL, E,
                               (int32_t *)moe_tensor_data(keys), rt_p(p->sort_perm),
                               rt_p(p->sort_inv), rt_p(p->offsets), rt_p(p->counts));
  } else {
    memset(rt_p(p->counts), 0, sizeof(int64_t) * (size_t)E);
    st = rt_cpu_sort(ctx, ids, scores, E, (int32_t *)moe_tensor_data(keys), rt_p(p->sort_perm),
                     rt_p(p->sort_inv), rt_p(p->offsets), rt_p(p->counts));
  }
  if (st != MOE_OK) goto fail;

  /* the one host copy, when asked or when R depends on the data */
  bool local = p->e0 != 0 || p->e1 != E;
  bool data_rows = p->capacity == 0 && (p->block_size > 0 || local);
  if (o.known_counts) MOE_CHECK_GOTO(rt_known_counts(ctx, p, o.known_counts), st, fail);
  if (o.counts_to_host || data_rows) MOE_CHECK_GOTO(moe_routing_plan_counts_to_host(ctx, p), st, fail);
  if (p->capacity > 0) p->rows = (p->e1 - p->e0) * p->capacity;
  else if (data_rows) p->rows = p->row_offsets_host[E];
  else p->rows = N;
  MOE_CHECK_GOTO(rt_i64(ctx, p->rows, d, &p->src), st, fail);

  /* stage 2: the buffer layout */
  if (d.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_routing_layout(ctx, d.index, N, E, p->e0, p->e1, p->capacity, p->block_size,
                                 p->rows, (const int32_t *)moe_tensor_data(keys),
                                 rt_p(p->sort_perm), rt_p(p->offsets), rt_p(p->counts),
                                 rt_p(p->kept), rt_p(p->row_offsets), rt_p(p->dest),
                                 rt_p(p->src));
  } else {
    st = rt_cpu_layout(ctx, N, E, p->e0, p->e1, p->capacity, p->block_size, p->rows,
                       (const int32_t *)moe_tensor_data(keys), rt_p(p->sort_perm),
                       rt_p(p->offsets), rt_p(p->counts), rt_p(p->kept), rt_p(p->row_offsets),
                       rt_p(p->dest), rt_p(p->src));
  }
  if (st != MOE_OK) goto fail;

  /* stage 3: the block-sparse topology */
  if (p->block_size > 0 && o.ffn_hidden > 0) {
    int64_t bs = p->block_size, F = o.ffn_hidden / bs, Rb = p->rows / bs, EL = p->e1 - p->e0;
    if (Rb > 0 && F > INT64_MAX / 4 / Rb) {
      st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: the topology has too many blocks", fn);
      goto fail;
    }
    p->ffn_blocks = F;
    p->nnz = Rb * F;
    MOE_CHECK_GOTO(rt_i64(ctx, p->nnz, d, &p->bs_row_indices), st, fail);
    MOE_CHECK_GOTO(rt_i64(ctx, p->nnz, d, &p->bs_column_indices), st, fail);
    MOE_CHECK_GOTO(rt_i64(ctx, Rb + 1, d, &p->bs_offsets), st, fail);
    MOE_CHECK_GOTO(rt_i64(ctx, p->nnz, d, &p->bs_column_indices_t), st, fail);
    MOE_CHECK_GOTO(rt_i64(ctx, EL * F + 1, d, &p->bs_offsets_t), st, fail);
    MOE_CHECK_GOTO(rt_i64(ctx, p->nnz, d, &p->bs_block_offsets_t), st, fail);
    if (d.type == MOE_DEVICE_CUDA) {
      st = moe_cuda_routing_topology(ctx, d.index, rt_p(p->row_offsets), p->e0, p->e1, bs, F, Rb,
                                     rt_p(p->bs_row_indices), rt_p(p->bs_column_indices),
                                     rt_p(p->bs_offsets), rt_p(p->bs_column_indices_t),
                                     rt_p(p->bs_offsets_t), rt_p(p->bs_block_offsets_t));
      if (st != MOE_OK) goto fail;
    } else {
      rt_cpu_topology(rt_p(p->row_offsets), p->e0, p->e1, bs, F, Rb, rt_p(p->bs_row_indices),
                      rt_p(p->bs_column_indices), rt_p(p->bs_offsets),
                      rt_p(p->bs_column_indices_t), rt_p(p->bs_offsets_t),
                      rt_p(p->bs_block_offsets_t));
    }
  }
  moe_tensor_release(keys);
  *out = p;
  return MOE_OK;
fail:
  moe_tensor_release(keys);
  moe_routing_plan_release(p);
  return st;
}

moe_status moe_routing_rank_counts(moe_ctx *ctx, const moe_routing_plan *p, int64_t n_ranks,
                                   moe_tensor **out) {
  const char *fn = "routing_rank_counts";
  if (!p || !out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: plan or out is NULL", fn);
  if (n_ranks < 1 || p->E % n_ranks != 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: %lld ranks do not divide E = %lld experts", fn,
                     (long long)n_ranks, (long long)p->E);
  moe_tensor *r;
  MOE_CHECK(rt_i64(ctx, n_ranks, p->device, &r));
  moe_status st = MOE_OK;
  if (p->device.type == MOE_DEVICE_CUDA) {
    st = moe_cuda_routing_rank_counts(ctx, p->device.index, rt_p(p->offsets), p->E, n_ranks, rt_p(r));
  } else {
    const int64_t *off = rt_p(p->offsets);
    for (int64_t i = 0; i < n_ranks; i++)
      rt_p(r)[i] = off[(i + 1) * (p->E / n_ranks)] - off[i * (p->E / n_ranks)];
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------- data movement (raw) */

static inline const char *rt_at(const moe_tensor *t, int64_t i, int64_t j) {
  return (const char *)moe_tensor_data(t) +
         (i * t->stride[0] + j * t->stride[1]) * (int64_t)moe_dtype_size(t->dtype);
}

/* Whether every buffer row of p holds an assignment: no block or capacity
 * padding, and every expert local, so the rows are exactly the N slots. */
static bool rt_unpadded(const moe_routing_plan *p) {
  return p->block_size == 0 && p->capacity == 0 && p->e0 == 0 && p->e1 == p->E && p->rows == p->N;
}

/* out (R, d) = [gates[src[r]] *] x[src[r] / k]; no autograd. */
static moe_status rt_gather(moe_ctx *ctx, const moe_tensor *x, const moe_routing_plan *p,
                            const moe_tensor *gates, moe_tensor **out) {
  int64_t R = p->rows, d = x->shape[1], k = p->k;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, 2, (int64_t[]){R, d}, x->dtype, p->device, &r));
  moe_status st = MOE_OK;
  if (R * d > 0 && p->device.type == MOE_DEVICE_CUDA) {
    moe_kview vo = moe_kview_of(r), vx = moe_kview_of(x), vg;
    if (gates) vg = moe_kview_of(gates);
    st = moe_cuda_routing_gather(ctx, p->device.index, &vo, &vx, rt_p(p->src), rt_p(p->dest),
                                 gates ? &vg : NULL, k, !rt_unpadded(p));
  } else if (R * d > 0) {
    const int64_t *src = rt_p(p->src);
    moe_dtype dt = x->dtype;
    size_t es = moe_dtype_size(dt);
    char *po = (char *)moe_tensor_data(r);
#pragma omp parallel for if (R * d >= 65536)
    for (int64_t row = 0; row < R; row++) {
      int64_t a = src[row];
      char *o = po + row * d * (int64_t)es;
      if (a < 0) {
        for (int64_t c = 0; c < d; c++) moe_store_f64(o + c * (int64_t)es, dt, 0.0);
        continue;
      }
      int64_t t = a / k;
      if (!gates) {
        for (int64_t c = 0; c < d; c++) memcpy(o + c * (int64_t)es, rt_at(x, t, c), es);
      } else if (dt == MOE_F64) {
        double g = moe_load_f64(rt_at(gates, t, a % k), gates->dtype);
        for (int64_t c = 0; c < d; c++)
          moe_store_f64(o + c * (int64_t)es, dt, g * moe_load_f64(rt_at(x, t, c), dt));
      } else {
        float g = (float)moe_load_f64(rt_at(gates, t, a % k), gates->dtype);
        for (int64_t c = 0; c < d; c++) {
          float v = g * (float)moe_load_f64(rt_at(x, t, c), dt);
          moe_store_f64(o + c * (int64_t)es, dt, (double)v);
        }
      }
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* out (T, d) = sum_j [gates[t, j] *] y[dest[t * k + j]]; no autograd. */
static moe_status rt_combine(moe_ctx *ctx, const moe_tensor *y, const moe_routing_plan *p,
                             const moe_tensor *gates, moe_tensor **out) {
  int64_t T = p->T, d = y->shape[1], k = p->k;
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, 2, (int64_t[]){T, d}, y->dtype, p->device, &r));
  moe_status st = MOE_OK;
  if (T * d > 0 && p->device.type == MOE_DEVICE_CUDA) {
    moe_kview vo = moe_kview_of(r), vy = moe_kview_of(y), vg;
    if (gates) vg = moe_kview_of(gates);
    st = moe_cuda_routing_combine(ctx, p->device.index, &vo, &vy, rt_p(p->dest), gates ? &vg : NULL, k);
  } else if (T * d > 0) {
    const int64_t *dest = rt_p(p->dest);
    moe_dtype dt = y->dtype;
    size_t es = moe_dtype_size(dt);
    char *po = (char *)moe_tensor_data(r);
#pragma omp parallel for if (T * d * k >= 65536)
    for (int64_t t = 0; t < T; t++) {
      char *o = po + t * d * (int64_t)es;
      for (int64_t c = 0; c < d; c++) {
        if (dt == MOE_F64) {
          double acc = 0;
          for (int64_t j = 0; j < k; j++) {
            int64_t row = dest[t * k + j];
            if (row < 0) continue;
            double g = gates ? moe_load_f64(rt_at(gates, t, j), gates->dtype) : 1.0;
            double prod = g * moe_load_f64(rt_at(y, row, c), dt);
            acc = acc + prod;
          }
          moe_store_f64(o + c * (int64_t)es, dt, acc);
        } else {
          float acc = 0;
          for (int64_t j = 0; j < k; j++) {
            int64_t row = dest[t * k + j];
            if (row < 0) continue;
            float g = gates ? (float)moe_load_f64(rt_at(gates, t, j), gates->dtype) : 1.0f;
            float prod = g * (float)moe_load_f64(rt_at(y, row, c), dt);
            acc = acc + prod;
          }
          moe_store_f64(o + c * (int64_t)es, dt, (double)acc);
        }
      }
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* dgates (T, k) of dtype gdt = dot(dout[t], y[dest[a]]), 0 when dropped. */
static moe_status rt_gate_grad(moe_ctx *ctx, const moe_tensor *dout, const moe_tensor *y,
                               const moe_routing_plan *p, moe_dtype gdt, moe_tensor **out) {
  int64_t T = p->T, k = p->k, d = y->shape[1];
  moe_tensor *r;
  MOE_CHECK(moe_tensor_empty(ctx, 2, (int64_t[]){T, k}, gdt, p->device, &r));
  moe_status st = MOE_OK;
  if (T * k > 0 && p->device.type == MOE_DEVICE_CUDA) {
    moe_kview vo = moe_kview_of(r), vd = moe_kview_of(dout), vy = moe_kview_of(y);
    st = moe_cuda_routing_gate_grad(ctx, p->device.index, &vo, &vd, &vy, rt_p(p->dest), k);
  } else if (T * k > 0) {
    const int64_t *dest = rt_p(p->dest);
    char *po = (char *)moe_tensor_data(r);
    size_t es = moe_dtype_size(gdt);
#pragma omp parallel for if (T * k * d >= 65536)
    for (int64_t a = 0; a < T * k; a++) {
      int64_t row = dest[a];
      double acc = 0;
      if (row >= 0)
        for (int64_t c = 0; c < d; c++)
          acc += moe_load_f64(rt_at(dout, a / k, c), dout->dtype) * moe_load_f64(rt_at(y, row, c), y->dtype);
      moe_store_f64(po + a * (int64_t)es, gdt, acc);
    }
  }
  if (st != MOE_OK) {
    moe_tensor_release(r);
    return st;
  }
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------------ permute */

static moe_status rt_permute_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                      moe_tensor **gin) {
  if (!moe_node_needs_grad(n, 0)) return MOE_OK;
  if (!gout[0]) return moe_node_zeros_input(ctx, n, 0, &gin[0]);
  return rt_combine(ctx, gout[0], (const moe_routing_plan *)n->user, NULL, &gin[0]);
}

moe_status moe_routing_permute(moe_ctx *ctx, moe_tensor *x, moe_routing_plan *p,
                               moe_tensor **out) {
  const char *fn = "routing_permute";
  if (!x || !p || !out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: x, plan or out is NULL", fn);
  MOE_CHECK(rt_check_float(ctx, fn, "x", x));
  MOE_CHECK(rt_check_2d(ctx, fn, "x", x, p->T, -1, "(T, d) with the plan's T"));
  MOE_CHECK(rt_check_device(ctx, fn, "x", x, p->device));
  moe_tensor *r;
  MOE_CHECK(rt_gather(ctx, x, p, NULL, &r));
  /* the backward needs the plan alone: nothing is saved */
  moe_routing_plan_retain(p);
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_ROUTING_PERMUTE, .backward = rt_permute_backward, .n_in = 1, .in = {x},
      .user = p, .user_free = rt_plan_release_void}, 1, &r));
  *out = r;
  return MOE_OK;
}

/* ------------------------------------------------------------ combine */

static moe_status rt_combine_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
                                      moe_tensor **gin) {
  const moe_routing_plan *p = (const moe_routing_plan *)n->user;
  bool has_gates = n->n_inputs == 2;
  if (!gout[0]) return moe_node_zero_grads(ctx, n, gin);
  moe_tensor *y = NULL, *gates = NULL;
  moe_status st = MOE_OK;
  if (has_gates) MOE_CHECK_GOTO(moe_node_saved(ctx, n, 1, &gates), st, done);
  if (moe_node_needs_grad(n, 0)) {
    /* dy has y's dtype; gout has it too */
    MOE_CHECK_GOTO(rt_gather(ctx, gout[0], p, gates, &gin[0]), st, done);
  }
  if (has_gates && moe_node_needs_grad(n, 1)) {
    MOE_CHECK_GOTO(moe_node_saved(ctx, n, 0, &y), st, done);
    MOE_CHECK_GOTO(rt_gate_grad(ctx, gout[0], y, p, n->in_dtype[1], &gin[1]), st, done);
  }
done:
  moe_tensor_release(y);
  moe_tensor_release(gates);
  return st;
}

moe_status moe_routing_combine(moe_ctx *ctx, moe_tensor *y, moe_routing_plan *p,
                               moe_tensor *gates, moe_tensor **out) {
  const char *fn = "routing_combine";
  if (!y || !p || !out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: y, plan or out is NULL", fn);
  MOE_CHECK(rt_check_float(ctx, fn, "y", y));
  MOE_CHECK(rt_check_2d(ctx, fn, "y", y, p->rows, -1, "(R, d) with the plan's R rows"));
  MOE_CHECK(rt_check_device(ctx, fn, "y", y, p->device));
  if (gates) {
    MOE_CHECK(rt_check_float(ctx, fn, "gates", gates));
    MOE_CHECK(rt_check_2d(ctx, fn, "gates", gates, p->T, p->k, "the plan's (T, k)"));
    MOE_CHECK(rt_check_device(ctx, fn, "gates", gates, p->device));
  }
  moe_tensor *r;
  MOE_CHECK(rt_combine(ctx, y, p, gates, &r));
  int n_in = gates ? 2 : 1;
  moe_routing_plan_retain(p);
  MOE_CHECK(moe_record(ctx, &(moe_record_spec){
      .op = MOE_OP_ROUTING_COMBINE, .backward = rt_combine_backward, .n_in = n_in,
      .in = {y, gates}, .n_save = n_in, .save = {y, gates},
      .user = p, .user_free = rt_plan_release_void}, 1, &r));
  *out = r;
  return MOE_OK;
}
