// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_PROBE_HPP
#define KVEVICT_VIEWS_PROBE_HPP

// The address a view computes for one element, so an engine can check a layout factory
// against its own tensor in one line before it trusts the view with eviction:
//
//   assert(kvevict::probe_address(view, token, head, channel) == &my_cache[block][slot][head][channel]);
//
// A wrong factory, block order or stride shows up as a different address (the extents of the
// two block orders agree, so no check of the view alone can tell them apart).

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/views/cache_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// &view.at(head, token, channel), or null when token, head or channel is outside the view
/// ([0, num_tokens), [0, num_heads), [0, head_dim)), the view has no data, or (paged) the
/// token's block size, table or table entry cannot be read as a block of the pool (a null
/// table, block_size < 1, an id < 0 or >= num_pool_blocks when that is set). Reads one
/// block-table entry and nothing of the cache.
template <class T>
T* probe_address(const cache_view<T>& view, std::int64_t token, std::int64_t head, std::int64_t channel) noexcept {
  if (view.data == nullptr || token < 0 || token >= view.num_tokens || head < 0 || head >= view.num_heads ||
      channel < 0 || channel >= view.head_dim)
    return nullptr;
  if (view.is_paged()) {
    if (view.block_size < 1) return nullptr;
    const std::int64_t id =
        static_cast<std::int64_t>(view.table_of(view.has_head_tables() ? head : 0)[token / view.block_size]);
    if (id < 0 || (view.num_pool_blocks > 0 && id >= view.num_pool_blocks)) return nullptr;
  }
  return &view.at(head, token, channel);
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_PROBE_HPP
