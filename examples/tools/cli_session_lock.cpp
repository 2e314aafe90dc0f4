#include "cli_session_lock.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <stdexcept>

#include "tandem/core/atomic_file.hpp"

namespace tandem::cli {

namespace {

[[noreturn]] void fail(const std::filesystem::path& p, const std::string& why) {
  throw std::runtime_error(fmt::format("session file '{}': {}", p.string(), why));
}

}  // namespace

SessionFileLock::SessionFileLock(const std::filesystem::path& link) {
  // The file itself, not a symbolic link to it: the save replaces that file (atomic_file.hpp).
  path_ = resolve_save_target(link);
  const std::filesystem::path& path = path_;
  bool said = false;
  for (;;) {
    // O_NONBLOCK: opening a FIFO must not hang (it is refused below).
    const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    bool created = false;
    int f = fd;
    if (f < 0 && errno == ENOENT) {
      f = ::open(path.c_str(), O_RDONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (f < 0 && errno == EEXIST) continue;  // another run created it first
      created = f >= 0;
    }
    if (f < 0) fail(path, std::strerror(errno));
    struct stat st {};
    if (::fstat(f, &st) != 0 || !S_ISREG(st.st_mode)) {
      ::close(f);
      fail(path, "not a regular file");
    }
    if (::flock(f, LOCK_EX | LOCK_NB) != 0) {
      if (errno != EWOULDBLOCK) {
        const int err = errno;
        ::close(f);
        fail(path, std::string("cannot lock: ") + std::strerror(err));
      }
      if (!said) {
        std::fprintf(stderr, "tandem-cli: waiting for another run using %s\n", path.c_str());
        said = true;
      }
      while (::flock(f, LOCK_EX) != 0 && errno == EINTR) {
      }
    }
    // Still the file at the path? (A saving run may have replaced it meanwhile.)
    struct stat now {};
    if (::stat(path.c_str(), &now) == 0 && now.st_dev == st.st_dev && now.st_ino == st.st_ino) {
      fd_ = f;
      created_ = created;
      return;
    }
    ::close(f);
  }
}

SessionFileLock::~SessionFileLock() {
  struct stat st {
  }, now{};
  if (created_ && ::fstat(fd_, &st) == 0 && st.st_size == 0 && ::stat(path_.c_str(), &now) == 0 &&
      now.st_ino == st.st_ino && now.st_dev == st.st_dev) {
    ::unlink(path_.c_str());  // nothing was saved: leave no empty file behind
  }
  ::close(fd_);  // releases the lock
}

bool SessionFileLock::has_saved_state() const {
  struct stat st {};
  return ::stat(path_.c_str(), &st) == 0 && st.st_size > 0;
}

}  // namespace tandem::cli
