// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_EVICTION_KEEP_POSITIONS_HPP
#define KVEVICT_EVICTION_KEEP_POSITIONS_HPP

// Keep-list-only mode: for engines that keep their own per-cell metadata (llama.cpp) and
// apply a keep-list themselves, e.g. by freeing cells instead of moving rows. The keep-list
// is validated exactly as `evict` validates it, and the kept tokens' original positions
// are reported; no cache memory is read or written.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/index_ptr.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {
/// positions_out[k] = original position of keep.indices[k]; the keep-list is valid.
inline void write_keep_positions(const const_keep_list_view& keep, index_ptr key_positions,
                                 std::int64_t* positions_out) noexcept {
  const std::int64_t total = keep.total();
  if (key_positions == nullptr) {
    for (std::int64_t k = 0; k < total; ++k) positions_out[k] = keep.indices[k];
  } else {
    for (std::int64_t k = 0; k < total; ++k) positions_out[k] = key_positions[keep.indices[k]];
  }
}
}  // namespace detail

/// Original positions of the kept tokens, aligned with keep.indices.
///
///   keep:          CSR keep-list over [Hkv] heads (Hkv = keep.num_heads >= 1); head h's
///                  indices strictly ascending, in [0, num_tokens)
///   num_tokens:    L, the tokens of the cache the keep-list was selected from
///   key_positions: [L] position of every token (llama.cpp: the cells' pos), or null for
///                  position j
///   positions_out: [keep.total()] out; may be null when keep.total() == 0
///
/// RoPE positions are never changed by eviction: the next token is still decoded at the
/// position it would have had without eviction.
inline status keep_list_positions(const_keep_list_view keep, std::int64_t num_tokens, index_ptr key_positions,
                                  std::int64_t* positions_out) noexcept {
  static constexpr const char* fn = "kvevict::keep_list_positions";
  if (num_tokens < 0)
    return status::error(errc::invalid_shape, fn, "num_tokens", "expected >= 0, got %lld",
                         static_cast<long long>(num_tokens));
  if (keep.num_heads < 1)
    return status::error(errc::invalid_shape, fn, "keep.num_heads", "expected >= 1, got %lld",
                         static_cast<long long>(keep.num_heads));
  KVEVICT_RETURN_IF_ERROR(detail::validate_keep_list(keep, keep.num_heads, num_tokens, fn, "keep"));
  if (keep.total() > 0 && positions_out == nullptr)
    return status::error(errc::null_pointer, fn, "positions_out", "expected [%lld] (keep.total()) positions",
                         static_cast<long long>(keep.total()));
  detail::write_keep_positions(keep, key_positions, positions_out);
  return status();
}

/// The positions a sequence no longer keeps, as half-open ranges [p0, p1): what llama.cpp's
/// `llama_memory_seq_rm(mem, seq_id, p0, p1)` removes, for a keep set shared by every head
/// and layer (selection_scope::per_sequence with compaction::keep_list_only).
///
///   kept:       [num_kept] the kept tokens' positions, strictly ascending, in [begin, end)
///               (a shared keep set's report: its first report.length kept_positions)
///   begin, end: the sequence's positions before eviction, [begin, end) (llama.cpp: 0 and
///               n_past; positions missing from the sequence may fall inside a range, which
///               removes nothing there)
///   ranges:     [capacity][2] out: p0 and p1 of each range, ascending, non-empty, disjoint
///   capacity:   ranges it can hold (num_kept + 1 always suffices)
///   num_ranges: out, the ranges written
///
/// On error nothing is written.
inline status removed_position_ranges(const std::int64_t* kept, std::int64_t num_kept, std::int64_t begin,
                                      std::int64_t end, std::int64_t* ranges, std::int64_t capacity,
                                      std::int64_t* num_ranges) noexcept {
  static constexpr const char* fn = "kvevict::removed_position_ranges";
  if (num_kept < 0)
    return status::error(errc::invalid_shape, fn, "num_kept", "expected >= 0, got %lld",
                         static_cast<long long>(num_kept));
  if (num_kept > 0 && kept == nullptr)
    return status::error(errc::null_pointer, fn, "kept", "expected [%lld] positions", static_cast<long long>(num_kept));
  if (end < begin)
    return status::error(errc::invalid_argument, fn, "end", "expected >= begin = %lld, got %lld",
                         static_cast<long long>(begin), static_cast<long long>(end));
  if (num_ranges == nullptr) return status::error(errc::null_pointer, fn, "num_ranges", "expected non-null");
  if (capacity < 0)
    return status::error(errc::invalid_shape, fn, "capacity", "expected >= 0, got %lld",
                         static_cast<long long>(capacity));
  std::int64_t needed = 0, next = begin;  // next: the first position not yet covered
  for (std::int64_t i = 0; i < num_kept; ++i) {
    const std::int64_t p = kept[i];
    if (p < next || p >= end)
      return status::error(errc::invalid_argument, fn, "kept",
                           "expected strictly ascending positions in [begin, end) = [%lld, %lld): kept[%lld] = %lld",
                           static_cast<long long>(begin), static_cast<long long>(end), static_cast<long long>(i),
                           static_cast<long long>(p));
    needed += p > next ? 1 : 0;
    next = p + 1;
  }
  needed += end > next ? 1 : 0;
  if (needed > capacity)
    return status::error(errc::invalid_shape, fn, "capacity", "expected room for %lld ranges, got %lld",
                         static_cast<long long>(needed), static_cast<long long>(capacity));
  if (needed > 0 && ranges == nullptr)
    return status::error(errc::null_pointer, fn, "ranges", "expected [%lld][2]", static_cast<long long>(needed));
  std::int64_t n = 0;
  next = begin;
  for (std::int64_t i = 0; i <= num_kept; ++i) {
    const std::int64_t stop = i < num_kept ? kept[i] : end;
    if (stop > next) {
      ranges[2 * n] = next;
      ranges[2 * n + 1] = stop;
      ++n;
    }
    next = stop + 1;
  }
  *num_ranges = n;
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EVICTION_KEEP_POSITIONS_HPP
