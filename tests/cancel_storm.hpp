// The cancel storm of the scheduler lifecycle tests (CPU and cpu+gpu): many requests, each
// cancelled at a random stage, from its own callback or from outside.
#pragma once

#include <catch2/catch.hpp>

#include <atomic>
#include <chrono>
#include <random>
#include <thread>
#include <vector>

#include "tandem/sched/scheduler.hpp"

namespace tandem::test {

struct CancelStorm {
  explicit CancelStorm(int n) : handles(size_t(n)), finals(size_t(n)), tokens(size_t(n)), cancel_at(size_t(n)) {}

  std::vector<RequestHandle> handles;
  std::vector<std::atomic<int>> finals, tokens;  // per request: final events, token events
  std::vector<int> cancel_at;

  /// Submits make(i) for i in [0, n) to `sched`. Request i cancels itself (its callback
  /// returns false) at its cancel_at[i]-th token, drawn from rng in [0, max_cancel_at);
  /// 0 means never from the callback. After a request with cancel_at 0, and after a random
  /// quarter of the others, the caller's thread sleeps up to max_sleep_us and cancels a
  /// random request submitted so far.
  template <class Make>
  void submit(Scheduler& sched, std::mt19937& rng, int max_cancel_at, unsigned max_sleep_us, Make&& make) {
    const int n = static_cast<int>(handles.size());
    for (int i = 0; i < n; ++i) {
      cancel_at[size_t(i)] = int(rng() % unsigned(max_cancel_at));
      Request r = make(i);
      r.on_event = [this, i](const RequestEvent& ev) {
        if (ev.final) {
          ++finals[size_t(i)];
          return true;
        }
        return ++tokens[size_t(i)] != cancel_at[size_t(i)];  // false = cancel via the callback
      };
      handles[size_t(i)] = sched.submit(std::move(r));
      if (cancel_at[size_t(i)] == 0 || rng() % 4 == 0) {
        std::this_thread::sleep_for(std::chrono::microseconds(rng() % max_sleep_us));
        sched.cancel(handles[size_t(rng() % size_t(i + 1))]);
      }
    }
  }

  /// After the scheduler has released everything: every request is done with exactly one
  /// final event. Returns how many finished cancelled.
  int check_and_count_cancelled() {
    int cancelled = 0;
    for (size_t i = 0; i < handles.size(); ++i) {
      CHECK(handles[i].done());
      CHECK(finals[i].load() == 1);
      if (handles[i].wait().finish == RequestFinish::kCancelled) ++cancelled;
    }
    return cancelled;
  }
};

}  // namespace tandem::test
