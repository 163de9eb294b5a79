// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_LAYER_CACHE_HPP
#define KVEVICT_VIEWS_LAYER_CACHE_HPP

// One layer's K and V of one sequence as eviction sees them: the two views, where compaction
// writes (in place, or fresh memory for prefix-shared blocks), and which blocks are shared.
// Layout factories that describe K and V together (packed K|V, FlashInfer's single tensor)
// return one.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/views/cache_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// The mutable K and V caches of one layer of one sequence, as evict() compacts them, and what
/// the engine says about their blocks.
template <class T>
struct layer_cache {
  layer_cache() = default;
  /// In-place compaction of K and V (the common case: `policy.evict({keys, values}, ...)`).
  KVEVICT_HOST_DEVICE layer_cache(cache_view<T> k, cache_view<T> v) noexcept : keys(k), values(v) {}

  cache_view<T> keys;    ///< [Hkv, L, dk]
  cache_view<T> values;  ///< [Hkv, L, dv]
  /// Out of place (prefix-shared blocks): the destination, fresh memory of the same layout
  /// (paged: a table of fresh blocks); kept rows are copied there and keys/values stay intact.
  /// Empty (null data): compaction in place.
  cache_view<T> dst_keys;
  cache_view<T> dst_values;
  /// Paged caches: references to each block of the pool (> 1: shared by prefix caching), or a
  /// bitmap of shared blocks; in place, a compaction that would write a shared block is refused.
  const std::int32_t* block_refcounts = nullptr;
  const std::uint32_t* shared_blocks = nullptr;
  /// false: report the keep set and move nothing (engines that apply keep-lists themselves,
  /// like llama.cpp freeing cells); the result still says what the compaction would leave.
  bool compact = true;

  KVEVICT_HOST_DEVICE bool out_of_place() const noexcept {
    return dst_keys.data != nullptr || dst_values.data != nullptr;
  }
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_LAYER_CACHE_HPP
