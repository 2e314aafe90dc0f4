// Golden tests on a real model: SmolLM2-135M-Instruct, the Q4_0 file llama.cpp's
// quantizer makes from the PyPI wheel's Q4_1 file (shared/golden/README.md, SmolLM2
// section). Tandem loads the Q4_1 file and, asked to (ModelOptions::convert_to), converts it to Q4_0 at load;
// test_requantize.cpp proves those bytes equal llama.cpp's Q4_0 file tensor for tensor, so the goldens apply. Every
// case, every executor of the parity suite: logits at the listed rows within the tolerance, and teacher-forced greedy
// equal wherever the reference margin exceeds it.
//
// Prompts are token ids (cases.json), so no tokenizer or chat template is involved.
// Under AddressSanitizer only the shortest case on one executor runs (CI time).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "executor_factories.hpp"
#include "kv_test_support.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

#if defined(__SANITIZE_ADDRESS__)
constexpr bool kSanitizer = true;
#else
constexpr bool kSanitizer = false;
#endif

// Tolerance on |logit - reference| as a fraction of the case's max |logit|, measured: the
// largest difference over all cases and rows is 4.31e-2 (`chat_system` row 19; the
// others 2.6e-2 to 3.6e-2; the same on 1 and 2 threads). That is above the 2e-2 guide,
// and the evidence says it is rounding flips, not a formula difference: every row
// without a flip is bit-identical to llama.cpp (row 0 of `chat_capital`, `chat_system`,
// rows 0 and 1 of `long`, RoPE and two-position attention included), while a single
// flipped rounding (e.g. one Q8_0 rounding of an activation, README "What agreement to
// expect") moves row 0 of `text_story` by 6e-3 and propagates through 30 layers and the
// KV cache (the aidreams/stories goldens have 4-5 layers). 5e-2 covers the measurement;
// the teacher-forced argmax is checked at every step whose margin exceeds it (29 to 45
// of the 64 steps per case).
constexpr double kTolerance = 5e-2;

}  // namespace

TEST_CASE("SmolLM2-135M-Instruct logits and teacher-forced greedy match llama.cpp", "[golden][smollm2][parity]") {
  const auto path = test::smollm2_q4_1_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-smollm2 downloads it)");
    return;
  }
  const auto dir = test::golden_dir() / "smollm2-135m-instruct-q4_0";
  const auto golden = test::read_json(dir / "cases.json");
  ModelOptions mo;
  mo.n_threads = 2;
  mo.convert_to = GgmlType::kQ4_0;                  // the goldens' conversion (the default is Q8_0)
  static const auto model = Model::load(path, mo);  // converted once for every executor
  const int32_t n_vocab = model->hparams().n_vocab;
  REQUIRE(n_vocab == 49152);

  auto factories = test::executor_factories();
  if (kSanitizer) factories.resize(1);
  for (const auto& factory : factories) {
    auto exec = factory.make(model);
    for (const auto& c : golden["cases"]) {
      const std::string name = c["name"];
      if (kSanitizer && name != "text_story") continue;
      INFO(factory.name << " / " << name);
      const auto ids = c["prompt_ids"].get<std::vector<int32_t>>();
      const auto rows = c["logits_rows"].get<std::vector<size_t>>();
      const auto ref = test::read_f32(dir / c["logits_file"].get<std::string>());
      REQUIRE(ref.size() == rows.size() * size_t(n_vocab));
      const double max_abs = c["logits_max_abs"];
      const double tol = kTolerance * max_abs;

      SessionOptions so;
      so.n_ctx = 512;
      Session session(model, *exec, so);
      std::vector<float> logits(ids.size() * size_t(n_vocab));
      session.eval(ids, logits);
      double max_diff = 0.0;
      for (size_t j = 0; j < rows.size(); ++j) {
        const float* mine = logits.data() + rows[j] * size_t(n_vocab);
        const float* theirs = ref.data() + j * size_t(n_vocab);
        for (int32_t v = 0; v < n_vocab; ++v) max_diff = std::max(max_diff, double(std::fabs(mine[v] - theirs[v])));
      }
      INFO("max |diff| = " << max_diff << " = " << max_diff / max_abs << " x max|logit|");
      CHECK(max_diff <= tol);

      const auto greedy = c["greedy_ids"].get<std::vector<int32_t>>();
      const auto margin = c["greedy_top1_margin"].get<std::vector<double>>();
      int checked = 0;
      for (size_t step = 0; step < greedy.size(); ++step) {
        if (margin[step] > tol) {
          INFO("teacher-forced step " << step << " margin " << margin[step]);
          CHECK(test::argmax(session.logits()) == greedy[step]);
          ++checked;
        }
        const int32_t next = greedy[step];
        session.eval(std::span<const int32_t>(&next, 1));
      }
      CHECK(checked > 0);
    }
  }
}
