// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_KVEVICT_HPP
#define KVEVICT_KVEVICT_HPP

// kvevict: KV-cache eviction policies for LLM inference engines (CPU path; no dependency).
// The CUDA path is separate: #include <kvevict/cuda.cuh>.
//
// Folders: compressor/ (the planned, one-call-per-layer entry point), views/ (how a cache is
// laid out), scoring/ (the math), policies/ (what to keep), budgets/ (how many per layer and
// head), selection/ (top-B keep-lists), eviction/ (compacting the cache), rope/ (position
// helpers).

#include "kvevict/config.hpp"
#include "kvevict/cpu_isa.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/workspace.hpp"

#include "kvevict/views/attention_view.hpp"
#include "kvevict/views/batch_cache_view.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/layer_cache.hpp"
#include "kvevict/views/layouts.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/probe.hpp"
#include "kvevict/views/query_view.hpp"

#include "kvevict/scoring/attention_scores.hpp"
#include "kvevict/scoring/observation_scores.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/scoring/presets.hpp"

#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/selection/select.hpp"

#include "kvevict/budgets/adakv.hpp"
#include "kvevict/budgets/layer_budget.hpp"
#include "kvevict/budgets/pyramidkv.hpp"

#include "kvevict/policies/chunkkv.hpp"
#include "kvevict/policies/dapq.hpp"
#include "kvevict/policies/deferkv.hpp"
#include "kvevict/policies/deferkv_state.hpp"
#include "kvevict/policies/h2o.hpp"
#include "kvevict/policies/keydiff.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/layer_inputs.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "kvevict/policies/tova.hpp"

#include "kvevict/eviction/evict.hpp"
#include "kvevict/eviction/evict_batch.hpp"
#include "kvevict/eviction/evict_into.hpp"
#include "kvevict/eviction/flatten_varlen.hpp"
#include "kvevict/eviction/keep_positions.hpp"
#include "kvevict/policies/scoring_policy.hpp"

#include "kvevict/rope/rope.hpp"

#include "kvevict/compressor/compressor.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/sequence.hpp"

#endif  // KVEVICT_KVEVICT_HPP
