// The RoPE angle table, written once for both executors (docs/arithmetic.md, "Norms, RoPE,
// SwiGLU"): theta_i = freq_scale * (pos * theta_scale^i), theta_scale = base^(-2 / n_rot),
// with the power built by repeated multiplication as ggml does (RoFormer, arXiv:2104.09864),
// cos and sin from the host's C library. The GPU executor uploads the table the host builds,
// so both executors rotate by the same bits.
#pragma once

#include <cmath>
#include <cstdint>

namespace tandem::kernels {

/// base^(-2 / n_rot): the ratio between consecutive pairs' angles.
inline float rope_theta_scale(float base, int64_t n_rot) noexcept {
  return std::pow(base, -2.0f / float(n_rot));
}

/// One position's row of the table: c[0, n_rot/2) the cosines, c[n_rot/2, n_rot) the sines.
inline void rope_table_row(float* c, int32_t pos, int64_t n_rot, float theta_scale, float freq_scale) noexcept {
  const int64_t half = n_rot / 2;
  float theta = static_cast<float>(pos);
  for (int64_t i = 0; i < half; ++i) {
    const float th = freq_scale * theta;
    c[i] = std::cos(th);
    c[half + i] = std::sin(th);
    theta *= theta_scale;
  }
}

}  // namespace tandem::kernels
