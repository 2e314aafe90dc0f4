// A persistent pool of worker threads for data-parallel kernels.
//
// parallel_for() splits [0, n) into one contiguous chunk per thread and runs them on the
// calling thread plus the workers; it returns when every chunk is done. Dispatch does no
// heap allocation (the task is passed by reference) and takes no lock on the fast path
// (workers wait on an atomic generation counter, spinning briefly, then sleeping).
//
// Thread-safety: one parallel_for at a time per pool. Calls from several threads are
// serialised by an internal mutex (the pool is owned by one executor, whose step loop is
// the only caller, so the mutex is never contended in practice).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem {

/// Number of physical cores (hyper-threads counted once), at least 1.
int physical_core_count() noexcept;

class ThreadPool {
 public:
  /// n_threads <= 0 selects physical_core_count(). Throws Error(kOutOfMemory) when the
  /// threads cannot be started (none is left running then).
  explicit ThreadPool(int n_threads = 0);
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return n_threads_; }

  /// Run fn(begin, end, thread_index) over [0, n) split into size() chunks whose
  /// boundaries are multiples of `grain` (except the last). fn must not throw.
  template <class Fn>
  void parallel_for(int64_t n, int64_t grain, Fn&& fn) {
    Task task{&invoke<std::remove_reference_t<Fn>>, &fn, n, grain < 1 ? 1 : grain};
    run(task);
  }

 private:
  struct Task {
    void (*call)(void*, int64_t, int64_t, int);
    void* fn;
    int64_t n;
    int64_t grain;
  };
  template <class Fn>
  static void invoke(void* fn, int64_t b, int64_t e, int t) {
    (*static_cast<Fn*>(fn))(b, e, t);
  }
  void run(const Task& task);
  void run_chunk(const Task& task, int t) const;
  void worker(int t);
  void stop_workers() noexcept;

  int n_threads_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  const Task* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  std::atomic<bool> stop_{false};
};

}  // namespace tandem
