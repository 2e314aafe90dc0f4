// Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K weights run natively on the GPU (kernels/cuda gemm.cu:
// the decode GEMV, the dp4a GEMM, the Tensor Core GEMM, merged parts) against the CPU kernels
// (kernels/cpu gemm_q4_1_q8_0 ... gemm_q6_k_q8_0), bit for bit on every ISA this machine runs
// (docs/arithmetic.md "Quantised dot product": Q4_1 / Q5_1's offset term (m_w * d_x) * T_b,
// Q5_0's 5-bit values minus 16, the K-quants' per-32 p_b with sub-block scales and mins);
// then whole models: small models whose Q4_0 matrices are re-encoded as Q4_1 and Q5_0, or as
// Q4_K, Q6_K, Q5_K and Q5_1, and SmolLM2's Q4_1 file, on the GPU executor against the CPU's.
// Needs a CUDA device, real or emulated (cuemu); skipped without one.
#include <catch2/catch.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <random>
#include <sstream>
#include <type_traits>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "cpu_test_support.hpp"
#include "gemm_test_support.hpp"
#include "gpu_test_support.hpp"
#include "hooks/gpu_hooks.hpp"
#include "kv_test_support.hpp"
#include "options_parity.hpp"
#include "quant_blocks.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/gguf/gguf_writer.hpp"
#include "test_support.hpp"

using namespace tandem;
namespace k = tandem::kernels;

#if TANDEM_HAVE_CUDA
namespace {

// The CPU kernel of a weight block type (kernels/cpu/cpu_kernels.hpp).
void cpu_gemm(const std::vector<k::BlockQ4_1>& w, const std::vector<k::BlockQ8_0>& x, float* y, int64_t kd, int64_t m,
              int64_t n) {
  k::gemm_q4_1_q8_0(w.data(), x.data(), y, kd, m, n, 0, n);
}
void cpu_gemm(const std::vector<k::BlockQ5_0>& w, const std::vector<k::BlockQ8_0>& x, float* y, int64_t kd, int64_t m,
              int64_t n) {
  k::gemm_q5_0_q8_0(w.data(), x.data(), y, kd, m, n, 0, n);
}
void cpu_gemm(const std::vector<k::BlockQ5_1>& w, const std::vector<k::BlockQ8_0>& x, float* y, int64_t kd, int64_t m,
              int64_t n) {
  k::gemm_q5_1_q8_0(w.data(), x.data(), y, kd, m, n, 0, n);
}
void cpu_gemm(const std::vector<k::BlockQ4_K>& w, const std::vector<k::BlockQ8_0>& x, float* y, int64_t kd, int64_t m,
              int64_t n) {
  k::gemm_q4_k_q8_0(w.data(), x.data(), y, kd, m, n, 0, n);
}
void cpu_gemm(const std::vector<k::BlockQ5_K>& w, const std::vector<k::BlockQ8_0>& x, float* y, int64_t kd, int64_t m,
              int64_t n) {
  k::gemm_q5_k_q8_0(w.data(), x.data(), y, kd, m, n, 0, n);
}
void cpu_gemm(const std::vector<k::BlockQ6_K>& w, const std::vector<k::BlockQ8_0>& x, float* y, int64_t kd, int64_t m,
              int64_t n) {
  k::gemm_q6_k_q8_0(w.data(), x.data(), y, kd, m, n, 0, n);
}
std::vector<k::BlockQ5_1> random_weights(std::mt19937& g, size_t count, const k::BlockQ5_1*) {
  return gemm_test::random_q5_1(g, count);
}
std::vector<k::BlockQ4_K> random_weights(std::mt19937& g, size_t count, const k::BlockQ4_K*) {
  return gemm_test::random_k_min<k::BlockQ4_K>(g, count);
}
std::vector<k::BlockQ5_K> random_weights(std::mt19937& g, size_t count, const k::BlockQ5_K*) {
  return gemm_test::random_k_min<k::BlockQ5_K>(g, count);
}
std::vector<k::BlockQ6_K> random_weights(std::mt19937& g, size_t count, const k::BlockQ6_K*) {
  return gemm_test::random_q6_k(g, count);
}
std::vector<k::BlockQ4_1> random_weights(std::mt19937& g, size_t count, const k::BlockQ4_1*) {
  return gemm_test::random_q4_1(g, count);
}
std::vector<k::BlockQ5_0> random_weights(std::mt19937& g, size_t count, const k::BlockQ5_0*) {
  return gemm_test::random_q5_0(g, count);
}

// n = 45 rows (a partial thread block, warp pair and Tensor Core tile), k of 1, 18, 33 and
// 129 blocks of 32 (lanes with one to five blocks, the GEMV's load-ahead pair half outside
// the row, partial Tensor Core stages; K-quants: 8, 24, 40 and 136, whole 256-element
// blocks), m = 1 (decode GEMV), 7 (dp4a GEMM), 16 and 33 (Tensor Core GEMM, its last tile
// partial; the dp4a GEMM with Tensor Cores off).
template <class WB>
void check_against_cpu(GgmlType type, uint32_t seed) {
  std::mt19937 g(seed);
  const int64_t n = 45, per = ggml_block_elements(type);
  const auto kds = per == 32 ? std::vector<int64_t>{32, 576, 1056, 4128} : std::vector<int64_t>{256, 768, 1280, 4352};
  for (const int64_t kd : kds) {
    const int64_t nb = kd / 32;
    const auto w = random_weights(g, size_t(n * kd / per), static_cast<const WB*>(nullptr));
    for (const int64_t m : {int64_t{1}, int64_t{7}, int64_t{16}, int64_t{33}}) {
      const auto xq = test::rand_q8(g, size_t(m * nb));
      for (const bool tc : {false, true}) {
        std::vector<float> gpu(size_t(m * n));
        gpu_testing::gemm_q8_blocks(type, w.data(), n, kd, xq.data(), m, tc, gpu.data());
        for (const auto& isa : test::isas()) {
          test::IsaScope scope(isa);
          std::vector<float> cpu(gpu.size(), std::numeric_limits<float>::quiet_NaN());
          cpu_gemm(w, xq, cpu.data(), kd, m, n);
          INFO(ggml_type_name(type) << " " << isa << " k " << kd << " m " << m << (tc ? " tensor cores" : " dp4a"));
          CHECK(test::same_bits(gpu, cpu));
        }
      }
    }
  }
}

// Merged launches (gemm_parts: Q/K/V-like 64/16/16 and odd 33/7/1 row counts, biases on all
// but the second matrix) against gemm() per matrix and the CPU kernel plus the bias.
template <class WB>
void check_parts(GgmlType type, uint32_t seed) {
  std::mt19937 g(seed);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  const int64_t per = ggml_block_elements(type);  // 32, or 256 for the K-quants
  for (const std::vector<int64_t>& n : {std::vector<int64_t>{64, 16, 16}, std::vector<int64_t>{33, 7, 1}}) {
    for (const int64_t nb : {per / 32, per / 32 * 37}) {
      std::vector<std::vector<WB>> w;
      std::vector<const void*> ptrs;
      std::vector<std::vector<float>> bias(n.size());
      for (size_t i = 0; i < n.size(); ++i) {
        w.push_back(random_weights(g, size_t(n[i] * nb * 32 / per), static_cast<const WB*>(nullptr)));
        ptrs.push_back(w.back().data());
        if (i == 1) continue;
        bias[i].resize(size_t(n[i]));
        for (float& b : bias[i]) b = nd(g);
      }
      for (const int64_t m : {int64_t{1}, int64_t{5}, int64_t{16}}) {
        const auto xq = test::rand_q8(g, size_t(m * nb));
        for (const bool tc : {false, true}) {
          std::vector<std::vector<float>> merged, separate;
          gpu_testing::gemm_parts_q8_blocks(type, ptrs, n, nb * 32, xq.data(), m, true, tc, merged, bias);
          gpu_testing::gemm_parts_q8_blocks(type, ptrs, n, nb * 32, xq.data(), m, false, tc, separate, bias);
          REQUIRE(merged.size() == n.size());
          for (size_t i = 0; i < n.size(); ++i) {
            std::vector<float> want(size_t(m * n[i]));
            cpu_gemm(w[i], xq, want.data(), nb * 32, m, n[i]);
            for (int64_t c = 0; c < m && !bias[i].empty(); ++c) {
              for (int64_t r = 0; r < n[i]; ++r) want[size_t(c * n[i] + r)] += bias[i][size_t(r)];
            }
            INFO(ggml_type_name(type) << " matrix " << i << " of " << n[i] << " rows, " << nb << " blocks, m " << m
                                      << (tc ? " tensor cores" : " dp4a"));
            CHECK(test::same_bits(merged[i], separate[i]));
            CHECK(test::same_bits(merged[i], want));
          }
        }
      }
    }
  }
}

// A file's own matrices `names` of `type` (not random blocks) through the decode GEMV (m =
// 1), the dp4a GEMM (m = 6) and the Tensor Core GEMM (m = 16), against the CPU kernel on
// every ISA. SKIPPED when the file is absent.
template <class WB>
void check_file_matrices(const std::filesystem::path& path, GgmlType type, std::initializer_list<const char*> names) {
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-smollm2 / scripts/fetch-gemma3 download it)");
    return;
  }
  const auto file = GgufFile::open(path);
  std::mt19937 g(29);
  for (const char* name : names) {
    const GgufTensorInfo* t = file->find_tensor(name);
    REQUIRE(t != nullptr);
    REQUIRE(t->type == type);
    const int64_t kd = t->ne[0], n = t->n_rows(), nb = kd / 32;
    std::vector<WB> w(size_t(n * kd / ggml_block_elements(type)));
    std::memcpy(w.data(), t->data, w.size() * sizeof(WB));
    for (const int64_t m : {int64_t{1}, int64_t{6}, int64_t{16}}) {
      std::vector<float> x(size_t(m * kd));
      std::normal_distribution<float> nd(0.0f, 1.0f);
      for (float& v : x) v = nd(g);
      std::vector<k::BlockQ8_0> xq(size_t(m * nb));
      for (int64_t c = 0; c < m; ++c) k::quantize_row_q8_0(&x[size_t(c * kd)], &xq[size_t(c * nb)], kd);
      std::vector<float> gpu(size_t(m * n));
      gpu_testing::gemm_q8_blocks(type, w.data(), n, kd, xq.data(), m, true, gpu.data());
      for (const auto& isa : test::isas()) {
        test::IsaScope scope(isa);
        std::vector<float> cpu(gpu.size(), std::numeric_limits<float>::quiet_NaN());
        cpu_gemm(w, xq, cpu.data(), kd, m, n);
        INFO(name << " " << isa << " m " << m);
        CHECK(test::same_bits(gpu, cpu));
      }
    }
  }
}

// Largest |cpu - gpu| / max|cpu| over the rows of two [rows][n_vocab] logits arrays.
double worst_ratio(std::span<const float> cpu, std::span<const float> gpu, int32_t n_vocab) {
  double worst = 0.0;
  for (size_t r = 0; r * size_t(n_vocab) < cpu.size(); ++r) {
    worst = std::max(worst, test::row_ratio(cpu.subspan(r * size_t(n_vocab), size_t(n_vocab)),
                                            gpu.subspan(r * size_t(n_vocab), size_t(n_vocab))));
  }
  return worst;
}

// A copy of the shared Q4_0 model `name` whose Q4_0 matrices are re-encoded value for value,
// in turn as Q4_1 (the same d and nibbles, m = -8 d, exact in fp16) and as Q5_0 (the same d,
// the 5-bit value q + 8), so a small model takes both types through every GPU path: the same
// weights, another arithmetic (Q4_1's offset term, Q5_0's fifth bit).
std::filesystem::path write_q4_1_q5_0_copy(const std::string& name) {
  const auto src = GgufFile::open(test::model_path(name));
  GgufWriter w;
  for (const auto& kv : src->metadata()) w.add_value(kv.key, kv.value);
  int converted = 0;
  for (const auto& t : src->tensors()) {
    const GgufTensorInfo* info = &t;
    if (t.type != GgmlType::kQ4_0 || t.ne.size() != 2) {
      w.add_tensor(t.name, t.ne, t.type,
                   [src, info](std::span<std::byte> dst) { std::memcpy(dst.data(), info->data, dst.size()); });
      continue;
    }
    const bool q4_1 = converted++ % 2 == 0;
    w.add_tensor(t.name, t.ne, q4_1 ? GgmlType::kQ4_1 : GgmlType::kQ5_0, [src, info, q4_1](std::span<std::byte> dst) {
      const size_t count = info->n_elements / 32;
      const auto* in = reinterpret_cast<const k::BlockQ4_0*>(info->data);
      for (size_t b = 0; b < count; ++b) {
        if (q4_1) {
          k::BlockQ4_1 o{};
          o.d = in[b].d;
          o.m = k::fp32_to_fp16_bits(-8.0f * k::fp16_bits_to_fp32(in[b].d));
          std::memcpy(o.qs, in[b].qs, sizeof o.qs);
          std::memcpy(dst.data() + b * sizeof o, &o, sizeof o);
        } else {
          k::BlockQ5_0 o{};
          o.d = in[b].d;
          uint32_t qh = 0;
          for (int j = 0; j < 32; ++j) {
            const int q = (j < 16 ? in[b].qs[j] & 0x0F : in[b].qs[j - 16] >> 4) + 8;  // 8..23
            qh |= uint32_t(q >> 4) << j;
            o.qs[j % 16] = static_cast<uint8_t>(j < 16 ? (q & 0x0F) : (o.qs[j % 16] | (q & 0x0F) << 4));
          }
          std::memcpy(o.qh, &qh, sizeof qh);
          std::memcpy(dst.data() + b * sizeof o, &o, sizeof o);
        }
      }
    });
  }
  const auto path = test::scratch_dir("quant-types-" + name) / (name + "-q4_1-q5_0.gguf");
  w.write(path);
  return path;
}

// Prefill of 37 + 17 tokens (the Tensor Core GEMM), one of 5 (the dp4a GEMM) and 6 decode
// steps (the GEMV), against the CPU executor: every row the same bytes, as the Q4_0 models
// in test_gpu_executor.cpp. Then Tensor Cores and merged matmuls off give the same bits.
void check_logits_vs_cpu(const std::shared_ptr<const Model>& model) {
  const auto& hp = model->hparams();
  const int32_t n_vocab = hp.n_vocab;
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  GpuQ4Executor gpu(model);
  const auto ids = test::prompt_ids(37, n_vocab);
  auto cstore = test::make_store(hp, 32), gstore = test::make_store(hp, 32);
  KvSequence ca(*cstore, 128), cb(*cstore, 128), cc(*cstore, 128);
  KvSequence ga(*gstore, 128), gb(*gstore, 128), gc(*gstore, 128);
  const std::span<const int32_t> ia(ids.data(), 37), ib(ids.data() + 5, 17), ic(ids.data() + 3, 5);
  SequenceStep cbatch[2] = {{&ca, ia, 0, LogitsRows::kAll}, {&cb, ib, 0, LogitsRows::kLast}};
  SequenceStep gbatch[2] = {{&ga, ia, 0, LogitsRows::kAll}, {&gb, ib, 0, LogitsRows::kLast}};
  std::vector<float> lc(size_t(38) * size_t(n_vocab)), lg(lc.size(), std::numeric_limits<float>::quiet_NaN());
  cpu.step(cbatch, lc);
  gpu.step(gbatch, lg);
  INFO("prefill worst |diff| / max|logit| = " << worst_ratio(lc, lg, n_vocab));
  CHECK(test::same_bits(lc, lg));
  SequenceStep cs[1] = {{&cc, ic, 0, LogitsRows::kAll}};
  SequenceStep gs[1] = {{&gc, ic, 0, LogitsRows::kAll}};
  std::vector<float> sc(size_t(5) * size_t(n_vocab)), sg(sc.size(), std::numeric_limits<float>::quiet_NaN());
  cpu.step(cs, sc);
  gpu.step(gs, sg);
  INFO("5-token prefill worst ratio " << worst_ratio(sc, sg, n_vocab));
  CHECK(test::same_bits(sc, sg));
  for (int step = 0; step < 6; ++step) {
    const int32_t ta = ids[size_t(step)], tb = ids[size_t(36 - step)];
    SequenceStep cd[2] = {{&ca, std::span<const int32_t>(&ta, 1), ca.n_tokens(), LogitsRows::kLast},
                          {&cb, std::span<const int32_t>(&tb, 1), cb.n_tokens(), LogitsRows::kLast}};
    SequenceStep gd[2] = {{&ga, std::span<const int32_t>(&ta, 1), ga.n_tokens(), LogitsRows::kLast},
                          {&gb, std::span<const int32_t>(&tb, 1), gb.n_tokens(), LogitsRows::kLast}};
    std::vector<float> dc(2 * size_t(n_vocab)), dg(dc.size(), std::numeric_limits<float>::quiet_NaN());
    cpu.step(cd, dc);
    gpu.step(gd, dg);
    INFO("decode step " << step << " worst ratio " << worst_ratio(dc, dg, n_vocab));
    CHECK(test::same_bits(dc, dg));
  }
  GpuExecutorOptions plain;
  plain.tensor_cores = false;
  plain.merge_matmuls = false;
  test::check_same_logits(model, GpuExecutorOptions{}, plain, std::span(ids).first(20), std::span(ids).subspan(7, 3),
                          {{ids[10]}, {ids[11], ids[14]}});
}

// The 32 signed values q - 8 of a Q4_0 block.
std::array<int, 32> q4_0_values(const k::BlockQ4_0& b) {
  std::array<int, 32> q{};
  for (int e = 0; e < 32; ++e) q[size_t(e)] = (e < 16 ? b.qs[e] & 0x0F : b.qs[e - 16] >> 4) - 8;
  return q;
}

// Eight Q4_0 blocks (d_j * v, v = q - 8) as one Q4_K or Q5_K block: sub-block j's weights are
// a_j * u - o_j with a_j = |d_j|, u = v + 8 and o_j = 8 a_j for d_j >= 0, u = 7 - v and o_j =
// 7 a_j for d_j < 0 (Q5_K: u + 16 and o_j + 16 a_j, so every fifth bit is set), a_j and o_j
// rounded to the 6-bit multiples of d = max a_j / 63 and dmin = max o_j / 63: the nearest
// Q4_K / Q5_K of the same weights, not the same values.
template <class KB>
KB encode_k_min(const k::BlockQ4_0* in) {
  constexpr bool q5 = std::is_same_v<KB, k::BlockQ5_K>;
  KB o{};
  float a[8], off[8], amax = 0.0f, omax = 0.0f;
  for (int j = 0; j < 8; ++j) {
    const float d = k::fp16_bits_to_fp32(in[j].d);
    a[j] = std::fabs(d);
    off[j] = (d >= 0.0f ? 8.0f : 7.0f) * a[j] + (q5 ? 16.0f * a[j] : 0.0f);
    amax = std::max(amax, a[j]);
    omax = std::max(omax, off[j]);
  }
  o.d = k::fp32_to_fp16_bits(amax / 63.0f);
  o.dmin = k::fp32_to_fp16_bits(omax / 63.0f);
  const float dd = k::fp16_bits_to_fp32(o.d), dm = k::fp16_bits_to_fp32(o.dmin);
  for (int j = 0; j < 8; ++j) {
    const int sc = dd > 0.0f ? std::clamp(int(std::lround(a[j] / dd)), 0, 63) : 0;
    const int mn = dm > 0.0f ? std::clamp(int(std::lround(off[j] / dm)), 0, 63) : 0;
    if (j < 4) {
      o.scales[j] = static_cast<uint8_t>(o.scales[j] | sc);
      o.scales[j + 4] = static_cast<uint8_t>(o.scales[j + 4] | mn);
    } else {
      o.scales[j + 4] = static_cast<uint8_t>((sc & 0x0F) | (mn & 0x0F) << 4);
      o.scales[j - 4] = static_cast<uint8_t>(o.scales[j - 4] | (sc >> 4) << 6);
      o.scales[j] = static_cast<uint8_t>(o.scales[j] | (mn >> 4) << 6);
    }
    const bool pos = k::fp16_bits_to_fp32(in[j].d) >= 0.0f;
    const auto v = q4_0_values(in[j]);
    for (int e = 0; e < 32; ++e) {
      const int u = (pos ? v[size_t(e)] + 8 : 7 - v[size_t(e)]) + (q5 ? 16 : 0);
      uint8_t& byte = o.qs[32 * (j / 2) + e];
      byte = static_cast<uint8_t>(byte | (u & 0x0F) << (j % 2 == 0 ? 0 : 4));
      if constexpr (q5) o.qh[e] = static_cast<uint8_t>(o.qh[e] | (u >> 4) << j);
    }
  }
  return o;
}

// Eight Q4_0 blocks as one Q6_K block: q = v + 32 (v = q4 - 8), both sub-block scales of
// block j round(d_j / d), d = max |d_j| / 127 (the nearest Q6_K of the same weights).
k::BlockQ6_K encode_q6_k(const k::BlockQ4_0* in) {
  k::BlockQ6_K o{};
  float amax = 0.0f;
  for (int j = 0; j < 8; ++j) amax = std::max(amax, std::fabs(k::fp16_bits_to_fp32(in[j].d)));
  o.d = k::fp32_to_fp16_bits(amax / 127.0f);
  const float d = k::fp16_bits_to_fp32(o.d);
  for (int j = 0; j < 8; ++j) {
    const int s = d > 0.0f ? std::clamp(int(std::lround(k::fp16_bits_to_fp32(in[j].d) / d)), -128, 127) : 0;
    o.scales[2 * j] = o.scales[2 * j + 1] = static_cast<int8_t>(s);
    const auto v = q4_0_values(in[j]);
    for (int l = 0; l < 32; ++l) {
      const int e = 32 * j + l, h = e / 128, quarter = (e % 128) / 32, q = v[size_t(l)] + 32;
      uint8_t& lo = o.ql[64 * h + 32 * (quarter % 2) + l];
      lo = static_cast<uint8_t>(lo | (q & 0x0F) << (quarter < 2 ? 0 : 4));
      o.qh[32 * h + l] = static_cast<uint8_t>(o.qh[32 * h + l] | (q >> 4) << (2 * quarter));
    }
  }
  return o;
}

// One Q4_0 block as Q5_1, value for value: the same d, m = -16 d (exact in fp16) and the
// 5-bit q = v + 16 (8..23: the fifth bit is set for v >= 0).
k::BlockQ5_1 encode_q5_1(const k::BlockQ4_0& in) {
  k::BlockQ5_1 o{};
  o.d = in.d;
  o.m = k::fp32_to_fp16_bits(-16.0f * k::fp16_bits_to_fp32(in.d));
  uint32_t qh = 0;
  const auto v = q4_0_values(in);
  for (int e = 0; e < 32; ++e) {
    const int q = v[size_t(e)] + 16;  // d * q - 16 d == d * v
    qh |= uint32_t(q >> 4) << e;
    o.qs[e % 16] = static_cast<uint8_t>(o.qs[e % 16] | (q & 0x0F) << (e < 16 ? 0 : 4));
  }
  std::memcpy(o.qh, &qh, sizeof qh);
  return o;
}

// A copy of the shared Q4_0 model `name` (every Q4_0 matrix with k % 256 == 0) whose Q4_0
// matrices are re-encoded in turn as Q4_K, Q6_K, Q5_K (the nearest of each, above) and Q5_1
// (value for value), so a small model takes the four types through every GPU path.
std::filesystem::path write_k_quant_copy(const std::string& name) {
  const auto src = GgufFile::open(test::model_path(name));
  GgufWriter w;
  for (const auto& kv : src->metadata()) w.add_value(kv.key, kv.value);
  int converted = 0;
  for (const auto& t : src->tensors()) {
    const GgufTensorInfo* info = &t;
    if (t.type != GgmlType::kQ4_0 || t.ne.size() != 2) {
      w.add_tensor(t.name, t.ne, t.type,
                   [src, info](std::span<std::byte> dst) { std::memcpy(dst.data(), info->data, dst.size()); });
      continue;
    }
    REQUIRE(t.ne[0] % 256 == 0);
    const GgmlType types[4] = {GgmlType::kQ4_K, GgmlType::kQ6_K, GgmlType::kQ5_K, GgmlType::kQ5_1};
    const GgmlType type = types[converted++ % 4];
    w.add_tensor(t.name, t.ne, type, [src, info, type](std::span<std::byte> dst) {
      const size_t count = info->n_elements / 32;
      const auto* in = reinterpret_cast<const k::BlockQ4_0*>(info->data);
      for (size_t b = 0; b < count; b += 8) {
        if (type == GgmlType::kQ4_K) {
          const auto o = encode_k_min<k::BlockQ4_K>(in + b);
          std::memcpy(dst.data() + b / 8 * sizeof o, &o, sizeof o);
        } else if (type == GgmlType::kQ5_K) {
          const auto o = encode_k_min<k::BlockQ5_K>(in + b);
          std::memcpy(dst.data() + b / 8 * sizeof o, &o, sizeof o);
        } else if (type == GgmlType::kQ6_K) {
          const auto o = encode_q6_k(in + b);
          std::memcpy(dst.data() + b / 8 * sizeof o, &o, sizeof o);
        } else {
          for (size_t i = b; i < b + 8; ++i) {
            const auto o = encode_q5_1(in[i]);
            std::memcpy(dst.data() + i * sizeof o, &o, sizeof o);
          }
        }
      }
    });
  }
  const auto path = test::scratch_dir("quant-types-k-" + name) / (name + "-k-quants.gguf");
  w.write(path);
  return path;
}

}  // namespace
#endif

TEST_CASE("GPU Q4_1 and Q5_0 matmuls are the CPU kernels' bits on every ISA (docs/arithmetic.md)",
          "[gpu][kernels][isa]") {
#if TANDEM_HAVE_CUDA
  check_against_cpu<k::BlockQ4_1>(GgmlType::kQ4_1, 41);
  check_against_cpu<k::BlockQ5_0>(GgmlType::kQ5_0, 50);
#endif
}

TEST_CASE("merged Q4_1 and Q5_0 matmuls give each matrix's gemm() and the CPU kernel's bits", "[gpu][kernels][gemv]") {
#if TANDEM_HAVE_CUDA
  check_parts<k::BlockQ4_1>(GgmlType::kQ4_1, 43);
  check_parts<k::BlockQ5_0>(GgmlType::kQ5_0, 53);
#endif
}

TEST_CASE("GPU Q5_1, Q4_K, Q5_K and Q6_K matmuls are the CPU kernels' bits on every ISA (docs/arithmetic.md)",
          "[gpu][kernels][isa]") {
#if TANDEM_HAVE_CUDA
  check_against_cpu<k::BlockQ4_K>(GgmlType::kQ4_K, 44);
  check_against_cpu<k::BlockQ6_K>(GgmlType::kQ6_K, 66);
  check_against_cpu<k::BlockQ5_K>(GgmlType::kQ5_K, 55);
  check_against_cpu<k::BlockQ5_1>(GgmlType::kQ5_1, 51);
#endif
}

TEST_CASE("merged Q5_1, Q4_K, Q5_K and Q6_K matmuls give each matrix's gemm() and the CPU kernel's bits",
          "[gpu][kernels][gemv]") {
#if TANDEM_HAVE_CUDA
  check_parts<k::BlockQ4_K>(GgmlType::kQ4_K, 45);
  check_parts<k::BlockQ6_K>(GgmlType::kQ6_K, 67);
  check_parts<k::BlockQ5_K>(GgmlType::kQ5_K, 57);
  check_parts<k::BlockQ5_1>(GgmlType::kQ5_1, 59);
#endif
}

TEST_CASE("GPU logits agree with the CPU's on small models re-encoded as Q4_1 and Q5_0", "[gpu][parity]") {
#if TANDEM_HAVE_CUDA
  const std::string name = GENERATE(as<std::string>{}, "stories260K-q4_0", "synth-qwen2-small-q4_0");
  INFO(name << " re-encoded as Q4_1 / Q5_0");
  const auto model = Model::load(write_q4_1_q5_0_copy(name));
  int q4_1 = 0, q5_0 = 0;
  for (const auto& t : model->gguf().tensors()) {
    q4_1 += t.type == GgmlType::kQ4_1;
    q5_0 += t.type == GgmlType::kQ5_0;
  }
  REQUIRE(q4_1 > 0);
  REQUIRE(q5_0 > 0);
  check_logits_vs_cpu(model);
#endif
}

TEST_CASE("GPU logits agree with the CPU's on small models re-encoded as Q4_K, Q6_K, Q5_K and Q5_1", "[gpu][parity]") {
#if TANDEM_HAVE_CUDA
  const std::string name = GENERATE(as<std::string>{}, "synth-qwen2-small-q4_0", "synth-llama-small-q4_0");
  INFO(name << " re-encoded as Q4_K / Q6_K / Q5_K / Q5_1");
  const auto model = Model::load(write_k_quant_copy(name));
  std::map<GgmlType, int> count;
  for (const auto& t : model->gguf().tensors()) ++count[t.type];
  for (const GgmlType t : {GgmlType::kQ4_K, GgmlType::kQ6_K, GgmlType::kQ5_K, GgmlType::kQ5_1}) {
    INFO(ggml_type_name(t));
    REQUIRE(count[t] > 0);
  }
  check_logits_vs_cpu(model);
#endif
}

TEST_CASE("SmolLM2's own Q4_1 matrices: GPU outputs are the CPU kernel's bits", "[gpu][kernels][isa]") {
#if TANDEM_HAVE_CUDA
  // Q, gate (n_ff rows) and down (k = n_ff) of the first and last layers.
  check_file_matrices<k::BlockQ4_1>(test::smollm2_q4_1_path(), GgmlType::kQ4_1,
                                    {"blk.0.attn_q.weight", "blk.0.ffn_gate.weight", "blk.0.ffn_down.weight",
                                     "blk.29.attn_q.weight", "blk.29.ffn_down.weight"});
#endif
}

TEST_CASE("Gemma 3's own Q4_K and Q6_K matrices: GPU outputs are the CPU kernels' bits", "[gpu][kernels][isa]") {
#if TANDEM_HAVE_CUDA
  // The Q4_K_M file's attention outputs (Q4_K, k = 1024) and FFN downs (Q6_K, k = 2048) of
  // the first and last layers (the whole model on the GPU: tests/gpu/test_gpu_gemma3.cpp).
  const auto path = test::gemma3_q4_k_m_path();
  check_file_matrices<k::BlockQ4_K>(path, GgmlType::kQ4_K, {"blk.0.attn_output.weight", "blk.17.attn_output.weight"});
  check_file_matrices<k::BlockQ6_K>(path, GgmlType::kQ6_K, {"blk.0.ffn_down.weight", "blk.17.ffn_down.weight"});
#endif
}

TEST_CASE("SmolLM2's Q4_1 file on the GPU gives the CPU's logits bytes", "[gpu][parity][heavy]") {
#if TANDEM_HAVE_CUDA
  // The file's own Q4_1 weights (and its other types) on both executors, every primitive the
  // written arithmetic (docs/arithmetic.md): the same bytes. A 6-token prefill (every row)
  // and 2 decode steps: a few tokens, the emulator is slow on 30 layers (~5 min).
  const auto path = test::smollm2_q4_1_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  auto model = Model::load(path);
  const auto& hp = model->hparams();
  const int32_t n_vocab = hp.n_vocab;
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  GpuQ4Executor gpu(model);
  const auto ids = test::prompt_ids(8, n_vocab);
  auto cstore = test::make_store(hp, 4), gstore = test::make_store(hp, 4);
  KvSequence cs(*cstore, 64), gs(*gstore, 64);
  const std::span<const int32_t> prompt(ids.data(), 6);
  SequenceStep cb[1] = {{&cs, prompt, 0, LogitsRows::kAll}};
  SequenceStep gb[1] = {{&gs, prompt, 0, LogitsRows::kAll}};
  std::vector<float> lc(size_t(6) * size_t(n_vocab)), lg(lc.size(), std::numeric_limits<float>::quiet_NaN());
  cpu.step(cb, lc);
  gpu.step(gb, lg);
  std::ostringstream rows;
  for (size_t r = 0; r < 6; ++r) {
    rows << " "
         << worst_ratio(std::span(lc).subspan(r * size_t(n_vocab), size_t(n_vocab)),
                        std::span(lg).subspan(r * size_t(n_vocab), size_t(n_vocab)), n_vocab);
  }
  INFO("prefill rows' |diff| / max|logit|:" << rows.str());
  CHECK(test::same_bits(lc, lg));
  for (int step = 0; step < 2; ++step) {
    const int32_t t = ids[size_t(6 + step)];
    SequenceStep cd[1] = {{&cs, std::span<const int32_t>(&t, 1), cs.n_tokens(), LogitsRows::kLast}};
    SequenceStep gd[1] = {{&gs, std::span<const int32_t>(&t, 1), gs.n_tokens(), LogitsRows::kLast}};
    std::vector<float> dc(static_cast<size_t>(n_vocab)), dg(dc.size(), std::numeric_limits<float>::quiet_NaN());
    cpu.step(cd, dc);
    gpu.step(gd, dg);
    INFO("decode step " << step << " worst |diff| / max|logit| = " << worst_ratio(dc, dg, n_vocab));
    CHECK(test::same_bits(dc, dg));
  }
#endif
}
