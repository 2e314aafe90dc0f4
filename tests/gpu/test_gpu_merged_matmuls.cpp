// Merged matmuls (kernels/cuda gemm_parts: the matrices that share an input, Q/K/V and
// gate/up, in one launch of the dp4a kernels, biases added in it) against gemm() and
// add_bias() per matrix and the host replica of the dp4a arithmetic plus the bias, bit for
// bit, with and without biases: GQA-like row counts (64/16/16), odd ones (33/7/1: a
// part of one row, a thread block with idle warps), gate/up pairs, 1-70 blocks per row, m = 1
// (the decode GEMV), 2-15 (the dp4a GEMM), 16 and 40 (the Tensor Core path, where gemm_parts
// launches per matrix, and the dp4a GEMM with Tensor Cores off), Q4_0 and Q8_0 weights, and
// more matrices than one launch takes. Then the executor's logits with and without merging
// (GpuExecutorOptions::merge_matmuls), bit for bit.
// Needs a CUDA device, real or emulated (cuemu); skipped without one.
#include <catch2/catch.hpp>

#include <cstdint>
#include <random>
#include <vector>

#include "gemm_test_support.hpp"
#include "gpu_test_support.hpp"
#include "hooks/gpu_hooks.hpp"
#include "kv_test_support.hpp"
#include "options_parity.hpp"
#include "quant_blocks.hpp"
#include "test_support.hpp"

using namespace tandem;
namespace k = tandem::kernels;

#if TANDEM_HAVE_CUDA
namespace {

using test::same_bits;

template <class WB>
std::vector<WB> random_weights(std::mt19937& g, int64_t n, int64_t nb) {
  std::uniform_int_distribution<int> byte(0, 255), q8(-128, 127);
  std::vector<WB> w(size_t(n * nb));
  for (auto& b : w) {
    b.d = gemm_test::random_scale(g);
    for (auto& v : b.qs) {
      if constexpr (std::is_same_v<WB, k::BlockQ4_0>) {
        v = static_cast<uint8_t>(byte(g));
      } else {
        v = static_cast<int8_t>(q8(g));
      }
    }
  }
  return w;
}

template <class WB>
void check_parts(std::mt19937& g, const std::vector<int64_t>& n, int64_t nb, int64_t m, bool tensor_cores) {
  constexpr GgmlType kType = std::is_same_v<WB, k::BlockQ8_0> ? GgmlType::kQ8_0 : GgmlType::kQ4_0;
  std::vector<std::vector<WB>> w;
  std::vector<const void*> ptrs;
  for (int64_t rows : n) {
    w.push_back(random_weights<WB>(g, rows, nb));
    ptrs.push_back(w.back().data());
  }
  const auto x = gemm_test::random_activations(g, m, nb);
  // Biases on every matrix but the second (Qwen2's Q, K, V all have one; a part without
  // one must stay bias-free in a launch with biases).
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<std::vector<float>> bias(n.size());
  for (size_t i = 0; i < n.size(); ++i) {
    if (i == 1) continue;
    bias[i].resize(size_t(n[i]));
    for (float& b : bias[i]) b = nd(g);
  }
  for (const bool with_bias : {false, true}) {
    const std::vector<std::vector<float>> no_bias;
    const auto& b = with_bias ? bias : no_bias;
    std::vector<std::vector<float>> merged, separate;
    gpu_testing::gemm_parts_q8_blocks(kType, ptrs, n, nb * 32, x.data(), m, true, tensor_cores, merged, b);
    gpu_testing::gemm_parts_q8_blocks(kType, ptrs, n, nb * 32, x.data(), m, false, tensor_cores, separate, b);
    REQUIRE(merged.size() == n.size());
    for (size_t i = 0; i < n.size(); ++i) {
      INFO("matrix " << i << " of " << n[i] << " rows" << (with_bias ? ", with biases" : ""));
      auto want = gemm_test::host_replica(w[i], n[i], nb, x, m);
      if (with_bias && !bias[i].empty()) {
        for (int64_t c = 0; c < m; ++c) {
          for (int64_t r = 0; r < n[i]; ++r) want[size_t(c * n[i] + r)] += bias[i][size_t(r)];
        }
      }
      CHECK(same_bits(merged[i], separate[i]));
      CHECK(same_bits(merged[i], want));
    }
  }
}

// A prefill of 5 + 3 tokens (m = 8: dp4a GEMM, merged), then decode steps of one sequence
// (m = 1: the GEMV, merged) and of both (m = 2), on `model_name` with and without merging.
void check_merged_parity(const char* model_name) {
  auto model = Model::load(test::model_path(model_name));
  const auto ids = test::prompt_ids(20, model->hparams().n_vocab);
  GpuExecutorOptions off;
  off.merge_matmuls = false;
  test::check_same_logits(model, GpuExecutorOptions{}, off, std::span(ids).first(5), std::span(ids).subspan(7, 3),
                          {{ids[10]}, {ids[11], ids[14]}, {ids[12]}, {ids[13], ids[12]}});
}

}  // namespace
#endif

TEST_CASE("merged matmuls give each matrix's own gemm() outputs bit for bit", "[gpu][kernels][gemv]") {
#if TANDEM_HAVE_CUDA
  struct Shape {
    std::vector<int64_t> n;
    int64_t nb;
  };
  const Shape shapes[] = {{{64, 16, 16}, 8}, {{33, 7, 1}, 3}, {{160, 160}, 65}, {{9, 5, 3, 2}, 2}, {{24}, 70}};
  std::mt19937 g(51);
  for (const Shape& s : shapes) {
    for (const int64_t m : {1, 2, 9, 16, 40}) {
      for (const bool tensor_cores : {true, false}) {
        if (m < 16 && !tensor_cores) continue;  // the same kernels as with Tensor Cores on
        INFO(s.n.size() << " matrices, first of " << s.n[0] << " rows, k " << s.nb * 32 << ", m " << m
                        << (tensor_cores ? "" : ", Tensor Cores off"));
        check_parts<k::BlockQ4_0>(g, s.n, s.nb, m, tensor_cores);
        check_parts<k::BlockQ8_0>(g, s.n, s.nb, m, tensor_cores);
      }
    }
  }
#endif
}

TEST_CASE("the executor's logits with merged matmuls are the separate launches' bit for bit",
          "[gpu][kernels][gemv][parity]") {
#if TANDEM_HAVE_CUDA
  // A llama (Q4_0; Q, K and V of equal rows) and a Qwen2 (GQA: K and V of fewer rows, biases).
  for (const char* name : {"stories260K-q4_0", "synth-qwen2-small-q4_0"}) {
    INFO(name);
    check_merged_parity(name);
  }
#endif
}
