/*
 * glu_act.cuh - the GLU experts' activation on the device, shared by the
 * fused elementwise passes (kernels/experts.cu) and the block-sparse SDD
 * that computes a = act(h1) * h3 in its epilogue (kernels/blocksparse.cu),
 * so both give the same bits.
 */
#ifndef MOE_KERNELS_GLU_ACT_CUH
#define MOE_KERNELS_GLU_ACT_CUH

/* act(v) and act'(v); act as moe_glu_activation (0 silu, 1 gelu, 2 gelu_tanh). */
__device__ __forceinline__ void ex_act(int act, float v, float *f, float *df) {
  if (act == 0) {
    float s = 1.0f / (1.0f + expf(-v));
    *f = v * s;
    *df = s * (1.0f + v * (1.0f - s));
  } else if (act == 1) {
    float c = 0.5f * (1.0f + erff(v * 0.70710678118654752440f));
    *f = v * c;
    *df = c + v * expf(-0.5f * v * v) * 0.39894228040143267794f;
  } else {
    const float k0 = 0.79788456080286535588f, k1 = 0.044715f;
    float t = tanhf(k0 * (v + k1 * v * v * v));
    *f = 0.5f * v * (1.0f + t);
    *df = 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * k0 * (1.0f + 3.0f * k1 * v * v);
  }
}

#endif /* MOE_KERNELS_GLU_ACT_CUH */
