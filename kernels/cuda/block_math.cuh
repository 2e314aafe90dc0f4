// Per-block math of the CUDA kernels, written once as __host__ __device__ functions so the
// CPU unit tests (tests/test_cuda_block_math.cpp) exercise exactly what the GPU runs.
//
// GPU memory layout of quantised data (a pure rearrangement of the GGUF blocks, nothing
// is re-quantised):
//   Q4_0 weights [n rows][nb = k/32 blocks] -> qs: [n][nb][16] bytes (the block's 16
//       packed bytes, 16-byte aligned so a block is one 128-bit load), d: [n][nb] fp16 bits.
//   Q8_0 weights and Q8_0 activations [m][nb] -> qs: [m][nb][32] int8, d: [m][nb] fp16 bits.
//   Q4_1 weights -> qs and d as Q4_0, m: [n][nb] fp16 bits of the block's offset.
//   Q5_0 weights -> qs and d as Q4_0 (the low four bits), qh: [n][nb] uint32 (bit j = the
//       fifth bit of weight j, the block's little-endian qh).
//   Q5_1 weights -> qs, d and qh as Q5_0, m as Q4_1.
//   K-quants (256-element blocks, nb a multiple of 8): 32-element block b of a row is
//   sub-block b % 8 of weight block b / 8, stored as a 32-element block: qs [n][nb][16] the
//   low four bits of its values in Q4_0's order (byte i: element i low, 16 + i high); d
//   (and Q4_K/Q5_K's dmin in m) [n][nb / 8] per 256-element block; sc [n][nb] uint16 (Q4_K,
//   Q5_K: the 6-bit scale | the 6-bit min << 8; Q6_K: the int8 scales of elements 0-15 |
//   16-31 << 8). Q5_K: qh [n][nb] the fifth bits as Q5_0's. Q6_K: qh [n][nb][2] uint32, word
//   h = elements 16h..16h+15, bits 2e, 2e + 1 = the top two bits of element 16h + e.
// The integer dot of one block is computed with dp4a (four int8 products per
// instruction), or with int8 WMMA in the prefill GEMM (gemm.cu); the result is the
// exact integer S_b of docs/arithmetic.md ("Quantised dot product": Q4_0 nibble - 8, Q5_0
// 5-bit value - 16, Q4_1 / Q5_1 / Q4_K / Q5_K the unsigned value plus T_b = sum q_x, Q6_K
// the 6-bit value - 32 per 16-element half), and the float steps are the CPU's, so CPU and
// GPU agree bit for bit.
#pragma once

#include <cmath>
#include <cstdint>

#include "quant_blocks.hpp"

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#endif

namespace tandem::kernels::cuda {

/// a . b over four signed bytes, plus c (the __dp4a instruction on the device).
TANDEM_HD_INLINE int32_t dp4a(int32_t a, int32_t b, int32_t c) {
#if defined(__CUDA_ARCH__)
  return __dp4a(a, b, c);
#else
  for (int i = 0; i < 4; ++i) {
    c += static_cast<int32_t>(static_cast<int8_t>(static_cast<uint32_t>(a) >> (8 * i))) *
         static_cast<int32_t>(static_cast<int8_t>(static_cast<uint32_t>(b) >> (8 * i)));
  }
  return c;
#endif
}

/// fp16 bits -> float, exact (the hardware conversion on the device; identical for every
/// non-NaN input to quant_blocks.hpp's fp16_bits_to_fp32).
TANDEM_HD_INLINE float h2f(uint16_t h) {
#if defined(__CUDA_ARCH__)
  return __half2float(__ushort_as_half(h));
#else
  return fp16_bits_to_fp32(h);
#endif
}

/// Round a float to fp16 and back (the value an f16 KV cache or f16 activation holds).
TANDEM_HD_INLINE float round_f16(float x) {
  return h2f(fp32_to_fp16_bits(x));
}

/// Four consecutive weight nibbles as four bytes in [0, 15]. `word` holds packed bytes
/// 4i..4i+3 of a block; `high` selects the high nibbles (weights 16+4i..16+4i+3) instead of
/// the low ones (weights 4i..4i+3).
TANDEM_HD_INLINE uint32_t q4_nibbles(uint32_t word, bool high) {
  return (high ? (word >> 4) : word) & 0x0F0F0F0Fu;
}

/// Bytes of four consecutive Q4_0 weight nibbles, minus 8, as four signed bytes.
/// `word` holds packed bytes 4i..4i+3 of a block; `high` selects the high nibbles
/// (weights 16+4i..16+4i+3) instead of the low ones (weights 4i..4i+3).
TANDEM_HD_INLINE int32_t q4_nibbles_minus8(uint32_t word, bool high) {
  const uint32_t v = q4_nibbles(word, high);
  // Each byte is in [0, 15]; v | 0x80 per byte then - 8 never borrows across bytes:
  // (v + 0x78) & 0xFF ^ 0x80 == v - 8 as a signed byte.
  return static_cast<int32_t>(((v + 0x78787878u) ^ 0x80808080u));
}

/// Integer dot of one Q4_0 block (16 packed bytes as 4 words) with one Q8_0 block
/// (32 int8 as 8 words): sum_j (q_w[j] - 8) * q_x[j], exact.
TANDEM_HD_INLINE int32_t dot_q4_0_q8_0_words(const uint32_t w[4], const int32_t x[8]) {
  int32_t s = 0;
  for (int i = 0; i < 4; ++i) {
    s = dp4a(q4_nibbles_minus8(w[i], false), x[i], s);
    s = dp4a(q4_nibbles_minus8(w[i], true), x[4 + i], s);
  }
  return s;
}

/// Four consecutive 5-bit weights (Q5_0, Q5_1, Q5_K) as four bytes in [0, 31]: the nibbles
/// of q4_nibbles(word, high) plus 16 times bits 4i..4i+3 (16+4i.. when `high`) of the block's
/// qh, where `word` is packed word i (0..3) of the block.
TANDEM_HD_INLINE uint32_t q5_values(uint32_t word, uint32_t qh, int i, bool high) {
  const uint32_t b = qh >> (high ? 16 + 4 * i : 4 * i);
  // bit e of b -> bit 4 of byte e
  const uint32_t fifth = ((b & 1u) << 4) | ((b & 2u) << 11) | ((b & 4u) << 18) | ((b & 8u) << 25);
  return q4_nibbles(word, high) | fifth;
}

/// Four consecutive Q5_0 weights minus 16 as four signed bytes (q5_values - 16).
TANDEM_HD_INLINE int32_t q5_values_minus16(uint32_t word, uint32_t qh, int i, bool high) {
  // Each byte is in [0, 31]; + 0x70 stays below 0x100 (no borrow across bytes), and
  // (v + 0x70) ^ 0x80 == v - 16 as a signed byte.
  return static_cast<int32_t>((q5_values(word, qh, i, high) + 0x70707070u) ^ 0x80808080u);
}

/// Four consecutive Q6_K weights minus 32 as four signed bytes: the nibbles of
/// q4_nibbles(word, high) plus 16 times the two-bit fields 4i..4i+3 of `top` (the block
/// half's qh word: elements 16+4i.. when `high`, so `top` is qh word 1 then).
TANDEM_HD_INLINE int32_t q6_values_minus32(uint32_t word, uint32_t top, int i, bool high) {
  const uint32_t b = top >> (8 * i);
  // bits 2e, 2e + 1 of b -> bits 4, 5 of byte e
  const uint32_t hi2 = ((b & 0x03u) << 4) | ((b & 0x0Cu) << 10) | ((b & 0x30u) << 16) | ((b & 0xC0u) << 22);
  const uint32_t v = q4_nibbles(word, high) | hi2;
  // Each byte is in [0, 63]; + 0x60 stays below 0x100, and (v + 0x60) ^ 0x80 == v - 32.
  return static_cast<int32_t>((v + 0x60606060u) ^ 0x80808080u);
}

/// Integer dot of one Q5_0 block (16 packed bytes as 4 words, its qh) with one Q8_0 block:
/// sum_j (q_w[j] - 16) * q_x[j], exact (kernels/cpu s_dot_q's S_b).
TANDEM_HD_INLINE int32_t dot_q5_0_q8_0_words(const uint32_t w[4], uint32_t qh, const int32_t x[8]) {
  int32_t s = 0;
  for (int i = 0; i < 4; ++i) {
    s = dp4a(q5_values_minus16(w[i], qh, i, false), x[i], s);
    s = dp4a(q5_values_minus16(w[i], qh, i, true), x[4 + i], s);
  }
  return s;
}

/// Integer dot of one Q4_1 block's unsigned nibbles (4 words) with one Q8_0 block:
/// S_b = sum_j q_w[j] * q_x[j], q_w in [0, 15], exact.
TANDEM_HD_INLINE int32_t dot_q4_1_q8_0_words(const uint32_t w[4], const int32_t x[8]) {
  int32_t s = 0;
  for (int i = 0; i < 4; ++i) {
    s = dp4a(static_cast<int32_t>(q4_nibbles(w[i], false)), x[i], s);
    s = dp4a(static_cast<int32_t>(q4_nibbles(w[i], true)), x[4 + i], s);
  }
  return s;
}

/// Integer dot of one block's unsigned 5-bit values (Q5_1, Q5_K: 4 words and the fifth bits
/// qh) with one Q8_0 block: S_b = sum_j q_w[j] * q_x[j], q_w in [0, 31], exact.
TANDEM_HD_INLINE int32_t dot_q5_u_q8_0_words(const uint32_t w[4], uint32_t qh, const int32_t x[8]) {
  int32_t s = 0;
  for (int i = 0; i < 4; ++i) {
    s = dp4a(static_cast<int32_t>(q5_values(w[i], qh, i, false)), x[i], s);
    s = dp4a(static_cast<int32_t>(q5_values(w[i], qh, i, true)), x[4 + i], s);
  }
  return s;
}

/// Integer dot of half `h` (elements 16h..16h+15) of one Q6_K 32-element block (4 words,
/// the half's qh word `top`) with the matching 4 words of a Q8_0 block: sum (q - 32) * q_x,
/// exact.
TANDEM_HD_INLINE int32_t dot_q6_k_half_words(const uint32_t w[4], uint32_t top, const int32_t x4[4], bool h) {
  int32_t s = 0;
  for (int i = 0; i < 4; ++i) s = dp4a(q6_values_minus32(w[i], top, i, h), x4[i], s);
  return s;
}

/// Sum of the int8 values of `nw` words (T_b of Q4_1 over a whole block with nw = 8), exact.
TANDEM_HD_INLINE int32_t sum_q8_words(const int32_t* x, int nw) {
  int32_t s = 0;
  for (int i = 0; i < nw; ++i) s = dp4a(0x01010101, x[i], s);
  return s;
}

/// Integer dot of two Q8_0 blocks given as 8 words each, exact.
TANDEM_HD_INLINE int32_t dot_q8_0_q8_0_words(const int32_t w[8], const int32_t x[8]) {
  int32_t s = 0;
  for (int i = 0; i < 8; ++i) s = dp4a(w[i], x[i], s);
  return s;
}

/// The float contribution of one block, as the CPU forms it:
/// (fp16(d_w) * fp16(d_x)) * float(isum).
TANDEM_HD_INLINE float block_contribution(uint16_t dw, uint16_t dx, int32_t isum) {
  return (h2f(dw) * h2f(dx)) * static_cast<float>(isum);
}

/// The float contribution of one Q4_1 block, as the CPU forms it (docs/arithmetic.md):
/// ((fp16(d_w) * fp16(d_x)) * float(S)) + ((fp16(m_w) * fp16(d_x)) * float(T)), S over the
/// unsigned nibbles, T = sum q_x.
TANDEM_HD_INLINE float block_contribution_q4_1(uint16_t dw, uint16_t mw, uint16_t dx, int32_t s, int32_t t) {
  return block_contribution(dw, dx, s) + block_contribution(mw, dx, t);
}

/// The float contribution of one Q4_K / Q5_K 32-element block (docs/arithmetic.md):
/// ((fp16(d) * fp16(d_x)) * float(sc * S)) - ((fp16(dmin) * fp16(d_x)) * float(mn * T)), S over
/// the unsigned values, T = sum q_x; sc, mn the sub-block's 6-bit scale and min.
TANDEM_HD_INLINE float block_contribution_k_min(uint16_t d, uint16_t dmin, uint16_t dx, int32_t sc, int32_t mn,
                                                int32_t s, int32_t t) {
  return block_contribution(d, dx, sc * s) - block_contribution(dmin, dx, mn * t);
}

/// The float contribution of one Q6_K 32-element block: (fp16(d) * fp16(d_x)) * float(s0 *
/// S_lo + s1 * S_hi), `sc` = the int8 scales s0 | s1 << 8 (the device layout's sc).
TANDEM_HD_INLINE float block_contribution_q6_k(uint16_t d, uint16_t dx, uint16_t sc, int32_t lo, int32_t hi) {
  const int32_t s0 = static_cast<int8_t>(sc & 0xFFu), s1 = static_cast<int8_t>(sc >> 8);
  return block_contribution(d, dx, s0 * lo + s1 * hi);
}

// ---- Q8_0 quantisation of activations, exactly as kernels/cpu --------------------------
// amax = max |x| over the block; d = amax / 127 (stored as fp16, round-half-even);
// id = 127 / amax (0 for an all-zero block); q = clamp(round-half-even(x * id)).

struct Q8Scale {
  uint16_t d;  ///< fp16 bits of amax / 127
  float id;    ///< 127 / amax, or 0
};

TANDEM_HD_INLINE Q8Scale q8_scale_from_amax(float amax) {
  Q8Scale s;
  s.d = fp32_to_fp16_bits(amax / 127.f);
  s.id = amax != 0.0f ? 127.f / amax : 0.0f;
  return s;
}

TANDEM_HD_INLINE int8_t q8_quantize_value(float x, float id) {
  const float v = rintf(x * id);  // round half to even (the default rounding mode)
  return static_cast<int8_t>(v > 127.f ? 127 : (v < -128.f ? -128 : static_cast<int>(v)));
}

/// One block of 32 floats -> fp16 scale bits + 32 int8 (the host reference of the
/// one-warp-per-block device kernel, which computes amax with a shuffle reduction).
TANDEM_HD_INLINE uint16_t quantize_block_q8_0(const float* x, int8_t* q) {
  float amax = 0.0f;
  for (int j = 0; j < kQK; ++j) {
    const float a = fabsf(x[j]);
    amax = a > amax ? a : amax;
  }
  const Q8Scale s = q8_scale_from_amax(amax);
  for (int j = 0; j < kQK; ++j) q[j] = q8_quantize_value(x[j], s.id);
  return s.d;
}

// ---- KV page addressing (kv_store.hpp's KvLayout::row_offset, in elements) --------------

/// Element offset inside a page of the K (kind 0) or V (kind 1) row of `slot` in `layer`.
TANDEM_HD_INLINE int64_t kv_row_elem_offset(int32_t layer, int kind, int32_t slot, int32_t page_size,
                                            int32_t row_elems) {
  return ((int64_t(layer) * 2 + kind) * page_size + slot) * int64_t(row_elems);
}

}  // namespace tandem::kernels::cuda
