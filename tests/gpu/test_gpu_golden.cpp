// The GPU executor against the llama.cpp goldens (../shared/golden, as tests/test_golden.cpp
// does for every executor when a device is visible): prompt logits within the GPU
// tolerance of gpu_test_support.hpp, and teacher-forced greedy steps by the margin rule.
// Under emulation the real tiny models run in every pass, a synthetic one once ([heavy]).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>

#include "gpu_test_support.hpp"
#include "kv_test_support.hpp"

using namespace tandem;

namespace {

[[maybe_unused]] void check_golden(const std::string& dir) {
#if TANDEM_HAVE_CUDA
  const double rel_tol = dir.ends_with("-f32") ? test::kLogitTolF32 : test::kLogitTolQ4;
  const auto cases = test::read_json(test::golden_dir() / dir / "cases.json");
  auto model = Model::load(test::model_path(dir));
  GpuQ4Executor gpu(model);
  const int32_t n_vocab = model->hparams().n_vocab;
  for (const auto& c : cases["cases"]) {
    const std::string name = c["name"];
    INFO("gpu / " << dir << " / " << name);
    const auto ids = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto ref = test::read_f32(test::golden_dir() / dir / c["logits_file"].get<std::string>());
    REQUIRE(ref.size() == ids.size() * size_t(n_vocab));
    const double tol = rel_tol * double(c["logits_max_abs"]);
    SessionOptions so;
    so.n_ctx = 256;
    so.kv_store = test::gpu_kv_store(gpu, 17);
    so.kv_tier = KvTier::kDevice;
    Session session(model, gpu, so);
    std::vector<float> logits(ref.size());
    session.eval(ids, logits);
    double max_diff = 0.0;
    for (size_t i = 0; i < ref.size(); ++i) max_diff = std::max(max_diff, double(std::fabs(logits[i] - ref[i])));
    INFO("max |diff| = " << max_diff << " = " << max_diff / double(c["logits_max_abs"]) << " x max|logit|");
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
      session.eval(std::span<const int32_t>(&greedy[step], 1));
    }
    CHECK(checked > 0);
  }
#else
  (void)dir;
#endif
}

}  // namespace

TEST_CASE("GPU executor matches the llama.cpp goldens on the tiny models", "[gpu][golden][parity]") {
  check_golden(GENERATE(as<std::string>{}, "aidreams260K-f32", "stories260K-q4_0"));
}

TEST_CASE("GPU executor matches the llama.cpp goldens on a synthetic Qwen2 model", "[gpu][golden][parity][heavy]") {
  check_golden("synth-qwen2-small-q4_0");
}
