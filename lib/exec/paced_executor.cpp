#include "tandem/exec/paced_executor.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cmath>
#include <thread>

#include "tandem/core/error.hpp"

namespace tandem {

PacedExecutor::PacedExecutor(Executor& inner, PerfModel model, double time_scale, int32_t token_scale)
    : Executor(inner.model_ptr()),
      inner_(inner),
      model_(std::move(model)),
      time_scale_(time_scale),
      token_scale_(token_scale),
      name_("paced-" + std::string(model_.processor().name)) {
  if (!(time_scale > 0.0) || !std::isfinite(time_scale)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("paced executor: time_scale {} must be a positive finite number", time_scale));
  }
  if (token_scale < 1) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("paced executor: token_scale {} must be >= 1", token_scale));
  }
}

void PacedExecutor::step_impl(std::span<const SequenceStep> batch, std::span<float> logits) {
  using Clock = std::chrono::steady_clock;
  const auto t0 = Clock::now();
  const double modelled = model_.scaled_step_seconds(batch, token_scale_);
  const auto deadline =
      t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(modelled / time_scale_));
  inner_.step(batch, logits);
  const auto t1 = Clock::now();
  steps_.fetch_add(1, std::memory_order_relaxed);
  modelled_ns_.fetch_add(uint64_t(modelled * 1e9), std::memory_order_relaxed);
  compute_ns_.fetch_add(uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(t1 - t0).count()),
                        std::memory_order_relaxed);
  if (t1 >= deadline) {
    overruns_.fetch_add(1, std::memory_order_relaxed);
    return;
  }
  std::this_thread::sleep_until(deadline);
}

}  // namespace tandem
