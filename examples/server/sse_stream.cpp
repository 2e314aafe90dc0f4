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

/// Events copied out of the Scheduler's callback for the HTTP worker.
class EventChannel {
 public:
  struct Piece {
    std::string text;
    bool final = false;
    std::optional<TokenLogprob> logprob;  ///< with Request::logprobs >= 0, on a token's event
  };
  void push(const RequestEvent& e) {
    Piece p{std::string(e.text), e.final, std::nullopt};
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
  RequestHandle handle;
  RouteInfo route;
  std::shared_ptr<EventChannel> channel = std::make_shared<EventChannel>();
  std::atomic<bool> finished{false};
};

int32_t completion_tokens(const RequestResult& r) {
  return int32_t(r.tokens.size());
}

/// Once per submitted request: metrics, the request log line, the in-flight count.
void finish_job(ServerState& st, Job& job, const RequestResult& r, int status, std::string_view note) {
  if (job.finished.exchange(true)) return;
  st.metrics->observe(r.metrics, r.finish);
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
            {"completion_tokens", completion_tokens(r)},
            {"ttft_s", r.metrics.ttft_s},
            {"tpot_s", r.metrics.tpot_s},
            {"e2e_s", r.metrics.e2e_s}};
  if (!note.empty()) f["note"] = note;
  if (!r.message.empty()) f["error"] = r.message;
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

std::string header_value(std::string_view v) {
  std::string out;
  for (const char c : v) out += (c == '\r' || c == '\n') ? ' ' : c;
  return out;
}

bool write_event(httplib::DataSink& sink, const json& j) {
  const std::string s = "data: " + dump(j) + "\n\n";
  return sink.write(s.data(), s.size());
}

/// The SSE body: returns false (and cancels the request) when the client went away.
bool stream_body(ServerState& st, Job& job, httplib::DataSink& sink) {
  const GenerationSpec& spec = job.spec;
  const auto abort = [&](std::string_view why) {
    st.engine->cancel(job.handle);
    const RequestResult r = job.handle.wait();  // terminal: its KV pages are released
    finish_job(st, job, r, 499, why);
    return false;
  };
  if (spec.chat && !write_event(sink, stream_chunk(spec, job.id, job.created, "", true, std::nullopt))) {
    return abort("client disconnected");
  }
  // Logprobs: the entries of the tokens since the last chunk that carried text.
  std::vector<TokenLogprob> pending;
  size_t text_offset = 0;
  const auto take_logprobs = [&]() -> json {
    if (spec.logprobs < 0 || pending.empty()) return nullptr;
    json j = logprobs_json(spec, *st.info.tokenizer, pending, text_offset);
    pending.clear();
    return j;
  };
  for (;;) {
    EventChannel::Piece p;
    if (!job.channel->pop(p, std::chrono::milliseconds(1000))) {
      static constexpr std::string_view kPing = ": keep-alive\n\n";
      if (!sink.write(kPing.data(), kPing.size())) return abort("client disconnected");
      continue;
    }
    if (p.logprob) pending.push_back(*p.logprob);
    if (!p.text.empty() &&
        !write_event(sink, stream_chunk(spec, job.id, job.created, p.text, false, std::nullopt, take_logprobs()))) {
      return abort("client disconnected");
    }
    if (!p.final) continue;
    const RequestResult r = job.handle.wait();
    int status = 200;
    if (answered(r.finish)) {
      write_event(sink, stream_chunk(spec, job.id, job.created, "", false, r.finish, take_logprobs()));
      if (spec.include_usage) {
        write_event(sink,
                    usage_chunk(spec, job.id, job.created, int32_t(spec.prompt_ids.size()), completion_tokens(r)));
      }
    } else {
      const ApiError e = error_of(r);
      status = e.status();
      write_event(sink, e.body());
    }
    static constexpr std::string_view kDone = "data: [DONE]\n\n";
    sink.write(kDone.data(), kDone.size());
    finish_job(st, job, r, status, "");
    sink.done();
    return true;
  }
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
      ch->push(e);
      return true;
    };
  }
  st.in_flight.fetch_add(1);
  job->handle = st.engine->submit(std::move(r), job->route);
  if (job->handle.done()) {
    const RequestResult& rr = job->handle.wait();
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
    // A client that disconnects while it waits cancels its request (its slot and KV pages
    // are freed at the next step), as a closed stream does.
    while (!job->handle.wait_for(std::chrono::milliseconds(100))) {
      if (client_gone()) {
        st.engine->cancel(job->handle);
        break;
      }
    }
    const RequestResult rr = job->handle.wait();
    if (!answered(rr.finish)) {
      const ApiError e = error_of(rr);
      finish_job(st, *job, rr, e.status(), "");
      throw e;
    }
    finish_job(st, *job, rr, 200, "");
    json logprobs = nullptr;
    if (s.logprobs >= 0) {
      size_t text_offset = 0;
      logprobs = logprobs_json(s, *st.info.tokenizer, rr.logprobs, text_offset);
    }
    res.set_content(dump(completion_body(s, job->id, job->created, rr.text, rr.finish, int32_t(s.prompt_ids.size()),
                                         completion_tokens(rr), std::move(logprobs))),
                    "application/json");
    return;
  }
  res.set_header("Cache-Control", "no-cache");
  res.set_chunked_content_provider(
      "text/event-stream", [&st, job](size_t, httplib::DataSink& sink) { return stream_body(st, *job, sink); },
      [&st, job](bool) {
        if (job->finished.load()) return;  // the connection died before the body started
        st.engine->cancel(job->handle);
        const RequestResult rr = job->handle.wait();
        finish_job(st, *job, rr, 499, "client disconnected before the stream started");
      });
}

}  // namespace tandem::server
