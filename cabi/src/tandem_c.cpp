// The C ABI (cabi/include/tandem.h) over the C++ library. Every function body runs inside
// capi::guard(), which turns exceptions into status codes; handles are looked up in the
// registry before anything is touched.
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "capi_internal.hpp"
#include "tandem/exec/gpu/gpu_q4_executor.hpp"
#include "tandem/grammar/grammar.hpp"
#include "tandem/tokenizer/tokenizer.hpp"

using namespace tandem;
using namespace tandem::capi;

// ---- the status numbers are tandem::ErrorCode's ----------------------------------------

#define TANDEM_SAME_CODE(c_name, cpp_name) \
  static_assert(c_name == static_cast<int32_t>(ErrorCode::cpp_name), #c_name " != ErrorCode::" #cpp_name)
TANDEM_SAME_CODE(TANDEM_OK, kOk);
TANDEM_SAME_CODE(TANDEM_E_INVALID_ARG, kInvalidArgument);
TANDEM_SAME_CODE(TANDEM_E_IO, kIo);
TANDEM_SAME_CODE(TANDEM_E_OUT_OF_MEMORY, kOutOfMemory);
TANDEM_SAME_CODE(TANDEM_E_GGUF_BAD_MAGIC, kGgufBadMagic);
TANDEM_SAME_CODE(TANDEM_E_GGUF_BAD_VERSION, kGgufBadVersion);
TANDEM_SAME_CODE(TANDEM_E_GGUF_TRUNCATED, kGgufTruncated);
TANDEM_SAME_CODE(TANDEM_E_GGUF_BAD_LENGTH, kGgufBadLength);
TANDEM_SAME_CODE(TANDEM_E_GGUF_BAD_ALIGNMENT, kGgufBadAlignment);
TANDEM_SAME_CODE(TANDEM_E_GGUF_DUPLICATE_KEY, kGgufDuplicateKey);
TANDEM_SAME_CODE(TANDEM_E_GGUF_DUPLICATE_TENSOR, kGgufDuplicateTensor);
TANDEM_SAME_CODE(TANDEM_E_GGUF_BAD_TYPE, kGgufBadType);
TANDEM_SAME_CODE(TANDEM_E_GGUF_BAD_TENSOR, kGgufBadTensor);
TANDEM_SAME_CODE(TANDEM_E_TENSOR_NON_FINITE, kTensorNonFinite);
TANDEM_SAME_CODE(TANDEM_E_MODEL_UNSUPPORTED_ARCH, kModelUnsupportedArch);
TANDEM_SAME_CODE(TANDEM_E_MODEL_MISSING_TENSOR, kModelMissingTensor);
TANDEM_SAME_CODE(TANDEM_E_MODEL_BAD_HPARAMS, kModelBadHparams);
TANDEM_SAME_CODE(TANDEM_E_MODEL_BAD_TENSOR_SHAPE, kModelBadTensorShape);
TANDEM_SAME_CODE(TANDEM_E_TOKENIZER, kTokenizer);
TANDEM_SAME_CODE(TANDEM_E_CONTEXT_OVERFLOW, kContextOverflow);
TANDEM_SAME_CODE(TANDEM_E_BAD_POSITION, kBadPosition);
TANDEM_SAME_CODE(TANDEM_E_KV_MISMATCH, kKvMismatch);
TANDEM_SAME_CODE(TANDEM_E_KV_CHECKSUM, kKvChecksum);
TANDEM_SAME_CODE(TANDEM_E_KV_LEASE_EXPIRED, kKvLeaseExpired);
TANDEM_SAME_CODE(TANDEM_E_KV_TOKEN_RANGE, kKvTokenRange);
TANDEM_SAME_CODE(TANDEM_E_SESSION_CORRUPT, kSessionCorrupt);
TANDEM_SAME_CODE(TANDEM_E_SESSION_MODEL_MISMATCH, kSessionModelMismatch);
TANDEM_SAME_CODE(TANDEM_E_SESSION_VERSION, kSessionVersion);
TANDEM_SAME_CODE(TANDEM_E_INTERNAL, kInternal);
#undef TANDEM_SAME_CODE

static_assert(static_cast<int>(FinishReason::kStop) == TANDEM_FINISH_STOP);
static_assert(static_cast<int>(FinishReason::kStopString) == TANDEM_FINISH_STOP_STRING);
static_assert(static_cast<int>(FinishReason::kLength) == TANDEM_FINISH_LENGTH);
static_assert(static_cast<int>(FinishReason::kCancelled) == TANDEM_FINISH_CANCELLED);
static_assert(static_cast<int>(RequestFinish::kStop) == TANDEM_FINISH_STOP);
static_assert(static_cast<int>(RequestFinish::kStopString) == TANDEM_FINISH_STOP_STRING);
static_assert(static_cast<int>(RequestFinish::kLength) == TANDEM_FINISH_LENGTH);
static_assert(static_cast<int>(RequestFinish::kCancelled) == TANDEM_FINISH_CANCELLED);
static_assert(static_cast<int>(RequestFinish::kTimeout) == TANDEM_FINISH_TIMEOUT);
static_assert(static_cast<int>(RequestFinish::kOverloaded) == TANDEM_FINISH_OVERLOADED);
static_assert(static_cast<int>(RequestFinish::kError) == TANDEM_FINISH_ERROR);
static_assert(static_cast<int>(SlaClass::kInteractive) == TANDEM_SLA_INTERACTIVE);
static_assert(static_cast<int>(SlaClass::kStandard) == TANDEM_SLA_STANDARD);
static_assert(static_cast<int>(SlaClass::kBatch) == TANDEM_SLA_BATCH);
static_assert(static_cast<int>(KvTier::kDevice) == TANDEM_KV_DEVICE);
static_assert(static_cast<int>(KvTier::kHost) == TANDEM_KV_HOST);
static_assert(static_cast<int>(KvTier::kFile) == TANDEM_KV_FILE);
static_assert(static_cast<int>(KvDtype::kF32) == TANDEM_KV_F32);
static_assert(static_cast<int>(KvDtype::kF16) == TANDEM_KV_F16);
static_assert(static_cast<int>(KvDtype::kQ8_0) == TANDEM_KV_Q8_0);

// ---- struct sizes of version 0.1 ----------------------------------------------------------
//
// The smallest struct_size each function accepts. These numbers are frozen: when a field is
// added, sizeof grows and these stay. No struct may have tail padding (a later field could
// hide in it), hence the checks.

namespace {

constexpr size_t kModelParamsV01 = sizeof(tandem_model_params);
constexpr size_t kModelInfoV01 = sizeof(tandem_model_info);
constexpr size_t kSessionParamsV01 = offsetof(tandem_session_params, kv_tier);
constexpr size_t kSessionInfoV01 = sizeof(tandem_session_info);
constexpr size_t kSamplingParamsV01 = sizeof(tandem_sampling_params);
constexpr size_t kGenerateParamsV01 = offsetof(tandem_generate_params, logprobs);
constexpr size_t kGenerateResultV01 = offsetof(tandem_generate_result, logprobs);
constexpr size_t kExecutorParamsV01 = offsetof(tandem_executor_params, device_kind);
constexpr size_t kSchedulerParamsV01 = offsetof(tandem_scheduler_params, executor_handles);
constexpr size_t kRequestParamsV01 = offsetof(tandem_request_params, session);
constexpr size_t kRequestEventV01 = sizeof(tandem_request_event);
constexpr size_t kRequestResultV01 = offsetof(tandem_request_result, logprobs);
constexpr size_t kSchedulerSessionInfoV01 = sizeof(tandem_scheduler_session_info);

#define TANDEM_NO_TAIL_PADDING(T, last) \
  static_assert(offsetof(T, last) + sizeof(T::last) == sizeof(T), #T " has tail padding")
TANDEM_NO_TAIL_PADDING(tandem_model_params, max_alignment);
TANDEM_NO_TAIL_PADDING(tandem_model_info, weight_bytes);
TANDEM_NO_TAIL_PADDING(tandem_session_params, pool);
TANDEM_NO_TAIL_PADDING(tandem_session_info, has_logits);
TANDEM_NO_TAIL_PADDING(tandem_sampling_params, seed);
TANDEM_NO_TAIL_PADDING(tandem_generate_params, reserved2);
TANDEM_NO_TAIL_PADDING(tandem_generate_result, n_logprobs);
TANDEM_NO_TAIL_PADDING(tandem_executor_params, pool);
TANDEM_NO_TAIL_PADDING(tandem_scheduler_params, reserved);
TANDEM_NO_TAIL_PADDING(tandem_request_params, reserved2);
TANDEM_NO_TAIL_PADDING(tandem_request_event, reserved);
TANDEM_NO_TAIL_PADDING(tandem_request_result, n_logprobs);
TANDEM_NO_TAIL_PADDING(tandem_token_logprob, top_logprobs);
static_assert(TANDEM_MAX_TOP_LOGPROBS == kMaxTopLogprobs);
TANDEM_NO_TAIL_PADDING(tandem_scheduler_session_info, reserved);
#undef TANDEM_NO_TAIL_PADDING

constexpr int32_t kMaxThreads = 512;
constexpr uint32_t kTokenizeFlags = TANDEM_TOKENIZE_ADD_SPECIAL | TANDEM_TOKENIZE_PARSE_SPECIAL;
constexpr uint32_t kDetokenizeFlags = TANDEM_DETOKENIZE_REMOVE_SPECIAL | TANDEM_DETOKENIZE_UNPARSE_SPECIAL;
constexpr uint32_t kGenerateFlags = TANDEM_GENERATE_IGNORE_EOS | TANDEM_GENERATE_PARSE_SPECIAL;

tandem_model_params default_model_params() {
  tandem_model_params p{};
  p.struct_size = sizeof p;
  const GgufOpenOptions d;
  p.check_block_scales = d.check_block_scales ? 1 : 0;
  p.max_alignment = d.max_alignment;
  return p;
}

tandem_session_params default_session_params() {
  tandem_session_params p{};
  p.struct_size = sizeof p;
  const SessionOptions d;
  p.n_ctx = d.n_ctx;
  p.n_batch = d.n_batch;
  p.page_size = d.page_size;
  p.n_threads = 0;
  p.kv_tier = TANDEM_KV_HOST;
  p.kv_dtype = TANDEM_KV_F16;
  p.kv_dir = nullptr;
  return p;
}

tandem_sampling_params default_sampling_params() {
  tandem_sampling_params p{};
  p.struct_size = sizeof p;
  const SamplingParams d;
  p.temperature = d.temperature;
  p.top_k = d.top_k;
  p.top_p = d.top_p;
  p.min_p = d.min_p;
  p.repeat_penalty = d.repeat_penalty;
  p.repeat_last_n = d.repeat_last_n;
  p.frequency_penalty = d.frequency_penalty;
  p.presence_penalty = d.presence_penalty;
  p.seed = d.seed;
  return p;
}

tandem_generate_params default_generate_params() {
  tandem_generate_params p{};
  p.struct_size = sizeof p;
  p.max_tokens = GenerateOptions{}.max_tokens;
  p.logprobs = -1;
  return p;
}

tandem_executor_params default_executor_params() {
  tandem_executor_params p{};
  p.struct_size = sizeof p;
  const ExecutorConfig d;
  p.n_threads = 0;
  p.max_running = d.max_running;
  p.step_token_budget = d.step_token_budget;
  p.prefill_chunk = d.prefill_chunk;
  p.kv_pages = 0;
  p.accelerator = -1;
  p.device_kind = TANDEM_DEVICE_CPU;
  p.device_id = 0;
  p.kv_dtype = TANDEM_KV_F16;
  p.kv_file_pages = 0;
  p.kv_dir = nullptr;
  return p;
}

tandem_scheduler_params default_scheduler_params() {
  tandem_scheduler_params p{};
  p.struct_size = sizeof p;
  const SchedulerOptions d;
  p.executors = nullptr;
  p.n_executors = 1;
  p.max_queued = d.max_queued;
  p.max_context = d.max_context;
  p.prefix_cache_entries = d.prefix_cache_entries;
  p.page_size = 16;
  p.executor_handles = nullptr;
  p.log_routing = 1;
  p.reserved = 0;
  return p;
}

tandem_request_params default_request_params() {
  tandem_request_params p{};
  p.struct_size = sizeof p;
  p.max_tokens = Request{}.max_tokens;
  p.sla = TANDEM_SLA_STANDARD;
  p.deadline_ms = 0;
  p.session = 0;
  p.logprobs = -1;
  return p;
}

template <class T>
T zeroed() {
  T v{};
  v.struct_size = sizeof v;
  return v;
}

void check_flags(uint32_t flags, uint32_t known, const char* fn) {
  if ((flags & ~known) != 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: unknown flag bits {:#x}", fn, flags & ~known));
  }
}

/// Token counts beyond int32 cannot fit any context (and n * n_vocab must not overflow).
void check_count(size_t n, const char* fn, const char* what) {
  if (n > size_t(std::numeric_limits<int32_t>::max())) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: {} {} is larger than any context", fn, what, n));
  }
}

void check_utf8(std::string_view text, const char* fn, const char* what) {
  const size_t bad = utf8_invalid_at(text);
  if (bad != std::string_view::npos) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: {} is not valid UTF-8 (byte {} = {:#04x})", fn, what, bad,
                                           static_cast<unsigned char>(text[bad])));
  }
}

/// Copy text + NUL into a caller buffer under the size-query rules.
void write_text(const std::string& text, char* buf, size_t capacity, size_t* out_len, const char* fn) {
  *out_len = text.size();
  if (check_capacity(buf, capacity, text.size() + 1, fn, "buf")) {
    std::memcpy(buf, text.data(), text.size());
    buf[text.size()] = '\0';
  }
}

double physical_memory_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page = sysconf(_SC_PAGESIZE);
  if (pages <= 0 || page <= 0) return std::numeric_limits<double>::infinity();
  return double(pages) * double(page);
}

SamplingParams to_sampling(const tandem_sampling_params* user, const char* fn) {
  tandem_sampling_params p = default_sampling_params();
  if (user != nullptr) read_struct(user, kSamplingParamsV01, p, fn, "tandem_sampling_params");
  SamplingParams s;
  s.temperature = p.temperature;
  s.top_k = p.top_k;
  s.top_p = p.top_p;
  s.min_p = p.min_p;
  s.repeat_penalty = p.repeat_penalty;
  s.repeat_last_n = p.repeat_last_n;
  s.frequency_penalty = p.frequency_penalty;
  s.presence_penalty = p.presence_penalty;
  s.seed = p.seed;
  s.validate();  // Error(kInvalidArgument) naming the field
  return s;
}

std::vector<std::string> read_stops(const char* const* stop, size_t n_stop, const char* fn) {
  std::vector<std::string> out;
  if (n_stop > 0 && stop == nullptr) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: stop is NULL but n_stop is {}", fn, n_stop));
  }
  for (size_t i = 0; i < n_stop; ++i) {
    if (stop[i] == nullptr) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: stop[{}] is NULL", fn, i));
    const std::string_view s(stop[i]);
    if (s.empty()) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: stop[{}] is empty", fn, i));
    check_utf8(s, fn, "a stop string");
    out.emplace_back(s);
  }
  return out;
}

/// tandem_generate_params / tandem_request_params .logprobs (-1 .. 20) and .reserved (0).
int32_t read_logprobs(int32_t logprobs, int32_t reserved, const char* fn) {
  if (logprobs < -1 || logprobs > TANDEM_MAX_TOP_LOGPROBS) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: logprobs {} must be -1 (none) or 0 .. {} alternatives", fn, logprobs,
                                           TANDEM_MAX_TOP_LOGPROBS));
  }
  if (reserved != 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: reserved is {}, must be 0", fn, reserved));
  return logprobs;
}

/// The first min(size, cap) entries of `in` into `out` (NULL: nothing).
void write_logprobs(const std::vector<TokenLogprob>& in, tandem_token_logprob* out, size_t cap) {
  if (out == nullptr) return;
  const size_t n = std::min(in.size(), cap);
  for (size_t i = 0; i < n; ++i) {
    tandem_token_logprob e{};
    e.token = in[i].token;
    e.logprob = in[i].logprob;
    e.n_top = in[i].n_top;
    for (int32_t k = 0; k < in[i].n_top; ++k) {
      e.top_tokens[k] = in[i].top[size_t(k)].token;
      e.top_logprobs[k] = in[i].top[size_t(k)].logprob;
    }
    out[i] = e;
  }
}

/// tandem_generate_params / tandem_request_params .grammar, .grammar_type, .reserved2.
std::shared_ptr<const Grammar> read_grammar(const char* text, int32_t type, int32_t reserved2, const Tokenizer& tok,
                                            const char* fn) {
  if (reserved2 != 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: reserved2 is {}, must be 0", fn, reserved2));
  const bool needs_text = type == TANDEM_GRAMMAR_JSON_SCHEMA || type == TANDEM_GRAMMAR_GBNF;
  if (type < TANDEM_GRAMMAR_NONE || type > TANDEM_GRAMMAR_GBNF) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: grammar_type {} is not a tandem_grammar_type", fn, type));
  }
  if (needs_text && text == nullptr) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: grammar is NULL but grammar_type is {}", fn, type));
  }
  if (!needs_text && text != nullptr) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: grammar is set but grammar_type {} takes no text", fn, type));
  }
  if (type == TANDEM_GRAMMAR_NONE) return nullptr;
  if (type == TANDEM_GRAMMAR_JSON_OBJECT) return Grammar::json_object(tok);
  const std::string_view sv(text);
  check_utf8(sv, fn, "the grammar");
  return type == TANDEM_GRAMMAR_JSON_SCHEMA ? Grammar::from_json_schema(tok, sv) : Grammar::from_gbnf(tok, sv);
}

struct PreparedGenerate {
  GenerateOptions options;
  bool parse_special = false;
  tandem_generate_result result{};  // caller's input fields, when given
  size_t result_bytes = 0;
};

PreparedGenerate prepare_generate(const tandem_generate_params* user, tandem_generate_result* result,
                                  const Tokenizer& tok, const char* fn) {
  PreparedGenerate g;
  tandem_generate_params p = default_generate_params();
  if (user != nullptr) read_struct(user, kGenerateParamsV01, p, fn, "tandem_generate_params");
  check_flags(p.flags, kGenerateFlags, fn);
  if (p.max_tokens < 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: max_tokens {} must be >= 0", fn, p.max_tokens));
  g.options.max_tokens = p.max_tokens;
  g.options.ignore_eos = (p.flags & TANDEM_GENERATE_IGNORE_EOS) != 0;
  g.parse_special = (p.flags & TANDEM_GENERATE_PARSE_SPECIAL) != 0;
  g.options.sampling = to_sampling(p.sampling, fn);
  g.options.stop = read_stops(p.stop, p.n_stop, fn);
  g.options.logprobs = read_logprobs(p.logprobs, p.reserved, fn);
  g.options.grammar = read_grammar(p.grammar, p.grammar_type, p.reserved2, tok, fn);
  if (g.options.grammar && g.options.ignore_eos) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: TANDEM_GENERATE_IGNORE_EOS cannot be combined with a grammar", fn));
  }
  if (result != nullptr) {
    g.result_bytes = out_struct_size(result, kGenerateResultV01, fn, "tandem_generate_result");
    std::memcpy(&g.result, result, g.result_bytes);
    if (g.result.tokens == nullptr && g.result.tokens_cap != 0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: result->tokens is NULL but tokens_cap is {}", fn, g.result.tokens_cap));
    }
    if (g.result.text == nullptr && g.result.text_cap != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: result->text is NULL but text_cap is {}", fn, g.result.text_cap));
    }
    if (g.result.logprobs == nullptr && g.result.logprobs_cap != 0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: result->logprobs is NULL but logprobs_cap is {}", fn, g.result.logprobs_cap));
    }
  }
  return g;
}

/// The token callback, plus the abort check of tandem_session_abort after each piece.
void attach_callback(PreparedGenerate& g, SessionObj& s, tandem_token_callback callback, void* user_data) {
  g.options.on_text = [&s, callback, user_data](std::string_view text, int32_t token) {
    if (callback != nullptr) {
      s.piece.assign(text.data(), text.size());  // NUL-terminated copy, reused between calls
      if (callback(s.piece.c_str(), s.piece.size(), token, user_data) != 0) return false;
    }
    return !s.abort.load(std::memory_order_relaxed);
  };
}

/// Session::generate with the prompt evaluated here, n_batch tokens at a time, so that
/// tandem_session_abort can stop a long prefill between chunks. Same results as
/// Session::generate(prompt, options): the same chunks reach the executor, the whole
/// prompt is checked (ids, context) before anything is evaluated.
GenerateResult generate_abortable(SessionObj& s, std::span<const int32_t> prompt, const GenerateOptions& options) {
  Session& session = *s.session;
  const int32_t n_vocab = session.model().hparams().n_vocab;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= n_vocab) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("generate: token id {} at index {} is outside the vocabulary [0, {})", prompt[i], i, n_vocab));
    }
  }
  const size_t before = session.tokens().size();
  // A pending sampled token (at most one) is evaluated with the first chunk. When the
  // prompt might not fit with it, leave the whole check to Session::generate, which
  // refuses an overflowing prompt before evaluating anything.
  const bool chunked = !prompt.empty() && before + prompt.size() + 1 <= size_t(session.n_ctx());
  if (!chunked) return session.generate(prompt, options);
  const auto t0 = std::chrono::steady_clock::now();
  GenerateResult cancelled;
  cancelled.finish = FinishReason::kCancelled;
  const size_t chunk = size_t(s.n_batch);
  for (size_t b = 0; b < prompt.size(); b += chunk) {
    if (s.abort.load(std::memory_order_relaxed)) {
      cancelled.n_prompt = int32_t(session.tokens().size() - before);
      return cancelled;
    }
    session.eval(prompt.subspan(b, std::min(chunk, prompt.size() - b)));
  }
  const double prompt_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int32_t n_prompt = int32_t(session.tokens().size() - before);  // the pending token included
  if (s.abort.load(std::memory_order_relaxed)) {
    cancelled.n_prompt = n_prompt;
    cancelled.prompt_seconds = prompt_seconds;
    return cancelled;
  }
  GenerateResult r = session.generate(std::span<const int32_t>(), options);
  r.n_prompt = n_prompt;
  r.prompt_seconds = prompt_seconds;
  return r;
}

void write_result(const GenerateResult& r, PreparedGenerate& g, tandem_generate_result* result) {
  if (result == nullptr) return;
  tandem_generate_result out = g.result;  // keeps the caller's buffer fields
  out.n_tokens = r.tokens.size();
  out.text_len = r.text.size();
  out.finish_reason = static_cast<int32_t>(r.finish);
  out.n_prompt = r.n_prompt;
  out.prompt_seconds = r.prompt_seconds;
  out.generate_seconds = r.generate_seconds;
  out.n_logprobs = r.logprobs.size();
  write_logprobs(r.logprobs, out.logprobs, out.logprobs_cap);
  if (out.tokens != nullptr) {
    std::copy_n(r.tokens.begin(), std::min(r.tokens.size(), out.tokens_cap), out.tokens);
  }
  if (out.text != nullptr && out.text_cap > 0) {
    size_t n = std::min(r.text.size(), out.text_cap - 1);
    if (n < r.text.size()) {
      while (n > 0 && (static_cast<unsigned char>(r.text[n]) & 0xC0u) == 0x80u) --n;  // character boundary
    }
    std::memcpy(out.text, r.text.data(), n);
    out.text[n] = '\0';
  }
  write_struct(result, out, g.result_bytes);
}

}  // namespace

namespace {

void fill_request_result(const RequestObj& r, tandem_request_result* result, const char* fn) {
  const size_t n = out_struct_size(result, kRequestResultV01, fn, "tandem_request_result");
  tandem_request_result out{};
  std::memcpy(&out, result, n);
  if (out.tokens == nullptr && out.tokens_cap != 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: result->tokens is NULL but tokens_cap is {}", fn, out.tokens_cap));
  }
  if (out.text == nullptr && out.text_cap != 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: result->text is NULL but text_cap is {}", fn, out.text_cap));
  }
  if (out.logprobs == nullptr && out.logprobs_cap != 0) {
    fail(TANDEM_E_INVALID_ARG,
         fmt::format("{}: result->logprobs is NULL but logprobs_cap is {}", fn, out.logprobs_cap));
  }
  out.id = r.handle.id();
  out.n_logprobs = 0;
  out.n_tokens = 0;
  out.text_len = 0;
  out.finished = 0;
  out.finish_reason = -1;
  out.status = TANDEM_OK;
  out.n_prompt = 0;
  out.message = "";
  out.queue_seconds = out.ttft_seconds = out.e2e_seconds = 0.0;
  if (r.handle.done()) {
    const RequestResult& rr = r.handle.wait();  // finished: returns at once
    out.finished = 1;
    out.finish_reason = static_cast<int32_t>(rr.finish);
    out.status = rr.finish == RequestFinish::kError ? static_cast<int32_t>(rr.error) : TANDEM_OK;
    if (rr.finish == RequestFinish::kError && out.status == TANDEM_OK) out.status = TANDEM_E_INTERNAL;
    out.message = rr.message.c_str();
    out.n_tokens = rr.tokens.size();
    out.text_len = rr.text.size();
    out.n_prompt = rr.metrics.prompt_tokens;
    out.queue_seconds = rr.metrics.queue_s;
    out.ttft_seconds = rr.metrics.ttft_s;
    out.e2e_seconds = rr.metrics.e2e_s;
    if (out.tokens != nullptr) std::copy_n(rr.tokens.begin(), std::min(rr.tokens.size(), out.tokens_cap), out.tokens);
    out.n_logprobs = rr.logprobs.size();
    write_logprobs(rr.logprobs, out.logprobs, out.logprobs_cap);
    if (out.text != nullptr && out.text_cap > 0) {
      size_t k = std::min(rr.text.size(), out.text_cap - 1);
      if (k < rr.text.size()) {
        while (k > 0 && (static_cast<unsigned char>(rr.text[k]) & 0xC0u) == 0x80u) --k;  // character boundary
      }
      std::memcpy(out.text, rr.text.data(), k);
      out.text[k] = '\0';
    }
  }
  write_struct(result, out, n);
}

/// One poll of tandem_request_poll: writes *event (kind NONE when nothing is there) and
/// returns true when it delivered a token or finish event.
bool poll_event(RequestObj& r, tandem_request_event* event, const char* fn) {
  require(event, fn, "event");
  const size_t n = out_struct_size(event, kRequestEventV01, fn, "tandem_request_event");
  tandem_request_event out{};
  std::memcpy(&out, event, n);
  if (out.text == nullptr && out.text_cap != 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: event->text is NULL but text_cap is {}", fn, out.text_cap));
  }
  std::lock_guard<std::mutex> lock(r.poll_mu);
  out.kind = TANDEM_EVENT_NONE;
  out.token = -1;
  out.finish_reason = -1;
  out.reserved = 0;
  out.text_len = 0;
  std::string_view text;
  bool taking = false;
  if (!r.have_pending && !r.finish_seen) {
    r.have_pending = r.handle.poll(r.pending, r.pending_text);
  }
  if (r.have_pending) {
    taking = true;
    text = r.pending_text;
    out.kind = r.pending.final ? TANDEM_EVENT_FINISH : TANDEM_EVENT_TOKEN;
    out.token = r.pending.final ? -1 : r.pending.token;
    out.finish_reason = r.pending.final ? static_cast<int32_t>(r.pending.finish) : -1;
  } else if (r.finish_seen) {
    out.kind = TANDEM_EVENT_FINISH;
    out.finish_reason = static_cast<int32_t>(r.finish);
  }
  out.text_len = text.size();
  if (out.text != nullptr) {
    if (out.text_cap < text.size() + 1) {
      event->text_len = text.size();  // the event stays first in line
      fail(TANDEM_E_BUFFER_TOO_SMALL, fmt::format("{}: event->text holds {} bytes, {} needed (the event is kept)", fn,
                                                  out.text_cap, text.size() + 1));
    }
    if (!text.empty()) std::memcpy(out.text, text.data(), text.size());
    out.text[text.size()] = '\0';
  }
  if (taking) {
    r.have_pending = false;
    if (r.pending.final) {
      r.finish_seen = true;
      r.finish = r.pending.finish;
    }
  }
  write_struct(event, out, n);
  return out.kind != TANDEM_EVENT_NONE;
}

}  // namespace

extern "C" {

// ---- library-wide ------------------------------------------------------------------------

const char* tandem_version(void) {
  return TANDEM_VERSION_STRING;
}

const char* tandem_last_error(void) {
  return last_error();
}

const char* tandem_status_name(tandem_status status) {
  // 0..99 are tandem::ErrorCode's numbers: its table (lib/core/error.cpp) is the one name table;
  // only the codes of the C boundary itself are named here.
  switch (status) {
    case TANDEM_E_INVALID_HANDLE:
      return "INVALID_HANDLE";
    case TANDEM_E_BUSY:
      return "BUSY";
    case TANDEM_E_BUFFER_TOO_SMALL:
      return "BUFFER_TOO_SMALL";
    case TANDEM_E_UNSUPPORTED:
      return "UNSUPPORTED";
    default:
      break;
  }
  if (status >= 0 && status < 100) return error_code_name(static_cast<ErrorCode>(status)).data();  // literals
  return "UNKNOWN";
}

// ---- model ---------------------------------------------------------------------------------

tandem_status tandem_model_params_init(tandem_model_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kModelParamsV01, default_model_params(), "tandem_model_params_init",
                "tandem_model_params");
  });
}

tandem_status tandem_model_load(const char* path, const tandem_model_params* params, tandem_model** out_model) {
  static constexpr const char* fn = "tandem_model_load";
  if (out_model != nullptr) *out_model = nullptr;
  return guard([&] {
    require(out_model, fn, "out_model");
    require(path, fn, "path");
    tandem_model_params p = default_model_params();
    if (params != nullptr) read_struct(params, kModelParamsV01, p, fn, "tandem_model_params");
    ModelOptions options;
    options.gguf.check_block_scales = p.check_block_scales != 0;
    options.gguf.max_alignment = p.max_alignment;
    auto obj = std::make_shared<ModelObj>();
    obj->model = Model::load(path, options);
    obj->name = obj->model->name();
    *out_model = reinterpret_cast<tandem_model*>(Registry::instance().add(Kind::kModel, std::move(obj)));
  });
}

tandem_status tandem_model_free(tandem_model* model) {
  return guard([&] {
    if (model == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(model), Kind::kModel);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_model_free: model handle {:#x} is not live (double free?)",
                                                reinterpret_cast<uintptr_t>(model)));
    }
  });
}

tandem_status tandem_model_info_init(tandem_model_info* info, size_t struct_size) {
  return guard([&] {
    init_struct(info, struct_size, kModelInfoV01, zeroed<tandem_model_info>(), "tandem_model_info_init",
                "tandem_model_info");
  });
}

tandem_status tandem_model_get_info(const tandem_model* model, tandem_model_info* info) {
  static constexpr const char* fn = "tandem_model_get_info";
  return guard([&] {
    auto m = get_model(model, fn);
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kModelInfoV01, fn, "tandem_model_info");
    const HParams& hp = m->model->hparams();
    const Tokenizer& tok = m->model->tokenizer();
    tandem_model_info out{};
    out.arch = arch_name(hp.arch).data();  // string literals: NUL-terminated, static
    out.name = m->name.c_str();
    out.n_vocab = hp.n_vocab;
    out.n_ctx_train = hp.n_ctx_train;
    out.n_embd = hp.n_embd;
    out.n_layer = hp.n_layer;
    out.n_head = hp.n_head;
    out.n_head_kv = hp.n_head_kv;
    out.token_bos = tok.bos();
    out.token_eos = tok.eos();
    out.weight_bytes = m->model->weight_bytes();
    write_struct(info, out, n);
  });
}

tandem_status tandem_model_identity_hash(const tandem_model* model, uint64_t* out_hash) {
  static constexpr const char* fn = "tandem_model_identity_hash";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_hash, fn, "out_hash");
    *out_hash = m->model->identity_hash();
  });
}

// ---- tokenizer ---------------------------------------------------------------------------

tandem_status tandem_tokenize(const tandem_model* model, const char* text, size_t text_len, uint32_t flags,
                              int32_t* tokens, size_t capacity, size_t* out_n_tokens) {
  static constexpr const char* fn = "tandem_tokenize";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_n_tokens, fn, "out_n_tokens");
    if (text == nullptr && text_len != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: text is NULL but text_len is {}", fn, text_len));
    }
    check_flags(flags, kTokenizeFlags, fn);
    const std::string_view sv = text_len == 0 ? std::string_view() : std::string_view(text, text_len);
    check_utf8(sv, fn, "text");
    const auto ids = m->model->tokenizer().tokenize(sv, (flags & TANDEM_TOKENIZE_ADD_SPECIAL) != 0,
                                                    (flags & TANDEM_TOKENIZE_PARSE_SPECIAL) != 0);
    *out_n_tokens = ids.size();
    if (check_capacity(tokens, capacity, ids.size(), fn, "tokens")) std::copy(ids.begin(), ids.end(), tokens);
  });
}

tandem_status tandem_detokenize(const tandem_model* model, const int32_t* tokens, size_t n_tokens, uint32_t flags,
                                char* buf, size_t capacity, size_t* out_len) {
  static constexpr const char* fn = "tandem_detokenize";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_len, fn, "out_len");
    if (tokens == nullptr && n_tokens != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: tokens is NULL but n_tokens is {}", fn, n_tokens));
    }
    check_flags(flags, kDetokenizeFlags, fn);
    const std::span<const int32_t> ids(tokens, n_tokens);
    const int32_t n_vocab = m->model->tokenizer().n_vocab();
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= n_vocab) {
        fail(TANDEM_E_INVALID_ARG,
             fmt::format("{}: token id {} at index {} is outside the vocabulary [0, {})", fn, ids[i], i, n_vocab));
      }
    }
    const std::string text = m->model->tokenizer().detokenize(ids, (flags & TANDEM_DETOKENIZE_REMOVE_SPECIAL) != 0,
                                                              (flags & TANDEM_DETOKENIZE_UNPARSE_SPECIAL) != 0);
    write_text(text, buf, capacity, out_len, fn);
  });
}

tandem_status tandem_token_to_piece(const tandem_model* model, int32_t token, uint32_t flags, char* buf,
                                    size_t capacity, size_t* out_len) {
  static constexpr const char* fn = "tandem_token_to_piece";
  return guard([&] {
    auto m = get_model(model, fn);
    require(out_len, fn, "out_len");
    check_flags(flags, kDetokenizeFlags, fn);
    const std::string piece =
        m->model->tokenizer().token_to_piece(token, (flags & TANDEM_DETOKENIZE_UNPARSE_SPECIAL) != 0);
    write_text(piece, buf, capacity, out_len, fn);
  });
}

// ---- session -------------------------------------------------------------------------------

tandem_status tandem_session_params_init(tandem_session_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kSessionParamsV01, default_session_params(), "tandem_session_params_init",
                "tandem_session_params");
  });
}

tandem_status tandem_session_create(const tandem_model* model, const tandem_session_params* params,
                                    tandem_session** out_session) {
  static constexpr const char* fn = "tandem_session_create";
  if (out_session != nullptr) *out_session = nullptr;
  return guard([&] {
    require(out_session, fn, "out_session");
    auto m = get_model(model, fn);
    tandem_session_params p = default_session_params();
    if (params != nullptr) read_struct(params, kSessionParamsV01, p, fn, "tandem_session_params");
    if (p.n_ctx < 0 || p.n_batch < 1 || p.page_size < 1 || p.n_threads < 0 || p.n_threads > kMaxThreads) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: n_ctx {} must be >= 0, n_batch {} and page_size {} >= 1, n_threads {} in [0, {}]", fn,
                       p.n_ctx, p.n_batch, p.page_size, p.n_threads, kMaxThreads));
    }
    if (p.kv_tier != TANDEM_KV_HOST && p.kv_tier != TANDEM_KV_FILE) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: kv_tier {} must be TANDEM_KV_HOST (1) or TANDEM_KV_FILE (2) for a "
                                             "session",
                                             fn, p.kv_tier));
    }
    if (p.kv_dtype != TANDEM_KV_F16 && p.kv_dtype != TANDEM_KV_F32 && p.kv_dtype != TANDEM_KV_Q8_0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: kv_dtype {} is not a tandem_kv_dtype (0 f32, 1 f16, 2 q8_0)", fn, p.kv_dtype));
    }
    std::shared_ptr<PoolObj> pool;
    if (p.pool != nullptr) {
      pool = get_pool(p.pool, fn);
      if (p.n_threads != 0) {
        fail(TANDEM_E_INVALID_ARG,
             fmt::format("{}: n_threads {} with a pool: set one of them (the pool has its threads)", fn, p.n_threads));
      }
    }
    const HParams& hp = m->model->hparams();
    const int64_t n_ctx = p.n_ctx > 0 ? p.n_ctx : default_context_size(hp);
    if (n_ctx > int64_t(std::numeric_limits<int32_t>::max()) - p.page_size) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: n_ctx {} with page_size {} overflows the page count", fn, p.n_ctx, p.page_size));
    }
    // Refuse a KV cache that cannot fit in physical memory before allocating it (the
    // pool is zero-filled at creation, so all of it would be touched at once).
    const double n_pages = std::ceil(double(n_ctx) / double(p.page_size));
    const double elem_bytes = p.kv_dtype == TANDEM_KV_F16    ? 2.0
                              : p.kv_dtype == TANDEM_KV_Q8_0 ? double(kKvQ8BlockBytes) / double(kKvQ8Block)
                                                             : 4.0;
    const double kv_bytes = n_pages * double(p.page_size) * double(hp.n_layer) * 2.0 * double(hp.n_head_kv) *
                            double(std::max(hp.head_dim, hp.head_dim_v)) * elem_bytes;
    const double phys = physical_memory_bytes();
    if (p.kv_tier == TANDEM_KV_HOST && kv_bytes > phys) {
      fail(TANDEM_E_OUT_OF_MEMORY,
           fmt::format("{}: a KV cache of {} positions needs {:.3g} bytes, more than the {:.3g} bytes of physical "
                       "memory",
                       fn, n_ctx, kv_bytes, phys));
    }
    auto s = std::make_shared<SessionObj>();
    s->model = m;
    if (pool) {
      s->executor = std::make_unique<CpuQ4Executor>(m->model, pool->pool);
    } else {
      CpuExecutorOptions exec_options;
      exec_options.n_threads = p.n_threads;
      s->executor = std::make_unique<CpuQ4Executor>(m->model, exec_options);
    }
    SessionOptions session_options;
    session_options.n_ctx = p.n_ctx;
    session_options.n_batch = p.n_batch;
    session_options.page_size = p.page_size;
    session_options.kv_tier = static_cast<KvTier>(p.kv_tier);
    session_options.kv_dtype = static_cast<KvDtype>(p.kv_dtype);
    if (p.kv_dir != nullptr) session_options.kv_dir = std::filesystem::path(p.kv_dir);
    s->session = std::make_unique<Session>(m->model, *s->executor, session_options);
    s->n_batch = p.n_batch;
    s->page_size = p.page_size;
    *out_session = reinterpret_cast<tandem_session*>(Registry::instance().add(Kind::kSession, std::move(s)));
  });
}

tandem_status tandem_session_free(tandem_session* session) {
  return guard([&] {
    if (session == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(session), Kind::kSession);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_session_free: session handle {:#x} is not live (double free?)",
                                                reinterpret_cast<uintptr_t>(session)));
    }
  });
}

tandem_status tandem_session_info_init(tandem_session_info* info, size_t struct_size) {
  return guard([&] {
    init_struct(info, struct_size, kSessionInfoV01, zeroed<tandem_session_info>(), "tandem_session_info_init",
                "tandem_session_info");
  });
}

tandem_status tandem_session_get_info(const tandem_session* session, tandem_session_info* info) {
  static constexpr const char* fn = "tandem_session_get_info";
  return guard([&] {
    auto s = get_session(session, fn);
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kSessionInfoV01, fn, "tandem_session_info");
    BusyGuard busy(*s, fn);
    tandem_session_info out{};
    out.n_ctx = s->session->n_ctx();
    out.n_tokens = static_cast<int32_t>(s->session->tokens().size());
    out.n_batch = s->n_batch;
    out.page_size = s->page_size;
    out.n_threads = s->executor->n_threads();
    out.has_logits = s->session->logits().empty() ? 0 : 1;
    write_struct(info, out, n);
  });
}

tandem_status tandem_session_reset(tandem_session* session) {
  static constexpr const char* fn = "tandem_session_reset";
  return guard([&] {
    auto s = get_session(session, fn);
    BusyGuard busy(*s, fn);
    s->session->reset();
  });
}

tandem_status tandem_session_eval(tandem_session* session, const int32_t* tokens, size_t n_tokens, float* logits,
                                  size_t capacity) {
  static constexpr const char* fn = "tandem_session_eval";
  return guard([&] {
    auto s = get_session(session, fn);
    if (tokens == nullptr && n_tokens != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: tokens is NULL but n_tokens is {}", fn, n_tokens));
    }
    check_count(n_tokens, fn, "n_tokens");
    BusyGuard busy(*s, fn);
    const size_t n_vocab = size_t(s->session->model().hparams().n_vocab);
    std::span<float> out;
    if (check_capacity(logits, capacity, n_tokens * n_vocab, fn, "logits") && n_tokens > 0) {
      out = std::span<float>(logits, n_tokens * n_vocab);
    }
    s->session->eval(std::span<const int32_t>(tokens, n_tokens), out);
  });
}

tandem_status tandem_session_get_logits(const tandem_session* session, float* logits, size_t capacity, size_t* out_n) {
  static constexpr const char* fn = "tandem_session_get_logits";
  return guard([&] {
    auto s = get_session(session, fn);
    require(out_n, fn, "out_n");
    BusyGuard busy(*s, fn);
    const auto l = s->session->logits();
    *out_n = l.size();
    if (check_capacity(logits, capacity, l.size(), fn, "logits")) std::copy(l.begin(), l.end(), logits);
  });
}

tandem_status tandem_session_get_tokens(const tandem_session* session, int32_t* tokens, size_t capacity,
                                        size_t* out_n) {
  static constexpr const char* fn = "tandem_session_get_tokens";
  return guard([&] {
    auto s = get_session(session, fn);
    require(out_n, fn, "out_n");
    BusyGuard busy(*s, fn);
    const auto& t = s->session->tokens();
    *out_n = t.size();
    if (check_capacity(tokens, capacity, t.size(), fn, "tokens")) std::copy(t.begin(), t.end(), tokens);
  });
}

// ---- sampling and generation ----------------------------------------------------------------

tandem_status tandem_sampling_params_init(tandem_sampling_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kSamplingParamsV01, default_sampling_params(), "tandem_sampling_params_init",
                "tandem_sampling_params");
  });
}

tandem_status tandem_generate_params_init(tandem_generate_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kGenerateParamsV01, default_generate_params(), "tandem_generate_params_init",
                "tandem_generate_params");
  });
}

tandem_status tandem_generate_result_init(tandem_generate_result* result, size_t struct_size) {
  return guard([&] {
    init_struct(result, struct_size, kGenerateResultV01, zeroed<tandem_generate_result>(),
                "tandem_generate_result_init", "tandem_generate_result");
  });
}

tandem_status tandem_session_generate(tandem_session* session, const char* prompt_utf8,
                                      const tandem_generate_params* params, tandem_token_callback callback,
                                      void* user_data, tandem_generate_result* result) {
  static constexpr const char* fn = "tandem_session_generate";
  return guard([&] {
    auto s = get_session(session, fn);
    require(prompt_utf8, fn, "prompt_utf8");
    const std::string_view prompt(prompt_utf8);
    check_utf8(prompt, fn, "the prompt");
    PreparedGenerate g = prepare_generate(params, result, s->session->model().tokenizer(), fn);
    BusyGuard busy(*s, fn);
    attach_callback(g, *s, callback, user_data);
    // BOS when the conversation is empty (as Session::generate(text) adds it).
    const auto ids = s->session->model().tokenizer().tokenize(prompt, s->session->tokens().empty(), g.parse_special);
    const GenerateResult r = generate_abortable(*s, ids, g.options);
    write_result(r, g, result);
  });
}

tandem_status tandem_session_generate_tokens(tandem_session* session, const int32_t* prompt, size_t n_prompt,
                                             const tandem_generate_params* params, tandem_token_callback callback,
                                             void* user_data, tandem_generate_result* result) {
  static constexpr const char* fn = "tandem_session_generate_tokens";
  return guard([&] {
    auto s = get_session(session, fn);
    if (prompt == nullptr && n_prompt != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: prompt is NULL but n_prompt is {}", fn, n_prompt));
    }
    check_count(n_prompt, fn, "n_prompt");
    PreparedGenerate g = prepare_generate(params, result, s->session->model().tokenizer(), fn);
    BusyGuard busy(*s, fn);
    attach_callback(g, *s, callback, user_data);
    const GenerateResult r = generate_abortable(*s, std::span<const int32_t>(prompt, n_prompt), g.options);
    write_result(r, g, result);
  });
}

tandem_status tandem_session_abort(tandem_session* session) {
  static constexpr const char* fn = "tandem_session_abort";
  return guard([&] {
    auto s = get_session(session, fn);
    std::lock_guard<std::mutex> lock(s->abort_mu);
    if (s->busy.load(std::memory_order_acquire)) s->abort.store(true, std::memory_order_relaxed);
  });
}

// ---- session save / restore ----------------------------------------------------------------

tandem_status tandem_session_save(const tandem_session* session, const char* path) {
  static constexpr const char* fn = "tandem_session_save";
  return guard([&] {
    auto s = get_session(session, fn);
    require(path, fn, "path");
    if (*path == '\0') fail(TANDEM_E_INVALID_ARG, fmt::format("{}: path is empty", fn));
    BusyGuard busy(*s, fn);
    s->session->save(std::filesystem::path(path));
  });
}

tandem_status tandem_session_restore(tandem_session* session, const char* path) {
  static constexpr const char* fn = "tandem_session_restore";
  return guard([&] {
    auto s = get_session(session, fn);
    require(path, fn, "path");
    if (*path == '\0') fail(TANDEM_E_INVALID_ARG, fmt::format("{}: path is empty", fn));
    BusyGuard busy(*s, fn);
    s->session->restore(std::filesystem::path(path));  // all-or-nothing (Session::restore)
  });
}

// ---- scheduler -----------------------------------------------------------------------------

tandem_status tandem_executor_params_init(tandem_executor_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kExecutorParamsV01, default_executor_params(), "tandem_executor_params_init",
                "tandem_executor_params");
  });
}

tandem_status tandem_scheduler_params_init(tandem_scheduler_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kSchedulerParamsV01, default_scheduler_params(), "tandem_scheduler_params_init",
                "tandem_scheduler_params");
  });
}

tandem_status tandem_request_params_init(tandem_request_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kRequestParamsV01, default_request_params(), "tandem_request_params_init",
                "tandem_request_params");
  });
}

tandem_status tandem_request_event_init(tandem_request_event* event, size_t struct_size) {
  return guard([&] {
    tandem_request_event d = zeroed<tandem_request_event>();
    d.token = -1;
    d.finish_reason = -1;
    init_struct(event, struct_size, kRequestEventV01, d, "tandem_request_event_init", "tandem_request_event");
  });
}

tandem_status tandem_request_result_init(tandem_request_result* result, size_t struct_size) {
  return guard([&] {
    tandem_request_result d = zeroed<tandem_request_result>();
    d.finish_reason = -1;
    init_struct(result, struct_size, kRequestResultV01, d, "tandem_request_result_init", "tandem_request_result");
  });
}

tandem_status tandem_scheduler_create(const tandem_model* model, const tandem_scheduler_params* params,
                                      tandem_scheduler** out_scheduler) {
  static constexpr const char* fn = "tandem_scheduler_create";
  if (out_scheduler != nullptr) *out_scheduler = nullptr;
  return guard([&] {
    require(out_scheduler, fn, "out_scheduler");
    auto m = get_model(model, fn);
    tandem_scheduler_params p = default_scheduler_params();
    if (params != nullptr) read_struct(params, kSchedulerParamsV01, p, fn, "tandem_scheduler_params");
    constexpr size_t kMaxExecutors = 64;
    if (p.n_executors < 1 || p.n_executors > kMaxExecutors) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: n_executors {} must be in [1, {}]", fn, p.n_executors, kMaxExecutors));
    }
    if (p.max_queued < 0 || p.max_context < 0 || p.prefix_cache_entries < 0 || p.page_size < 1) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: max_queued {}, max_context {} and prefix_cache_entries {} must be >= 0, page_size {} >= 1",
                       fn, p.max_queued, p.max_context, p.prefix_cache_entries, p.page_size));
    }
    if (p.reserved != 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: reserved must be 0", fn));
    std::vector<tandem_executor_params> ex(p.n_executors, default_executor_params());
    if (p.executors != nullptr) {
      size_t stride = 0;
      std::memcpy(&stride, p.executors, sizeof stride);
      if (stride < kExecutorParamsV01) {
        fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[0].struct_size {} is smaller than {} (use "
                                               "tandem_executor_params_init)",
                                               fn, stride, kExecutorParamsV01));
      }
      const auto* base = reinterpret_cast<const unsigned char*>(p.executors);
      for (size_t i = 0; i < p.n_executors; ++i) {
        const auto* e = reinterpret_cast<const tandem_executor_params*>(base + i * stride);
        size_t n = 0;
        std::memcpy(&n, e, sizeof n);
        if (n != stride) {
          fail(TANDEM_E_INVALID_ARG,
               fmt::format("{}: executors[{}].struct_size {} differs from executors[0]'s {}", fn, i, n, stride));
        }
        read_struct(e, kExecutorParamsV01, ex[i], fn, "tandem_executor_params");
      }
    }
    std::vector<std::shared_ptr<ExecutorObj>> given(p.n_executors);
    if (p.executor_handles != nullptr) {
      for (size_t i = 0; i < p.n_executors; ++i) {
        given[i] = get_executor(p.executor_handles[i], fn);
        if (given[i]->model->model != m->model) {
          fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executor_handles[{}] was created for another model", fn, i));
        }
        for (size_t j = 0; j < i; ++j) {
          if (given[j] == given[i]) {
            fail(TANDEM_E_INVALID_ARG,
                 fmt::format("{}: executor_handles[{}] and [{}] are the same executor", fn, j, i));
          }
        }
        ex[i].device_kind = given[i]->device_kind;
        ex[i].device_id = given[i]->device_id;
      }
    }
    for (size_t i = 0; i < ex.size(); ++i) check_executor_params(ex[i], i, fn);
    const HParams& hp = m->model->hparams();
    const int64_t n_ctx = p.max_context > 0 ? p.max_context : default_context_size(hp);
    // The scheduler reserves the pages of prompt + max_tokens plus one (copy-on-write of a
    // shared last page) per sequence.
    const int64_t pages_per_seq = (n_ctx + p.page_size - 1) / p.page_size + 1;
    std::vector<int32_t> kv_pages(ex.size());
    double host_kv_bytes = 0.0;
    for (size_t i = 0; i < ex.size(); ++i) {
      const tandem_executor_params& e = ex[i];
      const int64_t pages = e.kv_pages > 0 ? int64_t(e.kv_pages) : int64_t(e.max_running) * pages_per_seq;
      if (pages > int64_t(std::numeric_limits<int32_t>::max())) {
        fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[{}]: {} KV pages (max_running {} x {} pages) is too many",
                                               fn, i, pages, e.max_running, pages_per_seq));
      }
      kv_pages[i] = int32_t(pages);
      const KvLayout layout = KvLayout::for_model(hp, p.page_size, static_cast<KvDtype>(e.kv_dtype));
      if (e.device_kind == TANDEM_DEVICE_CPU) host_kv_bytes += double(pages) * double(layout.page_bytes());
    }
    const double phys = physical_memory_bytes();
    if (host_kv_bytes > phys) {
      fail(TANDEM_E_OUT_OF_MEMORY,
           fmt::format("{}: the KV stores need {:.3g} bytes, more than the {:.3g} bytes of physical memory (set "
                       "kv_pages or max_context)",
                       fn, host_kv_bytes, phys));
    }
    auto obj = std::make_shared<SchedulerObj>();
    obj->model = m;
    // Take the given executors (one scheduler each); the destructor hands them back.
    for (size_t i = 0; i < given.size(); ++i) {
      if (!given[i]) continue;
      if (given[i]->in_use.exchange(true, std::memory_order_acq_rel)) {
        fail(TANDEM_E_BUSY, fmt::format("{}: executor_handles[{}] is in use by another scheduler", fn, i));
      }
      obj->executors.push_back(given[i]);
    }
    SchedulerOptions so;
    so.max_queued = p.max_queued;
    so.max_context = p.max_context;
    so.prefix_cache_entries = p.prefix_cache_entries;
    if (p.log_routing != 0) so.log = [](std::string_view line) { log_line(TANDEM_LOG_DEBUG, line); };
    std::vector<std::shared_ptr<ExecutorObj>> used(ex.size());
    for (size_t i = 0, k = 0; i < ex.size(); ++i) {
      if (given[i]) {
        used[i] = obj->executors[k++];
      } else {
        used[i] = make_executor(m, ex[i], fn);
        used[i]->in_use.store(true, std::memory_order_release);
        obj->executors.push_back(used[i]);
      }
    }
    for (size_t i = 0; i < ex.size(); ++i) {
      const tandem_executor_params& e = ex[i];
      KvStoreOptions ko;
      ko.layout = KvLayout::for_model(hp, p.page_size, static_cast<KvDtype>(e.kv_dtype));
      ko.file_pages = e.kv_file_pages;
      if (e.kv_dir != nullptr) ko.file_dir = std::filesystem::path(e.kv_dir);
      if (e.device_kind == TANDEM_DEVICE_CUDA) {
#if defined(TANDEM_HAVE_CUDA)
        ko.device =
            static_cast<const GpuQ4Executor&>(*used[i]->executor).make_kv_device_backend(ko.layout, kv_pages[i]);
#endif
      } else {
        ko.host_pages = kv_pages[i];
      }
      obj->stores.push_back(std::make_shared<KvStore>(std::move(ko)));
      log_line(TANDEM_LOG_INFO, fmt::format("scheduler: executor {} ({}) with {} KV pages of {} tokens ({}), {} File "
                                            "pages",
                                            i, used[i]->executor->name(), kv_pages[i], p.page_size,
                                            kv_dtype_name(static_cast<KvDtype>(e.kv_dtype)), e.kv_file_pages));
      ExecutorConfig c;
      c.executor = used[i]->executor.get();
      c.store = obj->stores.back();
      c.max_running = e.max_running;
      c.step_token_budget = e.step_token_budget;
      c.prefill_chunk = e.prefill_chunk;
      if (e.accelerator >= 0) c.accelerator = e.accelerator == 1;
      c.name = fmt::format("{}{}", used[i]->executor->name(), i);
      so.executors.push_back(std::move(c));
    }
    obj->scheduler = std::make_unique<Scheduler>(std::move(so));
    *out_scheduler = reinterpret_cast<tandem_scheduler*>(Registry::instance().add(Kind::kScheduler, std::move(obj)));
  });
}

tandem_status tandem_scheduler_free(tandem_scheduler* scheduler) {
  return guard([&] {
    if (scheduler == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(scheduler), Kind::kScheduler);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE,
           fmt::format("tandem_scheduler_free: scheduler handle {:#x} is not live (double free?)",
                       reinterpret_cast<uintptr_t>(scheduler)));
    }
    // Cancel outstanding requests now, even when another thread still holds the object.
    std::static_pointer_cast<SchedulerObj>(obj)->scheduler->shutdown();
  });
}

namespace {

/// tandem_request_params -> a Scheduler request (without its callback); throws the C
/// ABI's errors naming `fn`.
Request request_from_params(const SchedulerObj& s, const tandem_request_params* params, const char* fn) {
  const SchedulerObj* sc = &s;
  require(params, fn, "params");
  tandem_request_params p = default_request_params();
  read_struct(params, kRequestParamsV01, p, fn, "tandem_request_params");
  check_flags(p.flags, kGenerateFlags, fn);
  if (p.max_tokens < 1) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: max_tokens {} must be >= 1", fn, p.max_tokens));
  if (p.deadline_ms < 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: deadline_ms {} must be >= 0 (0 = none)", fn, p.deadline_ms));
  }
  if (p.sla < TANDEM_SLA_INTERACTIVE || p.sla > TANDEM_SLA_BATCH) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: sla {} is not a tandem_sla_class (0..2)", fn, p.sla));
  }
  Request r;
  if (p.prompt_tokens != nullptr) {
    if (p.n_prompt_tokens == 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: n_prompt_tokens is 0", fn));
    check_count(p.n_prompt_tokens, fn, "n_prompt_tokens");
    const int32_t n_vocab = sc->model->model->hparams().n_vocab;
    for (size_t i = 0; i < p.n_prompt_tokens; ++i) {
      const int32_t id = p.prompt_tokens[i];
      if (id < 0 || id >= n_vocab) {
        fail(TANDEM_E_INVALID_ARG,
             fmt::format("{}: prompt_tokens[{}] = {} is outside the vocabulary [0, {})", fn, i, id, n_vocab));
      }
    }
    r.prompt_ids.assign(p.prompt_tokens, p.prompt_tokens + p.n_prompt_tokens);
  } else {
    if (p.n_prompt_tokens != 0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: prompt_tokens is NULL but n_prompt_tokens is {}", fn, p.n_prompt_tokens));
    }
    if (p.prompt == nullptr) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: prompt and prompt_tokens are NULL", fn));
    r.prompt_text = p.prompt;
    check_utf8(r.prompt_text, fn, "the prompt");
  }
  r.parse_special = (p.flags & TANDEM_GENERATE_PARSE_SPECIAL) != 0;
  r.ignore_eos = (p.flags & TANDEM_GENERATE_IGNORE_EOS) != 0;
  r.sampling = to_sampling(p.sampling, fn);
  r.max_tokens = p.max_tokens;
  r.stop = read_stops(p.stop, p.n_stop, fn);
  r.sla = static_cast<SlaClass>(p.sla);
  if (p.deadline_ms > 0) r.deadline = Clock::now() + std::chrono::milliseconds(p.deadline_ms);
  r.session = p.session;
  r.logprobs = read_logprobs(p.logprobs, p.reserved, fn);
  r.grammar = read_grammar(p.grammar, p.grammar_type, p.reserved2, sc->model->model->tokenizer(), fn);
  if (r.grammar && r.ignore_eos) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: TANDEM_GENERATE_IGNORE_EOS cannot be combined with a grammar", fn));
  }
  return r;
}

}  // namespace

tandem_status tandem_scheduler_submit(tandem_scheduler* scheduler, const tandem_request_params* params,
                                      tandem_request** out_request) {
  static constexpr const char* fn = "tandem_scheduler_submit";
  if (out_request != nullptr) *out_request = nullptr;
  return guard([&] {
    require(out_request, fn, "out_request");
    auto sc = get_scheduler(scheduler, fn);
    Request r = request_from_params(*sc, params, fn);
    auto obj = std::make_shared<RequestObj>();
    r.on_event = [signal = obj->signal](const RequestEvent&) {
      {
        std::lock_guard<std::mutex> lock(signal->mu);
        ++signal->seq;
      }
      signal->cv.notify_all();
      return true;
    };
    obj->scheduler = sc;
    obj->handle = sc->scheduler->submit(std::move(r));  // kInvalidArgument after shutdown
    *out_request = reinterpret_cast<tandem_request*>(Registry::instance().add(Kind::kRequest, std::move(obj)));
  });
}

tandem_status tandem_scheduler_submit_n(tandem_scheduler* scheduler, const tandem_request_params* params, uint32_t n,
                                        tandem_request** out_requests) {
  static constexpr const char* fn = "tandem_scheduler_submit_n";
  if (out_requests != nullptr) {
    for (uint32_t i = 0; i < n && i <= uint32_t(Scheduler::kMaxChoices); ++i) out_requests[i] = nullptr;
  }
  return guard([&] {
    require(out_requests, fn, "out_requests");
    if (n < 1 || n > uint32_t(Scheduler::kMaxChoices)) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: n {} must be in [1, {}]", fn, n, Scheduler::kMaxChoices));
    }
    auto sc = get_scheduler(scheduler, fn);
    Request r = request_from_params(*sc, params, fn);
    if (n > 1 && r.session != 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: n > 1 cannot continue a session", fn));
    std::vector<std::shared_ptr<RequestObj>> objs;
    for (uint32_t i = 0; i < n; ++i) {
      objs.push_back(std::make_shared<RequestObj>());
      objs.back()->scheduler = sc;
    }
    std::vector<std::shared_ptr<EventSignal>> signals;
    for (const auto& o : objs) signals.push_back(o->signal);
    r.on_event = [signals = std::move(signals)](const RequestEvent& e) {
      EventSignal& signal = *signals[size_t(e.choice)];
      {
        std::lock_guard<std::mutex> lock(signal.mu);
        ++signal.seq;
      }
      signal.cv.notify_all();
      return true;
    };
    auto handles = sc->scheduler->submit_n(std::move(r), int32_t(n));  // kInvalidArgument after shutdown
    for (uint32_t i = 0; i < n; ++i) {
      objs[i]->handle = handles[i];
      out_requests[i] = reinterpret_cast<tandem_request*>(Registry::instance().add(Kind::kRequest, objs[i]));
    }
  });
}

tandem_status tandem_scheduler_session_open(tandem_scheduler* scheduler, uint64_t* out_session) {
  static constexpr const char* fn = "tandem_scheduler_session_open";
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(out_session, fn, "out_session");
    *out_session = sc->scheduler->open_session();
  });
}

tandem_status tandem_scheduler_session_close(tandem_scheduler* scheduler, uint64_t session) {
  static constexpr const char* fn = "tandem_scheduler_session_close";
  return guard([&] { get_scheduler(scheduler, fn)->scheduler->close_session(session); });
}

tandem_status tandem_scheduler_session_info_init(tandem_scheduler_session_info* info, size_t struct_size) {
  return guard([&] {
    init_struct(info, struct_size, kSchedulerSessionInfoV01, zeroed<tandem_scheduler_session_info>(),
                "tandem_scheduler_session_info_init", "tandem_scheduler_session_info");
  });
}

tandem_status tandem_scheduler_session_get_info(tandem_scheduler* scheduler, uint64_t session,
                                                tandem_scheduler_session_info* info) {
  static constexpr const char* fn = "tandem_scheduler_session_get_info";
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kSchedulerSessionInfoV01, fn, "tandem_scheduler_session_info");
    const Scheduler::SessionInfo si = sc->scheduler->session_info(session);
    tandem_scheduler_session_info out{};
    out.n_tokens = si.n_tokens;
    out.kv_tokens = si.kv_tokens;
    out.executor = si.executor;
    out.busy = si.busy ? 1 : 0;
    out.pages_device = si.pages[int(KvTier::kDevice)];
    out.pages_host = si.pages[int(KvTier::kHost)];
    out.pages_file = si.pages[int(KvTier::kFile)];
    write_struct(info, out, n);
  });
}

tandem_status tandem_scheduler_session_park(tandem_scheduler* scheduler, uint64_t session) {
  static constexpr const char* fn = "tandem_scheduler_session_park";
  return guard([&] {
    if (!get_scheduler(scheduler, fn)->scheduler->park_session(session)) {
      fail(TANDEM_E_BUSY,
           fmt::format("{}: a request is running on session {} (park it between requests)", fn, session));
    }
  });
}

tandem_status tandem_scheduler_session_unpark(tandem_scheduler* scheduler, uint64_t session) {
  static constexpr const char* fn = "tandem_scheduler_session_unpark";
  return guard([&] {
    if (!get_scheduler(scheduler, fn)->scheduler->unpark_session(session)) {
      fail(TANDEM_E_BUSY, fmt::format("{}: a request is running on session {}", fn, session));
    }
  });
}

tandem_status tandem_scheduler_drain(tandem_scheduler* scheduler) {
  static constexpr const char* fn = "tandem_scheduler_drain";
  return guard([&] { get_scheduler(scheduler, fn)->scheduler->drain(); });
}

tandem_status tandem_scheduler_shutdown(tandem_scheduler* scheduler) {
  static constexpr const char* fn = "tandem_scheduler_shutdown";
  return guard([&] { get_scheduler(scheduler, fn)->scheduler->shutdown(); });
}

tandem_status tandem_scheduler_metrics_json(const tandem_scheduler* scheduler, char* buf, size_t capacity,
                                            size_t* out_len) {
  static constexpr const char* fn = "tandem_scheduler_metrics_json";
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(out_len, fn, "out_len");
    write_text(sc->scheduler->metrics().to_json(), buf, capacity, out_len, fn);
  });
}

tandem_status tandem_request_poll(tandem_request* request, tandem_request_event* event) {
  static constexpr const char* fn = "tandem_request_poll";
  return guard([&] {
    auto r = get_request(request, fn);
    poll_event(*r, event, fn);
  });
}

tandem_status tandem_request_next_event(tandem_request* request, int32_t timeout_ms, tandem_request_event* event) {
  static constexpr const char* fn = "tandem_request_next_event";
  return guard([&] {
    auto r = get_request(request, fn);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
    EventSignal& signal = *r->signal;
    for (;;) {
      uint64_t seen = 0;
      {
        std::lock_guard<std::mutex> lock(signal.mu);
        seen = signal.seq;
      }
      if (poll_event(*r, event, fn) || timeout_ms == 0) return;
      std::unique_lock<std::mutex> lock(signal.mu);
      const auto moved = [&] { return signal.seq != seen; };
      if (timeout_ms < 0) {
        signal.cv.wait(lock, moved);
      } else if (!signal.cv.wait_until(lock, deadline, moved)) {
        lock.unlock();
        poll_event(*r, event, fn);  // a last look: the event may have come with the timeout
        return;
      }
    }
  });
}

tandem_status tandem_request_cancel(tandem_request* request) {
  static constexpr const char* fn = "tandem_request_cancel";
  return guard([&] {
    auto r = get_request(request, fn);
    if (r->handle.done()) return;
    if (auto sc = r->scheduler.lock()) sc->scheduler->cancel(r->handle);
  });
}

tandem_status tandem_request_wait(tandem_request* request, int32_t timeout_ms, tandem_request_result* result) {
  static constexpr const char* fn = "tandem_request_wait";
  return guard([&] {
    auto r = get_request(request, fn);
    if (result != nullptr) (void)out_struct_size(result, kRequestResultV01, fn, "tandem_request_result");
    if (timeout_ms < 0) {
      r->handle.wait();
    } else if (timeout_ms > 0) {
      r->handle.wait_for(std::chrono::milliseconds(timeout_ms));
    }
    if (result != nullptr) fill_request_result(*r, result, fn);
  });
}

tandem_status tandem_request_get_result(const tandem_request* request, tandem_request_result* result) {
  static constexpr const char* fn = "tandem_request_get_result";
  return guard([&] {
    auto r = get_request(request, fn);
    require(result, fn, "result");
    fill_request_result(*r, result, fn);
  });
}

tandem_status tandem_request_free(tandem_request* request) {
  return guard([&] {
    if (request == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(request), Kind::kRequest);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_request_free: request handle {:#x} is not live (double free?)",
                                                reinterpret_cast<uintptr_t>(request)));
    }
    auto r = std::static_pointer_cast<RequestObj>(obj);
    if (!r->handle.done()) {
      if (auto sc = r->scheduler.lock()) sc->scheduler->cancel(r->handle);
    }
  });
}

}  // extern "C"
