// AtomicFileWriter: replace a file so that its path always names either the complete old
// contents or the complete new ones, never a mix, a truncated file or a changed kind of
// file. Every Tandem writer of user-named files (session saves, GGUF files, logits dumps)
// goes through it.
//
// Steps (POSIX rename(2) semantics, as SQLite and git do it):
//   1. resolve the target: symbolic links are followed (to any depth, max 40 hops) so the
//      link stays and its final target is updated; the temporary file goes in that real
//      directory, so the rename never crosses a filesystem;
//   2. refuse an existing target that is not a regular file (directory, character or block
//      device such as /dev/full, FIFO, socket) with kInvalidArgument, before writing;
//   3. write a uniquely named temporary file ".NAME.tmp-PID-N" there, created with the
//      target's permission bits (a new file gets 0666 minus the umask, like fopen);
//   4. fsync the file, close it, rename it over the target, fsync the directory.
// Any failure (ENOSPC, EFBIG, EIO, ...) removes the temporary file and throws kIo with the
// errno text; the file at the path is then exactly what it was before.
//
// Thread-safety: one writer per object; distinct objects may write the same path from
// several threads or processes (each has its own temporary; the last rename wins).
#pragma once

#include <cstddef>
#include <filesystem>
#include <span>

namespace tandem {

class AtomicFileWriter {
 public:
  /// Resolves and checks `path` and creates the temporary file. Throws kInvalidArgument for
  /// an empty path or a target that is not a regular file, kIo when the directory is
  /// missing or not writable (message names the path and the errno text).
  explicit AtomicFileWriter(const std::filesystem::path& path);
  /// Without commit(): closes and removes the temporary file; the target is untouched.
  ~AtomicFileWriter();
  AtomicFileWriter(const AtomicFileWriter&) = delete;
  AtomicFileWriter& operator=(const AtomicFileWriter&) = delete;

  /// Appends `n` bytes. Throws kIo (e.g. "No space left on device"); the target is untouched.
  void write(const void* data, size_t n);
  /// fsync + close + rename over the target + fsync of the directory. Throws kIo; on a
  /// failure before the rename the target is untouched. Call once.
  void commit();
  /// The path that is replaced: `path` with symbolic links resolved.
  const std::filesystem::path& target() const noexcept { return target_; }

 private:
  [[noreturn]] void fail(const char* what);
  std::filesystem::path requested_;
  std::filesystem::path target_;
  std::filesystem::path temp_;
  int fd_ = -1;
};

/// The file a save to `path` replaces: symbolic links of the last component followed (to
/// any depth, max 40 hops), the directory made canonical. Throws kIo when the directory is
/// missing, kInvalidArgument when `path` names a directory ("x/", ".").
std::filesystem::path resolve_save_target(const std::filesystem::path& path);

/// Writes `data` to `path` through an AtomicFileWriter (errors as above).
void write_file_atomic(const std::filesystem::path& path, std::span<const std::byte> data);

}  // namespace tandem
