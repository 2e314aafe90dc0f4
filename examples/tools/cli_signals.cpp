#include "cli_signals.hpp"

#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>

namespace tandem::cli {

namespace {

std::atomic<int> g_signal{0};
static_assert(std::atomic<int>::is_always_lock_free);

extern "C" void on_interrupt(int sig) {
  int none = 0;
  if (g_signal.compare_exchange_strong(none, sig)) {
    constexpr char msg[] =
        "\ntandem-cli: interrupted: stopping after this token or prompt chunk (again to quit at once)\n";
    [[maybe_unused]] const ssize_t w = ::write(STDERR_FILENO, msg, sizeof msg - 1);
    return;
  }
  ::_exit(128 + g_signal.load());
}

}  // namespace

void install_interrupt_handlers() {
  struct sigaction sa {};
  sa.sa_handler = on_interrupt;
  sigemptyset(&sa.sa_mask);
  sa.sa_flags = 0;
  for (int sig : {SIGINT, SIGTERM, SIGHUP}) ::sigaction(sig, &sa, nullptr);
  ::signal(SIGXFSZ, SIG_IGN);
  // A closed stdout pipe (`tandem-cli ... | head`) is a failed write (EPIPE) that the tool
  // reports and exits 1 on, after saving its session, instead of a kill by SIGPIPE.
  ::signal(SIGPIPE, SIG_IGN);
}

bool interrupted() noexcept {
  return g_signal.load(std::memory_order_relaxed) != 0;
}

int interrupt_exit_code() noexcept {
  const int s = g_signal.load(std::memory_order_relaxed);
  return s == 0 ? 0 : 128 + s;
}

}  // namespace tandem::cli
