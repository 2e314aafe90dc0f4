// Helpers of the GPU tests (tests/gpu): device presence, logits comparison and the
// GPU-vs-CPU tolerance with the evidence behind it.
#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <string>

#if TANDEM_HAVE_CUDA
#include "tandem/gpu_q4_executor.hpp"
#endif

namespace tandem::test {

/// Exit status of tandem-gpu-tests when it skipped everything (ctest SKIP_RETURN_CODE).
inline constexpr int kSkipReturnCode = 77;

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

/// GPU-vs-CPU logits tolerance for Q4_0 models, x max|logit| of the CPU row (MEASURED below).
inline constexpr double kLogitTolQ4 = 3e-2;

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
