// Portable scalar kernels: the fallback ISA and the reference the SIMD paths are tested
// against. Numerics follow ggml's x86 path (see cpu_kernels.hpp); compiled with no extra
// -m flags. Quantisation is bit-identical to the SIMD paths.
#include <algorithm>
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

// The reference flash attention (cpu_kernels.hpp): one row at a time, the same tiles and
// update formulas as the SIMD paths, plain multiply-adds and std::exp.
void s_flash_attn(const FlashAttnArgs& a, float* scratch) noexcept {
  const int64_t hd = a.head_dim, G = a.group, R = int64_t{a.n_pos} * G;
  if (R <= 0 || hd <= 0) return;
  const FlashAttnLayout L = flash_attn_scratch_layout(hd, R);
  float* q = scratch + L.qt;  // [R][hd] here (the same size as the SIMD paths' transpose)
  float* kt = scratch + L.k;
  float* vt = scratch + L.v;
  float* sc = scratch + L.s;  // one row's scores
  float* o = scratch + L.o;
  float* m = scratch + L.m;
  float* l = scratch + L.l;
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = a.q + (r / G) * a.q_stride + (r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) q[r * hd + d] = a.kv_f16 ? fp16_bits_to_fp32(fp32_to_fp16_bits(qr[d])) : qr[d];
    m[r] = -INFINITY;
    l[r] = 0.0f;
    for (int64_t d = 0; d < hd; ++d) o[r * hd + d] = 0.0f;
  }
  const int64_t last = int64_t{a.pos0} + a.n_pos - 1;
  for (int64_t t0 = 0; t0 <= last; t0 += kFlashAttnTile) {
    const int64_t nc = std::min<int64_t>(kFlashAttnTile, last + 1 - t0);
    for (int64_t c = 0; c < nc; ++c) {
      const int64_t p = t0 + c;
      const int64_t off = (p % a.page_size) * a.row_stride + a.head_offset;
      const size_t page = static_cast<size_t>(p / a.page_size);
      for (int64_t d = 0; d < hd; ++d) {
        if (a.kv_f16) {
          kt[c * hd + d] = fp16_bits_to_fp32(static_cast<const uint16_t*>(a.k_pages[page])[off + d]);
          vt[c * hd + d] = fp16_bits_to_fp32(static_cast<const uint16_t*>(a.v_pages[page])[off + d]);
        } else {
          kt[c * hd + d] = static_cast<const float*>(a.k_pages[page])[off + d];
          vt[c * hd + d] = static_cast<const float*>(a.v_pages[page])[off + d];
        }
      }
    }
    for (int64_t r = 0; r < R; ++r) {
      const int64_t valid = std::min<int64_t>(nc, a.pos0 + r / G - t0 + 1);
      if (valid <= 0) continue;
      float mt = -INFINITY;
      for (int64_t c = 0; c < valid; ++c) {
        float dot = 0.0f;
        for (int64_t d = 0; d < hd; ++d) dot += kt[c * hd + d] * q[r * hd + d];
        sc[c] = dot * a.scale;
        mt = sc[c] > mt ? sc[c] : mt;
      }
      const float mn = m[r] > mt ? m[r] : mt;
      const float cr = std::exp(m[r] - mn);
      float ls = 0.0f;
      for (int64_t c = 0; c < valid; ++c) {
        sc[c] = std::exp(sc[c] - mn);
        ls += sc[c];
      }
      l[r] = l[r] * cr + ls;
      m[r] = mn;
      for (int64_t d = 0; d < hd; ++d) {
        float x = o[r * hd + d] * cr;
        for (int64_t c = 0; c < valid; ++c) x += sc[c] * vt[c * hd + d];
        o[r * hd + d] = x;
      }
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / l[r];
    float* dst = a.out + (r / G) * a.q_stride + (r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) dst[d] = o[r * hd + d] * inv;
  }
}

// The reference attn_tiled: the scalar vec_dot_f16 / axpy_f16 arithmetic per row.
void s_attn_tiled(const FlashAttnArgs& a, float* scratch) noexcept {
  const int64_t hd = a.head_dim, G = a.group, R = int64_t{a.n_pos} * G;
  if (R <= 0 || hd <= 0) return;
  const int64_t last = int64_t{a.pos0} + a.n_pos - 1;
  const AttnTiledLayout L = attn_tiled_scratch_layout(hd, R, last + 1);
  float* sc = scratch + L.s;
  float* q = scratch + L.q;
  const int64_t hp = (hd + 15) / 16 * 16;
  auto kval = [&](const void* const* pages, int64_t p, int64_t d) {
    const void* page = pages[static_cast<size_t>(p / a.page_size)];
    const int64_t off = (p % a.page_size) * a.row_stride + a.head_offset + d;
    if (a.kv_q8_0) {
      float y = 0.0f;
      q8_0_span_to_f32(static_cast<const BlockQ8_0*>(page), off, 1, &y);
      return y;
    }
    return a.kv_f16 ? fp16_bits_to_fp32(static_cast<const uint16_t*>(page)[off]) : static_cast<const float*>(page)[off];
  };
  const bool f16 = a.kv_f16 && !a.kv_q8_0;
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = a.q + (r / G) * a.q_stride + (r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) q[d] = f16 ? fp16_bits_to_fp32(fp32_to_fp16_bits(qr[d])) : qr[d];
    const int64_t n = a.pos0 + r / G + 1;
    float mx = -INFINITY;
    for (int64_t p = 0; p < n; ++p) {
      float dot = 0.0f;
      for (int64_t d = 0; d < hd; ++d) dot += kval(a.k_pages, p, d) * q[d];
      sc[p] = dot * a.scale;
      mx = sc[p] > mx ? sc[p] : mx;
    }
    double sum = 0.0;
    for (int64_t p = 0; p < n; ++p) {
      sc[p] = std::exp(sc[p] - mx);
      sum += sc[p];
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (int64_t p = 0; p < n; ++p) {
      sc[p] *= inv;
      if (f16) sc[p] = fp16_bits_to_fp32(fp32_to_fp16_bits(sc[p]));
    }
    float* out = a.out + (r / G) * a.q_stride + (r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) {
      float y = 0.0f;
      for (int64_t p = 0; p < n; ++p) y += sc[p] * kval(a.v_pages, p, d);
      out[d] = y;
    }
  }
  (void)hp;
}

// The reference arithmetic of gemm_q4_0x8_q8_0 (cpu_kernels.hpp), one (row, column) at a
// time: exact integer block dots, one f32 product and one fma per block.
void s_gemm_q4_0x8_q8_0(const BlockQ4_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy,
                        int64_t r0, int64_t r1) noexcept {
  const int64_t nb = k / kQK;
  for (int64_t c = 0; c < m; ++c) {
    for (int64_t r = r0; r < r1; ++r) {
      const BlockQ4_0x8* wg = w + (r / 8) * nb;
      const int lane = static_cast<int>(r % 8);
      float acc = 0.0f;
      for (int64_t b = 0; b < nb; ++b) {
        const BlockQ8_0& xb = x[c * nb + b];
        int32_t s = 0;
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) {
            const int q = wg[b].qs[32 * j + 4 * lane + i];
            s += ((q & 0x0F) - 8) * xb.qs[4 * j + i] + ((q >> 4) - 8) * xb.qs[16 + 4 * j + i];
          }
        const float d = fp16_bits_to_fp32(wg[b].d[lane]) * fp16_bits_to_fp32(xb.d);
        acc = std::fma(d, static_cast<float>(s), acc);
      }
      y[c * ldy + r] = acc;
    }
  }
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
                                 s_thread_prepare,
                                 s_flash_attn,
                                 s_attn_tiled,
                                 s_gemm_q4_0x8_q8_0,
                                 false};
  return t;
}

}  // namespace tandem::kernels::detail
