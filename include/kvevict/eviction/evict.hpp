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
//   - K and V must not share elements. Blocks a paged sequence shares with another one
//     (prefix caching) must not be written: pass the engine's block reference counts (or a
//     shared-block bitmap) in eviction_options and evict refuses, naming the block, when the
//     compaction would write one; then compact out of place (eviction/evict_into.hpp) into
//     fresh blocks. kvevict also detects a block id repeated in a table or in both K's and
//     V's tables of one pool. eviction_result::changed_blocks lists the blocks whose content
//     changed, whose prefix-cache hashes the engine must drop.
//   - Element copies only (no conversion); RoPE positions are not changed.
//   - Concurrent calls on different layers (different memory) are safe; no global state.

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <limits>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/keep_positions.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

/// What eviction reports. The pointers are optional outputs the caller owns.
struct eviction_result {
  /// [Hkv] out, optional: tokens head h holds afterwards (= keep.size(h)).
  std::int64_t* head_lengths = nullptr;
  /// [keep.total()] out, optional: the original position of every kept token, aligned with
  /// keep.indices (head h's row i came from position positions[keep.offsets[h] + i]).
  std::int64_t* positions = nullptr;
  /// [keep.total()] out, optional: the keep-list's token indices (head h's at the
  /// head_lengths[0] + ... + head_lengths[h-1] entries before it), for callers whose
  /// keep-list was chosen inside the call (a policy's evict()).
  std::int64_t* indices = nullptr;
  /// out: the longest head afterwards; the sequence's new length when every head keeps the
  /// same number of tokens.
  std::int64_t max_length = 0;
  /// out, paged caches only: trailing entries of the block table no head uses any more,
  /// ceil(L / block_size) - ceil(max_length / block_size). The engine may return them to
  /// its allocator. 0 for strided caches.
  std::int64_t freed_blocks = 0;
  /// [used blocks of K + used blocks of V] out, optional: the physical ids of the blocks the
  /// compaction writes (K's first, then V's when V has a table of its own), ascending by
  /// logical block. Their content changes, so their prefix-cache hashes are stale.
  std::int32_t* changed_blocks = nullptr;
  /// out: entries written to changed_blocks (0 without it, or for strided caches).
  std::int64_t num_changed_blocks = 0;
  /// [Hkv] out, optional, paged caches: head h's trailing table entries it no longer uses
  /// (per-head block tables: each head frees its own; one shared table: the entries beyond the
  /// longest head, freed_blocks, for every head).
  std::int64_t* head_freed_blocks = nullptr;
  /// out, from a policy's evict(): the candidates (tokens the selection chose among; the
  /// protected ones excluded) whose score was NaN or -inf, over every head (+inf is the "always
  /// keep" score of sinks and protected tokens). Selection ranks them by design (NaN last);
  /// the count tells the caller it happened.
  std::int64_t nonfinite_scores = 0;
};

/// Optional inputs and outputs of eviction beyond the keep-list.
struct eviction_options {
  /// [L] original position of every token (llama.cpp cells), or null for position j; only
  /// used for eviction_result::positions.
  index_ptr key_positions = nullptr;
  /// [num_pool_blocks] of each paged view: how many sequences reference each physical block
  /// (vLLM's ref_cnt). A block with a count above 1 is shared by prefix caching: evict() in
  /// place refuses to write it. Null: no block is shared.
  const std::int32_t* block_refcounts = nullptr;
  /// Alternative to block_refcounts: bit (id % 32) of word id / 32 set means block id is shared.
  const std::uint32_t* shared_blocks = nullptr;
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

/// The first row compaction writes and the rows it ends with, over every head: rows
/// [first, end) of the view change (keep[h][i] == i for every i below the first moving entry).
struct written_rows {
  std::int64_t first = 0;
  std::int64_t end = 0;
};
/// Head h's written rows.
inline written_rows rows_written(const const_keep_list_view& keep, std::int64_t h) noexcept {
  const std::int64_t* kept = keep.indices + keep.offsets[h];
  const std::int64_t n = keep.size(h);
  std::int64_t i = 0;
  while (i < n && kept[i] == i) ++i;
  return i < n ? written_rows{i, n} : written_rows{0, 0};
}
/// Every head's written rows together (a block table shared by the heads).
inline written_rows rows_written(const const_keep_list_view& keep) noexcept {
  written_rows w{std::numeric_limits<std::int64_t>::max(), 0};
  for (std::int64_t h = 0; h < keep.num_heads; ++h) {
    const written_rows one = rows_written(keep, h);
    if (one.end > one.first) {
      w.first = one.first < w.first ? one.first : w.first;
      w.end = one.end > w.end ? one.end : w.end;
    }
  }
  if (w.first == std::numeric_limits<std::int64_t>::max()) w.first = w.end = 0;
  return w;
}

/// The rows compaction writes through each block table of a view: table t is head t's with
/// per-head tables, else the shared one (all heads together).
struct written_per_table {
  const const_keep_list_view* keep = nullptr;  ///< null: `all` for every table
  written_rows all;
  bool from_zero = false;  ///< out of place: every kept row is written, from row 0
  template <class T>
  written_rows of(const cache_view<T>& v, std::int64_t t) const noexcept {
    if (keep == nullptr || !v.has_head_tables()) return all;
    return from_zero ? written_rows{0, keep->size(t)} : rows_written(*keep, t);
  }
};

/// Whether physical block `id` is marked shared.
inline bool block_shared(const eviction_options& opt, std::int32_t id, std::int32_t* count) noexcept {
  if (opt.block_refcounts != nullptr) {
    *count = opt.block_refcounts[id];
    return *count > 1;
  }
  *count = 2;
  return opt.shared_blocks != nullptr && (opt.shared_blocks[id >> 5] >> (id & 31)) & 1u;
}

/// Refuses a compaction that would write a block marked shared (checked before any write).
template <class T>
status check_shared_writes(const cache_view<T>& v, const written_per_table& w, const eviction_options& opt,
                           const char* fn, const char* arg) noexcept {
  if (!v.is_paged() || (opt.block_refcounts == nullptr && opt.shared_blocks == nullptr)) return status();
  for (std::int64_t t = 0; t < v.num_tables(); ++t) {
    const written_rows rows = w.of(v, t);
    for (std::int64_t b = rows.first / v.block_size;
         rows.end > rows.first && b < (rows.end + v.block_size - 1) / v.block_size; ++b) {
      const std::int64_t entry = t * v.head_table_stride + b;
      std::int32_t count = 0;
      if (block_shared(opt, static_cast<std::int32_t>(v.block_table[entry]), &count)) {
        char name[2 * status::max_argument];
        std::snprintf(name, sizeof(name), "%s.block_table[%lld]", arg, static_cast<long long>(entry));
        return status::error(errc::invalid_argument, fn, name,
                             "block %d is shared with another sequence (%d references) and compaction in place would "
                             "change it: compact out of place into fresh blocks (evict_into)",
                             static_cast<int>(v.block_table[entry]), static_cast<int>(count));
      }
    }
  }
  return status();
}

/// Appends the physical ids of the written blocks of a paged view to out; returns how many.
template <class T>
std::int64_t list_written_blocks(const cache_view<T>& v, const written_per_table& w, std::int32_t* out) noexcept {
  if (!v.is_paged()) return 0;
  std::int64_t n = 0;
  for (std::int64_t t = 0; t < v.num_tables(); ++t) {
    const written_rows rows = w.of(v, t);
    if (rows.end <= rows.first) continue;
    for (std::int64_t b = rows.first / v.block_size; b < (rows.end + v.block_size - 1) / v.block_size; ++b)
      out[n++] = static_cast<std::int32_t>(v.block_table[t * v.head_table_stride + b]);
  }
  return n;
}

template <class KT, class VT>
std::int64_t evict_scratch_ids(const cache_view<KT>& keys, const cache_view<VT>& values) noexcept {
  return saturating_add(used_blocks_or_zero(keys), used_blocks_or_zero(values));
}

inline void carve_evict_layout(arena& a, std::int64_t scratch_ids, std::int32_t** ids) noexcept {
  *ids = scratch_ids > 0 ? a.take<std::int32_t>(scratch_ids) : nullptr;
}

/// Fills `result` for a validated keep-list.
template <class KT, class VT>
void report_eviction(const cache_view<KT>& keys, const cache_view<VT>& values, const const_keep_list_view& keep,
                     index_ptr key_positions, eviction_result& result) noexcept {
  std::int64_t longest = 0;
  for (std::int64_t h = 0; h < keep.num_heads; ++h) {
    const std::int64_t n = keep.size(h);
    if (result.head_lengths != nullptr) result.head_lengths[h] = n;
    longest = n > longest ? n : longest;
  }
  if (result.positions != nullptr) write_keep_positions(keep, key_positions, result.positions);
  if (result.indices != nullptr)
    for (std::int64_t k = 0; k < keep.total(); ++k) result.indices[k] = keep.indices[k];
  result.max_length = longest;
  // K's table is the one an engine reclaims from; V is consulted only when K is strided.
  result.freed_blocks = keys.is_paged() ? keys.blocks_beyond(longest) : values.blocks_beyond(longest);
  if (result.head_freed_blocks != nullptr)
    for (std::int64_t h = 0; h < keep.num_heads; ++h)
      result.head_freed_blocks[h] = keys.is_paged()
                                        ? keys.blocks_beyond(keys.has_head_tables() ? keep.size(h) : longest)
                                        : values.blocks_beyond(values.has_head_tables() ? keep.size(h) : longest);
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
///   opt:           key positions (for result.positions) and shared-block marks (see
///                  eviction_options)
///   exec:          heads may be compacted in parallel through it
///
/// Afterwards head h's rows [0, keep.size(h)) hold its kept tokens in ascending order;
/// its rows from keep.size(h) on are stale (old contents, not to be read).
template <class KT, class VT>
status evict(cache_view<KT> keys, cache_view<VT> values, const_keep_list_view keep, eviction_result& result,
             workspace_span ws, const eviction_options& opt, const executor& exec = {}) {
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
  const detail::written_per_table written{&keep, detail::rows_written(keep)};
  KVEVICT_RETURN_IF_ERROR(detail::check_shared_writes(keys, written, opt, fn, "keys"));
  KVEVICT_RETURN_IF_ERROR(detail::check_shared_writes(values, written, opt, fn, "values"));

  detail::report_eviction(keys, values, keep, opt.key_positions, result);
  result.num_changed_blocks = 0;
  if (result.changed_blocks != nullptr) {
    result.num_changed_blocks = detail::list_written_blocks(keys, written, result.changed_blocks);
    if (!detail::same_block_table(keys, values))
      result.num_changed_blocks +=
          detail::list_written_blocks(values, written, result.changed_blocks + result.num_changed_blocks);
  }
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

/// evict() without options: key_positions (or null) only.
template <class KT, class VT>
status evict(cache_view<KT> keys, cache_view<VT> values, const_keep_list_view keep, eviction_result& result,
             workspace_span ws = {}, index_ptr key_positions = nullptr, const executor& exec = {}) {
  eviction_options opt;
  opt.key_positions = key_positions;
  return evict(keys, values, keep, result, ws, opt, exec);
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EVICTION_EVICT_HPP
