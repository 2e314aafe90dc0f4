// Scheduler internals, shared by the files that implement it (not installed):
//   request_handle.cpp        RequestState, RequestHandle, the terminal event (Impl::finish)
//   scheduler.cpp             the public Scheduler: construction, submit + routing, lifecycle, metrics
//   scheduler_admission.cpp   the wait queue, deadlines, admission with KV reservations, preemption
//   scheduler_step.cpp        the per-executor step loop: plan a step (a value), run it, sample
//   scheduler_prefix_cache.cpp  finished prompts kept for reuse, and the routing prefix index
//   scheduler_sessions.cpp    the session registry: parked KV between requests
//   scheduler_handoff.cpp     KV hand-offs between loops: export under a lease, import, lease expiry
//   generation.cpp            the per-token logic (sample, stop strings, UTF-8, limits), shared with Session
//
// Ownership: a Seq belongs to exactly one loop at a time (or to a loop's inbox while it
// travels). Only the owning loop's thread touches it. Pages: the loop that owns a
// sequence decides where its pages live (admission reserves, preemption swaps or drops,
// the prefix cache evicts), through the store's KvPlacement policy (the one Session uses
// too); executors only compute on pages made resident before the step.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "session/generation.hpp"
#include "tandem/kv/kv_contract.hpp"
#include "tandem/sched/scheduler.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

namespace tandem {

inline double secs(Clock::time_point a, Clock::time_point b) {
  return std::chrono::duration<double>(b - a).count();
}

/// Shared between the handle and the scheduler.
struct RequestState {
  uint64_t id = 0;
  int32_t choice = 0;  // submit_n's index
  Request req;
  Clock::time_point t_submit{}, t_admit{}, t_first{}, t_last{};
  bool admitted_once = false;
  std::atomic<bool> cancel{false};
  std::atomic<bool> terminal{false};  // the one terminal event has been claimed
  std::atomic<bool> done{false};      // ... and delivered; result is final
  mutable std::mutex done_mu;
  mutable std::condition_variable done_cv;
  RequestResult result;

  // Poll log: append-only, single writer (the owning loop), any one reader. Sized once,
  // before the handle is returned, for the request's bounded number of events.
  struct Slot {
    int32_t token;
    bool final;
    RequestFinish finish;
    uint32_t off, len;
  };
  std::unique_ptr<Slot[]> slots;
  size_t slot_cap = 0;
  std::unique_ptr<char[]> text_buf;
  size_t text_cap = 0, text_used = 0;
  std::atomic<size_t> n_slots{0};
  size_t read_pos = 0;  // reader side

  void init_log(size_t n_events, size_t text_bytes);
  void log_event(int32_t token, std::string_view text, bool final, RequestFinish f);
};

struct SessionRec;

/// A request's generation state; owned by one loop (or in flight between two). Holds no
/// per-step state: each step's batch is a value (StepPlan) built fresh.
struct Seq {
  std::shared_ptr<RequestState> rs;
  std::vector<int32_t> tokens;  // history: session tokens + prompt + generated (last may be pending)
  int32_t n_history = 0;        // tokens before this request's prompt (a continued session)
  int32_t n_prompt_end = 0;     // tokens.size() at submission
  int32_t max_new = 0;          // max_tokens clamped so that prompt + output fits the context
  int32_t n_ctx = 0;
  std::unique_ptr<KvSequence> kv;
  std::optional<KvHandoff> handoff;  // in hand-off: the exported KV under its lease
  int handoff_src = -1;
  std::optional<Generation> gen;       // sampler, detokeniser, stop strings, output limit
  std::vector<TokenLogprob> logprobs;  // one per generated token, with Request::logprobs >= 0
  int prefill_exec = 0, decode_exec = 0;
  uint64_t order = 0;  // admission order (preemption picks the youngest)
  std::shared_ptr<SessionRec> session;
  bool took_session_kv = false;
  bool pinned = false;                  // this request holds one pin on kv (while admitted)
  int kv_loop = -1;                     // the loop whose store holds kv
  int32_t charge = 0;                   // prompt tokens counted in a loop's queued_tokens
  int handoff_pending_at = -1;          // decode loop counting this request in handoffs_pending
  std::vector<uint64_t> prefix_hashes;  // page-boundary hashes of the prompt (routing index)
  uint64_t group = 0;                   // submit_n: the first choice's request id (0 = alone)

  int32_t pending() const { return int32_t(tokens.size()) - (kv ? kv->n_tokens() : 0); }
  /// Positions whose KV this request can need: prompt + clamped output - 1 (the last
  /// sampled token is never fed).
  int64_t final_len() const { return int64_t(n_prompt_end) + max_new - 1; }
};

struct SessionRec {
  std::mutex mu;
  uint64_t id = 0;
  int executor = -1;
  std::unique_ptr<KvSequence> kv;  // tokens[0, kv->n_tokens()) are in it
  std::vector<int32_t> tokens;     // history (the last one may not be in the KV yet)
  bool busy = false;
  bool closed = false;
};

struct PrefixEntry {
  std::unique_ptr<KvSequence> kv;
  std::vector<int32_t> tokens;
  uint64_t key = 0;  // routing index key
};

/// One sequence's part of one step.
struct StepEntry {
  Seq* seq = nullptr;
  int32_t n = 0;     // tokens fed this step
  int32_t row = -1;  // its logits row, -1 = none
};

/// One step: built from the running set, used once, then discarded. Storage is reused
/// between steps (no heap allocation per step), never its contents.
struct StepPlan {
  std::vector<StepEntry> entries;
  std::vector<SequenceStep> batch;  // entries[i] <-> batch[i]
  int32_t rows = 0, n_decode = 0, n_prefill = 0;
  void clear() {
    entries.clear();
    batch.clear();
    rows = n_decode = n_prefill = 0;
  }
};

/// The scheduler's pin on an admitted sequence's KV (counted: an executor's pin during a
/// step is separate).
inline void pin_kv(Seq& s) noexcept {
  if (s.kv && !s.pinned) {
    s.kv->pin();
    s.pinned = true;
  }
}
inline void unpin_kv(Seq& s) noexcept {
  if (s.kv && s.pinned) s.kv->unpin();
  s.pinned = false;
}

/// Hashes of tokens[0, k * ps) for k = 1 .. n / ps.
void boundary_hashes(std::span<const int32_t> tokens, int32_t ps, std::vector<uint64_t>& out);

struct Scheduler::Impl {
  struct Loop;
  SchedulerOptions opt;
  std::shared_ptr<const Model> model;
  std::shared_ptr<RoutingPolicy> policy;
  std::vector<std::unique_ptr<Loop>> loops;
  int32_t n_ctx = 0;
  size_t max_piece = 16;
  Clock::time_point t_start = Clock::now();

  std::mutex route_mu;
  std::atomic<uint64_t> next_id{1};
  std::atomic<bool> accepting{true};
  std::atomic<bool> stopped{false};
  std::atomic<int64_t> outstanding{0};
  std::atomic<int32_t> queued{0};  // waiting for admission, all loops
  std::mutex drain_mu;
  std::condition_variable drain_cv;

  std::mutex sessions_mu;
  std::unordered_map<uint64_t, std::shared_ptr<SessionRec>> sessions;
  std::atomic<uint64_t> next_session{1};

  // Aggregates (relaxed atomics; updated at retire).
  std::atomic<uint64_t> submitted{0}, finished{0};
  std::atomic<uint64_t> by_finish[8] = {};
  std::atomic<uint64_t> migrations{0}, migration_bytes{0}, migration_ns{0}, preemptions{0};
  std::atomic<uint64_t> prompt_tokens{0}, prefix_reused{0};

  void log(std::string_view s) const {
    if (opt.log) opt.log(s);
  }
  /// Deliver the one terminal event (later calls do nothing). Never throws.
  void finish(Seq* seq, const std::shared_ptr<RequestState>& rs, RequestFinish f, ErrorCode ec = ErrorCode::kOk,
              std::string message = {}) noexcept;
  /// Release every KV page the sequence holds in every tier (a session's KV is parked).
  void release_seq(Seq& seq) noexcept;
  /// Give a session its KV back at the end of a request.
  void park_session(Seq& seq) noexcept;
  /// Take a session for a new request (busy); throws Error(kInvalidArgument) when absent or busy.
  std::shared_ptr<SessionRec> take_session(uint64_t id, std::vector<int32_t>& tokens);
  void dispatch(std::unique_ptr<Seq> seq, int loop);
  /// Routing: pick the executors for a validated sequence; returns the prefill loop.
  int route(Seq& seq);
  /// Place a sequence where `like` was routed (submit_n's later choices); returns the
  /// prefill loop.
  int route_like(Seq& seq, const Seq& like);
  /// Count a routed sequence on its loops (queue, hand-off pending) and record the reason.
  void place(Seq& seq, int prefill, int decode, std::string reason);
  /// The request no longer waits to be handed to its decode loop (pushed there, decoding
  /// where it prefilled, or ended): that loop's handoffs_pending drops by one, once.
  void settle_pending_handoff(Seq& seq) noexcept;
};

struct Scheduler::Impl::Loop {
  Impl* sc = nullptr;
  int index = 0;
  ExecutorConfig cfg;
  std::string name;
  bool accelerator = false;
  Executor* ex = nullptr;
  KvStore* store = nullptr;
  KvTier tier = KvTier::kHost;
  int32_t ps = 16;
  int32_t n_vocab = 0;

  // Inbox: the only cross-thread entry point (one lock per step).
  std::mutex in_mu;
  std::condition_variable in_cv;
  std::vector<std::unique_ptr<Seq>> inbox;
  bool closed = false;  // under in_mu: no more pushes
  std::atomic<bool> stop{false};
  std::atomic<bool> clear_cache{false};
  std::atomic<uint64_t> cache_generation{0};

  // Loop-owned.
  std::vector<std::unique_ptr<Seq>> incoming;
  std::deque<std::unique_ptr<Seq>> waiting;
  std::vector<std::unique_ptr<Seq>> running;
  StepPlan plan;
  std::vector<float> logits;
  std::vector<PrefixEntry> cache;
  /// Pages referenced by the prefix cache alone (evictable: no request holds them),
  /// recounted by the loop thread each iteration; read by metrics() from any thread.
  std::atomic<int32_t> cache_only_pages{0};
  uint64_t admit_counter = 0;
  /// Set by a preemption for room, cleared when a sequence retires (its pages return) or
  /// nothing runs: a victim readmitted at once would take back the pages its preemption
  /// freed and be preempted again (a livelock).
  bool admission_paused = false;
  /// Leases this loop exported and the receiver has not settled yet, with their deadlines:
  /// reaped here, so an expired lease returns its pages when it expires.
  std::vector<std::pair<Clock::time_point, std::shared_ptr<KvLease>>> leases_out;

  // Routing view (atomics read by submitters).
  std::atomic<int32_t> n_queued{0}, n_running{0};
  /// Requests routed here for decode whose prefill still runs on another loop: they will
  /// want a decode slot, so the router counts them as queued here (ExecutorView::queued).
  std::atomic<int32_t> handoffs_pending{0};
  std::atomic<int64_t> queued_tokens{0};
  /// Admitted sequences' prompt tokens still to prefill, and admitted sequences decoding
  /// (publish_running(), after admission and after each step).
  std::atomic<int64_t> running_prompt_tokens{0};
  std::atomic<int32_t> n_decoding{0};
  std::atomic<double> prefill_tps{0}, decode_tps{0}, token_tps{0};
  // Prefix index for routing: key -> page-boundary hashes (under idx_mu; changed per request).
  std::mutex idx_mu;
  std::unordered_map<uint64_t, std::vector<uint64_t>> prefix_index;
  // Metrics.
  std::atomic<uint64_t> steps{0}, pf_tokens{0}, dec_tokens{0}, busy_ns{0}, occupancy_milli{0};

  std::thread thread;

  /// Capacity of the compute tier in pages (for routing: can this loop ever hold it?).
  int32_t capacity_pages() const { return store->usage(tier).capacity; }
  /// Pages a sequence of `positions` holds at most here (KvLayout::sequence_pages, steps of
  /// up to prefill_chunk positions).
  int64_t pages_for(int64_t positions) const {
    return store->layout().sequence_pages(positions, std::min<int64_t>(positions, cfg.prefill_chunk)) - 1;
  }
  bool can_hold(int64_t positions) const { return pages_for(positions) <= capacity_pages(); }

  void push(std::unique_ptr<Seq> s);
  /// Several at once (submit_n's choices): one inbox batch, so the loop admits them together.
  void push_all(std::vector<std::unique_ptr<Seq>>& seqs);
  void wake();

  // scheduler_prefix_cache.cpp
  int32_t prefix_tokens_for(std::span<const uint64_t> hashes);
  void index_add(uint64_t key, const std::vector<uint64_t>& hashes);
  void index_remove(uint64_t key);
  void park_prefix(Seq& s);
  void drop_cache_entry(size_t i);
  void drop_cache();
  void count_cache_only_pages();
  /// The longest resident prefix of s.tokens held by the cache or a running sequence,
  /// in whole pages (shared, never written), or from a running sibling (same submit_n)
  /// every position it holds up to the last prompt token; returns the tokens shared.
  int32_t share_cached_prefix(Seq& s);
  /// submit_n: `s` is a later choice whose prompt another choice running here is still
  /// computing; it waits for that prefill (then shares it) instead of computing it again.
  bool awaits_sibling_prefill(const Seq& s) const;

  // scheduler_admission.cpp
  void take_inbox();
  void enqueue(std::unique_ptr<Seq> s);
  void unqueue(Seq& s);
  void expire(Clock::time_point now);
  void admit();
  bool try_admit(Seq& s);
  bool attach_kv(Seq& s, Clock::time_point t0);
  bool reserve_pages(KvSequence& kv, int32_t pages);
  /// The store's placement policy: the only code that evicts or moves this loop's pages.
  KvPlacement placement() const noexcept { return KvPlacement(*store); }
  void preempt_youngest();
  void release_reservation(KvSequence& kv);

  // scheduler_handoff.cpp
  bool import_handoff(Seq& s, Clock::time_point t0);
  bool move_session_kv(Seq& s, std::unique_ptr<KvSequence>& skv, Clock::time_point t0);
  /// After the first token on a prefill-only loop: export and send to the decode loop.
  /// False when the export failed (the sequence then decodes here).
  bool hand_off(std::unique_ptr<Seq>& slot);
  void reap_leases();
  std::optional<Clock::time_point> next_lease_deadline() const;

  // scheduler_step.cpp
  void run();
  void iterate();
  void idle_wait();
  bool build_plan();
  void do_step();
  /// Stores n_running, running_prompt_tokens and n_decoding from `running` (loop thread;
  /// no allocation).
  void publish_running() noexcept;
  void run_plan();
  void sample_plan(Clock::time_point now);
  void fail_plan(ErrorCode ec, const std::string& what);
  void after_token(std::unique_ptr<Seq>& slot, const TokenStep& t, Clock::time_point now);
  /// Call the request's on_event; a throwing callback ends the request with kError.
  bool emit(std::unique_ptr<Seq>& slot, int32_t token, std::string_view piece, RequestFinish f);
  void retire(std::unique_ptr<Seq>& slot, RequestFinish f, ErrorCode ec = ErrorCode::kOk, std::string msg = {});
  void fail_all(const std::string& what);
  void stop_all();
};

}  // namespace tandem
