// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_SHAPE_HPP
#define KVEVICT_SHAPE_HPP

// The sizes of one layer's eviction problem, used by workspace-size queries so that an
// engine can size scratch once, before the hot path.

#include <cstdint>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN

struct layer_shape {
  std::int64_t num_query_heads = 0;  ///< Hq
  std::int64_t num_kv_heads = 0;     ///< Hkv
  std::int64_t head_dim = 0;         ///< d
  std::int64_t num_tokens = 0;       ///< L (an upper bound is fine)
  std::int64_t num_queries = 0;      ///< W observations per query head (an upper bound is fine)

  constexpr std::int64_t group_size() const noexcept { return num_kv_heads > 0 ? num_query_heads / num_kv_heads : 0; }
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_SHAPE_HPP
