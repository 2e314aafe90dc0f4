// SessionFileLock: one run of tandem-cli at a time per --session file. The lock (flock
// LOCK_EX, advisory) is held from before the restore until after the save, so concurrent
// runs sharing a file take turns: each one continues the conversation the previous one
// saved and no run's tokens are lost. Saving replaces the file by rename (a new inode,
// include/tandem/core/atomic_file.hpp), so after the lock is taken the path is checked to still
// name the locked file, and the lock is retaken on the new file otherwise.
//
// A missing file is created empty (the lock needs a file to hold); an empty file means
// "no saved session yet", and the empty file is removed again if the run saves nothing.
#pragma once

#include <filesystem>

namespace tandem::cli {

class SessionFileLock {
 public:
  /// Waits for the lock on the file `path` names (symbolic links followed), saying so on
  /// stderr when another run holds it. Throws std::runtime_error naming the path when it
  /// cannot be opened or is not a regular file, tandem::Error when its directory is missing.
  explicit SessionFileLock(const std::filesystem::path& path);
  ~SessionFileLock();
  SessionFileLock(const SessionFileLock&) = delete;
  SessionFileLock& operator=(const SessionFileLock&) = delete;

  /// True when the file holds a saved session (it is not empty).
  bool has_saved_state() const;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  bool created_ = false;
};

}  // namespace tandem::cli
