// tandem-server: generation requests, streamed or not (see sse_stream.hpp).
#include "sse_stream.hpp"

#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <ctime>
#include <deque>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "http_transport.hpp"

namespace tandem::server {

namespace {

using nlohmann::json;

std::string dump(const json& j) {
  return j.dump(-1, ' ', false, json::error_handler_t::replace);
}

/// Events copied out of the Scheduler's callbacks (every choice's) for the HTTP worker.
class EventChannel {
 public:
  struct Piece {
    int32_t index = 0;  ///< the choice
    std::string text;
    bool final = false;
    std::optional<TokenLogprob> logprob;  ///< with Request::logprobs >= 0, on a token's event
  };
  void push(int32_t index, const RequestEvent& e) {
    Piece p{index, std::string(e.text), e.final, std::nullopt};
    if (e.logprob != nullptr) p.logprob = *e.logprob;
    {
      std::lock_guard<std::mutex> lk(mu_);
      q_.push_back(std::move(p));
    }
    cv_.notify_one();
  }
  /// False when nothing arrived within `timeout`.
  bool pop(Piece& p, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu_);
    if (!cv_.wait_for(lk, timeout, [&] { return !q_.empty(); })) return false;
    p = std::move(q_.front());
    q_.pop_front();
    return true;
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Piece> q_;
};

struct Job {
  GenerationSpec spec;
  std::string id;
  int64_t created = 0;
  std::string endpoint;
  std::vector<RequestHandle> handles;  ///< one per choice (index i)
  RouteInfo route;
  std::shared_ptr<EventChannel> channel = std::make_shared<EventChannel>();
  std::atomic<bool> finished{false};
};

int32_t completion_tokens(const std::vector<RequestResult>& rs) {
  int32_t n = 0;
  for (const auto& r : rs) n += int32_t(r.tokens.size());
  return n;
}

void cancel_all(ServerState& st, Job& job) {
  for (const auto& h : job.handles) st.engine->cancel(h);
}

/// Every choice's result (waits for each: its KV pages are released then).
std::vector<RequestResult> wait_all(const Job& job) {
  std::vector<RequestResult> rs;
  for (const auto& h : job.handles) rs.push_back(h.wait());
  return rs;
}

/// Once per submitted request: metrics, the request log line, the in-flight count.
void finish_job(ServerState& st, Job& job, const std::vector<RequestResult>& rs, int status, std::string_view note) {
  if (job.finished.exchange(true)) return;
  for (const auto& r : rs) st.metrics->observe(r.metrics, r.finish);
  const RequestResult& r = rs.front();
  json f = {{"id", job.id},
            {"endpoint", job.endpoint},
            {"status", status},
            {"stream", job.spec.stream},
            {"sla", sla_class_name(job.spec.sla)},
            {"prefill_executor", job.route.prefill},
            {"decode_executor", job.route.decode},
            {"route_rule", job.route.rule},
            {"route_reason", job.route.reason},
            {"finish_reason", request_finish_name(r.finish)},
            {"prompt_tokens", job.spec.prompt_ids.size()},
            {"completion_tokens", completion_tokens(rs)},
            {"ttft_s", r.metrics.ttft_s},
            {"tpot_s", r.metrics.tpot_s},
            {"e2e_s", r.metrics.e2e_s}};
  if (rs.size() > 1) f["n"] = rs.size();
  if (!note.empty()) f["note"] = note;
  for (const auto& x : rs) {
    if (!x.message.empty()) {
      f["error"] = x.message;
      break;
    }
  }
  st.log.write("info", "request", std::move(f));
  st.in_flight.fetch_sub(1);
}

/// The error for a request the Scheduler ended without an answer.
ApiError error_of(const RequestResult& r) {
  if (r.finish == RequestFinish::kCancelled) {
    return ApiError(503, "the request was cancelled: the server is shutting down", "", "server_shutting_down");
  }
  if (r.error == ErrorCode::kInvalidArgument || r.error == ErrorCode::kContextOverflow) {
    return ApiError(400, r.message, "", std::string(error_code_name(r.error)));
  }
  return ApiError(500, r.message.empty() ? "the request failed" : r.message, "", std::string(error_code_name(r.error)));
}

bool answered(RequestFinish f) {
  return f == RequestFinish::kStop || f == RequestFinish::kStopString || f == RequestFinish::kLength ||
         f == RequestFinish::kTimeout;
}

/// The first choice that ended without an answer, or null.
const RequestResult* unanswered(const std::vector<RequestResult>& rs) {
  for (const auto& r : rs) {
    if (!answered(r.finish)) return &r;
  }
  return nullptr;
}

/// A choice's text parsed for tool calls (GenerationSpec::tools): the forced call's prefix
/// first; parallel_tool_calls false keeps the first call. An output cut short (max_tokens,
/// timeout) inside a call: that call is neither a call nor content (from its opening on the
/// text is dropped; see completion_body).
ParsedToolCalls parse_calls(const GenerationSpec& spec, std::string_view text, RequestFinish finish) {
  ParsedToolCalls p = parse_tool_calls(text, spec.tools->format);
  if (!spec.tools->parallel && p.calls.size() > 1) p.calls.resize(1);
  if (cut_short(finish)) p.content.resize(unfinished_call_start(p.content, spec.tools->format));
  return p;
}

std::string header_value(std::string_view v) {
  std::string out;
  for (const char c : v) out += (c == '\r' || c == '\n') ? ' ' : c;
  return out;
}

bool write_event(httplib::DataSink& sink, const json& j) {
  const std::string s = "data: " + dump(j) + "\n\n";
  return sink.write(s.data(), s.size());
}

/// One choice's streaming state.
struct ChoiceStream {
  std::vector<TokenLogprob> pending;  ///< logprob entries since the last chunk with text
  size_t text_offset = 0;
  std::string text;  ///< with tools: the forced prefix and everything generated so far
  size_t sent = 0;   ///< with tools: bytes of `text` sent as content (the rest may be a call)
};

/// The SSE body: returns false (and cancels every choice) when the client went away.
/// Choices' chunks interleave as their tokens arrive, each with its `index`.
bool stream_body(ServerState& st, Job& job, httplib::DataSink& sink) {
  const GenerationSpec& spec = job.spec;
  const auto abort = [&](std::string_view why) {
    cancel_all(st, job);
    finish_job(st, job, wait_all(job), 499, why);  // terminal: their KV pages are released
    return false;
  };
  const int32_t n = int32_t(job.handles.size());
  std::vector<ChoiceStream> cs(static_cast<size_t>(n));
  for (int32_t i = 0; i < n; ++i) {
    if (spec.chat && !write_event(sink, stream_chunk(spec, job.id, job.created, i, "", true, std::nullopt))) {
      return abort("client disconnected");
    }
    if (spec.tools) cs[size_t(i)].text = spec.tools->prefix;
  }
  const auto take_logprobs = [&](ChoiceStream& c) -> json {
    if (spec.logprobs < 0 || c.pending.empty()) return nullptr;
    json j = logprobs_json(spec, *st.info.tokenizer, c.pending, c.text_offset);
    c.pending.clear();
    return j;
  };
  int32_t open = n;
  while (open > 0) {
    EventChannel::Piece p;
    if (!job.channel->pop(p, std::chrono::milliseconds(1000))) {
      static constexpr std::string_view kPing = ": keep-alive\n\n";
      if (!sink.write(kPing.data(), kPing.size())) return abort("client disconnected");
      continue;
    }
    ChoiceStream& c = cs[size_t(p.index)];
    if (p.logprob) c.pending.push_back(*p.logprob);
    std::string_view out = p.text;
    if (spec.tools) {  // content streams; from a possible call's start on, text is held
      c.text += p.text;
      const size_t hold = std::max(c.sent, tool_call_start(c.text, spec.tools->format));
      out = std::string_view(c.text).substr(c.sent, hold - c.sent);
      c.sent = hold;
    }
    if (!out.empty() && !write_event(sink, stream_chunk(spec, job.id, job.created, p.index, out, false, std::nullopt,
                                                        take_logprobs(c)))) {
      return abort("client disconnected");
    }
    if (!p.final) continue;
    --open;
    const RequestResult& r = job.handles[size_t(p.index)].wait();
    if (!answered(r.finish)) {  // one choice failed: the request fails
      cancel_all(st, job);
      const auto rs = wait_all(job);
      const ApiError e = error_of(r);
      write_event(sink, e.body());
      static constexpr std::string_view kDone = "data: [DONE]\n\n";
      sink.write(kDone.data(), kDone.size());
      finish_job(st, job, rs, e.status(), "");
      sink.done();
      return true;
    }
    bool called = false;
    if (spec.tools) {  // the held text: calls (sent whole, after any content) or content
      const std::string_view held = std::string_view(c.text).substr(c.sent);
      const ParsedToolCalls parsed = parse_calls(spec, held, r.finish);
      called = !parsed.calls.empty();
      const std::string_view rest = parsed.content;
      if (!rest.empty()) write_event(sink, stream_chunk(spec, job.id, job.created, p.index, rest, false, std::nullopt));
      if (called) {
        write_event(sink, stream_chunk(spec, job.id, job.created, p.index, "", false, std::nullopt, nullptr,
                                       tool_calls_json(parsed.calls, true)));
      }
    }
    write_event(sink, stream_chunk(spec, job.id, job.created, p.index, "", false, r.finish, take_logprobs(c), nullptr,
                                   called && !cut_short(r.finish)));
  }
  const auto rs = wait_all(job);
  if (spec.include_usage) {
    write_event(sink, usage_chunk(spec, job.id, job.created, int32_t(spec.prompt_ids.size()), completion_tokens(rs)));
  }
  static constexpr std::string_view kDone = "data: [DONE]\n\n";
  sink.write(kDone.data(), kDone.size());
  finish_job(st, job, rs, 200, "");
  sink.done();
  return true;
}

}  // namespace

void run_generation(ServerState& st, GenerationSpec spec, httplib::Response& res, std::string_view endpoint) {
  auto job = std::make_shared<Job>();
  job->id = fmt::format("{}-{:016x}", spec.chat ? "chatcmpl" : "cmpl", st.next_id.fetch_add(1) * 0x9E3779B97F4A7C15ULL);
  job->created = int64_t(std::time(nullptr));
  job->endpoint = std::string(endpoint);
  job->spec = std::move(spec);
  const GenerationSpec& s = job->spec;

  Request r;
  r.prompt_ids = s.prompt_ids;
  r.sampling = s.sampling;
  r.max_tokens = s.max_tokens;
  r.stop = s.stop;
  r.ignore_eos = s.ignore_eos;
  r.logprobs = s.logprobs;
  r.grammar = s.grammar;
  r.sla = s.sla;
  if (s.timeout_s)
    r.deadline =
        Clock::now() + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(*s.timeout_s));
  if (s.stream) {
    r.on_event = [ch = job->channel](const RequestEvent& e) {
      ch->push(e.choice, e);
      return true;
    };
  }
  st.in_flight.fetch_add(1);
  job->handles = st.engine->submit_n(std::move(r), s.n, job->route);
  if (job->handles.front().done()) {  // refused at submission (all choices alike)
    const RequestResult& rr = job->handles.front().wait();
    if (rr.finish == RequestFinish::kOverloaded || rr.finish == RequestFinish::kError) {
      job->finished = true;
      st.in_flight.fetch_sub(1);
      if (rr.finish == RequestFinish::kError) throw error_of(rr);
      if (st.draining.load()) throw ApiError(503, "the server is shutting down", "", "server_shutting_down");
      res.set_header("Retry-After", "1");
      throw ApiError(429, "the request queue is full; retry later", "", "queue_full");
    }
  }
  res.set_header("x-request-id", job->id);
  if (job->route.known()) {
    res.set_header("x-tandem-route", header_value(fmt::format("prefill={} decode={} rule={}", job->route.prefill,
                                                              job->route.decode, job->route.rule)));
    res.set_header("x-tandem-route-reason", header_value(job->route.reason));
  }

  if (!s.stream) {
    // A client that disconnects while it waits cancels its request (its slots and KV pages
    // are freed at the next step), as a closed stream does. A client that only shut down its
    // sending side looks the same from here (a FIN either way), so it is treated alike, as
    // Go's net/http and nginx do; it reads nginx's 499 "client closed request", never a 503.
    bool client_left = false;
    for (const auto& h : job->handles) {
      while (!client_left && !h.wait_for(std::chrono::milliseconds(100))) {
        if (client_gone()) {
          cancel_all(st, *job);
          client_left = true;
        }
      }
    }
    const auto rs = wait_all(*job);
    if (client_left) {
      finish_job(st, *job, rs, 499, "client disconnected");
      const ApiError e(499, "the request was cancelled: the client closed its side of the connection", "",
                       "client_disconnected");
      res.status = e.status();
      res.set_content(dump(e.body()), "application/json");
      return;
    }
    if (const RequestResult* bad = unanswered(rs)) {
      const ApiError e = error_of(*bad);
      finish_job(st, *job, rs, e.status(), "");
      throw e;
    }
    finish_job(st, *job, rs, 200, "");
    std::vector<ChoiceResult> choices;
    for (const auto& rr : rs) {
      ChoiceResult c;
      c.text = s.tools ? s.tools->prefix + rr.text : rr.text;
      c.finish = rr.finish;
      if (s.logprobs >= 0) {
        size_t text_offset = 0;
        c.logprobs = logprobs_json(s, *st.info.tokenizer, rr.logprobs, text_offset);
      }
      if (s.tools) c.parsed = parse_calls(s, c.text, rr.finish);
      choices.push_back(std::move(c));
    }
    res.set_content(
        dump(completion_body(s, job->id, job->created, choices, int32_t(s.prompt_ids.size()), completion_tokens(rs))),
        "application/json");
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream", [&st, job](size_t, httplib::DataSink& sink) { return stream_body(st, *job, sink); },
      [&st, job](bool) {
        if (job->finished.load()) return;  // the connection died before the body started
        cancel_all(st, *job);
        finish_job(st, *job, wait_all(*job), 499, "client disconnected before the stream started");
      });
}

}  // namespace tandem::server
