// FileSizeLimit: a full disk on demand. Sets RLIMIT_FSIZE (the limit `ulimit -f` sets) for
// this process while in scope and ignores SIGXFSZ, so a write or posix_fallocate past
// `bytes` fails with EFBIG, the errno a full filesystem's ENOSPC shares every code path
// with. Restores both on destruction. Used by one test thread at a time.
#pragma once

#include <signal.h>
#include <sys/resource.h>

#include <cstdint>

namespace tandem::test {

class FileSizeLimit {
 public:
  explicit FileSizeLimit(uint64_t bytes) {
    ::getrlimit(RLIMIT_FSIZE, &old_);
    rlimit lim = old_;
    lim.rlim_cur = static_cast<rlim_t>(bytes);
    old_handler_ = ::signal(SIGXFSZ, SIG_IGN);
    ::setrlimit(RLIMIT_FSIZE, &lim);
  }
  ~FileSizeLimit() {
    ::setrlimit(RLIMIT_FSIZE, &old_);
    ::signal(SIGXFSZ, old_handler_);
  }
  FileSizeLimit(const FileSizeLimit&) = delete;
  FileSizeLimit& operator=(const FileSizeLimit&) = delete;

 private:
  rlimit old_{};
  sighandler_t old_handler_ = SIG_DFL;
};

}  // namespace tandem::test
