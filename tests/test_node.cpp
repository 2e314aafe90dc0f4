// tandem/node/node.hpp: executor sets, the page rule against a hand computation, budgets,
// and a cpu+cpu node built by build_node serving a request through the Scheduler.
#include <catch2/catch.hpp>

#include <algorithm>
#include <functional>
#include <limits>
#include <string>

#include "kv_test_support.hpp"
#include "tandem/node/node.hpp"
#include "tandem/sched/scheduler.hpp"
#include "tandem/session/session.hpp"

using namespace tandem;

namespace {

ErrorCode code_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.code();
  }
  return ErrorCode::kOk;
}

/// A model shape with no weights: only what KvLayout::for_model reads.
HParams shape(int32_t n_layer, int32_t n_head_kv, int32_t head_dim) {
  HParams hp;
  hp.n_layer = n_layer;
  hp.n_head_kv = n_head_kv;
  hp.head_dim = head_dim;
  return hp;
}

ExecutorSpec spec(ExecutorKind kind, int32_t max_running) {
  ExecutorSpec e;
  e.kind = kind;
  e.max_running = max_running;
  return e;
}

}  // namespace

TEST_CASE("executor sets: the four names, the thread split, GPU slots; other names are refused", "[node]") {
  const auto names = executor_set_names();
  CHECK(std::vector<std::string_view>(names.begin(), names.end()) ==
        std::vector<std::string_view>{"cpu", "cpu+cpu", "gpu", "cpu+gpu"});

  const auto cpu = executor_set("cpu", 6, 8);
  REQUIRE(cpu.size() == 1);
  CHECK(cpu[0].kind == ExecutorKind::kCpu);
  CHECK(cpu[0].name == "cpu");
  CHECK(cpu[0].n_threads == 6);
  CHECK(cpu[0].max_running == 8);
  CHECK(cpu[0].accelerator == false);

  const auto two = executor_set("cpu+cpu", 5, 3);
  REQUIRE(two.size() == 2);
  CHECK(two[0].name == "cpuA");
  CHECK(two[0].n_threads == 3);
  CHECK(two[0].accelerator == true);
  CHECK(two[1].name == "cpuB");
  CHECK(two[1].n_threads == 2);
  CHECK(two[1].accelerator == false);
  const auto two1 = executor_set("cpu+cpu", 1, 1);  // at least one thread each
  CHECK(two1[0].n_threads == 1);
  CHECK(two1[1].n_threads == 1);

  const auto gpu = executor_set("gpu", 4, 8);
  REQUIRE(gpu.size() == 1);
  CHECK(gpu[0].kind == ExecutorKind::kGpu);
  CHECK(gpu[0].max_running == 32);
  CHECK(!gpu[0].accelerator.has_value());

  const auto mixed = executor_set("cpu+gpu", 4, 2);
  REQUIRE(mixed.size() == 2);
  CHECK(mixed[0].kind == ExecutorKind::kGpu);
  CHECK(mixed[0].max_running == 8);
  CHECK(mixed[1].kind == ExecutorKind::kCpu);
  CHECK(mixed[1].n_threads == 4);

  for (const char* bad : {"", "CPU", "gpu+cpu", "cpu+cpu+cpu", "cpu "}) {
    INFO("name '" << bad << "'");
    try {
      executor_set(bad, 4, 1);
      FAIL("accepted");
    } catch (const Error& e) {
      CHECK(e.code() == ErrorCode::kInvalidArgument);
      CHECK(std::string(e.what()).find("cpu, cpu+cpu, gpu, cpu+gpu") != std::string::npos);
    }
  }
  CHECK(code_of([] { executor_set("cpu", 0, 1); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([] { executor_set("cpu", 1, 0); }) == ErrorCode::kInvalidArgument);
}

TEST_CASE("page rule: compute tiers equal a hand computation for several shapes", "[node]") {
  struct Case {
    int32_t n_layer, n_head_kv, head_dim, n_ctx, page_size, max_running, prefix;
    KvDtype dtype;
    int32_t pages;        // (max_running + prefix) x (ceil(n_ctx / page_size) + 1), by hand
    uint64_t page_bytes;  // n_layer x 2 (K, V) x page_size x n_head_kv x head_dim x element bytes
  };
  const Case cases[] = {
      {4, 2, 64, 256, 16, 8, 0, KvDtype::kF16, 8 * 17, 4ull * 2 * 16 * 2 * 64 * 2},
      {2, 1, 32, 100, 16, 3, 2, KvDtype::kF32, 5 * 8, 2ull * 2 * 16 * 1 * 32 * 4},
      {3, 4, 32, 1, 1, 1, 0, KvDtype::kQ8_0, 1 * 2, 3ull * 2 * 1 * (4 * 32 / 32 * 34)},
      {1, 8, 128, 4096, 32, 16, 4, KvDtype::kF16, 20 * 129, 1ull * 2 * 32 * 8 * 128 * 2},
  };
  for (const Case& c : cases) {
    INFO("n_ctx " << c.n_ctx << ", page_size " << c.page_size << ", max_running " << c.max_running << ", prefix "
                  << c.prefix);
    const HParams hp = shape(c.n_layer, c.n_head_kv, c.head_dim);
    CHECK(compute_tier_pages(KvLayout::for_model(hp, c.page_size, c.dtype), c.n_ctx, 0, c.max_running, c.prefix) ==
          c.pages);
    CHECK(KvLayout::for_model(hp, c.page_size, c.dtype).page_bytes() == c.page_bytes);
    NodeSpec ns;
    ns.n_ctx = c.n_ctx;
    ns.page_size = c.page_size;
    ns.prefix_cache_entries = c.prefix;
    ns.executors = {spec(ExecutorKind::kCpu, c.max_running)};
    ns.executors[0].kv_dtype = c.dtype;
    ns.executors[0].file_pages = kFilePagesAsCompute;
    ns.host_kv_bytes = uint64_t(c.pages) * c.page_bytes;  // exactly enough
    CHECK(kv_page_counts(hp, ns) == std::vector<KvPageCounts>{{0, c.pages, c.pages}});
    ns.host_kv_bytes -= 1;  // a byte short
    CHECK(code_of([&] { kv_page_counts(hp, ns); }) == ErrorCode::kOutOfMemory);
  }
}

TEST_CASE("page rule: GPU Device tier, its Host tier from what the budget leaves, overrides", "[node]") {
  const HParams hp = shape(2, 2, 32);
  const uint64_t pb = 2ull * 2 * 16 * 2 * 32 * 2;  // f16, 16-token pages
  NodeSpec ns;
  ns.n_ctx = 64;  // 4 + 1 = 5 pages per sequence
  ns.page_size = 16;
  ns.prefix_cache_entries = 1;
  ns.executors = {spec(ExecutorKind::kGpu, 8), spec(ExecutorKind::kCpu, 2)};
  // CPU: (2 + 1) x 5 = 15 Host pages; GPU: (8 + 1) x 5 = 45 Device pages and a Host tier
  // of at most 45 pages from what the CPU leaves of the budget: 15 + 20 pages here.
  ns.host_kv_bytes = 35 * pb + pb / 2;
  CHECK(kv_page_counts(hp, ns) == std::vector<KvPageCounts>{{45, 20, 0}, {0, 15, 0}});
  ns.host_kv_bytes = 1000 * pb;
  CHECK(kv_page_counts(hp, ns) == std::vector<KvPageCounts>{{45, 45, 0}, {0, 15, 0}});
  ns.host_kv_bytes = 15 * pb;  // the CPU fits, the GPU gets no Host tier
  CHECK(kv_page_counts(hp, ns) == std::vector<KvPageCounts>{{45, 0, 0}, {0, 15, 0}});

  ns.device_kv_bytes = 45 * pb;  // exactly the Device tier
  CHECK(kv_page_counts(hp, ns)[0].device == 45);
  ns.device_kv_bytes = 45 * pb - 1;
  CHECK(code_of([&] { kv_page_counts(hp, ns); }) == ErrorCode::kOutOfMemory);
  ns.device_kv_bytes = 0;

  ns.executors[0].kv_pages = 7;  // explicit pages replace the rule's count
  ns.executors[1].file_pages = 9;
  CHECK(kv_page_counts(hp, ns) == std::vector<KvPageCounts>{{7, 0, 0}, {0, 15, 9}});

  ns.executors[0].kv_dtype = KvDtype::kQ8_0;  // no GPU kernel reads q8_0 pages
  CHECK(code_of([&] { kv_page_counts(hp, ns); }) == ErrorCode::kInvalidArgument);
}

TEST_CASE("page rule: bad specs and counts past INT32_MAX are clear errors", "[node]") {
  const HParams hp = shape(2, 2, 32);
  auto rule = [&hp](int64_t n_ctx, int32_t page_size, int32_t max_running, int32_t prefix) {
    return compute_tier_pages(KvLayout::for_model(hp, page_size), n_ctx, 0, max_running, prefix);
  };
  CHECK(code_of([&] { rule(0, 16, 1, 0); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([&] { rule(16, 0, 1, 0); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([&] { rule(16, 16, 0, 0); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([&] { rule(16, 16, 1, -1); }) == ErrorCode::kInvalidArgument);
  CHECK(code_of([&] { rule(int64_t{1} << 30, 1, 4, 0); }) == ErrorCode::kInvalidArgument);
  constexpr int32_t kMax = std::numeric_limits<int32_t>::max();
  const HParams one = shape(1, 2, 32);  // one layer: one page per position
  CHECK(compute_tier_pages(KvLayout::for_model(one, 1), kMax - 1, 0, 1, 0) == kMax);  // kMax - 1 pages + 1
  CHECK(code_of([&] { compute_tier_pages(KvLayout::for_model(one, 1), kMax, 0, 1, 0); }) ==
        ErrorCode::kInvalidArgument);
  NodeSpec ns;
  ns.n_ctx = 64;
  CHECK(code_of([&] { kv_page_counts(hp, ns); }) == ErrorCode::kInvalidArgument);  // no executors
  ns.executors = {spec(ExecutorKind::kCpu, 1)};
  CHECK(kv_page_counts(hp, ns).size() == 1);  // the spec below differs in one field each
  ns.executors[0].file_pages = -2;
  CHECK(code_of([&] { kv_page_counts(hp, ns); }) == ErrorCode::kInvalidArgument);
  ns.executors[0].file_pages = 0;
  ns.executors[0].max_running = 0;
  CHECK(code_of([&] { kv_page_counts(hp, ns); }) == ErrorCode::kInvalidArgument);
  ns.executors[0].max_running = 1;
  ns.executors[0].kv_pages = 4;  // explicit pages: the page size is still checked
  ns.page_size = 0;
  CHECK(code_of([&] { kv_page_counts(hp, ns); }) == ErrorCode::kInvalidArgument);
  ns.page_size = 16;
  CHECK(code_of([&] { kv_page_counts(shape(0, 2, 32), ns); }) == ErrorCode::kInvalidArgument);  // empty pages
}

TEST_CASE("build_node: a cpu+cpu node serves a request through the Scheduler as a Session does", "[node]") {
  const auto model = Model::load(test::model_path("aidreams260K-q4_0"));
  NodeSpec ns;
  ns.n_ctx = 128;
  ns.page_size = 16;
  ns.prefix_cache_entries = 2;
  ns.executors = executor_set("cpu+cpu", 2, 4);
  ns.executors[1].file_pages = kFilePagesAsCompute;
  ns.executors[1].kv_dir = test::scratch_dir("node");
  std::vector<NodeExecutor> node = build_node(model, ns);
  REQUIRE(node.size() == 2);
  for (const NodeExecutor& n : node) {
    INFO(n.spec.name);
    CHECK(n.pages.host == (4 + 2) * (128 / 16 + 1));
    CHECK(n.store->usage(KvTier::kHost).capacity == n.pages.host);
    CHECK(n.store->usage(KvTier::kFile).capacity == n.pages.file);
    CHECK(!n.store->has_tier(KvTier::kDevice));
    CHECK(n.executor->kv_tier() == KvTier::kHost);
    CHECK(n.store->layout() == KvLayout::for_model(model->hparams(), 16));
  }
  CHECK(node[0].pages.file == 0);
  CHECK(node[1].pages.file == node[1].pages.host);

  const std::vector<int32_t> prompt = test::prompt_ids(20, model->hparams().n_vocab);
  std::vector<int32_t> expect;
  {
    SessionOptions so;
    so.n_ctx = 128;
    Session s(model, *node[1].executor, so);
    GenerateOptions go;
    go.sampling = SamplingParams::greedy();
    go.max_tokens = 12;
    go.ignore_eos = true;
    expect = s.generate(std::span<const int32_t>(prompt), go).tokens;
  }
  REQUIRE(expect.size() == 12);

  SchedulerOptions so;
  so.max_context = ns.n_ctx;
  so.prefix_cache_entries = ns.prefix_cache_entries;
  for (const NodeExecutor& n : node) {
    ExecutorConfig c;
    c.executor = n.executor.get();
    c.store = n.store;
    c.max_running = n.spec.max_running;
    c.accelerator = n.spec.accelerator;
    c.name = n.spec.name;
    so.executors.push_back(c);
  }
  Scheduler sched(std::move(so));
  Request r;
  r.prompt_ids = prompt;
  r.max_tokens = 12;
  r.ignore_eos = true;
  const RequestHandle h = sched.submit(std::move(r));
  const RequestResult& res = h.wait();
  CHECK(res.tokens == expect);
  sched.shutdown();
}
