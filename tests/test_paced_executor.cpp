// PacedExecutor: never faster than its model, never different in output, and a
// simulated node (paced "GPU" + paced "CPU" under the Scheduler) releases every KV page.
// Large time_scale factors keep the wall time of these tests to a few seconds; there is
// no upper timing bound anywhere (a loaded machine may make steps late, never early).
#include <catch2/catch.hpp>

#include <chrono>
#include <memory>
#include <vector>

#include "kv_test_support.hpp"
#include "tandem/core/error.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/exec/paced_executor.hpp"
#include "tandem/sched/scheduler.hpp"
#include "tandem/session/session.hpp"
#include "test_support.hpp"

using namespace tandem;

namespace {

std::shared_ptr<const Model> tiny() {
  static std::shared_ptr<const Model> m = Model::load(test::model_path("aidreams260K-q4_0"));
  return m;
}

PerfModel model_of(std::string_view processor) {
  return PerfModel(processor_profile(processor), ModelProfile::from_shape(model_shape("qwen-27b-class")));
}

}  // namespace

TEST_CASE("a paced step never finishes earlier than its model", "[paced]") {
  auto model = tiny();
  CpuQ4Executor cpu(model, CpuExecutorOptions{1});
  // 27B-class on an L40S: ~24 ms per decode step, ~0.2 s for 512 prompt tokens; / 20.
  PacedExecutor paced(cpu, model_of("l40s"), 20.0);
  CHECK(paced.name() == "paced-l40s");
  CHECK(paced.kv_tier() == cpu.kv_tier());
  auto store = test::make_store(model->hparams(), 64);
  KvSequence kv(*store, 512);
  const auto prompt = test::prompt_ids(200, model->hparams().n_vocab);
  std::vector<float> logits(size_t(model->hparams().n_vocab));
  using Clock = std::chrono::steady_clock;
  auto timed_step = [&](std::span<const int32_t> tokens) {
    const SequenceStep st{&kv, tokens, kv.n_tokens(), LogitsRows::kLast};
    const double expected = paced.paced_seconds(StepShape::of(std::span<const SequenceStep>(&st, 1)));
    const auto t0 = Clock::now();
    paced.step(std::span<const SequenceStep>(&st, 1), logits);
    const double elapsed = std::chrono::duration<double>(Clock::now() - t0).count();
    CHECK(elapsed >= expected);
    return expected;
  };
  const double prefill = timed_step(prompt);
  int32_t id = test::argmax(logits);
  double decode = 0;
  for (int i = 0; i < 8; ++i) {
    decode = timed_step(std::span<const int32_t>(&id, 1));
    id = test::argmax(logits);
  }
  CHECK(prefill > decode);  // the model charges the prompt's compute
  CHECK(paced.steps() == 9);
  CHECK(paced.modelled_seconds() > 0.0);
}

TEST_CASE("pacing changes time, never tokens or logits", "[paced]") {
  auto model = tiny();
  const auto prompt = test::prompt_ids(40, model->hparams().n_vocab);
  auto run = [&](Executor& ex) {
    SessionOptions so;
    so.n_ctx = 256;
    so.n_batch = 16;  // several prefill chunks
    Session s(model, ex, so);
    s.eval(prompt);
    return test::greedy(s, 24);
  };
  CpuQ4Executor plain(model, CpuExecutorOptions{1});
  CpuQ4Executor inner(model, CpuExecutorOptions{1});
  PacedExecutor paced(inner, model_of("epyc32"), 200.0);
  const auto expect = run(plain);
  REQUIRE(expect.size() == 24);
  CHECK(run(paced) == expect);

  // Logits bit for bit on one prefill step.
  auto sa = test::make_store(model->hparams(), 8);
  auto sb = test::make_store(model->hparams(), 8);
  KvSequence ka(*sa, 128), kb(*sb, 128);
  std::vector<float> la(size_t(model->hparams().n_vocab) * prompt.size()), lb(la.size());
  const SequenceStep a{&ka, prompt, 0, LogitsRows::kAll}, b{&kb, prompt, 0, LogitsRows::kAll};
  plain.step(std::span<const SequenceStep>(&a, 1), la);
  paced.step(std::span<const SequenceStep>(&b, 1), lb);
  CHECK(la == lb);
  CHECK(kb.n_tokens() == int32_t(prompt.size()));
}

TEST_CASE("a paced executor refuses a bad time scale", "[paced][errors]") {
  CpuQ4Executor cpu(tiny(), CpuExecutorOptions{1});
  for (double bad : {0.0, -1.0, std::numeric_limits<double>::infinity(), std::numeric_limits<double>::quiet_NaN()}) {
    INFO(bad);
    try {
      PacedExecutor p(cpu, model_of("h200"), bad);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
    }
  }
}

TEST_CASE("a simulated l40s+epyc32 node serves a mixed load and releases every KV page", "[paced][scheduler]") {
  auto model = tiny();
  const int32_t n_vocab = model->hparams().n_vocab;
  CpuQ4Executor gpu_inner(model, CpuExecutorOptions{1});
  CpuQ4Executor cpu_inner(model, CpuExecutorOptions{1});
  // Time compressed 50x: a simulated 27B decode step on the "GPU" lasts ~0.5 ms.
  PacedExecutor gpu(gpu_inner, model_of("l40s"), 50.0);
  PacedExecutor cpu(cpu_inner, model_of("epyc32"), 50.0);
  // Page counts follow the simulated node, capped to what the test can hold.
  const int32_t ps = 16;
  const int32_t gpu_pages = int32_t(std::min<int64_t>(256, gpu.perf_model().kv_budget_pages(ps)));
  const int32_t cpu_pages = int32_t(std::min<int64_t>(256, cpu.perf_model().kv_budget_pages(ps)));
  REQUIRE(gpu_pages > 0);
  REQUIRE(cpu_pages > 0);
  auto gs = test::make_store(model->hparams(), gpu_pages, 64, ps);
  auto cs = test::make_store(model->hparams(), cpu_pages, 64, ps);
  std::vector<int32_t> expect_tokens;
  {
    SchedulerOptions so;
    so.max_context = 256;
    ExecutorConfig g;
    g.executor = &gpu;
    g.store = gs;
    g.max_running = 8;
    g.step_token_budget = 128;
    g.prefill_chunk = 64;
    g.accelerator = true;
    g.name = "gpu";
    ExecutorConfig c = g;
    c.executor = &cpu;
    c.store = cs;
    c.max_running = 4;
    c.step_token_budget = 32;
    c.prefill_chunk = 16;
    c.accelerator = false;
    c.name = "cpu";
    so.executors = {g, c};
    Scheduler sched(std::move(so));
    std::vector<RequestHandle> hs;
    std::vector<std::vector<int32_t>> prompts;
    const SlaClass classes[3] = {SlaClass::kInteractive, SlaClass::kStandard, SlaClass::kBatch};
    for (int i = 0; i < 12; ++i) {
      auto p = test::prompt_ids(i % 4 == 1 ? 120 : 20 + 3 * i, n_vocab);
      p.back() = 3 + i;  // distinct prompts
      Request r;
      r.prompt_ids = p;
      r.max_tokens = 6 + i % 5;
      r.ignore_eos = true;
      r.sla = classes[i % 3];
      prompts.push_back(p);
      hs.push_back(sched.submit(std::move(r)));
    }
    CpuQ4Executor solo_ex(model, CpuExecutorOptions{1});
    for (size_t i = 0; i < hs.size(); ++i) {
      const RequestResult& r = hs[i].wait();
      INFO("request " << i << " route " << r.route);
      REQUIRE(r.finish == RequestFinish::kLength);
      SessionOptions so2;
      so2.n_ctx = 256;
      Session s(model, solo_ex, so2);
      s.eval(prompts[i]);
      CHECK(r.tokens == test::greedy(s, int32_t(r.tokens.size())));
    }
    sched.drain();
    sched.clear_prefix_cache();
    CHECK(gpu.steps() > 0);
    CHECK(cpu.steps() > 0);
  }
  for (auto* s : {gs.get(), cs.get()}) {
    for (KvTier t : {KvTier::kHost, KvTier::kFile}) {
      INFO("tier " << kv_tier_name(t));
      CHECK(s->usage(t).used == 0);
      CHECK(s->usage(t).reserved == 0);
    }
  }
}
