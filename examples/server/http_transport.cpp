// tandem-server: the connection layer under cpp-httplib (see http_transport.hpp).
#include "http_transport.hpp"

#include <arpa/inet.h>
#include <netdb.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fmt/format.h>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <chrono>
#include <cstring>
#include <string_view>
#include <system_error>
#include <vector>

#include "openai_json.hpp"

namespace tandem::server {

namespace {

using Clock = std::chrono::steady_clock;

thread_local ConnectionState* tls_connection = nullptr;
/// How many connections were open with this one when it was accepted (ConnectionThreads).
thread_local size_t tls_position = 0;

/// The methods httplib parses (it answers any other with a bare 400).
bool known_method(std::string_view m) {
  static constexpr std::string_view kKnown[] = {"GET",     "HEAD",    "POST",  "PUT",   "DELETE",
                                                "CONNECT", "OPTIONS", "TRACE", "PATCH", "PRI"};
  return std::find(std::begin(kKnown), std::end(kKnown), m) != std::end(kKnown);
}

ApiError too_many_connections() {
  return ApiError(503, "too many open connections; retry", "", "too_many_connections");
}

ApiError budget_exhausted(size_t capacity) {
  return ApiError(
      503, fmt::format("request bodies in flight would exceed the server's body budget ({} bytes); retry", capacity),
      "", "body_budget_exhausted");
}

std::string_view reason_phrase(int status) {
  switch (status) {
    case 400:
      return "Bad Request";
    case 408:
      return "Request Timeout";
    case 413:
      return "Payload Too Large";
    case 414:
      return "URI Too Long";
    case 431:
      return "Request Header Fields Too Large";
    case 501:
      return "Not Implemented";
    case 503:
      return "Service Unavailable";
    default:
      return "Error";
  }
}

/// Answer `e` (the OpenAI error object) on a connection that closes after it; a 503 says
/// Retry-After. Small enough for the socket's send buffer: never waits for the client.
void send_refusal(int sock, const ApiError& e) {
  const std::string body = e.body().dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const std::string reply = fmt::format(
      "HTTP/1.1 {} {}\r\nContent-Type: application/json\r\n{}Connection: close\r\nContent-Length: {}\r\n\r\n{}",
      e.status(), reason_phrase(e.status()), e.status() == 503 ? "Retry-After: 1\r\n" : "", body.size(), body);
  (void)::send(sock, reply.data(), reply.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
}

/// Whether the header line `line` ("Name: value") is named `name` (case-insensitive).
bool header_named(std::string_view line, std::string_view name) {
  return line.size() > name.size() && line[name.size()] == ':' &&
         std::equal(name.begin(), name.end(), line.begin(), [](char a, char b) {
           return std::tolower(static_cast<unsigned char>(a)) == std::tolower(static_cast<unsigned char>(b));
         });
}

/// The header lines of a response head ("status line\r\nName: value\r\n...\r\n\r\n"), in order.
std::vector<std::string_view> header_lines(std::string_view head) {
  std::vector<std::string_view> lines;
  for (size_t at = head.find("\r\n"); at != std::string_view::npos && at + 4 <= head.size();) {
    const size_t end = head.find("\r\n", at + 2);
    if (end == at + 2 || end == std::string_view::npos) break;  // the blank line ends the head
    lines.push_back(head.substr(at + 2, end - at - 2));
    at = end;
  }
  return lines;
}

/// poll() one socket for `events` up to `timeout_ms` (EINTR retried): >0 ready, 0 timeout, <0 error.
int wait_for(int sock, short events, int timeout_ms) {
  pollfd p{sock, events, 0};
  for (;;) {
    const int r = ::poll(&p, 1, timeout_ms);
    if (r < 0 && errno == EINTR) continue;
    return r;
  }
}

/// wait_for(POLLIN) in slices, giving up (-1) once the server stops listening: an idle or
/// slow connection does not hold a shutdown for its whole deadline.
int wait_readable(int sock, int timeout_ms, const std::atomic<socket_t>& listening) {
  for (;;) {
    if (listening.load() == INVALID_SOCKET) return -1;
    const int slice = std::min(timeout_ms, 200);
    const int r = wait_for(sock, POLLIN, slice);
    if (r != 0 || slice == timeout_ms) return r;
    timeout_ms -= slice;
  }
}

int to_ms(time_t sec, time_t usec) {
  const long long ms = (long long)sec * 1000 + usec / 1000;
  return ms > 0x7fffffff ? 0x7fffffff : int(ms);
}

void address_of(int sock, bool peer, std::string& ip, int& port) {
  sockaddr_storage addr{};
  socklen_t len = sizeof addr;
  const int r = peer ? ::getpeername(sock, reinterpret_cast<sockaddr*>(&addr), &len)
                     : ::getsockname(sock, reinterpret_cast<sockaddr*>(&addr), &len);
  if (r != 0) return;
  char host[NI_MAXHOST] = {};
  char serv[NI_MAXSERV] = {};
  if (::getnameinfo(reinterpret_cast<sockaddr*>(&addr), len, host, sizeof host, serv, sizeof serv,
                    NI_NUMERICHOST | NI_NUMERICSERV) == 0) {
    ip = host;
    port = std::atoi(serv);
  }
}

/// httplib's SocketStream plus the header deadline and byte cap: while `state.in_headers`,
/// a read waits at most until the deadline and counts against the cap; after that a body
/// read waits at most until the body deadline (end_of_headers) and the server's read
/// timeout; writes wait at most the write timeout per call.
class ConnectionStream final : public httplib::Stream {
 public:
  ConnectionStream(int sock, const TransportLimits& limits, ConnectionState& state, int read_timeout_ms,
                   int write_timeout_ms, const std::atomic<socket_t>& listening)
      : listening_(listening),
        sock_(sock),
        limits_(limits),
        state_(state),
        read_timeout_ms_(read_timeout_ms),
        write_timeout_ms_(write_timeout_ms) {}

  void begin_request(Clock::time_point deadline) {
    deadline_ = deadline;
    header_bytes_ = 0;
    line_ = LineScan{};
    head_written_ = false;
  }
  bool has_buffered() const { return off_ < len_; }

  bool is_readable() const override { return has_buffered() || wait_for(sock_, POLLIN, read_timeout_ms_) > 0; }
  bool is_writable() const override {
    if (wait_for(sock_, POLLOUT, write_timeout_ms_) <= 0) return false;
    // Alive: nothing to read, or something (not end of stream) to read.
    if (wait_for(sock_, POLLIN, 0) == 0) return true;
    char c;
    return ::recv(sock_, &c, 1, MSG_PEEK | MSG_DONTWAIT) > 0;
  }

  ssize_t read(char* ptr, size_t size) override {
    if (off_ == len_) {
      const auto until = state_.in_headers ? deadline_ : state_.body_deadline;
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
      bool& timed_out = state_.in_headers ? state_.header_timeout : state_.body_timeout;
      if (left <= 0) {
        timed_out = true;
        return -1;
      }
      const int timeout_ms = int(std::min<long long>(left, state_.in_headers ? 0x7fffffff : read_timeout_ms_));
      const int r =
          state_.in_headers ? wait_readable(sock_, timeout_ms, listening_) : wait_for(sock_, POLLIN, timeout_ms);
      if (r <= 0) {
        // A body read that waited out the read timeout (a stalled upload) has timed out too.
        if (r == 0 && (timeout_ms == left || !state_.in_headers)) timed_out = true;
        return -1;
      }
      ssize_t n;
      do {
        n = ::recv(sock_, buf_, sizeof buf_, 0);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return n;
      off_ = 0;
      len_ = size_t(n);
    }
    const size_t n = std::min(size, len_ - off_);
    if (state_.in_headers) {
      for (size_t i = 0; i < n; ++i) scan_header_byte(buf_[off_ + i]);  // may throw ApiError (the request line)
      header_bytes_ += n;
      if (header_bytes_ > limits_.header_max_bytes) {
        state_.header_overflow = true;
        return -1;
      }
    }
    std::memcpy(ptr, buf_ + off_, n);
    off_ += n;
    return ssize_t(n);
  }

  ssize_t write(const char* ptr, size_t size) override {
    const std::string_view data(ptr, size);
    // httplib writes a response's status line and headers in one call (a 100 Continue first).
    if (!head_written_ && data.size() > 12 && data.substr(0, 9) == "HTTP/1.1 " && data[9] != '1' &&
        data.substr(data.size() - 4) == "\r\n\r\n") {
      head_written_ = true;
      const std::string head = connection_headers(data);
      return send_all(head.data(), head.size()) ? ssize_t(size) : -1;
    }
    return send_all(ptr, size) ? ssize_t(size) : -1;
  }

  void get_remote_ip_and_port(std::string& ip, int& port) const override { address_of(sock_, true, ip, port); }
  void get_local_ip_and_port(std::string& ip, int& port) const override { address_of(sock_, false, ip, port); }
  socket_t socket() const override { return sock_; }

 private:
  /// All of `data`, waiting at most the write timeout per send (false: not all sent).
  bool send_all(const char* p, size_t size) {
    while (size > 0) {
      if (wait_for(sock_, POLLOUT, write_timeout_ms_) <= 0) return false;
      ssize_t n;
      do {
        n = ::send(sock_, p, size, MSG_NOSIGNAL);
      } while (n < 0 && errno == EINTR);
      if (n <= 0) return false;
      p += n;
      size -= size_t(n);
    }
    return true;
  }

  /// The response head `head` with the connection's own headers: when the connection closes
  /// after it (the request never reached routing, its body was not read whole, or the
  /// response says so), `Connection: close` and no `Keep-Alive`; `Retry-After: 1` when the
  /// transport asked for it.
  std::string connection_headers(std::string_view head) const {
    const std::vector<std::string_view> lines = header_lines(head);
    const auto has = [&](std::string_view name) {
      return std::any_of(lines.begin(), lines.end(), [&](std::string_view l) { return header_named(l, name); });
    };
    const bool closes =
        state_.in_headers || state_.close_after || std::any_of(lines.begin(), lines.end(), [](std::string_view l) {
          return header_named(l, "Connection") && l.substr(l.find(':') + 1).find("close") != l.npos;
        });
    const bool retry = state_.retry_after && !has("Retry-After");
    if (!closes && !retry) return std::string(head);
    std::string out(head.substr(0, head.find("\r\n")));  // the status line
    for (const std::string_view line : lines) {
      if (closes && (header_named(line, "Keep-Alive") || header_named(line, "Connection"))) continue;
      out.append("\r\n").append(line);
    }
    if (closes) out.append("\r\nConnection: close");
    if (retry) out.append("\r\nRetry-After: 1");
    out.append("\r\n\r\n");
    return out;
  }

  /// Where the header reader is in the current line: httplib skips a header line without
  /// a colon (and reads a folded line as a header of its own), a request smuggling vector
  /// behind proxies that read them otherwise, so such a line marks the request malformed.
  /// The first line is the request line (httplib refuses an empty one): a method httplib
  /// does not know is 501 (it would answer a bare 400), a line longer than
  /// request_line_max_bytes 414 as soon as it is (ApiError, answered by the connection loop).
  struct LineScan {
    bool request_line_seen = false;
    size_t length = 0;  ///< bytes of the line so far, CR excluded
    bool colon = false;
    std::string method;  ///< the request line's first word (its first 16 bytes)
    bool method_done = false;
  };

  void scan_header_byte(char c) {
    if (!line_.request_line_seen) {
      if (c == '\n') {
        line_.request_line_seen = true;
        if (line_.method_done && !known_method(line_.method)) {
          throw ApiError(501, fmt::format("method '{}' is not implemented", line_.method), "",
                         "method_not_implemented");
        }
      } else if (c != '\r') {
        if (++line_.length > limits_.request_line_max_bytes) {
          throw ApiError(414, fmt::format("the request line exceeds {} bytes", limits_.request_line_max_bytes), "",
                         "uri_too_long");
        }
        if (c == ' ') line_.method_done = true;
        if (!line_.method_done && line_.method.size() < 16) line_.method += c;
        return;
      }
      line_.length = 0;
      return;
    }
    if (c == '\n') {
      if (line_.length > 0 && !line_.colon) state_.header_malformed = true;
      line_.length = 0;
      line_.colon = false;
    } else if (c != '\r') {
      if (line_.length == 0 && (c == ' ' || c == '\t')) state_.header_malformed = true;
      ++line_.length;
      line_.colon = line_.colon || c == ':';
    }
  }

  const std::atomic<socket_t>& listening_;
  int sock_;
  const TransportLimits& limits_;
  ConnectionState& state_;
  int read_timeout_ms_;
  int write_timeout_ms_;
  Clock::time_point deadline_{};
  size_t header_bytes_ = 0;
  LineScan line_;
  bool head_written_ = false;  ///< this request's response head went out
  char buf_[4096];
  size_t off_ = 0, len_ = 0;
};

/// Closing with unread input sends a reset, which can destroy the response before the
/// client reads it (a 413 while it is still uploading): stop sending, then read and drop
/// what still arrives for a little while (bounded in time and bytes), as nginx's lingering close.
void linger(int sock) {
  ::shutdown(sock, SHUT_WR);
  const auto until = Clock::now() + std::chrono::seconds(2);
  char buf[16384];
  for (size_t drained = 0; drained < (size_t(64) << 20);) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(until - Clock::now()).count();
    if (left <= 0 || wait_for(sock, POLLIN, int(left)) <= 0) break;
    const ssize_t n = ::recv(sock, buf, sizeof buf, 0);
    if (n <= 0) break;
    drained += size_t(n);
  }
}

Clock::time_point deadline_in(double seconds) {
  return Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(seconds));
}

}  // namespace

void end_of_headers(ConnectionState& c, const TransportLimits& limits) noexcept {
  c.in_headers = false;
  c.body_deadline = deadline_in(limits.body_timeout_s);
}

ConnectionState* current_connection() noexcept {
  return tls_connection;
}

bool client_gone() noexcept {
  const ConnectionState* c = current_connection();
  if (c == nullptr || c->sock < 0) return false;
  char b = 0;
  const ssize_t n = ::recv(c->sock, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

bool BodyBudget::take(size_t n) noexcept {
  size_t used = used_.load();
  do {
    if (n > capacity_ - used) return false;
  } while (!used_.compare_exchange_weak(used, used + n));
  return true;
}

ConnectionThreads::ConnectionThreads(size_t max_threads, size_t warm, std::atomic<size_t>& open)
    : max_threads_(max_threads), open_(open) {
  std::lock_guard<std::mutex> lk(mu_);
  try {
    for (size_t i = 0; i < std::min(warm, max_threads); ++i) threads_.emplace_back([this] { work(); });
  } catch (const std::system_error&) {
    // Fewer warm threads: more start on demand.
  }
}

ConnectionThreads::~ConnectionThreads() {
  shutdown();
}

void ConnectionThreads::enqueue(std::function<void()> fn) {
  std::unique_lock<std::mutex> lk(mu_);
  jobs_.push_back(Job{std::move(fn), open_.fetch_add(1) + 1});
  if (idle_ < jobs_.size() && threads_.size() < max_threads_) {
    try {
      threads_.emplace_back([this] { work(); });
    } catch (const std::system_error&) {
      // No thread now: the job waits for one of those running (there is at least one
      // unless the very first failed; then the next accept tries again).
    }
  }
  lk.unlock();
  cv_.notify_one();
}

void ConnectionThreads::shutdown() {
  std::vector<std::thread> threads;
  {
    std::lock_guard<std::mutex> lk(mu_);
    shutdown_ = true;
    threads.swap(threads_);
  }
  cv_.notify_all();
  for (auto& t : threads) t.join();
}

void ConnectionThreads::work() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    ++idle_;
    cv_.wait(lk, [&] { return shutdown_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;  // shutting down, nothing left
    Job job = std::move(jobs_.front());
    jobs_.pop_front();
    lk.unlock();
    tls_position = job.position;
    job.fn();
    lk.lock();
  }
}

BoundedServer::BoundedServer(TransportLimits limits, size_t warm_threads)
    : limits_(limits), body_budget_(limits.body_budget) {
  // SO_REUSEADDR only (a restart binds over TIME_WAIT sockets); the library's default,
  // SO_REUSEPORT, let a second server bind a port another one listens on and take half of
  // its connections. Now that bind fails (EADDRINUSE), as llama-server's.
  set_socket_options([](socket_t sock) {
    int yes = 1;
    (void)::setsockopt(sock, SOL_SOCKET, SO_REUSEADDR, &yes, sizeof(yes));
  });
  // A connection over the cap and the reserve gets its 503 from a thread of its own: a few
  // spare threads.
  const size_t max_threads = limits_.max_connections + limits_.probe_reserve + 64;
  new_task_queue = [this, max_threads, warm_threads] {
    return new ConnectionThreads(max_threads, warm_threads, open_);
  };
}

bool BoundedServer::bind(const std::string& host, int port, int backlog) {
  if (!bind_to_port(host, port)) return false;
  // Linux: listen() again on a listening socket sets its backlog.
  (void)::listen(svr_sock_, backlog);
  return true;
}

bool BoundedServer::process_and_close_socket(socket_t sock) {
  struct Open {
    std::atomic<size_t>& n;
    ~Open() { n.fetch_sub(1); }
  } open{open_};
  bool ret = false;
  // Counted in accept order by ConnectionThreads::enqueue.
  const bool probe_only = tls_position > limits_.max_connections;
  if (tls_position > limits_.max_connections + limits_.probe_reserve) {
    send_refusal(sock, too_many_connections());
  } else {
    ConnectionState state;
    tls_connection = &state;
    ConnectionStream strm(sock, limits_, state, to_ms(read_timeout_sec_, read_timeout_usec_),
                          to_ms(write_timeout_sec_, write_timeout_usec_), svr_sock_);
    // Before routing, once the headers are parsed: a reserve connection serves the probes
    // only; a declared body takes its bytes from the budget now, before any is read (a
    // Content-Length over the body limit is refused by the routes, unread: not reserved).
    const auto admit = [&](httplib::Request& req) {
      if (probe_only &&
          !((req.method == "GET" || req.method == "HEAD") && (req.path == "/health" || req.path == "/metrics")))
        throw too_many_connections();
      const std::string cl = req.get_header_value("Content-Length");
      uint64_t length = 0;
      const auto [end, ec] = std::from_chars(cl.data(), cl.data() + cl.size(), length);
      if (ec != std::errc() || end != cl.data() + cl.size() || length == 0 || length > limits_.body_limit) return;
      if (!body_budget_.take(size_t(length))) throw budget_exhausted(body_budget_.capacity());
      state.budget_held = size_t(length);
    };
    const double header_timeout_s = probe_only ? limits_.probe_header_timeout_s : limits_.header_timeout_s;
    const size_t max_requests = probe_only ? 1 : keep_alive_max_count_;
    Clock::time_point deadline = deadline_in(header_timeout_s);  // the first request: from accept
    for (size_t count = max_requests; count > 0 && svr_sock_ != INVALID_SOCKET; --count) {
      if (count != max_requests) {  // keep-alive: wait for the next request to begin
        if (!strm.has_buffered() && wait_readable(sock, to_ms(keep_alive_timeout_sec_, 0), svr_sock_) <= 0) break;
        deadline = deadline_in(header_timeout_s);
      }
      state = ConnectionState{};
      state.sock = sock;
      state.budget = &body_budget_;
      strm.begin_request(deadline);
      bool closed = false;
      try {
        ret = process_request(strm, count == 1, closed, admit);
      } catch (const ApiError& e) {  // refused by the transport before routing (admit, the request line)
        send_refusal(sock, e);
        state.close_after = true;
        ret = false;
      }
      body_budget_.give(std::exchange(state.budget_held, 0));
      // Still "in headers": the request never reached routing (bad line, headers cut off).
      if (!ret || closed || state.close_after || state.in_headers) break;
    }
    tls_connection = nullptr;
    if (state.close_after) linger(sock);
  }
  ::shutdown(sock, SHUT_RDWR);
  ::close(sock);
  return ret;
}

int read_body(const httplib::ContentReader& reader, size_t limit, std::string& out) {
  auto* c = current_connection();
  bool over = false;
  bool over_budget = false;
  const bool ok = reader([&](const char* data, size_t n) {
    if (n > limit - out.size()) {
      over = true;
      return false;
    }
    // A chunked body (or one longer than declared) takes what it lacks from the budget.
    if (c && c->budget && out.size() + n > c->budget_held) {
      const size_t more = out.size() + n - c->budget_held;
      if (!c->budget->take(more)) {
        over_budget = true;
        return false;
      }
      c->budget_held += more;
    }
    out.append(data, n);
    return true;
  });
  if (ok && !over && !over_budget) return 0;
  if (c) c->close_after = true;
  if (over_budget) {
    c->retry_after = true;
    throw budget_exhausted(c->budget->capacity());
  }
  return over ? 413 : c && c->body_timeout ? 408 : 400;
}
size_t raise_open_file_limit(size_t want) {
  rlimit rl{};
  if (::getrlimit(RLIMIT_NOFILE, &rl) != 0) return want;
  if (rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur < want) {
    rlimit raised = rl;
    raised.rlim_cur = rl.rlim_max == RLIM_INFINITY ? rlim_t(want) : std::min<rlim_t>(rl.rlim_max, want);
    if (::setrlimit(RLIMIT_NOFILE, &raised) == 0) rl = raised;
  }
  return rl.rlim_cur == RLIM_INFINITY ? want : size_t(rl.rlim_cur);
}

}  // namespace tandem::server
