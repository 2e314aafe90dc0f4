#include "kv/kv_page_file.hpp"

#include <fcntl.h>
#include <signal.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <charconv>
#include <cstdlib>
#include <cstring>
#include <string_view>

#include "tandem/core/error.hpp"

namespace tandem {

namespace {

constexpr std::string_view kPrefix = "tandem-kv-";
constexpr std::string_view kSuffix = ".pages";

// The PID in "tandem-kv-PID-N.pages", or -1 when the name is not a page file's.
pid_t page_file_pid(std::string_view name) {
  if (!name.starts_with(kPrefix) || !name.ends_with(kSuffix)) return -1;
  name.remove_prefix(kPrefix.size());
  name.remove_suffix(kSuffix.size());
  const size_t dash = name.find('-');
  if (dash == std::string_view::npos || dash == 0 || dash + 1 == name.size()) return -1;
  long pid = 0;
  const auto [end, ec] = std::from_chars(name.data(), name.data() + dash, pid);
  if (ec != std::errc() || end != name.data() + dash || pid <= 0) return -1;
  uint64_t n = 0;
  const auto [end2, ec2] = std::from_chars(name.data() + dash + 1, name.data() + name.size(), n);
  if (ec2 != std::errc() || end2 != name.data() + name.size()) return -1;
  return static_cast<pid_t>(pid);
}

bool process_alive(pid_t pid) {
  return pid == ::getpid() || ::kill(pid, 0) == 0 || errno == EPERM;
}

}  // namespace

std::filesystem::path kv_page_file_dir(const std::filesystem::path& dir) {
  std::filesystem::path d = dir;
  std::string from;
  if (d.empty()) {
    const char* env = std::getenv("TMPDIR");  // NOLINT(concurrency-mt-unsafe): the library never calls setenv
    d = env && *env ? env : "/tmp";
    if (env && *env) from = " (from TMPDIR)";
  }
  struct stat st {};
  if (::stat(d.c_str(), &st) != 0) {
    throw Error(ErrorCode::kIo,
                fmt::format("KV file tier: directory '{}'{}: {}", d.string(), from, errno_message(errno)));
  }
  if (!S_ISDIR(st.st_mode)) {
    throw Error(ErrorCode::kIo, fmt::format("KV file tier: '{}'{} is not a directory", d.string(), from));
  }
  return d;
}

int32_t remove_stale_kv_page_files(const std::filesystem::path& dir) {
  int32_t removed = 0;
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    const pid_t pid = page_file_pid(name);
    if (pid < 0 || process_alive(pid)) continue;
    const int fd = ::open(it->path().c_str(), O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) continue;
    struct stat st {};
    // Only a regular file whose lock is free: a live owner (in another PID namespace, say)
    // holds its lock until it has unlinked the name.
    if (::fstat(fd, &st) == 0 && S_ISREG(st.st_mode) && ::flock(fd, LOCK_EX | LOCK_NB) == 0 &&
        ::unlink(it->path().c_str()) == 0) {
      ++removed;
    }
    ::close(fd);
  }
  return removed;
}

int create_kv_page_file(const std::filesystem::path& dir, std::filesystem::path& path) {
  remove_stale_kv_page_files(dir);
  static std::atomic<uint64_t> counter{0};
  path = dir / fmt::format("{}{}-{}{}", kPrefix, ::getpid(), counter.fetch_add(1), kSuffix);
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) {
    throw Error(ErrorCode::kIo,
                fmt::format("KV store: cannot create the file tier '{}': {}", path.string(), errno_message(errno)));
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0 || ::unlink(path.c_str()) != 0) {
    const int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    throw Error(ErrorCode::kIo, fmt::format("KV store: cannot lock and unlink the file tier '{}': {}", path.string(),
                                            errno_message(err)));
  }
  return fd;
}

void grow_kv_page_file(int fd, const std::filesystem::path& path, off_t offset, off_t bytes) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    throw Error(ErrorCode::kIo, fmt::format("KV file tier '{}': fstat: {}", path.string(), errno_message(errno)));
  }
  if (st.st_size >= offset + bytes) return;
  // posix_fallocate returns the error (it does not set errno). A file size limit also
  // raises SIGXFSZ, whose default action ends the process: tools that want EFBIG as an
  // error ignore SIGXFSZ (tandem-cli does).
  const int err = ::posix_fallocate(fd, offset, bytes);
  if (err != 0) {
    if (::ftruncate(fd, st.st_size) != 0) errno = 0;  // best effort: give back partly allocated blocks
    throw Error(ErrorCode::kIo, fmt::format("KV file tier: cannot grow '{}' (unlinked) to {} bytes: {}", path.string(),
                                            static_cast<long long>(offset + bytes), errno_message(err)));
  }
}

}  // namespace tandem
