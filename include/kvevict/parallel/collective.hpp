// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_PARALLEL_COLLECTIVE_HPP
#define KVEVICT_PARALLEL_COLLECTIVE_HPP

// The one thing kvevict asks of a tensor-parallel engine (design.md §15): its own collective
// library, behind a table of two values and a function. kvevict has no transport of its own;
// the engine wraps whatever its ranks already talk through (NCCL, MPI, a Gloo/CPU group, a
// custom all-reduce). kvevict/mpi.hpp and kvevict/nccl.hpp are ready-made adapters; no core
// header includes either.
//
// Only unsigned 32-bit words travel, summed (modulo 2^32) or maxed element-wise. Floats never
// go through the transport's arithmetic: a float sum's order depends on the transport's
// algorithm (ring, tree, number of ranks), so its bits would, and kvevict promises keep-lists
// equal bit for bit to one process holding every head. Floats travel as their bit patterns
// instead (one rank writes a slot, the others add 0), and counts and flags are exact integers.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN

/// How an all-reduce combines the ranks' words, element by element.
enum class reduce_op : std::int32_t {
  sum,  ///< the sum modulo 2^32
  max,  ///< the largest (unsigned)
};

/// A group of ranks (processes or devices) that share a layer's KV heads, as the engine's
/// collective library sees it. Every rank of the group makes the same all_reduce calls in the
/// same order with the same count and op; kvevict keeps that true even when a call fails on
/// some rank (design.md §15), as long as every rank calls the same kvevict entry points.
struct collective {
  std::int32_t rank = 0;        ///< this rank, in [0, world_size)
  std::int32_t world_size = 1;  ///< ranks in the group
  void* context = nullptr;      ///< the engine's communicator, passed back to all_reduce
  /// Replaces data[0, count) on every rank by its element-wise reduction over the group, and
  /// returns when it is there (a blocking call from the caller's point of view). A failure
  /// (a transport error, a timeout) returns an error status; kvevict passes it on.
  status (*all_reduce)(void* context, std::uint32_t* data, std::int64_t count, reduce_op op) = nullptr;
};

namespace detail {

/// The largest group kvevict plans for: planning learns every rank's head count in one
/// [world_size]-word all-reduce held on the stack.
constexpr std::int32_t max_world_size = 1024;

/// Whether `c` can be called at all (checked before any collective: a rank whose table is
/// broken cannot tell the others).
inline status validate_collective(const collective& c, const char* fn, const char* arg) noexcept {
  if (c.all_reduce == nullptr)
    return status::error(errc::null_pointer, fn, arg, "expected an all_reduce function (the engine's collective)");
  if (c.world_size < 1 || c.world_size > max_world_size)
    return status::error(errc::invalid_argument, fn, arg, "expected world_size in [1, %d], got %d", max_world_size,
                         static_cast<int>(c.world_size));
  if (c.rank < 0 || c.rank >= c.world_size)
    return status::error(errc::out_of_range, fn, arg, "expected rank in [0, world_size = %d), got %d",
                         static_cast<int>(c.world_size), static_cast<int>(c.rank));
  return status();
}

/// One all-reduce; a transport failure becomes a collective_error naming the call.
inline status all_reduce(const collective& c, std::uint32_t* data, std::int64_t count, reduce_op op, const char* fn,
                         const char* what) noexcept {
  const status st = c.all_reduce(c.context, data, count, op);
  if (st.ok()) return st;
  return status::error(errc::collective_error, fn, what, "the engine's all_reduce failed on rank %d: %s",
                       static_cast<int>(c.rank), st.message());
}

}  // namespace detail

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_PARALLEL_COLLECTIVE_HPP
