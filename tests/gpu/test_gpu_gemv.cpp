// The decode GEMV (kernels/cuda gemm with m == 1: several weight rows per warp, blocks loaded
// ahead) against the prefill GEMM kernel (8 activation rows per warp, unchanged), bit for bit:
// both add each lane's blocks in the same order and reduce with the same shuffle tree, so a
// token's logits do not depend on whether it was decoded alone or inside a batch.
// Needs a CUDA device, real or emulated (cuemu); skipped without one.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "gpu_test_support.hpp"
#include "hooks/gpu_hooks.hpp"
#include "quant_blocks.hpp"

using namespace tandem;
namespace k = tandem::kernels;

TEST_CASE("decode GEMV rows are bit-identical to the same rows of the prefill GEMM", "[gpu][kernels][gemv]") {
#if TANDEM_HAVE_CUDA
  std::mt19937 g(21);
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // n: odd row counts (a warp's second row past the end, a block's warps idle), k: one block,
  // odd block counts, 64 (n_embd 2048: two blocks per lane), 176 (n_ff 5632) and 65 (a lane
  // with a third block, the load-ahead pair half outside the row).
  struct Shape {
    int64_t n, k;
  };
  for (const Shape s : {Shape{1, 32}, Shape{3, 96}, Shape{7, 2048}, Shape{33, 2080}, Shape{64, 5632}, Shape{257, 2048},
                        Shape{10, 32 * 65}, Shape{5, 32 * 97}}) {
    INFO("n " << s.n << " k " << s.k);
    const int64_t nb = s.k / 32, m = 3;
    std::vector<k::BlockQ4_0> w(size_t(s.n * nb));
    for (auto& b : w) {
      b.d = k::fp32_to_fp16_bits(0.01f + 0.02f * std::abs(nd(g)));
      for (auto& q : b.qs) q = static_cast<uint8_t>(byte(g));
    }
    std::vector<float> x(size_t(m * s.k));
    for (float& v : x) v = nd(g);
    std::vector<float> batch(size_t(m * s.n));
    gpu_testing::gemm_q4_0(w.data(), s.n, s.k, x.data(), m, batch.data());
    for (int64_t c = 0; c < m; ++c) {
      std::vector<float> one(size_t(s.n));
      gpu_testing::gemm_q4_0(w.data(), s.n, s.k, &x[size_t(c * s.k)], 1, one.data());
      INFO("row " << c);
      CHECK(std::memcmp(one.data(), &batch[size_t(c * s.n)], one.size() * sizeof(float)) == 0);
    }
  }
#endif
}
