// Helpers for KV tests: models (loaded once per process), stores, greedy continuations,
// page checksums, and the batch-invariance check every KV dtype and executor must pass.
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/kv/kv_contract.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

namespace tandem::test {

/// The test model `name` (models_dir()/name.gguf), loaded on first use and kept for the
/// process. Not thread-safe: call from the test thread.
inline std::shared_ptr<const Model> load_model(const std::string& name) {
  static std::map<std::string, std::shared_ptr<const Model>> cache;
  auto& m = cache[name];
  if (!m) m = Model::load(model_path(name));
  return m;
}

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

/// Batch invariance of `exec` on `ids` (at least 25 tokens): one whole-prompt eval with
/// `one` is the reference; a chunked eval (n_batch 7, page size 5) must give the same logits
/// bit for bit; then two sequences `a` (ids[0, 25), all rows) and `b` (ids[3, 14), last row)
/// of `pool` prefilled in one step, and one decode token each in a second step, must equal
/// each run alone. CHECKs each; `a` and `b` keep their KV for the caller's further checks.
inline void check_batch_invariance(const std::shared_ptr<const Model>& model, Executor& exec,
                                   std::span<const int32_t> ids, const SessionOptions& one, KvSequence& a,
                                   KvSequence& b) {
  const int32_t n_vocab = model->hparams().n_vocab;
  REQUIRE(ids.size() >= 25);
  Session whole(model, exec, one);
  std::vector<float> ref(ids.size() * size_t(n_vocab));
  whole.eval(ids, ref);

  SessionOptions chunked = one;
  chunked.n_batch = 7;
  chunked.page_size = 5;
  Session parts(model, exec, chunked);
  std::vector<float> got(ref.size());
  parts.eval(ids, got);
  CHECK(got == ref);

  // Two sequences of different lengths in one step, against each run alone.
  const std::span<const int32_t> ia = ids.first(25), ib = ids.subspan(3, 11);
  SequenceStep batch[2] = {{&a, ia, 0, LogitsRows::kAll}, {&b, ib, 0, LogitsRows::kLast}};
  std::vector<float> both(size_t(25 + 1) * size_t(n_vocab));
  exec.step(batch, both);
  CHECK(std::equal(both.begin(), both.begin() + 25 * n_vocab, ref.begin()));
  Session alone(model, exec, one);
  alone.eval(ib);
  CHECK(std::equal(both.begin() + 25 * n_vocab, both.end(), alone.logits().begin()));
  // Then one decode token for each, together, against the same alone.
  const int32_t na = 7, nb = 9;
  SequenceStep dec[2] = {{&a, std::span<const int32_t>(&na, 1), 25, LogitsRows::kLast},
                         {&b, std::span<const int32_t>(&nb, 1), 11, LogitsRows::kLast}};
  std::vector<float> two(2 * size_t(n_vocab));
  exec.step(dec, two);
  alone.eval(std::span<const int32_t>(&nb, 1));
  CHECK(std::equal(two.begin() + n_vocab, two.end(), alone.logits().begin()));
}

}  // namespace tandem::test
