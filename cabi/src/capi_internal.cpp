// Error state, handle registry and helpers of the C ABI (see capi_internal.hpp).
#include "capi_internal.hpp"

#include <fmt/format.h>

#include <shared_mutex>

namespace tandem::capi {

namespace {
constexpr size_t kMaxMessage = 1024;
thread_local char tl_last_error[kMaxMessage] = "";
}  // namespace

tandem_status set_error(tandem_status code, const char* message) noexcept {
  if (message == nullptr) message = "";
  size_t n = std::strlen(message);
  if (n >= kMaxMessage) {
    n = kMaxMessage - 1;
    // Do not cut a UTF-8 character in half: back up over continuation bytes.
    while (n > 0 && (static_cast<unsigned char>(message[n]) & 0xC0u) == 0x80u) --n;
  }
  std::memcpy(tl_last_error, message, n);
  tl_last_error[n] = '\0';
  return code;
}

const char* last_error() noexcept {
  return tl_last_error;
}

void fail(tandem_status code, const std::string& message) {
  throw CError(code, message);
}

const char* kind_name(Kind kind) noexcept {
  switch (kind) {
    case Kind::kModel:
      return "model";
    case Kind::kSession:
      return "session";
    case Kind::kScheduler:
      return "scheduler";
    case Kind::kRequest:
      return "request";
    case Kind::kExecutor:
      return "executor";
    case Kind::kPool:
      return "pool";
  }
  return "unknown";
}

Registry& Registry::instance() {
  // Never destroyed: live objects (sessions own worker threads) must not be torn down by
  // static destructors while other threads may still use them at exit.
  static Registry* r = new Registry;
  return *r;
}

uintptr_t Registry::add(Kind kind, std::shared_ptr<void> obj) {
  std::lock_guard<std::mutex> lock(mutex_);
  const uintptr_t h = static_cast<uintptr_t>(next_id_++) << 4 | static_cast<uintptr_t>(kind);
  live_.emplace(h, std::make_pair(kind, std::move(obj)));
  return h;
}

std::shared_ptr<void> Registry::get(uintptr_t handle, Kind kind, const char* fn) const {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    const auto it = live_.find(handle);
    if (it != live_.end() && it->second.first == kind) return it->second.second;
  }
  fail(TANDEM_E_INVALID_HANDLE,
       fmt::format("{}: {} handle {:#x} is not live (freed already, never created, or another kind)", fn,
                   kind_name(kind), handle));
}

std::shared_ptr<void> Registry::remove(uintptr_t handle, Kind kind) {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = live_.find(handle);
  if (it == live_.end() || it->second.first != kind) return nullptr;
  auto obj = std::move(it->second.second);
  live_.erase(it);
  return obj;
}

std::shared_ptr<ModelObj> get_model(const tandem_model* h, const char* fn) {
  require(h, fn, "model");
  return std::static_pointer_cast<ModelObj>(Registry::instance().get(reinterpret_cast<uintptr_t>(h), Kind::kModel, fn));
}

std::shared_ptr<SessionObj> get_session(const tandem_session* h, const char* fn) {
  require(h, fn, "session");
  return std::static_pointer_cast<SessionObj>(
      Registry::instance().get(reinterpret_cast<uintptr_t>(h), Kind::kSession, fn));
}

std::shared_ptr<SchedulerObj> get_scheduler(const tandem_scheduler* h, const char* fn) {
  require(h, fn, "scheduler");
  return std::static_pointer_cast<SchedulerObj>(
      Registry::instance().get(reinterpret_cast<uintptr_t>(h), Kind::kScheduler, fn));
}

std::shared_ptr<RequestObj> get_request(const tandem_request* h, const char* fn) {
  require(h, fn, "request");
  return std::static_pointer_cast<RequestObj>(
      Registry::instance().get(reinterpret_cast<uintptr_t>(h), Kind::kRequest, fn));
}

std::shared_ptr<ExecutorObj> get_executor(const tandem_executor* h, const char* fn) {
  require(h, fn, "executor");
  return std::static_pointer_cast<ExecutorObj>(
      Registry::instance().get(reinterpret_cast<uintptr_t>(h), Kind::kExecutor, fn));
}

std::shared_ptr<PoolObj> get_pool(const tandem_pool* h, const char* fn) {
  require(h, fn, "pool");
  return std::static_pointer_cast<PoolObj>(Registry::instance().get(reinterpret_cast<uintptr_t>(h), Kind::kPool, fn));
}

BusyGuard::BusyGuard(SessionObj& s, const char* fn) : s_(s) {
  if (s_.busy.exchange(true, std::memory_order_acquire)) {
    fail(TANDEM_E_BUSY, std::string(fn) +
                            ": the session is in use by another call (a session serves one call "
                            "at a time)");
  }
}

BusyGuard::~BusyGuard() {
  std::lock_guard<std::mutex> lock(s_.abort_mu);
  s_.abort.store(false, std::memory_order_relaxed);
  s_.busy.store(false, std::memory_order_release);
}

namespace {
// The log sink. A line is delivered under the shared lock, so tandem_log_set (which takes
// it exclusively) returns only when no call to the old callback is in flight.
struct LogSink {
  std::shared_mutex mu;
  tandem_log_callback callback = nullptr;
  void* user_data = nullptr;
  std::atomic<int32_t> min_level{TANDEM_LOG_ERROR + 1};  // nothing when no callback
};
LogSink& log_sink() {
  static LogSink* sink = new LogSink;  // never destroyed: step loops may log at exit
  return *sink;
}
}  // namespace

bool log_enabled(int32_t level) noexcept {
  return level >= log_sink().min_level.load(std::memory_order_relaxed);
}

void log_line(int32_t level, std::string_view message) noexcept {
  LogSink& sink = log_sink();
  if (level < sink.min_level.load(std::memory_order_relaxed)) return;
  try {
    std::string line(message);
    while (!line.empty() && line.back() == '\n') line.pop_back();
    std::shared_lock<std::shared_mutex> lock(sink.mu);
    if (sink.callback != nullptr && level >= sink.min_level.load(std::memory_order_relaxed)) {
      sink.callback(level, line.c_str(), sink.user_data);
    }
  } catch (...) {
    // A log line is never worth failing the operation that produced it.
  }
}

tandem_status set_log(tandem_log_callback callback, void* user_data, int32_t min_level) noexcept {
  if (min_level < TANDEM_LOG_DEBUG || min_level > TANDEM_LOG_ERROR) {
    return set_error(TANDEM_E_INVALID_ARG, "tandem_log_set: min_level must be TANDEM_LOG_DEBUG..TANDEM_LOG_ERROR");
  }
  LogSink& sink = log_sink();
  std::unique_lock<std::shared_mutex> lock(sink.mu);
  sink.callback = callback;
  sink.user_data = user_data;
  sink.min_level.store(callback != nullptr ? min_level : TANDEM_LOG_ERROR + 1, std::memory_order_relaxed);
  return TANDEM_OK;
}

size_t utf8_invalid_at(std::string_view s) noexcept {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    const unsigned c = p[i];
    if (c < 0x80) {
      ++i;
      continue;
    }
    size_t len = 0;
    unsigned lo = 0x80, hi = 0xBF;  // allowed range of the second byte
    if (c >= 0xC2 && c <= 0xDF) {
      len = 2;
    } else if (c >= 0xE0 && c <= 0xEF) {
      len = 3;
      if (c == 0xE0) lo = 0xA0;  // no overlongs
      if (c == 0xED) hi = 0x9F;  // no surrogates
    } else if (c >= 0xF0 && c <= 0xF4) {
      len = 4;
      if (c == 0xF0) lo = 0x90;  // no overlongs
      if (c == 0xF4) hi = 0x8F;  // <= U+10FFFF
    } else {
      return i;
    }
    if (i + len > n) return i;
    if (p[i + 1] < lo || p[i + 1] > hi) return i;
    for (size_t k = 2; k < len; ++k) {
      if ((p[i + k] & 0xC0u) != 0x80u) return i;
    }
    i += len;
  }
  return std::string_view::npos;
}

bool check_capacity(const void* buf, size_t capacity, size_t needed, const char* fn, const char* what) {
  if (buf == nullptr) {
    if (capacity != 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: {} is NULL but capacity is {}", fn, what, capacity));
    return false;  // size query
  }
  if (capacity < needed) {
    fail(TANDEM_E_BUFFER_TOO_SMALL, fmt::format("{}: {} holds {} elements, {} needed", fn, what, capacity, needed));
  }
  return true;
}

}  // namespace tandem::capi
