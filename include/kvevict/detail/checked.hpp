// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_CHECKED_HPP
#define KVEVICT_DETAIL_CHECKED_HPP

// Overflow-checked and saturating arithmetic for sizes and extents. Argument checks use the
// checked forms (false on overflow, then an errc::overflow status); size queries, which must
// not fail, use the saturating forms, so an impossible shape reports a size no workspace
// meets and the call itself is then rejected (never a wrapped, small size).

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

inline bool checked_mul(std::int64_t a, std::int64_t b, std::int64_t* out) noexcept {
  return !__builtin_mul_overflow(a, b, out);
}
inline bool checked_add(std::int64_t a, std::int64_t b, std::int64_t* out) noexcept {
  return !__builtin_add_overflow(a, b, out);
}

/// a * b, or INT64_MAX / INT64_MIN (by the sign of the exact product) when it does not fit.
inline std::int64_t saturating_mul(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t r = 0;
  if (!__builtin_mul_overflow(a, b, &r)) return r;
  return (a < 0) == (b < 0) ? std::numeric_limits<std::int64_t>::max() : std::numeric_limits<std::int64_t>::min();
}

/// a + b, or INT64_MAX / INT64_MIN when it does not fit.
inline std::int64_t saturating_add(std::int64_t a, std::int64_t b) noexcept {
  std::int64_t r = 0;
  if (!__builtin_add_overflow(a, b, &r)) return r;
  return a < 0 ? std::numeric_limits<std::int64_t>::min() : std::numeric_limits<std::int64_t>::max();
}

/// a * b, or SIZE_MAX when it does not fit.
inline std::size_t saturating_mul(std::size_t a, std::size_t b) noexcept {
  std::size_t r = 0;
  return __builtin_mul_overflow(a, b, &r) ? std::numeric_limits<std::size_t>::max() : r;
}

/// a + b, or SIZE_MAX when it does not fit.
inline std::size_t saturating_add(std::size_t a, std::size_t b) noexcept {
  std::size_t r = 0;
  return __builtin_add_overflow(a, b, &r) ? std::numeric_limits<std::size_t>::max() : r;
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_CHECKED_HPP
