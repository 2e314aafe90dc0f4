// A persistent pool of worker threads for data-parallel kernels.
//
// parallel_for() splits [0, n) into a few contiguous chunks per thread, which the calling
// thread and the workers claim with an atomic counter; it returns when every chunk is
// done. A worker the OS does not schedule (a busy machine) simply claims nothing, so the
// step slows down in proportion to the CPU it lost instead of waiting for that thread.
// Dispatch does no heap allocation (the task is passed by reference). It takes two
// locks: the run mutex (below) and, briefly, the sleep mutex to publish the new task to
// sleeping workers (workers wait on an atomic generation counter, spinning briefly, then
// sleeping). With one caller neither is contended.
//
// Thread-safety: one parallel_for at a time per pool. Calls from several threads (several
// executors sharing one node pool: CpuQ4Executor::node_pool) are serialised by the run
// mutex: their steps take turns on the same cores instead of oversubscribing them, and a
// caller waiting its turn sleeps.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace tandem {

/// Number of physical cores (hyper-threads counted once), at least 1.
int physical_core_count() noexcept;

class ThreadPool {
 public:
  static constexpr int kMaxThreads = 512;
  /// n_threads <= 0 selects physical_core_count(); at most kMaxThreads. Throws
  /// Error(kInvalidArgument) above that, Error(kOutOfMemory) when the threads cannot be
  /// started (none is left running then).
  /// `thread_init`, when given, runs once on each worker thread before its first task
  /// (e.g. to allocate per-thread scratch outside the per-token path); the constructor
  /// returns after every worker has run it.
  explicit ThreadPool(int n_threads = 0, std::function<void()> thread_init = {});
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const noexcept { return n_threads_; }

  /// Run fn(begin, end, thread_index) over [0, n) split into chunks whose boundaries are
  /// multiples of `grain` (except the last); a thread may run several chunks, and
  /// thread_index (0 = the caller) identifies the running thread. fn must not throw.
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
  void work(int t);
  void worker(int t);
  void stop_workers() noexcept;

  int n_threads_;
  std::function<void()> thread_init_;
  std::vector<std::thread> workers_;
  std::mutex run_mutex_;
  std::mutex sleep_mutex_;
  std::condition_variable wake_;
  const Task* task_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  int64_t n_chunks_ = 0;  // of the current task (written before open_ is set)
  int64_t grains_per_chunk_ = 0;
  std::atomic<int64_t> next_chunk_{0};
  std::atomic<int64_t> done_chunks_{0};
  std::atomic<bool> open_{false};  // the current task accepts workers
  std::atomic<int> active_{0};     // workers inside the current task
  std::atomic<int> started_{0};    // workers past thread_init
  std::atomic<bool> stop_{false};
};

}  // namespace tandem
