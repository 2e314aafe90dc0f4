// CpuQ4Executor: the transformer forward pass on the CPU.
//
// Weights stay in the GGUF mapping (Q4_0, Q8_0, F16, BF16 or F32). Activations entering a
// Q4_0/Q8_0 matmul are quantised to Q8_0 and multiplied with integer dot products
// (kernels/cpu); F16 weights take f16-rounded activations; attention reads an f16 KV
// cache through each sequence's block table. The numerics follow llama.cpp's CPU backend
// (RMSNorm sum in double, RoPE angles by repeated multiplication, q and the attention
// probabilities rounded to f16 before the KV dot products) so logits agree with its
// golden references.
//
// Memory: scratch buffers grow to the largest batch seen and are then reused, so a
// steady decode loop does no heap allocation. Work is split over a persistent
// ThreadPool (threads default to the number of physical cores).
#pragma once

#include <memory>
#include <vector>

#include "tandem/executor.hpp"
#include "tandem/thread_pool.hpp"

namespace tandem {

struct CpuExecutorOptions {
  int n_threads = 0;  ///< <= 0: number of physical cores
};

class CpuQ4Executor final : public Executor {
 public:
  CpuQ4Executor(std::shared_ptr<const Model> model, const CpuExecutorOptions& options = {});
  ~CpuQ4Executor() override;
  std::string_view name() const noexcept override { return "cpu"; }
  /// Computes on Host pages; File pages (memory-mapped) are readable too.
  KvTier kv_tier() const noexcept override { return KvTier::kHost; }
  bool can_read(KvTier tier) const noexcept override { return tier != KvTier::kDevice; }
  bool supports(KvDtype) const noexcept override { return true; }
  int n_threads() const noexcept { return pool_.size(); }

 protected:
  void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) override;

 public:
  struct Scratch;  ///< opaque: per-step buffers, reused between steps

 private:
  ThreadPool pool_;
  std::unique_ptr<Scratch> s_;
};

}  // namespace tandem
