// The GPU compressor behind a CUDA-free interface, for the tests (compressor_runner.cu):
// a session plans a kvevict::cuda::compressor, keeps each sequence's device and host state
// across calls, and runs a list of calls, each mirroring the host caches it names to the
// device and copying them back afterwards.
#pragma once

#include <cstdint>
#include <vector>

#include "gpu_runner.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/sequence.hpp"

namespace gpu {

/// One sequence of a call: host views into host buffers. A buffer is copied to the device the
/// first time a call of the session names it and stays there (buffers given by one host
/// pointer are one device buffer), so later calls see what earlier ones did to it.
/// One layer's caches of a sequence (selection_scope::per_sequence: io.layers).
template <class T>
struct layer_sides {
  side<T> k, v;
  side<T> dst_k, dst_v;                       ///< compaction::out_of_place
  std::vector<std::int32_t> block_refcounts;  ///< empty: the sequence's marks
};

template <class T, class Q>
struct compressor_sequence {
  kvevict::sequence_event event = kvevict::sequence_event::idle;
  side<T> k, v;
  side<T> dst_k, dst_v;  ///< compaction::out_of_place; view.data null: none
  kvevict::query_view<const Q> queries;
  host_buffer qbuf;
  std::vector<std::int64_t> key_positions;  ///< empty: position j
  std::vector<float> lse;                   ///< empty: none
  std::int64_t lse_head_stride = 0;
  std::vector<std::int32_t> block_refcounts;         ///< empty: none
  std::vector<std::uint32_t> shared_blocks;          ///< empty: none
  const std::uint32_t* raw_shared_blocks = nullptr;  ///< passed as is when set (refusals: host memory)
  int state = -1;                                    ///< the session's state slot (DeferKV), -1: none
  void* raw_state = nullptr;                         ///< passed as io.state when set (refusals: host memory)
  bool outputs = true;                               ///< pass head_lengths, kept_positions and padded_indices
  bool block_outputs = false;                        ///< pass changed_blocks and head_freed_blocks
  /// The per-sequence scope: every layer's caches (io.layers, each with this sequence's marks);
  /// empty: none.
  std::vector<layer_sides<T>> layers;
};

template <class T, class Q>
struct compressor_call {
  std::int64_t layer = 0;
  std::vector<compressor_sequence<T, Q>> seqs;
};

struct compressor_sequence_result {
  std::vector<unsigned char> keys, values, dst_keys, dst_values;   ///< the buffers afterwards
  std::vector<std::int64_t> head_lengths, kept_positions, padded;  ///< -7 where untouched
  std::vector<std::int32_t> changed_blocks;                        ///< 77 where untouched
  std::vector<std::int64_t> head_freed_blocks;                     ///< -7 where untouched
  /// The buffers of every entry of `layers` afterwards.
  std::vector<std::vector<unsigned char>> layer_keys, layer_values, layer_dst_keys, layer_dst_values;
};

struct compressor_call_result {
  kvevict::status st;
  std::vector<kvevict::sequence_report> reports;
  std::vector<compressor_sequence_result> seqs;    ///< the session's buffers after the call
  std::vector<std::vector<unsigned char>> states;  ///< every state slot's device bytes afterwards
  std::uint32_t flags = 0;
};

struct compressor_session_result {
  kvevict::status plan;
  std::int64_t keep_capacity = 0, keep_capacity_per_head = 0;
  std::vector<compressor_call_result> calls;
};

/// Plans kvevict::cuda::compressor from `options` and runs `calls` in order with
/// `num_states` persistent sequence states. The workspace and the states start as 0xff bytes
/// (NaN floats, -1 indices): a read of anything not written first shows.
template <class T, class Q>
compressor_session_result compressor_session(const kvevict::compressor_options& options,
                                             const std::vector<compressor_call<T, Q>>& calls, int num_states);

/// The status of cuda::compressor::plan for these options (nothing run).
kvevict::status compressor_plan(const kvevict::compressor_options& options);

}  // namespace gpu
