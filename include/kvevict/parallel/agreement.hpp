// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_PARALLEL_AGREEMENT_HPP
#define KVEVICT_PARALLEL_AGREEMENT_HPP

// How a group of ranks fails together instead of waiting on each other forever.
//
// A collective returns only when every rank of the group has called it. If one rank returned
// early with an error, or passed a different shape and so made a different number of calls,
// the others would wait forever (MPI's all-reduce has no timeout). So every sharded call
// (design.md §15) follows two rules:
//   1. its first collective is an agreement: one max all-reduce of each rank's failure flag
//      (so far) and, for each field that decides the rest of the call (token count, budget,
//      protected tail, ...), the value and its complement (max of the complement = min). Every
//      rank then sees the same words and takes the same decision: all go on, or all return an
//      error (the failing rank its own, the others collective_error naming it; a field that
//      differs is the same invalid_shape error on every rank);
//   2. after it, the number, size and kind of collectives depend only on agreed values and on
//      reduced data (identical on every rank), and each data round carries one more word, the
//      number of ranks that failed since, so a late local failure also ends the call on every
//      rank at the same round.
// A cache changes only after its selection has passed its last collective; see design.md §15
// for the one exception (a transport failure between two sequences of one batch).

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/collective.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// A value every rank must pass identically. `digest` fields are hashes: a mismatch says
/// "differs" without printing them.
struct agreement_field {
  const char* name = "";
  std::uint64_t value = 0;
  bool digest = false;
};

constexpr int max_agreement_fields = 24;

/// FNV-1a, to fold a batch's per-sequence values into one agreement field.
struct digest {
  std::uint64_t h = 1469598103934665603ull;
  void add(std::uint64_t v) noexcept {
    for (int i = 0; i < 8; ++i) {
      h ^= (v >> (8 * i)) & 0xffu;
      h *= 1099511628211ull;
    }
  }
};

/// The agreement round (rule 1 above). `local` is this rank's status so far; `arg` names the
/// group in the error the other ranks get. Returns ok on every rank, or an error on every rank.
inline status agree(const collective& c, const char* fn, const char* arg, const status& local,
                    const agreement_field* fields, int n) noexcept {
  if (n > max_agreement_fields) n = max_agreement_fields;  // callers pass compile-time counts below it
  std::uint32_t words[1 + 4 * max_agreement_fields] = {};
  // The lowest failing rank wins the max, with its error code in the low half.
  if (!local.ok())
    words[0] =
        ((0xffffu - static_cast<std::uint32_t>(c.rank)) << 16) | (static_cast<std::uint32_t>(local.code()) & 0xffffu);
  for (int i = 0; i < n; ++i) {
    const std::uint64_t v = local.ok() ? fields[i].value : 0;
    const auto hi = static_cast<std::uint32_t>(v >> 32), lo = static_cast<std::uint32_t>(v);
    std::uint32_t* w = words + 1 + 4 * i;
    w[0] = hi;
    w[1] = lo;
    w[2] = ~hi;
    w[3] = ~lo;
  }
  KVEVICT_RETURN_IF_ERROR(all_reduce(c, words, 1 + 4 * n, reduce_op::max, fn, arg));
  if (words[0] != 0) {
    if (!local.ok()) return local;
    const unsigned failing = 0xffffu - (words[0] >> 16);
    return status::error(errc::collective_error, fn, arg,
                         "rank %u of %d failed its part of this call (%s); nothing changed", failing,
                         static_cast<int>(c.world_size), to_string(static_cast<errc>(words[0] & 0xffffu)));
  }
  for (int i = 0; i < n; ++i) {
    const std::uint32_t* w = words + 1 + 4 * i;
    if (w[0] == ~w[2] && w[1] == ~w[3]) continue;
    if (fields[i].digest)
      return status::error(errc::invalid_shape, fn, fields[i].name, "differs across the %d ranks of the group",
                           static_cast<int>(c.world_size));
    const unsigned long long most = (static_cast<unsigned long long>(w[0]) << 32) | w[1];
    const unsigned long long least = (static_cast<unsigned long long>(~w[2]) << 32) | static_cast<std::uint32_t>(~w[3]);
    return status::error(errc::invalid_shape, fn, fields[i].name,
                         "expected the same value on the %d ranks of the group, got %llu on one and %llu on another",
                         static_cast<int>(c.world_size), least, most);
  }
  return status();
}

/// After a data round whose last word counted failing ranks (rule 2): ok, or an error on every
/// rank (this rank's own if it is one of them).
inline status after_round(const collective& c, const char* fn, const char* arg, const status& local,
                          std::uint32_t failures) noexcept {
  if (failures == 0) return status();
  if (!local.ok()) return local;
  return status::error(errc::collective_error, fn, arg, "%u of the %d ranks failed their part of this call",
                       static_cast<unsigned>(failures), static_cast<int>(c.world_size));
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_PARALLEL_AGREEMENT_HPP
