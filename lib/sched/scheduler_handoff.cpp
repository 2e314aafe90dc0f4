// KV hand-offs between loops. The prefill loop exports a sequence's KV under a lease
// (kv_export) after its first token and sends the sequence to the decode loop, which
// imports it (kv_import: verified; the KV moves once). The exporting loop keeps the lease
// until the receiver settles it and reaps it at its deadline, so an expired hand-off
// returns its pages when it expires even while the receiver is busy. A session's KV on
// another executor (an SLA upgrade) moves the same way, in one call.
#include <fmt/format.h>

#include <algorithm>

#include "sched/scheduler_internal.hpp"

namespace tandem {

using Loop = Scheduler::Impl::Loop;

namespace {

void record_move(Seq& s, const KvDescriptor& d, Clock::time_point t0) {
  auto& m = s.rs->result.metrics;
  ++m.migrations;
  m.migration_bytes += d.payload_bytes();
  m.migration_s += secs(t0, Clock::now());
}

}  // namespace

bool Loop::import_handoff(Seq& s, Clock::time_point t0) {
  const auto need = int32_t(store->layout().pages_holding(s.handoff->descriptor.token_end));
  if (store->usage(tier).free() < need + 1) return false;
  try {
    KvHandoff h = *s.handoff;
    const int32_t nt = h.descriptor.token_end;
    s.kv = kv_import(std::span<const KvHandoff>(&h, 1), *sc->model, *store, tier, s.n_ctx,
                     std::span<const int32_t>(s.tokens.data(), size_t(nt)));
    record_move(s, h.descriptor, t0);
    sc->log(fmt::format("handoff req={} {} -> {}: {} pages, {} bytes, {:.4f}s", s.rs->id,
                        sc->loops[size_t(s.handoff_src)]->name, name, need, h.descriptor.payload_bytes(),
                        secs(t0, Clock::now())));
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kOutOfMemory) return false;
    // The lease expired or the import was refused: recompute here (same tokens).
    sc->log(fmt::format("handoff req={} failed ({}); recomputing on {}", s.rs->id, e.what(), name));
    s.kv.reset();
  }
  s.handoff.reset();
  return true;
}

bool Loop::move_session_kv(Seq& s, std::unique_ptr<KvSequence>& skv, Clock::time_point t0) {
  auto give_back = [&] {
    std::lock_guard<std::mutex> lk(s.session->mu);
    s.session->kv = std::move(skv);
    s.session->tokens = s.tokens;
    s.took_session_kv = false;
    return false;
  };
  const auto need = int32_t(store->layout().pages_holding(skv->n_tokens()));
  if (store->usage(tier).free() < need + 1) return give_back();
  try {
    const KvPin pin(*skv);  // not evicted while it is read
    const std::span<const int32_t> toks(s.tokens.data(), size_t(skv->n_tokens()));
    KvHandoff h = kv_export(*skv, *sc->model, toks, sc->opt.handoff_ttl);
    s.kv = kv_import(std::span<const KvHandoff>(&h, 1), *sc->model, *store, tier, s.n_ctx, toks);
    record_move(s, h.descriptor, t0);
    sc->log(fmt::format("session {} migrates to {}: {} pages, {:.4f}s", s.session->id, name, h.descriptor.n_pages(),
                        secs(t0, Clock::now())));
  } catch (const Error& e) {
    if (e.code() == ErrorCode::kOutOfMemory) return give_back();
    sc->log(fmt::format("session {} migration failed ({}); recomputing", s.session->id, e.what()));
  }
  skv.reset();  // the old pages go once the import is confirmed
  return true;
}

bool Loop::hand_off(std::unique_ptr<Seq>& slot) {
  Seq& s = *slot;
  index_remove(s.rs->id);
  try {
    release_reservation(*s.kv);
    s.handoff = kv_export(*s.kv, *sc->model, std::span<const int32_t>(s.tokens.data(), size_t(s.kv->n_tokens())),
                          sc->opt.handoff_ttl);
    leases_out.emplace_back(Clock::now() + sc->opt.handoff_ttl, s.handoff->lease);
  } catch (const Error& e) {
    s.handoff.reset();
    sc->log(fmt::format("handoff req={} export failed ({}); decoding on {}", s.rs->id, e.what(), name));
    sc->settle_pending_handoff(s);
    s.decode_exec = index;
    s.rs->result.metrics.decode_executor = name;
    return false;
  }
  s.handoff_src = index;
  unpin_kv(s);
  s.kv.reset();  // the lease holds the pages until the receiver confirms
  auto& dst = *sc->loops[size_t(s.decode_exec)];
  sc->queued.fetch_add(1, std::memory_order_relaxed);
  dst.n_queued.fetch_add(1, std::memory_order_relaxed);  // before the pending count drops: never uncounted
  sc->settle_pending_handoff(s);
  dst.push(std::move(slot));
  return true;
}

void Scheduler::Impl::settle_pending_handoff(Seq& s) noexcept {
  if (s.handoff_pending_at < 0) return;
  loops[size_t(s.handoff_pending_at)]->handoffs_pending.fetch_sub(1, std::memory_order_relaxed);
  s.handoff_pending_at = -1;
}

void Loop::reap_leases() {
  // state() settles a lease past its deadline (its pages return to the store).
  std::erase_if(leases_out, [](auto& l) { return l.second->state() != KvLeaseState::kPending; });
}

std::optional<Clock::time_point> Loop::next_lease_deadline() const {
  std::optional<Clock::time_point> t;
  for (const auto& l : leases_out) {
    if (!t || l.first < *t) t = l.first;
  }
  return t;
}

}  // namespace tandem
