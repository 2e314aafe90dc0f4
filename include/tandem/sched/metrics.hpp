// Serving metrics: per request, per executor, per KV tier, and the prefix cache.
//
// Units: seconds (double), tokens, pages, bytes. A snapshot is a plain value; text and
// JSON renderings are for logs, tandem-bench and the C ABI (which returns the JSON text).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/kv/kv_store.hpp"

namespace tandem {

/// How a scheduler request ended (one terminal event each).
enum class RequestFinish : int32_t {
  kStop = 0,        ///< an end-of-generation token
  kStopString = 1,  ///< a stop string appeared (not included in the text)
  kLength = 2,      ///< max_tokens generated or the context is full
  kCancelled = 3,   ///< cancel() (or the callback asked to stop)
  kTimeout = 4,     ///< the deadline passed
  kOverloaded = 5,  ///< refused at submission: the queue is full
  kError = 6,       ///< invalid request or an executor error (see error / message)
};
/// Number of RequestFinish values (they are 0 .. kRequestFinishCount - 1).
inline constexpr int kRequestFinishCount = 7;
std::string_view request_finish_name(RequestFinish f) noexcept;  ///< "stop", "timeout", ...

/// Per request (filled as the request runs; final when it has finished).
struct RequestMetrics {
  double queue_s = 0.0;  ///< submission -> admission on its first executor
  double ttft_s = 0.0;   ///< submission -> first generated token (0: none)
  double tpot_s = 0.0;   ///< mean time per output token after the first
  double e2e_s = 0.0;    ///< submission -> terminal event
  int32_t prompt_tokens = 0;
  int32_t prefix_reused_tokens = 0;  ///< prompt positions whose KV was shared, not computed
  int32_t generated_tokens = 0;
  std::string prefill_executor;  ///< "" when it never started
  std::string decode_executor;
  int32_t migrations = 0;  ///< KV hand-offs between executors
  uint64_t migration_bytes = 0;
  double migration_s = 0.0;
  int32_t preemptions = 0;  ///< times swapped out (or dropped and recomputed) for room
};

struct ExecutorMetrics {
  std::string name;
  bool accelerator = false;
  uint64_t steps = 0;
  uint64_t prefill_tokens = 0;
  uint64_t decode_tokens = 0;
  double busy_s = 0.0;           ///< time spent inside Executor::step
  double elapsed_s = 0.0;        ///< since the scheduler started
  double utilisation = 0.0;      ///< busy_s / elapsed_s
  double tokens_per_s = 0.0;     ///< (prefill + decode tokens) / elapsed_s
  double prefill_tps = 0.0;      ///< measured prompt tokens/s while busy (EWMA)
  double decode_tps = 0.0;       ///< measured decode tokens/s per sequence (EWMA)
  double batch_occupancy = 0.0;  ///< mean sequences per step / max_running
  int32_t running = 0;
  int32_t queued = 0;
  int32_t max_running = 0;
  KvTierUsage kv[kKvTierCount];  ///< its store's usage per tier (Device, Host, File)
  /// Of the compute tier's used pages, those only the prefix cache holds: evictable on
  /// demand, so free for admission (vLLM counts such cached blocks as free).
  int32_t kv_cache_only_pages = 0;
};

struct SchedulerMetrics {
  double elapsed_s = 0.0;
  uint64_t submitted = 0;
  uint64_t finished = 0;       ///< terminal events delivered
  uint64_t by_finish[8] = {};  ///< indexed by RequestFinish
  uint64_t migrations = 0;
  uint64_t migration_bytes = 0;
  double migration_s = 0.0;
  uint64_t preemptions = 0;
  uint64_t prompt_tokens = 0;  ///< of admitted requests
  uint64_t prefix_reused_tokens = 0;
  double prefix_hit_rate = 0.0;  ///< prefix_reused_tokens / prompt_tokens
  int32_t queued = 0;            ///< waiting in all executors
  std::vector<ExecutorMetrics> executors;

  std::string to_text() const;  ///< a human-readable multi-line dump
  std::string to_json() const;  ///< one JSON object (stable key names)
};

}  // namespace tandem
