// The per-executor step loop: take routed requests, expire, admit, then one step —
// every decoding sequence's next token first, then prefill chunks of waiting prompts up
// to the token budget (chunked prefill; the tightest SLA class prefilling first, looser
// classes within ExecutorConfig::looser_class_prefill_tokens) — sample, stream, retire,
// hand off.
//
// A loop never dies: whatever a step, a sampler or a user's callback throws is caught
// here; the requests it concerns end with one kError event each and the loop goes on.
#include <fmt/format.h>

#include <algorithm>

#include "sched/scheduler_internal.hpp"
#include "sched/speed_signals.hpp"

namespace tandem {

using Loop = Scheduler::Impl::Loop;

namespace {

ErrorCode code_of(const std::exception& e) {
  if (const auto* te = dynamic_cast<const Error*>(&e)) return te->code();
  if (dynamic_cast<const std::bad_alloc*>(&e)) return ErrorCode::kOutOfMemory;
  return ErrorCode::kInternal;
}

}  // namespace

void Scheduler::Impl::release_seq(Seq& s) noexcept {
  // Pages in every tier: the sequence's own, and an unfinished hand-off's lease.
  if (s.handoff) {
    if (s.handoff->lease && s.handoff->lease->state() == KvLeaseState::kPending) {
      try {
        s.handoff->lease->begin_read();
        s.handoff->lease->fail("request ended during the hand-off");
      } catch (const Error&) {  // expired meanwhile: its pages are already back
      }
    }
    s.handoff.reset();
  }
  settle_pending_handoff(s);
  unpin_kv(s);
  if (s.session) park_session(s);
  s.kv.reset();
}

void Scheduler::Impl::dispatch(std::unique_ptr<Seq> seq, int loop) {
  loops[size_t(loop)]->push(std::move(seq));
}

void Loop::push(std::unique_ptr<Seq> s) {
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

void Loop::push_all(std::vector<std::unique_ptr<Seq>>& seqs) {
  {
    std::lock_guard<std::mutex> lk(in_mu);
    if (!closed) {
      for (auto& s : seqs) inbox.push_back(std::move(s));
      in_cv.notify_all();
      return;
    }
  }
  for (auto& s : seqs) push(std::move(s));  // the loop has stopped: each ends there
}

void Loop::wake() {
  std::lock_guard<std::mutex> lk(in_mu);
  in_cv.notify_all();
}

void Loop::retire(std::unique_ptr<Seq>& slot, RequestFinish f, ErrorCode ec, std::string msg) {
  Seq& s = *slot;
  index_remove(s.rs->id);
  admission_paused = false;
  if (s.kv && !s.session && sc->opt.prefix_cache_entries > 0 &&
      (f == RequestFinish::kStop || f == RequestFinish::kLength || f == RequestFinish::kStopString)) {
    try {
      park_prefix(s);
    } catch (const std::exception&) {  // not cached: its pages are released below
    }
  }
  sc->release_seq(s);
  sc->finish(&s, s.rs, f, ec, std::move(msg));
  slot.reset();
}

bool Loop::emit(std::unique_ptr<Seq>& slot, int32_t token, std::string_view piece, RequestFinish f) {
  Seq& s = *slot;
  s.rs->log_event(token, piece, false, f);
  const auto& cb = s.rs->req.on_event;
  if (!cb) return true;
  try {
    RequestEvent ev{s.rs->id, token, piece, false, f};
    ev.choice = s.rs->choice;
    if (!s.logprobs.empty() && s.logprobs.back().token == token) ev.logprob = &s.logprobs.back();
    if (cb(ev)) return true;
    retire(slot, RequestFinish::kCancelled);
  } catch (const std::exception& e) {
    retire(slot, RequestFinish::kError, ErrorCode::kInvalidArgument,
           fmt::format("the on_event callback threw: {}", e.what()));
  } catch (...) {
    retire(slot, RequestFinish::kError, ErrorCode::kInvalidArgument, "the on_event callback threw");
  }
  return false;
}

void Loop::after_token(std::unique_ptr<Seq>& slot, const TokenStep& t, Clock::time_point now) {
  Seq& s = *slot;
  if (s.rs->t_first == Clock::time_point{}) {  // the first token
    s.rs->t_first = now;
    s.rs->result.metrics.decode_executor = sc->loops[size_t(s.decode_exec)]->name;
  }
  s.rs->t_last = now;
  if (t.end == GenEnd::kEog) {
    retire(slot, RequestFinish::kStop);
    return;
  }
  s.tokens.push_back(t.id);
  if (t.logprob != nullptr) s.logprobs.push_back(*t.logprob);
  s.rs->result.metrics.generated_tokens = s.gen->n_gen();
  if (t.end == GenEnd::kStopString) {
    // The piece before the stop string goes out with the token, then the terminal event.
    if (emit(slot, t.id, t.piece, RequestFinish::kStopString)) retire(slot, RequestFinish::kStopString);
    return;
  }
  if (!emit(slot, t.id, t.piece, RequestFinish::kLength)) return;
  if (t.end == GenEnd::kLength) {
    retire(slot, RequestFinish::kLength);
    return;
  }
  // Prefill done here, decode elsewhere: the KV moves once.
  if (s.gen->n_gen() == 1 && s.decode_exec != index) hand_off(slot);
}

bool Loop::build_plan() {
  plan.clear();
  int32_t budget = cfg.step_token_budget;
  for (auto& p : running) {  // decodes first
    if (p->pending() == 1 && budget > 0) {
      plan.entries.push_back(StepEntry{p.get(), 1, plan.rows++});
      --budget;
      ++plan.n_decode;
    }
  }
  // Then prefill chunks, tightest SLA class first: the prompts of the tightest class that
  // is prefilling take chunks in admission order up to the budget; looser classes share
  // at most `looser` tokens, oldest admission first, so they still progress while the
  // step stays short for the tighter class's TTFT.
  int tightest = kSlaClassCount;
  for (const auto& p : running) {
    if (p->pending() > 1) tightest = std::min(tightest, int(p->rs->req.sla));
  }
  int32_t looser =
      cfg.looser_class_prefill_tokens < 0 ? std::max(1, cfg.prefill_chunk / 4) : cfg.looser_class_prefill_tokens;
  for (int pass = 0; pass < 2; ++pass) {
    for (auto& p : running) {
      const int32_t pend = p->pending();
      if (pend <= 1 || budget <= 0) continue;
      const bool tight = int(p->rs->req.sla) == tightest;
      if (tight != (pass == 0)) continue;
      const int32_t n = std::min({pend, cfg.prefill_chunk, budget, tight ? budget : looser});
      if (n <= 0) continue;
      plan.entries.push_back(StepEntry{p.get(), n, n == pend ? plan.rows++ : -1});
      budget -= n;
      if (!tight) looser -= n;
      plan.n_prefill += n;
    }
  }
  // The pages the step writes are reserved before it runs (the executor never finds a
  // full tier); when the tier has no room, the youngest sequence makes way.
  for (const StepEntry& e : plan.entries) {
    KvSequence& kv = *e.seq->kv;
    if (!reserve_pages(kv, placement().pages_to_grow(kv, int64_t(kv.n_tokens()) + e.n))) {
      preempt_youngest();
      return false;
    }
  }
  for (const StepEntry& e : plan.entries) {
    Seq& s = *e.seq;
    const int32_t pos0 = s.kv->n_tokens();
    plan.batch.push_back(SequenceStep{s.kv.get(), std::span<const int32_t>(s.tokens.data() + pos0, size_t(e.n)), pos0,
                                      e.row >= 0 ? LogitsRows::kLast : LogitsRows::kNone});
  }
  return !plan.entries.empty();
}

void Loop::fail_plan(ErrorCode ec, const std::string& what) {
  for (const StepEntry& e : plan.entries) {
    for (auto& p : running) {
      if (p.get() == e.seq) {
        sc->log(fmt::format("step error req={} on {}: {}", p->rs->id, name, what));
        retire(p, RequestFinish::kError, ec, what);
      }
    }
  }
  plan.clear();
  std::erase_if(running, [](const auto& q) { return !q; });
}

void Loop::run_plan() {
  try {
    ex->step(plan.batch, std::span<float>(logits.data(), size_t(plan.rows) * size_t(n_vocab)));
    return;
  } catch (const Error&) {
    // Isolate below: one sequence's bad input must not end the others.
  }
  for (size_t i = 0; i < plan.entries.size(); ++i) {
    StepEntry& e = plan.entries[i];
    const SequenceStep& st = plan.batch[i];
    try {
      ex->step(std::span<const SequenceStep>(&st, 1),
               std::span<float>(logits.data() + size_t(std::max(e.row, 0)) * size_t(n_vocab), size_t(n_vocab)));
    } catch (const Error& e2) {
      for (auto& p : running) {
        if (p.get() != e.seq) continue;
        sc->log(fmt::format("step error req={} on {}: {}", p->rs->id, name, e2.what()));
        retire(p, RequestFinish::kError, e2.code(), e2.what());
      }
      e.seq = nullptr;
    }
  }
}

void Loop::sample_plan(Clock::time_point now) {
  for (const StepEntry& e : plan.entries) {
    if (!e.seq || e.row < 0) continue;
    auto slot = std::find_if(running.begin(), running.end(), [&](const auto& p) { return p.get() == e.seq; });
    if (slot == running.end()) continue;
    Seq& s = **slot;
    try {
      const std::span<const float> l(logits.data() + size_t(e.row) * size_t(n_vocab), size_t(n_vocab));
      const TokenStep t = s.gen->next(l, std::span<const int32_t>(s.tokens.data(), size_t(s.kv->n_tokens())));
      after_token(*slot, t, now);
    } catch (const std::exception& ex2) {
      if (*slot) retire(*slot, RequestFinish::kError, code_of(ex2), fmt::format("after the step: {}", ex2.what()));
    }
  }
  plan.clear();
}

void Loop::do_step() {
  if (!build_plan()) return;
  const auto t0 = Clock::now();
  try {
    run_plan();
  } catch (const std::exception& e) {  // not a tandem::Error (e.g. std::bad_alloc): the batch ends
    fail_plan(code_of(e), fmt::format("step on {} failed: {}", name, e.what()));
  }
  const auto t1 = Clock::now();
  const double dt = secs(t0, t1);
  steps.fetch_add(1, std::memory_order_relaxed);
  pf_tokens.fetch_add(uint64_t(plan.n_prefill), std::memory_order_relaxed);
  dec_tokens.fetch_add(uint64_t(plan.n_decode), std::memory_order_relaxed);
  busy_ns.fetch_add(uint64_t(dt * 1e9), std::memory_order_relaxed);
  occupancy_milli.fetch_add(uint64_t(1000.0 * double(running.size()) / double(cfg.max_running)),
                            std::memory_order_relaxed);
  update_speed_signals(prefill_tps, decode_tps, plan.n_prefill, plan.n_decode, dt);
  update_token_rate(token_tps, plan.n_prefill, plan.n_decode, dt);
  sample_plan(t1);
  std::erase_if(running, [](const auto& q) { return !q; });
  publish_running();
}

void Loop::publish_running() noexcept {
  int64_t prompt = 0;
  int32_t decoding = 0;
  for (const auto& p : running) {
    if (!p || !p->kv) continue;
    const int32_t pend = p->pending();
    if (pend > 1) {
      prompt += pend;
    } else {
      ++decoding;
    }
  }
  running_prompt_tokens.store(prompt, std::memory_order_relaxed);
  n_decoding.store(decoding, std::memory_order_relaxed);
  n_running.store(int32_t(running.size()), std::memory_order_relaxed);
}

void Loop::fail_all(const std::string& what) {
  for (auto& s : waiting) {
    unqueue(*s);
    retire(s, RequestFinish::kError, ErrorCode::kInternal, what);
  }
  waiting.clear();
  for (auto& s : running) {
    if (s) retire(s, RequestFinish::kError, ErrorCode::kInternal, what);
  }
  running.clear();
  plan.clear();
  publish_running();
}

void Loop::stop_all() {
  {
    std::lock_guard<std::mutex> lk(in_mu);
    closed = true;
  }
  take_inbox();
  for (auto& s : waiting) {
    unqueue(*s);
    retire(s, RequestFinish::kCancelled, ErrorCode::kOk, "scheduler shut down");
  }
  waiting.clear();
  for (auto& s : running) retire(s, RequestFinish::kCancelled, ErrorCode::kOk, "scheduler shut down");
  running.clear();
  drop_cache();
  cache_only_pages.store(0, std::memory_order_relaxed);
  leases_out.clear();  // dropping a pending lease expires it: its pages return
  publish_running();
}

void Loop::idle_wait() {
  std::unique_lock<std::mutex> lk(in_mu);
  auto woken = [&] { return !inbox.empty() || stop.load() || clear_cache.load(); };
  if (woken()) return;
  // Blocked on KV (or a cancel/deadline to notice): poll gently. Else sleep until a
  // request arrives or an exported lease is due.
  std::optional<Clock::time_point> until = next_lease_deadline();
  if (!waiting.empty()) {
    const auto soon = Clock::now() + std::chrono::milliseconds(5);
    until = until ? std::min(*until, soon) : soon;
  }
  if (until) {
    in_cv.wait_until(lk, *until, woken);
  } else {
    in_cv.wait(lk, woken);
  }
}

void Loop::iterate() {
  take_inbox();
  if (clear_cache.exchange(false)) {
    drop_cache();
    cache_generation.fetch_add(1, std::memory_order_release);
    std::lock_guard<std::mutex> lk(in_mu);
    in_cv.notify_all();
  }
  reap_leases();
  expire(Clock::now());
  admit();
  count_cache_only_pages();  // after this iteration's retirements (last step) and admissions
  if (running.empty()) {
    idle_wait();
    return;
  }
  do_step();
}

void Loop::run() {
  while (!stop.load(std::memory_order_acquire)) {
    try {
      iterate();
    } catch (const std::exception& e) {
      // Outside any one request's step (should not happen): end what this loop holds,
      // keep serving.
      sc->log(fmt::format("loop {} recovered from: {}", name, e.what()));
      fail_all(fmt::format("the {} step loop failed: {}", name, e.what()));
    } catch (...) {
      sc->log(fmt::format("loop {} recovered from a non-standard exception", name));
      fail_all(fmt::format("the {} step loop failed", name));
    }
  }
  stop_all();
}

}  // namespace tandem
