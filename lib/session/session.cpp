#include "tandem/session/session.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "session/generation.hpp"
#include "tandem/kv/kv_contract.hpp"
#include "tandem/node/node.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

namespace tandem {

std::string_view finish_reason_name(FinishReason r) noexcept {
  switch (r) {
    case FinishReason::kStop:
      return "stop";
    case FinishReason::kStopString:
      return "stop_string";
    case FinishReason::kLength:
      return "length";
    case FinishReason::kCancelled:
      return "cancelled";
  }
  return "?";
}

namespace {

int32_t resolve_n_ctx(const HParams& hp, const SessionOptions& o) {
  const int32_t n_ctx = resolve_context_size(o.n_ctx, hp, "session", "n_ctx");
  if (o.n_batch < 1)
    throw Error(ErrorCode::kInvalidArgument, fmt::format("session: n_batch {} must be >= 1", o.n_batch));
  if (o.page_size < 1) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("session: page_size {} must be >= 1", o.page_size));
  }
  return n_ctx;
}

// The tier an own store puts pages in: the executor's Device tier when it offers one
// and the options ask for Host (the default) or Device, else the options' tier.
bool own_device_store(const SessionOptions& o, const Executor& ex) {
  return !o.kv_store && o.kv_tier != KvTier::kFile && ex.kv_tier() == KvTier::kDevice;
}

std::shared_ptr<KvStore> own_store(const HParams& hp, const SessionOptions& o, int32_t n_ctx, const Executor& ex) {
  if (o.kv_store) return o.kv_store;
  KvStoreOptions so;
  so.layout = KvLayout::for_model(hp, o.page_size, o.kv_dtype);
  // The node's page rule for one decode slot (tandem/node/node.hpp).
  const int32_t pages = compute_tier_pages(so.layout, n_ctx, o.n_batch, 1, 0);
  if (own_device_store(o, ex)) {
    so.device = ex.make_kv_device_backend(so.layout, pages);
    if (so.device) return std::make_shared<KvStore>(std::move(so));
  }
  if (o.kv_tier == KvTier::kDevice) {
    throw Error(ErrorCode::kInvalidArgument,
                "session: a Device-tier session needs an executor with a Device tier or a store from one");
  }
  (o.kv_tier == KvTier::kHost ? so.host_pages : so.file_pages) = pages;
  so.file_dir = o.kv_dir;
  so.file_chunk_pages = std::min(pages, 256);
  return std::make_shared<KvStore>(std::move(so));
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

Session::Session(std::shared_ptr<const Model> model, Executor& executor, const SessionOptions& options)
    : model_(std::move(model)),
      executor_(&executor),
      options_(options),
      n_ctx_(resolve_n_ctx(model_->hparams(), options)),
      store_(own_store(model_->hparams(), options, n_ctx_, executor)),
      kv_(std::make_unique<KvSequence>(
          *store_, n_ctx_, options.kv_store || !store_->has_tier(KvTier::kDevice) ? options.kv_tier : KvTier::kDevice)),
      logits_(size_t(model_->hparams().n_vocab)),
      rng_(options.seed),
      gen_(std::make_unique<Generation>(model_->tokenizer())) {
  if (&executor.model() != model_.get()) {
    throw Error(ErrorCode::kInvalidArgument, "session: the executor runs a different model");
  }
  tokens_.reserve(size_t(n_ctx_));
}

Session::~Session() = default;
Session::Session(Session&&) noexcept = default;
Session& Session::operator=(Session&&) noexcept = default;

std::span<const float> Session::logits() const noexcept {
  if (!have_logits_) return {};
  return logits_;
}

void Session::eval(std::span<const int32_t> ids, std::span<float> all_logits) {
  eval_until(ids, all_logits, nullptr);
}

size_t Session::eval_until(std::span<const int32_t> ids, std::span<float> all_logits,
                           const std::function<bool()>* should_stop) {
  const int32_t n_vocab = model_->hparams().n_vocab;
  const size_t n_new = ids.size() + (pending_ ? 1 : 0);
  if (n_new == 0) return 0;
  const bool polled = should_stop != nullptr && *should_stop;
  const int64_t need = static_cast<int64_t>(tokens_.size() + n_new);
  if (need > n_ctx_) {
    throw Error(ErrorCode::kContextOverflow,
                fmt::format("context overflow: {} positions needed, n_ctx is {}", need, n_ctx_));
  }
  if (!all_logits.empty() && all_logits.size() < ids.size() * size_t(n_vocab)) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("eval: logits buffer holds {} floats, {} needed",
                                                         all_logits.size(), ids.size() * size_t(n_vocab)));
  }
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= n_vocab) {
      throw Error(ErrorCode::kInvalidArgument,
                  fmt::format("eval: token id {} at index {} is outside the vocabulary [0, {})", ids[i], i, n_vocab));
    }
  }
  if (pending_) {
    const int32_t id = *pending_;
    SequenceStep st{kv_.get(), std::span<const int32_t>(&id, 1), kv_->n_tokens(),
                    ids.empty() ? LogitsRows::kLast : LogitsRows::kNone};
    place_kv(st.pos0 + 1);
    executor_->step(std::span<const SequenceStep>(&st, 1), logits_);
    tokens_.push_back(id);
    pending_.reset();
    have_logits_ = ids.empty();
  }
  const size_t chunk = size_t(options_.n_batch);
  for (size_t b = 0; b < ids.size(); b += chunk) {
    if (polled && (*should_stop)()) return b;
    const size_t n = std::min(chunk, ids.size() - b);
    // A polled evaluation keeps the logits of every chunk: it may stop after any of them.
    const bool last = b + n == ids.size() || polled;
    SequenceStep st{kv_.get(), ids.subspan(b, n), kv_->n_tokens(), LogitsRows::kNone};
    place_kv(st.pos0 + int32_t(n));
    std::span<float> out;
    if (!all_logits.empty()) {
      st.logits = LogitsRows::kAll;
      out = all_logits.subspan(b * size_t(n_vocab), n * size_t(n_vocab));
    } else if (last) {
      st.logits = LogitsRows::kLast;
      out = logits_;
    }
    executor_->step(std::span<const SequenceStep>(&st, 1), out);
    tokens_.insert(tokens_.end(), st.tokens.begin(), st.tokens.end());
    if (last) {
      if (!all_logits.empty()) {
        std::copy_n(all_logits.begin() + std::ptrdiff_t((b + n - 1) * size_t(n_vocab)), n_vocab, logits_.begin());
      }
      have_logits_ = true;
    }
  }
  return ids.size();
}

void Session::place_kv(int32_t end) {
  // The same placement policy as the scheduler's: resident in the executor's tier
  // (brought back when a shared store swapped it out), with room for positions up to `end`.
  KvPlacement(*store_).prepare_step(*kv_, executor_->kv_tier(), end);
}

GenerateResult Session::generate(std::string_view text, const GenerateOptions& options, bool parse_special) {
  const bool first = tokens_.empty() && !pending_;
  const auto ids = model_->tokenizer().tokenize(text, first, parse_special);
  return generate(std::span<const int32_t>(ids), options);
}

GenerateResult Session::generate(std::span<const int32_t> prompt, const GenerateOptions& options) {
  if (options.max_tokens < 0) {
    throw Error(ErrorCode::kInvalidArgument, fmt::format("generate: max_tokens {} must be >= 0", options.max_tokens));
  }
  // Output clamped to the context (an overflowing prompt is refused by eval below).
  const int64_t positions = int64_t(tokens_.size() + prompt.size()) + (pending_ ? 1 : 0);
  const int32_t max_new = std::max(0, clamp_output_tokens(options.max_tokens, positions, n_ctx_));
  gen_->begin(options.sampling, model_->hparams().n_vocab, options.stop, options.ignore_eos, max_new, options.logprobs,
              options.grammar);
  if (options.sampling.seed == SamplingParams::kSessionSeed) gen_->sampler().set_rng(rng_);
  GenerateResult r;
  const auto t0 = std::chrono::steady_clock::now();
  if (prompt.empty() && !pending_ && !have_logits_) {
    throw Error(ErrorCode::kInvalidArgument, "generate: empty prompt and nothing to continue from");
  }
  const int32_t had_pending = pending_ ? 1 : 0;
  const size_t n_evaluated = eval_until(prompt, {}, &options.should_stop);
  r.n_prompt = static_cast<int32_t>(n_evaluated) + had_pending;
  r.prompt_seconds = seconds_since(t0);
  if (n_evaluated < prompt.size()) {
    r.finish = FinishReason::kCancelled;
    rng_ = gen_->sampler().rng();
    return r;
  }

  const auto t1 = std::chrono::steady_clock::now();
  r.finish = FinishReason::kLength;
  while (gen_->n_gen() < max_new) {
    if (options.should_stop && options.should_stop()) {
      r.finish = FinishReason::kCancelled;
      break;
    }
    const TokenStep t = gen_->next(logits_, tokens_);
    if (t.end == GenEnd::kEog) {
      r.finish = FinishReason::kStop;
      break;
    }
    r.tokens.push_back(t.id);
    if (t.logprob != nullptr) r.logprobs.push_back(*t.logprob);
    pending_ = t.id;
    const bool cancelled = !t.piece.empty() && options.on_text && !options.on_text(t.piece, t.id);
    if (cancelled && t.end != GenEnd::kStopString) {
      r.finish = FinishReason::kCancelled;
      break;
    }
    if (t.end != GenEnd::kNone) {
      r.finish = t.end == GenEnd::kStopString ? FinishReason::kStopString : FinishReason::kLength;
      break;
    }
    eval({});
  }
  // At a natural end the held-back UTF-8 bytes go out as U+FFFD, unless the caller keeps
  // them for the next generate (flush_text false, stopped at the length limit).
  const bool hold = !options.flush_text && r.finish == FinishReason::kLength;
  if (!hold && (r.finish == FinishReason::kStop || r.finish == FinishReason::kLength)) {
    gen_->flush_utf8();
    const std::string_view tail = gen_->take_unsent();
    if (!tail.empty() && options.on_text) options.on_text(tail, r.tokens.empty() ? -1 : r.tokens.back());
  }
  r.text = gen_->text();
  r.generate_seconds = seconds_since(t1);
  rng_ = gen_->sampler().rng();
  return r;
}

Session::MoveReport Session::migrate(Executor& dst, std::shared_ptr<KvStore> dst_store) {
  const auto t0 = std::chrono::steady_clock::now();
  if (!dst_store) {
    SessionOptions o = options_;
    o.kv_store = nullptr;
    o.kv_tier = dst.kv_tier() == KvTier::kDevice ? KvTier::kHost : dst.kv_tier();
    o.kv_dtype = store_->layout().dtype;
    o.page_size = store_->layout().page_size;
    dst_store = own_store(dst.model().hparams(), o, n_ctx_, dst);  // Device tier for a GPU dst
  }
  // Where the pages land is KvPlacement's decision, among the tiers `dst` can read.
  std::vector<KvTier> readable;
  for (KvTier t : {dst.kv_tier(), KvTier::kHost, KvTier::kFile}) {
    if (dst.can_read(t)) readable.push_back(t);
  }
  const auto pages = static_cast<int32_t>(dst_store->layout().pages_holding(kv_->n_tokens()));
  const KvTier tier = KvPlacement(*dst_store).import_tier(readable, pages);
  KvHandoff h = kv_export(*kv_, *model_, tokens_);
  auto seq = kv_import(std::span<const KvHandoff>(&h, 1), dst.model(), *dst_store, tier, n_ctx_, tokens_);
  MoveReport r;
  r.pages = static_cast<int32_t>(h.descriptor.n_pages());
  r.bytes = h.descriptor.payload_bytes();
  kv_ = std::move(seq);
  store_ = std::move(dst_store);
  executor_ = &dst;
  model_ = dst.model_ptr();
  r.seconds = seconds_since(t0);
  return r;
}

void Session::truncate(size_t n) {
  const size_t length = tokens_.size() + (pending_ ? 1 : 0);
  if (n >= length) return;
  pending_.reset();  // n <= tokens_.size() from here on
  if (n < tokens_.size()) {
    // A sliding-window model cut behind its window no longer holds the KV the window needs:
    // the first n tokens are evaluated again.
    const auto kept = size_t(kv_->truncate(static_cast<int32_t>(n)));
    const std::vector<int32_t> again(tokens_.begin() + std::ptrdiff_t(kept), tokens_.begin() + std::ptrdiff_t(n));
    tokens_.resize(kept);
    if (!again.empty()) eval(again, {});
    have_logits_ = false;
  }
  gen_->discard_held();
}

size_t Session::reuse_prefix(std::span<const int32_t> prompt) {
  const size_t limit = prompt.empty() ? 0 : prompt.size() - 1;
  size_t n = 0;
  while (n < limit && n < tokens_.size() && tokens_[n] == prompt[n]) ++n;
  if (n == tokens_.size() && n < limit && pending_ && *pending_ == prompt[n]) ++n;
  if (n < tokens_.size() && !kv_->holds_prefix(static_cast<int32_t>(n))) n = 0;  // behind a sliding window
  truncate(n);
  return n;
}

void Session::reset() {
  gen_->discard_held();
  kv_->truncate(0);
  tokens_.clear();
  pending_.reset();
  have_logits_ = false;
}

}  // namespace tandem
