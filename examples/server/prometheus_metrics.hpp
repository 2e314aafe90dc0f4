// tandem-server: /metrics in the Prometheus text format (exposition format 0.0.4).
//
// Names follow vLLM's so that dashboards and routers (llm-d's inference scheduler, the
// Gateway API Inference Extension's endpoint picker) read Tandem unchanged:
// vllm:num_requests_running / _waiting, vllm:kv_cache_usage_perc (and the older
// vllm:gpu_cache_usage_perc: pages held by running or waiting requests / capacity; pages
// only the prefix cache holds count as free, as vLLM's evictable cached blocks do),
// vllm:cache_config_info, the TTFT / TPOT / end-to-end histograms with vLLM's bucket
// bounds, vllm:prompt_tokens_total, vllm:generation_tokens_total and
// vllm:request_success_total{finished_reason}; all labelled model_name. Tandem's own
// `tandem:` metrics are per executor (queue, running, tokens/s, KV pages per tier) and
// per scheduler (hand-offs, preemptions, prefix-cache reuse).
//
// Thread-safety: observe() and render() may be called from any thread (one mutex; it is
// taken once per finished request and once per scrape, never per token).
#pragma once

#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "tandem/sched/metrics.hpp"
#include "tandem/sched/scheduler.hpp"

namespace tandem::server {

/// vllm:cache_config_info's labels (vLLM: its CacheConfig; value 1).
struct CacheConfigInfo {
  int32_t block_size = 16;      ///< tokens per KV page
  std::string cache_dtype;      ///< f16, f32 or q8_0 (vLLM: auto, fp8, ...)
  bool prefix_caching = false;  ///< --prefix-cache > 0
  int64_t num_gpu_blocks = 0;   ///< pages of the tiers requests compute in (Device, or Host for a CPU executor)
  int64_t num_cpu_blocks = 0;   ///< pages of the swap tier (--kv-tier file)
};

class PrometheusMetrics {
 public:
  PrometheusMetrics(std::string model_name, CacheConfigInfo cache);
  /// Record one finished request (its metrics and finish reason).
  void observe(const RequestMetrics& m, RequestFinish finish);
  /// The exposition text: the histograms and counters, and gauges from `snapshot`.
  std::string render(const SchedulerMetrics& snapshot) const;

 private:
  struct Histogram {
    std::vector<double> bounds;
    std::vector<uint64_t> counts;  // per bucket (not cumulative); one more for +Inf
    double sum = 0.0;
    uint64_t count = 0;
    void add(double v);
  };
  void render_histogram(std::string& out, const char* name, const char* help, const Histogram& h) const;

  std::string model_;
  std::string label_;  // model_name="..."
  CacheConfigInfo cache_;
  mutable std::mutex mu_;
  Histogram ttft_, tpot_, e2e_, queue_;
  uint64_t prompt_tokens_ = 0;
  uint64_t generation_tokens_ = 0;
  std::map<std::string, uint64_t> finished_;  // by finished_reason
};

}  // namespace tandem::server
