// Portable scalar kernels: the fallback ISA and the reference the SIMD paths are tested
// against. They run the SIMD paths' written arithmetic lane by lane (8 f32 lanes, fma, the
// same sums), so every kernel but flash_attn (vectorised exp there) gives the SIMD bits;
// compiled with no extra -m flags and no FMA contraction (every fma is explicit).
#include <algorithm>
#include <cmath>

#include "kernels_table.hpp"
#include "softmax_exp.hpp"

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

// The SIMD paths' arithmetic (kernels_simd.hpp, cpu_kernels.hpp), lane by lane, so scalar
// results are the same bits as avx2/avx512/avx512vnni.

/// hsum256's tree: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
float sum8(const float* a) noexcept {
  return ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
}

/// Element e of a quantised block as the integer the SIMD tiles multiply.
inline int32_t q_at(const BlockQ4_0& w, int e) noexcept {
  return e < kHalf ? (w.qs[e] & 0x0F) - 8 : (w.qs[e - kHalf] >> 4) - 8;
}
inline int32_t q_at(const BlockQ5_0& w, int e) noexcept {
  uint32_t qh;
  std::memcpy(&qh, w.qh, sizeof qh);
  const int32_t hi = static_cast<int32_t>((qh >> e) & 1u) << 4;
  return (e < kHalf ? (w.qs[e] & 0x0F) : (w.qs[e - kHalf] >> 4)) + hi - 16;
}
inline int32_t q_at(const BlockQ8_0& w, int e) noexcept {
  return w.qs[e];
}

/// The 32 lane sums of the quantised dot and float matmul arithmetic (cpu_kernels.hpp):
/// add(i, p) puts term i in lane i % 32; tree() adds the lanes at o = 16, 8, 4, 2, 1.
struct Lanes32 {
  float a[32] = {};
  void add(int64_t i, float p) noexcept { a[i % 32] = a[i % 32] + p; }
  float tree() noexcept {
    for (int o = 16; o > 0; o /= 2)
      for (int l = 0; l < o; ++l) a[l] = a[l] + a[l + o];
    return a[0];
  }
};

/// The quantised dot arithmetic for one (row, column): p_b = (d_w * d_x) * f32(S_b).
template <class TW>
float s_dot_q(const TW* w, const BlockQ8_0* x, int64_t k) noexcept {
  Lanes32 lanes;
  for (int64_t b = 0; b < k / kQK; ++b) {
    int32_t s = 0;
    for (int e = 0; e < kQK; ++e) s += q_at(w[b], e) * x[b].qs[e];
    lanes.add(b, block_scale_product(w[b].d, x[b].d) * static_cast<float>(s));
  }
  return lanes.tree();
}
float s_vec_dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  return s_dot_q(w, x, k);
}
float s_vec_dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  return s_dot_q(w, x, k);
}
float s_vec_dot_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  return s_dot_q(w, x, k);
}
/// Element e of a block whose weight is d * q + m, as the unsigned q the tiles multiply.
inline int32_t uq_at(const BlockQ4_1& w, int e) noexcept {
  return e < kHalf ? (w.qs[e] & 0x0F) : (w.qs[e - kHalf] >> 4);
}
inline int32_t uq_at(const BlockQ5_1& w, int e) noexcept {
  uint32_t qh;
  std::memcpy(&qh, w.qh, sizeof qh);
  return (e < kHalf ? (w.qs[e] & 0x0F) : (w.qs[e - kHalf] >> 4)) | static_cast<int32_t>((qh >> e) & 1u) << 4;
}

/// Q4_1, Q5_1: p_b = ((d_w * d_x) * f32(S_b)) + ((m_w * d_x) * f32(T_b)), S_b over the unsigned q.
template <class TW>
float s_dot_q_min(const TW* w, const BlockQ8_0* x, int64_t k) noexcept {
  Lanes32 lanes;
  for (int64_t b = 0; b < k / kQK; ++b) {
    int32_t s = 0, t = 0;
    for (int e = 0; e < kQK; ++e) {
      s += uq_at(w[b], e) * x[b].qs[e];
      t += x[b].qs[e];
    }
    const float ps = block_scale_product(w[b].d, x[b].d) * static_cast<float>(s);
    const float pm = block_scale_product(w[b].m, x[b].d) * static_cast<float>(t);
    lanes.add(b, ps + pm);
  }
  return lanes.tree();
}

float s_vec_dot_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, int64_t k) noexcept {
  return s_dot_q_min(w, x, k);
}
float s_vec_dot_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, int64_t k) noexcept {
  return s_dot_q_min(w, x, k);
}

inline int32_t kq_at(const BlockQ4_K& w, int e) noexcept {
  return q4k_at(w, e);
}
inline int32_t kq_at(const BlockQ5_K& w, int e) noexcept {
  return q5k_at(w, e);
}
/// Q4_K, Q5_K: block b is sub-block j = b % 8 of weight block b / 8;
/// p_b = ((d * d_x) * f32(sc_j * S_b)) - ((dmin * d_x) * f32(m_j * T_b)), S_b over the unsigned q.
template <class TW>
float s_dot_q_k_min(const TW* w, const BlockQ8_0* x, int64_t k) noexcept {
  Lanes32 lanes;
  for (int64_t b = 0; b < k / kQK; ++b) {
    const TW& wb = w[b / 8];
    const int j = static_cast<int>(b % 8);
    int sc = 0, mn = 0;
    k4_scale_min(wb.scales, j, sc, mn);
    int32_t s = 0, t = 0;
    for (int e = 0; e < kQK; ++e) {
      s += kq_at(wb, kQK * j + e) * x[b].qs[e];
      t += x[b].qs[e];
    }
    const float ps = block_scale_product(wb.d, x[b].d) * static_cast<float>(sc * s);
    const float pm = block_scale_product(wb.dmin, x[b].d) * static_cast<float>(mn * t);
    lanes.add(b, ps - pm);
  }
  return lanes.tree();
}
float s_vec_dot_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  return s_dot_q_k_min(w, x, k);
}
float s_vec_dot_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  return s_dot_q_k_min(w, x, k);
}
/// Q6_K: block b covers the 16-element sub-blocks 2j, 2j + 1 (j = b % 8) of weight block
/// b / 8; p_b = (d * d_x) * f32(s_2j * S_lo + s_2j+1 * S_hi).
float s_vec_dot_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  Lanes32 lanes;
  for (int64_t b = 0; b < k / kQK; ++b) {
    const BlockQ6_K& wb = w[b / 8];
    const int j = static_cast<int>(b % 8);
    int32_t lo = 0, hi = 0;
    for (int e = 0; e < kQK / 2; ++e) {
      lo += q6k_at(wb, kQK * j + e) * x[b].qs[e];
      hi += q6k_at(wb, kQK * j + kQK / 2 + e) * x[b].qs[kQK / 2 + e];
    }
    const int32_t s = wb.scales[2 * j] * lo + wb.scales[2 * j + 1] * hi;
    lanes.add(b, block_scale_product(wb.d, x[b].d) * static_cast<float>(s));
  }
  return lanes.tree();
}

struct F16 {
  static float get(uint16_t v) noexcept { return fp16_bits_to_fp32(v); }
};
struct BF16 {
  static float get(uint16_t v) noexcept { return bf16_bits_to_fp32(v); }
};
struct F32 {
  static float get(float v) noexcept { return v; }
};

/// vec_dot_f's arithmetic: element i of the full 32-element chunks goes to accumulator
/// (i / 8) % 4, lane i % 8; the remaining full 8-element chunks to accumulator 0; then
/// sum8 of (acc0 + acc1) + (acc2 + acc3) lane-wise; the last n % 8 elements by fma.
template <class LA, class LB, class TA, class TB>
float s_dot_f(const TA* a, const TB* b, int64_t n) noexcept {
  float acc[4][8] = {};
  int64_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int v = 0; v < 4; ++v)
      for (int l = 0; l < 8; ++l) acc[v][l] = std::fma(LA::get(a[i + 8 * v + l]), LB::get(b[i + 8 * v + l]), acc[v][l]);
  for (; i + 8 <= n; i += 8)
    for (int l = 0; l < 8; ++l) acc[0][l] = std::fma(LA::get(a[i + l]), LB::get(b[i + l]), acc[0][l]);
  float t[8];
  for (int l = 0; l < 8; ++l) t[l] = (acc[0][l] + acc[1][l]) + (acc[2][l] + acc[3][l]);
  float sum = sum8(t);
  for (; i < n; ++i) sum = std::fma(LA::get(a[i]), LB::get(b[i]), sum);
  return sum;
}
/// tile_f's arithmetic (the float GEMM/GEMV, the GPU's): element e's product in lane
/// e % 32, then the tree.
template <class LA, class LB, class TA, class TB>
float s_dot_tile_f(const TA* w, const TB* x, int64_t k) noexcept {
  Lanes32 lanes;
  for (int64_t i = 0; i < k; ++i) lanes.add(i, LA::get(w[i]) * LB::get(x[i]));
  return lanes.tree();
}

float s_vec_dot_f32(const float* a, const float* b, int64_t n) noexcept {
  return s_dot_f<F32, F32>(a, b, n);
}
float s_vec_dot_f16(const uint16_t* a, const uint16_t* b, int64_t n) noexcept {
  return s_dot_f<F16, F16>(a, b, n);
}
float s_vec_dot_bf16_f32(const uint16_t* a, const float* b, int64_t n) noexcept {
  return s_dot_f<BF16, F32>(a, b, n);
}
float s_tile_f32(const float* w, const float* x, int64_t k) noexcept {
  return s_dot_tile_f<F32, F32>(w, x, k);
}
float s_tile_f16(const uint16_t* w, const uint16_t* x, int64_t k) noexcept {
  return s_dot_tile_f<F16, F16>(w, x, k);
}
float s_tile_bf16(const uint16_t* w, const float* x, int64_t k) noexcept {
  return s_dot_tile_f<BF16, F32>(w, x, k);
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
void s_gemm_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ4_1, BlockQ8_0, s_vec_dot_q4_1_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK, k / kQK);
}
void s_gemm_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ5_0, BlockQ8_0, s_vec_dot_q5_0_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK, k / kQK);
}
void s_gemm_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ4_K, BlockQ8_0, s_vec_dot_q4_k_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK_K, k / kQK);
}
void s_gemm_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ5_1, BlockQ8_0, s_vec_dot_q5_1_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK, k / kQK);
}
void s_gemm_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ5_K, BlockQ8_0, s_vec_dot_q5_k_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK_K, k / kQK);
}
void s_gemm_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ6_K, BlockQ8_0, s_vec_dot_q6_k_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK_K, k / kQK);
}
void s_gemm_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  s_gemm<BlockQ8_0, BlockQ8_0, s_vec_dot_q8_0_q8_0>(w, x, y, k, m, ldy, r0, r1, k / kQK, k / kQK);
}
void s_gemm_f32_f32(const float* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  s_gemm<float, float, s_tile_f32>(w, x, y, k, m, ldy, r0, r1, k, k);
}
void s_gemm_f16_f16(const uint16_t* w, const uint16_t* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  s_gemm<uint16_t, uint16_t, s_tile_f16>(w, x, y, k, m, ldy, r0, r1, k, k);
}
void s_gemm_bf16_f32(const uint16_t* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                     int64_t r1) noexcept {
  s_gemm<uint16_t, float, s_tile_bf16>(w, x, y, k, m, ldy, r0, r1, k, k);
}

void s_axpy_f16(float a, const uint16_t* x, float* y, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) y[i] = std::fma(a, fp16_bits_to_fp32(x[i]), y[i]);
}

void s_swiglu(float* gate, const float* up, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
}

void s_geglu(const uint16_t* table, float* gate, const float* up, int64_t n) noexcept {
  for (int64_t i = 0; i < n; ++i) gate[i] = geglu_value(table, gate[i], up[i]);
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

// attn_tiled's softmax of one row's scores sc[p0 .. n) given their max: e, the sum in
// double (8 lanes over the full groups of 8 positions from p0, the 8-lane tree, then the
// tail), the weights e * f32(1 / sum), rounded to f16 for an f16 cache.
void s_softmax_row(float* sc, int64_t p0, int64_t n, float mx, bool f16) noexcept {
  double lanes[8] = {};
  const int64_t n8 = p0 + (n - p0) / 8 * 8;
  for (int64_t p = p0; p < n; ++p) {
    sc[p] = softmax_exp(sc[p] - mx);
    if (p < n8) lanes[(p - p0) % 8] = lanes[(p - p0) % 8] + double(sc[p]);
  }
  double sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
  for (int64_t p = n8; p < n; ++p) sum = sum + double(sc[p]);
  const float inv = static_cast<float>(1.0 / sum);
  for (int64_t p = p0; p < n; ++p) {
    sc[p] *= inv;
    if (f16) sc[p] = fp16_bits_to_fp32(fp32_to_fp16_bits(sc[p]));
  }
}

// The reference attn_tiled (docs/arithmetic.md "Attention"), one row at a time: each score
// by vec_dot_f's arithmetic, the written softmax, then per element the chunked fma chains.
void s_attn_tiled(const FlashAttnArgs& a, float* scratch) noexcept {
  const int64_t hd = a.head_dim, G = a.group, R = int64_t{a.n_pos} * G;
  if (R <= 0 || hd <= 0) return;
  const int64_t last = int64_t{a.pos0} + a.n_pos - 1;
  const AttnTiledLayout L = attn_tiled_scratch_layout(hd, R, last + 1);
  float* sc = scratch + L.s;
  float* q = scratch + L.q;
  float* krow = scratch + L.kv;
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
    const int64_t p0 = a.window > 0 ? std::max<int64_t>(0, n - a.window) : 0;  // the window's first position
    float mx = -INFINITY;
    for (int64_t p = p0; p < n; ++p) {
      for (int64_t d = 0; d < hd; ++d) krow[d] = kval(a.k_pages, p, d);
      sc[p] = s_dot_f<F32, F32>(krow, q, hd) * a.scale;
      mx = sc[p] > mx ? sc[p] : mx;
    }
    s_softmax_row(sc, p0, n, mx, f16);
    // Chunks of kFlashAttnTile positions from p0: part over a chunk, then out = out + part.
    float* out = a.out + (r / G) * a.q_stride + (r % G) * hd;
    for (int64_t d = 0; d < hd; ++d) {
      float y = 0.0f, part = 0.0f;
      for (int64_t p = p0; p < n; ++p) {
        part = std::fma(sc[p], kval(a.v_pages, p, d), part);
        if ((p + 1 - p0) % kFlashAttnTile == 0 || p + 1 == n) {
          y = y + part;
          part = 0.0f;
        }
      }
      out[d] = y;
    }
  }
}

// attn_split_* (cpu_kernels.hpp): attn_tiled's per-row steps above over a range of chunks.
void s_attn_split_scores(const FlashAttnArgs& a, int64_t c0, int64_t c1, float* s, int64_t ld,
                         float* row_max) noexcept {
  const AttnSplitGeom g = attn_split_geom(a);
  const int64_t hd = a.head_dim, pb = g.p0 + c0 * kFlashAttnTile, pe = std::min(g.n, g.p0 + c1 * kFlashAttnTile);
  float q[kAttnSplitMaxDim];
  for (int64_t r = 0; r < a.group; ++r) {
    for (int64_t d = 0; d < hd; ++d) q[d] = fp16_bits_to_fp32(fp32_to_fp16_bits(a.q[r * hd + d]));
    float mx = -INFINITY;
    for (int64_t p = pb; p < pe; ++p) {
      const float sp = s_dot_f<F16, F32>(attn_kv_row_f16(a, a.k_pages, p), q, hd) * a.scale;
      s[r * ld + p] = sp;
      mx = sp > mx ? sp : mx;
    }
    row_max[r] = mx;
  }
}
void s_attn_split_softmax(const FlashAttnArgs& a, float* s, int64_t ld, const float* range_max,
                          int64_t n_ranges) noexcept {
  const AttnSplitGeom g = attn_split_geom(a);
  for (int64_t r = 0; r < a.group; ++r) {
    float mx = -INFINITY;
    for (int64_t i = 0; i < n_ranges; ++i) mx = range_max[i * a.group + r] > mx ? range_max[i * a.group + r] : mx;
    s_softmax_row(s + r * ld, g.p0, g.n, mx, true);
  }
}
void s_attn_split_wv(const FlashAttnArgs& a, int64_t c0, int64_t c1, const float* s, int64_t ld,
                     float* parts) noexcept {
  const AttnSplitGeom g = attn_split_geom(a);
  const int64_t hd = a.head_dim;
  for (int64_t c = c0; c < c1; ++c) {
    const int64_t cb = g.p0 + c * kFlashAttnTile, ce = std::min(g.n, cb + kFlashAttnTile);
    for (int64_t r = 0; r < a.group; ++r)
      for (int64_t d = 0; d < hd; ++d) {
        float part = 0.0f;
        for (int64_t p = cb; p < ce; ++p)
          part = std::fma(s[r * ld + p], fp16_bits_to_fp32(attn_kv_row_f16(a, a.v_pages, p)[d]), part);
        parts[(c * a.group + r) * hd + d] = part;
      }
  }
}

// The repacked gemms (gemm_q4_0x8_q8_0 and its Q4_1 / Q5_0 twins, cpu_kernels.hpp), one
// (row, column) at a time: block b's term p_b = p(record, lane, activation block) into the
// 32 lanes and the tree.
template <class TB, class P>
void s_gemm_x8(const TB* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0, int64_t r1,
               P p) noexcept {
  const int64_t nb = k / kQK;
  for (int64_t c = 0; c < m; ++c) {
    for (int64_t r = r0; r < r1; ++r) {
      const TB* wg = w + (r / 8) * nb;
      const int lane = static_cast<int>(r % 8);
      Lanes32 lanes;
      for (int64_t b = 0; b < nb; ++b) lanes.add(b, p(wg[b], lane, x[c * nb + b]));
      y[c * ldy + r] = lanes.tree();
    }
  }
}

// Q4_0: the quantised dot arithmetic, q = nibble - 8.
void s_gemm_q4_0x8_q8_0(const BlockQ4_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy,
                        int64_t r0, int64_t r1) noexcept {
  s_gemm_x8(w, x, y, k, m, ldy, r0, r1, [](const BlockQ4_0x8& wb, int lane, const BlockQ8_0& xb) {
    int32_t s = 0;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const int q = wb.qs[32 * j + 4 * lane + i];
        s += ((q & 0x0F) - 8) * xb.qs[4 * j + i] + ((q >> 4) - 8) * xb.qs[16 + 4 * j + i];
      }
    return block_scale_product(wb.d[lane], xb.d) * static_cast<float>(s);
  });
}

// Q4_1: s_vec_dot_q4_1_q8_0's arithmetic.
void s_gemm_q4_1x8_q8_0(const BlockQ4_1x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy,
                        int64_t r0, int64_t r1) noexcept {
  s_gemm_x8(w, x, y, k, m, ldy, r0, r1, [](const BlockQ4_1x8& wb, int lane, const BlockQ8_0& xb) {
    int32_t s = 0, t = 0;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const int q = wb.qs[32 * j + 4 * lane + i];
        s += (q & 0x0F) * xb.qs[4 * j + i] + (q >> 4) * xb.qs[16 + 4 * j + i];
        t += xb.qs[4 * j + i] + xb.qs[16 + 4 * j + i];
      }
    const float ps = block_scale_product(wb.d[lane], xb.d) * static_cast<float>(s);
    const float pm = block_scale_product(wb.m[lane], xb.d) * static_cast<float>(t);
    return ps + pm;
  });
}

// Q5_0: s_dot_q's Q5_0 arithmetic (q = the nibble plus 16 times its fifth bit, minus 16).
void s_gemm_q5_0x8_q8_0(const BlockQ5_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy,
                        int64_t r0, int64_t r1) noexcept {
  s_gemm_x8(w, x, y, k, m, ldy, r0, r1, [](const BlockQ5_0x8& wb, int lane, const BlockQ8_0& xb) {
    int32_t s = 0;
    for (int j = 0; j < 4; ++j) {
      for (int i = 0; i < 4; ++i) {
        const int q = wb.qs[32 * j + 4 * lane + i], h = wb.qh[4 * lane + i];
        const int lo = (q & 0x0F) | (((h >> (2 * j)) & 1) << 4), hi = (q >> 4) | (((h >> (2 * j + 1)) & 1) << 4);
        s += (lo - 16) * xb.qs[4 * j + i] + (hi - 16) * xb.qs[16 + 4 * j + i];
      }
    }
    return block_scale_product(wb.d[lane], xb.d) * static_cast<float>(s);
  });
}

// Q4_K: s_dot_q_k_min's arithmetic (q = the nibble, the sub-block's scale and min).
void s_gemm_q4_kx8_q8_0(const BlockQ4_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy,
                        int64_t r0, int64_t r1) noexcept {
  s_gemm_x8(w, x, y, k, m, ldy, r0, r1, [](const BlockQ4_Kx8& wb, int lane, const BlockQ8_0& xb) {
    int32_t s = 0, t = 0;
    for (int j = 0; j < 4; ++j)
      for (int i = 0; i < 4; ++i) {
        const int q = wb.qs[32 * j + 4 * lane + i];
        s += (q & 0x0F) * xb.qs[4 * j + i] + (q >> 4) * xb.qs[16 + 4 * j + i];
        t += xb.qs[4 * j + i] + xb.qs[16 + 4 * j + i];
      }
    const float ps = block_scale_product(wb.d[lane], xb.d) * static_cast<float>(wb.sc[lane] * s);
    const float pm = block_scale_product(wb.dmin[lane], xb.d) * static_cast<float>(wb.m[lane] * t);
    return ps - pm;
  });
}

// Q6_K: s_vec_dot_q6_k_q8_0's arithmetic (q = u - 32, the two 16-element scales).
void s_gemm_q6_kx8_q8_0(const BlockQ6_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy,
                        int64_t r0, int64_t r1) noexcept {
  s_gemm_x8(w, x, y, k, m, ldy, r0, r1, [](const BlockQ6_Kx8& wb, int lane, const BlockQ8_0& xb) {
    int32_t lo = 0, hi = 0;
    for (int c = 0; c < 4; ++c)
      for (int i = 0; i < 4; ++i) {
        const int q = wb.qs[32 * c + 4 * lane + i];
        const int h = wb.qh[32 * (c / 2) + 4 * lane + i] >> (4 * (c % 2));
        lo += ((q & 0x0F) + ((h & 3) << 4) - 32) * xb.qs[4 * c + i];
        hi += ((q >> 4) + (((h >> 2) & 3) << 4) - 32) * xb.qs[16 + 4 * c + i];
      }
    const int32_t s = wb.s[lane] * lo + wb.s[8 + lane] * hi;
    return block_scale_product(wb.d[lane], xb.d) * static_cast<float>(s);
  });
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
                                 s_vec_dot_q4_1_q8_0,
                                 s_gemm_q4_1_q8_0,
                                 s_vec_dot_q5_0_q8_0,
                                 s_gemm_q5_0_q8_0,
                                 s_gemm_q4_1x8_q8_0,
                                 s_gemm_q5_0x8_q8_0,

                                 s_vec_dot_q4_k_q8_0,
                                 s_gemm_q4_k_q8_0,
                                 s_vec_dot_q6_k_q8_0,
                                 s_gemm_q6_k_q8_0,
                                 s_vec_dot_q5_1_q8_0,
                                 s_gemm_q5_1_q8_0,
                                 s_vec_dot_q5_k_q8_0,
                                 s_gemm_q5_k_q8_0,
                                 s_gemm_q4_kx8_q8_0,
                                 s_gemm_q6_kx8_q8_0,
                                 s_swiglu,
                                 s_attn_split_scores,
                                 s_attn_split_softmax,
                                 s_attn_split_wv,
                                 s_geglu};
  return t;
}

}  // namespace tandem::kernels::detail
