// CpuQ4Executor: the transformer forward pass on the CPU.
//
// Weights stay in the GGUF mapping (Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, Q8_0, F16, BF16 or F32), except that
// by default (on every ISA: the kernels compute the same bits on each) the executor keeps a
// copy of every Q4_0, Q4_1, Q5_0, Q4_K and Q6_K weight matrix repacked 8 rows at a time
// (kernels::BlockQ4_0x8, BlockQ4_1x8, BlockQ5_0x8, BlockQ4_Kx8, BlockQ6_Kx8; the same bytes
// again in memory, the K-quants' 1.22x and 1.07x that) and multiplies with
// kernels::gemm_q4_0x8_q8_0 / gemm_q4_1x8_q8_0 / gemm_q5_0x8_q8_0 / gemm_q4_kx8_q8_0 /
// gemm_q6_kx8_q8_0. The copy is
// made by the first executor of a Model (on its pool) and shared by every executor of that
// Model alive at the same time (repacked_weights_id()); it is freed with the last of them.
// Once a matrix mapped from the file is repacked, its file pages are released
// (GgufFile::release_pages), so resident memory holds the copy instead of both.
// Each matrix's copy is found once, at construction (a per-layer table): a step indexes it.
// TANDEM_CPU_REPACK=0 (or false, off, no) in the environment, or
// CpuExecutorOptions::repack = false, turns repacking off.
// Activations entering a Q4_0/Q8_0 matmul are quantised to Q8_0 and multiplied with
// integer dot products (kernels/cpu); F16 weights take f16-rounded activations; attention reads an f16 KV
// cache through each sequence's block table, tiled (kernels::attn_tiled): one task per
// (sequence, KV head, query tile) over the thread pool, each K/V row read once per task
// for all query heads sharing it (GQA). The numerics follow llama.cpp's CPU backend
// (RMSNorm sum in double, RoPE angles by repeated multiplication, q and the attention
// probabilities rounded to f16 before the KV dot products) so logits agree with its
// golden references.
//
// Memory: scratch buffers grow to the largest batch seen and are then reused, so a
// steady decode loop does no heap allocation.
//
// Threads: work is split over a persistent ThreadPool. By default every CpuQ4Executor of
// the process shares one node pool (node_pool(): one thread per physical core), so
// several executors and sessions never run more compute threads than cores — their steps
// take turns on the pool. n_threads > 0 gives the executor a pool of its own (the caller
// then chooses the core budget); the pool constructor shares a pool the caller made.
#pragma once

#include <memory>
#include <vector>

#include "tandem/core/thread_pool.hpp"
#include "tandem/exec/executor.hpp"

namespace tandem {

struct CpuExecutorOptions {
  int n_threads = 0;  ///< > 0: a pool of this many threads of its own; <= 0: the shared node_pool()
  /// false: multiply Q4_0, Q4_1 and Q5_0 weights in the GGUF layout instead of the repacked copy
  /// (llama.cpp's --no-repack): the same bits (one quantised dot arithmetic, the GPU
  /// kernels' too: kernels/cpu/cpu_kernels.hpp), no second copy of the weights, slower.
  bool repack = true;
};

class CpuQ4Executor final : public Executor {
 public:
  CpuQ4Executor(std::shared_ptr<const Model> model, const CpuExecutorOptions& options = {});
  /// Computes on `pool`, shared with other executors (from make_pool() or node_pool()).
  /// Throws Error(kInvalidArgument) for a null pool.
  CpuQ4Executor(std::shared_ptr<const Model> model, std::shared_ptr<ThreadPool> pool);
  ~CpuQ4Executor() override;
  std::string_view name() const noexcept override { return "cpu"; }
  /// Computes on Host pages; File pages (memory-mapped) are readable too.
  KvTier kv_tier() const noexcept override { return KvTier::kHost; }
  bool can_read(KvTier tier) const noexcept override { return tier != KvTier::kDevice; }
  bool supports(KvDtype) const noexcept override { return true; }
  int n_threads() const noexcept { return pool_->size(); }
  const std::shared_ptr<ThreadPool>& pool() const noexcept { return pool_; }

  /// A pool of `n_threads` (<= 0: physical cores) whose workers have the kernels'
  /// per-thread scratch prepared, for sharing between executors. Errors as ThreadPool's.
  static std::shared_ptr<ThreadPool> make_pool(int n_threads);
  /// The process-wide pool (one thread per physical core) every executor built without
  /// n_threads or pool shares. Made on first use, released with its last user.
  /// Thread-safe.
  static std::shared_ptr<ThreadPool> node_pool();

 protected:
  void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) override;

 public:
  struct Scratch;   ///< opaque: per-step buffers, reused between steps
  struct Repacked;  ///< opaque: the repacked Q4_0 weights (empty when not used)
  /// Whether this executor computes Q4_0 matmuls on repacked weights (fixed at construction).
  bool repacked_weights() const noexcept;
  /// Identity of the repacked weights: equal for executors that share one copy (those of
  /// one Model alive together), null when this executor does not repack.
  const void* repacked_weights_id() const noexcept;

 private:
  void repack_weights(bool wanted);
  std::shared_ptr<ThreadPool> pool_;
  std::unique_ptr<Scratch> s_;
  std::shared_ptr<const Repacked> repacked_;  ///< never null (empty when not repacking)
};

}  // namespace tandem
