// tandem-server: HTTP routes (see http_routes.hpp).
#include "http_routes.hpp"

#include <fmt/format.h>

#include <chrono>
#include <cstdio>
#include <ctime>

#include "sse_stream.hpp"
#include "tandem/error.hpp"

namespace tandem::server {

using nlohmann::json;

void Log::write(std::string_view level, std::string_view msg, json fields) {
  const double ts = std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  std::string line;
  if (json_) {
    json j = {{"ts", ts}, {"level", level}, {"msg", msg}};
    for (auto it = fields.begin(); it != fields.end(); ++it) j[it.key()] = it.value();
    line = j.dump(-1, ' ', false, json::error_handler_t::replace);
  } else {
    line = fmt::format("tandem-server: {} {}", level, msg);
    for (auto it = fields.begin(); it != fields.end(); ++it) {
      line += fmt::format(" {}={}", it.key(),
                          it.value().is_string() ? it.value().get<std::string>()
                                                 : it.value().dump(-1, ' ', false, json::error_handler_t::replace));
    }
  }
  line += '\n';
  std::lock_guard<std::mutex> lk(mu_);
  std::fwrite(line.data(), 1, line.size(), stderr);
  std::fflush(stderr);
}

namespace {

void send_error(httplib::Response& res, const ApiError& e) {
  res.status = e.status();
  res.set_content(e.body().dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

void send_json(httplib::Response& res, const json& j) {
  res.set_content(j.dump(-1, ' ', false, json::error_handler_t::replace), "application/json");
}

/// Run a handler; ApiError and tandem::Error become the OpenAI error object.
template <class F>
httplib::Server::Handler guarded(ServerState& st, std::string_view endpoint, F f) {
  return [&st, endpoint, f](const httplib::Request& req, httplib::Response& res) {
    try {
      f(req, res);
    } catch (const ApiError& e) {
      st.log.write("info", "rejected", {{"endpoint", endpoint}, {"status", e.status()}, {"error", e.what()}});
      send_error(res, e);
    } catch (const Error& e) {
      const int status = e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kContextOverflow ? 400 : 500;
      st.log.write("info", "rejected", {{"endpoint", endpoint}, {"status", status}, {"error", e.what()}});
      send_error(res, ApiError(status, e.what(), "", std::string(error_code_name(e.code()))));
    }
  };
}

bool public_path(const std::string& path) {
  return path == "/health" || path == "/metrics";
}

std::string bearer_token(const httplib::Request& req) {
  const std::string auth = req.get_header_value("Authorization");
  static constexpr std::string_view kBearer = "Bearer ";
  if (auth.size() > kBearer.size() && auth.compare(0, kBearer.size(), kBearer) == 0) return auth.substr(kBearer.size());
  return req.get_header_value("x-api-key");
}

}  // namespace

void register_routes(httplib::Server& svr, ServerState& st) {
  svr.set_payload_max_length(st.options.body_limit);

  // Before routing: authentication, then "loading" / "shutting down".
  svr.set_pre_routing_handler([&st](const httplib::Request& req, httplib::Response& res) {
    if (public_path(req.path)) return httplib::Server::HandlerResponse::Unhandled;
    if (!st.options.api_key.empty() && bearer_token(req) != st.options.api_key) {
      send_error(res, ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "", "invalid_api_key"));
      return httplib::Server::HandlerResponse::Handled;
    }
    if (!st.ready.load(std::memory_order_acquire)) {
      send_error(res, ApiError(503, "the model is loading", "", "model_loading"));
      return httplib::Server::HandlerResponse::Handled;
    }
    return httplib::Server::HandlerResponse::Unhandled;
  });
  // Statuses set by httplib itself (404 no route, 413 body too large, 400 bad request line).
  svr.set_error_handler(
      httplib::Server::HandlerWithResponse([&st](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        if (res.status == 413) {
          send_error(res, ApiError(413, fmt::format("the request body exceeds {} bytes", st.options.body_limit), "",
                                   "request_too_large"));
        } else if (res.status == 404) {
          send_error(res, ApiError(404, fmt::format("no route {} {}", req.method, req.path), "", "not_found"));
        } else {
          send_error(res, ApiError(res.status, fmt::format("HTTP {}", res.status)));
        }
        return httplib::Server::HandlerResponse::Handled;
      }));
  svr.set_exception_handler([&st](const httplib::Request&, httplib::Response& res, std::exception_ptr ep) {
    std::string what = "internal error";
    try {
      std::rethrow_exception(ep);
    } catch (const std::exception& e) {
      what = e.what();
    } catch (...) {
    }
    st.log.write("error", "exception", {{"error", what}});
    send_error(res, ApiError(500, what));
  });

  svr.Get("/health", [&st](const httplib::Request&, httplib::Response& res) {
    if (!st.ready.load(std::memory_order_acquire)) {
      send_error(res, ApiError(503, "the model is loading", "", "model_loading"));
    } else if (st.draining.load()) {
      send_error(res, ApiError(503, "the server is shutting down", "", "server_shutting_down"));
    } else {
      send_json(res, {{"status", "ok"}});
    }
  });
  svr.Get("/metrics", [&st](const httplib::Request&, httplib::Response& res) {
    if (!st.ready.load(std::memory_order_acquire)) {
      send_error(res, ApiError(503, "the model is loading", "", "model_loading"));
      return;
    }
    res.set_content(st.metrics->render(st.engine->metrics()), "text/plain; version=0.0.4; charset=utf-8");
  });

  const auto models = guarded(st, "/v1/models", [&st](const httplib::Request&, httplib::Response& res) {
    const auto& hp = st.engine->model().hparams();
    json m = {{"id", st.info.names.front()},
              {"object", "model"},
              {"created", st.created},
              {"owned_by", "tandem"},
              {"meta",
               {{"n_ctx", st.info.n_ctx},
                {"n_ctx_train", hp.n_ctx_train},
                {"n_vocab", st.info.tokenizer->n_vocab()},
                {"chat_template", st.engine->chat_template().name()},
                {"executors", st.engine->executor_names()}}}};
    send_json(res, {{"object", "list"}, {"data", json::array({m})}});
  });
  svr.Get("/v1/models", models);
  svr.Get("/models", models);

  const auto generation = [&st](bool chat, std::string_view endpoint) {
    return guarded(st, endpoint, [&st, chat, endpoint](const httplib::Request& req, httplib::Response& res) {
      if (st.draining.load()) throw ApiError(503, "the server is shutting down", "", "server_shutting_down");
      const json body = parse_body(req.body);
      const std::string sla = req.get_header_value("x-tandem-sla");
      GenerationSpec spec =
          chat ? parse_chat_request(body, st.info, sla) : parse_completion_request(body, st.info, sla);
      run_generation(st, std::move(spec), res, endpoint);
    });
  };
  svr.Post("/v1/chat/completions", generation(true, "/v1/chat/completions"));
  svr.Post("/chat/completions", generation(true, "/v1/chat/completions"));
  svr.Post("/v1/completions", generation(false, "/v1/completions"));
  svr.Post("/completions", generation(false, "/v1/completions"));

  svr.Post("/tokenize", guarded(st, "/tokenize", [&st](const httplib::Request& req, httplib::Response& res) {
             send_json(res, tokenize_response(parse_body(req.body), *st.info.tokenizer));
           }));
  svr.Post("/detokenize", guarded(st, "/detokenize", [&st](const httplib::Request& req, httplib::Response& res) {
             send_json(res, detokenize_response(parse_body(req.body), *st.info.tokenizer));
           }));
}

}  // namespace tandem::server
