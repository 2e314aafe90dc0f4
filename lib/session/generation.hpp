// The per-token generation logic, one implementation shared by Session::generate and the
// scheduler's step loop (internal): sample the next token, end at an end-of-generation
// token, detokenise with an incomplete UTF-8 sequence held back, hold back text that may
// still become a stop string and cut at one, and end at the output limit.
//
// The callers keep only what differs between them: where the logits come from, how a
// piece of text is delivered (Session: on_text; scheduler: an event), and what happens to
// the sampled token next (fed on the next step).
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/grammar/grammar.hpp"
#include "tandem/session/sampler.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

namespace tandem {

/// Output tokens that fit in `n_ctx` positions after `positions` (prompt and history):
/// n_ctx - positions + 1, as the last sampled token is never fed; at most `max_tokens`.
/// <= 0 when the prompt does not fit (the caller refuses it with kContextOverflow).
int32_t clamp_output_tokens(int32_t max_tokens, int64_t positions, int32_t n_ctx) noexcept;

/// Why one token ended the generation (kNone: it goes on).
enum class GenEnd : uint8_t {
  kNone,
  kEog,         ///< an end-of-generation token was sampled (not part of the output)
  kStopString,  ///< a stop string appeared: the text is cut before it
  kLength,      ///< this token is the last one allowed
};

/// One sampled token and what it decided.
struct TokenStep {
  int32_t id = -1;
  GenEnd end = GenEnd::kNone;
  std::string_view piece;  ///< text newly final (views text(); valid until the next call)
  /// next() with logprobs >= 0: the token's log-probability and top alternatives (points
  /// into the Generation; valid until the next call). Null otherwise.
  const TokenLogprob* logprob = nullptr;
};

/// Thread-safety: one thread at a time. No heap allocation per token once the text
/// buffer has grown (the caller may reserve it).
class Generation {
 public:
  explicit Generation(const Tokenizer& tok) : tok_(&tok), detok_(tok, false, false) {}

  /// Start a generation (text, counters and sampler fresh; bytes of an incomplete UTF-8
  /// sequence held from an earlier generation are kept and complete with this one).
  /// `stops` must outlive the generation. Throws Error(kInvalidArgument) for an empty stop
  /// string or bad sampling parameters (see Sampler), leaving the object unchanged.
  /// `logprobs`: -1 none; 0 .. kMaxTopLogprobs: next() reports each token's log-probability
  /// with that many alternatives (TokenStep::logprob); other values are refused.
  /// `grammar`: null, or a grammar compiled for this tokenizer's vocabulary whose mask
  /// constrains every sampled token (Error(kInvalidArgument) for another vocabulary or with
  /// ignore_eos, which would run past the grammar's end).
  void begin(const SamplingParams& sampling, int32_t n_vocab, const std::vector<std::string>& stops, bool ignore_eos,
             int32_t max_new, int32_t logprobs = -1, const std::shared_ptr<const Grammar>& grammar = nullptr);

  Sampler& sampler() noexcept { return *sampler_; }

  /// Sample from `logits` ([n_vocab]) given `history` (the tokens fed so far) and decide.
  /// Throws Error(kInvalidArgument) on a logits size mismatch (nothing changed).
  TokenStep next(std::span<const float> logits, std::span<const int32_t> history);
  /// The decisions for a token chosen elsewhere (as next() after sampling).
  TokenStep accept(int32_t id);

  /// At the end: write held-back UTF-8 bytes out as U+FFFD into text() (not yet passed on).
  void flush_utf8();
  /// Drop what was never passed on (a cancelled or failed generation ends with what was
  /// streamed).
  void cut_to_emitted();
  /// Text after what was passed on, marked passed on.
  std::string_view take_unsent() noexcept;
  /// Forget held-back bytes (a new conversation).
  void discard_held() { detok_.finish(); }

  const std::string& text() const noexcept { return text_; }
  std::string& text() noexcept { return text_; }
  int32_t n_gen() const noexcept { return n_gen_; }
  int32_t max_new() const noexcept { return max_new_; }

 private:
  const Tokenizer* tok_;
  StreamingDetokenizer detok_;
  std::optional<Sampler> sampler_;
  std::optional<GrammarMatcher> matcher_;
  const std::vector<std::string>* stops_ = nullptr;
  bool ignore_eos_ = false;
  int32_t max_new_ = 0;
  int32_t n_gen_ = 0;
  int32_t logprobs_ = -1;
  TokenLogprob logprob_;  // the last next()'s
  std::string text_;
  size_t emitted_ = 0;  // bytes of text_ passed on
};

}  // namespace tandem
