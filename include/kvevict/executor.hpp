// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_EXECUTOR_HPP
#define KVEVICT_EXECUTOR_HPP

// The optional hook through which an engine runs kvevict's independent tasks (one per KV
// head) on its own thread pool. kvevict never creates threads. The default executor runs
// tasks in order on the calling thread; results do not depend on the executor.

#include <cstdint>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN

/// A task: fn(arg, index, worker). `worker` is in [0, num_workers) and no two tasks running
/// at the same time get the same worker id (kvevict gives each worker its own scratch).
using task_fn = void (*)(void* arg, std::int64_t index, int worker);

struct executor {
  /// Most tasks that may run at once; scratch is sized for this many workers.
  int num_workers = 1;
  /// Engine state passed back to parallel_for.
  void* context = nullptr;
  /// Runs fn(arg, i, worker) for every i in [0, n) and returns when all have finished.
  /// nullptr runs them serially on the calling thread with worker 0.
  void (*parallel_for)(void* context, std::int64_t n, task_fn fn, void* arg) = nullptr;

  void run(std::int64_t n, task_fn fn, void* arg) const {
    if (parallel_for == nullptr || num_workers <= 1) {
      for (std::int64_t i = 0; i < n; ++i) fn(arg, i, 0);
    } else {
      parallel_for(context, n, fn, arg);
    }
  }
  int workers() const noexcept { return (parallel_for == nullptr || num_workers < 1) ? 1 : num_workers; }
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EXECUTOR_HPP
