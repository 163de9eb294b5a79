// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_RADIX_LOGIC_HPP
#define KVEVICT_CUDA_DETAIL_RADIX_LOGIC_HPP

// The pure logic of the GPU radix select (cuda/select.cuh), in host+device functions so the
// CPU test binary runs the same arithmetic the kernel runs (tests/unit/test_cuda_logic.cpp
// emulates whole rows pass by pass and compares with a full sort).
//
// Order: every score maps to a 32-bit key whose unsigned order is the selection order of
// the CPU (detail/topk.hpp): numbers by value with -0 == +0, NaN below everything. The k
// largest keys are found most significant digit first, 8 bits per pass: each pass counts
// the digits of the keys that still match the decided prefix, and the bucket holding the
// k-th largest key extends the prefix. After at most four passes the prefix is the k-th key
// (or, if a pass ends with the whole bucket taken, a prefix every taken key shares). Keys
// above the prefix are kept; among keys equal to it ("ties") the first `remaining` in index
// order are kept, which is the CPU's smaller-index-wins rule.
//
// Includes only config.hpp and <cstdint>: usable from g++ and from nvcc device code.

#include <cstdint>
#include <cstring>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int radix_bits = 8;
constexpr int radix_buckets = 1 << radix_bits;  // 256
constexpr int radix_passes = 32 / radix_bits;   // 4
/// Digits one warp lane owns when a warp searches the 256 buckets (32 lanes x 8 digits).
constexpr int radix_digits_per_lane = radix_buckets / 32;

/// Unsigned key with the selection order: NaN -> 0, -0 -> key(+0). Equals the CPU's
/// kvevict::detail::score_key bit for bit (tested). Integer operations only: any float
/// operation (a `x += 0.0f` to fold -0 into +0, say) flushes denormal scores to zero under
/// --use_fast_math, tying them with 0.
KVEVICT_HOST_DEVICE inline std::uint32_t radix_key(float x) noexcept {
  std::uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  if ((bits & 0x7fffffffu) > 0x7f800000u) return 0u;  // NaN
  if (bits == 0x80000000u) bits = 0u;                 // -0 -> +0
  return (bits & 0x80000000u) ? ~bits : (bits | 0x80000000u);
}

/// Bit position of the lowest bit of pass p's digit (pass 0 is the most significant).
KVEVICT_HOST_DEVICE constexpr int radix_shift(int pass) noexcept {
  return 32 - radix_bits * (pass + 1);
}

/// The digit of `key` examined by pass p.
KVEVICT_HOST_DEVICE constexpr std::uint32_t radix_digit(std::uint32_t key, int pass) noexcept {
  return (key >> radix_shift(pass)) & static_cast<std::uint32_t>(radix_buckets - 1);
}

/// The decided part of the threshold. A key "matches" when (key & mask) == prefix.
struct radix_state {
  std::uint32_t prefix = 0;
  std::uint32_t mask = 0;
  /// How many of the matching keys are still to be taken (1 <= remaining <= matching).
  std::uint32_t remaining = 0;
  /// Set when the last pass took its whole bucket: every matching key is kept, no more
  /// passes are needed.
  std::uint32_t done = 0;
};

KVEVICT_HOST_DEVICE inline radix_state radix_start(std::uint32_t k) noexcept {
  radix_state s;
  s.remaining = k;
  return s;
}

KVEVICT_HOST_DEVICE inline bool radix_matches(std::uint32_t key, const radix_state& s) noexcept {
  return (key & s.mask) == s.prefix;
}

/// The digit lane `lane` of the searching warp owns at position i (0..7). Lanes walk the
/// buckets from the largest digit down, so a prefix sum over lanes counts larger keys.
KVEVICT_HOST_DEVICE constexpr int radix_lane_digit(int lane, int i) noexcept {
  return radix_buckets - 1 - lane * radix_digits_per_lane - i;
}

/// Sum of the 8 buckets lane `lane` owns.
KVEVICT_HOST_DEVICE inline std::uint32_t radix_lane_sum(const std::uint32_t* hist, int lane) noexcept {
  std::uint32_t sum = 0;
  for (int i = 0; i < radix_digits_per_lane; ++i) sum += hist[radix_lane_digit(lane, i)];
  return sum;
}

/// Whether the bucket holding the `remaining`-th largest matching key lies in this lane's
/// digits, given `greater` = keys in the buckets of all lanes before it (larger digits).
KVEVICT_HOST_DEVICE inline bool radix_lane_owns(std::uint32_t greater, std::uint32_t lane_sum,
                                                std::uint32_t remaining) noexcept {
  return greater < remaining && remaining <= greater + lane_sum;
}

/// In the owning lane: walks its digits from the largest and returns the state after pass
/// `pass` (prefix extended by the chosen digit, remaining reduced by the keys in larger
/// buckets, done when the chosen bucket is taken whole).
KVEVICT_HOST_DEVICE inline radix_state radix_advance(const std::uint32_t* hist, int lane, std::uint32_t greater,
                                                     const radix_state& s, int pass) noexcept {
  radix_state next = s;
  for (int i = 0; i < radix_digits_per_lane; ++i) {
    const int digit = radix_lane_digit(lane, i);
    const std::uint32_t count = hist[digit];
    if (greater + count >= s.remaining) {
      const int shift = radix_shift(pass);
      next.prefix = s.prefix | (static_cast<std::uint32_t>(digit) << shift);
      next.mask = s.mask | (static_cast<std::uint32_t>(radix_buckets - 1) << shift);
      next.remaining = s.remaining - greater;
      next.done = (next.remaining == count || pass == radix_passes - 1) ? 1u : 0u;
      return next;
    }
    greater += count;
  }
  return next;  // unreachable when radix_lane_owns held
}

/// Class of a key against the final state: 2 above the threshold (always kept), 1 a tie
/// (kept while fewer than `remaining` ties precede it), 0 below.
KVEVICT_HOST_DEVICE inline int radix_class(std::uint32_t key, const radix_state& s) noexcept {
  const std::uint32_t top = key & s.mask;
  return top > s.prefix ? 2 : (top == s.prefix ? 1 : 0);
}

/// Counts of above-threshold keys and ties, packed in one word so one block scan carries
/// both: above in the high 16 bits, ties in the low 16 bits. A scan tile must therefore
/// hold fewer than 2^16 keys (select.cuh uses 4096).
KVEVICT_HOST_DEVICE constexpr std::uint32_t radix_pack(std::uint32_t above, std::uint32_t ties) noexcept {
  return (above << 16) | ties;
}
KVEVICT_HOST_DEVICE constexpr std::uint32_t radix_packed_above(std::uint32_t packed) noexcept {
  return packed >> 16;
}
KVEVICT_HOST_DEVICE constexpr std::uint32_t radix_packed_ties(std::uint32_t packed) noexcept {
  return packed & 0xffffu;
}

/// Output slot of a kept key: keys before it that are kept, i.e. every above-threshold key
/// before it plus the ties before it, of which at most `remaining` are kept.
KVEVICT_HOST_DEVICE inline std::int64_t radix_output_slot(std::int64_t above_before, std::int64_t ties_before,
                                                          std::uint32_t remaining) noexcept {
  return above_before +
         (ties_before < static_cast<std::int64_t>(remaining) ? ties_before : static_cast<std::int64_t>(remaining));
}

/// Budget arithmetic of selection/budget.hpp in host+device form (equal to candidates_kept
/// and tokens_kept; tested). mode: 0 inside the budget, 1 on top of it.
KVEVICT_HOST_DEVICE inline std::int64_t select_candidates_kept(std::int64_t budget_tokens, std::int64_t num_tokens,
                                                               std::int64_t protected_tail, int mode) noexcept {
  const std::int64_t protect = protected_tail < num_tokens ? protected_tail : num_tokens;
  const std::int64_t candidates = num_tokens - protect;
  const std::int64_t want = mode == 0 ? budget_tokens - protect : budget_tokens;
  return want < 0 ? 0 : (want > candidates ? candidates : want);
}
KVEVICT_HOST_DEVICE inline std::int64_t select_tokens_kept(std::int64_t budget_tokens, std::int64_t num_tokens,
                                                           std::int64_t protected_tail, int mode) noexcept {
  const std::int64_t protect = protected_tail < num_tokens ? protected_tail : num_tokens;
  return select_candidates_kept(budget_tokens, num_tokens, protected_tail, mode) + protect;
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_RADIX_LOGIC_HPP
