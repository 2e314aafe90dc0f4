// The C ABI's session functions (cabi/include/tandem.h): create, eval, sampling and
// generation, save / restore.
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <limits>
#include <span>
#include <string>
#include <vector>

#include "capi_internal.hpp"

using namespace tandem;
using namespace tandem::capi;

namespace {

struct PreparedGenerate {
  GenerateOptions options;
  bool parse_special = false;
  tandem_generate_result result{};  // caller's input fields, when given
  size_t result_bytes = 0;
};

PreparedGenerate prepare_generate(const tandem_generate_params* user, tandem_generate_result* result,
                                  const Tokenizer& tok, const char* fn) {
  PreparedGenerate g;
  tandem_generate_params p = default_generate_params();
  if (user != nullptr) read_struct(user, kGenerateParamsV01, p, fn, "tandem_generate_params");
  check_flags(p.flags, kGenerateFlags, fn);
  if (p.max_tokens < 0) fail(TANDEM_E_INVALID_ARG, fmt::format("{}: max_tokens {} must be >= 0", fn, p.max_tokens));
  g.options.max_tokens = p.max_tokens;
  g.options.ignore_eos = (p.flags & TANDEM_GENERATE_IGNORE_EOS) != 0;
  g.parse_special = (p.flags & TANDEM_GENERATE_PARSE_SPECIAL) != 0;
  g.options.sampling = to_sampling(p.sampling, fn);
  g.options.stop = read_stops(p.stop, p.n_stop, fn);
  g.options.logprobs = read_logprobs(p.logprobs, p.reserved, fn);
  g.options.grammar = read_grammar(p.grammar, p.grammar_type, p.reserved2, tok, fn);
  if (result != nullptr) {
    g.result_bytes = out_struct_size(result, kGenerateResultV01, fn, "tandem_generate_result");
    std::memcpy(&g.result, result, g.result_bytes);
    if (g.result.tokens == nullptr && g.result.tokens_cap != 0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: result->tokens is NULL but tokens_cap is {}", fn, g.result.tokens_cap));
    }
    if (g.result.text == nullptr && g.result.text_cap != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: result->text is NULL but text_cap is {}", fn, g.result.text_cap));
    }
    if (g.result.logprobs == nullptr && g.result.logprobs_cap != 0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: result->logprobs is NULL but logprobs_cap is {}", fn, g.result.logprobs_cap));
    }
  }
  return g;
}

/// The token callback, plus the abort check of tandem_session_abort after each piece.
void attach_callback(PreparedGenerate& g, SessionObj& s, tandem_token_callback callback, void* user_data) {
  g.options.on_text = [&s, callback, user_data](std::string_view text, int32_t token) {
    if (callback != nullptr) {
      s.piece.assign(text.data(), text.size());  // NUL-terminated copy, reused between calls
      if (callback(s.piece.c_str(), s.piece.size(), token, user_data) != 0) return false;
    }
    return !s.abort.load(std::memory_order_relaxed);
  };
}

/// Session::generate with the prompt evaluated here, n_batch tokens at a time, so that
/// tandem_session_abort can stop a long prefill between chunks. Same results as
/// Session::generate(prompt, options): the same chunks reach the executor, the whole
/// prompt is checked (ids, context) before anything is evaluated.
GenerateResult generate_abortable(SessionObj& s, std::span<const int32_t> prompt, const GenerateOptions& options) {
  Session& session = *s.session;
  const int32_t n_vocab = session.model().hparams().n_vocab;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if (prompt[i] < 0 || prompt[i] >= n_vocab) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("generate: token id {} at index {} is outside the vocabulary [0, {})", prompt[i], i, n_vocab));
    }
  }
  const size_t before = session.tokens().size();
  // A pending sampled token (at most one) is evaluated with the first chunk. When the
  // prompt might not fit with it, leave the whole check to Session::generate, which
  // refuses an overflowing prompt before evaluating anything.
  const bool chunked = !prompt.empty() && before + prompt.size() + 1 <= size_t(session.n_ctx());
  if (!chunked) return session.generate(prompt, options);
  const auto t0 = std::chrono::steady_clock::now();
  GenerateResult cancelled;
  cancelled.finish = FinishReason::kCancelled;
  const size_t chunk = size_t(s.n_batch);
  for (size_t b = 0; b < prompt.size(); b += chunk) {
    if (s.abort.load(std::memory_order_relaxed)) {
      cancelled.n_prompt = int32_t(session.tokens().size() - before);
      return cancelled;
    }
    session.eval(prompt.subspan(b, std::min(chunk, prompt.size() - b)));
  }
  const double prompt_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const int32_t n_prompt = int32_t(session.tokens().size() - before);  // the pending token included
  if (s.abort.load(std::memory_order_relaxed)) {
    cancelled.n_prompt = n_prompt;
    cancelled.prompt_seconds = prompt_seconds;
    return cancelled;
  }
  GenerateResult r = session.generate(std::span<const int32_t>(), options);
  r.n_prompt = n_prompt;
  r.prompt_seconds = prompt_seconds;
  return r;
}

void write_result(const GenerateResult& r, PreparedGenerate& g, tandem_generate_result* result) {
  if (result == nullptr) return;
  tandem_generate_result out = g.result;  // keeps the caller's buffer fields
  out.n_tokens = r.tokens.size();
  out.text_len = r.text.size();
  out.finish_reason = static_cast<int32_t>(r.finish);
  out.n_prompt = r.n_prompt;
  out.prompt_seconds = r.prompt_seconds;
  out.generate_seconds = r.generate_seconds;
  out.n_logprobs = r.logprobs.size();
  write_logprobs(r.logprobs, out.logprobs, out.logprobs_cap);
  if (out.tokens != nullptr) {
    std::copy_n(r.tokens.begin(), std::min(r.tokens.size(), out.tokens_cap), out.tokens);
  }
  if (out.text != nullptr && out.text_cap > 0) {
    size_t n = std::min(r.text.size(), out.text_cap - 1);
    if (n < r.text.size()) {
      while (n > 0 && (static_cast<unsigned char>(r.text[n]) & 0xC0u) == 0x80u) --n;  // character boundary
    }
    std::memcpy(out.text, r.text.data(), n);
    out.text[n] = '\0';
  }
  write_struct(result, out, g.result_bytes);
}

}  // namespace

extern "C" {

// ---- session -------------------------------------------------------------------------------

tandem_status tandem_session_params_init(tandem_session_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kSessionParamsV01, default_session_params(), "tandem_session_params_init",
                "tandem_session_params");
  });
}

tandem_status tandem_session_create(const tandem_model* model, const tandem_session_params* params,
                                    tandem_session** out_session) {
  static constexpr const char* fn = "tandem_session_create";
  if (out_session != nullptr) *out_session = nullptr;
  return guard([&] {
    require(out_session, fn, "out_session");
    auto m = get_model(model, fn);
    tandem_session_params p = default_session_params();
    if (params != nullptr) read_struct(params, kSessionParamsV01, p, fn, "tandem_session_params");
    if (p.n_ctx < 0 || p.n_batch < 1 || p.page_size < 1 || p.n_threads < 0 || p.n_threads > kMaxThreads) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: n_ctx {} must be >= 0, n_batch {} and page_size {} >= 1, n_threads {} in [0, {}]", fn,
                       p.n_ctx, p.n_batch, p.page_size, p.n_threads, kMaxThreads));
    }
    if (p.kv_tier != TANDEM_KV_HOST && p.kv_tier != TANDEM_KV_FILE) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: kv_tier {} must be TANDEM_KV_HOST (1) or TANDEM_KV_FILE (2) for a "
                                             "session",
                                             fn, p.kv_tier));
    }
    if (p.kv_dtype != TANDEM_KV_F16 && p.kv_dtype != TANDEM_KV_F32 && p.kv_dtype != TANDEM_KV_Q8_0) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: kv_dtype {} is not a tandem_kv_dtype (0 f32, 1 f16, 2 q8_0)", fn, p.kv_dtype));
    }
    std::shared_ptr<PoolObj> pool;
    if (p.pool != nullptr) {
      pool = get_pool(p.pool, fn);
      if (p.n_threads != 0) {
        fail(TANDEM_E_INVALID_ARG,
             fmt::format("{}: n_threads {} with a pool: set one of them (the pool has its threads)", fn, p.n_threads));
      }
    }
    const HParams& hp = m->model->hparams();
    const int64_t n_ctx = p.n_ctx > 0 ? p.n_ctx : default_context_size(hp);
    if (n_ctx > int64_t(std::numeric_limits<int32_t>::max()) - p.page_size) {
      fail(TANDEM_E_INVALID_ARG,
           fmt::format("{}: n_ctx {} with page_size {} overflows the page count", fn, p.n_ctx, p.page_size));
    }
    // Refuse a KV cache that cannot fit in physical memory before allocating it: the
    // session's own store holds one sequence by the node's page rule (tandem/node/node.hpp).
    const KvLayout layout = KvLayout::for_model(hp, p.page_size, static_cast<KvDtype>(p.kv_dtype));
    const double kv_bytes = double(compute_tier_pages(layout, n_ctx, p.n_batch, 1, 0)) * double(layout.page_bytes());
    const uint64_t phys = physical_memory_bytes();
    if (p.kv_tier == TANDEM_KV_HOST && phys > 0 && kv_bytes > double(phys)) {
      fail(TANDEM_E_OUT_OF_MEMORY,
           fmt::format("{}: a KV cache of {} positions needs {:.3g} bytes, more than the {} bytes of physical "
                       "memory",
                       fn, n_ctx, kv_bytes, phys));
    }
    auto s = std::make_shared<SessionObj>();
    s->model = m;
    if (pool) {
      s->executor = std::make_unique<CpuQ4Executor>(m->model, pool->pool);
    } else {
      CpuExecutorOptions exec_options;
      exec_options.n_threads = p.n_threads;
      s->executor = std::make_unique<CpuQ4Executor>(m->model, exec_options);
    }
    SessionOptions session_options;
    session_options.n_ctx = p.n_ctx;
    session_options.n_batch = p.n_batch;
    session_options.page_size = p.page_size;
    session_options.kv_tier = static_cast<KvTier>(p.kv_tier);
    session_options.kv_dtype = static_cast<KvDtype>(p.kv_dtype);
    if (p.kv_dir != nullptr) session_options.kv_dir = std::filesystem::path(p.kv_dir);
    s->session = std::make_unique<Session>(m->model, *s->executor, session_options);
    s->n_batch = p.n_batch;
    s->page_size = p.page_size;
    *out_session = Registry::instance().add_handle<tandem_session>(Kind::kSession, std::move(s));
  });
}

tandem_status tandem_session_free(tandem_session* session) {
  return guard([&] {
    if (session == nullptr) return;
    auto obj = Registry::instance().remove(reinterpret_cast<uintptr_t>(session), Kind::kSession);
    if (!obj) {
      fail(TANDEM_E_INVALID_HANDLE, fmt::format("tandem_session_free: session handle {:#x} is not live (double free?)",
                                                reinterpret_cast<uintptr_t>(session)));
    }
  });
}

tandem_status tandem_session_info_init(tandem_session_info* info, size_t struct_size) {
  return guard([&] {
    init_struct(info, struct_size, kSessionInfoV01, zeroed<tandem_session_info>(), "tandem_session_info_init",
                "tandem_session_info");
  });
}

tandem_status tandem_session_get_info(const tandem_session* session, tandem_session_info* info) {
  static constexpr const char* fn = "tandem_session_get_info";
  return guard([&] {
    auto s = get_session(session, fn);
    require(info, fn, "info");
    const size_t n = out_struct_size(info, kSessionInfoV01, fn, "tandem_session_info");
    BusyGuard busy(*s, fn);
    tandem_session_info out{};
    out.n_ctx = s->session->n_ctx();
    out.n_tokens = static_cast<int32_t>(s->session->tokens().size());
    out.n_batch = s->n_batch;
    out.page_size = s->page_size;
    out.n_threads = s->executor->n_threads();
    out.has_logits = s->session->logits().empty() ? 0 : 1;
    write_struct(info, out, n);
  });
}

tandem_status tandem_session_reset(tandem_session* session) {
  static constexpr const char* fn = "tandem_session_reset";
  return guard([&] {
    auto s = get_session(session, fn);
    BusyGuard busy(*s, fn);
    s->session->reset();
  });
}

tandem_status tandem_session_eval(tandem_session* session, const int32_t* tokens, size_t n_tokens, float* logits,
                                  size_t capacity) {
  static constexpr const char* fn = "tandem_session_eval";
  return guard([&] {
    auto s = get_session(session, fn);
    if (tokens == nullptr && n_tokens != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: tokens is NULL but n_tokens is {}", fn, n_tokens));
    }
    check_count(n_tokens, fn, "n_tokens");
    BusyGuard busy(*s, fn);
    const size_t n_vocab = size_t(s->session->model().hparams().n_vocab);
    std::span<float> out;
    if (check_capacity(logits, capacity, n_tokens * n_vocab, fn, "logits") && n_tokens > 0) {
      out = std::span<float>(logits, n_tokens * n_vocab);
    }
    s->session->eval(std::span<const int32_t>(tokens, n_tokens), out);
  });
}

tandem_status tandem_session_get_logits(const tandem_session* session, float* logits, size_t capacity, size_t* out_n) {
  static constexpr const char* fn = "tandem_session_get_logits";
  return guard([&] {
    auto s = get_session(session, fn);
    require(out_n, fn, "out_n");
    BusyGuard busy(*s, fn);
    const auto l = s->session->logits();
    *out_n = l.size();
    if (check_capacity(logits, capacity, l.size(), fn, "logits")) std::copy(l.begin(), l.end(), logits);
  });
}

tandem_status tandem_session_get_tokens(const tandem_session* session, int32_t* tokens, size_t capacity,
                                        size_t* out_n) {
  static constexpr const char* fn = "tandem_session_get_tokens";
  return guard([&] {
    auto s = get_session(session, fn);
    require(out_n, fn, "out_n");
    BusyGuard busy(*s, fn);
    const auto& t = s->session->tokens();
    *out_n = t.size();
    if (check_capacity(tokens, capacity, t.size(), fn, "tokens")) std::copy(t.begin(), t.end(), tokens);
  });
}

// ---- sampling and generation ----------------------------------------------------------------

tandem_status tandem_sampling_params_init(tandem_sampling_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kSamplingParamsV01, default_sampling_params(), "tandem_sampling_params_init",
                "tandem_sampling_params");
  });
}

tandem_status tandem_generate_params_init(tandem_generate_params* params, size_t struct_size) {
  return guard([&] {
    init_struct(params, struct_size, kGenerateParamsV01, default_generate_params(), "tandem_generate_params_init",
                "tandem_generate_params");
  });
}

tandem_status tandem_generate_result_init(tandem_generate_result* result, size_t struct_size) {
  return guard([&] {
    init_struct(result, struct_size, kGenerateResultV01, zeroed<tandem_generate_result>(),
                "tandem_generate_result_init", "tandem_generate_result");
  });
}

tandem_status tandem_session_generate(tandem_session* session, const char* prompt_utf8,
                                      const tandem_generate_params* params, tandem_token_callback callback,
                                      void* user_data, tandem_generate_result* result) {
  static constexpr const char* fn = "tandem_session_generate";
  return guard([&] {
    auto s = get_session(session, fn);
    require(prompt_utf8, fn, "prompt_utf8");
    const std::string_view prompt(prompt_utf8);
    check_utf8(prompt, fn, "the prompt");
    PreparedGenerate g = prepare_generate(params, result, s->session->model().tokenizer(), fn);
    BusyGuard busy(*s, fn);
    attach_callback(g, *s, callback, user_data);
    // BOS when the conversation is empty (as Session::generate(text) adds it).
    const auto ids = s->session->model().tokenizer().tokenize(prompt, s->session->tokens().empty(), g.parse_special);
    const GenerateResult r = generate_abortable(*s, ids, g.options);
    write_result(r, g, result);
  });
}

tandem_status tandem_session_generate_tokens(tandem_session* session, const int32_t* prompt, size_t n_prompt,
                                             const tandem_generate_params* params, tandem_token_callback callback,
                                             void* user_data, tandem_generate_result* result) {
  static constexpr const char* fn = "tandem_session_generate_tokens";
  return guard([&] {
    auto s = get_session(session, fn);
    if (prompt == nullptr && n_prompt != 0) {
      fail(TANDEM_E_INVALID_ARG, fmt::format("{}: prompt is NULL but n_prompt is {}", fn, n_prompt));
    }
    check_count(n_prompt, fn, "n_prompt");
    PreparedGenerate g = prepare_generate(params, result, s->session->model().tokenizer(), fn);
    BusyGuard busy(*s, fn);
    attach_callback(g, *s, callback, user_data);
    const GenerateResult r = generate_abortable(*s, std::span<const int32_t>(prompt, n_prompt), g.options);
    write_result(r, g, result);
  });
}

tandem_status tandem_session_abort(tandem_session* session) {
  static constexpr const char* fn = "tandem_session_abort";
  return guard([&] {
    auto s = get_session(session, fn);
    std::lock_guard<std::mutex> lock(s->abort_mu);
    if (s->busy.load(std::memory_order_acquire)) s->abort.store(true, std::memory_order_relaxed);
  });
}

// ---- session save / restore ----------------------------------------------------------------

tandem_status tandem_session_save(const tandem_session* session, const char* path) {
  static constexpr const char* fn = "tandem_session_save";
  return guard([&] {
    auto s = get_session(session, fn);
    require(path, fn, "path");
    if (*path == '\0') fail(TANDEM_E_INVALID_ARG, fmt::format("{}: path is empty", fn));
    BusyGuard busy(*s, fn);
    s->session->save(std::filesystem::path(path));
  });
}

tandem_status tandem_session_restore(tandem_session* session, const char* path) {
  static constexpr const char* fn = "tandem_session_restore";
  return guard([&] {
    auto s = get_session(session, fn);
    require(path, fn, "path");
    if (*path == '\0') fail(TANDEM_E_INVALID_ARG, fmt::format("{}: path is empty", fn));
    BusyGuard busy(*s, fn);
    s->session->restore(std::filesystem::path(path));  // all-or-nothing (Session::restore)
  });
}

}  // extern "C"
