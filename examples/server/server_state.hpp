// tandem-server: what every HTTP handler shares — options, the engine once loaded, the
// metrics, the request log, and the in-flight bookkeeping used by graceful shutdown.
//
// Thread-safety: `engine` and `info` are written once before `ready` is set (release) and
// only read after it is seen (acquire); the rest is atomic or internally locked.
#pragma once

#include <atomic>
#include <cstdint>
#include <memory>
#include <mutex>
#include <random>
#include <string>

#include <nlohmann/json.hpp>

#include "openai_json.hpp"
#include "prometheus_metrics.hpp"
#include "serving_engine.hpp"

namespace tandem::server {

struct ServerOptions {
  std::string host = "127.0.0.1";
  int port = 8080;
  std::string api_key;               ///< "" = no authentication
  std::string alias;                 ///< the model id answered by /v1/models ("" = file stem)
  bool log_json = false;             ///< --log-format json: one JSON object per line on stderr
  bool verbose = false;              ///< also log the Scheduler's debug lines
  size_t body_limit = 8u << 20;      ///< request bodies larger than this get 413
  int threads_http = 0;              ///< HTTP threads started at once (0 = enough for every slot and queue entry)
  size_t max_connections = 1024;     ///< open connections at most (a thread each); beyond: 503
  double header_timeout_s = 10.0;    ///< the request line and headers must arrive within this
  double body_timeout_s = 60.0;      ///< then the whole request body must arrive within this
  double grammar_deadline_s = 10.0;  ///< a request's grammar compile, its turn included (ModelInfo)
  double shutdown_grace_s = 30.0;
};

/// Lines on stderr: plain text, or one JSON object per line (--log-format json).
class Log {
 public:
  explicit Log(bool json) : json_(json) {}
  /// `fields` is a JSON object; `msg` names the event ("request", "listening", ...).
  void write(std::string_view level, std::string_view msg, nlohmann::json fields = nlohmann::json::object());

 private:
  bool json_;
  std::mutex mu_;
};

struct ServerState {
  ServerOptions options;
  Log log{false};
  std::atomic<bool> ready{false};     ///< the model is loaded and the Scheduler runs
  std::atomic<bool> draining{false};  ///< shutting down: new generation requests get 503
  std::unique_ptr<ServingEngine> engine;
  ModelInfo info;
  std::unique_ptr<PrometheusMetrics> metrics;
  int64_t created = 0;            ///< model load time (Unix seconds), for /v1/models
  std::atomic<int> in_flight{0};  ///< generation requests submitted and not yet finished
  /// Response ids ("chatcmpl-..."): a random start per process, so replicas do not collide.
  std::atomic<uint64_t> next_id{(uint64_t(std::random_device{}()) << 32) ^ std::random_device{}()};

  explicit ServerState(ServerOptions o) : options(std::move(o)), log(options.log_json) {}
};

}  // namespace tandem::server
