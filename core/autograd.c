/*
 * autograd.c - the reverse-mode engine behind moe_autograd.h: per-tensor
 * autograd state (requires_grad, .grad, grad_fn), graph nodes and their
 * edges, saved tensors (through the saved-tensor hooks when pushed), grad
 * mode, moe_backward (with its leaf hook) and moe_sum_to_shape.
 *
 * Ownership, chosen so that the graph has no reference cycles and frees
 * deterministically:
 *   - a tensor holds its grad_fn node (one reference) and its .grad;
 *   - a node holds its producers' nodes and the leaves it feeds (edges);
 *   - a node never holds its outputs, only their metadata;
 *   - a saved tensor is kept as a fresh header over the same storage with no
 *     autograd state (so saving an op's own output makes no cycle), or as the
 *     value the hooks packed from such a header.
 * Releasing the last tensor of a graph therefore frees every node behind it;
 * nodes are freed from a worklist, never by recursion, so a chain of a
 * million ops frees without growing the C stack.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"


/* The state behind moe_tensor.autograd (NULL for a tensor that never took
 * part in autograd). */
typedef struct moe_autograd_meta {
  bool requires_grad; /* set by the user on a leaf */
  moe_tensor *grad;   /* accumulated gradient, the tensor's shape; or NULL */
  moe_node *grad_fn;  /* producer (one reference), NULL for a leaf */
  int output;         /* which output of grad_fn this tensor is */
} moe_autograd_meta;

/* A value saved while hooks were pushed, with what unpack must give back. */
typedef struct saved_packed {
  void *packed;                 /* what hooks->pack returned */
  moe_dtype dtype;
  moe_device device;
  int ndim;
  int64_t shape[MOE_MAX_DIMS];  /* (ndim) */
} saved_packed;

static moe_autograd_meta *meta_of(const moe_tensor *t) {
  return t ? (moe_autograd_meta *)t->autograd : NULL;
}

static moe_status meta_get(moe_ctx *ctx, const char *fn, moe_tensor *t, moe_autograd_meta **out) {
  moe_autograd_meta *m = meta_of(t);
  if (!m) {
    m = calloc(1, sizeof(*m));
    if (!m) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
    t->autograd = m;
  }
  *out = m;
  return MOE_OK;
}

static bool same_shape(int na, const int64_t *a, int nb, const int64_t *b) {
  if (na != nb) return false;
  for (int i = 0; i < na; i++)
    if (a[i] != b[i]) return false;
  return true;
}

/* A new header over t's storage and layout, without autograd state. */
static moe_status header_alias(moe_ctx *ctx, const char *fn, const moe_tensor *t,
                               moe_tensor **out) {
  moe_tensor *a = calloc(1, sizeof(*a));
  if (!a) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "%s: out of host memory", fn);
  *a = *t;
  a->refcount = 1;
  a->autograd = NULL;
  moe_storage_retain(a->storage);
  *out = a;
  return MOE_OK;
}

/* ---------------------------------------------------------- grad mode */

bool moe_grad_enabled(const moe_ctx *ctx) { return ctx && ctx->grad_enabled; }

bool moe_grad_set(moe_ctx *ctx, bool enabled) {
  if (!ctx) return false;
  bool prev = ctx->grad_enabled;
  ctx->grad_enabled = enabled;
  return prev;
}

/* ----------------------------------------------------- tensor fields */

bool moe_requires_grad(const moe_tensor *t) {
  const moe_autograd_meta *m = meta_of(t);
  return m && (m->requires_grad || m->grad_fn);
}

moe_status moe_set_requires_grad(moe_ctx *ctx, moe_tensor *t, bool requires) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "requires_grad: tensor is NULL");
  moe_autograd_meta *m = meta_of(t);
  if (m && m->grad_fn)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "requires_grad: only leaf tensors can change requires_grad (this one is the "
                     "output of %s; use detach() for a leaf)",
                     moe_node_name(m->grad_fn));
  if (requires && !moe_dtype_is_float(t->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "requires_grad: only floating-point tensors can require grad, not %s",
                     moe_dtype_name(t->dtype));
  if (!m && !requires) return MOE_OK;
  MOE_CHECK(meta_get(ctx, "requires_grad", t, &m));
  m->requires_grad = requires;
  return MOE_OK;
}

moe_tensor *moe_tensor_grad(const moe_tensor *t) {
  const moe_autograd_meta *m = meta_of(t);
  return m ? m->grad : NULL;
}

moe_status moe_tensor_set_grad(moe_ctx *ctx, moe_tensor *t, moe_tensor *g) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "set_grad: tensor is NULL");
  moe_autograd_meta *m = meta_of(t);
  if (!g) {
    if (m && m->grad) {
      moe_tensor *old = m->grad;
      m->grad = NULL;
      moe_tensor_release(old);
    }
    return MOE_OK;
  }
  if (g == t)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "set_grad: a tensor cannot be its own gradient");
  if (!same_shape(g->ndim, g->shape, t->ndim, t->shape))
    return moe_error(ctx, MOE_ERR_SHAPE, "set_grad: gradient of shape %s for a tensor of shape %s",
                     MOE_SHAPE(g), MOE_SHAPE(t));
  MOE_CHECK(moe_check_same_dtype(ctx, "set_grad", "the gradient", g->dtype, "the tensor", t->dtype));
  MOE_CHECK(moe_check_same_device(ctx, "set_grad", "the gradient", moe_tensor_device(g),
                                  "the tensor", moe_tensor_device(t)));
  MOE_CHECK(meta_get(ctx, "set_grad", t, &m));
  moe_tensor_retain(g);
  moe_tensor *old = m->grad;
  m->grad = g;
  moe_tensor_release(old);
  return MOE_OK;
}

moe_node *moe_tensor_grad_fn(const moe_tensor *t) {
  const moe_autograd_meta *m = meta_of(t);
  return m ? m->grad_fn : NULL;
}

bool moe_tensor_is_leaf(const moe_tensor *t) { return moe_tensor_grad_fn(t) == NULL; }

moe_status moe_detach(moe_ctx *ctx, moe_tensor *t, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!t) return moe_error(ctx, MOE_ERR_INVALID_ARG, "detach: tensor is NULL");
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "detach: out is NULL");
  return header_alias(ctx, "detach", t, out);
}

void moe_autograd_meta_free(moe_tensor *t) {
  moe_autograd_meta *m = meta_of(t);
  if (!m) return;
  t->autograd = NULL;
  moe_tensor_release(m->grad);
  moe_node_release(m->grad_fn);
  free(m);
}

/* -------------------------------------------------------- saved hooks */

static void hooks_retain(moe_saved_hooks *h) { h->refcount++; }

static void hooks_release(moe_saved_hooks *h) {
  if (!h) return;
  MOE_ASSERT(h->refcount > 0);
  if (--h->refcount > 0) return;
  if (h->free_ud) h->free_ud(h->ud);
  free(h);
}

moe_status moe_saved_hooks_push(moe_ctx *ctx, const moe_saved_hooks *hooks) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!hooks || !hooks->pack || !hooks->unpack)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "saved_hooks_push: hooks and their pack and unpack functions are required");
  int cap = (int)(sizeof(ctx->hooks) / sizeof(ctx->hooks[0]));
  if (ctx->n_hooks >= cap)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "saved_hooks_push: more than %d saved-tensor hooks nested", cap);
  moe_saved_hooks *h = malloc(sizeof(*h));
  if (!h) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "saved_hooks_push: out of host memory");
  *h = *hooks;
  h->refcount = 1;
  ctx->hooks[ctx->n_hooks++] = h;
  return MOE_OK;
}

moe_status moe_saved_hooks_pop(moe_ctx *ctx) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (ctx->n_hooks <= 0)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "saved_hooks_pop: no saved-tensor hooks are pushed");
  moe_saved_hooks *h = ctx->hooks[--ctx->n_hooks];
  ctx->hooks[ctx->n_hooks] = NULL;
  hooks_release(h);
  return MOE_OK;
}

/* --------------------------------------------------------------- nodes */

bool moe_grad_wanted(const moe_ctx *ctx, int n, const moe_tensor *const *inputs) {
  if (!ctx || !ctx->grad_enabled || !inputs) return false;
  for (int i = 0; i < n; i++)
    if (moe_requires_grad(inputs[i])) return true;
  return false;
}

moe_status moe_node_new(moe_ctx *ctx, moe_op op, moe_backward_fn backward, int n_inputs,
                        moe_tensor *const *inputs, moe_node **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  const char *name = moe_op_name(op);
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_new (%s): out is NULL", name);
  if (!backward)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_new (%s): backward function is NULL", name);
  if (n_inputs < 0 || n_inputs > MOE_NODE_MAX_INPUTS)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_new (%s): %d inputs (at most %d)", name,
                     n_inputs, MOE_NODE_MAX_INPUTS);
  if (n_inputs > 0 && !inputs)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_new (%s): inputs is NULL", name);
  moe_node *n = calloc(1, sizeof(*n));
  if (!n) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "node_new (%s): out of host memory", name);
  n->refcount = 1;
  n->op = op;
  n->backward = backward;
  n->n_inputs = n_inputs;
  for (int i = 0; i < n_inputs; i++) {
    moe_tensor *t = inputs[i]; /* NULL: an optional input that is absent */
    if (!t) continue;
    moe_autograd_meta *m = meta_of(t);
    if (m && m->grad_fn) {
      n->next[i].node = m->grad_fn;
      n->next[i].output = m->output;
      moe_node_retain(m->grad_fn);
      n->needs_grad[i] = true;
    } else if (m && m->requires_grad) {
      n->next[i].leaf = t;
      moe_tensor_retain(t);
      n->needs_grad[i] = true;
    }
    n->in_dtype[i] = t->dtype;
    n->in_device[i] = moe_tensor_device(t);
    n->in_ndim[i] = t->ndim;
    memcpy(n->in_shape[i], t->shape, sizeof(int64_t) * (size_t)t->ndim);
  }
  *out = n;
  return MOE_OK;
}

moe_status moe_record(moe_ctx *ctx, const moe_record_spec *spec, int n_out, moe_tensor **outs) {
  moe_status st = MOE_OK;
  moe_node *n = NULL;
  if (!ctx || !spec || n_out < 1 || n_out > MOE_NODE_MAX_OUTPUTS || !outs) {
    st = ctx ? moe_error(ctx, MOE_ERR_INVALID_ARG, "record: bad spec or outputs") : MOE_ERR_INVALID_ARG;
    goto fail;
  }
  if (!moe_grad_wanted(ctx, spec->n_in, (const moe_tensor *const *)spec->in)) {
    if (spec->user_free) spec->user_free(spec->user);
    return MOE_OK;
  }
  if (spec->n_save < 0 || spec->n_save > MOE_NODE_MAX_SAVED) {
    st = moe_error(ctx, MOE_ERR_INVALID_ARG, "record (%s): %d saved tensors (at most %d)",
                   moe_op_name(spec->op), spec->n_save, MOE_NODE_MAX_SAVED);
    goto fail;
  }
  MOE_CHECK_GOTO(moe_node_new(ctx, spec->op, spec->backward, spec->n_in, spec->in, &n), st, fail);
  n->user = spec->user;
  n->user_free = spec->user_free;
  n->name = spec->name;
  memcpy(n->iargs, spec->iargs, sizeof n->iargs);
  memcpy(n->dargs, spec->dargs, sizeof n->dargs);
  for (int i = 0; i < spec->n_save; i++) MOE_CHECK_GOTO(moe_node_save(ctx, n, spec->save[i]), st, fail_node);
  for (int k = 0; k < n_out; k++) MOE_CHECK_GOTO(moe_node_set_output(ctx, n, k, outs[k]), st, fail_node);
  moe_node_release(n); /* the outputs hold it now */
  return MOE_OK;
fail_node:
  moe_node_release(n); /* frees user through user_free */
  goto release_outs;
fail:
  if (spec && spec->user_free) spec->user_free(spec->user);
release_outs:
  if (outs)
    for (int k = 0; k < n_out && k < MOE_NODE_MAX_OUTPUTS; k++) {
      moe_tensor_release(outs[k]);
      outs[k] = NULL;
    }
  return st;
}

moe_status moe_node_zeros_input(moe_ctx *ctx, const moe_node *n, int i, moe_tensor **out) {
  return moe_tensor_full(ctx, n->in_ndim[i], n->in_shape[i], 0.0, n->in_dtype[i], n->in_device[i],
                         out);
}

moe_status moe_node_zero_grads(moe_ctx *ctx, const moe_node *n, moe_tensor **gin) {
  for (int i = 0; i < n->n_inputs; i++) {
    if (!moe_node_needs_grad(n, i)) continue;
    moe_status st = moe_node_zeros_input(ctx, n, i, &gin[i]);
    if (st != MOE_OK) {
      for (int j = 0; j < i; j++) {
        moe_tensor_release(gin[j]);
        gin[j] = NULL;
      }
      return st;
    }
  }
  return MOE_OK;
}

void moe_node_retain(moe_node *n) {
  if (n) n->refcount++;
}

/* Releases the saved slots of n (through the hooks that packed them). */
static void slot_free(moe_node *n, int i) {
  moe_saved_hooks *h = (moe_saved_hooks *)n->saved_hooks;
  void *p = n->saved[i];
  n->saved[i] = NULL;
  if (!p) return;
  if (h) {
    saved_packed *sp = (saved_packed *)p;
    if (h->free_packed) h->free_packed(h->ud, sp->packed);
    free(sp);
  } else {
    moe_tensor_release((moe_tensor *)p);
  }
}

static void node_free_saved(moe_node *n) {
  moe_saved_hooks *h = (moe_saved_hooks *)n->saved_hooks;
  for (int i = 0; i < n->n_saved; i++) slot_free(n, i);
  n->n_saved = 0;
  n->saved_hooks = NULL;
  hooks_release(h);
}

/* Frees n's own resources and hands its producer nodes (whose last reference
 * this was) to push. */
static void node_free(moe_node *n, void (*push)(void *, moe_node *), void *list) {
  node_free_saved(n);
  for (int i = 0; i < n->n_inputs; i++) {
    moe_node *p = n->next[i].node;
    moe_tensor *leaf = n->next[i].leaf;
    n->next[i].node = NULL;
    n->next[i].leaf = NULL;
    moe_tensor_release(leaf);
    if (p) {
      MOE_ASSERT(p->refcount > 0);
      if (--p->refcount == 0) push(list, p);
    }
  }
  if (n->user_free) n->user_free(n->user);
  free(n);
}

/* A worklist of nodes to free: a small array on the stack, grown on the heap. */
typedef struct node_list {
  moe_node **items;
  int64_t len, cap;
  moe_node *small[32];
} node_list;

static void node_list_push(void *list, moe_node *n) {
  node_list *l = (node_list *)list;
  if (l->len == l->cap) {
    int64_t cap = l->cap * 2;
    moe_node **grown = l->items == l->small ? malloc(sizeof(*grown) * (size_t)cap)
                                            : realloc(l->items, sizeof(*grown) * (size_t)cap);
    if (!grown) {
      /* no memory for the worklist: free this one by recursion instead */
      node_free(n, node_list_push, list);
      return;
    }
    if (l->items == l->small) memcpy(grown, l->small, sizeof(l->small));
    l->items = grown;
    l->cap = cap;
  }
  l->items[l->len++] = n;
}

void moe_node_release(moe_node *n) {
  if (!n) return;
  MOE_ASSERT(n->refcount > 0);
  if (--n->refcount > 0) return;
  node_list l;
  l.items = l.small;
  l.len = 0;
  l.cap = (int64_t)(sizeof(l.small) / sizeof(l.small[0]));
  node_list_push(&l, n);
  while (l.len > 0) node_free(l.items[--l.len], node_list_push, &l);
  if (l.items != l.small) free(l.items);
}

bool moe_node_needs_grad(const moe_node *n, int i) {
  return n && i >= 0 && i < n->n_inputs && n->needs_grad[i];
}

const char *moe_node_name(const moe_node *n) {
  if (!n) return "(none)";
  return n->name ? n->name : moe_op_name(n->op);
}

moe_status moe_node_save(moe_ctx *ctx, moe_node *n, moe_tensor *t) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!n) return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_save: node is NULL");
  const char *name = moe_node_name(n);
  if (n->released)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_save (%s): the node was already released",
                     name);
  if (n->n_saved >= MOE_NODE_MAX_SAVED)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_save (%s): more than %d saved tensors", name,
                     MOE_NODE_MAX_SAVED);
  if (!t) { /* an optional tensor that is absent: saved as NULL */
    n->saved[n->n_saved++] = NULL;
    return MOE_OK;
  }
  moe_saved_hooks *h = ctx->n_hooks > 0 ? ctx->hooks[ctx->n_hooks - 1] : NULL;
  if (n->n_saved > 0 && h != (moe_saved_hooks *)n->saved_hooks)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "node_save (%s): the saved-tensor hooks changed between saves of one node",
                     name);
  moe_tensor *a = NULL;
  MOE_CHECK(header_alias(ctx, "node_save", t, &a));
  if (!h) {
    n->saved[n->n_saved++] = a;
    return MOE_OK;
  }
  saved_packed *sp = calloc(1, sizeof(*sp));
  if (!sp) {
    moe_tensor_release(a);
    return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "node_save (%s): out of host memory", name);
  }
  sp->dtype = t->dtype;
  sp->device = moe_tensor_device(t);
  sp->ndim = t->ndim;
  memcpy(sp->shape, t->shape, sizeof(int64_t) * (size_t)t->ndim);
  moe_status st = h->pack(ctx, h->ud, a, &sp->packed);
  moe_tensor_release(a);
  if (st != MOE_OK) {
    free(sp);
    return st;
  }
  if (!n->saved_hooks) {
    hooks_retain(h);
    n->saved_hooks = h;
  }
  n->saved[n->n_saved++] = sp;
  return MOE_OK;
}

bool moe_node_saved_owned(moe_ctx *ctx, const moe_node *n, int i, const moe_tensor *t,
                          int64_t held) {
  if (!ctx || !n || !t || !ctx->backward_frees || n->released || n->saved_hooks) return false;
  if (i < 0 || i >= n->n_saved || n->saved[i] != t) return false;
  bool owned = t->refcount == 1 + held && t->storage && t->storage->refcount == 1 &&
               !t->storage->data_freed && !t->storage->not_ready;
  if (owned) ctx->backward_owned = true;
  return owned;
}

void moe_node_saved_free(moe_ctx *ctx, moe_node *n, int i) {
  if (!ctx || !n || !ctx->backward_frees || n->released || i < 0 || i >= n->n_saved) return;
  if (!n->saved[i]) return;
  slot_free(n, i);
  ctx->backward_owned = true;
}

moe_status moe_node_saved(moe_ctx *ctx, moe_node *n, int i, moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!n) return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_saved: node is NULL");
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_saved: out is NULL");
  const char *name = moe_node_name(n);
  if (n->released)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s: saved tensors were freed: call backward with retain_graph to "
                     "backward through the graph a second time",
                     name);
  if (i < 0 || i >= n->n_saved)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_saved (%s): slot %d of %d saved tensors",
                     name, i, n->n_saved);
  void *p = n->saved[i];
  if (!p) {
    *out = NULL;
    return MOE_OK;
  }
  moe_saved_hooks *h = (moe_saved_hooks *)n->saved_hooks;
  if (!h) {
    /* a sharded parameter released after its forward: gathered again here */
    MOE_CHECK(moe_storage_ready(ctx, ((moe_tensor *)p)->storage, name));
    moe_tensor_retain((moe_tensor *)p);
    *out = (moe_tensor *)p;
    return MOE_OK;
  }
  saved_packed *sp = (saved_packed *)p;
  moe_tensor *t = NULL;
  MOE_CHECK(h->unpack(ctx, h->ud, sp->packed, &t));
  moe_status st = MOE_OK;
  if (!t)
    st = moe_error(ctx, MOE_ERR_INVALID_ARG, "%s: the unpack hook gave no tensor for saved slot %d",
                   name, i);
  else if (!same_shape(t->ndim, t->shape, sp->ndim, sp->shape))
    st = moe_error(ctx, MOE_ERR_SHAPE,
                   "%s: the unpack hook gave shape %s for saved slot %d, which had shape %s", name,
                   MOE_SHAPE(t), i, MOE_SHAPE_OF(sp->ndim, sp->shape));
  else if (t->dtype != sp->dtype)
    st = moe_error(ctx, MOE_ERR_DTYPE,
                   "%s: the unpack hook gave dtype %s for saved slot %d, which had dtype %s", name,
                   moe_dtype_name(t->dtype), i, moe_dtype_name(sp->dtype));
  else if (!moe_device_equal(moe_tensor_device(t), sp->device))
    st = moe_error(ctx, MOE_ERR_DEVICE,
                   "%s: the unpack hook gave a tensor on %s for saved slot %d, which was on %s",
                   name, MOE_DEVICE(moe_tensor_device(t)), i, MOE_DEVICE(sp->device));
  if (st == MOE_OK) st = moe_storage_ready(ctx, t->storage, name);
  if (st != MOE_OK) {
    moe_tensor_release(t);
    return st;
  }
  *out = t;
  return MOE_OK;
}

moe_status moe_node_set_output(moe_ctx *ctx, moe_node *n, int k, moe_tensor *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!n) return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_set_output: node is NULL");
  const char *name = moe_node_name(n);
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_set_output (%s): tensor is NULL", name);
  if (k < 0 || k >= MOE_NODE_MAX_OUTPUTS)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "node_set_output (%s): output %d (at most %d)",
                     name, k, MOE_NODE_MAX_OUTPUTS);
  if (!moe_dtype_is_float(out->dtype))
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "node_set_output (%s): output %d of dtype %s cannot carry a gradient", name, k,
                     moe_dtype_name(out->dtype));
  moe_autograd_meta *m = NULL;
  MOE_CHECK(meta_get(ctx, "node_set_output", out, &m));
  n->out_dtype[k] = out->dtype;
  n->out_ndim[k] = out->ndim;
  memcpy(n->out_shape[k], out->shape, sizeof(int64_t) * (size_t)out->ndim);
  if (k >= n->n_outputs) n->n_outputs = k + 1;
  moe_node_retain(n);
  moe_node *old = m->grad_fn;
  m->grad_fn = n;
  m->output = k;
  m->requires_grad = false; /* a non-leaf requires grad through grad_fn */
  moe_node_release(old);
  return MOE_OK;
}

/* ---------------------------------------------------------- leaf hook */

void moe_autograd_set_grad_ready(moe_ctx *ctx, moe_grad_ready_fn fn, void *ud) {
  if (!ctx) return;
  ctx->grad_ready = fn;
  ctx->grad_ready_ud = fn ? ud : NULL;
}

/* ---------------------------------------------------------- sum_to_shape */

moe_status moe_sum_to_shape(moe_ctx *ctx, moe_tensor *g, int ndim, const int64_t *shape,
                            moe_tensor **out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!g || !out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "sum_to_shape: tensor or out is NULL");
  if (ndim < 0 || ndim > MOE_MAX_DIMS || (ndim > 0 && !shape))
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "sum_to_shape: bad target shape (%d dims)", ndim);
  if (same_shape(g->ndim, g->shape, ndim, shape)) {
    moe_tensor_retain(g);
    *out = g;
    return MOE_OK;
  }
  int lead = g->ndim - ndim;
  int64_t dims[MOE_MAX_DIMS];
  int nd = 0;
  bool ok = lead >= 0;
  for (int i = 0; ok && i < g->ndim; i++) {
    if (i < lead) {
      dims[nd++] = i;
    } else if (shape[i - lead] != g->shape[i]) {
      if (shape[i - lead] == 1)
        dims[nd++] = i;
      else
        ok = false;
    }
  }
  if (!ok)
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "sum_to_shape: a gradient of shape %s is not a broadcast of shape %s",
                     MOE_SHAPE(g), MOE_SHAPE_OF(ndim, shape));
  moe_tensor *s;
  MOE_CHECK(moe_sum(ctx, g, nd, dims, true, &s));
  moe_status st = moe_reshape(ctx, s, ndim, shape, out);
  moe_tensor_release(s);
  return st;
}

/* ------------------------------------------------------------ backward */

/* One node of the graph being run, with the gradients arriving at it. */
typedef struct bw_entry {
  moe_node *node;
  int64_t deps;                               /* consumers not yet run */
  moe_tensor *grad[MOE_NODE_MAX_OUTPUTS];     /* (n_outputs) summed so far */
} bw_entry;

/* The nodes reachable from the root: entries in discovery order, indexed by
 * an open-addressing hash of node pointers. */
typedef struct bw_graph {
  bw_entry *e;
  int64_t n, cap;
  int64_t *slot; /* (nslot) entry index + 1, 0 when empty */
  int64_t nslot;
} bw_graph;

static uint64_t ptr_hash(const void *p) {
  uint64_t x = (uint64_t)(uintptr_t)p;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdull;
  x ^= x >> 33;
  return x;
}

static int64_t graph_find(const bw_graph *g, const moe_node *n) {
  uint64_t mask = (uint64_t)g->nslot - 1;
  for (uint64_t h = ptr_hash(n) & mask;; h = (h + 1) & mask) {
    int64_t s = g->slot[h];
    if (s == 0) return -1;
    if (g->e[s - 1].node == n) return s - 1;
  }
}

static moe_status graph_add(moe_ctx *ctx, bw_graph *g, moe_node *n, int64_t *index) {
  if (g->n == g->cap) {
    int64_t cap = g->cap ? g->cap * 2 : 64;
    bw_entry *e = realloc(g->e, sizeof(*e) * (size_t)cap);
    if (!e) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "backward: out of host memory");
    g->e = e;
    g->cap = cap;
  }
  if ((g->n + 1) * 2 > g->nslot) { /* keep the table at most half full */
    int64_t nslot = g->nslot ? g->nslot * 2 : 128;
    int64_t *slot = calloc((size_t)nslot, sizeof(*slot));
    if (!slot) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "backward: out of host memory");
    free(g->slot);
    g->slot = slot;
    g->nslot = nslot;
    uint64_t mask = (uint64_t)nslot - 1;
    for (int64_t i = 0; i < g->n; i++) {
      uint64_t h = ptr_hash(g->e[i].node) & mask;
      while (slot[h]) h = (h + 1) & mask;
      slot[h] = i + 1;
    }
  }
  bw_entry *e = &g->e[g->n];
  memset(e, 0, sizeof(*e));
  e->node = n;
  uint64_t mask = (uint64_t)g->nslot - 1, h = ptr_hash(n) & mask;
  while (g->slot[h]) h = (h + 1) & mask;
  g->slot[h] = g->n + 1;
  *index = g->n++;
  return MOE_OK;
}

static void graph_free(bw_graph *g) {
  for (int64_t i = 0; i < g->n; i++)
    for (int k = 0; k < MOE_NODE_MAX_OUTPUTS; k++) moe_tensor_release(g->e[i].grad[k]);
  free(g->e);
  free(g->slot);
}

/* The leaves a backward reaches, for the leaf hook: an open-addressing hash
 * of leaf pointers with, for each, the edges to it whose node has not run. */
typedef struct leaf_table {
  moe_tensor **key; /* (nslot) NULL when empty */
  int64_t *count;   /* (nslot) edges still to run */
  int64_t n, nslot;
} leaf_table;

/* The slot holding t, or the empty slot where it would go. */
static int64_t leaf_slot(const leaf_table *lt, const moe_tensor *t) {
  uint64_t mask = (uint64_t)lt->nslot - 1, h = ptr_hash(t) & mask;
  while (lt->key[h] && lt->key[h] != t) h = (h + 1) & mask;
  return (int64_t)h;
}

/* One more edge to leaf t. */
static moe_status leaf_add_edge(moe_ctx *ctx, leaf_table *lt, moe_tensor *t) {
  if ((lt->n + 1) * 2 > lt->nslot) { /* keep the table at most half full */
    int64_t nslot = lt->nslot ? lt->nslot * 2 : 64;
    moe_tensor **key = calloc((size_t)nslot, sizeof(*key));
    int64_t *count = calloc((size_t)nslot, sizeof(*count));
    if (!key || !count) {
      free(key);
      free(count);
      return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "backward: out of host memory");
    }
    leaf_table grown = {key, count, lt->n, nslot};
    for (int64_t i = 0; i < lt->nslot; i++) {
      if (!lt->key[i]) continue;
      int64_t h = leaf_slot(&grown, lt->key[i]);
      key[h] = lt->key[i];
      count[h] = lt->count[i];
    }
    free(lt->key);
    free(lt->count);
    *lt = grown;
  }
  int64_t h = leaf_slot(lt, t);
  if (!lt->key[h]) {
    lt->key[h] = t;
    lt->n++;
  }
  lt->count[h]++;
  return MOE_OK;
}

static void leaf_table_free(leaf_table *lt) {
  free(lt->key);
  free(lt->count);
}

/* Collects every node reachable from root (iterative depth-first search)
 * and counts, for each, the edges that reach it from collected nodes; with
 * lt, also the edges that reach each leaf. */
static moe_status graph_collect(moe_ctx *ctx, bw_graph *g, moe_node *root, leaf_table *lt) {
  int64_t idx, cap = 64, top = 0;
  moe_node **stack = malloc(sizeof(*stack) * (size_t)cap);
  if (!stack) return moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "backward: out of host memory");
  moe_status st = graph_add(ctx, g, root, &idx);
  if (st == MOE_OK) stack[top++] = root;
  while (st == MOE_OK && top > 0) {
    moe_node *n = stack[--top];
    for (int i = 0; i < n->n_inputs && st == MOE_OK; i++) {
      moe_node *p = n->next[i].node;
      if (!p) {
        if (lt && n->next[i].leaf) st = leaf_add_edge(ctx, lt, n->next[i].leaf);
        continue;
      }
      idx = graph_find(g, p);
      if (idx >= 0) {
        g->e[idx].deps++;
        continue;
      }
      st = graph_add(ctx, g, p, &idx);
      if (st != MOE_OK) break;
      g->e[idx].deps = 1;
      if (top == cap) {
        moe_node **grown = realloc(stack, sizeof(*stack) * (size_t)(cap * 2));
        if (!grown) {
          st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "backward: out of host memory");
          break;
        }
        stack = grown;
        cap *= 2;
      }
      stack[top++] = p;
    }
  }
  free(stack);
  return st;
}

/* *acc += g (g consumed). */
static moe_status grad_sum(moe_ctx *ctx, moe_tensor **acc, moe_tensor *g) {
  if (!*acc) {
    *acc = g;
    return MOE_OK;
  }
  moe_tensor *s;
  moe_status st = moe_binary(ctx, MOE_OP_ADD, *acc, g, &s);
  moe_tensor_release(g);
  if (st != MOE_OK) return st;
  moe_tensor_release(*acc);
  *acc = s;
  return MOE_OK;
}

/* Whether g is a dense tensor nobody else holds (safe to keep as .grad). */
static bool grad_is_fresh(const moe_tensor *g) {
  return g->refcount == 1 && g->storage->refcount == 1 && g->autograd == NULL && g->offset == 0 &&
         moe_tensor_is_contiguous(g) &&
         (size_t)moe_tensor_numel(g) * moe_dtype_size(g->dtype) == g->storage->nbytes;
}

/* leaf.grad += g (g consumed). The first gradient is stored as a fresh
 * tensor the user cannot otherwise reach; later ones add out of place. */
static moe_status leaf_accumulate(moe_ctx *ctx, moe_tensor *leaf, moe_tensor *g) {
  moe_autograd_meta *m = NULL;
  moe_status st = meta_get(ctx, "backward", leaf, &m);
  if (st != MOE_OK) {
    moe_tensor_release(g);
    return st;
  }
  if (!m->grad) {
    if (grad_is_fresh(g)) {
      m->grad = g;
      return MOE_OK;
    }
    moe_tensor *c;
    st = moe_clone(ctx, g, &c);
    moe_tensor_release(g);
    if (st == MOE_OK) m->grad = c;
    return st;
  }
  moe_tensor *s;
  st = moe_binary(ctx, MOE_OP_ADD, m->grad, g, &s);
  moe_tensor_release(g);
  if (st != MOE_OK) return st;
  moe_tensor_release(m->grad);
  m->grad = s;
  return MOE_OK;
}

/* Checks a gradient returned by n's backward for input i. */
static moe_status grad_check(moe_ctx *ctx, const moe_node *n, int i, const moe_tensor *g) {
  const char *name = moe_node_name(n);
  if (!same_shape(g->ndim, g->shape, n->in_ndim[i], n->in_shape[i]))
    return moe_error(ctx, MOE_ERR_SHAPE,
                     "backward of %s: the gradient of input %d has shape %s, expected %s", name, i,
                     MOE_SHAPE(g), MOE_SHAPE_OF(n->in_ndim[i], n->in_shape[i]));
  if (g->dtype != n->in_dtype[i])
    return moe_error(ctx, MOE_ERR_DTYPE,
                     "backward of %s: the gradient of input %d has dtype %s, expected %s", name, i,
                     moe_dtype_name(g->dtype), moe_dtype_name(n->in_dtype[i]));
  if (!moe_device_equal(moe_tensor_device(g), n->in_device[i]))
    return moe_error(ctx, MOE_ERR_DEVICE,
                     "backward of %s: the gradient of input %d is on %s, expected %s", name, i,
                     MOE_DEVICE(moe_tensor_device(g)), MOE_DEVICE(n->in_device[i]));
  return MOE_OK;
}

/* Runs the backward of entry e and routes its input gradients. */
static moe_status node_run(moe_ctx *ctx, bw_graph *g, int64_t ei) {
  moe_node *n = g->e[ei].node;
  moe_tensor *gout[MOE_NODE_MAX_OUTPUTS], *gin[MOE_NODE_MAX_INPUTS] = {NULL};
  bool any = false;
  for (int k = 0; k < MOE_NODE_MAX_OUTPUTS; k++) {
    gout[k] = g->e[ei].grad[k];
    any = any || gout[k];
  }
  if (!any) return MOE_OK; /* nothing flowed here: every input gradient is zero */
  if (n->released)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "backward: the graph through %s was already freed by an earlier backward; "
                     "call backward with retain_graph to backward through it a second time",
                     moe_node_name(n));
  moe_status st = n->backward(ctx, n, gout, gin);
  for (int i = 0; i < n->n_inputs; i++) {
    moe_tensor *gi = gin[i];
    gin[i] = NULL;
    if (!gi) continue;
    if (st != MOE_OK || !n->needs_grad[i]) {
      moe_tensor_release(gi);
      continue;
    }
    st = grad_check(ctx, n, i, gi);
    if (st != MOE_OK) {
      moe_tensor_release(gi);
      continue;
    }
    const moe_edge *ed = &n->next[i];
    if (ed->node) {
      int64_t pi = graph_find(g, ed->node);
      MOE_ASSERT(pi >= 0);
      st = grad_sum(ctx, &g->e[pi].grad[ed->output], gi);
    } else if (ed->leaf) {
      st = leaf_accumulate(ctx, ed->leaf, gi);
    } else {
      moe_tensor_release(gi);
    }
  }
  return st;
}

moe_status moe_backward(moe_ctx *ctx, moe_tensor *root, moe_tensor *grad, bool retain_graph) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!root) return moe_error(ctx, MOE_ERR_INVALID_ARG, "backward: tensor is NULL");
  if (!moe_requires_grad(root))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "backward: tensor does not require grad and has no grad_fn");
  moe_tensor *g0 = NULL;
  if (!grad) {
    if (moe_tensor_numel(root) != 1)
      return moe_error(ctx, MOE_ERR_SHAPE,
                       "backward: a gradient can be implied only for a tensor of one element; "
                       "this one has shape %s, so pass its gradient",
                       MOE_SHAPE(root));
    MOE_CHECK(moe_tensor_full(ctx, root->ndim, root->shape, 1.0, root->dtype,
                              moe_tensor_device(root), &g0));
  } else {
    if (!same_shape(grad->ndim, grad->shape, root->ndim, root->shape))
      return moe_error(ctx, MOE_ERR_SHAPE, "backward: gradient of shape %s for a tensor of shape %s",
                       MOE_SHAPE(grad), MOE_SHAPE(root));
    MOE_CHECK(moe_check_same_dtype(ctx, "backward", "the gradient", grad->dtype, "the tensor",
                                   root->dtype));
    MOE_CHECK(moe_check_same_device(ctx, "backward", "the gradient", moe_tensor_device(grad),
                                    "the tensor", moe_tensor_device(root)));
    /* a header without history, so a grad that requires grad adds nothing */
    MOE_CHECK(header_alias(ctx, "backward", grad, &g0));
  }
  /* the leaf hook as it is now (a hook that changes it affects the next backward) */
  moe_grad_ready_fn ready_fn = ctx->grad_ready;
  void *ready_ud = ctx->grad_ready_ud;
  bool prev = moe_grad_set(ctx, false);
  moe_status st = MOE_OK;
  moe_autograd_meta *rm = meta_of(root);
  if (!rm->grad_fn) { /* a leaf: its own gradient */
    st = leaf_accumulate(ctx, root, g0);
    if (st == MOE_OK && ready_fn) st = ready_fn(ctx, root, ready_ud);
    moe_grad_set(ctx, prev);
    return st;
  }
  bw_graph g;
  memset(&g, 0, sizeof(g));
  leaf_table lt;
  memset(&lt, 0, sizeof(lt));
  int64_t *ready = NULL;
  st = graph_collect(ctx, &g, rm->grad_fn, ready_fn ? &lt : NULL);
  if (st == MOE_OK) {
    g.e[0].grad[rm->output] = g0;
    g0 = NULL;
    ready = malloc(sizeof(*ready) * (size_t)g.n);
    if (!ready) st = moe_error(ctx, MOE_ERR_OUT_OF_MEMORY, "backward: out of host memory");
  }
  int64_t top = 0;
  if (st == MOE_OK) ready[top++] = 0;
  bool frees = ctx->backward_frees, owned = ctx->backward_owned; /* a backward inside a node's */
  ctx->backward_frees = !retain_graph;
  while (st == MOE_OK && top > 0) {
    int64_t ei = ready[--top];
    moe_node *n = g.e[ei].node;
    ctx->backward_owned = false;
    st = node_run(ctx, &g, ei);
    for (int k = 0; k < MOE_NODE_MAX_OUTPUTS; k++) {
      moe_tensor_release(g.e[ei].grad[k]);
      g.e[ei].grad[k] = NULL;
    }
    /* freed also when the node failed after writing into slots it owned
     * (moe_node_saved_owned): they must not be read again */
    if (!retain_graph && (st == MOE_OK || ctx->backward_owned)) {
      node_free_saved(n);
      n->released = true;
    }
    if (st != MOE_OK) break;
    for (int i = 0; i < n->n_inputs; i++) {
      moe_node *p = n->next[i].node;
      if (!p) continue;
      int64_t pi = graph_find(&g, p);
      if (--g.e[pi].deps == 0) ready[top++] = pi;
    }
    /* the leaf hook: a leaf whose last edge this node was has its gradient
     * (or got none from this backward) */
    for (int i = 0; ready_fn && i < n->n_inputs && st == MOE_OK; i++) {
      moe_tensor *leaf = n->next[i].leaf;
      if (!leaf) continue;
      int64_t h = leaf_slot(&lt, leaf);
      MOE_ASSERT(lt.key[h] == leaf && lt.count[h] > 0);
      if (--lt.count[h] == 0) st = ready_fn(ctx, leaf, ready_ud);
    }
  }
  ctx->backward_frees = frees;
  ctx->backward_owned = owned;
  moe_tensor_release(g0);
  free(ready);
  leaf_table_free(&lt);
  graph_free(&g);
  moe_grad_set(ctx, prev);
  return st;
}
