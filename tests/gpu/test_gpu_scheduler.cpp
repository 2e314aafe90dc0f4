// The Scheduler with the GPU executor in it ("cpu+gpu"), run on a device or under cuemu:
// routing across both, a GPU prefill handed off to the CPU for decode, a session moved
// CPU -> GPU on an SLA upgrade, and cancellations. Every request must give the solo CPU
// run's greedy tokens (by the margin rule of gpu_test_support.hpp) and every store must
// end with zero pages in every tier.
#include <catch2/catch.hpp>

#include <atomic>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "cancel_storm.hpp"
#include "gpu_test_support.hpp"
#include "kv_test_support.hpp"
#include "tandem/sched/scheduler.hpp"

using namespace tandem;

#if TANDEM_HAVE_CUDA
namespace {

// The real tiny model: GPU and CPU logits are bit-identical on it under cuemu (measured
// in tests/gpu/test_gpu_executor.cpp), and its steps are cheap under emulation.
std::shared_ptr<const Model> tiny() {
  static std::shared_ptr<const Model> m = Model::load(test::model_path("aidreams260K-q4_0"));
  return m;
}

constexpr int32_t kCtx = 256;

std::vector<int32_t> prompt_of(int32_t n, int32_t salt) {
  const int32_t n_vocab = tiny()->hparams().n_vocab;
  auto ids = test::prompt_ids(n, n_vocab);
  for (size_t i = 1; i < ids.size(); ++i) ids[i] = 3 + (ids[i] + salt * 7) % (n_vocab - 3);
  return ids;
}

Request greedy_request(std::vector<int32_t> prompt, int32_t max_tokens, SlaClass sla) {
  Request r;
  r.prompt_ids = std::move(prompt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sla = sla;
  return r;
}

// A solo CPU run: greedy tokens and each step's top-1 margin over its tolerance.
struct Solo {
  std::vector<int32_t> tokens;
  std::vector<double> margin_over_tol;
};

Solo solo_cpu(const std::vector<int32_t>& prompt, int32_t n) {
  static CpuQ4Executor ex(tiny(), CpuExecutorOptions{1});
  SessionOptions so;
  so.n_ctx = kCtx;
  Session s(tiny(), ex, so);
  s.eval(prompt);
  Solo r;
  for (int32_t i = 0; i < n; ++i) {
    const auto l = s.logits();
    const int32_t next = test::argmax(l);
    r.tokens.push_back(next);
    r.margin_over_tol.push_back(test::top1_margin(l) / (test::kLogitTolQ4 * test::max_abs(l)));
    s.eval(std::span<const int32_t>(&next, 1));
  }
  return r;
}

// The margin rule: identical up to the first step whose solo margin is within the
// tolerance (there the two runs may legitimately part).
void check_margin_rule(const std::vector<int32_t>& got, const Solo& want) {
  REQUIRE(got.size() == want.tokens.size());
  for (size_t i = 0; i < got.size(); ++i) {
    if (got[i] != want.tokens[i]) {
      INFO("first difference at generated token " << i);
      CHECK(want.margin_over_tol[i] <= 1.0);
      return;
    }
  }
}

// Executor 0: the GPU (Device + Host tiers); executor 1: the CPU (Host, optional File).
struct GpuRig {
  std::shared_ptr<const Model> model = tiny();
  GpuQ4Executor gpu{model};
  CpuQ4Executor cpu{model, CpuExecutorOptions{1}};
  std::shared_ptr<KvStore> sg, sc;
  std::unique_ptr<Scheduler> sched;

  struct Opt {
    int32_t max_running = 6;
    int32_t file_pages = 0;
    DefaultRoutingOptions routing{};
  };

  explicit GpuRig(const Opt& o) {
    sg = test::gpu_kv_store(gpu, 256, 64);
    sc = test::make_store(model->hparams(), 256, o.file_pages);
    SchedulerOptions so;
    so.max_context = kCtx;
    so.prefix_cache_entries = 0;
    so.policy = std::make_shared<DefaultRoutingPolicy>(o.routing);
    ExecutorConfig g;
    g.executor = &gpu;
    g.store = sg;
    g.max_running = o.max_running;
    g.step_token_budget = 64;
    g.prefill_chunk = 32;
    g.name = "gpu";
    so.executors.push_back(g);
    ExecutorConfig c = g;
    c.executor = &cpu;
    c.store = sc;
    c.name = "cpu";
    so.executors.push_back(c);
    sched = std::make_unique<Scheduler>(std::move(so));
  }

  void check_released() {
    sched->drain();
    sched->clear_prefix_cache();
    for (auto* s : {sg.get(), sc.get()}) {
      for (KvTier t : {KvTier::kDevice, KvTier::kHost, KvTier::kFile}) {
        if (!s->has_tier(t)) continue;
        INFO("tier " << kv_tier_name(t));
        CHECK(s->usage(t).used == 0);
        CHECK(s->usage(t).reserved == 0);
      }
    }
  }
};

}  // namespace
#endif

TEST_CASE("cpu+gpu: mixed requests give the solo CPU tokens and GPU prefills hand off to the CPU",
          "[gpu][scheduler][parity]") {
#if TANDEM_HAVE_CUDA
  GpuRig::Opt o;
  o.routing.long_prompt_tokens = 40;       // "long" for the tiny model
  o.routing.decode_scarce_fraction = 0.0;  // decode slots always scarce: long prompts hand off
  GpuRig rig(o);
  struct Case {
    std::vector<int32_t> prompt;
    int32_t n;
    SlaClass sla;
  };
  std::vector<Case> cases;
  std::mt19937 rng(5);
  for (int i = 0; i < 12; ++i) {
    cases.push_back({prompt_of(2 + int32_t(rng() % 90), i % 7), 1 + int32_t(rng() % 24), SlaClass(i % 3)});
  }
  std::vector<RequestHandle> hs;
  for (const auto& c : cases) hs.push_back(rig.sched->submit(greedy_request(c.prompt, c.n, c.sla)));
  int gpu_to_cpu = 0, on_gpu = 0, on_cpu = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = hs[i].wait();
    INFO("case " << i << " route " << r.route << " prefill " << r.metrics.prefill_executor << " decode "
                 << r.metrics.decode_executor);
    CHECK(r.finish == RequestFinish::kLength);
    check_margin_rule(r.tokens, solo_cpu(cases[i].prompt, cases[i].n));
    if (r.metrics.prefill_executor == "gpu" && r.metrics.decode_executor == "cpu") {
      ++gpu_to_cpu;
      CHECK(r.metrics.migrations == 1);
      CHECK(r.metrics.migration_bytes > 0);
    }
    on_gpu += r.metrics.decode_executor == "gpu";
    on_cpu += r.metrics.decode_executor == "cpu";
  }
  CHECK(gpu_to_cpu > 0);  // GPU prefill -> CPU decode hand-offs happened
  CHECK(on_gpu > 0);      // ... and the GPU decoded too
  CHECK(on_cpu > 0);
  rig.check_released();
#endif
}

TEST_CASE("cpu+gpu: a session moves CPU -> GPU on an SLA upgrade and continues the same way",
          "[gpu][scheduler][session]") {
#if TANDEM_HAVE_CUDA
  GpuRig::Opt o;
  o.file_pages = 32;
  GpuRig rig(o);
  const auto p1 = prompt_of(10, 4);
  const std::vector<int32_t> p2{30, 31};
  // Reference: one CPU session, two turns.
  CpuQ4Executor ex(tiny(), CpuExecutorOptions{1});
  SessionOptions so;
  so.n_ctx = kCtx;
  Session ref(tiny(), ex, so);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.ignore_eos = true;
  go.max_tokens = 8;
  const auto e1 = ref.generate(std::span<const int32_t>(p1), go).tokens;
  const auto e2 = ref.generate(std::span<const int32_t>(p2), go).tokens;

  const uint64_t sid = rig.sched->open_session();
  Request r1 = greedy_request(p1, 8, SlaClass::kStandard);
  r1.session = sid;
  const RequestResult a = rig.sched->submit(std::move(r1)).wait();
  CHECK(a.tokens == e1);
  CHECK(a.metrics.decode_executor == "cpu");  // short standard: the host executor
  Request r2 = greedy_request(p2, 8, SlaClass::kInteractive);
  r2.session = sid;
  const RequestResult b = rig.sched->submit(std::move(r2)).wait();
  INFO("route " << b.route);
  CHECK(b.tokens == e2);
  CHECK(b.metrics.migrations == 1);
  CHECK(b.metrics.decode_executor == "gpu");
  CHECK_THAT(b.route, Catch::Contains("SLA upgrade"));
  CHECK(rig.sg->usage(KvTier::kDevice).used > 0);  // the parked session's KV is in VRAM now
  rig.sched->close_session(sid);
  rig.check_released();
#endif
}

TEST_CASE("cpu+gpu: cancellations at every stage leave zero KV pages and one terminal event each",
          "[gpu][scheduler][lifecycle]") {
#if TANDEM_HAVE_CUDA
  GpuRig::Opt o;
  o.max_running = 3;
  o.routing.long_prompt_tokens = 30;
  o.routing.decode_scarce_fraction = 0.0;
  GpuRig rig(o);
  std::mt19937 rng(13);
  test::CancelStorm storm(24);
  storm.submit(*rig.sched, rng, 8, 2000, [&](int i) {
    return greedy_request(prompt_of(2 + int32_t(rng() % 70), i % 5), 4 + int32_t(rng() % 10), SlaClass(i % 3));
  });
  rig.check_released();
  CHECK(storm.check_and_count_cancelled() > 3);
#endif
}
