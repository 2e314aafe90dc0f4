// tandem.hpp -- a header-only C++17 layer over the C ABI (tandem.h), installed with it.
//
// Move-only RAII classes own the C handles (as ONNX Runtime's onnxruntime_cxx_api.h does
// over its C API); a failed call throws tandem::c::Error carrying the status and the
// library's message. A C++ service links only the installed libtandem (find_package(Tandem),
// target Tandem::tandem), never the in-tree C++ API, so it keeps working across library
// versions with the same ABI (TANDEM_ABI_VERSION). Thread-safety is the C ABI's (tandem.h):
// Model may be shared, a Session serves one call at a time, Scheduler and Request are
// thread-safe.
#ifndef TANDEM_HPP
#define TANDEM_HPP

#include <algorithm>
#include <cstdint>
#include <functional>
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
  explicit operator bool() const noexcept { return h_ != nullptr; }
  void reset() noexcept {
    if (h_ != nullptr) (void)Free(std::exchange(h_, nullptr));
  }

 private:
  T* h_ = nullptr;
};

template <class S, tandem_status (*Init)(S*, size_t)>
S make_struct() {
  S s{};
  check(Init(&s, sizeof s));
  return s;
}

/// An immutable loaded GGUF model (tandem_model_load).
class Model {
 public:
  explicit Model(const std::string& path) {
    tandem_model* h = nullptr;
    check(tandem_model_load(path.c_str(), nullptr, &h));
    h_ = Handle<tandem_model, tandem_model_free>(h);
  }
  tandem_model* get() const noexcept { return h_.get(); }
  tandem_model_info info() const {
    auto i = make_struct<tandem_model_info, tandem_model_info_init>();
    check(tandem_model_get_info(h_.get(), &i));
    return i;
  }
  std::vector<int32_t> tokenize(std::string_view text, bool add_special = true) const {
    size_t n = 0;
    const uint32_t flags = add_special ? TANDEM_TOKENIZE_ADD_SPECIAL : 0u;
    check(tandem_tokenize(h_.get(), text.data(), text.size(), flags, nullptr, 0, &n));
    std::vector<int32_t> ids(n);
    check(tandem_tokenize(h_.get(), text.data(), text.size(), flags, ids.data(), ids.size(), &n));
    return ids;
  }
  /// A GGUF metadata value as text (tandem_model_meta_value).
  std::string meta(const std::string& key) const {
    size_t n = 0;
    check(tandem_model_meta_value(h_.get(), key.c_str(), nullptr, 0, &n));
    std::string out(n + 1, '\0');
    check(tandem_model_meta_value(h_.get(), key.c_str(), out.data(), out.size(), &n));
    out.resize(n);
    return out;
  }

 private:
  Handle<tandem_model, tandem_model_free> h_;
};

/// A CPU thread pool shared by sessions and executors (tandem_pool_create): set
/// tandem_session_params::pool / tandem_executor_params::pool to get().
class Pool {
 public:
  explicit Pool(int32_t n_threads = 0) {
    tandem_pool* h = nullptr;
    check(tandem_pool_create(n_threads, &h));
    h_ = Handle<tandem_pool, tandem_pool_free>(h);
  }
  tandem_pool* get() const noexcept { return h_.get(); }
  int32_t n_threads() const {
    int32_t n = 0;
    check(tandem_pool_get_threads(h_.get(), &n));
    return n;
  }

 private:
  Handle<tandem_pool, tandem_pool_free> h_;
};

/// What Session::generate produced.
struct GenerateResult {
  std::string text;
  std::vector<int32_t> tokens;
  int32_t finish_reason = -1;  ///< a tandem_finish_reason
};

/// One conversation (tandem_session_create). One call at a time; abort() from any thread.
class Session {
 public:
  explicit Session(const Model& model,
                   tandem_session_params params = make_struct<tandem_session_params, tandem_session_params_init>()) {
    tandem_session* h = nullptr;
    check(tandem_session_create(model.get(), &params, &h));
    h_ = Handle<tandem_session, tandem_session_free>(h);
  }
  tandem_session* get() const noexcept { return h_.get(); }

  /// Generate from `prompt`; on_piece(text) streams (return false to stop). Throws Error.
  GenerateResult generate(const std::string& prompt, tandem_generate_params params,
                          const std::function<bool(std::string_view)>& on_piece = {}) {
    GenerateResult out;
    auto r = make_struct<tandem_generate_result, tandem_generate_result_init>();
    out.tokens.resize(params.max_tokens > 0 ? size_t(params.max_tokens) : 0);
    r.tokens = out.tokens.data();
    r.tokens_cap = out.tokens.size();
    struct Ctx {
      std::string* text;
      const std::function<bool(std::string_view)>* fn;
    } ctx{&out.text, &on_piece};
    const auto cb = [](const char* piece, size_t len, int32_t, void* user) -> int {
      auto* c = static_cast<Ctx*>(user);
      c->text->append(piece, len);
      return (*c->fn && !(*c->fn)(std::string_view(piece, len))) ? 1 : 0;
    };
    check(tandem_session_generate(h_.get(), prompt.c_str(), &params, cb, &ctx, &r));
    out.tokens.resize(std::min(r.n_tokens, r.tokens_cap));
    out.finish_reason = r.finish_reason;
    return out;
  }
  /// Stop the generation running on this session (from another thread).
  void abort() { check(tandem_session_abort(h_.get())); }
  void reset() { check(tandem_session_reset(h_.get())); }

 private:
  Handle<tandem_session, tandem_session_free> h_;
};

/// A submitted request (tandem_request_*).
class Request {
 public:
  explicit Request(tandem_request* h) noexcept : h_(h) {}
  tandem_request* get() const noexcept { return h_.get(); }
  /// Block until the next event (timeout_ms < 0: no limit); kind TANDEM_EVENT_NONE on a
  /// timeout. `text` receives the event's text.
  tandem_request_event next_event(int32_t timeout_ms, std::string& text) {
    auto ev = make_struct<tandem_request_event, tandem_request_event_init>();
    text.resize(256);
    for (;;) {
      ev.text = text.data();
      ev.text_cap = text.size();
      const tandem_status st = tandem_request_next_event(h_.get(), timeout_ms, &ev);
      if (st == TANDEM_E_BUFFER_TOO_SMALL) {
        text.resize(ev.text_len + 1);
        continue;
      }
      check(st);
      text.resize(ev.text_len);
      return ev;
    }
  }
  void cancel() { check(tandem_request_cancel(h_.get())); }

 private:
  Handle<tandem_request, tandem_request_free> h_;
};

/// The scheduler (tandem_scheduler_create) and its sessions.
class Scheduler {
 public:
  Scheduler(const Model& model, const tandem_scheduler_params& params) {
    tandem_scheduler* h = nullptr;
    check(tandem_scheduler_create(model.get(), &params, &h));
    h_ = Handle<tandem_scheduler, tandem_scheduler_free>(h);
  }
  tandem_scheduler* get() const noexcept { return h_.get(); }
  Request submit(const tandem_request_params& params) {
    tandem_request* r = nullptr;
    check(tandem_scheduler_submit(h_.get(), &params, &r));
    return Request(r);
  }
  uint64_t open_session() {
    uint64_t id = 0;
    check(tandem_scheduler_session_open(h_.get(), &id));
    return id;
  }
  void close_session(uint64_t id) { check(tandem_scheduler_session_close(h_.get(), id)); }
  /// Move a session's KV to the File tier / back to the compute tier between requests.
  void park_session(uint64_t id) { check(tandem_scheduler_session_park(h_.get(), id)); }
  void unpark_session(uint64_t id) { check(tandem_scheduler_session_unpark(h_.get(), id)); }
  tandem_scheduler_session_info session_info(uint64_t id) {
    auto info = make_struct<tandem_scheduler_session_info, tandem_scheduler_session_info_init>();
    check(tandem_scheduler_session_get_info(h_.get(), id, &info));
    return info;
  }

 private:
  Handle<tandem_scheduler, tandem_scheduler_free> h_;
};

}  // namespace tandem::c

#endif  // TANDEM_HPP
