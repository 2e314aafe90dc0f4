// tandem-server: executors, stores and the Scheduler (see serving_engine.hpp).
#include "serving_engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <span>

#include "executor_sets.hpp"
#include "tandem/core/error.hpp"
#include "tandem/core/thread_pool.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/sched/routing_policy.hpp"
#if TANDEM_HAVE_CUDA
#include "tandem/exec/gpu/gpu_q4_executor.hpp"
#endif

namespace tandem::server {

namespace {

// The decision of the route() call made on this thread by the last submit().
thread_local RouteInfo t_last_route;

class RecordingPolicy final : public RoutingPolicy {
 public:
  RouteDecision route(const RouteInput& in, std::span<const ExecutorView> executors) override {
    RouteDecision d = inner_.route(in, executors);
    const auto name = [&](int i) {
      return i >= 0 && size_t(i) < executors.size() ? std::string(executors[size_t(i)].name) : std::string();
    };
    t_last_route = {name(d.prefill), name(d.decode), d.rule, d.reason};
    return d;
  }

 private:
  DefaultRoutingPolicy inner_;
};

}  // namespace

ServingEngine::ServingEngine(const EngineOptions& o, std::function<void(std::string_view)> log)
    : model_(Model::load(o.model_path)), template_(ChatTemplate::for_model(*model_)) {
  if (o.parallel < 1) throw Error(ErrorCode::kInvalidArgument, "--parallel must be >= 1");
  n_ctx_ = o.n_ctx > 0 ? o.n_ctx : default_context_size(model_->hparams());
  SchedulerOptions so;
  so.max_queued = o.max_queued;
  so.max_context = n_ctx_;
  so.prefix_cache_entries = o.prefix_cache;
  so.policy = std::make_shared<RecordingPolicy>();
  so.log = std::move(log);
  const int32_t ps = page_size_;
  const int32_t per_seq = (n_ctx_ + ps - 1) / ps + 1;
  const int32_t pages = (o.parallel + std::max(o.prefix_cache, 0)) * per_seq;
  const int32_t file_pages = o.kv_file_tier ? pages : 0;

  const auto add_cpu = [&](int threads, bool primary, const std::string& name) {
    executors_.push_back(std::make_unique<CpuQ4Executor>(model_, CpuExecutorOptions{threads}));
    KvStoreOptions ko;
    ko.layout = KvLayout::for_model(model_->hparams(), ps, o.kv_dtype);
    ko.host_pages = pages;
    ko.file_pages = file_pages;
    ko.file_dir = o.kv_dir;
    ko.file_chunk_pages = 64;
    stores_.push_back(std::make_shared<KvStore>(std::move(ko)));
    ExecutorConfig c;
    c.executor = executors_.back().get();
    c.store = stores_.back();
    c.max_running = o.parallel;
    c.accelerator = primary;
    c.name = name;
    so.executors.push_back(c);
    names_.push_back(name);
  };
  [[maybe_unused]] const auto add_gpu = [&]() {
#if TANDEM_HAVE_CUDA
    auto g = std::make_unique<GpuQ4Executor>(model_);
    stores_.push_back(g->make_kv_store(pages * 4, pages, ps, o.kv_dtype, file_pages));
    ExecutorConfig c;
    c.executor = g.get();
    c.store = stores_.back();
    c.max_running = o.parallel * 4;
    c.step_token_budget = std::max(1024, c.max_running);
    c.prefill_chunk = 512;
    c.name = "gpu";
    executors_.push_back(std::move(g));
    so.executors.push_back(c);
    names_.push_back("gpu");
#else
    throw Error(ErrorCode::kInvalidArgument, "this build has no GPU executor (configure with -DTANDEM_CUDA=ON)");
#endif
  };
  const int t = o.threads > 0 ? o.threads : physical_core_count();
  if (std::find(cli::kExecutorSets.begin(), cli::kExecutorSets.end(), o.executors) == cli::kExecutorSets.end()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("--executors must be cpu, cpu+cpu, gpu or cpu+gpu, got '{}'", o.executors));
  }
  try {  // the model is loaded: a failure from here on is the executor's (a GPU that is missing)
    cli::add_executor_set(o.executors, t, add_cpu, add_gpu);
  } catch (const std::exception& e) {
    throw ExecutorCreationError(e.what());
  }
  scheduler_ = std::make_unique<Scheduler>(std::move(so));
}

ServingEngine::~ServingEngine() {
  scheduler_->shutdown();
}

RequestHandle ServingEngine::submit(Request r, RouteInfo& route) {
  t_last_route = {};
  RequestHandle h = scheduler_->submit(std::move(r));
  route = std::move(t_last_route);
  return h;
}

std::vector<RequestHandle> ServingEngine::submit_n(Request r, int32_t n, RouteInfo& route) {
  t_last_route = {};
  std::vector<RequestHandle> hs = scheduler_->submit_n(std::move(r), n);
  route = std::move(t_last_route);
  return hs;
}

}  // namespace tandem::server
