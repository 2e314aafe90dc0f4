// Shared by the quantised-GEMM tests (test_gpu_tensor_core.cpp, test_gpu_merged_matmuls.cpp):
// a host replica of the dp4a kernel's arithmetic and random Q4_0/Q8_0 blocks with extremes;
// random Q4_1/Q5_0 blocks (test_gpu_quant_types.cpp, against the CPU kernels).
#pragma once

#include <cstdint>
#include <random>
#include <type_traits>
#include <vector>

#include "quant_blocks.hpp"

namespace gemm_test {

namespace k = tandem::kernels;

// Weight value j of a Q4_0 or Q8_0 block (Q4_0: low nibbles are values 0..15, high 16..31).
inline int weight_value(const k::BlockQ4_0& b, int j) {
  return (j < 16 ? (b.qs[j] & 0x0F) : (b.qs[j - 16] >> 4)) - 8;
}
inline int weight_value(const k::BlockQ8_0& b, int j) {
  return b.qs[j];
}

// The dp4a kernel's arithmetic, written out on the host (independent of both GPU kernels):
// 32 lane sums, lane l adding (fp16(d_w) * fp16(d_x)) * float(block dot) for blocks l, l+32,
// ... from 0.0f, then the shuffle tree's pairs (o = 16, 8, 4, 2, 1). volatile keeps a host
// compiler from contracting the multiply-add into an FMA.
template <class WB>
std::vector<float> host_replica(const std::vector<WB>& w, int64_t n, int64_t nb, const std::vector<k::BlockQ8_0>& x,
                                int64_t m) {
  std::vector<float> y(size_t(m * n));
  for (int64_t c = 0; c < m; ++c) {
    for (int64_t r = 0; r < n; ++r) {
      float lane[32] = {};
      for (int64_t b = 0; b < nb; ++b) {
        const WB& wb = w[size_t(r * nb + b)];
        const k::BlockQ8_0& xb = x[size_t(c * nb + b)];
        int32_t dot = 0;
        for (int j = 0; j < 32; ++j) dot += weight_value(wb, j) * int32_t{xb.qs[j]};
        volatile float contribution = (k::fp16_bits_to_fp32(wb.d) * k::fp16_bits_to_fp32(xb.d)) * float(dot);
        lane[b % 32] = lane[b % 32] + contribution;
      }
      for (int o = 16; o > 0; o /= 2) {
        for (int l = 0; l < o; ++l) lane[l] = lane[l] + lane[l + o];
      }
      y[size_t(c * n + r)] = lane[0];
    }
  }
  return y;
}

inline uint16_t random_scale(std::mt19937& g) {
  std::uniform_real_distribution<float> u(-0.05f, 0.05f);
  return k::fp32_to_fp16_bits(u(g));
}

// Activation blocks: random int8 over the full range, with every 5th block all -128 and
// every 7th all 127 (the extremes no float quantiser produces, e.g. a hand-made input).
inline std::vector<k::BlockQ8_0> random_activations(std::mt19937& g, int64_t m, int64_t nb) {
  std::uniform_int_distribution<int> q(-128, 127);
  std::vector<k::BlockQ8_0> x(size_t(m * nb));
  for (size_t i = 0; i < x.size(); ++i) {
    x[i].d = random_scale(g);
    for (auto& v : x[i].qs) v = static_cast<int8_t>(i % 5 == 0 ? -128 : i % 7 == 0 ? 127 : q(g));
  }
  return x;
}

// Q4_1 blocks: random scales, offsets and nibbles; every 3rd block all nibbles 15, every
// 4th all 0 (the ends of the unsigned range).
inline std::vector<k::BlockQ4_1> random_q4_1(std::mt19937& g, size_t count) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> off(-0.4f, 0.1f);
  std::vector<k::BlockQ4_1> w(count);
  for (size_t i = 0; i < count; ++i) {
    w[i].d = random_scale(g);
    w[i].m = k::fp32_to_fp16_bits(off(g));
    for (auto& q : w[i].qs) q = static_cast<uint8_t>(i % 3 == 0 ? 0xFF : i % 4 == 0 ? 0x00 : byte(g));
  }
  return w;
}

// Q5_0 blocks: random scales, nibbles and fifth bits; every 3rd block all 31 (+15 after the
// -16), every 4th all 0 (-16).
inline std::vector<k::BlockQ5_0> random_q5_0(std::mt19937& g, size_t count) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::vector<k::BlockQ5_0> w(count);
  for (size_t i = 0; i < count; ++i) {
    w[i].d = random_scale(g);
    const auto fill = [&] { return static_cast<uint8_t>(i % 3 == 0 ? 0xFF : i % 4 == 0 ? 0x00 : byte(g)); };
    for (auto& h : w[i].qh) h = fill();
    for (auto& q : w[i].qs) q = fill();
  }
  return w;
}

// Q5_1 blocks: random scales, offsets, nibbles and fifth bits; every 3rd block all 31,
// every 4th all 0 (the ends of the unsigned range).
inline std::vector<k::BlockQ5_1> random_q5_1(std::mt19937& g, size_t count) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> off(-0.8f, 0.1f);
  std::vector<k::BlockQ5_1> w(count);
  for (size_t i = 0; i < count; ++i) {
    w[i].d = random_scale(g);
    w[i].m = k::fp32_to_fp16_bits(off(g));
    const auto fill = [&] { return static_cast<uint8_t>(i % 3 == 0 ? 0xFF : i % 4 == 0 ? 0x00 : byte(g)); };
    for (auto& h : w[i].qh) h = fill();
    for (auto& q : w[i].qs) q = fill();
  }
  return w;
}

// Q4_K / Q5_K blocks: random super-block scales and mins, packed 6-bit sub-block scales and
// mins, values (and fifth bits); every 3rd block all bits set (scales, mins 63, every q the
// largest), every 4th all 0.
template <class KB>
std::vector<KB> random_k_min(std::mt19937& g, size_t count) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> mn(0.0f, 0.02f);
  std::vector<KB> w(count);
  for (size_t i = 0; i < count; ++i) {
    w[i].d = random_scale(g);
    w[i].dmin = k::fp32_to_fp16_bits(mn(g));
    const auto fill = [&] { return static_cast<uint8_t>(i % 3 == 0 ? 0xFF : i % 4 == 0 ? 0x00 : byte(g)); };
    for (auto& q : w[i].scales) q = fill();
    if constexpr (std::is_same_v<KB, k::BlockQ5_K>) {
      for (auto& q : w[i].qh) q = fill();
    }
    for (auto& q : w[i].qs) q = fill();
  }
  return w;
}

// Q6_K blocks: random scale, int8 sub-block scales and 6-bit values; every 3rd block every
// q = 31 and scale 127, every 4th every q = -32 and scale -128 (the largest |s * q|).
inline std::vector<k::BlockQ6_K> random_q6_k(std::mt19937& g, size_t count) {
  std::uniform_int_distribution<int> byte(0, 255), scale(-128, 127);
  std::vector<k::BlockQ6_K> w(count);
  for (size_t i = 0; i < count; ++i) {
    w[i].d = random_scale(g);
    const auto fill = [&] { return static_cast<uint8_t>(i % 3 == 0 ? 0xFF : i % 4 == 0 ? 0x00 : byte(g)); };
    for (auto& q : w[i].ql) q = fill();
    for (auto& q : w[i].qh) q = fill();
    for (auto& sc : w[i].scales) sc = static_cast<int8_t>(i % 3 == 0 ? 127 : i % 4 == 0 ? -128 : scale(g));
  }
  return w;
}

}  // namespace gemm_test
