// PerfModel: how long one executor step of a named big model takes on a named processor.
//
// Used by PacedExecutor (paced_executor.hpp) to make a CPU executor running a small model
// behave *in time* like, say, an L40S running a 27B model, so that the Scheduler's
// routing, batching, hand-offs and KV pressure can be exercised at full scale on any
// machine. docs/simulation.md states the model, its sources and its limits.
//
// Step time (seconds) for a batch with T new tokens (prefill + decode), whose sequences
// read R cached-plus-new KV positions in all, and whose new tokens attend to A
// (query, key) position pairs in all:
//
//   t = max(W / (B * e_b), (2 * P * T + 4 * n_layer * n_head * head_dim * A) / (C * e_c))
//       + R * kv_bytes_per_token / (B * e_b)
//       + overhead
//
//   W  bytes of matmul weights one step reads (every Q4_0 matrix once, output included;
//      token embeddings are gathered rows, not read whole)
//   P  matmul parameters per token (2 * P FLOPs per token: one multiply-add each)
//   B  peak memory bandwidth (datasheet), e_b its achieved fraction when streaming weights
//   C  peak dense int8 throughput (tensor cores for GPUs, int8 dot-product SIMD for CPUs:
//      Q4_0 x Q8_0 runs as int8 dot products on both), e_c its achieved fraction in a Q4_0
//      matmul
//   4 * n_layer * n_head * head_dim FLOPs per attended pair: q.k and p.v, 2 FLOPs each
//
// The first term is the classic roofline of a step (weights are read once per step, so a
// bigger batch costs compute, not bandwidth); KV is read per sequence on top (attention
// reads each sequence's cache once per step: FlashAttention-style tiling); the overhead
// covers kernel launches / thread wake-ups and the host-side step. KV bytes are f16 K and
// V per layer: 2 * n_layer * n_head_kv * head_dim * 2 bytes per token.
//
// Sources of the profile constants (processor_profiles()):
//   * Bandwidth, memory and int8 peaks: NVIDIA H200 (141 GB HBM3e, 4.8 TB/s, INT8 Tensor
//     3,958 TOPS with sparsity = 1,979 dense), L40S (48 GB GDDR6, 864 GB/s, INT8 Tensor
//     1,466 TOPS sparse = 733 dense), A10 (24 GB GDDR6, 600 GB/s, INT8 500 TOPS sparse =
//     250 dense) datasheets; AMD EPYC 9354 (Genoa, 32 cores, 3.25 GHz base, 12 channels
//     DDR5-4800 = 460.8 GB/s) and EPYC 7R13 (Milan, as AWS g6e.16xlarge exposes it:
//     32 cores, 8 channels DDR4-3200 = 204.8 GB/s) product pages.
//   * GPU achieved fractions from published llama.cpp CUDA measurements: decode of
//     llama 8B Q4_0 (4.66 GB) at one token per step, RTX 3090: 155 t/s (ggml-org/llama.cpp
//     PR #15802) = 0.72 TB/s of 0.936 TB/s -> e_b = 0.75; prefill (MMQ on int8 tensor
//     cores), RTX 4090, llama 8B Q4_0 pp512: 10,359 t/s (PR #7676) = 166 TOPS of 661 int8
//     dense -> e_c = 0.25.
//   * CPU fractions from Tandem's own measurements on its development VM: decode reads
//     weights at ~94% of the measured stream bandwidth (kVm2Calibration below, quiet Zen 1
//     host, benchmarks/README.md); prefill achieves 38.1 int8 ops per cycle per core with
//     the repacked AVX2 kernels (2026-12-06, Intel Xeon host; the vm2 profile keeps its own
//     host's kVm2Calibration.int8_ops_per_cycle), e_c = that / 128 (peak: 64 int8
//     multiply-adds per cycle). The EPYC profiles reuse these fractions over their
//     datasheet peaks, with the STREAM-to-peak ratio of a DDR server (~0.78) folded into
//     e_b. Genoa would run the AVX-512 VNNI kernels, which do more per cycle than AVX2: the
//     CPU's compute is underestimated there, so what the simulation credits the CPU with is
//     a lower bound.
//   * Per-step overhead: GPU 1 ms (kernel launches of a 64-layer model with CUDA graphs
//     plus the engine's host-side step, the order vLLM reports for its scheduler step);
//     CPU 0.2 ms (assumed: thread-pool wake-ups and the host-side step; a whole 1-token
//     decode step of the 260K-parameter aidreams260K takes 0.07-0.27 ms on the loaded VM).
//
// Thread-safety: all functions are pure; profiles are immutable constants.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>

#include "tandem/exec/executor.hpp"
#include "tandem/model/model.hpp"

namespace tandem {

/// A processor as the performance model sees it.
struct ProcessorProfile {
  std::string_view name;            ///< "h200", "l40s", "a10", "epyc32", "epyc7r13", "vm2"
  std::string_view description;     ///< what it stands for, with the datasheet figures
  bool accelerator = false;         ///< a GPU (routing: big batches, fast prefill)
  double mem_bw = 0;                ///< peak memory bandwidth, bytes/s
  double bw_efficiency = 0;         ///< achieved fraction of mem_bw (0, 1]
  double peak_ops = 0;              ///< peak dense int8 operations/s (multiply and add = 2)
  double compute_efficiency = 0;    ///< achieved fraction of peak_ops in a Q4_0 matmul (0, 1]
  double step_overhead_s = 0;       ///< fixed cost per step, seconds
  uint64_t memory_bytes = 0;        ///< VRAM (GPU) or host RAM (CPU), bytes
  int32_t max_running = 16;         ///< decode slots the simulated executor gets
  int32_t step_token_budget = 256;  ///< tokens per step (decodes + prefill chunks)
  int32_t prefill_chunk = 128;      ///< prompt tokens of one sequence per step
};

/// The hyper-parameters the model needs (a subset of HParams).
struct ModelShape {
  std::string_view name;
  int32_t n_vocab = 0;
  int32_t n_embd = 0;
  int32_t n_layer = 0;
  int32_t n_head = 0;
  int32_t n_head_kv = 0;
  int32_t head_dim = 0;
  int32_t n_ff = 0;
};

/// Byte and FLOP counts derived from a ModelShape (all matmuls Q4_0: 18 bytes per 32
/// weights, the format Tandem shares between CPU and GPU; KV f16).
struct ModelProfile {
  std::string name;
  int64_t matmul_params = 0;        ///< weights in the per-token matmuls (output head included)
  int64_t total_params = 0;         ///< matmul_params + token embeddings
  uint64_t weight_bytes_read = 0;   ///< Q4_0 bytes of matmul_params: read once per step
  uint64_t weight_bytes_total = 0;  ///< Q4_0 bytes of total_params: resident in the processor's memory
  uint64_t kv_bytes_per_token = 0;  ///< f16 K + V, all layers
  double attn_flops_per_pair = 0;   ///< 4 * n_layer * n_head * head_dim
  ModelShape shape;

  /// Throws Error(kInvalidArgument) for a non-positive dimension.
  static ModelProfile from_shape(const ModelShape& s);
  /// From a loaded model's hyper-parameters (head_dim_v taken equal to head_dim).
  static ModelProfile from_hparams(std::string name, const HParams& hp);
};

/// What a step computes, counted from its batch.
struct StepShape {
  int64_t prefill_tokens = 0;  ///< new tokens of sequences stepping more than one token
  int64_t decode_tokens = 0;   ///< new tokens of sequences stepping exactly one
  int64_t kv_positions = 0;    ///< sum over sequences of pos0 + n (positions attention reads)
  int64_t attn_pairs = 0;      ///< sum over new tokens at position i of (i + 1)

  /// Counts for an executor batch; no allocation.
  static StepShape of(std::span<const SequenceStep> batch) noexcept;
  /// One sequence stepping `n` tokens after `pos0` cached positions.
  static StepShape single(int64_t pos0, int64_t n) noexcept;
  StepShape& operator+=(const StepShape& o) noexcept;
};

class PerfModel {
 public:
  /// Throws Error(kInvalidArgument) when a profile rate or efficiency is not positive.
  PerfModel(const ProcessorProfile& processor, ModelProfile model);

  /// Seconds one step of this shape takes (the formula at the top of this file).
  double step_seconds(const StepShape& s) const noexcept;
  /// Seconds `steps` steps take whose shapes add up to `s`: weights and overhead `steps`
  /// times, compute and KV of `s` (= the sum of their step_seconds while all of them are
  /// on the same side of the roofline's max).
  double steps_seconds(const StepShape& s, int64_t steps) const noexcept;
  /// Decode speed of one sequence in a batch of `batch` sequences at `ctx` positions each.
  double decode_tokens_per_s(int32_t batch, int64_t ctx) const noexcept;
  /// Seconds of a real executor step in which every real token stands for `token_scale`
  /// modelled tokens (k; 1 = step_seconds(StepShape::of(batch))). The real step is taken
  /// as k modelled steps, each with the real step's token counts (a sequence stepping n
  /// tokens at real position pos0 steps n tokens in each, from modelled position k * pos0),
  /// so prompt tokens cost k times their compute, a decode token k decode steps, and KV
  /// reads and attention are those of k times the positions. Returns steps_seconds of the
  /// k steps' summed shape. No allocation.
  double scaled_step_seconds(std::span<const SequenceStep> batch, int32_t token_scale) const noexcept;
  /// Prompt speed of one `n`-token prefill step from an empty sequence.
  double prefill_tokens_per_s(int64_t n) const noexcept;
  /// Bytes of the processor's memory left for KV: memory_bytes * kKvMemoryFraction minus
  /// the resident weights (0 when the weights do not fit).
  uint64_t kv_budget_bytes() const noexcept;
  /// kv_budget_bytes() in KV pages of `page_size` tokens of the modelled (big) model.
  int64_t kv_budget_pages(int32_t page_size) const noexcept;

  const ProcessorProfile& processor() const noexcept { return p_; }
  const ModelProfile& model() const noexcept { return m_; }

  /// Fraction of a processor's memory an engine may use (vLLM's gpu_memory_utilization
  /// default, applied to host RAM as well).
  static constexpr double kKvMemoryFraction = 0.9;

 private:
  ProcessorProfile p_;
  ModelProfile m_;
};

/// Every built-in processor profile.
std::span<const ProcessorProfile> processor_profiles() noexcept;
/// Every built-in model shape.
std::span<const ModelShape> model_shapes() noexcept;
/// Look up by name; throws Error(kInvalidArgument) naming the known profiles.
const ProcessorProfile& processor_profile(std::string_view name);
const ModelShape& model_shape(std::string_view name);

/// The measurements the vm2 profile and the server CPU profiles' decode fraction come from
/// (this project's 2-core development VM on its AMD EPYC Zen 1 host, AVX2 kernels;
/// tandem-bench on a TinyLlama-1.1B-shaped Q4_0 file; docs/simulation.md "Calibration").
/// The server profiles' compute efficiency is the newer kernels' (lib/exec/perf_model.cpp).
struct CpuCalibration {
  double stream_bw = 0;           ///< bytes/s, tandem-bench's read-bandwidth figure (2 threads)
  double decode_bw_fraction = 0;  ///< decode weight bytes/s over stream_bw (quiet machine)
  double int8_ops_per_cycle = 0;  ///< achieved per core in pp512 (2 * params * tokens / CPU-seconds / clock)
  double clock_hz = 0;            ///< reported core clock
  int32_t cores = 0;
  double step_overhead_s = 0;  ///< fixed seconds per decode step, fitted with the bandwidth (vm2 only)
};
extern const CpuCalibration kVm2Calibration;

}  // namespace tandem
