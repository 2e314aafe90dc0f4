// Standard output of the command-line tools (cli_stdout.hpp).
#include "cli_stdout.hpp"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <iostream>

#include "cli_signals.hpp"

namespace tandem::cli {

namespace {
int g_write_errno = 0;  // errno of the first failed write_stdout
}

bool write_stdout(std::string_view text) {
  errno = 0;
  if (!text.empty()) std::fwrite(text.data(), 1, text.size(), stdout);
  std::fflush(stdout);
  if (std::ferror(stdout) && errno == EINTR && interrupted()) std::clearerr(stdout);  // not a failure
  if (std::ferror(stdout) && g_write_errno == 0) g_write_errno = errno ? errno : EIO;
  return !interrupted() && !std::ferror(stdout);
}

int finish_stdout(std::string_view tool, int rc) {
  errno = 0;
  std::cout.flush();
  if (std::fflush(stdout) != 0 || std::ferror(stdout) || !std::cout) {
    const int e = g_write_errno ? g_write_errno : errno ? errno : EIO;
    std::fprintf(stderr, "%.*s: error: cannot write standard output: %s\n", int(tool.size()), tool.data(),
                 std::strerror(e));
    return rc == 0 ? 1 : rc;
  }
  return rc;
}

}  // namespace tandem::cli
