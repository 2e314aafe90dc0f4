// The session registry: a session's KV stays parked (unpinned, unreserved, swappable down
// the tiers) between its requests; one request runs on a session at a time. Idle sessions
// save to and restore from session files (the format and code of Session::save).
#include <fmt/format.h>

#include "sched/scheduler_internal.hpp"
#include "session/session_file.hpp"

namespace tandem {

std::shared_ptr<SessionRec> Scheduler::Impl::take_session(uint64_t id, std::vector<int32_t>& tokens) {
  std::shared_ptr<SessionRec> rec;
  {
    std::lock_guard<std::mutex> lk(sessions_mu);
    auto it = sessions.find(id);
    if (it == sessions.end()) throw Error(ErrorCode::kInvalidArgument, fmt::format("no session {}", id));
    rec = it->second;
  }
  std::lock_guard<std::mutex> lk(rec->mu);
  if (rec->busy || rec->closed) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("session {} is busy or closed", id));
  }
  tokens = rec->tokens;
  rec->busy = true;
  return rec;
}

void Scheduler::Impl::park_session(Seq& s) noexcept {
  std::shared_ptr<SessionRec> rec = std::move(s.session);
  std::lock_guard<std::mutex> lk(rec->mu);
  try {
    if (rec->closed) {
      // closed meanwhile: the KV is released with the sequence
    } else if (s.kv) {
      const int32_t r = s.kv->reservation();
      if (r > 0) {
        s.kv->adopt_reservation(-r);
        s.kv->store().unreserve(s.kv->tier(), r);
      }
      rec->tokens = s.tokens;  // the KV holds [0, kv->n_tokens()); further tokens are pending
      rec->kv = std::move(s.kv);
      rec->executor = s.kv_loop;
    } else if (s.took_session_kv) {
      // The KV was lost (dropped for recompute, or the hand-off failed): the session
      // keeps its history and recomputes on its next use.
      rec->tokens = s.tokens;
    }
  } catch (...) {  // no memory to copy the history: the session starts over
    rec->tokens.clear();
    rec->kv.reset();
  }
  rec->busy = false;
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
  // A running request still holds the KV; it is released when that request ends.
  if (!s->busy) s->kv.reset();
}

namespace {

std::shared_ptr<SessionRec> find_session(Scheduler::Impl& I, uint64_t id) {
  std::lock_guard<std::mutex> lk(I.sessions_mu);
  auto it = I.sessions.find(id);
  if (it == I.sessions.end()) throw Error(ErrorCode::kInvalidArgument, fmt::format("no session {}", id));
  return it->second;
}

}  // namespace

Scheduler::SessionInfo Scheduler::session_info(uint64_t id) const {
  std::shared_ptr<SessionRec> rec = find_session(*impl_, id);
  std::lock_guard<std::mutex> lk(rec->mu);
  if (rec->closed) throw Error(ErrorCode::kInvalidArgument, fmt::format("session {} is closed", id));
  SessionInfo info;
  info.id = id;
  info.busy = rec->busy;
  info.n_tokens = static_cast<int32_t>(rec->tokens.size());
  if (rec->kv && !rec->busy) {  // while busy the KV is (or is about to be) the request's
    info.executor = rec->executor;
    info.kv_tokens = rec->kv->n_tokens();
    for (PageId p : rec->kv->held_page_ids()) ++info.pages[int(rec->kv->store().tier_of(p))];
  }
  return info;
}

namespace {

// Moves an idle session's KV under its lock with `move(rec, loop)`, which returns what it
// moved: false (nothing moved) while a request runs on the session, an error when the
// session is closed. The session's KV is parked (owned by its SessionRec, unpinned): no
// step reads its exclusive pages, and a request that takes it does so under rec->mu.
template <class Move>
bool move_idle_session(Scheduler::Impl& I, uint64_t id, KvMoveStats* stats, Move&& move) {
  std::shared_ptr<SessionRec> rec = find_session(I, id);
  std::lock_guard<std::mutex> lk(rec->mu);
  if (rec->closed) throw Error(ErrorCode::kInvalidArgument, fmt::format("session {} is closed", id));
  if (rec->busy) return false;
  KvMoveStats st;
  if (rec->kv) st = move(*rec, *I.loops[size_t(rec->executor)]);
  if (stats != nullptr) *stats = st;
  return true;
}

}  // namespace

bool Scheduler::park_session(uint64_t id, KvMoveStats* stats) {
  return move_idle_session(*impl_, id, stats, [&](SessionRec& rec, const auto& loop) {
    if (!rec.kv->store().has_tier(KvTier::kFile)) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("session {}: the KV store of executor {} has no File tier to park it in", id, loop.name));
    }
    const KvMoveStats st = KvPlacement(rec.kv->store()).park(*rec.kv);
    impl_->log(fmt::format("session {} parked to file: {} pages, {:.4f}s", id, st.pages, st.seconds));
    return st;
  });
}

bool Scheduler::unpark_session(uint64_t id, KvMoveStats* stats) {
  return move_idle_session(*impl_, id, stats, [&](SessionRec& rec, const auto& loop) {
    const KvMoveStats st = KvPlacement(rec.kv->store()).unpark(*rec.kv, loop.tier);
    impl_->log(
        fmt::format("session {} unparked to {}: {} pages, {:.4f}s", id, kv_tier_name(loop.tier), st.pages, st.seconds));
    return st;
  });
}

bool Scheduler::save_session(uint64_t id, const std::filesystem::path& path) {
  std::shared_ptr<SessionRec> rec = find_session(*impl_, id);
  std::lock_guard<std::mutex> lk(rec->mu);
  if (rec->closed) throw Error(ErrorCode::kInvalidArgument, fmt::format("session {} is closed", id));
  if (rec->busy) return false;
  const int32_t kv_tokens = rec->kv ? rec->kv->n_tokens() : 0;
  const auto n = static_cast<int32_t>(rec->tokens.size());
  if (n < kv_tokens) {
    throw Error(ErrorCode::kInternal,
                fmt::format("session {}: its KV holds {} positions for {} tokens", id, kv_tokens, n));
  }
  if (n > kv_tokens + 1) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("session {}: {} of its {} tokens are not in its KV yet (a request stopped before "
                            "evaluating them, or its KV was dropped); its next request evaluates them",
                            id, n - kv_tokens, n));
  }
  const std::span<const int32_t> evaluated(rec->tokens.data(), size_t(kv_tokens));
  const int32_t pending = n > kv_tokens ? rec->tokens.back() : -1;
  if (rec->kv) {
    const KvPin pin(*rec->kv);  // not evicted while its pages are read
    session_file_write(path, *rec->kv, *impl_->model, evaluated, pending, {}, nullptr);
  } else {  // no KV (never ran, or nothing evaluated): an empty one in any store says so
    const Impl::Loop& loop = *impl_->loops.front();
    const KvSequence empty(*loop.store, impl_->n_ctx, loop.tier);
    session_file_write(path, empty, *impl_->model, evaluated, pending, {}, nullptr);
  }
  impl_->log(fmt::format("session {} saved to '{}': {} tokens", id, path.string(), n));
  return true;
}

uint64_t Scheduler::restore_session(const std::filesystem::path& path, int executor) {
  if (executor < 0 || size_t(executor) >= impl_->loops.size()) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("restore_session: executor {} is outside [0, {})", executor, impl_->loops.size()));
  }
  const Impl::Loop& loop = *impl_->loops[size_t(executor)];
  SessionFile f(path, *impl_->model, impl_->n_ctx);
  const KvTier landing[2] = {loop.tier, KvTier::kFile};
  const KvTier tier = KvPlacement(*loop.store)
                          .import_tier(landing, int32_t(loop.store->layout().pages_holding(f.descriptor().token_end)));
  auto rec = std::make_shared<SessionRec>();
  rec->kv = f.import_kv(*loop.store, tier, impl_->n_ctx);
  rec->executor = executor;
  rec->tokens = f.take_tokens();
  if (f.pending()) rec->tokens.push_back(*f.pending());
  rec->id = impl_->next_session.fetch_add(1);
  impl_->log(fmt::format("session {} restored from '{}' on {}: {} tokens, {} pages in {}", rec->id, path.string(),
                         loop.name, rec->tokens.size(), rec->kv->held_pages(), kv_tier_name(tier)));
  std::lock_guard<std::mutex> lk(impl_->sessions_mu);
  impl_->sessions[rec->id] = rec;
  return rec->id;
}

}  // namespace tandem
