// tandem-server: the model, its executors and KV stores, and the Scheduler over them.
//
// --executors cpu | cpu+cpu | gpu | cpu+gpu builds the executors of that executor set
// (tandem/node/node.hpp: cpu+cpu splits the threads into two pools, the first marked as the
// primary; a GPU executor gets 4 x -np slots) with stores sized by the node's page rule:
// every slot and prefix-cache entry can hold -c positions in the compute tier; --kv-tier
// file adds a File tier as large in --kv-dir that preempted sequences swap to instead of
// being recomputed.
//
// The routing decision of each request is recorded by a RoutingPolicy wrapper around the
// default policy: RoutingPolicy::route() is called once per request at submission
// (routing_policy.hpp), so submit() returns the decision together with the handle.
//
// Thread-safety: submit(), cancel(), metrics() from any thread (the Scheduler's own rules).
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "tandem/model/model.hpp"
#include "tandem/node/node.hpp"
#include "tandem/sched/scheduler.hpp"
#include "tandem/template/chat_template.hpp"

namespace tandem::server {

struct EngineOptions {
  std::string model_path;
  std::string executors = "cpu";  ///< cpu, cpu+cpu, gpu, cpu+gpu
  int threads = 0;                ///< 0 = physical cores
  int32_t n_ctx = 0;              ///< positions per sequence (0 = model's training context, <= 4096)
  int32_t parallel = 4;           ///< decode slots per executor
  int32_t max_queued = 64;
  int32_t prefix_cache = 4;
  bool kv_file_tier = false;
  KvDtype kv_dtype = KvDtype::kF16;  ///< --cache-type-k/-v; q8_0 on CPU executors only (the GPU refuses it)
  std::filesystem::path kv_dir = std::filesystem::temp_directory_path();
  std::optional<ChatTemplateOverride> chat_template;  ///< --chat-template(-file); nullopt: the model's
};

/// Where a request was routed: executor names and the policy's rule and reason.
struct RouteInfo {
  std::string prefill, decode, rule, reason;
  bool known() const noexcept { return !rule.empty() || !reason.empty(); }
};

/// The model loaded but an executor of --executors (or its KV store) could not be created,
/// e.g. --executors gpu where no CUDA device is visible; what() is the underlying reason.
struct ExecutorCreationError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

class ServingEngine {
 public:
  /// Loads the model and starts the Scheduler. Throws tandem::Error (bad file, bad flags),
  /// ExecutorCreationError when the model loaded but an executor could not be created.
  /// `log` receives the Scheduler's debug lines (may be empty).
  ServingEngine(const EngineOptions& o, std::function<void(std::string_view)> log);
  ~ServingEngine();

  RequestHandle submit(Request r, RouteInfo& route);
  /// n choices of one prompt (Scheduler::submit_n): one handle per choice, one route.
  std::vector<RequestHandle> submit_n(Request r, int32_t n, RouteInfo& route);
  void cancel(const RequestHandle& h) noexcept { scheduler_->cancel(h); }
  SchedulerMetrics metrics() const { return scheduler_->metrics(); }
  /// Cancel everything outstanding and stop the step loops.
  void shutdown() { scheduler_->shutdown(); }

  const Model& model() const noexcept { return *model_; }
  const ChatTemplate& chat_template() const noexcept { return template_; }
  int32_t n_ctx() const noexcept { return n_ctx_; }
  int32_t page_size() const noexcept { return page_size_; }
  const std::vector<std::string>& executor_names() const noexcept { return names_; }

 private:
  std::shared_ptr<const Model> model_;
  ChatTemplate template_;
  int32_t n_ctx_ = 0;
  int32_t page_size_ = 16;
  std::vector<std::string> names_;
  std::vector<NodeExecutor> node_;
  std::unique_ptr<Scheduler> scheduler_;
};

}  // namespace tandem::server
