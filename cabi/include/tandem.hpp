// tandem.hpp -- a header-only C++17 layer over the C ABI (tandem.h), installed with it.
//
// It wraps every function of tandem.h (ctest c_abi_hpp_coverage checks that against
// cabi/abi/tandem.symbols). Move-only RAII classes own the C handles (as ONNX Runtime's
// onnxruntime_cxx_api.h does over its C API): Model, Pool, Session, Executor, Scheduler,
// Request. Each *_init function has a function returning the struct with its defaults
// (session_params(), request_params(), ...): change fields, then pass it on. Text and id
// results come back as std::string / std::vector (the C size query and buffer are done
// here); inputs are std::string / std::vector instead of pointer + length.
//
// Errors. A failed call throws tandem::c::Error carrying the tandem_status and the
// library's message (tandem_last_error of the calling thread); the status codes and the
// conditions that give them are the C functions' (tandem.h). A std::bad_alloc can come
// from the buffers made here. An exception thrown by a callback given to this layer
// (on_piece of Session::generate / generate_tokens, set_log's function) does not cross the C boundary:
// on_piece's exception stops the generation and is rethrown by the call; set_log's is
// swallowed.
//
// Thread-safety is the C ABI's (tandem.h): a Model, a Pool, an Executor, a Scheduler and
// a Request may be used from any number of threads at once; a Session serves one call at
// a time (a concurrent call throws Error TANDEM_E_BUSY), except abort(), made to be
// called from another thread. The objects themselves are plain C++ values: moving or
// destroying one while another thread uses it is a data race, as for any C++ object.
// A C++ service links only the installed libtandem (find_package(Tandem), target
// Tandem::tandem), never the in-tree C++ API, so it keeps working across library versions
// with the same ABI (TANDEM_ABI_VERSION).
#ifndef TANDEM_HPP
#define TANDEM_HPP

#include <algorithm>
#include <cstdint>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "tandem.h"

namespace tandem::c {

/// A tandem_* call failed: status() is the tandem_status, what() "NAME (n): message".
class Error : public std::runtime_error {
 public:
  Error(tandem_status status, const std::string& message)
      : std::runtime_error(std::string(tandem_status_name(status)) + " (" + std::to_string(status) + "): " + message),
        status_(status) {}
  tandem_status status() const noexcept { return status_; }

 private:
  tandem_status status_;
};

/// Throw Error for a status other than TANDEM_OK (with this thread's last error).
inline void check(tandem_status status) {
  if (status != TANDEM_OK) throw Error(status, tandem_last_error());
}

// ---- library-wide ---------------------------------------------------------------------------

/// "MAJOR.MINOR.PATCH" of the library actually loaded (compare with TANDEM_VERSION_STRING).
/// Thread-safe.
inline std::string version() {
  return tandem_version();
}
/// TANDEM_VERSION_NUMBER of the library actually loaded. Thread-safe, never throws.
inline int32_t version_number() noexcept {
  return tandem_version_number();
}
/// The message of this thread's most recent failed call ("" if none). Thread-safe.
inline std::string last_error() {
  return tandem_last_error();
}
/// "OK", "INVALID_ARG", ... ("UNKNOWN" for a number that is not a code). Static storage.
/// Thread-safe, never throws.
inline std::string_view status_name(tandem_status status) noexcept {
  return tandem_status_name(status);
}

/// Receives each library log line: a tandem_log_level and the line (no newline).
using LogFunction = std::function<void(int32_t level, std::string_view line)>;

/// Send every library log line of `min_level` and above to `fn` (an empty function: discard
/// them, the default), for the whole process (tandem_log_set). `fn` is called from any
/// library thread, possibly several at once: it must be thread-safe and quick, and must
/// not call tandem functions; an exception it throws is swallowed. Once this returns the
/// previous function is never called again (it is destroyed here). Throws Error
/// TANDEM_E_INVALID_ARG for a min_level outside TANDEM_LOG_DEBUG..ERROR (the previous
/// function stays installed). Thread-safe (calls are serialised).
inline void set_log(LogFunction fn, int32_t min_level = TANDEM_LOG_INFO) {
  static std::mutex mutex;
  static std::unique_ptr<LogFunction> installed;
  const tandem_log_callback trampoline = [](int32_t level, const char* line, void* user) {
    try {
      (*static_cast<LogFunction*>(user))(level, line);
    } catch (...) {  // nothing may cross the C boundary
    }
  };
  std::lock_guard<std::mutex> lock(mutex);
  auto next = fn ? std::make_unique<LogFunction>(std::move(fn)) : nullptr;
  check(tandem_log_set(next ? trampoline : nullptr, next.get(), min_level));
  installed = std::move(next);
}

// ---- params structs with their defaults (the *_init functions) -------------------------------
// Each returns the struct filled by its tandem_*_init (struct_size = this header's sizeof).
// Thread-safe.

inline tandem_model_params model_params() {
  tandem_model_params p{};
  check(tandem_model_params_init(&p, sizeof p));
  return p;
}
inline tandem_model_info model_info() {
  tandem_model_info p{};
  check(tandem_model_info_init(&p, sizeof p));
  return p;
}
inline tandem_session_params session_params() {
  tandem_session_params p{};
  check(tandem_session_params_init(&p, sizeof p));
  return p;
}
inline tandem_session_info session_info() {
  tandem_session_info p{};
  check(tandem_session_info_init(&p, sizeof p));
  return p;
}
inline tandem_sampling_params sampling_params() {
  tandem_sampling_params p{};
  check(tandem_sampling_params_init(&p, sizeof p));
  return p;
}
inline tandem_generate_params generate_params() {
  tandem_generate_params p{};
  check(tandem_generate_params_init(&p, sizeof p));
  return p;
}
inline tandem_generate_result generate_result() {
  tandem_generate_result p{};
  check(tandem_generate_result_init(&p, sizeof p));
  return p;
}
inline tandem_device_info device_info() {
  tandem_device_info p{};
  check(tandem_device_info_init(&p, sizeof p));
  return p;
}
inline tandem_executor_params executor_params() {
  tandem_executor_params p{};
  check(tandem_executor_params_init(&p, sizeof p));
  return p;
}
inline tandem_scheduler_params scheduler_params() {
  tandem_scheduler_params p{};
  check(tandem_scheduler_params_init(&p, sizeof p));
  return p;
}
inline tandem_request_params request_params() {
  tandem_request_params p{};
  check(tandem_request_params_init(&p, sizeof p));
  return p;
}
inline tandem_request_event request_event() {
  tandem_request_event p{};
  check(tandem_request_event_init(&p, sizeof p));
  return p;
}
inline tandem_request_result request_result() {
  tandem_request_result p{};
  check(tandem_request_result_init(&p, sizeof p));
  return p;
}
inline tandem_scheduler_session_info scheduler_session_info() {
  tandem_scheduler_session_info p{};
  check(tandem_scheduler_session_info_init(&p, sizeof p));
  return p;
}

namespace detail {

/// A C text result: `call(buf, capacity, &len)` is asked for the size, then called with a
/// buffer of len + 1 bytes (again while it answers TANDEM_E_BUFFER_TOO_SMALL: the size of
/// a metrics snapshot can grow between two calls).
template <class Call>
std::string read_text(Call&& call) {
  size_t n = 0;
  check(call(nullptr, size_t(0), &n));
  std::string out;
  for (;;) {
    out.assign(n + 1, '\0');
    const tandem_status st = call(out.data(), out.size(), &n);
    if (st == TANDEM_E_BUFFER_TOO_SMALL) continue;
    check(st);
    out.resize(n);
    return out;
  }
}

/// The same for an array result (token ids, logits): `call(buf, capacity, &n)`.
template <class T, class Call>
std::vector<T> read_array(Call&& call) {
  size_t n = 0;
  check(call(static_cast<T*>(nullptr), size_t(0), &n));
  std::vector<T> out;
  for (;;) {
    out.assign(n, T{});
    const tandem_status st = call(out.data(), out.size(), &n);
    if (st == TANDEM_E_BUFFER_TOO_SMALL) continue;
    check(st);
    out.resize(n);
    return out;
  }
}

/// A move-only owner of one C handle; Free is the tandem_*_free function.
template <class T, tandem_status (*Free)(T*)>
class Handle {
 public:
  Handle() = default;
  explicit Handle(T* h) noexcept : h_(h) {}
  Handle(Handle&& o) noexcept : h_(std::exchange(o.h_, nullptr)) {}
  Handle& operator=(Handle&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, nullptr);
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { reset(); }
  T* get() const noexcept { return h_; }
  void reset() noexcept {
    if (h_ != nullptr) (void)Free(std::exchange(h_, nullptr));
  }

 private:
  T* h_ = nullptr;
};

}  // namespace detail

// ---- devices --------------------------------------------------------------------------------

/// Number of devices: the CPU (index 0) plus the CUDA devices of a library built with CUDA.
/// Thread-safe.
inline size_t device_count() {
  size_t n = 0;
  check(tandem_device_count(&n));
  return n;
}
/// Device `index` (0 .. device_count() - 1; else Error TANDEM_E_INVALID_ARG). Its name and
/// isa are static strings. Thread-safe.
inline tandem_device_info device_info(size_t index) {
  tandem_device_info info = device_info();
  check(tandem_device_get_info(index, &info));
  return info;
}
/// Every device, index order. Thread-safe.
inline std::vector<tandem_device_info> devices() {
  std::vector<tandem_device_info> out;
  const size_t n = device_count();
  for (size_t i = 0; i < n; ++i) out.push_back(device_info(i));
  return out;
}

// ---- model ----------------------------------------------------------------------------------

/// One message of a conversation for the chat functions.
struct ChatMessage {
  std::string role;  ///< what the template accepts ("system", "user", "assistant", ...)
  std::string content;
};

/// An immutable loaded GGUF model (tandem_model_load). Every method is const and thread-safe;
/// the model stays loaded while sessions, executors or schedulers made from it exist.
class Model {
 public:
  /// Load and validate `path`. Throws Error (TANDEM_E_IO, TANDEM_E_GGUF_*, TANDEM_E_MODEL_*,
  /// TANDEM_E_TOKENIZER, TANDEM_E_OUT_OF_MEMORY, ...; see tandem_model_load).
  explicit Model(const std::string& path, const tandem_model_params& params = model_params()) {
    tandem_model* h = nullptr;
    check(tandem_model_load(path.c_str(), &params, &h));
    h_ = Handle(h);
  }
  tandem_model* get() const noexcept { return h_.get(); }

  /// Hyper-parameters; arch is static, name valid while this Model lives.
  tandem_model_info info() const {
    tandem_model_info i = model_info();
    check(tandem_model_get_info(h_.get(), &i));
    return i;
  }
  /// xxHash3-64 of the weights (the first call reads every weight once).
  uint64_t identity_hash() const {
    uint64_t h = 0;
    check(tandem_model_identity_hash(h_.get(), &h));
    return h;
  }

  /// Token ids of UTF-8 `text`; flags: TANDEM_TOKENIZE_* bits (true = ADD_SPECIAL). Throws
  /// Error TANDEM_E_INVALID_ARG for invalid UTF-8 or unknown flag bits.
  std::vector<int32_t> tokenize(std::string_view text, uint32_t flags = TANDEM_TOKENIZE_ADD_SPECIAL) const {
    return detail::read_array<int32_t>([&](int32_t* buf, size_t cap, size_t* n) {
      return tandem_tokenize(h_.get(), text.data(), text.size(), flags, buf, cap, n);
    });
  }
  /// The bytes of `tokens` (may be invalid UTF-8 when they end inside a character); flags:
  /// TANDEM_DETOKENIZE_* bits. Throws Error TANDEM_E_INVALID_ARG for an id outside the vocabulary.
  std::string detokenize(const std::vector<int32_t>& tokens, uint32_t flags = 0) const {
    return detail::read_text([&](char* buf, size_t cap, size_t* n) {
      return tandem_detokenize(h_.get(), tokens.data(), tokens.size(), flags, buf, cap, n);
    });
  }
  /// The raw bytes of one token ("" for a control token without UNPARSE_SPECIAL).
  std::string token_to_piece(int32_t token, uint32_t flags = 0) const {
    return detail::read_text(
        [&](char* buf, size_t cap, size_t* n) { return tandem_token_to_piece(h_.get(), token, flags, buf, cap, n); });
  }

  /// Number of GGUF metadata entries.
  size_t meta_count() const {
    size_t n = 0;
    check(tandem_model_meta_count(h_.get(), &n));
    return n;
  }
  /// Key of metadata entry `index` (file order; index >= meta_count(): TANDEM_E_INVALID_ARG).
  std::string meta_key(size_t index) const {
    return detail::read_text(
        [&](char* buf, size_t cap, size_t* n) { return tandem_model_meta_key_by_index(h_.get(), index, buf, cap, n); });
  }
  /// A metadata value as text (tandem_model_meta_value; an absent key: TANDEM_E_INVALID_ARG).
  std::string meta(const std::string& key) const {
    return detail::read_text(
        [&](char* buf, size_t cap, size_t* n) { return tandem_model_meta_value(h_.get(), key.c_str(), buf, cap, n); });
  }

  /// The conversation rendered by the model's chat template (template_name "") or by the
  /// built-in family named ("chatml", "llama3", ...); with add_assistant it ends with the
  /// opening of an assistant turn. Errors as tandem_chat_render.
  std::string chat_render(const std::vector<ChatMessage>& messages, bool add_assistant = true,
                          const std::string& template_name = {}) const {
    const Conversation conv(messages);
    return detail::read_text([&](char* buf, size_t cap, size_t* n) {
      return tandem_chat_render(h_.get(), name_or_null(template_name), conv.roles.data(), conv.contents.data(),
                                messages.size(), add_assistant ? 1 : 0, buf, cap, n);
    });
  }
  /// Its token ids (markers as control tokens, message text never; tandem_chat_tokenize).
  std::vector<int32_t> chat_tokenize(const std::vector<ChatMessage>& messages, bool add_assistant = true,
                                     const std::string& template_name = {}) const {
    const Conversation conv(messages);
    return detail::read_array<int32_t>([&](int32_t* buf, size_t cap, size_t* n) {
      return tandem_chat_tokenize(h_.get(), name_or_null(template_name), conv.roles.data(), conv.contents.data(),
                                  messages.size(), add_assistant ? 1 : 0, buf, cap, n);
    });
  }
  /// The prompt of an OpenAI chat-completions request (JSON text with "messages", optional
  /// "tools", ...), as the model's template renders it (tandem_chat_apply_template).
  std::string chat_apply_template(const std::string& request_json) const {
    return detail::read_text([&](char* buf, size_t cap, size_t* n) {
      return tandem_chat_apply_template(h_.get(), request_json.c_str(), buf, cap, n);
    });
  }
  /// Its token ids (tandem_chat_apply_template_tokens).
  std::vector<int32_t> chat_apply_template_tokens(const std::string& request_json) const {
    return detail::read_array<int32_t>([&](int32_t* buf, size_t cap, size_t* n) {
      return tandem_chat_apply_template_tokens(h_.get(), request_json.c_str(), buf, cap, n);
    });
  }
  /// Tool calls in generated text, as the JSON object {"content", "tool_calls"}
  /// (tandem_chat_parse_tool_calls).
  std::string chat_parse_tool_calls(const std::string& text) const {
    return detail::read_text([&](char* buf, size_t cap, size_t* n) {
      return tandem_chat_parse_tool_calls(h_.get(), text.c_str(), buf, cap, n);
    });
  }

 private:
  using Handle = detail::Handle<tandem_model, tandem_model_free>;
  /// The C arrays of a conversation (pointers into `messages`, which must outlive it).
  struct Conversation {
    explicit Conversation(const std::vector<ChatMessage>& messages) {
      for (const ChatMessage& m : messages) {
        roles.push_back(m.role.c_str());
        contents.push_back(m.content.c_str());
      }
    }
    std::vector<const char*> roles, contents;
  };
  static const char* name_or_null(const std::string& name) { return name.empty() ? nullptr : name.c_str(); }
  Handle h_;
};

// ---- pool -----------------------------------------------------------------------------------

/// A CPU thread pool shared by sessions and executors (tandem_pool_create): set
/// tandem_session_params::pool / tandem_executor_params::pool to get(). Thread-safe.
class Pool {
 public:
  /// n_threads 0..512 (0 = one per physical core). Throws Error TANDEM_E_INVALID_ARG, _OUT_OF_MEMORY.
  explicit Pool(int32_t n_threads = 0) {
    tandem_pool* h = nullptr;
    check(tandem_pool_create(n_threads, &h));
    h_ = detail::Handle<tandem_pool, tandem_pool_free>(h);
  }
  tandem_pool* get() const noexcept { return h_.get(); }
  /// Its number of threads (the calling thread of a step counted).
  int32_t n_threads() const {
    int32_t n = 0;
    check(tandem_pool_get_threads(h_.get(), &n));
    return n;
  }

 private:
  detail::Handle<tandem_pool, tandem_pool_free> h_;
};

// ---- session --------------------------------------------------------------------------------

/// What Session::generate / generate_tokens produced.
struct GenerateResult {
  std::string text;
  std::vector<int32_t> tokens;
  int32_t finish_reason = -1;  ///< a tandem_finish_reason
  int32_t n_prompt = 0;        ///< tokens evaluated for the prompt (pending token included)
  double prompt_seconds = 0;   ///< wall time of the prompt evaluation
  double generate_seconds = 0;
  std::vector<tandem_token_logprob> logprobs;  ///< one per token when params.logprobs >= 0
};

/// Receives each final piece of generated text (valid UTF-8); return false to stop the
/// generation (finish reason TANDEM_FINISH_CANCELLED).
using PieceFunction = std::function<bool(std::string_view piece)>;

/// One conversation with its own CPU executor and KV cache (tandem_session_create). One call
/// at a time: a call while another thread is inside one on the same session throws Error
/// TANDEM_E_BUSY (abort() excepted). Errors of each method: those of its C function.
class Session {
 public:
  explicit Session(const Model& model, const tandem_session_params& params = session_params())
      : n_vocab_(model.info().n_vocab) {
    tandem_session* h = nullptr;
    check(tandem_session_create(model.get(), &params, &h));
    h_ = detail::Handle<tandem_session, tandem_session_free>(h);
  }
  tandem_session* get() const noexcept { return h_.get(); }

  tandem_session_info info() const {
    tandem_session_info i = session_info();
    check(tandem_session_get_info(h_.get(), &i));
    return i;
  }
  /// Forget the conversation.
  void reset() { check(tandem_session_reset(h_.get())); }
  /// Stop the generation running on this session; from any thread, never TANDEM_E_BUSY.
  void abort() { check(tandem_session_abort(h_.get())); }

  /// Append `tokens` to the conversation and evaluate them (a pending sampled token first).
  /// Throws Error TANDEM_E_CONTEXT_OVERFLOW (nothing evaluated), TANDEM_E_INVALID_ARG, ...
  void eval(const std::vector<int32_t>& tokens) {
    check(tandem_session_eval(h_.get(), tokens.data(), tokens.size(), nullptr, 0));
  }
  /// As eval, returning the logits: [tokens.size(), n_vocab] floats, row i after tokens[i].
  std::vector<float> eval_logits(const std::vector<int32_t>& tokens) {
    std::vector<float> logits(tokens.size() * size_t(n_vocab_));
    check(tandem_session_eval(h_.get(), tokens.data(), tokens.size(), logits.data(), logits.size()));
    return logits;
  }
  /// The logits after the last evaluated token: n_vocab floats (none before the first eval).
  std::vector<float> logits() const {
    return detail::read_array<float>(
        [&](float* buf, size_t cap, size_t* n) { return tandem_session_get_logits(h_.get(), buf, cap, n); });
  }
  /// The ids whose KV is in the cache, in order.
  std::vector<int32_t> tokens() const {
    return detail::read_array<int32_t>(
        [&](int32_t* buf, size_t cap, size_t* n) { return tandem_session_get_tokens(h_.get(), buf, cap, n); });
  }

  /// Save the conversation to `path` (atomically). Throws Error TANDEM_E_IO, ...
  void save(const std::string& path) const { check(tandem_session_save(h_.get(), path.c_str())); }
  /// Replace the conversation with the one saved in `path`; on any failure the session is
  /// unchanged. Throws Error TANDEM_E_SESSION_CORRUPT, _SESSION_MODEL_MISMATCH, _IO, ...
  void restore(const std::string& path) { check(tandem_session_restore(h_.get(), path.c_str())); }

  /// Generate from a text prompt (BOS added when the session is empty and the vocabulary asks;
  /// "" continues); on_piece streams the text. An exception from on_piece stops the
  /// generation and is rethrown here (the tokens so far stay in the conversation).
  GenerateResult generate(const std::string& prompt, const tandem_generate_params& params = generate_params(),
                          const PieceFunction& on_piece = {}) {
    return run(params, on_piece, [&](tandem_token_callback cb, void* user, tandem_generate_result* r) {
      return tandem_session_generate(h_.get(), prompt.c_str(), &params, cb, user, r);
    });
  }
  /// The same with the prompt as ids (nothing added; empty continues).
  GenerateResult generate_tokens(const std::vector<int32_t>& prompt,
                                 const tandem_generate_params& params = generate_params(),
                                 const PieceFunction& on_piece = {}) {
    return run(params, on_piece, [&](tandem_token_callback cb, void* user, tandem_generate_result* r) {
      return tandem_session_generate_tokens(h_.get(), prompt.data(), prompt.size(), &params, cb, user, r);
    });
  }

 private:
  struct Stream {
    std::string* text;
    const PieceFunction* fn;
    std::exception_ptr error;
  };
  template <class Call>
  GenerateResult run(const tandem_generate_params& params, const PieceFunction& on_piece, Call&& call) {
    GenerateResult out;
    tandem_generate_result r = generate_result();
    const size_t max_tokens = params.max_tokens > 0 ? size_t(params.max_tokens) : 0;
    out.tokens.resize(max_tokens);
    r.tokens = out.tokens.data();
    r.tokens_cap = out.tokens.size();
    if (params.logprobs >= 0) {
      out.logprobs.resize(max_tokens);
      r.logprobs = out.logprobs.data();
      r.logprobs_cap = out.logprobs.size();
    }
    Stream stream{&out.text, &on_piece, nullptr};
    const tandem_token_callback cb = [](const char* piece, size_t len, int32_t, void* user) -> int {
      auto* s = static_cast<Stream*>(user);
      try {
        s->text->append(piece, len);
        return (*s->fn && !(*s->fn)(std::string_view(piece, len))) ? 1 : 0;
      } catch (...) {
        s->error = std::current_exception();
        return 1;
      }
    };
    const tandem_status st = call(cb, &stream, &r);
    if (stream.error) std::rethrow_exception(stream.error);
    check(st);
    out.tokens.resize(std::min(r.n_tokens, r.tokens_cap));
    out.logprobs.resize(std::min(r.n_logprobs, out.logprobs.size()));
    out.finish_reason = r.finish_reason;
    out.n_prompt = r.n_prompt;
    out.prompt_seconds = r.prompt_seconds;
    out.generate_seconds = r.generate_seconds;
    return out;
  }
  int32_t n_vocab_;
  detail::Handle<tandem_session, tandem_session_free> h_;
};

// ---- executors ------------------------------------------------------------------------------

/// A CPU or GPU executor on a model (tandem_executor_create), to build a Scheduler from
/// (one scheduler at a time). Thread-safe.
class Executor {
 public:
  /// params' device_kind, device_id, n_threads and pool choose it (its slot and KV fields
  /// are used by the scheduler). Throws Error TANDEM_E_UNSUPPORTED (CUDA in a library
  /// without it), TANDEM_E_INVALID_ARG, TANDEM_E_OUT_OF_MEMORY, ...
  explicit Executor(const Model& model, const tandem_executor_params& params = executor_params()) {
    tandem_executor* h = nullptr;
    check(tandem_executor_create(model.get(), &params, &h));
    h_ = detail::Handle<tandem_executor, tandem_executor_free>(h);
  }
  tandem_executor* get() const noexcept { return h_.get(); }
  /// The device it computes on (n_cores of a CPU executor: its thread count).
  tandem_device_info device() const {
    tandem_device_info info = device_info();
    check(tandem_executor_get_device(h_.get(), &info));
    return info;
  }

 private:
  detail::Handle<tandem_executor, tandem_executor_free> h_;
};

// ---- requests -------------------------------------------------------------------------------

/// One streamed event of a request.
struct Event {
  int32_t kind = TANDEM_EVENT_NONE;  ///< a tandem_event_kind
  int32_t token = -1;                ///< the generated id (TANDEM_EVENT_TOKEN)
  int32_t finish_reason = -1;        ///< a tandem_finish_reason (TANDEM_EVENT_FINISH)
  std::string text;                  ///< the text this event completed (valid UTF-8)
};

/// A request's outcome (Request::wait / result).
struct RequestResult {
  bool finished = false;  ///< false: the fields below are not final (only id is set)
  uint64_t id = 0;        ///< the scheduler's request id
  int32_t finish_reason = -1;
  tandem_status status = TANDEM_OK;  ///< the error of TANDEM_FINISH_ERROR
  std::string message;               ///< why it ended with an error or overloaded
  std::vector<int32_t> tokens;
  std::string text;  ///< stop strings cut off
  int32_t n_prompt = 0;
  double queue_seconds = 0, ttft_seconds = 0, e2e_seconds = 0;
  std::vector<tandem_token_logprob> logprobs;  ///< with tandem_request_params::logprobs >= 0
};

/// A submitted request (tandem_request_*). Thread-safe; destroying it cancels the request
/// when it has not finished.
class Request {
 public:
  explicit Request(tandem_request* h) noexcept : h_(h) {}
  tandem_request* get() const noexcept { return h_.get(); }

  /// Take the next event without blocking (kind TANDEM_EVENT_NONE: nothing new). Token events
  /// come in order, then one FINISH, which every later poll repeats with empty text.
  Event poll() {
    return take([&](tandem_request_event* ev) { return tandem_request_poll(h_.get(), ev); });
  }
  /// As poll, blocking until an event is there or timeout_ms passed (< 0: no limit; kind
  /// TANDEM_EVENT_NONE on a timeout).
  Event next_event(int32_t timeout_ms = -1) {
    return take([&](tandem_request_event* ev) { return tandem_request_next_event(h_.get(), timeout_ms, ev); });
  }
  /// Ask it to stop (TANDEM_FINISH_CANCELLED within one step unless already finished).
  void cancel() { check(tandem_request_cancel(h_.get())); }
  /// Block until it finished or timeout_ms passed (< 0: no limit); finished says which.
  RequestResult wait(int32_t timeout_ms = -1) {
    check(tandem_request_wait(h_.get(), timeout_ms, nullptr));
    return result();
  }
  /// The outcome now, without blocking (finished false while it runs). The FINISH event
  /// can reach poll / next_event just before the result is published here: after it, call
  /// wait() (it returns once the result is there).
  RequestResult result() const {
    tandem_request_result r = request_result();
    check(tandem_request_get_result(h_.get(), &r));  // sizes (final once finished)
    RequestResult out;
    out.finished = r.finished != 0;
    out.id = r.id;
    if (!out.finished) return out;
    out.tokens.resize(r.n_tokens);
    out.text.assign(r.text_len + 1, '\0');
    out.logprobs.resize(r.n_logprobs);
    r.tokens = out.tokens.data();
    r.tokens_cap = out.tokens.size();
    r.text = out.text.data();
    r.text_cap = out.text.size();
    r.logprobs = out.logprobs.data();
    r.logprobs_cap = out.logprobs.size();
    check(tandem_request_get_result(h_.get(), &r));
    out.text.resize(r.text_len);
    out.finish_reason = r.finish_reason;
    out.status = r.status;
    out.message = r.message != nullptr ? r.message : "";
    out.n_prompt = r.n_prompt;
    out.queue_seconds = r.queue_seconds;
    out.ttft_seconds = r.ttft_seconds;
    out.e2e_seconds = r.e2e_seconds;
    return out;
  }

 private:
  template <class Call>
  static Event take(Call&& call) {
    tandem_request_event ev = request_event();
    Event out;
    out.text.resize(256);
    for (;;) {
      ev.text = out.text.data();
      ev.text_cap = out.text.size();
      const tandem_status st = call(&ev);
      if (st == TANDEM_E_BUFFER_TOO_SMALL) {  // the event stays first in line
        out.text.resize(ev.text_len + 1);
        continue;
      }
      check(st);
      out.text.resize(ev.text_len);
      out.kind = ev.kind;
      out.token = ev.token;
      out.finish_reason = ev.finish_reason;
      return out;
    }
  }
  detail::Handle<tandem_request, tandem_request_free> h_;
};

// ---- scheduler ------------------------------------------------------------------------------

/// The multi-executor scheduler (tandem_scheduler_create) and its sessions. Thread-safe;
/// destroying it cancels the outstanding requests (their Request objects stay usable).
class Scheduler {
 public:
  /// Executors built from params.executors (NULL: n_executors default CPU executors).
  /// Throws Error TANDEM_E_INVALID_ARG, TANDEM_E_OUT_OF_MEMORY, ...
  Scheduler(const Model& model, const tandem_scheduler_params& params = scheduler_params()) {
    tandem_scheduler* h = nullptr;
    check(tandem_scheduler_create(model.get(), &params, &h));
    h_ = detail::Handle<tandem_scheduler, tandem_scheduler_free>(h);
  }
  /// On the given executors (executor i = executors[i]; e.g. "cpu+cpu" is two CPU
  /// executors, the first with accelerator 1). params.n_executors and
  /// params.executor_handles are set here; params.executors may give the executors' slot
  /// and KV fields, one entry each (params.n_executors must then be executors.size(), else
  /// Error TANDEM_E_INVALID_ARG). An executor in use by another live scheduler: Error
  /// TANDEM_E_BUSY. The scheduler keeps the executors alive.
  Scheduler(const Model& model, const std::vector<Executor>& executors,
            tandem_scheduler_params params = scheduler_params()) {
    if (params.executors != nullptr && params.n_executors != executors.size())
      throw Error(TANDEM_E_INVALID_ARG,
                  "params.executors must describe each of the " + std::to_string(executors.size()) + " executors");
    std::vector<tandem_executor*> handles;
    for (const Executor& e : executors) handles.push_back(e.get());
    params.n_executors = handles.size();
    params.executor_handles = handles.data();
    tandem_scheduler* h = nullptr;
    check(tandem_scheduler_create(model.get(), &params, &h));
    h_ = detail::Handle<tandem_scheduler, tandem_scheduler_free>(h);
  }
  tandem_scheduler* get() const noexcept { return h_.get(); }

  /// Submit a request (arguments checked here: Error TANDEM_E_INVALID_ARG). One the scheduler
  /// cannot take is returned finished (TANDEM_FINISH_OVERLOADED / _ERROR).
  Request submit(const tandem_request_params& params) {
    tandem_request* r = nullptr;
    check(tandem_scheduler_submit(h_.get(), &params, &r));
    return Request(r);
  }
  /// n choices of one prompt (1..128), computed once; choice i is seeded seed + i.
  std::vector<Request> submit_n(const tandem_request_params& params, uint32_t n) {
    std::vector<tandem_request*> handles(n, nullptr);
    check(tandem_scheduler_submit_n(h_.get(), &params, n, handles.data()));
    std::vector<Request> out;
    out.reserve(n);
    for (tandem_request* r : handles) out.emplace_back(r);
    return out;
  }
  /// Stop accepting requests and block until every submitted one has finished.
  void drain() { check(tandem_scheduler_drain(h_.get())); }
  /// Cancel everything and stop the step loops (later submits: TANDEM_E_INVALID_ARG). Idempotent.
  void shutdown() { check(tandem_scheduler_shutdown(h_.get())); }
  /// A JSON snapshot of the serving metrics (include/tandem/sched/metrics.hpp).
  std::string metrics_json() const {
    return detail::read_text(
        [&](char* buf, size_t cap, size_t* n) { return tandem_scheduler_metrics_json(h_.get(), buf, cap, n); });
  }

  /// A conversation whose KV stays with the scheduler between requests (pass the id in
  /// tandem_request_params::session).
  uint64_t open_session() {
    uint64_t id = 0;
    check(tandem_scheduler_session_open(h_.get(), &id));
    return id;
  }
  /// Release its KV (an unknown or closed id: no-op).
  void close_session(uint64_t id) { check(tandem_scheduler_session_close(h_.get(), id)); }
  /// Move a session's KV to the File tier / back to the compute tier between requests
  /// (TANDEM_E_BUSY while a request runs on it).
  void park_session(uint64_t id) { check(tandem_scheduler_session_park(h_.get(), id)); }
  void unpark_session(uint64_t id) { check(tandem_scheduler_session_unpark(h_.get(), id)); }
  tandem_scheduler_session_info session_info(uint64_t id) {
    tandem_scheduler_session_info info = scheduler_session_info();
    check(tandem_scheduler_session_get_info(h_.get(), id, &info));
    return info;
  }
  /// Save an idle session to `path` in the session-file format (atomically: on any error
  /// the file is left as it was). Throws Error TANDEM_E_BUSY while a request runs on it.
  void save_session(uint64_t id, const std::string& path) {
    check(tandem_scheduler_session_save(h_.get(), id, path.c_str()));
  }
  /// Open a new idle session from a file of save_session or Session::save, its KV in the
  /// store of executor `executor` (compute tier if it has room, else File). Errors as
  /// tandem_scheduler_session_restore (corrupt file, other model, context overflow, ...).
  uint64_t restore_session(const std::string& path, int32_t executor = 0) {
    uint64_t id = 0;
    check(tandem_scheduler_session_restore(h_.get(), path.c_str(), executor, &id));
    return id;
  }

 private:
  detail::Handle<tandem_scheduler, tandem_scheduler_free> h_;
};

}  // namespace tandem::c

#endif  // TANDEM_HPP
