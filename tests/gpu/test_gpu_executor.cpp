// GPU executor tests: kernel parity (field case B09, Q8_0 quantisation), CPU/GPU logits
// agreement, greedy continuations, the Device KV tier and CPU <-> GPU migration.
// Every test needs a CUDA device, real or emulated (cuemu); without one tandem-gpu-tests
// reports them skipped (tests/gpu/gpu_test_main.cpp).
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "cpu/cpu_kernels.hpp"
#include "cpu_test_support.hpp"
#include "gpu_test_support.hpp"
#include "hooks/gpu_hooks.hpp"
#include "kv_test_support.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/kv/kv_contract.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;
namespace k = tandem::kernels;

namespace {

[[maybe_unused]] std::shared_ptr<const Model> load(const std::string& name) {
  return Model::load(test::model_path(name));
}

// Largest row_ratio over the rows of two [rows][n_vocab] logits arrays.
[[maybe_unused]] double worst_ratio(std::span<const float> cpu, std::span<const float> gpu, int32_t n_vocab) {
  double worst = 0.0;
  for (size_t r = 0; r * size_t(n_vocab) < cpu.size(); ++r) {
    worst = std::max(worst, test::row_ratio(cpu.subspan(r * size_t(n_vocab), size_t(n_vocab)),
                                            gpu.subspan(r * size_t(n_vocab), size_t(n_vocab))));
  }
  return worst;
}

// The models of the parity tests. Quick ones run in every emulated CI pass; [heavy] ones
// (the larger synthetic models, minutes each under emulation) once.
const std::vector<std::string> kQuickParityModels = {"stories260K-q4_0", "stories260K-f32", "aidreams260K-q4_0",
                                                     "aidreams260K-f32", "synth-qwen2-small-q4_0"};
const std::vector<std::string> kHeavyParityModels = {"synth-llama-small-q4_0", "synth-qwen3-small-q4_0",
                                                     "synth-qwen3-hd64-small-q4_0"};

#if TANDEM_HAVE_CUDA
// Prefill of two sequences (all rows / last row) and 20 decode steps of both together,
// crossing page boundaries, on a Host store (pages staged through VRAM) and a Device store:
// every logit row the same bytes as the CPU's. Both executors run the written arithmetic
// (docs/arithmetic.md: matmuls, attention, RMSNorm, RoPE, SiLU; the CPU's repack changes
// nothing), so nothing is left to a tolerance; worst |diff| / max|logit| is reported to
// show how far apart a failure is.
void check_logits_parity(const std::string& model_name) {
  auto model = load(model_name);
  const auto& hp = model->hparams();
  const int32_t n_vocab = hp.n_vocab;
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  GpuQ4Executor gpu(model);
  INFO(model_name << ": weights in VRAM " << gpu.weight_bytes() << " bytes");
  const auto ids = test::prompt_ids(37, n_vocab);

  for (bool device_store : {false, true}) {
    INFO((device_store ? "Device-tier store" : "Host store, staged"));
    auto cstore = test::make_store(hp, 32);
    auto gstore = device_store ? test::gpu_kv_store(gpu, 32) : test::make_store(hp, 32);
    const KvTier gtier = device_store ? KvTier::kDevice : KvTier::kHost;
    KvSequence ca(*cstore, 128), cb(*cstore, 128);
    KvSequence ga(*gstore, 128, gtier), gb(*gstore, 128, gtier);

    const std::span<const int32_t> ia(ids.data(), 37), ib(ids.data() + 5, 17);
    SequenceStep cbatch[2] = {{&ca, ia, 0, LogitsRows::kAll}, {&cb, ib, 0, LogitsRows::kLast}};
    SequenceStep gbatch[2] = {{&ga, ia, 0, LogitsRows::kAll}, {&gb, ib, 0, LogitsRows::kLast}};
    std::vector<float> lc(size_t(38) * size_t(n_vocab)), lg(lc.size(), std::numeric_limits<float>::quiet_NaN());
    cpu.step(cbatch, lc);
    gpu.step(gbatch, lg);
    INFO("prefill worst |diff| / max|logit| = " << worst_ratio(lc, lg, n_vocab));
    CHECK(test::same_bits(lc, lg));
    CHECK(ga.n_tokens() == 37);
    CHECK(gb.n_tokens() == 17);

    for (int step = 0; step < 20; ++step) {
      const int32_t ta = ids[size_t(step)], tb = ids[size_t(36 - step)];
      SequenceStep cd[2] = {{&ca, std::span<const int32_t>(&ta, 1), ca.n_tokens(), LogitsRows::kLast},
                            {&cb, std::span<const int32_t>(&tb, 1), cb.n_tokens(), LogitsRows::kLast}};
      SequenceStep gd[2] = {{&ga, std::span<const int32_t>(&ta, 1), ga.n_tokens(), LogitsRows::kLast},
                            {&gb, std::span<const int32_t>(&tb, 1), gb.n_tokens(), LogitsRows::kLast}};
      std::vector<float> dc(2 * size_t(n_vocab)), dg(dc.size());
      cpu.step(cd, dc);
      gpu.step(gd, dg);
      INFO("decode step " << step << " worst ratio " << worst_ratio(dc, dg, n_vocab));
      CHECK(test::same_bits(dc, dg));
    }
    if (device_store) CHECK(gstore->usage(KvTier::kDevice).used > 0);
  }
}

// Chunked prefill mixed with decode in one step, with the tiled flash-attention prefill
// (GpuExecutorOptions::flash_prefill, the default) and without it: step 1 prefills a (20
// tokens) and b (9); step 2 carries a's later chunk (17 tokens from position 20), b's decode
// token and c's whole prompt (5 tokens). Every logit row of both GPU runs: the CPU's bytes.
void check_chunked_prefill_parity(const std::string& model_name) {
  auto model = load(model_name);
  const auto& hp = model->hparams();
  const int32_t n_vocab = hp.n_vocab;
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  const auto ids = test::prompt_ids(37, n_vocab);
  std::vector<float> ref1, ref2;
  for (bool flash : {true, false}) {
    INFO(model_name << (flash ? ": flash prefill" : ": per-head prefill"));
    GpuExecutorOptions opts;
    opts.flash_prefill = flash;
    GpuQ4Executor gpu(model, opts);
    for (bool on_gpu : {false, true}) {
      if (!on_gpu && !ref1.empty()) continue;  // the CPU's logits once
      Executor& ex = on_gpu ? static_cast<Executor&>(gpu) : static_cast<Executor&>(cpu);
      auto store = on_gpu ? test::gpu_kv_store(gpu, 32) : test::make_store(hp, 32);
      const KvTier tier = on_gpu ? KvTier::kDevice : KvTier::kHost;
      KvSequence a(*store, 128, tier), b(*store, 128, tier), c(*store, 128, tier);
      const std::span<const int32_t> a1(ids.data(), 20), b1(ids.data() + 11, 9), a2(ids.data() + 20, 17),
          b2(ids.data() + 3, 1), c1(ids.data() + 30, 5);
      SequenceStep s1[2] = {{&a, a1, 0, LogitsRows::kAll}, {&b, b1, 0, LogitsRows::kAll}};
      std::vector<float> l1(size_t(29) * size_t(n_vocab), std::numeric_limits<float>::quiet_NaN());
      ex.step(s1, l1);
      SequenceStep s2[3] = {
          {&a, a2, 20, LogitsRows::kAll}, {&b, b2, 9, LogitsRows::kLast}, {&c, c1, 0, LogitsRows::kAll}};
      std::vector<float> l2(size_t(23) * size_t(n_vocab), std::numeric_limits<float>::quiet_NaN());
      ex.step(s2, l2);
      if (!on_gpu) {
        ref1 = l1;
        ref2 = l2;
        continue;
      }
      INFO("step 1 worst |diff| / max|logit| = " << worst_ratio(ref1, l1, n_vocab) << ", step 2 "
                                                 << worst_ratio(ref2, l2, n_vocab));
      CHECK(test::same_bits(ref1, l1));
      CHECK(test::same_bits(ref2, l2));
    }
  }
}

// Greedy generation on the CPU's tokens (32 steps, a Device-tier store on the GPU): every
// step's logits the same bytes on both, so the same tokens.
void check_greedy_parity(const std::string& model_name) {
  auto model = load(model_name);
  const int32_t n_vocab = model->hparams().n_vocab;
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  GpuQ4Executor gpu(model);
  const auto ids = test::prompt_ids(12, n_vocab);
  SessionOptions so;
  so.n_ctx = 96;
  Session c(model, cpu, so);
  c.eval(ids);
  SessionOptions gso = so;
  gso.kv_store = test::gpu_kv_store(gpu, 8);
  gso.kv_tier = KvTier::kDevice;
  Session g(model, gpu, gso);
  g.eval(ids);
  for (int step = 0; step < 32; ++step) {
    const auto lc = c.logits();
    const auto lg = g.logits();
    INFO(model_name << " step " << step);
    REQUIRE(test::same_bits(lc, lg));
    const int32_t next = test::argmax(lc);
    c.eval(std::span<const int32_t>(&next, 1));
    g.eval(std::span<const int32_t>(&next, 1));
  }
}
#endif

}  // namespace

TEST_CASE("B09: Q4_0 gemm inner-dimension tails, CUDA vs CPU vs fp64", "[gpu][kernels][field-case]") {
#if TANDEM_HAVE_CUDA
  constexpr int64_t kRows = 64;
  for (int64_t kd : {32, 64, 96, 320, 4128}) {
    std::mt19937 g(static_cast<uint32_t>(9000 + kd));
    const int64_t nb = kd / 32;
    std::vector<k::BlockQ4_0> w(size_t(kRows * nb));
    for (auto& b : w) {
      b.d = k::fp32_to_fp16_bits(std::uniform_real_distribution<float>(-0.05f, 0.05f)(g));
      for (auto& q : b.qs) q = static_cast<uint8_t>(g() & 0xFF);
    }
    std::vector<double> wd(size_t(kRows * kd));
    for (int64_t r = 0; r < kRows; ++r) {
      for (int64_t j = 0; j < kd; ++j) {
        const auto& b = w[size_t(r * nb + j / 32)];
        const int jj = int(j % 32);
        const int q = jj < 16 ? (b.qs[jj] & 0x0F) : (b.qs[jj - 16] >> 4);
        wd[size_t(r * kd + j)] = double(k::fp16_bits_to_fp32(b.d)) * (q - 8);
      }
    }
    for (int64_t m : {1, 2, 8, 33, 512}) {
      INFO("K " << kd << " M " << m);
      std::vector<float> x(size_t(m * kd));
      for (auto& v : x) v = std::uniform_real_distribution<float>(-1.0f, 1.0f)(g);
      std::vector<double> ref(size_t(m * kRows));
      double maxref = 0.0;
      for (int64_t i = 0; i < m; ++i) {
        for (int64_t r = 0; r < kRows; ++r) {
          double s = 0.0;
          for (int64_t j = 0; j < kd; ++j) s += wd[size_t(r * kd + j)] * x[size_t(i * kd + j)];
          ref[size_t(i * kRows + r)] = s;
          maxref = std::max(maxref, std::fabs(s));
        }
      }
      std::vector<k::BlockQ8_0> xq(size_t(m * nb));
      for (int64_t i = 0; i < m; ++i) k::quantize_row_q8_0(&x[size_t(i * kd)], &xq[size_t(i * nb)], kd);
      std::vector<float> ycpu(size_t(m * kRows), std::numeric_limits<float>::quiet_NaN());
      k::gemm_q4_0_q8_0(w.data(), xq.data(), ycpu.data(), kd, m, kRows, 0, kRows);
      std::vector<float> ygpu(size_t(m * kRows), 0.0f);
      gpu_testing::gemm_q4_0(w.data(), kRows, kd, x.data(), m, ygpu.data());
      int nan = 0, bad_gpu = 0, bad_cpu = 0, diff = 0;
      for (size_t i = 0; i < ygpu.size(); ++i) {
        if (std::isnan(ygpu[i])) ++nan;
        if (!(std::fabs(ygpu[i] - ref[i]) <= 0.01 * maxref)) ++bad_gpu;
        if (!(std::fabs(ycpu[i] - ref[i]) <= 0.01 * maxref)) ++bad_cpu;
        if (std::memcmp(&ygpu[i], &ycpu[i], sizeof(float)) != 0) ++diff;  // one arithmetic
      }
      CHECK(nan == 0);
      CHECK(bad_gpu == 0);
      CHECK(bad_cpu == 0);
      CHECK(diff == 0);
    }
  }
#endif
}

TEST_CASE("GPU quantised matmuls are bit-identical to the CPU's on every ISA (docs/arithmetic.md)",
          "[gpu][kernels][isa]") {
#if TANDEM_HAVE_CUDA
  // Q4_0 and Q8_0 weights, the dp4a GEMV/GEMM and the Tensor Core GEMM (m >= 16), against
  // the CPU kernels in the GGUF layout and repacked, under every ISA this machine runs.
  std::mt19937 g(23);
  const int64_t n = 45;
  for (const int64_t kd : {int64_t{32}, int64_t{576}, int64_t{1056}, int64_t{4128}}) {
    const int64_t nb = kd / 32;
    const auto w4 = test::rand_q4(g, size_t(n * nb));
    const auto w8 = test::rand_q8(g, size_t(n * nb));
    std::vector<k::BlockQ4_0x8> w4x8(size_t(k::q4_0x8_records(n, kd)));
    k::repack_q4_0x8(w4.data(), n, kd, w4x8.data(), 0, (n + 7) / 8);
    for (const int64_t m : {int64_t{1}, int64_t{3}, int64_t{16}, int64_t{33}}) {
      const auto xq = test::rand_q8(g, size_t(m * nb));
      for (const bool tc : {false, true}) {
        std::vector<float> g4(size_t(m * n)), g8(g4.size());
        gpu_testing::gemm_q8_blocks(GgmlType::kQ4_0, w4.data(), n, kd, xq.data(), m, tc, g4.data());
        gpu_testing::gemm_q8_blocks(GgmlType::kQ8_0, w8.data(), n, kd, xq.data(), m, tc, g8.data());
        for (const auto& isa : test::isas()) {
          test::IsaScope scope(isa);
          std::vector<float> c4(g4.size()), c4x8(g4.size()), c8(g4.size());
          k::gemm_q4_0_q8_0(w4.data(), xq.data(), c4.data(), kd, m, n, 0, n);
          k::gemm_q4_0x8_q8_0(w4x8.data(), xq.data(), c4x8.data(), kd, m, n, 0, n);
          k::gemm_q8_0_q8_0(w8.data(), xq.data(), c8.data(), kd, m, n, 0, n);
          INFO(isa << " k " << kd << " m " << m << (tc ? " tensor cores" : " dp4a"));
          CHECK(std::memcmp(g4.data(), c4.data(), g4.size() * sizeof(float)) == 0);
          CHECK(std::memcmp(g4.data(), c4x8.data(), g4.size() * sizeof(float)) == 0);
          CHECK(std::memcmp(g8.data(), c8.data(), g8.size() * sizeof(float)) == 0);
        }
      }
    }
  }
#endif
}

TEST_CASE("GPU Q8_0 activation quantisation is bit-identical to the CPU's", "[gpu][kernels]") {
#if TANDEM_HAVE_CUDA
  std::mt19937 g(17);
  const int64_t m = 7, kd = 4128;
  std::vector<float> x(size_t(m * kd));
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (auto& v : x) v = nd(g);
  std::fill(x.begin(), x.begin() + 64, 0.0f);                         // zero blocks
  for (int j = 64; j < 96; ++j) x[size_t(j)] = float(j - 64) + 0.5f;  // ties
  x[64] = 127.0f;
  std::vector<k::BlockQ8_0> cpu(size_t(m * kd / 32)), gpu(cpu.size());
  for (int64_t i = 0; i < m; ++i) k::quantize_row_q8_0(&x[size_t(i * kd)], &cpu[size_t(i * kd / 32)], kd);
  gpu_testing::quantize_q8_0(x.data(), m, kd, gpu.data());
  for (size_t b = 0; b < cpu.size(); ++b) {
    INFO("block " << b);
    REQUIRE(cpu[b].d == gpu[b].d);
    REQUIRE(std::memcmp(cpu[b].qs, gpu[b].qs, 32) == 0);
  }
#endif
}

TEST_CASE("GPU logits are the CPU's bytes: prefill, decode, mixed batches, both KV tiers", "[gpu][parity]") {
#if TANDEM_HAVE_CUDA
  check_logits_parity(GENERATE(from_range(kQuickParityModels)));
#endif
}

TEST_CASE("GPU chunked prefill mixed with decode gives the CPU's bytes, flash prefill on and off", "[gpu][parity]") {
#if TANDEM_HAVE_CUDA
  check_chunked_prefill_parity(GENERATE(from_range(kQuickParityModels)));
#endif
}

TEST_CASE("GPU logits are the CPU's bytes on the larger synthetic models", "[gpu][parity][heavy]") {
#if TANDEM_HAVE_CUDA
  check_logits_parity(GENERATE(from_range(kHeavyParityModels)));
#endif
}

TEST_CASE("GPU greedy continuations are the CPU's, step logits the same bytes", "[gpu][parity]") {
#if TANDEM_HAVE_CUDA
  check_greedy_parity(GENERATE(from_range(kQuickParityModels)));
#endif
}

TEST_CASE("GPU greedy continuations are the CPU's on the larger synthetic models", "[gpu][parity][heavy]") {
#if TANDEM_HAVE_CUDA
  check_greedy_parity(GENERATE(from_range(kHeavyParityModels)));
#endif
}

TEST_CASE("a session migrated CPU -> GPU -> CPU mid-generation continues the same way", "[gpu][migration][parity]") {
#if TANDEM_HAVE_CUDA
  const auto model_name = GENERATE(as<std::string>{}, "aidreams260K-q4_0", "synth-qwen2-small-q4_0");
  auto model = load(model_name);
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  GpuQ4Executor gpu(model);
  const auto ids = test::prompt_ids(21, model->hparams().n_vocab);
  SessionOptions so;
  so.n_ctx = 128;
  // Baseline on the CPU: its greedy tokens.
  Session base(model, cpu, so);
  base.eval(ids);
  std::vector<int32_t> expect;
  for (int i = 0; i < 24; ++i) {
    expect.push_back(test::argmax(base.logits()));
    base.eval(std::span<const int32_t>(&expect.back(), 1));
  }
  for (int cut : {0, 1, 16, 17}) {  // around the page boundary (21 + 11 = 32)
    INFO(model_name << ", CPU -> GPU after " << cut << " tokens, GPU -> CPU after " << cut + 4);
    Session s(model, cpu, so);
    s.eval(ids);
    std::vector<int32_t> got = test::greedy(s, cut);
    const auto report = s.migrate(gpu, test::gpu_kv_store(gpu, 16));
    CHECK(report.pages > 0);
    CHECK(&s.executor() == &gpu);
    auto mid = test::greedy(s, 4);
    got.insert(got.end(), mid.begin(), mid.end());
    s.migrate(cpu);
    CHECK(&s.executor() == &cpu);
    auto rest = test::greedy(s, 24 - cut - 4);
    got.insert(got.end(), rest.begin(), rest.end());
    REQUIRE(got.size() == expect.size());
    // The same arithmetic on both executors: the same tokens at every cut.
    CHECK(got == expect);
  }
#endif
}

TEST_CASE("GPU Device KV tier: copies round-trip and pages move between tiers bit-exactly", "[gpu][kv]") {
#if TANDEM_HAVE_CUDA
  auto model = load("synth-qwen2-small-q4_0");
  const auto& hp = model->hparams();
  GpuQ4Executor gpu(model);
  const KvLayout layout = KvLayout::for_model(hp, 16);
  auto backend = gpu.make_kv_device_backend(layout, 4);
  REQUIRE(backend->capacity_pages() == 4);
  std::vector<std::byte> a(layout.page_bytes()), b(a.size()), c(a.size());
  std::mt19937 g(1);
  for (auto& x : a) x = std::byte(g() & 0xFF);
  backend->copy_to_device(2, a.data(), a.size());
  backend->copy_device_to_device(0, 2, a.size());
  backend->copy_to_host(0, b.data(), b.size());
  backend->copy_to_host(2, c.data(), c.size());
  CHECK(a == b);
  CHECK(a == c);

  // A sequence computed on the GPU, swapped to Host and back: same checksums, same logits.
  auto store = test::gpu_kv_store(gpu, 16, 16);
  SessionOptions so;
  so.kv_store = store;
  so.kv_tier = KvTier::kDevice;
  so.n_ctx = 64;
  Session s(model, gpu, so);
  const auto ids = test::prompt_ids(20, hp.n_vocab);
  s.eval(ids);
  CHECK(store->usage(KvTier::kDevice).used == 2);
  const auto before = test::page_checksums(s.kv(), *model, s.tokens());
  s.kv().move_to(KvTier::kHost);
  CHECK(store->usage(KvTier::kDevice).used == 0);
  CHECK(test::page_checksums(s.kv(), *model, s.tokens()) == before);
  s.kv().move_to(KvTier::kDevice);
  CHECK(test::page_checksums(s.kv(), *model, s.tokens()) == before);
  // A twin that went Device -> Host -> Device (brought back by the session's KvPlacement) computes the next
  // token exactly as the one that never moved.
  Session t(model, gpu, so);
  t.eval(ids);
  t.kv().move_to(KvTier::kHost);
  const int32_t next = 5;
  s.eval(std::span<const int32_t>(&next, 1));
  t.eval(std::span<const int32_t>(&next, 1));
  CHECK(t.kv().pages_outside(KvTier::kDevice) == 0);
  CHECK(std::equal(s.logits().begin(), s.logits().end(), t.logits().begin()));
#endif
}

TEST_CASE("GPU KV pages hold the same values as the CPU's (same layout, f16)", "[gpu][kv][parity]") {
#if TANDEM_HAVE_CUDA
  auto model = load("synth-llama-small-q4_0");
  const auto& hp = model->hparams();
  CpuQ4Executor cpu(model, CpuExecutorOptions{2});
  GpuQ4Executor gpu(model);
  const auto ids = test::prompt_ids(33, hp.n_vocab);
  auto cstore = test::make_store(hp, 8);
  auto gstore = test::gpu_kv_store(gpu, 8);
  KvSequence cs(*cstore, 64), gs(*gstore, 64, KvTier::kDevice);
  std::vector<float> lc(size_t(hp.n_vocab)), lg(lc.size());
  SequenceStep cb[1] = {{&cs, ids, 0, LogitsRows::kLast}};
  SequenceStep gb[1] = {{&gs, ids, 0, LogitsRows::kLast}};
  cpu.step(cb, lc);
  gpu.step(gb, lg);
  REQUIRE(cs.n_pages() == gs.n_pages());
  const KvLayout& l = cstore->layout();
  std::vector<std::byte> pc(l.page_bytes()), pg(l.page_bytes());
  size_t same = 0, total = 0;
  double worst = 0.0, mx = 0.0;
  for (int32_t p = 0; p < cs.n_pages(); ++p) {
    cstore->read_page(cs.page(0, p), pc.data());
    gstore->read_page(gs.page(0, p), pg.data());
    const auto* a = reinterpret_cast<const uint16_t*>(pc.data());
    const auto* b = reinterpret_cast<const uint16_t*>(pg.data());
    const int32_t slots = std::min<int32_t>(l.page_size, 33 - int32_t(p) * l.page_size);
    for (int32_t layer = 0; layer < l.n_layer; ++layer) {
      for (int kind = 0; kind < 2; ++kind) {
        for (int32_t slot = 0; slot < slots; ++slot) {
          const size_t off = l.row_offset(layer, kind, slot) / 2;
          for (size_t e = 0; e < l.row_elems(); ++e) {
            const float fa = k::fp16_bits_to_fp32(a[off + e]), fb = k::fp16_bits_to_fp32(b[off + e]);
            same += a[off + e] == b[off + e];
            ++total;
            worst = std::max(worst, double(std::fabs(fa - fb)));
            mx = std::max(mx, double(std::fabs(fa)));
          }
        }
      }
    }
  }
  INFO("identical f16 values: " << same << " of " << total << ", worst |diff| " << worst << " of max " << mx);
  // The same written arithmetic up to the K/V rows (docs/arithmetic.md): every value identical.
  CHECK(total > 0);
  CHECK(same == total);
#endif
}

TEST_CASE("GPU executor refuses a device that does not exist", "[gpu]") {
#if TANDEM_HAVE_CUDA
  auto model = load("aidreams260K-q4_0");
  try {
    GpuQ4Executor bad(model, GpuExecutorOptions{GpuQ4Executor::device_count()});
    FAIL("no error");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::kInvalidArgument);
  }
#endif
}

TEST_CASE("steps replayed as CUDA graphs give the logits of direct launches, bit for bit", "[gpu][graphs]") {
#if TANDEM_HAVE_CUDA
  auto model = load("synth-qwen2-small-q4_0");
  const int32_t n_vocab = model->hparams().n_vocab;
  GpuQ4Executor direct(model, GpuExecutorOptions{0, false});
  GpuQ4Executor graphs(model, GpuExecutorOptions{0, true});
  auto sd = test::gpu_kv_store(direct, 16), sg = test::gpu_kv_store(graphs, 16);
  KvSequence da(*sd, 128, KvTier::kDevice), db(*sd, 128, KvTier::kDevice);
  KvSequence ga(*sg, 128, KvTier::kDevice), gb(*sg, 128, KvTier::kDevice);
  const auto ids = test::prompt_ids(30, n_vocab);
  const std::span<const int32_t> ia(ids.data(), 30), ib(ids.data() + 3, 14);
  SequenceStep dp[2] = {{&da, ia, 0, LogitsRows::kLast}, {&db, ib, 0, LogitsRows::kLast}};
  SequenceStep gp[2] = {{&ga, ia, 0, LogitsRows::kLast}, {&gb, ib, 0, LogitsRows::kLast}};
  std::vector<float> ld(2 * size_t(n_vocab)), lg(ld.size());
  direct.step(dp, ld);
  graphs.step(gp, lg);
  CHECK(ld == lg);
  CHECK(direct.graph_instantiations() == 0);
  CHECK(graphs.graph_instantiations() == 1);
  // Decode steps (crossing the page boundary at 32): attention goes through the split-KV
  // kernels instead of the prefill's, another topology: the first decode step instantiates
  // a graph, the next ones (other launch parameters only) update it in place.
  for (int step = 0; step < 6; ++step) {
    INFO("decode step " << step);
    const int32_t ta = ids[size_t(step)], tb = ids[size_t(20 - step)];
    SequenceStep dd[2] = {{&da, std::span<const int32_t>(&ta, 1), da.n_tokens(), LogitsRows::kLast},
                          {&db, std::span<const int32_t>(&tb, 1), db.n_tokens(), LogitsRows::kLast}};
    SequenceStep gd[2] = {{&ga, std::span<const int32_t>(&ta, 1), ga.n_tokens(), LogitsRows::kLast},
                          {&gb, std::span<const int32_t>(&tb, 1), gb.n_tokens(), LogitsRows::kLast}};
    direct.step(dd, ld);
    graphs.step(gd, lg);
    CHECK(ld == lg);
  }
  CHECK(graphs.graph_instantiations() == 2);
  // A prefill chunk without logits has fewer nodes: another topology, a new graph; the
  // next step with logits needs one more, and its logits still match.
  const std::span<const int32_t> chunk(ids.data() + 10, 5);
  SequenceStep dc[1] = {{&da, chunk, da.n_tokens(), LogitsRows::kNone}};
  SequenceStep gc[1] = {{&ga, chunk, ga.n_tokens(), LogitsRows::kNone}};
  direct.step(dc, {});
  graphs.step(gc, {});
  CHECK(graphs.graph_instantiations() == 3);
  const int32_t tc = 7;
  SequenceStep d1[1] = {{&da, std::span<const int32_t>(&tc, 1), da.n_tokens(), LogitsRows::kLast}};
  SequenceStep g1[1] = {{&ga, std::span<const int32_t>(&tc, 1), ga.n_tokens(), LogitsRows::kLast}};
  direct.step(d1, std::span(ld).first(size_t(n_vocab)));
  graphs.step(g1, std::span(lg).first(size_t(n_vocab)));
  CHECK(ld == lg);
  CHECK(graphs.graph_instantiations() == 4);
  // A Host-tier sequence is staged and runs without a graph.
  auto host = test::make_store(model->hparams(), 8);
  KvSequence hs(*host, 64);
  SequenceStep hp[1] = {{&hs, ib, 0, LogitsRows::kLast}};
  std::vector<float> lh(static_cast<size_t>(n_vocab));
  graphs.step(hp, lh);
  CHECK(graphs.graph_instantiations() == 4);
  // ... with the logits the direct executor gives for the same prompt.
  KvSequence hd(*sd, 64, KvTier::kDevice);
  SequenceStep hdp[1] = {{&hd, ib, 0, LogitsRows::kLast}};
  std::vector<float> lhd(static_cast<size_t>(n_vocab));
  direct.step(hdp, lhd);
  CHECK(lh == lhd);
#endif
}
