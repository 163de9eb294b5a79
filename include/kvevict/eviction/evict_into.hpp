// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_EVICTION_EVICT_INTO_HPP
#define KVEVICT_EVICTION_EVICT_INTO_HPP

// Out-of-place eviction: the kept rows of one layer's K and V copied into fresh memory the
// engine supplies (for paged caches, fresh blocks through a destination block table), the
// source left exactly as it was. This is how a sequence whose first blocks are shared with
// other sequences by prefix caching (vLLM, TensorRT-LLM block reuse) is compressed: the
// shared blocks keep their content and their prefix-cache hashes; the sequence switches to
// the destination table and drops its references to the old blocks.
//
// Afterwards head h's destination rows [0, keep.size(h)) hold its kept tokens in ascending
// order. Element copies only; RoPE positions do not change.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/detail/abi_std.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {

/// Copies head h's kept rows: dst row i <- src row keep[i].
template <class ST, class DT>
void copy_kept_rows(const cache_view<ST>& src, const cache_view<DT>& dst, std::int64_t h, const std::int64_t* keep,
                    std::int64_t n) noexcept {
  const std::int64_t d = src.head_dim;
  if (src.dim_stride == 1 && dst.dim_stride == 1) {
    const std::size_t bytes = static_cast<std::size_t>(d) * sizeof(DT);
    for (std::int64_t i = 0; i < n; ++i) {
      if (bytes >= 64 && i + compaction_prefetch_ahead < n)
        prefetch_row(src.row(h, keep[i + compaction_prefetch_ahead]), bytes);
      std::memcpy(dst.row(h, i), src.row(h, keep[i]), bytes);
    }
    return;
  }
  for (std::int64_t c = 0; c < d; ++c)
    for (std::int64_t i = 0; i < n; ++i) dst.at(h, i, c) = src.at(h, keep[i], c);
}

/// Whether two paged views index one pool of blocks: the same block size in bytes and bases
/// less than a block apart (K and V halves of vLLM's packed blocks, or one pool for both).
template <class A, class B>
bool one_pool(const cache_view<A>& a, const cache_view<B>& b) noexcept {
  if (!a.is_paged() || !b.is_paged()) return false;
  const auto bytes = static_cast<std::uintptr_t>(a.block_stride) * sizeof(A);
  if (bytes != static_cast<std::uintptr_t>(b.block_stride) * sizeof(B)) return false;
  const auto pa = reinterpret_cast<std::uintptr_t>(a.data), pb = reinterpret_cast<std::uintptr_t>(b.data);
  return (pa > pb ? pa - pb : pb - pa) < bytes;
}

/// The destination must not reach memory the source or the other destination view holds:
/// for views paged into one pool, no block id in common; otherwise no byte in common.
template <class A, class B>
status check_disjoint(const cache_view<A>& a, const cache_view<B>& b, std::int32_t* scratch, const char* fn,
                      const char* arg, const char* other) noexcept {
  if (a.num_tokens == 0 || b.num_tokens == 0) return status();
  if (one_pool(a, b)) {
    const std::int64_t na = gather_block_ids(a, scratch);
    const std::int64_t nb = gather_block_ids(b, scratch + na);
    std::sort(scratch, scratch + na, abi_less());  // detail/abi_std.hpp says why
    std::sort(scratch + na, scratch + na + nb, abi_less());
    const std::int32_t common = find_common_id(scratch, na, scratch + na, nb);
    if (common >= 0)
      return status::error(errc::invalid_argument, fn, field_name(arg, "block_table"),
                           "expected fresh blocks, got block %d, which %s also uses", static_cast<int>(common), other);
    return status();
  }
  const bool overlap = byte_ranges_overlap(a.data, saturating_mul(static_cast<std::size_t>(view_extent(a)), sizeof(A)),
                                           b.data, saturating_mul(static_cast<std::size_t>(view_extent(b)), sizeof(B)));
  if (overlap)
    return status::error(errc::invalid_argument, fn, field_name(arg, "data"),
                         "expected memory disjoint from %s, got an overlapping view", other);
  return status();
}

/// Every check evict_into runs on its destination (the first `rows` rows of dst), before
/// anything is written: K and V distinct, each destination block reached once, nothing the
/// source holds, no block marked shared. `ids` holds the used blocks of all four views.
template <class SK, class SV, class DK, class DV>
status check_destination(const cache_view<SK>& sk, const cache_view<SV>& sv, const cache_view<DK>& dk,
                         const cache_view<DV>& dv, const eviction_options& opt, std::int32_t* ids,
                         const char* fn) noexcept {
  KVEVICT_RETURN_IF_ERROR(check_kv_not_aliased(dk, dv, fn, "dst_values"));
  if (dk.is_paged() || dv.is_paged()) {  // the destination's own blocks: each reached once
    const auto kseq = [&dk](std::int64_t) { return dk; };
    const auto vseq = [&dv](std::int64_t) { return dv; };
    KVEVICT_RETURN_IF_ERROR(check_block_ids(1, kseq, vseq, same_block_table(dk, dv), same_block_pool(dk, dv), ids, fn,
                                            false, "dst_keys", "dst_values"));
  }
  KVEVICT_RETURN_IF_ERROR(check_disjoint(dk, sk, ids, fn, "dst_keys", "src_keys"));
  KVEVICT_RETURN_IF_ERROR(check_disjoint(dk, sv, ids, fn, "dst_keys", "src_values"));
  KVEVICT_RETURN_IF_ERROR(check_disjoint(dv, sk, ids, fn, "dst_values", "src_keys"));
  KVEVICT_RETURN_IF_ERROR(check_disjoint(dv, sv, ids, fn, "dst_values", "src_values"));
  const written_per_table all{nullptr, {0, dk.num_tokens}, true};
  KVEVICT_RETURN_IF_ERROR(check_shared_writes(dk, all, opt, fn, "dst_keys"));
  return check_shared_writes(dv, all, opt, fn, "dst_values");
}

/// Block ids check_destination needs room for.
template <class SK, class SV, class DK, class DV>
std::int64_t destination_scratch_ids(const cache_view<SK>& sk, const cache_view<SV>& sv, const cache_view<DK>& dk,
                                     const cache_view<DV>& dv) noexcept {
  return saturating_add(saturating_add(used_blocks_or_zero(sk), used_blocks_or_zero(sv)),
                        saturating_add(used_blocks_or_zero(dk), used_blocks_or_zero(dv)));
}

}  // namespace detail

/// Bytes of workspace evict_into needs: 4 bytes per used block of each of the four views
/// (block-id checks), plus alignment; 0 when nothing is paged. Grows only with num_tokens.
template <class SK, class SV, class DK, class DV>
std::size_t evict_into_workspace_size(const cache_view<SK>& src_keys, const cache_view<SV>& src_values,
                                      const cache_view<DK>& dst_keys, const cache_view<DV>& dst_values) noexcept {
  detail::arena a;
  const std::int64_t ids = detail::saturating_add(
      detail::saturating_add(detail::used_blocks_or_zero(src_keys), detail::used_blocks_or_zero(src_values)),
      detail::saturating_add(detail::used_blocks_or_zero(dst_keys), detail::used_blocks_or_zero(dst_values)));
  if (ids > 0) (void)a.take<std::int32_t>(ids);
  return a.used();
}

/// Copies the kept rows of one layer's K and V into destination views, leaving the source as
/// it was.
///
///   src_keys, src_values: [Hkv, L, dk] / [Hkv, L, dv] the layer's cache (read only)
///   dst_keys, dst_values: [Hkv, L', dk] / [Hkv, L', dv] of the same element types, L' at least
///                         the longest head's kept count: the fresh memory (paged: a block
///                         table of fresh blocks; blocks shared with the source are refused)
///   keep:                 CSR keep-list over the source's L tokens
///   result:               head_lengths, positions, max_length as evict() fills them;
///                         freed_blocks = the source's used blocks (this sequence releases them
///                         all; shared ones live on through their other references)
///   ws:                   at least evict_into_workspace_size(src_keys, src_values, dst_keys, dst_values)
///   opt:                  key positions, shared-block marks (a destination block marked shared is
///                         refused); result.changed_blocks lists the destination blocks written
///
/// All or nothing: on error neither view changed.
template <class SK, class SV, class DK, class DV>
status evict_into(cache_view<SK> src_keys, cache_view<SV> src_values, cache_view<DK> dst_keys,
                  cache_view<DV> dst_values, const_keep_list_view keep, eviction_result& result, workspace_span ws = {},
                  const eviction_options& opt = {}, const executor& exec = {}) {
  static_assert(!std::is_const<DK>::value && !std::is_const<DV>::value,
                "kvevict::evict_into writes the destination: pass views of mutable elements");
  static_assert(std::is_same<std::remove_const_t<SK>, DK>::value && std::is_same<std::remove_const_t<SV>, DV>::value,
                "kvevict::evict_into copies elements: destination and source have the same element types");
  static constexpr const char* fn = "kvevict::evict_into";
  KVEVICT_RETURN_IF_ERROR(detail::validate_kv_views(src_keys, src_values, fn, "src_keys", "src_values"));
  KVEVICT_RETURN_IF_ERROR(detail::validate_keep_list(keep, src_keys.num_heads, src_keys.num_tokens, fn, "keep"));
  std::int64_t longest = 0;
  for (std::int64_t h = 0; h < keep.num_heads; ++h) longest = std::max(longest, keep.size(h));
  KVEVICT_RETURN_IF_ERROR(detail::validate_kv_views(dst_keys, dst_values, fn, "dst_keys", "dst_values"));
  if (dst_keys.num_heads != src_keys.num_heads || dst_keys.head_dim != src_keys.head_dim)
    return status::error(errc::invalid_shape, fn, "dst_keys",
                         "expected the source's [%lld heads, d = %lld], got [%lld, %lld]",
                         static_cast<long long>(src_keys.num_heads), static_cast<long long>(src_keys.head_dim),
                         static_cast<long long>(dst_keys.num_heads), static_cast<long long>(dst_keys.head_dim));
  if (dst_values.head_dim != src_values.head_dim)
    return status::error(errc::invalid_shape, fn, "dst_values.head_dim", "expected the source's %lld, got %lld",
                         static_cast<long long>(src_values.head_dim), static_cast<long long>(dst_values.head_dim));
  if (dst_keys.num_tokens < longest)
    return status::error(errc::invalid_shape, fn, "dst_keys.num_tokens",
                         "expected room for the %lld rows the longest head keeps, got %lld",
                         static_cast<long long>(longest), static_cast<long long>(dst_keys.num_tokens));
  const cache_view<DK> dk = dst_keys.first_tokens(longest);
  const cache_view<DV> dv = dst_values.first_tokens(longest);
  detail::arena a(ws);
  std::int32_t* ids = nullptr;
  const std::int64_t n_ids = detail::destination_scratch_ids(src_keys, src_values, dk, dv);
  if (n_ids > 0) ids = a.take<std::int32_t>(n_ids);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (evict_into_workspace_size), got %zu", a.used(), ws.size);
  KVEVICT_RETURN_IF_ERROR(detail::check_destination(src_keys, src_values, dk, dv, opt, ids, fn));
  const detail::written_per_table all{&keep, {0, longest}, true};

  detail::report_eviction(dk, dv, keep, opt.key_positions, result);
  result.freed_blocks = src_keys.is_paged() ? src_keys.num_used_blocks() : src_values.num_used_blocks();
  result.num_changed_blocks = 0;
  if (result.changed_blocks != nullptr) {
    result.num_changed_blocks = detail::list_written_blocks(dk, all, result.changed_blocks);
    if (!detail::same_block_table(dk, dv))
      result.num_changed_blocks +=
          detail::list_written_blocks(dv, all, result.changed_blocks + result.num_changed_blocks);
  }
  struct task_context {
    cache_view<SK> sk;
    cache_view<SV> sv;
    cache_view<DK> dk;
    cache_view<DV> dv;
    const_keep_list_view keep;
  } ctx{src_keys, src_values, dk, dv, keep};
  exec.run(
      keep.num_heads,
      [](void* arg, std::int64_t h, int) {
        const auto& c = *static_cast<const task_context*>(arg);
        const std::int64_t* kept = c.keep.indices + c.keep.offsets[h];
        detail::copy_kept_rows(c.sk, c.dk, h, kept, c.keep.size(h));
        detail::copy_kept_rows(c.sv, c.dv, h, kept, c.keep.size(h));
      },
      &ctx);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EVICTION_EVICT_INTO_HPP
