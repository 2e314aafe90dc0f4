// Helpers of the GPU tests (tests/gpu): device presence, logits comparison and the
// GPU-vs-CPU tolerance with the evidence behind it.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <span>
#include <string>

#include "tandem/exec/gpu/gpu_q4_executor.hpp"
#include "tandem/node/node.hpp"

namespace tandem::test {

/// Exit status of tandem-gpu-tests when it skipped everything (ctest SKIP_RETURN_CODE).
inline constexpr int kSkipReturnCode = 77;

/// A store for `gpu`'s model with `device_pages` in its VRAM and optional Host / File tiers
/// (tandem::make_kv_store of tandem/node/node.hpp). Declared in every build: headers shared
/// by the GPU tests name it outside their TANDEM_HAVE_CUDA blocks.
inline std::shared_ptr<KvStore> gpu_kv_store(const GpuQ4Executor& gpu, int32_t device_pages, int32_t host_pages = 0,
                                             int32_t page_size = 16, KvDtype dtype = KvDtype::kF16,
                                             int32_t file_pages = 0) {
  return make_kv_store(gpu, KvLayout::for_model(gpu.model().hparams(), page_size, dtype),
                       KvPageCounts{device_pages, host_pages, file_pages});
}

#if TANDEM_HAVE_CUDA
inline constexpr bool kBuiltWithCuda = true;
inline int visible_gpus() {
  return GpuQ4Executor::device_count();
}
#else
inline constexpr bool kBuiltWithCuda = false;
inline int visible_gpus() {
  return 0;
}
#endif

// Logits tolerances of the GPU executor against llama.cpp's goldens (test_gpu_golden.cpp)
// and of the scheduler's margin rule (test_gpu_scheduler.cpp), as a fraction of max|logit|.
// (GPU against CPU needs none: the logits are the same bytes, test_gpu_executor.cpp.)
//
// Q4_0 models: 4e-2, as the CPU executor's own golden tolerance: an activation now and then
// lands on the other side of a Q8_0 rounding step against llama.cpp's order of summation,
// and the flipped value enters the KV cache and every later row carries it
// (../shared/golden/README.md).
inline constexpr double kLogitTolQ4 = 4e-2;
// F32 models: 5e-4: no quantised activations, so no flips, only float summation order.
inline constexpr double kLogitTolF32 = 5e-4;

inline double max_abs(std::span<const float> v) {
  double m = 0.0;
  for (float x : v) m = std::max(m, double(std::fabs(x)));
  return m;
}

/// |a - b| / max|a| over one row of logits (a NaN counts as 1e30).
inline double row_ratio(std::span<const float> a, std::span<const float> b) {
  const double ma = std::max(max_abs(a), 1e-30);
  double worst = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = std::fabs(double(a[i]) - double(b[i]));
    worst = std::max(worst, std::isnan(d) ? 1e30 : d / ma);
  }
  return worst;
}

/// Top-1 minus top-2 logit.
inline double top1_margin(std::span<const float> l) {
  float a = -std::numeric_limits<float>::infinity(), b = a;
  for (float v : l) {
    if (v > a) {
      b = a;
      a = v;
    } else if (v > b) {
      b = v;
    }
  }
  return double(a) - double(b);
}

}  // namespace tandem::test
