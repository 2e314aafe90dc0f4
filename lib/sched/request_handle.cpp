// RequestState's event log, RequestHandle, and the one terminal event of a request.
#include <algorithm>

#include "sched/scheduler_internal.hpp"

namespace tandem {

void RequestState::init_log(size_t n_events, size_t text_bytes) {
  slot_cap = n_events;
  slots = std::make_unique<Slot[]>(n_events);
  text_cap = text_bytes;
  text_buf = std::make_unique<char[]>(text_bytes);
  text_used = 0;
}

void RequestState::log_event(int32_t token, std::string_view text, bool final, RequestFinish f) {
  const size_t n = n_slots.load(std::memory_order_relaxed);
  if (n >= slot_cap) return;  // cannot happen: sized for the clamped output + 2
  const size_t len = std::min(text.size(), text_cap - text_used);
  std::copy_n(text.data(), len, text_buf.get() + text_used);
  slots[n] = Slot{token, final, f, uint32_t(text_used), uint32_t(len)};
  text_used += len;
  n_slots.store(n + 1, std::memory_order_release);
}

uint64_t RequestHandle::id() const noexcept {
  return s_ ? s_->id : 0;
}
bool RequestHandle::done() const noexcept {
  return s_ && s_->done.load(std::memory_order_acquire);
}

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

namespace {

/// The result's text and tokens from the sequence; returns the part not yet streamed.
std::string_view fill_result(Seq& seq, RequestResult& r, RequestFinish f) {
  if (!seq.gen) return {};
  Generation& g = *seq.gen;
  try {
    if (f == RequestFinish::kStop || f == RequestFinish::kLength) g.flush_utf8();
    if (f != RequestFinish::kStop && f != RequestFinish::kLength && f != RequestFinish::kStopString) {
      g.cut_to_emitted();  // only what was streamed
    }
    r.tokens.assign(seq.tokens.begin() + seq.n_prompt_end, seq.tokens.end());
    r.logprobs = std::move(seq.logprobs);
    r.logprobs.resize(std::min(r.logprobs.size(), r.tokens.size()));
    r.text = g.text();
  } catch (...) {  // no memory for the result: it ends with what was streamed
    r.tokens.clear();
    r.logprobs.clear();
    r.text.clear();
  }
  r.metrics.generated_tokens = g.n_gen();
  const size_t unsent = g.take_unsent().size();
  return std::string_view(r.text).substr(r.text.size() - std::min(unsent, r.text.size()));
}

}  // namespace

void Scheduler::Impl::finish(Seq* seq, const std::shared_ptr<RequestState>& rs, RequestFinish f, ErrorCode ec,
                             std::string message) noexcept {
  if (rs->terminal.exchange(true)) return;  // exactly once
  const auto now = Clock::now();
  RequestResult& r = rs->result;
  r.id = rs->id;
  r.finish = f;
  r.error = ec;
  r.message = std::move(message);
  const std::string_view tail = seq ? fill_result(*seq, r, f) : std::string_view();
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
    ev.choice = rs->choice;
    ev.text = tail;
    ev.final = true;
    ev.finish = f;
    try {
      rs->req.on_event(ev);
    } catch (...) {  // the request has ended either way; the callback's failure is its own
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

}  // namespace tandem
