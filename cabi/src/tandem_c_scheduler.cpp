// The C ABI's scheduler and request functions (cabi/include/tandem.h).
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <filesystem>
#include <string>
#include <vector>

#include "capi_internal.hpp"
#include "tandem/node/node.hpp"

using namespace tandem;
using namespace tandem::capi;

namespace {

void fill_request_result(RequestObj& r, tandem_request_result* result, const char* fn) {
  const size_t n = out_struct_size(result, kRequestResultV01, fn, "tandem_request_result");
  tandem_request_result out{};
  std::memcpy(&out, result, n);
  if (out.tokens == nullptr && out.tokens_cap != 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: result->tokens is NULL but tokens_cap is {}", fn, out.tokens_cap));
  }
  if (out.text == nullptr && out.text_cap != 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: result->text is NULL but text_cap is {}", fn, out.text_cap));
  }
  if (out.logprobs == nullptr && out.logprobs_cap != 0) {
    fail(TANDEM_E_INVALID_ARG,
         fmt::format("{}: result->logprobs is NULL but logprobs_cap is {}", fn, out.logprobs_cap));
  }
  out.id = r.handle.id();
  out.n_logprobs = 0;
  out.n_tokens = 0;
  out.text_len = 0;
  out.finished = 0;
  out.finish_reason = -1;
  out.status = TANDEM_OK;
  out.n_prompt = 0;
  out.message = "";
  out.queue_seconds = out.ttft_seconds = out.e2e_seconds = 0.0;
  bool finish_delivered = false;
  {
    std::lock_guard<std::mutex> lock(r.poll_mu);
    finish_delivered = r.finish_seen || (r.have_pending && r.pending.final);
  }
  // The FINISH event is logged just before the handle reports done: once a poll has seen
  // it, wait() returns within that gap, so a caller never reads "not finished" after it.
  if (finish_delivered || r.handle.done()) {
    const RequestResult& rr = r.handle.wait();
    out.finished = 1;
    out.finish_reason = static_cast<int32_t>(rr.finish);
    out.status = rr.finish == RequestFinish::kError ? static_cast<int32_t>(rr.error) : TANDEM_OK;
    if (rr.finish == RequestFinish::kError && out.status == TANDEM_OK) out.status = TANDEM_E_INTERNAL;
    out.message = rr.message.c_str();
    out.n_tokens = rr.tokens.size();
    out.text_len = rr.text.size();
    out.n_prompt = rr.metrics.prompt_tokens;
    out.queue_seconds = rr.metrics.queue_s;
    out.ttft_seconds = rr.metrics.ttft_s;
    out.e2e_seconds = rr.metrics.e2e_s;
    if (out.tokens != nullptr) std::copy_n(rr.tokens.begin(), std::min(rr.tokens.size(), out.tokens_cap), out.tokens);
    out.n_logprobs = rr.logprobs.size();
    write_logprobs(rr.logprobs, out.logprobs, out.logprobs_cap);
    if (out.text != nullptr && out.text_cap > 0) {
      size_t k = std::min(rr.text.size(), out.text_cap - 1);
      if (k < rr.text.size()) {
        while (k > 0 && (static_cast<unsigned char>(rr.text[k]) & 0xC0u) == 0x80u) --k;  // character boundary
      }
      std::memcpy(out.text, rr.text.data(), k);
      out.text[k] = '\0';
    }
  }
  write_struct(result, out, n);
}

/// One poll of tandem_request_poll: writes *event (kind NONE when nothing is there) and
/// returns true when it delivered a token or finish event.
bool poll_event(RequestObj& r, tandem_request_event* event, const char* fn) {
  require(event, fn, "event");
  const size_t n = out_struct_size(event, kRequestEventV01, fn, "tandem_request_event");
  tandem_request_event out{};
  std::memcpy(&out, event, n);
  if (out.text == nullptr && out.text_cap != 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: event->text is NULL but text_cap is {}", fn, out.text_cap));
  }
  std::lock_guard<std::mutex> lock(r.poll_mu);
  out.kind = TANDEM_EVENT_NONE;
  out.token = -1;
  out.finish_reason = -1;
  out.reserved = 0;
  out.text_len = 0;
  std::string_view text;
  bool taking = false;
  if (!r.have_pending && !r.finish_seen) {
    r.have_pending = r.handle.poll(r.pending, r.pending_text);
  }
  if (r.have_pending) {
    taking = true;
    text = r.pending_text;
    out.kind = r.pending.final ? TANDEM_EVENT_FINISH : TANDEM_EVENT_TOKEN;
    out.token = r.pending.final ? -1 : r.pending.token;
    out.finish_reason = r.pending.final ? static_cast<int32_t>(r.pending.finish) : -1;
  } else if (r.finish_seen) {
    out.kind = TANDEM_EVENT_FINISH;
    out.finish_reason = static_cast<int32_t>(r.finish);
  }
  out.text_len = text.size();
  if (out.text != nullptr) {
    if (out.text_cap < text.size() + 1) {
      event->text_len = text.size();  // the event stays first in line
      fail(TANDEM_E_BUFFER_TOO_SMALL, fmt::format("{}: event->text holds {} bytes, {} needed (the event is kept)", fn,
                                                  out.text_cap, text.size() + 1));
    }
    if (!text.empty()) std::memcpy(out.text, text.data(), text.size());
    out.text[text.size()] = '\0';
  }
  if (taking) {
    r.have_pending = false;
    if (r.pending.final) {
      r.finish_seen = true;
      r.finish = r.pending.finish;
    }
  }
  write_struct(event, out, n);
  return out.kind != TANDEM_EVENT_NONE;
}

/// tandem_request_params -> a Scheduler request (without its callback); throws the C
/// ABI's errors naming `fn`.
Request request_from_params(const SchedulerObj& s, const tandem_request_params* params, const char* fn) {
  const SchedulerObj* sc = &s;
  require(params, fn, "params");
  tandem_request_params p = default_request_params();
  read_struct(params, kRequestParamsV01, p, fn, "tandem_request_params");
  check_flags(p.flags, kGenerateFlags, fn);
  if (p.max_tokens < 1) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: max_tokens {} must be >= 1", fn, p.max_tokens));
  if (p.deadline_ms < 0) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: deadline_ms {} must be >= 0 (0 = none)", fn, p.deadline_ms));
  }
  if (p.sla < TANDEM_SLA_INTERACTIVE || p.sla > TANDEM_SLA_BATCH) {
    fail(TANDEM_E_INVALID_ARG, fmt::format("{}: sla {} is not a tandem_sla_class (0..2)", fn, p.sla));
  }
  Request r;
  if (p.prompt_tokens != nullptr) {
    if (p.n_prompt_tokens == 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: n_prompt_tokens is 0", fn));
    check_count(p.n_prompt_tokens, fn, "n_prompt_tokens");
    const int32_t n_vocab = sc->model->model->hparams().n_vocab;
    for (size_t i = 0; i < p.n_prompt_tokens; ++i) {
      const int32_t id = p.prompt_tokens[i];
      if (id < 0 || id >= n_vocab) {
        fail(TANDEM_E_INVALID_ARG,
             fmt::format("{}: prompt_tokens[{}] = {} is outside the vocabulary [0, {})", fn, i, id, n_vocab));
      }
    }
    r.prompt_ids.assign(p.prompt_tokens, p.prompt_tokens + p.n_prompt_tokens);
  } else {
    if (p.n_prompt_tokens != 0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: prompt_tokens is NULL but n_prompt_tokens is {}", fn, p.n_prompt_tokens));
    }
    if (p.prompt == nullptr) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: prompt and prompt_tokens are NULL", fn));
    r.prompt_text = p.prompt;
    check_utf8(r.prompt_text, fn, "the prompt");
  }
  r.parse_special = (p.flags & TANDEM_GENERATE_PARSE_SPECIAL) != 0;
  r.ignore_eos = (p.flags & TANDEM_GENERATE_IGNORE_EOS) != 0;
  r.sampling = to_sampling(p.sampling, fn);
  r.max_tokens = p.max_tokens;
  r.stop = read_stops(p.stop, p.n_stop, fn);
  r.sla = static_cast<SlaClass>(p.sla);
  if (p.deadline_ms > 0) r.deadline = Clock::now() + std::chrono::milliseconds(p.deadline_ms);
  r.session = p.session;
  r.logprobs = read_logprobs(p.logprobs, p.reserved, fn);
  r.grammar = read_grammar(p.grammar, p.grammar_type, p.reserved2, sc->model->model->tokenizer(), fn);
  return r;
}

}  // namespace

extern "C" {

// ---- scheduler -----------------------------------------------------------------------------

tandem_status tandem_executor_params_init(tandem_executor_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kExecutorParamsV01, default_executor_params(), "tandem_executor_params_init",
                "tandem_executor_params");
  });
}

tandem_status tandem_scheduler_params_init(tandem_scheduler_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kSchedulerParamsV01, default_scheduler_params(), "tandem_scheduler_params_init",
                "tandem_scheduler_params");
  });
}

tandem_status tandem_request_params_init(tandem_request_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kRequestParamsV01, default_request_params(), "tandem_request_params_init",
                "tandem_request_params");
  });
}

tandem_status tandem_request_event_init(tandem_request_event* event, size_t struct_size) {
  return guard([&] {
    tandem_request_event d = zeroed<tandem_request_event>();
    d.token = -1;
    d.finish_reason = -1;
    init_struct(event, struct_size, kRequestEventV01, d, "tandem_request_event_init", "tandem_request_event");
  });
}

tandem_status tandem_request_result_init(tandem_request_result* result, size_t struct_size) {
  return guard([&] {
    tandem_request_result d = zeroed<tandem_request_result>();
    d.finish_reason = -1;
    init_struct(result, struct_size, kRequestResultV01, d, "tandem_request_result_init", "tandem_request_result");
  });
}

tandem_status tandem_scheduler_create(const tandem_model* model, const tandem_scheduler_params* params,
                                      tandem_scheduler** out_scheduler) {
  static constexpr const char* fn = "tandem_scheduler_create";
  if (out_scheduler != nullptr) *out_scheduler = nullptr;
  return guard([&] {
    require(out_scheduler, fn, "out_scheduler");
    auto m = get_model(model, fn);
    tandem_scheduler_params p = default_scheduler_params();
    if (params != nullptr) read_struct(params, kSchedulerParamsV01, p, fn, "tandem_scheduler_params");
    constexpr size_t kMaxExecutors = 64;
    if (p.n_executors < 1 || p.n_executors > kMaxExecutors) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: n_executors {} must be in [1, {}]", fn, p.n_executors, kMaxExecutors));
    }
    if (p.max_queued < 0 || p.max_context < 0 || p.prefix_cache_entries < 0 || p.page_size < 1) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: max_queued {}, max_context {} and prefix_cache_entries {} must be >= 0, page_size {} >= 1",
                       fn, p.max_queued, p.max_context, p.prefix_cache_entries, p.page_size));
    }
    if (p.reserved != 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: reserved must be 0", fn));
    std::vector<tandem_executor_params> ex(p.n_executors, default_executor_params());
    if (p.executors != nullptr) {
      size_t stride = 0;
      std::memcpy(&stride, p.executors, sizeof stride);
      if (stride < kExecutorParamsV01) {
        fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executors[0].struct_size {} is smaller than {} (use "
                                               "tandem_executor_params_init)",
                                               fn, stride, kExecutorParamsV01));
      }
      const auto* base = reinterpret_cast<const unsigned char*>(p.executors);
      for (size_t i = 0; i < p.n_executors; ++i) {
        const auto* e = reinterpret_cast<const tandem_executor_params*>(base + i * stride);
        size_t n = 0;
        std::memcpy(&n, e, sizeof n);
        if (n != stride) {
          fail(TANDEM_E_INVALID_ARG,
               fmt::format("{}: executors[{}].struct_size {} differs from executors[0]'s {}", fn, i, n, stride));
        }
        read_struct(e, kExecutorParamsV01, ex[i], fn, "tandem_executor_params");
      }
    }
    std::vector<std::shared_ptr<ExecutorObj>> given(p.n_executors);
    if (p.executor_handles != nullptr) {
      for (size_t i = 0; i < p.n_executors; ++i) {
        given[i] = get_executor(p.executor_handles[i], fn);
        if (given[i]->model->model != m->model) {
          fail(TANDEM_E_INVALID_ARG, fmt::format("{}: executor_handles[{}] was created for another model", fn, i));
        }
        for (size_t j = 0; j < i; ++j) {
          if (given[j] == given[i]) {
            fail(TANDEM_E_INVALID_ARG,
                 fmt::format("{}: executor_handles[{}] and [{}] are the same executor", fn, j, i));
          }
        }
        ex[i].device_kind = given[i]->device_kind;
        ex[i].device_id = given[i]->device_id;
      }
    }
    for (size_t i = 0; i < ex.size(); ++i) check_executor_params(ex[i], i, fn);
    const HParams& hp = m->model->hparams();
    // Page counts by the node's rule (tandem/node/node.hpp), Host tiers within physical memory.
    NodeSpec ns;
    ns.n_ctx = p.max_context > 0 ? p.max_context : default_context_size(hp);
    ns.page_size = p.page_size;
    ns.prefix_cache_entries = p.prefix_cache_entries;
    for (const tandem_executor_params& e : ex) {
      ExecutorSpec es;
      es.kind = e.device_kind == TANDEM_DEVICE_CUDA ? ExecutorKind::kGpu : ExecutorKind::kCpu;
      es.max_running = e.max_running;
      es.kv_dtype = static_cast<KvDtype>(e.kv_dtype);
      es.kv_pages = e.kv_pages;
      es.max_step_tokens = e.prefill_chunk;
      es.file_pages = e.kv_file_pages;
      if (e.kv_dir != nullptr) es.kv_dir = std::filesystem::path(e.kv_dir);
      ns.executors.push_back(std::move(es));
    }
    const std::vector<KvPageCounts> kv_pages = kv_page_counts(hp, ns);
    auto obj = std::make_shared<SchedulerObj>();
    obj->model = m;
    // Take the given executors (one scheduler each); the destructor hands them back.
    for (size_t i = 0; i < given.size(); ++i) {
      if (!given[i]) continue;
      if (given[i]->in_use.exchange(true, std::memory_order_acq_rel)) {
        fail(TANDEM_E_BUSY, fmt::format("{}: executor_handles[{}] is in use by another scheduler", fn, i));
      }
      obj->executors.push_back(given[i]);
    }
    SchedulerOptions so;
    so.max_queued = p.max_queued;
    so.max_context = p.max_context;
    so.prefix_cache_entries = p.prefix_cache_entries;
    if (p.log_routing != 0) so.log = [](std::string_view line) { log_line(TANDEM_LOG_DEBUG, line); };
    std::vector<std::shared_ptr<ExecutorObj>> used(ex.size());
    for (size_t i = 0, k = 0; i < ex.size(); ++i) {
      if (given[i]) {
        used[i] = obj->executors[k++];
      } else {
        used[i] = make_executor(m, ex[i], fn);
        used[i]->in_use.store(true, std::memory_order_release);
        obj->executors.push_back(used[i]);
      }
    }
    for (size_t i = 0; i < ex.size(); ++i) {
      const tandem_executor_params& e = ex[i];
      const KvPageCounts& kp = kv_pages[i];
      obj->stores.push_back(make_kv_store(*used[i]->executor,
                                          KvLayout::for_model(hp, p.page_size, static_cast<KvDtype>(e.kv_dtype)), kp,
                                          ns.executors[i].kv_dir));
      log_line(TANDEM_LOG_INFO, fmt::format("scheduler: executor {} ({}) with {} Device, {} Host and {} File KV pages "
                                            "of {} tokens ({})",
                                            i, used[i]->executor->name(), kp.device, kp.host, kp.file, p.page_size,
                                            kv_dtype_name(static_cast<KvDtype>(e.kv_dtype))));
      ExecutorConfig c;
      c.executor = used[i]->executor.get();
      c.store = obj->stores.back();
      c.max_running = e.max_running;
      c.step_token_budget = e.step_token_budget;
      c.prefill_chunk = e.prefill_chunk;
      if (e.accelerator >= 0) c.accelerator = e.accelerator == 1;
      c.name = fmt::format("{}{}", used[i]->executor->name(), i);
      so.executors.push_back(std::move(c));
    }
    obj->scheduler = std::make_unique<Scheduler>(std::move(so));
    *out_scheduler = Registry::instance().add_handle<tandem_scheduler>(Kind::kScheduler, std::move(obj));
  });
}

tandem_status tandem_scheduler_free(tandem_scheduler* scheduler) {
  return guard([&] {
    if (scheduler == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(scheduler), Kind::kScheduler);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE,
           fmt::format("tandem_scheduler_free: scheduler handle {:#x} is not live (double free?)",
                       reinterpret_cast<uintptr_t>(scheduler)));
    }
    // Cancel outstanding requests now, even when another thread still holds the object.
    std::static_pointer_cast<SchedulerObj>(obj)->scheduler->shutdown();
  });
}

tandem_status tandem_scheduler_submit(tandem_scheduler* scheduler, const tandem_request_params* params,
                                      tandem_request** out_request) {
  static constexpr const char* fn = "tandem_scheduler_submit";
  if (out_request != nullptr) *out_request = nullptr;
  return guard([&] {
    require(out_request, fn, "out_request");
    auto sc = get_scheduler(scheduler, fn);
    Request r = request_from_params(*sc, params, fn);
    auto obj = std::make_shared<RequestObj>();
    r.on_event = [signal = obj->signal](const RequestEvent&) {
      {
        std::lock_guard<std::mutex> lock(signal->mu);
        ++signal->seq;
      }
      signal->cv.notify_all();
      return true;
    };
    obj->scheduler = sc;
    obj->handle = sc->scheduler->submit(std::move(r));  // kInvalidArgument after shutdown
    *out_request = Registry::instance().add_handle<tandem_request>(Kind::kRequest, std::move(obj));
  });
}

tandem_status tandem_scheduler_session_open(tandem_scheduler* scheduler, uint64_t* out_session) {
  static constexpr const char* fn = "tandem_scheduler_session_open";
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(out_session, fn, "out_session");
    *out_session = sc->scheduler->open_session();
  });
}

tandem_status tandem_scheduler_session_close(tandem_scheduler* scheduler, uint64_t session) {
  static constexpr const char* fn = "tandem_scheduler_session_close";
  return guard([&] { get_scheduler(scheduler, fn)->scheduler->close_session(session); });
}

tandem_status tandem_scheduler_session_info_init(tandem_scheduler_session_info* info, size_t struct_size) {
  return guard([&] {
    init_struct(info, struct_size, kSchedulerSessionInfoV01, zeroed<tandem_scheduler_session_info>(),
                "tandem_scheduler_session_info_init", "tandem_scheduler_session_info");
  });
}

tandem_status tandem_scheduler_session_get_info(tandem_scheduler* scheduler, uint64_t session,
                                                tandem_scheduler_session_info* info) {
  static constexpr const char* fn = "tandem_scheduler_session_get_info";
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kSchedulerSessionInfoV01, fn, "tandem_scheduler_session_info");
    const Scheduler::SessionInfo si = sc->scheduler->session_info(session);
    tandem_scheduler_session_info out{};
    out.n_tokens = si.n_tokens;
    out.kv_tokens = si.kv_tokens;
    out.executor = si.executor;
    out.busy = si.busy ? 1 : 0;
    out.pages_device = si.pages[int(KvTier::kDevice)];
    out.pages_host = si.pages[int(KvTier::kHost)];
    out.pages_file = si.pages[int(KvTier::kFile)];
    write_struct(info, out, n);
  });
}

tandem_status tandem_scheduler_session_park(tandem_scheduler* scheduler, uint64_t session) {
  static constexpr const char* fn = "tandem_scheduler_session_park";
  return guard([&] {
    if (!get_scheduler(scheduler, fn)->scheduler->park_session(session)) {
      fail(TANDEM_E_BUSY,
           fmt::format("{}: a request is running on session {} (park it between requests)", fn, session));
    }
  });
}

tandem_status tandem_scheduler_session_unpark(tandem_scheduler* scheduler, uint64_t session) {
  static constexpr const char* fn = "tandem_scheduler_session_unpark";
  return guard([&] {
    if (!get_scheduler(scheduler, fn)->scheduler->unpark_session(session)) {
      fail(TANDEM_E_BUSY, fmt::format("{}: a request is running on session {}", fn, session));
    }
  });
}

tandem_status tandem_scheduler_session_save(tandem_scheduler* scheduler, uint64_t session, const char* path) {
  static constexpr const char* fn = "tandem_scheduler_session_save";
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(path, fn, "path");
    if (*path == '\0') fail(TANDEM_E_INVALID_ARG, fmt::format("{}: path is empty", fn));
    if (!sc->scheduler->save_session(session, std::filesystem::path(path))) {
      fail(TANDEM_E_BUSY,
           fmt::format("{}: a request is running on session {} (save it between requests)", fn, session));
    }
  });
}

tandem_status tandem_scheduler_session_restore(tandem_scheduler* scheduler, const char* path, int32_t executor,
                                               uint64_t* out_session) {
  static constexpr const char* fn = "tandem_scheduler_session_restore";
  if (out_session) *out_session = 0;
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(path, fn, "path");
    require(out_session, fn, "out_session");
    if (*path == '\0') fail(TANDEM_E_INVALID_ARG, fmt::format("{}: path is empty", fn));
    *out_session = sc->scheduler->restore_session(std::filesystem::path(path), executor);
  });
}

tandem_status tandem_scheduler_drain(tandem_scheduler* scheduler) {
  static constexpr const char* fn = "tandem_scheduler_drain";
  return guard([&] { get_scheduler(scheduler, fn)->scheduler->drain(); });
}

tandem_status tandem_scheduler_shutdown(tandem_scheduler* scheduler) {
  static constexpr const char* fn = "tandem_scheduler_shutdown";
  return guard([&] { get_scheduler(scheduler, fn)->scheduler->shutdown(); });
}

tandem_status tandem_scheduler_metrics_json(const tandem_scheduler* scheduler, char* buf, size_t capacity,
                                            size_t* out_len) {
  static constexpr const char* fn = "tandem_scheduler_metrics_json";
  return guard([&] {
    auto sc = get_scheduler(scheduler, fn);
    require(out_len, fn, "out_len");
    write_text(sc->scheduler->metrics().to_json(), buf, capacity, out_len, fn);
  });
}

tandem_status tandem_request_poll(tandem_request* request, tandem_request_event* event) {
  static constexpr const char* fn = "tandem_request_poll";
  return guard([&] {
    auto r = get_request(request, fn);
    poll_event(*r, event, fn);
  });
}

tandem_status tandem_request_next_event(tandem_request* request, int32_t timeout_ms, tandem_request_event* event) {
  static constexpr const char* fn = "tandem_request_next_event";
  return guard([&] {
    auto r = get_request(request, fn);
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(std::max(timeout_ms, 0));
    EventSignal& signal = *r->signal;
    for (;;) {
      uint64_t seen = 0;
      {
        std::lock_guard<std::mutex> lock(signal.mu);
        seen = signal.seq;
      }
      if (poll_event(*r, event, fn) || timeout_ms == 0) return;
      std::unique_lock<std::mutex> lock(signal.mu);
      const auto moved = [&] { return signal.seq != seen; };
      if (timeout_ms < 0) {
        signal.cv.wait(lock, moved);
      } else if (!signal.cv.wait_until(lock, deadline, moved)) {
        lock.unlock();
        poll_event(*r, event, fn);  // a last look: the event may have come with the timeout
        return;
      }
    }
  });
}

tandem_status tandem_request_cancel(tandem_request* request) {
  static constexpr const char* fn = "tandem_request_cancel";
  return guard([&] {
    auto r = get_request(request, fn);
    if (r->handle.done()) return;
    if (auto sc = r->scheduler.lock()) sc->scheduler->cancel(r->handle);
  });
}

tandem_status tandem_request_wait(tandem_request* request, int32_t timeout_ms, tandem_request_result* result) {
  static constexpr const char* fn = "tandem_request_wait";
  return guard([&] {
    auto r = get_request(request, fn);
    if (result != nullptr) (void)out_struct_size(result, kRequestResultV01, fn, "tandem_request_result");
    if (timeout_ms < 0) {
      r->handle.wait();
    } else if (timeout_ms > 0) {
      r->handle.wait_for(std::chrono::milliseconds(timeout_ms));
    }
    if (result != nullptr) fill_request_result(*r, result, fn);
  });
}

tandem_status tandem_request_get_result(const tandem_request* request, tandem_request_result* result) {
  static constexpr const char* fn = "tandem_request_get_result";
  return guard([&] {
    auto r = get_request(request, fn);
    require(result, fn, "result");
    fill_request_result(*r, result, fn);
  });
}

tandem_status tandem_request_free(tandem_request* request) {
  return guard([&] {
    if (request == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(request), Kind::kRequest);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_request_free: request handle {:#x} is not live (double free?)",
                                                reinterpret_cast<uintptr_t>(request)));
    }
    auto r = std::static_pointer_cast<RequestObj>(obj);
    if (!r->handle.done()) {
      if (auto sc = r->scheduler.lock()) sc->scheduler->cancel(r->handle);
    }
  });
}

tandem_status tandem_scheduler_submit_n(tandem_scheduler* scheduler, const tandem_request_params* params, uint32_t n,
                                        tandem_request** out_requests) {
  static constexpr const char* fn = "tandem_scheduler_submit_n";
  if (out_requests != nullptr) {
    for (uint32_t i = 0; i < n && i <= uint32_t(Scheduler::kMaxChoices); ++i) out_requests[i] = nullptr;
  }
  return guard([&] {
    require(out_requests, fn, "out_requests");
    if (n < 1 || n > uint32_t(Scheduler::kMaxChoices)) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: n {} must be in [1, {}]", fn, n, Scheduler::kMaxChoices));
    }
    auto sc = get_scheduler(scheduler, fn);
    Request r = request_from_params(*sc, params, fn);
    if (n > 1 && r.session != 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: n > 1 cannot continue a session", fn));
    std::vector<std::shared_ptr<RequestObj>> objs;
    for (uint32_t i = 0; i < n; ++i) {
      objs.push_back(std::make_shared<RequestObj>());
      objs.back()->scheduler = sc;
    }
    std::vector<std::shared_ptr<EventSignal>> signals;
    signals.reserve(objs.size());
    for (const auto& o : objs) signals.push_back(o->signal);
    r.on_event = [signals = std::move(signals)](const RequestEvent& e) {
      EventSignal& signal = *signals[size_t(e.choice)];
      {
        std::lock_guard<std::mutex> lock(signal.mu);
        ++signal.seq;
      }
      signal.cv.notify_all();
      return true;
    };
    auto handles = sc->scheduler->submit_n(std::move(r), int32_t(n));  // kInvalidArgument after shutdown
    for (uint32_t i = 0; i < n; ++i) {
      objs[i]->handle = handles[i];
      out_requests[i] = Registry::instance().add_handle<tandem_request>(Kind::kRequest, objs[i]);
    }
  });
}

}  // extern "C"
