// Helpers for KV tests: stores, greedy continuations, page checksums.
#pragma once

#include <algorithm>
#include <memory>
#include <vector>

#include "tandem/cpu_q4_executor.hpp"
#include "tandem/kv_contract.hpp"
#include "tandem/session.hpp"
#include "test_support.hpp"

namespace tandem::test {

inline std::shared_ptr<KvStore> make_store(const HParams& hp, int32_t host_pages, int32_t file_pages = 0,
                                           int32_t page_size = 16, KvDtype dtype = KvDtype::kF16) {
  KvStoreOptions o;
  o.layout = KvLayout::for_model(hp, page_size, dtype);
  o.host_pages = host_pages;
  o.file_pages = file_pages;
  o.file_chunk_pages = 8;
  return std::make_shared<KvStore>(std::move(o));
}

inline int32_t argmax(std::span<const float> l) {
  return static_cast<int32_t>(std::max_element(l.begin(), l.end()) - l.begin());
}

/// Greedy continuation of `n` tokens from the session's current state.
inline std::vector<int32_t> greedy(Session& s, int32_t n) {
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.max_tokens = n;
  go.ignore_eos = true;
  return s.generate(std::span<const int32_t>(), go).tokens;
}

/// Prompt ids of length n (BOS then a deterministic pattern inside the vocabulary).
inline std::vector<int32_t> prompt_ids(int32_t n, int32_t n_vocab) {
  std::vector<int32_t> ids{1};
  for (int32_t i = 1; i < n; ++i) ids.push_back(3 + (i * 131) % (n_vocab - 3));
  return ids;
}

/// Checksums of a sequence's pages as the contract computes them (lease released at once).
inline std::vector<uint64_t> page_checksums(const KvSequence& seq, const Model& m, std::span<const int32_t> tokens) {
  KvHandoff h = kv_export(seq, m, tokens);
  h.lease->begin_read();
  h.lease->confirm();
  return h.descriptor.page_checksums;
}

}  // namespace tandem::test
