// tandem-server: Prometheus rendering (see prometheus_metrics.hpp).
#include "prometheus_metrics.hpp"

#include <fmt/format.h>

#include <algorithm>

namespace tandem::server {

namespace {

// vLLM's bucket bounds (vllm/engine/metrics.py), in seconds, so existing dashboards'
// quantile queries read the same buckets.
const std::vector<double> kTtftBounds = {0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1,  0.25,  0.5,   0.75,
                                         1.0,   2.5,   5.0,  7.5,  10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0};
const std::vector<double> kTpotBounds = {0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2,  0.3,  0.4, 0.5,
                                         0.75, 1.0,   2.5,  5.0,   7.5, 10.0, 20.0, 40.0, 80.0};
const std::vector<double> kE2eBounds = {0.3,  0.5,  0.8,  1.0,  1.5,   2.0,   2.5,   5.0,   10.0,   15.0,  20.0,
                                        30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0};

std::string escape_label(std::string_view v) {
  std::string out;
  for (const char c : v) {
    if (c == '\\' || c == '"') out += '\\';
    if (c == '\n') {
      out += "\\n";
      continue;
    }
    out += c;
  }
  return out;
}

void header(std::string& out, const char* name, const char* type, const char* help) {
  out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, help, name, type);
}

}  // namespace

void PrometheusMetrics::Histogram::add(double v) {
  const auto it = std::lower_bound(bounds.begin(), bounds.end(), v);  // le: v <= bound
  counts[size_t(it - bounds.begin())] += 1;
  sum += v;
  count += 1;
}

PrometheusMetrics::PrometheusMetrics(std::string model_name, CacheConfigInfo cache)
    : model_(std::move(model_name)),
      label_(fmt::format("model_name=\"{}\"", escape_label(model_))),
      cache_(std::move(cache)) {
  ttft_.bounds = kTtftBounds;
  tpot_.bounds = kTpotBounds;
  e2e_.bounds = kE2eBounds;
  queue_.bounds = kE2eBounds;  // vLLM uses the latency bounds for its queue-time histogram
  for (auto* h : {&ttft_, &tpot_, &e2e_, &queue_}) h->counts.assign(h->bounds.size() + 1, 0);
}

void PrometheusMetrics::observe(const RequestMetrics& m, RequestFinish finish) {
  std::string reason;
  switch (finish) {
    case RequestFinish::kStop:
    case RequestFinish::kStopString:
      reason = "stop";
      break;
    case RequestFinish::kLength:
      reason = "length";
      break;
    case RequestFinish::kTimeout:
      reason = "timeout";
      break;
    case RequestFinish::kError:
      reason = "error";
      break;
    default:
      reason = "abort";
      break;
  }
  std::lock_guard<std::mutex> lk(mu_);
  finished_[reason] += 1;
  prompt_tokens_ += uint64_t(std::max(0, m.prompt_tokens));
  generation_tokens_ += uint64_t(std::max(0, m.generated_tokens));
  if (m.generated_tokens > 0) ttft_.add(m.ttft_s);
  if (m.generated_tokens > 1) tpot_.add(m.tpot_s);
  e2e_.add(m.e2e_s);
  queue_.add(m.queue_s);
}

void PrometheusMetrics::render_histogram(std::string& out, const char* name, const char* help,
                                         const Histogram& h) const {
  header(out, name, "histogram", help);
  uint64_t cum = 0;
  for (size_t i = 0; i < h.bounds.size(); ++i) {
    cum += h.counts[i];
    out += fmt::format("{}_bucket{{{},le=\"{}\"}} {}\n", name, label_, h.bounds[i], cum);
  }
  cum += h.counts.back();
  out += fmt::format("{}_bucket{{{},le=\"+Inf\"}} {}\n", name, label_, cum);
  out += fmt::format("{}_sum{{{}}} {}\n{}_count{{{}}} {}\n", name, label_, h.sum, name, label_, h.count);
}

std::string PrometheusMetrics::render(const SchedulerMetrics& s) const {
  std::string out;
  int64_t running = 0;
  int64_t used = 0, capacity = 0;
  for (const auto& e : s.executors) {
    running += e.running;
    for (const KvTier t : {KvTier::kDevice, KvTier::kHost}) {  // compute tiers (File is swap space)
      used += e.kv[int(t)].used + e.kv[int(t)].reserved;
      capacity += e.kv[int(t)].capacity;
    }
    used -= e.kv_cache_only_pages;  // as vLLM: cached blocks no request holds count as free
  }
  const double kv_usage = capacity > 0 ? double(std::max<int64_t>(used, 0)) / double(capacity) : 0.0;

  header(out, "vllm:num_requests_running", "gauge", "Number of requests in model execution batches.");
  out += fmt::format("vllm:num_requests_running{{{}}} {}\n", label_, running);
  header(out, "vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.");
  out += fmt::format("vllm:num_requests_waiting{{{}}} {}\n", label_, s.queued);
  header(out, "vllm:kv_cache_usage_perc", "gauge", "KV-cache usage. 1 means 100 percent usage.");
  out += fmt::format("vllm:kv_cache_usage_perc{{{}}} {}\n", label_, kv_usage);
  header(out, "vllm:gpu_cache_usage_perc", "gauge", "KV-cache usage (older name). 1 means 100 percent usage.");
  out += fmt::format("vllm:gpu_cache_usage_perc{{{}}} {}\n", label_, kv_usage);
  header(out, "vllm:cache_config_info", "gauge", "Information of the LLMEngine CacheConfig");
  out += fmt::format(
      "vllm:cache_config_info{{block_size=\"{}\",cache_dtype=\"{}\",enable_prefix_caching=\"{}\","
      "num_cpu_blocks=\"{}\",num_gpu_blocks=\"{}\"}} 1\n",
      cache_.block_size, escape_label(cache_.cache_dtype), cache_.prefix_caching ? "True" : "False",
      cache_.num_cpu_blocks, cache_.num_gpu_blocks);

  std::lock_guard<std::mutex> lk(mu_);
  render_histogram(out, "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", ttft_);
  render_histogram(out, "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", tpot_);
  render_histogram(out, "vllm:e2e_request_latency_seconds", "Histogram of end to end request latency in seconds.",
                   e2e_);
  render_histogram(out, "vllm:request_queue_time_seconds", "Histogram of time spent waiting in the queue.", queue_);
  header(out, "vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.");
  out += fmt::format("vllm:prompt_tokens_total{{{}}} {}\n", label_, prompt_tokens_);
  header(out, "vllm:generation_tokens_total", "counter", "Number of generation tokens processed.");
  out += fmt::format("vllm:generation_tokens_total{{{}}} {}\n", label_, generation_tokens_);
  header(out, "vllm:request_success_total", "counter", "Count of finished requests by finish reason.");
  for (const char* r : {"stop", "length", "abort", "timeout", "error"}) {
    const auto it = finished_.find(r);
    out += fmt::format("vllm:request_success_total{{{},finished_reason=\"{}\"}} {}\n", label_, r,
                       it == finished_.end() ? 0 : it->second);
  }

  // Tandem: per executor.
  const auto per_exec = [&](const char* name, const char* type, const char* help, auto value) {
    header(out, name, type, help);
    for (const auto& e : s.executors) {
      out += fmt::format("{}{{{},executor=\"{}\"}} {}\n", name, label_, escape_label(e.name), value(e));
    }
  };
  per_exec("tandem:executor_queued", "gauge", "Requests waiting for admission on the executor.",
           [](const ExecutorMetrics& e) { return e.queued; });
  per_exec("tandem:executor_running", "gauge", "Sequences admitted on the executor.",
           [](const ExecutorMetrics& e) { return e.running; });
  per_exec("tandem:executor_max_running", "gauge", "Decode slots of the executor.",
           [](const ExecutorMetrics& e) { return e.max_running; });
  per_exec("tandem:executor_tokens_per_second", "gauge", "Prefill plus decode tokens per second since start.",
           [](const ExecutorMetrics& e) { return e.tokens_per_s; });
  per_exec("tandem:executor_prefill_tokens_per_second", "gauge", "Measured prompt tokens per second while busy (EWMA).",
           [](const ExecutorMetrics& e) { return e.prefill_tps; });
  per_exec("tandem:executor_decode_tokens_per_second", "gauge",
           "Measured decode tokens per second per sequence (EWMA).",
           [](const ExecutorMetrics& e) { return e.decode_tps; });
  per_exec("tandem:executor_utilisation", "gauge", "Fraction of time spent inside executor steps.",
           [](const ExecutorMetrics& e) { return e.utilisation; });
  per_exec("tandem:executor_prefill_tokens_total", "counter", "Prompt tokens computed by the executor.",
           [](const ExecutorMetrics& e) { return e.prefill_tokens; });
  per_exec("tandem:executor_decode_tokens_total", "counter", "Tokens decoded by the executor.",
           [](const ExecutorMetrics& e) { return e.decode_tokens; });
  header(out, "tandem:kv_pages", "gauge", "KV pages of each executor's store, per tier and state.");
  for (const auto& e : s.executors) {
    for (int t = 0; t < kKvTierCount; ++t) {
      const auto& u = e.kv[t];
      if (u.capacity == 0) continue;
      const std::string lbl =
          fmt::format("{},executor=\"{}\",tier=\"{}\"", label_, escape_label(e.name), kv_tier_name(KvTier(t)));
      out += fmt::format("tandem:kv_pages{{{},state=\"used\"}} {}\n", lbl, u.used);
      out += fmt::format("tandem:kv_pages{{{},state=\"reserved\"}} {}\n", lbl, u.reserved);
      out += fmt::format("tandem:kv_pages{{{},state=\"free\"}} {}\n", lbl, u.free());
    }
  }

  // Tandem: scheduler-wide.
  const auto one = [&](const char* name, const char* type, const char* help, auto v) {
    header(out, name, type, help);
    out += fmt::format("{}{{{}}} {}\n", name, label_, v);
  };
  one("tandem:handoffs_total", "counter", "KV hand-offs between executors (prefill -> decode, migrations).",
      s.migrations);
  one("tandem:handoff_bytes_total", "counter", "Bytes of KV moved by hand-offs.", s.migration_bytes);
  one("tandem:preemptions_total", "counter", "Sequences swapped out or dropped for room.", s.preemptions);
  one("tandem:prefix_cache_hit_tokens_total", "counter", "Prompt tokens whose KV was shared, not computed.",
      s.prefix_reused_tokens);
  one("tandem:prefix_cache_hit_rate", "gauge", "Prefix-reused prompt tokens / admitted prompt tokens.",
      s.prefix_hit_rate);
  return out;
}

}  // namespace tandem::server
