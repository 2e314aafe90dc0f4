// tandem-server: executors, stores and the Scheduler (see serving_engine.hpp).
#include "serving_engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <span>

#include "tandem/core/error.hpp"
#include "tandem/core/thread_pool.hpp"
#include "tandem/sched/routing_policy.hpp"

namespace tandem::server {

namespace {

// A GPU executor's prompt tokens per sequence per step (its scheduler loop's prefill_chunk).
constexpr int32_t kGpuPrefillChunk = 512;

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
    : model_(Model::load(o.model_path)),
      template_(ChatTemplate::for_model(*model_, o.chat_template ? &*o.chat_template : nullptr)) {
  if (o.parallel < 1) throw Error(ErrorCode::kInvalidArgument, "--parallel must be >= 1");
  n_ctx_ = o.n_ctx > 0 ? o.n_ctx : default_context_size(model_->hparams());
  SchedulerOptions so;
  so.max_queued = o.max_queued;
  so.max_context = n_ctx_;
  so.prefix_cache_entries = o.prefix_cache;
  so.policy = std::make_shared<RecordingPolicy>();
  so.log = std::move(log);
  NodeSpec ns;
  ns.n_ctx = n_ctx_;
  ns.page_size = page_size_;
  ns.prefix_cache_entries = std::max(o.prefix_cache, 0);
  const int t = o.threads > 0 ? o.threads : physical_core_count();
  ns.executors = executor_set(o.executors, t, o.parallel);
  for (ExecutorSpec& e : ns.executors) {
    e.max_step_tokens = e.kind == ExecutorKind::kGpu ? kGpuPrefillChunk : ExecutorConfig{}.prefill_chunk;
    e.kv_dtype = o.kv_dtype;
    e.file_pages = o.kv_file_tier ? kFilePagesAsCompute : 0;
    e.kv_dir = o.kv_dir;
  }
  try {  // the model is loaded: a failure from here on is the executor's (a GPU that is missing)
    node_ = build_node(model_, ns);
  } catch (const std::exception& e) {
    throw ExecutorCreationError(e.what());
  }
  for (const NodeExecutor& n : node_) {
    ExecutorConfig c;
    c.executor = n.executor.get();
    c.store = n.store;
    c.max_running = n.spec.max_running;
    if (n.spec.kind == ExecutorKind::kGpu) {
      c.step_token_budget = std::max(1024, c.max_running);
      c.prefill_chunk = kGpuPrefillChunk;
    }
    c.accelerator = n.spec.accelerator;
    c.name = n.spec.name;
    so.executors.push_back(c);
    names_.push_back(n.spec.name);
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
