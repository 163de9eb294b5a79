// A group of ranks as threads of one process, all-reducing through shared memory: the stand-in
// for an engine's collective library in the unit tests (ASan, UBSan and clang cover it there),
// where tests/parallel/mpi_main.cpp runs real processes. A rank that waits longer than the
// group's patience gets an error instead of hanging the test, and a call whose count or op
// differs from the other ranks' is an error on every rank (MPI would be undefined there).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

#include "kvevict/error.hpp"
#include "kvevict/parallel/collective.hpp"

namespace tp_test {

class thread_group {
 public:
  explicit thread_group(int size, std::chrono::milliseconds patience = std::chrono::seconds(30))
      : size_(size), patience_(patience), members_(static_cast<std::size_t>(size)) {
    for (int r = 0; r < size; ++r) {
      members_[static_cast<std::size_t>(r)].group = this;
      members_[static_cast<std::size_t>(r)].rank = r;
    }
  }
  thread_group(const thread_group&) = delete;
  thread_group& operator=(const thread_group&) = delete;

  int size() const { return size_; }

  /// Rank r's view of the group, as an engine would hand it to kvevict.
  kvevict::collective member(int rank) {
    kvevict::collective c;
    c.rank = rank;
    c.world_size = size_;
    c.context = &members_[static_cast<std::size_t>(rank)];
    c.all_reduce = &thread_group::all_reduce;
    return c;
  }

  /// Runs f(rank) on one thread per rank and waits for all of them.
  template <class F>
  void run(F&& f) {
    std::vector<std::thread> threads;
    for (int r = 0; r < size_; ++r) threads.emplace_back([&f, r] { f(r); });
    for (auto& t : threads) t.join();
  }

  /// All-reduce calls and words per rank since construction (rank 0's count).
  std::int64_t rounds() const { return rounds_; }
  std::int64_t words() const { return words_; }

 private:
  struct slot {
    thread_group* group = nullptr;
    int rank = 0;
  };

  static kvevict::status all_reduce(void* context, std::uint32_t* data, std::int64_t count, kvevict::reduce_op op) {
    auto* m = static_cast<slot*>(context);
    return m->group->reduce(m->rank, data, count, op);
  }

  kvevict::status reduce(int rank, std::uint32_t* data, std::int64_t count, kvevict::reduce_op op) {
    std::unique_lock<std::mutex> lock(mutex_);
    const auto fail = [](const char* why) {
      return kvevict::status::error(kvevict::errc::collective_error, "thread_group", "all_reduce", "%s", why);
    };
    if (!cv_.wait_for(lock, patience_, [&] { return !draining_; })) return fail("timed out before the round");
    const std::uint64_t round = generation_;
    if (arrived_ == 0) {
      buffer_.assign(data, data + count);
      op_ = op;
      mismatch_ = false;
    } else if (static_cast<std::int64_t>(buffer_.size()) != count || op_ != op) {
      mismatch_ = true;
    } else {
      for (std::int64_t i = 0; i < count; ++i) {
        std::uint32_t& acc = buffer_[static_cast<std::size_t>(i)];
        acc = op == kvevict::reduce_op::sum ? acc + data[i] : (data[i] > acc ? data[i] : acc);
      }
    }
    if (rank == 0) {
      ++rounds_;
      words_ += count;
    }
    if (++arrived_ == size_) {
      draining_ = true;
      leaving_ = size_;
      cv_.notify_all();
    } else if (!cv_.wait_for(lock, patience_, [&] { return draining_ && generation_ == round; })) {
      return fail("timed out waiting for the other ranks (a rank made a different number of calls)");
    }
    const bool bad = mismatch_;
    if (!bad)
      for (std::int64_t i = 0; i < count; ++i) data[i] = buffer_[static_cast<std::size_t>(i)];
    if (--leaving_ == 0) {
      arrived_ = 0;
      draining_ = false;
      ++generation_;
      cv_.notify_all();
    }
    return bad ? fail("the ranks passed different counts or ops") : kvevict::status();
  }

  int size_;
  std::chrono::milliseconds patience_;
  std::vector<slot> members_;
  std::mutex mutex_;
  std::condition_variable cv_;
  std::vector<std::uint32_t> buffer_;
  kvevict::reduce_op op_ = kvevict::reduce_op::sum;
  bool mismatch_ = false, draining_ = false;
  int arrived_ = 0, leaving_ = 0;
  std::uint64_t generation_ = 0;
  std::int64_t rounds_ = 0, words_ = 0;
};

}  // namespace tp_test
