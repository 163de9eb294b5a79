// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_PARALLEL_HEAD_SHARD_HPP
#define KVEVICT_PARALLEL_HEAD_SHARD_HPP

// Which of a layer's KV heads this rank holds, under tensor parallelism: a contiguous range
// [first_head, first_head + Hkv) of the layer's total_heads, the ranks' ranges tiling
// [0, total_heads) in rank order (what vLLM, SGLang and TensorRT-LLM do). Selections whose
// heads compete (AdaKV's layer-wide top Hkv*B) or share one keep set (the per-layer and
// per-sequence scopes) then run across the group and give every rank, for its heads, exactly
// what one process holding every head would (design.md §15). Per-head budgets need nothing.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/collective.hpp"

KVEVICT_NAMESPACE_BEGIN

struct head_shard {
  const collective* group = nullptr;  ///< null: this process holds every KV head
  std::int64_t first_head = 0;        ///< global index of this rank's first KV head
  std::int64_t total_heads = 0;       ///< KV heads of the layer over the whole group
  /// Each sharded selection first checks, in one max all-reduce, that every rank passes the
  /// same shape and budget and that none failed before it, so that a mismatch is an error on
  /// every rank instead of a wait that never ends. compressor::run checks a whole batch once
  /// and turns this off for the selections it makes.
  bool agree_shapes = true;

  bool sharded() const noexcept { return group != nullptr; }
};

namespace detail {

/// The shard's fields against this rank's `heads` (checked before any collective).
inline status validate_head_shard(const head_shard& s, std::int64_t heads, const char* fn) noexcept {
  if (s.group == nullptr) return status();
  KVEVICT_RETURN_IF_ERROR(validate_collective(*s.group, fn, "budget.shard.group"));
  if (s.first_head < 0 || s.total_heads < 1 || heads > s.total_heads || s.first_head > s.total_heads - heads)
    return status::error(errc::out_of_range, fn, "budget.shard",
                         "expected this rank's %lld heads inside [0, total_heads), got first_head %lld of "
                         "total_heads %lld",
                         static_cast<long long>(heads), static_cast<long long>(s.first_head),
                         static_cast<long long>(s.total_heads));
  return status();
}

}  // namespace detail

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_PARALLEL_HEAD_SHARD_HPP
