#include "tandem/core/thread_pool.hpp"

#include "tandem/core/error.hpp"

#include <algorithm>
#include <fstream>
#include <set>
#include <string>
#include <utility>

namespace tandem {

int physical_core_count() noexcept {
  // Count distinct (physical id, core id) pairs in /proc/cpuinfo; fall back to the
  // logical count when that file is unavailable.
  try {
    std::ifstream f("/proc/cpuinfo");
    std::set<std::pair<int, int>> cores;
    int phys = 0;
    std::string line;
    while (std::getline(f, line)) {
      const auto colon = line.find(':');
      if (colon == std::string::npos) continue;
      if (line.rfind("physical id", 0) == 0) phys = std::stoi(line.substr(colon + 1));
      if (line.rfind("core id", 0) == 0) cores.emplace(phys, std::stoi(line.substr(colon + 1)));
    }
    if (!cores.empty()) return static_cast<int>(cores.size());
  } catch (...) {
  }
  const unsigned n = std::thread::hardware_concurrency();
  return n == 0 ? 1 : static_cast<int>(n);
}

ThreadPool::ThreadPool(int n_threads, std::function<void()> thread_init)
    : n_threads_(n_threads > 0 ? n_threads : physical_core_count()), thread_init_(std::move(thread_init)) {
  if (n_threads_ > kMaxThreads) {
    throw Error(ErrorCode::kInvalidArgument, "thread pool: " + std::to_string(n_threads_) +
                                                 " threads requested, at most " + std::to_string(kMaxThreads));
  }
  try {
    workers_.reserve(static_cast<size_t>(n_threads_ - 1));
    for (int t = 1; t < n_threads_; ++t) workers_.emplace_back([this, t] { worker(t); });
    // Return only once every worker has run thread_init: its allocations are done here.
    while (started_.load(std::memory_order_acquire) != n_threads_ - 1) std::this_thread::yield();
  } catch (const std::exception& e) {  // std::system_error or std::bad_alloc: no threads left
    stop_workers();
    throw Error(ErrorCode::kOutOfMemory,
                "thread pool: cannot start " + std::to_string(n_threads_) + " threads: " + e.what());
  }
}

void ThreadPool::stop_workers() noexcept {
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    stop_.store(true);
  }
  wake_.notify_all();
  for (auto& w : workers_) w.join();
  workers_.clear();
}

ThreadPool::~ThreadPool() {
  stop_workers();
}

void ThreadPool::work(int t) {
  const Task& task = *task_;
  const int64_t span = grains_per_chunk_ * task.grain;
  for (;;) {
    const int64_t c = next_chunk_.fetch_add(1, std::memory_order_relaxed);
    if (c >= n_chunks_) return;
    const int64_t b = c * span;
    task.call(task.fn, b, std::min(task.n, b + span), t);
    done_chunks_.fetch_add(1, std::memory_order_acq_rel);
  }
}

void ThreadPool::run(const Task& task) {
  if (task.n <= 0) return;
  const int64_t n_grains = (task.n + task.grain - 1) / task.grain;
  if (n_threads_ == 1 || n_grains <= 1) {
    task.call(task.fn, 0, task.n, 0);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  // A few chunks per thread, claimed dynamically: a thread that is not scheduled (a busy
  // machine) leaves its share to the others instead of stalling the whole step.
  const int64_t want = std::min<int64_t>(n_grains, int64_t{n_threads_} * 4);
  grains_per_chunk_ = (n_grains + want - 1) / want;
  n_chunks_ = (n_grains + grains_per_chunk_ - 1) / grains_per_chunk_;
  task_ = &task;
  next_chunk_.store(0);
  done_chunks_.store(0);
  open_.store(true);
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    generation_.fetch_add(1);
  }
  wake_.notify_all();
  work(0);
  while (done_chunks_.load(std::memory_order_acquire) != n_chunks_) std::this_thread::yield();
  // Close the task and wait for workers still inside it (they found no chunk left).
  open_.store(false);
  while (active_.load() != 0) std::this_thread::yield();
  task_ = nullptr;
}

void ThreadPool::worker(int t) {
  if (thread_init_) thread_init_();
  started_.fetch_add(1, std::memory_order_release);
  uint64_t seen = 0;
  for (;;) {
    // Spin briefly for the next generation (decode steps arrive back to back), then sleep.
    uint64_t g = generation_.load(std::memory_order_acquire);
    for (int spin = 0; g == seen && spin < 20000 && !stop_.load(std::memory_order_relaxed); ++spin) {
      std::this_thread::yield();
      g = generation_.load(std::memory_order_acquire);
    }
    if (g == seen) {
      std::unique_lock<std::mutex> lock(sleep_mutex_);
      wake_.wait(lock, [&] { return stop_.load() || generation_.load() != seen; });
      g = generation_.load(std::memory_order_acquire);
    }
    if (stop_.load()) return;
    seen = g;
    active_.fetch_add(1);
    if (open_.load()) work(t);
    active_.fetch_sub(1);
  }
}

}  // namespace tandem
