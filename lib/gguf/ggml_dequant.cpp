// Dequantisation and reference quantisation of ggml blocks. See include/tandem/gguf/ggml_dequant.hpp.
//
// Each routine follows the block's definition in ggml-common.h and repeats the order of
// ggml's f32 operations (ggml-quants.c), so results are bit-identical. This file is built
// with -ffp-contract=off (CMakeLists.txt): a fused multiply-add would round differently.
#include "tandem/gguf/ggml_dequant.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "quant_blocks.hpp"

namespace tandem {

namespace {

using kernels::bf16_bits_to_fp32;
using kernels::fp16_bits_to_fp32;
using kernels::fp32_to_fp16_bits;

uint16_t load_u16(const std::byte* p) {
  uint16_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
float load_fp16(const std::byte* p) {
  return fp16_bits_to_fp32(load_u16(p));
}
const uint8_t* u8(const std::byte* p) {
  return reinterpret_cast<const uint8_t*>(p);
}
float f(int v) {
  return static_cast<float>(v);
}

// block_q4_0 {d; qs[16]}: x = (nibble - 8) * d; low nibbles are elements 0..15.
void dq_q4_0(const std::byte* b, float* y) {
  const float d = load_fp16(b);
  const uint8_t* qs = u8(b + 2);
  for (int j = 0; j < 16; ++j) {
    y[j] = f((qs[j] & 0x0F) - 8) * d;
    y[j + 16] = f((qs[j] >> 4) - 8) * d;
  }
}

// block_q4_1 {d; m; qs[16]}: x = nibble * d + m.
void dq_q4_1(const std::byte* b, float* y) {
  const float d = load_fp16(b);
  const float m = load_fp16(b + 2);
  const uint8_t* qs = u8(b + 4);
  for (int j = 0; j < 16; ++j) {
    y[j] = f(qs[j] & 0x0F) * d + m;
    y[j + 16] = f(qs[j] >> 4) * d + m;
  }
}

// block_q5_0 {d; qh[4]; qs[16]}: bit j of qh is the 5th bit of element j.
void dq_q5_0(const std::byte* b, float* y) {
  const float d = load_fp16(b);
  uint32_t qh;
  std::memcpy(&qh, b + 2, sizeof qh);
  const uint8_t* qs = u8(b + 6);
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10u);
    const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10u);
    y[j] = f(((qs[j] & 0x0F) | h0) - 16) * d;
    y[j + 16] = f(((qs[j] >> 4) | h1) - 16) * d;
  }
}

// block_q5_1 {d; m; qh[4]; qs[16]}: x = q5 * d + m.
void dq_q5_1(const std::byte* b, float* y) {
  const float d = load_fp16(b);
  const float m = load_fp16(b + 2);
  uint32_t qh;
  std::memcpy(&qh, b + 4, sizeof qh);
  const uint8_t* qs = u8(b + 8);
  for (int j = 0; j < 16; ++j) {
    const int h0 = static_cast<int>(((qh >> j) << 4) & 0x10u);
    const int h1 = static_cast<int>((qh >> (j + 12)) & 0x10u);
    y[j] = f((qs[j] & 0x0F) | h0) * d + m;
    y[j + 16] = f((qs[j] >> 4) | h1) * d + m;
  }
}

// block_q8_0 {d; qs[32] int8}: x = q * d.
void dq_q8_0(const std::byte* b, float* y) {
  const float d = load_fp16(b);
  for (int j = 0; j < 32; ++j) y[j] = f(static_cast<int8_t>(u8(b + 2)[j])) * d;
}

// block_q2_K {scales[16]; qs[64]; d; dmin}: 16 sub-blocks of 16; scale byte = (min << 4) |
// scale; x = (d * scale) * q2 - (dmin * min).
void dq_q2_k(const std::byte* b, float* y) {
  const uint8_t* scales = u8(b);
  const uint8_t* q = u8(b + 16);
  const float d = load_fp16(b + 80);
  const float dmin = load_fp16(b + 82);
  int is = 0;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const uint8_t sc = scales[is++];
        const float dl = d * f(sc & 0xF);
        const float ml = dmin * f(sc >> 4);
        for (int l = 0; l < 16; ++l) *y++ = dl * f((q[l + 16 * half] >> shift) & 3) - ml;
      }
      shift += 2;
    }
    q += 32;
  }
}

// block_q3_K {hmask[32]; qs[64]; scales[12]; d}: 16 six-bit signed scales (offset 32)
// packed in 12 bytes; x = (d * (scale - 32)) * (q2 - (hmask bit ? 0 : 4)).
void dq_q3_k(const std::byte* b, float* y) {
  const uint8_t* hm = u8(b);
  const uint8_t* q = u8(b + 32);
  const uint8_t* packed = u8(b + 96);
  const float d_all = load_fp16(b + 108);
  // Unpack: scale i (0..15) has its low 4 bits in packed[i % 8] (low nibble for i < 8,
  // high nibble otherwise) and its high 2 bits in packed[8 + i % 4] at bit 2 * (i / 4).
  int8_t scales[16];
  for (int i = 0; i < 16; ++i) {
    const int lo = i < 8 ? packed[i] & 0xF : packed[i - 8] >> 4;
    const int hi = (packed[8 + i % 4] >> (2 * (i / 4))) & 3;
    scales[i] = static_cast<int8_t>(lo | (hi << 4));
  }
  int is = 0;
  uint8_t m = 1;
  for (int n = 0; n < 256; n += 128) {
    int shift = 0;
    for (int j = 0; j < 4; ++j) {
      for (int half = 0; half < 2; ++half) {
        const float dl = d_all * f(scales[is++] - 32);
        for (int l = 16 * half; l < 16 * half + 16; ++l) {
          *y++ = dl * f(((q[l] >> shift) & 3) - ((hm[l] & m) ? 0 : 4));
        }
      }
      shift += 2;
      m = static_cast<uint8_t>(m << 1);
    }
    q += 32;
  }
}

// block_q4_K {d; dmin; scales[12]; qs[128]}: 8 sub-blocks of 32; x = (d * sc) * q4 - (dmin * m).
void dq_q4_k(const std::byte* b, float* y) {
  const float d = load_fp16(b);
  const float dmin = load_fp16(b + 2);
  const uint8_t* scales = u8(b + 4);
  const uint8_t* q = u8(b + 16);
  for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
    int sc, m;
    kernels::k4_scale_min(scales, is, sc, m);
    const float d1 = d * f(sc), m1 = dmin * f(m);
    kernels::k4_scale_min(scales, is + 1, sc, m);
    const float d2 = d * f(sc), m2 = dmin * f(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * f(q[l] & 0xF) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * f(q[l] >> 4) - m2;
    q += 32;
  }
}

// block_q5_K {d; dmin; scales[12]; qh[32]; qs[128]}: as Q4_K with a 5th bit from qh.
void dq_q5_k(const std::byte* b, float* y) {
  const float d = load_fp16(b);
  const float dmin = load_fp16(b + 2);
  const uint8_t* scales = u8(b + 4);
  const uint8_t* qh = u8(b + 16);
  const uint8_t* ql = u8(b + 48);
  unsigned u1 = 1, u2 = 2;
  for (int j = 0, is = 0; j < 256; j += 64, is += 2) {
    int sc, m;
    kernels::k4_scale_min(scales, is, sc, m);
    const float d1 = d * f(sc), m1 = dmin * f(m);
    kernels::k4_scale_min(scales, is + 1, sc, m);
    const float d2 = d * f(sc), m2 = dmin * f(m);
    for (int l = 0; l < 32; ++l) *y++ = d1 * f((ql[l] & 0xF) + ((qh[l] & u1) ? 16 : 0)) - m1;
    for (int l = 0; l < 32; ++l) *y++ = d2 * f((ql[l] >> 4) + ((qh[l] & u2) ? 16 : 0)) - m2;
    ql += 32;
    u1 <<= 2;
    u2 <<= 2;
  }
}

// block_q6_K {ql[128]; qh[64]; scales[16] int8; d}: x = (d * scale) * (q6 - 32).
void dq_q6_k(const std::byte* b, float* y) {
  const uint8_t* ql = u8(b);
  const uint8_t* qh = u8(b + 128);
  const auto* sc = reinterpret_cast<const int8_t*>(b + 192);
  const float d = load_fp16(b + 208);
  for (int n = 0; n < 256; n += 128) {
    for (int l = 0; l < 32; ++l) {
      const int is = l / 16;
      const int q1 = ((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32;
      const int q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32;
      const int q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
      const int q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
      y[l] = d * f(sc[is]) * f(q1);
      y[l + 32] = d * f(sc[is + 2]) * f(q2);
      y[l + 64] = d * f(sc[is + 4]) * f(q3);
      y[l + 96] = d * f(sc[is + 6]) * f(q4);
    }
    y += 128;
    ql += 64;
    qh += 32;
    sc += 8;
  }
}

// C's (int8_t)(float) as x86 compilers emit it (cvttss2si to 32 bits, keep the low
// byte), defined for every input: out of range or NaN gives 0x80000000, whose low byte is 0.
int8_t truncate_to_int8(float v) {
  const int32_t i =
      (v >= -2147483648.0f && v < 2147483648.0f) ? static_cast<int32_t>(v) : std::numeric_limits<int32_t>::min();
  return static_cast<int8_t>(static_cast<uint32_t>(i) & 0xFFu);
}

}  // namespace

void dequantize_row(GgmlType type, const std::byte* src, float* dst, int64_t k) {
  const int64_t be = ggml_block_elements(type);
  if (be <= 0 || k < 0 || k % be != 0) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("dequantize_row: {} elements of {} (type {})", k,
                                                         ggml_type_name(type), static_cast<uint32_t>(type)));
  }
  const int64_t bb = ggml_block_bytes(type);
  void (*block)(const std::byte*, float*) = nullptr;
  switch (type) {
    case GgmlType::kF32:
      std::memcpy(dst, src, size_t(k) * sizeof(float));
      return;
    case GgmlType::kF16:
      for (int64_t i = 0; i < k; ++i) dst[i] = load_fp16(src + 2 * i);
      return;
    case GgmlType::kBF16:
      for (int64_t i = 0; i < k; ++i) dst[i] = bf16_bits_to_fp32(load_u16(src + 2 * i));
      return;
    case GgmlType::kQ4_0:
      block = dq_q4_0;
      break;
    case GgmlType::kQ4_1:
      block = dq_q4_1;
      break;
    case GgmlType::kQ5_0:
      block = dq_q5_0;
      break;
    case GgmlType::kQ5_1:
      block = dq_q5_1;
      break;
    case GgmlType::kQ8_0:
      block = dq_q8_0;
      break;
    case GgmlType::kQ2_K:
      block = dq_q2_k;
      break;
    case GgmlType::kQ3_K:
      block = dq_q3_k;
      break;
    case GgmlType::kQ4_K:
      block = dq_q4_k;
      break;
    case GgmlType::kQ5_K:
      block = dq_q5_k;
      break;
    case GgmlType::kQ6_K:
      block = dq_q6_k;
      break;
  }
  for (int64_t i = 0; i < k / be; ++i) block(src + i * bb, dst + i * be);
}

void quantize_row_q4_0_ref(const float* x, std::byte* dst, int64_t k) {
  for (int64_t i = 0; i < k / 32; ++i, x += 32, dst += 18) {
    float amax = 0.0f;
    float max = 0.0f;
    for (int j = 0; j < 32; ++j) {
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    }
    const float d = max / -8;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = fp32_to_fp16_bits(d);
    std::memcpy(dst, &dh, sizeof dh);
    for (int j = 0; j < 16; ++j) {
      const auto q0 = static_cast<uint8_t>(std::min(15, int{truncate_to_int8(x[j] * id + 8.5f)}));
      const auto q1 = static_cast<uint8_t>(std::min(15, int{truncate_to_int8(x[j + 16] * id + 8.5f)}));
      dst[2 + j] = static_cast<std::byte>(q0 | (q1 << 4));
    }
  }
}

void quantize_row_q8_0_ref(const float* x, std::byte* dst, int64_t k) {
  for (int64_t i = 0; i < k / 32; ++i, x += 32, dst += 34) {
    float amax = 0.0f;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
    const float d = amax / 127;
    const float id = d != 0.0f ? 1.0f / d : 0.0f;
    const uint16_t dh = fp32_to_fp16_bits(d);
    std::memcpy(dst, &dh, sizeof dh);
    for (int j = 0; j < 32; ++j) dst[2 + j] = static_cast<std::byte>(truncate_to_int8(std::round(x[j] * id)));
  }
}

}  // namespace tandem
