// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_NCCL_HPP
#define KVEVICT_NCCL_HPP

// An NCCL communicator as kvevict's collective (parallel/collective.hpp, design.md §15), for
// engines whose tensor-parallel group is NCCL (vLLM, SGLang, TensorRT-LLM). Optional: include it
// where the engine already uses NCCL and the CUDA runtime (link libnccl and cudart); no other
// kvevict header includes it, and it is host code (no nvcc needed).
//
// kvevict's words live in host memory (the compressor runs on the CPU), and NCCL reduces device
// buffers, so each call copies its words into the engine's device scratch, all-reduces there on
// the engine's stream and copies them back. The scratch must be the same size on every rank
// (make_nccl_collective checks it); calls larger than it go in pieces.
//
//   kvevict::nccl_group group;              // outlives the compressor
//   group.comm = tp_comm;                   // the ranks that split the KV heads
//   group.stream = side_stream;             // any stream of this rank's device
//   group.device_words = scratch;           // cudaMalloc'd, compressor::collective_words() words
//   group.device_capacity = words;
//   kvevict::collective tp;
//   KVEVICT_RETURN_IF_ERROR(kvevict::make_nccl_collective(&group, &tp));   // collective call
//   options.tensor_parallel = &tp;
//
// Bounded waits: with timeout_seconds > 0 each call polls its stream and NCCL's asynchronous
// error; past the deadline it aborts the communicator (ncclCommAbort, NCCL's own way out of a
// collective a peer never joins) and returns collective_error; the group refuses calls after.

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <cstdint>
#include <thread>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/collective.hpp"

KVEVICT_NAMESPACE_BEGIN

/// What make_nccl_collective adapts. Its address is the collective's context: keep it alive and
/// in place while the collective is used.
struct nccl_group {
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;          ///< the copies and the all-reduce run here (0: the legacy stream)
  std::uint32_t* device_words = nullptr;  ///< device scratch of device_capacity words
  std::int64_t device_capacity = 0;
  /// 0: wait for the stream as long as it takes. > 0: abort the communicator after this long.
  double timeout_seconds = 0.0;
  bool aborted = false;  ///< set when a timeout or an NCCL error aborted the communicator
};

namespace detail {

inline status nccl_failure(ncclResult_t r, const char* what) noexcept {
  return status::error(errc::collective_error, "kvevict::nccl_all_reduce", what, "NCCL error %d: %s",
                       static_cast<int>(r), ncclGetErrorString(r));
}
inline status cuda_failure(cudaError_t e, const char* what) noexcept {
  return status::error(errc::collective_error, "kvevict::nccl_all_reduce", what, "CUDA error %d: %s",
                       static_cast<int>(e), cudaGetErrorString(e));
}

/// Waits for the stream: unbounded, or polling until the deadline, then aborting.
inline status nccl_wait(nccl_group& g) noexcept {
  if (g.timeout_seconds <= 0.0) {
    const cudaError_t e = cudaStreamSynchronize(g.stream);
    return e == cudaSuccess ? status() : cuda_failure(e, "cudaStreamSynchronize");
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(g.timeout_seconds);
  while (true) {
    const cudaError_t e = cudaStreamQuery(g.stream);
    if (e == cudaSuccess) return status();
    if (e != cudaErrorNotReady) return cuda_failure(e, "cudaStreamQuery");
    ncclResult_t async = ncclSuccess;
    const ncclResult_t r = ncclCommGetAsyncError(g.comm, &async);
    if (r != ncclSuccess || (async != ncclSuccess && async != ncclInProgress)) {
      (void)ncclCommAbort(g.comm);
      g.aborted = true;
      return nccl_failure(r != ncclSuccess ? r : async, "ncclCommGetAsyncError");
    }
    if (std::chrono::steady_clock::now() > deadline) {
      (void)ncclCommAbort(g.comm);
      g.aborted = true;
      return status::error(errc::collective_error, "kvevict::nccl_all_reduce", "timeout_seconds",
                           "no answer from every rank within %g s: the communicator was aborted", g.timeout_seconds);
    }
    std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

inline status nccl_all_reduce(void* context, std::uint32_t* data, std::int64_t count, reduce_op op) noexcept {
  nccl_group& g = *static_cast<nccl_group*>(context);
  if (g.aborted)
    return status::error(errc::collective_error, "kvevict::nccl_all_reduce", "comm",
                         "the communicator was aborted by an earlier failure");
  const ncclRedOp_t nccl_op = op == reduce_op::sum ? ncclSum : ncclMax;
  for (std::int64_t done = 0; done < count;) {
    const std::int64_t n = count - done < g.device_capacity ? count - done : g.device_capacity;
    const auto bytes = static_cast<std::size_t>(n) * sizeof(std::uint32_t);
    cudaError_t e = cudaMemcpyAsync(g.device_words, data + done, bytes, cudaMemcpyHostToDevice, g.stream);
    if (e != cudaSuccess) return cuda_failure(e, "cudaMemcpyAsync");
    const ncclResult_t r = ncclAllReduce(g.device_words, g.device_words, static_cast<std::size_t>(n), ncclUint32,
                                         nccl_op, g.comm, g.stream);
    if (r != ncclSuccess) return nccl_failure(r, "ncclAllReduce");
    KVEVICT_RETURN_IF_ERROR(nccl_wait(g));
    // Only now, the reduction done: a copy into pageable memory would block without a deadline.
    e = cudaMemcpyAsync(data + done, g.device_words, bytes, cudaMemcpyDeviceToHost, g.stream);
    if (e == cudaSuccess) e = cudaStreamSynchronize(g.stream);
    if (e != cudaSuccess) return cuda_failure(e, "cudaMemcpyAsync");
    done += n;
  }
  return status();
}

}  // namespace detail

/// Fills `out` (rank and size from g->comm) to all-reduce over g->comm. Collective: every rank
/// calls it, and it checks in one all-reduce that every rank's scratch has the same size.
inline status make_nccl_collective(nccl_group* g, collective* out) noexcept {
  static constexpr const char* fn = "kvevict::make_nccl_collective";
  if (g == nullptr) return status::error(errc::null_pointer, fn, "group", "expected an nccl_group");
  if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected a collective to fill");
  if (g->comm == nullptr) return status::error(errc::null_pointer, fn, "group.comm", "expected a communicator");
  if (g->device_words == nullptr || g->device_capacity < 4)
    return status::error(errc::invalid_argument, fn, "group.device_words",
                         "expected device scratch of at least 4 words, got %lld",
                         static_cast<long long>(g->device_capacity));
  int rank = 0, size = 0;
  ncclResult_t r = ncclCommUserRank(g->comm, &rank);
  if (r == ncclSuccess) r = ncclCommCount(g->comm, &size);
  if (r != ncclSuccess) return detail::nccl_failure(r, "group.comm");
  collective c;
  c.rank = rank;
  c.world_size = size;
  c.context = g;
  c.all_reduce = &detail::nccl_all_reduce;
  const auto capacity = static_cast<std::uint64_t>(g->device_capacity);
  std::uint32_t words[4] = {static_cast<std::uint32_t>(capacity >> 32), static_cast<std::uint32_t>(capacity),
                            ~static_cast<std::uint32_t>(capacity >> 32), ~static_cast<std::uint32_t>(capacity)};
  KVEVICT_RETURN_IF_ERROR(detail::nccl_all_reduce(g, words, 4, reduce_op::max));
  if (words[0] != ~words[2] || words[1] != ~words[3])
    return status::error(errc::invalid_argument, fn, "group.device_capacity",
                         "expected the same scratch size on every rank (calls are split by it)");
  *out = c;
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_NCCL_HPP
