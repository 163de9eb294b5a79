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

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EVICTION_KEEP_POSITIONS_HPP
