/*
 * moe_autograd.h - reverse-mode automatic differentiation in the core
 * (included by moe.h; implemented in core/autograd.c).
 *
 * A dynamic graph as in PyTorch: a differentiable op whose inputs need grad
 * (and grad mode is on) records a node holding what its backward needs;
 * moe_backward walks the nodes from the loss in reverse topological order.
 *
 * Rules (as llm.c's layernorm.cuh writes them):
 *   - Leaf tensors (requires_grad set by the user) ACCUMULATE into .grad.
 *   - A backward function RETURNS fresh activation gradients (it never writes
 *     into its inputs); the engine sums gradients that meet at one tensor.
 *   - When backward finishes, every node it visited is released with the
 *     tensors it saved, unless retain_graph: device memory returns to the
 *     caching allocator at once, without waiting for Lua's collector.
 *   - Backward functions run with grad mode off (no double backward yet).
 *   - A gradient has its input's shape, dtype and device; the engine checks.
 *
 * Writing a differentiable op (forward, in the op's .c file): compute the
 * output, then record it with the core's one record function (internal.h,
 * where the spec's fields and the failure contract are written):
 *
 *   MOE_CHECK(compute out ...);
 *   MOE_CHECK(moe_record(ctx, &(moe_record_spec){
 *       .op = MOE_OP_MUL, .backward = mul_backward,
 *       .n_in = 2, .in = {a, b}, .n_save = 2, .save = {a, b}}, 1, &out));
 *   // on failure out was released; on success out holds the node
 *
 * and its backward:
 *
 *   static moe_status mul_backward(moe_ctx *ctx, moe_node *n, moe_tensor *const *gout,
 *                                  moe_tensor **gin) {
 *     moe_tensor *a, *b;   // borrowed... see moe_node_saved
 *     ...
 *     if (moe_node_needs_grad(n, 0)) gin[0] = grad wrt a (new reference);
 *     if (moe_node_needs_grad(n, 1)) gin[1] = ...;
 *     return MOE_OK;
 *   }
 *
 * gout[k] is the gradient of output k, or NULL when nothing flowed into it
 * (treat as zeros; moe_node_zero_grads gives every input that needs one its
 * zeros). Gradients of broadcast inputs are reduced with
 * moe_sum_to_shape.
 *
 * Code outside the core (the Lua bindings' custom functions) builds nodes
 * with moe_node_new / moe_node_save / moe_node_set_output below.
 */
#ifndef MOE_AUTOGRAD_H
#define MOE_AUTOGRAD_H

#ifdef __cplusplus
extern "C" {
#endif

#define MOE_NODE_MAX_INPUTS 8
#define MOE_NODE_MAX_OUTPUTS 4
#define MOE_NODE_MAX_SAVED 12
#define MOE_NODE_MAX_ARGS 8

typedef struct moe_node moe_node;

/* gout: (n_outputs) borrowed, entries may be NULL. gin: (n_inputs), all NULL
 * on entry; set entry i (a new reference) only where moe_node_needs_grad. */
typedef moe_status (*moe_backward_fn)(moe_ctx *ctx, moe_node *node, moe_tensor *const *gout,
                                      moe_tensor **gin);

/* One edge of the graph: where the gradient of an input goes. */
typedef struct moe_edge {
  moe_node *node;    /* producer of the input (retained), or NULL for a leaf */
  int output;        /* which output of node */
  moe_tensor *leaf;  /* a leaf that requires grad (retained), else NULL */
} moe_edge;

struct moe_node {
  int64_t refcount;
  moe_op op;                                /* for printing and errors */
  moe_backward_fn backward;
  int n_inputs, n_outputs;
  moe_edge next[MOE_NODE_MAX_INPUTS];       /* (n_inputs) */
  bool needs_grad[MOE_NODE_MAX_INPUTS];     /* (n_inputs) */
  /* Metadata of inputs and outputs, so backward can build zeros and the
   * engine can check gradient shapes. */
  moe_dtype in_dtype[MOE_NODE_MAX_INPUTS];
  moe_device in_device[MOE_NODE_MAX_INPUTS];
  int in_ndim[MOE_NODE_MAX_INPUTS];
  int64_t in_shape[MOE_NODE_MAX_INPUTS][MOE_MAX_DIMS];
  moe_dtype out_dtype[MOE_NODE_MAX_OUTPUTS];
  int out_ndim[MOE_NODE_MAX_OUTPUTS];
  int64_t out_shape[MOE_NODE_MAX_OUTPUTS][MOE_MAX_DIMS];
  /* Saved for backward; through the saved-tensor hooks when set. */
  int n_saved;
  void *saved[MOE_NODE_MAX_SAVED];          /* packed values (or moe_tensor*) */
  void *saved_hooks;                        /* the hooks that packed them, or NULL */
  /* Plain arguments an op's backward needs (dims, scalars, flags). */
  int64_t iargs[MOE_NODE_MAX_ARGS];
  double dargs[MOE_NODE_MAX_ARGS];
  /* For ops defined outside the core (Lua functions): an opaque payload and
   * its destructor, called when the node is released. */
  void *user;
  void (*user_free)(void *user);
  const char *name;                         /* overrides moe_op_name when set */
  bool released;                            /* saved tensors already freed */
};

/* ----------------------------------------------------------- grad mode */

/* Grad mode is on by default; moe_grad_set returns the previous mode so
 * scopes nest: bool prev = moe_grad_set(ctx, false); ...; moe_grad_set(ctx, prev). */
bool moe_grad_enabled(const moe_ctx *ctx);
bool moe_grad_set(moe_ctx *ctx, bool enabled);

/* ------------------------------------------------------ tensor fields */

bool moe_requires_grad(const moe_tensor *t);
/* Only on leaves (no grad_fn) of a float dtype; a clear error otherwise. */
moe_status moe_set_requires_grad(moe_ctx *ctx, moe_tensor *t, bool requires);
/* The accumulated gradient of a leaf, borrowed (NULL if none yet). */
moe_tensor *moe_tensor_grad(const moe_tensor *t);
/* Replaces .grad (g retained; NULL clears it). Shape/dtype/device checked. */
moe_status moe_tensor_set_grad(moe_ctx *ctx, moe_tensor *t, moe_tensor *g);
/* The node that produced t (borrowed), NULL for leaves. */
moe_node *moe_tensor_grad_fn(const moe_tensor *t);
bool moe_tensor_is_leaf(const moe_tensor *t);
/* A new tensor header over the same storage with no grad history. */
moe_status moe_detach(moe_ctx *ctx, moe_tensor *t, moe_tensor **out);
/* Frees t's autograd state (called by moe_tensor_release at refcount 0). */
void moe_autograd_meta_free(moe_tensor *t);

/* --------------------------------------------------------------- nodes */

/* True when grad mode is on and any of the inputs requires grad. */
bool moe_grad_wanted(const moe_ctx *ctx, int n, const moe_tensor *const *inputs);
/* A node with one reference for the caller; edges to the inputs' producers
 * (or leaves) are set from the inputs. */
moe_status moe_node_new(moe_ctx *ctx, moe_op op, moe_backward_fn backward, int n_inputs,
                        moe_tensor *const *inputs, moe_node **out);
void moe_node_retain(moe_node *n);
void moe_node_release(moe_node *n);
/* Saves t for backward (through the current saved-tensor hooks, if any). */
moe_status moe_node_save(moe_ctx *ctx, moe_node *n, moe_tensor *t);
/* Saved slot i for use in backward: a new reference (unpacked through the
 * hooks that packed it); release it when done. Error after the graph was
 * released ("saved tensors were freed: call backward with retain_graph"). */
moe_status moe_node_saved(moe_ctx *ctx, moe_node *n, int i, moe_tensor **out);
/* Whether t, the tensor moe_node_saved gave for slot i, may be overwritten by
 * n's backward (a buffer for its own gradients): true only while a backward
 * without retain_graph runs n (so the slot is freed right after and never
 * read again), when the slot was saved without hooks, and when nothing but
 * the node and `held` handles of the caller (each the same tensor, t) refer
 * to t or its storage. Whatever the backward wrote there is lost with the
 * slot: when that backward fails after it was told so (or after it freed a
 * slot), the graph is released (a second backward says its saved tensors
 * were freed). */
bool moe_node_saved_owned(moe_ctx *ctx, const moe_node *n, int i, const moe_tensor *t,
                          int64_t held);
/* Frees saved slot i of n from inside n's backward, when that backward frees
 * the graph anyway (no retain_graph; otherwise a no-op): its memory returns
 * as soon as the caller's own references to it go, not when the backward
 * ends. The slot must not be asked for again (moe_node_saved gives NULL). */
void moe_node_saved_free(moe_ctx *ctx, moe_node *n, int i);
/* Makes out the k-th output of n: out becomes non-leaf, requires grad. */
moe_status moe_node_set_output(moe_ctx *ctx, moe_node *n, int k, moe_tensor *out);
bool moe_node_needs_grad(const moe_node *n, int i);
const char *moe_node_name(const moe_node *n);

/* ------------------------------------------------------------ backward */

/* Backpropagates from root. grad: the gradient of root (NULL allowed only
 * when root has one element: then ones). Leaves' .grad accumulate. */
moe_status moe_backward(moe_ctx *ctx, moe_tensor *root, moe_tensor *grad, bool retain_graph);

/* Leaf hook: while set, moe_backward calls fn(ctx, leaf, ud) once for each
 * leaf that requires grad, right after the last gradient this backward
 * sends to it has been summed into its .grad (a leaf reached by several
 * edges, as tied weights are, is reported once, after all of them; a leaf
 * of the graph whose every incoming gradient was skipped is reported too).
 * A failure of fn stops the backward with fn's status. fn == NULL clears
 * it. Data parallelism's reducer (moe_dist.h) is the user. */
typedef moe_status (*moe_grad_ready_fn)(moe_ctx *ctx, moe_tensor *leaf, void *ud);
void moe_autograd_set_grad_ready(moe_ctx *ctx, moe_grad_ready_fn fn, void *ud);

/* Reduces g (broadcast from shape) back to shape by summing over broadcast
 * dims; returns g retained when the shapes already match. */
moe_status moe_sum_to_shape(moe_ctx *ctx, moe_tensor *g, int ndim, const int64_t *shape,
                            moe_tensor **out);

/* -------------------------------------------------- saved-tensor hooks */
/*
 * A pack/unpack pair applied to every tensor an op saves for backward while
 * the pair is pushed (the quantization of saved activations builds on this).
 * pack receives the tensor and returns an opaque packed value; unpack turns
 * it back into a tensor (new reference); free releases a packed value.
 * Hooks nest as a stack; the node remembers which hooks packed its tensors.
 */
typedef struct moe_saved_hooks {
  int64_t refcount; /* managed by push/pop and the nodes that used it */
  moe_status (*pack)(moe_ctx *ctx, void *ud, moe_tensor *t, void **packed);
  moe_status (*unpack)(moe_ctx *ctx, void *ud, void *packed, moe_tensor **out);
  void (*free_packed)(void *ud, void *packed);
  void (*free_ud)(void *ud); /* called when the last user of the hooks goes */
  void *ud;
} moe_saved_hooks;

/* Pushes hooks (copied into a refcounted block). */
moe_status moe_saved_hooks_push(moe_ctx *ctx, const moe_saved_hooks *hooks);
moe_status moe_saved_hooks_pop(moe_ctx *ctx);

#ifdef __cplusplus
}
#endif
#endif /* MOE_AUTOGRAD_H */
