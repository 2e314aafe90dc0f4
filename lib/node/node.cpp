#include "tandem/node/node.hpp"

#include <fmt/format.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <limits>

#include "tandem/core/error.hpp"
#include "tandem/core/thread_pool.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/model/model.hpp"
#if TANDEM_HAVE_CUDA
#include "tandem/exec/gpu/gpu_q4_executor.hpp"
#endif

namespace tandem {

namespace {

constexpr std::array<std::string_view, 4> kExecutorSets = {"cpu", "cpu+cpu", "gpu", "cpu+gpu"};
/// A GPU executor decodes this many times the sequences of a CPU executor of its set.
constexpr int32_t kGpuSlotsPerCpuSlot = 4;

ExecutorSpec cpu_spec(std::string name, int threads, int32_t max_running, bool accelerator) {
  ExecutorSpec e;
  e.kind = ExecutorKind::kCpu;
  e.name = std::move(name);
  e.n_threads = threads;
  e.max_running = max_running;
  e.accelerator = accelerator;
  return e;
}

ExecutorSpec gpu_spec(int32_t max_running) {
  ExecutorSpec e;
  e.kind = ExecutorKind::kGpu;
  e.name = "gpu";
  e.max_running = max_running * kGpuSlotsPerCpuSlot;
  return e;
}

}  // namespace

std::span<const std::string_view> executor_set_names() noexcept {
  return kExecutorSets;
}

std::vector<ExecutorSpec> executor_set(std::string_view name, int threads, int32_t max_running) {
  if (threads < 1 || max_running < 1) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("executor set: threads {} and max_running {} must be >= 1", threads, max_running));
  }
  if (max_running > std::numeric_limits<int32_t>::max() / kGpuSlotsPerCpuSlot) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("executor set: max_running {} is too large", max_running));
  }
  std::vector<ExecutorSpec> out;
  if (name == "cpu") {
    out.push_back(cpu_spec("cpu", threads, max_running, false));
  } else if (name == "cpu+cpu") {
    out.push_back(cpu_spec("cpuA", std::max(1, threads - threads / 2), max_running, true));
    out.push_back(cpu_spec("cpuB", std::max(1, threads / 2), max_running, false));
  } else if (name == "gpu") {
    out.push_back(gpu_spec(max_running));
  } else if (name == "cpu+gpu") {
    out.push_back(gpu_spec(max_running));
    out.push_back(cpu_spec("cpu", threads, max_running, false));
  } else {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("executor set '{}' is not one of {}", name, fmt::join(kExecutorSets, ", ")));
  }
  return out;
}

int32_t compute_tier_pages(const KvLayout& layout, int64_t n_ctx, int64_t max_step, int32_t max_running,
                           int32_t prefix_cache_entries) {
  const int32_t page_size = layout.page_size;
  if (n_ctx < 1 || page_size < 1 || max_running < 1 || prefix_cache_entries < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV pages: n_ctx {}, page_size {} and max_running {} must be >= 1, prefix cache entries "
                            "{} >= 0",
                            n_ctx, page_size, max_running, prefix_cache_entries));
  }
  const int64_t per_seq = layout.sequence_pages(n_ctx, max_step > 0 ? std::min(max_step, n_ctx) : n_ctx);
  const int64_t seqs = int64_t{max_running} + prefix_cache_entries;
  if (per_seq > std::numeric_limits<int32_t>::max() / seqs) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("KV pages: ({} slots + {} prefix cache entries) x {} pages per sequence is more than {}",
                            max_running, prefix_cache_entries, per_seq, std::numeric_limits<int32_t>::max()));
  }
  return static_cast<int32_t>(seqs * per_seq);
}

uint64_t physical_memory_bytes() noexcept {
  const long pages = ::sysconf(_SC_PHYS_PAGES);
  const long page = ::sysconf(_SC_PAGESIZE);
  return pages > 0 && page > 0 ? uint64_t(pages) * uint64_t(page) : 0;
}

std::vector<KvPageCounts> kv_page_counts(const HParams& hp, const NodeSpec& spec) {
  if (spec.executors.empty()) throw Error(ErrorCode::kInvalidArgument, "node: no executors");
  if (spec.n_ctx < 1 || spec.page_size < 1 || spec.prefix_cache_entries < 0) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("node: n_ctx {} and page_size {} must be >= 1, prefix_cache_entries {} >= 0", spec.n_ctx,
                            spec.page_size, spec.prefix_cache_entries));
  }
  std::vector<KvPageCounts> out(spec.executors.size());
  std::vector<uint64_t> page_bytes(spec.executors.size());
  // Host bytes: what the budget allows, less the CPU executors' compute tiers.
  uint64_t host_left = spec.host_kv_bytes > 0 ? spec.host_kv_bytes : physical_memory_bytes();
  if (host_left == 0) host_left = std::numeric_limits<uint64_t>::max();  // unknown: unlimited
  for (size_t i = 0; i < spec.executors.size(); ++i) {
    const ExecutorSpec& e = spec.executors[i];
    if (e.kind == ExecutorKind::kGpu && e.kv_dtype == KvDtype::kQ8_0) {
      throw Error(
          ErrorCode::kInvalidArgument,
          fmt::format("node: executor {} ({}): q8_0 KV pages are unsupported on the GPU (use f16 or f32)", i, e.name));
    }
    if (e.max_running < 1 || e.kv_pages < 0 || e.file_pages < kFilePagesAsCompute) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("node: executor {} ({}): max_running {} must be >= 1, kv_pages {} >= 0, file_pages {} "
                              ">= 0 or kFilePagesAsCompute",
                              i, e.name, e.max_running, e.kv_pages, e.file_pages));
    }
    const KvLayout layout = KvLayout::for_model(hp, spec.page_size, e.kv_dtype);
    const int32_t c = e.kv_pages > 0 ? e.kv_pages
                                     : compute_tier_pages(layout, spec.n_ctx, e.max_step_tokens, e.max_running,
                                                          spec.prefix_cache_entries);
    page_bytes[i] = layout.page_bytes();
    if (page_bytes[i] == 0) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("node: executor {} ({}): a KV page of {} layers x {} KV heads x {} dims holds no bytes",
                              i, e.name, hp.n_layer, hp.n_head_kv, hp.head_dim));
    }
    KvPageCounts& p = out[i];
    p.file = e.file_pages == kFilePagesAsCompute ? c : e.file_pages;
    if (e.kind == ExecutorKind::kGpu) {
      p.device = c;
      if (spec.device_kv_bytes > 0 && uint64_t(c) * page_bytes[i] > spec.device_kv_bytes) {
        throw Error(ErrorCode::kOutOfMemory,
                    fmt::format("node: executor {} ({}) needs {} Device KV pages of {} bytes, more than the Device "
                                "budget of {} bytes (lower max_running, n_ctx or the prefix cache)",
                                i, e.name, c, page_bytes[i], spec.device_kv_bytes));
      }
      continue;
    }
    p.host = c;
    const uint64_t bytes = uint64_t(c) * page_bytes[i];
    if (bytes > host_left) {
      throw Error(ErrorCode::kOutOfMemory,
                  fmt::format("node: executor {} ({}) needs {} Host KV pages of {} bytes ({} bytes), more than the {} "
                              "bytes left of the Host budget ({}; lower kv_pages, max_running, n_ctx or the prefix "
                              "cache)",
                              i, e.name, c, page_bytes[i], bytes, host_left,
                              spec.host_kv_bytes > 0 ? "host_kv_bytes" : "physical memory"));
    }
    host_left -= bytes;
  }
  for (size_t i = 0; i < spec.executors.size(); ++i) {  // GPU Host tiers: what the budget has left
    KvPageCounts& p = out[i];
    if (spec.executors[i].kind != ExecutorKind::kGpu) continue;
    p.host = int32_t(std::min<uint64_t>(uint64_t(p.device), host_left / page_bytes[i]));
    host_left -= uint64_t(p.host) * page_bytes[i];
  }
  return out;
}

std::unique_ptr<Executor> make_executor(std::shared_ptr<const Model> model, const ExecutorSpec& spec) {
  if (spec.kind == ExecutorKind::kGpu) {
#if TANDEM_HAVE_CUDA
    GpuExecutorOptions go;
    go.device = spec.device;
    return std::make_unique<GpuQ4Executor>(std::move(model), go);
#else
    throw Error(ErrorCode::kInvalidArgument,
                "this build has no GPU executor (configure with -DTANDEM_CUDA=ON on a machine with the CUDA toolkit)");
#endif
  }
  if (spec.pool) return std::make_unique<CpuQ4Executor>(std::move(model), spec.pool);
  CpuExecutorOptions co;
  co.n_threads = spec.n_threads;
  return std::make_unique<CpuQ4Executor>(std::move(model), co);
}

std::shared_ptr<KvStore> make_kv_store(const Executor& executor, const KvLayout& layout, const KvPageCounts& pages,
                                       const std::filesystem::path& kv_dir) {
  KvStoreOptions o;
  o.layout = layout;
  o.host_pages = pages.host;
  o.file_pages = pages.file;
  o.file_dir = kv_dir;
  o.file_chunk_pages = std::clamp(pages.file, 1, 64);
  if (pages.device > 0) {
    o.device = executor.make_kv_device_backend(layout, pages.device);
    if (!o.device) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("node: executor '{}' has no Device tier for {} KV pages", executor.name(), pages.device));
    }
  }
  return std::make_shared<KvStore>(std::move(o));
}

std::vector<NodeExecutor> build_node(const std::shared_ptr<const Model>& model, const NodeSpec& spec) {
  if (!model) throw Error(ErrorCode::kInvalidArgument, "node: null model");
  const std::vector<KvPageCounts> pages = kv_page_counts(model->hparams(), spec);
  std::vector<NodeExecutor> out;
  out.reserve(spec.executors.size());
  for (size_t i = 0; i < spec.executors.size(); ++i) {
    const ExecutorSpec& e = spec.executors[i];
    NodeExecutor n;
    n.spec = e;
    n.executor = make_executor(model, e);
    n.store = make_kv_store(*n.executor, KvLayout::for_model(model->hparams(), spec.page_size, e.kv_dtype), pages[i],
                            e.kv_dir);
    n.pages = pages[i];
    out.push_back(std::move(n));
  }
  return out;
}

}  // namespace tandem
