// GpuQ4Executor: the transformer forward pass on one CUDA device, with the same Q4_0
// weights and the same numerics as CpuQ4Executor (lib/exec/cpu/cpu_q4_executor.cpp).
//
// Built when CMake finds CUDA: tandem_core then carries the compile definition
// TANDEM_HAVE_CUDA=1 (public). The header compiles everywhere, but its functions are only
// defined in CUDA builds: guard uses with `#if TANDEM_HAVE_CUDA`.
//
// Weights are uploaded once per (Model, device): executors of one model on one device share
// them (weights_id()). Q4_0 and Q8_0 matrices are repacked into
// separate quant-byte and scale arrays (a pure rearrangement of the GGUF blocks,
// kernels/cuda/block_math.cuh); F32/F16/BF16 matrices are copied as they are; norms and
// biases as F32. The token-embedding table stays on the host (one row per token is
// dequantised there, exactly as the CPU does) unless the output projection is tied to it.
//
// Numerics: activations entering a Q4_0/Q8_0 matmul are quantised to Q8_0 on the device
// bit-identically to kernels/cpu (amax / 127, round-half-even), each block's integer dot
// is exact (dp4a, or int8 Tensor Core MMA for prefill steps of 16+ tokens, with the same
// float operations in the same order as dp4a), so CPU and GPU differ only in the order of
// float accumulation, and a token's GPU logits do not depend on its batch. RMSNorm
// sums in double; RoPE uses the CPU's cos/sin table (computed on the host the same way);
// with an f16 KV cache q is rounded to f16; softmax subtracts the max and sums in double.
// Attention rounds the probabilities to f16 as the CPU does: multi-token steps (prefill)
// take one block per (token, head); the single token of a decode step goes through split-KV
// attention (attention_split in kernels/cuda/cuda_kernels.hpp: partitions of 128 absolute
// positions, one block per GQA group and partition, log-sum-exp combination).
// Tolerances against the CPU: tests/gpu/gpu_test_support.hpp.
//
// KV: the executor computes on Device pages (kv_tier() == kDevice) of a KvStore whose
// Device tier is this executor's backend (make_kv_device_backend; tandem/node/node.hpp builds such stores): the
// attention kernel reads them in place through the block table; a Session without a store
// of its own gets such a Device store by default. Host and File pages are also readable
// (a store without a Device tier): their pages are staged into VRAM for the step and the
// written pages copied back, which is correct but moves the whole sequence's KV every
// step — use a Device store for speed.
//
// Streams: all compute runs on the executor's own non-blocking stream; KV page copies of
// a device backend run on the backend's own non-blocking stream with pinned staging, so
// a scheduler thread moving pages overlaps with a step in progress. step() returns after
// the logits are on the host (the compute stream is synchronised).
//
// Devices: every call makes the executor's device current and restores the caller's
// current device before returning. The attention kernels' shared-memory attribute is set
// once per device (at the first executor's construction) and checked.
//
// Memory: per-step device buffers grow (doubling) to the largest batch seen and are then
// reused, so a steady decode loop allocates nothing; outgrown buffers are freed only at
// destruction, since cudaFree would synchronise every stream on the device.
//
// CUDA graphs: a step whose pages are all Device-tier is captured and replayed as one
// graph (GpuExecutorOptions::cuda_graphs); the logits come back through a pinned buffer.
//
// Thread-safety: as every executor, one step at a time.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

#include "tandem/exec/executor.hpp"
#include "tandem/kv/kv_store.hpp"

namespace tandem {

struct GpuExecutorOptions {
  int device = 0;  ///< CUDA device ordinal
  /// Run each step whose KV pages are all in VRAM as a CUDA graph (captured, then updated
  /// in place or re-instantiated when the batch's shape changes). Same results either way.
  bool cuda_graphs = true;
  /// Fused kernels on the per-token path: RMSNorm + Q8_0 quantisation, SwiGLU + Q8_0,
  /// RoPE + KV store, and (steps where every token decodes, head_dim % 32 == 0) the split
  /// attention's last kernel + the Q8_0 input of Wo, each in one launch
  /// (kernels/cuda/cuda_kernels.hpp). Bit-identical results either way; off = the separate
  /// launches (tests compare the two).
  bool fused_kernels = true;
  /// Multiply Q4_0/Q8_0 weights by the Q8_0 activations of steps with at least 16 token
  /// rows (prefill) on the Tensor Cores (int8 WMMA, sm_72+) instead of the dp4a kernel.
  /// Bit-identical results either way (kernels/cuda/cuda_kernels.hpp gemm()); off = dp4a
  /// only (tests compare the two).
  bool tensor_cores = true;
  /// Attention of multi-token steps (prefill chunks) through the tiled flash-attention
  /// kernel (kernels/cuda/cuda_kernels.hpp attention_prefill: one block per tile of up to
  /// 16 query tokens and KV head, with the GQA group's heads; K/V tiles in shared memory;
  /// online-softmax statistics) instead of one block per (token, head). Not bit-identical
  /// (the softmax sum's order; both within the float64 bounds of
  /// tests/gpu/test_gpu_attention.cpp); off = attention() for prefill tokens. Shapes whose
  /// tile does not fit 48 KiB of shared memory use attention() either way; decode tokens
  /// use the split-KV kernels either way.
  bool flash_prefill = true;
  /// Matrices that share their input in one launch where the step takes the dp4a kernels
  /// (decode and small batches): Q, K and V with their biases added in the same launch;
  /// gate and up (kernels/cuda/cuda_kernels.hpp gemm_parts). Bit-identical results either
  /// way; off = a launch per matrix and per bias (tests compare the two).
  bool merge_matmuls = true;
};

class GpuQ4Executor final : public Executor {
 public:
  /// Uploads the weights. Throws Error(kInvalidArgument) when there is no such CUDA device
  /// or the model has a shape the kernels do not take (head_dim > 1024), kOutOfMemory when the weights do not fit,
  /// kInternal on another CUDA error.
  GpuQ4Executor(std::shared_ptr<const Model> model, const GpuExecutorOptions& options = {});
  ~GpuQ4Executor() override;

  std::string_view name() const noexcept override { return "gpu"; }
  KvTier kv_tier() const noexcept override { return KvTier::kDevice; }
  /// Device pages are read in place; Host and File pages are staged through VRAM.
  bool can_read(KvTier) const noexcept override { return true; }
  /// f16 and f32 KV pages; q8_0 is unsupported (no CUDA kernel reads it yet): a step on a
  /// q8_0 store is refused with Error(kInvalidArgument), and make_kv_device_backend
  /// refuses a q8_0 layout the same way.
  bool supports(KvDtype dtype) const noexcept override { return dtype != KvDtype::kQ8_0; }

  /// Number of CUDA devices visible (0 without a driver or device).
  static int device_count() noexcept;
  int device() const noexcept;
  /// Bytes of VRAM holding the model's weights.
  uint64_t weight_bytes() const noexcept;
  /// Identity of the weights in VRAM: executors of one Model on one device share a single
  /// upload (freed with the last of them) and return the same value.
  const void* weights_id() const noexcept;
  /// Bytes of VRAM held by per-step buffers (grow to the largest batch seen).
  uint64_t scratch_bytes() const noexcept;
  /// How many times a step's CUDA graph was instantiated (not just updated) so far.
  int64_t graph_instantiations() const noexcept;
  /// The compute stream (a cudaStream_t), for a scheduler that records events on it.
  void* stream() const noexcept;

  /// A Device tier of `pages` page slots in one VRAM allocation on this executor's device.
  /// Throws Error(kOutOfMemory) when it does not fit.
  std::unique_ptr<KvDeviceBackend> make_kv_device_backend(const KvLayout& layout, int32_t pages) const override;

 protected:
  void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) override;

 public:
  struct Impl;  ///< opaque: device buffers, streams

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
