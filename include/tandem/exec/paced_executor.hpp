// PacedExecutor: an Executor that computes with another one but takes as long as a
// modelled processor would.
//
// A decorator (faiss-style: same interface, one wrapped object). step() runs the wrapped
// executor on the real (small) model — logits, KV pages, hand-offs and the KV contract are
// all real — and then sleeps until the step has lasted at least
//   PerfModel::step_seconds(StepShape::of(batch)) / time_scale
// seconds of wall time, measured from the start of step_impl (after the base class has
// validated the batch and made its pages resident). So the Scheduler sees a processor
// with the modelled speed (e.g. an L40S running a 27B model) while tokens stay those of
// the wrapped executor: pacing changes time, never outputs.
//
// time_scale compresses simulated time: with time_scale k a modelled 100 ms step lasts
// 100 / k ms of wall time (a caller replaying a trace must compress arrivals, deadlines
// and SLOs by the same k and multiply measured times back).
//
// When the wrapped executor alone takes longer than the modelled time, the step finishes
// when it finishes (late); overruns() counts such steps so a simulation can report that
// the host was too slow to pace it faithfully.
//
// The per-step path computes the shape in place, sleeps with sleep_until (no busy wait)
// and allocates nothing. Thread-safety: as Executor (one step at a time); the counters
// may be read from any thread.
#pragma once

#include <atomic>
#include <cstdint>
#include <string>

#include "tandem/exec/executor.hpp"
#include "tandem/exec/perf_model.hpp"

namespace tandem {

class PacedExecutor final : public Executor {
 public:
  /// `inner` must outlive this executor and must not be stepped by anyone else.
  /// token_scale k >= 1: every real token stands for k modelled tokens (a step is paced to
  /// PerfModel::scaled_step_seconds(batch, k) / time_scale), so long contexts can be
  /// simulated with short real prompts. Throws Error(kInvalidArgument) when time_scale is
  /// not a positive finite number or token_scale < 1.
  PacedExecutor(Executor& inner, PerfModel model, double time_scale = 1.0, int32_t token_scale = 1);

  /// "paced-" + the processor profile's name (e.g. "paced-l40s").
  std::string_view name() const noexcept override { return name_; }
  KvTier kv_tier() const noexcept override { return inner_.kv_tier(); }
  bool can_read(KvTier tier) const noexcept override { return inner_.can_read(tier); }
  bool supports(KvDtype dtype) const noexcept override { return inner_.supports(dtype); }
  std::unique_ptr<KvDeviceBackend> make_kv_device_backend(const KvLayout& layout, int32_t pages) const override {
    return inner_.make_kv_device_backend(layout, pages);
  }

  const PerfModel& perf_model() const noexcept { return model_; }
  double time_scale() const noexcept { return time_scale_; }
  int32_t token_scale() const noexcept { return token_scale_; }
  /// Wall seconds a step of this shape is paced to (modelled seconds / time_scale; token scale 1).
  double paced_seconds(const StepShape& s) const noexcept { return model_.step_seconds(s) / time_scale_; }
  /// Wall seconds this batch is paced to (any token scale).
  double paced_seconds(std::span<const SequenceStep> batch) const noexcept {
    return model_.scaled_step_seconds(batch, token_scale_) / time_scale_;
  }

  uint64_t steps() const noexcept { return steps_.load(std::memory_order_relaxed); }
  /// Steps whose wrapped computation alone outlasted the modelled time.
  uint64_t overruns() const noexcept { return overruns_.load(std::memory_order_relaxed); }
  /// Sum of modelled step times, simulated seconds.
  double modelled_seconds() const noexcept { return double(modelled_ns_.load(std::memory_order_relaxed)) * 1e-9; }
  /// Sum of the wrapped executor's own compute time, wall seconds.
  double compute_seconds() const noexcept { return double(compute_ns_.load(std::memory_order_relaxed)) * 1e-9; }

 protected:
  void step_impl(std::span<const SequenceStep> batch, std::span<float> logits) override;

 private:
  Executor& inner_;
  PerfModel model_;
  double time_scale_;
  int32_t token_scale_;
  std::string name_;
  std::atomic<uint64_t> steps_{0}, overruns_{0}, modelled_ns_{0}, compute_ns_{0};
};

}  // namespace tandem
