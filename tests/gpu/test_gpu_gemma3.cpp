// Gemma 3 on the GPU executor: the GEGLU kernel against the CPU's arithmetic, a tiny random
// gemma3 (tests/gemma3_test_support.hpp: F32 weights, window 8) against the CPU executor over
// prompts far longer than its window (every attention path: tiled prefill, per-head, split
// decode across partitions wholly before the window), soft-capping, and the real 270M file
// against the CPU and llama.cpp's goldens ([heavy]: over 30 minutes under cuemu on a loaded
// 2-core host).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "gemma3_test_support.hpp"
#include "gpu_test_support.hpp"
#include "hooks/gpu_hooks.hpp"
#include "kv_test_support.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;
namespace k = tandem::kernels;

namespace {

#if TANDEM_HAVE_CUDA
// Every row's logits of `ids` fed to `exec` in steps of the given lengths (the remainder in
// one last step), on a Device store for a GPU executor, a Host store otherwise.
std::vector<float> rows_in_steps(Executor& exec, GpuQ4Executor* gpu, std::span<const int32_t> ids,
                                 const std::vector<int32_t>& steps, KvDtype dtype = KvDtype::kF16) {
  const HParams& hp = exec.model().hparams();
  const size_t nv = size_t(hp.n_vocab);
  const int32_t n = static_cast<int32_t>(ids.size());
  // One sequence's pages by the node's rule (a page per layer group: the windowed and the
  // global layers apart).
  const auto pages = int32_t(KvLayout::for_model(hp, 16, dtype).sequence_pages(n, n));
  auto store = gpu ? test::gpu_kv_store(*gpu, pages, 0, 16, dtype) : test::make_store(hp, pages, 0, 16, dtype);
  KvSequence seq(*store, n, gpu ? KvTier::kDevice : KvTier::kHost);
  std::vector<float> out(size_t(n) * nv, std::numeric_limits<float>::quiet_NaN());
  int32_t pos = 0;
  for (size_t i = 0; pos < n; ++i) {
    const int32_t len = i < steps.size() ? std::min(steps[i], n - pos) : n - pos;
    SequenceStep s{&seq, ids.subspan(size_t(pos), size_t(len)), pos, LogitsRows::kAll};
    exec.step(std::span<const SequenceStep>(&s, 1), std::span<float>(out).subspan(size_t(pos) * nv, size_t(len) * nv));
    pos += len;
  }
  return out;
}

// Largest row_ratio over rows [r0, r1) of two [rows][nv] arrays.
double worst_rows(std::span<const float> a, std::span<const float> b, size_t nv, size_t r0, size_t r1) {
  double worst = 0.0;
  for (size_t r = r0; r < r1; ++r)
    worst = std::max(worst, test::row_ratio(a.subspan(r * nv, nv), b.subspan(r * nv, nv)));
  return worst;
}

// Smallest row_ratio over rows [r0, r1): how far apart the closest rows are.
double least_rows(std::span<const float> a, std::span<const float> b, size_t nv, size_t r0, size_t r1) {
  double least = std::numeric_limits<double>::infinity();
  for (size_t r = r0; r < r1; ++r)
    least = std::min(least, test::row_ratio(a.subspan(r * nv, nv), b.subspan(r * nv, nv)));
  return least;
}
#endif

}  // namespace

TEST_CASE("GPU GEGLU gives the CPU's bits (f16 GELU table), fused with Q8_0 or not", "[gpu][kernels][gemma3]") {
#if TANDEM_HAVE_CUDA
  std::mt19937 g(25);
  std::normal_distribution<float> nd(0.0f, 4.0f);
  const uint16_t* table = k::gelu_f16_table();
  for (const int64_t n : {int64_t{32}, int64_t{32 * 37}, int64_t{3 * 2048}}) {
    INFO("n " << n);
    std::vector<float> gate(static_cast<size_t>(n)), up(static_cast<size_t>(n));
    for (float& v : gate) v = nd(g);
    for (float& v : up) v = nd(g);
    // The table's edges: at and beyond +-10, and the largest f16 below 10.
    const float edges[] = {-10.0f, 10.0f, -10.5f, 12.0f, 9.9921875f, -9.9921875f, 0.0f, -0.0f};
    std::copy(std::begin(edges), std::end(edges), gate.begin());
    std::vector<float> h_sep(static_cast<size_t>(n)), h_fused(static_cast<size_t>(n));
    std::vector<k::BlockQ8_0> b_sep(size_t(n / 32)), b_fused(b_sep.size());
    gpu_testing::geglu_q8_0(gate.data(), up.data(), n, false, h_sep.data(), b_sep.data());
    gpu_testing::geglu_q8_0(gate.data(), up.data(), n, true, h_fused.data(), b_fused.data());
    // The CPU's rule (cpu_q4_executor.cpp geglu): 0 at or below -10, gate * up at or above
    // 10, else the table's value at f16(gate) times up.
    std::vector<float> want(static_cast<size_t>(n));
    for (size_t i = 0; i < want.size(); ++i) {
      const float x = gate[i];
      want[i] = x <= -10.0f ? 0.0f : x >= 10.0f ? x * up[i] : k::fp16_to_fp32(table[k::fp32_to_fp16(x)]) * up[i];
    }
    CHECK(test::same_bits(want, h_sep));
    CHECK(test::same_bits(h_sep, h_fused));
    CHECK(std::memcmp(b_sep.data(), b_fused.data(), b_sep.size() * sizeof(k::BlockQ8_0)) == 0);
    std::vector<k::BlockQ8_0> b_cpu(b_sep.size());
    k::quantize_row_q8_0(want.data(), b_cpu.data(), n);
    CHECK(std::memcmp(b_cpu.data(), b_fused.data(), b_cpu.size() * sizeof(k::BlockQ8_0)) == 0);
  }
#endif
}

TEST_CASE("GPU gemma3 (tiny, window 8) agrees with the CPU over 280 positions, every attention path",
          "[gpu][parity][gemma3][swa]") {
#if TANDEM_HAVE_CUDA
  test::TinyGemma3 spec;  // window 8 on layers 0..4, full attention on layer 5
  const auto model = Model::load(test::write_tiny_gemma3(spec, "gpu-swa8"));
  REQUIRE(model->hparams().n_swa == 8);
  test::TinyGemma3 wide = spec;
  wide.sliding_window = 4096;  // the same weights, every layer sees everything
  const auto model_wide = Model::load(test::write_tiny_gemma3(wide, "gpu-swa4096"));
  const size_t nv = size_t(model->hparams().n_vocab);
  const auto ids = test::prompt_ids(280, model->hparams().n_vocab);
  // 130 at once (prefill tiles across window edges), a chunk of 5, decode 135..149, a chunk
  // of 110, then decode 260..279: the split kernels' partitions of 128 positions, the
  // first ones wholly before the window from position 263 on.
  std::vector<int32_t> steps{130, 5};
  for (int i = 0; i < 15; ++i) steps.push_back(1);
  steps.push_back(110);
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  CpuQ4Executor cpu_wide(model_wide, CpuExecutorOptions{2});
  struct Variant {
    const char* name;
    GpuExecutorOptions opts;
  };
  std::vector<Variant> variants(3);
  variants[0].name = "default (tiled prefill, split decode, fused kernels)";
  variants[1].name = "per-head prefill attention(), no fused kernels";
  variants[1].opts.flash_prefill = false;
  variants[1].opts.fused_kernels = false;
  variants[2].name = "no merged matmuls, no CUDA graphs";
  variants[2].opts.merge_matmuls = false;
  variants[2].opts.cuda_graphs = false;
  // The GPU runs the written arithmetic (docs/arithmetic.md): the same bytes as the CPU on
  // every path, f32 and f16 KV.
  for (const KvDtype dtype : {KvDtype::kF32, KvDtype::kF16}) {
    INFO(kv_dtype_name(dtype) << " KV");
    const auto ref = rows_in_steps(cpu, nullptr, ids, steps, dtype);
    // The window changes every row past it: a GPU ignoring it would fail below.
    const auto ref_wide = rows_in_steps(cpu_wide, nullptr, ids, steps, dtype);
    const double window_effect = least_rows(ref, ref_wide, nv, 8, ids.size());
    INFO("least |windowed - full| / max|logit| over rows 8.. = " << window_effect);
    CHECK(window_effect > 1e-3);
    for (auto& v : variants) {
      INFO(v.name);
      GpuQ4Executor gpu(model, v.opts);
      const auto got = rows_in_steps(gpu, &gpu, ids, steps, dtype);
      INFO("worst |gpu - cpu| / max|logit| = " << worst_rows(ref, got, nv, 0, ids.size()));
      CHECK(test::same_bits(ref, got));
    }
  }
#endif
}

TEST_CASE("GPU gemma3 final-logit soft-capping: c * tanh(logits / c) of the uncapped logits", "[gpu][gemma3]") {
#if TANDEM_HAVE_CUDA
  test::TinyGemma3 spec;
  const auto plain = Model::load(test::write_tiny_gemma3(spec, "gpu-nocap"));
  spec.softcap = 0.05f;  // small enough to bend these logits
  const auto capped = Model::load(test::write_tiny_gemma3(spec, "gpu-cap"));
  const std::vector<int32_t> ids{2, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19};
  GpuQ4Executor g1(plain), g2(capped);
  const auto a = rows_in_steps(g1, &g1, ids, {});
  const auto b = rows_in_steps(g2, &g2, ids, {});
  CpuQ4Executor c2(capped, CpuExecutorOptions{1});
  const auto cpu = rows_in_steps(c2, nullptr, ids, {});
  size_t bent = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const float want = std::tanh(a[i] * (1.0f / 0.05f)) * 0.05f;
    // The device's tanhf is within 2 ulp of the host's (cuemu: the host's): 1e-6 relative.
    REQUIRE(std::fabs(b[i] - want) <= 1e-6f * 0.05f);
    bent += std::fabs(a[i]) > 0.06f ? 1 : 0;
  }
  CHECK(bent > 0);
  CHECK(worst_rows(cpu, b, size_t(capped->hparams().n_vocab), 0, ids.size()) <= test::kLogitTolF32);
#endif
}

namespace {

#if TANDEM_HAVE_CUDA
// The tolerance tests/test_golden_gemma3.cpp holds the CPU executors to on the hub file:
// llama.cpp's own build-to-build spread on it, 1.1e-1 x max|logit|. It bounds the GPU
// against the goldens and against the CPU: the Q4 rule of gpu_test_support.hpp (4e-2,
// measured on the small synthetic models) does not hold here, as Gemma 3 amplifies
// activation rounding (shared/golden/README.md). Measured under cuemu, GPU vs CPU:
// 2.85e-2 (`text_capital`), 4.56e-2 (`code_sort`); vs the goldens 6.18e-2, 5.15e-2;
// teacher-forced argmax = golden at 64 of 64 steps on both.
constexpr double kHubTolerance = 1.1e-1;

std::shared_ptr<const Model> gemma3_hub_model() {
  ModelOptions mo;
  mo.n_threads = 2;
  return Model::load(test::gemma3_q4_k_m_path(), mo);  // every weight as the file has it
}
#endif

}  // namespace

TEST_CASE("GPU Gemma 3 270M (hub Q4_K_M): logits within the GPU tolerance of the CPU's, and llama.cpp's goldens",
          "[gpu][golden][parity][gemma3][heavy]") {
#if TANDEM_HAVE_CUDA
  const auto path = test::gemma3_q4_k_m_path();
  if (!std::filesystem::exists(path)) {
    WARN("SKIPPED: " << path << " is absent (scripts/fetch-gemma3 downloads it)");
    return;
  }
  const auto model = gemma3_hub_model();
  const int32_t n_vocab = model->hparams().n_vocab;
  const size_t nv = size_t(n_vocab);
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  GpuQ4Executor gpu(model);
  const auto dir = test::golden_dir() / "gemma-3-270m-q4_k_m";
  const auto golden = test::read_json(dir / "cases.json");
  for (const auto& c : golden["cases"]) {
    const std::string name = c["name"];
    INFO(name);
    const auto ids = c["prompt_ids"].get<std::vector<int32_t>>();
    const auto rows = c["logits_rows"].get<std::vector<size_t>>();
    const auto ref = test::read_f32(dir / c["logits_file"].get<std::string>());
    REQUIRE(ref.size() == rows.size() * nv);
    const double max_abs = c["logits_max_abs"];

    SessionOptions so;
    so.n_ctx = 256;
    Session cs(model, cpu, so);
    SessionOptions gso = so;
    gso.kv_store = test::gpu_kv_store(gpu, int32_t(KvLayout::for_model(model->hparams(), 16).sequence_pages(256, 256)));
    gso.kv_tier = KvTier::kDevice;
    Session gs(model, gpu, gso);
    std::vector<float> lc(ids.size() * nv), lg(ids.size() * nv);
    cs.eval(ids, lc);
    gs.eval(ids, lg);
    double vs_cpu = 0.0, vs_golden = 0.0;
    for (size_t j = 0; j < rows.size(); ++j) {
      const std::span<const float> mine(lg.data() + rows[j] * nv, nv), cpu_row(lc.data() + rows[j] * nv, nv);
      vs_cpu = std::max(vs_cpu, test::row_ratio(cpu_row, mine));
      double d = 0.0;
      for (size_t v = 0; v < nv; ++v) d = std::max(d, double(std::fabs(mine[v] - ref[j * nv + v])));
      vs_golden = std::max(vs_golden, d / max_abs);
    }
    INFO("GPU vs CPU " << vs_cpu << ", GPU vs golden " << vs_golden << " x max|logit|");
    CHECK(vs_cpu <= kHubTolerance);
    CHECK(vs_golden <= kHubTolerance);

    // Teacher-forced greedy: equal to the golden wherever its margin exceeds the tolerance.
    const auto greedy = c["greedy_ids"].get<std::vector<int32_t>>();
    const auto margin = c["greedy_top1_margin"].get<std::vector<double>>();
    int checked = 0, agreed = 0;
    for (size_t step = 0; step < greedy.size(); ++step) {
      const bool same = test::argmax(gs.logits()) == greedy[step];
      agreed += same ? 1 : 0;
      if (margin[step] > kHubTolerance * max_abs) {
        INFO("teacher-forced step " << step << " margin " << margin[step]);
        CHECK(same);
        ++checked;
      }
      gs.eval(std::span<const int32_t>(&greedy[step], 1));
    }
    WARN("gpu / " << name << ": vs CPU " << vs_cpu << ", vs golden " << vs_golden
                  << " x max|logit|; argmax = golden at " << agreed << " of " << greedy.size()
                  << " teacher-forced steps, " << checked << " required");
    CHECK(checked > 0);
  }
#endif
}
