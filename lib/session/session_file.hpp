// Session files (internal): the one reader and writer of the format, shared by
// Session::save / Session::restore and Scheduler::save_session / restore_session
// (lib/session/session_file.cpp has the layout).
//
// A file holds a conversation: the KV of its evaluated tokens (the KV contract's
// descriptor and page payloads), at most one sampled token not yet evaluated, the logits
// after the last evaluated token (optional), and the state of a random engine (optional:
// a scheduler session has none, each of its requests seeds its own sampler).
//
// Thread-safety: free functions and a value. The sequence written must not be written to
// during the call; its pages are read under the store's lock, so other threads may move
// them meanwhile.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <random>
#include <span>
#include <vector>

#include "tandem/kv/kv_contract.hpp"
#include "tandem/model/model.hpp"

namespace tandem {

/// Write the conversation atomically (write_file_atomic: the old file is intact on any
/// error). `tokens` are the positions of `kv` (tokens.size() == kv.n_tokens()); `pending`
/// a sampled token not yet evaluated (-1: none); `logits` empty or [n_vocab]; `rng` null
/// for none. Errors: kIo, kInvalidArgument (a path that is a directory, device, FIFO or
/// socket; tokens not matching kv), kOutOfMemory.
void session_file_write(const std::filesystem::path& path, const KvSequence& kv, const Model& model,
                        std::span<const int32_t> tokens, int32_t pending, std::span<const float> logits,
                        const std::mt19937_64* rng);

/// A session file read and verified against a model (whole-file checksum, magic,
/// version, descriptor invariants, field ranges, the page bytes' length), KV not yet
/// imported. Throws kIo (unreadable), kSessionCorrupt, kSessionVersion,
/// kSessionModelMismatch, kContextOverflow (more evaluated positions than `n_ctx`).
class SessionFile {
 public:
  SessionFile(const std::filesystem::path& path, const Model& model, int32_t n_ctx);

  /// The KV contract's descriptor: tokens (the evaluated ids), dtype, page size, pages.
  const KvDescriptor& descriptor() const noexcept { return d_; }
  /// The evaluated tokens, moved out (call once, after import_kv).
  std::vector<int32_t> take_tokens() noexcept { return std::move(d_.tokens); }
  /// The sampled token not yet evaluated, if any.
  std::optional<int32_t> pending() const noexcept { return pending_; }
  /// The logits after the last evaluated token ([n_vocab]); empty when none were saved.
  std::span<const float> logits() const noexcept { return logits_; }
  /// The random engine's state, when one was saved.
  const std::optional<std::mt19937_64>& rng() const noexcept { return rng_; }
  /// Import the pages into a new sequence of `store` in `tier` (converted to the store's
  /// dtype and page size, verified). Errors: kSessionCorrupt (a page's checksum or
  /// conversion), kOutOfMemory, kInvalidArgument (no such tier); nothing is left
  /// allocated on error.
  std::unique_ptr<KvSequence> import_kv(KvStore& store, KvTier tier, int32_t max_tokens) const;

 private:
  std::filesystem::path path_;
  std::vector<std::byte> data_;
  KvDescriptor d_;
  std::optional<int32_t> pending_;
  std::vector<float> logits_;
  std::optional<std::mt19937_64> rng_;
  size_t pages_at_ = 0;  ///< offset of the page payloads in data_
};

}  // namespace tandem
