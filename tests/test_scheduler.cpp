// Scheduler end-to-end on real executors (two CpuQ4Executor pools, "cpu+cpu"): field case
// B18 and its mirror, parity with solo runs (greedy, including KV hand-offs between
// executors and prefix sharing), cancellations at every stage, back-pressure, deadlines,
// sessions with an SLA upgrade, the pollable handle, metrics, and a 1000-request stress
// counting terminal events. After every scenario the stores hold zero pages.
#include <catch2/catch.hpp>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include <nlohmann/json.hpp>

#include "tandem/sched/scheduler.hpp"

#include "cancel_storm.hpp"
#include "file_size_limit.hpp"
#include "kv_test_support.hpp"

using namespace tandem;
using namespace std::chrono_literals;

namespace {

std::shared_ptr<const Model> tiny() {
  static std::shared_ptr<const Model> m = Model::load(test::model_path("aidreams260K-q4_0"));
  return m;
}

constexpr int32_t kCtx = 256;

/// Two CPU executors with split thread pools; executor 0 plays the accelerator.
struct Rig {
  std::shared_ptr<const Model> model = tiny();
  CpuQ4Executor a{model, CpuExecutorOptions{1}};
  CpuQ4Executor b{model, CpuExecutorOptions{1}};
  std::shared_ptr<KvStore> sa, sb;
  std::unique_ptr<Scheduler> sched;
  std::vector<std::string> log;
  std::mutex log_mu;

  struct Opt {
    int n_exec = 2;
    int32_t max_running = 8;
    int32_t max_queued = 1024;
    int32_t host_pages = 256;
    int32_t host_pages_a = 0;  // executor 0's Host tier when different (0 = host_pages)
    int32_t admission_output = -1;
    std::chrono::milliseconds handoff_ttl{30000};
    Executor* exec_a = nullptr;  // replaces executor 0 (e.g. a fault-injecting wrapper)
    int32_t file_pages = 0;
    int32_t prefix_cache = 0;
    int32_t prefill_chunk = 32;
    int32_t budget = 64;
    DefaultRoutingOptions routing{};
  };

  explicit Rig(const Opt& o) {
    const auto& hp = model->hparams();
    sa = test::make_store(hp, o.host_pages_a > 0 ? o.host_pages_a : o.host_pages, o.file_pages);
    sb = test::make_store(hp, o.host_pages, o.file_pages);
    SchedulerOptions so;
    so.max_queued = o.max_queued;
    so.max_context = kCtx;
    so.prefix_cache_entries = o.prefix_cache;
    so.handoff_ttl = o.handoff_ttl;
    so.policy = std::make_shared<DefaultRoutingPolicy>(o.routing);
    so.log = [this](std::string_view s) {
      std::lock_guard<std::mutex> lk(log_mu);
      log.emplace_back(s);
    };
    ExecutorConfig ca;
    ca.executor = o.exec_a ? o.exec_a : &a;
    ca.admission_output_tokens = o.admission_output;
    ca.store = sa;
    ca.max_running = o.max_running;
    ca.step_token_budget = o.budget;
    ca.prefill_chunk = o.prefill_chunk;
    ca.accelerator = true;
    ca.name = "cpuA";
    so.executors.push_back(ca);
    if (o.n_exec > 1) {
      ExecutorConfig cb = ca;
      cb.executor = &b;
      cb.store = sb;
      cb.accelerator = false;
      cb.name = "cpuB";
      so.executors.push_back(cb);
    }
    sched = std::make_unique<Scheduler>(std::move(so));
  }
  bool logged(std::string_view what) {
    std::lock_guard<std::mutex> lk(log_mu);
    return std::any_of(log.begin(), log.end(), [&](const std::string& l) { return l.find(what) != l.npos; });
  }
  /// Everything finished and released: zero pages in every tier of both stores.
  void check_released() {
    sched->drain();
    sched->clear_prefix_cache();
    for (auto* s : {sa.get(), sb.get()}) {
      for (KvTier t : {KvTier::kHost, KvTier::kFile}) {
        if (!s->has_tier(t)) continue;
        INFO("tier " << kv_tier_name(t));
        CHECK(s->usage(t).used == 0);
        CHECK(s->usage(t).reserved == 0);
      }
    }
  }
};

/// The solo reference: the same prompt and options through a Session alone.
std::vector<int32_t> solo(const std::vector<int32_t>& prompt, int32_t max_tokens, bool ignore_eos = true) {
  static CpuQ4Executor ex(tiny(), CpuExecutorOptions{1});
  static std::map<std::pair<std::vector<int32_t>, std::pair<int32_t, bool>>, std::vector<int32_t>> memo;
  static std::mutex mu;
  std::lock_guard<std::mutex> lk(mu);
  auto key = std::make_pair(prompt, std::make_pair(max_tokens, ignore_eos));
  if (auto it = memo.find(key); it != memo.end()) return it->second;
  SessionOptions so;
  so.n_ctx = kCtx;
  Session s(tiny(), ex, so);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.max_tokens = max_tokens;
  go.ignore_eos = ignore_eos;
  auto r = s.generate(std::span<const int32_t>(prompt), go).tokens;
  memo[key] = r;
  return r;
}

std::vector<int32_t> prompt_of(int32_t n, int32_t salt = 0) {
  auto ids = test::prompt_ids(n, tiny()->hparams().n_vocab);
  for (size_t i = 1; i < ids.size(); ++i) ids[i] = 3 + (ids[i] + salt * 7) % (tiny()->hparams().n_vocab - 3);
  return ids;
}

Request greedy_request(std::vector<int32_t> prompt, int32_t max_tokens, SlaClass sla = SlaClass::kStandard) {
  Request r;
  r.prompt_ids = std::move(prompt);
  r.max_tokens = max_tokens;
  r.ignore_eos = true;
  r.sla = sla;
  return r;
}

}  // namespace

TEST_CASE("B18: cancelling or timing out a queued request touches only it", "[scheduler][B18]") {
  Rig::Opt o;
  o.n_exec = 1;
  o.max_running = 1;  // max concurrency 1
  Rig rig(o);
  const auto pa = prompt_of(12, 1), pb = prompt_of(9, 2);
  const auto expect_a = solo(pa, 64);
  const bool use_timeout = GENERATE(false, true);
  INFO((use_timeout ? "B's timeout expires" : "B is cancelled"));

  RequestHandle hb;
  std::atomic<int> a_tokens{0};
  std::atomic<bool> b_ready{false};
  Request ra = greedy_request(pa, 64);
  ra.on_event = [&](const RequestEvent& ev) {
    if (!ev.final && ++a_tokens == 10 && !use_timeout) {
      while (!b_ready.load()) std::this_thread::yield();
      rig.sched->cancel(hb);  // at A's 10th token
    }
    if (use_timeout) std::this_thread::sleep_for(1ms);  // A runs >= 64 ms
    return true;
  };
  auto ha = rig.sched->submit(std::move(ra));
  Request rb = greedy_request(pb, 16);
  if (use_timeout) rb.deadline = Clock::now() + 20ms;
  hb = rig.sched->submit(std::move(rb));
  b_ready = true;

  const auto& A = ha.wait();
  const auto& B = hb.wait();
  CHECK(A.finish == RequestFinish::kLength);
  CHECK(A.tokens == expect_a);
  CHECK(B.finish == (use_timeout ? RequestFinish::kTimeout : RequestFinish::kCancelled));
  CHECK(B.tokens.empty());
  CHECK(B.metrics.prefill_executor.empty());  // never started
  CHECK(B.metrics.generated_tokens == 0);
  rig.check_released();
}

TEST_CASE("B18 mirror: cancelling the running request lets the queued one run to completion", "[scheduler][B18]") {
  Rig::Opt o;
  o.n_exec = 1;
  o.max_running = 1;
  Rig rig(o);
  const auto pa = prompt_of(12, 1), pb = prompt_of(9, 2);
  const auto expect_a = solo(pa, 64), expect_b = solo(pb, 32);
  RequestHandle ha;
  std::atomic<bool> a_ready{false};
  std::atomic<int> a_tokens{0};
  Request ra = greedy_request(pa, 64);
  ra.on_event = [&](const RequestEvent& ev) {
    if (!ev.final && ++a_tokens == 10) {
      while (!a_ready.load()) std::this_thread::yield();
      rig.sched->cancel(ha);
    }
    return true;
  };
  ha = rig.sched->submit(std::move(ra));
  a_ready = true;
  auto hb = rig.sched->submit(greedy_request(pb, 32));
  const auto& A = ha.wait();
  const auto& B = hb.wait();
  CHECK(A.finish == RequestFinish::kCancelled);
  REQUIRE(A.tokens.size() >= 10);
  CHECK(A.tokens.size() <= 11);  // stops within one step
  CHECK(std::equal(A.tokens.begin(), A.tokens.end(), expect_a.begin()));
  CHECK(B.finish == RequestFinish::kLength);
  CHECK(B.tokens == expect_b);
  rig.check_released();
}

TEST_CASE("mixed concurrent requests on cpu+cpu produce the solo tokens, hand-offs included", "[scheduler][parity]") {
  Rig::Opt o;
  o.max_running = 6;
  o.routing.long_prompt_tokens = 40;       // "long" for the tiny model
  o.routing.decode_scarce_fraction = 0.0;  // always scarce: long standard prompts hand off
  o.prefix_cache = 2;
  Rig rig(o);
  struct Case {
    std::vector<int32_t> prompt;
    int32_t n;
    SlaClass sla;
    bool ignore_eos;
  };
  std::vector<Case> cases;
  std::mt19937 rng(7);
  for (int i = 0; i < 36; ++i) {
    const int32_t len = 2 + int32_t(rng() % 120);
    const int32_t n = 1 + int32_t(rng() % 40);
    cases.push_back({prompt_of(len, i % 9), n, SlaClass(i % 3), i % 5 != 0});
  }
  std::vector<RequestHandle> hs(cases.size());
  std::vector<std::thread> th;
  for (int t = 0; t < 4; ++t) {
    th.emplace_back([&, t] {
      for (size_t i = size_t(t); i < cases.size(); i += 4) {
        Request r = greedy_request(cases[i].prompt, cases[i].n, cases[i].sla);
        r.ignore_eos = cases[i].ignore_eos;
        hs[i] = rig.sched->submit(std::move(r));
      }
    });
  }
  for (auto& t : th) t.join();
  int handed_off = 0;
  for (size_t i = 0; i < cases.size(); ++i) {
    const auto& r = hs[i].wait();
    INFO("case " << i << " route " << r.route);
    CHECK((r.finish == RequestFinish::kLength || r.finish == RequestFinish::kStop));
    CHECK(r.tokens == solo(cases[i].prompt, cases[i].n, cases[i].ignore_eos));
    if (r.metrics.migrations > 0) {
      ++handed_off;
      CHECK(r.metrics.prefill_executor != r.metrics.decode_executor);
      CHECK(r.metrics.migration_bytes > 0);
    }
  }
  CHECK(handed_off > 0);
  const auto m = rig.sched->metrics();
  CHECK(m.migrations == uint64_t(handed_off));
  CHECK(m.executors.size() == 2);
  CHECK(m.executors[0].steps > 0);
  CHECK(m.executors[1].steps > 0);
  rig.check_released();
}

TEST_CASE("requests sharing a prefix reuse its KV pages and still match solo runs", "[scheduler][prefix]") {
  Rig::Opt o;
  o.n_exec = 1;
  o.prefix_cache = 4;
  Rig rig(o);
  const auto system = prompt_of(50, 3);
  std::vector<std::vector<int32_t>> prompts;
  for (int i = 0; i < 5; ++i) {
    auto p = system;
    for (int k = 0; k < 3 + i; ++k) p.push_back(10 + i * 5 + k);
    prompts.push_back(p);
  }
  // The first computes the prefix; the rest (submitted after) share it.
  auto first = rig.sched->submit(greedy_request(prompts[0], 12));
  CHECK(first.wait().tokens == solo(prompts[0], 12));
  std::vector<RequestHandle> hs;
  for (size_t i = 1; i < prompts.size(); ++i) hs.push_back(rig.sched->submit(greedy_request(prompts[i], 12)));
  for (size_t i = 1; i < prompts.size(); ++i) {
    const auto& r = hs[i - 1].wait();
    CHECK(r.tokens == solo(prompts[i], 12));
    CHECK(r.metrics.prefix_reused_tokens == 48);  // whole pages of the 50-token prefix
  }
  const auto m = rig.sched->metrics();
  CHECK(m.prefix_reused_tokens == 4 * 48);
  CHECK(m.prefix_hit_rate > 0.5);
  rig.check_released();
}

TEST_CASE("cancellations injected at every stage leave zero KV pages and one terminal event each",
          "[scheduler][lifecycle]") {
  Rig::Opt o;
  o.max_running = 4;
  o.routing.long_prompt_tokens = 30;
  o.routing.decode_scarce_fraction = 0.0;
  o.prefix_cache = 2;
  Rig rig(o);
  std::mt19937 rng(11);
  test::CancelStorm storm(120);
  storm.submit(*rig.sched, rng, 12, 300, [&](int i) {
    return greedy_request(prompt_of(2 + int32_t(rng() % 90), i % 5), 4 + int32_t(rng() % 16), SlaClass(i % 3));
  });
  rig.check_released();
  CHECK(storm.check_and_count_cancelled() > 10);
}

TEST_CASE("a full queue answers overloaded; deadlines answer timeout", "[scheduler][admission]") {
  SECTION("overloaded") {
    Rig::Opt o;
    o.n_exec = 1;
    o.max_running = 1;
    o.max_queued = 2;
    Rig rig(o);
    std::atomic<bool> release{false};
    Request slow = greedy_request(prompt_of(5), 8);
    slow.on_event = [&](const RequestEvent&) {
      while (!release.load()) std::this_thread::sleep_for(1ms);
      return true;
    };
    auto h0 = rig.sched->submit(std::move(slow));
    while (rig.sched->metrics().executors[0].running == 0) std::this_thread::sleep_for(1ms);
    std::vector<RequestHandle> hs;
    for (int i = 0; i < 4; ++i) hs.push_back(rig.sched->submit(greedy_request(prompt_of(5, i), 4)));
    CHECK(hs[2].done());
    CHECK(hs[2].wait().finish == RequestFinish::kOverloaded);
    CHECK(hs[3].wait().finish == RequestFinish::kOverloaded);
    CHECK_THAT(hs[3].wait().message, Catch::Contains("overloaded"));
    release = true;
    CHECK(h0.wait().finish == RequestFinish::kLength);
    CHECK(hs[0].wait().finish == RequestFinish::kLength);
    CHECK(hs[1].wait().finish == RequestFinish::kLength);
    rig.check_released();
  }
  SECTION("timeout while decoding and while queued") {
    Rig::Opt o;
    o.n_exec = 1;
    o.max_running = 1;
    Rig rig(o);
    Request r = greedy_request(prompt_of(6), 200);
    r.deadline = Clock::now() + 40ms;
    r.on_event = [](const RequestEvent&) {
      std::this_thread::sleep_for(1ms);
      return true;
    };
    auto h = rig.sched->submit(std::move(r));
    Request q = greedy_request(prompt_of(6, 1), 4);
    q.deadline = Clock::now() + 10ms;
    auto hq = rig.sched->submit(std::move(q));
    const auto& res = h.wait();
    CHECK(res.finish == RequestFinish::kTimeout);
    CHECK(res.tokens.size() < 200);
    CHECK(!res.tokens.empty());
    CHECK(std::equal(res.tokens.begin(), res.tokens.end(), solo(prompt_of(6), 200).begin()));
    CHECK(hq.wait().finish == RequestFinish::kTimeout);
    rig.check_released();
  }
  SECTION("invalid requests end with an error event") {
    Rig::Opt o;
    o.n_exec = 1;
    Rig rig(o);
    Request bad = greedy_request({1, 999999}, 4);
    CHECK(rig.sched->submit(std::move(bad)).wait().finish == RequestFinish::kError);
    Request too_long = greedy_request(prompt_of(kCtx + 1), 4);
    const RequestResult r = rig.sched->submit(std::move(too_long)).wait();
    CHECK(r.finish == RequestFinish::kError);
    CHECK(r.error == ErrorCode::kContextOverflow);
    rig.check_released();
  }
}

TEST_CASE("KV capacity is reserved at admission; a full tier queues instead of failing", "[scheduler][admission]") {
  Rig::Opt o;
  o.n_exec = 1;
  o.host_pages = 6;  // room for about one request at a time
  o.max_running = 4;
  Rig rig(o);
  std::vector<RequestHandle> hs;
  for (int i = 0; i < 5; ++i) hs.push_back(rig.sched->submit(greedy_request(prompt_of(30, i), 40)));
  for (int i = 0; i < 5; ++i) {
    const auto& r = hs[size_t(i)].wait();
    CHECK(r.finish == RequestFinish::kLength);
    CHECK(r.tokens == solo(prompt_of(30, i), 40));
  }
  // A request larger than the whole tier fails clearly instead of blocking the queue.
  const RequestResult big = rig.sched->submit(greedy_request(prompt_of(60), 100)).wait();
  CHECK(big.finish == RequestFinish::kError);
  CHECK(big.error == ErrorCode::kOutOfMemory);
  rig.check_released();
}

TEST_CASE("sessions continue, swap out when idle, and migrate on an SLA upgrade", "[scheduler][session]") {
  Rig::Opt o;
  o.file_pages = 64;
  Rig rig(o);
  const auto p1 = prompt_of(10, 4);
  const std::vector<int32_t> p2{20, 21, 22, 23};
  const std::vector<int32_t> p3{30, 31};
  // Reference: one Session, three turns.
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
  const auto e3 = ref.generate(std::span<const int32_t>(p3), go).tokens;

  const uint64_t sid = rig.sched->open_session();
  Request r1 = greedy_request(p1, 8, SlaClass::kStandard);
  r1.session = sid;
  const RequestResult a = rig.sched->submit(std::move(r1)).wait();
  CHECK(a.tokens == e1);
  CHECK(a.metrics.decode_executor == "cpuB");  // short standard: the host executor
  // Idle session KV goes down a tier and comes back on use.
  CHECK(rig.sb->evict_lru(KvTier::kHost, KvTier::kFile, 100) > 0);
  CHECK(rig.sb->usage(KvTier::kFile).used > 0);
  Request r2 = greedy_request(p2, 8, SlaClass::kStandard);
  r2.session = sid;
  const RequestResult b = rig.sched->submit(std::move(r2)).wait();
  CHECK(b.tokens == e2);
  CHECK(b.metrics.migrations == 0);
  // SLA upgrade: interactive continues on the accelerator after one KV move.
  Request r3 = greedy_request(p3, 8, SlaClass::kInteractive);
  r3.session = sid;
  const RequestResult c = rig.sched->submit(std::move(r3)).wait();
  CHECK(c.tokens == e3);
  CHECK(c.metrics.migrations == 1);
  CHECK(c.metrics.decode_executor == "cpuA");
  CHECK_THAT(c.route, Catch::Contains("SLA upgrade"));
  // A session runs one request at a time.
  rig.sched->close_session(sid);
  Request r4 = greedy_request(p3, 2);
  r4.session = sid;
  CHECK(rig.sched->submit(std::move(r4)).wait().finish == RequestFinish::kError);
  rig.check_released();
}

TEST_CASE("an explicitly parked session continues bit-exact after its KV went to File and back",
          "[scheduler][session]") {
  Rig::Opt o;
  o.file_pages = 64;
  Rig rig(o);
  const auto p1 = prompt_of(10, 4);
  const std::vector<int32_t> p2{20, 21, 22, 23};
  const std::vector<int32_t> p3{30, 31};
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
  const auto e3 = ref.generate(std::span<const int32_t>(p3), go).tokens;

  const uint64_t sid = rig.sched->open_session();
  KvMoveStats st;
  CHECK(rig.sched->park_session(sid, &st));  // no KV yet: nothing moves
  CHECK(st.pages == 0);
  const std::vector<int32_t>* prompts[3] = {&p1, &p2, &p3};
  const std::vector<int32_t>* expect[3] = {&e1, &e2, &e3};
  for (int i = 0; i < 3; ++i) {
    Request r = greedy_request(*prompts[i], 8, SlaClass::kStandard);
    r.session = sid;
    const RequestResult res = rig.sched->submit(std::move(r)).wait();
    CHECK(res.tokens == *expect[i]);
    CHECK(res.metrics.migrations == 0);
    const Scheduler::SessionInfo before = rig.sched->session_info(sid);
    REQUIRE(before.executor >= 0);
    CHECK(before.kv_tokens == before.n_tokens - 1);
    const int32_t pages = before.pages[int(KvTier::kHost)];
    CHECK(pages > 0);
    CHECK(rig.sched->park_session(sid, &st));
    CHECK(st.pages == pages);
    const Scheduler::SessionInfo parked = rig.sched->session_info(sid);
    CHECK(parked.pages[int(KvTier::kHost)] == 0);
    CHECK(parked.pages[int(KvTier::kFile)] == pages);
    if (i == 1) {
      CHECK(rig.sched->unpark_session(sid, &st));
      CHECK(st.pages == pages);
      CHECK(rig.sched->session_info(sid).pages[int(KvTier::kHost)] == pages);
    }
  }
  rig.sched->close_session(sid);
  CHECK_THROWS_AS(rig.sched->park_session(sid), Error);
  CHECK_THROWS_AS(rig.sched->session_info(sid), Error);
  rig.check_released();
}

namespace {

RequestResult session_turn(Scheduler& sched, uint64_t sid, const std::vector<int32_t>& prompt) {
  Request r = greedy_request(prompt, 8);
  r.session = sid;
  r.logprobs = 0;
  return RequestResult(sched.submit(std::move(r)).wait());
}

uint32_t bits_of(float f) {
  uint32_t u = 0;
  std::memcpy(&u, &f, sizeof(u));
  return u;
}

std::string file_text(const std::filesystem::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

}  // namespace

TEST_CASE("a saved scheduler session restores and continues bit-exact, and Session files travel both ways",
          "[scheduler][session][session-file]") {
  Rig::Opt o;
  o.file_pages = 64;
  Rig rig(o);
  const auto dir = test::scratch_dir("scheduler-session-file");
  const auto p1 = prompt_of(10, 4);
  const std::vector<int32_t> p2{20, 21, 22, 23};
  // Reference: a Session, two turns, saved between them.
  CpuQ4Executor ex(tiny(), CpuExecutorOptions{1});
  SessionOptions so;
  so.n_ctx = kCtx;
  Session ref(tiny(), ex, so);
  GenerateOptions go;
  go.sampling = SamplingParams::greedy();
  go.ignore_eos = true;
  go.max_tokens = 8;
  const auto e1 = ref.generate(std::span<const int32_t>(p1), go).tokens;
  ref.save(dir / "ref.session");
  const auto e2 = ref.generate(std::span<const int32_t>(p2), go).tokens;

  const uint64_t live = rig.sched->open_session();
  CHECK(session_turn(*rig.sched, live, p1).tokens == e1);
  const Scheduler::SessionInfo saved = rig.sched->session_info(live);
  REQUIRE(rig.sched->save_session(live, dir / "s.session"));
  const RequestResult never_saved = session_turn(*rig.sched, live, p2);
  CHECK(never_saved.tokens == e2);
  REQUIRE(never_saved.logprobs.size() == e2.size());
  for (int executor : {saved.executor, 1 - saved.executor}) {
    INFO("restored on executor " << executor);
    const uint64_t back = rig.sched->restore_session(dir / "s.session", executor);
    CHECK(back != live);
    const Scheduler::SessionInfo info = rig.sched->session_info(back);
    CHECK(info.executor == executor);
    CHECK(info.n_tokens == saved.n_tokens);
    CHECK(info.kv_tokens == saved.kv_tokens);
    CHECK(info.kv_tokens == info.n_tokens - 1);                                // the last sampled token is pending
    CHECK(info.pages[int(KvTier::kHost)] == saved.pages[int(KvTier::kHost)]);  // room: the compute tier
    const RequestResult r = session_turn(*rig.sched, back, p2);
    CHECK(r.tokens == never_saved.tokens);
    REQUIRE(r.logprobs.size() == never_saved.logprobs.size());
    for (size_t i = 0; i < r.logprobs.size(); ++i) {
      INFO("token " << i);
      CHECK(bits_of(r.logprobs[i].logprob) == bits_of(never_saved.logprobs[i].logprob));
    }
    rig.sched->close_session(back);
  }
  // A Session's file continues in the scheduler; the scheduler's file in a Session.
  const uint64_t from_session = rig.sched->restore_session(dir / "ref.session", 1);
  CHECK(rig.sched->session_info(from_session).n_tokens == saved.n_tokens);
  CHECK(session_turn(*rig.sched, from_session, p2).tokens == e2);
  Session s2(tiny(), ex, so);
  s2.restore(dir / "s.session");
  CHECK(s2.tokens().size() == size_t(saved.kv_tokens));
  CHECK(s2.logits().empty());  // the scheduler keeps no logits: the pending token is fed first
  CHECK(s2.generate(std::span<const int32_t>(p2), go).tokens == e2);
  rig.sched->close_session(from_session);
  rig.sched->close_session(live);
  rig.check_released();
}

TEST_CASE("a restored scheduler session's KV lands in File when the compute tier is full; it continues",
          "[scheduler][session][session-file]") {
  Rig::Opt o;
  o.n_exec = 1;
  o.host_pages = 4;
  o.file_pages = 16;
  Rig rig(o);
  const auto dir = test::scratch_dir("scheduler-session-file-tier");
  const auto p1 = prompt_of(30, 2);  // 30 + 8 positions: 3 pages
  const uint64_t sid = rig.sched->open_session();
  const RequestResult first = session_turn(*rig.sched, sid, p1);
  REQUIRE(rig.sched->save_session(sid, dir / "s.session"));
  const std::vector<int32_t> p2{40, 41};
  const RequestResult second = session_turn(*rig.sched, sid, p2);
  REQUIRE(second.tokens.size() == 8);
  // The live session's 3 Host pages leave 1: the restored KV goes to File (parked).
  CHECK(rig.sa->usage(KvTier::kHost).free() < 3);
  const uint64_t back = rig.sched->restore_session(dir / "s.session");
  const Scheduler::SessionInfo info = rig.sched->session_info(back);
  CHECK(info.pages[int(KvTier::kFile)] == 3);
  CHECK(info.pages[int(KvTier::kHost)] == 0);
  rig.sched->close_session(sid);  // room again: the next request brings it up
  const RequestResult r = session_turn(*rig.sched, back, p2);
  CHECK(r.tokens == second.tokens);
  rig.sched->close_session(back);
  rig.check_released();
}

TEST_CASE("scheduler session files: busy, unknown and closed sessions, foreign, corrupt and long files, full disk",
          "[scheduler][session][session-file]") {
  Rig::Opt o;
  o.file_pages = 64;
  Rig rig(o);
  const auto dir = test::scratch_dir("scheduler-session-file-errors");
  auto used_pages = [&] { return rig.sa->used_pages() + rig.sb->used_pages(); };
  const uint64_t sid = rig.sched->open_session();
  // A session that never ran saves and restores as an empty one.
  REQUIRE(rig.sched->save_session(sid, dir / "empty.session"));
  const uint64_t empty = rig.sched->restore_session(dir / "empty.session");
  CHECK(rig.sched->session_info(empty).n_tokens == 0);
  CHECK(rig.sched->session_info(empty).kv_tokens == 0);
  rig.sched->close_session(empty);

  const auto p1 = prompt_of(10, 4);
  CHECK(session_turn(*rig.sched, sid, p1).finish == RequestFinish::kLength);
  REQUIRE(rig.sched->save_session(sid, dir / "s.session"));
  const std::string saved = file_text(dir / "s.session");
  REQUIRE(saved.size() > 100);

  // Busy: a request holds the session (its callback waits): nothing is written.
  {
    std::atomic<bool> entered{false}, release{false};
    Request r = greedy_request({20, 21}, 4);
    r.session = sid;
    r.on_event = [&](const RequestEvent&) {
      entered = true;
      while (!release) std::this_thread::sleep_for(1ms);
      return true;
    };
    RequestHandle h = rig.sched->submit(std::move(r));
    while (!entered) std::this_thread::sleep_for(1ms);
    CHECK_FALSE(rig.sched->save_session(sid, dir / "s.session"));
    CHECK(file_text(dir / "s.session") == saved);
    release = true;
    CHECK(h.wait().finish == RequestFinish::kLength);
  }
  // A full disk: the session is longer now, its file does not fit; the old file stays.
  {
    test::FileSizeLimit full(saved.size());
    CHECK(test::code_of([&] { rig.sched->save_session(sid, dir / "s.session"); }) == ErrorCode::kIo);
  }
  CHECK(file_text(dir / "s.session") == saved);
  // Unknown session; a directory as the path.
  CHECK(test::code_of([&] { rig.sched->save_session(9999, dir / "x.session"); }) == ErrorCode::kInvalidArgument);
  CHECK_FALSE(std::filesystem::exists(dir / "x.session"));
  CHECK(test::code_of([&] { rig.sched->save_session(sid, dir); }) == ErrorCode::kInvalidArgument);

  // Restore refusals open nothing and leave no page allocated.
  const int32_t pages_before = used_pages();
  auto restore_code = [&](const std::filesystem::path& p, int executor = 0) {
    return test::code_of([&] { rig.sched->restore_session(p, executor); });
  };
  CHECK(restore_code(dir / "s.session", 2) == ErrorCode::kInvalidArgument);
  CHECK(restore_code(dir / "s.session", -1) == ErrorCode::kInvalidArgument);
  CHECK(restore_code(dir / "missing.session") == ErrorCode::kIo);
  {
    std::ofstream(dir / "text.session") << "not a session file at all, just some words";
    CHECK(restore_code(dir / "text.session") == ErrorCode::kSessionCorrupt);
    std::string flipped = saved;
    flipped[saved.size() / 2] = char(flipped[saved.size() / 2] ^ 0x10);
    std::ofstream(dir / "flipped.session", std::ios::binary) << flipped;
    CHECK(restore_code(dir / "flipped.session") == ErrorCode::kSessionCorrupt);
    std::ofstream(dir / "short.session", std::ios::binary) << saved.substr(0, saved.size() - 9);
    CHECK(restore_code(dir / "short.session") == ErrorCode::kSessionCorrupt);
  }
  {  // saved with other weights
    auto other = Model::load(test::model_path("stories260K-q4_0"));
    CpuQ4Executor ex(other, CpuExecutorOptions{1});
    Session s(other, ex);
    s.eval(std::span<const int32_t>(p1));
    s.save(dir / "other.session");
    CHECK(restore_code(dir / "other.session") == ErrorCode::kSessionModelMismatch);
  }
  {  // more evaluated positions than the scheduler's context
    CpuQ4Executor ex(tiny(), CpuExecutorOptions{1});
    SessionOptions so;
    so.n_ctx = kCtx * 2;
    Session s(tiny(), ex, so);
    const auto ids = test::prompt_ids(kCtx + 8, tiny()->hparams().n_vocab);
    s.eval(std::span<const int32_t>(ids));
    s.save(dir / "long.session");
    CHECK(restore_code(dir / "long.session") == ErrorCode::kContextOverflow);
  }
  CHECK(used_pages() == pages_before);
  // A closed session is gone.
  rig.sched->close_session(sid);
  CHECK(test::code_of([&] { rig.sched->save_session(sid, dir / "s.session"); }) == ErrorCode::kInvalidArgument);
  CHECK(file_text(dir / "s.session") == saved);
  rig.check_released();
}

TEST_CASE("the pollable handle streams every piece; text matches; metrics render", "[scheduler][stream]") {
  Rig::Opt o;
  Rig rig(o);
  Request r;
  r.prompt_text = "Once upon a time";
  r.max_tokens = 40;
  r.sla = SlaClass::kInteractive;
  auto h = rig.sched->submit(std::move(r));
  std::string streamed, buf;
  RequestEvent ev;
  int finals = 0, n_tokens = 0;
  while (finals == 0) {
    if (!h.poll(ev, buf)) {
      std::this_thread::sleep_for(100us);
      continue;
    }
    streamed += buf;
    if (ev.final)
      ++finals;
    else
      ++n_tokens;
  }
  CHECK(!h.poll(ev, buf));
  const auto& res = h.wait();
  CHECK(streamed == res.text);
  CHECK(n_tokens == int(res.tokens.size()));
  CHECK(!res.text.empty());
  CHECK(res.metrics.ttft_s > 0);
  CHECK(res.metrics.e2e_s >= res.metrics.ttft_s);
  const auto m = rig.sched->metrics();
  const auto j = nlohmann::json::parse(m.to_json());
  CHECK(j["submitted"] == 1);
  CHECK(j["executors"].size() == 2);
  CHECK(m.to_text().find("cpuA") != std::string::npos);
  {
    std::lock_guard<std::mutex> lk(rig.log_mu);
    REQUIRE(!rig.log.empty());
    CHECK_THAT(rig.log[0], Catch::Contains("route req=1") && Catch::Contains("R6"));
  }
  rig.check_released();
}

TEST_CASE("stress: 1000 requests, exactly one terminal event each, zero KV after", "[scheduler][stress]") {
  Rig::Opt o;
  o.max_running = 8;
  o.max_queued = 400;
  o.routing.long_prompt_tokens = 24;
  o.routing.decode_scarce_fraction = 0.5;
  o.prefix_cache = 2;
  Rig rig(o);
  const int N = 1000, T = 4;
  std::vector<RequestHandle> hs(N);
  std::vector<std::atomic<int>> finals(N);
  std::atomic<int> events{0};
  std::vector<std::thread> th;
  for (int t = 0; t < T; ++t) {
    th.emplace_back([&, t] {
      std::mt19937 rng(uint32_t(100 + t));
      for (int i = t; i < N; i += T) {
        Request r =
            greedy_request(prompt_of(2 + int32_t(rng() % 40), i % 7), 1 + int32_t(rng() % 5), SlaClass(rng() % 3));
        if (rng() % 10 == 0) r.deadline = Clock::now() + std::chrono::microseconds(rng() % 2000);
        r.on_event = [&, i](const RequestEvent& ev) {
          ++events;
          if (ev.final) ++finals[size_t(i)];
          return true;
        };
        hs[size_t(i)] = rig.sched->submit(std::move(r));
        if (rng() % 8 == 0) rig.sched->cancel(hs[size_t(i)]);
      }
    });
  }
  for (auto& t : th) t.join();
  rig.check_released();
  std::map<RequestFinish, int> by;
  for (int i = 0; i < N; ++i) {
    REQUIRE(hs[size_t(i)].done());
    CHECK(finals[size_t(i)].load() == 1);
    by[hs[size_t(i)].wait().finish]++;
  }
  const auto m = rig.sched->metrics();
  CHECK(m.submitted == uint64_t(N));
  CHECK(m.finished == uint64_t(N));
  CHECK(by[RequestFinish::kLength] > 0);
  CHECK(by[RequestFinish::kCancelled] > 0);
}

namespace {

/// Runs `inner`, but throws std::bad_alloc from the step numbered `fail_at` (0-based): an
/// allocation failure inside a step, as the executor's scratch growth can raise.
class FaultyExecutor final : public Executor {
 public:
  explicit FaultyExecutor(Executor& inner) : Executor(inner.model_ptr()), inner_(inner) {}
  std::string_view name() const noexcept override { return "faulty"; }
  KvTier kv_tier() const noexcept override { return inner_.kv_tier(); }
  bool can_read(KvTier t) const noexcept override { return inner_.can_read(t); }
  bool supports(KvDtype d) const noexcept override { return inner_.supports(d); }
  std::atomic<int> fail_at{-1};
  std::atomic<int> steps{0};

 protected:
  void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) override {
    if (steps++ == fail_at.load()) throw std::bad_alloc();
    inner_.step(batch, logits);
  }

 private:
  Executor& inner_;
};

/// Resident set size of this process in bytes (/proc/self/statm).
size_t rss_bytes() {
  std::ifstream f("/proc/self/statm");
  size_t pages = 0, resident = 0;
  f >> pages >> resident;
  return resident * size_t(sysconf(_SC_PAGESIZE));
}

/// Poll `cond` every millisecond for at most `limit`; true when it held.
template <class Cond>
bool eventually(Cond cond, std::chrono::milliseconds limit = 10s) {
  const auto until = Clock::now() + limit;
  while (!cond()) {
    if (Clock::now() > until) return false;
    std::this_thread::sleep_for(1ms);
  }
  return true;
}

}  // namespace

// Fails on the main before this change: the exception escaped the step loop's thread
// (std::terminate, the test process died).
TEST_CASE("a throwing on_event callback ends only its request; the loop keeps serving", "[scheduler][robust]") {
  Rig::Opt o;
  o.n_exec = 1;
  Rig rig(o);
  const auto pa = prompt_of(12, 1), pb = prompt_of(9, 2);
  std::atomic<int> a_finals{0}, a_tokens{0};
  Request ra = greedy_request(pa, 20);
  ra.on_event = [&](const RequestEvent& ev) -> bool {
    if (ev.final) {
      ++a_finals;
      throw std::runtime_error("the final event's callback throws too");
    }
    if (++a_tokens == 3) throw std::runtime_error("callback failure");
    return true;
  };
  auto ha = rig.sched->submit(std::move(ra));
  auto hb = rig.sched->submit(greedy_request(pb, 24));
  const RequestResult A = ha.wait();
  CHECK(A.finish == RequestFinish::kError);
  CHECK_THAT(A.message, Catch::Contains("callback failure"));
  CHECK(A.tokens.size() == 3);
  CHECK(a_finals.load() == 1);
  CHECK(hb.wait().tokens == solo(pb, 24));
  // Still serving.
  CHECK(rig.sched->submit(greedy_request(pa, 8)).wait().tokens == solo(pa, 8));
  rig.check_released();
}

// Fails on the main before this change: std::bad_alloc from a step escaped the loop
// (std::terminate).
TEST_CASE("an allocation failure inside a step ends that step's requests; the loop keeps serving",
          "[scheduler][robust]") {
  Rig::Opt base;
  auto model = tiny();
  CpuQ4Executor inner(model, CpuExecutorOptions{1});
  FaultyExecutor faulty(inner);
  faulty.fail_at = 4;
  Rig::Opt o;
  o.n_exec = 1;
  o.max_running = 4;
  o.exec_a = &faulty;
  Rig rig(o);
  std::vector<RequestHandle> hs;
  std::vector<std::atomic<int>> finals(4);
  for (int i = 0; i < 4; ++i) {
    Request r = greedy_request(prompt_of(10 + i, i), 12);
    r.on_event = [&, i](const RequestEvent& ev) {
      if (ev.final) ++finals[size_t(i)];
      return true;
    };
    hs.push_back(rig.sched->submit(std::move(r)));
  }
  int failed = 0;
  for (int i = 0; i < 4; ++i) {
    const RequestResult& r = hs[size_t(i)].wait();
    CHECK(finals[size_t(i)].load() == 1);
    if (r.finish == RequestFinish::kError) {
      ++failed;
      CHECK(r.error == ErrorCode::kOutOfMemory);
      CHECK_THAT(r.message, Catch::Contains("bad_alloc") || Catch::Contains("allocation"));
    } else {
      CHECK(r.tokens == solo(prompt_of(10 + i, i), 12));
    }
  }
  CHECK(failed >= 1);
  CHECK(faulty.steps.load() > 4);  // the loop went on stepping
  CHECK(rig.sched->submit(greedy_request(prompt_of(7, 5), 10)).wait().tokens == solo(prompt_of(7, 5), 10));
  rig.check_released();
}

// Preemption under KV pressure. Admitting with only the prompt reserved
// (admission_output_tokens = 0) lets more sequences run than the tier can finish, so
// growing sequences preempt the youngest: swapped to File, or dropped and recomputed.
// Each step's batch is a value, so a sequence left out of a step never reads another's
// logits row; every output must equal its solo run.
TEST_CASE("preemption swaps out or recomputes, and every output equals its solo run", "[scheduler][preempt]") {
  const bool swap = GENERATE(false, true);
  INFO((swap ? "swap to the File tier" : "drop and recompute"));
  Rig::Opt o;
  o.n_exec = 1;
  o.max_running = 8;
  o.host_pages = 12;  // 192 positions for 8 sequences of up to 80
  o.file_pages = swap ? 128 : 0;
  o.admission_output = 0;
  o.budget = 24;  // the token budget leaves sequences out of some steps
  o.prefill_chunk = 16;
  Rig rig(o);
  std::vector<std::pair<std::vector<int32_t>, int32_t>> cases;
  for (int i = 0; i < 16; ++i) cases.emplace_back(prompt_of(10 + (i * 7) % 30, i), 20 + (i * 11) % 30);
  std::vector<RequestHandle> hs;
  for (const auto& [p, n] : cases) hs.push_back(rig.sched->submit(greedy_request(p, n)));
  for (size_t i = 0; i < cases.size(); ++i) {
    const RequestResult& r = hs[i].wait();
    INFO("case " << i);
    CHECK(r.finish == RequestFinish::kLength);
    CHECK(r.tokens == solo(cases[i].first, cases[i].second));
  }
  CHECK(rig.sched->metrics().preemptions > 0);
  CHECK(rig.logged(swap ? "swapped to file" : "KV dropped"));
  rig.check_released();
}

// Fails on the main before this change: the interactive request was routed to the
// accelerator, whose tier can never hold it, and ended with kOutOfMemory; the refusal
// said "needs 9 pages" for a request that needs 8.
TEST_CASE("routing offers only executors that can hold the request; refusals count pages right",
          "[scheduler][routing]") {
  const auto prompt = prompt_of(28, 3);
  SECTION("an executor that can hold it is chosen") {
    Rig::Opt o;
    o.host_pages_a = 4;  // cpuA (the accelerator) holds 64 positions
    Rig rig(o);
    const RequestResult r = rig.sched->submit(greedy_request(prompt, 100, SlaClass::kInteractive)).wait();
    CHECK(r.finish == RequestFinish::kLength);
    CHECK(r.tokens == solo(prompt, 100));
    CHECK(r.metrics.prefill_executor == "cpuB");
    CHECK(r.metrics.decode_executor == "cpuB");
    rig.check_released();
  }
  SECTION("no executor can: the refusal names the right page count") {
    Rig::Opt o;
    o.n_exec = 1;
    o.host_pages = 7;
    Rig rig(o);
    // 28 + 100 tokens: 127 positions hold KV (the last sampled token is never fed) = 8 pages.
    const RequestResult r = rig.sched->submit(greedy_request(prompt, 100)).wait();
    CHECK(r.finish == RequestFinish::kError);
    CHECK(r.error == ErrorCode::kOutOfMemory);
    CHECK_THAT(r.message, Catch::Contains("= 8 pages of 16 tokens") && Catch::Contains("holds 7 pages"));
    rig.check_released();
  }
}

// Fails on the main before this change: the lease's pages stayed in cpuA's store until
// the busy receiver looked at the hand-off again.
TEST_CASE("an expired hand-off lease returns its pages while the receiver is busy", "[scheduler][handoff]") {
  Rig::Opt o;
  o.routing.long_prompt_tokens = 20;
  o.routing.decode_scarce_fraction = 0.0;  // long standard prompts prefill on cpuA, decode on cpuB
  o.handoff_ttl = 50ms;
  Rig rig(o);
  std::atomic<bool> release{false};
  Request blocker = greedy_request(prompt_of(5, 1), 4);  // short standard: runs on cpuB
  blocker.on_event = [&](const RequestEvent&) {
    while (!release.load()) std::this_thread::sleep_for(1ms);
    return true;
  };
  auto hb = rig.sched->submit(std::move(blocker));
  REQUIRE(eventually([&] { return rig.sched->metrics().executors[1].running == 1; }));
  const auto long_prompt = prompt_of(40, 2);
  auto h = rig.sched->submit(greedy_request(long_prompt, 10));
  // Prefilled on cpuA and handed to the blocked cpuB: once the lease expires, cpuA's
  // store is empty although nobody imported or refused the hand-off.
  const bool returned = eventually([&] {
    const auto m = rig.sched->metrics();
    return m.executors[0].steps > 0 && m.executors[0].running == 0 && rig.sa->usage(KvTier::kHost).used == 0;
  });
  CHECK(returned);
  release = true;
  CHECK(hb.wait().finish == RequestFinish::kLength);
  const RequestResult& r = h.wait();
  CHECK(r.tokens == solo(long_prompt, 10));  // recomputed on cpuB
  CHECK(rig.logged("recomputing on cpuB"));
  rig.check_released();
}

// Issue 15 item 5. Fails on the main before this change: the event log was sized for the
// unclamped max_tokens (INT32_MAX: std::bad_alloc out of submit; 10^7: about 1 GB).
TEST_CASE("max_tokens far beyond the context is clamped: kLength at the context end, no big allocation",
          "[scheduler][sizes]") {
  Rig::Opt o;
  o.n_exec = 1;
  Rig rig(o);
  const auto prompt = prompt_of(200, 4);
  const int32_t max_tokens = GENERATE(10'000'000, INT32_MAX);
  const size_t rss0 = rss_bytes();
  Request r = greedy_request(prompt, max_tokens);
  std::atomic<bool> go{false};
  r.on_event = [&](const RequestEvent&) {
    while (!go.load()) std::this_thread::sleep_for(1ms);
    return true;
  };
  auto h = rig.sched->submit(std::move(r));
  // Measured while the request is alive: its buffers are sized for the context, not for
  // max_tokens (a 1 GB log would show; 64 MB is far above any context-sized buffer here).
  CHECK(rss_bytes() < rss0 + (size_t(64) << 20));
  go = true;
  const RequestResult& res = h.wait();
  CHECK(res.finish == RequestFinish::kLength);
  CHECK(res.tokens.size() == size_t(kCtx - 200 + 1));  // the last sampled token needs no KV
  CHECK(res.tokens == solo(prompt, kCtx - 200 + 1));
  rig.check_released();
}

// Issue 12 item 6: one generation loop. Session::generate and a scheduler request run the
// same per-token logic (lib/session/generation.hpp): for each case the tokens, the text, the
// streamed pieces and the finish reason agree — stop strings (held back, then cut), an
// end-of-generation token, the context limit, a seeded sampler.
TEST_CASE("a request and a Session agree on tokens, text, streamed pieces and finish", "[scheduler][parity]") {
  struct Case {
    const char* name;
    std::string prompt;
    int32_t max_tokens;
    std::vector<std::string> stop;
    bool ignore_eos;
    float temperature;
  };
  const std::string long_prompt = [] {
    std::string p;
    while (tiny()->tokenizer().tokenize(p, true, false).size() < size_t(kCtx - 12)) p += " Once upon a time,";
    return p;
  }();
  const Case c = GENERATE_COPY(values<Case>({
      {"stop string", "Once upon a time", 64, {"flower", "xyz"}, true, 0.0f},
      {"two stops, one a prefix of text", "Lily", 48, {"the", "he said"}, true, 0.0f},
      {"end of generation", "Once upon a time", 400, {}, false, 0.0f},
      {"context limit", long_prompt, 1000, {}, true, 0.0f},
      {"seeded sampling", "Tom had a dog", 40, {"."}, true, 0.8f},
  }));
  INFO(c.name);
  SamplingParams sp = c.temperature > 0 ? SamplingParams{} : SamplingParams::greedy();
  if (c.temperature > 0) {
    sp.temperature = c.temperature;
    sp.seed = 1234;
  }

  CpuQ4Executor ex(tiny(), CpuExecutorOptions{1});
  SessionOptions so;
  so.n_ctx = kCtx;
  Session s(tiny(), ex, so);
  GenerateOptions go;
  go.sampling = sp;
  go.max_tokens = c.max_tokens;
  go.stop = c.stop;
  go.ignore_eos = c.ignore_eos;
  std::string session_streamed;
  go.on_text = [&](std::string_view t, int32_t) {
    session_streamed += t;
    return true;
  };
  const GenerateResult want = s.generate(c.prompt, go);

  Rig::Opt o;
  o.n_exec = 1;
  Rig rig(o);
  Request r;
  r.prompt_text = c.prompt;
  r.max_tokens = c.max_tokens;
  r.stop = c.stop;
  r.ignore_eos = c.ignore_eos;
  r.sampling = sp;
  std::string streamed;
  r.on_event = [&](const RequestEvent& e) {
    streamed += e.text;
    return true;
  };
  const RequestResult got = rig.sched->submit(std::move(r)).wait();
  CHECK(got.tokens == want.tokens);
  CHECK(got.text == want.text);
  CHECK(streamed == session_streamed);
  CHECK(request_finish_name(got.finish) == finish_reason_name(want.finish));
  rig.check_released();
}

namespace {

/// Runs `inner`, recording every step's prompt chunks (pos0 and tokens); the first step
/// blocks until `open` is set, so requests submitted meanwhile join the second step together.
class GatedRecorder final : public Executor {
 public:
  explicit GatedRecorder(Executor& inner) : Executor(inner.model_ptr()), inner_(inner) {}
  std::string_view name() const noexcept override { return "gated"; }
  KvTier kv_tier() const noexcept override { return inner_.kv_tier(); }
  bool can_read(KvTier t) const noexcept override { return inner_.can_read(t); }
  bool supports(KvDtype d) const noexcept override { return inner_.supports(d); }
  struct Chunk {
    int32_t pos0;
    std::vector<int32_t> tokens;
  };
  std::atomic<bool> open{false};
  std::atomic<int> steps{0};
  std::mutex mu;
  std::vector<std::vector<Chunk>> log;  // per step, in batch order

 protected:
  void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) override {
    {
      std::lock_guard<std::mutex> lk(mu);
      auto& st = log.emplace_back();
      for (const auto& s : batch) st.push_back({s.pos0, std::vector<int32_t>(s.tokens.begin(), s.tokens.end())});
    }
    if (steps++ == 0) {
      while (!open.load()) std::this_thread::sleep_for(1ms);
    }
    inner_.step(batch, logits);
  }

 private:
  Executor& inner_;
};

}  // namespace

// Fails on the main before this change: chunks were taken in admission order, so the
// batch prompt admitted first took a full chunk of every step and finished its prefill
// before the standard prompt admitted after it.
TEST_CASE("prefill chunks go to the tightest SLA class first; looser classes keep a small share",
          "[scheduler][prefill-order]") {
  auto model = tiny();
  CpuQ4Executor inner(model, CpuExecutorOptions{1});
  GatedRecorder rec(inner);
  Rig::Opt o;
  o.n_exec = 1;
  o.max_running = 4;
  o.prefill_chunk = 32;
  o.budget = 64;  // looser classes share prefill_chunk / 4 = 8 tokens per step
  o.exec_a = &rec;
  Rig rig(o);
  const auto pb = prompt_of(100, 1), pi = prompt_of(40, 2), ps = prompt_of(60, 3);
  auto hb = rig.sched->submit(greedy_request(pb, 4, SlaClass::kBatch));
  REQUIRE(eventually([&] { return rec.steps.load() == 1; }));  // the batch prompt's first chunk, held
  auto hi = rig.sched->submit(greedy_request(pi, 4, SlaClass::kInteractive));
  auto hs = rig.sched->submit(greedy_request(ps, 4, SlaClass::kStandard));
  rec.open = true;
  CHECK(hb.wait().tokens == solo(pb, 4));  // order changes time, never tokens
  CHECK(hi.wait().tokens == solo(pi, 4));
  CHECK(hs.wait().tokens == solo(ps, 4));

  // Which prompt a chunk belongs to: its tokens are that prompt's at [pos0, pos0 + n).
  auto owner = [&](const GatedRecorder::Chunk& c) -> char {
    for (const auto& [name, p] : {std::pair{'b', &pb}, std::pair{'i', &pi}, std::pair{'s', &ps}}) {
      if (c.tokens.size() > 1 && size_t(c.pos0) + c.tokens.size() <= p->size() &&
          std::equal(c.tokens.begin(), c.tokens.end(), p->begin() + c.pos0)) {
        return name;
      }
    }
    return '-';  // a decode
  };
  std::lock_guard<std::mutex> lk(rec.mu);
  REQUIRE(rec.log.size() >= 6);
  // Steps as (owner, tokens) lists; the expected plan, step by step:
  //   1: b 32 (alone)  2: i 32 + b 8  3: i 8 + b 8  4: s 32 + b 8  5: s 28 + b 8  6: b 32 ...
  std::vector<std::vector<std::pair<char, size_t>>> steps;
  for (const auto& st : rec.log) {
    auto& v = steps.emplace_back();
    for (const auto& c : st) {
      if (owner(c) != '-') v.emplace_back(owner(c), c.tokens.size());
    }
  }
  using P = std::vector<std::pair<char, size_t>>;
  CHECK(steps[0] == P{{'b', 32}});
  CHECK(steps[1] == P{{'i', 32}, {'b', 8}});
  CHECK(steps[2] == P{{'i', 8}, {'b', 8}});
  CHECK(steps[3] == P{{'s', 32}, {'b', 8}});
  CHECK(steps[4] == P{{'s', 28}, {'b', 8}});
  CHECK(steps[5] == P{{'b', 32}});
  // Every prompt token was fed exactly once.
  std::map<char, size_t> fed;
  for (const auto& v : steps) {
    for (const auto& [who, n] : v) fed[who] += n;
  }
  CHECK(fed['b'] == pb.size());
  CHECK(fed['i'] == pi.size());
  CHECK(fed['s'] == ps.size());
  rig.check_released();
}

TEST_CASE("logprobs: Session and Scheduler report the log-softmax of each step's logits, events included",
          "[scheduler][logprobs]") {
  // Reference: replay the generated tokens through a fresh Session and take a float64
  // log-softmax of the logits before each token.
  const auto model = tiny();
  const std::vector<int32_t> prompt = {1, 400, 401, 402, 403};
  SamplingParams sp;  // temperature 0.8, top-k 40: sampling transforms do not enter logprobs
  sp.seed = 7;
  GenerateOptions go;
  go.sampling = sp;
  go.max_tokens = 12;
  go.ignore_eos = true;
  go.logprobs = 3;
  CpuQ4Executor ex(model, CpuExecutorOptions{1});
  SessionOptions so;
  so.n_ctx = kCtx;
  Session s(model, ex, so);
  const GenerateResult r = s.generate(std::span<const int32_t>(prompt), go);
  REQUIRE(r.logprobs.size() == r.tokens.size());
  Session replay(model, ex, so);
  replay.eval(std::span<const int32_t>(prompt));
  for (size_t i = 0; i < r.tokens.size(); ++i) {
    const auto l = replay.logits();
    double mx = -INFINITY, sum = 0.0;
    for (const float v : l) mx = std::max(mx, double(v));
    for (const float v : l) sum += std::exp(double(v) - mx);
    const double ref = double(l[size_t(r.tokens[i])]) - mx - std::log(sum);
    INFO("token " << i);
    CHECK(r.logprobs[i].token == r.tokens[i]);
    CHECK(std::fabs(double(r.logprobs[i].logprob) - ref) <= std::ldexp(std::fabs(ref), -24) + 1e-12);
    REQUIRE(r.logprobs[i].n_top == 3);
    CHECK(r.logprobs[i].top[0].logprob >= r.logprobs[i].top[1].logprob);
    CHECK(r.logprobs[i].top[0].token == int32_t(std::max_element(l.begin(), l.end()) - l.begin()));
    replay.eval(std::span<const int32_t>(&r.tokens[i], 1));
  }
  // The same request through the scheduler: the same tokens (same seed) and logprobs, also
  // on each token's event; without logprobs none are reported.
  Rig rig(Rig::Opt{});
  Request q;
  q.prompt_ids = prompt;
  q.sampling = sp;
  q.max_tokens = 12;
  q.ignore_eos = true;
  q.logprobs = 3;
  std::vector<float> streamed;
  q.on_event = [&](const RequestEvent& e) {
    if (!e.final) streamed.push_back(e.logprob != nullptr ? e.logprob->logprob : NAN);
    return true;
  };
  const RequestResult res = rig.sched->submit(q).wait();
  REQUIRE(res.tokens == r.tokens);
  REQUIRE(res.logprobs.size() == r.logprobs.size());
  for (size_t i = 0; i < res.logprobs.size(); ++i) {
    CHECK(res.logprobs[i].logprob == r.logprobs[i].logprob);
    CHECK(res.logprobs[i].top[2].token == r.logprobs[i].top[2].token);
  }
  REQUIRE(streamed.size() == r.tokens.size());
  for (size_t i = 0; i < streamed.size(); ++i) CHECK(streamed[i] == r.logprobs[i].logprob);
  q.logprobs = -1;
  q.on_event = nullptr;
  CHECK(rig.sched->submit(q).wait().logprobs.empty());
  q.logprobs = kMaxTopLogprobs + 1;
  CHECK(rig.sched->submit(q).wait().finish == RequestFinish::kError);
  rig.check_released();
}

TEST_CASE("submit_n: n choices compute the prompt once and share its KV pages", "[scheduler][choices]") {
  Rig::Opt o;
  o.n_exec = 1;
  Rig rig(o);
  const auto prompt = prompt_of(50, 5);  // 3 whole pages of 16 + 2 positions: the last page is shared too
  SECTION("greedy: every choice is the solo run") {
    auto hs = rig.sched->submit_n(greedy_request(prompt, 12), 4);
    REQUIRE(hs.size() == 4);
    for (size_t i = 0; i < hs.size(); ++i) {
      const auto& r = hs[i].wait();
      INFO("choice " << i);
      CHECK(r.finish == RequestFinish::kLength);
      CHECK(r.tokens == solo(prompt, 12));
      CHECK(r.metrics.prefix_reused_tokens == (i == 0 ? 0 : 49));  // all but the last prompt token
    }
    // The prompt computed once. Each later choice feeds its last prompt token (for its
    // logits) as a one-token step, which the loop counts as a decode: 11 fed tokens per
    // choice (the 12th is sampled, never fed) + 3.
    const auto m = rig.sched->metrics().executors[0];
    CHECK(m.prefill_tokens == 50);
    CHECK(m.decode_tokens == 4 * 11 + 3);
  }
  SECTION("sampled: choice i is the single request seeded seed + i; choices differ") {
    Request q = greedy_request(prompt, 12);
    q.sampling.temperature = 1.0f;
    q.sampling.top_k = 0;
    q.sampling.top_p = 1.0f;
    q.sampling.min_p = 0.0f;
    q.sampling.seed = 42;
    auto hs = rig.sched->submit_n(q, 4);
    std::vector<std::vector<int32_t>> outs;
    for (auto& h : hs) outs.push_back(h.wait().tokens);
    for (size_t i = 0; i < outs.size(); ++i) {
      Request one = q;
      one.sampling.seed = 42 + i;
      INFO("choice " << i);
      CHECK(rig.sched->submit(one).wait().tokens == outs[i]);
      for (size_t k = 0; k < i; ++k) CHECK(outs[k] != outs[i]);
    }
  }
  SECTION("cancelling every choice mid-stream releases every page") {
    std::atomic<int> finals{0};
    Request q = greedy_request(prompt, 200);
    q.on_event = [&](const RequestEvent& e) {
      if (e.final) ++finals;
      return true;
    };
    auto hs = rig.sched->submit_n(q, 3);
    RequestEvent ev;
    std::string text;
    while (!hs[2].poll(ev, text)) std::this_thread::sleep_for(1ms);  // the last choice decodes: all hold pages
    for (auto& h : hs) rig.sched->cancel(h);
    for (auto& h : hs) CHECK(h.wait().finish == RequestFinish::kCancelled);
    CHECK(finals.load() == 3);
  }
  SECTION("refusals: n out of range, or n > 1 on a session") {
    auto bad = rig.sched->submit_n(greedy_request(prompt, 4), 0);
    REQUIRE(bad.size() == 1);
    CHECK(bad[0].wait().finish == RequestFinish::kError);
    CHECK(bad[0].wait().error == ErrorCode::kInvalidArgument);
    Request s = greedy_request(prompt, 4);
    s.session = rig.sched->open_session();
    auto hs = rig.sched->submit_n(s, 2);
    REQUIRE(hs.size() == 1);
    CHECK(hs[0].wait().error == ErrorCode::kInvalidArgument);
    rig.sched->close_session(s.session);
    Rig::Opt q;
    q.n_exec = 1;
    q.max_queued = 2;
    Rig small(q);
    auto many = small.sched->submit_n(greedy_request(prompt, 4), 3);  // can never be queued at once
    REQUIRE(many.size() == 3);
    for (auto& h : many) CHECK(h.wait().error == ErrorCode::kInvalidArgument);
    small.check_released();
  }
  rig.check_released();
}

TEST_CASE("submit_n on cpu+cpu: a routing that hands long prompts off still computes the prompt once",
          "[scheduler][choices]") {
  Rig::Opt o;
  o.routing.long_prompt_tokens = 30;  // as the lifecycle test: 50-token prompts would be handed off
  o.routing.decode_scarce_fraction = 0.0;
  Rig rig(o);
  const auto prompt = prompt_of(50, 6);
  auto hs = rig.sched->submit_n(greedy_request(prompt, 10), 3);
  for (size_t i = 0; i < hs.size(); ++i) {
    const auto& r = hs[i].wait();
    INFO("choice " << i);
    CHECK(r.tokens == solo(prompt, 10));
    CHECK(r.metrics.prefix_reused_tokens == (i == 0 ? 0 : 49));
    CHECK(r.metrics.migrations == 0);
  }
  const auto m = rig.sched->metrics();
  CHECK(m.executors[0].prefill_tokens + m.executors[1].prefill_tokens == 50);
  CHECK(m.migrations == 0);
  rig.check_released();
}
