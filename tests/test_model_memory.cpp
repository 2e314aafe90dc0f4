// Loading a hub file runs its own bytes: Gemma 3 270M Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0) is
// mapped, not copied, so loading it and running a step add only the KV cache, the step's
// scratch and the tokenizer to the process's anonymous memory, never a converted copy of
// the weights (issue 23: "RSS ~ file size + KV + scratch").
#include <catch2/catch.hpp>

#include <filesystem>
#include <fstream>
#include <string>

#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/gguf/gguf.hpp"
#include "tandem/session/session.hpp"
#include "tandem/tokenizer/tokenizer.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

/// A field of /proc/self/status in bytes ("RssAnon", "RssFile"); its values are in kB.
uint64_t status_bytes(const std::string& field) {
  std::ifstream f("/proc/self/status");
  std::string key;
  uint64_t kb = 0;
  while (f >> key) {
    if (key == field + ":") {
      f >> kb;
      return kb * 1024;
    }
    f.ignore(4096, '\n');
  }
  FAIL("/proc/self/status has no " << field);
  return 0;
}

}  // namespace

TEST_CASE("a Q4_K_M file is mapped, not converted: anonymous memory after load and a step holds no weight copy",
          "[memory][q4_k]") {
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " missing (scripts/fetch-gemma3)");
    return;
  }
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
  WARN("SKIPPED under a sanitizer (its shadow memory and quarantine are anonymous memory): the Release run covers it");
  return;
#endif
  const uint64_t file_bytes = std::filesystem::file_size(path);
  const uint64_t anon0 = status_bytes("RssAnon");
  const auto model = Model::load(path);
  CHECK(model->converted_tensors() == 0);
  const uint64_t anon_load = status_bytes("RssAnon") - anon0;

  // The control: what the file's metadata and its 262k-entry vocabulary cost alone (they
  // are held as parsed structures, not mapped), built while the model is alive so that no
  // freed memory is reused.
  const uint64_t anon1 = status_bytes("RssAnon");
  const auto metadata = GgufFile::open(path);
  const Tokenizer vocabulary = Tokenizer::from_gguf(*metadata);
  const uint64_t anon_control = status_bytes("RssAnon") - anon1;

  // One step over every weight, on the GGUF layout (repack off: the repacked copy is the
  // executor's choice, the same one llama.cpp's CPU repack makes, and has its own tests).
  CpuQ4Executor exec(model, CpuExecutorOptions{.n_threads = 2, .repack = false});
  const int32_t n_vocab = model->hparams().n_vocab;
  const std::vector<int32_t> prompt = model->tokenizer().tokenize("The lighthouse keeper wrote", true, false);
  Session s(model, exec, {.n_ctx = 64});
  std::vector<float> logits(prompt.size() * size_t(n_vocab));
  s.eval(prompt, logits);
  const uint64_t anon_step = status_bytes("RssAnon") - anon1 - anon_control;
  const uint64_t file_resident = status_bytes("RssFile");
  INFO("file " << file_bytes << " B; anonymous: load " << anon_load << " B, metadata + vocabulary alone "
               << anon_control << " B, executor + KV + a step " << anon_step << " B; file-backed resident "
               << file_resident << " B");
  // A converted copy of the layers' Q4_K / Q6_K / Q5_0 matrices would add tens of MB (the
  // Q8_0 conversion ~1.9x their 75 MB, the Q4_0 one ~0.9x); the load adds only what the
  // metadata and vocabulary cost (within 8 MiB), the executor and one step only the KV
  // cache, the scratch and the step's logits (within 32 MiB).
  CHECK(anon_load < anon_control + (8u << 20));
  // The metadata and vocabulary themselves: measured 26 MB (GGUF arrays in one buffer or
  // blob each, ~6 MB; the tokenizer's texts, pieces, lookup table, scores and types, ~11 MB;
  // the rest the parse's transient copies left in malloc's arenas). With one std::variant
  // per array element and a std::string per token text in the tokenizer, it was 81 MB.
  CHECK(anon_control < (36u << 20));
  CHECK(anon_step < (32u << 20));
  // The step read the weights from the mapping: the file's pages are resident.
  CHECK(file_resident > file_bytes / 2);
}
