/*
 * The C ABI test program: compiled as C99 (not C++), run by ctest in the Release and the
 * ASan+UBSan builds. It calls every function of cabi/include/tandem.h, including every
 * error path: NULL handles and arguments, freed / foreign / wrong-kind handles, double
 * free, bad struct_size, invalid UTF-8, small buffers, a callback that stops, a callback
 * that frees its session, a session used from two threads (refused with TANDEM_E_BUSY),
 * and the field case B21 (failed create, NULL to every function, double free); session
 * save/restore (round trip; truncated, corrupt, foreign, too-large and other-model files
 * leave the session unchanged); the scheduler ("cpu+cpu" with two requests checked
 * against the golden continuation, polling, small buffers, cancel before and after the
 * finish, deadline, overload, drain, shutdown, freeing the scheduler with live requests,
 * poll after free, every bad parameter). It generates with the aidreams260K model and
 * checks against the golden continuation.
 *
 * Data: TANDEM_SHARED (default: <source>/../shared), TANDEM_MODELS (default
 * $TANDEM_SHARED/models). Exit status 0 when every check passed.
 */
#define _POSIX_C_SOURCE 200809L

#include <dirent.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "tandem.h"

/* ---- tiny harness --------------------------------------------------------------------- */

static int g_checks = 0;
static int g_failures = 0;

#define CHECK(cond)                                                            \
  do {                                                                         \
    ++g_checks;                                                                \
    if (!(cond)) {                                                             \
      ++g_failures;                                                            \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond); \
    }                                                                          \
  } while (0)

#define CHECK_STATUS(expr, want)                                                                                 \
  do {                                                                                                           \
    tandem_status st_ = (expr);                                                                                  \
    ++g_checks;                                                                                                  \
    if (st_ != (want)) {                                                                                         \
      ++g_failures;                                                                                              \
      fprintf(stderr, "%s:%d: %s\n  returned %s (%d), expected %s; last error: %s\n", __FILE__, __LINE__, #expr, \
              tandem_status_name(st_), (int)st_, tandem_status_name(want), tandem_last_error());                 \
    }                                                                                                            \
  } while (0)

#define CHECK_OK(expr) CHECK_STATUS(expr, TANDEM_OK)

/* Stop the program: a precondition of the remaining checks failed. */
#define REQUIRE_OK(expr)                                                                                 \
  do {                                                                                                   \
    tandem_status st_ = (expr);                                                                          \
    if (st_ != TANDEM_OK) {                                                                              \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #expr, tandem_status_name(st_), \
              tandem_last_error());                                                                      \
      exit(2);                                                                                           \
    }                                                                                                    \
  } while (0)

#define CHECK_MSG_CONTAINS(needle) CHECK(strstr(tandem_last_error(), (needle)) != NULL)

/* ---- data paths and the golden case ------------------------------------------------------ */

static char g_model_path[8192];
static char g_golden_path[8192];

static void find_data(void) {
  const char* shared = getenv("TANDEM_SHARED");
  const char* models = getenv("TANDEM_MODELS");
  char shared_buf[4096];
  if (shared == NULL || *shared == '\0') {
    snprintf(shared_buf, sizeof shared_buf, "%s/../shared", TANDEM_SOURCE_DIR);
    shared = shared_buf;
  }
  if (models != NULL && *models != '\0') {
    snprintf(g_model_path, sizeof g_model_path, "%s/aidreams260K-q4_0.gguf", models);
  } else {
    snprintf(g_model_path, sizeof g_model_path, "%s/models/aidreams260K-q4_0.gguf", shared);
  }
  snprintf(g_golden_path, sizeof g_golden_path, "%s/golden/aidreams260K-q4_0/cases.json", shared);
}

static char* read_file(const char* path) {
  FILE* f = fopen(path, "rb");
  char* buf;
  long n;
  if (f == NULL) return NULL;
  fseek(f, 0, SEEK_END);
  n = ftell(f);
  fseek(f, 0, SEEK_SET);
  buf = (char*)malloc((size_t)n + 1);
  if (buf == NULL || fread(buf, 1, (size_t)n, f) != (size_t)n) {
    free(buf);
    fclose(f);
    return NULL;
  }
  buf[n] = '\0';
  fclose(f);
  return buf;
}

/* The golden case, read with a tiny scanner (cases.json has a fixed, simple shape). */
typedef struct golden_case {
  int32_t prompt_ids[256];
  size_t n_prompt;
  int32_t greedy_ids[64];
  double margin[64];
  size_t n_greedy;
  double logits_max_abs;
  char greedy_text[4096];
  char prompt_text[1024];
} golden_case;

static const char* find_key(const char* from, const char* key) {
  char pattern[128];
  const char* p;
  snprintf(pattern, sizeof pattern, "\"%s\"", key);
  p = strstr(from, pattern);
  if (p == NULL) return NULL;
  p = strchr(p + strlen(pattern), ':');
  return p == NULL ? NULL : p + 1;
}

static size_t parse_number_array(const char* p, double* out, size_t cap) {
  size_t n = 0;
  p = strchr(p, '[');
  if (p == NULL) return 0;
  ++p;
  for (;;) {
    char* end;
    double v;
    while (*p == ' ' || *p == '\n' || *p == '\r' || *p == '\t' || *p == ',') ++p;
    if (*p == ']' || *p == '\0') break;
    v = strtod(p, &end);
    if (end == p) break;
    if (n < cap) out[n] = v;
    ++n;
    p = end;
  }
  return n;
}

static void put_utf8(char** w, const char* end, unsigned long cp) {
  char tmp[4];
  int n, i;
  if (cp < 0x80) {
    tmp[0] = (char)cp;
    n = 1;
  } else if (cp < 0x800) {
    tmp[0] = (char)(0xC0 | (cp >> 6));
    tmp[1] = (char)(0x80 | (cp & 0x3F));
    n = 2;
  } else if (cp < 0x10000) {
    tmp[0] = (char)(0xE0 | (cp >> 12));
    tmp[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    tmp[2] = (char)(0x80 | (cp & 0x3F));
    n = 3;
  } else {
    tmp[0] = (char)(0xF0 | (cp >> 18));
    tmp[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    tmp[2] = (char)(0x80 | ((cp >> 6) & 0x3F));
    tmp[3] = (char)(0x80 | (cp & 0x3F));
    n = 4;
  }
  for (i = 0; i < n && *w < end; ++i) *(*w)++ = tmp[i];
}

static int parse_string(const char* p, char* out, size_t cap) {
  char* w = out;
  const char* end = out + cap - 1;
  p = strchr(p, '"');
  if (p == NULL) return 0;
  ++p;
  while (*p != '"' && *p != '\0') {
    if (*p == '\\') {
      ++p;
      switch (*p) {
        case 'n':
          if (w < end) *w++ = '\n';
          ++p;
          break;
        case 't':
          if (w < end) *w++ = '\t';
          ++p;
          break;
        case 'r':
          if (w < end) *w++ = '\r';
          ++p;
          break;
        case 'b':
          if (w < end) *w++ = '\b';
          ++p;
          break;
        case 'f':
          if (w < end) *w++ = '\f';
          ++p;
          break;
        case 'u': {
          unsigned long cp = strtoul((char[5]){p[1], p[2], p[3], p[4], 0}, NULL, 16);
          p += 5;
          if (cp >= 0xD800 && cp < 0xDC00 && p[0] == '\\' && p[1] == 'u') {
            const unsigned long lo = strtoul((char[5]){p[2], p[3], p[4], p[5], 0}, NULL, 16);
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            p += 6;
          }
          put_utf8(&w, end, cp);
          break;
        }
        default:
          if (w < end) *w++ = *p;
          ++p;
          break; /* \" \\ \/ */
      }
    } else {
      if (w < end) *w++ = *p;
      ++p;
    }
  }
  *w = '\0';
  return 1;
}

static int load_golden(const char* case_name, golden_case* g) {
  char* json = read_file(g_golden_path);
  char pattern[128];
  const char* c;
  const char* p;
  double tmp[256];
  size_t i;
  if (json == NULL) {
    fprintf(stderr, "cannot read %s\n", g_golden_path);
    return 0;
  }
  memset(g, 0, sizeof *g);
  snprintf(pattern, sizeof pattern, "\"name\": \"%s\"", case_name);
  c = strstr(json, pattern);
  if (c == NULL) {
    free(json);
    return 0;
  }
  p = find_key(c, "prompt_text");
  if (p) parse_string(p, g->prompt_text, sizeof g->prompt_text);
  p = find_key(c, "prompt_ids");
  g->n_prompt = parse_number_array(p, tmp, 256);
  for (i = 0; i < g->n_prompt && i < 256; ++i) g->prompt_ids[i] = (int32_t)tmp[i];
  p = find_key(c, "logits_max_abs");
  g->logits_max_abs = strtod(p, NULL);
  p = find_key(c, "greedy_ids");
  g->n_greedy = parse_number_array(p, tmp, 64);
  for (i = 0; i < g->n_greedy && i < 64; ++i) g->greedy_ids[i] = (int32_t)tmp[i];
  p = find_key(c, "greedy_top1_margin");
  parse_number_array(p, g->margin, 64);
  p = find_key(c, "greedy_text");
  parse_string(p, g->greedy_text, sizeof g->greedy_text);
  free(json);
  return g->n_prompt > 0 && g->n_greedy == 64;
}

/* Steps of the greedy continuation that must match exactly: up to the first step whose
 * reference top-1 margin is within the Q4_0 logit tolerance (2e-2 x max|logit|), the rule
 * of shared/golden/README.md and tests/test_golden.cpp. */
static size_t golden_clear_prefix(const golden_case* g) {
  const double tol = 2e-2 * g->logits_max_abs;
  size_t n = 0;
  while (n < g->n_greedy && g->margin[n] > tol) ++n;
  return n;
}

/* ---- callback helpers ---------------------------------------------------------------------- */

typedef struct collector {
  char text[8192];
  size_t len;
  int calls;
  int stop_after; /* >0: return nonzero on this call */
  int32_t last_token;
} collector;

static int collect_cb(const char* piece, size_t len, int32_t token, void* user_data) {
  collector* c = (collector*)user_data;
  CHECK(piece != NULL);
  CHECK(piece[len] == '\0');
  CHECK(strlen(piece) == len);
  if (c->len + len < sizeof c->text) {
    memcpy(c->text + c->len, piece, len);
    c->len += len;
    c->text[c->len] = '\0';
  }
  c->calls++;
  c->last_token = token;
  return c->stop_after > 0 && c->calls >= c->stop_after;
}

static tandem_model* g_model = NULL;
static int32_t g_n_vocab = 0;

static tandem_session* new_session(int32_t n_ctx) {
  tandem_session_params sp;
  tandem_session* s = NULL;
  REQUIRE_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.n_ctx = n_ctx;
  sp.n_threads = 1;
  REQUIRE_OK(tandem_session_create(g_model, &sp, &s));
  return s;
}

static tandem_generate_params greedy_params(tandem_sampling_params* sampling, int32_t max_tokens) {
  tandem_generate_params gp;
  REQUIRE_OK(tandem_sampling_params_init(sampling, sizeof *sampling));
  sampling->temperature = 0.0f;
  REQUIRE_OK(tandem_generate_params_init(&gp, sizeof gp));
  gp.sampling = sampling;
  gp.max_tokens = max_tokens;
  gp.flags = TANDEM_GENERATE_IGNORE_EOS;
  return gp;
}

/* ---- tests ------------------------------------------------------------------------------------ */

static void test_version_and_names(void) {
  char expect[32];
  CHECK(strcmp(tandem_version(), TANDEM_VERSION_STRING) == 0);
  snprintf(expect, sizeof expect, "%d.%d.%d", TANDEM_VERSION_MAJOR, TANDEM_VERSION_MINOR, TANDEM_VERSION_PATCH);
  CHECK(strcmp(tandem_version(), expect) == 0);
  CHECK(TANDEM_VERSION_NUMBER == TANDEM_VERSION_MAJOR * 10000 + TANDEM_VERSION_MINOR * 100 + TANDEM_VERSION_PATCH);
  CHECK(strcmp(tandem_status_name(TANDEM_OK), "OK") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_INVALID_ARG), "INVALID_ARG") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_GGUF_TRUNCATED), "GGUF_TRUNCATED") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_INVALID_HANDLE), "INVALID_HANDLE") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_BUSY), "BUSY") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_BUFFER_TOO_SMALL), "BUFFER_TOO_SMALL") == 0);
  CHECK(strcmp(tandem_status_name(12345), "UNKNOWN") == 0);
  CHECK(TANDEM_E_KV_MISMATCH == 60 && TANDEM_E_KV_CHECKSUM == 61 && TANDEM_E_KV_LEASE_EXPIRED == 62);
  CHECK(TANDEM_E_KV_TOKEN_RANGE == 63 && TANDEM_E_SESSION_CORRUPT == 70);
  CHECK(TANDEM_E_SESSION_MODEL_MISMATCH == 71 && TANDEM_E_SESSION_VERSION == 72);
  CHECK(strcmp(tandem_status_name(TANDEM_E_KV_MISMATCH), "KV_MISMATCH") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_KV_CHECKSUM), "KV_CHECKSUM") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_KV_LEASE_EXPIRED), "KV_LEASE_EXPIRED") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_KV_TOKEN_RANGE), "KV_TOKEN_RANGE") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_SESSION_CORRUPT), "SESSION_CORRUPT") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_SESSION_MODEL_MISMATCH), "SESSION_MODEL_MISMATCH") == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_SESSION_VERSION), "SESSION_VERSION") == 0);
  CHECK(TANDEM_FINISH_TIMEOUT == 4 && TANDEM_FINISH_OVERLOADED == 5 && TANDEM_FINISH_ERROR == 6);
  CHECK(TANDEM_SLA_INTERACTIVE == 0 && TANDEM_SLA_STANDARD == 1 && TANDEM_SLA_BATCH == 2);
  CHECK(strcmp(tandem_status_name(-1), "UNKNOWN") == 0);
  CHECK(tandem_last_error() != NULL);
}

/* Every *_init: NULL, too small, exact, larger (tail zeroed), defaults. */
static void test_init_functions(void) {
  unsigned char big[512];
  tandem_model_params mp;
  tandem_model_info mi;
  tandem_session_params sp;
  tandem_session_info si;
  tandem_sampling_params smp;
  tandem_generate_params gp;
  tandem_generate_result gr;
  tandem_executor_params ep;
  tandem_scheduler_params scp;
  tandem_request_params rp;
  tandem_request_event re;
  tandem_request_result rr;

#define CHECK_INIT_MIN(fn, type, min_size)                                                  \
  do {                                                                                      \
    CHECK_STATUS(fn(NULL, sizeof(type)), TANDEM_E_INVALID_ARG);                             \
    CHECK_STATUS(fn((type*)big, 0), TANDEM_E_INVALID_ARG);                                  \
    CHECK_STATUS(fn((type*)big, sizeof(size_t)), TANDEM_E_INVALID_ARG);                     \
    CHECK_STATUS(fn((type*)big, (min_size)-1), TANDEM_E_INVALID_ARG);                       \
    CHECK_OK(fn((type*)big, (min_size)));                                                   \
    memset(big, 0xAB, sizeof big);                                                          \
    CHECK_OK(fn((type*)big, sizeof(type) + 64));                                            \
    CHECK(((type*)big)->struct_size == sizeof(type) + 64);                                  \
    CHECK(big[sizeof(type) + 63] == 0);    /* the tail the library does not know: zeroed */ \
    CHECK(big[sizeof(type) + 64] == 0xAB); /* nothing past struct_size */                   \
  } while (0)
#define CHECK_INIT(fn, type) CHECK_INIT_MIN(fn, type, sizeof(type))
  CHECK_INIT(tandem_model_info_init, tandem_model_info);
  /* Structs that grew accept the struct_size of their first version. */
  CHECK_INIT_MIN(tandem_model_params_init, tandem_model_params, offsetof(tandem_model_params, chat_template));
  CHECK_INIT_MIN(tandem_session_params_init, tandem_session_params, offsetof(tandem_session_params, kv_tier));
  CHECK_INIT(tandem_session_info_init, tandem_session_info);
  CHECK_INIT(tandem_sampling_params_init, tandem_sampling_params);
  CHECK_INIT_MIN(tandem_generate_params_init, tandem_generate_params, offsetof(tandem_generate_params, logprobs));
  CHECK_INIT_MIN(tandem_generate_result_init, tandem_generate_result, offsetof(tandem_generate_result, logprobs));
  CHECK_INIT_MIN(tandem_executor_params_init, tandem_executor_params, offsetof(tandem_executor_params, device_kind));
  CHECK_INIT_MIN(tandem_scheduler_params_init, tandem_scheduler_params,
                 offsetof(tandem_scheduler_params, executor_handles));
  CHECK_INIT_MIN(tandem_request_params_init, tandem_request_params, offsetof(tandem_request_params, session));
  CHECK_INIT(tandem_request_event_init, tandem_request_event);
  CHECK_INIT_MIN(tandem_request_result_init, tandem_request_result, offsetof(tandem_request_result, logprobs));
  CHECK_INIT(tandem_device_info_init, tandem_device_info);
#undef CHECK_INIT
#undef CHECK_INIT_MIN

  CHECK_OK(tandem_model_params_init(&mp, sizeof mp));
  CHECK(mp.struct_size == sizeof mp && mp.check_block_scales == 1 && mp.max_alignment == (1u << 20));
  CHECK(mp.chat_template == NULL);
  CHECK_OK(tandem_model_info_init(&mi, sizeof mi));
  CHECK(mi.struct_size == sizeof mi && mi.arch == NULL && mi.n_vocab == 0);
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  CHECK(sp.n_ctx == 0 && sp.n_batch == 512 && sp.page_size == 16 && sp.n_threads == 0);
  CHECK(sp.kv_tier == TANDEM_KV_HOST && sp.kv_dtype == TANDEM_KV_F16 && sp.kv_dir == NULL);
  CHECK_OK(tandem_session_info_init(&si, sizeof si));
  CHECK(si.n_ctx == 0 && si.has_logits == 0);
  CHECK_OK(tandem_sampling_params_init(&smp, sizeof smp));
  CHECK(fabsf(smp.temperature - 0.8f) < 1e-6f && smp.top_k == 40 && fabsf(smp.top_p - 0.95f) < 1e-6f);
  CHECK(fabsf(smp.min_p - 0.05f) < 1e-6f && smp.repeat_penalty == 1.0f && smp.repeat_last_n == 64);
  CHECK(smp.frequency_penalty == 0.0f && smp.presence_penalty == 0.0f);
  CHECK_OK(tandem_generate_params_init(&gp, sizeof gp));
  CHECK(gp.max_tokens == 128 && gp.flags == 0 && gp.sampling == NULL && gp.stop == NULL && gp.n_stop == 0);
  CHECK_OK(tandem_generate_result_init(&gr, sizeof gr));
  CHECK(gr.tokens == NULL && gr.text == NULL && gr.tokens_cap == 0 && gr.text_cap == 0 && gr.n_tokens == 0);
  CHECK_OK(tandem_executor_params_init(&ep, sizeof ep));
  CHECK(ep.n_threads == 0 && ep.max_running == 16 && ep.step_token_budget == 256 && ep.prefill_chunk == 128);
  CHECK(ep.kv_pages == 0 && ep.accelerator == -1);
  CHECK_OK(tandem_scheduler_params_init(&scp, sizeof scp));
  CHECK(scp.executors == NULL && scp.n_executors == 1 && scp.max_queued == 1024 && scp.max_context == 0);
  CHECK(scp.prefix_cache_entries == 4 && scp.page_size == 16);
  CHECK_OK(tandem_request_params_init(&rp, sizeof rp));
  CHECK(rp.prompt == NULL && rp.prompt_tokens == NULL && rp.n_prompt_tokens == 0 && rp.sampling == NULL);
  CHECK(rp.stop == NULL && rp.n_stop == 0 && rp.max_tokens == 128 && rp.flags == 0);
  CHECK(rp.sla == TANDEM_SLA_STANDARD && rp.deadline_ms == 0 && rp.session == 0);
  CHECK_OK(tandem_request_event_init(&re, sizeof re));
  CHECK(re.text == NULL && re.text_cap == 0 && re.kind == TANDEM_EVENT_NONE && re.token == -1);
  CHECK(re.finish_reason == -1);
  CHECK_OK(tandem_request_result_init(&rr, sizeof rr));
  CHECK(rr.tokens == NULL && rr.text == NULL && rr.finished == 0 && rr.finish_reason == -1 && rr.message == NULL);
}

/* ABI layout of version 0.1 on LP64: a change here is an ABI break (bump
 * TANDEM_ABI_VERSION and update cabi/abi/tandem.symbols' header comment). */
static void test_struct_layout(void) {
  if (sizeof(void*) != 8) return;
  CHECK(sizeof(tandem_model_params) == 24);
  CHECK(offsetof(tandem_model_params, check_block_scales) == 8);
  CHECK(offsetof(tandem_model_params, max_alignment) == 12);
  CHECK(offsetof(tandem_model_params, chat_template) == 16);
  CHECK(sizeof(tandem_model_info) == 64);
  CHECK(offsetof(tandem_model_info, arch) == 8);
  CHECK(offsetof(tandem_model_info, name) == 16);
  CHECK(offsetof(tandem_model_info, n_vocab) == 24);
  CHECK(offsetof(tandem_model_info, token_eos) == 52);
  CHECK(offsetof(tandem_model_info, weight_bytes) == 56);
  CHECK(sizeof(tandem_session_params) == 48);
  CHECK(offsetof(tandem_session_params, pool) == 40);
  CHECK(offsetof(tandem_session_params, n_threads) == 20);
  CHECK(offsetof(tandem_session_params, kv_tier) == 24);
  CHECK(offsetof(tandem_session_params, kv_dir) == 32);
  CHECK(sizeof(tandem_session_info) == 32);
  CHECK(offsetof(tandem_session_info, has_logits) == 28);
  CHECK(sizeof(tandem_sampling_params) == 48);
  CHECK(offsetof(tandem_sampling_params, presence_penalty) == 36);
  CHECK(offsetof(tandem_sampling_params, seed) == 40);
  CHECK(sizeof(tandem_generate_params) == 64);
  CHECK(offsetof(tandem_generate_params, logprobs) == 40);
  CHECK(offsetof(tandem_generate_params, reserved) == 44);
  CHECK(offsetof(tandem_generate_params, grammar) == 48);
  CHECK(offsetof(tandem_generate_params, grammar_type) == 56);
  CHECK(sizeof(tandem_token_logprob) == 172);
  CHECK(offsetof(tandem_token_logprob, n_top) == 8);
  CHECK(offsetof(tandem_token_logprob, top_tokens) == 12);
  CHECK(offsetof(tandem_token_logprob, top_logprobs) == 92);
  CHECK(offsetof(tandem_generate_params, sampling) == 8);
  CHECK(offsetof(tandem_generate_params, stop) == 16);
  CHECK(offsetof(tandem_generate_params, n_stop) == 24);
  CHECK(offsetof(tandem_generate_params, max_tokens) == 32);
  CHECK(offsetof(tandem_generate_params, flags) == 36);
  CHECK(sizeof(tandem_generate_result) == 104);
  CHECK(offsetof(tandem_generate_result, logprobs) == 80);
  CHECK(offsetof(tandem_generate_result, n_logprobs) == 96);
  CHECK(offsetof(tandem_generate_result, tokens) == 8);
  CHECK(offsetof(tandem_generate_result, text_cap) == 32);
  CHECK(offsetof(tandem_generate_result, n_tokens) == 40);
  CHECK(offsetof(tandem_generate_result, finish_reason) == 56);
  CHECK(offsetof(tandem_generate_result, prompt_seconds) == 64);
  CHECK(offsetof(tandem_generate_result, generate_seconds) == 72);
  CHECK(sizeof(tandem_executor_params) == 64);
  CHECK(offsetof(tandem_executor_params, pool) == 56);
  CHECK(sizeof(tandem_scheduler_session_info) == 40);
  CHECK(offsetof(tandem_scheduler_session_info, pages_host) == 28);
  CHECK(offsetof(tandem_executor_params, n_threads) == 8);
  CHECK(offsetof(tandem_executor_params, accelerator) == 28);
  CHECK(offsetof(tandem_executor_params, device_kind) == 32);
  CHECK(offsetof(tandem_executor_params, kv_file_pages) == 44);
  CHECK(offsetof(tandem_executor_params, kv_dir) == 48);
  CHECK(sizeof(tandem_scheduler_params) == 56);
  CHECK(offsetof(tandem_scheduler_params, executor_handles) == 40);
  CHECK(offsetof(tandem_scheduler_params, log_routing) == 48);
  CHECK(offsetof(tandem_scheduler_params, executors) == 8);
  CHECK(offsetof(tandem_scheduler_params, n_executors) == 16);
  CHECK(offsetof(tandem_scheduler_params, max_queued) == 24);
  CHECK(offsetof(tandem_scheduler_params, page_size) == 36);
  CHECK(sizeof(tandem_request_params) == 104);
  CHECK(offsetof(tandem_request_params, logprobs) == 80);
  CHECK(offsetof(tandem_request_params, grammar) == 88);
  CHECK(offsetof(tandem_request_params, grammar_type) == 96);
  CHECK(offsetof(tandem_request_params, session) == 72);
  CHECK(offsetof(tandem_request_params, prompt) == 8);
  CHECK(offsetof(tandem_request_params, prompt_tokens) == 16);
  CHECK(offsetof(tandem_request_params, sampling) == 32);
  CHECK(offsetof(tandem_request_params, n_stop) == 48);
  CHECK(offsetof(tandem_request_params, max_tokens) == 56);
  CHECK(offsetof(tandem_request_params, sla) == 64);
  CHECK(offsetof(tandem_request_params, deadline_ms) == 68);
  CHECK(sizeof(tandem_request_event) == 48);
  CHECK(offsetof(tandem_request_event, text) == 8);
  CHECK(offsetof(tandem_request_event, text_len) == 24);
  CHECK(offsetof(tandem_request_event, kind) == 32);
  CHECK(offsetof(tandem_request_event, finish_reason) == 40);
  CHECK(sizeof(tandem_request_result) == 136);
  CHECK(offsetof(tandem_request_result, logprobs) == 112);
  CHECK(offsetof(tandem_request_result, n_logprobs) == 128);
  CHECK(offsetof(tandem_request_result, n_tokens) == 40);
  CHECK(offsetof(tandem_request_result, id) == 56);
  CHECK(offsetof(tandem_request_result, finished) == 64);
  CHECK(offsetof(tandem_request_result, status) == 72);
  CHECK(offsetof(tandem_request_result, message) == 80);
  CHECK(offsetof(tandem_request_result, e2e_seconds) == 104);
  CHECK(sizeof(tandem_device_info) == 48);
  CHECK(offsetof(tandem_device_info, memory_bytes) == 24);
  CHECK(offsetof(tandem_device_info, compute_capability) == 44);
}

/* B21: NULL handles to every function -> TANDEM_E_INVALID_ARG; free(NULL) no-op. */
static void test_null_handles(void) {
  tandem_model_info mi;
  tandem_session_info si;
  uint64_t h = 0;
  size_t n = 0;
  int32_t ids[4] = {1, 2, 3, 4};
  char buf[16];
  float logits[4];
  tandem_model* m = (tandem_model*)&h; /* sentinel: must be overwritten with NULL */
  tandem_session* s = (tandem_session*)&h;

  CHECK_OK(tandem_model_info_init(&mi, sizeof mi));
  CHECK_OK(tandem_session_info_init(&si, sizeof si));

  CHECK_STATUS(tandem_model_load(NULL, NULL, &m), TANDEM_E_INVALID_ARG);
  CHECK(m == NULL);
  CHECK_MSG_CONTAINS("path");
  CHECK_STATUS(tandem_model_load(g_model_path, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_model_free(NULL));
  CHECK_STATUS(tandem_model_get_info(NULL, &mi), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("model");
  CHECK_STATUS(tandem_model_identity_hash(NULL, &h), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_tokenize(NULL, "a", 1, 0, ids, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_detokenize(NULL, ids, 1, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_token_to_piece(NULL, 1, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_create(NULL, NULL, &s), TANDEM_E_INVALID_ARG);
  CHECK(s == NULL);
  CHECK_STATUS(tandem_session_create(g_model, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_session_free(NULL));
  CHECK_STATUS(tandem_session_get_info(NULL, &si), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_reset(NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_eval(NULL, ids, 1, NULL, 0), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_get_logits(NULL, logits, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_get_tokens(NULL, ids, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_generate(NULL, "x", NULL, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_generate_tokens(NULL, ids, 1, NULL, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_model_params_init(NULL, sizeof(tandem_model_params)), TANDEM_E_INVALID_ARG);

  /* NULL for every other required pointer, with a live model / session. */
  s = new_session(32);
  CHECK_STATUS(tandem_model_get_info(g_model, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_model_identity_hash(g_model, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_tokenize(g_model, "a", 1, 0, ids, 4, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_tokenize(g_model, NULL, 1, 0, ids, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_tokenize(g_model, "a", 1, 0, NULL, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_detokenize(g_model, ids, 1, 0, buf, sizeof buf, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_detokenize(g_model, NULL, 1, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_detokenize(g_model, ids, 1, 0, NULL, 16, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_token_to_piece(g_model, 1, 0, buf, sizeof buf, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_token_to_piece(g_model, 1, 0, NULL, 16, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_get_info(s, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_eval(s, NULL, 1, NULL, 0), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_eval(s, ids, 1, NULL, 4), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_get_logits(s, logits, 4, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_get_logits(s, NULL, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_get_tokens(s, ids, 4, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_get_tokens(s, NULL, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_generate(s, NULL, NULL, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_generate_tokens(s, NULL, 3, NULL, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_session_free(s));
}

/* B21: a create that must fail returns NULL plus a code and a message. */
static void test_failed_create(void) {
  tandem_model* m = (tandem_model*)&g_checks;
  tandem_session* s = (tandem_session*)&g_checks;
  tandem_session_params sp;
  tandem_model_params mp;
  char path[] = "/tmp/tandem-c-api-XXXXXX";
  int fd;
  static const char junk[64] = "NOT A GGUF FILE";
  static const unsigned char truncated[] = {'G', 'G', 'U', 'F', 3, 0, 0, 0, 1, 0};

  CHECK_STATUS(tandem_model_load("/nonexistent/dir/model.gguf", NULL, &m), TANDEM_E_IO);
  CHECK(m == NULL);
  CHECK(strlen(tandem_last_error()) > 0);
  CHECK_MSG_CONTAINS("nonexistent");
  CHECK_STATUS(tandem_model_load("/tmp", NULL, &m), TANDEM_E_IO); /* a directory */
  CHECK(m == NULL);

  fd = mkstemp(path);
  CHECK(fd >= 0);
  if (fd >= 0) {
    tandem_status st;
    CHECK(write(fd, junk, sizeof junk) == (ssize_t)sizeof junk);
    close(fd);
    m = (tandem_model*)&g_checks;
    CHECK_STATUS(tandem_model_load(path, NULL, &m), TANDEM_E_GGUF_BAD_MAGIC);
    CHECK(m == NULL);
    {
      FILE* f = fopen(path, "wb");
      CHECK(f != NULL);
      if (f) {
        fwrite(truncated, 1, sizeof truncated, f);
        fclose(f);
      }
    }
    m = (tandem_model*)&g_checks;
    st = tandem_model_load(path, NULL, &m);
    CHECK(st >= TANDEM_E_GGUF_BAD_MAGIC && st <= TANDEM_E_TENSOR_NON_FINITE);
    CHECK(m == NULL);
    unlink(path);
  }

  /* Bad model params: struct_size too small / unknown nonzero field. */
  CHECK_OK(tandem_model_params_init(&mp, sizeof mp));
  mp.struct_size = 4;
  CHECK_STATUS(tandem_model_load(g_model_path, &mp, &m), TANDEM_E_INVALID_ARG);
  CHECK(m == NULL);
  CHECK_MSG_CONTAINS("struct_size");
  {
    /* A caller built against a newer header: zero tail accepted, nonzero refused. */
    unsigned char big[sizeof(tandem_model_params) + 8];
    tandem_model_params* bp = (tandem_model_params*)big;
    CHECK_OK(tandem_model_params_init(bp, sizeof big));
    bp->check_block_scales = 0;
    CHECK_OK(tandem_model_load(g_model_path, bp, &m));
    CHECK(m != NULL);
    CHECK_OK(tandem_model_free(m));
    big[sizeof big - 1] = 7;
    CHECK_STATUS(tandem_model_load(g_model_path, bp, &m), TANDEM_E_INVALID_ARG);
    CHECK(m == NULL);
  }
  {
    unsigned char big[sizeof(tandem_session_params) + 8];
    tandem_session_params* bp = (tandem_session_params*)big;
    CHECK_OK(tandem_session_params_init(bp, sizeof big));
    bp->n_ctx = 16;
    bp->n_threads = 1;
    CHECK_OK(tandem_session_create(g_model, bp, &s));
    CHECK(s != NULL);
    CHECK_OK(tandem_session_free(s));
    big[sizeof(tandem_session_params)] = 1;
    CHECK_STATUS(tandem_session_create(g_model, bp, &s), TANDEM_E_INVALID_ARG);
    CHECK(s == NULL);
  }

  /* Sessions that cannot be created. */
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.n_ctx = -1;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK(s == NULL);
  sp.n_ctx = INT32_MAX; /* the page count would overflow */
  s = (tandem_session*)&g_checks;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK(s == NULL);
  sp.n_ctx = INT32_MAX - 64; /* terabytes of KV cache */
  s = (tandem_session*)&g_checks;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_OUT_OF_MEMORY);
  CHECK(s == NULL);
  CHECK_MSG_CONTAINS("physical memory");
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.n_batch = 0;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.page_size = 0;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.kv_dtype = 7;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("kv_dtype");
  sp.kv_dtype = TANDEM_KV_Q8_0; /* a Q8_0 KV cache: accepted (aidreams' KV rows are whole blocks) */
  sp.n_ctx = 64;
  sp.n_threads = 1;
  CHECK_OK(tandem_session_create(g_model, &sp, &s));
  CHECK_OK(tandem_session_free(s));
  s = NULL;
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.n_threads = 100000;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  sp.n_threads = -1;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK(s == NULL);
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.struct_size = 0;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK(s == NULL);
}

/* Double free, use after free, wrong-kind and foreign handles -> TANDEM_E_INVALID_HANDLE. */
static void test_handle_registry(void) {
  tandem_model* m = NULL;
  tandem_model* m2 = NULL;
  tandem_session* s = NULL;
  tandem_model_info mi;
  tandem_session_info si;
  uint64_t hash;
  size_t n;
  int32_t ids[8];
  char buf[32];
  float logits[8];
  int local = 0;
  tandem_model* foreign_model = (tandem_model*)&local;
  tandem_session* foreign_session = (tandem_session*)&local;

  CHECK_OK(tandem_model_info_init(&mi, sizeof mi));
  CHECK_OK(tandem_session_info_init(&si, sizeof si));
  REQUIRE_OK(tandem_model_load(g_model_path, NULL, &m));
  CHECK(m != NULL);
  REQUIRE_OK(tandem_session_create(m, NULL, &s));

  /* Wrong kind: a session handle where a model is expected and the other way round. */
  CHECK_STATUS(tandem_model_get_info((const tandem_model*)s, &mi), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_model_free((tandem_model*)s), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_get_info((const tandem_session*)m, &si), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_free((tandem_session*)m), TANDEM_E_INVALID_HANDLE);
  /* Pointers the library never returned: checked, never dereferenced. */
  CHECK_STATUS(tandem_model_get_info(foreign_model, &mi), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_model_free(foreign_model), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_reset(foreign_session), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_free(foreign_session), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_free((tandem_session*)(uintptr_t)0x1), TANDEM_E_INVALID_HANDLE);

  CHECK_OK(tandem_session_free(s));
  CHECK_STATUS(tandem_session_free(s), TANDEM_E_INVALID_HANDLE); /* double free */
  CHECK_MSG_CONTAINS("double free");
  /* Every session function on a freed session. */
  CHECK_STATUS(tandem_session_get_info(s, &si), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_reset(s), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_eval(s, ids, 1, NULL, 0), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_get_logits(s, logits, 8, &n), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_get_tokens(s, ids, 8, &n), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_generate(s, "x", NULL, NULL, NULL, NULL), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_generate_tokens(s, ids, 1, NULL, NULL, NULL, NULL), TANDEM_E_INVALID_HANDLE);

  CHECK_OK(tandem_model_free(m));
  CHECK_STATUS(tandem_model_free(m), TANDEM_E_INVALID_HANDLE); /* double free */
  /* Every model function on a freed model. */
  CHECK_STATUS(tandem_model_get_info(m, &mi), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_model_identity_hash(m, &hash), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_tokenize(m, "a", 1, 0, ids, 8, &n), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_detokenize(m, ids, 0, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_token_to_piece(m, 1, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_HANDLE);
  s = (tandem_session*)&local;
  CHECK_STATUS(tandem_session_create(m, NULL, &s), TANDEM_E_INVALID_HANDLE);
  CHECK(s == NULL);

  /* Handle values are not reused: a new model does not revive the old handle. */
  REQUIRE_OK(tandem_model_load(g_model_path, NULL, &m2));
  CHECK(m2 != m);
  CHECK_STATUS(tandem_model_get_info(m, &mi), TANDEM_E_INVALID_HANDLE);
  CHECK_OK(tandem_model_free(m2));
}

static void test_model_info(void) {
  tandem_model_info mi;
  uint64_t h1 = 0, h2 = 0;
  unsigned char big[sizeof(tandem_model_info) + 32];
  tandem_model_info* bi = (tandem_model_info*)big;

  CHECK_OK(tandem_model_info_init(&mi, sizeof mi));
  CHECK_OK(tandem_model_get_info(g_model, &mi));
  CHECK(mi.struct_size == sizeof mi);
  CHECK(mi.arch != NULL && strcmp(mi.arch, "llama") == 0);
  CHECK(mi.name != NULL && strlen(mi.name) > 0);
  CHECK(mi.n_vocab == 512);
  CHECK(mi.n_ctx_train > 0);
  CHECK(mi.n_embd > 0 && mi.n_layer > 0 && mi.n_head > 0 && mi.n_head_kv > 0);
  CHECK(mi.token_bos == 1);
  CHECK(mi.token_eos == 2);
  CHECK(mi.weight_bytes > 0);
  g_n_vocab = mi.n_vocab;

  CHECK_OK(tandem_model_identity_hash(g_model, &h1));
  CHECK_OK(tandem_model_identity_hash(g_model, &h2));
  CHECK(h1 != 0 && h1 == h2);

  /* Output struct larger than the library's: bytes past sizeof are not touched. */
  memset(big, 0x5A, sizeof big);
  CHECK_OK(tandem_model_info_init(bi, sizeof big));
  memset(big + sizeof(tandem_model_info), 0x5A, 32);
  CHECK_OK(tandem_model_get_info(g_model, bi));
  CHECK(bi->struct_size == sizeof big);
  CHECK(bi->n_vocab == 512);
  CHECK(big[sizeof(tandem_model_info)] == 0x5A && big[sizeof big - 1] == 0x5A);
  /* Too small. */
  mi.struct_size = sizeof(size_t);
  CHECK_STATUS(tandem_model_get_info(g_model, &mi), TANDEM_E_INVALID_ARG);
  mi.struct_size = 0;
  CHECK_STATUS(tandem_model_get_info(g_model, &mi), TANDEM_E_INVALID_ARG);
}

static void test_tokenizer(const golden_case* g) {
  int32_t ids[256];
  size_t n = 12345;
  size_t i;
  char buf[256];
  const char* text = g->prompt_text;
  const size_t len = strlen(text);
  static const char* bad_utf8[] = {"\xff", "ab\xc0\x80",          "\xed\xa0\x80", "x\xe2\x82", "\xf4\x90\x80\x80",
                                   "\x80", "\xf8\x88\x80\x80\x80"};

  /* Size query, then fill. */
  CHECK_OK(tandem_tokenize(g_model, text, len, TANDEM_TOKENIZE_ADD_SPECIAL, NULL, 0, &n));
  CHECK(n == g->n_prompt);
  CHECK_OK(tandem_tokenize(g_model, text, len, TANDEM_TOKENIZE_ADD_SPECIAL, ids, 256, &n));
  CHECK(n == g->n_prompt);
  for (i = 0; i < n && i < g->n_prompt; ++i) CHECK(ids[i] == g->prompt_ids[i]);
  /* Without BOS: one fewer. */
  CHECK_OK(tandem_tokenize(g_model, text, len, 0, ids, 256, &n));
  CHECK(n == g->n_prompt - 1 && ids[0] == g->prompt_ids[1]);
  /* Too small: needed size reported, nothing written. */
  ids[0] = -7;
  CHECK_STATUS(tandem_tokenize(g_model, text, len, TANDEM_TOKENIZE_ADD_SPECIAL, ids, 3, &n), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK(n == g->n_prompt && ids[0] == -7);
  /* Empty text: NULL allowed with length 0. */
  CHECK_OK(tandem_tokenize(g_model, NULL, 0, TANDEM_TOKENIZE_ADD_SPECIAL, ids, 256, &n));
  CHECK(n == 1 && ids[0] == 1);
  CHECK_OK(tandem_tokenize(g_model, "", 0, 0, ids, 256, &n));
  CHECK(n == 0);
  /* Special-token text. */
  CHECK_OK(tandem_tokenize(g_model, "<s>", 3, TANDEM_TOKENIZE_PARSE_SPECIAL, ids, 256, &n));
  CHECK(n == 1 && ids[0] == 1);
  CHECK_OK(tandem_tokenize(g_model, "<s>", 3, 0, ids, 256, &n));
  CHECK(n > 1);
  /* Embedded NUL is just a byte when a length is given. */
  CHECK_OK(tandem_tokenize(g_model, "a\0b", 3, 0, ids, 256, &n));
  CHECK(n >= 2);
  /* Invalid UTF-8 and unknown flags. */
  for (i = 0; i < sizeof bad_utf8 / sizeof bad_utf8[0]; ++i) {
    CHECK_STATUS(tandem_tokenize(g_model, bad_utf8[i], strlen(bad_utf8[i]), 0, ids, 256, &n), TANDEM_E_INVALID_ARG);
    CHECK_MSG_CONTAINS("UTF-8");
  }
  CHECK_STATUS(tandem_tokenize(g_model, "a", 1, 0x80u, ids, 256, &n), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("flag");
  /* Valid multi-byte UTF-8 is accepted. */
  CHECK_OK(tandem_tokenize(g_model, "h\xc3\xa9 \xe2\x82\xac \xf0\x9f\x98\x80", 12, 0, ids, 256, &n));

  /* Detokenize: the prompt back (without BOS; the SPM leading space is removed). */
  CHECK_OK(tandem_detokenize(g_model, g->prompt_ids + 1, g->n_prompt - 1, 0, NULL, 0, &n));
  CHECK(n == len);
  CHECK_OK(tandem_detokenize(g_model, g->prompt_ids + 1, g->n_prompt - 1, 0, buf, len + 1, &n));
  CHECK(n == len && strcmp(buf, text) == 0);
  buf[0] = 'Z';
  CHECK_STATUS(tandem_detokenize(g_model, g->prompt_ids + 1, g->n_prompt - 1, 0, buf, len, &n),
               TANDEM_E_BUFFER_TOO_SMALL); /* no room for the NUL */
  CHECK(n == len && buf[0] == 'Z');
  /* With BOS and REMOVE_SPECIAL: BOS dropped, and (llama.cpp quirk) the space kept. */
  CHECK_OK(
      tandem_detokenize(g_model, g->prompt_ids, g->n_prompt, TANDEM_DETOKENIZE_REMOVE_SPECIAL, buf, sizeof buf, &n));
  CHECK(n == len + 1 && buf[0] == ' ' && strcmp(buf + 1, text) == 0);
  CHECK_OK(tandem_detokenize(g_model, NULL, 0, 0, buf, sizeof buf, &n));
  CHECK(n == 0 && buf[0] == '\0');
  CHECK_OK(tandem_detokenize(g_model, g->prompt_ids, 1, TANDEM_DETOKENIZE_UNPARSE_SPECIAL, buf, sizeof buf, &n));
  CHECK(strcmp(buf, "<s>") == 0);
  ids[0] = 1;
  ids[1] = 512;
  CHECK_STATUS(tandem_detokenize(g_model, ids, 2, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("512");
  ids[1] = -1;
  CHECK_STATUS(tandem_detokenize(g_model, ids, 2, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_detokenize(g_model, ids, 1, 0x10u, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);

  /* token_to_piece. */
  CHECK_OK(tandem_token_to_piece(g_model, g->prompt_ids[1], 0, NULL, 0, &n));
  CHECK(n > 0);
  CHECK_OK(tandem_token_to_piece(g_model, g->prompt_ids[1], 0, buf, sizeof buf, &n));
  CHECK(strlen(buf) == n);
  CHECK_STATUS(tandem_token_to_piece(g_model, g->prompt_ids[1], 0, buf, n, &n), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK_OK(tandem_token_to_piece(g_model, 1, 0, buf, sizeof buf, &n));
  CHECK(n == 0 && buf[0] == '\0');
  CHECK_OK(tandem_token_to_piece(g_model, 1, TANDEM_DETOKENIZE_UNPARSE_SPECIAL, buf, sizeof buf, &n));
  CHECK(strcmp(buf, "<s>") == 0);
  CHECK_STATUS(tandem_token_to_piece(g_model, 512, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_token_to_piece(g_model, -3, 0, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_token_to_piece(g_model, 1, 0x4u, buf, sizeof buf, &n), TANDEM_E_INVALID_ARG);
}

static int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0, i;
  for (i = 1; i < n; ++i) {
    if (x[i] > x[best]) best = i;
  }
  return best;
}

static void test_session_eval(const golden_case* g) {
  tandem_session* s = new_session(32);
  tandem_session_info si;
  float* logits = (float*)malloc(sizeof(float) * (size_t)g_n_vocab * 64);
  float* last = (float*)malloc(sizeof(float) * (size_t)g_n_vocab);
  int32_t ids[64];
  int32_t too_many[40];
  size_t n = 0, i;

  CHECK_OK(tandem_session_info_init(&si, sizeof si));
  CHECK_OK(tandem_session_get_info(s, &si));
  CHECK(si.n_ctx == 32 && si.n_tokens == 0 && si.n_batch == 512 && si.page_size == 16 && si.n_threads == 1);
  CHECK(si.has_logits == 0);
  CHECK_OK(tandem_session_get_logits(s, NULL, 0, &n));
  CHECK(n == 0);
  si.struct_size = 3;
  CHECK_STATUS(tandem_session_get_info(s, &si), TANDEM_E_INVALID_ARG);
  si.struct_size = sizeof si;

  /* Small logits buffer: refused, nothing evaluated. */
  CHECK_STATUS(tandem_session_eval(s, g->prompt_ids, g->n_prompt, logits, (size_t)g_n_vocab),
               TANDEM_E_BUFFER_TOO_SMALL);
  /* A bad id: refused, nothing evaluated. */
  memcpy(ids, g->prompt_ids, g->n_prompt * sizeof(int32_t));
  ids[2] = g_n_vocab;
  CHECK_STATUS(tandem_session_eval(s, ids, g->n_prompt, NULL, 0), TANDEM_E_INVALID_ARG);
  /* Too many tokens for n_ctx 32. */
  CHECK_STATUS(tandem_session_eval(s, ids, (size_t)INT32_MAX + 1, NULL, 0), TANDEM_E_INVALID_ARG); /* absurd count */
  CHECK_STATUS(tandem_session_generate_tokens(s, ids, (size_t)INT32_MAX + 1, NULL, NULL, NULL, NULL),
               TANDEM_E_INVALID_ARG);
  for (i = 0; i < 40; ++i) too_many[i] = 5;
  CHECK_STATUS(tandem_session_eval(s, too_many, 40, NULL, 0), TANDEM_E_CONTEXT_OVERFLOW);
  CHECK_MSG_CONTAINS("n_ctx");
  CHECK_OK(tandem_session_get_tokens(s, NULL, 0, &n));
  CHECK(n == 0);

  /* The prompt with per-token logits; the last row's argmax is the first greedy token
   * (margin 1.6, far above the tolerance). */
  CHECK_OK(tandem_session_eval(s, g->prompt_ids, g->n_prompt, logits, (size_t)g_n_vocab * 64));
  CHECK(argmax(logits + (g->n_prompt - 1) * (size_t)g_n_vocab, g_n_vocab) == g->greedy_ids[0]);
  CHECK_OK(tandem_session_get_logits(s, NULL, 0, &n));
  CHECK(n == (size_t)g_n_vocab);
  CHECK_STATUS(tandem_session_get_logits(s, last, n - 1, &n), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK_OK(tandem_session_get_logits(s, last, (size_t)g_n_vocab, &n));
  CHECK(memcmp(last, logits + (g->n_prompt - 1) * (size_t)g_n_vocab, sizeof(float) * (size_t)g_n_vocab) == 0);
  CHECK_OK(tandem_session_get_tokens(s, ids, 64, &n));
  CHECK(n == g->n_prompt && memcmp(ids, g->prompt_ids, n * sizeof(int32_t)) == 0);
  CHECK_STATUS(tandem_session_get_tokens(s, ids, 2, &n), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK(n == g->n_prompt);
  CHECK_OK(tandem_session_get_info(s, &si));
  CHECK(si.n_tokens == (int32_t)g->n_prompt && si.has_logits == 1);

  /* Teacher-force one more token without logits; n_tokens 0 is a no-op here. */
  CHECK_OK(tandem_session_eval(s, &g->greedy_ids[0], 1, NULL, 0));
  CHECK_OK(tandem_session_eval(s, NULL, 0, NULL, 0));
  CHECK_OK(tandem_session_get_logits(s, last, (size_t)g_n_vocab, &n));
  if (g->margin[1] > 2e-2 * g->logits_max_abs) CHECK(argmax(last, g_n_vocab) == g->greedy_ids[1]);
  /* The rest no longer fits (32 - 14 = 18 left). */
  CHECK_STATUS(tandem_session_eval(s, too_many, 19, NULL, 0), TANDEM_E_CONTEXT_OVERFLOW);
  CHECK_OK(tandem_session_get_info(s, &si));
  CHECK(si.n_tokens == (int32_t)g->n_prompt + 1);

  CHECK_OK(tandem_session_reset(s));
  CHECK_OK(tandem_session_get_info(s, &si));
  CHECK(si.n_tokens == 0 && si.has_logits == 0);
  CHECK_OK(tandem_session_free(s));
  free(logits);
  free(last);
}

/* Generation against the golden continuation (the README's rule: exact up to the first
 * low-margin step; when all 64 ids agree, as they do today, the text must agree too). */
static void check_against_golden(const golden_case* g, const int32_t* ids, size_t n, const char* text,
                                 const char* what) {
  const size_t clear = golden_clear_prefix(g);
  size_t i, same = 0;
  CHECK(n == g->n_greedy);
  while (same < n && same < g->n_greedy && ids[same] == g->greedy_ids[same]) ++same;
  CHECK(same >= clear);
  printf("  %s: %zu of %zu greedy ids equal the golden continuation (%zu required)\n", what, same, g->n_greedy, clear);
  for (i = 0; i < clear && i < n; ++i) CHECK(ids[i] == g->greedy_ids[i]);
  if (same == g->n_greedy) CHECK(strcmp(text, g->greedy_text) == 0);
}

static void test_generate_golden(const golden_case* g) {
  tandem_session* s = new_session(0);
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 64);
  tandem_generate_result r;
  collector c;
  int32_t ids[128];
  char text[4096];
  int32_t ids2[128];
  char text2[4096];
  size_t n;

  memset(&c, 0, sizeof c);
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens = ids;
  r.tokens_cap = 128;
  r.text = text;
  r.text_cap = sizeof text;
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, collect_cb, &c, &r));
  CHECK(r.struct_size == sizeof r);
  CHECK(r.tokens == ids && r.text == text); /* input fields kept */
  CHECK(r.finish_reason == TANDEM_FINISH_LENGTH);
  CHECK(r.n_prompt == (int32_t)g->n_prompt);
  CHECK(r.n_tokens == 64);
  CHECK(r.text_len == strlen(text));
  CHECK(r.prompt_seconds >= 0.0 && r.generate_seconds >= 0.0);
  CHECK(c.calls > 0);
  CHECK(strcmp(c.text, text) == 0); /* the streamed pieces are the text */
  check_against_golden(g, ids, r.n_tokens, text, "text prompt");
  /* The session holds prompt + generated ids except the last (pending). */
  CHECK_OK(tandem_session_get_tokens(s, NULL, 0, &n));
  CHECK(n == g->n_prompt + 63);

  /* Continue with an empty prompt. */
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  gp.max_tokens = 4;
  CHECK_OK(tandem_session_generate(s, "", &gp, NULL, NULL, &r));
  CHECK(r.n_tokens == 4 && r.n_prompt == 1);
  CHECK_OK(tandem_session_free(s));

  /* Token-id variant: same ids as the text variant. */
  s = new_session(0);
  gp.max_tokens = 64;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens = ids2;
  r.tokens_cap = 128;
  r.text = text2;
  r.text_cap = sizeof text2;
  CHECK_OK(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &r));
  CHECK(r.n_tokens == 64 && memcmp(ids, ids2, 64 * sizeof(int32_t)) == 0);
  CHECK(strcmp(text, text2) == 0);
  check_against_golden(g, ids2, r.n_tokens, text2, "token prompt");
  CHECK_OK(tandem_session_free(s));

  /* Small output buffers: as much as fits; counts tell the full size. NULL result and
   * NULL callback are fine. */
  s = new_session(0);
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens = ids2;
  r.tokens_cap = 5;
  r.text = text2;
  r.text_cap = 8;
  ids2[5] = -99;
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, &r));
  CHECK(r.n_tokens == 64 && ids2[5] == -99 && memcmp(ids, ids2, 5 * sizeof(int32_t)) == 0);
  CHECK(r.text_len == strlen(text) && strlen(text2) == 7 && strncmp(text, text2, 7) == 0);
  CHECK_OK(tandem_session_reset(s));
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, NULL));
  CHECK_OK(tandem_session_free(s));
}

static void test_generate_errors(const golden_case* g) {
  tandem_session* s = new_session(16);
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 4);
  tandem_generate_result r;
  unsigned char big[sizeof(tandem_generate_params) + 16];
  const char* stops[2] = {"ok", NULL};
  const char* bad_stop[1] = {"\xc3"};
  const char* empty_stop[1] = {""};
  int32_t ids[4] = {1, 5, 600, 7};
  size_t n;

  CHECK_STATUS(tandem_session_generate(s, "Once \xff upon", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("UTF-8");
  CHECK_STATUS(tandem_session_generate(s, "\xe0\x80\xaf", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_generate_tokens(s, NULL, 0, &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("empty prompt");
  CHECK_STATUS(tandem_session_generate_tokens(s, ids, 4, &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("600");
  /* Bad sampling parameters name the field. */
  smp.temperature = -1.0f;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("temperature");
  smp.temperature = 0.0f;
  smp.top_p = 2.0f;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("top_p");
  smp.top_p = 0.9f;
  smp.struct_size = 1;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  smp.struct_size = sizeof smp;
  smp.top_k = -1;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("top_k");
  smp.top_k = 40;
  smp.min_p = 2.0f; /* out of [0, 1] */
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("min_p");
  smp.min_p = 0.05f;
  smp.repeat_penalty = 0.0f;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("repeat_penalty");
  smp.repeat_penalty = 1.0f;
  {
    /* Sampling params from a "newer header": zero tail fine, nonzero refused. */
    unsigned char sbig[sizeof(tandem_sampling_params) + 8];
    memset(sbig, 0, sizeof sbig);
    memcpy(sbig, &smp, sizeof smp);
    ((tandem_sampling_params*)sbig)->struct_size = sizeof sbig;
    gp.sampling = (tandem_sampling_params*)sbig;
    CHECK_OK(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL));
    CHECK_OK(tandem_session_reset(s));
    sbig[sizeof sbig - 1] = 1;
    CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
    gp.sampling = &smp;
  }
  /* Bad generate parameters. */
  gp.max_tokens = -1;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("max_tokens");
  gp.max_tokens = 4;
  gp.flags = 0x100u;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  gp.flags = 0;
  gp.n_stop = 1;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  gp.stop = stops;
  gp.n_stop = 2; /* stops[1] is NULL */
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  gp.stop = bad_stop;
  gp.n_stop = 1;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("UTF-8");
  gp.stop = empty_stop;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  gp.stop = NULL;
  gp.n_stop = 0;
  gp.struct_size = 0;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  gp.struct_size = sizeof gp;
  /* A larger params struct from a "newer header": zero tail accepted, nonzero refused. */
  memset(big, 0, sizeof big);
  memcpy(big, &gp, sizeof gp);
  ((tandem_generate_params*)big)->struct_size = sizeof big;
  CHECK_OK(tandem_session_generate(s, "Hi", (tandem_generate_params*)big, NULL, NULL, NULL));
  CHECK_OK(tandem_session_reset(s));
  big[sizeof big - 3] = 1;
  CHECK_STATUS(tandem_session_generate(s, "Hi", (tandem_generate_params*)big, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("does not know");
  /* Bad result struct. */
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.struct_size = 8;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, &r), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens_cap = 4;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, &r), TANDEM_E_INVALID_ARG);
  r.tokens_cap = 0;
  r.text_cap = 4;
  CHECK_STATUS(tandem_session_generate(s, "Hi", &gp, NULL, NULL, &r), TANDEM_E_INVALID_ARG);
  /* A prompt longer than the context: refused, session unchanged. */
  CHECK_STATUS(tandem_session_generate(s,
                                       "Once upon a time there was a little machine that hummed in a "
                                       "garden full of colours and words",
                                       &gp, NULL, NULL, NULL),
               TANDEM_E_CONTEXT_OVERFLOW);
  CHECK_OK(tandem_session_get_tokens(s, NULL, 0, &n));
  CHECK(n == 0);
  /* An empty text prompt on an empty session starts from BOS alone. */
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  CHECK_OK(tandem_session_generate(s, "", &gp, NULL, NULL, &r));
  CHECK(r.n_prompt == 1 && r.n_tokens == 4);
  CHECK_OK(tandem_session_reset(s));
  /* Generation that reaches n_ctx ends with LENGTH, not an error. */
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  gp.max_tokens = 100;
  CHECK_OK(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &r));
  CHECK(r.finish_reason == TANDEM_FINISH_LENGTH && r.n_tokens == 16 - g->n_prompt + 1);
  CHECK_OK(tandem_session_free(s));
}

static void test_callback_stop_and_stop_strings(const golden_case* g) {
  tandem_session* s = new_session(0);
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 64);
  tandem_generate_result r;
  collector c;
  char full[4096];
  char stop[8];
  const char* stops[1];
  char* at;

  /* Callback returning nonzero: cancelled after exactly that call, status OK. */
  memset(&c, 0, sizeof c);
  c.stop_after = 3;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, collect_cb, &c, &r));
  CHECK(r.finish_reason == TANDEM_FINISH_CANCELLED);
  CHECK(c.calls == 3);
  CHECK(r.n_tokens >= 3 && r.n_tokens < 64);
  CHECK_OK(tandem_session_free(s));

  /* Stop string: take a piece from the middle of the free-running text. */
  s = new_session(0);
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.text = full;
  r.text_cap = sizeof full;
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, &r));
  CHECK(strlen(full) > 40);
  memcpy(stop, full + 30, 5);
  stop[5] = '\0';
  at = strstr(full, stop);
  CHECK(at != NULL);
  CHECK_OK(tandem_session_reset(s));
  memset(&c, 0, sizeof c);
  stops[0] = stop;
  gp.stop = stops;
  gp.n_stop = 1;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, collect_cb, &c, &r));
  CHECK(r.finish_reason == TANDEM_FINISH_STOP_STRING);
  if (at != NULL) {
    CHECK(r.text_len == (size_t)(at - full));
    CHECK(c.len == r.text_len && strncmp(c.text, full, c.len) == 0);
  }
  CHECK_OK(tandem_session_free(s));
}

static void test_sampling_seed(const golden_case* g) {
  tandem_sampling_params smp;
  tandem_generate_params gp;
  tandem_generate_result r;
  int32_t a[32], b[32];
  int k;
  CHECK_OK(tandem_sampling_params_init(&smp, sizeof smp));
  smp.temperature = 1.0f;
  smp.top_k = 0;
  smp.top_p = 1.0f;
  smp.min_p = 0.0f;
  smp.repeat_penalty = 1.1f;
  smp.seed = 1234;
  CHECK_OK(tandem_generate_params_init(&gp, sizeof gp));
  gp.sampling = &smp;
  gp.max_tokens = 32;
  gp.flags = TANDEM_GENERATE_IGNORE_EOS;
  for (k = 0; k < 2; ++k) {
    tandem_session* s = new_session(0);
    CHECK_OK(tandem_generate_result_init(&r, sizeof r));
    r.tokens = k == 0 ? a : b;
    r.tokens_cap = 32;
    CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, &r));
    CHECK(r.n_tokens == 32);
    CHECK_OK(tandem_session_free(s));
  }
  CHECK(memcmp(a, b, sizeof a) == 0); /* same seed, same tokens */
}

/* ---- re-entrancy and threads ------------------------------------------------------------ */

typedef struct reentry {
  tandem_session* self;
  tandem_session* other;
  int calls;
  tandem_status generate_status, info_status, eval_status, reset_status, logits_status, tokens_status, other_status,
      free_status;
  int free_in_callback;
} reentry;

static int reentry_cb(const char* piece, size_t len, int32_t token, void* user_data) {
  reentry* r = (reentry*)user_data;
  tandem_session_info si;
  size_t n;
  int32_t id = 5;
  (void)piece;
  (void)len;
  (void)token;
  if (r->calls++ > 0) return 0;
  tandem_session_info_init(&si, sizeof si);
  r->generate_status = tandem_session_generate(r->self, "again", NULL, NULL, NULL, NULL);
  r->info_status = tandem_session_get_info(r->self, &si);
  r->eval_status = tandem_session_eval(r->self, &id, 1, NULL, 0);
  r->reset_status = tandem_session_reset(r->self);
  r->logits_status = tandem_session_get_logits(r->self, NULL, 0, &n);
  r->tokens_status = tandem_session_get_tokens(r->self, NULL, 0, &n);
  r->other_status = r->other ? tandem_session_get_info(r->other, &si) : TANDEM_OK;
  if (r->free_in_callback) r->free_status = tandem_session_free(r->self);
  return 0;
}

static void test_reentrant_calls(const golden_case* g) {
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 8);
  tandem_generate_result r;
  reentry re;
  tandem_session_info si;

  /* The generating session is busy inside its own callback; another session is not. */
  memset(&re, 0, sizeof re);
  re.self = new_session(0);
  re.other = new_session(32);
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  CHECK_OK(tandem_session_generate(re.self, g->prompt_text, &gp, reentry_cb, &re, &r));
  CHECK(re.calls > 0);
  CHECK(re.generate_status == TANDEM_E_BUSY);
  CHECK(re.info_status == TANDEM_E_BUSY);
  CHECK(re.eval_status == TANDEM_E_BUSY);
  CHECK(re.reset_status == TANDEM_E_BUSY);
  CHECK(re.logits_status == TANDEM_E_BUSY);
  CHECK(re.tokens_status == TANDEM_E_BUSY);
  CHECK(re.other_status == TANDEM_OK);
  CHECK(r.n_tokens == 8);
  /* Not busy any more afterwards. */
  CHECK_OK(tandem_session_info_init(&si, sizeof si));
  CHECK_OK(tandem_session_get_info(re.self, &si));
  CHECK_OK(tandem_session_free(re.self));
  CHECK_OK(tandem_session_free(re.other));

  /* Freeing the session from its own callback: the generation completes, then the
   * session is gone. */
  memset(&re, 0, sizeof re);
  re.self = new_session(0);
  re.free_in_callback = 1;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  CHECK_OK(tandem_session_generate(re.self, g->prompt_text, &gp, reentry_cb, &re, &r));
  CHECK(re.free_status == TANDEM_OK);
  CHECK(r.n_tokens == 8);
  CHECK_STATUS(tandem_session_get_info(re.self, &si), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_free(re.self), TANDEM_E_INVALID_HANDLE);
}

typedef struct two_threads {
  tandem_session* s;
  const char* prompt;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int started;
  int release;
  tandem_status status;
} two_threads;

static int blocking_cb(const char* piece, size_t len, int32_t token, void* user_data) {
  two_threads* t = (two_threads*)user_data;
  (void)piece;
  (void)len;
  (void)token;
  pthread_mutex_lock(&t->mu);
  t->started = 1;
  pthread_cond_broadcast(&t->cv);
  while (!t->release) pthread_cond_wait(&t->cv, &t->mu);
  pthread_mutex_unlock(&t->mu);
  return 0;
}

static void* generating_thread(void* arg) {
  two_threads* t = (two_threads*)arg;
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 8);
  t->status = tandem_session_generate(t->s, t->prompt, &gp, blocking_cb, t, NULL);
  return NULL;
}

static void test_two_threads(const golden_case* g) {
  two_threads t;
  pthread_t th;
  tandem_session_info si;
  int32_t id = 5;
  size_t n;

  memset(&t, 0, sizeof t);
  t.s = new_session(0);
  t.prompt = g->prompt_text;
  pthread_mutex_init(&t.mu, NULL);
  pthread_cond_init(&t.cv, NULL);
  CHECK(pthread_create(&th, NULL, generating_thread, &t) == 0);
  pthread_mutex_lock(&t.mu);
  while (!t.started) pthread_cond_wait(&t.cv, &t.mu);
  pthread_mutex_unlock(&t.mu);

  /* The other thread is inside generate: every session call from here is refused. */
  CHECK_OK(tandem_session_info_init(&si, sizeof si));
  CHECK_STATUS(tandem_session_generate(t.s, "Hello", NULL, NULL, NULL, NULL), TANDEM_E_BUSY);
  CHECK_MSG_CONTAINS("in use");
  CHECK_STATUS(tandem_session_eval(t.s, &id, 1, NULL, 0), TANDEM_E_BUSY);
  CHECK_STATUS(tandem_session_get_info(t.s, &si), TANDEM_E_BUSY);
  CHECK_STATUS(tandem_session_get_tokens(t.s, NULL, 0, &n), TANDEM_E_BUSY);
  /* Model calls are fine concurrently. */
  CHECK_OK(tandem_tokenize(g_model, "Hello", 5, 0, NULL, 0, &n));

  pthread_mutex_lock(&t.mu);
  t.release = 1;
  pthread_cond_broadcast(&t.cv);
  pthread_mutex_unlock(&t.mu);
  CHECK(pthread_join(th, NULL) == 0);
  CHECK(t.status == TANDEM_OK);
  CHECK_OK(tandem_session_get_info(t.s, &si));
  CHECK(si.n_tokens > 0);
  CHECK_OK(tandem_session_free(t.s));
  pthread_mutex_destroy(&t.mu);
  pthread_cond_destroy(&t.cv);
}

/* Sessions keep their model alive; freeing the model handle first is fine. Concurrent
 * sessions on one model in several threads. */
typedef struct parallel_arg {
  const golden_case* g;
  int32_t ids[64];
  size_t n;
  tandem_status status;
} parallel_arg;

static void* parallel_generate(void* p) {
  parallel_arg* a = (parallel_arg*)p;
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 64);
  tandem_generate_result r;
  tandem_session* s = new_session(0);
  tandem_generate_result_init(&r, sizeof r);
  r.tokens = a->ids;
  r.tokens_cap = 64;
  a->status = tandem_session_generate(s, a->g->prompt_text, &gp, NULL, NULL, &r);
  a->n = r.n_tokens;
  tandem_session_free(s);
  return NULL;
}

static void test_lifetimes_and_parallel(const golden_case* g) {
  tandem_model* m = NULL;
  tandem_session* s = NULL;
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 64);
  tandem_generate_result r;
  tandem_model_info mi;
  int32_t ids[64];
  pthread_t th[3];
  parallel_arg args[3];
  int i;

  REQUIRE_OK(tandem_model_load(g_model_path, NULL, &m));
  REQUIRE_OK(tandem_session_create(m, NULL, &s));
  CHECK_OK(tandem_model_free(m));
  CHECK_OK(tandem_model_info_init(&mi, sizeof mi));
  CHECK_STATUS(tandem_model_get_info(m, &mi), TANDEM_E_INVALID_HANDLE);
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens = ids;
  r.tokens_cap = 64;
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, &r));
  CHECK(r.n_tokens == 64);
  CHECK_OK(tandem_session_free(s));

  for (i = 0; i < 3; ++i) {
    memset(&args[i], 0, sizeof args[i]);
    args[i].g = g;
    CHECK(pthread_create(&th[i], NULL, parallel_generate, &args[i]) == 0);
  }
  for (i = 0; i < 3; ++i) {
    CHECK(pthread_join(th[i], NULL) == 0);
    CHECK(args[i].status == TANDEM_OK && args[i].n == 64);
    CHECK(memcmp(args[i].ids, ids, sizeof ids) == 0);
  }
}

static void* error_in_thread(void* p) {
  size_t n;
  (void)p;
  tandem_tokenize(g_model, "\xff", 1, 0, NULL, 0, &n);
  return NULL;
}

static void test_last_error_is_per_thread(void) {
  pthread_t th;
  tandem_session* s = NULL;
  tandem_session_params sp;
  tandem_session_params_init(&sp, sizeof sp);
  sp.n_batch = -5;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &s), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("n_batch -5");
  CHECK(pthread_create(&th, NULL, error_in_thread, NULL) == 0);
  CHECK(pthread_join(th, NULL) == 0);
  CHECK_MSG_CONTAINS("n_batch -5"); /* the other thread's UTF-8 error did not replace it */
  /* Success does not clear it. */
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  CHECK_MSG_CONTAINS("n_batch -5");
}

/* ---- session save / restore ------------------------------------------------------------------ */

static char g_tmpdir[256];

static void sleep_us(long us) {
  struct timespec ts;
  ts.tv_sec = us / 1000000;
  ts.tv_nsec = (us % 1000000) * 1000;
  nanosleep(&ts, NULL);
}

static void tmp_path(char* out, size_t cap, const char* name) {
  snprintf(out, cap, "%s/%s", g_tmpdir, name);
}

static long file_size(const char* path) {
  FILE* f = fopen(path, "rb");
  long n;
  if (f == NULL) return -1;
  fseek(f, 0, SEEK_END);
  n = ftell(f);
  fclose(f);
  return n;
}

/* Copy the first `keep` bytes of src to dst; flip byte `flip` (if >= 0). */
static int copy_file(const char* src, const char* dst, long keep, long flip) {
  FILE* in = fopen(src, "rb");
  FILE* out;
  long i;
  int c;
  if (in == NULL) return 0;
  out = fopen(dst, "wb");
  if (out == NULL) {
    fclose(in);
    return 0;
  }
  for (i = 0; (keep < 0 || i < keep) && (c = fgetc(in)) != EOF; ++i) fputc(i == flip ? (c ^ 0x5A) : c, out);
  fclose(in);
  fclose(out);
  return 1;
}

/* Greedy continuation of n tokens from the session's state. */
static void continue_greedy(tandem_session* s, int32_t* ids, size_t n) {
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, (int32_t)n);
  tandem_generate_result r;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens = ids;
  r.tokens_cap = n;
  CHECK_OK(tandem_session_generate_tokens(s, NULL, 0, &gp, NULL, NULL, &r));
  CHECK(r.n_tokens == n);
}

static void test_session_save_restore(const golden_case* g) {
  char path[512], bad[512], missing[512];
  tandem_session* s = new_session(128);
  tandem_session* s2 = NULL;
  tandem_session* small = new_session(16);
  tandem_session* other = NULL;
  tandem_model* f32 = NULL;
  tandem_session_params sp;
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 20);
  int32_t a[10], b[10], c[10], before[256], after[256];
  size_t n_before = 0, n_after = 0, n_saved = 0;
  long size;
  char f32_path[8192];
  char* q4;

  tmp_path(path, sizeof path, "s.tss");
  tmp_path(bad, sizeof bad, "bad.tss");
  tmp_path(missing, sizeof missing, "no/such/dir/s.tss");

  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, NULL));
  CHECK_OK(tandem_session_save(s, path));
  CHECK_OK(tandem_session_get_tokens(s, NULL, 0, &n_saved));
  size = file_size(path);
  CHECK(size > 64);
  continue_greedy(s, a, 10);

  /* Round trip into a fresh session with other executor settings: same continuation. */
  REQUIRE_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.n_ctx = 128;
  sp.n_threads = 2;
  sp.n_batch = 7;
  REQUIRE_OK(tandem_session_create(g_model, &sp, &s2));
  CHECK_OK(tandem_session_restore(s2, path));
  CHECK_OK(tandem_session_get_tokens(s2, before, 256, &n_before));
  CHECK(n_before == n_saved);
  continue_greedy(s2, b, 10);
  CHECK(memcmp(a, b, sizeof a) == 0);
  /* Restoring into the session it came from rewinds it. */
  CHECK_OK(tandem_session_restore(s, path));
  continue_greedy(s, c, 10);
  CHECK(memcmp(a, c, sizeof a) == 0);

  /* NULL / empty / freed / wrong kind. */
  CHECK_STATUS(tandem_session_save(NULL, path), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_save(s, NULL), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("path");
  CHECK_STATUS(tandem_session_save(s, ""), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_restore(NULL, path), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_restore(s, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_restore(s, ""), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_session_save((const tandem_session*)g_model, path), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_save(s, missing), TANDEM_E_IO);
  /* A device node is refused and stays a device (a save never replaces a non-regular file). */
  CHECK_STATUS(tandem_session_save(s, "/dev/full"), TANDEM_E_INVALID_ARG);

  /* Every failed restore leaves s2 exactly as it was: the rewound state continues the same. */
  CHECK_OK(tandem_session_restore(s2, path));
  CHECK_OK(tandem_session_get_tokens(s2, before, 256, &n_before));
  CHECK_STATUS(tandem_session_restore(s2, missing), TANDEM_E_IO);
  /* truncated: half, a header only, empty */
  CHECK(copy_file(path, bad, size / 2, -1));
  CHECK_STATUS(tandem_session_restore(s2, bad), TANDEM_E_SESSION_CORRUPT);
  CHECK(copy_file(path, bad, 12, -1));
  CHECK_STATUS(tandem_session_restore(s2, bad), TANDEM_E_SESSION_CORRUPT);
  CHECK(copy_file(path, bad, 0, -1));
  CHECK_STATUS(tandem_session_restore(s2, bad), TANDEM_E_SESSION_CORRUPT);
  /* one flipped byte in the middle, in the last byte (the checksum) */
  CHECK(copy_file(path, bad, -1, size / 2));
  CHECK_STATUS(tandem_session_restore(s2, bad), TANDEM_E_SESSION_CORRUPT);
  CHECK(copy_file(path, bad, -1, size - 1));
  CHECK_STATUS(tandem_session_restore(s2, bad), TANDEM_E_SESSION_CORRUPT);
  /* a foreign file: the GGUF model */
  CHECK_STATUS(tandem_session_restore(s2, g_model_path), TANDEM_E_SESSION_CORRUPT);
  CHECK(tandem_last_error()[0] != '\0');
  /* more positions than the session holds */
  CHECK_STATUS(tandem_session_restore(small, path), TANDEM_E_CONTEXT_OVERFLOW);
  /* saved with other weights: the same model in f32 */
  snprintf(f32_path, sizeof f32_path, "%s", g_model_path);
  q4 = strstr(f32_path, "q4_0.gguf");
  if (q4 != NULL) memcpy(q4, "f32.gguf", sizeof "f32.gguf");
  if (q4 != NULL && tandem_model_load(f32_path, NULL, &f32) == TANDEM_OK) {
    REQUIRE_OK(tandem_session_create(f32, &sp, &other));
    CHECK_STATUS(tandem_session_restore(other, path), TANDEM_E_SESSION_MODEL_MISMATCH);
    CHECK_OK(tandem_session_free(other));
    CHECK_OK(tandem_model_free(f32));
  } else {
    printf("  (aidreams260K-f32.gguf not found: model-mismatch case skipped)\n");
  }
  CHECK_OK(tandem_session_get_tokens(s2, after, 256, &n_after));
  CHECK(n_after == n_before && memcmp(before, after, n_before * sizeof(int32_t)) == 0);
  continue_greedy(s2, b, 10);
  CHECK(memcmp(a, b, sizeof a) == 0);

  CHECK_OK(tandem_session_free(s2));
  CHECK_STATUS(tandem_session_restore(s2, path), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_save(s2, path), TANDEM_E_INVALID_HANDLE);
  CHECK_OK(tandem_session_free(small));
  CHECK_OK(tandem_session_free(s));
  remove(path);
  remove(bad);
}

/* ---- scheduler ---------------------------------------------------------------------------------- */

static tandem_scheduler* new_scheduler(size_t n_exec, int32_t max_running, int32_t max_queued) {
  tandem_executor_params ep[2];
  tandem_scheduler_params sp;
  tandem_scheduler* sched = NULL;
  size_t i;
  for (i = 0; i < 2; ++i) {
    REQUIRE_OK(tandem_executor_params_init(&ep[i], sizeof ep[i]));
    ep[i].n_threads = 1;
    ep[i].max_running = max_running;
  }
  ep[0].accelerator = 1; /* "cpu+cpu": pool 0 is the primary */
  REQUIRE_OK(tandem_scheduler_params_init(&sp, sizeof sp));
  sp.executors = ep;
  sp.n_executors = n_exec;
  sp.max_context = 256;
  sp.max_queued = max_queued;
  REQUIRE_OK(tandem_scheduler_create(g_model, &sp, &sched));
  return sched;
}

static tandem_request_params greedy_request(tandem_sampling_params* smp, int32_t max_tokens) {
  tandem_request_params rp;
  REQUIRE_OK(tandem_sampling_params_init(smp, sizeof *smp));
  smp->temperature = 0.0f;
  REQUIRE_OK(tandem_request_params_init(&rp, sizeof rp));
  rp.sampling = smp;
  rp.max_tokens = max_tokens;
  rp.flags = TANDEM_GENERATE_IGNORE_EOS;
  return rp;
}

static int32_t finish_of(tandem_request* r) {
  tandem_request_result res;
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK_OK(tandem_request_wait(r, -1, &res));
  CHECK(res.finished != 0);
  return res.finish_reason;
}

static void test_scheduler_golden(const golden_case* g) {
  tandem_scheduler* sched = new_scheduler(2, 8, 1024);
  tandem_sampling_params smp;
  tandem_request_params rp = greedy_request(&smp, 64);
  tandem_request* r1 = NULL;
  tandem_request* r2 = NULL;
  tandem_request_result res;
  int32_t ids[128], ids2[128];
  char text[4096], text2[4096], streamed[4096], piece[256];
  tandem_request_event ev;
  size_t streamed_len = 0, n = 0;
  int tokens = 0, finals = 0, spins = 0;
  char* json;

  /* Two requests at once: a text prompt and the same prompt as ids. */
  rp.prompt = g->prompt_text;
  rp.sla = TANDEM_SLA_INTERACTIVE;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r1));
  rp.prompt = NULL;
  rp.prompt_tokens = g->prompt_ids;
  rp.n_prompt_tokens = g->n_prompt;
  rp.sla = TANDEM_SLA_BATCH;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r2));

  /* Stream r1 by polling (small buffer first: the event is kept). */
  CHECK_OK(tandem_request_event_init(&ev, sizeof ev));
  CHECK(ev.kind == TANDEM_EVENT_NONE && ev.token == -1 && ev.finish_reason == -1 && ev.text == NULL);
  while (finals == 0 && spins < 10000000) {
    tandem_status st;
    ev.text = piece;
    ev.text_cap = 1;
    st = tandem_request_poll(r1, &ev);
    if (st == TANDEM_E_BUFFER_TOO_SMALL) {
      CHECK(ev.text_len > 0);
      ev.text_cap = sizeof piece;
      st = tandem_request_poll(r1, &ev);
    }
    CHECK_OK(st);
    if (st != TANDEM_OK) break;
    if (ev.kind == TANDEM_EVENT_NONE) {
      ++spins;
      sleep_us(50);
      continue;
    }
    CHECK(strlen(piece) == ev.text_len);
    if (streamed_len + ev.text_len < sizeof streamed) {
      memcpy(streamed + streamed_len, piece, ev.text_len + 1);
      streamed_len += ev.text_len;
    }
    if (ev.kind == TANDEM_EVENT_TOKEN) {
      CHECK(ev.token >= 0 && ev.token < g_n_vocab && ev.finish_reason == -1);
      ++tokens;
    } else {
      CHECK(ev.kind == TANDEM_EVENT_FINISH && ev.token == -1);
      CHECK(ev.finish_reason == TANDEM_FINISH_LENGTH);
      ++finals;
    }
  }
  CHECK(finals == 1);
  CHECK(tokens == 64);
  /* FINISH delivered: the result is there without a wait. */
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK_OK(tandem_request_get_result(r1, &res));
  CHECK(res.finished == 1 && res.n_tokens == 64 && res.finish_reason == TANDEM_FINISH_LENGTH);
  /* After the finish: FINISH again, no text. */
  ev.text = piece;
  ev.text_cap = sizeof piece;
  CHECK_OK(tandem_request_poll(r1, &ev));
  CHECK(ev.kind == TANDEM_EVENT_FINISH && ev.finish_reason == TANDEM_FINISH_LENGTH && ev.text_len == 0 &&
        piece[0] == '\0');
  ev.text = NULL;
  ev.text_cap = 0;
  CHECK_OK(tandem_request_poll(r1, &ev));
  CHECK(ev.kind == TANDEM_EVENT_FINISH);

  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK(res.finish_reason == -1);
  res.tokens = ids;
  res.tokens_cap = 128;
  res.text = text;
  res.text_cap = sizeof text;
  CHECK_OK(tandem_request_wait(r1, -1, &res));
  CHECK(res.finished && res.finish_reason == TANDEM_FINISH_LENGTH && res.status == TANDEM_OK);
  CHECK(res.n_tokens == 64 && res.text_len == strlen(text) && res.id >= 1);
  CHECK(res.n_prompt == (int32_t)g->n_prompt);
  CHECK(res.message != NULL && res.e2e_seconds >= res.ttft_seconds && res.ttft_seconds > 0.0);
  CHECK(strcmp(streamed, text) == 0);
  check_against_golden(g, ids, res.n_tokens, text, "scheduler, text prompt");

  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  res.tokens = ids2;
  res.tokens_cap = 128;
  res.text = text2;
  res.text_cap = sizeof text2;
  CHECK_OK(tandem_request_wait(r2, 60000, &res));
  CHECK(res.finished && res.n_tokens == 64);
  CHECK(memcmp(ids, ids2, 64 * sizeof(int32_t)) == 0 && strcmp(text, text2) == 0);
  check_against_golden(g, ids2, res.n_tokens, text2, "scheduler, token prompt");
  /* Small buffers: as much as fits, full sizes reported. */
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  res.tokens = ids2;
  res.tokens_cap = 3;
  res.text = text2;
  res.text_cap = 6;
  ids2[3] = -77;
  CHECK_OK(tandem_request_get_result(r2, &res));
  CHECK(res.n_tokens == 64 && ids2[3] == -77 && strlen(text2) <= 5 && res.text_len == strlen(text));

  /* Cancel after finish: OK, nothing changes. */
  CHECK_OK(tandem_request_cancel(r1));
  CHECK(finish_of(r1) == TANDEM_FINISH_LENGTH);

  /* Metrics JSON: size query, too small, then the text. */
  CHECK_OK(tandem_scheduler_metrics_json(sched, NULL, 0, &n));
  CHECK(n > 10);
  CHECK_STATUS(tandem_scheduler_metrics_json(sched, text, 4, &n), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK_STATUS(tandem_scheduler_metrics_json(sched, NULL, 4, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_metrics_json(sched, text, 4, NULL), TANDEM_E_INVALID_ARG);
  json = (char*)malloc(n + 1024);
  CHECK_OK(tandem_scheduler_metrics_json(sched, json, n + 1024, &n));
  CHECK(json[0] == '{' && strlen(json) == n);
  CHECK(strstr(json, "\"submitted\"") != NULL && strstr(json, "cpu1") != NULL);
  free(json);

  CHECK_OK(tandem_request_free(r1));
  CHECK_STATUS(tandem_request_free(r1), TANDEM_E_INVALID_HANDLE); /* double free */
  CHECK_MSG_CONTAINS("double free");
  CHECK_STATUS(tandem_request_poll(r1, &ev), TANDEM_E_INVALID_HANDLE); /* poll after free */
  CHECK_STATUS(tandem_request_wait(r1, 0, &res), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_request_get_result(r1, &res), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_request_cancel(r1), TANDEM_E_INVALID_HANDLE);
  CHECK_OK(tandem_request_free(r2));
  CHECK_OK(tandem_request_free(NULL));

  CHECK_OK(tandem_scheduler_drain(sched));
  /* Draining: later submissions are refused with OVERLOADED. */
  rp.prompt_tokens = NULL;
  rp.n_prompt_tokens = 0;
  rp.prompt = "Once";
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r1));
  CHECK(finish_of(r1) == TANDEM_FINISH_OVERLOADED);
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK_OK(tandem_request_get_result(r1, &res));
  CHECK(res.message != NULL && strlen(res.message) > 0 && res.n_tokens == 0);
  CHECK_OK(tandem_request_free(r1));
  CHECK_OK(tandem_scheduler_shutdown(sched));
  CHECK_OK(tandem_scheduler_shutdown(sched)); /* idempotent */
  r1 = (tandem_request*)&g_checks;
  CHECK_STATUS(tandem_scheduler_submit(sched, &rp, &r1), TANDEM_E_INVALID_ARG); /* after shutdown */
  CHECK(r1 == NULL);
  CHECK_OK(tandem_scheduler_free(sched));
  CHECK_STATUS(tandem_scheduler_free(sched), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_drain(sched), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_shutdown(sched), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_metrics_json(sched, NULL, 0, &n), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_submit(sched, &rp, &r1), TANDEM_E_INVALID_HANDLE);
}

/* n choices (tandem_scheduler_submit_n): greedy choices are the golden tokens; seeded
 * sampled choice i is the single request seeded seed + i; refusals. */
static void test_scheduler_choices(const golden_case* g) {
  tandem_scheduler* sched = new_scheduler(1, 4, 1024);
  tandem_sampling_params smp;
  tandem_request_params rp = greedy_request(&smp, (int32_t)g->n_greedy);
  tandem_request* r[3] = {NULL, NULL, NULL};
  tandem_request* one = NULL;
  tandem_request_result res;
  int32_t ids[3][64], ref[64];
  size_t i, k;

  rp.prompt_tokens = g->prompt_ids;
  rp.n_prompt_tokens = g->n_prompt;
  REQUIRE_OK(tandem_scheduler_submit_n(sched, &rp, 3, r));
  for (i = 0; i < 3; ++i) {
    CHECK_OK(tandem_request_result_init(&res, sizeof res));
    res.tokens = ids[i];
    res.tokens_cap = 64;
    CHECK_OK(tandem_request_wait(r[i], -1, &res));
    CHECK(res.finished && res.n_tokens == g->n_greedy);
    CHECK(memcmp(ids[i], g->greedy_ids, g->n_greedy * sizeof(int32_t)) == 0);
    CHECK_OK(tandem_request_free(r[i]));
  }

  smp.temperature = 1.0f;
  smp.top_k = 0;
  smp.top_p = 1.0f;
  smp.min_p = 0.0f;
  smp.seed = 42;
  REQUIRE_OK(tandem_scheduler_submit_n(sched, &rp, 3, r));
  for (i = 0; i < 3; ++i) {
    CHECK_OK(tandem_request_result_init(&res, sizeof res));
    res.tokens = ids[i];
    res.tokens_cap = 64;
    CHECK_OK(tandem_request_wait(r[i], -1, &res));
    CHECK_OK(tandem_request_free(r[i]));
    smp.seed = 42 + i;
    REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &one));
    CHECK_OK(tandem_request_result_init(&res, sizeof res));
    res.tokens = ref;
    res.tokens_cap = 64;
    CHECK_OK(tandem_request_wait(one, -1, &res));
    CHECK(memcmp(ids[i], ref, g->n_greedy * sizeof(int32_t)) == 0);
    CHECK_OK(tandem_request_free(one));
    smp.seed = 42;
  }
  for (k = 1; k < 3; ++k) CHECK(memcmp(ids[0], ids[k], g->n_greedy * sizeof(int32_t)) != 0);

  CHECK_STATUS(tandem_scheduler_submit_n(sched, &rp, 0, r), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_submit_n(sched, NULL, 2, r), TANDEM_E_INVALID_ARG);
  CHECK(r[0] == NULL && r[1] == NULL);
  CHECK_STATUS(tandem_scheduler_submit_n(sched, &rp, 129, r), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_submit_n(sched, &rp, 2, NULL), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_scheduler_free(sched));
}

/* Cancel, deadline, overload, errors finishing a request, and freeing the scheduler with
 * requests outstanding. One executor with one decode slot: requests queue behind a long
 * one, so the queued ones are certainly still waiting when they are cancelled. */
static void test_scheduler_lifecycle(const golden_case* g) {
  tandem_scheduler* sched = new_scheduler(1, 1, 1024);
  tandem_sampling_params smp;
  tandem_request_params rp = greedy_request(&smp, 240);
  tandem_request* r[8];
  tandem_request* late = NULL;
  tandem_request* timed = NULL;
  tandem_request* err = NULL;
  tandem_request_result res;
  tandem_request_event ev;
  int32_t long_prompt[300];
  size_t i;
  int f;

  rp.prompt_tokens = g->prompt_ids;
  rp.n_prompt_tokens = g->n_prompt;
  for (i = 0; i < 8; ++i) REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r[i]));
  rp.deadline_ms = 1;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &timed));
  rp.deadline_ms = 0;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &late));
  CHECK_OK(tandem_request_cancel(late));
  CHECK(finish_of(late) == TANDEM_FINISH_CANCELLED);
  CHECK(finish_of(timed) == TANDEM_FINISH_TIMEOUT);
  CHECK_OK(tandem_request_cancel(late)); /* again, after the finish */
  CHECK(finish_of(late) == TANDEM_FINISH_CANCELLED);
  /* its poll: the FINISH event (no tokens were generated) */
  CHECK_OK(tandem_request_event_init(&ev, sizeof ev));
  CHECK_OK(tandem_request_poll(late, &ev));
  CHECK(ev.kind == TANDEM_EVENT_FINISH && ev.finish_reason == TANDEM_FINISH_CANCELLED);
  CHECK_OK(tandem_request_free(late));
  CHECK_OK(tandem_request_free(timed));

  /* A prompt longer than max_context (256): returned, finished with ERROR. */
  for (i = 0; i < 300; ++i) long_prompt[i] = (int32_t)(3 + i % 200);
  rp.prompt_tokens = long_prompt;
  rp.n_prompt_tokens = 300;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &err));
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK_OK(tandem_request_wait(err, -1, &res));
  CHECK(res.finished && res.finish_reason == TANDEM_FINISH_ERROR && res.status != TANDEM_OK);
  CHECK(res.message != NULL && strlen(res.message) > 0);
  printf("  too-long prompt: %s: %s\n", tandem_status_name(res.status), res.message);
  CHECK_OK(tandem_request_free(err));

  /* wait with a timeout that passes: finished = 0 (the last queued request). */
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK_OK(tandem_request_wait(r[7], 1, &res));
  CHECK(res.finished == 0 && res.finish_reason == -1 && res.id >= 1);
  CHECK_OK(tandem_request_wait(r[7], 0, NULL));

  /* Freeing a request that has not finished cancels it (r[6]); freeing the scheduler
   * with requests outstanding cancels them; their handles stay valid and terminal. */
  CHECK_OK(tandem_request_free(r[6]));
  CHECK_OK(tandem_scheduler_free(sched));
  for (i = 0; i < 8; ++i) {
    if (i == 6) continue;
    f = finish_of(r[i]);
    if (f != TANDEM_FINISH_CANCELLED && f != TANDEM_FINISH_LENGTH) {
      CHECK_OK(tandem_request_get_result(r[i], &res));
      printf("  request %zu: finish %d status %d %s\n", i, f, res.status, res.message);
    }
    CHECK(f == TANDEM_FINISH_CANCELLED || f == TANDEM_FINISH_LENGTH);
    if (i == 7) CHECK(f == TANDEM_FINISH_CANCELLED);
    /* poll drains the buffered events, then FINISH */
    do {
      CHECK_OK(tandem_request_poll(r[i], &ev));
    } while (ev.kind == TANDEM_EVENT_TOKEN);
    CHECK(ev.kind == TANDEM_EVENT_FINISH && ev.finish_reason == f);
    CHECK_OK(tandem_request_cancel(r[i])); /* cancel after the scheduler is gone */
    CHECK_OK(tandem_request_free(r[i]));
  }

  /* max_queued 0: everything is refused as overloaded. */
  sched = new_scheduler(1, 1, 0);
  rp.prompt_tokens = g->prompt_ids;
  rp.n_prompt_tokens = g->n_prompt;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &late));
  CHECK(finish_of(late) == TANDEM_FINISH_OVERLOADED);
  CHECK_OK(tandem_request_free(late));
  CHECK_OK(tandem_scheduler_free(sched));
}

static void test_scheduler_errors(void) {
  tandem_scheduler* sched = new_scheduler(2, 4, 16);
  tandem_scheduler* out = NULL;
  tandem_session* s = new_session(32);
  tandem_scheduler_params sp;
  tandem_executor_params ep[2];
  unsigned char big[256];
  tandem_sampling_params smp;
  tandem_request_params rp = greedy_request(&smp, 4);
  tandem_request* r = NULL;
  tandem_request_event ev;
  tandem_request_result res;
  int32_t bad_ids[2] = {1, 1 << 30};
  const char* stops_empty[1] = {""};
  const char* stops_bad[1] = {"\xff"};
  const char* stops_null[1] = {NULL};
  size_t n;
  int local = 0;

#define CHECK_CREATE_FAILS(params, want)                                    \
  do {                                                                      \
    out = (tandem_scheduler*)&local;                                        \
    CHECK_STATUS(tandem_scheduler_create(g_model, (params), &out), (want)); \
    CHECK(out == NULL);                                                     \
  } while (0)

  /* create: NULLs, handles, params. */
  CHECK_STATUS(tandem_scheduler_create(NULL, NULL, &out), TANDEM_E_INVALID_ARG);
  CHECK(out == NULL);
  CHECK_STATUS(tandem_scheduler_create(g_model, NULL, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_create((const tandem_model*)s, NULL, &out), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_create((const tandem_model*)&local, NULL, &out), TANDEM_E_INVALID_HANDLE);
  REQUIRE_OK(tandem_scheduler_params_init(&sp, sizeof sp));
  sp.n_executors = 0;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("n_executors");
  sp.n_executors = 65;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  sp.n_executors = 1;
  sp.page_size = 0;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  sp.page_size = 16;
  sp.max_queued = -1;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  sp.max_queued = 16;
  sp.struct_size = 4;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("struct_size");
  memset(big, 0, sizeof big);
  CHECK_OK(tandem_scheduler_params_init((tandem_scheduler_params*)big, sizeof big));
  big[sizeof(tandem_scheduler_params) + 3] = 1; /* a field of a newer version */
  CHECK_CREATE_FAILS((tandem_scheduler_params*)big, TANDEM_E_INVALID_ARG);
  REQUIRE_OK(tandem_scheduler_params_init(&sp, sizeof sp));
  REQUIRE_OK(tandem_executor_params_init(&ep[0], sizeof ep[0]));
  REQUIRE_OK(tandem_executor_params_init(&ep[1], sizeof ep[1]));
  sp.executors = ep;
  sp.n_executors = 2;
  ep[1].n_threads = -1;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("executors[1]");
  ep[1].n_threads = 1;
  ep[1].max_running = 0;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  ep[1].max_running = 4;
  ep[1].accelerator = 2;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  ep[1].accelerator = -1;
  ep[1].struct_size = sizeof ep[1] - 1; /* elements of different sizes */
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  ep[1].struct_size = sizeof ep[1];
  ep[0].struct_size = 0;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_INVALID_ARG);
  ep[0].struct_size = sizeof ep[0];
  ep[0].kv_pages = 2000000000; /* far beyond physical memory */
  ep[1].kv_pages = 2000000000;
  CHECK_CREATE_FAILS(&sp, TANDEM_E_OUT_OF_MEMORY);

  /* submit: NULLs, handles. */
  rp.prompt = "Once upon a time";
  r = (tandem_request*)&local;
  CHECK_STATUS(tandem_scheduler_submit(NULL, &rp, &r), TANDEM_E_INVALID_ARG);
  CHECK(r == NULL);
  CHECK_STATUS(tandem_scheduler_submit(sched, NULL, &r), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_submit(sched, &rp, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_submit((tandem_scheduler*)s, &rp, &r), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_submit((tandem_scheduler*)&local, &rp, &r), TANDEM_E_INVALID_HANDLE);
  CHECK(r == NULL);
  /* submit: bad request params, each refused with INVALID_ARG and no request. */
#define CHECK_SUBMIT_FAILS(what)                                                 \
  do {                                                                           \
    r = (tandem_request*)&local;                                                 \
    CHECK_STATUS(tandem_scheduler_submit(sched, &rp, &r), TANDEM_E_INVALID_ARG); \
    CHECK(r == NULL);                                                            \
    CHECK_MSG_CONTAINS(what);                                                    \
  } while (0)
  rp.struct_size = 8;
  CHECK_SUBMIT_FAILS("struct_size");
  rp.struct_size = sizeof rp;
  rp.prompt = "caf\xc3";
  CHECK_SUBMIT_FAILS("UTF-8");
  rp.prompt = "\xed\xa0\x80"; /* a surrogate */
  CHECK_SUBMIT_FAILS("UTF-8");
  rp.prompt = NULL;
  CHECK_SUBMIT_FAILS("prompt");
  rp.n_prompt_tokens = 2;
  CHECK_SUBMIT_FAILS("n_prompt_tokens");
  rp.prompt_tokens = bad_ids;
  CHECK_SUBMIT_FAILS("vocabulary");
  rp.n_prompt_tokens = 0;
  CHECK_SUBMIT_FAILS("n_prompt_tokens");
  rp.prompt_tokens = NULL;
  rp.prompt = "Once";
  rp.sla = 3;
  CHECK_SUBMIT_FAILS("sla");
  rp.sla = -1;
  CHECK_SUBMIT_FAILS("sla");
  rp.sla = TANDEM_SLA_STANDARD;
  rp.max_tokens = 0;
  CHECK_SUBMIT_FAILS("max_tokens");
  rp.max_tokens = 4;
  rp.deadline_ms = -5;
  CHECK_SUBMIT_FAILS("deadline_ms");
  rp.deadline_ms = 0;
  rp.flags = 0x80;
  CHECK_SUBMIT_FAILS("flag");
  rp.flags = 0;
  rp.stop = stops_empty;
  rp.n_stop = 1;
  CHECK_SUBMIT_FAILS("empty");
  rp.stop = stops_bad;
  CHECK_SUBMIT_FAILS("UTF-8");
  rp.stop = stops_null;
  CHECK_SUBMIT_FAILS("stop[0]");
  rp.stop = NULL;
  CHECK_SUBMIT_FAILS("stop");
  rp.n_stop = 0;
  smp.temperature = -1.0f;
  CHECK_SUBMIT_FAILS("temperature");
  smp.temperature = 0.0f;

  /* A good request; then the request functions' errors. */
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
  CHECK_OK(tandem_request_event_init(&ev, sizeof ev));
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK_STATUS(tandem_request_poll(NULL, &ev), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_request_poll(r, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_request_poll((tandem_request*)sched, &ev), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_request_poll((tandem_request*)&local, &ev), TANDEM_E_INVALID_HANDLE);
  ev.struct_size = 4;
  CHECK_STATUS(tandem_request_poll(r, &ev), TANDEM_E_INVALID_ARG);
  ev.struct_size = sizeof ev;
  ev.text_cap = 8; /* text NULL with a capacity */
  CHECK_STATUS(tandem_request_poll(r, &ev), TANDEM_E_INVALID_ARG);
  ev.text_cap = 0;
  CHECK_STATUS(tandem_request_wait(NULL, 0, &res), TANDEM_E_INVALID_ARG);
  res.struct_size = 0;
  CHECK_STATUS(tandem_request_wait(r, 0, &res), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_request_get_result(r, &res), TANDEM_E_INVALID_ARG);
  res.struct_size = sizeof res;
  res.tokens_cap = 4; /* tokens NULL with a capacity */
  CHECK_STATUS(tandem_request_get_result(r, &res), TANDEM_E_INVALID_ARG);
  res.tokens_cap = 0;
  res.text_cap = 4;
  CHECK_STATUS(tandem_request_wait(r, -1, &res), TANDEM_E_INVALID_ARG);
  res.text_cap = 0;
  CHECK_STATUS(tandem_request_get_result(NULL, &res), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_request_get_result(r, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_request_cancel(NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_request_cancel((tandem_request*)s), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_request_free((tandem_request*)sched), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_request_free((tandem_request*)&local), TANDEM_E_INVALID_HANDLE);
  CHECK_OK(tandem_request_wait(r, -1, &res));
  CHECK(res.finished);
  CHECK_OK(tandem_request_free(r));

  /* scheduler functions: NULL and wrong kinds. */
  CHECK_STATUS(tandem_scheduler_drain(NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_shutdown(NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_metrics_json(NULL, NULL, 0, &n), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_drain((tandem_scheduler*)s), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_free((tandem_scheduler*)s), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_scheduler_free((tandem_scheduler*)&local), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_free((tandem_session*)sched), TANDEM_E_INVALID_HANDLE);
  CHECK_OK(tandem_scheduler_free(NULL));
  CHECK_OK(tandem_scheduler_free(sched));
  CHECK_OK(tandem_session_free(s));
#undef CHECK_CREATE_FAILS
#undef CHECK_SUBMIT_FAILS
}

/* ---- later entry points: version number, log, devices, executors, metadata, chat,
 * abort, scheduler sessions, blocking waits ------------------------------------------- */

typedef struct log_sink {
  pthread_mutex_t mu;
  int lines[4];
  int bad_lines; /* NULL, empty or newline-terminated messages */
  char last_debug[512];
} log_sink;

static void log_cb(int32_t level, const char* message, void* user_data) {
  log_sink* s = (log_sink*)user_data;
  pthread_mutex_lock(&s->mu);
  if (level >= TANDEM_LOG_DEBUG && level <= TANDEM_LOG_ERROR) s->lines[level]++;
  if (message == NULL || message[0] == '\0' || message[strlen(message) - 1] == '\n') s->bad_lines++;
  if (message != NULL && level == TANDEM_LOG_DEBUG) snprintf(s->last_debug, sizeof s->last_debug, "%s", message);
  pthread_mutex_unlock(&s->mu);
}

static void test_version_number(void) {
  const int32_t v = tandem_version_number();
  char text[32];
  CHECK(v == TANDEM_VERSION_NUMBER);
  snprintf(text, sizeof text, "%d.%d.%d", (int)(v / 10000), (int)(v / 100 % 100), (int)(v % 100));
  CHECK(strcmp(text, tandem_version()) == 0);
  CHECK(strcmp(tandem_status_name(TANDEM_E_UNSUPPORTED), "UNSUPPORTED") == 0);
}

static void test_devices_and_executors(void) {
  size_t n = 0, i;
  int n_cuda = 0;
  tandem_device_info di;
  tandem_executor_params ep;
  tandem_executor* e = NULL;
  tandem_executor* e2 = NULL;
  tandem_status st;

  CHECK_STATUS(tandem_device_count(NULL), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_device_count(&n));
  CHECK(n >= 1);
  CHECK_OK(tandem_device_info_init(&di, sizeof di));
  CHECK_OK(tandem_device_get_info(0, &di));
  CHECK(di.struct_size == sizeof di && di.kind == TANDEM_DEVICE_CPU && di.device_id == 0);
  CHECK(di.name != NULL && strcmp(di.name, "cpu") == 0);
  CHECK(di.isa != NULL && strlen(di.isa) > 0);
  CHECK(di.n_cores >= 1 && di.memory_bytes > 0 && di.compute_capability == 0);
  for (i = 1; i < n; ++i) {
    CHECK_OK(tandem_device_get_info(i, &di));
    CHECK(di.kind == TANDEM_DEVICE_CUDA && di.device_id == (int32_t)(i - 1) && di.compute_capability > 0);
    CHECK(di.memory_bytes > 0 && di.name != NULL && strncmp(di.isa, "sm_", 3) == 0);
    ++n_cuda;
  }
  printf("  devices: %zu (cpu + %d CUDA)\n", n, n_cuda);
  CHECK_STATUS(tandem_device_get_info(n, &di), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("out of range");
  CHECK_STATUS(tandem_device_get_info(0, NULL), TANDEM_E_INVALID_ARG);
  di.struct_size = 4;
  CHECK_STATUS(tandem_device_get_info(0, &di), TANDEM_E_INVALID_ARG);

  /* A CPU executor. */
  CHECK_OK(tandem_executor_params_init(&ep, sizeof ep));
  CHECK(ep.device_kind == TANDEM_DEVICE_CPU && ep.device_id == 0 && ep.kv_dtype == TANDEM_KV_F16);
  CHECK(ep.kv_file_pages == 0 && ep.kv_dir == NULL);
  ep.n_threads = 1;
  CHECK_OK(tandem_executor_create(g_model, &ep, &e));
  CHECK(e != NULL);
  CHECK_OK(tandem_device_info_init(&di, sizeof di));
  CHECK_OK(tandem_executor_get_device(e, &di));
  CHECK(di.kind == TANDEM_DEVICE_CPU && di.n_cores == 1);
  CHECK_OK(tandem_executor_free(e));
  CHECK_STATUS(tandem_executor_free(e), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_executor_get_device(e, &di), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_executor_get_device(NULL, &di), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_executor_free(NULL));
  /* A model handle is not an executor handle. */
  CHECK_STATUS(tandem_executor_get_device((const tandem_executor*)(void*)g_model, &di), TANDEM_E_INVALID_HANDLE);
  /* The 0.1 form of the struct (without the later fields) is still accepted. */
  ep.struct_size = offsetof(tandem_executor_params, device_kind);
  CHECK_OK(tandem_executor_create(g_model, &ep, &e2));
  CHECK_OK(tandem_executor_free(e2));
  ep.struct_size = sizeof ep;

  /* A GPU executor: UNSUPPORTED without CUDA; without a device, INVALID_ARG. */
  ep.device_kind = TANDEM_DEVICE_CUDA;
  ep.device_id = 99;
  e = (tandem_executor*)(void*)&ep;
  st = tandem_executor_create(g_model, &ep, &e);
  CHECK(e == NULL);
  CHECK(st == TANDEM_E_UNSUPPORTED || (n_cuda < 100 && st == TANDEM_E_INVALID_ARG));
  if (st == TANDEM_E_UNSUPPORTED) CHECK_MSG_CONTAINS("without CUDA");
  /* Bad descriptions. */
  ep.device_kind = 7;
  ep.device_id = 0;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &e), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("device_kind");
  ep.device_kind = TANDEM_DEVICE_CPU;
  ep.device_id = 1;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &e), TANDEM_E_INVALID_ARG);
  ep.device_id = 0;
  ep.kv_dtype = 5;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &e), TANDEM_E_INVALID_ARG);
  ep.kv_dtype = TANDEM_KV_F16;
  ep.kv_dtype = TANDEM_KV_Q8_0; /* q8_0 KV is CPU-only */
  ep.device_kind = TANDEM_DEVICE_CUDA;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &e), TANDEM_E_UNSUPPORTED);
  CHECK_MSG_CONTAINS("q8_0");
  ep.device_kind = TANDEM_DEVICE_CPU;
  ep.kv_dtype = TANDEM_KV_F16;
  ep.kv_file_pages = -1;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &e), TANDEM_E_INVALID_ARG);
  ep.kv_file_pages = 0;
  ep.n_threads = 513;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &e), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_executor_create(NULL, NULL, &e), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_executor_create(g_model, NULL, NULL), TANDEM_E_INVALID_ARG);
}

/* Copy `in` without spaces; 0 when it does not fit. */
static int strip_spaces(const char* in, char* out, size_t cap) {
  size_t n = 0;
  for (; *in; ++in) {
    if (*in == ' ') continue;
    if (n + 1 >= cap) return 0;
    out[n++] = *in;
  }
  out[n] = '\0';
  return 1;
}

static void test_metadata_and_chat(void) {
  size_t n = 0, len = 0, i, n_ids = 0;
  char buf[512], plain_text[512], want_text[512];
  char key0[256];
  int32_t ids[256];
  const char* roles[3] = {"system", "user", "assistant"};
  const char* contents[3] = {"Be brief.", "Hi <|im_end|>", "Hello."};
  const char* bad_role[1] = {"wizard"};
  const char* bad_utf8[1] = {"\xff"};
  const char* expect =
      "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi <|im_end|><|im_end|>\n"
      "<|im_start|>assistant\nHello.<|im_end|>\n<|im_start|>assistant\n";

  CHECK_OK(tandem_model_meta_count(g_model, &n));
  CHECK(n > 5);
  CHECK_OK(tandem_model_meta_key_by_index(g_model, 0, NULL, 0, &len));
  CHECK(len > 0 && len < sizeof key0);
  CHECK_OK(tandem_model_meta_key_by_index(g_model, 0, key0, sizeof key0, &len));
  CHECK(strlen(key0) == len);
  CHECK_STATUS(tandem_model_meta_key_by_index(g_model, 0, key0, len, &len), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK_STATUS(tandem_model_meta_key_by_index(g_model, n, key0, sizeof key0, &len), TANDEM_E_INVALID_ARG);
  /* Every key has a value. */
  for (i = 0; i < n; ++i) {
    CHECK_OK(tandem_model_meta_key_by_index(g_model, i, key0, sizeof key0, &len));
    CHECK_OK(tandem_model_meta_value(g_model, key0, NULL, 0, &len));
  }
  CHECK_OK(tandem_model_meta_value(g_model, "general.architecture", buf, sizeof buf, &len));
  CHECK(strcmp(buf, "llama") == 0 && len == 5);
  CHECK_OK(tandem_model_meta_value(g_model, "llama.block_count", buf, sizeof buf, &len));
  CHECK(atoi(buf) > 0);
  /* Arrays are summarised with their length: the vocabulary has n_vocab strings. */
  CHECK_OK(tandem_model_meta_value(g_model, "tokenizer.ggml.tokens", buf, sizeof buf, &len));
  CHECK(strcmp(buf, "[512 string]") == 0);
  CHECK_STATUS(tandem_model_meta_value(g_model, "no.such.key", buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("no.such.key");
  CHECK_STATUS(tandem_model_meta_value(g_model, NULL, buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_model_meta_count(NULL, &n), TANDEM_E_INVALID_ARG);

  /* Chat: the model has no template, so ChatML (the documented fallback); the user's
   * "<|im_end|>" stays text. */
  CHECK_OK(tandem_chat_render(g_model, NULL, roles, contents, 3, 1, NULL, 0, &len));
  CHECK(len == strlen(expect));
  CHECK_OK(tandem_chat_render(g_model, NULL, roles, contents, 3, 1, buf, sizeof buf, &len));
  CHECK(strcmp(buf, expect) == 0);
  CHECK_OK(tandem_chat_render(g_model, "chatml", roles, contents, 3, 1, buf, sizeof buf, &len));
  CHECK(strcmp(buf, expect) == 0);
  CHECK_STATUS(tandem_chat_render(g_model, NULL, roles, contents, 3, 1, buf, 10, &len), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK_STATUS(tandem_chat_render(g_model, "no-such-template", roles, contents, 3, 1, buf, sizeof buf, &len),
               TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_chat_render(g_model, NULL, bad_role, contents, 1, 1, buf, sizeof buf, &len),
               TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_chat_render(g_model, NULL, roles, bad_utf8, 1, 1, buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_chat_render(g_model, NULL, NULL, contents, 1, 1, buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_chat_render(g_model, NULL, NULL, NULL, 0, 1, buf, sizeof buf, &len));
  CHECK(strcmp(buf, "<|im_start|>assistant\n") == 0);
  /* Tokenize: this vocabulary has no ChatML control tokens, so the markers are plain
   * text and no id is a control token; the size query agrees with the ids. */
  CHECK_OK(tandem_chat_tokenize(g_model, NULL, roles, contents, 3, 1, NULL, 0, &n_ids));
  CHECK(n_ids > 10 && n_ids <= 256);
  CHECK_OK(tandem_chat_tokenize(g_model, NULL, roles, contents, 3, 1, ids, 256, &n_ids));
  CHECK(ids[0] == 1); /* BOS */
  /* The text of the ids is the rendered conversation; SentencePiece puts a space before
   * each piece tokenized on its own (its dummy prefix), so compare without spaces. */
  CHECK_OK(tandem_detokenize(g_model, ids, n_ids, TANDEM_DETOKENIZE_REMOVE_SPECIAL, buf, sizeof buf, &len));
  CHECK(strip_spaces(buf, plain_text, sizeof plain_text) && strip_spaces(expect, want_text, sizeof want_text));
  CHECK(strcmp(plain_text, want_text) == 0);
  /* The user's "<|im_end|>" is text: no id of the conversation is the BOS/EOS control
   * token except the leading BOS. */
  for (i = 1; i < n_ids; ++i) CHECK(ids[i] != 1 && ids[i] != 2);
  CHECK_STATUS(tandem_chat_tokenize(g_model, NULL, roles, contents, 3, 1, ids, 2, &n_ids), TANDEM_E_BUFFER_TOO_SMALL);
  CHECK_STATUS(tandem_chat_tokenize(g_model, NULL, bad_role, contents, 1, 1, ids, 256, &n_ids), TANDEM_E_INVALID_ARG);

  /* An OpenAI chat request (llama-server's /apply-template): the built-in ChatML here, as
   * the model has no template of its own; ids as tandem_chat_tokenize gives them. */
  {
    const char* request = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"max_tokens\": 4}";
    const char* no_prompt =
        "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], \"add_generation_prompt\": false}";
    const char* user_role[1] = {"user"};
    const char* hi[1] = {"hi"};
    int32_t ids2[64];
    size_t n2 = 0;
    CHECK_OK(tandem_chat_apply_template(g_model, request, buf, sizeof buf, &len));
    CHECK(strcmp(buf, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") == 0);
    CHECK_OK(tandem_chat_apply_template(g_model, no_prompt, buf, sizeof buf, &len));
    CHECK(strcmp(buf, "<|im_start|>user\nhi<|im_end|>\n") == 0);
    CHECK_OK(tandem_chat_apply_template_tokens(g_model, request, ids2, 64, &n2));
    CHECK_OK(tandem_chat_tokenize(g_model, NULL, user_role, hi, 1, 1, ids, 256, &n_ids));
    CHECK(n2 == n_ids && memcmp(ids, ids2, n2 * sizeof ids[0]) == 0);
    CHECK_STATUS(tandem_chat_apply_template(g_model, "{\"messages\": [", buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
    CHECK_MSG_CONTAINS("not JSON");
    CHECK_STATUS(tandem_chat_apply_template(g_model, "{}", buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
    CHECK_STATUS(tandem_chat_apply_template(g_model, NULL, buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
    /* Tool calls in generated text: the tiny model has no template, so the Hermes format. */
    CHECK_OK(tandem_chat_parse_tool_calls(g_model,
                                          "Sure.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": "
                                          "{\"city\": \"Paris\"}}\n</tool_call>",
                                          buf, sizeof buf, &len));
    CHECK(strcmp(buf,
                 "{\"content\":\"Sure.\",\"tool_calls\":[{\"name\":\"get_weather\",\"arguments\":"
                 "\"{\\\"city\\\":\\\"Paris\\\"}\"}]}") == 0);
    CHECK(len == strlen(buf));
    CHECK_OK(tandem_chat_parse_tool_calls(g_model, "<tool_call>{broken</tool_call>", buf, sizeof buf, &len));
    CHECK(strcmp(buf, "{\"content\":\"<tool_call>{broken</tool_call>\",\"tool_calls\":[]}") == 0);
    CHECK_OK(tandem_chat_parse_tool_calls(g_model, "", buf, sizeof buf, &len));
    CHECK(strcmp(buf, "{\"content\":null,\"tool_calls\":[]}") == 0);
    CHECK_STATUS(tandem_chat_parse_tool_calls(g_model, NULL, buf, sizeof buf, &len), TANDEM_E_INVALID_ARG);
    CHECK_STATUS(tandem_chat_parse_tool_calls(g_model, "x", buf, 2, &len), TANDEM_E_BUFFER_TOO_SMALL);
    /* tools need the model's own template */
    CHECK_STATUS(tandem_chat_apply_template(g_model,
                                            "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}], "
                                            "\"tools\": [{\"type\": \"function\", \"function\": {\"name\": \"f\"}}]}",
                                            buf, sizeof buf, &len),
                 TANDEM_E_INVALID_ARG);
    CHECK_STATUS(tandem_chat_apply_template(g_model, request, buf, 4, &len), TANDEM_E_BUFFER_TOO_SMALL);
  }

  /* tandem_model_params.chat_template replaces the model's template in every chat
   * function: Jinja source (with the vocabulary's BOS text), a built-in name; the tool-call
   * format follows it (<|python_tag|>: Llama 3's whole-message JSON, not Hermes'). A
   * template that does not parse fails the load; the version-0.1 struct_size loads the
   * model's own. */
  {
    const char* request = "{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}";
    const char* user_role[1] = {"user"};
    const char* hi[1] = {"hi"};
    tandem_model_params mp;
    tandem_model* m = NULL;
    int32_t ids2[64];
    size_t n2 = 0;
    CHECK_OK(tandem_model_params_init(&mp, sizeof mp));
    mp.chat_template =
        "<|python_tag|>{{ bos_token }}[{{ messages[0].content }}]{% if add_generation_prompt %}>{% endif %}";
    CHECK_OK(tandem_model_load(g_model_path, &mp, &m));
    CHECK_OK(tandem_chat_apply_template(m, request, buf, sizeof buf, &len));
    CHECK(strcmp(buf, "<|python_tag|><s>[hi]>") == 0);
    CHECK_OK(tandem_chat_render(m, NULL, user_role, hi, 1, 0, buf, sizeof buf, &len));
    CHECK(strcmp(buf, "<|python_tag|><s>[hi]") == 0);
    CHECK_OK(tandem_chat_render(m, "chatml", user_role, hi, 1, 0, buf, sizeof buf, &len)); /* a name still wins */
    CHECK(strcmp(buf, "<|im_start|>user\nhi<|im_end|>\n") == 0);
    CHECK_OK(tandem_chat_apply_template_tokens(m, request, ids2, 64, &n2));
    CHECK_OK(tandem_chat_tokenize(m, NULL, user_role, hi, 1, 1, ids, 256, &n_ids));
    CHECK(n2 == n_ids && memcmp(ids, ids2, n2 * sizeof ids[0]) == 0);
    CHECK_OK(tandem_chat_parse_tool_calls(m, "{\"name\": \"f\", \"parameters\": {\"x\": 1}}", buf, sizeof buf, &len));
    CHECK(strcmp(buf, "{\"content\":null,\"tool_calls\":[{\"name\":\"f\",\"arguments\":\"{\\\"x\\\":1}\"}]}") == 0);
    CHECK_OK(tandem_model_free(m));
    mp.chat_template = "gemma";
    CHECK_OK(tandem_model_load(g_model_path, &mp, &m));
    CHECK_OK(tandem_chat_apply_template(m, request, buf, sizeof buf, &len));
    CHECK(strcmp(buf, "<start_of_turn>user\nhi<end_of_turn>\n<start_of_turn>model\n") == 0);
    CHECK_OK(tandem_model_free(m));
    mp.chat_template = "ok\n{% if %}";
    CHECK_STATUS(tandem_model_load(g_model_path, &mp, &m), TANDEM_E_INVALID_ARG);
    CHECK(m == NULL);
    CHECK_MSG_CONTAINS("chat_template: jinja: line 2");
    mp.struct_size = offsetof(tandem_model_params, chat_template); /* version 0.1: no such field */
    CHECK_OK(tandem_model_load(g_model_path, &mp, &m));
    CHECK_OK(tandem_chat_apply_template(m, request, buf, sizeof buf, &len));
    CHECK(strcmp(buf, "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n") == 0);
    CHECK_OK(tandem_model_free(m));
  }
}

/* Abort from another thread: the token callback hands control to an aborting thread at
 * the 5th piece and waits until it has called tandem_session_abort, so the generation
 * must end right there (deterministic: the abort lands while the call is running). */
typedef struct abort_ctx {
  tandem_session* s;
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int pieces;
  int stop_at; /* the callback's piece number that triggers the abort */
  int asked;
  int aborted;
  int done;
  tandem_status abort_status;
} abort_ctx;

static void* aborter_thread(void* arg) {
  abort_ctx* a = (abort_ctx*)arg;
  pthread_mutex_lock(&a->mu);
  while (!a->asked) pthread_cond_wait(&a->cv, &a->mu);
  pthread_mutex_unlock(&a->mu);
  a->abort_status = tandem_session_abort(a->s);
  pthread_mutex_lock(&a->mu);
  a->aborted = 1;
  pthread_cond_broadcast(&a->cv);
  pthread_mutex_unlock(&a->mu);
  return NULL;
}

static int abort_at_cb(const char* piece, size_t len, int32_t token, void* user_data) {
  abort_ctx* a = (abort_ctx*)user_data;
  (void)piece;
  (void)len;
  (void)token;
  pthread_mutex_lock(&a->mu);
  if (++a->pieces == a->stop_at) {
    a->asked = 1;
    pthread_cond_broadcast(&a->cv);
    while (!a->aborted) pthread_cond_wait(&a->cv, &a->mu);
  }
  pthread_mutex_unlock(&a->mu);
  return 0;
}

typedef struct prefill_ctx {
  tandem_session* s;
  const int32_t* prompt;
  size_t n_prompt;
  volatile int done;
  tandem_status status;
  tandem_generate_result r;
} prefill_ctx;

static void* prefill_thread(void* arg) {
  prefill_ctx* p = (prefill_ctx*)arg;
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 8);
  tandem_generate_result_init(&p->r, sizeof p->r);
  p->status = tandem_session_generate_tokens(p->s, p->prompt, p->n_prompt, &gp, NULL, NULL, &p->r);
  __atomic_store_n(&p->done, 1, __ATOMIC_RELEASE);
  return NULL;
}

static void test_session_abort(const golden_case* g) {
  tandem_session_params sp;
  tandem_session* s = NULL;
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 200);
  tandem_generate_result r;
  abort_ctx a;
  pthread_t th;
  prefill_ctx p;
  int32_t ids[128], long_prompt[1000];
  char text[4096];
  size_t n = 0, i;
  int aborts = 0;

  /* No call running: nothing happens, a later call is not affected. */
  s = new_session(0);
  CHECK_OK(tandem_session_abort(s));
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens = ids;
  r.tokens_cap = 128;
  r.text = text;
  r.text_cap = sizeof text;
  gp.max_tokens = 64;
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, &r));
  CHECK(r.finish_reason == TANDEM_FINISH_LENGTH && r.n_tokens == 64);
  check_against_golden(g, ids, r.n_tokens, text, "after an idle abort");
  CHECK_OK(tandem_session_reset(s));

  /* During decode, from another thread. */
  memset(&a, 0, sizeof a);
  a.s = s;
  a.stop_at = 5;
  pthread_mutex_init(&a.mu, NULL);
  pthread_cond_init(&a.cv, NULL);
  pthread_create(&th, NULL, aborter_thread, &a);
  gp.max_tokens = 200;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, abort_at_cb, &a, &r));
  pthread_join(th, NULL);
  CHECK_OK(a.abort_status);
  CHECK(r.finish_reason == TANDEM_FINISH_CANCELLED);
  CHECK(a.pieces == 5);                      /* no piece after the abort */
  CHECK(r.n_tokens >= 5 && r.n_tokens <= 8); /* a piece may span a few tokens */
  printf("  abort during decode: ended after %zu of 200 tokens\n", r.n_tokens);
  /* The session is usable: it continues, and after a reset it reproduces the golden text. */
  gp.max_tokens = 3;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  CHECK_OK(tandem_session_generate(s, "", &gp, NULL, NULL, &r));
  CHECK(r.finish_reason == TANDEM_FINISH_LENGTH && r.n_tokens == 3);
  CHECK_OK(tandem_session_reset(s));
  gp.max_tokens = 64;
  CHECK_OK(tandem_generate_result_init(&r, sizeof r));
  r.tokens = ids;
  r.tokens_cap = 128;
  r.text = text;
  r.text_cap = sizeof text;
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, &r));
  check_against_golden(g, ids, r.n_tokens, text, "after an abort and a reset");
  CHECK_OK(tandem_session_free(s));
  pthread_mutex_destroy(&a.mu);
  pthread_cond_destroy(&a.cv);

  /* During prefill: a 1000-token prompt evaluated one token per step; another thread
   * aborts as soon as the call runs. The call ends in the prompt (fewer than 1000 tokens
   * evaluated, nothing generated) and the session keeps what was evaluated. */
  REQUIRE_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.n_ctx = 1024;
  sp.n_batch = 1;
  sp.n_threads = 1;
  REQUIRE_OK(tandem_session_create(g_model, &sp, &s));
  for (i = 0; i < 1000; ++i) long_prompt[i] = g->prompt_ids[i % g->n_prompt];
  memset(&p, 0, sizeof p);
  p.s = s;
  p.prompt = long_prompt;
  p.n_prompt = 1000;
  pthread_create(&th, NULL, prefill_thread, &p);
  while (!__atomic_load_n(&p.done, __ATOMIC_ACQUIRE)) {
    CHECK_OK(tandem_session_abort(s));
    ++aborts;
    sched_yield();
  }
  pthread_join(th, NULL);
  CHECK_OK(p.status);
  CHECK(p.r.finish_reason == TANDEM_FINISH_CANCELLED);
  CHECK(p.r.n_tokens == 0);
  CHECK(p.r.n_prompt >= 0 && p.r.n_prompt < 1000);
  CHECK_OK(tandem_session_get_tokens(s, NULL, 0, &n));
  CHECK(n == (size_t)p.r.n_prompt);
  printf("  abort during prefill: %d of 1000 prompt tokens evaluated (%d abort calls)\n", (int)p.r.n_prompt, aborts);
  CHECK_STATUS(tandem_session_abort(NULL), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_session_free(s));
  CHECK_STATUS(tandem_session_abort(s), TANDEM_E_INVALID_HANDLE);
}

typedef struct waiter_ctx {
  tandem_request* r;
  tandem_status status;
  tandem_request_event ev;
} waiter_ctx;

static void* waiter_thread(void* arg) {
  waiter_ctx* w = (waiter_ctx*)arg;
  tandem_request_event_init(&w->ev, sizeof w->ev);
  do {
    w->status = tandem_request_next_event(w->r, -1, &w->ev);
  } while (w->status == TANDEM_OK && w->ev.kind == TANDEM_EVENT_TOKEN);
  return NULL;
}

/* Stream a request with the blocking wait; returns the number of token events. */
static int stream_blocking(tandem_request* r, char* text, size_t cap, int32_t* finish) {
  tandem_request_event ev;
  char piece[512];
  size_t len = 0;
  int tokens = 0;
  text[0] = '\0';
  CHECK_OK(tandem_request_event_init(&ev, sizeof ev));
  for (;;) {
    ev.text = piece;
    ev.text_cap = sizeof piece;
    CHECK_OK(tandem_request_next_event(r, -1, &ev));
    CHECK(ev.kind != TANDEM_EVENT_NONE); /* no limit: never returns empty-handed */
    if (ev.kind == TANDEM_EVENT_NONE) return -1;
    if (len + ev.text_len < cap) {
      memcpy(text + len, piece, ev.text_len + 1);
      len += ev.text_len;
    }
    if (ev.kind == TANDEM_EVENT_FINISH) break;
    ++tokens;
  }
  *finish = ev.finish_reason;
  return tokens;
}

static void test_scheduler_sessions_and_waits(const golden_case* g) {
  log_sink sink;
  tandem_executor_params ep[2];
  tandem_executor* ex[2] = {NULL, NULL};
  tandem_scheduler_params scp;
  tandem_scheduler* sched = NULL;
  tandem_scheduler* other = NULL;
  tandem_sampling_params smp;
  tandem_request_params rp = greedy_request(&smp, 20);
  tandem_request* r = NULL;
  tandem_request* busy = NULL;
  tandem_request_result res;
  tandem_request_event ev;
  waiter_ctx w;
  pthread_t th;
  uint64_t session = 0;
  int32_t ids[64];
  char text[4096], part[2048];
  size_t n_ids = 0, i;
  int32_t finish = -1;
  const int32_t steps[3] = {20, 20, 24};

  memset(&sink, 0, sizeof sink);
  pthread_mutex_init(&sink.mu, NULL);
  CHECK_STATUS(tandem_log_set(log_cb, &sink, 7), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_log_set(log_cb, &sink, TANDEM_LOG_DEBUG));

  /* cpu+cpu from two executor handles. */
  for (i = 0; i < 2; ++i) {
    REQUIRE_OK(tandem_executor_params_init(&ep[i], sizeof ep[i]));
    ep[i].n_threads = 1;
    ep[i].max_running = 4;
    REQUIRE_OK(tandem_executor_create(g_model, &ep[i], &ex[i]));
  }
  ep[0].accelerator = 1;
  REQUIRE_OK(tandem_scheduler_params_init(&scp, sizeof scp));
  CHECK(scp.executor_handles == NULL && scp.log_routing == 1 && scp.reserved == 0);
  scp.executors = ep;
  scp.n_executors = 2;
  scp.max_context = 256;
  scp.executor_handles = ex;
  REQUIRE_OK(tandem_scheduler_create(g_model, &scp, &sched));
  /* An executor serves one scheduler at a time. */
  CHECK_STATUS(tandem_scheduler_create(g_model, &scp, &other), TANDEM_E_BUSY);
  CHECK(other == NULL);
  /* The same handle twice. */
  ex[1] = ex[0];
  CHECK_STATUS(tandem_scheduler_create(g_model, &scp, &other), TANDEM_E_INVALID_ARG);
  ex[1] = NULL;
  CHECK_STATUS(tandem_scheduler_create(g_model, &scp, &other), TANDEM_E_INVALID_ARG);
  scp.reserved = 1;
  scp.executor_handles = NULL;
  CHECK_STATUS(tandem_scheduler_create(g_model, &scp, &other), TANDEM_E_INVALID_ARG);
  scp.reserved = 0;
  pthread_mutex_lock(&sink.mu);
  CHECK(sink.lines[TANDEM_LOG_INFO] >= 2); /* executors and KV stores were announced */
  pthread_mutex_unlock(&sink.mu);

  /* One request per session at a time: a second request submitted while the first runs
   * ends in ERROR. On a loaded machine the first may finish before the second is
   * submitted (then the second continues the session), so this tries up to 5 times: a
   * scheduler without the rule never refuses. A session of its own keeps the golden
   * session below untouched. */
  {
    tandem_request_params bp = rp;
    tandem_request* first = NULL;
    uint64_t s2 = 0;
    int refused = 0, tries;
    int32_t f;
    CHECK_OK(tandem_scheduler_session_open(sched, &s2));
    bp.session = s2;
    bp.prompt = g->prompt_text;
    bp.max_tokens = 16;
    for (tries = 0; tries < 5 && refused == 0; ++tries) {
      REQUIRE_OK(tandem_scheduler_submit(sched, &bp, &first));
      REQUIRE_OK(tandem_scheduler_submit(sched, &bp, &busy));
      f = finish_of(busy);
      if (f == TANDEM_FINISH_ERROR) {
        ++refused;
      } else {
        CHECK(f == TANDEM_FINISH_LENGTH);
      }
      CHECK(finish_of(first) == TANDEM_FINISH_LENGTH);
      CHECK_OK(tandem_request_free(busy));
      CHECK_OK(tandem_request_free(first));
      bp.prompt = "";
    }
    CHECK(refused == 1);
    CHECK_OK(tandem_scheduler_session_close(sched, s2));
  }

  /* A session continued over three requests equals one long generation (the golden
   * continuation: 20 + 20 + 24 = 64 tokens). */
  CHECK_OK(tandem_scheduler_session_open(sched, &session));
  CHECK(session != 0);
  rp.session = session;
  text[0] = '\0';
  for (i = 0; i < 3; ++i) {
    rp.prompt = i == 0 ? g->prompt_text : "";
    rp.max_tokens = steps[i];
    rp.sla = i == 1 ? TANDEM_SLA_BATCH : TANDEM_SLA_INTERACTIVE; /* may move the session */
    REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
    CHECK(stream_blocking(r, part, sizeof part, &finish) == steps[i]);
    CHECK(finish == TANDEM_FINISH_LENGTH);
    CHECK_OK(tandem_request_result_init(&res, sizeof res));
    res.tokens = ids + n_ids;
    res.tokens_cap = 64 - n_ids;
    CHECK_OK(tandem_request_wait(r, -1, &res));
    CHECK(res.finished && res.n_tokens == (size_t)steps[i]);
    n_ids += res.n_tokens;
    strncat(text, part, sizeof text - strlen(text) - 1);
    CHECK_OK(tandem_request_free(r));
  }
  check_against_golden(g, ids, n_ids, text, "scheduler session over three requests");
  pthread_mutex_lock(&sink.mu);
  CHECK(sink.lines[TANDEM_LOG_DEBUG] >= 3); /* a routing decision per request */
  CHECK(sink.bad_lines == 0);
  printf("  last routing line: %s\n", sink.last_debug);
  pthread_mutex_unlock(&sink.mu);
  CHECK_OK(tandem_scheduler_session_close(sched, session));
  CHECK_OK(tandem_scheduler_session_close(sched, session)); /* closed: no-op */
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));      /* on a closed session */
  CHECK(finish_of(r) == TANDEM_FINISH_ERROR);
  CHECK_OK(tandem_request_free(r));
  rp.session = 0;

  /* A blocked waiter wakes when the request is cancelled. */
  rp.prompt = g->prompt_text;
  rp.max_tokens = 200;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
  memset(&w, 0, sizeof w);
  w.r = r;
  pthread_create(&th, NULL, waiter_thread, &w);
  CHECK_OK(tandem_request_cancel(r));
  pthread_join(th, NULL);
  CHECK_OK(w.status);
  CHECK(w.ev.kind == TANDEM_EVENT_FINISH);
  CHECK(w.ev.finish_reason == TANDEM_FINISH_CANCELLED || w.ev.finish_reason == TANDEM_FINISH_LENGTH);
  /* After the finish: the FINISH event again, at once, whatever the timeout. */
  CHECK_OK(tandem_request_event_init(&ev, sizeof ev));
  CHECK_OK(tandem_request_next_event(r, 0, &ev));
  CHECK(ev.kind == TANDEM_EVENT_FINISH);
  CHECK_OK(tandem_request_next_event(r, 1000000, &ev));
  CHECK(ev.kind == TANDEM_EVENT_FINISH);
  CHECK_OK(tandem_request_free(r));
  CHECK_STATUS(tandem_request_next_event(r, 0, &ev), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_request_next_event(NULL, 0, &ev), TANDEM_E_INVALID_ARG);

  /* A timeout returns NONE: a request queued behind a long one on a one-slot executor. */
  {
    tandem_executor_params one;
    tandem_scheduler_params sp1;
    tandem_scheduler* s1 = NULL;
    tandem_request* first = NULL;
    tandem_request* second = NULL;
    tandem_request_result fr;
    REQUIRE_OK(tandem_executor_params_init(&one, sizeof one));
    one.n_threads = 1;
    one.max_running = 1;
    REQUIRE_OK(tandem_scheduler_params_init(&sp1, sizeof sp1));
    sp1.executors = &one;
    sp1.max_context = 256;
    REQUIRE_OK(tandem_scheduler_create(g_model, &sp1, &s1));
    rp.max_tokens = 240;
    REQUIRE_OK(tandem_scheduler_submit(s1, &rp, &first));
    REQUIRE_OK(tandem_scheduler_submit(s1, &rp, &second));
    CHECK_OK(tandem_request_event_init(&ev, sizeof ev));
    CHECK_OK(tandem_request_next_event(second, 1, &ev));
    CHECK_OK(tandem_request_result_init(&fr, sizeof fr));
    CHECK_OK(tandem_request_get_result(first, &fr));
    /* Only meaningful while the first request still holds the only slot. */
    if (!fr.finished) CHECK(ev.kind == TANDEM_EVENT_NONE);
    CHECK_STATUS(tandem_request_next_event(second, 0, NULL), TANDEM_E_INVALID_ARG);
    CHECK_OK(tandem_scheduler_free(s1));
    CHECK(finish_of(second) == TANDEM_FINISH_CANCELLED);
    CHECK_OK(tandem_request_free(first));
    CHECK_OK(tandem_request_free(second));
  }

  CHECK_STATUS(tandem_scheduler_session_open(NULL, &session), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_open(sched, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_close(NULL, 1), TANDEM_E_INVALID_ARG);

  /* The executor handles may go before the scheduler; once it is freed they are free to
   * serve another one. */
  CHECK_OK(tandem_executor_free(ex[1]));
  CHECK_OK(tandem_scheduler_free(sched));
  scp.n_executors = 1;
  scp.executor_handles = ex;
  REQUIRE_OK(tandem_scheduler_create(g_model, &scp, &other));
  CHECK_OK(tandem_scheduler_free(other));
  CHECK_OK(tandem_executor_free(ex[0]));

  /* After tandem_log_set(NULL) nothing reaches the old callback. */
  CHECK_OK(tandem_log_set(NULL, NULL, TANDEM_LOG_DEBUG));
  pthread_mutex_lock(&sink.mu);
  i = (size_t)(sink.lines[0] + sink.lines[1] + sink.lines[2] + sink.lines[3]);
  pthread_mutex_unlock(&sink.mu);
  sched = new_scheduler(1, 1, 16);
  CHECK_OK(tandem_scheduler_free(sched));
  CHECK(i == (size_t)(sink.lines[0] + sink.lines[1] + sink.lines[2] + sink.lines[3]));
  pthread_mutex_destroy(&sink.mu);
}

/* Explicit park / unpark of a scheduler session: its KV pages go to the File tier and come
 * back bit-exact (nothing recomputed), so a conversation parked between its requests still
 * continues into the golden continuation. */
static void test_scheduler_session_park(const golden_case* g) {
  tandem_executor_params ep;
  tandem_scheduler_params scp;
  tandem_scheduler* sched = NULL;
  tandem_scheduler* no_file = NULL;
  tandem_sampling_params smp;
  tandem_request_params rp = greedy_request(&smp, 20);
  tandem_request* r = NULL;
  tandem_request* blocker = NULL;
  tandem_request_result res;
  tandem_scheduler_session_info si;
  uint64_t session = 0, other = 0;
  int32_t ids[64];
  char text[4096], part[2048];
  size_t n_ids = 0, i;
  int32_t finish = -1, pages = 0;
  tandem_status st;
  const int32_t steps[3] = {20, 20, 24};

  REQUIRE_OK(tandem_executor_params_init(&ep, sizeof ep));
  CHECK(ep.pool == NULL);
  ep.n_threads = 1;
  ep.max_running = 1;
  ep.kv_file_pages = 64;
  ep.kv_dir = g_tmpdir;
  REQUIRE_OK(tandem_scheduler_params_init(&scp, sizeof scp));
  scp.executors = &ep;
  scp.n_executors = 1;
  scp.max_context = 256;
  scp.prefix_cache_entries = 0; /* the session's pages are its own */
  REQUIRE_OK(tandem_scheduler_create(g_model, &scp, &sched));
  CHECK_OK(tandem_scheduler_session_open(sched, &session));
  REQUIRE_OK(tandem_scheduler_session_info_init(&si, sizeof si));
  CHECK_OK(tandem_scheduler_session_get_info(sched, session, &si));
  CHECK(si.n_tokens == 0 && si.kv_tokens == 0 && si.executor == -1 && si.busy == 0);
  CHECK_OK(tandem_scheduler_session_park(sched, session)); /* no KV yet: nothing moves */
  CHECK_OK(tandem_scheduler_session_unpark(sched, session));

  rp.session = session;
  text[0] = '\0';
  for (i = 0; i < 3; ++i) {
    rp.prompt = i == 0 ? g->prompt_text : "";
    rp.max_tokens = steps[i];
    REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
    CHECK(stream_blocking(r, part, sizeof part, &finish) == steps[i]);
    CHECK(finish == TANDEM_FINISH_LENGTH);
    CHECK_OK(tandem_request_result_init(&res, sizeof res));
    res.tokens = ids + n_ids;
    res.tokens_cap = 64 - n_ids;
    CHECK_OK(tandem_request_wait(r, -1, &res));
    CHECK(res.finished && res.n_tokens == (size_t)steps[i]);
    n_ids += res.n_tokens;
    strncat(text, part, sizeof text - strlen(text) - 1);
    CHECK_OK(tandem_request_free(r));

    /* Between requests the KV is parked in the compute (Host) tier. */
    CHECK_OK(tandem_scheduler_session_get_info(sched, session, &si));
    CHECK(si.busy == 0 && si.executor == 0);
    CHECK(si.n_tokens == (int32_t)(g->n_prompt + n_ids));
    CHECK(si.kv_tokens == si.n_tokens - 1); /* the last sampled token is not evaluated yet */
    CHECK(si.pages_host >= (si.kv_tokens + 15) / 16 && si.pages_file == 0 && si.pages_device == 0);
    pages = si.pages_host;
    if (i == 2) break;
    /* Park it: every page to the File tier. */
    CHECK_OK(tandem_scheduler_session_park(sched, session));
    CHECK_OK(tandem_scheduler_session_get_info(sched, session, &si));
    CHECK(si.pages_host == 0 && si.pages_file == pages && si.kv_tokens == si.n_tokens - 1);
    CHECK_OK(tandem_scheduler_session_park(sched, session)); /* already there: no-op */
    if (i == 1) {
      /* Unpark ahead of the next request (the other time the request brings it back). */
      CHECK_OK(tandem_scheduler_session_unpark(sched, session));
      CHECK_OK(tandem_scheduler_session_get_info(sched, session, &si));
      CHECK(si.pages_host == pages && si.pages_file == 0);
    }
  }
  check_against_golden(g, ids, n_ids, text, "scheduler session parked to the File tier between requests");

  /* A session with a request on it cannot be parked: with one decode slot, a session
   * request queued behind a long request waits (busy) at least until that one finishes. */
  rp.session = 0;
  rp.prompt = g->prompt_text;
  rp.max_tokens = 240;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &blocker));
  rp.session = session;
  rp.prompt = "";
  rp.max_tokens = 4;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
  st = tandem_scheduler_session_park(sched, session);
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  CHECK_OK(tandem_request_get_result(blocker, &res));
  if (!res.finished) {
    CHECK(st == TANDEM_E_BUSY);
    CHECK_STATUS(tandem_scheduler_session_unpark(sched, session), TANDEM_E_BUSY);
    CHECK_OK(tandem_scheduler_session_get_info(sched, session, &si));
    CHECK(si.busy == 1 && si.executor == -1);
  } else {
    printf("  (the long request finished before the park: busy case not observed)\n");
  }
  CHECK(finish_of(r) == TANDEM_FINISH_LENGTH);
  CHECK_OK(tandem_request_free(r));
  CHECK_OK(tandem_request_free(blocker));

  /* Errors. */
  CHECK_STATUS(tandem_scheduler_session_park(NULL, session), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_unpark(NULL, session), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_park(sched, 999999), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_get_info(sched, session, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_get_info(NULL, session, &si), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_info_init(&si, 8), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_scheduler_session_close(sched, session));
  CHECK_STATUS(tandem_scheduler_session_park(sched, session), TANDEM_E_INVALID_ARG); /* closed */
  CHECK_STATUS(tandem_scheduler_session_get_info(sched, session, &si), TANDEM_E_INVALID_ARG);

  /* A store without a File tier: park refuses, the session stays usable. */
  ep.kv_file_pages = 0;
  REQUIRE_OK(tandem_scheduler_create(g_model, &scp, &no_file));
  CHECK_OK(tandem_scheduler_session_open(no_file, &other));
  rp.session = other;
  rp.prompt = g->prompt_text;
  REQUIRE_OK(tandem_scheduler_submit(no_file, &rp, &r));
  CHECK(finish_of(r) == TANDEM_FINISH_LENGTH);
  CHECK_OK(tandem_request_free(r));
  CHECK_STATUS(tandem_scheduler_session_park(no_file, other), TANDEM_E_INVALID_ARG);
  CHECK(strstr(tandem_last_error(), "File tier") != NULL);
  CHECK_OK(tandem_scheduler_session_unpark(no_file, other)); /* already in the compute tier */
  CHECK_OK(tandem_scheduler_free(no_file));
  CHECK_STATUS(tandem_scheduler_session_park(no_file, other), TANDEM_E_INVALID_HANDLE);
  CHECK_OK(tandem_scheduler_free(sched));
}

/* A scheduler session saved between requests restores (into the same scheduler, as a new
 * session) and continues with the ids the live one produced; the file is a session file
 * both ways: a tandem_session continues the scheduler's, the scheduler a tandem_session's. */
static size_t scheduler_turn(tandem_scheduler* sched, uint64_t session, const char* prompt, int32_t* ids, size_t cap) {
  tandem_sampling_params smp;
  tandem_request_params rp = greedy_request(&smp, (int32_t)cap);
  tandem_request* r = NULL;
  tandem_request_result res;
  rp.session = session;
  rp.prompt = prompt;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
  CHECK_OK(tandem_request_result_init(&res, sizeof res));
  res.tokens = ids;
  res.tokens_cap = cap;
  CHECK_OK(tandem_request_wait(r, -1, &res));
  CHECK(res.finished && res.finish_reason == TANDEM_FINISH_LENGTH);
  CHECK_OK(tandem_request_free(r));
  return res.n_tokens;
}

static void test_scheduler_session_save(const golden_case* g) {
  tandem_executor_params ep;
  tandem_scheduler_params scp;
  tandem_scheduler* sched = NULL;
  tandem_scheduler_session_info si;
  tandem_session* s = NULL;
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 20);
  uint64_t live = 0, back = 0, from_session = 0, out = 7;
  int32_t first[20], cont[20], again[20], c[10];
  char path[512], path2[512], bad[512], missing[512];
  size_t i, clear = golden_clear_prefix(g);
  FILE* f;

  tmp_path(path, sizeof path, "sched.tss");
  tmp_path(path2, sizeof path2, "from-session.tss");
  tmp_path(bad, sizeof bad, "sched-bad.tss");
  tmp_path(missing, sizeof missing, "sched-missing.tss");
  REQUIRE_OK(tandem_executor_params_init(&ep, sizeof ep));
  ep.n_threads = 1;
  ep.kv_file_pages = 64;
  ep.kv_dir = g_tmpdir;
  REQUIRE_OK(tandem_scheduler_params_init(&scp, sizeof scp));
  scp.executors = &ep;
  scp.n_executors = 1;
  scp.max_context = 256;
  scp.prefix_cache_entries = 0;
  REQUIRE_OK(tandem_scheduler_create(g_model, &scp, &sched));
  REQUIRE_OK(tandem_scheduler_session_info_init(&si, sizeof si));

  CHECK_OK(tandem_scheduler_session_open(sched, &live));
  CHECK(scheduler_turn(sched, live, g->prompt_text, first, 20) == 20);
  CHECK_OK(tandem_scheduler_session_save(sched, live, path));
  CHECK(file_size(path) > 64);
  CHECK(scheduler_turn(sched, live, "", cont, 20) == 20);
  for (i = 0; i < clear && i < 40; ++i) CHECK((i < 20 ? first[i] : cont[i - 20]) == g->greedy_ids[i]);

  /* Restored: a new session with the saved conversation, continuing as the live one did. */
  CHECK_OK(tandem_scheduler_session_restore(sched, path, 0, &back));
  CHECK(back != 0 && back != live);
  CHECK_OK(tandem_scheduler_session_get_info(sched, back, &si));
  CHECK(si.n_tokens == (int32_t)(g->n_prompt + 20) && si.kv_tokens == si.n_tokens - 1);
  CHECK(si.executor == 0 && si.busy == 0 && si.pages_host > 0);
  CHECK(scheduler_turn(sched, back, "", again, 20) == 20);
  CHECK(memcmp(again, cont, sizeof cont) == 0);

  /* The same file in a tandem_session; a tandem_session's file in the scheduler. */
  s = new_session(256);
  CHECK_OK(tandem_session_restore(s, path));
  continue_greedy(s, c, 10);
  CHECK(memcmp(c, cont, sizeof c) == 0);
  CHECK_OK(tandem_session_reset(s));
  CHECK_OK(tandem_session_generate(s, g->prompt_text, &gp, NULL, NULL, NULL));
  CHECK_OK(tandem_session_save(s, path2));
  CHECK_OK(tandem_scheduler_session_restore(sched, path2, 0, &from_session));
  CHECK(scheduler_turn(sched, from_session, "", again, 20) == 20);
  CHECK(memcmp(again, cont, sizeof cont) == 0);
  CHECK_OK(tandem_session_free(s));

  /* Errors. */
  CHECK_STATUS(tandem_scheduler_session_save(NULL, live, path), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_save(sched, live, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_save(sched, live, ""), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_save(sched, 999999, missing), TANDEM_E_INVALID_ARG);
  CHECK(file_size(missing) == -1);
  CHECK_STATUS(tandem_scheduler_session_save(sched, live, "/dev/full"), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_restore(NULL, path, 0, &out), TANDEM_E_INVALID_ARG);
  CHECK(out == 0);
  CHECK_STATUS(tandem_scheduler_session_restore(sched, NULL, 0, &out), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_restore(sched, "", 0, &out), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_scheduler_session_restore(sched, path, 0, NULL), TANDEM_E_INVALID_ARG);
  out = 7;
  CHECK_STATUS(tandem_scheduler_session_restore(sched, path, 1, &out), TANDEM_E_INVALID_ARG);
  CHECK(out == 0);
  CHECK_MSG_CONTAINS("executor");
  CHECK_STATUS(tandem_scheduler_session_restore(sched, missing, 0, &out), TANDEM_E_IO);
  f = fopen(bad, "wb");
  CHECK(f != NULL);
  if (f != NULL) {
    fputs("not a session file, only a few words of text", f);
    fclose(f);
  }
  CHECK_STATUS(tandem_scheduler_session_restore(sched, bad, 0, &out), TANDEM_E_SESSION_CORRUPT);
  CHECK(out == 0);
  CHECK_OK(tandem_scheduler_session_close(sched, live));
  CHECK_STATUS(tandem_scheduler_session_save(sched, live, path), TANDEM_E_INVALID_ARG); /* closed */
  CHECK_OK(tandem_scheduler_session_close(sched, back));
  CHECK_OK(tandem_scheduler_session_close(sched, from_session));
  CHECK_OK(tandem_scheduler_free(sched));
  CHECK_STATUS(tandem_scheduler_session_save(sched, live, path), TANDEM_E_INVALID_HANDLE);
  remove(path);
  remove(path2);
  remove(bad);
}

/* Threads of this process (entries of /proc/self/task); -1 when unreadable. */
static int count_threads(void) {
  DIR* d = opendir("/proc/self/task");
  struct dirent* e;
  int n = 0;
  if (d == NULL) return -1;
  while ((e = readdir(d)) != NULL) {
    if (e->d_name[0] != '.') ++n;
  }
  closedir(d);
  return n;
}

typedef struct pool_gen_ctx {
  tandem_session* s;
  const golden_case* g;
  int32_t ids[64];
  char text[4096];
  size_t n;
  tandem_status status;
  int max_threads; /* most threads seen from the token callback */
} pool_gen_ctx;

static int pool_gen_cb(const char* piece, size_t len, int32_t token, void* user_data) {
  pool_gen_ctx* c = (pool_gen_ctx*)user_data;
  const int n = count_threads();
  (void)piece;
  (void)len;
  (void)token;
  if (n > c->max_threads) c->max_threads = n;
  return 0;
}

static void* pool_gen_thread(void* arg) {
  pool_gen_ctx* c = (pool_gen_ctx*)arg;
  tandem_sampling_params smp;
  tandem_generate_params gp;
  tandem_generate_result gr;
  tandem_sampling_params_init(&smp, sizeof smp);
  smp.temperature = 0.0f;
  tandem_generate_params_init(&gp, sizeof gp);
  gp.sampling = &smp;
  gp.max_tokens = 64;
  gp.flags = TANDEM_GENERATE_IGNORE_EOS;
  tandem_generate_result_init(&gr, sizeof gr);
  gr.tokens = c->ids;
  gr.tokens_cap = 64;
  gr.text = c->text;
  gr.text_cap = sizeof c->text;
  c->status = tandem_session_generate(c->s, c->g->prompt_text, &gp, pool_gen_cb, c, &gr);
  c->n = gr.n_tokens;
  return NULL;
}

/* Several sessions (and executors, schedulers) on one pool run no more compute threads
 * than the pool has: thread counts from /proc/self/task. */
static void test_shared_pool(const golden_case* g) {
  tandem_pool* pool = NULL;
  tandem_session_params sp;
  tandem_session* s[2] = {NULL, NULL};
  tandem_session* extra = NULL;
  tandem_session_info info;
  tandem_executor_params ep;
  tandem_executor* ex = NULL;
  tandem_device_info dev;
  tandem_scheduler_params scp;
  tandem_executor_params eps[2];
  tandem_scheduler* sched = NULL;
  pool_gen_ctx ctx[2];
  pthread_t th[2];
  int32_t n = 0;
  int t0, t1, t_def1, t_def2;
  size_t i;
  const long cores = sysconf(_SC_NPROCESSORS_ONLN);

  t0 = count_threads();
  if (t0 < 0) {
    printf("  /proc/self/task unreadable: thread counts skipped\n");
  }
  CHECK_STATUS(tandem_pool_create(2, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_pool_create(-1, &pool), TANDEM_E_INVALID_ARG);
  CHECK(pool == NULL);
  CHECK_STATUS(tandem_pool_create(513, &pool), TANDEM_E_INVALID_ARG);
  REQUIRE_OK(tandem_pool_create(2, &pool));
  CHECK_OK(tandem_pool_get_threads(pool, &n));
  CHECK(n == 2);
  CHECK_STATUS(tandem_pool_get_threads(pool, NULL), TANDEM_E_INVALID_ARG);
  CHECK_STATUS(tandem_pool_get_threads(NULL, &n), TANDEM_E_INVALID_ARG);
  t1 = count_threads();
  if (t0 >= 0) CHECK(t1 == t0 + 1); /* the caller's thread is the pool's first */

  /* Two sessions on the pool add no thread and generate the golden continuation at once. */
  REQUIRE_OK(tandem_session_params_init(&sp, sizeof sp));
  CHECK(sp.pool == NULL && sp.n_threads == 0);
  sp.n_ctx = 256;
  sp.pool = pool;
  sp.n_threads = 2;
  CHECK_STATUS(tandem_session_create(g_model, &sp, &extra), TANDEM_E_INVALID_ARG); /* pool and n_threads */
  sp.n_threads = 0;
  for (i = 0; i < 2; ++i) REQUIRE_OK(tandem_session_create(g_model, &sp, &s[i]));
  if (t0 >= 0) CHECK(count_threads() == t1);
  REQUIRE_OK(tandem_session_info_init(&info, sizeof info));
  CHECK_OK(tandem_session_get_info(s[0], &info));
  CHECK(info.n_threads == 2);
  CHECK_OK(tandem_pool_free(pool)); /* the sessions keep it */
  CHECK_STATUS(tandem_pool_free(pool), TANDEM_E_INVALID_HANDLE);
  CHECK_STATUS(tandem_session_create(g_model, &sp, &extra), TANDEM_E_INVALID_HANDLE); /* freed pool */
  CHECK(extra == NULL);
  for (i = 0; i < 2; ++i) {
    memset(&ctx[i], 0, sizeof ctx[i]);
    ctx[i].s = s[i];
    ctx[i].g = g;
    pthread_create(&th[i], NULL, pool_gen_thread, &ctx[i]);
  }
  for (i = 0; i < 2; ++i) pthread_join(th[i], NULL);
  for (i = 0; i < 2; ++i) {
    CHECK_OK(ctx[i].status);
    check_against_golden(g, ctx[i].ids, ctx[i].n, ctx[i].text, "session on a shared pool");
    /* This thread, the pool's worker and the two generating threads: nothing more. */
    if (t0 >= 0) CHECK(ctx[i].max_threads <= t1 + 2);
  }
  printf("  2 sessions on a pool of 2: %d threads before, at most %d while generating\n", t0,
         ctx[0].max_threads > ctx[1].max_threads ? ctx[0].max_threads : ctx[1].max_threads);
  for (i = 0; i < 2; ++i) CHECK_OK(tandem_session_free(s[i]));
  if (t0 >= 0) CHECK(count_threads() == t0); /* the pool's worker ended with its last user */

  /* Executors and a scheduler on one pool: only the step-loop threads are added. */
  REQUIRE_OK(tandem_pool_create(2, &pool));
  REQUIRE_OK(tandem_executor_params_init(&ep, sizeof ep));
  ep.pool = pool;
  ep.n_threads = 1;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &ex), TANDEM_E_INVALID_ARG);
  ep.n_threads = 0;
  ep.device_kind = TANDEM_DEVICE_CUDA;
  CHECK_STATUS(tandem_executor_create(g_model, &ep, &ex), TANDEM_E_INVALID_ARG);
  ep.device_kind = TANDEM_DEVICE_CPU;
  REQUIRE_OK(tandem_executor_create(g_model, &ep, &ex));
  REQUIRE_OK(tandem_device_info_init(&dev, sizeof dev));
  CHECK_OK(tandem_executor_get_device(ex, &dev));
  CHECK(dev.n_cores == 2);
  CHECK_OK(tandem_executor_free(ex));
  for (i = 0; i < 2; ++i) {
    REQUIRE_OK(tandem_executor_params_init(&eps[i], sizeof eps[i]));
    eps[i].pool = pool;
    eps[i].max_running = 2;
  }
  eps[0].accelerator = 1;
  REQUIRE_OK(tandem_scheduler_params_init(&scp, sizeof scp));
  scp.executors = eps;
  scp.n_executors = 2;
  scp.max_context = 256;
  REQUIRE_OK(tandem_scheduler_create(g_model, &scp, &sched));
  if (t0 >= 0) CHECK(count_threads() == t0 + 1 + 2); /* the pool's worker and two step loops */
  CHECK_OK(tandem_scheduler_free(sched));
  CHECK_OK(tandem_pool_free(pool));

  /* Without a pool, n_threads 0 shares the node pool: a second session adds no thread. */
  REQUIRE_OK(tandem_session_params_init(&sp, sizeof sp));
  sp.n_ctx = 256;
  REQUIRE_OK(tandem_session_create(g_model, &sp, &s[0]));
  t_def1 = count_threads();
  REQUIRE_OK(tandem_session_create(g_model, &sp, &s[1]));
  t_def2 = count_threads();
  if (t0 >= 0) {
    CHECK(t_def2 == t_def1);
    CHECK(t_def1 - t0 <= cores); /* one thread per physical core at most */
  }
  printf("  2 default sessions: %d threads (%d before, %ld cores online)\n", t_def2, t0, cores);
  for (i = 0; i < 2; ++i) CHECK_OK(tandem_session_free(s[i]));
}

/* Logprobs: each generated token's log-probability equals a double log-softmax of the
 * logits tandem_session_eval gives for the same tokens (teacher-forced), its alternatives
 * are the most likely ids in order; the scheduler's entries equal the session's; old
 * struct sizes and bad values. */
static void log_softmax(const float* row, int32_t n, double* out) {
  double m = -INFINITY, z = 0.0;
  int32_t i;
  for (i = 0; i < n; ++i) m = row[i] > m ? row[i] : m;
  for (i = 0; i < n; ++i) z += exp((double)row[i] - m);
  for (i = 0; i < n; ++i) out[i] = (double)row[i] - (m + log(z));
}

static void test_logprobs(const golden_case* g) {
  enum { N = 8, TOP = 5 };
  tandem_session* s = new_session(128);
  tandem_session* replay = new_session(128);
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, N);
  tandem_generate_result gr;
  tandem_token_logprob lp[N], lp_small[2], lp_sched[N];
  int32_t ids[N], all[256];
  size_t n_all = 0, i, n = 0;
  float* logits;
  double* want;
  tandem_scheduler* sched;
  tandem_request_params rp;
  tandem_request* r = NULL;
  tandem_request_result rr;

  CHECK(gp.logprobs == -1 && gp.reserved == 0);
  gp.logprobs = TOP;
  REQUIRE_OK(tandem_generate_result_init(&gr, sizeof gr));
  CHECK(gr.logprobs == NULL && gr.logprobs_cap == 0 && gr.n_logprobs == 0);
  gr.tokens = ids;
  gr.tokens_cap = N;
  gr.logprobs = lp;
  gr.logprobs_cap = N;
  CHECK_OK(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr));
  CHECK(gr.n_tokens == N && gr.n_logprobs == N);

  /* Truth: the logits of prompt + ids[0 .. N-2], row n_prompt - 1 + i chose ids[i]. */
  for (i = 0; i < g->n_prompt; ++i) all[n_all++] = g->prompt_ids[i];
  for (i = 0; i + 1 < N; ++i) all[n_all++] = ids[i];
  logits = (float*)malloc(sizeof(float) * (size_t)g_n_vocab * n_all);
  want = (double*)malloc(sizeof(double) * (size_t)g_n_vocab);
  if (logits == NULL || want == NULL) abort();
  CHECK_OK(tandem_session_eval(replay, all, n_all, logits, (size_t)g_n_vocab * n_all));
  for (i = 0; i < N; ++i) {
    int32_t k;
    const float* row = logits + (g->n_prompt - 1 + i) * (size_t)g_n_vocab;
    log_softmax(row, g_n_vocab, want);
    CHECK(lp[i].token == ids[i]);
    CHECK(fabs(lp[i].logprob - want[ids[i]]) < 2e-5);
    CHECK(lp[i].n_top == TOP);
    CHECK(lp[i].top_tokens[0] == ids[i] && lp[i].top_logprobs[0] == lp[i].logprob); /* greedy */
    for (k = 0; k < TOP; ++k) {
      int32_t j, better = 0;
      const int32_t t = lp[i].top_tokens[k];
      CHECK(t >= 0 && t < g_n_vocab);
      if (t < 0 || t >= g_n_vocab) continue;
      CHECK(fabs(lp[i].top_logprobs[k] - want[t]) < 2e-5);
      for (j = 0; j < g_n_vocab; ++j) better += want[j] > want[t] || (want[j] == want[t] && j < t);
      CHECK(better == k); /* the k-th most likely id */
    }
  }
  free(logits);
  free(want);

  /* A small buffer gets the first entries; n_logprobs is the full count. Without logprobs: 0. */
  REQUIRE_OK(tandem_session_reset(s));
  gr.logprobs = lp_small;
  gr.logprobs_cap = 2;
  CHECK_OK(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr));
  CHECK(gr.n_logprobs == N && lp_small[0].token == lp[0].token && lp_small[1].logprob == lp[1].logprob);
  REQUIRE_OK(tandem_session_reset(s));
  gp.logprobs = -1;
  CHECK_OK(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr));
  CHECK(gr.n_tokens == N && gr.n_logprobs == 0);

  /* Refusals: out of range, reserved set, a NULL buffer with a capacity. */
  REQUIRE_OK(tandem_session_reset(s));
  gp.logprobs = 21;
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("logprobs");
  gp.logprobs = -2;
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);
  gp.logprobs = 0;
  gp.reserved = 1;
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);
  gp.reserved = 0;
  gr.logprobs = NULL;
  gr.logprobs_cap = 3;
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);

  /* Callers built against the version-0.1 structs: no logprobs, the result written up to their size. */
  {
    unsigned char old_result[sizeof(tandem_generate_result) + 8];
    tandem_generate_result* o = (tandem_generate_result*)old_result;
    tandem_generate_params og = greedy_params(&smp, N);
    memset(old_result, 0xAB, sizeof old_result);
    REQUIRE_OK(tandem_generate_result_init(o, offsetof(tandem_generate_result, logprobs)));
    og.struct_size = offsetof(tandem_generate_params, logprobs);
    og.logprobs = 7; /* beyond its struct_size: not read */
    REQUIRE_OK(tandem_session_reset(s));
    CHECK_OK(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &og, NULL, NULL, o));
    CHECK(o->n_tokens == N);
    CHECK(old_result[offsetof(tandem_generate_result, logprobs)] == 0xAB); /* nothing written past it */
  }

  /* The scheduler: the same entries for the same greedy request. */
  sched = new_scheduler(1, 4, 16);
  rp = greedy_request(&smp, N);
  CHECK(rp.logprobs == -1);
  rp.prompt_tokens = g->prompt_ids;
  rp.n_prompt_tokens = g->n_prompt;
  rp.logprobs = TOP;
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
  REQUIRE_OK(tandem_request_result_init(&rr, sizeof rr));
  rr.logprobs = lp_sched;
  rr.logprobs_cap = N;
  CHECK_OK(tandem_request_wait(r, -1, &rr));
  CHECK(rr.finished && rr.n_tokens == N && rr.n_logprobs == N);
  for (i = 0; i < N; ++i) {
    int32_t k;
    CHECK(lp_sched[i].token == lp[i].token && lp_sched[i].n_top == TOP);
    CHECK(fabsf(lp_sched[i].logprob - lp[i].logprob) < 2e-5f);
    for (k = 0; k < TOP; ++k) {
      CHECK(lp_sched[i].top_tokens[k] == lp[i].top_tokens[k]);
      CHECK(fabsf(lp_sched[i].top_logprobs[k] - lp[i].top_logprobs[k]) < 2e-5f);
    }
    n += lp_sched[i].token == ids[i];
  }
  CHECK(n == N);
  CHECK_OK(tandem_request_free(r));
  rp.logprobs = 21;
  CHECK_STATUS(tandem_scheduler_submit(sched, &rp, &r), TANDEM_E_INVALID_ARG);
  CHECK(r == NULL);
  rp.logprobs = 1;
  rp.reserved = 5;
  CHECK_STATUS(tandem_scheduler_submit(sched, &rp, &r), TANDEM_E_INVALID_ARG);
  CHECK_OK(tandem_scheduler_free(sched));
  CHECK_OK(tandem_session_free(s));
  CHECK_OK(tandem_session_free(replay));
}

/* Structured outputs: a GBNF grammar and a JSON schema constrain sampled text at
 * temperature 1 (the outputs checked by hand); compile errors and bad fields refused. A
 * library built without xgrammar refuses every grammar (reported, then skipped). */
static void test_grammar(const golden_case* g) {
  tandem_session* s = new_session(128);
  tandem_sampling_params smp;
  tandem_generate_params gp = greedy_params(&smp, 24);
  tandem_generate_result gr;
  tandem_scheduler* sched;
  tandem_request_params rp;
  tandem_request* r = NULL;
  tandem_request_result rr;
  char text[128], rtext[128];
  int32_t seed;
  tandem_status st;

  CHECK(gp.grammar == NULL && gp.grammar_type == TANDEM_GRAMMAR_NONE && gp.reserved2 == 0);
  gp.flags = 0; /* a grammar ends at end-of-generation */
  REQUIRE_OK(tandem_generate_result_init(&gr, sizeof gr));
  gr.text = text;
  gr.text_cap = sizeof text;
  smp.temperature = 1.0f;
  gp.grammar_type = TANDEM_GRAMMAR_GBNF;
  gp.grammar = "root ::= (\"cat\" | \"dog\") \"!\"";
  st = tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr);
  if (st == TANDEM_E_INVALID_ARG && strstr(tandem_last_error(), "grammar engine") != NULL) {
    printf("test_grammar: SKIPPED (libtandem built without xgrammar)\n");
    CHECK_OK(tandem_session_free(s));
    return;
  }
  CHECK_OK(st);
  CHECK(gr.finish_reason == TANDEM_FINISH_STOP);
  CHECK(strcmp(text, "cat!") == 0 || strcmp(text, "dog!") == 0);

  /* A schema: one key, an integer 0..9, so the text is {"n": D} with one digit D. */
  gp.grammar_type = TANDEM_GRAMMAR_JSON_SCHEMA;
  gp.grammar =
      "{\"type\": \"object\", \"properties\": {\"n\": {\"type\": \"integer\", \"minimum\": 0,"
      " \"maximum\": 9}}, \"required\": [\"n\"], \"additionalProperties\": false}";
  for (seed = 0; seed < 6; ++seed) {
    smp.seed = (uint64_t)seed;
    /* With IGNORE_EOS too: the completed grammar still ends the output. */
    gp.flags = seed % 2 ? TANDEM_GENERATE_IGNORE_EOS : 0;
    REQUIRE_OK(tandem_session_reset(s));
    CHECK_OK(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr));
    CHECK(gr.finish_reason == TANDEM_FINISH_STOP);
    CHECK(strlen(text) == 8 && strncmp(text, "{\"n\": ", 6) == 0 && text[6] >= '0' && text[6] <= '9' && text[7] == '}');
  }

  /* Refusals: the reason in tandem_last_error. */
  gp.flags = 0;
  REQUIRE_OK(tandem_session_reset(s));
  gp.grammar = "{\"type\": \"nope\"}";
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("nope");
  gp.grammar_type = TANDEM_GRAMMAR_GBNF;
  gp.grammar = "root ::= undefined_rule";
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);
  CHECK_MSG_CONTAINS("undefined_rule");
  gp.grammar = NULL;
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);
  gp.grammar_type = 9;
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);
  gp.grammar_type = TANDEM_GRAMMAR_JSON_OBJECT;
  gp.reserved2 = 1;
  CHECK_STATUS(tandem_session_generate_tokens(s, g->prompt_ids, g->n_prompt, &gp, NULL, NULL, &gr),
               TANDEM_E_INVALID_ARG);

  /* The scheduler: a request with a GBNF grammar. */
  sched = new_scheduler(1, 4, 16);
  rp = greedy_request(&smp, 24);
  rp.flags = 0;
  rp.prompt_tokens = g->prompt_ids;
  rp.n_prompt_tokens = g->n_prompt;
  rp.grammar_type = TANDEM_GRAMMAR_GBNF;
  rp.grammar = "root ::= [0-9] [0-9] \".\"";
  REQUIRE_OK(tandem_scheduler_submit(sched, &rp, &r));
  REQUIRE_OK(tandem_request_result_init(&rr, sizeof rr));
  rr.text = rtext;
  rr.text_cap = sizeof rtext;
  CHECK_OK(tandem_request_wait(r, -1, &rr));
  CHECK(rr.finished && rr.finish_reason == TANDEM_FINISH_STOP);
  CHECK(strlen(rtext) == 3 && rtext[0] >= '0' && rtext[0] <= '9' && rtext[1] >= '0' && rtext[1] <= '9' &&
        rtext[2] == '.');
  CHECK_OK(tandem_request_free(r));
  r = NULL;
  rp.grammar = "root ::= nothing_here";
  CHECK_STATUS(tandem_scheduler_submit(sched, &rp, &r), TANDEM_E_INVALID_ARG);
  CHECK(r == NULL);
  CHECK_OK(tandem_scheduler_free(sched));
  CHECK_OK(tandem_session_free(s));
}

int main(int argc, char** argv) {
  golden_case g;
  (void)argc;
  (void)argv;
  find_data();
  snprintf(g_tmpdir, sizeof g_tmpdir, "/tmp/tandem-c-api.XXXXXX");
  if (mkdtemp(g_tmpdir) == NULL) {
    perror("mkdtemp");
    return 2;
  }
  printf("tandem %s (header %s), model %s\n", tandem_version(), TANDEM_VERSION_STRING, g_model_path);
  if (!load_golden("once_upon", &g)) {
    fprintf(stderr, "cannot read the golden case once_upon from %s\n", g_golden_path);
    return 2;
  }

  test_version_and_names();
  test_init_functions();
  test_struct_layout();
  REQUIRE_OK(tandem_model_load(g_model_path, NULL, &g_model));
  test_model_info();
  test_null_handles();
  test_failed_create();
  test_handle_registry();
  test_tokenizer(&g);
  test_session_eval(&g);
  test_generate_golden(&g);
  test_generate_errors(&g);
  test_callback_stop_and_stop_strings(&g);
  test_sampling_seed(&g);
  test_reentrant_calls(&g);
  test_two_threads(&g);
  test_lifetimes_and_parallel(&g);
  test_last_error_is_per_thread();
  test_session_save_restore(&g);
  test_scheduler_golden(&g);
  test_scheduler_choices(&g);
  test_scheduler_lifecycle(&g);
  test_scheduler_errors();
  test_version_number();
  test_devices_and_executors();
  test_metadata_and_chat();
  test_session_abort(&g);
  test_scheduler_sessions_and_waits(&g);
  test_scheduler_session_park(&g);
  test_scheduler_session_save(&g);
  test_shared_pool(&g);
  test_logprobs(&g);
  test_grammar(&g);
  CHECK_OK(tandem_model_free(g_model));
  CHECK_STATUS(tandem_model_free(g_model), TANDEM_E_INVALID_HANDLE);

  rmdir(g_tmpdir);
  printf("%d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
