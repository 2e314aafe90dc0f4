// Internals of the GPU executor shared with its test-only harnesses (tests/gpu/hooks): the
// CUDA error check, the current-device guard, device buffers, the device layout of quantised
// weights and the once-per-device attention setup. Not installed; only lib/exec/gpu and the tandem_gpu_test_hooks
// target include it.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

#include "cuda/cuda_kernels.hpp"
#include "tandem/core/error.hpp"
#include "tandem/model/model.hpp"  // GgmlType

namespace tandem::gpu_detail {

/// Throws Error (kOutOfMemory for cudaErrorMemoryAllocation, else kInternal) naming `what`
/// when `e` is not cudaSuccess, after clearing a non-sticky error.
void cuda_check(cudaError_t e, const char* what);
#define TANDEM_CUDA(expr) ::tandem::gpu_detail::cuda_check((expr), #expr)

// Makes `device` current for its lifetime, then restores the caller's current device
// (a library call never leaves the caller's thread on another device).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) : device_(device) {
    TANDEM_CUDA(cudaGetDevice(&prev_));
    if (prev_ != device_) TANDEM_CUDA(cudaSetDevice(device_));
  }
  ~DeviceGuard() {
    if (prev_ != device_) (void)cudaSetDevice(prev_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int device_;
  int prev_ = 0;
};

// Device memory, freed on destruction.
class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) { alloc(bytes); }
  ~DevBuf() { reset(); }
  DevBuf(DevBuf&& o) noexcept : p_(o.p_), bytes_(o.bytes_) { o.p_ = nullptr, o.bytes_ = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      reset();
      p_ = o.p_, bytes_ = o.bytes_;
      o.p_ = nullptr, o.bytes_ = 0;
    }
    return *this;
  }
  void alloc(size_t bytes) {
    reset();
    if (bytes == 0) return;
    TANDEM_CUDA(cudaMalloc(&p_, bytes));
    bytes_ = bytes;
  }
  void reset() noexcept {
    if (p_) cudaFree(p_);
    p_ = nullptr, bytes_ = 0;
  }
  /// Grow (contents not kept) to at least `bytes`, doubling. The outgrown allocation is
  /// moved to `retired` rather than freed: cudaFree synchronises the whole device (every
  /// stream of every executor on it), so it waits for the owner's destruction; doubling
  /// bounds what is kept to the final size.
  void* grow(size_t bytes, std::vector<DevBuf>& retired) {
    if (bytes_ < bytes) {
      const size_t want = std::max(bytes, 2 * bytes_);
      if (p_) retired.push_back(std::move(*this));
      alloc(want);
    }
    return p_;
  }
  template <class T>
  T* as() const noexcept {
    return static_cast<T*>(p_);
  }
  size_t bytes() const noexcept { return bytes_; }

 private:
  void* p_ = nullptr;
  size_t bytes_ = 0;
};

/// A quantised matrix in kernels/cuda's device layout (block_math.cuh), still on the host:
/// the fields of its GGUF blocks split into arrays, nothing re-quantised.
struct SplitBlocks {
  std::vector<uint8_t> qs;   ///< [rows][nb][16] low four bits (Q4_0 order) or [rows][nb][32] int8 (Q8_0)
  std::vector<uint16_t> d;   ///< [rows][nb] fp16 scales (K-quants: [rows][nb / 8])
  std::vector<uint16_t> m;   ///< Q4_1 / Q5_1: [rows][nb] fp16 offsets; Q4_K / Q5_K: [rows][nb / 8] dmin
  std::vector<uint32_t> qh;  ///< Q5_0 / Q5_1 / Q5_K: [rows][nb] fifth bits; Q6_K: [rows][nb][2] top bits
  std::vector<uint16_t> sc;  ///< K-quants: [rows][nb] sub-block scales (block_math.cuh); else empty
};

/// The GPU kernels' type for GGUF weights of `type`, or false when there is no GPU kernel
/// for it (the quantised types but Q2_K, Q3_K and others; float types are not block types).
bool gpu_quant_type(GgmlType type, kernels::cuda::WType& out) noexcept;

/// Splits `rows` rows of k elements in GGUF blocks of the quantised `type` (Q4_0, Q8_0, Q4_1,
/// Q5_0, Q5_1, Q4_K, Q5_K or Q6_K; row r starts at data + r * row_bytes) into the device
/// layout (block_math.cuh). Throws Error(kInvalidArgument) for a float type, k <= 0, k % 32
/// != 0 or, for a K-quant, k % 256 != 0. Thread-safe.
SplitBlocks split_blocks(kernels::cuda::WType type, const std::byte* data, int64_t rows, int64_t k, size_t row_bytes);

/// The attention kernels' score capacity on `device`, set up on the first call for that
/// device (thread-safe). The caller makes `device` current.
int32_t attention_setup_once(int device);

}  // namespace tandem::gpu_detail
