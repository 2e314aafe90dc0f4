/*
 * The C ABI test program: compiled as C99 (not C++), run by ctest in the Release and the
 * ASan+UBSan builds. It calls every function of cabi/include/tandem.h, including every
 * error path: NULL handles and arguments, freed / foreign / wrong-kind handles, double
 * free, bad struct_size, invalid UTF-8, small buffers, a callback that stops, a callback
 * that frees its session, a session used from two threads (refused with TANDEM_E_BUSY),
 * and the field case B21 (failed create, NULL to every function, double free). It
 * generates with the aidreams260K model and checks against the golden continuation.
 *
 * Data: TANDEM_SHARED (default: <source>/../shared), TANDEM_MODELS (default
 * $TANDEM_SHARED/models). Exit status 0 when every check passed.
 */
#define _POSIX_C_SOURCE 200809L

#include <math.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tandem.h"

/* ---- tiny harness --------------------------------------------------------------------- */

static int g_checks = 0;
static int g_failures = 0;

#define CHECK(cond)                                                              \
  do {                                                                           \
    ++g_checks;                                                                  \
    if (!(cond)) {                                                               \
      ++g_failures;                                                              \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
    }                                                                            \
  } while (0)

#define CHECK_STATUS(expr, want)                                                              \
  do {                                                                                        \
    tandem_status st_ = (expr);                                                               \
    ++g_checks;                                                                               \
    if (st_ != (want)) {                                                                      \
      ++g_failures;                                                                           \
      fprintf(stderr, "%s:%d: %s\n  returned %s (%d), expected %s; last error: %s\n", __FILE__, \
              __LINE__, #expr, tandem_status_name(st_), (int)st_, tandem_status_name(want),   \
              tandem_last_error());                                                           \
    }                                                                                         \
  } while (0)

#define CHECK_OK(expr) CHECK_STATUS(expr, TANDEM_OK)

/* Stop the program: a precondition of the remaining checks failed. */
#define REQUIRE_OK(expr)                                                                  \
  do {                                                                                    \
    tandem_status st_ = (expr);                                                           \
    if (st_ != TANDEM_OK) {                                                               \
      fprintf(stderr, "%s:%d: %s returned %s: %s\n", __FILE__, __LINE__, #expr,           \
              tandem_status_name(st_), tandem_last_error());                              \
      exit(2);                                                                            \
    }                                                                                     \
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
  if (cp < 0x80) { tmp[0] = (char)cp; n = 1; }
  else if (cp < 0x800) { tmp[0] = (char)(0xC0 | (cp >> 6)); tmp[1] = (char)(0x80 | (cp & 0x3F)); n = 2; }
  else if (cp < 0x10000) {
    tmp[0] = (char)(0xE0 | (cp >> 12)); tmp[1] = (char)(0x80 | ((cp >> 6) & 0x3F));
    tmp[2] = (char)(0x80 | (cp & 0x3F)); n = 3;
  } else {
    tmp[0] = (char)(0xF0 | (cp >> 18)); tmp[1] = (char)(0x80 | ((cp >> 12) & 0x3F));
    tmp[2] = (char)(0x80 | ((cp >> 6) & 0x3F)); tmp[3] = (char)(0x80 | (cp & 0x3F)); n = 4;
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
        case 'n': if (w < end) *w++ = '\n'; ++p; break;
        case 't': if (w < end) *w++ = '\t'; ++p; break;
        case 'r': if (w < end) *w++ = '\r'; ++p; break;
        case 'b': if (w < end) *w++ = '\b'; ++p; break;
        case 'f': if (w < end) *w++ = '\f'; ++p; break;
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
        default: if (w < end) *w++ = *p; ++p; break; /* \" \\ \/ */
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
  if (c == NULL) { free(json); return 0; }
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
  int stop_after;          /* >0: return nonzero on this call */
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

#define CHECK_INIT(fn, type)                                                              \
  do {                                                                                    \
    CHECK_STATUS(fn(NULL, sizeof(type)), TANDEM_E_INVALID_ARG);                           \
    CHECK_STATUS(fn((type*)big, 0), TANDEM_E_INVALID_ARG);                                \
    CHECK_STATUS(fn((type*)big, sizeof(size_t)), TANDEM_E_INVALID_ARG);                   \
    CHECK_STATUS(fn((type*)big, sizeof(type) - 1), TANDEM_E_INVALID_ARG);                 \
    memset(big, 0xAB, sizeof big);                                                        \
    CHECK_OK(fn((type*)big, sizeof(type) + 64));                                          \
    CHECK(((type*)big)->struct_size == sizeof(type) + 64);                                \
    CHECK(big[sizeof(type) + 63] == 0); /* the tail the library does not know: zeroed */  \
    CHECK(big[sizeof(type) + 64] == 0xAB); /* nothing past struct_size */                 \
  } while (0)
  CHECK_INIT(tandem_model_params_init, tandem_model_params);
  CHECK_INIT(tandem_model_info_init, tandem_model_info);
  CHECK_INIT(tandem_session_params_init, tandem_session_params);
  CHECK_INIT(tandem_session_info_init, tandem_session_info);
  CHECK_INIT(tandem_sampling_params_init, tandem_sampling_params);
  CHECK_INIT(tandem_generate_params_init, tandem_generate_params);
  CHECK_INIT(tandem_generate_result_init, tandem_generate_result);
#undef CHECK_INIT

  CHECK_OK(tandem_model_params_init(&mp, sizeof mp));
  CHECK(mp.struct_size == sizeof mp && mp.check_block_scales == 1 && mp.max_alignment == (1u << 20));
  CHECK_OK(tandem_model_info_init(&mi, sizeof mi));
  CHECK(mi.struct_size == sizeof mi && mi.arch == NULL && mi.n_vocab == 0);
  CHECK_OK(tandem_session_params_init(&sp, sizeof sp));
  CHECK(sp.n_ctx == 0 && sp.n_batch == 512 && sp.page_size == 16 && sp.n_threads == 0);
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
}

/* ABI layout of version 0.1 on LP64: a change here is an ABI break (bump
 * TANDEM_ABI_VERSION and update cabi/abi/tandem.symbols' header comment). */
static void test_struct_layout(void) {
  if (sizeof(void*) != 8) return;
  CHECK(sizeof(tandem_model_params) == 16);
  CHECK(offsetof(tandem_model_params, check_block_scales) == 8);
  CHECK(offsetof(tandem_model_params, max_alignment) == 12);
  CHECK(sizeof(tandem_model_info) == 64);
  CHECK(offsetof(tandem_model_info, arch) == 8);
  CHECK(offsetof(tandem_model_info, name) == 16);
  CHECK(offsetof(tandem_model_info, n_vocab) == 24);
  CHECK(offsetof(tandem_model_info, token_eos) == 52);
  CHECK(offsetof(tandem_model_info, weight_bytes) == 56);
  CHECK(sizeof(tandem_session_params) == 24);
  CHECK(offsetof(tandem_session_params, n_threads) == 20);
  CHECK(sizeof(tandem_session_info) == 32);
  CHECK(offsetof(tandem_session_info, has_logits) == 28);
  CHECK(sizeof(tandem_sampling_params) == 48);
  CHECK(offsetof(tandem_sampling_params, presence_penalty) == 36);
  CHECK(offsetof(tandem_sampling_params, seed) == 40);
  CHECK(sizeof(tandem_generate_params) == 40);
  CHECK(offsetof(tandem_generate_params, sampling) == 8);
  CHECK(offsetof(tandem_generate_params, stop) == 16);
  CHECK(offsetof(tandem_generate_params, n_stop) == 24);
  CHECK(offsetof(tandem_generate_params, max_tokens) == 32);
  CHECK(offsetof(tandem_generate_params, flags) == 36);
  CHECK(sizeof(tandem_generate_result) == 80);
  CHECK(offsetof(tandem_generate_result, tokens) == 8);
  CHECK(offsetof(tandem_generate_result, text_cap) == 32);
  CHECK(offsetof(tandem_generate_result, n_tokens) == 40);
  CHECK(offsetof(tandem_generate_result, finish_reason) == 56);
  CHECK(offsetof(tandem_generate_result, prompt_seconds) == 64);
  CHECK(offsetof(tandem_generate_result, generate_seconds) == 72);
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
  static const char* bad_utf8[] = {"\xff", "ab\xc0\x80", "\xed\xa0\x80", "x\xe2\x82", "\xf4\x90\x80\x80",
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
  CHECK_STATUS(tandem_tokenize(g_model, text, len, TANDEM_TOKENIZE_ADD_SPECIAL, ids, 3, &n),
               TANDEM_E_BUFFER_TOO_SMALL);
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
    CHECK_STATUS(tandem_tokenize(g_model, bad_utf8[i], strlen(bad_utf8[i]), 0, ids, 256, &n),
                 TANDEM_E_INVALID_ARG);
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
  CHECK_OK(tandem_detokenize(g_model, g->prompt_ids, g->n_prompt, TANDEM_DETOKENIZE_REMOVE_SPECIAL, buf,
                             sizeof buf, &n));
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
  CHECK_STATUS(tandem_session_eval(s, g->prompt_ids, g->n_prompt, logits, (size_t)g_n_vocab), TANDEM_E_BUFFER_TOO_SMALL);
  /* A bad id: refused, nothing evaluated. */
  memcpy(ids, g->prompt_ids, g->n_prompt * sizeof(int32_t));
  ids[2] = g_n_vocab;
  CHECK_STATUS(tandem_session_eval(s, ids, g->n_prompt, NULL, 0), TANDEM_E_INVALID_ARG);
  /* Too many tokens for n_ctx 32. */
  CHECK_STATUS(tandem_session_eval(s, ids, (size_t)INT32_MAX + 1, NULL, 0), TANDEM_E_INVALID_ARG); /* absurd count */
  CHECK_STATUS(tandem_session_generate_tokens(s, ids, (size_t)INT32_MAX + 1, NULL, NULL, NULL, NULL), TANDEM_E_INVALID_ARG);
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
  printf("  %s: %zu of %zu greedy ids equal the golden continuation (%zu required)\n", what, same, g->n_greedy,
         clear);
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
  CHECK_STATUS(tandem_session_generate(s, "Hi", (tandem_generate_params*)big, NULL, NULL, NULL),
               TANDEM_E_INVALID_ARG);
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
  CHECK_STATUS(tandem_session_generate(s, "Once upon a time there was a little machine that hummed in a "
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
  tandem_status generate_status, info_status, eval_status, reset_status, logits_status, tokens_status,
      other_status, free_status;
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

int main(int argc, char** argv) {
  golden_case g;
  (void)argc;
  (void)argv;
  find_data();
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
  CHECK_OK(tandem_model_free(g_model));
  CHECK_STATUS(tandem_model_free(g_model), TANDEM_E_INVALID_HANDLE);

  printf("%d checks, %d failed\n", g_checks, g_failures);
  return g_failures == 0 ? 0 : 1;
}
