// Scheduler: many requests, several executors, continuous batching.
//
// submit() takes a Request (prompt text or ids, sampling, max tokens, stop strings, SLA
// class, optional deadline, optional session to continue) and returns a RequestHandle.
// Results stream through Request::on_event (called on the executor's step-loop thread:
// it must be quick and must not call back into the Scheduler except cancel()) and into
// the handle's own bounded event queue (poll()), and the whole result is available from
// wait(). Every submitted request ends with exactly one terminal event (final == true)
// carrying a RequestFinish; cancel/timeout/error at any stage (queued, prefilling, in
// hand-off, decoding, swapped out) releases every KV page it held in every tier.
//
// Inside: one step loop (thread) per executor. Between steps a loop takes newly routed
// requests from its inbox (one uncontended lock per step), expires deadlines and
// cancellations, admits waiting requests while it has decode slots and can reserve their
// KV pages (KvStore::reserve + KvSequence::adopt_reservation: prompt + max_tokens by
// default, so an admitted sequence never runs out of pages; see admission_output_tokens),
// then builds one step as a value: every decoding sequence's next token first, then
// prefill chunks of waiting prompts up to the per-step token budget (chunked prefill: a
// long prompt never stalls running decodes). The pages a step writes are reserved by the
// loop before it runs; the loop alone decides where a sequence's pages live. Finished
// sequences are retired right after the step that finished them. A loop never dies: an
// exception from a step (std::bad_alloc included) or from a request's on_event callback
// ends the requests it concerns with kError (one terminal event each); the rest go on.
//
// Routing: a RoutingPolicy (routing_policy.hpp) picks the prefill and decode executors
// at submission, among the executors whose KV tier can hold the request (prompt + clamped
// output); only when none can is every executor offered (the request then ends with
// kOutOfMemory, naming the pages it needs). When they differ, the prefill loop samples the first token, exports the
// KV under a lease (kv_export) and hands the sequence to the decode loop, which imports
// it (kv_import: verified, the KV moves once) and continues. Requests sharing a prompt
// prefix with a sequence an executor holds (running, a parked session, or its prefix
// cache of recently finished prompts) share those KV pages (KvSequence::share_prefix,
// copy-on-write) instead of recomputing them.
//
// Back-pressure: at most max_queued requests wait (all executors together); beyond that
// submit() finishes the request at once with RequestFinish::kOverloaded. When a step
// cannot get KV pages (kOutOfMemory) the youngest running sequence is preempted: swapped
// to the File tier when the store has one, else its KV is dropped and recomputed later
// (its generated tokens are kept, so greedy output is unchanged).
//
// Thread-safety: submit(), cancel(), metrics(), the session calls may be called from
// any number of threads. Executors must not be stepped by anyone else while the
// Scheduler runs. The Executors and stores must outlive the Scheduler.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/exec/executor.hpp"
#include "tandem/grammar/grammar.hpp"
#include "tandem/kv/kv_store.hpp"
#include "tandem/sched/metrics.hpp"
#include "tandem/sched/routing_policy.hpp"
#include "tandem/session/sampler.hpp"

namespace tandem {

// RequestFinish and request_finish_name() are in tandem/metrics.hpp.

using Clock = std::chrono::steady_clock;

/// One streamed event. Non-final events carry one generated token and the text it
/// completed (possibly empty: text is held back while it may become a stop string or an
/// incomplete UTF-8 sequence). The final event carries the finish reason and any text
/// flushed at the end (token -1).
struct RequestEvent {
  uint64_t request_id = 0;
  int32_t token = -1;
  std::string_view text;
  bool final = false;
  RequestFinish finish = RequestFinish::kLength;
  /// With Request::logprobs >= 0, on a token's event: its log-probability and alternatives
  /// (valid during the callback only; poll() does not carry it: RequestResult::logprobs).
  const TokenLogprob* logprob = nullptr;
  /// The choice this event belongs to (Scheduler::submit_n's index i; 0 for submit()).
  int32_t choice = 0;
};

struct Request {
  std::string prompt_text;  ///< used when prompt_ids is empty (tokenised with BOS
                            ///< when the sequence is new)
  std::vector<int32_t> prompt_ids;
  bool parse_special = false;
  SamplingParams sampling = SamplingParams::greedy();
  /// Most tokens to generate; any value >= 1. Clamped to what the context leaves after
  /// the prompt (n_ctx - prompt + 1: the last sampled token needs no KV), which ends the
  /// request with kLength; nothing is allocated in proportion to the unclamped value.
  int32_t max_tokens = 128;
  std::vector<std::string> stop;
  bool ignore_eos = false;
  /// -1: none; 0 .. kMaxTopLogprobs: each token's log-probability and that many
  /// alternatives (GenerateOptions::logprobs), in the events and RequestResult::logprobs.
  int32_t logprobs = -1;
  /// Structured output (GenerateOptions::grammar): null = unconstrained. Requests without
  /// one in the same batch are unaffected.
  std::shared_ptr<const Grammar> grammar;
  SlaClass sla = SlaClass::kStandard;
  std::optional<Clock::time_point> deadline;  ///< the request ends with kTimeout after it
  uint64_t session = 0;                       ///< continue this session (open_session()); 0 = none
  /// Streaming callback, on a step-loop thread: keep it short (copy and return). Return
  /// false to cancel the request.
  std::function<bool(const RequestEvent&)> on_event;
};

/// The whole outcome, available once the request has finished.
struct RequestResult {
  uint64_t id = 0;
  RequestFinish finish = RequestFinish::kLength;
  ErrorCode error = ErrorCode::kOk;    ///< for kError
  std::string message;                 ///< for kError / kOverloaded
  std::vector<int32_t> tokens;         ///< generated ids
  std::vector<TokenLogprob> logprobs;  ///< one per token, with Request::logprobs >= 0
  std::string text;
  RequestMetrics metrics;
  std::string route;  ///< the routing decision's rule and reason
};

struct RequestState;  // opaque, shared between the handle and the scheduler

/// A submitted request. Copyable (shared). poll() and wait() may be called from any one
/// thread at a time; the scheduler writes, the handle's holder reads.
class RequestHandle {
 public:
  RequestHandle() = default;
  explicit RequestHandle(std::shared_ptr<RequestState> s) : s_(std::move(s)) {}
  uint64_t id() const noexcept;
  bool valid() const noexcept { return s_ != nullptr; }
  bool done() const noexcept;
  /// Take the next buffered event (text copied into `text`); false when none is ready.
  /// The queue holds (clamped) max_tokens + 2 events, so a poller never loses one.
  bool poll(RequestEvent& event, std::string& text);
  /// Block until finished (or `timeout` passes: false).
  bool wait_for(std::chrono::milliseconds timeout) const;
  /// Block until finished. The reference lives as long as a handle to this request does
  /// (copy the result when the handle is a temporary).
  const RequestResult& wait() const;
  const std::shared_ptr<RequestState>& state() const noexcept { return s_; }

 private:
  std::shared_ptr<RequestState> s_;
};

struct ExecutorConfig {
  Executor* executor = nullptr;
  /// Its KV store: must have the executor's compute tier (a File tier enables swap-out).
  std::shared_ptr<KvStore> store;
  int32_t max_running = 16;         ///< decode slots (sequences admitted at once)
  int32_t step_token_budget = 256;  ///< tokens per step (decodes + prefill chunks)
  int32_t prefill_chunk = 128;      ///< most prompt tokens of one sequence per step
  /// Prefill order within a step. Decodes go first; then the prompts of the tightest SLA
  /// class that has prompt tokens pending (interactive < standard < batch) take chunks in
  /// admission order up to step_token_budget; prompts of looser classes share at most
  /// this many tokens per step (oldest admission first), so a 4k standard prompt is not
  /// prefilled in steps lengthened by 20k batch prompts, and batch prompts still progress.
  /// -1 (default): prefill_chunk / 4 (at least 1). 0: looser classes wait until no
  /// tighter prompt is pending. step_token_budget: no cap (class order only).
  int32_t looser_class_prefill_tokens = -1;
  /// Output tokens whose KV pages are reserved when a request is admitted. -1 (default):
  /// all of them (its clamped max_tokens), so an admitted sequence never runs out of
  /// pages. n >= 0: only the next n — more sequences run at once (as vLLM admits), and
  /// when a growing sequence finds the tier full the youngest running sequence is
  /// preempted (swapped to the File tier when the store has one, else its KV is dropped
  /// and recomputed from its tokens; greedy output is unchanged either way).
  int32_t admission_output_tokens = -1;
  /// Treat as an accelerator in routing (default: the executor computes on Device pages).
  std::optional<bool> accelerator;
  double prior_prefill_tps = 0.0;  ///< speeds assumed before any measurement (0 = 1000 / 100)
  double prior_decode_tps = 0.0;
  /// Optional performance model of the executor for the router: predicted wall seconds
  /// per decode token of one sequence in a batch of `decode_batch` sequences of `ctx`
  /// positions each. When set, the router also sees the TPOT a request would get here
  /// if admitted now (ExecutorView::model_tpot_s; batch = running + queued + 1, capped at
  /// max_running). Called under the routing lock from submit()'s thread; must not throw.
  std::function<double(int32_t decode_batch, int64_t ctx)> tpot_estimate_s;
  std::string name;  ///< for logs and metrics ("" = executor name + index)
};

struct SchedulerOptions {
  std::vector<ExecutorConfig> executors;
  std::shared_ptr<RoutingPolicy> policy;  ///< null = DefaultRoutingPolicy
  int32_t max_queued = 1024;              ///< waiting requests, all executors together
  /// Positions per sequence (prompt + output): 0 = default_context_size(model); at most
  /// kMaxContextSize (else the constructor throws Error(kInvalidArgument)).
  int32_t max_context = 0;
  int32_t prefix_cache_entries = 4;              ///< finished prompts kept per executor for reuse (0 = off)
  std::chrono::milliseconds handoff_ttl{30000};  ///< lease lifetime of a KV hand-off
  /// Debug log (routing decisions, preemptions, hand-offs), called from any thread.
  std::function<void(std::string_view)> log;
};

class Scheduler {
 public:
  /// Starts one step loop per executor. Throws Error(kInvalidArgument) for no executors,
  /// a null executor or store, executors of different models, a store without the
  /// executor's tier.
  explicit Scheduler(SchedulerOptions options);
  ~Scheduler();  ///< shutdown()
  Scheduler(const Scheduler&) = delete;
  Scheduler& operator=(const Scheduler&) = delete;

  /// Never throws for a bad request: it is finished with kError (or kOverloaded) and the
  /// handle reports it. Throws Error(kInvalidArgument) only after shutdown().
  RequestHandle submit(Request request);
  /// n choices of one prompt (OpenAI's `n`): n requests, one handle each (index i = choice
  /// i), routed together to one executor, which also decodes them (no hand-off). The prompt is computed once: choice 0
  /// prefills it, and choices 1..n-1 wait until it is in the KV and then share every prompt position but the last
  /// (KvSequence::share_prefix, copy-on-write; only the last prompt token is recomputed per choice, for its logits).
  /// Choice i samples with seed `request.sampling.seed + i` (mod 2^64), so a seeded request is reproducible and its
  /// choices differ. Each choice streams and ends on its own (on_event calls with its own
  /// request id and RequestEvent::choice == i, its own terminal event); cancelling one
  /// leaves the others. n == 1
  /// is submit(). Never throws for a bad request (every handle reports it: n outside
  /// [1, kMaxChoices], n > SchedulerOptions::max_queued, or n > 1 with a session -> kError
  /// kInvalidArgument; the queue too full for all n at once -> kOverloaded); throws
  /// Error(kInvalidArgument) only after shutdown().
  std::vector<RequestHandle> submit_n(Request request, int32_t n);
  static constexpr int32_t kMaxChoices = 128;
  /// Ask the request to stop; its terminal event (kCancelled, unless it already finished)
  /// follows within one step. Safe from any thread, including callbacks.
  void cancel(const RequestHandle& handle) noexcept;

  /// A session keeps its KV between requests (parked, swappable down the tiers when
  /// memory is short). A request names it in Request::session; one request per session
  /// at a time (a second one is finished with kError).
  uint64_t open_session();
  /// Release the session's KV (a running request on it finishes first).
  void close_session(uint64_t session);

  /// Where a session stands (session_info()).
  struct SessionInfo {
    uint64_t id = 0;
    int executor = -1;                 ///< executor whose KV store holds its KV; -1 = none (busy: the
                                       ///< request's; or lost: recomputed on next use)
    int32_t n_tokens = 0;              ///< tokens of the conversation (the last may not be in the KV yet)
    int32_t kv_tokens = 0;             ///< positions whose KV the session holds
    int32_t pages[kKvTierCount] = {};  ///< its KV pages per tier (index: KvTier)
    bool busy = false;                 ///< a request runs on it (its KV is the request's then)
  };
  /// Throws Error(kInvalidArgument) for an unknown or closed session. Thread-safe.
  SessionInfo session_info(uint64_t session) const;
  /// Park a session explicitly: move its KV pages from the executor's compute tier to the
  /// File tier of the executor's store (ExecutorConfig::store with file pages), freeing
  /// compute-tier pages until its next request, which brings them back (bit-exact copies:
  /// nothing is recomputed). unpark_session() moves them back to the compute tier ahead of
  /// the next request (a prefetch). Pages the session shares with other sequences (a
  /// prefix another request shares) stay where they are. A session with no KV: nothing to
  /// move. Returns false, moving nothing, while a request runs on the session. Throws
  /// Error(kInvalidArgument) for an unknown or closed session or (park) a store without a
  /// File tier, Error(kOutOfMemory) when the destination tier lacks free pages (nothing
  /// moved then). `stats` (may be null) receives what the move cost. Thread-safe.
  bool park_session(uint64_t session, KvMoveStats* stats = nullptr);
  bool unpark_session(uint64_t session, KvMoveStats* stats = nullptr);

  /// Save an idle session to `path` in the session-file format of Session::save (the same
  /// code, lib/session/session_file.hpp): its tokens, the KV of the evaluated ones (read
  /// in whatever tier the pages are; nothing moves) and the last sampled token, not yet in
  /// the KV, as the pending token. No logits and no random state (each request seeds its
  /// own sampler). Written atomically: on any error the file at `path` is left as it was.
  /// Returns false, writing nothing, while a request runs on the session. Throws
  /// Error(kInvalidArgument) for an unknown or closed session, or one whose tokens run
  /// more than one past its KV (a request stopped before its prompt was evaluated, or its
  /// KV was dropped: the session's next request evaluates them); Error(kIo) when the file
  /// cannot be written (a full disk included), kInvalidArgument for a path that is a
  /// directory, device, FIFO or socket. Thread-safe.
  bool save_session(uint64_t session, const std::filesystem::path& path);
  /// Open a new session from a file written by save_session() or Session::save(),
  /// verified as Session::restore verifies it; its KV is imported into the store of
  /// executor `executor` (converted to that store's dtype and page size), in the tier
  /// KvPlacement::import_tier picks: the executor's compute tier when it has room, else the
  /// store's File tier (parked; the session's next request brings it up). The session is
  /// idle, as after a request: its tokens are the file's evaluated tokens plus its pending
  /// token. A Session file's logits and random state are not used. Returns the new
  /// session's id. Errors (nothing is opened): kInvalidArgument (executor out of range),
  /// kIo (unreadable), kSessionCorrupt (not a session file, truncated, any damaged byte),
  /// kSessionVersion (a newer format), kSessionModelMismatch (other weights,
  /// hyper-parameters or tokenizer than the scheduler's model), kContextOverflow (more
  /// evaluated tokens than max_context), kOutOfMemory (no tier has room). Thread-safe.
  uint64_t restore_session(const std::filesystem::path& path, int executor = 0);

  /// Stop accepting (submit -> kOverloaded), wait until every request has finished.
  void drain();
  /// Cancel everything outstanding, stop the loops, release parked KV. Idempotent.
  void shutdown();
  /// Drop the executors' prefix caches (their KV pages return to the stores).
  void clear_prefix_cache();

  SchedulerMetrics metrics() const;
  int executor_count() const noexcept;

  struct Impl;

 private:
  std::unique_ptr<Impl> impl_;
};

}  // namespace tandem
