// Scheduler: routing at submission, one continuous-batching step loop per executor,
// KV hand-offs between loops, admission with KV reservations, lifecycle and metrics.
// See include/tandem/scheduler.hpp for the contract.
#include "tandem/scheduler.hpp"

#include "stop_strings.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>
#include <unordered_map>

#include "tandem/kv_contract.hpp"
#include "tandem/tokenizer.hpp"

namespace tandem {

std::string_view request_finish_name(RequestFinish f) noexcept {
  switch (f) {
    case RequestFinish::kStop: return "stop";
    case RequestFinish::kStopString: return "stop_string";
    case RequestFinish::kLength: return "length";
    case RequestFinish::kCancelled: return "cancelled";
    case RequestFinish::kTimeout: return "timeout";
    case RequestFinish::kOverloaded: return "overloaded";
    case RequestFinish::kError: return "error";
  }
  return "?";
}

namespace {

double secs(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }


uint64_t mix(uint64_t h, uint64_t v) {
  h ^= v + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
  return h;
}

/// Hashes of tokens[0, k * ps) for k = 1 .. n / ps.
void boundary_hashes(std::span<const int32_t> tokens, int32_t ps, std::vector<uint64_t>& out) {
  out.clear();
  uint64_t h = 0x12345;
  for (size_t i = 0; i < tokens.size(); ++i) {
    h = mix(h, uint64_t(uint32_t(tokens[i])));
    if ((i + 1) % size_t(ps) == 0) out.push_back(h);
  }
}

int32_t pages_for(int64_t tokens, int32_t ps) { return int32_t((tokens + ps - 1) / ps); }

}  // namespace

// ------------------------------------------------------------------------ request state

struct RequestState {
  uint64_t id = 0;
  Request req;
  Clock::time_point t_submit{}, t_admit{}, t_first{}, t_last{};
  bool admitted_once = false;
  std::atomic<bool> cancel{false};
  std::atomic<bool> terminal{false};  // the one terminal event has been claimed
  std::atomic<bool> done{false};      // ... and delivered; result is final
  mutable std::mutex done_mu;
  mutable std::condition_variable done_cv;
  RequestResult result;

  // Poll log: append-only, single writer (the owning loop), any one reader.
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

  void init_log(size_t n_events, size_t text_bytes) {
    slot_cap = n_events;
    slots = std::make_unique<Slot[]>(n_events);
    text_cap = text_bytes;
    text_buf = std::make_unique<char[]>(text_bytes);
  }
  void log_event(int32_t token, std::string_view text, bool final, RequestFinish f) {
    const size_t n = n_slots.load(std::memory_order_relaxed);
    if (n >= slot_cap) return;  // cannot happen: sized for max_tokens + 2
    const size_t len = std::min(text.size(), text_cap - text_used);
    std::copy_n(text.data(), len, text_buf.get() + text_used);
    slots[n] = Slot{token, final, f, uint32_t(text_used), uint32_t(len)};
    text_used += len;
    n_slots.store(n + 1, std::memory_order_release);
  }
};

uint64_t RequestHandle::id() const noexcept { return s_ ? s_->id : 0; }
bool RequestHandle::done() const noexcept { return s_ && s_->done.load(std::memory_order_acquire); }

bool RequestHandle::poll(RequestEvent& ev, std::string& text) {
  if (!s_) return false;
  const size_t n = s_->n_slots.load(std::memory_order_acquire);
  if (s_->read_pos >= n) return false;
  const auto& sl = s_->slots[s_->read_pos++];
  text.assign(s_->text_buf.get() + sl.off, sl.len);
  ev.request_id = s_->id;
  ev.token = sl.token;
  ev.text = text;
  ev.final = sl.final;
  ev.finish = sl.finish;
  return true;
}

bool RequestHandle::wait_for(std::chrono::milliseconds timeout) const {
  if (!s_) return true;
  std::unique_lock<std::mutex> lk(s_->done_mu);
  return s_->done_cv.wait_for(lk, timeout, [&] { return s_->done.load(std::memory_order_acquire); });
}

const RequestResult& RequestHandle::wait() const {
  static const RequestResult empty{};
  if (!s_) return empty;
  std::unique_lock<std::mutex> lk(s_->done_mu);
  s_->done_cv.wait(lk, [&] { return s_->done.load(std::memory_order_acquire); });
  return s_->result;
}

// ------------------------------------------------------------------------ sequences

namespace {

struct SessionRec;

/// A request's generation state; owned by one loop (or in flight between two).
struct Seq {
  std::shared_ptr<RequestState> rs;
  std::vector<int32_t> tokens;  // history: session tokens + prompt + generated (last may be pending)
  int32_t n_history = 0;        // tokens before this request's prompt (a continued session)
  int32_t n_prompt_end = 0;     // tokens.size() at submission
  int32_t n_ctx = 0;
  std::unique_ptr<KvSequence> kv;
  std::optional<KvHandoff> handoff;  // in hand-off: the exported KV under its lease
  int handoff_src = -1;
  std::optional<Sampler> sampler;
  std::optional<StreamingDetokenizer> detok;
  std::string text;
  size_t emitted = 0;
  int32_t n_gen = 0;
  int prefill_exec = 0, decode_exec = 0;
  bool prefill_done = false;  // the first token has been sampled
  uint64_t order = 0;         // admission order (preemption picks the youngest)
  std::shared_ptr<SessionRec> session;
  bool took_session_kv = false;
  int kv_loop = -1;           // the loop whose store holds kv
  int32_t charge = 0;         // prompt tokens counted in a loop's queued_tokens
  std::vector<uint64_t> prefix_hashes;  // page-boundary hashes of the prompt (routing index)
  int32_t step_tokens = 0;    // tokens fed this step
  int32_t logits_row = -1;    // row of this step's logits, -1 = none

  int32_t pending() const { return int32_t(tokens.size()) - (kv ? kv->n_tokens() : 0); }
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
  uint64_t key = 0;  // index key
};

}  // namespace

// ------------------------------------------------------------------------ the loops

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
  void finish(Seq* seq, const std::shared_ptr<RequestState>& rs, RequestFinish f, ErrorCode ec = ErrorCode::kOk,
              std::string message = {});
  void release_seq(Seq& seq);
  void dispatch(std::unique_ptr<Seq> seq, int loop);
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
  std::vector<SequenceStep> batch;
  std::vector<Seq*> batch_seqs;
  std::vector<float> logits;
  std::vector<PrefixEntry> cache;
  uint64_t admit_counter = 0;

  // Routing view (atomics read by submitters).
  std::atomic<int32_t> n_queued{0}, n_running{0};
  std::atomic<int64_t> queued_tokens{0};
  std::atomic<double> prefill_tps{0}, decode_tps{0};
  // Prefix index for routing: key -> page-boundary hashes (under idx_mu; changed per request).
  std::mutex idx_mu;
  std::unordered_map<uint64_t, std::vector<uint64_t>> prefix_index;
  // Metrics.
  std::atomic<uint64_t> steps{0}, pf_tokens{0}, dec_tokens{0}, busy_ns{0}, occupancy_milli{0};

  std::thread thread;

  void push(std::unique_ptr<Seq> s) {
    {
      std::lock_guard<std::mutex> lk(in_mu);
      if (!closed) {
        inbox.push_back(std::move(s));
        in_cv.notify_all();
        return;
      }
    }
    // The loop has stopped: the request ends here.
    sc->queued.fetch_sub(1, std::memory_order_relaxed);
    n_queued.fetch_sub(1, std::memory_order_relaxed);
    sc->release_seq(*s);
    sc->finish(s.get(), s->rs, RequestFinish::kCancelled, ErrorCode::kOk, "scheduler shut down");
  }
  void wake() {
    std::lock_guard<std::mutex> lk(in_mu);
    in_cv.notify_all();
  }

  int32_t prefix_tokens_for(std::span<const uint64_t> hashes) {
    std::lock_guard<std::mutex> lk(idx_mu);
    size_t best = 0;
    for (const auto& [k, hs] : prefix_index) {
      size_t n = 0;
      while (n < hs.size() && n < hashes.size() && hs[n] == hashes[n]) ++n;
      best = std::max(best, n);
    }
    return int32_t(best) * ps;
  }
  void index_add(uint64_t key, const std::vector<uint64_t>& hashes) {
    if (hashes.empty()) return;
    std::lock_guard<std::mutex> lk(idx_mu);
    prefix_index[key] = hashes;
  }
  void index_remove(uint64_t key) {
    std::lock_guard<std::mutex> lk(idx_mu);
    prefix_index.erase(key);
  }

  void run();
  void take_inbox();
  void enqueue(std::unique_ptr<Seq> s);
  void expire(Clock::time_point now);
  void admit();
  bool try_admit(Seq& s);
  void do_step();
  void after_token(std::unique_ptr<Seq>& slot, int32_t token, Clock::time_point now);
  void retire(std::unique_ptr<Seq>& slot, RequestFinish f, ErrorCode ec = ErrorCode::kOk, std::string msg = {});
  void preempt_youngest();
  void park_prefix(Seq& s);
  void drop_cache_entry(size_t i);
  void release_reservation(KvSequence& kv);
  void stop_all();
};

void Scheduler::Impl::release_seq(Seq& s) {
  // Pages in every tier: the sequence's own, and an unfinished hand-off's lease.
  if (s.handoff) {
    if (s.handoff->lease && s.handoff->lease->state() == KvLeaseState::kPending) {
      try {
        s.handoff->lease->begin_read();
        s.handoff->lease->fail("request ended during the hand-off");
      } catch (const Error&) {
      }
    }
    s.handoff.reset();
  }
  if (s.session) {
    // Give the KV back to the session (parked: unpinned, no reservation).
    std::shared_ptr<SessionRec> rec = std::move(s.session);
    std::lock_guard<std::mutex> lk(rec->mu);
    if (rec->closed) {
      // closed meanwhile: the KV is released below
    } else if (s.kv) {
      const int32_t r = s.kv->reservation();
      if (r > 0) {
        s.kv->adopt_reservation(-r);
        s.kv->store().unreserve(s.kv->tier(), r);
      }
      s.kv->set_pinned(false);
      rec->kv = std::move(s.kv);
      rec->tokens = s.tokens;
      rec->executor = s.kv_loop;
      // The KV holds [0, kv->n_tokens()); any further tokens are pending.
    } else if (s.took_session_kv) {
      // The KV was lost (dropped for recompute, or the hand-off failed): the session
      // keeps its history and recomputes on its next use.
      rec->tokens = s.tokens;
    }
    rec->busy = false;
  }
  if (s.kv) {
    s.kv->set_pinned(false);
    s.kv.reset();
  }
}

void Scheduler::Impl::finish(Seq* seq, const std::shared_ptr<RequestState>& rs, RequestFinish f, ErrorCode ec,
                             std::string message) {
  if (rs->terminal.exchange(true)) return;  // exactly once
  const auto now = Clock::now();
  RequestResult& r = rs->result;
  r.id = rs->id;
  r.finish = f;
  r.error = ec;
  r.message = std::move(message);
  std::string_view tail;
  if (seq) {
    if ((f == RequestFinish::kStop || f == RequestFinish::kLength) && seq->detok) {
      seq->text += seq->detok->finish();
    }
    if (f != RequestFinish::kStop && f != RequestFinish::kLength && f != RequestFinish::kStopString) {
      seq->text.resize(std::min(seq->emitted, seq->text.size()));  // only what was streamed
    }
    r.tokens.assign(seq->tokens.begin() + seq->n_prompt_end, seq->tokens.end());
    r.text = seq->text;
    tail = std::string_view(r.text).substr(std::min(seq->emitted, r.text.size()));
    r.metrics.generated_tokens = seq->n_gen;
  }
  auto& m = r.metrics;
  m.e2e_s = secs(rs->t_submit, now);
  if (m.generated_tokens > 0) {
    m.ttft_s = secs(rs->t_submit, rs->t_first);
    if (m.generated_tokens > 1) m.tpot_s = secs(rs->t_first, rs->t_last) / double(m.generated_tokens - 1);
  }
  rs->log_event(-1, tail, true, f);
  if (rs->req.on_event) {
    RequestEvent ev;
    ev.request_id = rs->id;
    ev.text = tail;
    ev.final = true;
    ev.finish = f;
    try {
      rs->req.on_event(ev);
    } catch (...) {
    }
  }
  by_finish[int(f)].fetch_add(1, std::memory_order_relaxed);
  migrations.fetch_add(uint64_t(m.migrations), std::memory_order_relaxed);
  migration_bytes.fetch_add(m.migration_bytes, std::memory_order_relaxed);
  migration_ns.fetch_add(uint64_t(m.migration_s * 1e9), std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lk(rs->done_mu);
    rs->done.store(true, std::memory_order_release);
  }
  rs->done_cv.notify_all();
  finished.fetch_add(1, std::memory_order_relaxed);
  if (outstanding.fetch_sub(1) == 1) {
    std::lock_guard<std::mutex> lk(drain_mu);
    drain_cv.notify_all();
  }
}

void Scheduler::Impl::dispatch(std::unique_ptr<Seq> seq, int loop) {
  loops[size_t(loop)]->push(std::move(seq));
}

void Scheduler::Impl::Loop::release_reservation(KvSequence& kv) {
  const int32_t r = kv.reservation();
  if (r > 0) {
    kv.adopt_reservation(-r);
    kv.store().unreserve(kv.tier(), r);
  }
}

void Scheduler::Impl::Loop::enqueue(std::unique_ptr<Seq> s) {
  // Priority: interactive, standard, batch; FIFO within a class; preempted ones first.
  const int cls = int(s->rs->req.sla);
  auto it = waiting.end();
  while (it != waiting.begin()) {
    auto prev = std::prev(it);
    if (int((*prev)->rs->req.sla) <= cls) break;
    it = prev;
  }
  waiting.insert(it, std::move(s));
}

void Scheduler::Impl::Loop::take_inbox() {
  {
    std::lock_guard<std::mutex> lk(in_mu);
    incoming.swap(inbox);
  }
  for (auto& s : incoming) enqueue(std::move(s));
  incoming.clear();
}

void Scheduler::Impl::Loop::retire(std::unique_ptr<Seq>& slot, RequestFinish f, ErrorCode ec, std::string msg) {
  Seq& s = *slot;
  index_remove(s.rs->id);
  if (s.kv && !s.session && sc->opt.prefix_cache_entries > 0 &&
      (f == RequestFinish::kStop || f == RequestFinish::kLength || f == RequestFinish::kStopString)) {
    park_prefix(s);
  }
  sc->release_seq(s);
  sc->finish(&s, s.rs, f, ec, std::move(msg));
  slot.reset();
}

void Scheduler::Impl::Loop::drop_cache_entry(size_t i) {
  index_remove(cache[i].key);
  cache.erase(cache.begin() + std::ptrdiff_t(i));
}

void Scheduler::Impl::Loop::park_prefix(Seq& s) {
  const int32_t keep = std::min(s.n_prompt_end, s.kv->n_tokens()) / ps * ps;
  if (keep < ps || s.kv->tier() != tier) return;
  for (const auto& e : cache) {  // already cached (a shared prefix): nothing new to keep
    if (int32_t(e.tokens.size()) >= keep && std::equal(s.tokens.begin(), s.tokens.begin() + keep, e.tokens.begin()))
      return;
  }
  release_reservation(*s.kv);
  s.kv->truncate(keep);
  s.kv->set_pinned(false);
  PrefixEntry e;
  e.kv = std::move(s.kv);
  e.tokens.assign(s.tokens.begin(), s.tokens.begin() + keep);
  e.key = (uint64_t(1) << 63) | s.rs->id;
  std::vector<uint64_t> h;
  boundary_hashes(e.tokens, ps, h);
  index_add(e.key, h);
  cache.push_back(std::move(e));
  while (int32_t(cache.size()) > sc->opt.prefix_cache_entries) drop_cache_entry(0);
}

void Scheduler::Impl::Loop::expire(Clock::time_point now) {
  auto check = [&](Seq& s) -> std::optional<RequestFinish> {
    if (s.rs->cancel.load(std::memory_order_acquire)) return RequestFinish::kCancelled;
    if (s.rs->req.deadline && now >= *s.rs->req.deadline) return RequestFinish::kTimeout;
    return std::nullopt;
  };
  for (auto it = waiting.begin(); it != waiting.end();) {
    if (auto f = check(**it)) {
      sc->queued.fetch_sub(1, std::memory_order_relaxed);
      n_queued.fetch_sub(1, std::memory_order_relaxed);
      queued_tokens.fetch_sub((*it)->charge, std::memory_order_relaxed);
      retire(*it, *f);
      it = waiting.erase(it);
    } else {
      ++it;
    }
  }
  for (auto& slot : running) {
    if (auto f = check(*slot)) retire(slot, *f);
  }
  std::erase_if(running, [](const auto& p) { return !p; });
}

bool Scheduler::Impl::Loop::try_admit(Seq& s) {
  const auto t0 = Clock::now();
  // 1. The KV: a hand-off to import, a session's KV (maybe on another executor), a
  //    swapped-out KV to bring back, or a fresh sequence (sharing a cached prefix).
  if (s.handoff) {
    const int32_t need = s.handoff->descriptor.n_pages();
    if (store->usage(tier).free() < need + 1) return false;
    try {
      KvHandoff h = *s.handoff;
      const int32_t nt = h.descriptor.token_end;
      s.kv = kv_import(std::span<const KvHandoff>(&h, 1), *sc->model, *store, tier, s.n_ctx,
                       std::span<const int32_t>(s.tokens.data(), size_t(nt)));
      auto& m = s.rs->result.metrics;
      ++m.migrations;
      m.migration_bytes += uint64_t(need) * h.descriptor.page_payload_bytes();
      m.migration_s += secs(t0, Clock::now());
      sc->log(fmt::format("handoff req={} {} -> {}: {} pages, {} bytes, {:.4f}s", s.rs->id,
                          sc->loops[size_t(s.handoff_src)]->name, name, need,
                          uint64_t(need) * h.descriptor.page_payload_bytes(), secs(t0, Clock::now())));
    } catch (const Error& e) {
      if (e.code() == ErrorCode::kOutOfMemory) return false;
      // The lease expired or the import was refused: recompute here (same tokens).
      sc->log(fmt::format("handoff req={} failed ({}); recomputing on {}", s.rs->id, e.what(), name));
      s.kv.reset();
    }
    s.handoff.reset();
  }
  if (!s.kv && s.session) {
    std::unique_ptr<KvSequence> skv;
    {
      std::lock_guard<std::mutex> lk(s.session->mu);
      skv = std::move(s.session->kv);
      s.session->tokens.clear();
    }
    s.took_session_kv = true;
    if (skv && &skv->store() != store) {
      // Session KV on another executor (SLA upgrade): one verified move.
      const int32_t need = int32_t(skv->block_table().size());
      if (store->usage(tier).free() < need + 1) {
        std::lock_guard<std::mutex> lk(s.session->mu);
        s.session->kv = std::move(skv);
        s.session->tokens = s.tokens;
        s.took_session_kv = false;
        return false;
      }
      try {
        skv->set_pinned(true);
        const std::span<const int32_t> toks(s.tokens.data(), size_t(skv->n_tokens()));
        KvHandoff h = kv_export(*skv, *sc->model, toks, sc->opt.handoff_ttl);
        s.kv = kv_import(std::span<const KvHandoff>(&h, 1), *sc->model, *store, tier, s.n_ctx, toks);
        auto& m = s.rs->result.metrics;
        ++m.migrations;
        m.migration_bytes += uint64_t(h.descriptor.n_pages()) * h.descriptor.page_payload_bytes();
        m.migration_s += secs(t0, Clock::now());
        sc->log(fmt::format("session {} migrates to {}: {} pages, {:.4f}s", s.session->id, name,
                            h.descriptor.n_pages(), secs(t0, Clock::now())));
      } catch (const Error& e) {
        if (e.code() == ErrorCode::kOutOfMemory) {
          skv->set_pinned(false);
          std::lock_guard<std::mutex> lk(s.session->mu);
          s.session->kv = std::move(skv);
          s.session->tokens = s.tokens;
          s.took_session_kv = false;
          return false;
        }
        sc->log(fmt::format("session {} migration failed ({}); recomputing", s.session->id, e.what()));
      }
      skv.reset();  // the old pages go once the import is confirmed
    } else {
      s.kv = std::move(skv);
    }
  }
  if (s.kv && s.kv->pages_outside(tier) > 0) {
    // Swapped out (File tier): bring it back first, then reserve the rest.
    const int32_t outside = s.kv->pages_outside(tier);
    if (store->usage(tier).free() < outside) return false;
    try {
      s.kv->make_resident(tier);
    } catch (const Error&) {
      return false;
    }
  }
  int32_t reused = 0;
  bool fresh = false;
  if (!s.kv) {
    s.kv = std::make_unique<KvSequence>(*store, s.n_ctx, tier);
    fresh = true;
    // Prefix sharing: the longest common prefix with a resident sequence of this executor.
    const int32_t limit = int32_t(s.tokens.size()) - 1;  // the last token must be computed
    const KvSequence* best = nullptr;
    int32_t best_n = 0;
    auto consider = [&](const KvSequence& kv, std::span<const int32_t> toks) {
      if (kv.tier() != tier || kv.pages_outside(tier) > 0) return;
      const int32_t n = std::min({kv.n_tokens(), int32_t(toks.size()), limit});
      int32_t i = 0;
      while (i < n && toks[size_t(i)] == s.tokens[size_t(i)]) ++i;
      if (i > best_n) {
        best_n = i;
        best = &kv;
      }
    };
    for (const auto& e : cache) consider(*e.kv, e.tokens);
    for (const auto& r : running) {
      if (r && r->kv) consider(*r->kv, r->tokens);
    }
    best_n = best_n / ps * ps;  // whole pages only: nobody ever writes a shared page
    if (best && best_n >= ps) {
      s.kv->share_prefix(*best, best_n);
      reused = best_n;
    }
  }
  // 2. Reserve the pages it can still need: through max_tokens, capped by the context.
  const int64_t final_len = std::min<int64_t>(int64_t(s.tokens.size()) + (s.rs->req.max_tokens - s.n_gen), s.n_ctx);
  const int32_t held = int32_t(s.kv->block_table().size());
  const int32_t cow = (s.kv->n_tokens() % ps != 0) ? 1 : 0;
  const int32_t need = std::max(0, pages_for(final_len, ps) - held + cow - s.kv->reservation());
  if (need > 0) {
    auto free_now = [&] { return store->usage(tier).free(); };
    while (free_now() < need && !cache.empty()) drop_cache_entry(0);  // prefix cache first
    if (free_now() < need && store->has_tier(KvTier::kFile)) {
      store->evict_lru(tier, KvTier::kFile, need - free_now(), s.kv.get());  // parked sessions
    }
    if (free_now() < need) {
      if (fresh) {
        s.kv.reset();  // nothing lost: recreated (and the prefix re-shared) next time
        reused = 0;
      }
      return false;
    }
    store->reserve(tier, need);
    s.kv->adopt_reservation(need);
  }
  s.kv->set_pinned(true);
  s.kv_loop = index;
  // Metrics of the first admission.
  auto& m = s.rs->result.metrics;
  if (!s.rs->admitted_once) {
    s.rs->admitted_once = true;
    s.rs->t_admit = Clock::now();
    m.queue_s = secs(s.rs->t_submit, s.rs->t_admit);
    m.prompt_tokens = s.n_prompt_end - s.n_history;
    m.prefix_reused_tokens = std::max(0, reused - s.n_history);
    sc->prompt_tokens.fetch_add(uint64_t(m.prompt_tokens), std::memory_order_relaxed);
    sc->prefix_reused.fetch_add(uint64_t(m.prefix_reused_tokens), std::memory_order_relaxed);
  }
  if (m.prefill_executor.empty()) m.prefill_executor = name;
  s.order = ++admit_counter;
  index_add(s.rs->id, s.prefix_hashes);
  return true;
}

void Scheduler::Impl::Loop::admit() {
  while (!waiting.empty() && int32_t(running.size()) < cfg.max_running) {
    Seq& s = *waiting.front();
    // A request that can never fit this tier fails instead of blocking the queue.
    const int64_t final_len = std::min<int64_t>(int64_t(s.tokens.size()) + s.rs->req.max_tokens, s.n_ctx);
    const int32_t cap = store->usage(tier).capacity;
    if (pages_for(final_len, ps) + 1 > cap) {
      sc->queued.fetch_sub(1, std::memory_order_relaxed);
      n_queued.fetch_sub(1, std::memory_order_relaxed);
      queued_tokens.fetch_sub(s.charge, std::memory_order_relaxed);
      retire(waiting.front(), RequestFinish::kError, ErrorCode::kOutOfMemory,
             fmt::format("{} positions need {} KV pages; the {} tier of {} holds {}", final_len,
                         pages_for(final_len, ps) + 1, kv_tier_name(tier), name, cap));
      waiting.pop_front();
      continue;
    }
    if (!try_admit(s)) break;  // head of line waits for KV (FIFO within a class)
    sc->queued.fetch_sub(1, std::memory_order_relaxed);
    n_queued.fetch_sub(1, std::memory_order_relaxed);
    queued_tokens.fetch_sub(s.charge, std::memory_order_relaxed);
    s.charge = 0;
    running.push_back(std::move(waiting.front()));
    waiting.pop_front();
  }
  n_running.store(int32_t(running.size()), std::memory_order_relaxed);
}

void Scheduler::Impl::Loop::preempt_youngest() {
  if (running.empty()) return;
  auto it = std::max_element(running.begin(), running.end(),
                             [](const auto& a, const auto& b) { return a->order < b->order; });
  std::unique_ptr<Seq> s = std::move(*it);
  running.erase(it);
  ++s->rs->result.metrics.preemptions;
  sc->preemptions.fetch_add(1, std::memory_order_relaxed);
  index_remove(s->rs->id);
  bool swapped = false;
  if (store->has_tier(KvTier::kFile)) {
    try {
      s->kv->set_pinned(false);
      s->kv->move_to(KvTier::kFile);  // its reservation is returned
      swapped = true;
    } catch (const Error&) {
    }
  }
  if (!swapped) s->kv.reset();  // recomputed from its tokens on readmission
  sc->log(fmt::format("preempt req={} on {}: {}", s->rs->id, name, swapped ? "swapped to file" : "KV dropped"));
  sc->queued.fetch_add(1, std::memory_order_relaxed);
  n_queued.fetch_add(1, std::memory_order_relaxed);
  s->charge = s->pending();
  queued_tokens.fetch_add(s->charge, std::memory_order_relaxed);
  waiting.push_front(std::move(s));
}

void Scheduler::Impl::Loop::after_token(std::unique_ptr<Seq>& slot, int32_t id, Clock::time_point now) {
  Seq& s = *slot;
  const Request& q = s.rs->req;
  const Tokenizer& tok = sc->model->tokenizer();
  if (s.n_gen == 0) {
    s.rs->t_first = now;
    s.prefill_done = true;
    s.rs->result.metrics.decode_executor = sc->loops[size_t(s.decode_exec)]->name;
  }
  s.rs->t_last = now;
  if (tok.is_eog(id) && !q.ignore_eos) {
    retire(slot, RequestFinish::kStop);
    return;
  }
  s.tokens.push_back(id);
  ++s.n_gen;
  s.rs->result.metrics.generated_tokens = s.n_gen;
  s.text += s.detok->push(id);
  const StopScan scan = scan_stop_strings(s.text, s.emitted, q.stop);
  const bool hit_stop = scan.hit;
  const std::string_view piece = scan.piece;
  if (hit_stop) {
    // The piece before the stop string goes out with the token, then the terminal event.
    s.rs->log_event(id, piece, false, RequestFinish::kStopString);
    if (q.on_event) q.on_event(RequestEvent{s.rs->id, id, piece, false, RequestFinish::kStopString});
    retire(slot, RequestFinish::kStopString);
    return;
  }
  s.rs->log_event(id, piece, false, RequestFinish::kLength);
  if (q.on_event && !q.on_event(RequestEvent{s.rs->id, id, piece, false, RequestFinish::kLength})) {
    retire(slot, RequestFinish::kCancelled);
    return;
  }
  if (s.n_gen >= q.max_tokens || int32_t(s.tokens.size()) > s.n_ctx) {
    retire(slot, RequestFinish::kLength);
    return;
  }
  if (s.n_gen == 1 && s.decode_exec != index) {
    // Prefill done here, decode elsewhere: export under a lease, hand over (the KV moves once).
    index_remove(s.rs->id);
    try {
      release_reservation(*s.kv);
      s.handoff = kv_export(*s.kv, *sc->model, std::span<const int32_t>(s.tokens.data(), size_t(s.kv->n_tokens())),
                            sc->opt.handoff_ttl);
      s.handoff_src = index;
      s.kv->set_pinned(false);
      s.kv.reset();  // the lease holds the pages until the receiver confirms
    } catch (const Error& e) {
      sc->log(fmt::format("handoff req={} export failed ({}); decoding on {}", s.rs->id, e.what(), name));
      s.decode_exec = index;
      s.rs->result.metrics.decode_executor = name;
      return;
    }
    auto& dst = *sc->loops[size_t(s.decode_exec)];
    sc->queued.fetch_add(1, std::memory_order_relaxed);
    dst.n_queued.fetch_add(1, std::memory_order_relaxed);
    dst.push(std::move(slot));
  }
}

void Scheduler::Impl::Loop::do_step() {
  // Build: decodes first, then prefill chunks under the token budget.
  batch.clear();
  batch_seqs.clear();
  int32_t budget = cfg.step_token_budget;
  int32_t rows = 0, n_decode = 0, n_prefill = 0;
  for (auto& p : running) {
    Seq& s = *p;
    if (s.pending() == 1 && budget > 0) {
      s.step_tokens = 1;
      s.logits_row = rows++;
      --budget;
      ++n_decode;
      batch_seqs.push_back(&s);
    }
  }
  for (auto& p : running) {
    Seq& s = *p;
    const int32_t pend = s.pending();
    if (pend <= 1 || budget <= 0) continue;
    const int32_t n = std::min({pend, cfg.prefill_chunk, budget});
    s.step_tokens = n;
    s.logits_row = n == pend ? rows++ : -1;
    budget -= n;
    n_prefill += n;
    batch_seqs.push_back(&s);
  }
  if (batch_seqs.empty()) return;
  for (Seq* s : batch_seqs) {
    const int32_t pos0 = s->kv->n_tokens();
    batch.push_back(SequenceStep{s->kv.get(), std::span<const int32_t>(s->tokens.data() + pos0, size_t(s->step_tokens)),
                                 pos0, s->logits_row >= 0 ? LogitsRows::kLast : LogitsRows::kNone});
  }
  const auto t0 = Clock::now();
  try {
    ex->step(batch, std::span<float>(logits.data(), size_t(rows) * size_t(n_vocab)));
  } catch (const Error& e) {
    for (auto& p : running) p->kv->set_pinned(true);
    if (e.code() == ErrorCode::kOutOfMemory && running.size() > 1) {
      preempt_youngest();
      return;
    }
    // Isolate: step each sequence alone; the ones that fail end with the error.
    for (auto& p : running) {
      Seq& s = *p;
      if (s.step_tokens == 0) continue;
      const int32_t pos0 = s.kv->n_tokens();
      SequenceStep st{s.kv.get(), std::span<const int32_t>(s.tokens.data() + pos0, size_t(s.step_tokens)), pos0,
                      s.logits_row >= 0 ? LogitsRows::kLast : LogitsRows::kNone};
      try {
        ex->step(std::span<const SequenceStep>(&st, 1),
                 std::span<float>(logits.data() + size_t(std::max(s.logits_row, 0)) * size_t(n_vocab), size_t(n_vocab)));
      } catch (const Error& e2) {
        s.step_tokens = 0;
        s.logits_row = -1;
        sc->log(fmt::format("step error req={} on {}: {}", s.rs->id, name, e2.what()));
        retire(p, RequestFinish::kError, e2.code(), e2.what());
      }
    }
    std::erase_if(running, [](const auto& q) { return !q; });
  }
  const auto t1 = Clock::now();
  const double dt = secs(t0, t1);
  for (auto& p : running) p->kv->set_pinned(true);  // step() unpins its batch
  steps.fetch_add(1, std::memory_order_relaxed);
  pf_tokens.fetch_add(uint64_t(n_prefill), std::memory_order_relaxed);
  dec_tokens.fetch_add(uint64_t(n_decode), std::memory_order_relaxed);
  busy_ns.fetch_add(uint64_t(dt * 1e9), std::memory_order_relaxed);
  occupancy_milli.fetch_add(uint64_t(1000.0 * double(running.size()) / double(cfg.max_running)),
                            std::memory_order_relaxed);
  auto ewma = [](std::atomic<double>& a, double v) {
    const double old = a.load(std::memory_order_relaxed);
    a.store(old <= 0 ? v : 0.8 * old + 0.2 * v, std::memory_order_relaxed);
  };
  if (dt > 0) {
    if (n_prefill > 0) ewma(prefill_tps, double(n_prefill + n_decode) / dt);
    if (n_prefill == 0 && n_decode > 0) ewma(decode_tps, 1.0 / dt);
  }
  // Sample, stream, retire, hand off.
  for (auto& p : running) {
    Seq& s = *p;
    if (s.step_tokens == 0) continue;
    s.step_tokens = 0;
    const int32_t row = s.logits_row;
    s.logits_row = -1;
    if (row < 0) continue;
    const std::span<const float> l(logits.data() + size_t(row) * size_t(n_vocab), size_t(n_vocab));
    const int32_t id = s.sampler->sample(l, std::span<const int32_t>(s.tokens.data(), size_t(s.kv->n_tokens())));
    after_token(p, id, t1);
  }
  std::erase_if(running, [](const auto& q) { return !q; });
  n_running.store(int32_t(running.size()), std::memory_order_relaxed);
}

void Scheduler::Impl::Loop::stop_all() {
  {
    std::lock_guard<std::mutex> lk(in_mu);
    closed = true;
  }
  take_inbox();
  for (auto& s : waiting) {
    sc->queued.fetch_sub(1, std::memory_order_relaxed);
    n_queued.fetch_sub(1, std::memory_order_relaxed);
    retire(s, RequestFinish::kCancelled, ErrorCode::kOk, "scheduler shut down");
  }
  waiting.clear();
  for (auto& s : running) retire(s, RequestFinish::kCancelled, ErrorCode::kOk, "scheduler shut down");
  running.clear();
  while (!cache.empty()) drop_cache_entry(cache.size() - 1);
  n_running.store(0);
}

void Scheduler::Impl::Loop::run() {
  while (true) {
    take_inbox();
    if (stop.load(std::memory_order_acquire)) {
      stop_all();
      return;
    }
    if (clear_cache.exchange(false)) {
      while (!cache.empty()) drop_cache_entry(cache.size() - 1);
      cache_generation.fetch_add(1, std::memory_order_release);
      std::lock_guard<std::mutex> lk(in_mu);
      in_cv.notify_all();
    }
    expire(Clock::now());
    admit();
    if (running.empty()) {
      std::unique_lock<std::mutex> lk(in_mu);
      if (!inbox.empty() || stop.load() || clear_cache.load()) continue;
      if (waiting.empty()) {
        in_cv.wait(lk, [&] { return !inbox.empty() || stop.load() || clear_cache.load(); });
      } else {
        // Blocked on KV (or a cancel/deadline to notice): poll gently.
        auto until = Clock::now() + std::chrono::milliseconds(5);
        in_cv.wait_until(lk, until);
      }
      continue;
    }
    do_step();
  }
}

// ------------------------------------------------------------------------ Scheduler

Scheduler::Scheduler(SchedulerOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.opt = std::move(options);
  if (I.opt.executors.empty()) throw Error(ErrorCode::kInvalidArgument, "scheduler: no executors");
  for (size_t i = 0; i < I.opt.executors.size(); ++i) {
    const auto& c = I.opt.executors[i];
    if (!c.executor || !c.store) {
      throw Error(ErrorCode::kInvalidArgument, fmt::format("scheduler: executor {} has no executor or no store", i));
    }
    if (!c.store->has_tier(c.executor->kv_tier())) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("scheduler: executor {}'s store has no {} tier", i, kv_tier_name(c.executor->kv_tier())));
    }
    if (c.max_running < 1 || c.step_token_budget < c.max_running || c.prefill_chunk < 1) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("scheduler: executor {}: max_running {} >= 1, step_token_budget {} >= max_running, "
                              "prefill_chunk {} >= 1 needed",
                              i, c.max_running, c.step_token_budget, c.prefill_chunk));
    }
    if (i > 0 && c.executor->model().identity_hash() != I.opt.executors[0].executor->model().identity_hash()) {
      throw Error(ErrorCode::kInvalidArgument, "scheduler: the executors run different models");
    }
  }
  I.model = I.opt.executors[0].executor->model_ptr();
  I.policy = I.opt.policy ? I.opt.policy : std::make_shared<DefaultRoutingPolicy>();
  const HParams& hp = I.model->hparams();
  I.n_ctx = I.opt.max_context > 0 ? I.opt.max_context : std::min(hp.n_ctx_train > 0 ? hp.n_ctx_train : 4096, 4096);
  const Tokenizer& tok = I.model->tokenizer();
  size_t mx = 1;
  for (int32_t id = 0; id < tok.n_vocab(); ++id) mx = std::max(mx, tok.token_text(id).size());
  I.max_piece = 3 * (mx + 4);
  for (size_t i = 0; i < I.opt.executors.size(); ++i) {
    auto L = std::make_unique<Impl::Loop>();
    L->sc = &I;
    L->index = int(i);
    L->cfg = I.opt.executors[i];
    L->ex = L->cfg.executor;
    L->store = L->cfg.store.get();
    L->tier = L->ex->kv_tier();
    L->ps = L->store->layout().page_size;
    L->n_vocab = hp.n_vocab;
    L->accelerator = L->cfg.accelerator.value_or(L->tier == KvTier::kDevice);
    L->name = L->cfg.name.empty() ? fmt::format("{}{}", L->ex->name(), i) : L->cfg.name;
    L->prefill_tps = L->cfg.prior_prefill_tps > 0 ? L->cfg.prior_prefill_tps : 1000.0;
    L->decode_tps = L->cfg.prior_decode_tps > 0 ? L->cfg.prior_decode_tps : 100.0;
    L->logits.resize(size_t(L->cfg.max_running) * size_t(hp.n_vocab));
    L->running.reserve(size_t(L->cfg.max_running));
    L->batch.reserve(size_t(L->cfg.max_running));
    L->batch_seqs.reserve(size_t(L->cfg.max_running));
    I.loops.push_back(std::move(L));
  }
  for (auto& L : I.loops) L->thread = std::thread([l = L.get()] { l->run(); });
}

Scheduler::~Scheduler() { shutdown(); }

int Scheduler::executor_count() const noexcept { return int(impl_->loops.size()); }

RequestHandle Scheduler::submit(Request request) {
  Impl& I = *impl_;
  if (I.stopped.load()) throw Error(ErrorCode::kInvalidArgument, "scheduler: submit after shutdown");
  auto rs = std::make_shared<RequestState>();
  rs->id = I.next_id.fetch_add(1);
  rs->t_submit = Clock::now();
  rs->req = std::move(request);
  const Request& q = rs->req;
  rs->init_log(size_t(std::max(q.max_tokens, 0)) + 2,
               (size_t(std::max(q.max_tokens, 0)) + 2) * I.max_piece + [&] {
                 size_t n = 0;
                 for (const auto& s : q.stop) n += s.size();
                 return n;
               }());
  I.submitted.fetch_add(1, std::memory_order_relaxed);
  I.outstanding.fetch_add(1);
  RequestHandle h(rs);
  auto refuse = [&](RequestFinish f, ErrorCode ec, std::string msg) {
    I.finish(nullptr, rs, f, ec, std::move(msg));
    return h;
  };
  if (!I.accepting.load()) return refuse(RequestFinish::kOverloaded, ErrorCode::kOk, "scheduler is draining");

  auto seq = std::make_unique<Seq>();
  seq->rs = rs;
  seq->n_ctx = I.n_ctx;
  std::shared_ptr<SessionRec> sess;
  try {
    if (q.max_tokens < 1) throw Error(ErrorCode::kInvalidArgument, fmt::format("max_tokens {} must be >= 1", q.max_tokens));
    for (const auto& s : q.stop) {
      if (s.empty()) throw Error(ErrorCode::kInvalidArgument, "a stop string is empty");
    }
    seq->sampler.emplace(q.sampling, I.model->hparams().n_vocab);
    seq->detok.emplace(I.model->tokenizer(), false, false);
    if (q.session != 0) {
      std::lock_guard<std::mutex> lk(I.sessions_mu);
      auto it = I.sessions.find(q.session);
      if (it == I.sessions.end()) throw Error(ErrorCode::kInvalidArgument, fmt::format("no session {}", q.session));
      sess = it->second;
      std::lock_guard<std::mutex> lk2(sess->mu);
      if (sess->busy || sess->closed) {
        sess = nullptr;
        throw Error(ErrorCode::kInvalidArgument, fmt::format("session {} is busy or closed", q.session));
      }
      sess->busy = true;
      seq->tokens = sess->tokens;
    }
    seq->n_history = int32_t(seq->tokens.size());
    std::vector<int32_t> prompt = q.prompt_ids;
    if (prompt.empty() && !q.prompt_text.empty()) {
      prompt = I.model->tokenizer().tokenize(q.prompt_text, seq->tokens.empty(), q.parse_special);
    }
    if (prompt.empty() && seq->tokens.empty()) throw Error(ErrorCode::kInvalidArgument, "empty prompt");
    for (int32_t id : prompt) {
      if (id < 0 || id >= I.model->hparams().n_vocab) {
        throw Error(ErrorCode::kInvalidArgument, fmt::format("prompt token id {} is outside the vocabulary", id));
      }
    }
    const int64_t total = int64_t(seq->tokens.size()) + int64_t(prompt.size());
    if (total > I.n_ctx) {
      throw Error(ErrorCode::kContextOverflow,
                  fmt::format("context overflow: {} positions needed, n_ctx is {}", total, I.n_ctx));
    }
    seq->tokens.reserve(size_t(std::min<int64_t>(total + q.max_tokens + 1, I.n_ctx + 1)));
    seq->tokens.insert(seq->tokens.end(), prompt.begin(), prompt.end());
    seq->n_prompt_end = int32_t(seq->tokens.size());
    seq->text.reserve(size_t(q.max_tokens) * 8 + 16);
  } catch (const Error& e) {
    if (sess) {
      std::lock_guard<std::mutex> lk(sess->mu);
      sess->busy = false;
    }
    return refuse(RequestFinish::kError, e.code(), e.what());
  }
  seq->session = sess;
  // Back-pressure: a bounded queue.
  if (I.queued.fetch_add(1) >= I.opt.max_queued) {
    I.queued.fetch_sub(1);
    I.release_seq(*seq);
    return refuse(RequestFinish::kOverloaded, ErrorCode::kOk,
                  fmt::format("overloaded: {} requests already waiting", I.opt.max_queued));
  }
  // Route.
  int target;
  {
    std::lock_guard<std::mutex> lk(I.route_mu);
    std::vector<ExecutorView> views;
    views.reserve(I.loops.size());
    const int32_t ps = I.loops[0]->ps;
    boundary_hashes(std::span<const int32_t>(seq->tokens.data(), size_t(seq->n_prompt_end)), ps, seq->prefix_hashes);
    for (const auto& L : I.loops) {
      ExecutorView v;
      v.index = L->index;
      v.name = L->name;
      v.accelerator = L->accelerator;
      v.prefill_tps = L->prefill_tps.load(std::memory_order_relaxed);
      v.decode_tps = L->decode_tps.load(std::memory_order_relaxed);
      v.queued = L->n_queued.load(std::memory_order_relaxed);
      v.queued_tokens = std::max<int64_t>(0, L->queued_tokens.load(std::memory_order_relaxed));
      v.running = L->n_running.load(std::memory_order_relaxed);
      v.max_running = L->cfg.max_running;
      v.kv_free_pages = L->store->usage(L->tier).free();
      v.page_size = L->ps;
      v.prefix_tokens = L->ps == ps ? L->prefix_tokens_for(seq->prefix_hashes) : 0;
      views.push_back(v);
    }
    RouteInput in;
    in.sla = q.sla;
    in.prompt_tokens = seq->n_prompt_end;
    in.max_tokens = q.max_tokens;
    if (q.deadline) in.deadline_s = std::max(0.0, secs(Clock::now(), *q.deadline));
    if (sess) {
      std::lock_guard<std::mutex> lk2(sess->mu);
      in.session_executor = sess->kv ? sess->executor : -1;
    }
    RouteDecision d = I.policy->route(in, views);
    const int n = int(I.loops.size());
    d.prefill = std::clamp(d.prefill, 0, n - 1);
    d.decode = std::clamp(d.decode, 0, n - 1);
    seq->prefill_exec = d.prefill;
    seq->decode_exec = d.decode;
    rs->result.route = d.reason;
    I.log(fmt::format("route req={} {}", rs->id, d.reason));
    target = d.prefill;
    auto& L = *I.loops[size_t(target)];
    L.n_queued.fetch_add(1, std::memory_order_relaxed);
    seq->charge = seq->n_prompt_end - seq->n_history;
    L.queued_tokens.fetch_add(seq->charge, std::memory_order_relaxed);
  }
  I.dispatch(std::move(seq), target);
  return h;
}

void Scheduler::cancel(const RequestHandle& handle) noexcept {
  if (!handle.valid()) return;
  handle.state()->cancel.store(true, std::memory_order_release);
  for (auto& L : impl_->loops) L->wake();
}

uint64_t Scheduler::open_session() {
  auto s = std::make_shared<SessionRec>();
  s->id = impl_->next_session.fetch_add(1);
  std::lock_guard<std::mutex> lk(impl_->sessions_mu);
  impl_->sessions[s->id] = s;
  return s->id;
}

void Scheduler::close_session(uint64_t id) {
  std::shared_ptr<SessionRec> s;
  {
    std::lock_guard<std::mutex> lk(impl_->sessions_mu);
    auto it = impl_->sessions.find(id);
    if (it == impl_->sessions.end()) return;
    s = it->second;
    impl_->sessions.erase(it);
  }
  std::lock_guard<std::mutex> lk(s->mu);
  s->closed = true;
  // A running request still holds the KV; it is given back to this record and freed
  // with it (the record dies with the last reference).
  if (!s->busy) s->kv.reset();
}

void Scheduler::drain() {
  Impl& I = *impl_;
  I.accepting.store(false);
  std::unique_lock<std::mutex> lk(I.drain_mu);
  I.drain_cv.wait(lk, [&] { return I.outstanding.load() == 0; });
}

void Scheduler::shutdown() {
  Impl& I = *impl_;
  if (I.stopped.exchange(true)) return;
  I.accepting.store(false);
  for (auto& L : I.loops) {
    L->stop.store(true, std::memory_order_release);
    L->wake();
  }
  for (auto& L : I.loops) {
    if (L->thread.joinable()) L->thread.join();
  }
  // Hand-offs pushed to a loop after it closed ended in push(); nothing is left.
  std::lock_guard<std::mutex> lk(I.sessions_mu);
  for (auto& [id, s] : I.sessions) {
    std::lock_guard<std::mutex> lk2(s->mu);
    s->kv.reset();
  }
  I.sessions.clear();
}

void Scheduler::clear_prefix_cache() {
  for (auto& L : impl_->loops) {
    const uint64_t gen = L->cache_generation.load(std::memory_order_acquire);
    L->clear_cache.store(true, std::memory_order_release);
    std::unique_lock<std::mutex> lk(L->in_mu);
    L->in_cv.notify_all();
    L->in_cv.wait(lk, [&] { return L->cache_generation.load(std::memory_order_acquire) != gen || L->closed; });
  }
}

SchedulerMetrics Scheduler::metrics() const {
  const Impl& I = *impl_;
  SchedulerMetrics m;
  m.elapsed_s = secs(I.t_start, Clock::now());
  m.submitted = I.submitted.load();
  m.finished = I.finished.load();
  for (int i = 0; i < 8; ++i) m.by_finish[i] = I.by_finish[i].load();
  m.migrations = I.migrations.load();
  m.migration_bytes = I.migration_bytes.load();
  m.migration_s = double(I.migration_ns.load()) / 1e9;
  m.preemptions = I.preemptions.load();
  m.prompt_tokens = I.prompt_tokens.load();
  m.prefix_reused_tokens = I.prefix_reused.load();
  m.prefix_hit_rate = m.prompt_tokens ? double(m.prefix_reused_tokens) / double(m.prompt_tokens) : 0.0;
  m.queued = std::max(0, I.queued.load());
  for (const auto& L : I.loops) {
    ExecutorMetrics e;
    e.name = L->name;
    e.accelerator = L->accelerator;
    e.steps = L->steps.load();
    e.prefill_tokens = L->pf_tokens.load();
    e.decode_tokens = L->dec_tokens.load();
    e.busy_s = double(L->busy_ns.load()) / 1e9;
    e.elapsed_s = m.elapsed_s;
    e.utilisation = m.elapsed_s > 0 ? e.busy_s / m.elapsed_s : 0.0;
    e.tokens_per_s = m.elapsed_s > 0 ? double(e.prefill_tokens + e.decode_tokens) / m.elapsed_s : 0.0;
    e.prefill_tps = L->prefill_tps.load();
    e.decode_tps = L->decode_tps.load();
    e.batch_occupancy = e.steps ? double(L->occupancy_milli.load()) / 1000.0 / double(e.steps) : 0.0;
    e.running = L->n_running.load();
    e.queued = std::max(0, L->n_queued.load());
    e.max_running = L->cfg.max_running;
    for (int t = 0; t < kKvTierCount; ++t) {
      if (L->store->has_tier(KvTier(t))) e.kv[t] = L->store->usage(KvTier(t));
    }
    m.executors.push_back(std::move(e));
  }
  return m;
}

}  // namespace tandem
