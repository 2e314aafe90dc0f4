// The C ABI (cabi/include/tandem.h) over the C++ library. Every function body runs inside
// capi::guard(), which turns exceptions into status codes; handles are looked up in the
// registry before anything is touched.
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cstddef>
#include <limits>
#include <string>
#include <vector>

#include "capi_internal.hpp"

using namespace tandem;
using namespace tandem::capi;

#include "tandem/grammar/grammar.hpp"
// ---- the status numbers are tandem::ErrorCode's ----------------------------------------

#define TANDEM_SAME_CODE(c_name, cpp_name)                                                                    \
  static_assert(c_name == static_cast<int32_t>(ErrorCode::cpp_name), /* NOLINT(bugprone-macro-parentheses) */ \
                #c_name " != ErrorCode::" #cpp_name)
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

// ---- struct sizes of version 0.1: no tail padding (capi_internal.hpp) ---------------------

#define TANDEM_NO_TAIL_PADDING(T, last) \
  static_assert(offsetof(T, last) + sizeof(T::last) == sizeof(T), #T " has tail padding")
TANDEM_NO_TAIL_PADDING(tandem_model_params,
                       chat_template);  // NOLINT(bugprone-sizeof-expression): the pointer is the member
TANDEM_NO_TAIL_PADDING(tandem_model_info, weight_bytes);
TANDEM_NO_TAIL_PADDING(tandem_session_params, pool);  // NOLINT(bugprone-sizeof-expression): the pointer is the member
TANDEM_NO_TAIL_PADDING(tandem_session_info, has_logits);
TANDEM_NO_TAIL_PADDING(tandem_sampling_params, seed);
TANDEM_NO_TAIL_PADDING(tandem_generate_params, reserved2);
TANDEM_NO_TAIL_PADDING(tandem_generate_result, n_logprobs);
TANDEM_NO_TAIL_PADDING(tandem_executor_params, pool);  // NOLINT(bugprone-sizeof-expression): the pointer is the member
TANDEM_NO_TAIL_PADDING(tandem_scheduler_params, reserved);
TANDEM_NO_TAIL_PADDING(tandem_request_params, reserved2);
TANDEM_NO_TAIL_PADDING(tandem_request_event, reserved);
TANDEM_NO_TAIL_PADDING(tandem_request_result, n_logprobs);
TANDEM_NO_TAIL_PADDING(tandem_token_logprob, top_logprobs);
static_assert(TANDEM_MAX_TOP_LOGPROBS == kMaxTopLogprobs);
TANDEM_NO_TAIL_PADDING(tandem_scheduler_session_info, reserved);
#undef TANDEM_NO_TAIL_PADDING

namespace tandem::capi {

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

}  // namespace tandem::capi

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

}  // extern "C"
