// The one C ABI property a C program cannot test: a C++ exception thrown by a callback
// (a C++ embedder's lambda behind the function pointer) does not cross the boundary; it
// becomes TANDEM_E_INTERNAL with a message, and the session stays usable. Also checks
// that tandem.h compiles as C++ (extern "C").
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>

#include "tandem.h"

namespace {

int failures = 0;

void check(bool ok, const char* what) {
  if (!ok) {
    ++failures;
    std::fprintf(stderr, "CHECK failed: %s (last error: %s)\n", what, tandem_last_error());
  }
}

int throwing_callback(const char*, size_t, int32_t, void* user_data) {
  ++*static_cast<int*>(user_data);
  throw std::runtime_error("thrown by the embedder's callback");
}

}  // namespace

int main() {
  const char* shared = std::getenv("TANDEM_SHARED");
  const std::string dir = shared && *shared ? shared : std::string(TANDEM_SOURCE_DIR) + "/../shared";
  const std::string path = dir + "/models/aidreams260K-q4_0.gguf";
  tandem_model* model = nullptr;
  tandem_session* session = nullptr;
  if (tandem_model_load(path.c_str(), nullptr, &model) != TANDEM_OK) {
    std::fprintf(stderr, "cannot load %s: %s\n", path.c_str(), tandem_last_error());
    return 2;
  }
  check(tandem_session_create(model, nullptr, &session) == TANDEM_OK, "create");
  tandem_generate_params gp;
  tandem_generate_params_init(&gp, sizeof gp);
  gp.max_tokens = 8;
  gp.flags = TANDEM_GENERATE_IGNORE_EOS;
  int calls = 0;
  const tandem_status st =
      tandem_session_generate(session, "Once upon a time", &gp, throwing_callback, &calls, nullptr);
  check(st == TANDEM_E_INTERNAL, "a throwing callback gives TANDEM_E_INTERNAL");
  check(calls == 1, "the callback ran once");
  check(std::strstr(tandem_last_error(), "thrown by the embedder") != nullptr, "the exception's message");
  // The session is not left busy.
  check(tandem_session_reset(session) == TANDEM_OK, "reset after the exception");
  check(tandem_session_generate(session, "Once", &gp, nullptr, nullptr, nullptr) == TANDEM_OK, "generate again");
  check(tandem_session_free(session) == TANDEM_OK, "free session");
  check(tandem_model_free(model) == TANDEM_OK, "free model");
  std::printf("C++ boundary checks: %d failed\n", failures);
  return failures == 0 ? 0 : 1;
}
