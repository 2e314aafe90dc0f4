// The CUDA kernels' per-block math (kernels/cuda/block_math.cuh), run on the CPU: the
// same __host__ __device__ functions the GPU runs, compared bit for bit with the CPU
// kernels (kernels/cpu) they must agree with. Runs on every build, with or without CUDA.
#include <catch2/catch.hpp>

#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <string_view>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "cuda/block_math.cuh"
#include "tandem/kv/kv_store.hpp"

using namespace tandem;
namespace k = tandem::kernels;
namespace kc = tandem::kernels::cuda;

namespace {

int32_t pack4(int8_t a, int8_t b, int8_t c, int8_t d) {
  const uint32_t u =
      uint32_t(uint8_t(a)) | uint32_t(uint8_t(b)) << 8 | uint32_t(uint8_t(c)) << 16 | uint32_t(uint8_t(d)) << 24;
  int32_t s;
  std::memcpy(&s, &u, 4);
  return s;
}

// The words a kernel loads from the repacked layout (16 quant bytes / 32 int8, little-endian).
void q4_words(const k::BlockQ4_0& b, uint32_t w[4]) {
  std::memcpy(w, b.qs, 16);
}
void q8_words(const k::BlockQ8_0& b, int32_t w[8]) {
  std::memcpy(w, b.qs, 32);
}

k::BlockQ4_0 random_q4(std::mt19937& rng) {
  k::BlockQ4_0 b{};
  b.d = k::fp32_to_fp16_bits(std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng));
  for (auto& q : b.qs) q = static_cast<uint8_t>(rng() & 0xFF);
  return b;
}
k::BlockQ8_0 random_q8(std::mt19937& rng) {
  k::BlockQ8_0 b{};
  b.d = k::fp32_to_fp16_bits(std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng));
  for (auto& q : b.qs) q = static_cast<int8_t>(int(rng() % 256) - 128);
  return b;
}

}  // namespace

TEST_CASE("cuda block math: dp4a emulation is the signed byte dot", "[cuda-math]") {
  CHECK(kc::dp4a(pack4(1, 2, 3, 4), pack4(5, 6, 7, 8), 10) == 10 + 5 + 12 + 21 + 32);
  CHECK(kc::dp4a(pack4(-128, -128, -128, -128), pack4(-128, -128, -128, -128), 0) == 4 * 16384);
  CHECK(kc::dp4a(pack4(127, -128, 0, -1), pack4(-128, 127, 5, -1), -3) == -3 - 16256 - 16256 + 0 + 1);
  std::mt19937 rng(7);
  for (int i = 0; i < 10000; ++i) {
    int8_t a[4], b[4];
    int32_t ref = int32_t(rng() % 1000) - 500;
    const int32_t c = ref;
    for (int j = 0; j < 4; ++j) {
      a[j] = static_cast<int8_t>(int(rng() % 256) - 128);
      b[j] = static_cast<int8_t>(int(rng() % 256) - 128);
      ref += int32_t(a[j]) * int32_t(b[j]);
    }
    REQUIRE(kc::dp4a(pack4(a[0], a[1], a[2], a[3]), pack4(b[0], b[1], b[2], b[3]), c) == ref);
  }
}

TEST_CASE("cuda block math: Q4_0 nibbles minus 8, every value in every byte", "[cuda-math]") {
  for (int byte = 0; byte < 4; ++byte) {
    for (uint32_t lo = 0; lo < 16; ++lo) {
      for (uint32_t hi = 0; hi < 16; ++hi) {
        // The other bytes hold 0xF0 | 0x0F patterns that must not leak across.
        uint32_t word = 0xA5A5A5A5u;
        word &= ~(0xFFu << (8 * byte));
        word |= ((hi << 4) | lo) << (8 * byte);
        const auto l = static_cast<uint32_t>(kc::q4_nibbles_minus8(word, false));
        const auto h = static_cast<uint32_t>(kc::q4_nibbles_minus8(word, true));
        REQUIRE(static_cast<int8_t>(l >> (8 * byte)) == int(lo) - 8);
        REQUIRE(static_cast<int8_t>(h >> (8 * byte)) == int(hi) - 8);
        const int other = (byte + 1) % 4;
        REQUIRE(static_cast<int8_t>(l >> (8 * other)) == 0x5 - 8);
        REQUIRE(static_cast<int8_t>(h >> (8 * other)) == 0xA - 8);
      }
    }
  }
}

TEST_CASE("cuda block math: dp4a block dots equal the shared integer block dots", "[cuda-math]") {
  std::mt19937 rng(42);
  for (int i = 0; i < 20000; ++i) {
    const k::BlockQ4_0 w = random_q4(rng);
    const k::BlockQ8_0 x = random_q8(rng);
    const k::BlockQ8_0 w8 = random_q8(rng);
    uint32_t ww[4];
    int32_t xw[8], w8w[8];
    q4_words(w, ww);
    q8_words(x, xw);
    q8_words(w8, w8w);
    REQUIRE(kc::dot_q4_0_q8_0_words(ww, xw) == k::dot_block_q4_0_q8_0(w, x));
    REQUIRE(kc::dot_q8_0_q8_0_words(w8w, xw) == k::dot_block_q8_0_q8_0(w8, x));
  }
  // Extremes: all nibbles 0 (-8) or 15 (+7) against -128 / 127.
  for (uint8_t nib : {uint8_t(0x00), uint8_t(0xFF), uint8_t(0x0F), uint8_t(0xF0)}) {
    for (int8_t xv : {int8_t(-128), int8_t(127), int8_t(0)}) {
      k::BlockQ4_0 w{};
      k::BlockQ8_0 x{};
      std::memset(w.qs, nib, sizeof w.qs);
      std::memset(x.qs, static_cast<uint8_t>(xv), sizeof x.qs);
      uint32_t ww[4];
      int32_t xw[8];
      q4_words(w, ww);
      q8_words(x, xw);
      CHECK(kc::dot_q4_0_q8_0_words(ww, xw) == k::dot_block_q4_0_q8_0(w, x));
    }
  }
}

TEST_CASE("cuda block math: the GPU warp's sum of block contributions is the CPU dot on every ISA", "[cuda-math]") {
  // gemm_quant_kernel: lane i of the warp adds block_contribution() of blocks i, i + 32, ...
  // from 0.0f, then warp_sum's xor tree (o = 16 .. 1: lane l's v + lane l+o's v). The CPU
  // kernels run the same arithmetic (cpu_kernels.hpp), so the bits must agree.
  std::mt19937 rng(3);
  for (int64_t kdim : {32, 64, 96, 320, 4128}) {
    const int64_t nb = kdim / 32;
    std::vector<k::BlockQ4_0> w(static_cast<size_t>(nb));
    std::vector<k::BlockQ8_0> x(static_cast<size_t>(nb));
    for (auto& b : w) b = random_q4(rng);
    for (auto& b : x) b = random_q8(rng);
    float lane[32] = {};
    for (int64_t b = 0; b < nb; ++b) {
      uint32_t ww[4];
      int32_t xw[8];
      q4_words(w[size_t(b)], ww);
      q8_words(x[size_t(b)], xw);
      lane[b % 32] += kc::block_contribution(w[size_t(b)].d, x[size_t(b)].d, kc::dot_q4_0_q8_0_words(ww, xw));
    }
    for (int o = 16; o > 0; o /= 2)
      for (int l = 0; l < o; ++l) lane[l] += lane[l + o];
    for (const char* isa : {"scalar", "avx2", "avx512", "avx512vnni"}) {
      if (!k::cpu_isa_supported(isa)) continue;
      if (std::string_view(isa) == "scalar")
        k::cpu_force_scalar(true);
      else
        REQUIRE(k::cpu_set_isa(isa));
      INFO(isa << " k = " << kdim);
      const float got = k::vec_dot_q4_0_q8_0(w.data(), x.data(), kdim);
      CHECK(std::bit_cast<uint32_t>(got) == std::bit_cast<uint32_t>(lane[0]));
    }
    k::cpu_force_scalar(false);
  }
}

TEST_CASE("cuda block math: Q5_0 values minus 16, every value in every byte", "[cuda-math]") {
  for (int i = 0; i < 4; ++i) {  // packed word i: weights 4i.. (low nibbles) and 16 + 4i.. (high)
    for (int byte = 0; byte < 4; ++byte) {
      for (uint32_t v = 0; v < 32; ++v) {
        // The other bytes hold nibbles 0x5 / 0xA and fifth bits 1 / 0 that must not leak across.
        uint32_t word = 0xA5A5A5A5u;
        word &= ~(0xFFu << (8 * byte));
        word |= ((((31 - v) & 0xFu) << 4) | (v & 0xFu)) << (8 * byte);
        uint32_t qh = 0x0F0F0F0Fu & ~(1u << (4 * i + byte)) & ~(1u << (16 + 4 * i + byte));
        qh |= (v >> 4) << (4 * i + byte);
        qh |= ((31 - v) >> 4) << (16 + 4 * i + byte);
        const auto l = static_cast<uint32_t>(kc::q5_values_minus16(word, qh, i, false));
        const auto h = static_cast<uint32_t>(kc::q5_values_minus16(word, qh, i, true));
        INFO("word " << i << " byte " << byte << " value " << v);
        REQUIRE(static_cast<int8_t>(l >> (8 * byte)) == int(v) - 16);
        REQUIRE(static_cast<int8_t>(h >> (8 * byte)) == int(31 - v) - 16);
        const int other = (byte + 1) % 4;
        const int other_l = 0x5 + 16 * int((0x0F0F0F0Fu >> (4 * i + other)) & 1u);
        const int other_h = 0xA + 16 * int((0x0F0F0F0Fu >> (16 + 4 * i + other)) & 1u);
        REQUIRE(static_cast<int8_t>(l >> (8 * other)) == other_l - 16);
        REQUIRE(static_cast<int8_t>(h >> (8 * other)) == other_h - 16);
      }
    }
  }
}

TEST_CASE("cuda block math: Q6_K values minus 32 and unsigned 5-bit values, every value in every byte", "[cuda-math]") {
  for (int i = 0; i < 4; ++i) {  // packed word i: weights 4i.. (low nibbles) and 16 + 4i.. (high)
    for (int byte = 0; byte < 4; ++byte) {
      for (uint32_t v = 0; v < 64; ++v) {
        // The other bytes hold nibbles 0x5 / 0xA and top bits 2 / 1 that must not leak across.
        uint32_t word = 0xA5A5A5A5u;
        word &= ~(0xFFu << (8 * byte));
        word |= ((((63 - v) & 0xFu) << 4) | (v & 0xFu)) << (8 * byte);
        const int f = 4 * i + byte;  // the two-bit field of weight 4i + byte in its half's word
        uint32_t lo = 0xAAAAAAAAu & ~(3u << (2 * f)), hi = 0x55555555u & ~(3u << (2 * f));
        lo |= (v >> 4) << (2 * f);
        hi |= ((63 - v) >> 4) << (2 * f);
        const auto l = static_cast<uint32_t>(kc::q6_values_minus32(word, lo, i, false));
        const auto h = static_cast<uint32_t>(kc::q6_values_minus32(word, hi, i, true));
        INFO("word " << i << " byte " << byte << " value " << v);
        REQUIRE(static_cast<int8_t>(l >> (8 * byte)) == int(v) - 32);
        REQUIRE(static_cast<int8_t>(h >> (8 * byte)) == int(63 - v) - 32);
        const int other = (byte + 1) % 4;
        REQUIRE(static_cast<int8_t>(l >> (8 * other)) == 0x5 + 16 * 2 - 32);
        REQUIRE(static_cast<int8_t>(h >> (8 * other)) == 0xA + 16 * 1 - 32);
        if (v < 32) {  // the unsigned 5-bit values (Q5_1, Q5_K) of the same nibbles
          const uint32_t qh = (v >> 4) << f | (((63 - v) >> 4) & 1u) << (16 + f);
          REQUIRE(((kc::q5_values(word, qh, i, false) >> (8 * byte)) & 0xFFu) == v);
          REQUIRE(((kc::q5_values(word, qh, i, true) >> (8 * byte)) & 0xFFu) == ((63 - v) & 0x1Fu));
        }
      }
    }
  }
}

TEST_CASE("cuda block math: the GPU warp's Q4_1 and Q5_0 block sums are the CPU dots on every ISA", "[cuda-math]") {
  // gemm.cu's WeightWords<kQ4_1 / kQ5_0>::contribution in the warp's lane order, against
  // kernels/cpu vec_dot_q4_1_q8_0 / vec_dot_q5_0_q8_0 (docs/arithmetic.md: Q4_1's p_b adds
  // (m_w * d_x) * T_b to (d_w * d_x) * S_b over the unsigned nibbles; Q5_0's S_b is over
  // 5-bit values minus 16).
  std::mt19937 rng(5);
  for (int64_t kdim : {32, 64, 96, 320, 4128}) {
    const int64_t nb = kdim / 32;
    std::vector<k::BlockQ4_1> w1(static_cast<size_t>(nb));
    std::vector<k::BlockQ5_0> w5(static_cast<size_t>(nb));
    std::vector<k::BlockQ8_0> x(static_cast<size_t>(nb));
    for (size_t b = 0; b < w1.size(); ++b) {
      w1[b].d = k::fp32_to_fp16_bits(std::uniform_real_distribution<float>(0.001f, 0.05f)(rng));
      w1[b].m = k::fp32_to_fp16_bits(std::uniform_real_distribution<float>(-0.4f, 0.1f)(rng));
      for (auto& q : w1[b].qs) q = static_cast<uint8_t>(rng() & 0xFF);
      w5[b].d = k::fp32_to_fp16_bits(std::uniform_real_distribution<float>(-0.1f, 0.1f)(rng));
      for (auto& h : w5[b].qh) h = static_cast<uint8_t>(rng() & 0xFF);
      for (auto& q : w5[b].qs) q = static_cast<uint8_t>(rng() & 0xFF);
      x[b] = random_q8(rng);
    }
    float lane1[32] = {}, lane5[32] = {};
    for (int64_t b = 0; b < nb; ++b) {
      const size_t i = size_t(b);
      uint32_t ww1[4], ww5[4], qh;
      int32_t xw[8];
      std::memcpy(ww1, w1[i].qs, 16);
      std::memcpy(ww5, w5[i].qs, 16);
      std::memcpy(&qh, w5[i].qh, 4);
      q8_words(x[i], xw);
      lane1[b % 32] += kc::block_contribution_q4_1(w1[i].d, w1[i].m, x[i].d, kc::dot_q4_1_q8_0_words(ww1, xw),
                                                   kc::sum_q8_words(xw, 8));
      lane5[b % 32] += kc::block_contribution(w5[i].d, x[i].d, kc::dot_q5_0_q8_0_words(ww5, qh, xw));
    }
    for (int o = 16; o > 0; o /= 2) {
      for (int l = 0; l < o; ++l) {
        lane1[l] += lane1[l + o];
        lane5[l] += lane5[l + o];
      }
    }
    for (const char* isa : {"scalar", "avx2", "avx512", "avx512vnni"}) {
      if (!k::cpu_isa_supported(isa)) continue;
      if (std::string_view(isa) == "scalar")
        k::cpu_force_scalar(true);
      else
        REQUIRE(k::cpu_set_isa(isa));
      INFO(isa << " k = " << kdim);
      CHECK(std::bit_cast<uint32_t>(k::vec_dot_q4_1_q8_0(w1.data(), x.data(), kdim)) ==
            std::bit_cast<uint32_t>(lane1[0]));
      CHECK(std::bit_cast<uint32_t>(k::vec_dot_q5_0_q8_0(w5.data(), x.data(), kdim)) ==
            std::bit_cast<uint32_t>(lane5[0]));
    }
    k::cpu_force_scalar(false);
  }
}

TEST_CASE("cuda block math: Q8_0 quantisation is bit-identical to kernels/cpu on every ISA", "[cuda-math]") {
  std::mt19937 rng(11);
  const int64_t nb = 512;
  std::vector<float> x(size_t(nb) * 32);
  std::uniform_real_distribution<float> u(-3.0f, 3.0f);
  for (auto& v : x) v = u(rng);
  // Edge blocks: all zero, one tiny value, exact ties (x * id lands on .5), huge values,
  // negative zero, subnormal scale.
  std::fill(x.begin(), x.begin() + 32, 0.0f);
  std::fill(x.begin() + 32, x.begin() + 64, 0.0f);
  x[40] = 1e-30f;
  for (int j = 0; j < 32; ++j) x[size_t(64 + j)] = (j == 0) ? 127.0f : float(j) + 0.5f;  // id = 1: ties
  for (int j = 0; j < 32; ++j) x[size_t(96 + j)] = (j % 2 ? -1.0f : 1.0f) * 6.0e4f * float(j + 1) / 32.0f;
  for (int j = 0; j < 32; ++j) x[size_t(128 + j)] = -0.0f;
  for (int j = 0; j < 32; ++j) x[size_t(160 + j)] = 1e-6f * float(j - 16);
  for (int j = 0; j < 32; ++j) x[size_t(192 + j)] = (j == 5) ? -254.0f : float(j) * 0.5f - 8.0f;  // id = 0.5
  std::vector<k::BlockQ8_0> mine(static_cast<size_t>(nb));
  for (int64_t b = 0; b < nb; ++b) mine[size_t(b)].d = kc::quantize_block_q8_0(&x[size_t(b) * 32], mine[size_t(b)].qs);
  for (const char* isa : {"scalar", "avx2", "avx512"}) {
    if (!k::cpu_isa_supported(isa)) continue;
    REQUIRE(k::cpu_set_isa(isa));
    std::vector<k::BlockQ8_0> ref(static_cast<size_t>(nb));
    k::quantize_row_q8_0(x.data(), ref.data(), int64_t(x.size()));
    for (int64_t b = 0; b < nb; ++b) {
      INFO(isa << " block " << b);
      REQUIRE(mine[size_t(b)].d == ref[size_t(b)].d);
      REQUIRE(std::memcmp(mine[size_t(b)].qs, ref[size_t(b)].qs, 32) == 0);
    }
  }
  k::cpu_force_scalar(false);  // back to the automatic choice
  // The tie block rounds half to even: 1.5 -> 2, 2.5 -> 2, 3.5 -> 4.
  CHECK(mine[2].qs[1] == 2);
  CHECK(mine[2].qs[2] == 2);
  CHECK(mine[2].qs[3] == 4);
}

TEST_CASE("cuda block math: per-element helpers match the warp formulation", "[cuda-math]") {
  // The device kernel computes amax with a shuffle tree of max() in a different order;
  // max is exact, so the scale is the same. Check q8_scale_from_amax + q8_quantize_value
  // against quantize_block_q8_0 with a reversed-order amax.
  std::mt19937 rng(5);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  for (int i = 0; i < 2000; ++i) {
    float xb[32];
    for (float& v : xb) v = nd(rng);
    int8_t q_ref[32];
    const uint16_t d_ref = kc::quantize_block_q8_0(xb, q_ref);
    float amax = 0.0f;
    for (int j = 31; j >= 0; --j) amax = std::fabs(xb[j]) > amax ? std::fabs(xb[j]) : amax;
    const kc::Q8Scale s = kc::q8_scale_from_amax(amax);
    REQUIRE(s.d == d_ref);
    for (int j = 0; j < 32; ++j) REQUIRE(kc::q8_quantize_value(xb[j], s.id) == q_ref[j]);
  }
}

TEST_CASE("cuda block math: fp16 helpers and KV addressing", "[cuda-math]") {
  for (uint32_t h = 0; h < 0x10000u; ++h) {
    const auto hb = static_cast<uint16_t>(h);
    const float f = kc::h2f(hb);
    if (std::isnan(f)) continue;
    REQUIRE(k::fp32_to_fp16_bits(f) == hb);  // exact round trip
    REQUIRE((kc::round_f16(f) == f || (std::isinf(f) && std::isinf(kc::round_f16(f)))));
  }
  CHECK(kc::round_f16(1.0f + 1.0f / 4096.0f) == 1.0f);  // tie to even
  for (KvDtype dt : {KvDtype::kF16, KvDtype::kF32}) {
    KvLayout l;
    l.n_layer = 3;
    l.n_head_kv = 4;
    l.head_dim = 48;
    l.page_size = 16;
    l.dtype = dt;
    for (int32_t layer = 0; layer < 3; ++layer) {
      for (int kind = 0; kind < 2; ++kind) {
        for (int32_t slot : {0, 1, 15}) {
          const int64_t e = kc::kv_row_elem_offset(layer, kind, slot, l.page_size, int32_t(l.row_elems()));
          REQUIRE(size_t(e) * l.elem_bytes() == l.row_offset(layer, kind, slot));
        }
      }
    }
  }
}
