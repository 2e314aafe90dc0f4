// tandem-server: the connection layer under cpp-httplib, bounded against hostile clients.
//
// Debian's cpp-httplib 0.11.4 is a compiled library (libcpp-httplib.so): its CPPHTTPLIB_*
// macros (header line length, thread count) are fixed when the library was built, and
// defining them here changes nothing. What it lacks, checked in its source:
//   - a chunked body is read whole, whatever set_payload_max_length says (read_content_chunked
//     has no limit); a Content-Length body over the limit is read and thrown away;
//   - a header line is buffered whole before its 8192-byte check, and headers have no count;
//   - one worker thread serves one connection from accept, with only a per-read timeout
//     (5 s): slow clients holding the fixed pool's threads starve /health;
//   - its ThreadPool queue is unbounded; its listen backlog is 5.
// What it offers and this uses: a virtual process_and_close_socket (the per-connection
// loop), the protected process_request over any Stream, new_task_queue, content-reader
// handlers (the body read through a receiver that can refuse), the pre-routing hook.
//
// BoundedServer serves each connection on its own thread (ConnectionThreads grows up to
// the connection cap), reads the request line and headers within a deadline and a byte
// cap, serves a few connections beyond the cap for GET /health and /metrics only (the
// probe reserve) and answers beyond that with 503 at once. Each body is bounded by
// read_body(); all bodies in flight together by the body budget (BodyBudget).
// What the transport refuses by itself (an unknown method, a request line over 8 KiB, a
// body over the budget, a non-probe request on the reserve) it answers with the OpenAI
// error object and closes. A response that closes the connection says `Connection: close`
// and offers no `Keep-Alive` (httplib adds one unless it decided the close itself).
#pragma once

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace tandem::server {

struct TransportLimits {
  size_t max_connections = 1024;       ///< open connections; beyond: 503 and close
  double header_timeout_s = 10.0;      ///< request line + headers must arrive within this
  double body_timeout_s = 60.0;        ///< then the whole body must arrive within this (beyond: 408)
  size_t header_max_bytes = 64 << 10;  ///< request line + headers, bytes (beyond: 431)
  size_t header_max_count = 100;       ///< header lines (beyond: 431)
  size_t request_line_max_bytes = CPPHTTPLIB_REQUEST_URI_MAX_LENGTH;  ///< beyond: 414 as soon as it is passed
  size_t body_limit = 8 << 20;  ///< one body, bytes (the routes answer 413 beyond it; not budgeted)
  /// Bytes of request bodies held by all connections together: reserved from Content-Length
  /// when the headers are read, taken chunk by chunk for a chunked body, given back when the
  /// request ends. A body that does not fit: 503 body_budget_exhausted with Retry-After.
  size_t body_budget = 64 << 20;
  size_t probe_reserve = 8;             ///< connections beyond max_connections, for GET /health and /metrics only
  double probe_header_timeout_s = 2.0;  ///< header deadline on a reserve connection (one request each)
};

/// The server-wide count of request-body bytes in flight, at most `capacity`. Thread-safe.
class BodyBudget {
 public:
  explicit BodyBudget(size_t capacity) : capacity_(capacity) {}
  /// Take `n` bytes if they fit (true), else take nothing (false).
  bool take(size_t n) noexcept;
  void give(size_t n) noexcept { used_.fetch_sub(n); }
  size_t capacity() const noexcept { return capacity_; }

 private:
  size_t capacity_;
  std::atomic<size_t> used_{0};
};

/// A thread per task, started when no thread is idle, up to `max_threads`; beyond that
/// tasks wait in the queue (each one is an accepted socket, already bounded by the cap).
/// Each task is counted in `open` when it is queued (the accept order) and runs knowing
/// (thread-locally) how many were open with it then, its position against the connection
/// cap; the task itself decrements `open`.
class ConnectionThreads : public httplib::TaskQueue {
 public:
  /// `warm` threads start at once.
  ConnectionThreads(size_t max_threads, size_t warm, std::atomic<size_t>& open);
  ~ConnectionThreads() override;
  void enqueue(std::function<void()> fn) override;
  void shutdown() override;

 private:
  void work();
  size_t max_threads_;
  std::mutex mu_;
  std::condition_variable cv_;
  struct Job {
    std::function<void()> fn;
    size_t position = 0;  ///< how many were open with this one, when it was accepted
  };
  std::atomic<size_t>& open_;
  std::deque<Job> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool shutdown_ = false;
};

/// What a handler knows of its connection (thread-local: one connection per thread).
struct ConnectionState {
  bool in_headers = true;        ///< still reading the request line and headers
  bool header_overflow = false;  ///< the header byte cap was hit
  bool header_timeout = false;   ///< the header deadline passed
  /// A header line without a colon, or an obsolete folded line (RFC 9112 5.1, 5.2): 400.
  bool header_malformed = false;
  bool close_after = false;      ///< the body was not read whole: close after this response
  bool body_timeout = false;     ///< the body deadline passed, or a body read waited out the read timeout (5 s)
  bool retry_after = false;      ///< the response carries `Retry-After: 1` (a transient refusal)
  BodyBudget* budget = nullptr;  ///< the server's (set per request)
  size_t budget_held = 0;        ///< bytes of it this request holds
  std::chrono::steady_clock::time_point body_deadline{};  ///< set by end_of_headers
  int sock = -1;                                          ///< the connection's socket
};

/// The headers are read: from now on reads belong to the body and must all arrive within
/// limits.body_timeout_s (a client trickling bytes cannot hold its thread for longer).
void end_of_headers(ConnectionState& c, const TransportLimits& limits) noexcept;

/// The calling thread's connection (nullptr outside a BoundedServer connection).
ConnectionState* current_connection() noexcept;

/// Whether the calling thread's client has closed its connection (an orderly shutdown or an
/// error on the socket; data it may still send does not count). Non-blocking; false outside
/// a connection. A handler that waits for a long result polls it (llama-server does too).
bool client_gone() noexcept;

class BoundedServer : public httplib::Server {
 public:
  /// `warm_threads`: threads started with the listener (more start on demand).
  BoundedServer(TransportLimits limits, size_t warm_threads);
  const TransportLimits& limits() const noexcept { return limits_; }
  /// bind_to_port, then a listen backlog of `backlog` (the library's is 5: a burst of
  /// connects beyond it waits for SYN retries, seconds).
  bool bind(const std::string& host, int port, int backlog = 1024);
  size_t open_connections() const noexcept { return open_.load(); }

 private:
  bool process_and_close_socket(socket_t sock) override;
  TransportLimits limits_;
  std::atomic<size_t> open_{0};
  BodyBudget body_budget_;
};

/// Read the request body through `reader`, at most `limit` bytes, into `out`, within the
/// connection's share of the body budget (grown chunk by chunk beyond what its
/// Content-Length reserved). Returns 0, or the status to answer: 413 when larger (reading
/// stops there), 408 when it did not arrive within the body deadline or stalled for the
/// read timeout, 400 when malformed or cut short. Either way the connection is closed after
/// the response. Throws ApiError 503 `body_budget_exhausted` (the response gets Retry-After)
/// when the body outgrows what the budget has left.
int read_body(const httplib::ContentReader& reader, size_t limit, std::string& out);

/// Raise the soft open-file limit towards `want` descriptors; returns the limit now in force.
size_t raise_open_file_limit(size_t want);

}  // namespace tandem::server
