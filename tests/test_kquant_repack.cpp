// The repacked K-quant layouts (BlockQ4_Kx8, BlockQ6_Kx8) inside the CPU executor: Gemma 3
// 270M's Q4_K_M file, run in its own types (Q4_K, Q6_K, Q5_0, Q8_0), gives the same logit
// bytes with the weights repacked as without, on each ISA compared (the kernel-level tests
// in test_cpu_kernels.cpp check every layout against the GGUF-layout kernels; this checks
// the executor hands each matrix to the kernel of its type). SKIPPED when the file is absent.
#include <catch2/catch.hpp>

#include <filesystem>
#include <string>
#include <vector>

#include "cpu_test_support.hpp"
#include "kv_test_support.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;

TEST_CASE("Gemma 3 Q4_K_M: repacked K-quant weights give the GGUF layout's logits bit for bit",
          "[executor][isa][gemma3]") {
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  const auto model = Model::load(path);  // the file's own types (no conversion asked)
  const auto ids = test::prompt_ids(40, model->hparams().n_vocab);
  // A 37-token prefill (the prefill tiles), then three one-token steps (the GEMV path).
  auto run = [&](bool repack) {
    CpuQ4Executor exec(model, CpuExecutorOptions{.n_threads = 2, .repack = repack});
    CHECK(exec.repacked_weights() == repack);
    SessionOptions so;
    so.n_ctx = 64;
    Session s(model, exec, so);
    std::vector<float> all;
    s.eval(std::span(ids.data(), 37));
    all.assign(s.logits().begin(), s.logits().end());
    for (size_t i = 37; i < ids.size(); ++i) {
      s.eval(std::span(ids.data() + i, 1));
      all.insert(all.end(), s.logits().begin(), s.logits().end());
    }
    return all;
  };
  int compared = 0;
  for (const char* isa : {"avx512vnni", "avx512", "avx2"}) {
    if (!kernels::cpu_isa_supported(isa)) continue;
    test::IsaScope scope(isa);
    const auto packed = run(true), plain = run(false);
    INFO(isa);
    REQUIRE(packed.size() == 4 * size_t(model->hparams().n_vocab));
    CHECK(test::same_bits(packed, plain));
    ++compared;
  }
  if (compared == 0)
    WARN("SKIPPED: this CPU runs none of avx512vnni, avx512, avx2 (the scalar path: test_cpu_kernels)");
}
