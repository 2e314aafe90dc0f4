/*
 * tandem-generate: a program outside the Tandem project, built against the installed
 * library (CMake find_package(Tandem) or pkg-config tandem). It loads a GGUF model,
 * generates from a prompt, and streams the text to stdout.
 *
 *   tandem-generate MODEL.gguf "Once upon a time" [N_TOKENS] [--ids]
 *
 * Greedy decoding (temperature 0), end-of-generation tokens ignored. With --ids the first
 * line of stdout is the generated token ids (space-separated), then the text.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <tandem.h>

static int on_piece(const char* piece, size_t len, int32_t token, void* user_data) {
  (void)token;
  (void)user_data;
  fwrite(piece, 1, len, stdout);
  fflush(stdout);
  return 0; /* nonzero would stop the generation */
}

static int fail(const char* what, tandem_status st) {
  fprintf(stderr, "%s failed: %s (%d): %s\n", what, tandem_status_name(st), (int)st, tandem_last_error());
  return 1;
}

int main(int argc, char** argv) {
  tandem_model* model = NULL;
  tandem_session* session = NULL;
  tandem_session_params sp;
  tandem_sampling_params sampling;
  tandem_generate_params gp;
  tandem_generate_result result;
  int32_t ids[4096];
  tandem_status st;
  int print_ids = 0;
  size_t i;
  int rc = 0;

  if (argc < 3) {
    fprintf(stderr, "usage: %s MODEL.gguf PROMPT [N_TOKENS] [--ids]\n", argv[0]);
    return 2;
  }
  if (strcmp(tandem_version(), TANDEM_VERSION_STRING) != 0) {
    fprintf(stderr, "header %s but library %s\n", TANDEM_VERSION_STRING, tandem_version());
    return 1;
  }
  for (i = 3; i < (size_t)argc; ++i) {
    if (strcmp(argv[i], "--ids") == 0) print_ids = 1;
  }

  st = tandem_model_load(argv[1], NULL, &model);
  if (st != TANDEM_OK) return fail("tandem_model_load", st);

  tandem_session_params_init(&sp, sizeof sp);
  sp.n_threads = 1;
  st = tandem_session_create(model, &sp, &session);
  if (st != TANDEM_OK) {
    tandem_model_free(model);
    return fail("tandem_session_create", st);
  }
  tandem_model_free(model); /* the session keeps the model alive */

  tandem_sampling_params_init(&sampling, sizeof sampling);
  sampling.temperature = 0.0f;
  tandem_generate_params_init(&gp, sizeof gp);
  gp.sampling = &sampling;
  gp.max_tokens = argc > 3 && argv[3][0] != '-' ? atoi(argv[3]) : 64;
  gp.flags = TANDEM_GENERATE_IGNORE_EOS;
  tandem_generate_result_init(&result, sizeof result);
  result.tokens = ids;
  result.tokens_cap = sizeof ids / sizeof ids[0];

  if (print_ids) {
    /* ids first, so generate without streaming and print the text afterwards */
    static char text[1 << 16];
    result.text = text;
    result.text_cap = sizeof text;
    st = tandem_session_generate(session, argv[2], &gp, NULL, NULL, &result);
    if (st == TANDEM_OK) {
      for (i = 0; i < result.n_tokens && i < result.tokens_cap; ++i) printf(i ? " %d" : "%d", (int)ids[i]);
      printf("\n%s", text);
    }
  } else {
    st = tandem_session_generate(session, argv[2], &gp, on_piece, NULL, &result);
    printf("\n");
  }
  if (st != TANDEM_OK)
    rc = fail("tandem_session_generate", st);
  else
    fprintf(stderr, "[%zu tokens, finish reason %d]\n", result.n_tokens, (int)result.finish_reason);
  tandem_session_free(session);
  return rc;
}
