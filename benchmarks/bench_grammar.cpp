// Structured outputs: the per-token cost of a grammar (GrammarMatcher::fill_mask, the
// token mask over the whole vocabulary, plus accept) on SmolLM2-135M-Instruct's 49152-token
// byte-level BPE vocabulary, walking the tokens of a JSON document that fits the schema;
// and the one-time compile of a schema not yet cached.
//
// Needs $TANDEM_SMOLLM2 or ~/.cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf (only its
// tokenizer is read); skipped with an error message otherwise.
#include <benchmark/benchmark.h>

#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

#include "tandem/gguf/gguf.hpp"
#include "tandem/grammar/grammar.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

namespace {

const char* kSchema = R"({"type": "object",
  "properties": {"name": {"type": "string", "maxLength": 20},
                 "age": {"type": "integer", "minimum": 0, "maximum": 150},
                 "city": {"type": "string", "enum": ["Paris", "Berlin", "Rome"]},
                 "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4}},
  "required": ["name", "age", "city", "tags"], "additionalProperties": false})";
const char* kDocument = R"({"name": "Ava Smith", "age": 25, "city": "Berlin", "tags": ["art", "music", "travel"]})";

const tandem::Tokenizer* smollm2_tokenizer() {
  static const std::unique_ptr<tandem::Tokenizer> tok = []() -> std::unique_ptr<tandem::Tokenizer> {
    const char* env = std::getenv("TANDEM_SMOLLM2");
    const char* home = std::getenv("HOME");
    const std::filesystem::path p =
        env ? env : std::filesystem::path(home ? home : "") / ".cache/tandem/SmolLM2-135M-Instruct.Q4_1.gguf";
    if (!std::filesystem::exists(p)) return nullptr;
    return std::make_unique<tandem::Tokenizer>(tandem::Tokenizer::from_gguf(*tandem::GgufFile::open(p)));
  }();
  return tok.get();
}

/// The tokenizer, or null after marking the benchmark skipped (no model, no grammar engine).
const tandem::Tokenizer* smollm2(benchmark::State& state) {
  if (!tandem::Grammar::available()) {
    state.SkipWithError("built without xgrammar");
    return nullptr;
  }
  const tandem::Tokenizer* tok = smollm2_tokenizer();
  if (!tok) state.SkipWithError("SmolLM2 absent (TANDEM_SMOLLM2)");
  return tok;
}

void walk(benchmark::State& state, const std::shared_ptr<const tandem::Grammar>& g, const std::vector<int32_t>& ids) {
  tandem::GrammarMatcher m(g);
  for (auto _ : state) {
    m.reset();
    for (int32_t id : ids) {
      benchmark::DoNotOptimize(m.fill_mask().data());
      if (!m.accept(id)) {
        state.SkipWithError("the document does not fit the grammar");
        return;
      }
    }
  }
  state.SetItemsProcessed(int64_t(state.iterations()) * int64_t(ids.size()));  // items = tokens
  state.counters["tokens"] = double(ids.size());
}

void BM_GrammarMaskJsonSchema(benchmark::State& state) {
  const tandem::Tokenizer* tok = smollm2(state);
  if (!tok) return;
  walk(state, tandem::Grammar::from_json_schema(*tok, kSchema), tok->tokenize(kDocument, false, false));
}
BENCHMARK(BM_GrammarMaskJsonSchema)->Unit(benchmark::kMicrosecond);

void BM_GrammarMaskJsonObject(benchmark::State& state) {
  const tandem::Tokenizer* tok = smollm2(state);
  if (!tok) return;
  walk(state, tandem::Grammar::json_object(*tok), tok->tokenize(kDocument, false, false));
}
BENCHMARK(BM_GrammarMaskJsonObject)->Unit(benchmark::kMicrosecond);

// A schema not seen before each iteration (a fresh enum value, so a different grammar:
// xgrammar's cache would answer a mere textual change), so nothing is cached.
void BM_GrammarCompileSchema(benchmark::State& state) {
  const tandem::Tokenizer* tok = smollm2(state);
  if (!tok) return;
  static int n = 0;  // across repetitions too
  for (auto _ : state) {
    std::string schema = kSchema;
    schema.insert(schema.find("\"Rome\"") + 5, std::to_string(n++));
    benchmark::DoNotOptimize(tandem::Grammar::from_json_schema(*tok, schema));
  }
}
BENCHMARK(BM_GrammarCompileSchema)->Unit(benchmark::kMillisecond);

}  // namespace
