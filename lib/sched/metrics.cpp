#include "tandem/sched/metrics.hpp"

#include <fmt/format.h>

namespace tandem {

std::string_view request_finish_name(RequestFinish f) noexcept {
  switch (f) {
    case RequestFinish::kStop:
      return "stop";
    case RequestFinish::kStopString:
      return "stop_string";
    case RequestFinish::kLength:
      return "length";
    case RequestFinish::kCancelled:
      return "cancelled";
    case RequestFinish::kTimeout:
      return "timeout";
    case RequestFinish::kOverloaded:
      return "overloaded";
    case RequestFinish::kError:
      return "error";
  }
  return "?";
}

namespace {

std::string json_escape(std::string_view s) {
  std::string o;
  for (char c : s) {
    if (c == '"' || c == '\\') {
      o += '\\';
      o += c;
    } else if (static_cast<unsigned char>(c) < 0x20) {
      o += fmt::format("\\u{:04x}", int(c));
    } else {
      o += c;
    }
  }
  return o;
}

}  // namespace

std::string SchedulerMetrics::to_text() const {
  std::string o = fmt::format(
      "scheduler: elapsed {:.3f}s, submitted {}, finished {}, queued {}; migrations {} ({} bytes, {:.4f}s), "
      "preemptions {}, prefix hit rate {:.1f}% ({} of {} prompt tokens)\n",
      elapsed_s, submitted, finished, queued, migrations, migration_bytes, migration_s, preemptions,
      100.0 * prefix_hit_rate, prefix_reused_tokens, prompt_tokens);
  o += "  finish:";
  for (int i = 0; i < kRequestFinishCount; ++i)
    o += fmt::format(" {}={}", request_finish_name(RequestFinish(i)), by_finish[i]);
  o += "\n";
  for (const auto& e : executors) {
    o += fmt::format(
        "  {}{}: steps {}, prefill {} tok, decode {} tok, {:.1f} tok/s, util {:.1f}%, occupancy {:.1f}%, "
        "measured prefill {:.0f} t/s decode {:.0f} t/s, running {}/{}, queued {}\n",
        e.name, e.accelerator ? " (accelerator)" : "", e.steps, e.prefill_tokens, e.decode_tokens, e.tokens_per_s,
        100.0 * e.utilisation, 100.0 * e.batch_occupancy, e.prefill_tps, e.decode_tps, e.running, e.max_running,
        e.queued);
    for (int t = 0; t < kKvTierCount; ++t) {
      if (e.kv[t].capacity == 0) continue;
      o += fmt::format("    kv {}: used {} reserved {} of {} pages ({} bytes)\n", kv_tier_name(KvTier(t)), e.kv[t].used,
                       e.kv[t].reserved, e.kv[t].capacity, e.kv[t].used_bytes);
    }
  }
  return o;
}

std::string SchedulerMetrics::to_json() const {
  std::string o = fmt::format(
      "{{\"elapsed_s\":{:.6f},\"submitted\":{},\"finished\":{},\"queued\":{},\"migrations\":{},"
      "\"migration_bytes\":{},\"migration_s\":{:.6f},\"preemptions\":{},\"prompt_tokens\":{},"
      "\"prefix_reused_tokens\":{},\"prefix_hit_rate\":{:.6f},\"finish\":{{",
      elapsed_s, submitted, finished, queued, migrations, migration_bytes, migration_s, preemptions, prompt_tokens,
      prefix_reused_tokens, prefix_hit_rate);
  for (int i = 0; i < kRequestFinishCount; ++i) {
    o += fmt::format("{}\"{}\":{}", i ? "," : "", request_finish_name(RequestFinish(i)), by_finish[i]);
  }
  o += "},\"executors\":[";
  for (size_t k = 0; k < executors.size(); ++k) {
    const auto& e = executors[k];
    o += fmt::format(
        "{}{{\"name\":\"{}\",\"accelerator\":{},\"steps\":{},\"prefill_tokens\":{},\"decode_tokens\":{},"
        "\"busy_s\":{:.6f},\"utilisation\":{:.6f},\"tokens_per_s\":{:.3f},\"prefill_tps\":{:.3f},"
        "\"decode_tps\":{:.3f},\"batch_occupancy\":{:.6f},\"running\":{},\"queued\":{},\"max_running\":{},\"kv\":{{",
        k ? "," : "", json_escape(e.name), e.accelerator ? "true" : "false", e.steps, e.prefill_tokens, e.decode_tokens,
        e.busy_s, e.utilisation, e.tokens_per_s, e.prefill_tps, e.decode_tps, e.batch_occupancy, e.running, e.queued,
        e.max_running);
    for (int t = 0; t < kKvTierCount; ++t) {
      o += fmt::format("{}\"{}\":{{\"capacity\":{},\"used\":{},\"reserved\":{},\"used_bytes\":{}}}", t ? "," : "",
                       kv_tier_name(KvTier(t)), e.kv[t].capacity, e.kv[t].used, e.kv[t].reserved, e.kv[t].used_bytes);
    }
    o += "}}";
  }
  o += "]}";
  return o;
}

}  // namespace tandem
