/*
 * test_dist_env.c - moe_dist_env_read (core/dist_env.c): the launcher's
 * variables in order (Open MPI, Slurm, torchrun, none), Slurm's
 * tasks-per-node lists, the one-node defaults when local variables are
 * missing, and the errors that name a bad variable and its value. Only the
 * environment: no MPI.
 */
#define _POSIX_C_SOURCE 200809L /* setenv */
#include <stdlib.h>
#include <string.h>

#include "harness.h"
#include "moe_dist.h"

static const char *const all_vars[] = {
    "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
    "OMPI_COMM_WORLD_LOCAL_SIZE", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_STEP_NUM_TASKS",
    "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_TASKS_PER_NODE",
    "SLURM_TASKS_PER_NODE", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", NULL};

static void clear_env(void) {
  for (int i = 0; all_vars[i]; i++) unsetenv(all_vars[i]);
}

#define EXPECT_ENV(e, r, n, lr, ln, name)  \
  do {                                     \
    EXPECT((e).rank == (r));               \
    EXPECT((e).world_size == (n));         \
    EXPECT((e).local_rank == (lr));        \
    EXPECT((e).local_world_size == (ln));  \
    EXPECT_STR((e).launcher, (name));      \
  } while (0)

static void test_none(moe_ctx *ctx) {
  clear_env();
  moe_dist_env e;
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 0, 1, 0, 1, "none");
  setenv("RANK", "3", 1); /* RANK alone is not a job */
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 0, 1, 0, 1, "none");
  clear_env();
  EXPECT(moe_dist_env_read(ctx, NULL) == MOE_ERR_INVALID_ARG);
  EXPECT(moe_dist_env_read(NULL, &e) == MOE_ERR_INVALID_ARG);
}

static void test_mpirun(moe_ctx *ctx) {
  clear_env();
  setenv("OMPI_COMM_WORLD_RANK", "5", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "8", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "1", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "4", 1);
  /* Open MPI wins over the others */
  setenv("SLURM_PROCID", "0", 1);
  setenv("SLURM_NTASKS", "1", 1);
  setenv("RANK", "0", 1);
  setenv("WORLD_SIZE", "1", 1);
  moe_dist_env e;
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 5, 8, 1, 4, "mpirun");
  /* without the local variables: one node */
  unsetenv("OMPI_COMM_WORLD_LOCAL_RANK");
  unsetenv("OMPI_COMM_WORLD_LOCAL_SIZE");
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 5, 8, 5, 8, "mpirun");
}

static void test_srun(moe_ctx *ctx) {
  clear_env();
  setenv("SLURM_PROCID", "6", 1);
  setenv("SLURM_NTASKS", "7", 1);
  setenv("SLURM_LOCALID", "0", 1);
  setenv("SLURM_NODEID", "3", 1);
  setenv("SLURM_TASKS_PER_NODE", "2(x3),1", 1);
  setenv("RANK", "0", 1); /* Slurm wins over torchrun's names */
  setenv("WORLD_SIZE", "1", 1);
  moe_dist_env e;
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 6, 7, 0, 1, "srun");
  setenv("SLURM_PROCID", "5", 1);
  setenv("SLURM_LOCALID", "1", 1);
  setenv("SLURM_NODEID", "2", 1);
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 5, 7, 1, 2, "srun");
  /* the step's list before the allocation's, SLURM_NTASKS_PER_NODE first */
  setenv("SLURM_STEP_TASKS_PER_NODE", "3(x2),4", 1);
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT(e.local_world_size == 4);
  setenv("SLURM_NTASKS_PER_NODE", "2", 1);
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT(e.local_world_size == 2);
  /* the step's task count before the allocation's */
  setenv("SLURM_STEP_NUM_TASKS", "6", 1);
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 5, 6, 1, 2, "srun");
  /* no node id: the first node's count; no list: one node */
  unsetenv("SLURM_NODEID");
  unsetenv("SLURM_NTASKS_PER_NODE");
  unsetenv("SLURM_STEP_TASKS_PER_NODE");
  setenv("SLURM_TASKS_PER_NODE", "4(x2)", 1);
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT(e.local_world_size == 4);
  unsetenv("SLURM_TASKS_PER_NODE");
  unsetenv("SLURM_LOCALID");
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 5, 6, 5, 6, "srun");
}

static void test_torchrun(moe_ctx *ctx) {
  clear_env();
  setenv("RANK", "3", 1);
  setenv("WORLD_SIZE", "4", 1);
  setenv("LOCAL_RANK", "1", 1);
  setenv("LOCAL_WORLD_SIZE", "2", 1);
  moe_dist_env e;
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 3, 4, 1, 2, "torchrun");
  unsetenv("LOCAL_RANK");
  unsetenv("LOCAL_WORLD_SIZE");
  EXPECT_OK(moe_dist_env_read(ctx, &e));
  EXPECT_ENV(e, 3, 4, 3, 4, "torchrun");
}

/* A failed read names the variable and its value, and leaves one rank. */
static void test_errors(moe_ctx *ctx) {
  moe_dist_env e;
  clear_env();
  setenv("OMPI_COMM_WORLD_RANK", "one", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "OMPI_COMM_WORLD_RANK='one'");
  EXPECT_ENV(e, 0, 1, 0, 1, "none");
  setenv("OMPI_COMM_WORLD_RANK", "2", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG,
                 "OMPI_COMM_WORLD_RANK=2 is not below OMPI_COMM_WORLD_SIZE=2");
  setenv("OMPI_COMM_WORLD_RANK", "-1", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "OMPI_COMM_WORLD_RANK='-1'");
  setenv("OMPI_COMM_WORLD_RANK", "1 ", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "OMPI_COMM_WORLD_RANK='1 '");
  setenv("OMPI_COMM_WORLD_RANK", "99999999999", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "'99999999999'");
  setenv("OMPI_COMM_WORLD_RANK", "", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "OMPI_COMM_WORLD_RANK=''");
  setenv("OMPI_COMM_WORLD_RANK", "0", 1);
  setenv("OMPI_COMM_WORLD_SIZE", "0", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "OMPI_COMM_WORLD_SIZE=0");
  setenv("OMPI_COMM_WORLD_SIZE", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "2", 1);
  setenv("OMPI_COMM_WORLD_LOCAL_SIZE", "2", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG,
                 "OMPI_COMM_WORLD_LOCAL_RANK=2 is not below OMPI_COMM_WORLD_LOCAL_SIZE=2");
  unsetenv("OMPI_COMM_WORLD_SIZE");
  setenv("OMPI_COMM_WORLD_LOCAL_RANK", "0", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG,
                 "OMPI_COMM_WORLD_SIZE is not set");

  clear_env();
  setenv("SLURM_PROCID", "0", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "SLURM_NTASKS is not set");
  setenv("SLURM_NTASKS", "4", 1);
  setenv("SLURM_TASKS_PER_NODE", "2(x", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "SLURM_TASKS_PER_NODE='2(x'");
  setenv("SLURM_TASKS_PER_NODE", "2(x2)", 1);
  setenv("SLURM_NODEID", "2", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "tasks of node 2");
  setenv("SLURM_NODEID", "1", 1);
  setenv("SLURM_LOCALID", "3", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG,
                 "SLURM_LOCALID=3 is not below SLURM_TASKS_PER_NODE=2");
  setenv("SLURM_NTASKS_PER_NODE", "2(x2)", 1); /* a count, not a list */
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "SLURM_NTASKS_PER_NODE='2(x2)'");
  setenv("SLURM_STEP_NUM_TASKS", "x", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "SLURM_STEP_NUM_TASKS='x'");

  clear_env();
  setenv("RANK", "4", 1);
  setenv("WORLD_SIZE", "4", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "RANK=4 is not below WORLD_SIZE=4");
  setenv("RANK", "0", 1);
  setenv("LOCAL_WORLD_SIZE", "two", 1);
  EXPECT_ERR_MSG(moe_dist_env_read(ctx, &e), MOE_ERR_INVALID_ARG, "LOCAL_WORLD_SIZE='two'");
  clear_env();
}

int main(void) {
  harness_start();
  RUN(test_none);
  RUN(test_mpirun);
  RUN(test_srun);
  RUN(test_torchrun);
  RUN(test_errors);
  return harness_end();
}
