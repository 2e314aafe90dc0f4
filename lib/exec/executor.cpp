#include "tandem/exec/executor.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace tandem {

int32_t default_context_size(const HParams& hp) noexcept {
  return hp.n_ctx_train > 0 ? std::min(hp.n_ctx_train, 4096) : 4096;
}

int32_t resolve_context_size(int64_t requested, const HParams& hp, std::string_view who, std::string_view what) {
  if (requested < 0 || requested > kMaxContextSize) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("{}: {} {} must be in [0, {}]", who, what, requested, kMaxContextSize));
  }
  return requested > 0 ? int32_t(requested) : default_context_size(hp);
}

int64_t Executor::logits_rows(std::span<const SequenceStep> batch) noexcept {
  int64_t rows = 0;
  for (const auto& s : batch) {
    if (s.logits == LogitsRows::kLast) rows += 1;
    if (s.logits == LogitsRows::kAll) rows += static_cast<int64_t>(s.tokens.size());
  }
  return rows;
}

void Executor::step(std::span<const SequenceStep> batch, std::span<float> logits) {
  const HParams& hp = model_->hparams();
  if (batch.empty()) throw Error(ErrorCode::kInvalidArgument, "step: empty batch");
  for (size_t i = 0; i < batch.size(); ++i) {
    const SequenceStep& s = batch[i];
    if (!s.kv) throw Error(ErrorCode::kInvalidArgument, fmt::format("step: sequence {} has no KV", i));
    const KvLayout& l = s.kv->store().layout();
    if (l.n_layer != hp.n_layer || l.layer_begin != 0 || l.n_head_kv != hp.n_head_kv || l.head_dim != hp.head_dim ||
        l.window != hp.n_swa || l.window_pattern != hp.swa_pattern) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("step: sequence {} has a KV layout ({} layers, {} KV heads, head_dim {}, window {} "
                              "pattern {}) that does not fit the model ({}, {}, {}, {}, {}; KvLayout::for_model)",
                              i, l.n_layer, l.n_head_kv, l.head_dim, l.window, l.window_pattern, hp.n_layer,
                              hp.n_head_kv, hp.head_dim, hp.n_swa, hp.swa_pattern));
    }
    if (!supports(l.dtype)) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("step: the {} executor does not support {} KV pages", name(), kv_dtype_name(l.dtype)));
    }
    if (s.tokens.empty()) throw Error(ErrorCode::kInvalidArgument, fmt::format("step: sequence {} has no tokens", i));
    for (size_t j = 0; j < i; ++j) {
      if (batch[j].kv == s.kv) {
        throw Error(ErrorCode::kInvalidArgument, fmt::format("step: sequences {} and {} share one KV", j, i));
      }
    }
    for (size_t t = 0; t < s.tokens.size(); ++t) {
      if (s.tokens[t] < 0 || s.tokens[t] >= hp.n_vocab) {
        throw Error(ErrorCode::kInvalidArgument,
                    fmt::format("step: token id {} (sequence {}, index {}) is outside the vocabulary [0, {})",
                                s.tokens[t], i, t, hp.n_vocab));
      }
    }
    if (s.pos0 < 0 || s.pos0 >= s.kv->max_tokens() || s.pos0 != s.kv->n_tokens()) {
      throw Error(
          ErrorCode::kBadPosition,
          fmt::format("step: sequence {} starts at position {}, but it holds {} positions of a {}-position context", i,
                      s.pos0, s.kv->n_tokens(), s.kv->max_tokens()));
    }
    const int64_t end = int64_t{s.pos0} + static_cast<int64_t>(s.tokens.size());
    if (end > s.kv->max_tokens()) {
      throw Error(ErrorCode::kContextOverflow,
                  fmt::format("context overflow: sequence {} needs {} positions, the context holds {}", i, end,
                              s.kv->max_tokens()));
    }
  }
  const int64_t need = logits_rows(batch) * hp.n_vocab;
  if (static_cast<int64_t>(logits.size()) < need) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("step: logits buffer holds {} floats, {} needed", logits.size(), need));
  }
  struct Pins {
    std::span<const SequenceStep> b;
    explicit Pins(std::span<const SequenceStep> batch_) : b(batch_) {
      for (const auto& s : b) s.kv->pin();
    }
    ~Pins() {
      for (const auto& s : b) s.kv->unpin();
    }
  } pins(batch);
  // Pages are placed by the caller's KvPlacement (scheduler or Session) before the step;
  // the step only reads them where they are and allocates the positions it writes.
  for (const auto& s : batch) {
    s.kv->touch();
    for (int32_t g = 0; g < s.kv->store().layout().n_groups(); ++g) {
      for (PageId p : s.kv->block_table(g)) {
        if (p != kNoPage && !can_read(s.kv->store().tier_of(p))) {
          throw Error(
              ErrorCode::kInvalidArgument,
              fmt::format("step: a KV page of sequence {} lives in the {} tier, which the {} executor cannot read",
                          s.kv->id(), kv_tier_name(s.kv->store().tier_of(p)), name()));
        }
      }
    }
  }
  for (const auto& s : batch) s.kv->reserve(s.pos0 + static_cast<int32_t>(s.tokens.size()));
  step_impl(batch, logits);
}

}  // namespace tandem
