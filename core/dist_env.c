/*
 * dist_env.c - moe_dist_env_read (moe_dist.h): where this process sits in a
 * launched job, from the environment alone. It initialises nothing and needs
 * no MPI header, so the host can call it before any script runs.
 *
 * The launchers, first match wins:
 *   mpirun    OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK, _LOCAL_SIZE (Open MPI)
 *   srun      SLURM_PROCID, SLURM_STEP_NUM_TASKS (else SLURM_NTASKS),
 *             SLURM_LOCALID, and the tasks on this node from
 *             SLURM_NTASKS_PER_NODE (one count for every node), else the
 *             list SLURM_STEP_TASKS_PER_NODE, else SLURM_TASKS_PER_NODE
 *             ("2(x3),1": entry SLURM_NODEID of the expanded list)
 *   torchrun  RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE
 *   none      one rank
 * A launcher is chosen by its rank and size variables (both of RANK and
 * WORLD_SIZE for torchrun: RANK alone is too common a name). When its local
 * variables are missing, the job is taken to be on one node (local rank =
 * rank, local size = size).
 *
 * Errors (MOE_ERR_INVALID_ARG) name the variable and its value: a value that
 * is not a whole number, a size below 1, a rank not below its size. On error
 * *out still describes one rank ("none").
 */
#include <errno.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"
#include "moe_dist.h"

static const char *env(const char *name) {
  const char *v = getenv(name);
  return v; /* NULL when unset; "" is set (and fails to parse) */
}

/* A whole number >= 0 that fits an int, nothing else in the string. */
static int parse_count(const char *s, int *out) {
  if (s == NULL || *s < '0' || *s > '9') return 0;
  errno = 0;
  char *end;
  long v = strtol(s, &end, 10);
  if (errno != 0 || *end != '\0' || v > INT_MAX) return 0;
  *out = (int)v;
  return 1;
}

/* Reads variable name (set) into *out; min is the least value allowed. */
static moe_status read_int(moe_ctx *ctx, const char *name, int min, int *out) {
  const char *s = env(name);
  if (s == NULL)
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s is not set, but other variables of its launcher are", name);
  if (!parse_count(s, out))
    return moe_error(ctx, MOE_ERR_INVALID_ARG,
                     "%s='%s' is not a whole number", name, s);
  if (*out < min)
    return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s=%d must be at least %d", name, *out, min);
  return MOE_OK;
}

/* rank must be below size: both variables named in the message. */
static moe_status check_below(moe_ctx *ctx, const char *rank_name, int rank, const char *size_name,
                              int size) {
  if (rank < size) return MOE_OK;
  return moe_error(ctx, MOE_ERR_INVALID_ARG, "%s=%d is not below %s=%d", rank_name, rank,
                   size_name, size);
}

/* Slurm's tasks-per-node list ("2(x3),1", "4", "1,2"): the count of node
 * `node` (0-based). Returns 0 when the list is malformed or too short. */
static int slurm_tasks_on_node(const char *list, int node, int *out) {
  const char *p = list;
  long seen = 0;
  while (*p) {
    if (*p < '0' || *p > '9') return 0;
    char *end;
    long count = strtol(p, &end, 10);
    long repeat = 1;
    p = end;
    if (p[0] == '(' && p[1] == 'x') {
      if (p[2] < '0' || p[2] > '9') return 0;
      repeat = strtol(p + 2, &end, 10);
      if (*end != ')') return 0;
      p = end + 1;
    }
    if (count < 1 || count > INT_MAX || repeat < 1 || repeat > INT_MAX) return 0;
    if (node < seen + repeat) {
      *out = (int)count;
      return 1;
    }
    seen += repeat;
    if (*p == ',') p++;
    else if (*p != '\0') return 0;
  }
  return 0;
}

static moe_status read_mpirun(moe_ctx *ctx, moe_dist_env *e) {
  MOE_CHECK(read_int(ctx, "OMPI_COMM_WORLD_SIZE", 1, &e->world_size));
  MOE_CHECK(read_int(ctx, "OMPI_COMM_WORLD_RANK", 0, &e->rank));
  MOE_CHECK(check_below(ctx, "OMPI_COMM_WORLD_RANK", e->rank, "OMPI_COMM_WORLD_SIZE",
                        e->world_size));
  e->local_rank = e->rank;
  e->local_world_size = e->world_size;
  if (env("OMPI_COMM_WORLD_LOCAL_SIZE"))
    MOE_CHECK(read_int(ctx, "OMPI_COMM_WORLD_LOCAL_SIZE", 1, &e->local_world_size));
  if (env("OMPI_COMM_WORLD_LOCAL_RANK"))
    MOE_CHECK(read_int(ctx, "OMPI_COMM_WORLD_LOCAL_RANK", 0, &e->local_rank));
  return check_below(ctx, "OMPI_COMM_WORLD_LOCAL_RANK", e->local_rank, "OMPI_COMM_WORLD_LOCAL_SIZE",
                     e->local_world_size);
}

static moe_status read_srun(moe_ctx *ctx, moe_dist_env *e) {
  const char *size_name = env("SLURM_STEP_NUM_TASKS") ? "SLURM_STEP_NUM_TASKS" : "SLURM_NTASKS";
  MOE_CHECK(read_int(ctx, size_name, 1, &e->world_size));
  MOE_CHECK(read_int(ctx, "SLURM_PROCID", 0, &e->rank));
  MOE_CHECK(check_below(ctx, "SLURM_PROCID", e->rank, size_name, e->world_size));
  e->local_rank = e->rank;
  e->local_world_size = e->world_size;
  if (env("SLURM_LOCALID")) MOE_CHECK(read_int(ctx, "SLURM_LOCALID", 0, &e->local_rank));
  const char *per_node = NULL;
  if (env("SLURM_NTASKS_PER_NODE")) { /* the request: one count for every node */
    per_node = "SLURM_NTASKS_PER_NODE";
    MOE_CHECK(read_int(ctx, per_node, 1, &e->local_world_size));
  } else {
    if (env("SLURM_STEP_TASKS_PER_NODE")) per_node = "SLURM_STEP_TASKS_PER_NODE";
    else if (env("SLURM_TASKS_PER_NODE")) per_node = "SLURM_TASKS_PER_NODE";
  }
  if (per_node && strcmp(per_node, "SLURM_NTASKS_PER_NODE") != 0) {
    int node = 0;
    if (env("SLURM_NODEID")) MOE_CHECK(read_int(ctx, "SLURM_NODEID", 0, &node));
    if (!slurm_tasks_on_node(env(per_node), node, &e->local_world_size))
      return moe_error(ctx, MOE_ERR_INVALID_ARG,
                       "%s='%s' does not give the tasks of node %d (expected counts such as "
                       "'4' or '2(x3),1')",
                       per_node, env(per_node), node);
  }
  return check_below(ctx, "SLURM_LOCALID", e->local_rank, per_node ? per_node : size_name,
                     e->local_world_size);
}

static moe_status read_torchrun(moe_ctx *ctx, moe_dist_env *e) {
  MOE_CHECK(read_int(ctx, "WORLD_SIZE", 1, &e->world_size));
  MOE_CHECK(read_int(ctx, "RANK", 0, &e->rank));
  MOE_CHECK(check_below(ctx, "RANK", e->rank, "WORLD_SIZE", e->world_size));
  e->local_rank = e->rank;
  e->local_world_size = e->world_size;
  if (env("LOCAL_WORLD_SIZE")) MOE_CHECK(read_int(ctx, "LOCAL_WORLD_SIZE", 1, &e->local_world_size));
  if (env("LOCAL_RANK")) MOE_CHECK(read_int(ctx, "LOCAL_RANK", 0, &e->local_rank));
  return check_below(ctx, "LOCAL_RANK", e->local_rank, "LOCAL_WORLD_SIZE", e->local_world_size);
}

moe_status moe_dist_env_read(moe_ctx *ctx, moe_dist_env *out) {
  if (!ctx) return MOE_ERR_INVALID_ARG;
  if (!out) return moe_error(ctx, MOE_ERR_INVALID_ARG, "moe_dist_env_read: out is NULL");
  const moe_dist_env one = {.rank = 0, .world_size = 1, .local_rank = 0, .local_world_size = 1,
                            .launcher = "none"};
  moe_dist_env e = one;
  moe_status st = MOE_OK;
  if (env("OMPI_COMM_WORLD_RANK") || env("OMPI_COMM_WORLD_SIZE")) {
    e.launcher = "mpirun";
    st = read_mpirun(ctx, &e);
  } else if (env("SLURM_PROCID")) {
    e.launcher = "srun";
    st = read_srun(ctx, &e);
  } else if (env("RANK") && env("WORLD_SIZE")) {
    e.launcher = "torchrun";
    st = read_torchrun(ctx, &e);
  }
  *out = st == MOE_OK ? e : one;
  return st;
}
