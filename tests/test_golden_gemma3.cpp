// Gemma 3: the real 270M model against llama.cpp's goldens (shared/golden/README.md, Gemma 3
// section), its tokenizer goldens, and the interleaved sliding window (real model and a
// tiny random gemma3 written here, which always runs).
//
// Tandem loads the hub's Q4_K_M file and converts it to Q4_0 at load when asked
// (ModelOptions::convert_to, model.hpp), which is
// what llama.cpp's `llama-quantize --allow-requantize ... Q4_0` makes; the goldens used are
// those of that Q4_0 conversion (`gemma-3-270m-q4_0/`): the last test proves the converted
// bytes are that file's (its SHA-256). Prompts are token ids (cases.json).
// CPU executors here; the GPU executor against the same goldens: tests/gpu/test_gpu_gemma3.cpp.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>

#include "executor_factories.hpp"
#include "gemma3_test_support.hpp"
#include "kv_test_support.hpp"
#include "sha256.hpp"
#include "tandem/model/requantize.hpp"
#include "tandem/session/session.hpp"
#include "tandem/template/chat_template.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizer = true;
#else
constexpr bool kSanitizer = false;
#endif

// Tolerance on |logit - reference| as a fraction of the case's max |logit|. llama.cpp's own
// AVX2 and AVX-512 builds differ by up to 4.2e-2 x max|logit| on this Q4_0 conversion
// (golden README: Gemma 3 amplifies activation rounding); that spread is the tolerance.
// Measured here (both CPU executors, same bits): worst 2.54e-2 (`text_capital`), 3.73e-2
// (`code_sort`), 3.49e-2 (`long_lighthouse`); the one-token rows 0 are at 5.7e-3 to 7.5e-3
// (not bit-identical to llama.cpp, unlike SmolLM2's). Teacher-forced argmax equals the
// golden at 63, 62 and 62 of 64 steps; every step with a margin above the tolerance
// (45, 42, 32) is required.
constexpr double kTolerance = 4.2e-2;

// Tandem's default load of the hub file (every weight as it is: Q5_0, Q4_K, Q6_K, Q8_0,
// model.hpp) against llama.cpp running the hub file itself: the same weight bytes, but
// llama.cpp's activations for Q4_K / Q6_K are Q8_K (Tandem's are Q8_0) and its sums run in
// its own orders, so the bound is the issue's, llama.cpp's own build-to-build spread on this
// file (its AVX2 and AVX-512 builds differ by up to 1.1e-1 x max|logit|,
// shared/golden/README.md). Measured here (both CPU executors): 5.99e-2 (`text_capital`),
// 5.54e-2 (`code_sort`), 5.81e-2 (`long_lighthouse`); argmax = golden at 62, 64 and 63 of
// 64 teacher-forced steps. (With Q4_K / Q6_K converted to Q8_0: 6.02e-2, 5.41e-2, 5.60e-2;
// with every Q5_0 weight converted to Q8_0 as well: 5.76e-2, 5.44e-2, 5.88e-2.)
constexpr double kHubTolerance = 1.1e-1;

std::shared_ptr<const Model> gemma3_model() {
  static const auto model = [] {
    ModelOptions mo;
    mo.n_threads = 2;
    mo.convert_to = GgmlType::kQ4_0;                     // the goldens' conversion (the default is Q8_0)
    return Model::load(test::gemma3_q4_k_m_path(), mo);  // converted once for every test
  }();
  return model;
}

std::vector<test::ExecutorFactory> cpu_factories() {
  auto f = test::executor_factories();
  std::erase_if(f, [](const test::ExecutorFactory& e) { return e.name.rfind("cpu", 0) != 0; });
  return f;
}

// Every case of the golden directory `dir`, every CPU executor: logits at the listed rows
// within `tolerance` x max|logit|, and teacher-forced greedy equal wherever the reference
// margin exceeds it.
void check_goldens(const std::shared_ptr<const Model>& model, const std::filesystem::path& dir, double tolerance) {
  const auto golden = test::read_json(dir / "cases.json");
  const int32_t n_vocab = model->hparams().n_vocab;
  REQUIRE(n_vocab == 262144);

  auto factories = cpu_factories();
  if (kSanitizer) factories.resize(1);
  for (const auto& factory : factories) {
    auto exec = factory.make(model);
    for (const auto& c : golden["cases"]) {
      const std::string name = c["name"];
      if (kSanitizer && name != "text_capital") continue;
      INFO(factory.name << " / " << name);
      const auto ids = c["prompt_ids"].get<std::vector<int32_t>>();
      const auto rows = c["logits_rows"].get<std::vector<size_t>>();
      const auto ref = test::read_f32(dir / c["logits_file"].get<std::string>());
      REQUIRE(ref.size() == rows.size() * size_t(n_vocab));
      const double max_abs = c["logits_max_abs"];
      const double tol = tolerance * max_abs;

      SessionOptions so;
      so.n_ctx = 512;
      Session session(model, *exec, so);
      std::vector<float> logits(ids.size() * size_t(n_vocab));
      session.eval(ids, logits);
      double max_diff = 0.0;
      for (size_t j = 0; j < rows.size(); ++j) {
        const float* mine = logits.data() + rows[j] * size_t(n_vocab);
        const float* theirs = ref.data() + j * size_t(n_vocab);
        double row_diff = 0.0;
        for (int32_t v = 0; v < n_vocab; ++v) row_diff = std::max(row_diff, double(std::fabs(mine[v] - theirs[v])));
        UNSCOPED_INFO(name << " row " << rows[j] << ": max |diff| / max|logit| = " << row_diff / max_abs);
        max_diff = std::max(max_diff, row_diff);
      }
      INFO("max |diff| = " << max_diff << " = " << max_diff / max_abs << " x max|logit|");
      CHECK(max_diff <= tol);

      const auto greedy = c["greedy_ids"].get<std::vector<int32_t>>();
      const auto margin = c["greedy_top1_margin"].get<std::vector<double>>();
      int checked = 0, agreed = 0;
      for (size_t step = 0; step < greedy.size(); ++step) {
        const bool same = test::argmax(session.logits()) == greedy[step];
        agreed += same ? 1 : 0;
        if (margin[step] > tol) {
          INFO("teacher-forced step " << step << " margin " << margin[step]);
          CHECK(same);
          ++checked;
        }
        const int32_t next = greedy[step];
        session.eval(std::span<const int32_t>(&next, 1));
      }
      WARN(factory.name << " / " << name << ": max |diff| = " << max_diff / max_abs
                        << " x max|logit|; argmax = golden at " << agreed << " of " << greedy.size()
                        << " teacher-forced steps; " << checked
                        << " steps have a margin above the tolerance and were required");
      CHECK(checked > 0);
    }
  }
}

}  // namespace

TEST_CASE("Gemma 3 270M: hyper-parameters as llama.cpp reads them", "[golden][gemma3]") {
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  const auto model = gemma3_model();
  const HParams& hp = model->hparams();
  CHECK(hp.arch == Arch::kGemma3);
  CHECK(hp.n_layer == 18);
  CHECK(hp.n_embd == 640);
  CHECK(hp.n_head == 4);
  CHECK(hp.n_head_kv == 1);
  CHECK(hp.head_dim == 256);
  CHECK(hp.n_ff == 2048);
  CHECK(hp.n_vocab == 262144);
  CHECK(hp.n_swa == 512);
  CHECK(hp.q_scale == 1.0f / 16.0f);
  CHECK(hp.embd_scale == std::sqrt(640.0f));
  CHECK(hp.rope_freq_base == 1000000.0f);
  CHECK(hp.rope_freq_base_swa == 10000.0f);
  CHECK(hp.final_logit_softcap == 0.0f);
  CHECK(hp.tied_output);
  for (int32_t il = 0; il < hp.n_layer; ++il) CHECK(hp.is_swa_layer(il) == (il % 6 < 5));
  // Q4_K / Q5_0 / Q6_K weights converted to Q4_0; token_embd (the tied output) Q8_0 as it was.
  CHECK(model->converted_tensors() > 0);
  CHECK(model->token_embd().type == GgmlType::kQ8_0);
  for (const LayerWeights& L : model->layers())
    for (const TensorView* W : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down})
      CHECK(W->type == GgmlType::kQ4_0);
}

TEST_CASE("Gemma 3 270M logits and teacher-forced greedy match llama.cpp (Q4_0 conversion)",
          "[golden][gemma3][parity]") {
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  check_goldens(gemma3_model(), test::golden_dir() / "gemma-3-270m-q4_0", kTolerance);
}

TEST_CASE("Gemma 3 270M as loaded by default against llama.cpp on the hub's Q4_K_M", "[golden][gemma3][parity]") {
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  if (kSanitizer) return;  // CI time
  ModelOptions mo;
  mo.n_threads = 2;
  const auto model = Model::load(path, mo);
  CHECK(model->token_embd().type == GgmlType::kQ8_0);
  // Every weight (Q5_0, Q8_0, Q4_K, Q6_K) runs as the file has it: nothing is converted.
  CHECK(model->converted_tensors() == 0);
  int k_quants = 0;
  for (const LayerWeights& L : model->layers()) {
    for (const TensorView* W : {&L.wq, &L.wk, &L.wv, &L.wo, &L.ffn_gate, &L.ffn_up, &L.ffn_down}) {
      CHECK(W->type == W->info->type);
      k_quants += W->type == GgmlType::kQ4_K || W->type == GgmlType::kQ6_K ? 1 : 0;
    }
  }
  CHECK(k_quants == 36);  // 27 Q4_K and 9 Q6_K matrices
  check_goldens(model, test::golden_dir() / "gemma-3-270m-q4_k_m", kHubTolerance);
}

TEST_CASE("Gemma 3 270M tokenizer matches llama.cpp", "[golden][gemma3][tokenizer]") {
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  const Tokenizer& tok = gemma3_model()->tokenizer();
  CHECK(tok.n_vocab() == 262144);
  CHECK(tok.add_bos());
  CHECK(tok.bos() == 2);
  CHECK(tok.eos() == 1);
  const auto j = test::read_json(test::golden_dir() / "tokenizer-gemma3" / "gemma-3-270m-q4_0.json");
  REQUIRE(j["cases"].size() >= 8);
  for (const auto& c : j["cases"]) {
    const std::string text = c["text"];
    INFO("text: " << text);
    CHECK(tok.tokenize(text, true, false) == c["ids"].get<std::vector<int32_t>>());
    CHECK(tok.tokenize(text, true, true) == c["ids_parse_special"].get<std::vector<int32_t>>());
  }
  // The prompts of the logits goldens.
  const auto golden = test::read_json(test::golden_dir() / "gemma-3-270m-q4_0" / "cases.json");
  for (const auto& c : golden["cases"]) {
    INFO(c["name"].get<std::string>());
    CHECK(tok.tokenize(c["prompt_text"].get<std::string>(), true, false) ==
          c["prompt_ids"].get<std::vector<int32_t>>());
  }
}

namespace {

// Logits of every row of `ids`, fed in steps of n_batch prompt tokens (n_batch 1: one token
// per executor step, as decoding does).
std::vector<float> run_rows(const std::shared_ptr<const Model>& model, Executor& exec, std::span<const int32_t> ids,
                            int32_t n_batch, int32_t page_size = 16) {
  const size_t nv = size_t(model->hparams().n_vocab);
  SessionOptions so;
  so.n_ctx = int32_t(ids.size()) + 16;
  so.n_batch = n_batch;
  so.page_size = page_size;
  Session s(model, exec, so);
  std::vector<float> out(ids.size() * nv);
  if (n_batch == 1) {
    for (size_t i = 0; i < ids.size(); ++i) s.eval(ids.subspan(i, 1), std::span<float>(out).subspan(i * nv, nv));
  } else {
    s.eval(ids, out);
  }
  return out;
}

}  // namespace

TEST_CASE("gemma3 sliding window (tiny model): one-shot, chunked and one-token steps give the same bits",
          "[gemma3][swa]") {
  test::TinyGemma3 spec;  // window 8 on layers 0..4
  const auto model = Model::load(test::write_tiny_gemma3(spec, "swa8"));
  REQUIRE(model->hparams().n_swa == 8);
  test::TinyGemma3 wide = spec;
  wide.sliding_window = 4096;  // longer than the prompt: every layer sees everything
  const auto model_wide = Model::load(test::write_tiny_gemma3(wide, "swa4096"));
  std::vector<int32_t> ids{2};
  for (int i = 0; i < 45; ++i) ids.push_back(4 + (i * 17 + 5) % 60);
  const size_t nv = size_t(model->hparams().n_vocab);
  for (const auto& factory : cpu_factories()) {
    INFO(factory.name);
    auto exec = factory.make(model);
    const auto one_shot = run_rows(model, *exec, ids, 512);
    CHECK(test::same_bits(one_shot, run_rows(model, *exec, ids, 5)));     // chunks across window edges
    CHECK(test::same_bits(one_shot, run_rows(model, *exec, ids, 1)));     // decode steps
    CHECK(test::same_bits(one_shot, run_rows(model, *exec, ids, 7, 4)));  // other pages
    CHECK(test::same_bits(one_shot, run_rows(model, *exec, ids, 64, 32)));
    // The window is what it says: rows 0..7 see their whole past either way (same bits as
    // the wide window), later rows see only the last 8 positions on the sliding layers.
    auto exec_wide = factory.make(model_wide);
    const auto wide_rows = run_rows(model_wide, *exec_wide, ids, 512);
    const std::span<const float> a(one_shot), b(wide_rows);
    CHECK(test::same_bits(a.subspan(0, 8 * nv), b.subspan(0, 8 * nv)));
    for (size_t r = 8; r < ids.size(); ++r) {
      INFO("row " << r);
      CHECK_FALSE(test::same_bits(a.subspan(r * nv, nv), b.subspan(r * nv, nv)));
    }
  }
}

TEST_CASE("gemma3 final-logit soft-capping: c * tanh(logits / c)", "[gemma3]") {
  test::TinyGemma3 spec;
  const auto plain = Model::load(test::write_tiny_gemma3(spec, "nocap"));
  spec.softcap = 0.05f;  // small enough to bend these logits
  const auto capped = Model::load(test::write_tiny_gemma3(spec, "cap"));
  CHECK(capped->hparams().final_logit_softcap == 0.05f);
  const std::vector<int32_t> ids{2, 10, 11, 12, 13};
  CpuQ4Executor e1(plain, CpuExecutorOptions{1}), e2(capped, CpuExecutorOptions{1});
  const auto a = run_rows(plain, e1, ids, 512);
  const auto b = run_rows(capped, e2, ids, 512);
  size_t bent = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float want = std::tanh(a[i] * (1.0f / 0.05f)) * 0.05f;
    REQUIRE(b[i] == want);
    bent += std::fabs(a[i]) > 0.06f ? 1 : 0;
  }
  CHECK(bent > 0);
}

TEST_CASE("gemma3 load refusals: a missing tensor is named", "[gemma3][model]") {
  for (const std::string missing :
       {"blk.3.post_ffw_norm.weight", "blk.0.post_attention_norm.weight", "blk.5.attn_k_norm.weight"}) {
    test::TinyGemma3 spec;
    spec.skip_tensor = missing;
    INFO(missing);
    try {
      Model::load(test::write_tiny_gemma3(spec, "missing"));
      FAIL("loaded without " << missing);
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kModelMissingTensor);
      CHECK(std::string(e.what()).find(missing) != std::string::npos);
    }
  }
}

TEST_CASE("Gemma 3 270M: a 650-token prompt across the 512 window, one-shot = chunked = decode steps",
          "[golden][gemma3][swa]") {
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  if (kSanitizer) return;  // CI time
  const auto model = gemma3_model();
  const auto golden = test::read_json(test::golden_dir() / "gemma-3-270m-q4_0" / "cases.json");
  std::vector<int32_t> ids{2};
  while (ids.size() < 650)
    for (const auto& c : golden["cases"])
      for (int32_t id : c["prompt_ids"].get<std::vector<int32_t>>())
        if (id != 2 && ids.size() < 650) ids.push_back(id);
  const std::span<const int32_t> prompt(ids);
  CpuQ4Executor exec(model, CpuExecutorOptions{2});
  const size_t nv = size_t(model->hparams().n_vocab);
  // One step for all 650; chunks of 97 (edges at 485, 582: across the window's 512 and
  // the tiles' 64); 500 in one step then one token at a time (the decode path across it).
  std::vector<std::vector<float>> last(3);
  {
    SessionOptions so;
    so.n_ctx = 700;
    so.n_batch = 1024;
    Session s(model, exec, so);
    s.eval(prompt);
    last[0].assign(s.logits().begin(), s.logits().end());
  }
  {
    SessionOptions so;
    so.n_ctx = 700;
    so.n_batch = 97;
    Session s(model, exec, so);
    s.eval(prompt);
    last[1].assign(s.logits().begin(), s.logits().end());
  }
  {
    SessionOptions so;
    so.n_ctx = 700;
    so.n_batch = 1024;
    Session s(model, exec, so);
    s.eval(prompt.subspan(0, 500));
    for (size_t i = 500; i < ids.size(); ++i) s.eval(prompt.subspan(i, 1));
    last[2].assign(s.logits().begin(), s.logits().end());
  }
  REQUIRE(last[0].size() == nv);
  CHECK(test::same_bits(last[0], last[1]));
  CHECK(test::same_bits(last[0], last[2]));
}

TEST_CASE("Gemma 3 270M: the Q4_0 conversion is llama.cpp's byte for byte (file SHA-256 of the goldens' model)",
          "[golden][gemma3][requantize]") {
  const auto src = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(src)) {
    WARN("SKIPPED: " << src << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  if (kSanitizer) return;  // CI time
  const auto golden = test::read_json(test::golden_dir() / "gemma-3-270m-q4_0" / "cases.json");
  const auto out = test::scratch_dir("requantize-gemma3") / "gemma3-q4_0.gguf";
  QuantizeFileOptions opt;
  opt.n_threads = 2;
  quantize_file(src, out, opt);
  std::vector<char> bytes(std::filesystem::file_size(out));
  {
    std::ifstream f(out, std::ios::binary);
    f.read(bytes.data(), std::streamsize(bytes.size()));
  }
  // tandem-quantize's file is llama-quantize's (metadata, tensor order, every block).
  CHECK(test::sha256_hex(bytes.data(), bytes.size()) == golden["model_sha256"].get<std::string>());
  bytes = {};
  // Model::load's conversion of the Q4_K_M file holds the same bytes as that file.
  const auto converted = gemma3_model();
  const auto file = Model::load(out);
  CHECK(file->converted_tensors() == 0);
  auto same = [](const TensorView& a, const TensorView& b) {
    return a.type == b.type && a.n == b.n && a.row_bytes == b.row_bytes &&
           std::memcmp(a.data, b.data, size_t(a.n) * a.row_bytes) == 0;
  };
  CHECK(same(converted->token_embd(), file->token_embd()));
  for (size_t il = 0; il < file->layers().size(); ++il) {
    const LayerWeights &A = converted->layers()[il], &B = file->layers()[il];
    INFO("layer " << il);
    CHECK(same(A.wq, B.wq));
    CHECK(same(A.wk, B.wk));
    CHECK(same(A.wv, B.wv));
    CHECK(same(A.wo, B.wo));
    CHECK(same(A.ffn_gate, B.ffn_gate));
    CHECK(same(A.ffn_up, B.ffn_up));
    CHECK(same(A.ffn_down, B.ffn_down));
  }
}

TEST_CASE("a gemma3 file without a chat template chats in Gemma's turn format, not ChatML", "[gemma3][chat]") {
  test::TinyGemma3 spec;  // written without tokenizer.chat_template, as the 270M base GGUF
  const auto model = Model::load(test::write_tiny_gemma3(spec, "notemplate"));
  REQUIRE(model->tokenizer().chat_template().empty());
  const ChatTemplate t = ChatTemplate::for_model(*model);
  CHECK(t.name() == "gemma");
  CHECK_FALSE(t.is_jinja());
  CHECK(t.fallback_reason().find("gemma3") != std::string::npos);
  const std::vector<ChatMessage> conv{{"user", "hi"}};
  CHECK(t.render(conv, true) == "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n");
}
