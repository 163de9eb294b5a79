// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_EVICTION_EVICT_HPP
#define KVEVICT_EVICTION_EVICT_HPP

// The one eviction every policy shares (design.md §7): in-place, stable compaction of
// one layer's K and V caches by a keep-list. Afterwards head h's row i holds what its row
// keep[h][i] held before, for every layout a cache_view describes (contiguous, strided,
// transposed V, paged). Keep-lists are strictly ascending, so keep[h][i] >= i and a forward
// copy never overwrites a row it has still to read.
//
// Contract
//   - Everything is validated before the first byte moves; on error the cache, the
//     keep-list and `result` are exactly as they were.
//   - Rows at or beyond a head's new length keep their old contents. They are stale: the
//     engine must not read them (set its sequence length to the new length).
//   - Nothing is allocated; only paged caches need workspace (to check that the block
//     table names each physical block once). Strided caches need 0 bytes.
//   - K and V must not share elements, and a paged sequence's blocks must not be shared
//     with another sequence (copy-on-write them first). kvevict detects the cases it can
//     see cheaply (same base pointer, a block id repeated in a table or in both K's and V's
//     tables of one pool); the rest is the caller's promise.
//   - Element copies only (no conversion); RoPE positions are not changed.
//   - Concurrent calls on different layers (different memory) are safe; no global state.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/keep_positions.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

/// What eviction reports. The pointers are optional outputs the caller owns.
struct eviction_result {
  /// [Hkv] out, optional: tokens head h holds afterwards (= keep.size(h)).
  std::int64_t* head_lengths = nullptr;
  /// [keep.total()] out, optional: the original position of every kept token, aligned with
  /// keep.indices (head h's row i came from position positions[keep.offsets[h] + i]).
  std::int64_t* positions = nullptr;
  /// out: the longest head afterwards; the sequence's new length when every head keeps the
  /// same number of tokens.
  std::int64_t max_length = 0;
  /// out, paged caches only: trailing entries of the block table no head uses any more,
  /// ceil(L / block_size) - ceil(max_length / block_size). The engine may return them to
  /// its allocator. 0 for strided caches.
  std::int64_t freed_blocks = 0;
};

namespace detail {

/// Kept rows are scattered over the cache, so each copy waits on DRAM; asking for the rows
/// a few keep-list entries ahead keeps several misses in flight (rows of at least a cache
/// line only; a transposed V's channel lines are read in order and need no help).
constexpr std::int64_t compaction_prefetch_ahead = 8;

template <class T>
KVEVICT_ALWAYS_INLINE void prefetch_row(const T* row, std::size_t bytes) noexcept {
#if defined(__GNUC__) || defined(__clang__)
  for (std::size_t b = 0; b < bytes; b += 64) __builtin_prefetch(reinterpret_cast<const char*>(row) + b, 0, 3);
#else
  (void)row, (void)bytes;
#endif
}

/// Moves rows i..i+n of a line of back-to-back units (a row of d channels, or one channel
/// of a transposed V) by runs: consecutive kept tokens move with one memmove (the ranges
/// overlap forward when a run shifts by less than its length).
template <class T>
void compact_line(T* line, std::int64_t unit, std::int64_t i, const std::int64_t* keep, std::int64_t n) noexcept {
  const std::size_t unit_bytes = static_cast<std::size_t>(unit) * sizeof(T);
  const bool prefetch = unit_bytes >= 64;
  while (i < n) {
    const std::int64_t j = keep[i];
    if (prefetch && i + compaction_prefetch_ahead < n)
      prefetch_row(line + keep[i + compaction_prefetch_ahead] * unit, unit_bytes);
    std::int64_t run = 1;
    while (i + run < n && keep[i + run] == j + run) ++run;
    if (j != i) std::memmove(line + i * unit, line + j * unit, static_cast<std::size_t>(run) * unit_bytes);
    i += run;
  }
}

/// Compacts head h of one view: row i <- row keep[i] for i in [0, n). Rows of distinct
/// tokens never overlap (validated), and keep[i] >= i, so ascending order is safe.
template <class T>
void compact_head(const cache_view<T>& v, std::int64_t h, const std::int64_t* keep, std::int64_t n) noexcept {
  std::int64_t i = 0;
  while (i < n && keep[i] == i) ++i;  // the untouched prefix costs nothing
  if (i == n) return;
  const std::int64_t d = v.head_dim;
  if (v.dim_stride == 1) {
    if (!v.is_paged() && v.token_stride == d) {
      compact_line(v.data + h * v.head_stride, d, i, keep, n);
      return;
    }
    const std::size_t bytes = static_cast<std::size_t>(d) * sizeof(T);
    for (; i < n; ++i) {
      const std::int64_t j = keep[i];
      if (bytes >= 64 && i + compaction_prefetch_ahead < n)
        prefetch_row(v.row(h, keep[i + compaction_prefetch_ahead]), bytes);
      if (j != i) std::memcpy(v.row(h, i), v.row(h, j), bytes);
    }
    return;
  }
  if (!v.is_paged() && v.token_stride == 1) {
    // Transposed V: each channel is a contiguous line of tokens.
    for (std::int64_t c = 0; c < d; ++c) compact_line(v.data + h * v.head_stride + c * v.dim_stride, 1, i, keep, n);
    return;
  }
  for (std::int64_t c = 0; c < d; ++c)
    for (std::int64_t r = i; r < n; ++r) {
      const std::int64_t j = keep[r];
      if (j != r) v.at(h, r, c) = v.at(h, j, c);
    }
}

template <class KT, class VT>
std::int64_t evict_scratch_ids(const cache_view<KT>& keys, const cache_view<VT>& values) noexcept {
  return saturating_add(used_blocks_or_zero(keys), used_blocks_or_zero(values));
}

inline void carve_evict_layout(arena& a, std::int64_t scratch_ids, std::int32_t** ids) noexcept {
  *ids = scratch_ids > 0 ? a.take<std::int32_t>(scratch_ids) : nullptr;
}

/// Blocks of a paged view's table beyond what `new_length` tokens need.
template <class T>
std::int64_t freed_blocks_of(const cache_view<T>& v, std::int64_t new_length) noexcept {
  return v.num_used_blocks() - v.first_tokens(new_length).num_used_blocks();  // 0 when strided
}

/// Fills `result` for a validated keep-list.
template <class KT, class VT>
void report_eviction(const cache_view<KT>& keys, const cache_view<VT>& values, const const_keep_list_view& keep,
                     const std::int64_t* key_positions, eviction_result& result) noexcept {
  std::int64_t longest = 0;
  for (std::int64_t h = 0; h < keep.num_heads; ++h) {
    const std::int64_t n = keep.size(h);
    if (result.head_lengths != nullptr) result.head_lengths[h] = n;
    longest = n > longest ? n : longest;
  }
  if (result.positions != nullptr) write_keep_positions(keep, key_positions, result.positions);
  result.max_length = longest;
  // K's table is the one an engine reclaims from; V is consulted only when K is strided.
  result.freed_blocks = keys.is_paged() ? freed_blocks_of(keys, longest) : freed_blocks_of(values, longest);
}

/// Validation shared by `evict` and `evict_batch` for one sequence (names like "keys" or
/// "keys[2]").
template <class KT, class VT>
status validate_eviction_sequence(const cache_view<KT>& keys, const cache_view<VT>& values,
                                  const const_keep_list_view& keep, const char* fn, const char* karg, const char* varg,
                                  const char* keep_arg) noexcept {
  KVEVICT_RETURN_IF_ERROR(validate_kv_views(keys, values, fn, karg, varg));
  KVEVICT_RETURN_IF_ERROR(check_kv_not_aliased(keys, values, fn, varg));
  return validate_keep_list(keep, keys.num_heads, keys.num_tokens, fn, keep_arg);
}

}  // namespace detail

/// Bytes of workspace `evict` needs for these views: 0 for strided caches; for paged ones
/// 4 bytes per used block of K and of V, plus alignment. It grows with num_tokens only, so
/// views at an engine's longest sequence give a bound for every call.
template <class KT, class VT>
std::size_t evict_workspace_size(const cache_view<KT>& keys, const cache_view<VT>& values,
                                 const executor& exec = {}) noexcept {
  (void)exec;  // scratch is only used by validation, which runs on the calling thread
  detail::arena a;
  std::int32_t* ids = nullptr;
  detail::carve_evict_layout(a, detail::evict_scratch_ids(keys, values), &ids);
  return a.used();
}

/// Compacts one layer's K and V caches in place by a keep-list.
///
///   keys:          [Hkv, L, dk] (cache_view, any layout and storage type, mutable)
///   values:        [Hkv, L, dv] (same Hkv and L as keys; dv may differ from dk; its own
///                  layout and storage type, e.g. llama.cpp's transposed V)
///   keep:          CSR keep-list [Hkv]: head h's indices strictly ascending in [0, L)
///   result:        head_lengths [Hkv] and positions [keep.total()] optional outs;
///                  max_length, freed_blocks always written on success
///   ws:            at least evict_workspace_size(keys, values) bytes (0 when strided)
///   key_positions: [L] original position of every token (llama.cpp cells), or null for
///                  position j; only used for result.positions
///   exec:          heads may be compacted in parallel through it
///
/// Afterwards head h's rows [0, keep.size(h)) hold its kept tokens in ascending order;
/// its rows from keep.size(h) on are stale (old contents, not to be read).
template <class KT, class VT>
status evict(cache_view<KT> keys, cache_view<VT> values, const_keep_list_view keep, eviction_result& result,
             workspace_span ws = {}, const std::int64_t* key_positions = nullptr, const executor& exec = {}) {
  static_assert(!std::is_const<KT>::value && !std::is_const<VT>::value,
                "kvevict::evict writes the cache: pass views of mutable elements");
  static constexpr const char* fn = "kvevict::evict";
  KVEVICT_RETURN_IF_ERROR(detail::validate_eviction_sequence(keys, values, keep, fn, "keys", "values", "keep"));
  detail::arena a(ws);
  std::int32_t* ids = nullptr;
  detail::carve_evict_layout(a, detail::evict_scratch_ids(keys, values), &ids);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (evict_workspace_size), got %zu", a.used(), ws.size);
  if (keys.is_paged() || values.is_paged()) {
    const auto kseq = [&keys](std::int64_t) { return keys; };
    const auto vseq = [&values](std::int64_t) { return values; };
    KVEVICT_RETURN_IF_ERROR(detail::check_block_ids(1, kseq, vseq, detail::same_block_table(keys, values),
                                                    detail::same_block_pool(keys, values), ids, fn, false));
  }

  detail::report_eviction(keys, values, keep, key_positions, result);
  struct task_context {
    cache_view<KT> keys;
    cache_view<VT> values;
    const_keep_list_view keep;
  } ctx{keys, values, keep};
  exec.run(
      keys.num_heads,
      [](void* arg, std::int64_t h, int) {
        const auto& c = *static_cast<const task_context*>(arg);
        const std::int64_t* kept = c.keep.indices + c.keep.offsets[h];
        const std::int64_t n = c.keep.size(h);
        detail::compact_head(c.keys, h, kept, n);
        detail::compact_head(c.values, h, kept, n);
      },
      &ctx);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EVICTION_EVICT_HPP
