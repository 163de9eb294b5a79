// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_STATE_LAYOUT_HPP
#define KVEVICT_COMPRESSOR_DETAIL_STATE_LAYOUT_HPP

// Where a compressor keeps things: the layout of a sequence's state in caller memory (a
// header, the per-sequence scope's row, each layer's policy state, then each layer's
// chunked-prefill window) and of one run()'s workspace. Sizes are fixed by the plan, so a state or workspace is valid
// for every call.

#include <cstddef>
#include <cstdint>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// The head of a sequence's compressor state; each layer's policy state follows it.
struct sequence_state_header {
  std::uint64_t magic = 0;
  std::int64_t layers = 0;
  std::uint64_t layer_bytes = 0;
  std::uint64_t scope_bytes = 0;
  std::uint64_t window_bytes = 0;
};
/// The per-sequence scope's part of the state: layers folded so far, the tokens they scored,
/// whether the keep set was applied; the combined row [max_tokens] follows.
struct scope_state {
  std::int64_t folded = 0;
  std::int64_t tokens = 0;
  std::int64_t done = 0;
  std::int64_t reserved[5] = {};
};
/// A layer's window of queries: before prefill_end the last queries of the prompt chunks seen
/// so far (compressor_options::chunked_prefill), in time order from row 0; after it the last
/// decode queries (compressor_options::decoding), a ring from row `oldest`. Positions
/// [capacity] (int64) and the queries [Hq, capacity, d] (the plan's query type) follow.
/// prefill_end empties it and marks the sequence decoding.
struct window_state {
  std::int64_t count = 0;          ///< rows held (the newest ones seen)
  std::int64_t last_position = 0;  ///< the newest buffered query's position (when seen > 0)
  std::int64_t seen = 0;           ///< queries of every chunk (or decode step) so far, past the capacity too
  std::int64_t oldest = 0;         ///< the ring's oldest row (decode queries; 0 for chunks)
  std::int64_t decoding = 0;       ///< 1 once the layer's prefill_end ran
  std::int64_t reserved[3] = {};
};
constexpr std::uint64_t sequence_state_magic = 0x7173766576656b76ull;  // "vkevevsq"
constexpr std::size_t sequence_state_offset = 64;

inline std::size_t round_up_64(std::size_t n) noexcept {
  return n > std::numeric_limits<std::size_t>::max() - 63 ? std::numeric_limits<std::size_t>::max()
                                                          : (n + 63) / 64 * 64;
}

/// One run()'s workspace.
struct run_layout {
  std::int64_t* layer_budgets = nullptr;  ///< [layers] (PyramidKV)
  std::int64_t* head_lengths = nullptr;   ///< [Hkv] when the caller asks for none
  std::int64_t* indices = nullptr;        ///< [keep capacity] the keep-list (padded output)
  workspace_span policy;                  ///< the policy's evict / observe / scoring workspace
  /// chunked prefill: a window assembled from the buffered rows and the last chunk's
  void* window_queries = nullptr;            ///< [Hq, window capacity, d] of the query type
  std::int64_t* window_positions = nullptr;  ///< [window capacity]
};

/// The per-sequence scope's scratch, carved from run_layout::policy.
struct shared_layout {
  float* scores = nullptr;           ///< [Hkv, L]
  float* row = nullptr;              ///< [L] this layer's combined scores
  std::int64_t* offsets = nullptr;   ///< [Hkv + 1]
  std::int64_t* indices = nullptr;   ///< [keep capacity]
  std::int64_t* one_head = nullptr;  ///< [L + 2]
  workspace_span score, select, compact;
  workspace_span gather;  ///< tensor parallelism: the rows the group exchanges
};

/// What a sequence's event does at this layer (decided before anything changes): observe
/// (a deferred policy's queries into its state), then act on the layer's scores: evict this
/// layer, fold them into the sequence's combined scores, or fold and evict every layer.
enum class step_act { none, evict, fold, fold_and_evict_all };
struct plan_step {
  bool buffer = false;  ///< prefill_chunk: the chunk's last queries into the layer's window
  bool observe = false;
  /// decode-time budgets: the step's queries join the layer's window of decode queries
  bool buffer_decode = false;
  /// the action is a decode-time compression: the decode scorer, its window and target
  bool decode_round = false;
  step_act action = step_act::none;
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_STATE_LAYOUT_HPP
