// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_PREFILL_WINDOW_CUH
#define KVEVICT_CUDA_DETAIL_PREFILL_WINDOW_CUH

// The chunked-prefill window of cuda::compressor (compressor_options::chunked_prefill), on the
// device: each layer of a sequence keeps, in its device state, the last queries of the prompt
// chunks handed so far, and prefill_end observes with those rows followed by its own, the rows
// the unchunked prompt would have handed -- the CPU compressor's window
// (compressor/detail/prefill_window.hpp), so the keep set is the unchunked one.
//
// The rows sit in a ring of `capacity` slots, so that a chunk never moves the rows it keeps:
// a kernel that shifted them down while writing the new ones would race with itself. The host
// keeps the ring's counts (rows held, oldest slot, queries seen: all known from the calls'
// shapes); the positions are device data, so the order of the chunks (each after the earlier
// chunks' newest query, as the CPU requires) is checked on the device: a chunk out of order
// raises flag_query_position, and the eviction its window feeds is cancelled, whichever call
// evicts (prefill_end, DeferKV's step d, the per-sequence scope's last layer).

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/error.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// A layer's window in the device state: this header (64 bytes), positions [capacity] (int64),
/// then the rows [Hq, capacity, d] of the plan's query type.
struct device_window_header {
  std::int64_t newest_position;  ///< the newest buffered query's position
  std::uint32_t out_of_order;    ///< a chunk (or prefill_end's queries) came before an earlier one
  std::uint32_t reserved[13];
};
static_assert(sizeof(device_window_header) == 64, "the window's rows start 64 bytes in");

/// A layer's window in the host state: what the host knows of the ring (the prompt chunks'
/// rows before prefill_end; the decode steps' after it, under decode-time budgets).
struct host_window_state {
  std::int64_t count = 0;     ///< rows held (the newest so far)
  std::int64_t start = 0;     ///< the slot of the oldest
  std::int64_t seen = 0;      ///< queries of every chunk (or decode step) so far
  std::int64_t decoding = 0;  ///< 1 once the layer's prefill_end ran (compressor_options::decoding)
};

/// One layer's ring in a sequence's device state.
template <class Q>
struct window_ring {
  device_window_header* header = nullptr;
  std::int64_t* positions = nullptr;  ///< [capacity]
  Q* rows = nullptr;                  ///< [Hq, capacity, d]
  std::int64_t capacity = 0;
};

/// The order check of one call's queries (positions[0] after the window's newest, when earlier
/// chunks were buffered), then the header written for the next call. A chunk (cancel null)
/// raises the caller's flag when it comes out of order; prefill_end (cancel given) raises it and
/// the call's cancel word when it or an earlier chunk did. `keep`: the header holds a verdict
/// an eviction still waits for (DeferKV's prompt window, read at its step d) that the first
/// decode step's rows, checked against no earlier row, must not clear. One thread.
__device__ inline void check_window_order(device_window_header* header, index_ptr positions, std::int64_t newest,
                                          bool earlier, std::uint32_t* cancel, std::uint32_t* flags,
                                          bool keep = false) {
  const bool was = (earlier || keep) && header->out_of_order != 0;
  const bool late = earlier && positions[0] <= header->newest_position;
  if (cancel != nullptr ? was || late : late && !was) raise_flag(flags, flag_query_position);
  if ((was || late) && cancel != nullptr) atomicOr(cancel, flag_query_position);
  header->out_of_order = was || late ? 1u : 0u;
  header->newest_position = positions[newest];
}

/// prefill_end's order check (after the call's cancel word is cleared).
template <int Unused = 0>
__global__ void window_order_kernel(device_window_header* header, index_ptr positions, std::int64_t newest,
                                    bool earlier, std::uint32_t* cancel, std::uint32_t* flags) {
  check_window_order(header, positions, newest, earlier, cancel, flags);
}

/// An eviction fed by windows of earlier calls: the verdicts of `layers` windows (a sequence's
/// state, `stride` bytes apart) into the call's cancel word and the caller's flags.
template <int Unused = 0>
__global__ void window_verdicts_kernel(const unsigned char* first, std::size_t stride, std::int64_t layers,
                                       std::uint32_t* cancel, std::uint32_t* flags) {
  for (std::int64_t l = threadIdx.x; l < layers; l += blockDim.x)
    if (reinterpret_cast<const device_window_header*>(first + static_cast<std::size_t>(l) * stride)->out_of_order !=
        0) {
      atomicOr(cancel, flag_query_position);
      raise_flag(flags, flag_query_position);
    }
}

/// A chunk (or a decode step's queries): its order checked against the window's newest
/// (`chunk`: all its queries; block (0, 0)'s first thread: the header is no other thread's;
/// `keep`: see check_window_order), and its last `tail.num_queries` rows into the ring from
/// slot `slot` on (wrapping; none of the slots it keeps). Grid (rows, Hq), the threads over d.
template <class Q>
__global__ void window_append_kernel(query_view<const Q> chunk, query_view<const Q> tail, window_ring<Q> ring,
                                     std::int64_t slot, bool earlier, std::uint32_t* flags, bool keep) {
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0)
    check_window_order(ring.header, chunk.positions, chunk.num_queries - 1, earlier, nullptr, flags, keep);
  const std::int64_t t = blockIdx.x, h = blockIdx.y, d = tail.head_dim;
  const std::int64_t at = (slot + t) % ring.capacity;
  Q* row = ring.rows + (h * ring.capacity + at) * d;
  for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) row[c] = tail.at(h, t, c);
  if (h == 0 && threadIdx.x == 0) ring.positions[at] = tail.positions[t];
}

/// prefill_end's window [Hq, buffered + tail, d] (contiguous) and its positions: the ring's
/// newest `buffered` rows from slot `oldest` (wrapping), then the call's `tail`. Grid (rows, Hq).
template <class Q>
__global__ void window_assemble_kernel(window_ring<Q> ring, std::int64_t oldest, std::int64_t buffered,
                                       query_view<const Q> tail, Q* out, std::int64_t* out_positions) {
  const std::int64_t t = blockIdx.x, h = blockIdx.y, d = tail.head_dim;
  const std::int64_t rows = static_cast<std::int64_t>(gridDim.x);
  Q* dst = out + (h * rows + t) * d;
  if (t < buffered) {
    const std::int64_t at = (oldest + t) % ring.capacity;
    const Q* src = ring.rows + (h * ring.capacity + at) * d;
    for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = src[c];
    if (h == 0 && threadIdx.x == 0) out_positions[t] = ring.positions[at];
  } else {
    for (std::int64_t c = threadIdx.x; c < d; c += blockDim.x) dst[c] = tail.at(h, t - buffered, c);
    if (h == 0 && threadIdx.x == 0) out_positions[t] = tail.positions[t - buffered];
  }
}

/// The threads of a row copy: the head dim rounded up to a warp, at most 256.
inline unsigned window_threads(std::int64_t head_dim) noexcept {
  const std::int64_t warps = (head_dim + 31) / 32;
  return static_cast<unsigned>(warps > 8 ? 256 : warps * 32);
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_PREFILL_WINDOW_CUH
