// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_MEMORY_RANGES_HPP
#define KVEVICT_DETAIL_MEMORY_RANGES_HPP

// The memory a view can reach, and whether two byte ranges overlap: how out-of-place writers
// (flatten_varlen, evict_into) prove their destination is not their source.

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/views/cache_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {
/// Elements from v.data to one past the last element any token of the view (or, paged,
/// any block of its pool) can reach. The view is valid (when empty, its paged fields are
/// unchecked: nothing is addressed).
template <class T>
std::int64_t view_extent(const cache_view<T>& v) noexcept {
  if (v.num_tokens == 0) return 0;
  const std::int64_t tokens = v.is_paged() ? (v.num_tokens < v.block_size ? v.num_tokens : v.block_size) : v.num_tokens;
  const std::int64_t last =
      (v.num_heads - 1) * v.head_stride + (tokens - 1) * v.token_stride + (v.head_dim - 1) * v.dim_stride;
  return v.is_paged() ? (v.num_pool_blocks - 1) * v.block_stride + last + 1 : last + 1;
}

inline bool byte_ranges_overlap(const void* a, std::size_t a_bytes, const void* b, std::size_t b_bytes) noexcept {
  if (a_bytes == 0 || b_bytes == 0) return false;
  const std::uintptr_t a0 = reinterpret_cast<std::uintptr_t>(a), b0 = reinterpret_cast<std::uintptr_t>(b);
  // [a0, a0 + a_bytes) and [b0, b0 + b_bytes) intersect; the differences cannot wrap.
  return a0 <= b0 ? b0 - a0 < a_bytes : a0 - b0 < b_bytes;
}
}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_MEMORY_RANGES_HPP
