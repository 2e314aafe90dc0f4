// Internals of the C ABI (cabi/include/tandem.h): the one catch-all that turns exceptions
// into status codes, the thread-local last-error message, the handle registry, and the
// struct_size rules. Nothing here is exported (the library is built with
// -fvisibility=hidden and a version script that keeps only tandem_*).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <exception>
#include <memory>
#include <mutex>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tandem.h"
#include "tandem/core/error.hpp"
#include "tandem/exec/cpu/cpu_q4_executor.hpp"
#include "tandem/model/model.hpp"
#include "tandem/node/node.hpp"
#include "tandem/sched/scheduler.hpp"
#include "tandem/session/session.hpp"
#include "tandem/template/chat_template.hpp"

namespace tandem::capi {

/// An error raised by the C layer itself (codes that tandem::ErrorCode does not have).
class CError : public std::exception {
 public:
  CError(tandem_status code, std::string message) : code_(code), message_(std::move(message)) {}
  tandem_status code() const noexcept { return code_; }
  const char* what() const noexcept override { return message_.c_str(); }

 private:
  tandem_status code_;
  std::string message_;
};

/// Record `message` as this thread's last error and return `code`. Never throws and
/// never allocates (fixed thread-local buffer; long messages are cut at a UTF-8
/// boundary).
tandem_status set_error(tandem_status code, const char* message) noexcept;
const char* last_error() noexcept;

/// The catch-all (as faiss's c_api macros_impl.h): run `body`, which reports failure by
/// throwing; translate every exception to a status + message. Every exported function
/// goes through it, so no exception crosses the C boundary.
template <class Body>
tandem_status guard(Body&& body) noexcept {
  try {
    body();
    return TANDEM_OK;
  } catch (const CError& e) {
    return set_error(e.code(), e.what());
  } catch (const tandem::Error& e) {
    return set_error(static_cast<tandem_status>(e.code()), e.what());
  } catch (const std::bad_alloc&) {
    return set_error(TANDEM_E_OUT_OF_MEMORY, "out of memory");
  } catch (const std::exception& e) {
    return set_error(TANDEM_E_INTERNAL, e.what());
  } catch (...) {
    return set_error(TANDEM_E_INTERNAL, "unknown exception (a callback threw?)");
  }
}

[[noreturn]] void fail(tandem_status code, const std::string& message);
/// NULL check for a required pointer argument: TANDEM_E_INVALID_ARG naming it.
inline void require(const void* p, const char* fn, const char* what) {
  if (p == nullptr) fail(TANDEM_E_INVALID_ARG, std::string(fn) + ": " + what + " is NULL");
}

// ---- handles -------------------------------------------------------------------------

enum class Kind : uintptr_t { kModel = 1, kSession = 2, kScheduler = 3, kRequest = 4, kExecutor = 5, kPool = 6 };
const char* kind_name(Kind kind) noexcept;

struct ModelObj {
  std::shared_ptr<const tandem::Model> model;
  std::string name;                                           ///< backing store of tandem_model_info::name
  std::optional<tandem::ChatTemplateOverride> chat_template;  ///< tandem_model_params.chat_template
  /// The template the chat functions use (ChatTemplate::for_model with the override).
  tandem::ChatTemplate template_in_use() const {
    return tandem::ChatTemplate::for_model(*model, chat_template ? &*chat_template : nullptr);
  }
};

/// A CPU thread pool made by tandem_pool_create; executors hold the ThreadPool itself.
struct PoolObj {
  std::shared_ptr<tandem::ThreadPool> pool;
};

struct SessionObj {
  std::shared_ptr<ModelObj> model;
  std::unique_ptr<tandem::CpuQ4Executor> executor;
  std::unique_ptr<tandem::Session> session;  ///< destroyed before the executor it uses
  int32_t n_batch = 0;
  int32_t page_size = 0;
  std::atomic<bool> busy{false};
  /// tandem_session_abort: set only while a call is running (under abort_mu, which the
  /// end of every call also takes to clear it), so an abort never outlives its call.
  std::atomic<bool> abort{false};
  std::mutex abort_mu;
  std::string piece;  ///< NUL-terminated copy of the current callback piece
};

/// An executor made by tandem_executor_create (or by a scheduler for itself).
struct ExecutorObj {
  std::shared_ptr<ModelObj> model;
  std::unique_ptr<tandem::Executor> executor;
  int32_t device_kind = TANDEM_DEVICE_CPU;
  int32_t device_id = 0;
  std::atomic<bool> in_use{false};  ///< taken by a live scheduler (one at a time)
};

struct SchedulerObj {
  std::shared_ptr<ModelObj> model;
  std::vector<std::shared_ptr<ExecutorObj>> executors;  ///< in_use released by the destructor
  std::vector<std::shared_ptr<tandem::KvStore>> stores;
  std::unique_ptr<tandem::Scheduler> scheduler;  ///< declared last: stopped before the executors go
  ~SchedulerObj() {
    if (scheduler) scheduler->shutdown();
    scheduler.reset();
    for (auto& e : executors) e->in_use.store(false, std::memory_order_release);
  }
};

/// Wakes tandem_request_next_event: the request's on_event (on a step-loop thread) bumps
/// `seq` after the scheduler has appended the event to the handle's poll log (see
/// lib/sched/scheduler.cpp: log_event precedes on_event), so a waiter that saw seq unchanged
/// and found nothing to poll can sleep until seq moves.
struct EventSignal {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t seq = 0;
};

struct RequestObj {
  tandem::RequestHandle handle;
  std::weak_ptr<SchedulerObj> scheduler;  ///< for cancel(); the request outlives it safely
  std::mutex poll_mu;                     ///< serialises polls (the handle has one reader)
  bool have_pending = false;              ///< an event taken but not yet delivered
  tandem::RequestEvent pending{};
  std::string pending_text;
  bool finish_seen = false;  ///< the terminal event was delivered
  tandem::RequestFinish finish = tandem::RequestFinish::kLength;
  std::shared_ptr<EventSignal> signal = std::make_shared<EventSignal>();
};

/// Live handles. A handle value is (id << 4 | kind) with an id that is never reused, so a
/// freed handle stays invalid forever (no ABA through address reuse) and a handle is never
/// dereferenced: the registry maps it to a shared_ptr. Calls hold that shared_ptr while
/// they run, so a free from another thread (or from a callback) only unregisters; the
/// object dies with the last reference. Ids start at 2^16, so handle values are >= 1 MiB:
/// garbage-collected callers keep handles in pointer-typed variables, and Go aborts on a
/// pointer-typed value below 4096 ("invalid pointer found on stack").
class Registry {
 public:
  static Registry& instance();
  uintptr_t add(Kind kind, std::shared_ptr<void> obj);
  /// add(), as the C handle type the caller returns (the value is an id, not an address).
  template <class Handle>
  Handle* add_handle(Kind kind, std::shared_ptr<void> obj) {
    // NOLINTNEXTLINE(performance-no-int-to-ptr): a handle is never dereferenced (see above)
    return reinterpret_cast<Handle*>(add(kind, std::move(obj)));
  }
  /// The object of a live handle of this kind; throws INVALID_HANDLE otherwise.
  std::shared_ptr<void> get(uintptr_t handle, Kind kind, const char* fn) const;
  /// Unregister; false if the handle was not live (or of another kind).
  std::shared_ptr<void> remove(uintptr_t handle, Kind kind);

 private:
  mutable std::mutex mutex_;
  std::unordered_map<uintptr_t, std::pair<Kind, std::shared_ptr<void>>> live_;
  uint64_t next_id_ = uint64_t(1) << 16;
};

std::shared_ptr<ModelObj> get_model(const tandem_model* h, const char* fn);
std::shared_ptr<SessionObj> get_session(const tandem_session* h, const char* fn);
std::shared_ptr<SchedulerObj> get_scheduler(const tandem_scheduler* h, const char* fn);
std::shared_ptr<RequestObj> get_request(const tandem_request* h, const char* fn);
std::shared_ptr<ExecutorObj> get_executor(const tandem_executor* h, const char* fn);
std::shared_ptr<PoolObj> get_pool(const tandem_pool* h, const char* fn);

/// A new executor for `model` as params describe it (device kind and id, threads);
/// TANDEM_E_UNSUPPORTED for a GPU in a build without CUDA. Logged at TANDEM_LOG_INFO.
std::shared_ptr<ExecutorObj> make_executor(const std::shared_ptr<ModelObj>& model, const tandem_executor_params& p,
                                           const char* fn);
/// Range checks of an executor description (index names it in the message).
void check_executor_params(const tandem_executor_params& p, size_t index, const char* fn);

/// Send a line to the callback of tandem_log_set (if any and if level >= its minimum).
/// Never throws; a callback is never called after tandem_log_set replaced it.
void log_line(int32_t level, std::string_view message) noexcept;
tandem_status set_log(tandem_log_callback callback, void* user_data, int32_t min_level) noexcept;
bool log_enabled(int32_t level) noexcept;

/// Marks a session in use for the duration of one call; a second concurrent call gets
/// TANDEM_E_BUSY (never blocks). The end of the call clears a pending abort.
class BusyGuard {
 public:
  BusyGuard(SessionObj& s, const char* fn);
  ~BusyGuard();
  BusyGuard(const BusyGuard&) = delete;
  BusyGuard& operator=(const BusyGuard&) = delete;

 private:
  SessionObj& s_;
};

// ---- struct_size -----------------------------------------------------------------------
//
// Structs of version 0.1 have no tail padding on LP64 (checked by static_asserts in
// tandem_c.cpp), so a field added later always starts at or after the current sizeof and
// the "unknown bytes must be zero" rule covers it.

/// Copy a caller's input struct into `out` (which holds the defaults). struct_size must
/// be >= min_size; bytes past sizeof(T) must be zero.
template <class T>
void read_struct(const T* user, size_t min_size, T& out, const char* fn, const char* type) {
  size_t n = 0;
  std::memcpy(&n, user, sizeof n);
  if (n < min_size) {
    fail(TANDEM_E_INVALID_ARG, std::string(fn) + ": " + type + ".struct_size " + std::to_string(n) +
                                   " is smaller than " + std::to_string(min_size) + " (use the *_init function)");
  }
  if (n > sizeof(T)) {
    const auto* bytes = reinterpret_cast<const unsigned char*>(user);
    for (size_t i = sizeof(T); i < n; ++i) {
      if (bytes[i] != 0) {
        fail(TANDEM_E_INVALID_ARG, std::string(fn) + ": " + type + " sets a field at byte " + std::to_string(i) +
                                       " that this library version (" + TANDEM_VERSION_STRING + ") does not know");
      }
    }
  }
  std::memcpy(&out, user, std::min(n, sizeof(T)));
  out.struct_size = sizeof(T);
}

/// Check an output struct's struct_size; returns how many bytes may be written.
template <class T>
size_t out_struct_size(const T* user, size_t min_size, const char* fn, const char* type) {
  size_t n = 0;
  std::memcpy(&n, user, sizeof n);
  if (n < min_size) {
    fail(TANDEM_E_INVALID_ARG, std::string(fn) + ": " + type + ".struct_size " + std::to_string(n) +
                                   " is smaller than " + std::to_string(min_size) + " (use the *_init function)");
  }
  return std::min(n, sizeof(T));
}

/// Write `value` into the caller's output struct, at most `n` bytes, keeping the
/// caller's struct_size.
template <class T>
void write_struct(T* user, const T& value, size_t n) {
  const size_t caller_size = user->struct_size;
  std::memcpy(user, &value, n);
  user->struct_size = caller_size;
}

/// *_init: zero struct_size bytes, set struct_size, then the defaults that fit.
template <class T>
void init_struct(T* user, size_t struct_size, size_t min_size, const T& defaults, const char* fn, const char* type) {
  require(user, fn, type);
  if (struct_size < min_size) {
    fail(TANDEM_E_INVALID_ARG, std::string(fn) + ": struct_size " + std::to_string(struct_size) +
                                   " is smaller than sizeof(" + type + ") of version 0.1 (" + std::to_string(min_size) +
                                   ")");
  }
  std::memset(static_cast<void*>(user), 0, struct_size);
  std::memcpy(static_cast<void*>(user), &defaults, std::min(struct_size, sizeof(T)));
  user->struct_size = struct_size;
}

// ---- misc ---------------------------------------------------------------------------------

/// Well-formed UTF-8 (RFC 3629: no overlongs, no surrogates, <= U+10FFFF)?
/// Returns the offset of the first bad byte, or npos.
size_t utf8_invalid_at(std::string_view s) noexcept;

/// Caller-buffer size rules shared by every "buffer + capacity + out count" function.
/// Returns true when the data should be written.
bool check_capacity(const void* buf, size_t capacity, size_t needed, const char* fn, const char* what);

// ---- shared by the objects' files (defined in tandem_c.cpp) -------------------------------
//
// The smallest struct_size each function accepts. These numbers are frozen: when a field is
// added, sizeof grows and these stay. No struct may have tail padding (a later field could
// hide in it), hence the checks in tandem_c.cpp.

constexpr size_t kModelParamsV01 = offsetof(tandem_model_params, chat_template);
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

/// The most threads a pool or executor may ask for.
constexpr int32_t kMaxThreads = 512;
constexpr uint32_t kTokenizeFlags = TANDEM_TOKENIZE_ADD_SPECIAL | TANDEM_TOKENIZE_PARSE_SPECIAL;
constexpr uint32_t kDetokenizeFlags = TANDEM_DETOKENIZE_REMOVE_SPECIAL | TANDEM_DETOKENIZE_UNPARSE_SPECIAL;
constexpr uint32_t kGenerateFlags = TANDEM_GENERATE_IGNORE_EOS | TANDEM_GENERATE_PARSE_SPECIAL;

tandem_model_params default_model_params();
tandem_session_params default_session_params();
tandem_sampling_params default_sampling_params();
tandem_generate_params default_generate_params();
tandem_executor_params default_executor_params();
tandem_scheduler_params default_scheduler_params();
tandem_request_params default_request_params();

template <class T>
T zeroed() {
  T v{};
  v.struct_size = sizeof v;
  return v;
}

/// Unknown bits of a flags field: TANDEM_E_INVALID_ARG.
void check_flags(uint32_t flags, uint32_t known, const char* fn);
/// Token counts beyond int32 cannot fit any context (and n * n_vocab must not overflow).
void check_count(size_t n, const char* fn, const char* what);
/// Text that is not UTF-8: TANDEM_E_INVALID_ARG naming the first bad byte.
void check_utf8(std::string_view text, const char* fn, const char* what);
/// Copy text + NUL into a caller buffer under the size-query rules.
void write_text(const std::string& text, char* buf, size_t capacity, size_t* out_len, const char* fn);
/// A caller's tandem_sampling_params (NULL: the defaults) as validated SamplingParams.
SamplingParams to_sampling(const tandem_sampling_params* user, const char* fn);
/// A caller's stop strings: non-NULL, non-empty, UTF-8.
std::vector<std::string> read_stops(const char* const* stop, size_t n_stop, const char* fn);
/// tandem_generate_params / tandem_request_params .logprobs (-1 .. 20) and .reserved (0).
int32_t read_logprobs(int32_t logprobs, int32_t reserved, const char* fn);
/// The first min(size, cap) entries of `in` into `out` (NULL: nothing).
void write_logprobs(const std::vector<TokenLogprob>& in, tandem_token_logprob* out, size_t cap);
/// tandem_generate_params / tandem_request_params .grammar, .grammar_type, .reserved2 -> the
/// compiled grammar (null for TANDEM_GRAMMAR_NONE); throws the C ABI's errors naming `fn`.
std::shared_ptr<const Grammar> read_grammar(const char* text, int32_t type, int32_t reserved2, const Tokenizer& tok,
                                            const char* fn);

}  // namespace tandem::capi
