// The Tensor Core prefill GEMM (kernels/cuda gemm() with m >= 16: int8 WMMA block dots)
// against the dp4a GEMM and against a host replica of the dp4a kernel's float order, bit for
// bit: odd weight-row counts (edge tiles), m = 16, 17, 33, 64 (edge activation tiles), 1, 3
// and 70 blocks per row (a partial stage, a partial group of 32 lane sums), Q4_0 nibble
// extremes (-8, +7), Q8_0 activations of -128 and 127, Q8_0 weights. Then the executor's
// logits with and without Tensor Cores (GpuExecutorOptions::tensor_cores), bit for bit.
// Needs a CUDA device, real or emulated (cuemu); skipped without one.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <limits>
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

using gemm_test::host_replica;
using gemm_test::random_activations;
using gemm_test::random_scale;
using test::same_bits;

// A prefill of 30 + 17 tokens (every matmul then has m = 47 rows), then two decode steps, on
// `model_name` with and without Tensor Cores: logits bit for bit.
void check_tensor_core_parity(const char* model_name) {
  auto model = Model::load(test::model_path(model_name));
  const auto ids = test::prompt_ids(30, model->hparams().n_vocab);
  GpuExecutorOptions off;
  off.tensor_cores = false;
  test::check_same_logits(model, GpuExecutorOptions{}, off, std::span(ids).first(30), std::span(ids).subspan(3, 17),
                          {{ids[0]}, {ids[1]}});
}

}  // namespace
#endif

TEST_CASE("Tensor Core GEMM outputs are the dp4a GEMM's and the host replica's bit for bit",
          "[gpu][kernels][tensor-core]") {
#if TANDEM_HAVE_CUDA
  struct Shape {
    int64_t n, nb, m;
  };
  // n: one tile, an odd count (a partial tile), 33 (a tile with one row); nb: 1 and 3 (a
  // partial stage of 8 blocks), 70 (two full groups of 32 lane sums, then 6 blocks); m: the
  // threshold, one row past it, a partial second/third tile, four full tiles.
  const Shape shapes[] = {{16, 1, 16}, {37, 3, 17}, {5, 70, 33}, {33, 70, 64}, {1, 2, 16}, {20, 9, 15}};
  std::mt19937 g(41);
  std::uniform_int_distribution<int> byte(0, 255), q8(-128, 127);
  for (const Shape& s : shapes) {
    INFO("n " << s.n << " k " << s.nb * 32 << " m " << s.m);
    const auto x = random_activations(g, s.m, s.nb);
    {
      // Q4_0 weights: random bytes, with every 3rd block all 0x00 (-8s), every 4th all 0xFF
      // (+7s) and every 11th alternating 0x0F / 0xF0 (+7 low, -8 high and back).
      std::vector<k::BlockQ4_0> w(size_t(s.n * s.nb));
      for (size_t i = 0; i < w.size(); ++i) {
        w[i].d = random_scale(g);
        for (int j = 0; j < 16; ++j) {
          w[i].qs[j] = static_cast<uint8_t>(i % 3 == 0    ? 0x00
                                            : i % 4 == 0  ? 0xFF
                                            : i % 11 == 0 ? (j % 2 ? 0xF0 : 0x0F)
                                                          : byte(g));
        }
      }
      std::vector<float> tc(size_t(s.m * s.n)), dp(tc.size());
      gpu_testing::gemm_q8_blocks(GgmlType::kQ4_0, w.data(), s.n, s.nb * 32, x.data(), s.m, true, tc.data());
      gpu_testing::gemm_q8_blocks(GgmlType::kQ4_0, w.data(), s.n, s.nb * 32, x.data(), s.m, false, dp.data());
      const auto want = host_replica(w, s.n, s.nb, x, s.m);
      INFO("Q4_0 weights");
      CHECK(same_bits(dp, want));
      CHECK(same_bits(tc, want));
    }
    {
      std::vector<k::BlockQ8_0> w(size_t(s.n * s.nb));
      for (size_t i = 0; i < w.size(); ++i) {
        w[i].d = random_scale(g);
        for (auto& v : w[i].qs) v = static_cast<int8_t>(i % 6 == 0 ? -128 : q8(g));
      }
      std::vector<float> tc(size_t(s.m * s.n)), dp(tc.size());
      gpu_testing::gemm_q8_blocks(GgmlType::kQ8_0, w.data(), s.n, s.nb * 32, x.data(), s.m, true, tc.data());
      gpu_testing::gemm_q8_blocks(GgmlType::kQ8_0, w.data(), s.n, s.nb * 32, x.data(), s.m, false, dp.data());
      const auto want = host_replica(w, s.n, s.nb, x, s.m);
      INFO("Q8_0 weights");
      CHECK(same_bits(dp, want));
      CHECK(same_bits(tc, want));
    }
  }
#endif
}

TEST_CASE("the executor's logits with and without Tensor Core prefill are the same bit for bit",
          "[gpu][tensor-core][parity]") {
#if TANDEM_HAVE_CUDA
  // stories260K (k = 64: two blocks per row) and synth-qwen2-small (k = 256 and 768: 8 and 24
  // blocks, so the order of the lane sums' tree matters; biases, GQA, a tied output head).
  for (const char* name : {"stories260K-q4_0", "synth-qwen2-small-q4_0"}) {
    INFO(name);
    check_tensor_core_parity(name);
  }
#endif
}
