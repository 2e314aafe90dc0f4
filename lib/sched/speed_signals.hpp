// The routing speed signals an executor loop measures from its own steps (internal).
//
// prefill_tps: prompt tokens per wall second of steps that carry prompt tokens. Only the
// prompt tokens are counted, over the whole step time: the decode tokens riding in the
// same step are not prompt work (counting them overstated a CPU's prefill speed by the
// share of decodes in its steps and sent it prompts it could not prefill in time), and
// charging the step's decode time to the prompt errs on the slow side.
// decode_tps: one token per sequence per pure-decode step (1 / step seconds).
// token_tps (update_token_rate): prompt + decode tokens per wall second of the steps that
// carry prompt tokens — the executor's token rate when prefilling, from which the router
// predicts the prompt speed at another decode share (DefaultRoutingPolicy::est_prefill_s).
// All are EWMAs (weight 0.2 on the new step; the first measurement replaces a
// non-positive value). Thread-safety: one writer (the loop), any readers (relaxed).
#pragma once

#include <atomic>
#include <cstdint>

namespace tandem {

/// The signals' EWMA step: weight 0.2 on `v`; a non-positive old value is replaced.
inline void ewma_update(std::atomic<double>& a, double v) noexcept {
  const double old = a.load(std::memory_order_relaxed);
  a.store(old <= 0 ? v : 0.8 * old + 0.2 * v, std::memory_order_relaxed);
}

inline void update_speed_signals(std::atomic<double>& prefill_tps, std::atomic<double>& decode_tps, int32_t n_prefill,
                                 int32_t n_decode, double step_s) noexcept {
  if (!(step_s > 0.0)) return;
  if (n_prefill > 0) ewma_update(prefill_tps, double(n_prefill) / step_s);
  if (n_prefill == 0 && n_decode > 0) ewma_update(decode_tps, 1.0 / step_s);
}

inline void update_token_rate(std::atomic<double>& token_tps, int32_t n_prefill, int32_t n_decode,
                              double step_s) noexcept {
  if (!(step_s > 0.0) || n_prefill <= 0) return;
  ewma_update(token_tps, double(n_prefill + n_decode) / step_s);
}

}  // namespace tandem
