// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_SEQUENCE_CUH
#define KVEVICT_CUDA_SEQUENCE_CUH

// What cuda::compressor::run() takes for one sequence at one layer: kvevict::sequence_io with
// device pointers, and the host bookkeeping the GPU path decides from.

#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// One sequence at one layer, on the device: kvevict::sequence_io's fields, with every
/// pointer in device memory (views, their block tables and positions, key_positions, lse,
/// the outputs head_lengths [Hkv], kept_positions [keep_capacity()] and padded_indices
/// [Hkv, keep_capacity_per_head()]), `state` the sequence's sequence_state_size() device
/// bytes, and the host-side bookkeeping below.
template <class T, class Q = default_query_type_t<T>>
struct sequence_io : kvevict::sequence_io<T, Q> {
  /// Host memory of compressor::host_state_size() bytes, set up by compressor::reset_sequence
  /// when the sequence starts: what each layer has observed (DeferKV's phase, prompt length,
  /// decode steps and normaliser), so that run() decides without reading the device. Null
  /// when that size is 0.
  void* host_state = nullptr;
};

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_SEQUENCE_CUH
