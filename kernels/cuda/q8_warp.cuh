// Device-only helper shared by the Q8_0 quantisation kernel (gemm.cu) and the fused kernels
// that quantise what they compute (ops.cu), so both run the same float operations in the
// same order and their outputs agree bit for bit.
#pragma once

#include "block_math.cuh"

namespace tandem::kernels::cuda {

/// One Q8_0 block of 32 values quantised by one warp: lane j holds value j (`v`); writes
/// q[lane] and, from lane 0, *d. amax by a shuffle tree, then q8_scale_from_amax /
/// q8_quantize_value (block_math.cuh; bit-identical to kernels/cpu quantize_row_q8_0).
/// All 32 lanes must call it, converged.
__device__ __forceinline__ void warp_quantize_q8_0(float v, int lane, int8_t* __restrict__ q,
                                                   uint16_t* __restrict__ d) {
  float amax = fabsf(v);
  for (int o = 16; o > 0; o /= 2) {
    const float other = __shfl_xor_sync(0xFFFFFFFFu, amax, o);
    amax = other > amax ? other : amax;
  }
  const Q8Scale s = q8_scale_from_amax(amax);
  q[lane] = q8_quantize_value(v, s.id);
  if (lane == 0) *d = s.d;
}

}  // namespace tandem::kernels::cuda
