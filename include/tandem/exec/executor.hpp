// Executor: the one interface every processor implements.
//
// A step runs the model over a batch of sequences. Each SequenceStep gives a sequence's
// new token ids, the position of the first one, and the sequence's KV block table
// (KvSequence). Prefill (many tokens of one sequence) and decode (one token for each of
// many sequences) are the same call with different shapes. Logits come back for the rows
// each sequence asks for, in batch order, as a row-major float32 [n_rows, n_vocab] array.
//
// Template method (as faiss's GpuIndex::search -> searchImpl_): step() validates the
// whole batch, pins the sequences against eviction (a counted pin: a caller's own pin
// stays), allocates the pages the new positions need in each sequence's tier, then calls
// step_impl(), which may assume valid inputs. On an error thrown by step() nothing has
// been computed and no sequence's n_tokens changed.
//
// Placement is not the executor's: step() never evicts or moves a page. The caller's
// KvPlacement (include/tandem/kv/kv_store.hpp) — the Scheduler's loops and Session use it —
// brings a sequence into the executor's tier (kv_tier(): Host for the CPU, Device for the
// GPU) and frees the pages it will write before the step. A direct caller that skips it
// gets kInvalidArgument for a page in a tier the executor cannot read, and
// kOutOfMemory when the sequence's tier has no free page.
//
// Thread-safety: an executor runs one step at a time (the caller serialises; the
// scheduler gives each executor one step loop). Different executors run concurrently.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <string_view>

#include "tandem/kv/kv_store.hpp"
#include "tandem/model/model.hpp"

namespace tandem {

enum class LogitsRows {
  kNone,  ///< no logits (a prefill chunk that is not the last)
  kLast,  ///< the row of the last new token
  kAll,   ///< one row per new token
};

struct SequenceStep {
  KvSequence* kv = nullptr;         ///< positions [0, pos0) already hold this sequence's KV
  std::span<const int32_t> tokens;  ///< new token ids, at positions pos0 .. pos0 + n - 1
  int32_t pos0 = 0;                 ///< must equal kv->n_tokens()
  LogitsRows logits = LogitsRows::kLast;
};

/// The context size used when none is given — the one rule for Session, Scheduler and the
/// tools: the model's n_ctx_train capped at 4096 (4096 when the model does not say).
int32_t default_context_size(const HParams& hp) noexcept;

/// The largest context any Session or Scheduler accepts (2^24 positions): a size beyond it
/// is refused before anything is allocated.
inline constexpr int32_t kMaxContextSize = 1 << 24;

/// The context size for a request of `requested` positions (0 = default_context_size).
/// Throws Error(kInvalidArgument) "<who>: <what> N must be in [0, kMaxContextSize]" for a
/// size outside that range, before anything is allocated.
int32_t resolve_context_size(int64_t requested, const HParams& hp, std::string_view who, std::string_view what);

class Executor {
 public:
  explicit Executor(std::shared_ptr<const Model> model) : model_(std::move(model)) {}
  virtual ~Executor() = default;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  virtual std::string_view name() const noexcept = 0;
  /// The KV tier this executor computes on.
  virtual KvTier kv_tier() const noexcept = 0;
  /// Whether step_impl can read pages that live in `tier` directly.
  virtual bool can_read(KvTier tier) const noexcept { return tier == kv_tier(); }
  /// Whether step_impl supports KV pages of this element type.
  virtual bool supports(KvDtype dtype) const noexcept { return dtype == KvDtype::kF16; }
  /// A Device tier of `pages` pages of `layout` that step_impl computes on in place, for a
  /// KvStore (KvStoreOptions::device); null (the default) for executors computing on Host
  /// pages. Sessions without a store of their own use it (SessionOptions::kv_store).
  /// Throws Error when the pages do not fit. Not on the per-token path.
  virtual std::unique_ptr<KvDeviceBackend> make_kv_device_backend(const KvLayout& layout, int32_t pages) const {
    (void)layout, (void)pages;
    return nullptr;
  }
  const Model& model() const noexcept { return *model_; }
  const std::shared_ptr<const Model>& model_ptr() const noexcept { return model_; }

  /// Number of logits rows a batch produces.
  static int64_t logits_rows(std::span<const SequenceStep> batch) noexcept;

  /// Run one step; `logits` must hold logits_rows(batch) * n_vocab floats.
  /// Errors (nothing computed, no sequence changed): kInvalidArgument (null kv, empty
  /// tokens, token id outside the vocabulary, the same sequence twice, logits too small,
  /// a KV layout or dtype that does not fit the model or executor, a KV page in a tier
  /// this executor cannot read), kBadPosition (pos0 != kv->n_tokens(), or pos0 outside
  /// [0, max_tokens)), kContextOverflow (pos0 + n > max_tokens), kOutOfMemory (no free KV page in the
  /// sequence's tier: nothing is evicted here, see KvPlacement).
  void step(std::span<const SequenceStep> batch, std::span<float> logits);

 protected:
  /// Compute the step. Inputs are valid and every KV page needed is allocated; must set
  /// each sequence's n_tokens to pos0 + n when done.
  virtual void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) = 0;

 private:
  std::shared_ptr<const Model> model_;
};

}  // namespace tandem
