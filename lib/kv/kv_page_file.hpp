// The File KV tier's backing file (internal to lib/kv/kv_store.cpp).
//
// Lifetime. The file "tandem-kv-PID-N.pages" is created in the tier's directory, locked
// (flock LOCK_EX) and unlinked at once: the pages live in an unnamed inode that the kernel
// frees when the descriptor closes, so no exit path (return, exception, SIGINT, SIGKILL,
// a crash) leaves it behind. A name can remain only from a process killed between open()
// and unlink(), or from an older build; create_kv_page_file() first removes such stale
// files of this directory: a name whose PID is not alive and whose lock is free.
//
// Growth. grow_kv_page_file() reserves real blocks with posix_fallocate before the range
// is mapped, so a full disk (ENOSPC) or a file size limit (EFBIG) is a kIo error here and
// never a SIGBUS on a later page fault.
#pragma once

#include <sys/types.h>

#include <cstdint>
#include <filesystem>

namespace tandem {

/// The directory to use: `dir`, or when empty the temporary directory ($TMPDIR, else
/// /tmp). Throws kIo naming the directory (and TMPDIR when it came from there) when it is
/// missing or not a directory.
std::filesystem::path kv_page_file_dir(const std::filesystem::path& dir);

/// Removes stale page files (see above) in `dir`; returns how many were removed.
int32_t remove_stale_kv_page_files(const std::filesystem::path& dir);

/// Creates, locks and unlinks a new page file in `dir` (after removing stale ones).
/// Returns the descriptor; `path` receives the name it had. Throws kIo.
int create_kv_page_file(const std::filesystem::path& dir, std::filesystem::path& path);

/// Makes sure bytes [offset, offset + bytes) of the file have blocks on disk. Throws kIo
/// ("No space left on device", "File too large", ...) and restores the previous size.
void grow_kv_page_file(int fd, const std::filesystem::path& path, off_t offset, off_t bytes);

}  // namespace tandem
