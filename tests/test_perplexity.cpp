// tandem::perplexity: llama-perplexity's chunking, BOS, second-half scoring and
// uncertainty against an independent float64 recomputation on a small model, its errors,
// and on SmolLM2 against llama.cpp's own perplexity of the same bytes.
#include <catch2/catch.hpp>

#include <cmath>
#include <fstream>
#include <iterator>
#include <random>

#include "tandem/core/error.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/session/perplexity.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;

TEST_CASE("perplexity scores the second half of each BOS-led chunk (float64 recomputation)", "[perplexity]") {
  const auto model = Model::load(test::model_path("stories260K-f32"));
  const Tokenizer& tok = model->tokenizer();
  REQUIRE(tok.add_bos());
  const int32_t n_vocab = model->hparams().n_vocab;
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  const int32_t n_ctx = 16;
  std::mt19937 rng(5);
  std::vector<int32_t> tokens(3 * n_ctx + 7);  // 3 chunks and a tail that is not used
  for (int32_t& t : tokens) t = int32_t(rng() % uint32_t(n_vocab));

  // Independent truth: each chunk evaluated whole, its first token BOS, logits of every
  // row; -log softmax in float64 over positions n_ctx/2 .. n_ctx-2.
  double nll = 0, nll2 = 0;
  int64_t count = 0;
  std::vector<double> running;
  for (int32_t c = 0; c < 3; ++c) {
    std::vector<int32_t> chunk(tokens.begin() + c * n_ctx, tokens.begin() + (c + 1) * n_ctx);
    chunk[0] = tok.bos();
    Session s(model, exec, {.n_ctx = n_ctx});
    std::vector<float> logits(size_t(n_ctx) * size_t(n_vocab));
    s.eval(chunk, logits);
    for (int32_t p = n_ctx / 2; p < n_ctx - 1; ++p) {
      const float* row = logits.data() + size_t(p) * size_t(n_vocab);
      double mx = row[0], sum = 0;
      for (int32_t v = 0; v < n_vocab; ++v) mx = std::max(mx, double(row[v]));
      for (int32_t v = 0; v < n_vocab; ++v) sum += std::exp(double(row[v]) - mx);
      const double x = -(double(row[chunk[size_t(p + 1)]]) - mx - std::log(sum));
      nll += x;
      nll2 += x * x;
      ++count;
    }
    running.push_back(std::exp(nll / double(count)));
  }
  const double mean = nll / double(count);
  const double ppl = std::exp(mean);
  const double unc = ppl * std::sqrt((nll2 / double(count) - mean * mean) / double(count - 1));

  for (int32_t n_batch : {2048, 5, 1}) {
    INFO("n_batch " << n_batch);
    PerplexityOptions opt;
    opt.n_ctx = n_ctx;
    opt.n_batch = n_batch;
    std::vector<std::pair<int32_t, double>> seen;
    opt.on_chunk = [&](int32_t i, double r) { seen.emplace_back(i, r); };
    const auto r = perplexity(exec, tokens, opt);
    CHECK(r.n_chunks == 3);
    CHECK(r.n_scored == 3 * (n_ctx - n_ctx / 2 - 1));
    REQUIRE(r.running.size() == 3);
    REQUIRE(seen.size() == 3);
    for (size_t i = 0; i < 3; ++i) {
      CHECK(seen[i].first == int32_t(i + 1));
      CHECK(seen[i].second == r.running[i]);
      // float exp and float max-subtraction (llama.cpp's) vs float64: ~1e-7 relative.
      CHECK(r.running[i] == Approx(running[i]).epsilon(1e-5));
    }
    CHECK(r.ppl == Approx(ppl).epsilon(1e-5));
    CHECK(r.uncertainty == Approx(unc).epsilon(1e-4));
    CHECK(r.uncertainty > 0);
  }
  PerplexityOptions two;
  two.n_ctx = n_ctx;
  two.n_chunks = 2;
  const auto r2 = perplexity(exec, tokens, two);
  CHECK(r2.n_chunks == 2);
  CHECK(r2.ppl == Approx(running[1]).epsilon(1e-5));
}

TEST_CASE("perplexity refuses what llama-perplexity refuses, naming it", "[perplexity]") {
  const auto model = Model::load(test::model_path("stories260K-f32"));
  CpuQ4Executor exec(model, CpuExecutorOptions{1});
  std::vector<int32_t> tokens(63, 1);
  auto code_of = [&](const PerplexityOptions& o, std::span<const int32_t> t) {
    try {
      perplexity(exec, t, o);
    } catch (const Error& e) {
      return std::make_pair(e.code(), std::string(e.what()));
    }
    return std::make_pair(ErrorCode::kOk, std::string());
  };
  PerplexityOptions o;
  o.n_ctx = 32;
  auto [c, m] = code_of(o, tokens);  // 63 < 2 * 32
  CHECK(c == ErrorCode::kInvalidArgument);
  CHECK(m.find("the text has 63") != std::string::npos);
  tokens.push_back(1);
  o.n_chunks = 0;
  CHECK(code_of(o, tokens).first == ErrorCode::kInvalidArgument);
  o.n_chunks = -1;
  o.n_ctx = 2;
  CHECK(code_of(o, tokens).first == ErrorCode::kInvalidArgument);
  o.n_ctx = 16;
  o.n_batch = 0;
  CHECK(code_of(o, tokens).first == ErrorCode::kInvalidArgument);
  o.n_batch = 16;
  tokens[40] = 1 << 20;  // outside the vocabulary
  CHECK(code_of(o, tokens).first == ErrorCode::kInvalidArgument);
}

// llama.cpp's llama-perplexity on the same bytes (issue 23, shared/golden/README.md; -c 512,
// all 14 chunks of Debian's /usr/share/common-licenses/GPL-3): 18.38 on SmolLM2's Q4_1 file
// as shipped (Tandem's default load runs its Q4_1 weights natively), 23.05 on its Q4_0
// conversion (ModelOptions::convert_to = Q4_0; test_requantize proves the bytes equal).
TEST_CASE("SmolLM2 perplexity on GPL-3 is llama.cpp's on the same bytes (within 0.5 %)",
          "[perplexity][smollm2][golden]") {
  const auto path = test::smollm2_q4_1_path();
  const std::filesystem::path text_path = "/usr/share/common-licenses/GPL-3";
  if (!std::filesystem::exists(path) || !std::filesystem::exists(text_path)) {
    WARN("SKIPPED: " << path << " (scripts/fetch-smollm2) or " << text_path << " (Debian base-files) is absent");
    return;
  }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  WARN("SKIPPED under a sanitizer (about 1.5 min in Release): the Release run covers it");
  return;
#endif
  std::ifstream f(text_path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  for (const auto& [type, reference] : {std::pair{GgmlType::kQ8_0, 18.38}, std::pair{GgmlType::kQ4_0, 23.05}}) {
    INFO("convert_to " << ggml_type_name(type));
    ModelOptions mo;
    mo.n_threads = 2;
    mo.convert_to = type;
    const auto model = Model::load(path, mo);
    // The default keeps every weight as the file has it (Q4_1 has a kernel).
    CHECK(model->converted_tensors() == (type == GgmlType::kQ8_0 ? 0 : 210));
    const auto tokens = model->tokenizer().tokenize(text, true, false);
    CpuQ4Executor exec(model, CpuExecutorOptions{2});
    PerplexityOptions opt;
    opt.n_ctx = 512;
    const auto r = perplexity(exec, tokens, opt);
    WARN("SmolLM2, convert_to " << ggml_type_name(type) << ": PPL " << r.ppl << " +/- " << r.uncertainty
                                << " (llama.cpp " << reference << ")");
    CHECK(r.n_chunks == 14);
    CHECK(std::fabs(r.ppl / reference - 1.0) < 5e-3);
  }
}

// Gemma 3 270M's Q4_K_M hub file as Tandem loads it by default (every weight as it is: Q5_0,
// Q4_K, Q6_K, Q8_0; measured 13.8713) against llama.cpp's 13.88 on the hub file itself
// (issue 23; its Q8_0 conversion gives 13.88 too): within 0.5 %.
TEST_CASE("Gemma 3 perplexity on GPL-3 is llama.cpp's on the hub file (within 0.5 %)", "[perplexity][gemma3][golden]") {
  const auto path = test::gemma3_q4_k_m_path();
  const std::filesystem::path text_path = "/usr/share/common-licenses/GPL-3";
  if (!std::filesystem::exists(path) || !std::filesystem::exists(text_path)) {
    WARN("SKIPPED: " << path << " (scripts/fetch-gemma3) or " << text_path << " (Debian base-files) is absent");
    return;
  }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  WARN("SKIPPED under a sanitizer (about 1 min in Release): the Release run covers it");
  return;
#endif
  std::ifstream f(text_path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  if (!text.empty() && text.back() == '\n') text.pop_back();
  ModelOptions mo;
  mo.n_threads = 2;
  const auto model = Model::load(path, mo);
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  const auto r = perplexity(exec, model->tokenizer().tokenize(text, true, false), PerplexityOptions{});
  WARN("Gemma 3 Q4_K_M, default load: PPL " << r.ppl << " +/- " << r.uncertainty << " (llama.cpp 13.88)");
  CHECK(r.n_chunks == 14);
  CHECK(std::fabs(r.ppl / 13.88 - 1.0) < 5e-3);
}
