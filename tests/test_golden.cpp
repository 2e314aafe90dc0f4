// Golden tests: logits and greedy continuations against llama.cpp on the same GGUF files
// (../shared/golden, see its README "What agreement to expect"), for every executor.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "executor_factories.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

struct GoldenModel {
  std::string dir;
  double tol;  // max |diff| allowed, as a fraction of max |logit| of the case
};

// Guide from the issue: 5e-3 for F32, 2e-2 for Q4_0; tightened where measured lower
// (see the per-model comments).
const std::vector<GoldenModel> kModels = {
    {"aidreams260K-f32", 2e-4},  // measured 6.7e-5 (README: 4e-5..3e-4 vs exact math)
    {"stories260K-f32", 1e-3},   // measured 6.4e-4 on `long` (README: llama.cpp vs f64 4.3e-3)
    {"aidreams260K-q4_0", 2e-2},
    {"stories260K-q4_0", 2e-2},
    {"synth-llama-small-q4_0", 2e-2},
    {"synth-qwen2-small-q4_0", 2e-2},
    {"synth-qwen3-small-q4_0", 2e-2},
    // measured 2.09e-2 on `long` (AVX-512 host): one Q8_0 activation rounding flip carried
    // by the KV cache; Tandem's own AVX-512 and scalar paths differ by 2.1e-2 on these
    // synthetic models (golden README, issue 11), so 2.5e-2.
    {"synth-qwen3-hd64-small-q4_0", 2.5e-2},
};

int32_t argmax(const float* x, int64_t n) {
  return static_cast<int32_t>(std::max_element(x, x + n) - x);  // first maximum: lowest id on ties
}

}  // namespace

TEST_CASE("golden logits and greedy continuations match llama.cpp", "[golden][parity]") {
  const auto exec_name = GENERATE(from_range(test::executor_names()));
  const auto gm = GENERATE(from_range(kModels));
  const auto cases = test::read_json(test::golden_dir() / gm.dir / "cases.json");
  auto model = Model::load(test::model_path(gm.dir));
  auto exec = test::make_executor(exec_name, model);
  const int32_t n_vocab = model->hparams().n_vocab;

  for (const auto& c : cases["cases"]) {
    const std::string name = c["name"];
    INFO(exec_name << " / " << gm.dir << " / " << name);
    const auto ids = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto ref = test::read_f32(test::golden_dir() / gm.dir / c["logits_file"].get<std::string>());
    REQUIRE(ref.size() == ids.size() * size_t(n_vocab));
    const double max_abs = c["logits_max_abs"];
    const double tol = gm.tol * max_abs;

    Session session(model, *exec);
    std::vector<float> logits(ref.size());
    session.eval(ids, logits);
    double max_diff = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) max_diff = std::max(max_diff, double(std::fabs(logits[i] - ref[i])));
    INFO("max |diff| = " << max_diff << " = " << max_diff / max_abs << " x max|logit|");
    CHECK(max_diff <= tol);

    // Teacher forcing: feed the reference tokens; our argmax must equal the reference
    // wherever the reference's top-1 margin exceeds the tolerance.
    const auto greedy = c["greedy_ids"].get<std::vector<int32_t>>();
    const auto margin = c["greedy_top1_margin"].get<std::vector<double>>();
    int checked = 0;
    for (size_t step = 0; step < greedy.size(); ++step) {
      const auto l = session.logits();
      if (margin[step] > tol) {
        INFO("teacher-forced step " << step << " margin " << margin[step]);
        CHECK(argmax(l.data(), n_vocab) == greedy[step]);
        ++checked;
      }
      const int32_t next = greedy[step];
      session.eval(std::span<const int32_t>(&next, 1));
    }
    CHECK(checked > 0);

    // Free running: greedy generation reproduces the reference up to the first step whose
    // margin is within the tolerance (after it the two may legitimately part).
    size_t clear = 0;
    while (clear < greedy.size() && margin[clear] > tol) ++clear;
    Session free_run(model, *exec);
    GenerateOptions go;
    go.max_tokens = static_cast<int32_t>(greedy.size());
    go.sampling = SamplingParams::greedy();
    go.ignore_eos = true;
    const auto r = free_run.generate(std::span<const int32_t>(ids), go);
    REQUIRE(r.tokens.size() == greedy.size());
    INFO("all margins clear for the first " << clear << " steps");
    CHECK(std::equal(greedy.begin(), greedy.begin() + std::ptrdiff_t(clear), r.tokens.begin()));
  }
}
