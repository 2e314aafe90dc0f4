// Shared SIMD implementation, included by exactly one ISA-specific translation unit each:
// kernels_avx2.cpp (-mavx2 -mfma -mf16c) and kernels_avx512.cpp (-mavx512f/bw/dq/cd/vl).
// Float kernels use xsimd batches templated on the selected xsimd arch; the Q4_0/Q8_0
// integer dot products use raw AVX2 intrinsics (maddubs/madd), which the AVX-512 TU
// compiles with EVEX encodings and 32 vector registers (bigger tiles).
//
// Everything lives in namespace detail::TANDEM_ISA_NS so no inline function or template
// instantiation is shared (ODR-merged) between TUs compiled with different -m flags.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cstddef>
#include <type_traits>
#include <utility>

#include <xsimd/xsimd.hpp>

#include "kernels_table.hpp"

#if !defined(TANDEM_ISA_NS) || !defined(TANDEM_ISA_AVX512)
#error "define TANDEM_ISA_NS and TANDEM_ISA_AVX512 before including kernels_simd.hpp"
#endif

namespace tandem::kernels::detail::TANDEM_ISA_NS {

#if TANDEM_ISA_AVX512
using Arch = xsimd::avx512bw;
constexpr int kQRows = 4, kQCols = 4;  // Q4_0/Q8_0 prefill tile: 16 zmm accumulators
constexpr int kFRows = 4, kFCols = 4;  // float tile: 16 zmm accumulators
#else
using Arch = xsimd::fma3<xsimd::avx2>;
constexpr int kQRows = 4, kQCols = 2;  // 8 accumulators of 16 regs
constexpr int kFRows = 4, kFCols = 3;  // 12 accumulators + 3 activations + 1 weight
#endif
using VF = xsimd::batch<float, Arch>;
constexpr int64_t kW = static_cast<int64_t>(VF::size);
constexpr int kGemvRows = 4;  // rows per GEMV step (independent streams/accumulators)

// ---------------------------------------------------------------- small helpers ---------

inline float h2f(uint16_t h) noexcept { return _cvtsh_ss(h); }

inline VF load_f16(const uint16_t* p) noexcept {
#if TANDEM_ISA_AVX512
  return VF(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#else
  return VF(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#endif
}
inline void store_f16(const VF& v, uint16_t* p) noexcept {
#if TANDEM_ISA_AVX512
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#else
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
#endif
}
inline VF load_bf16(const uint16_t* p) noexcept {
#if TANDEM_ISA_AVX512
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return VF(_mm512_castsi512_ps(_mm512_slli_epi32(u, 16)));
#else
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return VF(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
#endif
}

inline float hsum256(__m256 v) noexcept {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Loaders for the float-family kernels.
struct LdF32 {
  using T = float;
  static VF load(const float* p) noexcept { return VF::load_unaligned(p); }
  static float one(float v) noexcept { return v; }
};
struct LdF16 {
  using T = uint16_t;
  static VF load(const uint16_t* p) noexcept { return load_f16(p); }
  static float one(uint16_t v) noexcept { return h2f(v); }
};
struct LdBF16 {
  using T = uint16_t;
  static VF load(const uint16_t* p) noexcept { return load_bf16(p); }
  static float one(uint16_t v) noexcept { return bf16_bits_to_fp32(v); }
};

// ---------------------------------------------------------------- conversions -----------

void fp16_to_fp32_row(const uint16_t* x, float* y, int64_t n) noexcept {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) load_f16(x + i).store_unaligned(y + i);
  for (; i < n; ++i) y[i] = h2f(x[i]);
}
void fp32_to_fp16_row(const float* x, uint16_t* y, int64_t n) noexcept {
  int64_t i = 0;
  for (; i + kW <= n; i += kW) store_f16(VF::load_unaligned(x + i), y + i);
  for (; i < n; ++i) y[i] = _cvtss_sh(x[i], _MM_FROUND_TO_NEAREST_INT);
}

// ---------------------------------------------------------------- Q8_0 quantisation -----

void quantize_row_q8_0(const float* x, BlockQ8_0* y, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  for (int64_t b = 0; b < nb; ++b) {
    const float* xb = x + b * kQK;
#if TANDEM_ISA_AVX512
    __m512 v0 = _mm512_loadu_ps(xb);
    __m512 v1 = _mm512_loadu_ps(xb + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
#else
    __m256 v0 = _mm256_loadu_ps(xb);
    __m256 v1 = _mm256_loadu_ps(xb + 8);
    __m256 v2 = _mm256_loadu_ps(xb + 16);
    __m256 v3 = _mm256_loadu_ps(xb + 24);
    const __m256 sign = _mm256_set1_ps(-0.0f);
    __m256 mx = _mm256_andnot_ps(sign, v0);
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v1));
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v2));
    mx = _mm256_max_ps(mx, _mm256_andnot_ps(sign, v3));
    __m128 m4 = _mm_max_ps(_mm256_extractf128_ps(mx, 1), _mm256_castps256_ps128(mx));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
    const float amax = _mm_cvtss_f32(m4);
#endif
    const float d = amax / 127.f;
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    y[b].d = fp32_to_fp16_bits(d);  // bit-exact with _cvtss_sh(d, 0)
#if TANDEM_ISA_AVX512
    const __m512 mul = _mm512_set1_ps(id);
    // cvtps_epi32 rounds with MXCSR (nearest even by default), same as round_ps(NEAREST).
    const __m512i i0 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v0, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    const __m512i i1 = _mm512_cvtps_epi32(_mm512_roundscale_ps(_mm512_mul_ps(v1, mul), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs), _mm512_cvtsepi32_epi8(i0));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(y[b].qs + 16), _mm512_cvtsepi32_epi8(i1));
#else
    const __m256 mul = _mm256_set1_ps(id);
    v0 = _mm256_round_ps(_mm256_mul_ps(v0, mul), _MM_ROUND_NEAREST);
    v1 = _mm256_round_ps(_mm256_mul_ps(v1, mul), _MM_ROUND_NEAREST);
    v2 = _mm256_round_ps(_mm256_mul_ps(v2, mul), _MM_ROUND_NEAREST);
    v3 = _mm256_round_ps(_mm256_mul_ps(v3, mul), _MM_ROUND_NEAREST);
    __m256i i0 = _mm256_cvtps_epi32(v0);
    const __m256i i1 = _mm256_cvtps_epi32(v1);
    __m256i i2 = _mm256_cvtps_epi32(v2);
    const __m256i i3 = _mm256_cvtps_epi32(v3);
    i0 = _mm256_packs_epi32(i0, i1);
    i2 = _mm256_packs_epi32(i2, i3);
    i0 = _mm256_packs_epi16(i0, i2);
    i0 = _mm256_permutevar8x32_epi32(i0, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y[b].qs), i0);
#endif
  }
}

// ---------------------------------------------------------------- dequantisation --------

inline void store_i8x16_scaled(__m128i q, float d, float* y) noexcept {
#if TANDEM_ISA_AVX512
  _mm512_storeu_ps(y, _mm512_mul_ps(_mm512_set1_ps(d), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q))));
#else
  const __m256 vd = _mm256_set1_ps(d);
  _mm256_storeu_ps(y, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
#endif
}

void dequantize_row_q4_0(const BlockQ4_0* x, float* y, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  const __m128i m4 = _mm_set1_epi8(0x0F), o8 = _mm_set1_epi8(8);
  for (int64_t b = 0; b < nb; ++b) {
    const float d = h2f(x[b].d);
    const __m128i t = _mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs));
    const __m128i lo = _mm_sub_epi8(_mm_and_si128(t, m4), o8);
    const __m128i hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(t, 4), m4), o8);
    store_i8x16_scaled(lo, d, y + b * kQK);
    store_i8x16_scaled(hi, d, y + b * kQK + 16);
  }
}
void dequantize_row_q8_0(const BlockQ8_0* x, float* y, int64_t k) noexcept {
  const int64_t nb = k / kQK;
  for (int64_t b = 0; b < nb; ++b) {
    const float d = h2f(x[b].d);
    store_i8x16_scaled(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs)), d, y + b * kQK);
    store_i8x16_scaled(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs + 16)), d,
                       y + b * kQK + 16);
  }
}

// ---------------------------------------------------------------- quantised tiles -------
//
// tile_q<TW, R, C>: y[c*ldy + r] = dot(W row r, X row c) for r < R, c < C.
// Per block and (row, column) pair: i32 lanes of the integer dot (exact), converted to f32,
// times the f32 product fp16(d_w) * fp16(d_x), accumulated with FMA into 8 f32 lanes
// (the form of ggml's AVX2 path). Q4_0 uses sum (q-8)*x = maddubs(q, x) - 8 * sum(x), so
// the per-column correction is computed once per block and shared by all R rows.

template <class TW>
using TileFn = void (*)(const TW*, int64_t, const BlockQ8_0*, float*, int64_t, const char*) noexcept;

/// 16 packed bytes -> 32 bytes: low nibbles (weights 0-15) then high nibbles (16-31).
/// Broadcast load + one variable shift of the upper 128-bit lane + mask.
inline __m256i unpack_q4(const uint8_t* qs) noexcept {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i v = _mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

// pf: if not null, the start of the weights the next call will read (the next R rows,
// contiguous); walked linearly at the pace this tile consumes its own R rows so the
// decode GEMV keeps DRAM busy while it computes.
template <class TW, int R, int C>
void tile_q(const TW* w, int64_t nb, const BlockQ8_0* x, float* y, int64_t ldy,
            const char* pf) noexcept {
  constexpr bool kQ4 = std::is_same_v<TW, BlockQ4_0>;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const __m256i ones16 = _mm256_set1_epi16(1);
  for (int64_t b = 0; b < nb; ++b) {
    if (pf != nullptr) {
      const char* p = pf + b * R * static_cast<int64_t>(sizeof(TW));
      _mm_prefetch(p, _MM_HINT_T0);
      if constexpr (R * sizeof(TW) > 64) _mm_prefetch(p + 64, _MM_HINT_T0);
      if constexpr (R * sizeof(TW) > 128) _mm_prefetch(p + 128, _MM_HINT_T0);
    }
    __m256i xq[C];
    __m256i xs[C];
    __m256 dx[C];
    for (int c = 0; c < C; ++c) {
      const BlockQ8_0& xb = x[c * nb + b];
      xq[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      dx[c] = _mm256_set1_ps(h2f(xb.d));
      if constexpr (kQ4)
        xs[c] = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), xq[c]), ones16);
    }
    for (int r = 0; r < R; ++r) {
      const TW& wb = w[r * nb + b];
      const __m256 dw = _mm256_set1_ps(h2f(wb.d));
      if constexpr (kQ4) {
        const __m256i wq = unpack_q4(wb.qs);
        for (int c = 0; c < C; ++c) {
          const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xq[c]), ones16);
          const __m256i s = _mm256_sub_epi32(p, xs[c]);
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx[c]), _mm256_cvtepi32_ps(s), acc[r][c]);
        }
      } else {
        const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.qs));
        const __m256i aw = _mm256_abs_epi8(wq);
        for (int c = 0; c < C; ++c) {
          const __m256i sx = _mm256_sign_epi8(xq[c], wq);
          const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(aw, sx), ones16);
          acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx[c]), _mm256_cvtepi32_ps(s), acc[r][c]);
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[c * ldy + r] = hsum256(acc[r][c]);
}

#if TANDEM_ISA_AVX512
// AVX-512 prefill tile: two consecutive blocks per 512-bit register (half the integer and
// float instructions of the 256-bit tile); an odd last block goes through 256-bit ops.
// Per (row, column) the arithmetic is the same as tile_q's: exact i32 lane sums per block,
// times the f32 product fp16(d_w) * fp16(d_x), FMA-accumulated.
inline __m512i unpack_q4_x2(const uint8_t* qs0, const uint8_t* qs1) noexcept {
  const __m256i a = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs0)));
  const __m256i b = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs1)));
  const __m512i t = _mm512_inserti64x4(_mm512_castsi256_si512(a), b, 1);
  const __m512i v = _mm512_srlv_epi64(t, _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4));
  return _mm512_and_si512(v, _mm512_set1_epi8(0x0F));
}
/// Sums of four u8 x s8 products per i32 lane: one vpdpbusd with AVX512-VNNI, else
/// maddubs + madd. The same integers either way (the i16 pair sums cannot saturate:
/// |q| <= 15 x 127 or 128 x 127 per pair), so every ISA gives identical block dots.
inline __m512i dot_u8s8(__m512i u, __m512i s) noexcept {
#if TANDEM_ISA_VNNI
  return _mm512_dpbusd_epi32(_mm512_setzero_si512(), u, s);
#else
  return _mm512_madd_epi16(_mm512_maddubs_epi16(u, s), _mm512_set1_epi16(1));
#endif
}
/// [fp16(d0) x 8, fp16(d1) x 8] as f32.
inline __m512 scales_x2(uint16_t d0, uint16_t d1) noexcept {
  const __m256i h = _mm256_inserti128_si256(
      _mm256_castsi128_si256(_mm_set1_epi16(static_cast<short>(d0))), _mm_set1_epi16(static_cast<short>(d1)), 1);
  return _mm512_cvtph_ps(h);
}

template <class TW, int R, int C>
void tile_q512(const TW* w, int64_t nb, const BlockQ8_0* x, float* y, int64_t ldy,
               const char* /*pf*/) noexcept {
  // The integer work and the scale products run two blocks per 512-bit register; the
  // f32 accumulation then takes the two halves in block order into 8 lanes, exactly as
  // tile_q does, so prefill (m > 1) and decode (m == 1) give bit-identical dot products
  // and a sequence's logits do not depend on what else shares its batch.
  constexpr bool kQ4 = std::is_same_v<TW, BlockQ4_0>;
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  auto accumulate = [](__m256& a, __m512 scale, __m512i s) {
    const __m512 sf = _mm512_cvtepi32_ps(s);
    a = _mm256_fmadd_ps(_mm512_castps512_ps256(scale), _mm512_castps512_ps256(sf), a);
    a = _mm256_fmadd_ps(_mm512_extractf32x8_ps(scale, 1), _mm512_extractf32x8_ps(sf, 1), a);
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    __m512i xq[C];
    __m512i xs[C];
    __m512 dx[C];
    for (int c = 0; c < C; ++c) {
      const BlockQ8_0& x0 = x[c * nb + b];
      const BlockQ8_0& x1 = x[c * nb + b + 1];
      xq[c] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x0.qs))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x1.qs)), 1);
      dx[c] = scales_x2(x0.d, x1.d);
      if constexpr (kQ4)
        xs[c] = dot_u8s8(_mm512_set1_epi8(8), xq[c]);
    }
    for (int r = 0; r < R; ++r) {
      const TW& w0 = w[r * nb + b];
      const TW& w1 = w[r * nb + b + 1];
      const __m512 dw = scales_x2(w0.d, w1.d);
      if constexpr (kQ4) {
        const __m512i wq = unpack_q4_x2(w0.qs, w1.qs);
        for (int c = 0; c < C; ++c) {
          const __m512i p = dot_u8s8(wq, xq[c]);
          accumulate(acc[r][c], _mm512_mul_ps(dw, dx[c]), _mm512_sub_epi32(p, xs[c]));
        }
      } else {
        const __m512i wq = _mm512_inserti64x4(
            _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w0.qs))),
            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1.qs)), 1);
        const __m512i aw = _mm512_abs_epi8(wq);
        const __mmask64 neg = _mm512_movepi8_mask(wq);
        for (int c = 0; c < C; ++c) {
          // sign(x, w) without AVX-512 psignb: negate x where w < 0 (w == 0 gives aw = 0).
          const __m512i sx = _mm512_mask_sub_epi8(xq[c], neg, _mm512_setzero_si512(), xq[c]);
          accumulate(acc[r][c], _mm512_mul_ps(dw, dx[c]),
                     dot_u8s8(aw, sx));
        }
      }
    }
  }
  if (b < nb) {  // odd block count: the last block with 256-bit ops into the same lanes
    const __m256i ones16_256 = _mm256_set1_epi16(1);
    for (int c = 0; c < C; ++c) {
      const BlockQ8_0& xb = x[c * nb + b];
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      const __m256 dx = _mm256_set1_ps(h2f(xb.d));
      for (int r = 0; r < R; ++r) {
        const TW& wb = w[r * nb + b];
        const __m256 dw = _mm256_set1_ps(h2f(wb.d));
        __m256i s;
        if constexpr (kQ4) {
          const __m256i xs = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_set1_epi8(8), xq), ones16_256);
          s = _mm256_sub_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(unpack_q4(wb.qs), xq), ones16_256), xs);
        } else {
          const __m256i wq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.qs));
          s = _mm256_madd_epi16(_mm256_maddubs_epi16(_mm256_abs_epi8(wq), _mm256_sign_epi8(xq, wq)), ones16_256);
        }
        acc[r][c] = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s), acc[r][c]);
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) y[c * ldy + r] = hsum256(acc[r][c]);
}
#endif

template <class TW, int RB, int CB, size_t... I>
constexpr std::array<TileFn<TW>, RB * CB> make_q_tiles(std::index_sequence<I...>) {
  return {&tile_q<TW, static_cast<int>(I) / CB + 1, static_cast<int>(I) % CB + 1>...};
}
template <class TW, int RB, int CB, size_t... I>
constexpr std::array<TileFn<TW>, RB * CB> make_q_prefill_tiles(std::index_sequence<I...>) {
#if TANDEM_ISA_AVX512
  return {&tile_q512<TW, static_cast<int>(I) / CB + 1, static_cast<int>(I) % CB + 1>...};
#else
  return {&tile_q<TW, static_cast<int>(I) / CB + 1, static_cast<int>(I) % CB + 1>...};
#endif
}

template <class TW>
void gemm_q(const TW* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy,
            int64_t r0, int64_t r1) noexcept {
  const int64_t nb = k / kQK;
  if (m <= 0 || r1 <= r0) return;
  if (m == 1) {  // decode GEMV: stream each weight row once, kGemvRows rows in flight
    static constexpr auto gemv = make_q_tiles<TW, kGemvRows, 1>(std::make_index_sequence<kGemvRows>{});
    for (int64_t r = r0; r < r1; r += kGemvRows) {
      const int64_t rr = std::min<int64_t>(kGemvRows, r1 - r);
      const int64_t rn = r + kGemvRows;
      const char* pf = rn < r1 ? reinterpret_cast<const char*>(w + rn * nb) : nullptr;
      gemv[rr - 1](w + r * nb, nb, x, y + r, ldy, pf);
    }
    return;
  }
  static constexpr auto tiles =
      make_q_prefill_tiles<TW, kQRows, kQCols>(std::make_index_sequence<kQRows * kQCols>{});
  // Column chunk: keep the chunk's activations (~512 KiB) in L2 while all row tiles pass.
  const int64_t col_bytes = nb * static_cast<int64_t>(sizeof(BlockQ8_0));
  int64_t nc = std::max<int64_t>(kQCols, (512 * 1024 / std::max<int64_t>(col_bytes, 1)) / kQCols * kQCols);
  for (int64_t c0 = 0; c0 < m; c0 += nc) {
    const int64_t c1 = std::min(m, c0 + nc);
    for (int64_t r = r0; r < r1; r += kQRows) {
      const int64_t rr = std::min<int64_t>(kQRows, r1 - r);
      for (int64_t c = c0; c < c1; c += kQCols) {
        const int64_t cc = std::min<int64_t>(kQCols, c1 - c);
        tiles[(rr - 1) * kQCols + (cc - 1)](w + r * nb, nb, x + c * nb, y + c * ldy + r, ldy,
                                            nullptr);
      }
    }
  }
}

float vec_dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  tile_q<BlockQ4_0, 1, 1>(w, k / kQK, x, &out, 1, nullptr);
  return out;
}
float vec_dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  tile_q<BlockQ8_0, 1, 1>(w, k / kQK, x, &out, 1, nullptr);
  return out;
}
void gemm_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m,
                    int64_t ldy, int64_t r0, int64_t r1) noexcept {
  gemm_q<BlockQ4_0>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m,
                    int64_t ldy, int64_t r0, int64_t r1) noexcept {
  gemm_q<BlockQ8_0>(w, x, y, k, m, ldy, r0, r1);
}

// ---------------------------------------------------------------- float-family ----------

template <class LA, class LB>
float vec_dot_f(const typename LA::T* a, const typename LB::T* b, int64_t n) noexcept {
  VF s0(0.0f), s1(0.0f), s2(0.0f), s3(0.0f);
  int64_t i = 0;
  for (; i + 4 * kW <= n; i += 4 * kW) {
    s0 = xsimd::fma(LA::load(a + i), LB::load(b + i), s0);
    s1 = xsimd::fma(LA::load(a + i + kW), LB::load(b + i + kW), s1);
    s2 = xsimd::fma(LA::load(a + i + 2 * kW), LB::load(b + i + 2 * kW), s2);
    s3 = xsimd::fma(LA::load(a + i + 3 * kW), LB::load(b + i + 3 * kW), s3);
  }
  for (; i + kW <= n; i += kW) s0 = xsimd::fma(LA::load(a + i), LB::load(b + i), s0);
  float sum = xsimd::hadd((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) sum += LA::one(a[i]) * LB::one(b[i]);
  return sum;
}

template <class LW, class LX>
using FTileFn = void (*)(const typename LW::T*, const typename LX::T*, float*, int64_t, int64_t) noexcept;

template <class LW, class LX, int R, int C>
void tile_f(const typename LW::T* w, const typename LX::T* x, float* y, int64_t k,
            int64_t ldy) noexcept {
  VF acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = VF(0.0f);
  int64_t i = 0;
  for (; i + kW <= k; i += kW) {
    VF xv[C];
    for (int c = 0; c < C; ++c) xv[c] = LX::load(x + c * k + i);
    for (int r = 0; r < R; ++r) {
      const VF wv = LW::load(w + r * k + i);
      for (int c = 0; c < C; ++c) acc[r][c] = xsimd::fma(wv, xv[c], acc[r][c]);
    }
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      float s = xsimd::hadd(acc[r][c]);
      for (int64_t j = i; j < k; ++j) s += LW::one(w[r * k + j]) * LX::one(x[c * k + j]);
      y[c * ldy + r] = s;
    }
}

template <class LW, class LX, int RB, int CB, size_t... I>
constexpr std::array<FTileFn<LW, LX>, RB * CB> make_f_tiles(std::index_sequence<I...>) {
  return {&tile_f<LW, LX, static_cast<int>(I) / CB + 1, static_cast<int>(I) % CB + 1>...};
}

template <class LW, class LX>
void gemm_f(const typename LW::T* w, const typename LX::T* x, float* y, int64_t k, int64_t m,
            int64_t ldy, int64_t r0, int64_t r1) noexcept {
  if (m <= 0 || r1 <= r0) return;
  if (m == 1) {
    static constexpr auto gemv = make_f_tiles<LW, LX, kGemvRows, 1>(std::make_index_sequence<kGemvRows>{});
    for (int64_t r = r0; r < r1; r += kGemvRows) {
      const int64_t rr = std::min<int64_t>(kGemvRows, r1 - r);
      gemv[rr - 1](w + r * k, x, y + r, k, ldy);
    }
    return;
  }
  static constexpr auto tiles =
      make_f_tiles<LW, LX, kFRows, kFCols>(std::make_index_sequence<kFRows * kFCols>{});
  const int64_t col_bytes = k * static_cast<int64_t>(sizeof(typename LX::T));
  const int64_t nc =
      std::max<int64_t>(kFCols, (512 * 1024 / std::max<int64_t>(col_bytes, 1)) / kFCols * kFCols);
  for (int64_t c0 = 0; c0 < m; c0 += nc) {
    const int64_t c1 = std::min(m, c0 + nc);
    for (int64_t r = r0; r < r1; r += kFRows) {
      const int64_t rr = std::min<int64_t>(kFRows, r1 - r);
      for (int64_t c = c0; c < c1; c += kFCols) {
        const int64_t cc = std::min<int64_t>(kFCols, c1 - c);
        tiles[(rr - 1) * kFCols + (cc - 1)](w + r * k, x + c * k, y + c * ldy + r, k, ldy);
      }
    }
  }
}

float vec_dot_f32(const float* a, const float* b, int64_t n) noexcept {
  return vec_dot_f<LdF32, LdF32>(a, b, n);
}
float vec_dot_f16(const uint16_t* a, const uint16_t* b, int64_t n) noexcept {
  return vec_dot_f<LdF16, LdF16>(a, b, n);
}
float vec_dot_bf16_f32(const uint16_t* a, const float* b, int64_t n) noexcept {
  return vec_dot_f<LdBF16, LdF32>(a, b, n);
}
void gemm_f32_f32(const float* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy,
                  int64_t r0, int64_t r1) noexcept {
  gemm_f<LdF32, LdF32>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_f16_f16(const uint16_t* w, const uint16_t* x, float* y, int64_t k, int64_t m,
                  int64_t ldy, int64_t r0, int64_t r1) noexcept {
  gemm_f<LdF16, LdF16>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_bf16_f32(const uint16_t* w, const float* x, float* y, int64_t k, int64_t m,
                   int64_t ldy, int64_t r0, int64_t r1) noexcept {
  gemm_f<LdBF16, LdF32>(w, x, y, k, m, ldy, r0, r1);
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) noexcept {
  const VF va(a);
  int64_t i = 0;
  for (; i + kW <= n; i += kW)
    xsimd::fma(va, load_f16(x + i), VF::load_unaligned(y + i)).store_unaligned(y + i);
  for (; i < n; ++i) y[i] += a * h2f(x[i]);
}

inline const KernelTable& table() noexcept {
  static constexpr KernelTable t{
      TANDEM_ISA_NAME,     fp16_to_fp32_row,  fp32_to_fp16_row,  quantize_row_q8_0,
      dequantize_row_q4_0, dequantize_row_q8_0, vec_dot_q4_0_q8_0, vec_dot_q8_0_q8_0,
      vec_dot_f32,         vec_dot_f16,       vec_dot_bf16_f32,  gemm_q4_0_q8_0,
      gemm_q8_0_q8_0,      gemm_f32_f32,      gemm_f16_f16,      gemm_bf16_f32,
      axpy_f16};
  return t;
}

}  // namespace tandem::kernels::detail::TANDEM_ISA_NS
