// Admission: the per-loop wait queue (SLA class order, FIFO within a class), deadlines
// and cancellations of waiting and running requests, KV reservations at admission and as
// sequences grow, and preemption when a tier runs out.
//
// Reservation rule: at admission a sequence reserves the pages for its prompt plus
// ExecutorConfig::admission_output_tokens of output (default: all of its clamped
// max_tokens, so it never runs out). Before each step the loop reserves whatever a
// sequence's next tokens still need; when the tier has no room even after dropping the
// prefix cache and evicting parked sessions to File, the youngest running sequence is
// preempted (swapped to File, or its KV dropped and recomputed from its tokens).
#include <fmt/format.h>

#include <algorithm>

#include "sched/scheduler_internal.hpp"

namespace tandem {

using Loop = Scheduler::Impl::Loop;

void Loop::release_reservation(KvSequence& kv) {
  const int32_t r = kv.reservation();
  if (r > 0) {
    kv.adopt_reservation(-r);
    kv.store().unreserve(kv.tier(), r);
  }
}

void Loop::enqueue(std::unique_ptr<Seq> s) {
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

void Loop::take_inbox() {
  {
    std::lock_guard<std::mutex> lk(in_mu);
    incoming.swap(inbox);
  }
  for (auto& s : incoming) enqueue(std::move(s));
  incoming.clear();
}

void Loop::unqueue(Seq& s) {
  sc->queued.fetch_sub(1, std::memory_order_relaxed);
  n_queued.fetch_sub(1, std::memory_order_relaxed);
  queued_tokens.fetch_sub(s.charge, std::memory_order_relaxed);
  s.charge = 0;
}

void Loop::expire(Clock::time_point now) {
  auto check = [&](Seq& s) -> std::optional<RequestFinish> {
    if (s.rs->cancel.load(std::memory_order_acquire)) return RequestFinish::kCancelled;
    if (s.rs->req.deadline && now >= *s.rs->req.deadline) return RequestFinish::kTimeout;
    return std::nullopt;
  };
  for (auto it = waiting.begin(); it != waiting.end();) {
    if (auto f = check(**it)) {
      unqueue(**it);
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

bool Loop::reserve_pages(KvSequence& kv, int32_t need) {
  if (need <= 0) return true;
  auto free_now = [&] { return store->usage(tier).free(); };
  while (free_now() < need && !cache.empty()) drop_cache_entry(0);  // the prefix cache first
  if (!placement().free_pages(tier, need, &kv)) return false;       // parked sessions go to File
  try {
    store->reserve(tier, need);
  } catch (const Error&) {  // another user of the store took the pages meanwhile
    return false;
  }
  kv.adopt_reservation(need);
  return true;
}

bool Loop::attach_kv(Seq& s, Clock::time_point t0) {
  if (s.handoff && !import_handoff(s, t0)) return false;
  if (!s.kv && s.session) {
    std::unique_ptr<KvSequence> skv;
    {
      std::lock_guard<std::mutex> lk(s.session->mu);
      skv = std::move(s.session->kv);
      s.session->tokens.clear();
    }
    s.took_session_kv = true;
    if (skv && &skv->store() != store) {
      if (!move_session_kv(s, skv, t0)) return false;
    } else {
      s.kv = std::move(skv);
    }
  }
  if (s.kv && s.kv->pages_outside(tier) > 0) {
    // Swapped out (File tier): bring it back first, then reserve the rest.
    if (store->usage(tier).free() < s.kv->pages_outside(tier)) return false;
    try {
      placement().make_resident(*s.kv, tier);
    } catch (const Error&) {
      return false;
    }
  }
  return true;
}

bool Loop::try_admit(Seq& s) {
  const auto t0 = Clock::now();
  // 1. The KV: a hand-off to import, a session's KV (maybe on another executor), a
  //    swapped-out KV to bring back, or a fresh sequence (sharing a cached prefix).
  if (!attach_kv(s, t0)) return false;
  int32_t reused = 0;
  bool fresh = false;
  if (!s.kv) {
    s.kv = std::make_unique<KvSequence>(*store, s.n_ctx, tier);
    fresh = true;
    reused = share_cached_prefix(s);
  }
  // 2. Reserve the pages of the prompt and of the output admitted up front.
  const int32_t ahead = cfg.admission_output_tokens;
  // A prefill whose decode is handed to another executor needs room for its first token
  // only here: the output's pages are reserved where it decodes.
  const int64_t remaining = s.decode_exec != index && s.gen->n_gen() == 0 ? 1 : s.max_new - s.gen->n_gen();
  const int64_t to_len = int64_t(s.tokens.size()) + (ahead < 0 ? remaining : std::min<int64_t>(ahead, remaining));
  if (!reserve_pages(*s.kv, placement().pages_to_grow(*s.kv, std::min(to_len, s.final_len())))) {
    if (fresh) s.kv.reset();  // nothing lost: recreated (and the prefix re-shared) next time
    return false;
  }
  pin_kv(s);
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

void Loop::admit() {
  if (running.empty()) admission_paused = false;
  while (!admission_paused && !waiting.empty() && int32_t(running.size()) < cfg.max_running) {
    Seq& s = *waiting.front();
    // A request that can never fit this tier fails instead of blocking the queue (routing
    // avoids such an executor whenever another can hold the request).
    const int64_t final_len = s.final_len();
    if (!can_hold(final_len)) {
      unqueue(s);
      retire(waiting.front(), RequestFinish::kError, ErrorCode::kOutOfMemory,
             fmt::format("{} prompt + {} output tokens need {} KV positions = {} pages of {} tokens; the {} tier "
                         "of {} holds {} pages",
                         s.n_prompt_end, s.max_new, final_len, pages_for(final_len), ps, kv_tier_name(tier), name,
                         capacity_pages()));
      waiting.pop_front();
      continue;
    }
    if (awaits_sibling_prefill(s)) break;  // admitted once its prompt is in the KV (a few steps)
    bool admitted = false;
    try {
      admitted = try_admit(s);
    } catch (const std::exception& e) {  // e.g. no memory for a new sequence: this request ends
      unqueue(s);
      retire(waiting.front(), RequestFinish::kError, ErrorCode::kOutOfMemory,
             fmt::format("admission on {} failed: {}", name, e.what()));
      waiting.pop_front();
      continue;
    }
    if (!admitted) break;  // head of line waits for KV (FIFO within a class)
    unqueue(s);
    running.push_back(std::move(waiting.front()));
    waiting.pop_front();
  }
  publish_running();
}

void Loop::preempt_youngest() {
  if (running.empty()) return;
  auto it = std::max_element(running.begin(), running.end(),
                             [](const auto& a, const auto& b) { return a->order < b->order; });
  std::unique_ptr<Seq> s = std::move(*it);
  running.erase(it);
  ++s->rs->result.metrics.preemptions;
  sc->preemptions.fetch_add(1, std::memory_order_relaxed);
  index_remove(s->rs->id);
  unpin_kv(*s);
  const bool swapped = s->kv && placement().spill(*s->kv);
  if (!swapped) s->kv.reset();  // recomputed from its tokens on readmission
  sc->log(fmt::format("preempt req={} on {}: {}", s->rs->id, name, swapped ? "swapped to file" : "KV dropped"));
  sc->queued.fetch_add(1, std::memory_order_relaxed);
  n_queued.fetch_add(1, std::memory_order_relaxed);
  s->charge = s->pending();
  queued_tokens.fetch_add(s->charge, std::memory_order_relaxed);
  waiting.push_front(std::move(s));
  admission_paused = true;
  publish_running();
}

}  // namespace tandem
