// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_CUH
#define KVEVICT_CUDA_CUH

// kvevict's optional CUDA header (design.md §8): the scoring, selection and eviction
// pipeline as kernels, for engines whose caches live on the GPU. Compile with nvcc (C++17).
// Never included by the CPU headers; includes no Eigen.
//
//   cuda::observation_scores   fused scoring (K tile read once per KV head for all G*W queries)
//   cuda::decode_observation   DeferKV decode step (W = 1), a bandwidth-bound stream over K
//   cuda::finalize_state_scores  scores from a running state (normalise, pool, +inf tail)
//   cuda::select / select_rows exact top-B of many ragged rows in one launch (radix select)
//   cuda::compact              in-place compaction of K and V (staged, hazard-free)
//   cuda::select_layer         a layer's keep set under uniform, PyramidKV or AdaKV budgets
//   cuda::compressor           the compressor plan (SnapKV, DeferKV) driving all of the above
//
// Conventions: every call returns a kvevict::status (no exceptions), has a workspace-size
// query, takes a caller-owned device workspace and a stream (launch_options), never
// allocates and never synchronises. See docs/cuda.md.

#include "kvevict/cuda/adakv.cuh"
#include "kvevict/cuda/chunk_scores.cuh"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/compact.cuh"
#include "kvevict/cuda/compact_batch.cuh"
#include "kvevict/cuda/compact_into.cuh"
#include "kvevict/cuda/compressor.cuh"
#include "kvevict/cuda/decode_observation.cuh"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/cuda/head_mean_scores.cuh"
#include "kvevict/cuda/key_scores.cuh"
#include "kvevict/cuda/keydiff_scores.cuh"
#include "kvevict/cuda/observation_scores.cuh"
#include "kvevict/cuda/observation_scores_batch.cuh"
#include "kvevict/cuda/rerotate.cuh"
#include "kvevict/cuda/scope.cuh"
#include "kvevict/cuda/select.cuh"
#include "kvevict/cuda/select_layer.cuh"
#include "kvevict/cuda/select_row.hpp"
#include "kvevict/cuda/select_wide.cuh"
#include "kvevict/views/layouts.hpp"

#endif  // KVEVICT_CUDA_CUH
