// Fused decode kernels (kernels/cuda: rms_norm_q8_0, swiglu_q8_0, rope_kv_store, the split
// attention's Q8_0 output) against the
// separate launches they replace, bit for bit, over odd widths, n_embd 32..2048, GQA, partial
// rotary, f16 and f32 KV; the Q8_0 blocks also against the CPU's quantiser; and the whole
// executor with and without fused kernels, logits bit for bit.
// Needs a CUDA device, real or emulated (cuemu); skipped without one.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.hpp"
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

bool same_blocks(const std::vector<k::BlockQ8_0>& a, const std::vector<k::BlockQ8_0>& b) {
  if (a.size() != b.size()) return false;
  for (size_t i = 0; i < a.size(); ++i) {
    if (a[i].d != b[i].d || std::memcmp(a[i].qs, b[i].qs, sizeof(a[i].qs)) != 0) return false;
  }
  return true;
}

// The CPU's Q8_0 of `y` (rows of n) equals `blocks` (independent of both GPU paths).
bool cpu_quantises_to(const std::vector<float>& y, int64_t n, const std::vector<k::BlockQ8_0>& blocks) {
  std::vector<k::BlockQ8_0> cpu(blocks.size());
  for (size_t r = 0; r * size_t(n) < y.size(); ++r) {
    k::quantize_row_q8_0(&y[r * size_t(n)], &cpu[r * size_t(n) / k::kQK], n);
  }
  return same_blocks(cpu, blocks);
}

bool all_finite(const std::vector<float>& v) {
  for (float x : v) {
    if (!std::isfinite(x)) return false;
  }
  return true;
}

}  // namespace
#endif

TEST_CASE("fused RMSNorm + Q8_0 gives the bits of rms_norm then quantize_q8_0", "[gpu][kernels][fused]") {
#if TANDEM_HAVE_CUDA
  std::mt19937 g(11);
  std::normal_distribution<float> nd(0.0f, 1.0f);
  // n_embd from one Q8_0 block to 2048, odd multiples of 32 (warps of the 256-thread block
  // left idle or wrapping around), with and without a row gather (the output norm's).
  for (const int64_t n : {32, 64, 96, 224, 576, 1056, 2048}) {
    for (const bool gather : {false, true}) {
      INFO("n " << n << (gather ? ", gathered rows" : ""));
      const int64_t n_x_rows = 5;
      std::vector<float> x(size_t(n_x_rows * n)), w(static_cast<size_t>(n));
      for (float& v : x) v = nd(g);
      for (float& v : w) v = 1.0f + 0.25f * nd(g);
      std::fill(x.begin() + 2 * n, x.begin() + 3 * n, 0.0f);         // a zero row: all-zero blocks
      for (int64_t i = 0; i < n; ++i) x[size_t(3 * n + i)] *= 1e4f;  // large values
      const std::vector<int32_t> rows = gather ? std::vector<int32_t>{4, 0, 2, 0} : std::vector<int32_t>{};
      const int64_t m = gather ? 4 : n_x_rows;
      std::vector<float> y_sep(size_t(m * n)), y_fused(y_sep.size());
      std::vector<k::BlockQ8_0> b_sep(size_t(m * n / 32)), b_fused(b_sep.size());
      gpu_testing::rms_norm_q8_0(x.data(), w.data(), n_x_rows, n, 1e-5f, rows, false, y_sep.data(), b_sep.data());
      gpu_testing::rms_norm_q8_0(x.data(), w.data(), n_x_rows, n, 1e-5f, rows, true, y_fused.data(), b_fused.data());
      CHECK(all_finite(y_fused));  // every element written (the output starts as NaN)
      CHECK(same_bits(y_sep, y_fused));
      CHECK(same_blocks(b_sep, b_fused));
      CHECK(cpu_quantises_to(y_fused, n, b_fused));
    }
  }
#endif
}

TEST_CASE("fused SwiGLU + Q8_0 gives the bits of swiglu then quantize_q8_0", "[gpu][kernels][fused]") {
#if TANDEM_HAVE_CUDA
  std::mt19937 g(12);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  // n_ff of the small models, TinyLlama's (5632), odd block counts, several rows flattened.
  for (const int64_t n : {int64_t{32}, int64_t{96}, int64_t{32 * 37}, int64_t{3 * 5632}, int64_t{2 * 8960}}) {
    INFO("n " << n);
    std::vector<float> gate(static_cast<size_t>(n)), up(static_cast<size_t>(n));
    for (float& v : gate) v = nd(g);
    for (float& v : up) v = nd(g);
    gate[0] = -100.0f;  // exp(-g) overflows to inf: silu gives -0
    gate[size_t(n - 1)] = 90.0f;
    std::fill(up.begin() + 32 * ((n / 32) / 2), up.begin() + 32 * ((n / 32) / 2 + 1), 0.0f);  // a zero block
    std::vector<float> h_sep(static_cast<size_t>(n)), h_fused(static_cast<size_t>(n));
    std::vector<k::BlockQ8_0> b_sep(size_t(n / 32)), b_fused(b_sep.size());
    gpu_testing::swiglu_q8_0(gate.data(), up.data(), n, false, h_sep.data(), b_sep.data());
    gpu_testing::swiglu_q8_0(gate.data(), up.data(), n, true, h_fused.data(), b_fused.data());
    CHECK(same_bits(h_sep, h_fused));
    CHECK(same_blocks(b_sep, b_fused));
    CHECK(cpu_quantises_to(h_fused, n, b_fused));
  }
#endif
}

TEST_CASE("split attention with Q8_0 output gives the bits of attention_split then quantize_q8_0",
          "[gpu][kernels][fused]") {
#if TANDEM_HAVE_CUDA
  std::mt19937 g(13);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  // head_dim 32 (one block per head), 64 and 128 (several), GQA groups 1/4, f16 and f32 KV,
  // sequences ending inside, on and past the 64-position partitions.
  struct Shape {
    int32_t n_head, n_head_kv, head_dim;
    bool f16;
  };
  for (const Shape c :
       {Shape{4, 4, 32, true}, Shape{8, 2, 64, true}, Shape{4, 1, 128, false}, Shape{8, 8, 64, false}}) {
    INFO("n_head " << c.n_head << " n_head_kv " << c.n_head_kv << " head_dim " << c.head_dim << " f16 " << c.f16);
    const std::vector<int32_t> lens = {1, 64, 65, 130};
    int64_t rows = 0;
    for (int32_t l : lens) rows += l;
    const size_t q_row = size_t(c.n_head) * size_t(c.head_dim), kv_row = size_t(c.n_head_kv) * size_t(c.head_dim);
    std::vector<float> q(lens.size() * q_row), k_rows(size_t(rows) * kv_row), v_rows(k_rows.size());
    for (float& x : q) x = 2.0f * u(g);
    for (float& x : k_rows) x = u(g);
    for (float& x : v_rows) x = u(g);
    std::vector<float> plain(q.size()), fused(q.size());
    std::vector<k::BlockQ8_0> blocks(q.size() / k::kQK), separate(blocks.size());
    gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, lens, q.data(), k_rows.data(),
                                  v_rows.data(), plain.data(), 64);
    gpu_testing::attention_decode(c.n_head, c.n_head_kv, c.head_dim, 16, c.f16, lens, q.data(), k_rows.data(),
                                  v_rows.data(), fused.data(), 64, 0, blocks.data());
    gpu_testing::quantize_q8_0(fused.data(), int64_t(lens.size()), int64_t(q_row), separate.data());
    CHECK(same_bits(plain, fused));
    CHECK(same_blocks(blocks, separate));
    CHECK(cpu_quantises_to(fused, int64_t(q_row), blocks));
  }
  // Shapes the fused quantisation does not take are refused, not half-written.
  std::vector<float> q(8 * 8), kv(8), out(q.size());
  std::vector<k::BlockQ8_0> b(2);
  CHECK_THROWS_AS(gpu_testing::attention_decode(8, 1, 8, 16, true, {1}, q.data(), kv.data(), kv.data(), out.data(), 64,
                                                0, b.data()),
                  Error);
#endif
}

TEST_CASE("fused RoPE + KV store gives the bits of rope, rope and kv_store_rows", "[gpu][kernels][fused]") {
#if TANDEM_HAVE_CUDA
  struct Case {
    int32_t n_head, n_head_kv, head_dim, n_rot;
    bool neox;
  };
  // TinyLlama (GQA 8), stories260K, Qwen2-0.5B-like (GQA 7, neox), head_dim 128, partial
  // rotary (normal and neox), an odd head count.
  const Case cases[] = {{32, 4, 64, 64, false}, {8, 8, 8, 8, false},  {14, 2, 64, 64, true}, {4, 2, 128, 128, true},
                        {6, 3, 64, 32, false},  {2, 1, 96, 64, true}, {5, 1, 32, 32, false}};
  struct Tokens {
    const char* what;
    std::vector<int32_t> seq, pos;
  };
  const Tokens layouts[] = {{"decode batch", {0, 1, 2}, {0, 17, 40}},
                            {"prefill across a page", {0, 0, 0, 0, 0, 0, 0, 0}, {12, 13, 14, 15, 16, 17, 18, 19}},
                            {"mixed", {0, 0, 0, 1}, {5, 6, 7, 33}}};
  constexpr int32_t kPage = 16;
  std::mt19937 g(13);
  std::uniform_real_distribution<float> u(-2.0f, 2.0f);
  for (const Case& c : cases) {
    for (const Tokens& tl : layouts) {
      for (const bool f16 : {true, false}) {
        INFO("n_head " << c.n_head << " n_head_kv " << c.n_head_kv << " head_dim " << c.head_dim << " n_rot " << c.n_rot
                       << (c.neox ? " neox" : "") << ", " << tl.what << (f16 ? ", f16 KV" : ", f32 KV"));
        const auto T = tl.seq.size();
        const size_t row = size_t(c.n_head_kv) * size_t(c.head_dim);
        std::vector<float> q(T * size_t(c.n_head) * size_t(c.head_dim)), kk(T * row), v(T * row);
        for (float& x : q) x = u(g);
        for (float& x : kk) x = u(g);
        for (float& x : v) x = u(g);
        // cos/sin of pos * base^(-2i/n_rot), as the executor builds them.
        std::vector<float> cs(T * size_t(c.n_rot));
        const float theta_scale = std::pow(10000.0f, -2.0f / float(c.n_rot));
        for (size_t t = 0; t < T; ++t) {
          float theta = float(tl.pos[t]);
          for (int32_t i = 0; i < c.n_rot / 2; ++i) {
            cs[t * size_t(c.n_rot) + size_t(i)] = std::cos(theta);
            cs[t * size_t(c.n_rot) + size_t(c.n_rot / 2 + i)] = std::sin(theta);
            theta *= theta_scale;
          }
        }
        std::vector<float> q_sep = q, k_sep = kk, q_fused = q, k_fused = kk;
        std::vector<uint8_t> pages_sep, pages_fused;
        gpu_testing::rope_kv_store(c.n_head, c.n_head_kv, c.head_dim, c.n_rot, c.neox, kPage, f16, tl.seq, tl.pos,
                                   q_sep.data(), k_sep.data(), v.data(), cs.data(), pages_sep, false);
        gpu_testing::rope_kv_store(c.n_head, c.n_head_kv, c.head_dim, c.n_rot, c.neox, kPage, f16, tl.seq, tl.pos,
                                   q_fused.data(), k_fused.data(), v.data(), cs.data(), pages_fused, true);
        CHECK(same_bits(q_sep, q_fused));
        CHECK(same_bits(k_sep, k_fused));
        REQUIRE(pages_sep.size() == pages_fused.size());
        CHECK(pages_sep == pages_fused);
        CHECK(q_fused != q);  // rotated (no position is 0 in every layout)

        // The pages hold exactly the rotated K and the V rows, each at its token's slot of
        // layer 1 (page layout: [layer][K|V][slot][row], harness: pages sequence by sequence).
        const size_t es = f16 ? 2 : 4;
        const size_t page_bytes = 2 * 2 * size_t(kPage) * row * es;
        std::vector<size_t> seq_first_page;
        size_t n_pages = 0;
        for (size_t t = 0; t < T; ++t) {
          if (size_t(tl.seq[t]) == seq_first_page.size()) {
            seq_first_page.push_back(n_pages);
            int32_t last = 0;
            for (size_t j = t; j < T && tl.seq[j] == tl.seq[t]; ++j) last = std::max(last, tl.pos[j]);
            n_pages += size_t(last / kPage + 1);
          }
        }
        REQUIRE(pages_fused.size() == n_pages * page_bytes);
        for (size_t t = 0; t < T; ++t) {
          const size_t page = seq_first_page[size_t(tl.seq[t])] + size_t(tl.pos[t] / kPage);
          const size_t slot = size_t(tl.pos[t] % kPage);
          for (int kind = 0; kind < 2; ++kind) {
            const uint8_t* r = pages_fused.data() + page * page_bytes + ((2 + size_t(kind)) * kPage + slot) * row * es;
            const float* want = (kind == 0 ? k_fused.data() : v.data()) + t * row;
            bool ok = true;
            for (size_t e = 0; e < row; ++e) {
              float got = 0.0f;
              if (f16) {
                uint16_t b = 0;
                std::memcpy(&b, r + e * 2, 2);
                got = k::fp16_bits_to_fp32(b);
                ok = ok && got == k::fp16_bits_to_fp32(k::fp32_to_fp16_bits(want[e]));
              } else {
                std::memcpy(&got, r + e * 4, 4);
                ok = ok && std::memcmp(&got, &want[e], 4) == 0;
              }
            }
            INFO("token " << t << (kind == 0 ? " K" : " V"));
            CHECK(ok);
          }
        }
      }
    }
  }
#endif
}

TEST_CASE("the executor's logits with fused kernels are the separate launches' bit for bit", "[gpu][fused][parity]") {
#if TANDEM_HAVE_CUDA
  // A llama (Q4_0), a Qwen2 (biases, GQA, neox; Q4_0) and an F32 model (nothing quantised:
  // only RoPE + KV store is fused there); f16 and f32 KV; graphs on as in production.
  struct Run {
    const char* model;
    KvDtype dtype;
  };
  for (const Run& run : {Run{"stories260K-q4_0", KvDtype::kF16}, Run{"stories260K-q4_0", KvDtype::kF32},
                         Run{"synth-qwen2-small-q4_0", KvDtype::kF16}, Run{"aidreams260K-f32", KvDtype::kF16}}) {
    INFO(run.model << (run.dtype == KvDtype::kF16 ? ", f16 KV" : ", f32 KV"));
    auto model = Model::load(test::model_path(run.model));
    const auto ids = test::prompt_ids(30, model->hparams().n_vocab);
    GpuExecutorOptions plain;
    plain.fused_kernels = false;
    // A prefill of 30 + 14 tokens, then decode steps of both sequences together (crossing the
    // page boundary at 32).
    std::vector<test::DecodeTokens> decode;
    for (size_t step = 0; step < 4; ++step) decode.push_back({ids[step], ids[20 - step]});
    test::check_same_logits(model, plain, GpuExecutorOptions{}, std::span(ids).first(30), std::span(ids).subspan(3, 14),
                            decode, run.dtype);
  }
#endif
}
