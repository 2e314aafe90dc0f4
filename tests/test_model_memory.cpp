// Loading a hub file runs its own bytes: Gemma 3 270M Q4_K_M (Q4_K, Q6_K, Q5_0, Q8_0) is
// mapped, not copied, so loading it and running a step add only the KV cache, the step's
// scratch and the tokenizer to the process's anonymous memory, never a converted copy of
// the weights (issue 23: "RSS ~ file size + KV + scratch"). With the CPU repack on, the
// repacked matrices' file pages are given back (GgufFile::release_pages): resident memory
// is the copies plus the rest of the file, not the whole file plus the copies, and weights
// a Model converted onto its heap are never released.
#include <unistd.h>
#include <catch2/catch.hpp>

#define XXH_INLINE_ALL
#include <xxhash.h>

#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <span>
#include <string>
#include <vector>

#include "kv_test_support.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/gguf/gguf.hpp"
#include "tandem/gguf/gguf_writer.hpp"
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

namespace {

/// The matrices the CPU executor repacks, each once (tied embeddings share their data):
/// Q4_0, Q4_1 and Q5_0 rows of whole 32-element blocks, Q4_K and Q6_K rows of whole
/// 256-element super-blocks (CpuQ4Executor's rule, restated).
std::vector<const TensorView*> repackable(const Model& m) {
  std::vector<const TensorView*> out;
  auto add = [&](const TensorView& W) {
    const bool q32 = W.type == GgmlType::kQ4_0 || W.type == GgmlType::kQ4_1 || W.type == GgmlType::kQ5_0;
    const bool q256 = W.type == GgmlType::kQ4_K || W.type == GgmlType::kQ6_K;
    if (!W || !((q32 && W.k % 32 == 0) || (q256 && W.k % 256 == 0))) return;
    for (const TensorView* o : out)
      if (o->data == W.data) return;
    out.push_back(&W);
  };
  for (const LayerWeights& L : m.layers())
    for (const TensorView* W : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down}) add(*W);
  add(m.output());
  return out;
}

/// xxHash3 of each matrix's bytes as a reader sees them now (reading makes them resident).
std::vector<uint64_t> hashes(const std::vector<const TensorView*>& ws) {
  std::vector<uint64_t> out;
  for (const TensorView* W : ws) out.push_back(XXH3_64bits(W->data, W->row_bytes * size_t(W->n)));
  return out;
}

/// Logits of a 9-token prompt, one row per token.
std::vector<float> logits_of(const std::shared_ptr<const Model>& model, CpuQ4Executor& exec) {
  const auto ids = test::prompt_ids(9, model->hparams().n_vocab);
  Session s(model, exec, {.n_ctx = 16});
  std::vector<float> out(ids.size() * size_t(model->hparams().n_vocab));
  s.eval(ids, out);
  return out;
}

}  // namespace

TEST_CASE("release_pages drops a mapped file's pages, which read back the same; heap bytes are never touched",
          "[memory][gguf]") {
  const int64_t n = 1 << 20;  // 4 MiB of F32
  std::vector<float> pattern(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) pattern[size_t(i)] = float(i % 1000) * 0.25f - 7.0f;
  GgufWriter w;
  w.add_tensor("t", {n}, GgmlType::kF32,
               [&](std::span<std::byte> out) { std::memcpy(out.data(), pattern.data(), out.size()); });
  const auto path = test::scratch_dir("release_pages") / "t.gguf";
  w.write(path);
  const uint64_t bytes = uint64_t(n) * 4;

  const auto f = GgufFile::open(path);  // the finiteness scan reads every byte: resident
  const GgufTensorInfo& t = *f->find_tensor("t");
  REQUIRE(std::memcmp(t.data, pattern.data(), bytes) == 0);
  const uint64_t file0 = status_bytes("RssFile");
  f->release_pages(t.data, t.n_bytes);
  const uint64_t file1 = status_bytes("RssFile");
  INFO("file-backed resident " << file0 << " B before, " << file1 << " B after releasing " << bytes << " B");
  // Every page wholly inside the tensor left (at most one partial page at each end stays).
  const auto page = uint64_t(::sysconf(_SC_PAGESIZE));
  CHECK(file1 + bytes - 2 * page <= file0);
  CHECK(std::memcmp(t.data, pattern.data(), bytes) == 0);  // faulted in from the file again

  // A GgufFile parsed from memory holds a heap copy: dropping its pages would zero them.
  std::vector<std::byte> raw(std::filesystem::file_size(path));
  std::ifstream(path, std::ios::binary).read(reinterpret_cast<char*>(raw.data()), std::streamsize(raw.size()));
  const auto g = GgufFile::from_bytes(raw);
  const GgufTensorInfo& gt = *g->find_tensor("t");
  g->release_pages(gt.data, gt.n_bytes);
  CHECK(std::memcmp(gt.data, pattern.data(), bytes) == 0);
  // Bytes that are not the file's (another buffer) are left alone too.
  f->release_pages(reinterpret_cast<const std::byte*>(pattern.data()), bytes);
  CHECK(std::memcmp(gt.data, pattern.data(), bytes) == 0);
  CHECK(pattern[size_t(n) - 1] == float((n - 1) % 1000) * 0.25f - 7.0f);
}

namespace {

/// SmolLM2-135M-Instruct requantised to Q4_K_M (Q5_0, Q4_K, Q6_K and Q8_0 matrices):
/// $TANDEM_SMOLLM2_Q4_K_M, else the cache's SmolLM2-135M-Instruct-Q4_K_M.gguf. Made with
/// llama.cpp's `llama-quantize --allow-requantize SmolLM2-135M-Instruct.Q4_1.gguf OUT Q4_K_M`.
std::filesystem::path smollm2_q4_k_m_path() {
  if (const char* env = std::getenv("TANDEM_SMOLLM2_Q4_K_M"); env && *env) return env;
  return test::cache_dir() / "SmolLM2-135M-Instruct-Q4_K_M.gguf";
}

}  // namespace

TEST_CASE(
    "repacking gives back the file's pages of the repacked matrices: resident memory is the copies plus the rest, "
    "not the file plus the copies; bytes and logits unchanged",
    "[memory][repack]") {
  // Gemma 3's file; SmolLM2 Q4_K_M's, whose small tensors share large page-cache folios
  // with its matrices (where the kernel's fault-around mapped the released pages back).
  const auto path = GENERATE(test::gemma3_q4_k_m_path(), smollm2_q4_k_m_path());
  INFO(path);
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " missing (scripts/fetch-gemma3; for SmolLM2 Q4_K_M see smollm2_q4_k_m_path)");
    return;
  }
  const auto model = Model::load(path);
  REQUIRE(model->converted_tensors() == 0);  // every weight is the file's
  const auto ws = repackable(*model);
  uint64_t repack_bytes = 0;
  for (const TensorView* W : ws) repack_bytes += W->row_bytes * uint64_t(W->n);
  REQUIRE(repack_bytes > (32u << 20));

  const auto before = hashes(ws);  // every repackable matrix read: its pages are resident
  const uint64_t file0 = status_bytes("RssFile"), anon0 = status_bytes("RssAnon");
  CpuQ4Executor packed(model, CpuExecutorOptions{.n_threads = 2, .repack = true});
  if (!packed.repacked_weights()) {
    WARN("SKIPPED: TANDEM_CPU_REPACK turns the repack off");
    return;
  }
  const uint64_t file1 = status_bytes("RssFile"), anon1 = status_bytes("RssAnon");
  // A session's steps, which read the small tensors beside the released matrices, do not
  // bring the released pages back (the kernel's fault-around did, before release_pages gave
  // each range a mapping of its own).
  const auto logits_packed = logits_of(model, packed);
  const uint64_t file2 = status_bytes("RssFile");
  INFO("repackable " << repack_bytes << " B; file-backed resident " << file0 << " -> " << file1 << " -> " << file2
                     << " B after a step; anonymous " << anon0 << " -> " << anon1 << " B");
  // The file's pages of the originals left (all but a partial page at each end of each
  // matrix). Together: what stays plus the copies' excess over the originals (the K-quant
  // layouts are 1.22x and 1.07x their blocks, Q4_0/Q4_1/Q5_0 1x), not the file plus the
  // copies. (The anonymous growth alone is no measure of the copies: malloc may place them
  // in memory the load freed but kept resident.)
  CHECK(file1 + repack_bytes * 9 / 10 < file0);
  CHECK(file1 + anon1 < file0 + anon0 + repack_bytes * 3 / 10);
  CHECK(file2 + repack_bytes * 9 / 10 < file0);

  // The GGUF layout (reading the originals back from the file) gives the same logits, and
  // the originals' bytes are unchanged.
  CpuQ4Executor plain(model, CpuExecutorOptions{.n_threads = 2, .repack = false});
  CHECK(test::same_bits(logits_of(model, plain), logits_packed));
  CHECK(hashes(ws) == before);
}

TEST_CASE("weights a Model converted live on its heap and keep their bytes when an executor repacks them",
          "[memory][repack]") {
  const auto path = test::smollm2_q4_1_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " missing (scripts/fetch-smollm2)");
    return;
  }
  ModelOptions mo;
  mo.convert_to = GgmlType::kQ4_0;  // every Q4_1 weight becomes Q4_0 on the Model's heap
  const auto model = Model::load(path, mo);
  REQUIRE(model->converted_tensors() > 0);
  const auto ws = repackable(*model);
  REQUIRE(!ws.empty());
  const auto before = hashes(ws);
  CpuQ4Executor plain(model, CpuExecutorOptions{.n_threads = 2, .repack = false});
  const auto logits_plain = logits_of(model, plain);
  CpuQ4Executor packed(model, CpuExecutorOptions{.n_threads = 2, .repack = true});
  // Had the repack dropped these pages, they would read as zeros now.
  CHECK(hashes(ws) == before);
  CHECK(test::same_bits(logits_of(model, plain), logits_plain));
  if (packed.repacked_weights()) CHECK(test::same_bits(logits_of(model, packed), logits_plain));
}
