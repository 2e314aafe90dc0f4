// The public Scheduler: construction (one loop per executor), submit (validation, size
// clamps, routing), cancel, drain, shutdown, metrics. See include/tandem/sched/scheduler.hpp for
// the contract and lib/sched/scheduler_internal.hpp for where each part lives.
#include "tandem/sched/scheduler.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "sched/scheduler_internal.hpp"

namespace tandem {

namespace {

void check_executor(const ExecutorConfig& c, size_t i, const ExecutorConfig& first) {
  if (!c.executor || !c.store) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("scheduler: executor {} has no executor or no store", i));
  }
  if (!c.store->has_tier(c.executor->kv_tier())) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("scheduler: executor {}'s store has no {} tier", i, kv_tier_name(c.executor->kv_tier())));
  }
  if (c.max_running < 1 || c.step_token_budget < c.max_running || c.prefill_chunk < 1 ||
      c.admission_output_tokens < -1 || c.looser_class_prefill_tokens < -1) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("scheduler: executor {}: max_running {} >= 1, step_token_budget {} >= max_running, "
                            "prefill_chunk {} >= 1, admission_output_tokens {} >= -1, looser_class_prefill_tokens {} "
                            ">= -1 needed",
                            i, c.max_running, c.step_token_budget, c.prefill_chunk, c.admission_output_tokens,
                            c.looser_class_prefill_tokens));
  }
  if (i > 0 && c.executor->model().identity_hash() != first.executor->model().identity_hash()) {
    throw Error(ErrorCode::kInvalidArgument, "scheduler: the executors run different models");
  }
}

/// Longest token text, for sizing a request's streamed-text log.
size_t max_piece_bytes(const Tokenizer& tok) {
  size_t mx = 1;
  for (int32_t id = 0; id < tok.n_vocab(); ++id) mx = std::max(mx, tok.token_text(id).size());
  return 3 * (mx + 4);
}

}  // namespace

Scheduler::Scheduler(SchedulerOptions options) : impl_(std::make_unique<Impl>()) {
  Impl& I = *impl_;
  I.opt = std::move(options);
  if (I.opt.executors.empty()) throw Error(ErrorCode::kInvalidArgument, "scheduler: no executors");
  for (size_t i = 0; i < I.opt.executors.size(); ++i) check_executor(I.opt.executors[i], i, I.opt.executors[0]);
  I.model = I.opt.executors[0].executor->model_ptr();
  I.policy = I.opt.policy ? I.opt.policy : std::make_shared<DefaultRoutingPolicy>();
  const HParams& hp = I.model->hparams();
  I.n_ctx = resolve_context_size(I.opt.max_context, hp, "scheduler", "max_context");
  I.max_piece = max_piece_bytes(I.model->tokenizer());
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
    L->plan.entries.reserve(size_t(L->cfg.max_running));
    L->plan.batch.reserve(size_t(L->cfg.max_running));
    I.loops.push_back(std::move(L));
  }
  for (auto& L : I.loops) L->thread = std::thread([l = L.get()] { l->run(); });
}

Scheduler::~Scheduler() {
  shutdown();
}

int Scheduler::executor_count() const noexcept {
  return int(impl_->loops.size());
}

int Scheduler::Impl::route(Seq& seq) {
  const Request& q = seq.rs->req;
  std::lock_guard<std::mutex> lk(route_mu);
  std::vector<ExecutorView> views;
  views.reserve(loops.size());
  const int32_t ps = loops[0]->ps;
  boundary_hashes(std::span<const int32_t>(seq.tokens.data(), size_t(seq.n_prompt_end)), ps, seq.prefix_hashes);
  // Only executors that can hold the whole request are offered (all of them when none can:
  // admission then refuses it with the page count).
  const bool any_fits =
      std::any_of(loops.begin(), loops.end(), [&](const auto& L) { return L->can_hold(seq.final_len()); });
  for (const auto& L : loops) {
    if (any_fits && !L->can_hold(seq.final_len())) continue;
    ExecutorView v;
    v.index = L->index;
    v.name = L->name;
    v.accelerator = L->accelerator;
    v.prefill_tps = L->prefill_tps.load(std::memory_order_relaxed);
    v.decode_tps = L->decode_tps.load(std::memory_order_relaxed);
    v.queued = L->n_queued.load(std::memory_order_relaxed) + L->handoffs_pending.load(std::memory_order_relaxed);
    v.queued_tokens = std::max<int64_t>(0, L->queued_tokens.load(std::memory_order_relaxed));
    v.running = L->n_running.load(std::memory_order_relaxed);
    v.running_prompt_tokens = L->running_prompt_tokens.load(std::memory_order_relaxed);
    v.decoding = L->n_decoding.load(std::memory_order_relaxed) + L->handoffs_pending.load(std::memory_order_relaxed);
    v.token_tps = L->token_tps.load(std::memory_order_relaxed);
    v.prefill_chunk = L->cfg.prefill_chunk;
    v.max_running = L->cfg.max_running;
    v.kv_free_pages = L->store->usage(L->tier).free();
    v.page_size = L->ps;
    v.prefix_tokens = L->ps == ps ? L->prefix_tokens_for(seq.prefix_hashes) : 0;
    if (L->cfg.tpot_estimate_s) {
      const int32_t batch = std::min(v.max_running, std::max(0, v.running) + std::max(0, v.queued) + 1);
      v.model_tpot_s = L->cfg.tpot_estimate_s(batch, seq.final_len());
    }
    views.push_back(v);
  }
  RouteInput in;
  in.sla = q.sla;
  in.prompt_tokens = seq.n_prompt_end;
  in.max_tokens = seq.max_new;
  if (q.deadline) in.deadline_s = std::max(0.0, secs(Clock::now(), *q.deadline));
  if (seq.session) {
    std::lock_guard<std::mutex> lk2(seq.session->mu);
    in.session_executor = seq.session->kv ? seq.session->executor : -1;
  }
  RouteDecision d = policy->route(in, views);
  auto offered = [&](int i) {
    return std::any_of(views.begin(), views.end(), [&](const ExecutorView& v) { return v.index == i; });
  };
  if (!offered(d.prefill)) d.prefill = views.front().index;
  if (!offered(d.decode)) d.decode = d.prefill;
  place(seq, d.prefill, d.decode, std::move(d.reason));
  return d.prefill;
}

int Scheduler::Impl::route_like(Seq& seq, const Seq& like) {
  std::lock_guard<std::mutex> lk(route_mu);
  seq.prefix_hashes = like.prefix_hashes;
  place(seq, like.prefill_exec, like.decode_exec, like.rs->result.route);
  return like.prefill_exec;
}

void Scheduler::Impl::place(Seq& seq, int prefill, int decode, std::string reason) {
  seq.prefill_exec = prefill;
  seq.decode_exec = decode;
  if (decode != prefill) {  // counted on its decode loop until the hand-off arrives
    loops[size_t(decode)]->handoffs_pending.fetch_add(1, std::memory_order_relaxed);
    seq.handoff_pending_at = decode;
  }
  seq.rs->result.route = std::move(reason);
  log(fmt::format("route req={} {}", seq.rs->id, seq.rs->result.route));
  auto& L = *loops[size_t(prefill)];
  L.n_queued.fetch_add(1, std::memory_order_relaxed);
  seq.charge = seq.n_prompt_end - seq.n_history;
  L.queued_tokens.fetch_add(seq.charge, std::memory_order_relaxed);
}

namespace {

/// The validated prompt and clamped output of a request (throws Error for a bad one).
void prepare(Seq& seq, const Request& q, const Model& model, int32_t n_ctx) {
  if (q.max_tokens < 1)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("max_tokens {} must be >= 1", q.max_tokens));
  const int32_t n_vocab = model.hparams().n_vocab;
  seq.gen.emplace(model.tokenizer());
  seq.n_history = int32_t(seq.tokens.size());
  std::vector<int32_t> tokenized;
  if (q.prompt_ids.empty() && !q.prompt_text.empty()) {
    tokenized = model.tokenizer().tokenize(q.prompt_text, seq.tokens.empty(), q.parse_special);
  }
  const std::span<const int32_t> prompt = q.prompt_ids.empty() ? std::span<const int32_t>(tokenized) : q.prompt_ids;
  if (prompt.empty() && seq.tokens.empty()) throw Error(ErrorCode::kInvalidArgument, "empty prompt");
  for (int32_t id : prompt) {
    if (id < 0 || id >= n_vocab) {
      throw Error(ErrorCode::kInvalidArgument, fmt::format("prompt token id {} is outside the vocabulary", id));
    }
  }
  const int64_t total = int64_t(seq.tokens.size()) + int64_t(prompt.size());
  if (total > n_ctx) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("context overflow: {} positions needed, n_ctx is {}", total, n_ctx));
  }
  seq.max_new = clamp_output_tokens(q.max_tokens, total, n_ctx);
  seq.gen->begin(q.sampling, n_vocab, q.stop, q.ignore_eos, seq.max_new, q.logprobs, q.grammar);
  if (q.logprobs >= 0) seq.logprobs.reserve(size_t(seq.max_new));
  seq.tokens.reserve(size_t(total + seq.max_new));
  seq.tokens.insert(seq.tokens.end(), prompt.begin(), prompt.end());
  seq.n_prompt_end = int32_t(seq.tokens.size());
}

/// A request's state before it is queued: its id, submission time and a poll log with room
/// for a refusal's terminal event.
std::shared_ptr<RequestState> new_request_state(Scheduler::Impl& I, Request request) {
  auto rs = std::make_shared<RequestState>();
  rs->id = I.next_id.fetch_add(1);
  rs->t_submit = Clock::now();
  rs->req = std::move(request);
  rs->init_log(1, 0);  // resized once the output is known
  I.submitted.fetch_add(1, std::memory_order_relaxed);
  I.outstanding.fetch_add(1);
  return rs;
}

/// The sequence of a validated request (its poll log sized for its output); throws Error
/// for a bad request, after parking a session it took.
std::unique_ptr<Seq> new_seq(Scheduler::Impl& I, const std::shared_ptr<RequestState>& rs) {
  const Request& q = rs->req;
  auto seq = std::make_unique<Seq>();
  seq->rs = rs;
  seq->n_ctx = I.n_ctx;
  try {
    if (q.session != 0) seq->session = I.take_session(q.session, seq->tokens);
    prepare(*seq, q, *I.model, I.n_ctx);
    size_t stop_bytes = 0;
    for (const auto& s : q.stop) stop_bytes += s.size();
    const size_t n_events = size_t(seq->max_new) + 2;
    rs->init_log(n_events, n_events * I.max_piece + stop_bytes);
  } catch (...) {
    if (seq->session) I.park_session(*seq);
    throw;
  }
  return seq;
}

ErrorCode error_code_of(const std::exception& e) {
  const auto* te = dynamic_cast<const Error*>(&e);
  return te ? te->code() : ErrorCode::kOutOfMemory;
}

}  // namespace

RequestHandle Scheduler::submit(Request request) {
  Impl& I = *impl_;
  if (I.stopped.load()) throw Error(ErrorCode::kInvalidArgument, "scheduler: submit after shutdown");
  auto rs = new_request_state(I, std::move(request));
  RequestHandle h(rs);
  auto refuse = [&](RequestFinish f, ErrorCode ec, std::string msg) {
    I.finish(nullptr, rs, f, ec, std::move(msg));
    return h;
  };
  if (!I.accepting.load()) return refuse(RequestFinish::kOverloaded, ErrorCode::kOk, "scheduler is draining");
  std::unique_ptr<Seq> seq;
  try {
    seq = new_seq(I, rs);
  } catch (const std::exception& e) {
    return refuse(RequestFinish::kError, error_code_of(e), e.what());
  }
  // Back-pressure: a bounded queue.
  if (I.queued.fetch_add(1) >= I.opt.max_queued) {
    I.queued.fetch_sub(1);
    I.release_seq(*seq);
    return refuse(RequestFinish::kOverloaded, ErrorCode::kOk,
                  fmt::format("overloaded: {} requests already waiting", I.opt.max_queued));
  }
  const int target = I.route(*seq);
  I.dispatch(std::move(seq), target);
  return h;
}

std::vector<RequestHandle> Scheduler::submit_n(Request request, int32_t n) {
  if (n == 1) return {submit(std::move(request))};
  Impl& I = *impl_;
  if (I.stopped.load()) throw Error(ErrorCode::kInvalidArgument, "scheduler: submit after shutdown");
  std::vector<RequestHandle> handles;
  std::vector<std::shared_ptr<RequestState>> states;
  auto refuse_all = [&](RequestFinish f, ErrorCode ec, const std::string& msg) {
    for (auto& rs : states) I.finish(nullptr, rs, f, ec, msg);
    return handles;
  };
  if (n < 1 || n > kMaxChoices || request.session != 0) {
    states.push_back(new_request_state(I, std::move(request)));
    handles.emplace_back(states.back());
    return refuse_all(RequestFinish::kError, ErrorCode::kInvalidArgument,
                      n < 1 || n > kMaxChoices ? fmt::format("n {} must be in [1, {}]", n, kMaxChoices)
                                               : std::string("n > 1 cannot continue a session"));
  }
  const uint64_t seed = request.sampling.seed;
  for (int32_t i = 0; i < n; ++i) {
    // NOLINTNEXTLINE(bugprone-use-after-move): moved on the last pass only
    Request q = i + 1 < n ? request : std::move(request);
    q.sampling.seed = seed + uint64_t(i);
    states.push_back(new_request_state(I, std::move(q)));
    states.back()->choice = i;
    handles.emplace_back(states.back());
  }
  if (!I.accepting.load()) return refuse_all(RequestFinish::kOverloaded, ErrorCode::kOk, "scheduler is draining");
  std::vector<std::unique_ptr<Seq>> seqs;
  try {
    for (const auto& rs : states) seqs.push_back(new_seq(I, rs));
  } catch (const std::exception& e) {
    return refuse_all(RequestFinish::kError, error_code_of(e), e.what());
  }
  if (n > I.opt.max_queued) {  // could never be queued at once: not a transient overload
    for (auto& s : seqs) I.release_seq(*s);
    return refuse_all(
        RequestFinish::kError, ErrorCode::kInvalidArgument,
        fmt::format("n {} exceeds the scheduler's queue of {} requests (max_queued)", n, I.opt.max_queued));
  }
  if (I.queued.fetch_add(n) + n > I.opt.max_queued) {
    I.queued.fetch_sub(n);
    for (auto& s : seqs) I.release_seq(*s);
    return refuse_all(RequestFinish::kOverloaded, ErrorCode::kOk,
                      fmt::format("overloaded: {} requests already waiting", I.opt.max_queued));
  }
  const uint64_t group = states.front()->id;
  for (auto& s : seqs) s->group = group;
  const int target = I.route(*seqs.front());
  // Every choice decodes where the prompt was computed: a hand-off would move each choice's
  // KV on its own, the shared prompt pages copied n times.
  Seq& first = *seqs.front();
  I.settle_pending_handoff(first);
  first.decode_exec = first.prefill_exec;
  for (size_t i = 1; i < seqs.size(); ++i) I.route_like(*seqs[i], first);
  I.loops[size_t(target)]->push_all(seqs);
  return handles;
}

void Scheduler::cancel(const RequestHandle& handle) noexcept {
  if (!handle.valid()) return;
  handle.state()->cancel.store(true, std::memory_order_release);
  for (auto& L : impl_->loops) L->wake();
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
    e.kv_cache_only_pages = L->cache_only_pages.load(std::memory_order_relaxed);
    m.executors.push_back(std::move(e));
  }
  return m;
}

}  // namespace tandem
