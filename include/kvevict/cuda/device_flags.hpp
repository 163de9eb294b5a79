// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DEVICE_FLAGS_HPP
#define KVEVICT_CUDA_DEVICE_FLAGS_HPP

// Problems the CUDA kernels find in device memory. The host validates everything it can see
// without reading device memory (shapes, strides, pointers, parameters) and returns a status
// before launching anything. What only the device can see (block-table entries, positions,
// keep-list contents, row descriptors, weights) is checked by the kernels: each problem sets
// a bit in an optional device word (launch_options::device_flags) with atomicOr, and the
// kernels handle it deterministically (documented per bit). Reading the word is the caller's
// choice: copy it to the host when convenient (that synchronises) and call
// device_flags_status. No CUDA header is needed to decode it.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// Bits of the device flag word.
enum device_flag : std::uint32_t {
  /// A block-table entry outside [0, num_pool_blocks). Scoring treats that token's key as
  /// NaN (no attention, score from the other keys); compaction moves nothing.
  flag_block_id_out_of_range = 1u << 0,
  /// A negative observation position (the CPU rejects it). The observation sees no key with
  /// a non-negative position.
  flag_negative_position = 1u << 1,
  /// Window weights not finite and >= 0 with a sum >= FLT_MIN. Scores are computed anyway and
  /// may be NaN or infinite.
  flag_invalid_weights = 1u << 2,
  /// A keep-list that is not CSR with strictly ascending indices in [0, L) within capacity.
  /// Compaction moves nothing and writes no outputs.
  flag_invalid_keep_list = 1u << 3,
  /// A selection row descriptor out of its domain (length outside [0, max_length], negative
  /// budget or protected tail, unknown mode, null pointer). That row's output is not written.
  flag_invalid_row = 1u << 4,
  /// A physical block reached twice by one compaction (a repeated id in a table, or K and V
  /// sharing a block of one pool). Compaction moves nothing.
  flag_duplicate_block = 1u << 5,
  /// Per-row budgets whose kept tokens exceed the keep-list capacity. Selection writes no
  /// row.
  flag_capacity_exceeded = 1u << 6,
  /// A device-side token count (decode_plan's num_tokens) outside [0, the plan's capacity].
  /// The step changes nothing and is not counted.
  flag_length_out_of_range = 1u << 7,
  /// In-place compaction would write a block marked shared by prefix caching (its reference
  /// count above 1, or its bit in the shared-block bitmap). Compaction moves nothing and
  /// writes no outputs (the CPU's evict refuses the same call).
  flag_shared_block = 1u << 8,
  /// DapQ's pseudo-token positions below the prompt length, or a prompt chunk whose first
  /// position is not after the earlier chunks' newest (cuda::compressor; the CPU refuses both by
  /// name). The call's compaction moves nothing and no keep-list output is written (a late
  /// chunk: at the call that evicts from its window).
  flag_query_position = 1u << 9,
};

/// A status for a device flag word read back by the caller: ok when `flags` is 0, otherwise
/// the most severe problem first (the word may hold several bits).
inline status device_flags_status(std::uint32_t flags, const char* fn = "kvevict::cuda") noexcept {
  if (flags == 0) return status();
  if (flags & flag_block_id_out_of_range)
    return status::error(errc::out_of_range, fn, "block_table", "a block id outside [0, num_pool_blocks) (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_duplicate_block)
    return status::error(errc::invalid_argument, fn, "block_table",
                         "a physical block reached twice (repeated id, or K and V sharing a block) (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_invalid_keep_list)
    return status::error(errc::invalid_keep_list, fn, "keep",
                         "expected CSR offsets and strictly ascending indices in [0, L) (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_shared_block)
    return status::error(errc::invalid_argument, fn, "block_refcounts",
                         "in-place compaction would write a block shared with another sequence: compact out of "
                         "place into fresh blocks (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_query_position)
    return status::error(errc::out_of_range, fn, "queries.positions",
                         "expected DapQ's pseudo-token positions >= the prompt length, and each prompt chunk after "
                         "the earlier chunks' newest query (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_capacity_exceeded)
    return status::error(errc::invalid_keep_list, fn, "out.capacity",
                         "the per-row budgets keep more tokens than the keep-list holds (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_invalid_row)
    return status::error(errc::invalid_argument, fn, "rows",
                         "a row descriptor out of its domain (length, budget, protected tail, mode or pointer) "
                         "(flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_length_out_of_range)
    return status::error(errc::out_of_range, fn, "num_tokens",
                         "expected a device-side token count in [0, the plan's capacity] (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_negative_position)
    return status::error(errc::out_of_range, fn, "queries.positions", "expected positions >= 0 (flags 0x%x)",
                         static_cast<unsigned>(flags));
  if (flags & flag_invalid_weights)
    return status::error(errc::invalid_argument, fn, "inputs.weights",
                         "expected finite weights >= 0 with a sum >= FLT_MIN (flags 0x%x)",
                         static_cast<unsigned>(flags));
  return status::error(errc::device_error, fn, "device_flags", "unknown flag bits 0x%x", static_cast<unsigned>(flags));
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DEVICE_FLAGS_HPP
