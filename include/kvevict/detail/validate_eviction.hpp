// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_VALIDATE_EVICTION_HPP
#define KVEVICT_DETAIL_VALIDATE_EVICTION_HPP

// Checks that only eviction needs: K and V agree, a paged sequence's block table names
// each physical block once (compaction through a table that maps two logical blocks to
// one physical block would read rows it has already overwritten), and a batch's table
// geometry. Like validate.hpp, every check runs before the cache is touched.

#include <algorithm>
#include <cstdint>
#include <cstdio>

#include "kvevict/config.hpp"
#include "kvevict/detail/abi_std.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/batch_cache_view.hpp"
#include "kvevict/views/cache_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Both views valid, and the same [Hkv, L] (head_dim may differ: K and V heads need not
/// have the same width).
template <class KT, class VT>
status validate_kv_views(const cache_view<KT>& keys, const cache_view<VT>& values, const char* fn, const char* karg,
                         const char* varg) noexcept {
  KVEVICT_RETURN_IF_ERROR(validate_cache_view(keys, fn, karg));
  KVEVICT_RETURN_IF_ERROR(validate_cache_view(values, fn, varg));
  if (values.num_heads != keys.num_heads)
    return status::error(errc::invalid_shape, fn, field_name(varg, "num_heads"),
                         "expected %s.num_heads = %lld, got %lld", karg, static_cast<long long>(keys.num_heads),
                         static_cast<long long>(values.num_heads));
  if (values.num_tokens != keys.num_tokens)
    return status::error(errc::invalid_shape, fn, field_name(varg, "num_tokens"),
                         "expected %s.num_tokens = %lld, got %lld", karg, static_cast<long long>(keys.num_tokens),
                         static_cast<long long>(values.num_tokens));
  return status();
}

/// Block-table entries a view uses (used blocks, times Hkv with per-head tables); 0 for
/// strided views and for views too malformed to say (size queries run before validation and
/// must not divide by zero).
template <class T>
std::int64_t used_blocks_or_zero(const cache_view<T>& v) noexcept {
  if (!v.is_paged() || v.block_size < 1 || v.num_tokens < 1) return 0;
  return saturating_mul(v.num_tables(), v.num_used_blocks());
}

/// Index in block_table of the view's e-th used entry (tables in head order).
template <class T>
std::int64_t table_entry(const cache_view<T>& v, std::int64_t e) noexcept {
  const std::int64_t used = v.num_used_blocks();
  return (e / used) * v.head_table_stride + e % used;
}

/// Whether V's block ids are K's (same table, same geometry), so checking K covers V.
template <class KT, class VT>
bool same_block_table(const cache_view<KT>& keys, const cache_view<VT>& values) noexcept {
  return keys.is_paged() && values.block_table == keys.block_table && values.block_size == keys.block_size &&
         values.num_tokens == keys.num_tokens && values.head_table_stride == keys.head_table_stride;
}

/// Whether K and V are paged into one pool with the same block geometry (TensorRT-LLM: one
/// pool, separate K and V block offsets); then a block id in both tables is a shared block.
template <class KT, class VT>
bool same_block_pool(const cache_view<KT>& keys, const cache_view<VT>& values) noexcept {
  return keys.is_paged() && values.is_paged() && sizeof(KT) == sizeof(VT) &&
         static_cast<const void*>(keys.data) == static_cast<const void*>(values.data) &&
         keys.block_stride == values.block_stride;
}

/// Sorts ids[0, n) and returns a value that occurs twice, or -1.
inline std::int32_t find_duplicate_id(std::int32_t* ids, std::int64_t n) noexcept {
  std::sort(ids, ids + n, abi_less());
  for (std::int64_t i = 1; i < n; ++i)
    if (ids[i] == ids[i - 1]) return ids[i];
  return -1;
}

/// A value in both sorted ranges, or -1.
inline std::int32_t find_common_id(const std::int32_t* a, std::int64_t na, const std::int32_t* b,
                                   std::int64_t nb) noexcept {
  std::int64_t i = 0, j = 0;
  while (i < na && j < nb) {
    if (a[i] == b[j]) return a[i];
    if (a[i] < b[j]) {
      ++i;
    } else {
      ++j;
    }
  }
  return -1;
}

/// Where a block id sits: entry `entry` of sequence `seq`'s block table.
struct block_entry {
  std::int64_t seq = -1;
  std::int64_t entry = -1;
};

/// First entry holding `id` that comes after `after` in (sequence, entry) order.
template <class SeqFn>
block_entry locate_block_id(const SeqFn& sequence, std::int64_t num_seqs, std::int32_t id, block_entry after = {}) {
  for (std::int64_t s = after.seq < 0 ? 0 : after.seq; s < num_seqs; ++s) {
    const auto v = sequence(s);
    const std::int64_t used = used_blocks_or_zero(v);
    for (std::int64_t e = 0; e < used; ++e) {
      const std::int64_t b = table_entry(v, e);
      if ((s != after.seq || b > after.entry) && v.block_table[b] == id) return {s, b};
    }
  }
  return {};
}

/// How a block-table entry is named: "keys.block_table[3]" for one sequence,
/// "keys[2].block_table[3]" in a batch view, "seqs[2].keys.block_table[3]" in a compressor call.
enum class block_naming { single, batch, seqs };

struct block_entry_name {
  char text[2 * status::max_argument];  // roomy enough for two int64s; status::error truncates
  block_entry_name(const char* arg, bool batch, block_entry e) noexcept
      : block_entry_name(arg, batch ? block_naming::batch : block_naming::single, e) {}
  block_entry_name(const char* arg, block_naming style, block_entry e) noexcept {
    const long long s = static_cast<long long>(e.seq), b = static_cast<long long>(e.entry);
    if (style == block_naming::batch) {
      std::snprintf(text, sizeof(text), "%s[%lld].block_table[%lld]", arg, s, b);
    } else if (style == block_naming::seqs) {
      std::snprintf(text, sizeof(text), "seqs[%lld].%s.block_table[%lld]", s, arg, b);
    } else {
      std::snprintf(text, sizeof(text), "%s.block_table[%lld]", arg, b);
    }
  }
  operator const char*() const noexcept { return text; }
};

/// Writes the ids of a view's used blocks (used_blocks_or_zero of them, tables in head order)
/// to `out`; returns how many.
template <class T>
std::int64_t gather_block_ids(const cache_view<T>& v, std::int32_t* out) noexcept {
  const std::int64_t used = used_blocks_or_zero(v);
  for (std::int64_t e = 0; e < used; ++e) out[e] = static_cast<std::int32_t>(v.block_table[table_entry(v, e)]);
  return used;
}

/// Scratch ids `check_block_ids` needs: every used block of every paged sequence of K and V.
template <class KSeq, class VSeq>
std::int64_t block_id_scratch(std::int64_t num_seqs, const KSeq& kseq, const VSeq& vseq) noexcept {
  std::int64_t n = 0;
  for (std::int64_t s = 0; s < num_seqs; ++s)  // saturating: size queries see unvalidated views
    n = saturating_add(n, saturating_add(used_blocks_or_zero(kseq(s)), used_blocks_or_zero(vseq(s))));
  return n;
}

/// Compaction writes through the block tables, so no physical block may be reached twice:
/// not twice by one sequence, not by two sequences of a batch (vLLM prefix sharing must be
/// resolved, copy-on-write, before eviction), and not by both K and V when they share a
/// pool. Views are already valid (block ids in range). `scratch` holds block_id_scratch ids.
/// `karg`, `varg`: the views' argument names.
template <class KSeq, class VSeq>
status check_block_ids(std::int64_t num_seqs, const KSeq& kseq, const VSeq& vseq, bool v_same_tables, bool shared_pool,
                       std::int32_t* scratch, const char* fn, bool batch, const char* karg = "keys",
                       const char* varg = "values") {
  const char* scope = batch ? "across the batch's used blocks (a block shared by two sequences cannot be compacted "
                              "in place)"
                            : "among the used blocks (compaction through a repeated block is ill-defined)";
  std::int64_t nk = 0, nv = 0;
  for (std::int64_t s = 0; s < num_seqs; ++s) nk += gather_block_ids(kseq(s), scratch + nk);
  std::int32_t* vids = scratch + nk;
  for (std::int64_t s = 0; s < num_seqs; ++s) nv += gather_block_ids(vseq(s), vids + nv);
  const std::int32_t kdup = find_duplicate_id(scratch, nk);
  if (kdup >= 0) {
    const block_entry first = locate_block_id(kseq, num_seqs, kdup);
    const block_entry second = locate_block_id(kseq, num_seqs, kdup, first);
    return status::error(errc::invalid_argument, fn, block_entry_name(karg, batch, second),
                         "expected distinct block ids %s, got id %d again (first at %s)", scope, static_cast<int>(kdup),
                         block_entry_name(karg, batch, first).text);
  }
  const std::int32_t vdup = find_duplicate_id(vids, nv);
  if (vdup >= 0 && !v_same_tables) {
    const block_entry first = locate_block_id(vseq, num_seqs, vdup);
    const block_entry second = locate_block_id(vseq, num_seqs, vdup, first);
    return status::error(errc::invalid_argument, fn, block_entry_name(varg, batch, second),
                         "expected distinct block ids %s, got id %d again (first at %s)", scope, static_cast<int>(vdup),
                         block_entry_name(varg, batch, first).text);
  }
  if (shared_pool) {
    const std::int32_t common = find_common_id(scratch, nk, vids, nv);
    if (common >= 0) {
      const block_entry at_v = locate_block_id(vseq, num_seqs, common);
      const block_entry at_k = locate_block_id(kseq, num_seqs, common);
      return status::error(errc::invalid_argument, fn, block_entry_name(varg, batch, at_v),
                           "K and V share one block pool: expected block ids distinct from the keys', got id %d, "
                           "also at %s",
                           static_cast<int>(common), block_entry_name(karg, batch, at_k).text);
    }
  }
  return status();
}

/// In place, compaction rewrites every block a compacted sequence uses, so no other sequence
/// of the same call may reach one of them (prefix caching shares blocks between requests:
/// the other one would read rows moved under it). check_block_ids' rule for a batch where
/// only some sequences are written: `written(s)` says which; the others may share blocks
/// among themselves. Two views reach one block when they address one pool (same_block_pool) with
/// the same id; strided views reach none. Views are valid. `scratch`: the used blocks of the
/// largest written sequence (block_id_scratch(1, ...) of it). Names entries as `style` says.
template <class KSeq, class VSeq, class Written>
status check_blocks_not_reached(std::int64_t num_seqs, const KSeq& kseq, const VSeq& vseq, const Written& written,
                                std::int32_t* scratch, const char* fn, block_naming style) {
  for (std::int64_t c = 0; c < num_seqs; ++c) {
    if (!written(c)) continue;
    const auto ck = kseq(c);
    const auto cv = vseq(c);
    if (!ck.is_paged() && !cv.is_paged()) continue;
    std::int32_t* kids = scratch;
    const std::int64_t nk = gather_block_ids(ck, kids);
    std::int32_t* vids = scratch + nk;
    const std::int64_t nv = gather_block_ids(cv, vids);
    std::sort(kids, kids + nk, abi_less());
    std::sort(vids, vids + nv, abi_less());
    for (std::int64_t o = 0; o < num_seqs; ++o) {
      if (o == c) continue;
      // Each of o's views against each of c's that addresses the same pool.
      const auto conflict = [&](const auto& ov, const char* oarg, const auto& cview, const char* carg,
                                const std::int32_t* ids, std::int64_t n) -> status {
        if (n == 0 || !ov.is_paged() || !same_block_pool(ov, cview)) return status();
        const std::int64_t used = used_blocks_or_zero(ov);
        for (std::int64_t e = 0; e < used; ++e) {
          const std::int64_t b = table_entry(ov, e);
          const std::int32_t id = static_cast<std::int32_t>(ov.block_table[b]);
          if (!std::binary_search(ids, ids + n, id, abi_less())) continue;
          const auto cseq = [&](std::int64_t) { return cview; };
          block_entry at_c = locate_block_id(cseq, 1, id);
          at_c.seq = c;
          return status::error(errc::invalid_argument, fn, block_entry_name(carg, style, at_c),
                               "expected blocks that no other sequence of the call reaches (compacted in place; a "
                               "shared prefix: copy it, or compact out of place), got id %d, also at %s",
                               static_cast<int>(id), block_entry_name(oarg, style, block_entry{o, b}).text);
        }
        return status();
      };
      const auto ok = kseq(o);
      const auto ov = vseq(o);
      KVEVICT_RETURN_IF_ERROR(conflict(ok, "keys", ck, "keys", kids, nk));
      KVEVICT_RETURN_IF_ERROR(conflict(ok, "keys", cv, "values", vids, nv));
      KVEVICT_RETURN_IF_ERROR(conflict(ov, "values", ck, "keys", kids, nk));
      KVEVICT_RETURN_IF_ERROR(conflict(ov, "values", cv, "values", vids, nv));
    }
  }
  return status();
}

/// K and V based at the same element share element (0, 0, 0): a caller error that would
/// compact the memory twice. (Other overlaps of K and V are the caller's to rule out.)
template <class KT, class VT>
status check_kv_not_aliased(const cache_view<KT>& keys, const cache_view<VT>& values, const char* fn,
                            const char* varg) noexcept {
  if (keys.is_paged() || values.is_paged() || keys.num_tokens == 0) return status();
  if (static_cast<const void*>(keys.data) == static_cast<const void*>(values.data))
    return status::error(errc::invalid_argument, fn, field_name(varg, "data"),
                         "expected a V cache distinct from the K cache, got the same base pointer");
  return status();
}

/// Batch geometry: sequence lengths present, sequences of a strided batch do not overlap,
/// and every sequence's block-table row holds its used blocks (a short row would borrow
/// the next sequence's ids). Per-sequence views are validated separately.
template <class T>
status validate_batch_layout(const batch_cache_view<T>& b, const char* fn, const char* arg) noexcept {
  if (b.num_seqs < 0)
    return status::error(errc::invalid_shape, fn, field_name(arg, "num_seqs"), "expected >= 0, got %lld",
                         static_cast<long long>(b.num_seqs));
  if (b.num_seqs == 0) return status();
  if (b.seq_lens == nullptr)
    return status::error(errc::null_pointer, fn, field_name(arg, "seq_lens"), "expected [%lld] sequence lengths",
                         static_cast<long long>(b.num_seqs));
  std::int64_t max_len = 0;
  for (std::int64_t s = 0; s < b.num_seqs; ++s) {
    if (b.seq_lens[s] < 0) {
      char name[status::max_argument];
      std::snprintf(name, sizeof(name), "%s.seq_lens[%lld]", arg, static_cast<long long>(s));
      return status::error(errc::invalid_shape, fn, name, "expected >= 0, got %lld",
                           static_cast<long long>(b.seq_lens[s]));
    }
    max_len = std::max(max_len, b.seq_lens[s]);
  }
  const cache_view<T>& l = b.layout;
  if (!b.is_paged()) {
    if (l.num_heads < 1 || l.head_dim < 1) return status();  // reported per sequence, by name
    strided_dim dims[4] = {{b.num_seqs, b.seq_stride, "seq_stride"},
                           {l.num_heads, l.head_stride, "head_stride"},
                           {max_len, l.token_stride, "token_stride"},
                           {l.head_dim, l.dim_stride, "dim_stride"}};
    std::int64_t span = 0;
    return check_box(fn, arg, dims, 4, &span);
  }
  if (l.block_size < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "layout.block_size"), "expected >= 1, got %lld",
                         static_cast<long long>(l.block_size));
  if (b.block_indptr != nullptr) {
    for (std::int64_t s = 0; s < b.num_seqs; ++s) {
      const std::int64_t pages = b.block_indptr[s + 1] - b.block_indptr[s];
      const std::int64_t used = (b.seq_lens[s] + l.block_size - 1) / l.block_size;
      if (b.block_indptr[s] < 0 || pages < used) {
        char name[status::max_argument];
        std::snprintf(name, sizeof(name), "%s.block_indptr[%lld]", arg, static_cast<long long>(s + 1));
        return status::error(errc::invalid_shape, fn, name,
                             "sequence %lld holds %lld tokens (%lld blocks of %lld), got indptr %lld..%lld",
                             static_cast<long long>(s), static_cast<long long>(b.seq_lens[s]),
                             static_cast<long long>(used), static_cast<long long>(l.block_size),
                             static_cast<long long>(b.block_indptr[s]), static_cast<long long>(b.block_indptr[s + 1]));
      }
    }
  } else if (b.num_seqs > 1) {
    const std::int64_t used = (max_len + l.block_size - 1) / l.block_size;
    if (b.block_table_stride < used)
      return status::error(errc::invalid_stride, fn, field_name(arg, "block_table_stride"),
                           "expected >= %lld (the blocks of the longest sequence) so that block-table rows do not "
                           "overlap, got %lld",
                           static_cast<long long>(used), static_cast<long long>(b.block_table_stride));
  }
  return status();
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_VALIDATE_EVICTION_HPP
