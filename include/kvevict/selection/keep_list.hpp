// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SELECTION_KEEP_LIST_HPP
#define KVEVICT_SELECTION_KEEP_LIST_HPP

// Keep-lists: which tokens each KV head keeps, in CSR form. Head h keeps token indices
// indices[offsets[h] .. offsets[h+1]), strictly ascending. Ascending order is what makes
// in-place forward compaction safe. The view does not own memory.

#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvevict/config.hpp"
#include "kvevict/detail/abi_std.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class Index>
struct basic_keep_list {
  std::int64_t num_heads = 0;
  Index* offsets = nullptr;  ///< [num_heads + 1], offsets[0] == 0
  Index* indices = nullptr;  ///< [capacity]
  std::int64_t capacity = 0;

  KVEVICT_HOST_DEVICE std::int64_t size(std::int64_t h) const noexcept {
    return static_cast<std::int64_t>(offsets[h + 1] - offsets[h]);
  }
  KVEVICT_HOST_DEVICE std::int64_t total() const noexcept { return static_cast<std::int64_t>(offsets[num_heads]); }
  KVEVICT_HOST_DEVICE Index* head(std::int64_t h) const noexcept { return indices + offsets[h]; }
  template <class U = Index, std::enable_if_t<!std::is_const<U>::value, int> = 0>
  KVEVICT_HOST_DEVICE operator detail::const_view_t<Index, basic_keep_list<const std::int64_t>>() const noexcept {
    return {num_heads, offsets, indices, capacity};
  }
};

/// Mutable keep-list (selection writes it).
using keep_list_view = basic_keep_list<std::int64_t>;
/// Read-only keep-list (eviction reads it).
using const_keep_list_view = basic_keep_list<const std::int64_t>;

/// Owning keep-list storage for callers that do not manage their own (allocates on
/// construction and `resize` only).
class keep_list {
 public:
  keep_list() = default;
  keep_list(std::int64_t num_heads, std::int64_t capacity) { resize(num_heads, capacity); }

  void resize(std::int64_t num_heads, std::int64_t capacity) {
    num_heads_ = num_heads;
    offsets_.assign(static_cast<std::size_t>(num_heads + 1), 0);
    indices_.assign(static_cast<std::size_t>(capacity), 0);
  }

  keep_list_view view() noexcept {
    return {num_heads_, offsets_.data(), indices_.data(), static_cast<std::int64_t>(indices_.size())};
  }
  const_keep_list_view view() const noexcept {
    return {num_heads_, offsets_.data(), indices_.data(), static_cast<std::int64_t>(indices_.size())};
  }
  operator keep_list_view() noexcept { return view(); }
  operator const_keep_list_view() const noexcept { return view(); }

  std::int64_t num_heads() const noexcept { return num_heads_; }
  std::int64_t size(std::int64_t h) const noexcept {
    return offsets_[static_cast<std::size_t>(h + 1)] - offsets_[static_cast<std::size_t>(h)];
  }
  /// Head h's kept indices as a vector (convenience for tests and tools).
  std::vector<std::int64_t> head(std::int64_t h) const {
    return {indices_.begin() + offsets_[static_cast<std::size_t>(h)],
            indices_.begin() + offsets_[static_cast<std::size_t>(h + 1)]};
  }

 private:
  std::int64_t num_heads_ = 0;
  std::vector<std::int64_t, detail::abi_allocator<std::int64_t>> offsets_;  // detail/abi_std.hpp says why
  std::vector<std::int64_t, detail::abi_allocator<std::int64_t>> indices_;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SELECTION_KEEP_LIST_HPP
