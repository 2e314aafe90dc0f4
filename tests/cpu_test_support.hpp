// Helpers for CPU-kernel tests: the ISAs this machine runs, a scope that forces one, and
// random rows (f32, Q4_0 and Q8_0 blocks) from a seeded generator, and attention arguments.
#pragma once

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "cpu/cpu_kernels.hpp"

namespace tandem::test {

/// Every ISA this machine can run, widest first, always ending with "scalar".
inline std::vector<std::string> isas() {
  std::vector<std::string> out;
  for (const char* n : {"avx512vnni", "avx512", "avx2", "scalar"})
    if (kernels::cpu_isa_supported(n)) out.emplace_back(n);
  return out;
}

/// Selects one ISA for the scope (REQUIREs that it took); restores the automatic choice
/// afterwards. Process-wide: not for tests that run kernels on other threads meanwhile.
struct IsaScope {
  explicit IsaScope(const std::string& isa) {
    if (isa == "scalar")
      kernels::cpu_force_scalar(true);
    else
      REQUIRE(kernels::cpu_set_isa(isa));
    REQUIRE(kernels::cpu_isa_name() == isa);
  }
  ~IsaScope() { kernels::cpu_force_scalar(false); }
  IsaScope(const IsaScope&) = delete;
  IsaScope& operator=(const IsaScope&) = delete;
};

/// n floats uniform in [lo, hi), drawn in order from g.
inline std::vector<float> rand_f32(std::mt19937& g, size_t n, float lo = -1.f, float hi = 1.f) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<float> v(n);
  for (auto& x : v) x = d(g);
  return v;
}

/// nblocks Q4_0 blocks: scales uniform in [0.001, 0.05), random nibbles.
inline std::vector<kernels::BlockQ4_0> rand_q4(std::mt19937& g, size_t nblocks) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f);
  std::vector<kernels::BlockQ4_0> v(nblocks);
  for (auto& b : v) {
    b.d = kernels::fp32_to_fp16(sc(g));
    for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
  }
  return v;
}

/// nblocks Q8_0 blocks: scales uniform in [0.001, 0.05), quants uniform in [-127, 127].
inline std::vector<kernels::BlockQ8_0> rand_q8(std::mt19937& g, size_t nblocks) {
  std::uniform_int_distribution<int> q8(-127, 127);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f);
  std::vector<kernels::BlockQ8_0> v(nblocks);
  for (auto& b : v) {
    b.d = kernels::fp32_to_fp16(sc(g));
    for (auto& q : b.qs) q = static_cast<int8_t>(q8(g));
  }
  return v;
}

/// Attention arguments for KV head `h` over paged K/V (`row_stride` elements a position,
/// head_dim `hd`), for the `group` query heads of that KV head at positions
/// [pos0, pos0 + n_pos), query and output rows `q_stride` floats apart from position 0;
/// scale 1/sqrt(hd). The KV element type (kv_f16, kv_q8_0) is left to the caller.
inline kernels::FlashAttnArgs attn_args(const void* const* k_pages, const void* const* v_pages, int64_t page_size,
                                        int64_t row_stride, int64_t hd, int64_t h, int32_t group, const float* q,
                                        float* out, int64_t q_stride, int32_t pos0, int32_t n_pos) {
  kernels::FlashAttnArgs a;
  a.k_pages = k_pages;
  a.v_pages = v_pages;
  a.page_size = page_size;
  a.row_stride = row_stride;
  a.head_offset = h * hd;
  a.head_dim = hd;
  a.q = q + pos0 * q_stride + h * group * hd;
  a.out = out + pos0 * q_stride + h * group * hd;
  a.q_stride = q_stride;
  a.pos0 = pos0;
  a.n_pos = n_pos;
  a.group = group;
  a.scale = 1.0f / std::sqrt(static_cast<float>(hd));
  return a;
}

}  // namespace tandem::test
