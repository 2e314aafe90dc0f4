// Node: the one place that turns "which executors, and how much memory for KV" into
// executors and the KV stores they compute on. The C ABI (tandem_scheduler_create,
// tandem_session_create), tandem-server, tandem-bench, tandem-cli and Session size their
// KV through it; nothing else decides how many pages a tier gets.
//
// The page rule. With P = KvLayout::sequence_pages(n_ctx, max_step) (the pages of one
// sequence at full context: ceil(n_ctx / page_size) + 1 per layer group, the + 1 for a
// copy-on-write of a shared last page; a sliding-window group only what its window and one
// step of ExecutorSpec::max_step_tokens span), an executor's compute
// tier (the tier it computes on: Host for a CPU executor, Device for a GPU one) holds
//
//   C = (max_running + prefix_cache_entries) x P pages      (ExecutorSpec::kv_pages > 0 overrides)
//
// so every decode slot and every prefix-cache entry can hold a full context at once.
// A GPU executor's Device tier is C pages; its Host tier (where sequences park when the
// Device is full) is also C pages, cut to what the host budget has left. A CPU executor's
// Host tier is C pages. The File tier is ExecutorSpec::file_pages (kFilePagesAsCompute: C).
// Budgets: the Host tiers of the CPU executors together must fit NodeSpec::host_kv_bytes
// (0 = the machine's physical memory), GPU executors' Host tiers get what is left, in
// order; each GPU executor's Device tier must fit NodeSpec::device_kv_bytes (0 = no limit
// but the device's memory). A budget too small for the rule is Error(kOutOfMemory).
//
// Thread-safety: the functions here are free of shared state (reentrant); what they return
// is owned by the caller.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/exec/executor.hpp"
#include "tandem/kv/kv_store.hpp"

namespace tandem {

class Model;
class ThreadPool;
struct HParams;

enum class ExecutorKind : uint32_t { kCpu = 0, kGpu = 1 };

/// ExecutorSpec::file_pages value asking for a File tier as large as the compute tier.
inline constexpr int32_t kFilePagesAsCompute = -1;

/// One executor of a node and its KV store.
struct ExecutorSpec {
  ExecutorKind kind = ExecutorKind::kCpu;
  std::string name;                  ///< for the scheduler's logs and metrics ("cpu", "cpuA", "gpu")
  int n_threads = 0;                 ///< CPU: > 0 a pool of this many threads; <= 0 the shared node_pool()
  std::shared_ptr<ThreadPool> pool;  ///< CPU: compute on this pool instead (n_threads then unused)
  int device = 0;                    ///< GPU: CUDA device ordinal
  int32_t max_running = 1;           ///< sequences decoded at once (scheduler slots), >= 1
  std::optional<bool> accelerator;   ///< routing: treat as an accelerator (unset: computes on Device)
  KvDtype kv_dtype = KvDtype::kF16;  ///< f16, f32 or q8_0 (CPU only)
  int32_t kv_pages = 0;              ///< > 0: compute-tier pages instead of the rule's C
  int32_t file_pages = 0;            ///< File tier pages: 0 none, kFilePagesAsCompute = C
  std::filesystem::path kv_dir;      ///< File tier directory ("" = $TMPDIR, else /tmp)
  /// Positions a sequence writes in one step at most (the prefill_chunk of the executor's
  /// scheduler loop); 0: n_ctx. Bounds a sliding-window model's windowed pages (the rule).
  int32_t max_step_tokens = 0;
};

struct NodeSpec {
  std::vector<ExecutorSpec> executors;
  int32_t n_ctx = 0;                 ///< positions per sequence, >= 1 (callers resolve defaults)
  int32_t page_size = 16;            ///< tokens per KV page, >= 1
  int32_t prefix_cache_entries = 0;  ///< finished prompts kept per executor (Scheduler), >= 0
  uint64_t host_kv_bytes = 0;        ///< Host tiers of all executors together (0 = physical memory)
  uint64_t device_kv_bytes = 0;      ///< Device tier of each GPU executor (0 = no limit)
};

/// Pages of each tier of one executor's store.
struct KvPageCounts {
  int32_t device = 0;
  int32_t host = 0;
  int32_t file = 0;
  bool operator==(const KvPageCounts&) const = default;
};

/// The names executor_set() takes, in the order help texts list them:
/// "cpu", "cpu+cpu", "gpu", "cpu+gpu".
std::span<const std::string_view> executor_set_names() noexcept;

/// The executors of a named set, `threads` (>= 1) CPU threads in all, `max_running` (>= 1)
/// decode slots per CPU executor: cpu = one CPU executor "cpu" with every thread; cpu+cpu =
/// "cpuA" (the accelerator, the larger half of the threads) and "cpuB" (the rest, at least
/// 1 each); gpu = the GPU executor "gpu"; cpu+gpu = "gpu", then "cpu" with every thread.
/// A GPU executor gets 4 x max_running slots (it decodes wider batches at the same cost).
/// Throws Error(kInvalidArgument) for another name, threads < 1 or max_running < 1.
std::vector<ExecutorSpec> executor_set(std::string_view name, int threads, int32_t max_running);

/// P x (max_running + prefix_cache_entries): the rule's compute-tier pages (header comment)
/// for `layout`, steps of at most `max_step` positions (<= 0: n_ctx). Throws
/// Error(kInvalidArgument) for n_ctx, the page size or max_running < 1, prefix < 0, or a
/// count above INT32_MAX.
int32_t compute_tier_pages(const KvLayout& layout, int64_t n_ctx, int64_t max_step, int32_t max_running,
                           int32_t prefix_cache_entries);

/// The page counts of every executor of `spec` under the rule (header comment), in order,
/// for a model of `hp` (page bytes from KvLayout::for_model(hp, page_size, kv_dtype)).
/// Throws Error(kInvalidArgument) for a bad spec (see NodeSpec / ExecutorSpec; a q8_0 GPU
/// executor), Error(kOutOfMemory) when a budget cannot hold the rule's pages.
std::vector<KvPageCounts> kv_page_counts(const HParams& hp, const NodeSpec& spec);

/// Physical memory of this machine in bytes (0 when it cannot be read).
uint64_t physical_memory_bytes() noexcept;

/// The executor `spec` describes, for `model`. Throws Error(kInvalidArgument) when this
/// build has no GPU executor or the device is missing; otherwise what the executor's
/// constructor throws.
std::unique_ptr<Executor> make_executor(std::shared_ptr<const Model> model, const ExecutorSpec& spec);

/// A KV store of `layout` for `executor`: a Device tier of pages.device from the
/// executor's make_kv_device_backend (Error(kInvalidArgument) when pages.device > 0 and it
/// has none), pages.host Host and pages.file File pages in `kv_dir`. What the KvStore and
/// the backend throw propagates (kOutOfMemory when memory is short).
std::shared_ptr<KvStore> make_kv_store(const Executor& executor, const KvLayout& layout, const KvPageCounts& pages,
                                       const std::filesystem::path& kv_dir = {});

/// One executor of a built node.
struct NodeExecutor {
  ExecutorSpec spec;
  std::unique_ptr<Executor> executor;
  std::shared_ptr<KvStore> store;
  KvPageCounts pages;
};

/// Executors and stores of `spec` for `model`, sized by kv_page_counts; errors as
/// kv_page_counts, make_executor and make_kv_store.
std::vector<NodeExecutor> build_node(const std::shared_ptr<const Model>& model, const NodeSpec& spec);

}  // namespace tandem
