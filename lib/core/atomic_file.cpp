#include "tandem/core/atomic_file.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>

#include <atomic>
#include <cerrno>
#include <cstring>

#include "tandem/core/error.hpp"

namespace tandem {

namespace {

const char* kind_of(mode_t m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISSOCK(m)) return "a socket";
  return "not a regular file";
}

}  // namespace

std::filesystem::path resolve_save_target(const std::filesystem::path& path) {
  std::filesystem::path p = path;
  for (int hop = 0;; ++hop) {
    struct stat st {};
    if (::lstat(p.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) break;
    if (hop == 40) {
      throw Error(ErrorCode::kIo, fmt::format("cannot save '{}': too many levels of symbolic links", path.string()));
    }
    std::error_code ec;
    const std::filesystem::path link = std::filesystem::read_symlink(p, ec);
    if (ec) throw Error(ErrorCode::kIo, fmt::format("cannot save '{}': {}", path.string(), ec.message()));
    p = link.is_absolute() ? link : p.parent_path() / link;
  }
  const std::filesystem::path name = p.filename();
  if (name.empty() || name == "." || name == "..") {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("cannot save '{}': the path names a directory", path.string()));
  }
  std::error_code ec;
  const std::filesystem::path dir =
      std::filesystem::canonical(p.has_parent_path() ? p.parent_path() : std::filesystem::path("."), ec);
  if (ec) {
    throw Error(ErrorCode::kIo, fmt::format("cannot save '{}': directory '{}': {}", path.string(),
                                            p.parent_path().string(), ec.message()));
  }
  return dir / name;
}

AtomicFileWriter::AtomicFileWriter(const std::filesystem::path& path) : requested_(path) {
  if (path.empty()) throw Error(ErrorCode::kInvalidArgument, "cannot save: empty file name");
  target_ = resolve_save_target(path);
  struct stat st {};
  const bool exists = ::stat(target_.c_str(), &st) == 0;
  if (exists && !S_ISREG(st.st_mode)) {
    throw Error(ErrorCode::kInvalidArgument,
                fmt::format("cannot save '{}': it is {}, refusing to replace it (give a regular file's path)",
                            path.string(), kind_of(st.st_mode)));
  }
  static std::atomic<uint64_t> counter{0};
  for (int attempt = 0; fd_ < 0; ++attempt) {
    temp_ = target_.parent_path() /
            fmt::format(".{}.tmp-{}-{}", target_.filename().string(), ::getpid(), counter.fetch_add(1));
    // A new file gets 0666 minus the umask (the kernel applies it); an existing one keeps its bits.
    fd_ = ::open(temp_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, exists ? 0600 : 0666);
    if (fd_ < 0 && (errno != EEXIST || attempt == 100)) {
      throw Error(ErrorCode::kIo, fmt::format("cannot save '{}': cannot create a temporary file in '{}': {}",
                                              path.string(), target_.parent_path().string(), errno_message(errno)));
    }
  }
  if (exists) {
    // Owner and group are kept where we may set them (root, or the file is ours already).
    if (::fchown(fd_, st.st_uid, st.st_gid) != 0) errno = 0;
    if (::fchmod(fd_, st.st_mode & 07777) != 0) fail("cannot set the permissions of");
  }
}

AtomicFileWriter::~AtomicFileWriter() {
  if (fd_ >= 0) ::close(fd_);
  if (!temp_.empty()) ::unlink(temp_.c_str());
}

void AtomicFileWriter::fail(const char* what) {
  const int err = errno;
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  ::unlink(temp_.c_str());
  temp_.clear();
  throw Error(ErrorCode::kIo, fmt::format("cannot save '{}': {} '{}': {}; '{}' is unchanged", requested_.string(), what,
                                          target_.parent_path().string(), errno_message(err), requested_.string()));
}

void AtomicFileWriter::write(const void* data, size_t n) {
  if (fd_ < 0) throw Error(ErrorCode::kInvalidArgument, "AtomicFileWriter: write after commit or failure");
  const auto* p = static_cast<const char*>(data);
  while (n > 0) {
    const ssize_t w = ::write(fd_, p, n);
    if (w < 0 && errno == EINTR) continue;
    if (w < 0) fail("cannot write a temporary file in");
    if (w == 0) {
      errno = ENOSPC;
      fail("cannot write a temporary file in");
    }
    p += w;
    n -= size_t(w);
  }
}

void AtomicFileWriter::commit() {
  if (fd_ < 0) throw Error(ErrorCode::kInvalidArgument, "AtomicFileWriter: commit after commit or failure");
  if (::fsync(fd_) != 0) fail("cannot sync a temporary file in");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) fail("cannot close a temporary file in");
  if (::rename(temp_.c_str(), target_.c_str()) != 0) fail("cannot rename a temporary file in");
  temp_.clear();
  // The rename is durable once the directory is synced; a failure here cannot be undone
  // (the new file is in place) and some filesystems refuse fsync on directories.
  if (const int dfd = ::open(target_.parent_path().c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC); dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomic(const std::filesystem::path& path, std::span<const std::byte> data) {
  AtomicFileWriter w(path);
  w.write(data.data(), data.size());
  w.commit();
}

}  // namespace tandem
