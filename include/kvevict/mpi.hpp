// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_MPI_HPP
#define KVEVICT_MPI_HPP

// An MPI communicator as kvevict's collective (parallel/collective.hpp, design.md §15).
// Optional: include it where the engine already uses MPI (and link MPI); no other kvevict
// header includes it.
//
//   kvevict::mpi_group group;                       // outlives the compressor
//   group.comm = tp_comm;                           // the ranks that split the KV heads
//   kvevict::collective tp;
//   KVEVICT_RETURN_IF_ERROR(kvevict::make_mpi_collective(&group, &tp));
//   options.tensor_parallel = &tp;
//
// Bounded waits. MPI_Allreduce has no timeout: a rank that never calls leaves the others
// waiting. kvevict never makes a rank skip a collective the others make (mismatched shapes and
// failures are errors on every rank), so that only happens when a process dies or hangs outside
// kvevict. For that case set `timeout_seconds`: each all-reduce then runs as MPI_Iallreduce on
// the group's staging buffer, polled until it completes or the time is up. On timeout the call
// returns collective_error and the group refuses further calls: MPI cannot cancel a collective,
// so the request stays pending (and keeps the staging buffer) until every rank has called it;
// the engine aborts the communicator (MPI_Abort), or, if the late rank does come, drains it
// with mpi_group_drain().

#include <mpi.h>

#include <climits>
#include <cstdint>
#include <cstdio>
#include <cstring>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/collective.hpp"

KVEVICT_NAMESPACE_BEGIN

/// What make_mpi_collective adapts: the communicator and the waiting policy. Its address is
/// the collective's context: keep it alive and in place while the collective is used.
struct mpi_group {
  MPI_Comm comm = MPI_COMM_NULL;
  /// 0: MPI_Allreduce, waiting as long as MPI does. > 0: give up after this many seconds.
  double timeout_seconds = 0.0;
  /// With a timeout: staging for the nonblocking call, the same size on every rank. Larger calls
  /// go in pieces; compressor::collective_words() is the most one call of a plan passes.
  std::uint32_t* staging = nullptr;
  std::int64_t staging_words = 0;
  /// Set after a timeout: the pending request (MPI_REQUEST_NULL otherwise).
  MPI_Request pending = MPI_REQUEST_NULL;
};

namespace detail {

inline status mpi_error(int code, const char* what) noexcept {
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  if (MPI_Error_string(code, text, &length) != MPI_SUCCESS) std::snprintf(text, sizeof(text), "MPI error %d", code);
  return status::error(errc::collective_error, "kvevict::mpi_all_reduce", what, "%s", text);
}

/// One piece of at most INT_MAX words.
inline status mpi_reduce_piece(mpi_group& g, std::uint32_t* data, int count, MPI_Op op) noexcept {
  if (g.timeout_seconds <= 0.0) {
    const int rc = MPI_Allreduce(MPI_IN_PLACE, data, count, MPI_UINT32_T, op, g.comm);
    return rc == MPI_SUCCESS ? status() : mpi_error(rc, "MPI_Allreduce");
  }
  std::memcpy(g.staging, data, static_cast<std::size_t>(count) * sizeof(std::uint32_t));
  MPI_Request request = MPI_REQUEST_NULL;
  int rc = MPI_Iallreduce(MPI_IN_PLACE, g.staging, count, MPI_UINT32_T, op, g.comm, &request);
  if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Iallreduce");
  const double deadline = MPI_Wtime() + g.timeout_seconds;
  int done = 0;
  while (true) {
    rc = MPI_Test(&request, &done, MPI_STATUS_IGNORE);
    if (rc != MPI_SUCCESS) return mpi_error(rc, "MPI_Test");
    if (done) break;
    if (MPI_Wtime() > deadline) {
      g.pending = request;
      return status::error(errc::collective_error, "kvevict::mpi_all_reduce", "timeout_seconds",
                           "no answer from every rank within %g s; the request stays pending (MPI cannot cancel a "
                           "collective): abort the communicator, or mpi_group_drain() once the late rank has called",
                           g.timeout_seconds);
    }
  }
  std::memcpy(data, g.staging, static_cast<std::size_t>(count) * sizeof(std::uint32_t));
  return status();
}

inline status mpi_all_reduce(void* context, std::uint32_t* data, std::int64_t count, reduce_op op) noexcept {
  mpi_group& g = *static_cast<mpi_group*>(context);
  if (g.pending != MPI_REQUEST_NULL)
    return status::error(errc::collective_error, "kvevict::mpi_all_reduce", "pending",
                         "an earlier all-reduce timed out and is still pending: drain it or abort the communicator");
  const MPI_Op mpi_op = op == reduce_op::sum ? MPI_SUM : MPI_MAX;
  // Pieces of a size every rank computes alike (count and staging_words are the same everywhere).
  const std::int64_t limit = g.timeout_seconds > 0.0 ? g.staging_words : static_cast<std::int64_t>(INT_MAX);
  for (std::int64_t done = 0; done < count;) {
    const std::int64_t n = count - done < limit ? count - done : limit;
    KVEVICT_RETURN_IF_ERROR(mpi_reduce_piece(g, data + done, static_cast<int>(n), mpi_op));
    done += n;
  }
  return status();
}

}  // namespace detail

/// Fills `out` (rank and size from g->comm) to all-reduce over g->comm.
inline status make_mpi_collective(mpi_group* g, collective* out) noexcept {
  static constexpr const char* fn = "kvevict::make_mpi_collective";
  if (g == nullptr) return status::error(errc::null_pointer, fn, "group", "expected an mpi_group");
  if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected a collective to fill");
  if (g->comm == MPI_COMM_NULL)
    return status::error(errc::invalid_argument, fn, "group.comm", "expected a communicator");
  if (g->timeout_seconds > 0.0 && (g->staging == nullptr || g->staging_words < 1 || g->staging_words > INT_MAX))
    return status::error(errc::invalid_argument, fn, "group.staging",
                         "a timeout needs a staging buffer of 1 .. INT_MAX words, got %lld",
                         static_cast<long long>(g->staging_words));
  int rank = 0, size = 0;
  int rc = MPI_Comm_rank(g->comm, &rank);
  if (rc == MPI_SUCCESS) rc = MPI_Comm_size(g->comm, &size);
  if (rc != MPI_SUCCESS) return detail::mpi_error(rc, "group.comm");
  collective c;
  c.rank = rank;
  c.world_size = size;
  c.context = g;
  c.all_reduce = &detail::mpi_all_reduce;
  *out = c;
  return status();
}

/// After a timeout: waits for the pending all-reduce (every rank has called it by now) and lets
/// the group be used again. Its result is discarded: the call that timed out already failed.
inline status mpi_group_drain(mpi_group* g) noexcept {
  if (g == nullptr) return status::error(errc::null_pointer, "kvevict::mpi_group_drain", "group", "expected non-null");
  if (g->pending == MPI_REQUEST_NULL) return status();
  const int rc = MPI_Wait(&g->pending, MPI_STATUS_IGNORE);
  if (rc != MPI_SUCCESS) return detail::mpi_error(rc, "MPI_Wait");
  g->pending = MPI_REQUEST_NULL;
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_MPI_HPP
