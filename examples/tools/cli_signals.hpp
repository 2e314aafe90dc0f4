// Interrupts for the command-line tools: the first SIGINT, SIGTERM or SIGHUP asks the tool
// to stop at the next token boundary (it then saves its work and exits with 128 + the
// signal's number, e.g. 130 for Ctrl-C); a second one ends the process at once with that
// status. SIGXFSZ is ignored, so a file size limit (ulimit -f) is an EFBIG error that the
// tool reports instead of a kill; SIGPIPE too, so a closed stdout pipe is an EPIPE write
// error (exit 1) instead of a kill.
#pragma once

namespace tandem::cli {

/// Installs the handlers (no SA_RESTART: a blocking read of stdin returns at the first
/// signal). Call once, before any thread starts.
void install_interrupt_handlers();
/// True once a first interrupt arrived. Async-signal-safe, lock-free.
bool interrupted() noexcept;
/// 128 + the first interrupt's signal number (0 when none arrived).
int interrupt_exit_code() noexcept;

}  // namespace tandem::cli
