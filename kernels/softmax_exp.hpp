// The softmax's exp, written once (docs/arithmetic.md): the same float operations on every
// CPU ISA (kernels_simd.hpp runs them on 8 lanes) and, as __host__ __device__ code, on the
// GPU, instead of each platform's libm or __expf. Plain arithmetic, no tables.
//
// For x <= 0 (a score minus the row's maximum), and up to kExpMax for SiLU (silu() below):
// below kSoftmaxExpMin the result is 0, above kExpMax +inf
// (exp(-87) ~ 1.6e-38, weights that small vanish in the f16 probabilities anyway);
// otherwise, with n = round_half_even(x * log2(e)):
//   r = fma(n, -ln2_hi, x); r = fma(n, -ln2_lo, r)      (Cody-Waite reduction)
//   p = c0; p = fma(p, r, c1) ... fma(p, r, c5)            (Cephes expf's polynomial)
//   y = fma(p, r * r, r) + 1;  exp(x) = y * 2^n            (2^n built from its exponent bits)
// Every step is one IEEE operation with round-to-nearest-even, so any implementation that
// performs these steps gives the same bits. Accuracy against exp: within 2 ulp on
// [-87, 0] (tests/test_cpu_kernels.cpp). Source of the constants: Cephes (S. Moshier),
// expf.c, the same as ggml's and many SIMD libraries' exp.
#pragma once

#include <cmath>
#include <cstdint>

#include "quant_blocks.hpp"

namespace tandem::kernels {

inline constexpr float kSoftmaxExpMin = -87.0f;
inline constexpr float kExpMax = 88.0f;  // n <= 127: 2^n is still a normal float
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2Hi = 0.693359375f;
inline constexpr float kLn2Lo = -2.12194440e-4f;
inline constexpr float kExpC0 = 1.9875691500e-4f;
inline constexpr float kExpC1 = 1.3981999507e-3f;
inline constexpr float kExpC2 = 8.3334519073e-3f;
inline constexpr float kExpC3 = 4.1665795894e-2f;
inline constexpr float kExpC4 = 1.6666665459e-1f;
inline constexpr float kExpC5 = 5.0000001201e-1f;

/// exp(x) by the steps above: 0 below kSoftmaxExpMin (and for -inf), +inf above kExpMax,
/// NaN for NaN.
TANDEM_HD_INLINE float softmax_exp(float x) {
  if (!(x >= kSoftmaxExpMin)) return x != x ? x : 0.0f;  // NaN stays NaN; -inf and tiny -> 0
  if (x > kExpMax) return f32_from_bits(0x7F800000u);
#if defined(__CUDA_ARCH__)
  const float n = rintf(x * kLog2e);
  float r = __fmaf_rn(n, -kLn2Hi, x);
  r = __fmaf_rn(n, -kLn2Lo, r);
  float p = kExpC0;
  p = __fmaf_rn(p, r, kExpC1);
  p = __fmaf_rn(p, r, kExpC2);
  p = __fmaf_rn(p, r, kExpC3);
  p = __fmaf_rn(p, r, kExpC4);
  p = __fmaf_rn(p, r, kExpC5);
  const float y = __fadd_rn(__fmaf_rn(p, __fmul_rn(r, r), r), 1.0f);
  return __fmul_rn(y, f32_from_bits(uint32_t(int32_t(n) + 127) << 23));
#else
  const float n = std::nearbyint(x * kLog2e);
  float r = std::fma(n, -kLn2Hi, x);
  r = std::fma(n, -kLn2Lo, r);
  float p = kExpC0;
  p = std::fma(p, r, kExpC1);
  p = std::fma(p, r, kExpC2);
  p = std::fma(p, r, kExpC3);
  p = std::fma(p, r, kExpC4);
  p = std::fma(p, r, kExpC5);
  const float y = std::fma(p, r * r, r) + 1.0f;
  return y * f32_from_bits(uint32_t(int32_t(n) + 127) << 23);
#endif
}

/// SiLU, g * sigmoid(g), written: g / (1 + softmax_exp(-g)) (one rounded sum, one rounded
/// quotient), the same bits on the CPU and the GPU (docs/arithmetic.md). g < -88 gives
/// g / +inf = -0; NaN stays NaN.
TANDEM_HD_INLINE float silu(float g) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(g, __fadd_rn(1.0f, softmax_exp(-g)));
#else
  return g / (1.0f + softmax_exp(-g));
#endif
}

}  // namespace tandem::kernels
