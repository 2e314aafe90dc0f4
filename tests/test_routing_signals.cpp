// The routing signals the simulation showed wrong (issue 16) and the policy's guards for a
// non-accelerator: prefill speed counts prompt tokens only; a decode hand-off counts in its
// decode executor's queue from the moment it is routed; a host without a free decode slot,
// or whose modelled TPOT misses the SLO, gets nothing; a long prompt whose KV the
// accelerator cannot hold decodes on the host. Also the token-scaled performance model.
#include <catch2/catch.hpp>

#include <atomic>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kv_test_support.hpp"
#include "routing_test_support.hpp"
#include "sched/speed_signals.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/exec/perf_model.hpp"
#include "tandem/sched/routing_policy.hpp"
#include "tandem/sched/scheduler.hpp"
#include "test_support.hpp"

using namespace tandem;
using namespace std::chrono_literals;

using tandem::test::gpu_cpu;
using tandem::test::input;

// Fails before issue 16's fix: a step of 64 prompt tokens and 16 decodes in 1 s measured
// 80 prompt tokens/s (the decodes were counted as prompt work).
TEST_CASE("prefill speed counts only the prompt tokens of a step", "[routing][signals]") {
  std::atomic<double> pf{0.0}, dec{0.0};
  update_speed_signals(pf, dec, 64, 16, 1.0);
  CHECK(pf.load() == Approx(64.0));
  CHECK(dec.load() == 0.0);  // a step carrying prompt tokens says nothing of decode speed
  update_speed_signals(pf, dec, 0, 16, 0.05);
  CHECK(dec.load() == Approx(20.0));  // one token per sequence per 50 ms step
  CHECK(pf.load() == Approx(64.0));
  update_speed_signals(pf, dec, 128, 0, 1.0);  // EWMA: 0.8 old + 0.2 new
  CHECK(pf.load() == Approx(0.8 * 64.0 + 0.2 * 128.0));
  update_speed_signals(pf, dec, 10, 0, 0.0);  // no time: no measurement
  CHECK(pf.load() == Approx(0.8 * 64.0 + 0.2 * 128.0));
}

// The token rate of prefilling steps (issue 16): prompt and decode tokens over the step
// time, measured only in steps that carry prompt tokens.
TEST_CASE("token rate counts a prefilling step's prompt and decode tokens", "[routing][signals]") {
  std::atomic<double> tok{0.0};
  update_token_rate(tok, 0, 16, 0.05);  // a pure decode step: no measurement
  CHECK(tok.load() == 0.0);
  update_token_rate(tok, 64, 16, 1.0);  // 80 tokens in 1 s
  CHECK(tok.load() == Approx(80.0));
  update_token_rate(tok, 100, 0, 0.5);  // 200 t/s; EWMA 0.8 x 80 + 0.2 x 200
  CHECK(tok.load() == Approx(104.0));
  update_token_rate(tok, 10, 0, 0.0);  // no time: no measurement
  CHECK(tok.load() == Approx(104.0));
}

// Fails before issue 16's fix: R5 handed the decode to a host whose slots were all taken.
TEST_CASE("a host without a free decode slot gets neither a hand-off nor a whole request", "[routing][signals]") {
  DefaultRoutingOptions o;
  o.decode_scarce_fraction = 0.0;             // the accelerator's slots always look scarce
  for (int c = 0; c < kSlaClassCount; ++c) {  // targets every estimate here meets
    o.ttft_target_s[c] = 100.0;
    o.tpot_target_s[c] = 100.0;
  }
  DefaultRoutingPolicy pol(o);
  auto v = gpu_cpu();
  const auto free_slot = pol.route(input(SlaClass::kBatch, 400, 64), v);
  CHECK(free_slot.rule == "R5");
  CHECK(free_slot.decode == 1);
  v[1].running = 3;
  v[1].queued = 1;  // e.g. a hand-off still prefilling on the accelerator
  const auto full = pol.route(input(SlaClass::kBatch, 400, 64), v);
  CHECK(full.rule == "R4");
  CHECK(full.decode == 0);
  CHECK(full.reason.find("no free decode slot") != std::string::npos);
  const auto short_std = pol.route(input(SlaClass::kStandard, 20, 8), v);
  CHECK(short_std.rule == "R7");
  CHECK(short_std.prefill == 0);
}

// Fails before issue 16's fix: the guard used only the measured decode speed.
TEST_CASE("the host's modelled TPOT counts in the SLO guard", "[routing][signals]") {
  DefaultRoutingOptions o;
  o.tpot_target_s[int(SlaClass::kStandard)] = 0.5;
  o.ttft_target_s[int(SlaClass::kStandard)] = 5.0;
  DefaultRoutingPolicy pol(o);
  auto v = gpu_cpu();  // measured: 40 tok/s on the host, 25 ms per token
  CHECK(pol.route(input(SlaClass::kStandard, 20, 8), v).prefill == 1);
  v[1].model_tpot_s = 0.6;  // its model says a request admitted now gets 600 ms per token
  const auto d = pol.route(input(SlaClass::kStandard, 20, 8), v);
  CHECK(d.prefill == 0);
  CHECK(d.decode == 0);
  CHECK(d.reason.find("would miss") != std::string::npos);
}

// Fails before issue 16's fix: only decode slots made the accelerator "scarce".
TEST_CASE("a long prompt whose KV the accelerator cannot hold decodes on the host", "[routing][signals]") {
  DefaultRoutingPolicy pol;
  auto v = gpu_cpu();
  v[0].kv_free_pages = 40;  // 640 tokens of room; the request needs 400 + 300
  const auto d = pol.route(input(SlaClass::kStandard, 400, 300), v);
  CHECK(d.rule == "R5");
  CHECK(d.prefill == 0);
  CHECK(d.decode == 1);
  CHECK(d.reason.find("KV is short") != std::string::npos);
  v[0].kv_free_pages = 44;  // 704 tokens: it fits
  CHECK(pol.route(input(SlaClass::kStandard, 400, 300), v).rule == "R4");
  v[0].queued_tokens = 64;  // ... unless the prompts queued there take 4 of those pages
  CHECK(pol.route(input(SlaClass::kStandard, 400, 300), v).rule == "R5");
  DefaultRoutingOptions off;
  off.handoff_when_kv_short = false;
  CHECK(DefaultRoutingPolicy(off).route(input(SlaClass::kStandard, 400, 300), v).rule == "R4");
  // Interactive decode stays on the accelerator whatever its KV.
  CHECK(pol.route(input(SlaClass::kInteractive, 400, 300), v).rule == "R4");
}

namespace {

/// Runs `inner` only once `open` is set: holds a step without any timing.
class GatedExecutor final : public Executor {
 public:
  explicit GatedExecutor(Executor& inner) : Executor(inner.model_ptr()), inner_(inner) {}
  std::string_view name() const noexcept override { return "gated"; }
  KvTier kv_tier() const noexcept override { return inner_.kv_tier(); }
  bool can_read(KvTier t) const noexcept override { return inner_.can_read(t); }
  bool supports(KvDtype d) const noexcept override { return inner_.supports(d); }
  std::atomic<bool> open{false};

 protected:
  void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) override {
    while (!open.load()) std::this_thread::sleep_for(1ms);
    inner_.step(batch, logits);
  }

 private:
  Executor& inner_;
};

/// The default policy, recording every view it is given.
class RecordingPolicy final : public RoutingPolicy {
 public:
  explicit RecordingPolicy(DefaultRoutingOptions o) : inner_(o) {}
  RouteDecision route(const RouteInput& in, std::span<const ExecutorView> ex) override {
    std::lock_guard<std::mutex> lk(mu);
    views.emplace_back(ex.begin(), ex.end());
    return inner_.route(in, ex);
  }
  std::mutex mu;
  std::vector<std::vector<ExecutorView>> views;

 private:
  DefaultRoutingPolicy inner_;
};

}  // namespace

// Fails before issue 16's fix: while the prefill ran on the accelerator the host's view
// showed nothing queued, so the next request found a free-looking host.
TEST_CASE("a decode hand-off counts in its decode executor's queue from routing until it arrives",
          "[routing][signals][scheduler]") {
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  CpuQ4Executor a(model, CpuExecutorOptions{1}), b(model, CpuExecutorOptions{1});
  GatedExecutor gated(a);
  auto sa = test::make_store(model->hparams(), 128), sb = test::make_store(model->hparams(), 128);
  DefaultRoutingOptions ro;
  ro.long_prompt_tokens = 20;
  ro.decode_scarce_fraction = 0.0;  // long standard prompts prefill on A, decode on B
  auto policy = std::make_shared<RecordingPolicy>(ro);
  SchedulerOptions so;
  so.max_context = 128;
  so.prefix_cache_entries = 0;
  so.policy = policy;
  ExecutorConfig ca;
  ca.executor = &gated;
  ca.store = sa;
  ca.max_running = 4;
  ca.accelerator = true;
  ca.name = std::string("A");  // move-assigned: GCC 12 -O3 -Wrestrict misfires on = "A"
  ExecutorConfig cb = ca;
  cb.executor = &b;
  cb.store = sb;
  cb.accelerator = false;
  cb.name = std::string("B");
  so.executors = {ca, cb};
  Scheduler sched(std::move(so));
  auto req = [&](int32_t n, int32_t salt) {
    Request r;
    r.prompt_ids = test::prompt_ids(n, model->hparams().n_vocab);
    r.prompt_ids.back() = 3 + salt;
    r.max_tokens = 6;
    r.ignore_eos = true;
    r.sampling = SamplingParams::greedy();
    return r;
  };
  auto h1 = sched.submit(req(40, 1));  // R5: A prefills (held at the gate), B decodes
  auto h2 = sched.submit(req(40, 2));
  {
    std::lock_guard<std::mutex> lk(policy->mu);
    REQUIRE(policy->views.size() == 2);
    const ExecutorView& host = policy->views[1][1];
    CHECK(host.name == "B");
    CHECK(host.queued == 1);  // the first request's hand-off, still prefilling on A
    CHECK(host.running == 0);
  }
  gated.open = true;
  CHECK(h1.wait().finish == RequestFinish::kLength);
  CHECK(h2.wait().finish == RequestFinish::kLength);
  CHECK(h1.wait().metrics.decode_executor == "B");
  // Both finished, so both hand-offs arrived: nothing is counted on B any more.
  auto h3 = sched.submit(req(8, 3));
  CHECK(h3.wait().finish == RequestFinish::kLength);
  {
    std::lock_guard<std::mutex> lk(policy->mu);
    const ExecutorView& host = policy->views.back()[1];
    CHECK(host.queued == 0);  // (running may lag: a loop counts it after its step)
  }
  sched.drain();
  for (auto* s : {sa.get(), sb.get()}) {
    CHECK(s->usage(KvTier::kHost).used == 0);
    CHECK(s->usage(KvTier::kHost).reserved == 0);
  }
}

TEST_CASE("a token-scaled step costs the k modelled steps it stands for", "[perf_model][signals]") {
  const ModelProfile big = ModelProfile::from_shape(model_shape("qwen-27b-class"));
  auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  auto store = test::make_store(model->hparams(), 64);
  KvSequence kv1(*store, 512), kv2(*store, 512);
  const std::vector<int32_t> one{5}, ten(10, 7);
  for (const char* proc : {"l40s", "epyc32"}) {
    const PerfModel pm(processor_profile(proc), big);
    for (int32_t k : {1, 4, 32}) {
      INFO(proc << " k " << k);
      // Two decodes at real positions 100 and 300 (the SequenceStep's pos0 is what counts).
      const SequenceStep dec[2] = {{&kv1, one, 100, LogitsRows::kLast}, {&kv2, one, 300, LogitsRows::kLast}};
      double expect = 0;
      for (int32_t j = 0; j < k; ++j) {
        StepShape s = StepShape::single(int64_t{k} * 100 + j, 1);
        s += StepShape::single(int64_t{k} * 300 + j, 1);
        expect += pm.step_seconds(s);
      }
      CHECK(pm.scaled_step_seconds(dec, k) == Approx(expect));
      // A 10-token prompt chunk at real position 20: k steps of 10 tokens from 20 k.
      const SequenceStep pre[1] = {{&kv1, ten, 20, LogitsRows::kLast}};
      expect = 0;
      for (int32_t j = 0; j < k; ++j)
        expect += pm.step_seconds(StepShape::single(int64_t{k} * 20 + int64_t{j} * 10, 10));
      CHECK(pm.scaled_step_seconds(pre, k) == Approx(expect));
    }
  }
}

TEST_CASE("with a batch TPOT target a long batch decode goes to a host that meets it", "[routing][signals]") {
  DefaultRoutingOptions o;
  o.tpot_target_s[int(SlaClass::kBatch)] = 1.0;
  DefaultRoutingPolicy pol(o);
  auto v = gpu_cpu();  // neither slots nor KV are short on the accelerator ...
  v[0].running = 1;    // ... which decodes more sequences than the idle host (batch_host_balance)
  const auto d = pol.route(input(SlaClass::kBatch, 400, 64), v);
  CHECK(d.rule == "R5");
  CHECK(d.prefill == 0);
  CHECK(d.decode == 1);
  CHECK(pol.route(input(SlaClass::kStandard, 400, 64), v).rule == "R4");  // only batch
  v[1].model_tpot_s = 1.5;                                                // the host would miss it
  CHECK(pol.route(input(SlaClass::kBatch, 400, 64), v).rule == "R4");
  CHECK(DefaultRoutingPolicy().route(input(SlaClass::kBatch, 400, 64), gpu_cpu()).rule == "R4");  // no target
  o.handoff_batch_decode = false;
  CHECK(DefaultRoutingPolicy(o).route(input(SlaClass::kBatch, 400, 64), gpu_cpu()).rule == "R4");
}
