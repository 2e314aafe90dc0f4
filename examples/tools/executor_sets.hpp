// The --executors values of the serving tools (tandem-server, tandem-bench serve) and the
// executors each one builds: which processors serve, and how the CPU threads are split.
#pragma once

#include <algorithm>
#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace tandem::cli {

/// The --executors values, in the order help texts list them.
inline constexpr std::array<std::string_view, 4> kExecutorSets = {"cpu", "cpu+cpu", "gpu", "cpu+gpu"};

/// kExecutorSets as strings (for CLI::IsMember).
inline std::vector<std::string> executor_set_names() {
  return {kExecutorSets.begin(), kExecutorSets.end()};
}

/// Builds the executors of `set` through the caller's constructors, `threads` (>= 1) CPU
/// threads in all: add_cpu(threads, accelerator, name) for a CPU executor, add_gpu() for the
/// GPU one. cpu: one CPU executor "cpu" with every thread; cpu+cpu: "cpuA" (marked as the
/// accelerator, the larger half of the threads) and "cpuB" (the rest, at least 1 each);
/// gpu: the GPU executor; cpu+gpu: the GPU executor, then "cpu" with every thread. Returns
/// false, building nothing, for a value not in kExecutorSets. Whatever the constructors
/// throw propagates.
template <class AddCpu, class AddGpu>
bool add_executor_set(std::string_view set, int threads, AddCpu&& add_cpu, AddGpu&& add_gpu) {
  if (set == "cpu") {
    add_cpu(threads, false, "cpu");
  } else if (set == "cpu+cpu") {
    add_cpu(std::max(1, threads - threads / 2), true, "cpuA");
    add_cpu(std::max(1, threads / 2), false, "cpuB");
  } else if (set == "gpu") {
    add_gpu();
  } else if (set == "cpu+gpu") {
    add_gpu();
    add_cpu(threads, false, "cpu");
  } else {
    return false;
  }
  return true;
}

}  // namespace tandem::cli
