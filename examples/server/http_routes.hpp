// tandem-server: the HTTP routes on cpp-httplib.
//
//   POST /v1/chat/completions, /v1/completions (also without /v1), GET /v1/models and
//   /v1/models/{id}, POST /tokenize, /detokenize, /apply-template, GET /props (the chat
//   template in use; llama-server's shapes),
//   GET /health (503 while loading, and while shutting down), GET /metrics (Prometheus
//   text). They are one table in http_routes.cpp (method, paths, public or not, handler),
//   which the 405's Allow header and the API-key check read.
//
// Every error is the OpenAI error object with its status: 400 bad input (also a
// Content-Length that is not digits only, repeated with another value, or sent with
// Transfer-Encoding; the connection is then closed), 401 wrong or missing API key (all
// routes but /health and /metrics), 404 unknown route or model, 405 wrong method (with
// Allow), 408 a body that stalled or missed --body-timeout (then close), 413 body over
// --body-limit (bounded while read, chunked or not), 431 headers too large, 429 queue full
// (with Retry-After), 503 loading or draining.
#pragma once

#include <httplib.h>

#include "http_transport.hpp"
#include "server_state.hpp"

namespace tandem::server {

void register_routes(httplib::Server& server, ServerState& st, const TransportLimits& limits);

}  // namespace tandem::server
