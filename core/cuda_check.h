/*
 * cuda_check.h - the status checks of CUDA runtime and cuBLAS calls, shared by
 * core/cuda_runtime.c (C11) and kernels/ (.cu files, C++17); built with CUDA
 * only.
 *
 * Each macro returns MOE_ERR_CUDA from the enclosing function (which returns
 * moe_status and has a moe_ctx *) with a message naming what failed, the
 * file:line and the error:
 *   MOE_CUDA_CHECK(ctx, call)          a runtime call; clears the (non-sticky)
 *       error so later calls start clean:  "<call> failed at f.cu:12: <string> (<name>)"
 *   MOE_CUDA_CHECK_LAUNCH(ctx, what)   after kernel launches (cudaGetLastError);
 *       what is a string:                  "<what> failed at f.cu:12: <string> (<name>)"
 *   MOE_CUBLAS_CHECK(ctx, call)        a cuBLAS or cuBLASLt call (the caller
 *       includes cublas_v2.h):             "<call> failed at f.cu:12: <status string>"
 */
#ifndef MOE_CUDA_CHECK_H
#define MOE_CUDA_CHECK_H

#include <string.h>

#include <cuda_runtime_api.h>

#include "internal.h"

/* The file name without its directories, for messages. */
static inline const char *moe_check_file(const char *path) {
  const char *s = strrchr(path, '/');
  return s ? s + 1 : path;
}

#define MOE_CUDA_CHECK(ctx, call)                                                             \
  do {                                                                                        \
    cudaError_t moe_e_ = (call);                                                              \
    if (moe_e_ != cudaSuccess) {                                                              \
      (void)cudaGetLastError();                                                               \
      return moe_error((ctx), MOE_ERR_CUDA, "%s failed at %s:%d: %s (%s)", #call,             \
                       moe_check_file(__FILE__), __LINE__, cudaGetErrorString(moe_e_),        \
                       cudaGetErrorName(moe_e_));                                             \
    }                                                                                         \
  } while (0)

#define MOE_CUDA_CHECK_LAUNCH(ctx, what)                                                      \
  do {                                                                                        \
    cudaError_t moe_e_ = cudaGetLastError();                                                  \
    if (moe_e_ != cudaSuccess)                                                                \
      return moe_error((ctx), MOE_ERR_CUDA, "%s failed at %s:%d: %s (%s)", (what),            \
                       moe_check_file(__FILE__), __LINE__, cudaGetErrorString(moe_e_),        \
                       cudaGetErrorName(moe_e_));                                             \
  } while (0)

#define MOE_CUBLAS_CHECK(ctx, call)                                                           \
  do {                                                                                        \
    cublasStatus_t moe_b_ = (call);                                                           \
    if (moe_b_ != CUBLAS_STATUS_SUCCESS)                                                      \
      return moe_error((ctx), MOE_ERR_CUDA, "%s failed at %s:%d: %s", #call,                  \
                       moe_check_file(__FILE__), __LINE__, cublasGetStatusString(moe_b_));    \
  } while (0)

#endif /* MOE_CUDA_CHECK_H */
