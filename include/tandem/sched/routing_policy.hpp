// RoutingPolicy: who prefills and who decodes a request — a replaceable object.
//
// The Scheduler calls route() once per request, at submission, with a view of every
// executor (measured prefill/decode speed, queue, running sequences, free KV pages, how
// much of this prompt's prefix it already holds). The decision names a prefill executor
// and a decode executor; when they differ, the KV moves once after the prefill, through
// the KV contract (kv_export / kv_import under a lease). Every decision carries a
// human-readable reason with the numbers it used; the Scheduler logs it.
//
// The default policy follows ../shared/docs/brief.md ("Routing policy"); its decision
// table is docs/routing-policy.md and tests/test_routing_policy.cpp checks one case per
// row.
//
// Thread-safety: route() is called under the Scheduler's routing mutex (one call at a
// time); a policy need not be thread-safe itself.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>

namespace tandem {

enum class SlaClass : int32_t { kInteractive = 0, kStandard = 1, kBatch = 2 };
inline constexpr int kSlaClassCount = 3;
std::string_view sla_class_name(SlaClass c) noexcept;  ///< "interactive", "standard", "batch"
/// Parse "interactive" / "standard" / "batch"; nullopt otherwise.
std::optional<SlaClass> parse_sla_class(std::string_view s) noexcept;

/// What the router sees of one executor (a snapshot; numbers are estimates).
struct ExecutorView {
  int index = 0;
  std::string_view name;
  /// An accelerator (GPU-like: big batches, fast prefill). Default: kv_tier() == Device;
  /// configurable per executor (cpu+cpu runs mark one CPU pool as the primary).
  bool accelerator = false;
  double prefill_tps = 0.0;  ///< measured prompt tokens/s (EWMA over steps)
  double decode_tps = 0.0;   ///< measured decode tokens/s per sequence (EWMA)
  /// requests waiting for admission, plus decode hand-offs routed here whose prefill is
  /// still running elsewhere (they will want a decode slot here)
  int32_t queued = 0;
  int64_t queued_tokens = 0;  ///< prompt tokens of requests waiting for admission
  /// prompt tokens the admitted sequences still have to prefill (they go before a new
  /// request's prompt, which is admitted behind them)
  int64_t running_prompt_tokens = 0;
  /// admitted sequences decoding (one token each per step), plus decode hand-offs routed
  /// here whose KV has not arrived yet: each step of a new prompt's prefill carries them
  int32_t decoding = 0;
  /// measured tokens/s of the steps that carry prompt tokens, their decode tokens included
  /// (EWMA; 0 = not measured). With `decoding` and `prefill_chunk` it gives the prompt
  /// speed at the current decode share (est_prefill_s).
  double token_tps = 0.0;
  int32_t prefill_chunk = 0;  ///< most prompt tokens of one sequence per step (0 = unknown)
  int32_t running = 0;        ///< admitted sequences
  int32_t max_running = 1;    ///< decode slots
  int32_t kv_free_pages = 0;  ///< free pages in its compute tier
  int32_t page_size = 16;
  int32_t prefix_tokens = 0;  ///< tokens of this request's prompt whose KV it already holds
  /// Seconds per output token the executor's performance model predicts for this request
  /// if admitted now (ExecutorConfig::tpot_estimate_s); 0 = no model.
  double model_tpot_s = 0.0;
};

struct RouteInput {
  SlaClass sla = SlaClass::kStandard;
  int32_t prompt_tokens = 0;
  int32_t max_tokens = 0;     ///< expected output length
  double deadline_s = 0.0;    ///< seconds from now; 0 = none
  int session_executor = -1;  ///< where the continued session's KV lives (-1 = none)
};

struct RouteDecision {
  int prefill = 0;     ///< executor index that runs the prompt
  int decode = 0;      ///< executor index that generates (== prefill: no hand-off)
  std::string rule;    ///< the policy-table row that decided ("R1".."R8")
  std::string reason;  ///< human-readable reason with the numbers used
};

class RoutingPolicy {
 public:
  virtual ~RoutingPolicy() = default;
  /// `executors` is non-empty; the returned indices must be valid.
  virtual RouteDecision route(const RouteInput& in, std::span<const ExecutorView> executors) = 0;
};

struct DefaultRoutingOptions {
  int32_t long_prompt_tokens = 256;      ///< a prompt this long (after prefix reuse) is "long"
  double decode_scarce_fraction = 0.75;  ///< decode slots are scarce when running >= this * max_running
  /// R5 also hands a long prompt's decode to a non-accelerator when the accelerator's free
  /// KV pages, less those the prompts queued there will take, cannot hold the request
  /// (prompt + output): the host's larger memory holds sequences the accelerator cannot.
  bool handoff_when_kv_short = true;
  /// With a TPOT target set for `batch`, R5 hands every long batch prompt's decode to a
  /// non-accelerator that meets the target with a free slot (SLO guard below), so the
  /// accelerator's steps and KV reads go to the classes that need its speed.
  bool handoff_batch_decode = true;
  /// ... but weighed against the accelerator: while the accelerator has room for the
  /// request (its free KV pages, less the queued prompts' and this request's, still hold
  /// this request again, and its model_tpot_s, when known, meets the batch target), a
  /// batch decode goes to the host only when the host's predicted TPOT (the larger of
  /// est_decode_s(h, 1) and model_tpot_s, i.e. at its batch with this request) is at most
  /// this fraction of the target. The host's remaining slots are kept for decodes the
  /// accelerator cannot hold, and the accelerator's spare steps take the rest. 1.0 (with
  /// batch_host_balance off): every long batch decode goes to a host that meets the target
  /// (the rule before the split).
  double batch_host_tpot_fraction = 0.5;
  /// ... and, with room on the accelerator, only while the host has fewer sequences
  /// (running + queued, hand-offs on their way included) than the accelerator: one more
  /// decode costs an accelerator almost nothing (its steps read the weights anyway), so a
  /// host busier than an accelerator with room would spend the slots that decodes the
  /// accelerator cannot hold need later (issue 16: on the long-context trace 11 of 17
  /// batch decodes went to the EPYC while the L40S ran 0-2 sequences). false: the TPOT
  /// fraction alone decides.
  bool batch_host_balance = true;
  double prefix_fraction = 0.5;  ///< a holder of >= this fraction of the prompt is preferred ...
  double prefix_slack = 1.5;     ///< ... unless its estimated time exceeds the best by this factor
  double overload_factor = 3.0;  ///< a preferred executor is skipped when its estimate exceeds the best's by this
  /// Per-class SLO targets in seconds, indexed by SlaClass (0 = no target). With a target
  /// set, a request goes to a non-accelerator (R5's decode hand-off, R7) only when that
  /// executor's estimated TTFT (est_prefill_s) and TPOT (est_decode_s of one token) meet
  /// it; otherwise it stays on the accelerator (the host would only turn it into a miss).
  ///
  /// The host's TPOT estimate is the larger of est_decode_s(h, 1) and its model_tpot_s;
  /// with a target set for the class, the host must also have a free decode slot
  /// (running + queued < max_running, hand-offs on their way included): when in doubt the
  /// request stays on the accelerator.
  double ttft_target_s[kSlaClassCount] = {0.0, 0.0, 0.0};
  double tpot_target_s[kSlaClassCount] = {0.0, 0.0, 0.0};
};

/// The brief's policy; see docs/routing-policy.md for the table.
class DefaultRoutingPolicy final : public RoutingPolicy {
 public:
  explicit DefaultRoutingPolicy(DefaultRoutingOptions o = {}) : o_(o) {}
  RouteDecision route(const RouteInput& in, std::span<const ExecutorView> executors) override;
  const DefaultRoutingOptions& options() const noexcept { return o_; }

  /// Estimated seconds until executor `e` has prefilled `prompt_tokens` new tokens of a
  /// request (the admitted prompts and its queue first):
  /// (running_prompt_tokens + queued_tokens + prompt - prefix) / rate, where rate is
  /// prefill_tps, or, when `decoding` sequences share every step and token_tps and
  /// prefill_chunk are known, the smaller of prefill_tps and
  /// token_tps x prefill_chunk / (prefill_chunk + decoding) (a step of c prompt tokens
  /// also carries one token of each decoding sequence; step time ~ tokens in it).
  static double est_prefill_s(const ExecutorView& e, int32_t prompt_tokens) noexcept;
  /// Estimated seconds to decode `n` tokens there: n / decode_tps, slowed by a full batch.
  static double est_decode_s(const ExecutorView& e, int32_t n) noexcept;

 private:
  DefaultRoutingOptions o_;
};

}  // namespace tandem
