// Session: one conversation — its token history, its KV sequence, its sampler — running
// on one executor.
//
// Context policy: a session holds at most n_ctx positions. A prompt that does not fit is
// refused with Error(kContextOverflow) (needed vs n_ctx) before any compute, leaving the
// session unchanged; generation that reaches n_ctx ends with FinishReason::kLength.
// The last sampled token of a generation is not yet in the KV cache; it is fed first
// when the conversation continues.
//
// Thread-safety: a Session is used by one thread at a time.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "tandem/exec/executor.hpp"
#include "tandem/grammar/grammar.hpp"
#include "tandem/kv/kv_store.hpp"
#include "tandem/model/model.hpp"
#include "tandem/session/sampler.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

namespace tandem {

class Generation;

struct SessionOptions {
  int32_t n_ctx = 0;      ///< positions; 0 = default_context_size(); at most kMaxContextSize
  int32_t n_batch = 512;  ///< prompt tokens per executor step (chunked prefill)
  /// Where the KV pages live. Null: the session makes its own store sized for n_ctx,
  /// with pages of `page_size` tokens and `kv_dtype` in `kv_tier` (Host or File); with an
  /// executor that computes on Device pages and offers a Device tier
  /// (Executor::make_kv_device_backend, e.g. the GPU executor) and kv_tier Host or Device,
  /// the own store is that Device tier instead, so the pages stay in VRAM between steps.
  std::shared_ptr<KvStore> kv_store;
  int32_t page_size = 16;            ///< KV page size in tokens (own store only)
  KvDtype kv_dtype = KvDtype::kF16;  ///< f16, f32 or q8_0 (CPU executors; own store only)
  KvTier kv_tier = KvTier::kHost;    ///< tier new pages go to
  std::filesystem::path kv_dir;      ///< File tier directory of an own store ("" = $TMPDIR, else /tmp)
  uint64_t seed = 0;                 ///< initial state of the session's random engine
};

enum class FinishReason {
  kStop,        ///< an end-of-generation token (EOS/EOT) was sampled
  kStopString,  ///< a stop string appeared in the output (it is not included)
  kLength,      ///< max_tokens generated, or the context is full
  kCancelled,   ///< the token callback asked to stop
};
std::string_view finish_reason_name(FinishReason r) noexcept;  ///< "stop", "length", ...

struct GenerateOptions {
  int32_t max_tokens = 128;
  SamplingParams sampling;
  std::vector<std::string> stop;  ///< stop strings
  bool ignore_eos = false;        ///< keep going past end-of-generation tokens (not a grammar's: see `grammar`)
  /// At the end, write an incomplete UTF-8 sequence out as U+FFFD (one per byte). When
  /// false and generation stopped at max_tokens, the bytes stay held in the session and
  /// complete with the next generate() (a conversation continued in several calls).
  bool flush_text = true;
  /// Called with each piece of valid UTF-8 text as it becomes final (text is held back
  /// while it may still turn into a stop string or an incomplete UTF-8 sequence) and the
  /// id of the token that completed it. Return false to stop (FinishReason::kCancelled).
  std::function<bool(std::string_view text, int32_t token)> on_text;
  /// Polled before each prompt chunk of n_batch tokens and before each sampled token
  /// (cheap, non-blocking; e.g. an interrupt flag). True stops with FinishReason::
  /// kCancelled: the conversation then holds every chunk evaluated so far, with the logits
  /// after its last token (a prompt stopped part-way is in the KV up to a chunk boundary;
  /// GenerateResult::n_prompt counts the tokens evaluated). Null: never polled.
  std::function<bool()> should_stop;
  /// -1: none. 0 .. kMaxTopLogprobs (20): GenerateResult::logprobs gets each generated
  /// token's log-probability under the model (the logits before sampling transforms) and
  /// this many most likely alternatives (OpenAI's logprobs / top_logprobs). Other values:
  /// Error(kInvalidArgument).
  int32_t logprobs = -1;
  /// Structured output (include/tandem/grammar/grammar.hpp): every sampled token is one the grammar
  /// allows, and generation ends at an end-of-generation token only where the grammar is
  /// complete (max_tokens or a stop string can still cut it); a grammar that completes ends
  /// the output there even with ignore_eos (the grammar allows nothing after it; ignore_eos
  /// still keeps an unconstrained batch neighbour going). Null: unconstrained. A grammar for
  /// another vocabulary is Error(kInvalidArgument).
  std::shared_ptr<const Grammar> grammar;
};

struct GenerateResult {
  std::vector<int32_t> tokens;  ///< generated ids (an EOS that stopped it is not included)
  std::string text;             ///< their text, cut at a stop string
  FinishReason finish = FinishReason::kLength;
  int32_t n_prompt = 0;                ///< tokens evaluated for the prompt
  double prompt_seconds = 0.0;         ///< wall time of the prompt evaluation
  double generate_seconds = 0.0;       ///< wall time from the first sampled token to the end
  std::vector<TokenLogprob> logprobs;  ///< one per entry of tokens, with GenerateOptions::logprobs >= 0
};

class Session {
 public:
  ~Session();
  Session(Session&&) noexcept;
  Session& operator=(Session&&) noexcept;
  /// Throws Error(kInvalidArgument) for n_ctx outside [0, kMaxContextSize], n_batch < 1 or
  /// page_size < 1 (before anything is allocated).
  Session(std::shared_ptr<const Model> model, Executor& executor, const SessionOptions& options = {});

  const Model& model() const noexcept { return *model_; }
  int32_t n_ctx() const noexcept { return n_ctx_; }
  /// Tokens whose KV is in the cache, in order.
  const std::vector<int32_t>& tokens() const noexcept { return tokens_; }
  /// Logits after the last evaluated token ([n_vocab]); empty before the first eval.
  std::span<const float> logits() const noexcept;

  /// Evaluate `ids` (appended to the conversation). When `all_logits` is non-empty it
  /// receives [ids.size(), n_vocab] floats, row i = logits after ids[i]. Errors:
  /// kContextOverflow (nothing evaluated), kInvalidArgument (bad id, small buffer).
  void eval(std::span<const int32_t> ids, std::span<float> all_logits = {});

  /// Evaluate `prompt` then sample up to max_tokens. An empty prompt continues from the
  /// current state (there must be one). Errors as eval() plus sampling-parameter errors.
  GenerateResult generate(std::span<const int32_t> prompt, const GenerateOptions& options);
  /// Tokenise `text` (BOS added when the session is empty and the vocabulary asks for it;
  /// special-token text parsed when `parse_special`) and generate.
  GenerateResult generate(std::string_view text, const GenerateOptions& options, bool parse_special = false);

  /// Forget everything (KV pages returned).
  void reset();

  /// Keep the first `n` tokens of the conversation (tokens() plus a token sampled but not
  /// yet evaluated) and forget the rest: the KV pages past ceil(n / page_size) go back to
  /// the store at once, text held back by the streaming detokenizer is dropped. n at or
  /// beyond the conversation's length changes nothing. Cutting below the last evaluated
  /// token leaves no logits: the next generate() then needs a non-empty prompt (as after
  /// reset()). The random engine is not touched. A sliding-window model (Gemma 3) cut
  /// behind its window (KvSequence::holds_prefix) has released the KV that window needs:
  /// the first n tokens are then evaluated again (errors as eval()); otherwise no errors.
  void truncate(size_t n);

  /// Prompt cache (llama.cpp's --prompt-cache): keep the longest common prefix of the
  /// conversation and `prompt`, but at most prompt.size() - 1 tokens so that the prompt's
  /// last token is evaluated again and yields fresh logits; forget the rest (truncate()).
  /// Returns the number of tokens kept: the caller evaluates prompt[kept, end). Generating
  /// from there gives the same tokens as a fresh session given the whole prompt (the KV of
  /// a position depends only on the tokens up to it). With a sliding window, a prefix cut
  /// behind the window keeps nothing (0). No errors.
  size_t reuse_prefix(std::span<const int32_t> prompt);

  /// Restart the session's random engine from `seed` (SessionOptions::seed semantics).
  void reseed(uint64_t seed) { rng_.seed(seed); }

  /// Write tokens, the pending token, the last logits, the random engine's state, the KV
  /// descriptor and the KV pages to `path` atomically (AtomicFileWriter,
  /// include/tandem/core/atomic_file.hpp: symbolic links followed, a temporary file in the real
  /// directory, permissions kept, fsync, rename; concurrent savers never corrupt it, the
  /// last one wins). Format: "TANDEMSS", u32 version, ..., xxHash3-64 of everything before
  /// it (lib/session/session_file.cpp). Errors: kIo (the old file is then intact), kInvalidArgument
  /// (the path is a directory, device, FIFO or socket: refused, nothing written).
  void save(const std::filesystem::path& path) const;
  /// What restore() found: the KV dtype the file was saved with and this session's, which
  /// the restored pages now hold (converted when the two differ).
  struct RestoreReport {
    KvDtype saved_kv_dtype = KvDtype::kF16;
    KvDtype kv_dtype = KvDtype::kF16;
    bool kv_converted() const noexcept { return saved_kv_dtype != kv_dtype; }
  };

  /// Replace this session's state with the one saved in `path`. Refused, with the session
  /// left exactly as it was: kIo (unreadable), kSessionCorrupt (not a session file,
  /// truncated, any flipped byte, inconsistent fields), kSessionVersion (a newer format),
  /// kSessionModelMismatch (saved with other weights, hyper-parameters or tokenizer),
  /// kContextOverflow (more evaluated tokens than this session's n_ctx), kOutOfMemory. A file
  /// saved with the context full restores as saved: its last sampled token, which has no
  /// position left, stays pending, so continuing gives kContextOverflow as in the live
  /// session, while truncate() / reuse_prefix() / reset() make room.
  /// A file saved with another KV dtype (f16, f32, q8_0) than this session's store is
  /// converted on the way in (kv_import, include/tandem/kv/kv_contract.hpp); the report says so.
  /// A file written by Scheduler::save_session (the same format) holds no logits and no
  /// random state: the session then has no logits (generate() continues from its pending
  /// token, or needs a prompt) and keeps its own random engine.
  RestoreReport restore(const std::filesystem::path& path);

  struct MoveReport {
    int32_t pages = 0;
    uint64_t bytes = 0;
    double seconds = 0.0;
  };
  /// Hand the conversation to executor `dst` (KV exported under a lease, imported into
  /// `dst_store` — a new store like this session's own when null — verified, then the
  /// old pages released). The session then runs on `dst`; generation continues exactly
  /// as if it had not moved. The pages land in the tier KvPlacement::import_tier picks
  /// among those `dst` can read (its compute tier, Host, File, in that order): the first
  /// the store has with room, so a full compute tier no longer fails the move when a
  /// readable lower tier has room (the next step brings the pages up). On error the
  /// session stays on its current executor (Error(kInvalidArgument) when `dst_store` has
  /// no tier `dst` can read).
  MoveReport migrate(Executor& dst, std::shared_ptr<KvStore> dst_store = nullptr);

  KvSequence& kv() noexcept { return *kv_; }
  const std::shared_ptr<KvStore>& kv_store() const noexcept { return store_; }
  Executor& executor() const noexcept { return *executor_; }

 private:
  void place_kv(int32_t end);
  /// eval() polling `should_stop` (may be null or empty) before each chunk; returns the
  /// number of ids evaluated (ids.size() unless stopped).
  size_t eval_until(std::span<const int32_t> ids, std::span<float> all_logits,
                    const std::function<bool()>* should_stop);

  std::shared_ptr<const Model> model_;
  Executor* executor_;
  SessionOptions options_;
  int32_t n_ctx_;
  std::shared_ptr<KvStore> store_;
  std::unique_ptr<KvSequence> kv_;
  std::vector<int32_t> tokens_;
  std::optional<int32_t> pending_;  ///< sampled but not yet evaluated
  std::vector<float> logits_;
  bool have_logits_ = false;
  std::mt19937_64 rng_;
  /// The per-token logic shared with the scheduler (lib/session/generation.hpp); holds back an
  /// incomplete UTF-8 sequence between generate() calls.
  std::unique_ptr<Generation> gen_;
};

}  // namespace tandem
