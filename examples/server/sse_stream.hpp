// tandem-server: one generation request from submission to its last byte — the
// non-streaming JSON answer, or Server-Sent Events (`data: {chunk}` lines, `data: [DONE]`).
//
// Streaming: the Scheduler's on_event callback copies each event into the job's channel
// (a short lock, on the step-loop thread); the HTTP worker thread waits on the channel
// and writes chunks. While nothing arrives it writes an SSE comment line every second, so
// a client that went away is noticed even while its request waits in the queue. A write
// that fails (the client disconnected) cancels the request and waits for its terminal
// event, so every KV page it held is back in its store before the worker moves on.
//
// Logprobs when streaming: every token's event carries its entry, but its text may be held
// back (a possible stop string, an incomplete UTF-8 sequence) and released with a later
// token's. A chunk carrying text carries the entries of every token since the previous
// such chunk: the token that released the text and those whose text was held until then
// (a token's text can straddle two chunks when only its tail was held). The entries of
// tokens after the last text chunk (a stop string's tokens, whose text is cut) ride on the
// finish chunk. The entries of all chunks, in order, are the non-streamed
// answer's; completions' text_offset counts from the completion's start across chunks.
//
// Tool calls when streaming: content streams until where a call may begin
// (tool_call_start); the rest is held and, at the choice's end, sent as the calls (whole, one
// delta) and the content around them. An output cut short inside a call (max_tokens,
// `timeout`) sends neither that call nor its text, and finishes "length" as the
// non-streamed answer does (completion_body).
#pragma once

#include <httplib.h>

#include <memory>

#include "openai_json.hpp"
#include "server_state.hpp"

namespace tandem::server {

/// Submit `spec` and answer `res` (JSON, or an SSE stream). Throws ApiError when the
/// request is refused (429 queue full, 503 draining, 400 rejected by the Scheduler).
void run_generation(ServerState& st, GenerationSpec spec, httplib::Response& res, std::string_view endpoint);

}  // namespace tandem::server
