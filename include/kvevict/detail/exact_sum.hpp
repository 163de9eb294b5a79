// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_EXACT_SUM_HPP
#define KVEVICT_DETAIL_EXACT_SUM_HPP

// The exact sum of the magnitudes of finite floats, rounded once to double. A selection
// scope divides each head's scores by this sum (selection/scope.hpp); computing it exactly
// makes it independent of the order of the additions, so the CPU's loop, a GPU block's
// atomics (cuda/scope.cuh) and tensor-parallel ranks get the same bits.
//
// A float is s * 2^(max(e, 1) - 150) with e its biased exponent and s its significand
// (< 2^24). Bin e sums the significands of exponent e as an integer: exact for up to 2^40
// values. The bins then become one 320-bit integer (in units of 2^-149), rounded once.
// Host and device functions (the same code on both).

#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Bins of finite exponents (255 is inf/NaN and never binned).
constexpr int magnitude_bins = 255;

/// Splits |x| into its bin and significand; false for inf and NaN (not summed).
KVEVICT_HOST_DEVICE inline bool magnitude_parts(float x, int* bin, std::uint64_t* significand) noexcept {
  std::uint32_t u = 0;
  std::memcpy(&u, &x, sizeof(u));
  const std::uint32_t e = (u >> 23) & 0xffu;
  if (e == 0xffu) return false;
  *bin = static_cast<int>(e);
  *significand = (u & 0x7fffffu) | (e != 0 ? 0x800000u : 0u);
  return true;
}

KVEVICT_HOST_DEVICE inline int leading_zeros32(std::uint32_t x) noexcept {
  int n = 0;
  for (std::uint32_t bit = 0x80000000u; bit != 0 && (x & bit) == 0; bit >>= 1) ++n;
  return n;
}

/// 2^k as a double, for k in the normal range (built from its bits: no libm on the device).
KVEVICT_HOST_DEVICE inline double power_of_two(int k) noexcept {
  const std::uint64_t bits = static_cast<std::uint64_t>(k + 1023) << 52;
  double d = 0.0;
  std::memcpy(&d, &bits, sizeof(d));
  return d;
}

/// The value the bins hold, rounded to the nearest double (ties to even).
KVEVICT_HOST_DEVICE inline double bins_to_double(const std::uint64_t* bins) noexcept {
  // 32-bit limbs kept in 64-bit words: each bin adds three pieces below 2^32 and carries are
  // propagated once at the end. Bin e sits at bit max(e, 1) - 1; the top bin's 64 bits end
  // below bit 317, so 11 limbs hold the sum and its carries.
  constexpr int limbs = 11;
  constexpr std::uint64_t low32 = 0xffffffffu;
  std::uint64_t acc[limbs] = {};
  for (int e = 0; e < magnitude_bins; ++e) {
    const std::uint64_t b = bins[e];
    if (b == 0) continue;
    const int shift = (e > 0 ? e : 1) - 1;
    const int limb = shift / 32, bit = shift % 32;
    const std::uint64_t lo = (b & low32) << bit, hi = (b >> 32) << bit;
    acc[limb] += lo & low32;
    acc[limb + 1] += (lo >> 32) + (hi & low32);
    acc[limb + 2] += hi >> 32;
  }
  for (int i = 0; i + 1 < limbs; ++i) {
    acc[i + 1] += acc[i] >> 32;
    acc[i] &= low32;
  }
  int top = limbs - 1;
  while (top >= 0 && acc[top] == 0) --top;
  if (top < 0) return 0.0;
  // The leading 64 bits, the bits below them folded into the lowest bit (round to odd): the
  // conversion to double then rounds as the exact value would.
  const std::uint64_t next = top >= 1 ? acc[top - 1] : 0, third = top >= 2 ? acc[top - 2] : 0;
  const int s = leading_zeros32(static_cast<std::uint32_t>(acc[top]));
  std::uint64_t lead = ((acc[top] << 32) | next) << s;
  bool sticky = false;
  if (s > 0) {
    lead |= third >> (32 - s);
    sticky = (third & ((std::uint64_t{1} << (32 - s)) - 1)) != 0;
  } else {
    sticky = third != 0;
  }
  for (int i = 0; i + 2 < top; ++i) sticky = sticky || acc[i] != 0;
  if (sticky) lead |= 1u;
  // lead's lowest bit is bit 32 * (top - 2) + 32 - s of the sum, in units of 2^-149.
  return static_cast<double>(lead) * power_of_two(32 * (top - 1) - s - 149);
}

/// 1 / sum, rounded to float, or 1 when the sum is 0 or so small that its reciprocal exceeds
/// the largest float (a head with no usable mass keeps its scores as they are: an infinite
/// factor would turn its zeros into NaN).
KVEVICT_HOST_DEVICE inline float reciprocal_of_sum(double sum) noexcept {
  constexpr double largest_float = 3.4028234663852886e38;  // FLT_MAX, exactly
  const double r = sum > 0.0 ? 1.0 / sum : 0.0;
  return (r > 0.0 && r <= largest_float) ? static_cast<float>(r) : 1.0f;
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_EXACT_SUM_HPP
