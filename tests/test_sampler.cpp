// Sampling: field case B14 and the parameter rule of sampler.hpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <set>
#include <vector>

#include "tandem/core/error.hpp"
#include "tandem/session/sampler.hpp"

using namespace tandem;

namespace {

std::vector<float> ramp_logits(int n) {
  std::vector<float> l(static_cast<size_t>(n));
  std::iota(l.begin(), l.end(), 0.0f);
  return l;
}

std::vector<int32_t> draw(SamplingParams p, int n_draws, const std::vector<float>& logits) {
  Sampler s(p, static_cast<int32_t>(logits.size()));
  std::vector<int32_t> out;
  for (int i = 0; i < n_draws; ++i) out.push_back(s.sample(logits, {}));
  return out;
}

ErrorCode code_of(const SamplingParams& p) {
  try {
    Sampler s(p, 128);
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::kOk;
}

}  // namespace

TEST_CASE("B14: top_k at or above the vocabulary behaves as top-k off", "[sampler][field-case]") {
  const auto logits = ramp_logits(128);
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_p = 1.0f;
  p.min_p = 0.0f;
  p.seed = 7;
  p.top_k = 0;
  const auto off = draw(p, 200, logits);
  p.top_k = 128;
  CHECK(draw(p, 200, logits) == off);
  p.top_k = 9999999;
  CHECK(draw(p, 200, logits) == off);
  // Not degenerate: with temperature 1 over a ramp, several tokens are drawn.
  CHECK(std::set<int32_t>(off.begin(), off.end()).size() > 3);
}

TEST_CASE("B14: greedy-like settings always pick the largest logit", "[sampler][field-case]") {
  const auto logits = ramp_logits(128);
  SamplingParams p;
  p.seed = 3;
  p.temperature = 0.0f;
  for (int32_t id : draw(p, 50, logits)) CHECK(id == 127);
  p.temperature = 1.0f;
  p.top_p = 0.0f;
  for (int32_t id : draw(p, 50, logits)) CHECK(id == 127);
  p.top_p = 0.95f;
  p.temperature = 1e-4f;
  // fp16-representable logits: a tiny temperature must not produce NaN/Inf.
  for (int32_t id : draw(p, 50, logits)) CHECK(id == 127);
}

TEST_CASE("B14: top_p 1.0 is no filtering", "[sampler][field-case]") {
  const auto logits = ramp_logits(128);
  SamplingParams a;
  a.temperature = 1.0f;
  a.top_k = 0;
  a.min_p = 0.0f;
  a.seed = 11;
  a.top_p = 1.0f;
  // Equal logits: every token equally likely; with top_p = 1 all 8 must appear.
  const std::vector<float> flat(8, 0.5f);
  const auto d = draw(a, 400, flat);
  CHECK(std::set<int32_t>(d.begin(), d.end()).size() == 8);
  SamplingParams b = a;
  b.top_p = 0.5f;  // keeps the 4 first (lowest ids on ties) of 8 equal tokens
  const auto e = draw(b, 400, flat);
  CHECK(std::set<int32_t>(e.begin(), e.end()) == std::set<int32_t>{0, 1, 2, 3});
  (void)logits;
}

TEST_CASE("B14: out-of-domain parameters are refused naming the field", "[sampler][field-case]") {
  SamplingParams p;
  p.top_k = -5;
  CHECK(code_of(p) == ErrorCode::kInvalidArgument);
  p = {};
  p.temperature = -1.0f;
  CHECK(code_of(p) == ErrorCode::kInvalidArgument);
  p = {};
  p.temperature = std::numeric_limits<float>::quiet_NaN();
  CHECK(code_of(p) == ErrorCode::kInvalidArgument);
  p = {};
  p.top_p = 1.5f;
  CHECK(code_of(p) == ErrorCode::kInvalidArgument);
  p = {};
  p.min_p = -0.1f;
  CHECK(code_of(p) == ErrorCode::kInvalidArgument);
  p = {};
  p.repeat_penalty = 0.0f;
  CHECK(code_of(p) == ErrorCode::kInvalidArgument);
  p = {};
  p.top_p = 1.5f;
  try {
    Sampler s(p, 128);
    FAIL("accepted top_p 1.5");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("top_p") != std::string::npos);
  }
  // A refused request does not disturb another sampler (the engine carries on).
  SamplingParams ok = SamplingParams::greedy();
  Sampler s(ok, 128);
  CHECK(s.sample(ramp_logits(128), {}) == 127);
}

TEST_CASE("same seed, same logits, same tokens", "[sampler]") {
  std::vector<float> logits(64);
  for (size_t i = 0; i < logits.size(); ++i) logits[i] = std::sin(float(i));
  SamplingParams p;
  p.temperature = 1.2f;
  p.seed = 1234;
  CHECK(draw(p, 100, logits) == draw(p, 100, logits));
  SamplingParams q = p;
  q.seed = 4321;
  CHECK(draw(p, 100, logits) != draw(q, 100, logits));
}

TEST_CASE("repetition, frequency and presence penalties follow llama.cpp's rule", "[sampler]") {
  // Token 3 has the largest logit; penalising it hands the choice to token 2.
  const std::vector<float> logits{0.0f, 1.0f, 2.0f, 2.5f};
  const std::vector<int32_t> history{3};
  SamplingParams p = SamplingParams::greedy();
  p.repeat_penalty = 1.5f;  // 2.5 / 1.5 = 1.67 < 2
  Sampler a(p, 4);
  CHECK(a.sample(logits, history) == 2);
  p.repeat_penalty = 1.1f;  // 2.27 > 2
  Sampler b(p, 4);
  CHECK(b.sample(logits, history) == 3);
  p = SamplingParams::greedy();
  p.presence_penalty = 0.6f;  // 2.5 - 0.6 = 1.9 < 2
  Sampler c(p, 4);
  CHECK(c.sample(logits, history) == 2);
  p = SamplingParams::greedy();
  p.frequency_penalty = 0.3f;  // one occurrence: 2.2 > 2; two: 1.9 < 2
  Sampler d(p, 4);
  CHECK(d.sample(logits, history) == 3);
  const std::vector<int32_t> twice{3, 3};
  CHECK(d.sample(logits, twice) == 2);
  // A negative logit is multiplied by the penalty.
  const std::vector<float> neg{-1.0f, -1.2f};
  p = SamplingParams::greedy();
  p.repeat_penalty = 1.5f;
  Sampler e(p, 2);
  const std::vector<int32_t> h0{0};
  CHECK(e.sample(neg, h0) == 1);  // -1.5 < -1.2
}

TEST_CASE("min_p keeps tokens at least min_p times as likely as the best", "[sampler]") {
  // probs ~ e^0 : e^-1 : e^-5 -> the third is < 0.1 x the best and never drawn.
  const std::vector<float> logits{0.0f, -1.0f, -5.0f};
  SamplingParams p;
  p.temperature = 1.0f;
  p.top_k = 0;
  p.top_p = 1.0f;
  p.min_p = 0.1f;
  p.seed = 5;
  const auto d = draw(p, 500, logits);
  CHECK(std::count(d.begin(), d.end(), 2) == 0);
  CHECK(std::count(d.begin(), d.end(), 1) > 0);
}

TEST_CASE("sample refuses logits of the wrong size", "[sampler]") {
  Sampler s(SamplingParams::greedy(), 10);
  std::vector<float> l(9);
  CHECK_THROWS_AS(s.sample(l, {}), Error);
}

namespace {

/// log-softmax of `logits` at `i` in float64, written independently of token_logprobs:
/// log(exp(l_i) / sum exp(l_j)) with the sum shifted by the largest logit.
double ref_logprob(const std::vector<float>& logits, size_t i) {
  double mx = -INFINITY;
  for (const float l : logits) mx = std::max(mx, double(l));
  double sum = 0.0;
  for (const float l : logits) sum += std::exp(double(l) - mx);
  return double(logits[i]) - mx - std::log(sum);
}

}  // namespace

TEST_CASE("logprobs: a float64 log-softmax of the logits, the top alternatives in order", "[sampler][logprobs]") {
  std::mt19937 g(11);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> logits(5000);
  for (auto& l : logits) l = nd(g);
  logits[17] = logits[4000] = 30.0f;  // a tie at the top: the lower id first
  TokenLogprob out;
  for (const int32_t top_n : {0, 1, 5, kMaxTopLogprobs}) {
    for (const int32_t token : {0, 17, 4000, 4999, 1234}) {
      token_logprobs(logits, token, top_n, out);
      const double ref = ref_logprob(logits, size_t(token));
      INFO("top_n " << top_n << " token " << token);
      CHECK(out.token == token);
      // float(x) is within 2^-24 |x| of x; the double sums add far less.
      CHECK(std::fabs(double(out.logprob) - ref) <= std::ldexp(std::fabs(ref), -24) + 1e-12);
      REQUIRE(out.n_top == top_n);
      std::vector<size_t> order(logits.size());
      std::iota(order.begin(), order.end(), size_t{0});
      std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) { return logits[a] > logits[b]; });
      for (int32_t j = 0; j < top_n; ++j) {
        CHECK(out.top[size_t(j)].token == int32_t(order[size_t(j)]));
        const double rj = ref_logprob(logits, order[size_t(j)]);
        CHECK(std::fabs(double(out.top[size_t(j)].logprob) - rj) <= std::ldexp(std::fabs(rj), -24) + 1e-12);
      }
      if (top_n >= 2) {
        CHECK(out.top[0].token == 17);
        CHECK(out.top[1].token == 4000);
      }
    }
  }
  // The probabilities of the whole vocabulary sum to 1.
  double total = 0.0;
  for (size_t i = 0; i < logits.size(); ++i) {
    token_logprobs(logits, int32_t(i), 0, out);
    total += std::exp(double(out.logprob));
  }
  CHECK(std::fabs(total - 1.0) < 1e-5);
  // -inf logits (masked tokens) have logprob -inf; the others are unaffected.
  std::vector<float> masked = {1.0f, -INFINITY, 2.0f};
  token_logprobs(masked, 1, 3, out);
  CHECK(std::isinf(out.logprob));
  CHECK(out.top[0].token == 2);
  CHECK(out.top[2].token == 1);
  // Refusals.
  CHECK_THROWS_AS(token_logprobs(logits, -1, 0, out), Error);
  CHECK_THROWS_AS(token_logprobs(logits, 5000, 0, out), Error);
  CHECK_THROWS_AS(token_logprobs(logits, 0, kMaxTopLogprobs + 1, out), Error);
  CHECK_THROWS_AS(token_logprobs(logits, 0, -1, out), Error);
  CHECK_THROWS_AS(token_logprobs(std::vector<float>{}, 0, 0, out), Error);
}
