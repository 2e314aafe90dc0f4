// tandem-server: HTTP routes (see http_routes.hpp).
#include "http_routes.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cstdio>
#include <ctime>
#include <functional>
#include <memory>
#include <regex>
#include <set>

#include "http_transport.hpp"
#include "sse_stream.hpp"
#include "tandem/core/error.hpp"

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
    // A string with a control character (a client's "model" with a newline, say) is
    // written JSON-quoted, so that no value can start a line of its own.
    const auto printable = [](const std::string& v) {
      return std::none_of(v.begin(), v.end(), [](char c) { return (unsigned char)c < 0x20 || c == 0x7f; });
    };
    line = fmt::format("tandem-server: {} {}", level, msg);
    for (auto it = fields.begin(); it != fields.end(); ++it) {
      const json& v = it.value();
      line += fmt::format(" {}={}", it.key(),
                          v.is_string() && printable(v.get_ref<const std::string&>())
                              ? v.get_ref<const std::string&>()
                              : v.dump(-1, ' ', false, json::error_handler_t::replace));
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
      // The scheduler stopped under a request that passed the draining check before it.
      const ApiError api =
          st.draining.load()
              ? ApiError(503, "the server is shutting down", "", "server_shutting_down")
              : ApiError(e.code() == ErrorCode::kInvalidArgument || e.code() == ErrorCode::kContextOverflow ? 400 : 500,
                         e.what(), "", std::string(error_code_name(e.code())));
      st.log.write("info", "rejected", {{"endpoint", endpoint}, {"status", api.status()}, {"error", e.what()}});
      send_error(res, api);
    }
  };
}

/// A request body's framing from its headers (RFC 9112 6.3): `Content-Length` must be
/// digits only (repeated headers equal), never together with `Transfer-Encoding`; anything
/// else is `malformed` (answered 400: httplib would read "-1" as 2^64 - 1 and "12abc" as 12).
/// A length past 2^64 - 1 is that (over any body limit: 413).
struct BodyFraming {
  bool malformed = false;
  bool chunked = false;      ///< Transfer-Encoding present
  bool unsupported = false;  ///< a transfer coding other than a lone `chunked` (answered 501)
  uint64_t length = 0;       ///< Content-Length (0 when absent)
  std::string reason;        ///< why malformed
};

BodyFraming framing(const httplib::Request& req) {
  BodyFraming f;
  f.chunked = req.has_header("Transfer-Encoding");
  for (size_t i = 0; i < req.get_header_value_count("Transfer-Encoding"); ++i) {
    const std::string value = req.get_header_value("Transfer-Encoding", i);
    std::string_view v = value;
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
    // RFC 9112 6.1: a server that does not understand a transfer coding answers 501.
    if (i > 0 || v.size() != 7 || !std::equal(v.begin(), v.end(), "chunked", [](char a, char b) {
          return std::tolower(static_cast<unsigned char>(a)) == b;
        })) {
      f.unsupported = true;
      f.reason = fmt::format("Transfer-Encoding '{}' is not supported (only chunked)", v.substr(0, 64));
    }
  }
  const size_t n = req.get_header_value_count("Content-Length");
  for (size_t i = 0; i < n; ++i) {
    const std::string value = req.get_header_value("Content-Length", i);
    std::string_view v = value;
    while (!v.empty() && (v.front() == ' ' || v.front() == '\t')) v.remove_prefix(1);
    while (!v.empty() && (v.back() == ' ' || v.back() == '\t')) v.remove_suffix(1);
    if (v.empty() || !std::all_of(v.begin(), v.end(), [](char c) { return c >= '0' && c <= '9'; })) {
      f.malformed = true;
      f.reason = fmt::format("Content-Length '{}' is not a decimal number of bytes", v.substr(0, 64));
      return f;
    }
    uint64_t x = 0;
    for (const char c : v) {
      const uint64_t d = uint64_t(c - '0');
      x = x > (UINT64_MAX - d) / 10 ? UINT64_MAX : x * 10 + d;
    }
    if (i > 0 && x != f.length) {
      f.malformed = true;
      f.reason = "the request has several different Content-Length values";
      return f;
    }
    f.length = x;
  }
  if (n > 0 && f.chunked) {
    f.malformed = true;
    f.reason = "the request has both Content-Length and Transfer-Encoding";
  }
  return f;
}

/// The request carries a body httplib has not read (or will not read): the connection
/// cannot be reused after the response. A malformed framing counts as a body.
bool has_body(const httplib::Request& req) {
  const BodyFraming f = framing(req);
  return f.malformed || f.chunked || f.length > 0;
}

void close_after(httplib::Response& res) {
  if (auto* c = current_connection()) c->close_after = true;
  if (!res.has_header("Connection")) res.set_header("Connection", "close");
}

/// Run a handler that takes the request body: the body is read first, bounded by
/// --body-limit while it is read (chunked or not): 413 beyond it, 400 when cut short.
template <class F>
httplib::Server::HandlerWithContentReader guarded_body(ServerState& st, std::string_view endpoint, F f) {
  return [&st, endpoint, f](const httplib::Request& req, httplib::Response& res, const httplib::ContentReader& reader) {
    guarded(st, endpoint, [&](const httplib::Request& rq, httplib::Response& rs) {
      std::string body;
      // Without Content-Length and Transfer-Encoding a request has no body (RFC 9112 6.3).
      if (const int status = has_body(rq) ? read_body(reader, st.options.body_limit, body) : 0; status != 0) {
        close_after(rs);
        if (status == 413) {
          throw ApiError(413, fmt::format("the request body exceeds {} bytes", st.options.body_limit), "",
                         "request_too_large");
        }
        if (status == 408) {
          throw ApiError(
              408, fmt::format("the request body stalled or did not arrive within {} s", st.options.body_timeout_s), "",
              "request_timeout");
        }
        throw ApiError(400, "the request body could not be read (malformed chunked encoding or cut short)");
      }
      f(rq, rs, body);
    })(req, res);
  };
}

/// One route: what it answers, where, and whether it needs the API key. The handler gets
/// the request body (a POST's, read within --body-limit first; "" for GET).
using RouteHandler = std::function<void(const httplib::Request&, httplib::Response&, const std::string& body)>;
struct Route {
  std::string method;              ///< "GET" (HEAD is answered too) or "POST"
  std::vector<std::string> paths;  ///< as httplib matches them (a regex); the first names it in logs
  bool is_public = false;          ///< true: no API key, and it answers while the model loads
  RouteHandler handler;
};

class RouteTable {
 public:
  explicit RouteTable(std::vector<Route> routes) : routes_(std::move(routes)) {
    for (size_t i = 0; i < routes_.size(); ++i) {
      for (const auto& p : routes_[i].paths) patterns_.emplace_back(std::regex(p), i);
    }
  }
  const std::vector<Route>& routes() const noexcept { return routes_; }

  /// The methods the routes at `path` answer ("" for a path no route serves), for the
  /// Allow header of a 405.
  std::string allowed_methods(const std::string& path) const {
    bool get = false, post = false;
    for (const auto& [re, i] : patterns_) {
      if (!std::regex_match(path, re)) continue;
      (routes_[i].method == "GET" ? get : post) = true;
    }
    return get && post ? "GET, HEAD, POST" : get ? "GET, HEAD" : post ? "POST" : "";
  }
  /// A public route serves `path`.
  bool is_public(const std::string& path) const {
    return std::any_of(patterns_.begin(), patterns_.end(),
                       [&](const auto& p) { return routes_[p.second].is_public && std::regex_match(path, p.first); });
  }

 private:
  std::vector<Route> routes_;
  std::vector<std::pair<std::regex, size_t>> patterns_;
};

/// 404 for a path this server does not serve, 405 (with Allow) for a method it does not
/// answer on a path it serves.
ApiError no_route_error(const RouteTable& table, const httplib::Request& req, httplib::Response& res) {
  const std::string allow = table.allowed_methods(req.path);
  if (allow.empty()) return ApiError(404, fmt::format("no route {} {}", req.method, req.path), "", "not_found");
  res.set_header("Allow", allow);
  return ApiError(405, fmt::format("{} does not answer {} (allowed: {})", req.path, req.method, allow), "",
                  "method_not_allowed");
}

std::string bearer_token(const httplib::Request& req) {
  const std::string auth = req.get_header_value("Authorization");
  static constexpr std::string_view kBearer = "Bearer ";
  if (auth.size() > kBearer.size() && auth.compare(0, kBearer.size(), kBearer) == 0) return auth.substr(kBearer.size());
  return req.get_header_value("x-api-key");
}

}  // namespace

void register_routes(httplib::Server& svr, ServerState& st, const TransportLimits& limits) {
  const auto model_object = [&st] {
    const auto& hp = st.engine->model().hparams();
    return json{{"id", st.info.names.front()},
                {"object", "model"},
                {"created", st.created},
                {"owned_by", "tandem"},
                {"meta",
                 {{"n_ctx", st.info.n_ctx},
                  {"n_ctx_train", hp.n_ctx_train},
                  {"n_vocab", st.info.tokenizer->n_vocab()},
                  {"chat_template", st.engine->chat_template().name()},
                  {"executors", st.engine->executor_names()}}}};
  };
  const auto generation = [&st](bool chat, std::string_view endpoint) {
    return [&st, chat, endpoint](const httplib::Request& req, httplib::Response& res, const std::string& raw) {
      if (st.draining.load()) throw ApiError(503, "the server is shutting down", "", "server_shutting_down");
      const json body = parse_body(raw);
      const std::string sla = req.get_header_value("x-tandem-sla");
      GenerationSpec spec =
          chat ? parse_chat_request(body, st.info, sla, raw) : parse_completion_request(body, st.info, sla);
      run_generation(st, std::move(spec), res, endpoint);
    };
  };

  // Every route of the server, once: the 405's Allow header and the public paths (no API
  // key, answering while loading) are read from this table.
  const auto
      table =
          std::make_shared<const RouteTable>(
              std::vector<Route>{
                  {"GET",
                   {"/health"},
                   true,
                   [&st](const httplib::Request&, httplib::Response& res, const std::string&) {
                     if (!st.ready.load(std::memory_order_acquire)) {
                       send_error(res, ApiError(503, "the model is loading", "", "model_loading"));
                     } else if (st.draining.load()) {
                       send_error(res, ApiError(503, "the server is shutting down", "", "server_shutting_down"));
                     } else {
                       send_json(res, {{"status", "ok"}});
                     }
                   }},
                  {"GET",
                   {"/metrics"},
                   true,
                   [&st](const httplib::Request&, httplib::Response& res, const std::string&) {
                     if (!st.ready.load(std::memory_order_acquire)) {
                       send_error(res, ApiError(503, "the model is loading", "", "model_loading"));
                       return;
                     }
                     res.set_content(st.metrics->render(st.engine->metrics()),
                                     "text/plain; version=0.0.4; charset=utf-8");
                   }},
                  {"GET",
                   {"/v1/models", "/models"},
                   false,
                   [model_object](const httplib::Request&, httplib::Response& res, const std::string&) {
                     send_json(res, {{"object", "list"}, {"data", json::array({model_object()})}});
                   }},
                  // The client's models.retrieve(id): the alias or the model path (as `model` accepts).
                  {"GET",
                   {R"(/v1/models/(.+))", R"(/models/(.+))"},
                   false,
                   [&st, model_object](const httplib::Request& req, httplib::Response& res, const std::string&) {
                     const std::string id = req.matches.size() > 1 ? req.matches[1].str() : std::string();
                     if (std::find(st.info.names.begin(), st.info.names.end(), id) == st.info.names.end()) {
                       throw ApiError(404, fmt::format("the model '{}' does not exist", id), "model",
                                      "model_not_found");
                     }
                     send_json(res, model_object());
                   }},
                  // llama-server's /props, the fields Tandem has: the chat template in use. chat_template
                  // is its source text (--chat-template(-file)'s, or the model's tokenizer.chat_template:
                  // "" when the model has none), chat_template_name the matcher's family for it (the
                  // built-in that renders when chat_template_jinja is false), chat_template_origin where
                  // it came from ("tokenizer.chat_template", "--chat-template", "chat template file '...'").
                  {"GET",
                   {"/props"},
                   false,
                   [&st](const httplib::Request&, httplib::Response& res, const std::string&) {
                     const tandem::ChatTemplate& t = st.engine->chat_template();
                     send_json(res, {{"model_path", st.info.names.back()},
                                     {"chat_template", t.source()},
                                     {"chat_template_name", t.name()},
                                     {"chat_template_jinja", t.is_jinja()},
                                     {"chat_template_origin", t.origin()}});
                   }},
                  {"POST",
                   {"/v1/chat/completions", "/chat/completions"},
                   false,
                   generation(true, "/v1/chat/completions")},
                  {"POST", {"/v1/completions", "/completions"}, false, generation(false, "/v1/completions")},
                  {"POST",
                   {"/tokenize"},
                   false,
                   [&st](const httplib::Request&, httplib::Response& res, const std::string& raw) {
                     send_json(res, tokenize_response(parse_body(raw), *st.info.tokenizer));
                   }},
                  {"POST",
                   {"/detokenize"},
                   false,
                   [&st](const httplib::Request&, httplib::Response& res, const std::string& raw) {
                     send_json(res, detokenize_response(parse_body(raw), *st.info.tokenizer));
                   }},
                  // llama-server's /apply-template: the prompt the chat template in use makes of a chat
                  // request (messages, tools, add_generation_prompt, chat_template_kwargs), as the chat
                  // endpoint renders it (tools through tool_template_input: a template without its own
                  // tool rendering gets Hermes' tool prompt). The body keeps the client's key order (tojson prints it
                  // so). A template's own errors and its render limits are the request's fault: 400.
                  {"POST",
                   {"/apply-template"},
                   false,
                   [&st](const httplib::Request&, httplib::Response& res, const std::string& raw) {
                     const auto body = nlohmann::ordered_json::parse(raw, nullptr, /*allow_exceptions=*/false);
                     if (body.is_discarded())
                       throw ApiError(400, "the request body is not valid JSON", "", "invalid_json");
                     if (!body.is_object())
                       throw ApiError(400, "the request body must be a JSON object", "", "invalid_json");
                     check_body_depth(body);
                     const auto msgs = body.find("messages");
                     if (msgs == body.end() || !msgs->is_array()) {
                       throw ApiError(400, "'messages' is required (an array)", "messages", "invalid_value");
                     }
                     bool add_generation_prompt = true;
                     if (const auto agp = body.find("add_generation_prompt"); agp != body.end() && !agp->is_null()) {
                       if (!agp->is_boolean()) {
                         throw ApiError(400, "'add_generation_prompt' must be a boolean", "add_generation_prompt",
                                        "invalid_type");
                       }
                       add_generation_prompt = agp->get<bool>();
                     }
                     const auto tools = body.value("tools", nlohmann::ordered_json());
                     if (!tools.is_null() && !tools.is_array())
                       throw ApiError(400, "'tools' must be an array", "tools", "invalid_type");
                     const auto kwargs = body.value("chat_template_kwargs", nlohmann::ordered_json());
                     if (!kwargs.is_null() && !kwargs.is_object()) {
                       throw ApiError(400, "'chat_template_kwargs' must be an object", "chat_template_kwargs",
                                      "invalid_type");
                     }
                     std::string prompt;
                     try {
                       if (chat_request_uses_tools(body)) {  // the chat endpoint's tool path
                         const ToolTemplateInput in = tool_template_input(st.info.tool_prompt, *msgs, tools);
                         prompt =
                             st.info.chat_template->render_json(in.messages, add_generation_prompt, in.tools, kwargs);
                       } else {
                         prompt = st.info.chat_template->render_json(*msgs, add_generation_prompt, tools, kwargs);
                       }
                     } catch (const Error& e) {
                       if (e.code() != ErrorCode::kInvalidArgument && e.code() != ErrorCode::kOutOfMemory) throw;
                       throw ApiError(400, fmt::format("the chat template cannot render this request: {}", e.what()),
                                      "messages", std::string(error_code_name(e.code())));
                     }
                     send_json(res, json{{"prompt", prompt}});
                   }},
              });

  // A Content-Length body over the limit is refused in the pre-routing hook below, before
  // a byte of it is read (httplib's own check would read it all and throw it away); every
  // other body is read by a content-reader handler that stops at the limit.
  svr.set_payload_max_length(st.options.body_limit);

  // Before routing, once the headers are read: their count, the body's framing and declared
  // size, then authentication, then "loading" / "shutting down". Nothing of the body is read yet.
  svr.set_pre_routing_handler([&st, limits, table](const httplib::Request& req, httplib::Response& res) {
    using R = httplib::Server::HandlerResponse;
    if (auto* c = current_connection()) end_of_headers(*c, limits);
    const auto refuse = [&](const ApiError& e) {
      if (has_body(req)) close_after(res);
      send_error(res, e);
      return R::Handled;
    };
    // httplib adds REMOTE_ADDR, REMOTE_PORT, LOCAL_ADDR and LOCAL_PORT to the headers.
    if (req.headers.size() > limits.header_max_count + 4) {
      close_after(res);
      return refuse(ApiError(431, fmt::format("more than {} header lines", limits.header_max_count), "",
                             "request_header_fields_too_large"));
    }
    // httplib reads a PRI body whole, and never reads one sent with GET, HEAD or OPTIONS.
    static const std::set<std::string> kMethods = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"};
    if (!kMethods.count(req.method)) {
      close_after(res);
      return refuse(ApiError(405, fmt::format("method {} is not supported", req.method), "", "method_not_allowed"));
    }
    if (auto* c = current_connection(); c && c->header_malformed) {
      close_after(res);
      return refuse(
          ApiError(400, "a header line has no colon, or is folded onto the previous one", "", "invalid_header_line"));
    }
    const BodyFraming body = framing(req);
    if (body.malformed) {
      close_after(res);
      return refuse(ApiError(400, body.reason, "", "invalid_request_framing"));
    }
    if (body.unsupported) {
      close_after(res);
      return refuse(ApiError(501, body.reason, "", "unsupported_transfer_encoding"));
    }
    if (body.length > st.options.body_limit) {
      close_after(res);
      return refuse(ApiError(413, fmt::format("the request body exceeds {} bytes", st.options.body_limit), "",
                             "request_too_large"));
    }
    if (has_body(req) && (req.method == "GET" || req.method == "HEAD" || req.method == "OPTIONS")) close_after(res);
    if (table->is_public(req.path)) return R::Unhandled;
    if (!st.options.api_key.empty() && bearer_token(req) != st.options.api_key) {
      return refuse(ApiError(401, "invalid or missing API key (Authorization: Bearer KEY)", "", "invalid_api_key"));
    }
    if (!st.ready.load(std::memory_order_acquire))
      return refuse(ApiError(503, "the model is loading", "", "model_loading"));
    return R::Unhandled;
  });
  // Expect: 100-continue (answered before the pre-routing hook) with a declared body over
  // the limit: 413 before the client sends it; a malformed Content-Length: 400.
  // (httplib answers with res.status, the error handler below writes the body.)
  svr.set_expect_100_continue_handler([&st](const httplib::Request& req, httplib::Response& res) {
    const BodyFraming body = framing(req);
    if (!body.malformed && body.length <= st.options.body_limit) return 100;
    res.status = body.malformed ? 400 : 413;
    res.set_header("Connection", "close");
    return res.status;
  });
  // Statuses set by httplib itself (404 no route, 413 body too large, 400 bad request line).
  svr.set_error_handler(
      httplib::Server::HandlerWithResponse([&st, limits, table](const httplib::Request& req, httplib::Response& res) {
        if (!res.body.empty()) return httplib::Server::HandlerResponse::Unhandled;
        if (auto* c = current_connection(); c && c->header_overflow) {
          res.status = 431;
          send_error(res,
                     ApiError(431, fmt::format("the request line and headers exceed {} bytes", limits.header_max_bytes),
                              "", "request_header_fields_too_large"));
        } else if (c && c->header_timeout) {
          res.status = 408;
          send_error(res, ApiError(408, fmt::format("the headers did not arrive within {} s", limits.header_timeout_s),
                                   "", "request_timeout"));
        } else if (res.status == 413) {
          send_error(res, ApiError(413, fmt::format("the request body exceeds {} bytes", st.options.body_limit), "",
                                   "request_too_large"));
        } else if (const BodyFraming body = framing(req); res.status == 400 && body.malformed) {
          send_error(res, ApiError(400, body.reason, "", "invalid_request_framing"));
        } else if (res.status == 404) {
          const ApiError e = no_route_error(*table, req, res);
          res.status = e.status();
          send_error(res, e);
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

  for (const Route& r : table->routes()) {
    const std::string_view name = r.paths.front();
    for (const auto& path : r.paths) {
      if (r.method == "GET") {
        svr.Get(path, guarded(st, name, [h = r.handler](const httplib::Request& req, httplib::Response& res) {
                  h(req, res, std::string());
                }));
      } else {
        svr.Post(path, guarded_body(st, name, r.handler));
      }
    }
  }
  // Any other route with a body: read it within the limit too (httplib would read it
  // whole before its 404), then 404 (405 on a path a route serves).
  const auto no_route =
      guarded_body(st, "(no route)", [table](const httplib::Request& req, httplib::Response& res, const std::string&) {
        throw no_route_error(*table, req, res);
      });
  svr.Post(".*", no_route);
  svr.Put(".*", no_route);
  svr.Patch(".*", no_route);
  svr.Delete(".*", no_route);
}

}  // namespace tandem::server
