// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_EVICTION_FLATTEN_VARLEN_HPP
#define KVEVICT_EVICTION_FLATTEN_VARLEN_HPP

// Per-head variable lengths (AdaKV and other head-adaptive budgets) for varlen attention
// kernels: the kept rows of every head, written head after head into one flat [sum_h len_h, d]
// tensor with cumulative offsets cu[Hkv + 1] (FlashAttention's cu_seqlens, one "sequence"
// per head). `evict` already compacts per head and reports lengths; this is the other form.
//
// Out of place into any caller buffer disjoint from the cache. In place only when the cache
// is token-contiguous per head ([Hkv, L, d] as HF keeps it, rows token_stride apart, heads
// at least L rows apart) and the flat rows use the same row stride: the row head h's i-th
// kept token lands on, cu[h] + i, is never after the row it comes from, h*L + keep[h][i],
// because cu[h] <= h*L and i <= keep[h][i]; copying heads and rows in ascending order is
// then a forward copy. Every other overlap is rejected.

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Writes the kept rows of every head into a flat varlen layout.
///
///   src:            [Hkv, L, d] (cache_view, any layout and storage type)
///   keep:           CSR keep-list [Hkv], indices strictly ascending in [0, L)
///   dst:            [dst_rows, dst_row_stride] of src's storage type; head h's i-th kept
///                   token goes to row cu[h] + i, channels contiguous
///   dst_rows:       rows dst holds: at least keep.total()
///   dst_row_stride: elements between rows of dst, >= d
///   cu_lengths:     [Hkv + 1] out, optional: cu[0] = 0, cu[h + 1] = cu[h] + keep.size(h)
///                   (equal to keep.offsets)
///   exec:           heads may be copied in parallel (out of place only)
///
/// dst must not overlap src's memory, except for the in-place case described above
/// (dst == src.data, dst_row_stride == src.token_stride, src strided with dim_stride 1,
/// token_stride >= d and head_stride >= L * token_stride). In place, rows of src past the
/// flat rows are stale.
template <class ST>
status flatten_varlen(cache_view<ST> src, const_keep_list_view keep, std::remove_const_t<ST>* dst,
                      std::int64_t dst_rows, std::int64_t dst_row_stride, std::int64_t* cu_lengths = nullptr,
                      const executor& exec = {}) {
  using T = std::remove_const_t<ST>;
  static constexpr const char* fn = "kvevict::flatten_varlen";
  KVEVICT_RETURN_IF_ERROR(detail::validate_cache_view(src, fn, "src"));
  KVEVICT_RETURN_IF_ERROR(detail::validate_keep_list(keep, src.num_heads, src.num_tokens, fn, "keep"));
  const std::int64_t total = keep.total(), d = src.head_dim;
  if (dst_rows < total)
    return status::error(errc::invalid_shape, fn, "dst_rows", "expected >= %lld (keep.total()) rows, got %lld",
                         static_cast<long long>(total), static_cast<long long>(dst_rows));
  if (total > 0 && dst == nullptr) return status::error(errc::null_pointer, fn, "dst", "expected non-null");
  if (dst_row_stride < d)
    return status::error(errc::invalid_stride, fn, "dst_row_stride", "expected >= %lld (src.head_dim), got %lld",
                         static_cast<long long>(d), static_cast<long long>(dst_row_stride));
  std::int64_t dst_extent = 0;  // elements from dst to one past the last flat row's last channel
  if (total > 0 && (!detail::checked_mul(total - 1, dst_row_stride, &dst_extent) ||
                    !detail::checked_add(dst_extent, d, &dst_extent) ||
                    static_cast<std::uint64_t>(dst_extent) > PTRDIFF_MAX / sizeof(T)))
    return status::error(errc::overflow, fn, "dst_row_stride",
                         "the %lld flat rows %lld elements apart span more memory than an address space has",
                         static_cast<long long>(total), static_cast<long long>(dst_row_stride));
  const bool overlap = detail::byte_ranges_overlap(
      src.data, detail::saturating_mul(static_cast<std::size_t>(detail::view_extent(src)), sizeof(T)), dst,
      static_cast<std::size_t>(dst_extent) * sizeof(T));
  if (overlap) {
    const bool in_place = !src.is_paged() && static_cast<const void*>(dst) == static_cast<const void*>(src.data) &&
                          src.dim_stride == 1 && dst_row_stride == src.token_stride && src.token_stride >= d &&
                          (src.num_heads == 1 || src.head_stride >= src.num_tokens * src.token_stride);
    if (!in_place)
      return status::error(errc::invalid_argument, fn, "dst",
                           "expected a buffer disjoint from src, or in place dst == src.data with dst_row_stride == "
                           "src.token_stride over a [Hkv, L, d] source (dim_stride 1, head_stride >= L*token_stride); "
                           "got an overlapping buffer");
  }

  if (cu_lengths != nullptr)
    for (std::int64_t h = 0; h <= keep.num_heads; ++h) cu_lengths[h] = keep.offsets[h];
  if (overlap) {
    // Heads strictly in order: head h+1's rows may land on rows head h has already read.
    T* base = dst;
    const std::size_t bytes = static_cast<std::size_t>(d) * sizeof(T);
    for (std::int64_t h = 0; h < keep.num_heads; ++h) {
      const std::int64_t begin = keep.offsets[h], n = keep.size(h);
      for (std::int64_t i = 0; i < n; ++i) {  // no pointer is formed for heads that keep nothing
        T* to = base + (begin + i) * dst_row_stride;
        const T* from = base + h * src.head_stride + keep.indices[begin + i] * src.token_stride;
        if (to != from) std::memmove(to, from, bytes);
      }
    }
    return status();
  }
  struct task_context {
    cache_view<ST> src;
    const_keep_list_view keep;
    T* dst;
    std::int64_t row_stride;
  } ctx{src, keep, dst, dst_row_stride};
  exec.run(
      keep.num_heads,
      [](void* arg, std::int64_t h, int) {
        const auto& c = *static_cast<const task_context*>(arg);
        const std::int64_t begin = c.keep.offsets[h], n = c.keep.size(h), dim = c.src.head_dim;
        // A head that keeps nothing forms no pointer (begin * row_stride may be past dst, or
        // not even representable) and walks no channel (an empty source may claim any d).
        if (n == 0) return;
        T* out = c.dst + begin * c.row_stride;
        const std::int64_t* kept = c.keep.indices + begin;
        if (c.src.dim_stride == 1) {
          const std::size_t bytes = static_cast<std::size_t>(dim) * sizeof(T);
          for (std::int64_t i = 0; i < n; ++i) std::memcpy(out + i * c.row_stride, c.src.row(h, kept[i]), bytes);
          return;
        }
        // Transposed sources: walk each channel along its tokens.
        for (std::int64_t ch = 0; ch < dim; ++ch)
          for (std::int64_t i = 0; i < n; ++i) out[i * c.row_stride + ch] = c.src.at(h, kept[i], ch);
      },
      &ctx);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EVICTION_FLATTEN_VARLEN_HPP
