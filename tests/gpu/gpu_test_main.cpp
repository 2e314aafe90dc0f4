// Entry point of tandem-gpu-tests, the tests that need a CUDA device (a real one, or the
// cuemu emulator of a TANDEM_CUDA_EMU build). Without a device (or in a build without
// CUDA) it runs nothing and exits with kSkipReturnCode, which ctest reports as skipped
// (SKIP_RETURN_CODE in tests/gpu/CMakeLists.txt); listing the tests always works.
#define CATCH_CONFIG_RUNNER
#include <catch2/catch.hpp>

#include <cstdio>

#include "gpu_test_support.hpp"

int main(int argc, char* argv[]) {
  Catch::Session session;
  if (const int rc = session.applyCommandLine(argc, argv); rc != 0) return rc;
  const Catch::ConfigData& c = session.configData();
  const bool listing = c.listTests || c.listTags || c.listReporters || c.listTestNamesOnly || c.showHelp;
  if (!listing && tandem::test::visible_gpus() == 0) {
    std::printf("SKIPPED: no CUDA device (%s): the GPU tests did not run\n",
                tandem::test::kBuiltWithCuda ? "none visible" : "built without CUDA");
    return tandem::test::kSkipReturnCode;
  }
  return session.run();
}
