// CPU kernels against plain double-precision references, on every ISA this machine has
// (dispatched SIMD paths and the forced scalar path), plus SIMD-vs-scalar agreement,
// edge blocks (field case B07) and the inner-dimension tail sweep (field case B09, CPU side).
#include <catch2/catch.hpp>

#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <limits>
#include <random>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define TANDEM_TEST_X86 1
#endif

#include "cpu/cpu_kernels.hpp"
#include "cpu_test_support.hpp"
#include "softmax_exp.hpp"
#include "tandem/gguf/ggml_dequant.hpp"
#include "test_support.hpp"

using namespace tandem::kernels;
using tandem::test::isas;
using tandem::test::IsaScope;
using tandem::test::rand_f32;
using tandem::test::rand_q4;
using tandem::test::rand_q8;

namespace {

uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---- double-precision references ----
double ref_w(const BlockQ4_0& b, int j) {
  const int q = j < 16 ? (b.qs[j] & 0x0F) : (b.qs[j - 16] >> 4);
  return static_cast<double>(fp16_to_fp32(b.d)) * (q - 8);
}
double ref_x(const BlockQ8_0& b, int j) {
  return static_cast<double>(fp16_to_fp32(b.d)) * b.qs[j];
}

template <class TW>
double ref_wv(const TW& b, int j) {
  if constexpr (std::is_same_v<TW, BlockQ4_0>)
    return ref_w(b, j);
  else
    return ref_x(b, j);
}

/// Reference dot and sum of |terms| (the scale for the accumulation-order tolerance).
template <class TW>
std::pair<double, double> ref_dot_q(const TW* w, const BlockQ8_0* x, int64_t k) {
  double s = 0, a = 0;
  for (int64_t b = 0; b < k / 32; ++b)
    for (int j = 0; j < 32; ++j) {
      const double t = ref_wv(w[b], j) * ref_x(x[b], j);
      s += t;
      a += std::fabs(t);
    }
  return {s, a};
}

// Accumulation in f32 in a different order than the reference: allow a few ulp per term
// relative to sum |terms|.
constexpr double kRelTol = 1e-5;

}  // namespace

TEST_CASE("cpu kernels: dispatch names an ISA", "[kernels]") {
  const auto name = cpu_isa_name();
  CHECK((name == "avx512vnni" || name == "avx512" || name == "avx2" || name == "scalar"));
  CHECK(cpu_isa_supported("scalar"));
  CHECK_FALSE(cpu_set_isa("sse9"));
  WARN("dispatched ISA: " << std::string(name));
}

#if defined(TANDEM_TEST_X86)
__attribute__((target("f16c"))) static float hw_h2f(uint16_t h) {
  return _cvtsh_ss(h);
}
__attribute__((target("f16c"))) static uint16_t hw_f2h(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, 0));
}
#endif

TEST_CASE("fp16: all 65536 patterns round-trip and match F16C", "[kernels]") {
  int bad_roundtrip = 0, bad_hw = 0;
#if defined(TANDEM_TEST_X86)
  const bool hw = __builtin_cpu_supports("f16c");
#endif
  for (uint32_t h = 0; h < 65536; ++h) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(h));
    const bool nan = ((h >> 10) & 0x1F) == 0x1F && (h & 0x3FF);
    if (!nan && fp32_to_fp16(f) != h) ++bad_roundtrip;
    if (nan && !std::isnan(f)) ++bad_roundtrip;
#if defined(TANDEM_TEST_X86)
    if (hw && bits(hw_h2f(static_cast<uint16_t>(h))) != bits(f)) ++bad_hw;
    if (hw && hw_f2h(f) != fp32_to_fp16(f)) ++bad_hw;
#endif
  }
  CHECK(bad_roundtrip == 0);
  CHECK(bad_hw == 0);

  // Rounding: ties to even, subnormals, overflow.
  CHECK(fp32_to_fp16(65504.f) == 0x7BFF);
  CHECK(fp32_to_fp16(65519.99f) == 0x7BFF);
  CHECK(fp32_to_fp16(65520.f) == 0x7C00);
  CHECK(fp32_to_fp16(-1e9f) == 0xFC00);
  CHECK(fp32_to_fp16(std::ldexp(1.f, -24)) == 0x0001);
  CHECK(fp32_to_fp16(std::ldexp(1.f, -25)) == 0x0000);        // tie -> even (0)
  CHECK(fp32_to_fp16(std::ldexp(3.f, -25)) == 0x0002);        // 1.5 ulp -> 2
  CHECK(fp32_to_fp16(1.f + std::ldexp(1.f, -11)) == 0x3C00);  // tie -> even
  CHECK(fp32_to_fp16(1.f + std::ldexp(3.f, -11)) == 0x3C02);  // tie -> even (up)
  CHECK(fp16_to_fp32(0x0001) == std::ldexp(1.f, -24));
  CHECK(bf16_to_fp32(0x3F80) == 1.0f);
  CHECK(bf16_to_fp32(0xC040) == -3.0f);

#if defined(TANDEM_TEST_X86)
  if (hw) {  // random fp32 bit patterns vs VCVTPS2PH, including NaN payloads
    std::mt19937 g(7);
    int bad = 0;
    for (int i = 0; i < 2000000; ++i) {
      const float f = from_bits(static_cast<uint32_t>(g()));
      if (hw_f2h(f) != fp32_to_fp16(f)) ++bad;
    }
    CHECK(bad == 0);
  }
#endif
}

TEST_CASE("fp16/fp32 row conversions agree bit for bit on every ISA", "[kernels]") {
  std::mt19937 g(11);
  const int64_t n = 1000 + 13;
  std::vector<uint16_t> h(n);
  std::vector<float> f(n);
  for (int64_t i = 0; i < n; ++i) {
    h[i] = static_cast<uint16_t>(g());
    f[i] = from_bits(static_cast<uint32_t>(g()));
  }
  for (const auto& isa : isas()) {
    INFO("isa " << isa);
    IsaScope s(isa);
    std::vector<float> y(n);
    std::vector<uint16_t> hy(n);
    fp16_to_fp32_row(h.data(), y.data(), n);
    fp32_to_fp16_row(f.data(), hy.data(), n);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) {
      if (bits(y[i]) != bits(fp16_to_fp32(h[i]))) ++bad;
      if (hy[i] != fp32_to_fp16(f[i])) ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("quantize_row_q8_0: ggml numerics, bit-exact across ISAs", "[kernels]") {
  std::mt19937 g(1234);
  const int64_t k = 32 * 67;
  std::vector<float> x = rand_f32(g, k, -3.f, 3.f);
  // Block 1: all zero. Block 2: amax = 127 so id = 1 and x*id hits exact .5 ties.
  for (int j = 0; j < 32; ++j) x[32 + j] = 0.f;
  const float ties[] = {0.5f, 1.5f, 2.5f, -0.5f, -1.5f, -2.5f, 126.5f, -126.5f, 127.f, -3.49f};
  for (int j = 0; j < 32; ++j) x[64 + j] = j < 10 ? ties[j] : 0.25f * static_cast<float>(j);
  // Block 3: tiny values (subnormal d), block 4: large values.
  for (int j = 0; j < 32; ++j) x[96 + j] = 1e-6f * static_cast<float>(j - 16);
  for (int j = 0; j < 32; ++j) x[128 + j] = 1e4f * static_cast<float>(j - 16);

  std::vector<BlockQ8_0> ref(k / 32);
  {
    IsaScope s("scalar");
    quantize_row_q8_0(x.data(), ref.data(), k);
  }
  // Scalar path against the definition.
  int bad = 0;
  for (int64_t b = 0; b < k / 32; ++b) {
    double amax = 0;
    for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(static_cast<double>(x[b * 32 + j])));
    const float famax = static_cast<float>(amax);
    if (ref[b].d != fp32_to_fp16(famax / 127.f)) ++bad;
    const float id = famax != 0 ? 127.f / famax : 0.f;
    for (int j = 0; j < 32; ++j) {
      const double v = static_cast<double>(x[b * 32 + j] * id);
      double r = std::floor(v + 0.5);
      if (r - v == 0.5 && std::fmod(r, 2.0) != 0) r -= 1;  // half to even
      if (ref[b].qs[j] != static_cast<int>(r)) ++bad;
    }
  }
  CHECK(bad == 0);
  CHECK(ref[1].d == 0);
  const int8_t want_ties[] = {0, 2, 2, 0, -2, -2, 126, -126, 127, -3};
  for (int j = 0; j < 10; ++j) CHECK(ref[2].qs[j] == want_ties[j]);

  for (const auto& isa : isas()) {
    INFO("isa " << isa);
    IsaScope s(isa);
    std::vector<BlockQ8_0> y(k / 32);
    quantize_row_q8_0(x.data(), y.data(), k);
    CHECK(std::memcmp(y.data(), ref.data(), sizeof(BlockQ8_0) * y.size()) == 0);
  }
}

TEST_CASE("dequantize rows: exact against fp64", "[kernels]") {
  std::mt19937 g(99);
  const int64_t k = 32 * 37;
  auto w4 = rand_q4(g, k / 32);
  auto w8 = rand_q8(g, k / 32);
  for (const auto& isa : isas()) {
    INFO("isa " << isa);
    IsaScope s(isa);
    std::vector<float> y4(k), y8(k);
    dequantize_row_q4_0(w4.data(), y4.data(), k);
    dequantize_row_q8_0(w8.data(), y8.data(), k);
    int bad = 0;
    for (int64_t i = 0; i < k; ++i) {
      if (y4[i] != static_cast<float>(ref_w(w4[i / 32], static_cast<int>(i % 32)))) ++bad;
      if (y8[i] != static_cast<float>(ref_x(w8[i / 32], static_cast<int>(i % 32)))) ++bad;
    }
    CHECK(bad == 0);
  }
}

TEST_CASE("quantised dot products vs fp64 reference and vs scalar", "[kernels]") {
  std::mt19937 g(2024);
  for (int64_t k : {32, 64, 96, 320, 2048, 4128}) {
    auto w4 = rand_q4(g, k / 32);
    auto w8 = rand_q8(g, k / 32);
    auto x = rand_q8(g, k / 32);
    const auto [r4, a4] = ref_dot_q(w4.data(), x.data(), k);
    const auto [r8, a8] = ref_dot_q(w8.data(), x.data(), k);
    float s4 = 0, s8 = 0;
    {
      IsaScope s("scalar");
      s4 = vec_dot_q4_0_q8_0(w4.data(), x.data(), k);
      s8 = vec_dot_q8_0_q8_0(w8.data(), x.data(), k);
    }
    for (const auto& isa : isas()) {
      INFO("isa " << isa << " k " << k);
      IsaScope s(isa);
      const float d4 = vec_dot_q4_0_q8_0(w4.data(), x.data(), k);
      const float d8 = vec_dot_q8_0_q8_0(w8.data(), x.data(), k);
      CHECK(std::fabs(d4 - r4) <= kRelTol * a4);
      CHECK(std::fabs(d8 - r8) <= kRelTol * a8);
      CHECK(std::fabs(d4 - s4) <= kRelTol * a4);
      CHECK(std::fabs(d8 - s8) <= kRelTol * a8);
    }
  }
}

TEST_CASE("float dot products and axpy vs fp64 reference", "[kernels]") {
  std::mt19937 g(5);
  for (int64_t n : {1, 7, 16, 33, 100, 4099}) {
    auto a = rand_f32(g, n), b = rand_f32(g, n);
    std::vector<uint16_t> ah(n), bh(n), ab(n);
    for (int64_t i = 0; i < n; ++i) {
      ah[i] = fp32_to_fp16(a[i]);
      bh[i] = fp32_to_fp16(b[i]);
      ab[i] = static_cast<uint16_t>(bits(a[i]) >> 16);
    }
    double r32 = 0, r16 = 0, rb = 0, abs32 = 0, abs16 = 0, absb = 0;
    for (int64_t i = 0; i < n; ++i) {
      r32 += static_cast<double>(a[i]) * b[i];
      abs32 += std::fabs(static_cast<double>(a[i]) * b[i]);
      const double p16 = static_cast<double>(fp16_to_fp32(ah[i])) * fp16_to_fp32(bh[i]);
      r16 += p16;
      abs16 += std::fabs(p16);
      const double pb = static_cast<double>(bf16_to_fp32(ab[i])) * b[i];
      rb += pb;
      absb += std::fabs(pb);
    }
    for (const auto& isa : isas()) {
      INFO("isa " << isa << " n " << n);
      IsaScope s(isa);
      CHECK(std::fabs(vec_dot_f32(a.data(), b.data(), n) - r32) <= kRelTol * abs32 + 1e-30);
      CHECK(std::fabs(vec_dot_f16(ah.data(), bh.data(), n) - r16) <= kRelTol * abs16 + 1e-30);
      CHECK(std::fabs(vec_dot_bf16_f32(ab.data(), b.data(), n) - rb) <= kRelTol * absb + 1e-30);
      std::vector<float> y = b;
      axpy_f16(0.75f, ah.data(), y.data(), n);
      int bad = 0;
      for (int64_t i = 0; i < n; ++i) {
        const double want = static_cast<double>(b[i]) + 0.75 * fp16_to_fp32(ah[i]);
        if (std::fabs(y[i] - want) > 1e-6 * (std::fabs(b[i]) + 1.0)) ++bad;
      }
      CHECK(bad == 0);
    }
  }
}

namespace {

/// Runs one gemm through `call(y, r0, r1)` and checks it against ref (m x n, ldy = n + 3).
template <class Call>
void check_gemm(const std::string& what, int64_t m, int64_t n, const std::vector<double>& ref,
                const std::vector<double>& abs, Call call) {
  INFO(what << " m " << m << " n " << n);
  const int64_t ldy = n + 3;
  std::vector<float> y(m * ldy, std::numeric_limits<float>::quiet_NaN());
  call(y.data(), ldy, int64_t{0}, n);
  int bad = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < n; ++r)
      if (!(std::fabs(y[i * ldy + r] - ref[i * n + r]) <= kRelTol * abs[i * n + r] + 1e-30)) ++bad;
  CHECK(bad == 0);
  // Padding untouched.
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = n; r < ldy; ++r) CHECK(std::isnan(y[i * ldy + r]));
  // Row-range split gives exactly the same as the full call.
  std::vector<float> y2(m * ldy, std::numeric_limits<float>::quiet_NaN());
  const int64_t cut1 = n / 3, cut2 = (2 * n) / 3 + 1;
  call(y2.data(), ldy, int64_t{0}, cut1);
  call(y2.data(), ldy, cut1, cut2);
  call(y2.data(), ldy, cut2, n);
  int diff = 0;
  for (int64_t i = 0; i < m; ++i)
    for (int64_t r = 0; r < n; ++r)
      if (bits(y2[i * ldy + r]) != bits(y[i * ldy + r])) ++diff;
  CHECK(diff == 0);
}

}  // namespace

TEST_CASE("gemm kernels vs fp64 reference, tails, row-range split", "[kernels]") {
  std::mt19937 g(77);
  const int64_t n = 13;  // not a multiple of any row tile
  for (int64_t k : {32, 96, 320}) {
    for (int64_t m : {1, 2, 3, 5, 8, 17}) {
      auto w4 = rand_q4(g, n * k / 32);
      auto w8 = rand_q8(g, n * k / 32);
      auto xq = rand_q8(g, m * k / 32);
      auto wf = rand_f32(g, n * k), xf = rand_f32(g, m * k);
      std::vector<uint16_t> wh(n * k), xh(m * k), wb(n * k);
      for (int64_t i = 0; i < n * k; ++i) {
        wh[i] = fp32_to_fp16(wf[i]);
        wb[i] = static_cast<uint16_t>(bits(wf[i]) >> 16);
      }
      for (int64_t i = 0; i < m * k; ++i) xh[i] = fp32_to_fp16(xf[i]);
      const int64_t nb = k / 32;
      std::vector<double> r4(m * n), a4(m * n), r8(m * n), a8(m * n), rf(m * n), af(m * n), rh(m * n), ah(m * n),
          rb(m * n), ab(m * n);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < n; ++r) {
          std::tie(r4[i * n + r], a4[i * n + r]) = ref_dot_q(&w4[r * nb], &xq[i * nb], k);
          std::tie(r8[i * n + r], a8[i * n + r]) = ref_dot_q(&w8[r * nb], &xq[i * nb], k);
          double s1 = 0, s2 = 0, s3 = 0, t1 = 0, t2 = 0, t3 = 0;
          for (int64_t j = 0; j < k; ++j) {
            const double p1 = static_cast<double>(wf[r * k + j]) * xf[i * k + j];
            const double p2 = static_cast<double>(fp16_to_fp32(wh[r * k + j])) * fp16_to_fp32(xh[i * k + j]);
            const double p3 = static_cast<double>(bf16_to_fp32(wb[r * k + j])) * xf[i * k + j];
            s1 += p1, s2 += p2, s3 += p3;
            t1 += std::fabs(p1), t2 += std::fabs(p2), t3 += std::fabs(p3);
          }
          rf[i * n + r] = s1, rh[i * n + r] = s2, rb[i * n + r] = s3;
          af[i * n + r] = t1, ah[i * n + r] = t2, ab[i * n + r] = t3;
        }
      for (const auto& isa : isas()) {
        IsaScope s(isa);
        const std::string tag = isa + " k " + std::to_string(k);
        check_gemm(tag + " q4_0", m, n, r4, a4, [&](float* y, int64_t ldy, int64_t r0, int64_t r1) {
          gemm_q4_0_q8_0(w4.data(), xq.data(), y, k, m, ldy, r0, r1);
        });
        check_gemm(tag + " q8_0", m, n, r8, a8, [&](float* y, int64_t ldy, int64_t r0, int64_t r1) {
          gemm_q8_0_q8_0(w8.data(), xq.data(), y, k, m, ldy, r0, r1);
        });
        check_gemm(tag + " f32", m, n, rf, af, [&](float* y, int64_t ldy, int64_t r0, int64_t r1) {
          gemm_f32_f32(wf.data(), xf.data(), y, k, m, ldy, r0, r1);
        });
        check_gemm(tag + " f16", m, n, rh, ah, [&](float* y, int64_t ldy, int64_t r0, int64_t r1) {
          gemm_f16_f16(wh.data(), xh.data(), y, k, m, ldy, r0, r1);
        });
        check_gemm(tag + " bf16", m, n, rb, ab, [&](float* y, int64_t ldy, int64_t r0, int64_t r1) {
          gemm_bf16_f32(wb.data(), xf.data(), y, k, m, ldy, r0, r1);
        });
        // The quantised gemm agrees exactly with the single-row dot on the same ISA.
        float y00 = 0;
        gemm_q4_0_q8_0(w4.data(), xq.data(), &y00, k, 1, 1, 0, 1);
        CHECK(bits(y00) == bits(vec_dot_q4_0_q8_0(w4.data(), xq.data(), k)));
      }
    }
  }
}

TEST_CASE("edge blocks: zero, subnormal, 65504, Inf/NaN scales (B07)", "[kernels]") {
  BlockQ4_0 w{};
  std::memset(w.qs, 0x0F, sizeof w.qs);
  std::vector<float> ones(32, 1.0f);
  std::mt19937 g(3);
  auto xr = rand_f32(g, 32, -100.f, 100.f);

  for (const auto& isa : isas()) {
    INFO("isa " << isa);
    IsaScope s(isa);
    BlockQ8_0 x1{}, xr8{}, x0{};
    quantize_row_q8_0(ones.data(), &x1, 32);
    quantize_row_q8_0(xr.data(), &xr8, 32);
    std::vector<float> zeros(32, 0.f);
    quantize_row_q8_0(zeros.data(), &x0, 32);
    CHECK(x0.d == 0);
    std::vector<float> y(32);

    // Zero block (d = 0): all elements exactly 0, dot exactly 0 with any finite vector.
    w.d = 0x0000;
    dequantize_row_q4_0(&w, y.data(), 32);
    for (float v : y) CHECK(v == 0.0f);
    CHECK(vec_dot_q4_0_q8_0(&w, &x1, 32) == 0.0f);
    CHECK(vec_dot_q4_0_q8_0(&w, &xr8, 32) == 0.0f);
    float yg[3] = {NAN, NAN, NAN};
    gemm_q4_0_q8_0(&w, &xr8, yg, 32, 1, 1, 0, 1);
    CHECK(yg[0] == 0.0f);

    // Subnormal scale: exact.
    w.d = 0x0001;
    dequantize_row_q4_0(&w, y.data(), 32);
    CHECK(y[0] == std::ldexp(7.f, -24));
    CHECK(y[16] == std::ldexp(-8.f, -24));
    {
      const auto [r, a] = ref_dot_q(&w, &xr8, 32);
      CHECK(std::fabs(vec_dot_q4_0_q8_0(&w, &xr8, 32) - r) <= kRelTol * a);
    }

    // 65504 (0x7BFF): elements 0-15 = 458528, 16-31 = -524032; dot with 32 x 1.0.
    w.d = 0x7BFF;
    dequantize_row_q4_0(&w, y.data(), 32);
    for (int j = 0; j < 16; ++j) CHECK(y[j] == 458528.0f);
    for (int j = 16; j < 32; ++j) CHECK(y[j] == -524032.0f);
    const float dmax = vec_dot_q4_0_q8_0(&w, &x1, 32);
    CHECK(std::fabs(dmax - (-1048064.0)) <= 1e-3 * 1048064.0);
    gemm_q4_0_q8_0(&w, &x1, yg, 32, 1, 1, 0, 1);
    CHECK(bits(yg[0]) == bits(dmax));

    // +Inf scale: dequantises to [+inf x16, -inf x16]. The dot is -Inf on every ISA: the
    // arithmetic scales the block's whole integer dot (Inf * -2032). Against an all-zero
    // activation block it is NaN (Inf * 0).
    w.d = 0x7C00;
    dequantize_row_q4_0(&w, y.data(), 32);
    for (int j = 0; j < 16; ++j) CHECK((std::isinf(y[j]) && y[j] > 0));
    for (int j = 16; j < 32; ++j) CHECK((std::isinf(y[j]) && y[j] < 0));
    const float dinf = vec_dot_q4_0_q8_0(&w, &x1, 32);
    CHECK((std::isinf(dinf) && dinf < 0));
    CHECK(std::isnan(vec_dot_q4_0_q8_0(&w, &x0, 32)));
    // -Inf scale mirrors it.
    w.d = 0xFC00;
    const float dninf = vec_dot_q4_0_q8_0(&w, &x1, 32);
    CHECK((std::isinf(dninf) && dninf > 0));
    // NaN scale: every element and the dot are NaN.
    w.d = 0x7E00;
    dequantize_row_q4_0(&w, y.data(), 32);
    for (float v : y) CHECK(std::isnan(v));
    CHECK(std::isnan(vec_dot_q4_0_q8_0(&w, &x1, 32)));
    gemm_q4_0_q8_0(&w, &x1, yg, 32, 1, 1, 0, 1);
    CHECK(std::isnan(yg[0]));
  }
}

TEST_CASE("B09: Q4_0 gemm inner-dimension tails, CPU side", "[kernels]") {
  constexpr int64_t kRows = 64;
  for (int64_t k : {32, 64, 96, 320, 4128}) {
    std::mt19937 g(static_cast<uint32_t>(9000 + k));
    const int64_t nb = k / 32;
    auto w = rand_q4(g, kRows * nb);
    std::vector<double> wd(kRows * k);
    for (int64_t r = 0; r < kRows; ++r)
      for (int64_t j = 0; j < k; ++j) wd[r * k + j] = ref_w(w[r * nb + j / 32], static_cast<int>(j % 32));
    for (int64_t m : {1, 2, 8, 33, 512}) {
      auto x = rand_f32(g, m * k);
      std::vector<double> ref(m * kRows);
      double maxref = 0;
      for (int64_t i = 0; i < m; ++i)
        for (int64_t r = 0; r < kRows; ++r) {
          double s = 0;
          for (int64_t j = 0; j < k; ++j) s += wd[r * k + j] * x[i * k + j];
          ref[i * kRows + r] = s;
          maxref = std::max(maxref, std::fabs(s));
        }
      std::vector<float> first;
      for (const auto& isa : isas()) {
        INFO("isa " << isa << " K " << k << " M " << m);
        IsaScope s(isa);
        std::vector<BlockQ8_0> xq(m * nb);
        for (int64_t i = 0; i < m; ++i) quantize_row_q8_0(&x[i * k], &xq[i * nb], k);
        std::vector<float> y(m * kRows, std::numeric_limits<float>::quiet_NaN());
        gemm_q4_0_q8_0(w.data(), xq.data(), y.data(), k, m, kRows, 0, kRows);
        int nan = 0, bad = 0, diff = 0;
        for (int64_t i = 0; i < m * kRows; ++i) {
          if (std::isnan(y[i])) ++nan;
          if (!(std::fabs(y[i] - ref[i]) <= 0.01 * maxref)) ++bad;
          if (!first.empty() && !(std::fabs(y[i] - first[i]) <= 0.01 * maxref)) ++diff;
        }
        CHECK(nan == 0);
        CHECK(bad == 0);
        CHECK(diff == 0);
        if (first.empty()) first = y;
      }
    }
  }
}

TEST_CASE("gemm is batch-invariant: each column equals its own GEMV bit for bit", "[kernels]") {
  // A sequence's logits must not depend on what else shares its batch (continuous
  // batching, prefill chunking): every output column of an m-column gemm equals the
  // m == 1 call on that column alone, on every ISA and for every weight type.
  std::mt19937 g(99);
  const int64_t n = 11;
  for (int64_t k : {32, 64, 96, 352}) {
    const int64_t m = 9, nb = k / 32;
    auto w4 = rand_q4(g, n * nb);
    auto w8 = rand_q8(g, n * nb);
    auto xq = rand_q8(g, m * nb);
    auto wf = rand_f32(g, n * k), xf = rand_f32(g, m * k);
    std::vector<uint16_t> wh(n * k), xh(m * k);
    for (int64_t i = 0; i < n * k; ++i) wh[i] = fp32_to_fp16(wf[i]);
    for (int64_t i = 0; i < m * k; ++i) xh[i] = fp32_to_fp16(xf[i]);
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      auto check = [&](const char* what, auto&& run) {
        std::vector<float> all(m * n), one(n);
        run(0, m, all.data());
        for (int64_t c = 0; c < m; ++c) {
          run(c, 1, one.data());
          for (int64_t r = 0; r < n; ++r) {
            INFO(isa << " " << what << " k " << k << " column " << c << " row " << r);
            CHECK(bits(all[c * n + r]) == bits(one[r]));
          }
        }
      };
      check("q4_0",
            [&](int64_t c, int64_t mm, float* y) { gemm_q4_0_q8_0(w4.data(), xq.data() + c * nb, y, k, mm, n, 0, n); });
      check("q8_0",
            [&](int64_t c, int64_t mm, float* y) { gemm_q8_0_q8_0(w8.data(), xq.data() + c * nb, y, k, mm, n, 0, n); });
      check("f32",
            [&](int64_t c, int64_t mm, float* y) { gemm_f32_f32(wf.data(), xf.data() + c * k, y, k, mm, n, 0, n); });
      check("f16",
            [&](int64_t c, int64_t mm, float* y) { gemm_f16_f16(wh.data(), xh.data() + c * k, y, k, mm, n, 0, n); });
    }
  }
}

namespace {

// The repacked kernel's arithmetic, written from its contract (cpu_kernels.hpp) on the
// GGUF blocks: per (row, column), acc = fma(f32(d_w) * f32(d_x), f32(S_b), acc) over the
// blocks in order, S_b the exact integer block dot.
/// The quantised dot arithmetic as cpu_kernels.hpp writes it (an independent transcription):
/// p_b = (d_w * d_x) * S_b into lane b % 32, then the tree o = 16, 8, 4, 2, 1.
float ref_q4_0x8(const BlockQ4_0* w, const BlockQ8_0* x, int64_t nb) {
  float lane[32] = {};
  for (int64_t b = 0; b < nb; ++b) {
    int32_t s = 0;
    for (int j = 0; j < 16; ++j)
      s += ((w[b].qs[j] & 0x0F) - 8) * x[b].qs[j] + ((w[b].qs[j] >> 4) - 8) * x[b].qs[j + 16];
    const float d = fp16_to_fp32(w[b].d) * fp16_to_fp32(x[b].d);
    lane[b % 32] = lane[b % 32] + d * static_cast<float>(s);
  }
  for (int o = 16; o > 0; o /= 2)
    for (int l = 0; l < o; ++l) lane[l] = lane[l] + lane[l + o];
  return lane[0];
}

std::vector<BlockQ4_0x8> repack(const std::vector<BlockQ4_0>& w, int64_t n, int64_t k) {
  std::vector<BlockQ4_0x8> out(static_cast<size_t>(q4_0x8_records(n, k)));
  repack_q4_0x8(w.data(), n, k, out.data(), 0, (n + 7) / 8);
  return out;
}

}  // namespace

TEST_CASE("repacked Q4_0 (x8): layout as documented, padding rows zero", "[kernels]") {
  std::mt19937 g(5);
  const int64_t n = 11, k = 64, nb = 2;
  auto w = rand_q4(g, n * nb);
  auto p = repack(w, n, k);
  REQUIRE(p.size() == 2 * nb);
  for (int64_t row = 0; row < 16; ++row)
    for (int64_t b = 0; b < nb; ++b) {
      const BlockQ4_0x8& rec = p[(row / 8) * nb + b];
      const int r = static_cast<int>(row % 8);
      INFO("row " << row << " block " << b);
      CHECK(rec.d[r] == (row < n ? w[row * nb + b].d : 0));
      for (int j = 0; j < 4; ++j)
        for (int i = 0; i < 4; ++i)
          CHECK(rec.qs[32 * j + 4 * r + i] == (row < n ? w[row * nb + b].qs[4 * j + i] : 0x88));
    }
}

TEST_CASE("repacked Q4_0 gemm: bit-identical to its reference on every ISA, any row range and m", "[kernels]") {
  std::mt19937 g(2024);
  struct Shape {
    int64_t k, n;
  };
  for (const Shape sh : {Shape{32, 1}, Shape{96, 13}, Shape{896, 37}, Shape{2048, 19}, Shape{5632, 9}}) {
    const int64_t k = sh.k, n = sh.n, nb = k / 32, m = 6;
    auto w = rand_q4(g, n * nb);
    auto xq = rand_q8(g, m * nb);
    xq[0].qs[3] = -128;  // the int8 extreme the i16 sums must still hold
    const auto p = repack(w, n, k);
    std::vector<float> want(m * n);
    for (int64_t c = 0; c < m; ++c)
      for (int64_t r = 0; r < n; ++r) {
        want[c * n + r] = ref_q4_0x8(w.data() + r * nb, xq.data() + c * nb, nb);
        const auto [ref, scale] = ref_dot_q(w.data() + r * nb, xq.data() + c * nb, k);
        CHECK(std::fabs(want[c * n + r] - ref) <= kRelTol * scale);  // the reference itself is sane
      }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      for (int64_t mm : {int64_t{1}, int64_t{2}, int64_t{5}, m}) {
        // whole range, a split at a group boundary and one inside a group
        for (int64_t split : {int64_t{0}, std::min<int64_t>(8, n), n / 2}) {
          std::vector<float> y(mm * n, -1.0f);
          gemm_q4_0x8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, 0, split);
          gemm_q4_0x8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, split, n);
          for (int64_t c = 0; c < mm; ++c)
            for (int64_t r = 0; r < n; ++r) {
              INFO(isa << " k " << k << " n " << n << " m " << mm << " split " << split << " column " << c << " row "
                       << r);
              CHECK(bits(y[c * n + r]) == bits(want[c * n + r]));
            }
          // the GGUF-layout kernel runs the same arithmetic: repack on or off, same bits
          std::vector<float> u(mm * n, -1.0f);
          gemm_q4_0_q8_0(w.data(), xq.data(), u.data(), k, mm, n, 0, n);
          for (int64_t i = 0; i < mm * n; ++i) CHECK(bits(u[i]) == bits(want[i]));
        }
      }
    }
  }
}

TEST_CASE("repacked Q4_0 gemm is batch-invariant: each column equals its own GEMV bit for bit", "[kernels]") {
  std::mt19937 g(77);
  const int64_t n = 21;
  for (int64_t k : {32, 352, 896}) {
    const int64_t m = 11, nb = k / 32;
    auto w = rand_q4(g, n * nb);
    auto xq = rand_q8(g, m * nb);
    const auto p = repack(w, n, k);
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      std::vector<float> all(m * n), one(n);
      gemm_q4_0x8_q8_0(p.data(), xq.data(), all.data(), k, m, n, 0, n);
      for (int64_t c = 0; c < m; ++c) {
        gemm_q4_0x8_q8_0(p.data(), xq.data() + c * nb, one.data(), k, 1, n, 0, n);
        for (int64_t r = 0; r < n; ++r) {
          INFO(isa << " k " << k << " column " << c << " row " << r);
          CHECK(bits(all[c * n + r]) == bits(one[r]));
        }
      }
    }
  }
}

TEST_CASE("repacked Q4_1 gemm: layout as documented, the GGUF-layout kernel's bits on every ISA, any row range and m",
          "[kernels][q4_1]") {
  std::mt19937 g(411);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f), mn(-0.4f, 0.1f);
  struct Shape {
    int64_t k, n;
  };
  // n: 1, 2, 3, 5 row groups (odd counts leave a lone group beside the AVX-512 pairs) and tails
  for (const Shape sh : {Shape{32, 1}, Shape{96, 13}, Shape{896, 37}, Shape{2048, 19}, Shape{1152, 16}}) {
    const int64_t k = sh.k, n = sh.n, nb = k / 32, m = 6;
    std::vector<BlockQ4_1> w(static_cast<size_t>(n * nb));
    for (auto& b : w) {
      b.d = fp32_to_fp16(sc(g));
      b.m = fp32_to_fp16(mn(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
    }
    w[0].m = fp32_to_fp16(-65504.0f);  // extreme scale and min: the m * T_b term at full range
    w[0].d = fp32_to_fp16(65504.0f);
    auto xq = rand_q8(g, m * nb);
    xq[0].qs[3] = -128;
    std::vector<BlockQ4_1x8> p(static_cast<size_t>(q4_0x8_records(n, k)));
    repack_q4_1x8(w.data(), n, k, p.data(), 0, (n + 7) / 8);
    for (int64_t row = 0; row < (n + 7) / 8 * 8; ++row)
      for (int64_t b = 0; b < nb; ++b) {
        const BlockQ4_1x8& rec = p[static_cast<size_t>((row / 8) * nb + b)];
        const int r = static_cast<int>(row % 8);
        const bool real = row < n;
        INFO("layout: row " << row << " block " << b);
        CHECK(rec.d[r] == (real ? w[row * nb + b].d : 0));
        CHECK(rec.m[r] == (real ? w[row * nb + b].m : 0));
        for (int j = 0; j < 4; ++j)
          for (int i = 0; i < 4; ++i) CHECK(rec.qs[32 * j + 4 * r + i] == (real ? w[row * nb + b].qs[4 * j + i] : 0));
      }
    std::vector<float> want(static_cast<size_t>(m * n));
    {
      IsaScope s("scalar");  // the GGUF-layout kernel (fp64-bounded in "Q4_1 x Q8_0: ...")
      gemm_q4_1_q8_0(w.data(), xq.data(), want.data(), k, m, n, 0, n);
    }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      for (int64_t mm : {int64_t{1}, int64_t{2}, int64_t{5}, m}) {
        for (int64_t split : {int64_t{0}, std::min<int64_t>(8, n), std::min<int64_t>(16, n), n / 2}) {
          std::vector<float> y(static_cast<size_t>(mm * n), -1.0f);
          gemm_q4_1x8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, 0, split);
          gemm_q4_1x8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, split, n);
          for (int64_t c = 0; c < mm; ++c)
            for (int64_t r = 0; r < n; ++r) {
              INFO(isa << " k " << k << " n " << n << " m " << mm << " split " << split << " column " << c << " row "
                       << r);
              CHECK(bits(y[c * n + r]) == bits(want[c * n + r]));
            }
        }
      }
    }
  }
}

TEST_CASE("repacked Q5_0 gemm: layout as documented, the GGUF-layout kernel's bits on every ISA, any row range and m",
          "[kernels][q5_0]") {
  std::mt19937 g(505);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f);
  struct Shape {
    int64_t k, n;
  };
  for (const Shape sh : {Shape{32, 1}, Shape{96, 13}, Shape{896, 37}, Shape{2048, 19}, Shape{640, 16}}) {
    const int64_t k = sh.k, n = sh.n, nb = k / 32, m = 6;
    std::vector<BlockQ5_0> w(static_cast<size_t>(n * nb));
    for (auto& b : w) {
      b.d = fp32_to_fp16(sc(g));
      for (auto& h : b.qh) h = static_cast<uint8_t>(byte(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
    }
    // all fifth bits set and every nibble 15 (q = 31, the i16 sums' worst case) in block 0
    std::memset(w[0].qh, 0xFF, sizeof w[0].qh);
    std::memset(w[0].qs, 0xFF, sizeof w[0].qs);
    auto q5_0_value = [](const BlockQ5_0& b, int e) {  // ggml's: nibble plus 16 times bit e of qh, minus 16
      uint32_t h;
      std::memcpy(&h, b.qh, sizeof h);
      return ((e < 16 ? b.qs[e] & 0x0F : b.qs[e - 16] >> 4) | static_cast<int>(((h >> e) & 1u) << 4)) - 16;
    };
    auto xq = rand_q8(g, m * nb);
    for (int e = 0; e < 32; ++e) xq[0].qs[e] = 127;
    std::vector<BlockQ5_0x8> p(static_cast<size_t>(q4_0x8_records(n, k)));
    repack_q5_0x8(w.data(), n, k, p.data(), 0, (n + 7) / 8);
    for (int64_t row = 0; row < (n + 7) / 8 * 8; ++row)
      for (int64_t b = 0; b < nb; ++b) {
        const BlockQ5_0x8& rec = p[static_cast<size_t>((row / 8) * nb + b)];
        const int r = static_cast<int>(row % 8);
        const bool real = row < n;
        INFO("layout: row " << row << " block " << b);
        CHECK(rec.d[r] == (real ? w[row * nb + b].d : 0));
        for (int j = 0; j < 4; ++j) {
          for (int i = 0; i < 4; ++i) {
            // weight 4j + i (low nibble) and 16 + 4j + i (high nibble): nibble and fifth bit
            const int lo_bit = (rec.qh[4 * r + i] >> (2 * j)) & 1, hi_bit = (rec.qh[4 * r + i] >> (2 * j + 1)) & 1;
            const int q = rec.qs[32 * j + 4 * r + i];
            const int lo = (q & 0x0F) | (lo_bit << 4), hi = (q >> 4) | (hi_bit << 4);
            CHECK(lo == (real ? q5_0_value(w[row * nb + b], 4 * j + i) + 16 : 16));
            CHECK(hi == (real ? q5_0_value(w[row * nb + b], 16 + 4 * j + i) + 16 : 16));
          }
        }
      }
    std::vector<float> want(static_cast<size_t>(m * n));
    {
      IsaScope s("scalar");  // the GGUF-layout kernel (fp64-bounded in "Q5_0 x Q8_0: ...")
      gemm_q5_0_q8_0(w.data(), xq.data(), want.data(), k, m, n, 0, n);
    }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      for (int64_t mm : {int64_t{1}, int64_t{2}, int64_t{5}, m}) {
        for (int64_t split : {int64_t{0}, std::min<int64_t>(8, n), std::min<int64_t>(16, n), n / 2}) {
          std::vector<float> y(static_cast<size_t>(mm * n), -1.0f);
          gemm_q5_0x8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, 0, split);
          gemm_q5_0x8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, split, n);
          for (int64_t c = 0; c < mm; ++c)
            for (int64_t r = 0; r < n; ++r) {
              INFO(isa << " k " << k << " n " << n << " m " << mm << " split " << split << " column " << c << " row "
                       << r);
              CHECK(bits(y[c * n + r]) == bits(want[c * n + r]));
            }
        }
      }
    }
  }
}

TEST_CASE("repacked Q4_K gemm: layout as documented, the GGUF-layout kernel's bits on every ISA, any row range and m",
          "[kernels][q4_k]") {
  std::mt19937 g(4128);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(1e-4f, 4e-3f), mn(0.0f, 2e-2f);
  struct Shape {
    int64_t k, n;
  };
  // n: 1, 2, 3, 5 row groups (odd counts leave a lone group beside the AVX-512 pairs) and tails
  for (const Shape sh : {Shape{256, 1}, Shape{512, 13}, Shape{768, 37}, Shape{2048, 19}, Shape{1280, 16}}) {
    const int64_t k = sh.k, n = sh.n, nb = k / 32, nbw = k / 256, m = 6;
    std::vector<BlockQ4_K> w(static_cast<size_t>(n * nbw));
    for (auto& b : w) {
      b.d = fp32_to_fp16(sc(g));
      b.dmin = fp32_to_fp16(mn(g));
      for (auto& q : b.scales) q = static_cast<uint8_t>(byte(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
    }
    // block 0: every 6-bit scale and min 63, every nibble 15 (the i16 sums' and sc * S_b's worst case)
    std::memset(w[0].scales, 0xFF, sizeof w[0].scales);
    std::memset(w[0].qs, 0xFF, sizeof w[0].qs);
    w[0].d = fp32_to_fp16(1.0f / 945);
    w[0].dmin = fp32_to_fp16(1.0f / 63);
    auto nibble = [](const BlockQ4_K& b, int e) {  // ggml's: bytes 32i.. of chunk i = e / 64, low nibbles first
      const uint8_t v = b.qs[(e / 64) * 32 + e % 32];
      return e % 64 < 32 ? v & 0x0F : v >> 4;
    };
    auto xq = rand_q8(g, m * nb);
    for (int e = 0; e < 32; ++e) xq[0].qs[e] = 127;
    xq[1].qs[3] = -128;
    std::vector<BlockQ4_Kx8> p(static_cast<size_t>(q4_0x8_records(n, k)));
    repack_q4_kx8(w.data(), n, k, p.data(), 0, (n + 7) / 8);
    for (int64_t row = 0; row < (n + 7) / 8 * 8; ++row)
      for (int64_t b = 0; b < nb; ++b) {
        const BlockQ4_Kx8& rec = p[static_cast<size_t>((row / 8) * nb + b)];
        const int r = static_cast<int>(row % 8), j = static_cast<int>(b % 8);
        const bool real = row < n;
        const BlockQ4_K& src = w[static_cast<size_t>(real ? row * nbw + b / 8 : 0)];
        int want_sc = 0, want_m = 0;
        k4_scale_min(src.scales, j, want_sc, want_m);
        INFO("layout: row " << row << " block " << b);
        CHECK(rec.d[r] == (real ? src.d : 0));
        CHECK(rec.dmin[r] == (real ? src.dmin : 0));
        CHECK(rec.sc[r] == (real ? want_sc : 0));
        CHECK(rec.m[r] == (real ? want_m : 0));
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            // weight 4c + i (low nibble) and 16 + 4c + i (high nibble) of sub-block j
            const int q = rec.qs[32 * c + 4 * r + i];
            CHECK((q & 0x0F) == (real ? nibble(src, 32 * j + 4 * c + i) : 0));
            CHECK((q >> 4) == (real ? nibble(src, 32 * j + 16 + 4 * c + i) : 0));
          }
      }
    std::vector<float> want(static_cast<size_t>(m * n));
    {
      IsaScope s("scalar");  // the GGUF-layout kernel (fp64-bounded in "Q4_K x Q8_0: ...")
      gemm_q4_k_q8_0(w.data(), xq.data(), want.data(), k, m, n, 0, n);
    }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      for (int64_t mm : {int64_t{1}, int64_t{2}, int64_t{5}, m}) {
        for (int64_t split : {int64_t{0}, std::min<int64_t>(8, n), std::min<int64_t>(16, n), n / 2}) {
          std::vector<float> y(static_cast<size_t>(mm * n), -1.0f);
          gemm_q4_kx8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, 0, split);
          gemm_q4_kx8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, split, n);
          for (int64_t c = 0; c < mm; ++c)
            for (int64_t r = 0; r < n; ++r) {
              INFO(isa << " k " << k << " n " << n << " m " << mm << " split " << split << " column " << c << " row "
                       << r);
              CHECK(bits(y[c * n + r]) == bits(want[c * n + r]));
            }
        }
      }
    }
  }
}

TEST_CASE("repacked Q6_K gemm: layout as documented, the GGUF-layout kernel's bits on every ISA, any row range and m",
          "[kernels][q6_k]") {
  std::mt19937 g(6128);
  std::uniform_int_distribution<int> byte(0, 255), scale(-128, 127);
  std::uniform_real_distribution<float> sc(1e-4f, 2e-3f);
  struct Shape {
    int64_t k, n;
  };
  // n: 1, 2, 3, 5 row groups (odd counts leave a lone group beside the AVX-512 pairs) and tails
  for (const Shape sh : {Shape{256, 1}, Shape{512, 13}, Shape{768, 37}, Shape{2048, 19}, Shape{1280, 16}}) {
    const int64_t k = sh.k, n = sh.n, nb = k / 32, nbw = k / 256, m = 6;
    std::vector<BlockQ6_K> w(static_cast<size_t>(n * nbw));
    for (auto& b : w) {
      b.d = fp32_to_fp16(sc(g));
      for (auto& q : b.scales) q = static_cast<int8_t>(scale(g));
      for (auto& q : b.ql) q = static_cast<uint8_t>(byte(g));
      for (auto& q : b.qh) q = static_cast<uint8_t>(byte(g));
    }
    // block 0: every q = 31 (the largest u, 63: the i16 sums' worst case) and scales -128 / 127
    std::memset(w[0].ql, 0xFF, sizeof w[0].ql);
    std::memset(w[0].qh, 0xFF, sizeof w[0].qh);
    for (int i = 0; i < 16; ++i) w[0].scales[i] = static_cast<int8_t>(i % 2 ? 127 : -128);
    auto xq = rand_q8(g, m * nb);
    for (int e = 0; e < 32; ++e) xq[0].qs[e] = e < 16 ? 127 : -128;
    std::vector<BlockQ6_Kx8> p(static_cast<size_t>(q4_0x8_records(n, k)));
    repack_q6_kx8(w.data(), n, k, p.data(), 0, (n + 7) / 8);
    for (int64_t row = 0; row < (n + 7) / 8 * 8; ++row)
      for (int64_t b = 0; b < nb; ++b) {
        const BlockQ6_Kx8& rec = p[static_cast<size_t>((row / 8) * nb + b)];
        const int r = static_cast<int>(row % 8), j = static_cast<int>(b % 8);
        const bool real = row < n;
        const BlockQ6_K& src = w[static_cast<size_t>(real ? row * nbw + b / 8 : 0)];
        INFO("layout: row " << row << " block " << b);
        CHECK(rec.d[r] == (real ? src.d : 0));
        CHECK(rec.s[r] == (real ? src.scales[2 * j] : 0));
        CHECK(rec.s[8 + r] == (real ? src.scales[2 * j + 1] : 0));
        for (int c = 0; c < 4; ++c)
          for (int i = 0; i < 4; ++i) {
            // weight 4c + i (low nibble, qh bits 0-1 / 4-5) and 16 + 4c + i (high, bits 2-3 / 6-7)
            const int q = rec.qs[32 * c + 4 * r + i];
            const int h = rec.qh[32 * (c / 2) + 4 * r + i] >> (4 * (c % 2));
            CHECK((q & 0x0F) + 16 * (h & 3) - 32 == (real ? q6k_at(src, 32 * j + 4 * c + i) : 0));
            CHECK((q >> 4) + 16 * ((h >> 2) & 3) - 32 == (real ? q6k_at(src, 32 * j + 16 + 4 * c + i) : 0));
          }
      }
    std::vector<float> want(static_cast<size_t>(m * n));
    {
      IsaScope s("scalar");  // the GGUF-layout kernel (fp64-bounded in "Q6_K x Q8_0: ...")
      gemm_q6_k_q8_0(w.data(), xq.data(), want.data(), k, m, n, 0, n);
    }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      for (int64_t mm : {int64_t{1}, int64_t{2}, int64_t{5}, m}) {
        for (int64_t split : {int64_t{0}, std::min<int64_t>(8, n), std::min<int64_t>(16, n), n / 2}) {
          std::vector<float> y(static_cast<size_t>(mm * n), -1.0f);
          gemm_q6_kx8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, 0, split);
          gemm_q6_kx8_q8_0(p.data(), xq.data(), y.data(), k, mm, n, split, n);
          for (int64_t c = 0; c < mm; ++c)
            for (int64_t r = 0; r < n; ++r) {
              INFO(isa << " k " << k << " n " << n << " m " << mm << " split " << split << " column " << c << " row "
                       << r);
              CHECK(bits(y[c * n + r]) == bits(want[c * n + r]));
            }
        }
      }
    }
  }
}

TEST_CASE("attention row kernels equal the per-row calls bit for bit", "[kernels]") {
  std::mt19937 g(123);
  const int64_t n = 64, stride = 256, rows = 13;
  std::vector<uint16_t> kv(static_cast<size_t>(stride * rows)), q(static_cast<size_t>(n));
  for (auto& v : kv) v = fp32_to_fp16(std::uniform_real_distribution<float>(-2.f, 2.f)(g));
  for (auto& v : q) v = fp32_to_fp16(std::uniform_real_distribution<float>(-2.f, 2.f)(g));
  const auto a = rand_f32(g, static_cast<size_t>(rows));
  for (const auto& isa : isas()) {
    IsaScope s(isa);
    std::vector<float> dots(static_cast<size_t>(rows));
    vec_dot_f16_rows(kv.data() + 64, stride, rows, q.data(), n, dots.data());
    std::vector<float> y1(static_cast<size_t>(n), 0.5f), y2 = y1;
    axpy_f16_rows(a.data(), kv.data() + 64, stride, rows, y1.data(), n);
    for (int64_t r = 0; r < rows; ++r) {
      INFO(isa << " row " << r);
      CHECK(bits(dots[size_t(r)]) == bits(vec_dot_f16(kv.data() + 64 + r * stride, q.data(), n)));
      axpy_f16(a[size_t(r)], kv.data() + 64 + r * stride, y2.data(), n);
    }
    for (int64_t i = 0; i < n; ++i) CHECK(bits(y1[size_t(i)]) == bits(y2[size_t(i)]));
  }
}

// ---- tiled ("flash") attention over a paged KV (issue 14 item 2) ----
namespace {

/// A paged KV cache of one layer for the attention tests: n_head_kv heads of hd, pages of
/// page_size positions, K and V in separate page lists (the kernel takes one pointer per
/// page for each). f16 values, or their f32 widening for the f32 layout.
struct TestKv {
  int64_t hd, n_head_kv, page_size, n_ctx;
  bool f16;
  std::vector<std::vector<uint16_t>> k16, v16;
  std::vector<std::vector<float>> k32, v32;
  std::vector<const void*> kp, vp;
  int64_t stride() const { return n_head_kv * hd; }
  // Same values as `src` (f16 bits per position, head, d) in another page size / dtype.
  TestKv(const std::vector<uint16_t>& kvals, const std::vector<uint16_t>& vvals, int64_t hd_, int64_t nkv, int64_t ps,
         int64_t ctx, bool f16_)
      : hd(hd_), n_head_kv(nkv), page_size(ps), n_ctx(ctx), f16(f16_) {
    const int64_t n_pages = (ctx + ps - 1) / ps;
    for (int64_t pg = 0; pg < n_pages; ++pg) {
      const size_t n = size_t(ps * stride());
      k16.emplace_back(n, uint16_t{0x7C00});  // unused slots hold +Inf: never read
      v16.emplace_back(n, uint16_t{0x7C00});
      for (int64_t s = 0; s < ps && pg * ps + s < ctx; ++s)
        for (int64_t e = 0; e < stride(); ++e) {
          k16.back()[size_t(s * stride() + e)] = kvals[size_t((pg * ps + s) * stride() + e)];
          v16.back()[size_t(s * stride() + e)] = vvals[size_t((pg * ps + s) * stride() + e)];
        }
      k32.emplace_back(n);
      v32.emplace_back(n);
      for (size_t i = 0; i < n; ++i) {
        k32.back()[i] = fp16_to_fp32(k16.back()[i]);
        v32.back()[i] = fp16_to_fp32(v16.back()[i]);
      }
    }
    for (int64_t pg = 0; pg < n_pages; ++pg) {
      kp.push_back(f16 ? static_cast<const void*>(k16[size_t(pg)].data()) : k32[size_t(pg)].data());
      vp.push_back(f16 ? static_cast<const void*>(v16[size_t(pg)].data()) : v32[size_t(pg)].data());
    }
  }
  double k(int64_t pos, int64_t h, int64_t d) const {
    return k32[size_t(pos / page_size)][size_t((pos % page_size) * stride() + h * hd + d)];
  }
  double v(int64_t pos, int64_t h, int64_t d) const {
    return v32[size_t(pos / page_size)][size_t((pos % page_size) * stride() + h * hd + d)];
  }
};

std::vector<uint16_t> rand_f16(std::mt19937& g, size_t n, float lo, float hi) {
  std::uniform_real_distribution<float> d(lo, hi);
  std::vector<uint16_t> v(n);
  for (auto& x : v) x = fp32_to_fp16(d(g));
  return v;
}

/// Runs flash_attn for positions [pos0, pos0 + n_pos) of KV head `h`; q / out hold
/// n_head = n_head_kv * group heads per position, rows q_stride apart from position 0.
/// `online`: flash_attn (online softmax), else attn_tiled (the executor's kernel).
void run_flash(const TestKv& kv, int64_t h, int32_t group, const float* q, float* out, int64_t q_stride, int32_t pos0,
               int32_t n_pos, bool online = true) {
  FlashAttnArgs a = tandem::test::attn_args(kv.kp.data(), kv.vp.data(), kv.page_size, kv.stride(), kv.hd, h, group, q,
                                            out, q_stride, pos0, n_pos);
  a.kv_f16 = kv.f16;
  const int64_t rows = int64_t{n_pos} * group;
  std::vector<float> scratch(
      online ? flash_attn_scratch_floats(kv.hd, rows) : attn_tiled_scratch_floats(kv.hd, rows, int64_t{pos0} + n_pos),
      std::nanf(""));
  if (online)
    flash_attn(a, scratch.data());
  else
    attn_tiled(a, scratch.data());
}

}  // namespace

TEST_CASE("flash attention vs a float64 reference: head_dim, GQA ratio, page crossings, f16 and f32 KV",
          "[kernels][attention]") {
  std::mt19937 g(2024);
  struct Shape {
    int64_t hd;
    int32_t group;
    int64_t page_size, n_ctx;
    std::vector<int32_t> queries;  // positions checked (the kernel runs them as one call)
  };
  const std::vector<Shape> shapes = {
      {64, 1, 16, 1, {0}},
      {64, 4, 16, 70, {0, 15, 16, 17, 63, 64, 65, 69}},
      {128, 7, 5, 130, {3, 4, 5, 127, 128, 129}},
      {64, 8, 16, 200, {199}},
      {128, 1, 16, 97, {96}},
      {64, 7, 16, 4096, {4093, 4094, 4095}},
      {128, 8, 32, 1500, {1000, 1499}},
  };
  double worst = 0.0, worst_tiled = 0.0;
  for (const auto& sh : shapes) {
    const int64_t nkv = 2, stride = nkv * sh.hd;
    const auto kv16 = rand_f16(g, size_t(sh.n_ctx * stride), -2.f, 2.f);
    const auto vv16 = rand_f16(g, size_t(sh.n_ctx * stride), -2.f, 2.f);
    const int64_t q_stride = nkv * sh.group * sh.hd;
    const auto q = rand_f32(g, size_t(sh.n_ctx * q_stride), -2.f, 2.f);
    for (bool f16 : {true, false}) {
      const TestKv kv(kv16, vv16, sh.hd, nkv, sh.page_size, sh.n_ctx, f16);
      // Reference: softmax(q . k * scale) . v in double, q rounded to f16 as the kernel does.
      const double scale = 1.0 / std::sqrt(double(static_cast<float>(sh.hd)));
      for (const auto& isa : isas()) {
        IsaScope s(isa);
        // Every KV head, one call per contiguous run of checked positions.
        for (int32_t qp : sh.queries) {
          std::vector<float> out(q.size(), std::nanf("")), tiled(q.size(), std::nanf(""));
          for (int64_t h = 0; h < nkv; ++h) run_flash(kv, h, sh.group, q.data(), out.data(), q_stride, qp, 1);
          for (int64_t h = 0; h < nkv; ++h) run_flash(kv, h, sh.group, q.data(), tiled.data(), q_stride, qp, 1, false);
          for (int64_t h = 0; h < nkv; ++h)
            for (int32_t gi = 0; gi < sh.group; ++gi) {
              const float* qr = q.data() + qp * q_stride + (h * sh.group + gi) * sh.hd;
              std::vector<double> sc(size_t(qp) + 1);
              double mx = -INFINITY;
              for (int32_t p = 0; p <= qp; ++p) {
                double dot = 0.0;
                for (int64_t d = 0; d < sh.hd; ++d)
                  dot += (f16 ? double(fp16_to_fp32(fp32_to_fp16(qr[d]))) : double(qr[d])) * kv.k(p, h, d);
                sc[size_t(p)] = dot * scale;
                mx = std::max(mx, sc[size_t(p)]);
              }
              double sum = 0.0;
              for (auto& x : sc) sum += (x = std::exp(x - mx));
              for (int64_t d = 0; d < sh.hd; ++d) {
                double ref = 0.0;
                for (int32_t p = 0; p <= qp; ++p) ref += sc[size_t(p)] / sum * kv.v(p, h, d);
                const double got = out[size_t(qp * q_stride + (h * sh.group + gi) * sh.hd + d)];
                INFO(isa << " hd " << sh.hd << " group " << sh.group << " page " << sh.page_size << " pos " << qp
                         << (f16 ? " f16" : " f32") << " head " << h * sh.group + gi << " d " << d);
                // |v| <= 2: error relative to max |v|. Measured worst 4.3e-7 (AVX2, scalar):
                // f32 scores over head_dim products and a 1-ulp exp.
                const double err = std::fabs(got - ref) / 2.0;
                worst = std::max(worst, err);
                REQUIRE(err <= 2e-6);
                // attn_tiled rounds the weights to f16 with an f16 cache: each is off by at
                // most 2^-11 of itself, so the output by at most 2^-11 of max |v|.
                const double got_t = tiled[size_t(qp * q_stride + (h * sh.group + gi) * sh.hd + d)];
                const double err_t = std::fabs(got_t - ref) / 2.0;
                worst_tiled = std::max(worst_tiled, err_t);
                REQUIRE(err_t <= (f16 ? std::ldexp(1.0, -11) : 0.0) + 2e-6);
              }
            }
        }
      }
    }
  }
  WARN("flash attention: worst |out - f64| / max|v| = " << worst << " (online softmax), " << worst_tiled
                                                        << " (attn_tiled)");
}

TEST_CASE("flash attention is batch-invariant: alone, in one call, chunked, other page sizes: bit-identical",
          "[kernels][attention]") {
  std::mt19937 g(77);
  for (int64_t hd : {64, 128}) {
    for (int32_t group : {1, 4, 7, 8}) {
      const int64_t nkv = 2, n_ctx = hd == 64 ? 150 : 70, stride = nkv * hd;
      const auto k16 = rand_f16(g, size_t(n_ctx * stride), -3.f, 3.f);
      const auto v16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
      const int64_t q_stride = nkv * group * hd;
      const auto q = rand_f32(g, size_t(n_ctx * q_stride), -3.f, 3.f);
      for (bool f16 : {true, false}) {
        const TestKv kv16(k16, v16, hd, nkv, 16, n_ctx, f16), kv5(k16, v16, hd, nkv, 5, n_ctx, f16);
        for (const auto& isa : isas())
          for (bool online : {true, false}) {
            IsaScope s(isa);
            INFO(isa << " hd " << hd << " group " << group << (f16 ? " f16" : " f32")
                     << (online ? " flash_attn" : " attn_tiled"));
            std::vector<float> whole(q.size()), alone(q.size()), chunked(q.size()), paged5(q.size());
            for (int64_t h = 0; h < nkv; ++h) {
              run_flash(kv16, h, group, q.data(), whole.data(), q_stride, 0, static_cast<int32_t>(n_ctx), online);
              for (int32_t p = 0; p < n_ctx; ++p)
                run_flash(kv16, h, group, q.data(), alone.data(), q_stride, p, 1, online);
              for (int32_t p = 0; p < n_ctx; p += 7)
                run_flash(kv5, h, group, q.data(), chunked.data(), q_stride, p,
                          static_cast<int32_t>(std::min<int64_t>(7, n_ctx - p)), online);
              for (int32_t p = 0; p < n_ctx; p += 33)
                run_flash(kv5, h, group, q.data(), paged5.data(), q_stride, p,
                          static_cast<int32_t>(std::min<int64_t>(33, n_ctx - p)), online);
            }
            size_t diff = 0;
            for (size_t i = 0; i < q.size(); ++i) {
              diff += bits(whole[i]) != bits(alone[i]);
              diff += bits(whole[i]) != bits(chunked[i]);
              diff += bits(whole[i]) != bits(paged5[i]);
            }
            CHECK(diff == 0);
          }
      }
    }
  }
}

TEST_CASE("attn_tiled is the written attention arithmetic bit for bit; flash_attn within f16 rounding",
          "[kernels][attention]") {
  // docs/arithmetic.md "Attention", transcribed one (row, position, element) at a time: a
  // score is 32 lane sums by fma over d (q rounded to f16 for an f16 cache), their tree and
  // the tail, times the scale; the written softmax (softmax_exp, the sum in double over 8
  // lanes from the row's first position, their tree, the tail); weights rounded to f16 for
  // an f16 cache; per element an fma chain over each chunk of 64 positions counted from the
  // row's first position, the chunks added in order to out = 0. attn_tiled must give these
  // bits on every ISA, with and without a window (whose chunks then do not start at tile
  // edges), f16 and f32 KV, head_dim 64, 44 and 20 (the 8-element and the last hd % 8
  // tails). flash_attn (online softmax, f32 weights) differs by the f16 rounding of the
  // weights: at most 2^-11 of each, so |diff| <= 2^-11 * max|v| plus the f32 noise of both.
  std::mt19937 g(5);
  const int64_t nkv = 2, n_ctx = 300;
  const int32_t group = 7;
  for (const int64_t hd : {64, 44, 20}) {
    const int64_t stride = nkv * hd, q_stride = nkv * group * hd;
    const auto k16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
    const auto v16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
    const auto q = rand_f32(g, size_t(n_ctx * q_stride), -2.f, 2.f);
    const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
    for (const bool f16 : {true, false})
      for (const int32_t W : {0, 100}) {
        const TestKv kv(k16, v16, hd, nkv, 16, n_ctx, f16);
        auto round16 = [&](float x) { return f16 ? fp16_to_fp32(fp32_to_fp16(x)) : x; };
        // The transcription's outputs of the checked positions t (every 13th).
        std::vector<float> want(q.size(), 0.0f);
        for (int64_t t = 0; t < n_ctx; t += 13)
          for (int64_t head = 0; head < nkv * group; ++head) {
            const int64_t hk = head / group, p0 = W > 0 ? std::max<int64_t>(0, t + 1 - W) : 0;
            std::vector<float> w(size_t(t + 1));
            float mx = -INFINITY;
            for (int64_t p = p0; p <= t; ++p) {
              // 32 lanes: element d < n32 in lane d % 32, then d < n8 in lane d % 8, by fma;
              // lanes 8 apart added, then 16, 4, 2, 1; the last hd % 8 by fma into the sum.
              const int64_t n32 = hd / 32 * 32, n8 = hd / 8 * 8;
              auto qd = [&](int64_t d) { return round16(q[size_t(t * q_stride + head * hd + d)]); };
              std::array<float, 32> lane{};
              for (int64_t d = 0; d < n8; ++d) {
                const size_t l = size_t(d < n32 ? d % 32 : d % 8);
                lane[l] = std::fma(qd(d), float(kv.k(p, hk, d)), lane[l]);
              }
              for (const size_t o : {8, 16, 4, 2, 1})
                for (size_t l = 0; l < 32; ++l)
                  if ((l & o) == 0) lane[l] = lane[l] + lane[l + o];
              float acc = lane[0];
              for (int64_t d = n8; d < hd; ++d) acc = std::fma(qd(d), float(kv.k(p, hk, d)), acc);
              w[size_t(p)] = acc * scale;
              mx = std::max(mx, w[size_t(p)]);
            }
            double lanes[8] = {}, sum = 0.0;
            const int64_t n8 = p0 + (t + 1 - p0) / 8 * 8;
            for (int64_t p = p0; p <= t; ++p) {
              w[size_t(p)] = softmax_exp(w[size_t(p)] - mx);
              if (p < n8) lanes[(p - p0) % 8] += double(w[size_t(p)]);
            }
            sum = ((lanes[0] + lanes[4]) + (lanes[2] + lanes[6])) + ((lanes[1] + lanes[5]) + (lanes[3] + lanes[7]));
            for (int64_t p = n8; p <= t; ++p) sum += double(w[size_t(p)]);
            const float inv = static_cast<float>(1.0 / sum);
            for (int64_t p = p0; p <= t; ++p) w[size_t(p)] = round16(w[size_t(p)] * inv);
            for (int64_t d = 0; d < hd; ++d) {
              float out = 0.0f;
              for (int64_t c = p0; c <= t; c += 64) {
                float part = 0.0f;
                for (int64_t p = c; p <= std::min<int64_t>(t, c + 63); ++p)
                  part = std::fma(w[size_t(p)], float(kv.v(p, hk, d)), part);
                out = out + part;
              }
              want[size_t(t * q_stride + head * hd + d)] = out;
            }
          }
        for (const auto& isa : isas()) {
          IsaScope s(isa);
          // One call over every position (the keys-as-lanes scores) and one call per
          // checked position (a decode step's shape: vec_dot_f scores).
          std::vector<float> online(q.size()), tiled(q.size()), alone(q.size());
          auto run_tiled = [&](int64_t h, int32_t pos0, int32_t n_pos, std::vector<float>& out) {
            FlashAttnArgs a = tandem::test::attn_args(kv.kp.data(), kv.vp.data(), kv.page_size, kv.stride(), hd, h,
                                                      group, q.data(), out.data(), q_stride, pos0, n_pos);
            a.kv_f16 = f16;
            a.window = W;
            std::vector<float> scratch(attn_tiled_scratch_floats(hd, int64_t{n_pos} * group, int64_t{pos0} + n_pos),
                                       std::nanf(""));
            attn_tiled(a, scratch.data());
          };
          for (int64_t h = 0; h < nkv; ++h) {
            if (W == 0) run_flash(kv, h, group, q.data(), online.data(), q_stride, 0, static_cast<int32_t>(n_ctx));
            run_tiled(h, 0, int32_t(n_ctx), tiled);
            for (int64_t t = 0; t < n_ctx; t += 13) run_tiled(h, int32_t(t), 1, alone);
          }
          double worst = 0.0;
          size_t tiled_diff = 0;
          for (int64_t t = 0; t < n_ctx; t += 13)
            for (int64_t i = t * q_stride; i < (t + 1) * q_stride; ++i) {
              if (W == 0) worst = std::max(worst, double(std::fabs(want[size_t(i)] - online[size_t(i)])) / 2.0);
              tiled_diff += bits(want[size_t(i)]) != bits(tiled[size_t(i)]);
              tiled_diff += bits(want[size_t(i)]) != bits(alone[size_t(i)]);
            }
          INFO(isa << " hd " << hd << (f16 ? " f16" : " f32") << " window " << W
                   << ": worst |flash_attn - written| / max|v| = " << worst);
          CHECK(worst <= (f16 ? std::ldexp(1.0, -11) : 0.0) + 1e-5);
          CHECK(tiled_diff == 0);
        }
      }
  }
}

TEST_CASE("attn_split_* over any key ranges give attn_tiled's bits on every ISA", "[kernels][attention]") {
  // A decode call (one position) as the split phases, its chunks cut into 1, 2, 3 and 7
  // ranges, against the scalar table's attn_tiled (one row at a time, checked against the
  // written arithmetic above): head_dim 64, 128 and 256 (the AVX-512 V loop's one and four
  // 64-element blocks), groups 1, 3 and 8 (the score passes' row blocks and a remainder),
  // without and with a window (chunks not at tile edges), positions at and past chunk
  // edges (one chunk, a partial last chunk). Pages of 16 positions, 2 KV heads (rows
  // strided), the second head read.
  std::mt19937 g(11);
  const int64_t nkv = 2, n_ctx = 700;
  for (const int64_t hd : {64, 128, 256})
    for (const int32_t group : {1, 3, 8}) {
      const int64_t stride = nkv * hd, q_stride = nkv * group * hd;
      const auto k16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
      const auto v16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
      const auto q = rand_f32(g, size_t(n_ctx * q_stride), -2.f, 2.f);
      const TestKv kv(k16, v16, hd, nkv, 16, n_ctx, true);
      for (const int32_t W : {0, 300})
        for (const int32_t pos : {0, 63, 64, 200, 699}) {
          FlashAttnArgs a = tandem::test::attn_args(kv.kp.data(), kv.vp.data(), kv.page_size, kv.stride(), hd, 1, group,
                                                    q.data(), nullptr, q_stride, pos, 1);
          a.window = W;
          REQUIRE(attn_split_applies(a));
          std::vector<float> want(size_t(group * hd)), got(want.size());
          std::vector<float> scratch(attn_tiled_scratch_floats(hd, group, int64_t{pos} + 1));
          {
            tandem::test::IsaScope s("scalar");
            a.out = want.data();
            attn_tiled(a, scratch.data());
          }
          const int64_t n_chunks = attn_split_chunks(a), ld = pos + 1;
          CHECK(n_chunks == (std::min<int64_t>(pos + 1, W > 0 ? W : pos + 1) + 63) / 64);
          for (const auto& isa : isas()) {
            tandem::test::IsaScope s(isa);
            a.out = got.data();
            attn_tiled(a, scratch.data());
            INFO(isa << " hd " << hd << " group " << group << " window " << W << " position " << pos);
            CHECK(tandem::test::same_bits(got, want));
            for (const int64_t ranges : {1, 2, 3, 7}) {
              std::vector<float> sc(size_t(group * ld), std::nanf("")), range_max(size_t(ranges * group));
              std::vector<float> parts(size_t(n_chunks * group * hd), std::nanf(""));
              for (int64_t j = ranges - 1; j >= 0; --j)  // any order
                attn_split_scores(a, j * n_chunks / ranges, (j + 1) * n_chunks / ranges, sc.data(), ld,
                                  range_max.data() + j * group);
              attn_split_softmax(a, sc.data(), ld, range_max.data(), ranges);
              for (int64_t j = 0; j < ranges; ++j)
                attn_split_wv(a, j * n_chunks / ranges, (j + 1) * n_chunks / ranges, sc.data(), ld, parts.data());
              std::fill(got.begin(), got.end(), std::nanf(""));
              attn_split_combine(a, parts.data());
              INFO(ranges << " ranges");
              CHECK(tandem::test::same_bits(got, want));
            }
          }
        }
    }
  // Not applicable (attn_tiled alone): several positions, q8_0 or f32 KV, head_dim 44.
  FlashAttnArgs a;
  a.n_pos = 1;
  a.group = 1;
  a.head_dim = 64;
  CHECK(attn_split_applies(a));
  a.kv_f16 = false;
  CHECK_FALSE(attn_split_applies(a));
  a.kv_f16 = true;
  a.kv_q8_0 = true;
  CHECK_FALSE(attn_split_applies(a));
  a.kv_q8_0 = false;
  a.head_dim = 44;
  CHECK_FALSE(attn_split_applies(a));
  a.head_dim = 64;
  a.n_pos = 2;
  CHECK_FALSE(attn_split_applies(a));
}

TEST_CASE("attn_tiled with a sliding window: full attention over the window's positions, bit for bit",
          "[kernels][attention][swa]") {
  // Row at position t with window W sees positions max(0, t - W + 1) .. t (llama.cpp's
  // LLAMA_SWA_TYPE_STANDARD). Checked against (1) a float64 softmax over exactly those
  // positions, within the f16 rounding of the weights; (2) full (unwindowed) attention of
  // the same query over a KV holding only the window's positions: the same bits; (3) the
  // scalar path's bits on every ISA; (4) chunked calls (query tiles across the window's
  // and the KV tiles' edges) the same bits as one call. f16 and f32 KV.
  std::mt19937 g(91);
  const int64_t hd = 80, nkv = 2, stride = nkv * hd, n_ctx = 230;  // hd: a tail past the vectors
  const int32_t group = 3;
  const int64_t q_stride = nkv * group * hd;
  const auto k16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
  const auto v16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
  const auto q = rand_f32(g, size_t(n_ctx * q_stride), -2.f, 2.f);
  const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
  for (const bool f16 : {true, false}) {
    const TestKv kv(k16, v16, hd, nkv, 16, n_ctx, f16);
    for (const int32_t W : {1, 37, 64, 100, 229, 500}) {
      auto run = [&](int32_t pos0, int32_t n_pos, std::vector<float>& out) {
        for (int64_t h = 0; h < nkv; ++h) {
          FlashAttnArgs a = tandem::test::attn_args(kv.kp.data(), kv.vp.data(), kv.page_size, kv.stride(), hd, h, group,
                                                    q.data(), out.data(), q_stride, pos0, n_pos);
          a.kv_f16 = f16;
          a.scale = scale;
          a.window = W;
          std::vector<float> scratch(attn_tiled_scratch_floats(hd, int64_t{n_pos} * group, int64_t{pos0} + n_pos),
                                     std::nanf(""));
          attn_tiled(a, scratch.data());
        }
      };
      std::vector<std::vector<float>> outs;  // per ISA; isas() ends with scalar
      for (const auto& isa : isas()) {
        IsaScope scope(isa);
        INFO(isa << (f16 ? " f16" : " f32") << " window " << W);
        std::vector<float> one(q.size(), 0.0f), chunked(q.size(), 0.0f);
        run(0, int32_t(n_ctx), one);
        for (int32_t p0 = 0; p0 < n_ctx; p0 += 29) run(p0, std::min<int32_t>(29, int32_t(n_ctx) - p0), chunked);
        CHECK(std::memcmp(one.data(), chunked.data(), one.size() * sizeof(float)) == 0);
        for (int64_t t = 0; t < n_ctx; t += 11) {
          // (2) a KV with only positions w0..t, at 0..t-w0: full attention at position t - w0.
          const int64_t w0 = std::max<int64_t>(0, t - W + 1);
          std::vector<uint16_t> ks(size_t((t - w0 + 1) * stride)), vs(ks.size());
          std::copy(k16.begin() + w0 * stride, k16.begin() + (t + 1) * stride, ks.begin());
          std::copy(v16.begin() + w0 * stride, v16.begin() + (t + 1) * stride, vs.begin());
          const TestKv part(ks, vs, hd, nkv, 16, t - w0 + 1, f16);
          std::vector<float> full(static_cast<size_t>(q_stride));
          for (int64_t h = 0; h < nkv; ++h) {
            FlashAttnArgs a = tandem::test::attn_args(part.kp.data(), part.vp.data(), 16, stride, hd, h, group,
                                                      q.data(), full.data(), q_stride, int32_t(t - w0), 1);
            a.q = q.data() + t * q_stride + h * group * hd;  // the query of position t, at t - w0
            a.out = full.data() + h * group * hd;
            a.kv_f16 = f16;
            a.scale = scale;
            std::vector<float> scratch(attn_tiled_scratch_floats(hd, group, t - w0 + 1));
            attn_tiled(a, scratch.data());
          }
          INFO("position " << t);
          CHECK(std::memcmp(full.data(), one.data() + t * q_stride, full.size() * sizeof(float)) == 0);
        }
        outs.push_back(std::move(one));
      }
      for (size_t i = 0; i + 1 < outs.size(); ++i) {
        INFO(isas()[i] << " vs scalar, window " << W);
        CHECK(std::memcmp(outs[i].data(), outs.back().data(), outs[i].size() * sizeof(float)) == 0);
      }
      // (1) float64 softmax over the window (q rounded to f16 for an f16 cache, as the kernel).
      const std::vector<float>& one = outs.back();
      double worst = 0.0, moved = 0.0;
      for (int64_t t = 0; t < n_ctx; t += 11) {
        const int64_t w0 = std::max<int64_t>(0, t - W + 1);
        for (int64_t head = 0; head < nkv * group; ++head) {
          const int64_t hk = head / group;
          std::vector<double> qd(static_cast<size_t>(hd)), sa;
          for (int64_t d = 0; d < hd; ++d) {
            const float x = q[size_t(t * q_stride + head * hd + d)];
            qd[size_t(d)] = f16 ? fp16_to_fp32(fp32_to_fp16(x)) : x;
          }
          for (int64_t p = 0; p <= t; ++p) {
            double s = 0.0;
            for (int64_t d = 0; d < hd; ++d) s += qd[size_t(d)] * kv.k(p, hk, d);
            sa.push_back(s * scale);
          }
          auto softmax_from = [&](int64_t first) {
            std::vector<double> w(sa.begin() + first, sa.end());
            const double mx = *std::max_element(w.begin(), w.end());
            double sum = 0.0;
            for (double& x : w) sum += (x = std::exp(x - mx));
            for (double& x : w) x /= sum;
            return w;
          };
          const auto win = softmax_from(w0), all = softmax_from(0);
          for (int64_t d = 0; d < hd; ++d) {
            double y = 0.0, y_all = 0.0;
            for (int64_t p = w0; p <= t; ++p) y += win[size_t(p - w0)] * kv.v(p, hk, d);
            for (int64_t p = 0; p <= t; ++p) y_all += all[size_t(p)] * kv.v(p, hk, d);
            worst = std::max(worst, std::fabs(one[size_t(t * q_stride + head * hd + d)] - y) / 2.0);
            moved = std::max(moved, std::fabs(y_all - y));
          }
        }
      }
      INFO((f16 ? "f16" : "f32") << " window " << W << ": worst |windowed - float64| / max|v| = " << worst
                                 << ", the window moves outputs by up to " << moved);
      CHECK(worst <= std::ldexp(1.0, -11) + 1e-5);
      if (W < 220) CHECK(moved > 1e-2);  // positions up to 220 are checked
    }
  }
}

TEST_CASE("one arithmetic: every ISA gives the scalar path's bits in every executor kernel", "[kernels][isa]") {
  // The written arithmetic (kernels_simd.hpp: 8 f32 lanes, fma, hsum256's tree) is run
  // lane by lane by the scalar path; avx2, avx512 and avx512vnni share the 256-bit source.
  // So every output must be the same bits, for any k (tails), m (decode and prefill tiles)
  // and row range. ISAs this machine lacks are named in a warning (not compared) below.
  for (const char* isa : {"avx512vnni", "avx512", "avx2"})
    if (!cpu_isa_supported(isa)) WARN("not compared on this machine (the CPU lacks it): " << isa);
  std::mt19937 g(77);
  for (const int64_t k : {int64_t{32}, int64_t{96}, int64_t{576}, int64_t{2080}}) {
    const int64_t n = 21, m = 6, nb = k / 32;
    const auto w4 = rand_q4(g, size_t(n * nb));
    const auto w8 = rand_q8(g, size_t(n * nb));
    const auto xq = rand_q8(g, size_t(m * nb));
    const auto wf = rand_f32(g, size_t(n * (k + 3)));
    const auto xf = rand_f32(g, size_t(m * (k + 3)));
    std::vector<uint16_t> wh(wf.size()), xh(xf.size());
    fp32_to_fp16_row(wf.data(), wh.data(), int64_t(wf.size()));
    fp32_to_fp16_row(xf.data(), xh.data(), int64_t(xf.size()));
    const int64_t kf = k + 3;  // float kernels: a tail past the last full vector
    auto run_all = [&](std::vector<float>& out) {
      out.clear();
      for (const int64_t mm : {int64_t{1}, m}) {
        std::vector<float> y(size_t(mm * n));
        gemm_q4_0_q8_0(w4.data(), xq.data(), y.data(), k, mm, n, 0, 7);
        gemm_q4_0_q8_0(w4.data(), xq.data(), y.data(), k, mm, n, 7, n);
        out.insert(out.end(), y.begin(), y.end());
        gemm_q8_0_q8_0(w8.data(), xq.data(), y.data(), k, mm, n, 0, n);
        out.insert(out.end(), y.begin(), y.end());
        gemm_f32_f32(wf.data(), xf.data(), y.data(), kf, mm, n, 0, n);
        out.insert(out.end(), y.begin(), y.end());
        gemm_f16_f16(wh.data(), xh.data(), y.data(), kf, mm, n, 0, n);
        out.insert(out.end(), y.begin(), y.end());
        gemm_bf16_f32(wh.data(), xf.data(), y.data(), kf, mm, n, 0, n);
        out.insert(out.end(), y.begin(), y.end());
      }
      out.push_back(vec_dot_q4_0_q8_0(w4.data(), xq.data(), k));
      out.push_back(vec_dot_q8_0_q8_0(w8.data(), xq.data(), k));
      out.push_back(vec_dot_f32(wf.data(), xf.data(), kf));
      out.push_back(vec_dot_f16(wh.data(), xh.data(), kf));
      out.push_back(vec_dot_bf16_f32(wh.data(), xf.data(), kf));
      std::vector<float> acc(xf.begin(), xf.begin() + kf);
      axpy_f16(0.37f, wh.data(), acc.data(), kf);
      out.insert(out.end(), acc.begin(), acc.end());
    };
    std::vector<float> want, got;
    {
      IsaScope s("scalar");
      run_all(want);
    }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      run_all(got);
      REQUIRE(got.size() == want.size());
      size_t diff = 0;
      for (size_t i = 0; i < got.size(); ++i) diff += bits(got[i]) != bits(want[i]);
      INFO(isa << " k " << k);
      CHECK(diff == 0);
    }
  }
  // attn_tiled (the executor's attention) on f16 and f32 KV, GQA group 3, 70 positions.
  const int64_t hd = 36, nkv = 2, stride = nkv * hd, n_ctx = 70;  // hd % 8 != 0: the tails
  const int32_t group = 3;
  const auto k16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
  const auto v16 = rand_f16(g, size_t(n_ctx * stride), -2.f, 2.f);
  const int64_t q_stride = nkv * group * hd;
  const auto q = rand_f32(g, size_t(n_ctx * q_stride), -2.f, 2.f);
  for (const bool f16 : {true, false}) {
    const TestKv kv(k16, v16, hd, nkv, 16, n_ctx, f16);
    auto attend = [&] {
      std::vector<float> out(q.size());
      for (int64_t h = 0; h < nkv; ++h)
        run_flash(kv, h, group, q.data(), out.data(), q_stride, 0, static_cast<int32_t>(n_ctx), false);
      return out;
    };
    std::vector<float> want;
    {
      IsaScope s("scalar");
      want = attend();
    }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      const auto got = attend();
      size_t diff = 0;
      for (size_t i = 0; i < got.size(); ++i) diff += bits(got[i]) != bits(want[i]);
      INFO(isa << (f16 ? " f16 KV" : " f32 KV"));
      CHECK(diff == 0);
    }
  }
}

TEST_CASE("softmax_exp: within 2 ulp of exp from -87 to 0, exact at 0, 0 below the range", "[kernels][attention]") {
  std::mt19937 g(3);
  std::uniform_real_distribution<float> u(-87.0f, 0.0f);
  int worst = 0;
  for (int i = 0; i < 1000000; ++i) {
    const float x = i < 1000 ? -float(i) / 1000.0f : u(g);
    const float got = softmax_exp(x);
    const double want = std::exp(double(x));
    const float want_f = static_cast<float>(want);
    const int ulps = std::abs(int(bits(got)) - int(bits(want_f)));
    worst = std::max(worst, ulps);
  }
  INFO("worst ulp distance from exp (float64, rounded) " << worst);
  CHECK(worst <= 2);
  CHECK(softmax_exp(0.0f) == 1.0f);
  CHECK(softmax_exp(-87.5f) == 0.0f);
  CHECK(softmax_exp(-INFINITY) == 0.0f);
  CHECK(std::isnan(softmax_exp(NAN)));
}

// SiLU's exp is softmax_exp extended to (0, 88] (kernels/softmax_exp.hpp, silu): the same
// steps on positive arguments stay within 2 ulp of exp; +inf above kExpMax; silu on
// [-88, 88] within 4 ulp of float64 (the exp's 2, the sum's and the quotient's roundings).
TEST_CASE("softmax_exp above 0 up to 88 and silu: within a few ulp of float64, +inf above the range", "[kernels]") {
  std::mt19937 g(5);
  std::uniform_real_distribution<float> u(0.0f, 88.0f), v(-88.0f, 88.0f);
  int worst = 0, worst_silu = 0;
  for (int i = 0; i < 1000000; ++i) {
    const float x = u(g);
    const int ulps = std::abs(int(bits(softmax_exp(x))) - int(bits(static_cast<float>(std::exp(double(x))))));
    worst = std::max(worst, ulps);
    const float y = v(g);
    const float want = static_cast<float>(double(y) / (1.0 + std::exp(-double(y))));
    worst_silu = std::max(worst_silu, std::abs(int(bits(silu(y))) - int(bits(want))));
  }
  INFO("worst ulp distance: exp " << worst << ", silu " << worst_silu);
  CHECK(worst <= 2);
  CHECK(worst_silu <= 4);
  CHECK(softmax_exp(88.5f) == INFINITY);
  CHECK(silu(0.0f) == 0.0f);
  CHECK(silu(-100.0f) == 0.0f);  // -100 / +inf = -0
  CHECK(silu(100.0f) == 100.0f);
  CHECK(std::isnan(silu(NAN)));
}

TEST_CASE("swiglu: the written silu times up, the same bits on every ISA, lanes and tail alike", "[kernels]") {
  // Values across silu's whole range, its edges (|g| around 87-88, where the exp leaves its
  // range), zeros, infinities and NaN, in every lane position and the scalar tail (n = 1003).
  std::mt19937 g(11);
  std::uniform_real_distribution<float> wide(-100.0f, 100.0f), narrow(-6.0f, 6.0f);
  const int64_t n = 1003;
  std::vector<float> gate(n), up(n);
  const float edges[] = {0.0f,  -0.0f,  87.0f,    -87.0f,    87.4f, -87.4f, 88.0f,  -88.0f,
                         88.5f, -88.5f, INFINITY, -INFINITY, NAN,   1e-30f, -1e-30f};
  for (int64_t i = 0; i < n; ++i) {
    gate[i] = i < 15 * 8 ? edges[i % 15] : i % 2 ? wide(g) : narrow(g);
    up[i] = narrow(g);
  }
  std::vector<float> want(n);
  for (int64_t i = 0; i < n; ++i) want[i] = silu(gate[i]) * up[i];
  for (const auto& isa : isas()) {
    INFO("isa " << isa);
    IsaScope s(isa);
    std::vector<float> got = gate;
    swiglu(got.data(), up.data(), n);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += bits(got[i]) != bits(want[i]);
    CHECK(bad == 0);
  }
}

TEST_CASE("geglu: ggml's table GEGLU, the same bits on every ISA, lanes and tail alike", "[kernels]") {
  // Every f16 value as a gate (the table's whole domain, infinities and NaNs included), then
  // values between them, the clamps' edges (+-10 and their neighbours), -0, and a tail
  // (n = 65536 + 203, not a multiple of 8). Transcribed: g <= -10 -> +0, g >= 10 -> g * up,
  // else f32(table[f16(g)]) * up with the round-to-nearest-even conversion.
  std::mt19937 g(12);
  std::uniform_real_distribution<float> in(-12.0f, 12.0f), u(-3.0f, 3.0f);
  const float edges[] = {
      10.0f, -10.0f,   std::nextafter(10.0f, 0.0f), std::nextafter(-10.0f, 0.0f), 10.0001f, -10.0001f, -0.0f, 0.0f,
      NAN,   -INFINITY};
  const int64_t n = 65536 + 203;
  std::vector<float> gate(n), up(n);
  for (int64_t i = 0; i < n; ++i) {
    gate[i] = i < 65536 ? fp16_to_fp32(static_cast<uint16_t>(i)) : i < 65536 + 10 ? edges[i - 65536] : in(g);
    up[i] = u(g);
  }
  const uint16_t* table = gelu_f16_table();
  std::vector<float> want(n);
  for (int64_t i = 0; i < n; ++i)
    want[i] = gate[i] <= -10.0f  ? 0.0f
              : gate[i] >= 10.0f ? gate[i] * up[i]
                                 : fp16_to_fp32(table[fp32_to_fp16(gate[i])]) * up[i];
  for (const auto& isa : isas()) {
    INFO("isa " << isa);
    IsaScope s(isa);
    std::vector<float> got = gate;
    geglu(table, got.data(), up.data(), n);
    int bad = 0;
    for (int64_t i = 0; i < n; ++i) bad += bits(got[i]) != bits(want[i]);
    CHECK(bad == 0);
  }
}

namespace {

// A weight type run natively (the file's own blocks) x Q8_0 activations: the scalar path
// against float64 references (the dequantised blocks times the quantised activations, and
// times the float activations with the Q8_0 rounding bound), then every ISA, a column of a
// batch alone, vec_dot and a row range all giving the scalar path's bits. A weight block
// holds kPer elements (32, or 256 for the K-quants); w_at(block, e) is element e's value
// and w_mag(block, e) the magnitude of the parts the arithmetic rounds separately (|w| for
// a plain scale; the scaled value and the min apart where a min is subtracted), for the
// rounding bound. Activation column 0 is all +1 and column 1 all -1 per block (every q_x
// = +-127: the integer dots' extremes).
template <class TW, int kPer = 32, class MakeBlocks, class WAt, class WMag, class Gemm, class VecDot>
void check_native_q(std::mt19937& g, tandem::GgmlType type, std::initializer_list<int64_t> ks, MakeBlocks make_blocks,
                    WAt w_at, WMag w_mag, Gemm gemm, VecDot vec_dot) {
  const int64_t n = 11, m = 9;
  for (int64_t k : ks) {
    const int64_t nb = k / 32, nbw = k / kPer;
    const std::vector<TW> w = make_blocks(size_t(n * nbw));
    // w_at against the library's transcription of ggml's dequantisation (f32: d * scale
    // and the min's product rounded, then the value), so the kernels read the file's layout.
    for (const TW& wb : w) {
      float deq[kPer];
      tandem::dequantize_row(type, reinterpret_cast<const std::byte*>(&wb), deq, kPer);
      for (int e = 0; e < kPer; ++e) {
        INFO("element " << e);
        CHECK(std::fabs(double(deq[e]) - w_at(wb, e)) <= std::ldexp(w_mag(wb, e), -22));
      }
    }
    auto xf = rand_f32(g, size_t(m * k));
    for (int64_t e = 0; e < k; ++e) {
      xf[size_t(e)] = 1.0f;
      xf[size_t(k + e)] = -1.0f;
    }
    std::vector<BlockQ8_0> xq(size_t(m * nb));
    for (int64_t c = 0; c < m; ++c) quantize_row_q8_0(xf.data() + c * k, xq.data() + c * nb, k);
    // The scalar path's bits are the reference every ISA must give.
    std::vector<float> ref_bits(size_t(m * n));
    {
      IsaScope s("scalar");
      gemm(w.data(), xq.data(), ref_bits.data(), k, m, n, 0, n);
    }
    for (int64_t c = 0; c < m; ++c) {
      for (int64_t r = 0; r < n; ++r) {
        INFO("k " << k << " column " << c << " row " << r);
        // (a) against the dequantised blocks times the quantised activations, in fp64: only
        // the f32 roundings of the written arithmetic separate them.
        double exact = 0, terms = 0, bound_q = 0;
        // (b) against the float activations themselves: each Q8_0 element is off by at most
        // amax / 254 (rounding q) + amax * 2^-11 (d rounded to fp16, |q| <= 127).
        double vs_float = 0;
        for (int64_t b = 0; b < nb; ++b) {
          const TW& wb = w[size_t(r * nbw + b * 32 / kPer)];
          const int e0 = static_cast<int>(b * 32 % kPer);  // the block's first element in wb
          const BlockQ8_0& xb = xq[size_t(c * nb + b)];
          double amax = 0;
          for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(double(xf[size_t(c * k + b * 32 + j)])));
          for (int j = 0; j < 32; ++j) {
            const double wj = w_at(wb, e0 + j);
            const double t = wj * double(fp16_to_fp32(xb.d)) * xb.qs[j];
            exact += t;
            terms += w_mag(wb, e0 + j) * std::fabs(double(fp16_to_fp32(xb.d)) * xb.qs[j]);
            vs_float += wj * double(xf[size_t(c * k + b * 32 + j)]);
            bound_q += std::fabs(wj) * amax * (1.0 / 254 + std::ldexp(1.0, -11));
          }
        }
        const float got = ref_bits[size_t(c * n + r)];
        CHECK(std::fabs(double(got) - exact) <= kRelTol * terms);
        CHECK(std::fabs(double(got) - vs_float) <= bound_q + kRelTol * terms);
      }
    }
    for (const auto& isa : isas()) {
      IsaScope s(isa);
      std::vector<float> all(static_cast<size_t>(m * n)), one(static_cast<size_t>(n));
      gemm(w.data(), xq.data(), all.data(), k, m, n, 0, n);
      for (int64_t c = 0; c < m; ++c) {
        gemm(w.data(), xq.data() + c * nb, one.data(), k, 1, n, 0, n);
        for (int64_t r = 0; r < n; ++r) {
          INFO(isa << " k " << k << " column " << c << " row " << r);
          CHECK(bits(all[size_t(c * n + r)]) == bits(ref_bits[size_t(c * n + r)]));
          CHECK(bits(one[size_t(r)]) == bits(ref_bits[size_t(c * n + r)]));
          CHECK(bits(vec_dot(w.data() + r * nbw, xq.data() + c * nb, k)) == bits(ref_bits[size_t(c * n + r)]));
        }
      }
      // A row range (as a thread pool splits it) gives the same bits.
      std::vector<float> part(static_cast<size_t>(m * n), -1.0f);
      gemm(w.data(), xq.data(), part.data(), k, m, n, 3, 8);
      for (int64_t c = 0; c < m; ++c)
        for (int64_t r = 3; r < 8; ++r) CHECK(bits(part[size_t(c * n + r)]) == bits(ref_bits[size_t(c * n + r)]));
    }
  }
}

}  // namespace

TEST_CASE("Q4_1 x Q8_0: fp64 reference bound, the same bits on every ISA, batch-invariant", "[kernels][q4_1]") {
  std::mt19937 g(41);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f), mn(-0.4f, 0.1f);
  auto make = [&](size_t nblocks) {
    std::vector<BlockQ4_1> v(nblocks);
    for (auto& b : v) {
      b.d = fp32_to_fp16(sc(g));
      b.m = fp32_to_fp16(mn(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
    }
    return v;
  };
  auto w_at = [](const BlockQ4_1& b, int j) {  // ggml's dequantisation, in fp64
    const int q = j < 16 ? (b.qs[j] & 0x0F) : (b.qs[j - 16] >> 4);
    return double(fp16_to_fp32(b.d)) * q + double(fp16_to_fp32(b.m));
  };
  auto w_mag = [](const BlockQ4_1& b, int j) {
    const int q = j < 16 ? (b.qs[j] & 0x0F) : (b.qs[j - 16] >> 4);
    return std::fabs(double(fp16_to_fp32(b.d)) * q) + std::fabs(double(fp16_to_fp32(b.m)));
  };
  check_native_q<BlockQ4_1>(g, tandem::GgmlType::kQ4_1, {32, 64, 96, 576, 1536, 4128}, make, w_at, w_mag,
                            gemm_q4_1_q8_0, vec_dot_q4_1_q8_0);
}

TEST_CASE("Q5_0 x Q8_0: fp64 reference bound, the same bits on every ISA, batch-invariant", "[kernels][q5_0]") {
  std::mt19937 g(50);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f);
  auto make = [&](size_t nblocks) {
    std::vector<BlockQ5_0> v(nblocks);
    for (auto& b : v) {
      b.d = fp32_to_fp16(sc(g));
      for (auto& h : b.qh) h = static_cast<uint8_t>(byte(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
    }
    return v;
  };
  auto w_at = [](const BlockQ5_0& b, int j) {  // ggml's dequantisation, in fp64: bit j of qh is bit 4 of q_j
    const uint32_t qh = uint32_t(b.qh[0]) | uint32_t(b.qh[1]) << 8 | uint32_t(b.qh[2]) << 16 | uint32_t(b.qh[3]) << 24;
    const int lo = j < 16 ? (b.qs[j] & 0x0F) : (b.qs[j - 16] >> 4);
    return double(fp16_to_fp32(b.d)) * ((lo | int((qh >> j) & 1u) << 4) - 16);
  };
  auto w_mag = [&](const BlockQ5_0& b, int j) { return std::fabs(w_at(b, j)); };
  check_native_q<BlockQ5_0>(g, tandem::GgmlType::kQ5_0, {32, 64, 96, 576, 1536, 4128}, make, w_at, w_mag,
                            gemm_q5_0_q8_0, vec_dot_q5_0_q8_0);
}

TEST_CASE("Q4_K x Q8_0: fp64 reference bound, the same bits on every ISA, batch-invariant", "[kernels][q4_k]") {
  std::mt19937 g(412);
  std::uniform_int_distribution<int> byte(0, 255), pick(0, 7);
  std::uniform_real_distribution<float> sc(1e-4f, 4e-3f), mn(0.0f, 2e-2f);
  auto make = [&](size_t nblocks) {
    std::vector<BlockQ4_K> v(nblocks);
    for (auto& b : v) {
      // One block in eight has extreme parts: 6-bit scales and mins all 63 or all 0, every
      // nibble 15 or 0, the largest fp16 scales a 256-element block of weights <= 1 can use.
      const int kind = pick(g);
      b.d = fp32_to_fp16(kind == 0 ? 1.0f / 945 : sc(g));
      b.dmin = fp32_to_fp16(kind == 0 ? 1.0f / 63 : kind == 1 ? 0.0f : mn(g));
      for (auto& q : b.scales) q = static_cast<uint8_t>(kind == 0 ? 0xFF : kind == 1 ? 0x00 : byte(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(kind == 0 ? 0xFF : kind == 1 ? 0x00 : byte(g));
    }
    return v;
  };
  // ggml's dequantisation, in fp64: 64-element chunk i uses bytes 32i..32i+31, low nibbles
  // first (sub-block 2i), then high nibbles (sub-block 2i + 1).
  auto nibble = [](const BlockQ4_K& b, int e) {
    const uint8_t v = b.qs[(e / 64) * 32 + e % 32];
    return e % 64 < 32 ? v & 0x0F : v >> 4;
  };
  auto w_at = [&](const BlockQ4_K& b, int e) {
    int s = 0, m = 0;
    k4_scale_min(b.scales, e / 32, s, m);
    return double(fp16_to_fp32(b.d)) * s * nibble(b, e) - double(fp16_to_fp32(b.dmin)) * m;
  };
  auto w_mag = [&](const BlockQ4_K& b, int e) {
    int s = 0, m = 0;
    k4_scale_min(b.scales, e / 32, s, m);
    return std::fabs(double(fp16_to_fp32(b.d)) * s * nibble(b, e)) + std::fabs(double(fp16_to_fp32(b.dmin)) * m);
  };
  // The scales' unpacking against the layout written out by hand: sub-block j < 4 in the
  // low 6 bits of bytes j (scale) and j + 4 (min); j >= 4 in byte j + 4's nibbles plus the
  // top 2 bits of bytes j - 4 (scale) and j (min).
  BlockQ4_K one{};
  for (int i = 0; i < 12; ++i) one.scales[i] = static_cast<uint8_t>(0x40 * (i % 4) + 3 * i + 1);
  for (int j = 0; j < 8; ++j) {
    int s = -1, m = -1;
    k4_scale_min(one.scales, j, s, m);
    const int want_s = j < 4 ? one.scales[j] % 64 : one.scales[j + 4] % 16 + 16 * (one.scales[j - 4] / 64);
    const int want_m = j < 4 ? one.scales[j + 4] % 64 : one.scales[j + 4] / 16 + 16 * (one.scales[j] / 64);
    CHECK(s == want_s);
    CHECK(m == want_m);
  }
  check_native_q<BlockQ4_K, 256>(g, tandem::GgmlType::kQ4_K, {256, 512, 768, 2048, 8448}, make, w_at, w_mag,
                                 gemm_q4_k_q8_0, vec_dot_q4_k_q8_0);
}

TEST_CASE("Q5_1 x Q8_0: fp64 reference bound, the same bits on every ISA, batch-invariant", "[kernels][q5_1]") {
  std::mt19937 g(51);
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_real_distribution<float> sc(0.001f, 0.05f), mn(-0.8f, 0.1f);
  auto make = [&](size_t nblocks) {
    std::vector<BlockQ5_1> v(nblocks);
    for (auto& b : v) {
      b.d = fp32_to_fp16(sc(g));
      b.m = fp32_to_fp16(mn(g));
      for (auto& h : b.qh) h = static_cast<uint8_t>(byte(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
    }
    return v;
  };
  auto q_of = [](const BlockQ5_1& b, int j) {  // bit j of qh (little-endian) is bit 4 of q_j
    const uint32_t qh = uint32_t(b.qh[0]) | uint32_t(b.qh[1]) << 8 | uint32_t(b.qh[2]) << 16 | uint32_t(b.qh[3]) << 24;
    return (j < 16 ? (b.qs[j] & 0x0F) : (b.qs[j - 16] >> 4)) | int((qh >> j) & 1u) << 4;
  };
  auto w_at = [&](const BlockQ5_1& b, int j) {  // ggml's dequantisation, in fp64
    return double(fp16_to_fp32(b.d)) * q_of(b, j) + double(fp16_to_fp32(b.m));
  };
  auto w_mag = [&](const BlockQ5_1& b, int j) {
    return std::fabs(double(fp16_to_fp32(b.d)) * q_of(b, j)) + std::fabs(double(fp16_to_fp32(b.m)));
  };
  check_native_q<BlockQ5_1>(g, tandem::GgmlType::kQ5_1, {32, 64, 96, 576, 1536, 4128}, make, w_at, w_mag,
                            gemm_q5_1_q8_0, vec_dot_q5_1_q8_0);
}

TEST_CASE("Q5_K x Q8_0: fp64 reference bound, the same bits on every ISA, batch-invariant", "[kernels][q5_k]") {
  std::mt19937 g(512);
  std::uniform_int_distribution<int> byte(0, 255), pick(0, 7);
  std::uniform_real_distribution<float> sc(1e-4f, 2e-3f), mn(0.0f, 2e-2f);
  auto make = [&](size_t nblocks) {
    std::vector<BlockQ5_K> v(nblocks);
    for (auto& b : v) {
      // One block in eight has scales and mins all 63 and every q 31 (all bits set), one all 0.
      const int kind = pick(g);
      b.d = fp32_to_fp16(kind == 0 ? 1.0f / 1953 : sc(g));
      b.dmin = fp32_to_fp16(kind == 0 ? 1.0f / 63 : kind == 1 ? 0.0f : mn(g));
      for (auto& q : b.scales) q = static_cast<uint8_t>(kind == 0 ? 0xFF : kind == 1 ? 0x00 : byte(g));
      for (auto& q : b.qh) q = static_cast<uint8_t>(kind == 0 ? 0xFF : kind == 1 ? 0x00 : byte(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(kind == 0 ? 0xFF : kind == 1 ? 0x00 : byte(g));
    }
    return v;
  };
  // ggml's dequantisation, in fp64: 64-element chunk i uses qs bytes 32i..32i+31, low nibbles
  // first, and bits 2i (low half) and 2i + 1 (high half) of qh[l].
  auto q_of = [](const BlockQ5_K& b, int e) {
    const int chunk = e / 64, l = e % 32;
    const bool high = e % 64 >= 32;
    const int lo = high ? b.qs[32 * chunk + l] >> 4 : b.qs[32 * chunk + l] & 0x0F;
    return lo + ((b.qh[l] >> (2 * chunk + (high ? 1 : 0))) & 1) * 16;
  };
  auto w_at = [&](const BlockQ5_K& b, int e) {
    int s = 0, m = 0;
    k4_scale_min(b.scales, e / 32, s, m);
    return double(fp16_to_fp32(b.d)) * s * q_of(b, e) - double(fp16_to_fp32(b.dmin)) * m;
  };
  auto w_mag = [&](const BlockQ5_K& b, int e) {
    int s = 0, m = 0;
    k4_scale_min(b.scales, e / 32, s, m);
    return std::fabs(double(fp16_to_fp32(b.d)) * s * q_of(b, e)) + std::fabs(double(fp16_to_fp32(b.dmin)) * m);
  };
  check_native_q<BlockQ5_K, 256>(g, tandem::GgmlType::kQ5_K, {256, 512, 768, 2048, 8448}, make, w_at, w_mag,
                                 gemm_q5_k_q8_0, vec_dot_q5_k_q8_0);
}

TEST_CASE("Q6_K x Q8_0: fp64 reference bound, the same bits on every ISA, batch-invariant", "[kernels][q6_k]") {
  std::mt19937 g(614);
  std::uniform_int_distribution<int> byte(0, 255), scale(-128, 127), pick(0, 7);
  std::uniform_real_distribution<float> sc(1e-5f, 5e-4f);
  auto make = [&](size_t nblocks) {
    std::vector<BlockQ6_K> v(nblocks);
    for (auto& b : v) {
      // One block in eight is extreme: every q = -32 (all bits 0) and every scale -128 (the
      // largest |s * q|), or every q = 31 and every scale 127.
      const int kind = pick(g);
      b.d = fp32_to_fp16(kind <= 1 ? 1.0f / 4096 : sc(g));
      for (auto& q : b.ql) q = static_cast<uint8_t>(kind == 0 ? 0x00 : kind == 1 ? 0xFF : byte(g));
      for (auto& q : b.qh) q = static_cast<uint8_t>(kind == 0 ? 0x00 : kind == 1 ? 0xFF : byte(g));
      for (auto& s : b.scales) s = static_cast<int8_t>(kind == 0 ? -128 : kind == 1 ? 127 : scale(g));
    }
    return v;
  };
  // ggml's dequantisation, in fp64, from its loops over the block's halves and quarters.
  auto w_at = [](const BlockQ6_K& b, int e) {
    const int h = e / 128, quarter = (e % 128) / 32, l = e % 32;
    const uint8_t lo_byte = b.ql[64 * h + (quarter == 1 || quarter == 3 ? 32 : 0) + l];
    const int lo = quarter < 2 ? lo_byte & 0x0F : lo_byte >> 4;
    const int hi = (b.qh[32 * h + l] >> (2 * quarter)) & 3;
    return double(fp16_to_fp32(b.d)) * b.scales[8 * h + 2 * quarter + l / 16] * ((lo | hi << 4) - 32);
  };
  auto w_mag = [&](const BlockQ6_K& b, int e) { return std::fabs(w_at(b, e)); };
  check_native_q<BlockQ6_K, 256>(g, tandem::GgmlType::kQ6_K, {256, 512, 768, 2048, 8448}, make, w_at, w_mag,
                                 gemm_q6_k_q8_0, vec_dot_q6_k_q8_0);
}
