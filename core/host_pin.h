/*
 * host_pin.h - page-locking host memory for fast copies from the GPUs
 * (cudaHostRegister), defined in core/cuda_runtime.c and, without CUDA,
 * core/nocuda.c. Used by the asynchronous checkpoint writer
 * (core/safetensors.c), whose buffer receives device tensors.
 */
#ifndef MOE_HOST_PIN_H
#define MOE_HOST_PIN_H

#include <stddef.h>

#include "moe.h"

/* Page-locks [p, p + nbytes): MOE_OK, or an error in ctx (nothing locked;
 * the memory stays pageable and usable). Unlock before freeing it. */
moe_status moe_cuda_host_register(moe_ctx *ctx, void *p, size_t nbytes);
/* Unlocks what moe_cuda_host_register locked at p; NULL is a no-op. */
void moe_cuda_host_unregister(void *p);

#endif
