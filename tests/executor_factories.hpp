// The executor parity suite's list of executors: every test that takes an executor runs
// once per entry. The GPU executor joins this list when it is built and a device exists.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#if TANDEM_HAVE_CUDA
#include "tandem/exec/gpu/gpu_q4_executor.hpp"
#endif

namespace tandem::test {

struct ExecutorFactory {
  std::string name;
  std::function<std::unique_ptr<Executor>(std::shared_ptr<const Model>)> make;
};

inline std::vector<ExecutorFactory> executor_factories() {
  std::vector<ExecutorFactory> f = {
      {"cpu-2threads",
       [](std::shared_ptr<const Model> m) {
         return std::make_unique<CpuQ4Executor>(std::move(m), CpuExecutorOptions{2});
       }},
      {"cpu-1thread",
       [](std::shared_ptr<const Model> m) {
         return std::make_unique<CpuQ4Executor>(std::move(m), CpuExecutorOptions{1});
       }},
  };
#if TANDEM_HAVE_CUDA
  // Built with CUDA: the GPU executor joins when a device is present at run time.
  if (GpuQ4Executor::device_count() > 0) {
    f.push_back({"gpu", [](std::shared_ptr<const Model> m) -> std::unique_ptr<Executor> {
                   return std::make_unique<GpuQ4Executor>(std::move(m));
                 }});
  }
#endif
  return f;
}

inline std::vector<std::string> executor_names() {
  std::vector<std::string> names;
  for (const auto& f : executor_factories()) names.push_back(f.name);
  return names;
}

inline std::unique_ptr<Executor> make_executor(const std::string& name, std::shared_ptr<const Model> m) {
  for (const auto& f : executor_factories()) {
    if (f.name == name) return f.make(std::move(m));
  }
  return nullptr;
}

}  // namespace tandem::test
