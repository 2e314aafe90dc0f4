#include "tandem/session/sampler.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "tandem/core/error.hpp"

namespace tandem {

namespace {
[[noreturn]] void bad(const char* field, double value, const char* rule) {
  throw Error(ErrorCode::kInvalidArgument, fmt::format("sampling: {} = {} is invalid: {}", field, value, rule));
}
}  // namespace

void SamplingParams::validate() const {
  if (!(temperature >= 0.0f)) bad("temperature", temperature, "must be >= 0 (0 = greedy)");
  if (top_k < 0) bad("top_k", top_k, "must be >= 0 (0 = off)");
  if (!(top_p >= 0.0f && top_p <= 1.0f)) bad("top_p", top_p, "must be in [0, 1]");
  if (!(min_p >= 0.0f && min_p <= 1.0f)) bad("min_p", min_p, "must be in [0, 1]");
  if (!(repeat_penalty > 0.0f) || !std::isfinite(repeat_penalty)) {
    bad("repeat_penalty", repeat_penalty, "must be a finite number > 0 (1 = off)");
  }
  if (repeat_last_n < 0) bad("repeat_last_n", repeat_last_n, "must be >= 0");
  if (!std::isfinite(frequency_penalty)) bad("frequency_penalty", frequency_penalty, "must be finite");
  if (!std::isfinite(presence_penalty)) bad("presence_penalty", presence_penalty, "must be finite");
}

void token_logprobs(std::span<const float> logits, int32_t token, int32_t top_n, TokenLogprob& out) {
  const auto n = static_cast<int64_t>(logits.size());
  if (n == 0) throw Error(ErrorCode::kInvalidArgument, "logprobs: no logits");
  if (token < 0 || token >= n) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("logprobs: token {} outside the {} logits", token, n));
  }
  if (top_n < 0 || top_n > kMaxTopLogprobs) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("logprobs: {} alternatives requested, at most {}", top_n, kMaxTopLogprobs));
  }
  float mx = -INFINITY;
  for (const float l : logits) mx = std::max(mx, l);  // NaN never wins here; it poisons the sum
  double sum = 0.0;
  for (const float l : logits) sum += std::exp(double(l) - double(mx));
  const double log_z = double(mx) + std::log(sum);
  out.token = token;
  out.logprob = static_cast<float>(double(logits[size_t(token)]) - log_z);
  // The top_n best by insertion into a sorted list (top_n <= 20): the larger logit first,
  // the lower id on ties (ids are scanned in order and only a larger logit moves ahead).
  int32_t k = 0;  // entries held
  for (int64_t i = 0; i < n && top_n > 0; ++i) {
    const float l = logits[size_t(i)];
    if (k == top_n && !(l > logits[size_t(out.top[size_t(k - 1)].token)])) continue;
    int32_t at = k < top_n ? k++ : k - 1;  // a full list drops its last entry
    while (at > 0 && l > logits[size_t(out.top[size_t(at - 1)].token)]) {
      out.top[size_t(at)] = out.top[size_t(at - 1)];
      --at;
    }
    out.top[size_t(at)].token = static_cast<int32_t>(i);
  }
  out.n_top = k;
  for (int32_t j = 0; j < k; ++j) {
    auto& a = out.top[size_t(j)];
    a.logprob = static_cast<float>(double(logits[size_t(a.token)]) - log_z);
  }
}

Sampler::Sampler(const SamplingParams& params, int32_t n_vocab)
    : params_(params), n_vocab_(n_vocab), rng_(params.seed) {
  params_.validate();
  if (n_vocab <= 0) throw Error(ErrorCode::kInvalidArgument, fmt::format("sampling: n_vocab {} must be > 0", n_vocab));
  cand_.resize(size_t(n_vocab));
  probs_.resize(size_t(n_vocab));
  counts_.assign(size_t(n_vocab), 0);
}

int32_t Sampler::sample(std::span<const float> logits, std::span<const int32_t> history,
                        std::span<const uint32_t> allowed) {
  if (static_cast<int64_t>(logits.size()) != n_vocab_) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("sampling: {} logits given for a vocabulary of {}", logits.size(), n_vocab_));
  }
  const SamplingParams& p = params_;
  for (int32_t i = 0; i < n_vocab_; ++i) cand_[size_t(i)] = {logits[size_t(i)], i};

  // Penalties over the last repeat_last_n tokens of history.
  const bool penalise = p.repeat_penalty != 1.0f || p.frequency_penalty != 0.0f || p.presence_penalty != 0.0f;
  if (penalise && p.repeat_last_n > 0 && !history.empty()) {
    const size_t n = std::min(history.size(), size_t(p.repeat_last_n));
    const auto recent = history.subspan(history.size() - n);
    for (int32_t id : recent) {
      if (id >= 0 && id < n_vocab_) ++counts_[size_t(id)];
    }
    for (int32_t id : recent) {
      if (id < 0 || id >= n_vocab_ || counts_[size_t(id)] == 0) continue;
      float& l = cand_[size_t(id)].logit;
      l = l > 0.0f ? l / p.repeat_penalty : l * p.repeat_penalty;
      l -= float(counts_[size_t(id)]) * p.frequency_penalty + p.presence_penalty;
      counts_[size_t(id)] = 0;  // each distinct token penalised once
    }
  }

  // A grammar's mask: keep only the allowed candidates (in id order).
  size_t n = cand_.size();
  if (!allowed.empty()) {
    size_t kept = 0;
    for (size_t i = 0; i < cand_.size(); ++i) {
      if (i / 32 < allowed.size() && ((allowed[i / 32] >> (i % 32)) & 1u) != 0) cand_[kept++] = cand_[i];
    }
    if (kept == 0) throw Error(ErrorCode::kInvalidArgument, "sampling: the grammar allows no token");
    n = kept;
  }
  const auto end = cand_.begin() + std::ptrdiff_t(n);

  auto by_logit = [](const Candidate& a, const Candidate& b) {
    return a.logit > b.logit || (a.logit == b.logit && a.id < b.id);
  };
  if (p.temperature == 0.0f || p.top_p == 0.0f || p.top_k == 1) {
    return std::min_element(cand_.begin(), end, by_logit)->id;
  }

  if (p.top_k > 0 && size_t(p.top_k) < n) {
    n = size_t(p.top_k);
    std::partial_sort(cand_.begin(), cand_.begin() + std::ptrdiff_t(n), end, by_logit);
  } else {
    std::sort(cand_.begin(), end, by_logit);
  }

  // Softmax at temperature 1 for the top-p and min-p filters (sorted, so max is first).
  auto softmax = [&](float temp) {
    const float mx = cand_[0].logit;
    double sum = 0.0;
    for (size_t i = 0; i < n; ++i) {
      probs_[i] = std::exp((cand_[i].logit - mx) / temp);
      sum += probs_[i];
    }
    for (size_t i = 0; i < n; ++i) probs_[i] = float(probs_[i] / sum);
  };
  softmax(1.0f);
  if (p.top_p < 1.0f) {
    double cum = 0.0;
    for (size_t i = 0; i < n; ++i) {
      cum += probs_[i];
      if (cum >= p.top_p) {
        n = i + 1;
        break;
      }
    }
  }
  if (p.min_p > 0.0f) {
    const float threshold = p.min_p * probs_[0];
    size_t keep = 1;
    while (keep < n && probs_[keep] >= threshold) ++keep;
    n = keep;
  }
  softmax(p.temperature);
  std::uniform_real_distribution<double> uni(0.0, 1.0);
  const double r = uni(rng_);
  double cum = 0.0;
  for (size_t i = 0; i < n; ++i) {
    cum += probs_[i];
    if (r < cum) return cand_[i].id;
  }
  return cand_[n - 1].id;
}

}  // namespace tandem
