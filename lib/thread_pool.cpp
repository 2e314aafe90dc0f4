#include "tandem/thread_pool.hpp"

#include "tandem/error.hpp"

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

ThreadPool::ThreadPool(int n_threads)
    : n_threads_(n_threads > 0 ? n_threads : physical_core_count()) {
  try {
    workers_.reserve(static_cast<size_t>(n_threads_ - 1));
    for (int t = 1; t < n_threads_; ++t) workers_.emplace_back([this, t] { worker(t); });
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

ThreadPool::~ThreadPool() { stop_workers(); }

void ThreadPool::run_chunk(const Task& task, int t) const {
  const int64_t n_grains = (task.n + task.grain - 1) / task.grain;
  const int64_t per = (n_grains + n_threads_ - 1) / n_threads_;
  const int64_t b = std::min(task.n, static_cast<int64_t>(t) * per * task.grain);
  const int64_t e = std::min(task.n, b + per * task.grain);
  if (b < e) task.call(task.fn, b, e, t);
}

void ThreadPool::run(const Task& task) {
  if (task.n <= 0) return;
  if (n_threads_ == 1 || task.n <= task.grain) {
    task.call(task.fn, 0, task.n, 0);
    return;
  }
  std::lock_guard<std::mutex> run_lock(run_mutex_);
  task_ = &task;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  {
    std::lock_guard<std::mutex> lock(sleep_mutex_);
    generation_.fetch_add(1, std::memory_order_release);
  }
  wake_.notify_all();
  run_chunk(task, 0);
  while (pending_.load(std::memory_order_acquire) != 0) std::this_thread::yield();
  task_ = nullptr;
}

void ThreadPool::worker(int t) {
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
    run_chunk(*task_, t);
    pending_.fetch_sub(1, std::memory_order_acq_rel);
  }
}

}  // namespace tandem
