// Standard output of the command-line tools: a failed write (a full disk, /dev/full, a
// closed pipe: SIGPIPE is ignored, so EPIPE) is an error the tool reports with the failing
// write's own errno and exit status 1, never a kill or a silent success.
#pragma once

#include <string_view>

namespace tandem::cli {

/// Writes `text` to stdout and flushes it. False once a write failed (its errno is kept for
/// finish_stdout) or an interrupt arrived (cli_signals.hpp); EINTR from an interrupt is not
/// a failure. Not thread-safe (the tools write stdout from one thread).
bool write_stdout(std::string_view text);

/// Flushes std::cout and stdout. After a failed write prints "<tool>: error: cannot write
/// standard output: <reason>" on stderr (the reason of the first failed write_stdout, else
/// of this flush) and returns 1 when `rc` is 0, else `rc`; otherwise returns `rc`.
int finish_stdout(std::string_view tool, int rc);

}  // namespace tandem::cli
