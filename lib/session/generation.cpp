#include "session/generation.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "session/stop_strings.hpp"
#include "tandem/core/error.hpp"

namespace tandem {

int32_t clamp_output_tokens(int32_t max_tokens, int64_t positions, int32_t n_ctx) noexcept {
  return int32_t(std::min<int64_t>(max_tokens, int64_t(n_ctx) - positions + 1));
}

void Generation::begin(const SamplingParams& sampling, int32_t n_vocab, const std::vector<std::string>& stops,
                       bool ignore_eos, int32_t max_new, int32_t logprobs,
                       const std::shared_ptr<const Grammar>& grammar) {
  for (const auto& s : stops) {
    if (s.empty()) throw Error(ErrorCode::kInvalidArgument, "a stop string is empty");
  }
  if (logprobs < -1 || logprobs > kMaxTopLogprobs) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("logprobs: {} alternatives requested, at most {}", logprobs, kMaxTopLogprobs));
  }
  if (grammar) {
    if (grammar->vocab_hash() != tok_->identity_hash()) {
      throw Error(ErrorCode::kInvalidArgument, "grammar: compiled for another vocabulary than this model's");
    }
  }
  sampler_.emplace(sampling, n_vocab);
  if (grammar) {
    matcher_.emplace(grammar);
  } else {
    matcher_.reset();
  }
  stops_ = &stops;
  ignore_eos_ = ignore_eos;
  max_new_ = max_new;
  logprobs_ = logprobs;
  n_gen_ = 0;
  text_.clear();
  emitted_ = 0;
}

TokenStep Generation::next(std::span<const float> logits, std::span<const int32_t> history) {
  const std::span<const uint32_t> mask = matcher_ ? matcher_->fill_mask() : std::span<const uint32_t>{};
  const int32_t id = sampler_->sample(logits, history, mask);
  if (matcher_ && !matcher_->accept(id)) {
    throw Error(ErrorCode::kInternal, fmt::format("grammar: token {} was in the mask but not accepted", id));
  }
  TokenStep t = accept(id);
  if (logprobs_ >= 0) {
    token_logprobs(logits, id, logprobs_, logprob_);
    t.logprob = &logprob_;
  }
  return t;
}

TokenStep Generation::accept(int32_t id) {
  TokenStep t;
  t.id = id;
  // With a grammar, an end-of-generation token is sampled only where the grammar is complete
  // (the matcher accepted it and terminated): it ends the output even with ignore_eos.
  if (tok_->is_eog(id) && (!ignore_eos_ || (matcher_ && matcher_->is_terminated()))) {
    t.end = GenEnd::kEog;
    return t;
  }
  text_ += detok_.push(id);
  ++n_gen_;
  static const std::vector<std::string> kNoStops;
  const StopScan scan = scan_stop_strings(text_, emitted_, stops_ ? *stops_ : kNoStops);
  t.piece = scan.piece;
  if (scan.hit) {
    t.end = GenEnd::kStopString;
  } else if (n_gen_ >= max_new_) {  // max_tokens, or the context is full (max_new is clamped to it)
    t.end = GenEnd::kLength;
  }
  return t;
}

void Generation::flush_utf8() {
  text_ += detok_.finish();
}

void Generation::cut_to_emitted() {
  text_.resize(std::min(emitted_, text_.size()));
}

std::string_view Generation::take_unsent() noexcept {
  const size_t from = std::min(emitted_, text_.size());
  emitted_ = text_.size();
  return std::string_view(text_).substr(from);
}

}  // namespace tandem
