/*
 * kerr.h - bad input that a CUDA kernel finds (an index or target out of
 * range), kept in host memory the device writes to (mapped, pinned) and
 * reported by the host at the next synchronisation of that device
 * (moe_cuda_synchronize, a copy to the host): the launch itself cannot fail
 * without a host sync, and the kernels stay inside memory meanwhile.
 * Shared by core/cuda_runtime.c and the kernels (kernels/common.cuh).
 */
#ifndef MOE_KERR_H
#define MOE_KERR_H

typedef struct moe_kerr {
  unsigned int set;  /* 0: nothing found; 1: the fields below hold the first find */
  int tag;           /* the op (core/cuda_runtime.c's table of names) */
  long long value;   /* the bad index or target */
  long long limit;   /* it had to lie in [0, limit) */
} moe_kerr;

#endif
