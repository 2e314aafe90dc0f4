// Shared SIMD implementation, included by exactly one ISA-specific translation unit each:
// kernels_avx2.cpp (-mavx2 -mfma -mf16c), kernels_avx512.cpp (-mavx512f/bw/dq/cd/vl) and
// kernels_avx512vnni.cpp (the same + -mavx512vnni). Every TU computes with 256-bit vectors
// (xsimd batches of the fma3<avx2> arch for the float kernels, AVX2 intrinsics for the
// Q4_0/Q8_0 tiles), so all of them run one arithmetic and give the same bits; the AVX-512
// TUs get EVEX encodings, 32 vector registers (bigger tiles) and, with VNNI, vpdpbusd for
// the exact integer block dots.
//
// Everything lives in namespace detail::TANDEM_ISA_NS so no inline function or template
// instantiation is shared (ODR-merged) between TUs compiled with different -m flags.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include <xsimd/xsimd.hpp>

#include "kernels_table.hpp"
#include "softmax_exp.hpp"

#if !defined(TANDEM_ISA_NS) || !defined(TANDEM_ISA_AVX512)
#error "define TANDEM_ISA_NS and TANDEM_ISA_AVX512 before including kernels_simd.hpp"
#endif

namespace tandem::kernels::detail::TANDEM_ISA_NS {

// One arithmetic on every x86 ISA: a vector lane is one output and runs the same
// operations on the same operands in the same order, so AVX2 and AVX-512 give the same
// bits by construction. The float kernels and most quantised tiles use 256-bit vectors (8
// f32 lanes) in every TU; the AVX-512 TUs differ in encoding (EVEX, 32 vector registers:
// bigger tiles, which change which registers hold what, never an operation's operands),
// in the repacked Q4_0 tile's width (tile_q4x16: two 8-row groups in one 512-bit
// register, each lane still one row) and, with VNNI, in how the exact integer block dots
// are formed (vpdpbusd instead of maddubs + madd: the same i32 lane sums).
using Arch = xsimd::fma3<xsimd::avx2>;
#if TANDEM_ISA_AVX512
constexpr int kQCols = 4;              // Q4_0/Q8_0 prefill tile: 8 rows x 4 columns
constexpr int kFRows = 2, kFCols = 2;  // float tile: 16 accumulators of 32 registers
#else
constexpr int kQCols = 2;              // 8 rows x 2 columns
constexpr int kFRows = 2, kFCols = 1;  // 8 accumulators of 16 registers
#endif
using VF = xsimd::batch<float, Arch>;
constexpr int64_t kW = static_cast<int64_t>(VF::size);
constexpr int kFGemvRows = 2;  // float GEMV: rows per step (4 accumulators each)

// ---------------------------------------------------------------- small helpers ---------

inline float h2f(uint16_t h) noexcept {
  return _cvtsh_ss(h);
}

inline VF load_f16(const uint16_t* p) noexcept {
  return VF(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void store_f16(const VF& v, uint16_t* p) noexcept {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
}
inline VF load_bf16(const uint16_t* p) noexcept {
  const __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return VF(_mm256_castsi256_ps(_mm256_slli_epi32(u, 16)));
}

/// The written sum of 8 f32 lanes a0..a7: ((a0 + a4) + (a2 + a6)) + ((a1 + a5) + (a3 + a7)).
/// Every 8-lane reduction of the kernels uses it (kernels_scalar.cpp's sum8 is the same).
inline float hsum256(__m256 v) noexcept {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

/// softmax_exp (softmax_exp.hpp) on 8 lanes: the same steps, lane by lane.
inline __m256 softmax_exp8(__m256 x) noexcept {
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Hi), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(-kLn2Lo), r);
  __m256 p = _mm256_set1_ps(kExpC0);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC1));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC5));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(p, _mm256_mul_ps(r, r), r), _mm256_set1_ps(1.0f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  const __m256 v = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  // below kSoftmaxExpMin (and -inf): 0; above kExpMax: +inf; NaN: NaN (x itself)
  const __m256 small = _mm256_cmp_ps(x, _mm256_set1_ps(kSoftmaxExpMin), _CMP_LT_OQ);
  const __m256 big = _mm256_cmp_ps(x, _mm256_set1_ps(kExpMax), _CMP_GT_OQ);
  const __m256 nan = _mm256_cmp_ps(x, x, _CMP_UNORD_Q);
  const __m256 inf = _mm256_castsi256_ps(_mm256_set1_epi32(0x7F800000));
  return _mm256_blendv_ps(_mm256_blendv_ps(_mm256_andnot_ps(small, v), inf, big), x, nan);
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
    const float d = amax / 127.f;
    const float id = amax != 0.0f ? 127.f / amax : 0.0f;
    y[b].d = fp32_to_fp16_bits(d);  // bit-exact with _cvtss_sh(d, 0)
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
  }
}

// ---------------------------------------------------------------- dequantisation --------

inline void store_i8x16_scaled(__m128i q, float d, float* y) noexcept {
  const __m256 vd = _mm256_set1_ps(d);
  _mm256_storeu_ps(y, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q))));
  _mm256_storeu_ps(y + 8, _mm256_mul_ps(vd, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)))));
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
    store_i8x16_scaled(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x[b].qs + 16)), d, y + b * kQK + 16);
  }
}

// ---------------------------------------------------------------- quantised tiles -------
//
// The quantised dot arithmetic (docs/arithmetic.md), the GPU warp's: per (row, column) and
// block b, p_b = (f32(d_w) * f32(d_x)) * f32(S_b) with S_b the exact integer block dot;
// lane i < 32 adds p_i, p_{i+32}, p_{i+64}, ... in that order to 0.0f; then the 32 lane
// sums are added in the tree a[l] = a[l] + a[l + o], o = 16, 8, 4, 2, 1 (l < o), and the
// result is a[0]. Every product and sum is rounded (no FMA). Here the 8 f32 lanes of a
// vector are 8 output rows, so a tile keeps 32 such vectors per column (Lanes32) and no
// horizontal float sum is ever taken.

/// The exact i32 lane sums of 32 byte products, lane l taking bytes 4l .. 4l + 3: u (u8)
/// times s (i8). No i16 step saturates for the operands used here (Q4_0 / Q4_1 / Q4_K
/// nibbles <= 15, Q5_0 / Q5_1 / Q5_K values <= 31, Q6_K values <= 63,
/// Q8_0 |w| <= 128 against |x| <= 127), so vpdpbusd and maddubs + madd agree exactly.
inline __m256i dot_u8s8(__m256i u, __m256i s) noexcept {
#if TANDEM_ISA_VNNI
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

/// 32 lane sums of 8 outputs (vector lane r = output r), the arithmetic above. Lanes no
/// block reached hold +0 and are never touched: adding +0 changes no lane sum (a lane sum
/// is never -0: it starts at +0), so skipping those additions keeps the bits and saves the
/// work when a row has fewer than 32 blocks (k < 1024: most of a small model's matrices).
inline __m256 vadd(__m256 a, __m256 b) noexcept {
  return _mm256_add_ps(a, b);
}
inline __m256 vzero(__m256) noexcept {
  return _mm256_setzero_ps();
}
#if TANDEM_ISA_AVX512
inline __m512 vadd(__m512 a, __m512 b) noexcept {
  return _mm512_add_ps(a, b);
}
inline __m512 vzero(__m512) noexcept {
  return _mm512_setzero_ps();
}
#endif

template <int N>
struct F32Vec;  ///< the f32 vector of N lanes
template <>
struct F32Vec<8> {
  using type = __m256;
};
#if TANDEM_ISA_AVX512
template <>
struct F32Vec<16> {
  using type = __m512;
};
#endif

/// N = 8 (__m256) or, in the AVX-512 TUs, 16 (__m512) outputs: a vector lane is an output
/// and every lane runs the same additions, so the width changes no result.
template <int N>
struct Lanes32T {
  using V = typename F32Vec<N>::type;
  V a[32];
  /// Block b's terms p (one per output) into lane b % 32: a[b % 32] = a[b % 32] + p,
  /// from +0 on first use.
  void add_p(int64_t b, V p) noexcept {
    if (b < 32) {
      a[b] = vadd(vzero(p), p);
    } else {
      V& v = a[b % 32];
      v = vadd(v, p);
    }
  }
  /// The tree over the lanes that `nb` (>= 1) blocks reached.
  V tree(int64_t nb) noexcept {
    int64_t used = std::min<int64_t>(nb, 32);
    for (int o = 16; o > 0; o /= 2) {
      for (int l = 0; l < o && l + o < used; ++l) a[l] = vadd(a[l], a[l + o]);
      used = std::min<int64_t>(used, o);
    }
    return a[0];
  }
};

/// 32 lane sums of 8 outputs (vector lane r = output r), the arithmetic above. Lanes no
/// block reached hold +0 and are never touched: adding +0 changes no lane sum (a lane sum
/// is never -0: it starts at +0), so skipping those additions keeps the bits and saves the
/// work when a row has fewer than 32 blocks (k < 1024: most of a small model's matrices).
struct Lanes32 : Lanes32T<8> {
  /// Block b's products (8 outputs): a[b % 32] = a[b % 32] + (d * S), from +0 on first use.
  void add(int64_t b, __m256 d, __m256i s) noexcept { add_p(b, _mm256_mul_ps(d, _mm256_cvtepi32_ps(s))); }
};

/// Lane r of the result = the sum of v[r]'s 8 i32 lanes (exact).
inline __m256i transpose_sum8(const __m256i (&v)[8]) noexcept {
  const __m256i a = _mm256_hadd_epi32(_mm256_hadd_epi32(v[0], v[1]), _mm256_hadd_epi32(v[2], v[3]));
  const __m256i b = _mm256_hadd_epi32(_mm256_hadd_epi32(v[4], v[5]), _mm256_hadd_epi32(v[6], v[7]));
  return _mm256_add_epi32(_mm256_permute2x128_si256(a, b, 0x20), _mm256_permute2x128_si256(a, b, 0x31));
}

/// Stores lanes [lo, hi) of v to y[lo..hi).
inline void store_rows(__m256 v, float* y, int lo, int hi) noexcept {
  if (lo == 0 && hi == 8) {
    _mm256_storeu_ps(y, v);
    return;
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int r = lo; r < hi; ++r) y[r] = t[r];
}

template <class TW>
using TileFn = void (*)(const TW*, int64_t, int, const BlockQ8_0*, float*, int64_t, const char*) noexcept;

/// 16 packed bytes -> 32 bytes: low nibbles (weights 0-15) then high nibbles (16-31).
/// Broadcast load + one variable shift of the upper 128-bit lane + mask.
inline __m256i unpack_q4(const uint8_t* qs) noexcept {
  const __m256i t = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
  const __m256i v = _mm256_srlv_epi64(t, _mm256_setr_epi64x(0, 0, 4, 4));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x0F));
}

/// Q5_0's fifth bits: byte e = 0x10 where bit e of the block's qh (little-endian) is set.
/// Byte e takes qh's byte e / 8 (a shuffle within each 128-bit lane of the broadcast), then
/// its bit e % 8 is tested by setting every other bit and comparing with 0xFF.
inline __m256i q5_high_bits(const uint8_t* qh) noexcept {
  uint32_t h;
  std::memcpy(&h, qh, sizeof h);
  const __m256i rep = _mm256_shuffle_epi8(
      _mm256_set1_epi32(static_cast<int32_t>(h)),
      _mm256_setr_epi64x(0x0000000000000000, 0x0101010101010101, 0x0202020202020202, 0x0303030303030303));
  const __m256i all_but = _mm256_or_si256(rep, _mm256_set1_epi64x(0x7FBFDFEFF7FBFDFE));
  return _mm256_and_si256(_mm256_cmpeq_epi8(all_but, _mm256_set1_epi8(-1)), _mm256_set1_epi8(0x10));
}

/// Q8_0 activation blocks per weight block: 8 for the K-quants' 256-element super-blocks.
template <class TW>
inline constexpr int64_t kSubBlocks =
    std::is_same_v<TW, BlockQ4_K> || std::is_same_v<TW, BlockQ5_K> || std::is_same_v<TW, BlockQ6_K> ? kQK_K / kQK : 1;

// tile_q<TW, C>: y[c * ldy + r] = dot(W row r, X column c) for r < rows (<= 8), c < C, on
// the weights in the GGUF layout (rows nb blocks apart). Per block: each row's 8 exact i32
// lane dots, summed across lanes into one vector (lane = row, transpose_sum8), Q4_0 minus
// 8 * sum(x) (its weights are stored as q + 8), then Lanes32::add; Q4_1 adds its offset
// term (m_w * d_x) * sum(x) to the scaled dot, as Q5_1 does (cpu_kernels.hpp). K-quants
// (Q4_K, Q5_K, Q6_K): block b is sub-block b % 8 of weight block b / 8 (rows nb / 8 weight
// blocks apart); Q4_K and Q5_K multiply the exact dot and sum(x) by the sub-block's scale and min in i32, Q6_K
// multiplies each row's lane dots (lanes 0-3: elements 0-15, lanes 4-7: 16-31) by the two
// 16-element scales before the lane sum (all exact: docs/arithmetic.md). Rows past `rows`
// repeat the last row and are not stored. pf: if not null, the start of the weights the next call
// reads (the next 8 rows), prefetched at the pace this tile consumes its own.
template <class TW, int C>
void tile_q(const TW* w, int64_t nb, int rows, const BlockQ8_0* x, float* y, int64_t ldy, const char* pf) noexcept {
  constexpr bool kQ4 = std::is_same_v<TW, BlockQ4_0>;
  constexpr bool kQ41 = std::is_same_v<TW, BlockQ4_1>;
  constexpr bool kQ5 = std::is_same_v<TW, BlockQ5_0>;
  constexpr bool kQ51 = std::is_same_v<TW, BlockQ5_1>;
  constexpr bool kQ4K = std::is_same_v<TW, BlockQ4_K>;
  constexpr bool kQ5K = std::is_same_v<TW, BlockQ5_K>;
  constexpr bool kQ6K = std::is_same_v<TW, BlockQ6_K>;
  constexpr bool kMin = kQ41 || kQ51;                 // weight = d * q + m
  constexpr bool kKMin = kQ4K || kQ5K;                // 6-bit scales and mins
  constexpr bool kNib = kQ4 || kQ5 || kMin || kKMin;  // unsigned weights against signed x
  constexpr int64_t kSub = kSubBlocks<TW>;
  constexpr int64_t kPfBytes = 8 * static_cast<int64_t>(sizeof(TW)) / kSub;  // 8 rows' bytes per block
  const TW* wr[8];
  for (int r = 0; r < 8; ++r) wr[r] = w + std::min(r, rows - 1) * (nb / kSub);
  Lanes32 acc[C];
  for (int64_t b = 0; b < nb; ++b) {
    if (pf != nullptr) {
      const char* p = pf + b * kPfBytes;
      for (int64_t o = 0; o < kPfBytes; o += 64) _mm_prefetch(p + o, _MM_HINT_T0);
    }
    const int64_t bw = b / kSub;               // the weight block
    const int j = static_cast<int>(b % kSub);  // its sub-block (K-quants)
    const __m256 dw = _mm256_cvtph_ps(_mm_setr_epi16(
        static_cast<int16_t>(wr[0][bw].d), static_cast<int16_t>(wr[1][bw].d), static_cast<int16_t>(wr[2][bw].d),
        static_cast<int16_t>(wr[3][bw].d), static_cast<int16_t>(wr[4][bw].d), static_cast<int16_t>(wr[5][bw].d),
        static_cast<int16_t>(wr[6][bw].d), static_cast<int16_t>(wr[7][bw].d)));
    __m256 mw = _mm256_setzero_ps();
    if constexpr (kMin) {
      mw = _mm256_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(wr[0][b].m), static_cast<int16_t>(wr[1][b].m),
                                          static_cast<int16_t>(wr[2][b].m), static_cast<int16_t>(wr[3][b].m),
                                          static_cast<int16_t>(wr[4][b].m), static_cast<int16_t>(wr[5][b].m),
                                          static_cast<int16_t>(wr[6][b].m), static_cast<int16_t>(wr[7][b].m)));
    }
    __m256i sc = _mm256_setzero_si256(), mn = _mm256_setzero_si256();  // Q4_K / Q5_K: sc_j, m_j per row
    if constexpr (kKMin) {
      mw = _mm256_cvtph_ps(_mm_setr_epi16(static_cast<int16_t>(wr[0][bw].dmin), static_cast<int16_t>(wr[1][bw].dmin),
                                          static_cast<int16_t>(wr[2][bw].dmin), static_cast<int16_t>(wr[3][bw].dmin),
                                          static_cast<int16_t>(wr[4][bw].dmin), static_cast<int16_t>(wr[5][bw].dmin),
                                          static_cast<int16_t>(wr[6][bw].dmin), static_cast<int16_t>(wr[7][bw].dmin)));
      alignas(32) int32_t scs[8], mns[8];
      for (int r = 0; r < 8; ++r) k4_scale_min(wr[r][bw].scales, j, scs[r], mns[r]);
      sc = _mm256_load_si256(reinterpret_cast<const __m256i*>(scs));
      mn = _mm256_load_si256(reinterpret_cast<const __m256i*>(mns));
    }
    __m256i u[8];  // the u8 operands: Q4_0 nibbles (q + 8), Q4_1 / Q5_1 / Q4_K / Q5_K (q), Q5_0
                   // (q + 16), Q6_K (q + 32), Q8_0 |q|
    __m256i wq[8];
    __m256i ws[8];  // Q6_K: the row's two 16-element scales, i32 lanes 0-3 and 4-7
    for (int r = 0; r < 8; ++r) {
      if constexpr (kQ5 || kQ51) {
        u[r] = _mm256_or_si256(unpack_q4(wr[r][b].qs), q5_high_bits(wr[r][b].qh));
      } else if constexpr (kKMin) {
        const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r][bw].qs + 32 * (j / 2)));
        u[r] = _mm256_and_si256(_mm256_srl_epi16(q, _mm_cvtsi32_si128(4 * (j % 2))), _mm256_set1_epi8(0x0F));
        if constexpr (kQ5K) {  // bit j of qh[l] is bit 4 of element l
          const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r][bw].qh));
          u[r] = _mm256_or_si256(
              u[r], _mm256_slli_epi16(
                        _mm256_and_si256(_mm256_srl_epi16(h, _mm_cvtsi32_si128(j)), _mm256_set1_epi8(0x01)), 4));
        }
      } else if constexpr (kQ6K) {
        const BlockQ6_K& wb = wr[r][bw];
        const int h = j / 4, jq = j % 4;
        const __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.ql + 64 * h + 32 * (jq % 2)));
        const __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wb.qh + 32 * h));
        u[r] = _mm256_or_si256(
            _mm256_and_si256(_mm256_srl_epi16(lo, _mm_cvtsi32_si128(4 * (jq / 2))), _mm256_set1_epi8(0x0F)),
            _mm256_slli_epi16(_mm256_and_si256(_mm256_srl_epi16(hi, _mm_cvtsi32_si128(2 * jq)), _mm256_set1_epi8(0x03)),
                              4));
        ws[r] =
            _mm256_setr_epi32(wb.scales[2 * j], wb.scales[2 * j], wb.scales[2 * j], wb.scales[2 * j],
                              wb.scales[2 * j + 1], wb.scales[2 * j + 1], wb.scales[2 * j + 1], wb.scales[2 * j + 1]);
      } else if constexpr (kNib) {
        u[r] = unpack_q4(wr[r][b].qs);
      } else {
        wq[r] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(wr[r][b].qs));
        u[r] = _mm256_abs_epi8(wq[r]);
      }
    }
    for (int c = 0; c < C; ++c) {
      const BlockQ8_0& xb = x[c * nb + b];
      const __m256i xq = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb.qs));
      __m256i v[8];
      if constexpr (kQ6K) {
        // Per lane (4 elements): q * x = (q + 32) * x - 32 * x, then times the lane's scale.
        const __m256i x32 = dot_u8s8(_mm256_set1_epi8(32), xq);
        for (int r = 0; r < 8; ++r) v[r] = _mm256_mullo_epi32(_mm256_sub_epi32(dot_u8s8(u[r], xq), x32), ws[r]);
      } else {
        for (int r = 0; r < 8; ++r) v[r] = dot_u8s8(u[r], kNib ? xq : _mm256_sign_epi8(xq, wq[r]));
      }
      __m256i s = transpose_sum8(v);
      if constexpr (kNib) {
        // sum(x) times the offset (Q4_0: 8, Q5_0: 16; subtracted) or 1 (T_b of Q4_1, Q5_1,
        // Q4_K, Q5_K), in 8 lanes, then all.
        const __m256i xs = dot_u8s8(_mm256_set1_epi8(kQ4 ? 8 : kQ5 ? 16 : 1), xq);
        __m128i t = _mm_add_epi32(_mm256_castsi256_si128(xs), _mm256_extracti128_si256(xs, 1));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
        t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
        const __m256i tb = _mm256_broadcastd_epi32(t);
        if constexpr (kQ4 || kQ5) {
          s = _mm256_sub_epi32(s, tb);
        } else if constexpr (kMin) {
          const __m256 dx = _mm256_set1_ps(h2f(xb.d));
          const __m256 ps = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s));
          const __m256 pm = _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(tb));
          acc[c].add_p(b, _mm256_add_ps(ps, pm));
          continue;
        } else {  // Q4_K / Q5_K: ((d * d_x) * f32(sc_j * S_b)) - ((dmin * d_x) * f32(m_j * T_b))
          const __m256 dx = _mm256_set1_ps(h2f(xb.d));
          const __m256 ps = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(_mm256_mullo_epi32(sc, s)));
          const __m256 pm = _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_cvtepi32_ps(_mm256_mullo_epi32(mn, tb)));
          acc[c].add_p(b, _mm256_sub_ps(ps, pm));
          continue;
        }
      }
      acc[c].add(b, _mm256_mul_ps(dw, _mm256_set1_ps(h2f(xb.d))), s);
    }
  }
  for (int c = 0; c < C; ++c) store_rows(acc[c].tree(nb), y + c * ldy, 0, rows);
}

template <class TW, int CB, size_t... I>
constexpr std::array<TileFn<TW>, CB> make_q_tiles(std::index_sequence<I...>) {
  return {&tile_q<TW, static_cast<int>(I) + 1>...};
}

template <class TW>
void gemm_q(const TW* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
            int64_t r1) noexcept {
  const int64_t nb = k / kQK;
  const int64_t nbw = nb / kSubBlocks<TW>;  // weight blocks per row
  if (m <= 0 || r1 <= r0 || nb <= 0) return;
  if (m == 1) {  // decode GEMV: stream each weight row once, 8 rows in flight
    for (int64_t r = r0; r < r1; r += 8) {
      const int rows = static_cast<int>(std::min<int64_t>(8, r1 - r));
      const char* pf = r + 8 < r1 ? reinterpret_cast<const char*>(w + (r + 8) * nbw) : nullptr;
      tile_q<TW, 1>(w + r * nbw, nb, rows, x, y + r, ldy, pf);
    }
    return;
  }
  static constexpr auto tiles = make_q_tiles<TW, kQCols>(std::make_index_sequence<kQCols>{});
  // Column chunk: keep the chunk's activations (~512 KiB) in L2 while all row tiles pass.
  const int64_t col_bytes = nb * static_cast<int64_t>(sizeof(BlockQ8_0));
  int64_t nc = std::max<int64_t>(kQCols, (512 * 1024 / std::max<int64_t>(col_bytes, 1)) / kQCols * kQCols);
  for (int64_t c0 = 0; c0 < m; c0 += nc) {
    const int64_t c1 = std::min(m, c0 + nc);
    for (int64_t r = r0; r < r1; r += 8) {
      const int rows = static_cast<int>(std::min<int64_t>(8, r1 - r));
      for (int64_t c = c0; c < c1; c += kQCols) {
        const int64_t cc = std::min<int64_t>(kQCols, c1 - c);
        tiles[static_cast<size_t>(cc - 1)](w + r * nbw, nb, rows, x + c * nb, y + c * ldy + r, ldy, nullptr);
      }
    }
  }
}

float vec_dot_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ4_0>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}
float vec_dot_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ8_0>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}
float vec_dot_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ4_1>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}
float vec_dot_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ5_0>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}
float vec_dot_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ5_1>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}
float vec_dot_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ5_K>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}
float vec_dot_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ4_K>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}
float vec_dot_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, int64_t k) noexcept {
  float out = 0.0f;
  gemm_q<BlockQ6_K>(w, x, &out, k, 1, 1, 0, 1);
  return out;
}

// ---------------------------------------------------------------- repacked Q4_0 (x8) ----
//
// gemm_q4_0x8_q8_0 (cpu_kernels.hpp): one 256-bit register holds 4 weights of each of 8
// rows (32-bit lane r = row r), so the activation's 4 matching bytes, broadcast to every
// lane, serve all 8 rows in one maddubs. Per (group of 8 rows, block, column): 8 maddubs
// (chunk j: low nibbles x bytes 4j..4j+3, high nibbles x bytes 16+4j..16+4j+3) summed in
// i16 (|sum| <= 8 * 2 * 15 * 128 = 30720: exact), one madd with ones (VNNI: vpdpbusd into
// i32 directly) -> the 8 rows' block dots of q (0..15) in i32, minus 8 * sum(x) -> exact
// S_b, then Lanes32::add: the quantised dot arithmetic, lane = row, no horizontal sums.

constexpr int kX8Cols = 4;        // columns per prefill tile (4 f32 + 4 i16 accumulators)
constexpr int kX8GemvGroups = 2;  // row groups per GEMV tile (16 rows share the broadcasts)

inline std::vector<XAux>& aux_buffer() noexcept {
  static thread_local std::vector<XAux> buf;
  return buf;
}
inline constexpr int64_t kPreparedAux = int64_t{1} << 15;  // 256 KiB: thread_prepare sizes it
inline XAux* aux_scratch(int64_t n) noexcept {             // grows only past the prepared size
  std::vector<XAux>& buf = aux_buffer();
  if (static_cast<int64_t>(buf.size()) < n) buf.resize(static_cast<size_t>(n));
  return buf.data();
}

inline void x8_aux(const BlockQ8_0* x, int64_t n, XAux* aux) noexcept {
  const __m256i eight = _mm256_set1_epi8(8), ones16 = _mm256_set1_epi16(1);
  for (int64_t i = 0; i < n; ++i) {
    const __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x[i].qs));
    const __m256i s = _mm256_madd_epi16(_mm256_maddubs_epi16(eight, q), ones16);  // exact
    __m128i t = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
    t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
    __m128i tl = _mm256_castsi256_si128(s);  // bytes 0-15
    tl = _mm_add_epi32(tl, _mm_shuffle_epi32(tl, 0x4E));
    tl = _mm_add_epi32(tl, _mm_shuffle_epi32(tl, 0xB1));
    aux[i].dx = h2f(x[i].d);
    aux[i].corr = _mm_cvtsi128_si32(t);
    aux[i].corr_lo = _mm_cvtsi128_si32(tl);
  }
}

inline __m256i bcast4(const int8_t* p) noexcept {
  int32_t v;
  std::memcpy(&v, p, 4);
  return _mm256_set1_epi32(v);
}

/// Bit `from` of every byte of h moved to bit 4 (0x10), the byte's other bits 0. A 16-bit
/// shift by at most 4 moves bits within their byte into bit 4, and the mask drops the rest.
inline __m256i bit_to_0x10(__m256i h, int from) noexcept {
  const __m256i v =
      from <= 4 ? _mm256_sll_epi16(h, _mm_cvtsi32_si128(4 - from)) : _mm256_srl_epi16(h, _mm_cvtsi32_si128(from - 4));
  return _mm256_and_si256(v, _mm256_set1_epi8(0x10));
}

/// BlockQ5_0x8's fifth bits of chunk j (qh: the record's 32 bytes, byte 4r + i; bits 2j and
/// 2j + 1) as 0x10 in the byte of each weight: lo for the low-nibble weights, hi for the high ones.
inline void q5x8_fifth_bits(const uint8_t* qh, int j, __m256i& lo, __m256i& hi) noexcept {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh));
  lo = _mm256_or_si256(lo, bit_to_0x10(h, 2 * j));
  hi = _mm256_or_si256(hi, bit_to_0x10(h, 2 * j + 1));
}

/// BlockQ6_Kx8's top two bits of chunk j (qh: the record's qh + 32 * (j / 2)) as 16 and 32
/// in the byte of each weight: lo for the low-nibble weights, hi for the high ones.
inline void q6x8_top_bits(const uint8_t* qh, int j, __m256i& lo, __m256i& hi) noexcept {
  const __m256i h =
      _mm256_srl_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(qh)), _mm_cvtsi32_si128(4 * (j % 2)));
  lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x03)), 4));
  hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(h, _mm256_set1_epi8(0x0C)), 2));
}

// y[c * ldy + 8g + r] for g < G, c < C, r < 8, except rows below row_lo of the first group
// and from row_hi on of the last (outside the caller's row range).
// w: G groups (stride nb records); x / aux: C columns (stride nb).
template <class TB, int G, int C>
void tile_q4x8(const TB* w, int64_t nb, const BlockQ8_0* x, const XAux* aux, float* y, int64_t ldy, int row_lo,
               int row_hi, const char* pf) noexcept {
  constexpr bool kQ41 = std::is_same_v<TB, BlockQ4_1x8>;
  constexpr bool kQ4K = std::is_same_v<TB, BlockQ4_Kx8>;
  constexpr bool kQ5 = std::is_same_v<TB, BlockQ5_0x8>;
  constexpr bool kQ6K = std::is_same_v<TB, BlockQ6_Kx8>;  // S_lo in s16, S_hi in s16h
  [[maybe_unused]] constexpr bool kWide = kQ5 || kQ6K;    // values > 15: i16 sums widened per chunk
  constexpr int32_t kCorr = kQ5 ? 2 : 1;                  // Q4_0: minus 8 * sum(x) = corr; Q5_0: 16 * sum(x)
  Lanes32 acc[G][C];
  const __m256i m4 = _mm256_set1_epi8(0x0F);
#if !TANDEM_ISA_VNNI
  const __m256i ones16 = _mm256_set1_epi16(1);
#endif
  for (int64_t b = 0; b < nb; ++b) {
    if (pf != nullptr) {
      const char* p = pf + b * static_cast<int64_t>(sizeof(TB));
      for (int g = 0; g < G; ++g) {
        const char* pg = p + g * nb * static_cast<int64_t>(sizeof(TB));
        for (int64_t o = 0; o < static_cast<int64_t>(sizeof(TB)); o += 64) _mm_prefetch(pg + o, _MM_HINT_T0);
      }
    }
    __m256i s16[G][C], s16h[G][C];
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < C; ++c) s16[g][c] = s16h[g][c] = _mm256_setzero_si256();
    for (int j = 0; j < 4; ++j) {
      __m256i lo[G], hi[G];
      for (int g = 0; g < G; ++g) {
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[g * nb + b].qs + 32 * j));
        lo[g] = _mm256_and_si256(raw, m4);
        hi[g] = _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4);
        if constexpr (kQ5) q5x8_fifth_bits(w[g * nb + b].qh, j, lo[g], hi[g]);
        if constexpr (kQ6K) q6x8_top_bits(w[g * nb + b].qh + 32 * (j / 2), j, lo[g], hi[g]);
      }
      for (int c = 0; c < C; ++c) {
        const int8_t* q = x[c * nb + b].qs;
        const __m256i bl = bcast4(q + 4 * j), bh = bcast4(q + 16 + 4 * j);
        for (int g = 0; g < G; ++g) {
#if TANDEM_ISA_VNNI  // s16 holds i32 lane sums here
          if constexpr (kQ6K) {
            s16[g][c] = _mm256_dpbusd_epi32(s16[g][c], lo[g], bl);
            s16h[g][c] = _mm256_dpbusd_epi32(s16h[g][c], hi[g], bh);
          } else {
            s16[g][c] = _mm256_dpbusd_epi32(_mm256_dpbusd_epi32(s16[g][c], lo[g], bl), hi[g], bh);
          }
#else  // i16 sums; Q5_0's and Q6_K's (values up to 31, 63) are widened per chunk: 4 chunks could overflow
          if constexpr (kQ6K) {
            s16[g][c] = _mm256_add_epi32(s16[g][c], _mm256_madd_epi16(_mm256_maddubs_epi16(lo[g], bl), ones16));
            s16h[g][c] = _mm256_add_epi32(s16h[g][c], _mm256_madd_epi16(_mm256_maddubs_epi16(hi[g], bh), ones16));
          } else {
            const __m256i p = _mm256_add_epi16(_mm256_maddubs_epi16(lo[g], bl), _mm256_maddubs_epi16(hi[g], bh));
            s16[g][c] =
                kQ5 ? _mm256_add_epi32(s16[g][c], _mm256_madd_epi16(p, ones16)) : _mm256_add_epi16(s16[g][c], p);
          }
#endif
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m256 dw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[g * nb + b].d)));
      for (int c = 0; c < C; ++c) {
        const XAux& a = aux[c * nb + b];
#if TANDEM_ISA_VNNI
        const __m256i sq = s16[g][c];
#else
        const __m256i sq = kWide ? s16[g][c] : _mm256_madd_epi16(s16[g][c], ones16);
#endif
        const __m256 dx = _mm256_set1_ps(a.dx);
        if constexpr (kQ41) {  // S_b over the nibbles, T_b = corr / 8 (exact)
          const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[g * nb + b].m)));
          const __m256 ps = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(sq));
          const __m256 pm = _mm256_mul_ps(_mm256_mul_ps(mw, dx), _mm256_set1_ps(static_cast<float>(a.corr / 8)));
          acc[g][c].add_p(b, _mm256_add_ps(ps, pm));
        } else if constexpr (kQ4K) {  // ((d * d_x) * f32(sc * S_b)) - ((dmin * d_x) * f32(m * T_b))
          const TB& wb = w[g * nb + b];
          const __m256i sc = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb.sc)));
          const __m256i mn = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb.m)));
          const __m256 mw = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(wb.dmin)));
          const __m256 ps = _mm256_mul_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(_mm256_mullo_epi32(sc, sq)));
          const __m256 pm = _mm256_mul_ps(_mm256_mul_ps(mw, dx),
                                          _mm256_cvtepi32_ps(_mm256_mullo_epi32(mn, _mm256_set1_epi32(a.corr / 8))));
          acc[g][c].add_p(b, _mm256_sub_ps(ps, pm));
        } else if constexpr (kQ6K) {  // s0 * S_lo + s1 * S_hi, S = the dot of u minus 32 * sum(x)
          const TB& wb = w[g * nb + b];
          const __m256i s0 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb.s)));
          const __m256i s1 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(wb.s + 8)));
          const __m256i slo = _mm256_sub_epi32(sq, _mm256_set1_epi32(4 * a.corr_lo));
          const __m256i shi = _mm256_sub_epi32(s16h[g][c], _mm256_set1_epi32(4 * (a.corr - a.corr_lo)));
          acc[g][c].add(b, _mm256_mul_ps(dw, dx),
                        _mm256_add_epi32(_mm256_mullo_epi32(s0, slo), _mm256_mullo_epi32(s1, shi)));
        } else {
          acc[g][c].add(b, _mm256_mul_ps(dw, dx), _mm256_sub_epi32(sq, _mm256_set1_epi32(kCorr * a.corr)));
        }
      }
    }
  }
  for (int c = 0; c < C; ++c)
    for (int g = 0; g < G; ++g)
      store_rows(acc[g][c].tree(nb), y + c * ldy + 8 * g, g == 0 ? row_lo : 0, g == G - 1 ? row_hi : 8);
}

#if TANDEM_ISA_AVX512
// tile_q4x16<C>: tile_q4x8<2, C> with the two row groups in one 512-bit register (lanes
// 0-7 group g, 8-15 group g + 1): every lane runs tile_q4x8's operations on the same
// operands (exact integer dots, then the same rounded products and additions), so the
// results are its bits, with half the instructions per row.
template <class TB, int C>
void tile_q4x16(const TB* w, int64_t nb, const BlockQ8_0* x, const XAux* aux, float* y, int64_t ldy, int row_lo,
                int row_hi, const char* pf) noexcept {
  constexpr bool kQ41 = std::is_same_v<TB, BlockQ4_1x8>;
  constexpr bool kQ4K = std::is_same_v<TB, BlockQ4_Kx8>;
  constexpr bool kQ5 = std::is_same_v<TB, BlockQ5_0x8>;
  constexpr bool kQ6K = std::is_same_v<TB, BlockQ6_Kx8>;
  [[maybe_unused]] constexpr bool kWide = kQ5 || kQ6K;
  constexpr int32_t kCorr = kQ5 ? 2 : 1;
  Lanes32T<16> acc[C];
  const __m512i m4 = _mm512_set1_epi8(0x0F);
#if !TANDEM_ISA_VNNI
  const __m512i ones16 = _mm512_set1_epi16(1);
#endif
  const TB* w1 = w + nb;
  for (int64_t b = 0; b < nb; ++b) {
    if (pf != nullptr) {
      const char* p = pf + b * static_cast<int64_t>(sizeof(TB));
      for (int g = 0; g < 2; ++g) {
        const char* pg = p + g * nb * static_cast<int64_t>(sizeof(TB));
        for (int64_t o = 0; o < static_cast<int64_t>(sizeof(TB)); o += 64) _mm_prefetch(pg + o, _MM_HINT_T0);
      }
    }
    __m512i s16[C], s16h[C];
    for (int c = 0; c < C; ++c) s16[c] = s16h[c] = _mm512_setzero_si512();
    for (int j = 0; j < 4; ++j) {
      const __m512i raw = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qs + 32 * j))),
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1[b].qs + 32 * j)), 1);
      __m512i lo = _mm512_and_si512(raw, m4);
      __m512i hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), m4);
      if constexpr (kQ5) {  // q5x8_fifth_bits on both groups
        const __m512i h =
            _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qh))),
                               _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1[b].qh)), 1);
        const auto bit = [&](int from) {  // bit_to_0x10
          const __m512i v = from <= 4 ? _mm512_sll_epi16(h, _mm_cvtsi32_si128(4 - from))
                                      : _mm512_srl_epi16(h, _mm_cvtsi32_si128(from - 4));
          return _mm512_and_si512(v, _mm512_set1_epi8(0x10));
        };
        lo = _mm512_or_si512(lo, bit(2 * j));
        hi = _mm512_or_si512(hi, bit(2 * j + 1));
      }
      if constexpr (kQ6K) {  // q6x8_top_bits on both groups
        const __m512i h = _mm512_srl_epi16(
            _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w[b].qh + 32 * (j / 2)))),
                _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w1[b].qh + 32 * (j / 2))), 1),
            _mm_cvtsi32_si128(4 * (j % 2)));
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(0x03)), 4));
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(_mm512_and_si512(h, _mm512_set1_epi8(0x0C)), 2));
      }
      for (int c = 0; c < C; ++c) {
        const int8_t* q = x[c * nb + b].qs;
        int32_t vl, vh;
        std::memcpy(&vl, q + 4 * j, 4);
        std::memcpy(&vh, q + 16 + 4 * j, 4);
        const __m512i bl = _mm512_set1_epi32(vl), bh = _mm512_set1_epi32(vh);
#if TANDEM_ISA_VNNI  // s16 holds i32 lane sums here
        if constexpr (kQ6K) {
          s16[c] = _mm512_dpbusd_epi32(s16[c], lo, bl);
          s16h[c] = _mm512_dpbusd_epi32(s16h[c], hi, bh);
        } else {
          s16[c] = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(s16[c], lo, bl), hi, bh);
        }
#else
        if constexpr (kQ6K) {
          s16[c] = _mm512_add_epi32(s16[c], _mm512_madd_epi16(_mm512_maddubs_epi16(lo, bl), ones16));
          s16h[c] = _mm512_add_epi32(s16h[c], _mm512_madd_epi16(_mm512_maddubs_epi16(hi, bh), ones16));
        } else {
          const __m512i p = _mm512_add_epi16(_mm512_maddubs_epi16(lo, bl), _mm512_maddubs_epi16(hi, bh));
          s16[c] = kQ5 ? _mm512_add_epi32(s16[c], _mm512_madd_epi16(p, ones16)) : _mm512_add_epi16(s16[c], p);
        }
#endif
      }
    }
    const auto halves = [&](const uint16_t* lo16, const uint16_t* hi16) {
      return _mm512_cvtph_ps(
          _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(lo16))),
                                  _mm_loadu_si128(reinterpret_cast<const __m128i*>(hi16)), 1));
    };
    const __m512 dw = halves(w[b].d, w1[b].d);
    __m512 mw = _mm512_setzero_ps();
    // Q4_K: the 16 rows' sub-block scales and mins; Q6_K: their scales of elements 0-15, 16-31
    __m512i sc = _mm512_setzero_si512(), mn = sc;
    [[maybe_unused]] const auto bytes16 = [](const void* lo8, const void* hi8) {  // 8 bytes of each group
      return _mm_unpacklo_epi64(_mm_loadl_epi64(static_cast<const __m128i*>(lo8)),
                                _mm_loadl_epi64(static_cast<const __m128i*>(hi8)));
    };
    if constexpr (kQ4K) {
      mw = halves(w[b].dmin, w1[b].dmin);
      sc = _mm512_cvtepu8_epi32(bytes16(w[b].sc, w1[b].sc));
      mn = _mm512_cvtepu8_epi32(bytes16(w[b].m, w1[b].m));
    }
    if constexpr (kQ6K) {
      sc = _mm512_cvtepi8_epi32(bytes16(w[b].s, w1[b].s));
      mn = _mm512_cvtepi8_epi32(bytes16(w[b].s + 8, w1[b].s + 8));
    }
    for (int c = 0; c < C; ++c) {
      const XAux& a = aux[c * nb + b];
#if TANDEM_ISA_VNNI
      const __m512i sq = s16[c];
#else
      const __m512i sq = kWide ? s16[c] : _mm512_madd_epi16(s16[c], ones16);
#endif
      const __m512 dx = _mm512_set1_ps(a.dx);
      if constexpr (kQ41) {
        const __m512 ps = _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(sq));
        const __m512 pm =
            _mm512_mul_ps(_mm512_mul_ps(halves(w[b].m, w1[b].m), dx), _mm512_set1_ps(static_cast<float>(a.corr / 8)));
        acc[c].add_p(b, _mm512_add_ps(ps, pm));
      } else if constexpr (kQ4K) {
        const __m512 ps = _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(_mm512_mullo_epi32(sc, sq)));
        const __m512 pm = _mm512_mul_ps(_mm512_mul_ps(mw, dx),
                                        _mm512_cvtepi32_ps(_mm512_mullo_epi32(mn, _mm512_set1_epi32(a.corr / 8))));
        acc[c].add_p(b, _mm512_sub_ps(ps, pm));
      } else if constexpr (kQ6K) {  // tile_q4x8's s0 * S_lo + s1 * S_hi
        const __m512i slo = _mm512_sub_epi32(sq, _mm512_set1_epi32(4 * a.corr_lo));
        const __m512i shi = _mm512_sub_epi32(s16h[c], _mm512_set1_epi32(4 * (a.corr - a.corr_lo)));
        const __m512i s = _mm512_add_epi32(_mm512_mullo_epi32(sc, slo), _mm512_mullo_epi32(mn, shi));
        acc[c].add_p(b, _mm512_mul_ps(_mm512_mul_ps(dw, dx), _mm512_cvtepi32_ps(s)));
      } else {
        acc[c].add_p(b, _mm512_mul_ps(_mm512_mul_ps(dw, dx),
                                      _mm512_cvtepi32_ps(_mm512_sub_epi32(sq, _mm512_set1_epi32(kCorr * a.corr)))));
      }
    }
  }
  for (int c = 0; c < C; ++c) {
    const __m512 v = acc[c].tree(nb);
    store_rows(_mm512_castps512_ps256(v), y + c * ldy, row_lo, 8);
    store_rows(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1)), y + c * ldy + 8, 0, row_hi);
  }
}

template <class TB>
using TileX16Fn = void (*)(const TB*, int64_t, const BlockQ8_0*, const XAux*, float*, int64_t, int, int,
                           const char*) noexcept;
template <class TB, size_t... I>
constexpr std::array<TileX16Fn<TB>, sizeof...(I)> make_x16_tiles(std::index_sequence<I...>) {
  return {&tile_q4x16<TB, static_cast<int>(I) + 1>...};
}
#endif

template <class TB>
using TileX8Fn = void (*)(const TB*, int64_t, const BlockQ8_0*, const XAux*, float*, int64_t, int, int,
                          const char*) noexcept;
template <class TB, int GB, int CB, size_t... I>
constexpr std::array<TileX8Fn<TB>, GB * CB> make_x8_tiles(std::index_sequence<I...>) {
  return {&tile_q4x8<TB, static_cast<int>(I) / CB + 1, static_cast<int>(I) % CB + 1>...};
}

/// gemm_q4_0x8_q8_0, gemm_q4_1x8_q8_0, gemm_q5_0x8_q8_0, gemm_q4_kx8_q8_0, gemm_q6_kx8_q8_0
/// (TB: BlockQ4_0x8, BlockQ4_1x8, BlockQ5_0x8, BlockQ4_Kx8, BlockQ6_Kx8).
template <class TB>
void gemm_x8(const TB* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
             int64_t r1) noexcept {
  const int64_t nb = k / kQK;
  if (m <= 0 || r1 <= r0 || nb <= 0) return;
  const int64_t g0 = r0 / 8, g1 = (r1 + 7) / 8;
  // Rows [lo, hi) of group g that belong to [r0, r1).
  auto lo_of = [&](int64_t g) { return static_cast<int>(std::max<int64_t>(r0 - 8 * g, 0)); };
  auto hi_of = [&](int64_t g) { return static_cast<int>(std::min<int64_t>(r1 - 8 * g, 8)); };
  if (m == 1) {  // decode GEMV: kX8GemvGroups groups per step, prefetching the next ones
    static constexpr auto gemv = make_x8_tiles<TB, kX8GemvGroups, 1>(std::make_index_sequence<kX8GemvGroups>{});
    XAux* aux = aux_scratch(nb);
    x8_aux(x, nb, aux);
    for (int64_t g = g0; g < g1; g += kX8GemvGroups) {
      const int64_t gg = std::min<int64_t>(kX8GemvGroups, g1 - g);
      const int64_t gn = g + kX8GemvGroups;
      const char* pf = gn < g1 ? reinterpret_cast<const char*>(w + gn * nb) : nullptr;
#if TANDEM_ISA_AVX512
      if (gg == 2) {
        tile_q4x16<TB, 1>(w + g * nb, nb, x, aux, y + 8 * g, ldy, lo_of(g), hi_of(g + 1), pf);
        continue;
      }
#endif
      gemv[static_cast<size_t>(gg - 1)](w + g * nb, nb, x, aux, y + 8 * g, ldy, lo_of(g), hi_of(g + gg - 1), pf);
    }
    return;
  }
  static constexpr auto tiles = make_x8_tiles<TB, 1, kX8Cols>(std::make_index_sequence<kX8Cols>{});
#if TANDEM_ISA_AVX512
  static constexpr auto tiles16 = make_x16_tiles<TB>(std::make_index_sequence<kX8Cols>{});
#endif
  // Column chunk: its activations (~512 KiB) stay in L2 while every row group passes;
  // its aux records fit the prepared buffer.
  const int64_t col_bytes = nb * static_cast<int64_t>(sizeof(BlockQ8_0));
  int64_t nc = std::max<int64_t>(kX8Cols, (512 * 1024 / std::max<int64_t>(col_bytes, 1)) / kX8Cols * kX8Cols);
  nc = std::min(nc, std::max<int64_t>(kX8Cols, kPreparedAux / nb / kX8Cols * kX8Cols));
  XAux* aux = aux_scratch(std::min(m, nc) * nb);
  for (int64_t c0 = 0; c0 < m; c0 += nc) {
    const int64_t c1 = std::min(m, c0 + nc);
    x8_aux(x + c0 * nb, (c1 - c0) * nb, aux);
    for (int64_t g = g0; g < g1;) {
#if TANDEM_ISA_AVX512
      if (g + 1 < g1) {  // two groups, 16 rows per register
        for (int64_t c = c0; c < c1; c += kX8Cols) {
          const int64_t cc = std::min<int64_t>(kX8Cols, c1 - c);
          tiles16[static_cast<size_t>(cc - 1)](w + g * nb, nb, x + c * nb, aux + (c - c0) * nb, y + c * ldy + 8 * g,
                                               ldy, lo_of(g), hi_of(g + 1), nullptr);
        }
        g += 2;
        continue;
      }
#endif
      for (int64_t c = c0; c < c1; c += kX8Cols) {
        const int64_t cc = std::min<int64_t>(kX8Cols, c1 - c);
        tiles[static_cast<size_t>(cc - 1)](w + g * nb, nb, x + c * nb, aux + (c - c0) * nb, y + c * ldy + 8 * g, ldy,
                                           lo_of(g), hi_of(g), nullptr);
      }
      ++g;
    }
  }
}

void gemm_q4_0x8_q8_0(const BlockQ4_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  gemm_x8(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q4_1x8_q8_0(const BlockQ4_1x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  gemm_x8(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_0x8_q8_0(const BlockQ5_0x8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  gemm_x8(w, x, y, k, m, ldy, r0, r1);
}

void gemm_q4_kx8_q8_0(const BlockQ4_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  gemm_x8(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q6_kx8_q8_0(const BlockQ6_Kx8* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                      int64_t r1) noexcept {
  gemm_x8(w, x, y, k, m, ldy, r0, r1);
}

void gemm_q4_0_q8_0(const BlockQ4_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ4_0>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q8_0_q8_0(const BlockQ8_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ8_0>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q4_1_q8_0(const BlockQ4_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ4_1>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_0_q8_0(const BlockQ5_0* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ5_0>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q4_k_q8_0(const BlockQ4_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ4_K>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_1_q8_0(const BlockQ5_1* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ5_1>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q5_k_q8_0(const BlockQ5_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ5_K>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_q6_k_q8_0(const BlockQ6_K* w, const BlockQ8_0* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                    int64_t r1) noexcept {
  gemm_q<BlockQ6_K>(w, x, y, k, m, ldy, r0, r1);
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
  float sum = hsum256((s0 + s1) + (s2 + s3));
  for (; i < n; ++i) sum = std::fma(LA::one(a[i]), LB::one(b[i]), sum);
  return sum;
}

template <class LW, class LX>
using FTileFn = void (*)(const typename LW::T*, const typename LX::T*, float*, int64_t, int64_t) noexcept;

// tile_f<LW, LX, R, C>: y[c * ldy + r] = dot(W row r, X row c), the float matmul
// arithmetic of the GPU's warp (docs/arithmetic.md): lane i < 32 sums the products
// w[e] * x[e] of the elements e = i, i + 32, ... in order from 0.0f (each product and sum
// rounded, no FMA), then the 32 lane sums in the tree of o = 16, 8, 4, 2, 1. Here lane i
// is vector i / 8, element i % 8 (4 vectors per output); the last partial chunk of 32 is
// read zero-padded (+0 terms change no sum); the tree is (v0 + v2) + (v1 + v3), then
// hsum256 (its o = 4, 2, 1 levels).
template <class LW, class LX, int R, int C>
void tile_f(const typename LW::T* w, const typename LX::T* x, float* y, int64_t k, int64_t ldy) noexcept {
  using TW = typename LW::T;
  using TX = typename LX::T;
  VF acc[R][C][4];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c)
      for (int v = 0; v < 4; ++v) acc[r][c][v] = VF(0.0f);
  auto chunk = [&](const TW* const* wp, const TX* const* xp) {
    for (int v = 0; v < 4; ++v) {
      VF xv[C];
      for (int c = 0; c < C; ++c) xv[c] = LX::load(xp[c] + v * kW);
      for (int r = 0; r < R; ++r) {
        const VF wv = LW::load(wp[r] + v * kW);
        for (int c = 0; c < C; ++c) acc[r][c][v] = acc[r][c][v] + wv * xv[c];
      }
    }
  };
  const TW* wp[R];
  const TX* xp[C];
  int64_t i = 0;
  for (; i + 32 <= k; i += 32) {
    for (int r = 0; r < R; ++r) wp[r] = w + r * k + i;
    for (int c = 0; c < C; ++c) xp[c] = x + c * k + i;
    chunk(wp, xp);
  }
  if (i < k) {  // the last partial chunk, zero-padded
    TW wt[R][32] = {};
    TX xt[C][32] = {};
    for (int r = 0; r < R; ++r) {
      std::memcpy(wt[r], w + r * k + i, size_t(k - i) * sizeof(TW));
      wp[r] = wt[r];
    }
    for (int c = 0; c < C; ++c) {
      std::memcpy(xt[c], x + c * k + i, size_t(k - i) * sizeof(TX));
      xp[c] = xt[c];
    }
    chunk(wp, xp);
  }
  for (int c = 0; c < C; ++c)
    for (int r = 0; r < R; ++r) {
      const VF* a = acc[r][c];
      y[c * ldy + r] = hsum256((a[0] + a[2]) + (a[1] + a[3]));
    }
}

template <class LW, class LX, int RB, int CB, size_t... I>
constexpr std::array<FTileFn<LW, LX>, RB * CB> make_f_tiles(std::index_sequence<I...>) {
  return {&tile_f<LW, LX, static_cast<int>(I) / CB + 1, static_cast<int>(I) % CB + 1>...};
}

template <class LW, class LX>
void gemm_f(const typename LW::T* w, const typename LX::T* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
            int64_t r1) noexcept {
  if (m <= 0 || r1 <= r0) return;
  if (m == 1) {
    static constexpr auto gemv = make_f_tiles<LW, LX, kFGemvRows, 1>(std::make_index_sequence<kFGemvRows>{});
    for (int64_t r = r0; r < r1; r += kFGemvRows) {
      const int64_t rr = std::min<int64_t>(kFGemvRows, r1 - r);
      gemv[rr - 1](w + r * k, x, y + r, k, ldy);
    }
    return;
  }
  static constexpr auto tiles = make_f_tiles<LW, LX, kFRows, kFCols>(std::make_index_sequence<kFRows * kFCols>{});
  const int64_t col_bytes = k * static_cast<int64_t>(sizeof(typename LX::T));
  const int64_t nc = std::max<int64_t>(kFCols, (512 * 1024 / std::max<int64_t>(col_bytes, 1)) / kFCols * kFCols);
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
void gemm_f32_f32(const float* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                  int64_t r1) noexcept {
  gemm_f<LdF32, LdF32>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_f16_f16(const uint16_t* w, const uint16_t* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                  int64_t r1) noexcept {
  gemm_f<LdF16, LdF16>(w, x, y, k, m, ldy, r0, r1);
}
void gemm_bf16_f32(const uint16_t* w, const float* x, float* y, int64_t k, int64_t m, int64_t ldy, int64_t r0,
                   int64_t r1) noexcept {
  gemm_f<LdBF16, LdF32>(w, x, y, k, m, ldy, r0, r1);
}

void axpy_f16(float a, const uint16_t* x, float* y, int64_t n) noexcept {
  const VF va(a);
  int64_t i = 0;
  for (; i + kW <= n; i += kW) xsimd::fma(va, load_f16(x + i), VF::load_unaligned(y + i)).store_unaligned(y + i);
  for (; i < n; ++i) y[i] = std::fma(a, h2f(x[i]), y[i]);
}

void swiglu(float* gate, const float* up, int64_t n) noexcept {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {  // silu(g) = g / (1 + exp(-g)), then * up: softmax_exp.hpp's steps
    const __m256 g = _mm256_loadu_ps(gate + i);
    const __m256 e = softmax_exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
    const __m256 s = _mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.0f), e));
    _mm256_storeu_ps(gate + i, _mm256_mul_ps(s, _mm256_loadu_ps(up + i)));
  }
  for (; i < n; ++i) gate[i] = silu(gate[i]) * up[i];
}

// 8 at a time: F16C conversions (as fp32_to_fp16_bits / fp16_bits_to_fp32), the table read
// per lane, the two clamps as blends; the tail by geglu_value.
void geglu(const uint16_t* table, float* gate, const float* up, int64_t n) noexcept {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_loadu_ps(gate + i), u = _mm256_loadu_ps(up + i);
    alignas(16) uint16_t h[8];
    _mm_store_si128(reinterpret_cast<__m128i*>(h), _mm256_cvtps_ph(g, _MM_FROUND_TO_NEAREST_INT));
    for (uint16_t& x : h) x = table[x];
    const __m256 t = _mm256_mul_ps(_mm256_cvtph_ps(_mm_load_si128(reinterpret_cast<const __m128i*>(h))), u);
    const __m256 big = _mm256_cmp_ps(g, _mm256_set1_ps(10.0f), _CMP_GE_OQ);
    const __m256 small = _mm256_cmp_ps(g, _mm256_set1_ps(-10.0f), _CMP_LE_OQ);
    const __m256 r = _mm256_blendv_ps(t, _mm256_mul_ps(g, u), big);
    _mm256_storeu_ps(gate + i, _mm256_andnot_ps(small, r));
  }
  for (; i < n; ++i) gate[i] = geglu_value(table, gate[i], up[i]);
}

bool thread_prepare() noexcept {
  try {
    std::vector<XAux>& aux = aux_buffer();
    if (static_cast<int64_t>(aux.size()) < kPreparedAux) aux.resize(static_cast<size_t>(kPreparedAux));
  } catch (...) {
    return false;
  }
  return true;
}

void vec_dot_f16_rows(const uint16_t* k, int64_t stride, int64_t n_rows, const uint16_t* q, int64_t n,
                      float* out) noexcept {
  for (int64_t r = 0; r < n_rows; ++r) out[r] = vec_dot_f<LdF16, LdF16>(k + r * stride, q, n);
}
void axpy_f16_rows(const float* a, const uint16_t* x, int64_t stride, int64_t n_rows, float* y, int64_t n) noexcept {
  for (int64_t r = 0; r < n_rows; ++r) axpy_f16(a[r], x + r * stride, y, n);
}

// ---------------------------------------------------------------- flash attention -------
//
// cpu_kernels.hpp (FlashAttnArgs) states the contract. Lanes run over query rows: the
// scores of one KV position for kW query rows form one vector (the queries are transposed
// once per call), so the online softmax's max, exp and sums are elementwise and no
// horizontal reduction enters any row's result. Per row: s[c] = sum over d in order of
// q[d] * k[c][d] (one FMA chain), masked to -inf past the row's position; O is rescaled,
// then gets fma(w[c], v[c][d], O[d]) for c in position order. Blocking (how many rows or
// columns go together) changes which registers hold what, never an operation's operands.

constexpr int kAttnCB = 4;  // KV positions per QK block
#if TANDEM_ISA_AVX512
constexpr int kAttnVB = 4;  // row vectors per QK block: 16 accumulators
constexpr int kPvHC = 8;    // head_dim vectors per PV block
#else
constexpr int kAttnVB = 2;  // 8 accumulators
constexpr int kPvHC = 4;
#endif
constexpr int kPvRB = 2;  // query rows per PV block

// s[c * rp + lane] = sum_d kt[c * hd + d] * qt[d * rp + lane] for c < CB, VB vectors of lanes.
template <int CB, int VB>
void attn_qk(const float* kt, int64_t hd, const float* qt, int64_t rp, float* s) noexcept {
  VF acc[CB][VB];
  for (int c = 0; c < CB; ++c)
    for (int v = 0; v < VB; ++v) acc[c][v] = VF(0.0f);
  for (int64_t d = 0; d < hd; ++d) {
    VF qv[VB];
    for (int v = 0; v < VB; ++v) qv[v] = VF::load_unaligned(qt + d * rp + v * kW);
    for (int c = 0; c < CB; ++c) {
      const VF kb(kt[c * hd + d]);
      for (int v = 0; v < VB; ++v) acc[c][v] = xsimd::fma(kb, qv[v], acc[c][v]);
    }
  }
  for (int c = 0; c < CB; ++c)
    for (int v = 0; v < VB; ++v) acc[c][v].store_unaligned(s + c * rp + v * kW);
}
using AttnQkFn = void (*)(const float*, int64_t, const float*, int64_t, float*) noexcept;
template <size_t... I>
constexpr std::array<AttnQkFn, kAttnCB * kAttnVB> make_attn_qk(std::index_sequence<I...>) {
  return {&attn_qk<static_cast<int>(I) / kAttnVB + 1, static_cast<int>(I) % kAttnVB + 1>...};
}

// RB output rows (o, hd apart), head_dim lanes [d0, d0 + HC * kW): acc = O (times corr[j]
// when corr is given), then acc = fma(w[c * rp + j], V[c], acc) for c in [c0, c1) in order.
template <int RB, int HC>
void attn_pv(float* o, int64_t hd, const float* w, int64_t rp, const float* vt, const float* corr, int64_t c0,
             int64_t c1, int64_t d0) noexcept {
  VF acc[RB][HC];
  for (int j = 0; j < RB; ++j)
    for (int h = 0; h < HC; ++h) {
      acc[j][h] = VF::load_unaligned(o + j * hd + d0 + h * kW);
      if (corr != nullptr) acc[j][h] = acc[j][h] * VF(corr[j]);
    }
  for (int64_t c = c0; c < c1; ++c) {
    VF vv[HC];
    for (int h = 0; h < HC; ++h) vv[h] = VF::load_unaligned(vt + c * hd + d0 + h * kW);
    for (int j = 0; j < RB; ++j) {
      const VF wb(w[c * rp + j]);
      for (int h = 0; h < HC; ++h) acc[j][h] = xsimd::fma(wb, vv[h], acc[j][h]);
    }
  }
  for (int j = 0; j < RB; ++j)
    for (int h = 0; h < HC; ++h) acc[j][h].store_unaligned(o + j * hd + d0 + h * kW);
}
using AttnPvFn = void (*)(float*, int64_t, const float*, int64_t, const float*, const float*, int64_t, int64_t,
                          int64_t) noexcept;
template <size_t... I>
constexpr std::array<AttnPvFn, kPvRB * kPvHC> make_attn_pv(std::index_sequence<I...>) {
  return {&attn_pv<static_cast<int>(I) / kPvHC + 1, static_cast<int>(I) % kPvHC + 1>...};
}

// rb rows starting at row r: the whole head_dim (vector chunks, then a scalar tail).
inline void attn_pv_rows(int rb, float* o, int64_t hd, const float* w, int64_t rp, const float* vt, const float* corr,
                         int64_t c0, int64_t c1) noexcept {
  static constexpr auto pv = make_attn_pv(std::make_index_sequence<kPvRB * kPvHC>{});
  const int64_t hdv = hd / kW * kW;
  for (int64_t d0 = 0; d0 < hdv; d0 += kPvHC * kW) {
    const int64_t hc = std::min<int64_t>(kPvHC, (hdv - d0) / kW);
    pv[static_cast<size_t>((rb - 1) * kPvHC + (hc - 1))](o, hd, w, rp, vt, corr, c0, c1, d0);
  }
  for (int j = 0; j < rb; ++j)
    for (int64_t d = hdv; d < hd; ++d) {
      float x = o[j * hd + d];
      if (corr != nullptr) x = x * corr[j];
      for (int64_t c = c0; c < c1; ++c) x = std::fma(w[c * rp + j], vt[c * hd + d], x);
      o[j * hd + d] = x;
    }
}

void flash_attn(const FlashAttnArgs& a, float* scratch) noexcept {
  const int64_t hd = a.head_dim, G = a.group, R = int64_t{a.n_pos} * G;
  if (R <= 0 || hd <= 0) return;
  const FlashAttnLayout L = flash_attn_scratch_layout(hd, R);
  const int64_t rp = L.rp, nv = rp / kW;
  float* qt = scratch + L.qt;
  float* kt = scratch + L.k;
  float* vt = scratch + L.v;
  float* s = scratch + L.s;
  float* o = scratch + L.o;
  float* m = scratch + L.m;
  float* l = scratch + L.l;
  float* corr = scratch + L.corr;
  float* pos = scratch + L.pos;
  const int64_t last = int64_t{a.pos0} + a.n_pos - 1;
  for (int64_t r = 0; r < rp; ++r) {  // queries transposed (f16-rounded for an f16 cache)
    if (r < R) {
      const float* qr = a.q + (r / G) * a.q_stride + (r % G) * hd;
      for (int64_t d = 0; d < hd; ++d)
        qt[d * rp + r] = a.kv_f16 ? h2f(static_cast<uint16_t>(_cvtss_sh(qr[d], _MM_FROUND_TO_NEAREST_INT))) : qr[d];
      pos[r] = static_cast<float>(a.pos0 + r / G);
    } else {
      for (int64_t d = 0; d < hd; ++d) qt[d * rp + r] = 0.0f;
      pos[r] = static_cast<float>(last);
    }
    m[r] = -std::numeric_limits<float>::infinity();
    l[r] = 0.0f;
  }
  std::fill(o, o + R * hd, 0.0f);
  static constexpr auto qk = make_attn_qk(std::make_index_sequence<kAttnCB * kAttnVB>{});
  const VF ninf(-std::numeric_limits<float>::infinity()), vscale(a.scale);
  for (int64_t t0 = 0; t0 <= last; t0 += kFlashAttnTile) {
    const int64_t nc = std::min<int64_t>(kFlashAttnTile, last + 1 - t0);
    for (int64_t c = 0; c < nc; ++c) {  // the tile's K and V rows as f32
      const int64_t p = t0 + c;
      const int64_t off = (p % a.page_size) * a.row_stride + a.head_offset;
      const size_t page = static_cast<size_t>(p / a.page_size);
      if (a.kv_f16) {
        fp16_to_fp32_row(static_cast<const uint16_t*>(a.k_pages[page]) + off, kt + c * hd, hd);
        fp16_to_fp32_row(static_cast<const uint16_t*>(a.v_pages[page]) + off, vt + c * hd, hd);
      } else {
        std::memcpy(kt + c * hd, static_cast<const float*>(a.k_pages[page]) + off, size_t(hd) * sizeof(float));
        std::memcpy(vt + c * hd, static_cast<const float*>(a.v_pages[page]) + off, size_t(hd) * sizeof(float));
      }
    }
    // Rows are ordered by position: those before r_first see nothing of this tile.
    const int64_t r_first = t0 > a.pos0 ? (t0 - a.pos0) * G : 0;
    const int64_t v_first = r_first / kW;
    for (int64_t c = 0; c < nc; c += kAttnCB) {
      const int64_t cb = std::min<int64_t>(kAttnCB, nc - c);
      for (int64_t v = v_first; v < nv; v += kAttnVB) {
        const int64_t vb = std::min<int64_t>(kAttnVB, nv - v);
        qk[static_cast<size_t>((cb - 1) * kAttnVB + (vb - 1))](kt + c * hd, hd, qt + v * kW, rp, s + c * rp + v * kW);
      }
    }
    for (int64_t v = v_first; v < nv; ++v) {  // online softmax, kW rows at a time
      const VF pv = VF::load_unaligned(pos + v * kW);
      VF mt = ninf;
      for (int64_t c = 0; c < nc; ++c) {
        const VF x =
            xsimd::select(VF(static_cast<float>(t0 + c)) <= pv, VF::load_unaligned(s + c * rp + v * kW) * vscale, ninf);
        x.store_unaligned(s + c * rp + v * kW);
        mt = xsimd::max(mt, x);
      }
      const VF mo = VF::load_unaligned(m + v * kW);
      const auto seen = mt > ninf;  // rows with a position in this tile
      const VF mn = xsimd::select(seen, xsimd::max(mo, mt), mo);
      const VF cr = xsimd::select(seen, xsimd::exp(mo - mn), VF(1.0f));
      VF ls(0.0f);
      for (int64_t c = 0; c < nc; ++c) {
        const VF e = xsimd::exp(VF::load_unaligned(s + c * rp + v * kW) - mn);
        e.store_unaligned(s + c * rp + v * kW);
        ls = ls + e;
      }
      xsimd::fma(VF::load_unaligned(l + v * kW), cr, ls).store_unaligned(l + v * kW);
      mn.store_unaligned(m + v * kW);
      cr.store_unaligned(corr + v * kW);
    }
    for (int64_t r = r_first; r < R;) {  // O = O * corr + weights x V
      const int rb = static_cast<int>(std::min<int64_t>(kPvRB, R - r));
      auto valid = [&](int64_t row) { return std::min<int64_t>(nc, a.pos0 + row / G - t0 + 1); };
      const int64_t cmin = valid(r);
      attn_pv_rows(rb, o + r * hd, hd, s + r, rp, vt, corr + r, 0, cmin);
      for (int j = 1; j < rb; ++j) {
        const int64_t cj = valid(r + j);
        if (cj > cmin) attn_pv_rows(1, o + (r + j) * hd, hd, s + r + j, rp, vt, nullptr, cmin, cj);
      }
      r += rb;
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    const float inv = 1.0f / l[r];
    float* dst = a.out + (r / G) * a.q_stride + (r % G) * hd;
    const float* src = o + r * hd;
    int64_t d = 0;
    for (; d + kW <= hd; d += kW) (VF::load_unaligned(src + d) * VF(inv)).store_unaligned(dst + d);
    for (; d < hd; ++d) dst[d] = src[d] * inv;
  }
}

// ---------------------------------------------------------------- attn_tiled ------------
//
// docs/arithmetic.md "Attention": a K tile is transposed to [d][key] so that the keys are
// the lanes (each lane the score's 32 lane sums and their tree, no horizontal sum), the softmax is the written
// one, and V is accumulated per fixed chunk of kFlashAttnTile positions counted from the
// row's first position. The AVX-512 TUs hold 16 keys (or head_dim elements) per vector,
// the AVX2 TU 8: every lane runs the same chain, so the width changes no bit.
#if TANDEM_ISA_AVX512
struct AttnVec {
  using T = __m512;
  static constexpr int64_t n = 16;
  static T zero() noexcept { return _mm512_setzero_ps(); }
  static T set1(float x) noexcept { return _mm512_set1_ps(x); }
  static T load(const float* p) noexcept { return _mm512_loadu_ps(p); }
  static T load_f16(const uint16_t* p) noexcept {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store(float* p, T v) noexcept { _mm512_storeu_ps(p, v); }
  static T fma(T a, T b, T c) noexcept { return _mm512_fmadd_ps(a, b, c); }
  static T add(T a, T b) noexcept { return _mm512_add_ps(a, b); }
};
constexpr int kScRB = 2, kScKB = 2;  // scores: 2 rows x 32 keys (6 x 4 tree accumulators)
constexpr int kWvRB = 4, kWvHC = 4;  // weights x V: 4 rows x 64 elements of head_dim
#else
struct AttnVec {
  using T = __m256;
  static constexpr int64_t n = 8;
  static T zero() noexcept { return _mm256_setzero_ps(); }
  static T set1(float x) noexcept { return _mm256_set1_ps(x); }
  static T load(const float* p) noexcept { return _mm256_loadu_ps(p); }
  static T load_f16(const uint16_t* p) noexcept {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(float* p, T v) noexcept { _mm256_storeu_ps(p, v); }
  static T fma(T a, T b, T c) noexcept { return _mm256_fmadd_ps(a, b, c); }
  static T add(T a, T b) noexcept { return _mm256_add_ps(a, b); }
};
constexpr int kScRB = 2, kScKB = 1;  // 2 rows x 8 keys (6 x 2 tree accumulators)
constexpr int kWvRB = 2, kWvHC = 4;  // 2 rows x 32 elements
#endif

// The score's 32 lanes and their tree for rows j < RB (q rows hp apart) and keys
// k < KB * n of the transposed tile kt ([d][tile]), n32 = hd rounded down to 32, n8 to 8.
// Lane l: a = fma(q_j[e], kt[e][k], a) from a = 0 over e = l, l + 32, ... < n32, then (l < 8)
// over e = n32 + l, n32 + l + 8, ... < n8. Level L < 5 of the tree adds the lanes
// kTreeOff[L] apart: t_L(l) = t_L+1(l) + t_L+1(l + kTreeOff[L]); t_0(0) is the tree's sum.
inline constexpr int kTreeOff[5] = {1, 2, 4, 16, 8};
template <int RB, int KB, int L>
[[gnu::always_inline]] inline void attn_score_tree(const float* kt, int64_t n32, int64_t n8, const float* q, int64_t hp,
                                                   int64_t l, typename AttnVec::T (&out)[RB][KB]) noexcept {
  using V = AttnVec;
  if constexpr (L == 5) {
    for (int j = 0; j < RB; ++j)
      for (int v = 0; v < KB; ++v) out[j][v] = V::zero();
    auto term = [&](int64_t e) {
      typename V::T k[KB];
      for (int v = 0; v < KB; ++v) k[v] = V::load(kt + e * kFlashAttnTile + v * V::n);
      for (int j = 0; j < RB; ++j) {
        const typename V::T qb = V::set1(q[j * hp + e]);
        for (int v = 0; v < KB; ++v) out[j][v] = V::fma(qb, k[v], out[j][v]);
      }
    };
    for (int64_t e = l; e < n32; e += 32) term(e);
    if (l < 8)
      for (int64_t e = n32 + l; e < n8; e += 8) term(e);
  } else {
    typename V::T right[RB][KB];
    attn_score_tree<RB, KB, L + 1>(kt, n32, n8, q, hp, l, out);
    attn_score_tree<RB, KB, L + 1>(kt, n32, n8, q, hp, l + kTreeOff[L], right);
    for (int j = 0; j < RB; ++j)
      for (int v = 0; v < KB; ++v) out[j][v] = V::add(out[j][v], right[j][v]);
  }
}
// The dots of rows j < RB and keys k < KB * n to s[j * ld + k]: the tree's sum (see
// attn_score_tree), then the last hd % 8 terms by fma in order.
template <int RB, int KB>
void attn_scores(const float* kt, int64_t hd, const float* q, int64_t hp, float* s, int64_t ld) noexcept {
  using V = AttnVec;
  typename V::T acc[RB][KB];
  const int64_t n32 = hd / 32 * 32, n8 = hd / 8 * 8;
  attn_score_tree<RB, KB, 0>(kt, n32, n8, q, hp, 0, acc);
  for (int64_t e = n8; e < hd; ++e) {
    typename V::T k[KB];
    for (int v = 0; v < KB; ++v) k[v] = V::load(kt + e * kFlashAttnTile + v * V::n);
    for (int j = 0; j < RB; ++j) {
      const typename V::T qb = V::set1(q[j * hp + e]);
      for (int v = 0; v < KB; ++v) acc[j][v] = V::fma(qb, k[v], acc[j][v]);
    }
  }
  for (int j = 0; j < RB; ++j)
    for (int v = 0; v < KB; ++v) V::store(s + j * ld + v * V::n, acc[j][v]);
}
using AttnScoresFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t) noexcept;
template <size_t... I>
constexpr std::array<AttnScoresFn, kScRB * kScKB> make_attn_scores(std::index_sequence<I...>) {
  return {&attn_scores<static_cast<int>(I) / kScKB + 1, static_cast<int>(I) % kScKB + 1>...};
}

// Rows j < RB: part_j[d0 .. d0 + HC * n) (rows hp apart) = fma(w[j * ld + c], v_c[d], part)
// for c = c0 .. c1 - 1 in order; src(c, d) loads V row c's elements d .. d + n as f32 (from
// the f32 tile, TileRows, or straight from an f16 page, F16Rows: the same values).
struct TileRows {
  const float* vt;
  int64_t hp;
  AttnVec::T operator()(int64_t c, int64_t d) const noexcept { return AttnVec::load(vt + c * hp + d); }
};
struct F16Rows {
  const uint16_t* const* rows;
  AttnVec::T operator()(int64_t c, int64_t d) const noexcept { return AttnVec::load_f16(rows[c] + d); }
};
template <int RB, int HC, class Src>
void attn_wv(float* part, int64_t hp, const float* w, int64_t ld, Src src, int64_t c0, int64_t c1,
             int64_t d0) noexcept {
  using V = AttnVec;
  typename V::T acc[RB][HC];
  for (int j = 0; j < RB; ++j)
    for (int h = 0; h < HC; ++h) acc[j][h] = V::load(part + j * hp + d0 + h * V::n);
  for (int64_t c = c0; c < c1; ++c) {
    typename V::T vv[HC];
    for (int h = 0; h < HC; ++h) vv[h] = src(c, d0 + h * V::n);
    for (int j = 0; j < RB; ++j) {
      const typename V::T wb = V::set1(w[j * ld + c]);
      for (int h = 0; h < HC; ++h) acc[j][h] = V::fma(wb, vv[h], acc[j][h]);
    }
  }
  for (int j = 0; j < RB; ++j)
    for (int h = 0; h < HC; ++h) V::store(part + j * hp + d0 + h * V::n, acc[j][h]);
}
template <class Src>
using AttnWvFn = void (*)(float*, int64_t, const float*, int64_t, Src, int64_t, int64_t, int64_t) noexcept;
template <class Src, size_t... I>
constexpr std::array<AttnWvFn<Src>, kWvRB * kWvHC> make_attn_wv(std::index_sequence<I...>) {
  return {&attn_wv<static_cast<int>(I) / kWvHC + 1, static_cast<int>(I) % kWvHC + 1, Src>...};
}

// out[i * ldo + j] = r[j][i] for i, j < 8 (moves only).
inline void transpose8x8(__m256 (&r)[8], float* out, int64_t ldo) noexcept {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    _mm256_storeu_ps(out + i * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x20));
    _mm256_storeu_ps(out + (i + 4) * ldo, _mm256_permute2f128_ps(r[i], r[i + 4], 0x31));
  }
}
// out[i * ldo + j] = in[j * ldi + i] (f32 rows), or row j's element d + i (f16 rows, as f32).
inline void transpose8x8(const float* in, int64_t ldi, float* out, int64_t ldo) noexcept {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(in + i * ldi);
  transpose8x8(r, out, ldo);
}
inline void transpose8x8(const uint16_t* const* rows, int64_t d, float* out, int64_t ldo) noexcept {
  __m256 r[8];
  for (int i = 0; i < 8; ++i) r[i] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(rows[i] + d)));
  transpose8x8(r, out, ldo);
}

// sr[p] *= scale for p in [p0, n), and the max of the results, 8 lanes at a time (the max
// is exact in any order; a NaN is skipped, as std::max(mx, s) skips it, and the sign of a
// zero max changes no s - mx the softmax computes).
inline float scale_and_max(float* sr, int64_t p0, int64_t n, float scale) noexcept {
  const __m256 vs = _mm256_set1_ps(scale);
  __m256 vmax = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t p = p0;
  for (; p + 8 <= n; p += 8) {
    const __m256 v = _mm256_mul_ps(_mm256_loadu_ps(sr + p), vs);
    _mm256_storeu_ps(sr + p, v);
    vmax = _mm256_max_ps(v, vmax);  // a NaN in v: vmax
  }
  alignas(32) float t[8];
  _mm256_store_ps(t, vmax);
  float mx = -std::numeric_limits<float>::infinity();
  for (const float x : t) mx = std::max(mx, x);
  for (; p < n; ++p) {
    sr[p] *= scale;
    mx = std::max(mx, sr[p]);
  }
  return mx;
}

// The written softmax of K rows' scores sr[j][p0 .. n) (docs/arithmetic.md "Attention"),
// given their maxima: e = softmax_exp(s - mx), the sum in double, sr = e * f32(1 / sum),
// rounded to f16 for an f16 cache. The rows go together only so that their sums' add
// chains overlap: each row's operations are the one-row ones.
template <int K>
void softmax_rows(float* const* sr, int64_t p0, int64_t n, const float* mx, bool f16) noexcept {
  // softmax_exp on 8 lanes; the sum in double: 8 lanes (lane (p - p0) % 8 over the full
  // groups of 8 positions from the window's start p0, in order), the tree ((l0 + l4) +
  // (l2 + l6)) + ((l1 + l5) + (l3 + l7)), then the tail in order; inv = f32(1 / sum).
  __m256d lo[K], hi[K];  // lanes 0-3, 4-7
  __m256 vmx[K];
  for (int j = 0; j < K; ++j) {
    lo[j] = hi[j] = _mm256_setzero_pd();
    vmx[j] = _mm256_set1_ps(mx[j]);
  }
  int64_t p = p0;
  for (; p + 8 <= n; p += 8)
    for (int j = 0; j < K; ++j) {
      const __m256 e = softmax_exp8(_mm256_sub_ps(_mm256_loadu_ps(sr[j] + p), vmx[j]));
      _mm256_storeu_ps(sr[j] + p, e);
      lo[j] = _mm256_add_pd(lo[j], _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
      hi[j] = _mm256_add_pd(hi[j], _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
    }
  const int64_t tail = p;
  for (int j = 0; j < K; ++j) {
    float* r = sr[j];
    const __m256d t = _mm256_add_pd(lo[j], hi[j]);  // l0 + l4, l1 + l5, l2 + l6, l3 + l7
    const __m128d u = _mm_add_pd(_mm256_castpd256_pd128(t), _mm256_extractf128_pd(t, 1));
    double sum = _mm_cvtsd_f64(_mm_add_sd(u, _mm_unpackhi_pd(u, u)));
    for (p = tail; p < n; ++p) {
      r[p] = softmax_exp(r[p] - mx[j]);
      sum = sum + double(r[p]);
    }
    const float inv = static_cast<float>(1.0 / sum);
    for (p = p0; p < n; ++p) r[p] *= inv;
    if (f16) {
      for (p = p0; p + kW <= n; p += kW) {
        uint16_t h[kW];
        store_f16(VF::load_unaligned(r + p), h);
        load_f16(h).store_unaligned(r + p);
      }
      for (; p < n; ++p) r[p] = h2f(static_cast<uint16_t>(_cvtss_sh(r[p], _MM_FROUND_TO_NEAREST_INT)));
    }
  }
}
// Rows r0 .. r0 + k (k <= 4) at sr + r * ld, all over [p0, n): softmax_rows in one pass.
inline void softmax_rows(float* sr, int64_t ld, int64_t k, int64_t p0, int64_t n, const float* mx, bool f16) noexcept {
  float* rows[4];
  for (int64_t j = 0; j < k; ++j) rows[j] = sr + j * ld;
  switch (k) {
    case 4:
      softmax_rows<4>(rows, p0, n, mx, f16);
      break;
    case 3:
      softmax_rows<3>(rows, p0, n, mx, f16);
      break;
    case 2:
      softmax_rows<2>(rows, p0, n, mx, f16);
      break;
    default:
      softmax_rows<1>(rows, p0, n, mx, f16);
      break;
  }
}

// ---------------------------------------------------------------- attn_split_* ----------
//
// One query position (cpu_kernels.hpp, attn_split_*): the R = group rows see the same
// positions, so the K and V rows are read from their pages and converted in registers
// (exact) instead of through attn_tiled's f32 tile, and eight keys' scores share one
// reduction. attn_tiled takes this path for such a call, so both give the same bits.
#if TANDEM_ISA_AVX512
constexpr int kSplitRB = 4;  // score rows per pass: 16 accumulators + 4 K vectors of 32 registers
#else
constexpr int kSplitRB = 2;          // 8 + 4 of 16
#endif

// Rows r0 .. r0 + rb of q rounded to f16 (attn_tiled's qf), head_dim apart (n_pos 1: row r
// is at q + r * head_dim).
inline void split_q_rows(const FlashAttnArgs& a, int64_t r0, int64_t rb, float* qf) noexcept {
  const int64_t hd = a.head_dim;
  for (int64_t j = 0; j < rb; ++j)
    for (int64_t d = 0; d < hd; d += 8) {
      const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(a.q + (r0 + j) * hd + d), _MM_FROUND_TO_NEAREST_INT);
      _mm256_storeu_ps(qf + j * hd + d, _mm256_cvtph_ps(h));
    }
}

// vec_dot_f(k, q_j) for one key and RB rows up to its final tree: (s0 + s1) + (s2 + s3) of
// the four 8-lane accumulators (head_dim % 32 == 0: no tails).
template <int RB>
[[gnu::always_inline]] inline void split_key_lanes(const uint16_t* k, const float* qf, int64_t hd,
                                                   __m256 (&c)[RB]) noexcept {
  __m256 acc[RB][4];
  for (int j = 0; j < RB; ++j)
    for (int v = 0; v < 4; ++v) acc[j][v] = _mm256_setzero_ps();
  for (int64_t e = 0; e < hd; e += 32) {
    __m256 kv[4];
    for (int v = 0; v < 4; ++v)
      kv[v] = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(k + e + 8 * v)));
    for (int j = 0; j < RB; ++j)
      for (int v = 0; v < 4; ++v)
        acc[j][v] = _mm256_fmadd_ps(kv[v], _mm256_loadu_ps(qf + j * hd + e + 8 * v), acc[j][v]);
  }
  for (int j = 0; j < RB; ++j)
    c[j] = _mm256_add_ps(_mm256_add_ps(acc[j][0], acc[j][1]), _mm256_add_ps(acc[j][2], acc[j][3]));
}

// Lane k = hsum256(c[k]) for k < 8, by the same adds: t = c(l) + c(l + 4), then
// t(l) + t(l + 2), then the two left.
inline __m256 hsum256x8(const __m256* c) noexcept {
  __m256 d[4];  // [t_k | t_k+4]
  for (int k = 0; k < 4; ++k)
    d[k] = _mm256_add_ps(_mm256_permute2f128_ps(c[k], c[k + 4], 0x20), _mm256_permute2f128_ps(c[k], c[k + 4], 0x31));
  const __m256 e01 = _mm256_add_ps(_mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(d[0], d[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m256 e23 = _mm256_add_ps(_mm256_shuffle_ps(d[2], d[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                   _mm256_shuffle_ps(d[2], d[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm256_add_ps(_mm256_shuffle_ps(e01, e23, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm256_shuffle_ps(e01, e23, _MM_SHUFFLE(3, 1, 3, 1)));
}

// Scores of RB rows (qf, head_dim apart) over positions [pb, pe) into s (row j at s + j * ld),
// eight keys at a time; mx[j] = their max (std::max's order: a NaN score is skipped).
template <int RB>
void split_scores_rows(const FlashAttnArgs& a, const float* qf, int64_t pb, int64_t pe, float* s, int64_t ld,
                       float* mx) noexcept {
  const __m256 scale = _mm256_set1_ps(a.scale);
  __m256 vmax[RB];
  float tail_max[RB];
  __m256 c[RB][8];
  for (int j = 0; j < RB; ++j) {
    vmax[j] = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
    tail_max[j] = -std::numeric_limits<float>::infinity();
  }
  for (int64_t p = pb; p < pe; p += 8) {
    const int64_t nk = std::min<int64_t>(8, pe - p);
    const uint16_t* rows[8];
    const int64_t n_ahead = std::clamp<int64_t>(pe - (p + 32), 0, 8);  // 32 keys ahead: prefetched
    attn_kv_rows_f16(a, a.k_pages, p + 32, n_ahead, rows);
    for (int64_t k = 0; k < n_ahead; ++k)
      for (int64_t b = 0; b < a.head_dim * 2; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(rows[k]) + b, _MM_HINT_T0);
    attn_kv_rows_f16(a, a.k_pages, p, nk, rows);
    for (int64_t k = 0; k < 8; ++k) {
      __m256 ck[RB];
      if (k < nk) {
        split_key_lanes<RB>(rows[k], qf, a.head_dim, ck);
      } else {
        for (int j = 0; j < RB; ++j) ck[j] = _mm256_setzero_ps();
      }
      for (int j = 0; j < RB; ++j) c[j][k] = ck[j];
    }
    for (int j = 0; j < RB; ++j) {
      const __m256 sv = _mm256_mul_ps(hsum256x8(c[j]), scale);
      if (nk == 8) {
        _mm256_storeu_ps(s + j * ld + p, sv);
        vmax[j] = _mm256_max_ps(sv, vmax[j]);  // a NaN in sv: vmax
      } else {
        alignas(32) float t[8];
        _mm256_store_ps(t, sv);
        for (int64_t k = 0; k < nk; ++k) {
          s[j * ld + p + k] = t[k];
          tail_max[j] = std::max(tail_max[j], t[k]);
        }
      }
    }
  }
  for (int j = 0; j < RB; ++j) {
    alignas(32) float t[8];
    _mm256_store_ps(t, vmax[j]);
    mx[j] = tail_max[j];
    for (float x : t) mx[j] = std::max(mx[j], x);
  }
}

void attn_split_scores(const FlashAttnArgs& a, int64_t c0, int64_t c1, float* s, int64_t ld, float* row_max) noexcept {
  const AttnSplitGeom g = attn_split_geom(a);
  const int64_t pb = g.p0 + c0 * kFlashAttnTile, pe = std::min(g.n, g.p0 + c1 * kFlashAttnTile);
  alignas(32) float qf[kSplitRB * kAttnSplitMaxDim];
  for (int64_t r = 0; r < a.group; r += kSplitRB) {
    const int64_t rb = std::min<int64_t>(kSplitRB, a.group - r);
    split_q_rows(a, r, rb, qf);
    float* sr = s + r * ld;
    switch (rb) {
#if TANDEM_ISA_AVX512
      case 4:
        split_scores_rows<4>(a, qf, pb, pe, sr, ld, row_max + r);
        break;
      case 3:
        split_scores_rows<3>(a, qf, pb, pe, sr, ld, row_max + r);
        break;
#endif
      case 2:
        split_scores_rows<2>(a, qf, pb, pe, sr, ld, row_max + r);
        break;
      default:
        split_scores_rows<1>(a, qf, pb, pe, sr, ld, row_max + r);
        break;
    }
  }
}

void attn_split_softmax(const FlashAttnArgs& a, float* s, int64_t ld, const float* range_max,
                        int64_t n_ranges) noexcept {
  const AttnSplitGeom g = attn_split_geom(a);
  for (int64_t r = 0; r < a.group; r += 4) {
    const int64_t k = std::min<int64_t>(4, a.group - r);
    float mx[4];
    for (int64_t j = 0; j < k; ++j) {
      mx[j] = -std::numeric_limits<float>::infinity();
      for (int64_t i = 0; i < n_ranges; ++i) mx[j] = std::max(mx[j], range_max[i * a.group + r + j]);
    }
    softmax_rows(s + r * ld, ld, k, g.p0, g.n, mx, true);
  }
}

// Chunk c's partial outputs of every row into part (row r at part + r * head_dim): from 0,
// an fma chain over the chunk's positions in order, V read from its f16 pages.
inline void split_wv_chunk(const FlashAttnArgs& a, const AttnSplitGeom& g, int64_t c, const float* s, int64_t ld,
                           float* part) noexcept {
  using V = AttnVec;
  static constexpr auto wv = make_attn_wv<F16Rows>(std::make_index_sequence<kWvRB * kWvHC>{});
  const int64_t hd = a.head_dim, R = a.group;
  const int64_t cb = g.p0 + c * kFlashAttnTile, nc = std::min(kFlashAttnTile, g.n - cb);
  const uint16_t* rows[kFlashAttnTile];
  // The next chunk's rows prefetched, then this chunk's.
  const int64_t n_next = std::clamp<int64_t>(g.n - (cb + kFlashAttnTile), 0, kFlashAttnTile);
  attn_kv_rows_f16(a, a.v_pages, cb + kFlashAttnTile, n_next, rows);
  for (int64_t i = 0; i < n_next; ++i)
    for (int64_t b = 0; b < a.head_dim * 2; b += 64)
      _mm_prefetch(reinterpret_cast<const char*>(rows[i]) + b, _MM_HINT_T1);
  attn_kv_rows_f16(a, a.v_pages, cb, nc, rows);
  std::fill(part, part + R * hd, 0.0f);
  for (int64_t r = 0; r < R; r += kWvRB) {
    const int64_t rb = std::min<int64_t>(kWvRB, R - r);
    for (int64_t d0 = 0; d0 < hd; d0 += kWvHC * V::n) {
      const int64_t hc = std::min<int64_t>(kWvHC, (hd - d0) / V::n);
      wv[static_cast<size_t>((rb - 1) * kWvHC + (hc - 1))](part + r * hd, hd, s + r * ld + cb, ld, F16Rows{rows}, 0, nc,
                                                           d0);
    }
  }
}

void attn_split_wv(const FlashAttnArgs& a, int64_t c0, int64_t c1, const float* s, int64_t ld, float* parts) noexcept {
  const AttnSplitGeom g = attn_split_geom(a);
  for (int64_t c = c0; c < c1; ++c) split_wv_chunk(a, g, c, s, ld, parts + c * a.group * a.head_dim);
}

constexpr int64_t kScDotRows = 4;  // attn_tiled: a tile with at most this many rows takes vec_dot_f
// attn_tiled (cpu_kernels.hpp, docs/arithmetic.md "Attention"). One query position (f16,
// head_dim % 32 == 0) is the attn_split_* phases in one call. Otherwise K tiles are
// transposed and V rows multiplied: f16 rows with head_dim % 32 == 0 straight from their
// pages (converted in registers), others through an f32 tile (exact for f16 and q8_0).
void attn_tiled(const FlashAttnArgs& a, float* scratch) noexcept {
  using V = AttnVec;
  constexpr int64_t T = kFlashAttnTile;
  const int64_t hd = a.head_dim, G = a.group, R = int64_t{a.n_pos} * G;
  if (R <= 0 || hd <= 0) return;
  const int64_t last = int64_t{a.pos0} + a.n_pos - 1;
  const AttnTiledLayout L = attn_tiled_scratch_layout(hd, R, last + 1);
  const int64_t hp = L.hp, ld = L.ld;
  float* qf = scratch + L.q;
  float* kv = scratch + L.kv;
  float* kt = scratch + L.kt;
  float* sc = scratch + L.s;
  float* o = scratch + L.o;
  float* part = scratch + L.part;
  if (detail::attn_split_applies(a)) {  // one query position: the split's phases in one call
    const AttnSplitGeom g = attn_split_geom(a);
    TANDEM_ISA_NS::attn_split_scores(a, 0, g.n_chunks, sc, ld, kv);  // the rows' maxima in kv
    TANDEM_ISA_NS::attn_split_softmax(a, sc, ld, kv, 1);
    std::fill(o, o + R * hd, 0.0f);
    for (int64_t c = 0; c < g.n_chunks; ++c) {
      split_wv_chunk(a, g, c, sc, ld, part);
      for (int64_t i = 0; i < R * hd; i += V::n) V::store(o + i, V::add(V::load(o + i), V::load(part + i)));
    }
    std::memcpy(a.out, o, size_t(R * hd) * sizeof(float));
    return;
  }
  const bool f16 = a.kv_f16 && !a.kv_q8_0;  // q8_0 KV: q and the weights stay f32
  for (int64_t r = 0; r < R; ++r) {
    const float* qr = a.q + (r / G) * a.q_stride + (r % G) * hd;
    if (f16) {
      for (int64_t d = 0; d < hd; ++d)
        qf[r * hp + d] = h2f(static_cast<uint16_t>(_cvtss_sh(qr[d], _MM_FROUND_TO_NEAREST_INT)));
    } else {
      std::memcpy(qf + r * hp, qr, size_t(hd) * sizeof(float));
    }
    std::fill(o + r * hp, o + (r + 1) * hp, 0.0f);
    std::fill(part + r * hp, part + (r + 1) * hp, 0.0f);
  }
  // The tile's rows [cs, nc) as f32 (hp wide, zero past hd); rows [0, cs) (before every
  // window: never read) and [nc, 16-rounded nc) zero.
  auto load_tile = [&](const void* const* pages, int64_t t0, int64_t nc, int64_t cs) {
    std::fill(kv, kv + cs * hp, 0.0f);
    for (int64_t c = cs; c < nc; ++c) {
      const int64_t p = t0 + c;
      const void* page = pages[static_cast<size_t>(p / a.page_size)];
      const int64_t off = (p % a.page_size) * a.row_stride + a.head_offset;
      float* row = kv + c * hp;
      if (a.kv_q8_0) {
        q8_0_span_to_f32(static_cast<const BlockQ8_0*>(page), off, hd, row);
      } else if (a.kv_f16) {
        fp16_to_fp32_row(static_cast<const uint16_t*>(page) + off, row, hd);
      } else {
        std::memcpy(row, static_cast<const float*>(page) + off, size_t(hd) * sizeof(float));
      }
      std::fill(row + hd, row + hp, 0.0f);
    }
    std::fill(kv + nc * hp, kv + (nc + 15) / 16 * 16 * hp, 0.0f);
  };
  // Row r sees positions win0(r) .. pos0 + r / G; rows are ordered by position, so both
  // ends grow with r.
  auto win0 = [&](int64_t r) {
    return a.window > 0 ? std::max<int64_t>(0, a.pos0 + r / G + 1 - a.window) : int64_t{0};
  };
  auto first_row = [&](int64_t t0) { return t0 > a.pos0 ? (t0 - a.pos0) * G : 0; };
  // One past the last row whose window reaches into the tile starting at t0 (R without a window).
  auto end_row = [&](int64_t t0, int64_t nc) {
    if (a.window <= 0) return R;
    // win0(r) < t0 + nc  <=>  pos0 + r / G + 1 - window < t0 + nc
    const int64_t last_pos = t0 + nc + a.window - 2;  // the latest position whose window reaches the tile
    return std::min<int64_t>(R, std::max<int64_t>(0, (last_pos - a.pos0 + 1) * G));
  };
  auto n_valid = [&](int64_t r, int64_t t0, int64_t nc) { return std::min<int64_t>(nc, a.pos0 + r / G - t0 + 1); };
  auto c_first = [&](int64_t r, int64_t t0) { return std::max<int64_t>(0, win0(r) - t0); };
  const int64_t t_begin = win0(0) / T * T;  // tiles before it: no row's window
  // An f16 cache with head_dim a multiple of 32 (hp == hd) is read from its pages: each K/V
  // row converted in registers (exact, the tile's values); rows [0, cs) and [nc, T) of the
  // tile (never read) point at zeros.
  const bool direct = f16 && hd % 32 == 0 && hd <= kAttnSplitMaxDim;
  static constexpr uint16_t kZeroRow[kAttnSplitMaxDim] = {};
  const uint16_t* rows[T];
  auto page_rows = [&](const void* const* pages, int64_t t0, int64_t nc, int64_t cs) {
    std::fill(rows, rows + T, kZeroRow);
    attn_kv_rows_f16(a, pages, t0 + cs, nc - cs, rows + cs);
  };
  // Scores, one K tile at a time: blocks of kScRB rows x kScKB key vectors over the keys
  // the block's rows see (rounded out to whole vectors: the other lanes are not read). With
  // at most kScDotRows rows in the tile the transpose costs more than it saves: vec_dot_f
  // on the K rows computes the same 32 lanes and tree (docs/arithmetic.md).
  static constexpr auto scores = make_attn_scores(std::make_index_sequence<kScRB * kScKB>{});
  for (int64_t t0 = t_begin; t0 <= last; t0 += T) {
    const int64_t nc = std::min<int64_t>(T, last + 1 - t0);
    const int64_t rf = first_row(t0), re = end_row(t0, nc);
    if (rf >= re) continue;
    const int64_t cs = c_first(rf, t0), n16 = (nc + 15) / 16 * 16;
    if (direct) {
      page_rows(a.k_pages, t0, nc, cs);
    } else {
      load_tile(a.k_pages, t0, nc, cs);
    }
    if (re - rf <= kScDotRows) {  // few rows: vec_dot_f per score, the same bits
      for (int64_t r = rf; r < re; ++r)
        for (int64_t c = c_first(r, t0), n = n_valid(r, t0, nc); c < n; ++c)
          sc[r * ld + t0 + c] = direct ? vec_dot_f<LdF16, LdF32>(rows[c], qf + r * hp, hd)
                                       : vec_dot_f<LdF32, LdF32>(kv + c * hp, qf + r * hp, hd);
      continue;
    }
    for (int64_t c = cs / 16 * 16; c < n16; c += 8)
      for (int64_t d = 0; d < hp; d += 8) {
        if (direct) {
          transpose8x8(rows + c, d, kt + d * T + c, T);
        } else {
          transpose8x8(kv + c * hp + d, hp, kt + d * T + c, T);
        }
      }
    for (int64_t r = rf; r < re; r += kScRB) {
      const int64_t rb = std::min<int64_t>(kScRB, re - r);
      const int64_t v0 = c_first(r, t0) / V::n, v1 = (n_valid(r + rb - 1, t0, nc) + V::n - 1) / V::n;
      for (int64_t v = v0; v < v1; v += kScKB) {
        const int64_t kb = std::min<int64_t>(kScKB, v1 - v);
        scores[static_cast<size_t>((rb - 1) * kScKB + (kb - 1))](kt + v * V::n, hd, qf + r * hp, hp,
                                                                 sc + r * ld + t0 + v * V::n, ld);
      }
    }
  }
  // Softmax per row (docs/arithmetic.md; f16 weights for an f16 cache), up to 4 rows of one
  // position (the same positions seen) in one pass.
  for (int64_t r = 0; r < R;) {
    const int64_t n = a.pos0 + r / G + 1, p0 = win0(r), k = std::min<int64_t>(4, G - r % G);
    float mx[4];
    for (int64_t j = 0; j < k; ++j) mx[j] = scale_and_max(sc + (r + j) * ld, p0, n, a.scale);
    softmax_rows(sc + r * ld, ld, k, p0, n, mx, f16);
    r += k;
  }
  // Weights x V, one V tile at a time. Per (row, element): part = fma(w_p, v_p, part) over a
  // chunk's positions in order, then out = out + part, chunk after chunk; a chunk is T
  // positions counted from the row's first position p0 (0 without a window). Rows with the
  // same p0 share the chunk edges and go kWvRB together over their common columns.
  static constexpr auto wv = make_attn_wv<TileRows>(std::make_index_sequence<kWvRB * kWvHC>{});
  static constexpr auto wv_f16 = make_attn_wv<F16Rows>(std::make_index_sequence<kWvRB * kWvHC>{});
  auto wv_rows = [&](int64_t rb, int64_t r, int64_t t0, int64_t c0, int64_t c1) {
    if (c1 <= c0) return;
    for (int64_t d0 = 0; d0 < hp; d0 += kWvHC * V::n) {
      const int64_t hc = std::min<int64_t>(kWvHC, (hp - d0) / V::n);
      const auto i = static_cast<size_t>((rb - 1) * kWvHC + (hc - 1));
      if (direct) {
        wv_f16[i](part + r * hp, hp, sc + r * ld + t0, ld, F16Rows{rows}, c0, c1, d0);
      } else {
        wv[i](part + r * hp, hp, sc + r * ld + t0, ld, TileRows{kv, hp}, c0, c1, d0);
      }
    }
  };
  auto flush = [&](int64_t r) {  // out = out + part; part = 0
    for (int64_t d = 0; d < hp; d += V::n) {
      V::store(o + r * hp + d, V::add(V::load(o + r * hp + d), V::load(part + r * hp + d)));
      V::store(part + r * hp + d, V::zero());
    }
  };
  for (int64_t t0 = t_begin; t0 <= last; t0 += T) {
    const int64_t nc = std::min<int64_t>(T, last + 1 - t0);
    const int64_t rf = first_row(t0), re = end_row(t0, nc);
    if (rf >= re) continue;
    if (direct) {
      page_rows(a.v_pages, t0, nc, c_first(rf, t0));
    } else {
      load_tile(a.v_pages, t0, nc, c_first(rf, t0));
    }
    for (int64_t r = rf; r < re;) {
      const int64_t p0 = win0(r);
      int64_t rb = 1;
      while (rb < kWvRB && r + rb < re && win0(r + rb) == p0) ++rb;
      // The tile's columns split where a chunk ends: [c0, b) and [b, nc).
      const int64_t c0 = c_first(r, t0);
      const int64_t b = std::min<int64_t>(nc, p0 + ((t0 + c0 - p0) / T + 1) * T - t0);
      for (const auto& [s, e] : {std::pair{c0, b}, std::pair{b, nc}}) {
        if (s >= e) continue;
        int64_t ej[kWvRB], emin = e;
        for (int64_t j = 0; j < rb; ++j) {
          ej[j] = std::max(s, std::min(e, n_valid(r + j, t0, nc)));
          emin = std::min(emin, ej[j]);
        }
        wv_rows(rb, r, t0, s, emin);
        for (int64_t j = 0; j < rb; ++j) {
          wv_rows(1, r + j, t0, emin, ej[j]);
          const int64_t pe = t0 + ej[j];  // one past the row's last position so far
          if (ej[j] > s && ((pe - p0) % T == 0 || pe == a.pos0 + (r + j) / G + 1)) flush(r + j);
        }
      }
      r += rb;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    std::memcpy(a.out + (r / G) * a.q_stride + (r % G) * hd, o + r * hp, size_t(hd) * sizeof(float));
}

inline const KernelTable& table() noexcept {
  static constexpr KernelTable t{TANDEM_ISA_NAME,
                                 fp16_to_fp32_row,
                                 fp32_to_fp16_row,
                                 quantize_row_q8_0,
                                 dequantize_row_q4_0,
                                 dequantize_row_q8_0,
                                 vec_dot_q4_0_q8_0,
                                 vec_dot_q8_0_q8_0,
                                 vec_dot_f32,
                                 vec_dot_f16,
                                 vec_dot_bf16_f32,
                                 gemm_q4_0_q8_0,
                                 gemm_q8_0_q8_0,
                                 gemm_f32_f32,
                                 gemm_f16_f16,
                                 gemm_bf16_f32,
                                 axpy_f16,
                                 vec_dot_f16_rows,
                                 axpy_f16_rows,
                                 thread_prepare,
                                 flash_attn,
                                 attn_tiled,
                                 gemm_q4_0x8_q8_0,
                                 vec_dot_q4_1_q8_0,
                                 gemm_q4_1_q8_0,
                                 vec_dot_q5_0_q8_0,
                                 gemm_q5_0_q8_0,
                                 gemm_q4_1x8_q8_0,
                                 gemm_q5_0x8_q8_0,
                                 vec_dot_q4_k_q8_0,
                                 gemm_q4_k_q8_0,
                                 vec_dot_q6_k_q8_0,
                                 gemm_q6_k_q8_0,
                                 vec_dot_q5_1_q8_0,
                                 gemm_q5_1_q8_0,
                                 vec_dot_q5_k_q8_0,
                                 gemm_q5_k_q8_0,
                                 gemm_q4_kx8_q8_0,
                                 gemm_q6_kx8_q8_0,
                                 swiglu,
                                 attn_split_scores,
                                 attn_split_softmax,
                                 attn_split_wv,
                                 geglu};
  return t;
}

}  // namespace tandem::kernels::detail::TANDEM_ISA_NS
