// The one definition of the quantisation blocks shared by kernels/cpu and kernels/cuda.
//
// Layout as ggml (ggml-common.h) and the GGUF files it writes:
//   Q4_0: 32 weights = fp16 scale d + 16 bytes; byte j holds weight j in its low nibble
//         and weight j+16 in its high nibble; w = d * (q - 8).
//   Q8_0: 32 values  = fp16 scale d + 32 int8;  x = d * q.
// Everything here is plain arithmetic usable from host and device code.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define TANDEM_HD __host__ __device__
#else
#define TANDEM_HD
#endif

// Helpers below are `static inline`: each translation unit gets its own copy, so a copy
// compiled with -mavx512f in one ISA-specific TU can never be picked by the linker for a
// call from the scalar TU (the classic multi-ISA ODR trap).
#define TANDEM_HD_INLINE TANDEM_HD static inline

namespace tandem::kernels {

inline constexpr int kQK = 32;  ///< elements per Q4_0 / Q8_0 block

struct BlockQ4_0 {
  uint16_t d;  ///< IEEE fp16 bits of the scale
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ4_0) == 18, "Q4_0 block must be 18 bytes");

/// Q4_1: weight j = fp16(d) * q_j + fp16(m), q_j in 0..15 (low nibbles: j < 16).
struct BlockQ4_1 {
  uint16_t d;  ///< IEEE fp16 bits of the scale
  uint16_t m;  ///< IEEE fp16 bits of the offset (the block's minimum)
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ4_1) == 20, "Q4_1 block must be 20 bytes");

/// Q5_0: weight j = fp16(d) * (q_j - 16), q_j = its nibble (low nibbles: j < 16) plus 16
/// times bit j of qh (little-endian u32).
struct BlockQ5_0 {
  uint16_t d;  ///< IEEE fp16 bits of the scale
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ5_0) == 22, "Q5_0 block must be 22 bytes");

/// Weights per K-quant super-block (Q4_K, Q5_K, Q6_K): 8 sub-blocks of 32, each paired with one
/// Q8_0 activation block.
inline constexpr int kQK_K = 256;

/// Q4_K: 256 weights in 8 sub-blocks of 32; sub-block j has a 6-bit scale sc_j and min m_j
/// (k4_scale_min) and weight l of it = (fp16(d) * sc_j) * q - fp16(dmin) * m_j, q = the
/// nibble of qs[32 * (j / 2) + l] (the low one for even j, the high one for odd j).
struct BlockQ4_K {
  uint16_t d;     ///< IEEE fp16 bits of the super-block scale
  uint16_t dmin;  ///< IEEE fp16 bits of the super-block scale of the mins
  uint8_t scales[12];
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ4_K) == 144, "Q4_K block must be 144 bytes");

/// Q5_K: Q4_K with a fifth bit: weight l of sub-block j = (fp16(d) * sc_j) * q - fp16(dmin)
/// * m_j, q = the Q4_K nibble plus 16 times bit j of qh[l] (q5k_at).
struct BlockQ5_K {
  uint16_t d;     ///< IEEE fp16 bits of the super-block scale
  uint16_t dmin;  ///< IEEE fp16 bits of the super-block scale of the mins
  uint8_t scales[12];
  uint8_t qh[kQK_K / 8];
  uint8_t qs[kQK_K / 2];
};
static_assert(sizeof(BlockQ5_K) == 176, "Q5_K block must be 176 bytes");

/// Q6_K: 256 weights in 16 sub-blocks of 16, each with an int8 scale; weight e = (fp16(d) *
/// scales[e / 16]) * (q - 32), q (0..63) = 4 low bits from ql and 2 high bits from qh (see
/// q6k_at). 32-element block j (0..7) has the scales 2j and 2j + 1.
struct BlockQ6_K {
  uint8_t ql[kQK_K / 2];  ///< low 4 bits
  uint8_t qh[kQK_K / 4];  ///< high 2 bits
  int8_t scales[kQK_K / 16];
  uint16_t d;  ///< IEEE fp16 bits of the super-block scale
};
static_assert(sizeof(BlockQ6_K) == 210, "Q6_K block must be 210 bytes");

/// Q5_1: weight j = fp16(d) * q_j + fp16(m), q_j (0..31) = its nibble (as Q4_1) plus 16
/// times bit j of qh (little-endian u32).
struct BlockQ5_1 {
  uint16_t d;  ///< IEEE fp16 bits of the scale
  uint16_t m;  ///< IEEE fp16 bits of the offset (the block's minimum)
  uint8_t qh[4];
  uint8_t qs[kQK / 2];
};
static_assert(sizeof(BlockQ5_1) == 24, "Q5_1 block must be 24 bytes");

struct BlockQ8_0 {
  uint16_t d;  ///< IEEE fp16 bits of the scale
  int8_t qs[kQK];
};
static_assert(sizeof(BlockQ8_0) == 34, "Q8_0 block must be 34 bytes");

// ---- fp16 <-> fp32, bit-exact with x86 F16C (VCVTPH2PS / VCVTPS2PH imm=0) -------------

TANDEM_HD_INLINE uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}
TANDEM_HD_INLINE float f32_from_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

/// Exact widening. Subnormals are normalised; Inf stays Inf; NaN keeps sign and payload
/// and becomes quiet (bit 22 set), as VCVTPH2PS does.
TANDEM_HD_INLINE float fp16_bits_to_fp32(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  uint32_t m = h & 0x3FFu;
  uint32_t bits;
  if (e == 0x1F) {
    bits = sign | 0x7F800000u | (m << 13) | (m ? 0x00400000u : 0u);
  } else if (e != 0) {
    bits = sign | ((e + 112u) << 23) | (m << 13);
  } else if (m == 0) {
    bits = sign;
  } else {  // subnormal: m * 2^-24, normalise
    uint32_t e32 = 113;
    while (!(m & 0x400u)) {
      m <<= 1;
      --e32;
    }
    bits = sign | (e32 << 23) | ((m & 0x3FFu) << 13);
  }
  return f32_from_bits(bits);
}

/// Round to nearest, ties to even, with fp16 subnormals, overflow to Inf (|x| >= 65520),
/// NaN -> quiet NaN keeping sign and the top 10 payload bits (as VCVTPS2PH imm=0).
TANDEM_HD_INLINE uint16_t fp32_to_fp16_bits(float f) {
  const uint32_t x = f32_bits(f);
  const uint32_t sign = (x >> 16) & 0x8000u;
  const uint32_t ax = x & 0x7FFFFFFFu;
  if (ax > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((ax >> 13) & 0x3FFu));
  if (ax >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520 -> Inf
  if (ax >= 0x38800000u) {  // normal fp16 result (may round up into the next binade)
    uint32_t h = (ax - 0x38000000u) >> 13;
    const uint32_t rem = ax & 0x1FFFu;
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1u))) ++h;
    return static_cast<uint16_t>(sign | h);
  }
  const uint32_t e = ax >> 23;
  if (e < 102) return static_cast<uint16_t>(sign);  // < 2^-25: rounds to zero
  const uint32_t mant = (ax & 0x7FFFFFu) | 0x800000u;
  const uint32_t s = 126u - e;  // 14..24
  uint32_t h = mant >> s;
  const uint32_t rem = mant & ((1u << s) - 1u);
  const uint32_t half = 1u << (s - 1u);
  if (rem > half || (rem == half && (h & 1u))) ++h;
  return static_cast<uint16_t>(sign | h);
}

TANDEM_HD_INLINE float bf16_bits_to_fp32(uint16_t h) {
  return f32_from_bits(static_cast<uint32_t>(h) << 16);
}

// ---- per-block integer dot products (exact; |result| <= 32*8*128) ----------------------

/// sum_j (q_w[j] - 8) * q_x[j] over one block.
TANDEM_HD_INLINE int32_t dot_block_q4_0_q8_0(const BlockQ4_0& w, const BlockQ8_0& x) {
  int32_t s = 0;
  for (int j = 0; j < kQK / 2; ++j) {
    s += (static_cast<int32_t>(w.qs[j] & 0x0F) - 8) * x.qs[j];
    s += (static_cast<int32_t>(w.qs[j] >> 4) - 8) * x.qs[j + kQK / 2];
  }
  return s;
}
/// sum_j q_w[j] * q_x[j] over one block.
TANDEM_HD_INLINE int32_t dot_block_q8_0_q8_0(const BlockQ8_0& w, const BlockQ8_0& x) {
  int32_t s = 0;
  for (int j = 0; j < kQK; ++j) s += static_cast<int32_t>(w.qs[j]) * x.qs[j];
  return s;
}
/// Block contribution as ggml's x86 path forms it: (fp16(d_w) * fp16(d_x)) * isum in f32.
/// d = 0 gives exactly +-0 for any finite partner; Inf/NaN scales propagate per IEEE
/// (Inf * 0 = NaN when isum or the partner scale is 0).
TANDEM_HD_INLINE float block_scale_product(uint16_t dw, uint16_t dx) {
  return fp16_bits_to_fp32(dw) * fp16_bits_to_fp32(dx);
}

// ---- K-quant unpacking ----------------------------------------------------------------

/// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K block (the 12 packed
/// bytes): j < 4 in the low 6 bits of bytes j and j + 4; otherwise the low 4 bits in byte
/// j + 4 (the scale's in its low nibble, the min's in its high one) and the top 2 bits in
/// the top 2 bits of bytes j - 4 (scale) and j (min).
TANDEM_HD_INLINE void k4_scale_min(const uint8_t* q, int j, int& sc, int& m) {
  if (j < 4) {
    sc = q[j] & 63;
    m = q[j + 4] & 63;
  } else {
    sc = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
    m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
  }
}

/// The 4-bit value (0..15) of weight e (0..255) of a Q4_K block.
TANDEM_HD_INLINE int q4k_at(const BlockQ4_K& w, int e) {
  const uint8_t byte = w.qs[32 * (e / 64) + e % 32];
  return (e / 32) % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
}

/// The 5-bit value (0..31) of weight e (0..255) of a Q5_K block.
TANDEM_HD_INLINE int q5k_at(const BlockQ5_K& w, int e) {
  const uint8_t byte = w.qs[32 * (e / 64) + e % 32];
  const int lo = (e / 32) % 2 == 0 ? (byte & 0x0F) : (byte >> 4);
  return lo | (((w.qh[e % 32] >> (e / 32)) & 1) << 4);
}

/// The 6-bit value minus 32 (-32..31) of weight e (0..255) of a Q6_K block: in half h =
/// e / 128, quarter j = (e % 128) / 32, l = e % 32, the low 4 bits are the nibble (low for
/// j < 2) of ql[64h + 32 (j % 2) + l], the high 2 bits are bits 2j, 2j + 1 of qh[32h + l].
TANDEM_HD_INLINE int q6k_at(const BlockQ6_K& w, int e) {
  const int h = e / 128, j = (e % 128) / 32, l = e % 32;
  const uint8_t lo = w.ql[64 * h + 32 * (j % 2) + l];
  const int lo4 = j < 2 ? (lo & 0x0F) : (lo >> 4);
  const int hi2 = (w.qh[32 * h + l] >> (2 * j)) & 3;
  return (lo4 | (hi2 << 4)) - 32;
}

}  // namespace tandem::kernels
