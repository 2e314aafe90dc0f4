// Portable scalar kernels: the fallback ISA and the reference the SIMD paths are tested
// against. Numerics follow ggml's x86 path (see cpu_kernels.hpp); compiled with no extra
// -m flags. Quantisation is bit-identical to the SIMD paths.
#include <cmath>

#include "kernels_table.hpp"

namespace tandem::kernels::detail {
namespace {

constexpr int64_t kHalf = kQK / 2;

void s_fp16_to_fp32_row(const uint16_t* x, float* y, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) y[i] = fp16_bits_to_fp32(x[i]);
}
void s_fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) y[i] = fp32_to_fp16_bits(x[i]);
}

void s_quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQK;
    float amax = 0.0f;
    for (int j = 0; j < kQK; ++j) {
      const float a = std::fabs(xb[j]);
      amax = a > amax ? a : amax;
    }
    const float d = amax / 127.f;
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    y[b].d = fp32_to_fp16_bits(d);
    for (int j = 0; j < kQK; ++j) {
      // Round half to even, like _mm256_round_ps(_MM_ROUND_NEAREST) + cvtps_epi32.
      const float v = std::nearbyint(xb[j] * id);
      y[b].qs[j] = static_cast<int8_t>(v > 127.f ? 127 : (v < -128.f ? -128 : static_cast<int>(v)));
    }
  }
}

void s_dequantize_row_q4_0(const BlockQ4_0* x, float* y, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  for (int64_t b = 0; b < nb; ++b) {
    const float d = fp16_bits_to_fp32(x[b].d);
    for (int j = 0; j < kHalf; ++j) {
      y[b * kQK + j] = d * static_cast<float>((x[b].qs[j] & 0x0F) - 8);
      y[b * kQK + j + kHalf] = d * static_cast<float>((x[b].qs[j] >> 4) - 8);
    }
  }
}
void s_dequantize_row_q8_0(const BlockQ8_0* x, float* y, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  for (int64_t b = 0; b < nb; ++b) {
    const float d = fp16_bits_to_fp32(x[b].d);
    for (int j = 0; j < kQK; ++j) y[b * kQK + j] = d * static_cast<float>(x[b].qs[j]);
  }
}

float s_vec_dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b)
    sum += block_scale_product(w[b].d, x[b].d) * static_cast<float>(dot_block_q4_0_q8_0(w[b], x[b]));
  return sum;
}
float s_vec_dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  float sum = 0.0f;
  for (int64_t b = 0; b < nb; ++b)
    sum += block_scale_product(w[b].d, x[b].d) * static_cast<float>(dot_block_q8_0_q8_0(w[b], x[b]));
  return sum;
}
float s_vec_dot_f32(const float* a, const float* b, int64_t n) noexcept {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += a[i] * b[i];
  return sum;
}
float s_vec_dot_f16(const uint16_t* a, const uint16_t* b, int64_t n) noexcept {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += fp16_bits_to_fp32(a[i]) * fp16_bits_to_fp32(b[i]);
  return sum;
}
float s_vec_dot_bf16_f32(const uint16_t* a, const float* b, int64_t n) noexcept {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += bf16_bits_to_fp32(a[i]) * b[i];
  return sum;
}

template <class TW, class TX, float (*Dot)(const TW*, const TX*, int64_t) noexcept>
void s_gemm(const TW* w, const TX* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0, int64_t r1,
            int64_t w_row, int64_t x_row) noexcept {
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = r0; r < r1; ++r) y[i * ldy + r] = Dot(w + r * w_row, x + i * x_row, k);
}

void s_gemm_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ4_0, BlockQ8_0, s_vec_dot_q4_0_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK, k / kQK);
}
void s_gemm_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ8_0, BlockQ8_0, s_vec_dot_q8_0_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK, k / kQK);
}
void s_gemm_f32_f32(const float* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  s_gemm<float, float, s_vec_dot_f32>(w, x, y, k, m, ldy, r0, r1, k, k);
}
void s_gemm_f16_f16(const uint16_t* w, const uint16_t* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  s_gemm<uint16_t, uint16_t, s_vec_dot_f16>(w, x, y, k, m, ldy, r0, r1, k, k);
}
void s_gemm_bf16_f32(const uint16_t* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                     int64_t r1) noexcept {
  s_gemm<uint16_t, float, s_vec_dot_bf16_f32>(w, x, y, k, m, ldy, r0, r1, k, k);
}

void s_axpy_f16(float a, const uint16_t* x, float* y, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) y[i] += a * fp16_bits_to_fp32(x[i]);
}

void s_vec_dot_f16_rows(const uint16_t* k, int64_t stride, int64_t n_rows, const uint16_t* q, int64_t n,
                        float* out) noexcept {
  for (int64_t r = 0; r < n_rows; ++r) out[r] = s_vec_dot_f16(k + r * stride, q, n);
}
void s_axpy_f16_rows(const float* a, const uint16_t* x, int64_t stride, int64_t n_rows, float* y, int64_t n) noexcept {
  for (int64_t r = 0; r < n_rows; ++r) s_axpy_f16(a[r], x + r * stride, y, n);
}

bool s_thread_prepare() noexcept {
  return true;
}  // the scalar kernels use no scratch

}  // namespace

const KernelTable& table_scalar() noexcept {
  static constexpr KernelTable t{"scalar",
                                 s_fp16_to_fp32_row,
                                 s_fp32_to_fp16_row,
                                 s_quantize_row_q8_0,
                                 s_dequantize_row_q4_0,
                                 s_dequantize_row_q8_0,
                                 s_vec_dot_q4_0_q8_0,
                                 s_vec_dot_q8_0_q8_0,
                                 s_vec_dot_f32,
                                 s_vec_dot_f16,
                                 s_vec_dot_bf16_f32,
                                 s_gemm_q4_0_q8_0,
                                 s_gemm_q8_0_q8_0,
                                 s_gemm_f32_f32,
                                 s_gemm_f16_f16,
                                 s_gemm_bf16_f32,
                                 s_axpy_f16,
                                 s_vec_dot_f16_rows,
                                 s_axpy_f16_rows,
                                 s_thread_prepare};
  return t;
}

}  // namespace tandem::kernels::detail
