// tandem-server: an OpenAI-compatible HTTP server over the Scheduler, with vLLM-style
// Prometheus metrics.
//
//   tandem-server -m MODEL.gguf [--executors cpu|cpu+cpu|gpu|cpu+gpu] [--host 127.0.0.1]
//                 [--port 8080] [-c N] [-np N] [-t N] [--api-key KEY] [--kv-tier host|file]
//                 [--kv-dir DIR] [--max-queued N] [--alias NAME] [--log-format text|json]
//                 [-ctk|--cache-type-k f16|f32|q8_0] [-ctv|--cache-type-v f16|f32|q8_0]
//                 [--body-limit BYTES] [--max-connections N] [--header-timeout S] [--body-timeout S]
//                 [--grammar-deadline S] [--shutdown-grace S]
//                 [--chat-template NAME_OR_JINJA | --chat-template-file FILE]
//
// The port opens first and /health answers 503 until the model is loaded. SIGTERM or
// SIGINT: stop accepting connections, let in-flight requests finish within
// --shutdown-grace seconds (a second signal ends the grace at once), cancel the rest, exit 0.
#include <fmt/format.h>
#include <httplib.h>
#include <CLI/CLI.hpp>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <thread>

#include "chat_template_flags.hpp"
#include "kv_cache_type.hpp"
#include "server/http_routes.hpp"
#include "server/http_transport.hpp"
#include "server/server_state.hpp"
#include "server/serving_engine.hpp"
#include "tandem/core/error.hpp"

namespace {

/// llama-server spells some flags with one dash and several letters (-np, -ctk, -ctv); CLI11 wants
/// those as long options.
std::vector<std::string> normalise_args(int argc, char** argv) {
  std::vector<std::string> args;
  for (int i = argc - 1; i >= 1; --i) {  // CLI11 parses a reversed vector
    const std::string a = argv[i];
    args.push_back(a == "-np" ? "--parallel" : tandem::cli::expand_cache_type_flag(a));
  }
  return args;
}

}  // namespace

int main(int argc, char** argv) {
  using namespace tandem::server;
  CLI::App app{"tandem-server: OpenAI-compatible HTTP server over the Tandem Scheduler", "tandem-server"};
  EngineOptions eo;
  ServerOptions so;
  std::string kv_tier = "host", kv_dir, log_format = "text", cache_type_k = "f16", cache_type_v = "f16";
  app.add_option("-m,--model", eo.model_path, "GGUF model file")->required();
  app.add_option("--executors", eo.executors, "cpu, cpu+cpu, gpu or cpu+gpu")
      ->capture_default_str()
      ->check(CLI::IsMember(
          std::vector<std::string>(tandem::executor_set_names().begin(), tandem::executor_set_names().end())));
  app.add_option("--host", so.host, "address to listen on")->capture_default_str();
  app.add_option("--port", so.port, "port to listen on")->capture_default_str()->check(CLI::Range(0, 65535));
  app.add_option("-c,--ctx-size", eo.n_ctx,
                 "context per sequence in tokens (0 = the model's training context, capped at 4096)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1 << 20));
  app.add_option("--parallel", eo.parallel, "sequences decoded at once per executor (slots; also -np)")
      ->capture_default_str()
      ->check(CLI::Range(1, 4096));  // -np is rewritten to --parallel
  app.add_option("-t,--threads", eo.threads, "CPU threads, all executors together (0 = physical cores)")
      ->capture_default_str()
      ->check(CLI::Range(0, 512));
  app.add_option("--threads-http", so.threads_http,
                 "HTTP threads started at once (one per open connection, more start as connections open, up to "
                 "--max-connections; 0 = 2 x slots + queue + 8, at most 512)")
      ->capture_default_str()
      ->check(CLI::Range(0, 4096));
  app.add_option("--api-key", so.api_key, "require 'Authorization: Bearer KEY' (not on /health, /metrics)")
      ->capture_default_str();
  app.add_option("--kv-tier", kv_tier, "host: KV in RAM only; file: plus a memory-mapped File tier for swap-out")
      ->capture_default_str()
      ->check(CLI::IsMember({"host", "file"}));
  app.add_option("--kv-dir", kv_dir, "directory of the File tier (default: the temp directory)")->capture_default_str();
  app.add_option("--cache-type-k", cache_type_k, "KV cache type of K: f16, f32 or q8_0 (also -ctk; same as V)")
      ->capture_default_str();
  app.add_option("--cache-type-v", cache_type_v, "KV cache type of V: f16, f32 or q8_0 (also -ctv; same as K)")
      ->capture_default_str();
  app.add_option("--max-queued", eo.max_queued, "waiting requests before 429 (all executors)")
      ->capture_default_str()
      ->check(CLI::Range(1, 1 << 20));
  app.add_option("--prefix-cache", eo.prefix_cache, "finished prompts kept per executor for prefix reuse (0 = off)")
      ->capture_default_str()
      ->check(CLI::Range(0, 1024));
  app.add_option("-a,--alias", so.alias, "model id in the API (default: the file name without .gguf)")
      ->capture_default_str();
  app.add_option("--log-format", log_format, "text or json (one object per line on stderr)")
      ->capture_default_str()
      ->check(CLI::IsMember({"text", "json"}));
  app.add_flag("-v,--verbose", so.verbose, "also log the Scheduler's decisions (preemptions, hand-offs)");
  app.add_option("--body-limit", so.body_limit, "largest request body in bytes (larger: 413)")
      ->capture_default_str()
      ->check(CLI::Range(size_t(1024), size_t(1) << 32));
  size_t body_budget = 0;
  app.add_option("--body-budget", body_budget,
                 "request-body bytes held by all connections together (default 8 x --body-limit); a body that "
                 "does not fit: 503 with Retry-After")
      ->check(CLI::Range(size_t(1024), size_t(1) << 40));
  app.add_option("--max-connections", so.max_connections,
                 "open connections at most (one thread each); beyond: 503 and close")
      ->capture_default_str()
      ->check(CLI::Range(size_t(8), size_t(1) << 16));
  app.add_option("--header-timeout", so.header_timeout_s,
                 "seconds a client has to send the request line and headers (then the connection is closed)")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--body-timeout", so.body_timeout_s,
                 "seconds a client has, after its headers, to send the whole request body (then 408 and close)")
      ->capture_default_str()
      ->check(CLI::Range(0.1, 3600.0));
  app.add_option("--grammar-deadline", so.grammar_deadline_s,
                 "seconds a request's json_schema / grammar / forced tool call may take to compile, waiting for "
                 "another's included (past it: 400 grammar_too_complex; no turn: 503)")
      ->capture_default_str()
      ->check(CLI::Range(0.001, 3600.0));
  app.add_option(
         "--shutdown-grace", so.shutdown_grace_s,
         "seconds in-flight requests may take to finish after SIGTERM/SIGINT (a second signal cancels them at once)")
      ->capture_default_str()
      ->check(CLI::Range(0.0, 3600.0));
  tandem::cli::ChatTemplateFlags chat_template_flags;
  tandem::cli::add_chat_template_flags(app, chat_template_flags);
  try {
    app.parse(normalise_args(argc, argv));
  } catch (const CLI::ParseError& e) {
    const int rc = app.exit(e);  // --help: 0; a refused flag: usage, 2 (as the other tools)
    return rc == 0 ? 0 : 2;
  }
  if (body_budget > 0 && body_budget < so.body_limit) {  // a body within the limit would never fit
    std::fprintf(stderr, "tandem-server: --body-budget (%zu) is below --body-limit (%zu)\n", body_budget,
                 so.body_limit);
    return 2;
  }
  eo.kv_file_tier = kv_tier == "file";
  if (const std::string bad = tandem::cli::resolve_cache_types(cache_type_k, cache_type_v, eo.kv_dtype); !bad.empty()) {
    std::fprintf(stderr, "tandem-server: %s\n", bad.c_str());
    return 2;
  }
  if (!kv_dir.empty()) eo.kv_dir = kv_dir;
  try {  // before the port opens: a template that cannot be used serves nothing
    eo.chat_template = tandem::cli::chat_template_override(chat_template_flags);
  } catch (const tandem::Error& e) {
    std::fprintf(stderr, "tandem-server: %s\n", e.what());
    return 1;
  }
  so.log_json = log_format == "json";
  if (so.alias.empty()) so.alias = std::filesystem::path(eo.model_path).stem().string();

  // Signals are taken by sigwait() below: block them in every thread this one starts.
  sigset_t sigs;
  sigemptyset(&sigs);
  sigaddset(&sigs, SIGINT);
  sigaddset(&sigs, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &sigs, nullptr);
  std::signal(SIGPIPE, SIG_IGN);

  ServerState st(so);
  TransportLimits limits;
  limits.header_timeout_s = so.header_timeout_s;
  limits.body_timeout_s = so.body_timeout_s;
  limits.body_limit = so.body_limit;
  limits.body_budget = body_budget > 0 ? body_budget : 8 * so.body_limit;
  // A descriptor per connection, plus the model, the KV files and the listener.
  const size_t nofile = raise_open_file_limit(so.max_connections + 64);
  limits.max_connections = std::min(so.max_connections, nofile > 128 ? nofile - 64 : size_t(64));
  // A connection holds its thread (a streaming request until it ends): threads start as
  // connections open, up to the cap (http_transport.hpp); http_threads are started at once.
  const int http_threads = so.threads_http > 0 ? so.threads_http : std::min(eo.parallel * 2 + eo.max_queued + 8, 512);
  BoundedServer svr(limits, size_t(http_threads));
  register_routes(svr, st, svr.limits());
  if (!svr.bind(so.host, so.port)) {
    st.log.write("error", "cannot listen", {{"host", so.host}, {"port", so.port}, {"error", std::strerror(errno)}});
    return 1;
  }
  std::atomic<bool> http_done{false};
  std::thread http([&] {
    svr.listen_after_bind();
    http_done.store(true);
  });
  // httplib's stop() does nothing before listen has started: wait for it (a model that
  // fails to load at once would otherwise leave the server listening forever).
  const auto stop_http = [&] {
    while (!svr.is_running() && !http_done.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
    svr.stop();
  };
  st.log.write("info", "listening",
               {{"host", so.host},
                {"port", so.port},
                {"http_threads", http_threads},
                {"max_connections", limits.max_connections},
                {"header_timeout_s", limits.header_timeout_s},
                {"body_timeout_s", limits.body_timeout_s},
                {"body_budget", limits.body_budget}});

  int rc = 0;
  try {
    const auto t0 = std::chrono::steady_clock::now();
    std::function<void(std::string_view)> sched_log;
    if (so.verbose) sched_log = [&st](std::string_view s) { st.log.write("debug", "scheduler", {{"line", s}}); };
    st.engine = std::make_unique<ServingEngine>(eo, sched_log);
    st.info.tokenizer = &st.engine->model().tokenizer();
    st.info.chat_template = &st.engine->chat_template();
    st.info.tool_prompt = tandem::tool_prompt_for_template(st.engine->chat_template().source());
    st.info.n_ctx = st.engine->n_ctx();
    st.info.names = {so.alias, eo.model_path};
    st.info.grammar_deadline = std::chrono::milliseconds(int64_t(so.grammar_deadline_s * 1000.0 + 0.5));
    CacheConfigInfo cache;
    cache.block_size = st.engine->page_size();
    cache.cache_dtype = std::string(tandem::kv_dtype_name(eo.kv_dtype));
    cache.prefix_caching = eo.prefix_cache > 0;
    for (const auto& e : st.engine->metrics().executors) {
      cache.num_gpu_blocks += e.kv[int(tandem::KvTier::kDevice)].capacity + e.kv[int(tandem::KvTier::kHost)].capacity;
      cache.num_cpu_blocks += e.kv[int(tandem::KvTier::kFile)].capacity;
    }
    st.metrics = std::make_unique<PrometheusMetrics>(so.alias, std::move(cache));
    st.created = int64_t(std::time(nullptr));
    if (!st.engine->chat_template().fallback_reason().empty()) {  // as tandem-cli --chat says it
      st.log.write("warn", "the model's chat template is not used",
                   {{"reason", st.engine->chat_template().fallback_reason()},
                    {"built_in_template", st.engine->chat_template().name()}});
    }
    st.ready.store(true, std::memory_order_release);
    st.log.write("info", "model loaded",
                 {{"model", so.alias},
                  {"path", eo.model_path},
                  {"executors", st.engine->executor_names()},
                  {"n_ctx", st.info.n_ctx},
                  {"parallel", eo.parallel},
                  {"chat_template", st.engine->chat_template().name()},
                  {"chat_template_jinja", st.engine->chat_template().is_jinja()},
                  {"chat_template_origin", st.engine->chat_template().origin()},
                  {"load_s", std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count()}});
  } catch (const ExecutorCreationError& e) {  // the model loaded; e.g. --executors gpu and no GPU
    st.log.write("error", "cannot create the executors",
                 {{"executors", eo.executors}, {"path", eo.model_path}, {"error", e.what()}});
    rc = 1;
  } catch (const std::exception& e) {
    st.log.write("error", "cannot load the model", {{"path", eo.model_path}, {"error", e.what()}});
    rc = 1;
  }

  if (rc == 0) {
    int sig = 0;
    sigwait(&sigs, &sig);
    st.log.write("info", "shutting down",
                 {{"signal", sig == SIGTERM ? "SIGTERM" : "SIGINT"},
                  {"in_flight", st.in_flight.load()},
                  {"grace_s", so.shutdown_grace_s}});
    st.draining.store(true);
    stop_http();  // closes the listening socket; workers finish the requests they hold
    const auto deadline =
        std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                               std::chrono::duration<double>(so.shutdown_grace_s));
    // A second SIGTERM / SIGINT ends the grace at once (as llama-server and uvicorn do).
    const timespec tick{0, 20'000'000};
    while (st.in_flight.load() > 0 && std::chrono::steady_clock::now() < deadline) {
      if (const int again = sigtimedwait(&sigs, nullptr, &tick); again > 0) {
        st.log.write("info", "second signal: cancelling the requests left",
                     {{"signal", again == SIGTERM ? "SIGTERM" : "SIGINT"}, {"in_flight", st.in_flight.load()}});
        break;
      }
    }
    const int left = st.in_flight.load();
    st.engine->shutdown();  // cancels whatever is left; their handlers answer and return
    st.log.write("info", "stopped", {{"cancelled", left}});
  } else {
    stop_http();
  }
  http.join();
  st.engine.reset();
  return rc;
}
