// A small real thread pool behind kvevict's executor hook, as an engine would provide one:
// `workers` threads, each with a fixed worker id, pulling task indices from a shared
// counter. Used by the TSan program (tests/tsan) and the determinism tests
// (tests/unit/test_determinism.cpp). The calling thread only waits, so worker ids are
// exactly the pool's thread ids and no two running tasks share one.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <numeric>
#include <thread>
#include <vector>

#include "kvevict/executor.hpp"

namespace test {

class thread_pool {
 public:
  /// Order in which task indices are handed out (results must not depend on it).
  enum class order { forward, reverse, interleaved };

  explicit thread_pool(int workers, order o = order::forward)
      : order_(o), num_workers_(workers), per_worker_(static_cast<std::size_t>(workers), 0) {
    threads_.reserve(static_cast<std::size_t>(workers));
    for (int w = 0; w < workers; ++w) threads_.emplace_back([this, w] { work(w); });
  }
  ~thread_pool() {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (std::thread& t : threads_) t.join();
  }
  thread_pool(const thread_pool&) = delete;
  thread_pool& operator=(const thread_pool&) = delete;

  /// The executor an engine hands kvevict.
  kvevict::executor executor() {
    kvevict::executor e;
    e.num_workers = num_workers_;
    e.context = this;
    e.parallel_for = &thread_pool::parallel_for;
    return e;
  }

  /// Tasks run so far, per worker (to check that work really spread over threads).
  std::vector<std::int64_t> tasks_per_worker() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return per_worker_;
  }

 private:
  static void parallel_for(void* context, std::int64_t n, kvevict::task_fn fn, void* arg) {
    static_cast<thread_pool*>(context)->run(n, fn, arg);
  }

  void run(std::int64_t n, kvevict::task_fn fn, void* arg) {
    if (n <= 0) return;
    std::lock_guard<std::mutex> serial(run_mutex_);  // one parallel_for at a time per pool
    std::unique_lock<std::mutex> lock(mutex_);
    fn_ = fn;
    arg_ = arg;
    n_ = n;
    next_.store(0, std::memory_order_relaxed);
    busy_ = num_workers_;
    ++generation_;
    wake_.notify_all();
    done_.wait(lock, [this] { return busy_ == 0; });
    fn_ = nullptr;
  }

  std::int64_t task_index(std::int64_t k) const {
    switch (order_) {
      case order::forward:
        return k;
      case order::reverse:
        return n_ - 1 - k;
      case order::interleaved:  // odd indices first, then even
        return k < n_ / 2 ? 2 * k + 1 : 2 * (k - n_ / 2);
    }
    return k;
  }

  void work(int worker) {
    std::uint64_t seen = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      const kvevict::task_fn fn = fn_;
      void* const arg = arg_;
      const std::int64_t n = n_;
      lock.unlock();
      std::int64_t ran = 0;
      for (std::int64_t k = next_.fetch_add(1); k < n; k = next_.fetch_add(1)) {
        fn(arg, task_index(k), worker);
        ++ran;
      }
      lock.lock();
      per_worker_[static_cast<std::size_t>(worker)] += ran;
      if (--busy_ == 0) done_.notify_all();
    }
  }

  order order_;
  int num_workers_;
  std::vector<std::thread> threads_;
  mutable std::mutex mutex_;
  std::mutex run_mutex_;
  std::condition_variable wake_, done_;
  kvevict::task_fn fn_ = nullptr;
  void* arg_ = nullptr;
  std::int64_t n_ = 0;
  std::atomic<std::int64_t> next_{0};
  int busy_ = 0;
  std::uint64_t generation_ = 0;
  bool stop_ = false;
  std::vector<std::int64_t> per_worker_;
};

/// Serial executors that still claim several workers: tasks in reverse or a fixed
/// permuted order on the calling thread, worker ids rotating. Results must not change.
struct serial_shuffle {
  int workers = 3;
  bool reverse = true;

  static void parallel_for(void* context, std::int64_t n, kvevict::task_fn fn, void* arg) {
    const auto* self = static_cast<const serial_shuffle*>(context);
    for (std::int64_t k = 0; k < n; ++k) {
      // reverse: n-1 .. 0; otherwise a fixed permutation (a stride coprime with n).
      std::int64_t stride = 7;
      while (n > 1 && std::gcd(stride, n) != 1) ++stride;
      const std::int64_t i = self->reverse ? n - 1 - k : (k * stride) % n;
      fn(arg, i, static_cast<int>(k % self->workers));
    }
  }
  kvevict::executor executor() {
    kvevict::executor e;
    e.num_workers = workers;
    e.context = this;
    e.parallel_for = &serial_shuffle::parallel_for;
    return e;
  }
};

}  // namespace test
