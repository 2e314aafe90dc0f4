// Token sampling: repetition/frequency/presence penalties, top-k, top-p (nucleus),
// min-p, temperature, then a draw from the remaining distribution.
//
// The chain and the parameter meanings follow llama.cpp's common sampler:
//   penalties (CTRL, arXiv:1909.05858: divide a positive logit by repeat_penalty,
//   multiply a negative one; OpenAI frequency/presence penalties subtract
//   count * frequency_penalty + (count > 0) * presence_penalty) -> a grammar's mask
//   (optional, tandem/grammar/grammar.hpp) -> top-k -> top-p
//   (Holtzman et al., arXiv:1904.09751) -> min-p (Nguyen et al., arXiv:2407.01082)
//   -> temperature -> draw.
// temperature == 0 is greedy: the largest logit, lowest token id on ties.
//
// Parameter rule (decided once, tested): values outside their domain are refused with
// Error(kInvalidArgument) naming the field — temperature < 0 or NaN, top_k < 0,
// top_p or min_p outside [0, 1] or NaN, repeat_penalty <= 0 or NaN, repeat_last_n < 0,
// non-finite frequency/presence penalties. top_k == 0 or top_k >= n_vocab means
// "no top-k". top_p == 1 and min_p == 0 disable those filters; top_p == 0 keeps only the
// most likely token.
//
// Thread-safety: a Sampler is used by one thread at a time. sample() does no heap
// allocation (buffers are sized to the vocabulary at construction).
#pragma once

#include <array>
#include <cstdint>
#include <random>
#include <span>
#include <vector>

namespace tandem {

struct SamplingParams {
  float temperature = 0.8f;
  int32_t top_k = 40;
  float top_p = 0.95f;
  float min_p = 0.05f;
  float repeat_penalty = 1.0f;  ///< 1 = off
  int32_t repeat_last_n = 64;   ///< tokens of history the penalties look at
  float frequency_penalty = 0.0f;
  float presence_penalty = 0.0f;
  /// Same seed + same logits -> same tokens. kSessionSeed: a Session continues its own
  /// random engine (seeded by SessionOptions::seed, saved with the session).
  uint64_t seed = kSessionSeed;
  static constexpr uint64_t kSessionSeed = UINT64_MAX;

  static SamplingParams greedy() {
    SamplingParams p;
    p.temperature = 0.0f;
    return p;
  }
  /// Throws Error(kInvalidArgument) naming the first bad field.
  void validate() const;
};

/// Most alternatives a TokenLogprob carries (OpenAI's top_logprobs limit).
inline constexpr int32_t kMaxTopLogprobs = 20;

/// A generated token's log-probability and the most likely tokens of the same step, from
/// the step's logits before any sampling transform (penalties, filters, temperature): the
/// model's own distribution, as OpenAI's and vLLM's `logprobs` report it.
struct TokenLogprob {
  struct Alt {
    int32_t token = -1;
    float logprob = 0.0f;
  };
  int32_t token = -1;
  float logprob = 0.0f;
  int32_t n_top = 0;  ///< entries of top in use
  /// top[0 .. n_top): the most likely tokens, most likely first (ties: lower id first).
  /// A fixed array, so a TokenLogprob is copied without allocating.
  std::array<Alt, kMaxTopLogprobs> top{};
};

/// out = the log-softmax of `logits` at `token` and its `top_n` best entries. Computed in
/// double: m = max logit, log Z = m + log(sum over ids in order of exp(l - m)), logprob =
/// float(l - log Z) (so exp(logprob) sums to 1 within float rounding). -inf logits give
/// -inf; a NaN logit makes the result NaN. Does not allocate. Throws Error(kInvalidArgument) for an empty `logits`,
/// `token` outside it or top_n outside [0, kMaxTopLogprobs].
void token_logprobs(std::span<const float> logits, int32_t token, int32_t top_n, TokenLogprob& out);

class Sampler {
 public:
  /// Validates `params`; throws Error(kInvalidArgument) for a bad field or n_vocab <= 0.
  Sampler(const SamplingParams& params, int32_t n_vocab);

  const SamplingParams& params() const noexcept { return params_; }
  /// Choose the next token from `logits` ([n_vocab]) given the token history (for the
  /// penalties). `allowed`, when not empty, is a grammar's mask (GrammarMatcher::fill_mask:
  /// bit id % 32 of word id / 32): only tokens whose bit is set are candidates, applied after
  /// the penalties and before top-k (ids past the mask are not allowed). Empty: no mask, the
  /// chain unchanged. Throws Error(kInvalidArgument) if logits.size() != n_vocab or the mask
  /// allows no token.
  int32_t sample(std::span<const float> logits, std::span<const int32_t> history,
                 std::span<const uint32_t> allowed = {});

  /// The random engine's state, for saving and restoring a session.
  const std::mt19937_64& rng() const noexcept { return rng_; }
  void set_rng(const std::mt19937_64& rng) noexcept { rng_ = rng; }

 private:
  struct Candidate {
    float logit;
    int32_t id;
  };
  SamplingParams params_;
  int32_t n_vocab_;
  std::mt19937_64 rng_;
  std::vector<Candidate> cand_;
  std::vector<float> probs_;
  std::vector<int32_t> counts_;
};

}  // namespace tandem
