// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_OPTIONS_HPP
#define KVEVICT_COMPRESSOR_OPTIONS_HPP

// What a compressor is planned from (compressor/compressor.hpp): the model's shape, the policy
// and its configuration, the budget and how it spreads over heads and layers, the limits of
// the calls it will serve, and the executor. Everything is a plain value chosen at run time
// (an engine reads it from its configuration), so one compressor type serves every policy.

#include <cstddef>
#include <cstdint>

#include "kvevict/budgets/adakv_params.hpp"
#include "kvevict/budgets/layer_budget_params.hpp"
#include "kvevict/compressor/decode_budget.hpp"
#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/parallel/collective.hpp"
#include "kvevict/policies/configs.hpp"
#include "kvevict/policies/policy_config.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/scoring/presets.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/scope.hpp"

KVEVICT_NAMESPACE_BEGIN

/// model_shape::query_storage left to the storage type's default query type.
constexpr dtype dtype_query_default = static_cast<dtype>(-1);

/// The attention shape of every layer of the model.
struct model_shape {
  std::int64_t num_layers = 0;
  std::int64_t num_query_heads = 0;  ///< Hq
  std::int64_t num_kv_heads = 0;     ///< Hkv (Hq must be a multiple)
  std::int64_t head_dim = 0;         ///< d of K (and of the queries)
  std::int64_t value_head_dim = 0;   ///< d of V; 0 means head_dim
  dtype storage = dtype::bf16;       ///< element type of K and V (fp8: with the views' scales)
  /// Element type of the queries: the storage type for float, fp16 and bf16 caches; for fp8
  /// caches the model's dtype (f32, f16 or bf16). dtype_query_default: storage's default
  /// (default_query_type_t: the storage type, bf16 for fp8).
  dtype query_storage = dtype_query_default;
};

namespace detail {
template <class T>
struct type_tag {
  using type = T;
};
/// f(type_tag<T>, type_tag<Q>) for a model's (validated) storage and query types: the one
/// place the tags become types (the compressors' sizing and their runtime-dtype run()).
template <class F>
auto with_types(dtype storage, dtype queries, F&& f) -> decltype(f(type_tag<float>{}, type_tag<float>{})) {
  auto fp8 = [&](auto t) {
    if (queries == dtype::f32) return f(t, type_tag<float>{});
    if (queries == dtype::f16) return f(t, type_tag<fp16>{});
    return f(t, type_tag<bf16>{});
  };
  switch (storage) {
    case dtype::f32:
      return f(type_tag<float>{}, type_tag<float>{});
    case dtype::f16:
      return f(type_tag<fp16>{}, type_tag<fp16>{});
    case dtype::f8_e4m3:
      return fp8(type_tag<fp8_e4m3>{});
    case dtype::f8_e5m2:
      return fp8(type_tag<fp8_e5m2>{});
    case dtype::bf16:
      break;
  }
  return f(type_tag<bf16>{}, type_tag<bf16>{});
}
}  // namespace detail

inline const char* to_string(policy_kind k) noexcept {
  return detail::visit_policy(default_policies{}, static_cast<std::size_t>(k), "unknown",
                              [](auto traits) { return decltype(traits)::name; });
}

/// How the model's budget spreads over its layers.
enum class layer_allocation : std::int32_t {
  uniform,    ///< every layer keeps the same number of tokens per head
  pyramidkv,  ///< PyramidKV: lower layers more, upper layers less, the same mean
};

/// What the attention kernel reads after eviction (design.md §14): one length for every head of
/// every layer of a sequence (a paged kernel with one seq_len), or per head.
enum class length_mode : std::int32_t {
  per_head,  ///< heads may keep different counts (AdaKV; PyramidKV layers): varlen or per-head tables
  uniform,   ///< every head of every layer keeps the same count; the plan refuses AdaKV and PyramidKV
};

/// What eviction does with the keep set.
enum class compaction : std::int32_t {
  in_place,        ///< K and V are compacted in their own blocks (refused on blocks marked shared)
  out_of_place,    ///< kept rows are copied into fresh blocks the engine supplies; the old ones stay intact
  keep_list_only,  ///< nothing moves: the keep set is reported (llama.cpp frees cells itself)
};

/// Whether the blocks of a paged cache are shared with sequences outside a run() call (prefix
/// caching: vLLM's default), which the compressor cannot see. In place, compaction rewrites
/// every block a compacted sequence uses, so the engine must say how it shares blocks before
/// a paged cache is compacted in place (docs/integration.md, "What the engine must tell
/// kvevict"). Sharing between the sequences of one call is always checked, whatever this says.
enum class block_sharing : std::int32_t {
  undeclared,  ///< not said: run() refuses to compact a paged cache in place
  marked,      ///< every in-place call passes block_refcounts or shared_blocks with each paged
               ///< sequence it compacts (marked blocks are refused; a sequence without marks too)
  none,        ///< the engine never shares a block between sequences (no prefix caching)
};

/// The most a call will see. Workspace and state sizes follow from these and the model
/// shape alone (never from views: a paged cache whose block table is not filled yet sizes
/// the same).
struct compressor_limits {
  std::int64_t max_sequences = 1;  ///< sequences per run() call
  std::int64_t max_tokens = 0;     ///< cache tokens of one sequence at any call (prompt + decoded)
  /// Observation queries per sequence and call; 0 takes the policy's window (SnapKV and
  /// DeferKV W, DapQ N; H2O max_tokens, since every prompt query observes).
  std::int64_t max_queries = 0;
  /// The most physical blocks of a paged pool the caches' views declare (num_pool_blocks):
  /// the GPU compressor's compactions size their block bitmaps by it (0: caches are not
  /// paged). The CPU compressor does not use it.
  std::int64_t max_pool_blocks = 0;
};

/// A called-back summary of each successful run(), for engines' metrics and for tests that
/// count calls. Called on the thread that called run().
struct run_trace {
  std::int64_t layer = 0;
  std::int64_t sequences = 0;
  std::int64_t observed = 0;  ///< sequences whose state took an observation and did not evict
  std::int64_t evicted = 0;   ///< sequences whose cache was compacted
};
struct compressor_tracer {
  void* context = nullptr;
  void (*on_run)(void* context, const run_trace& trace) = nullptr;
};

/// Everything a compressor is planned from.
struct compressor_options {
  model_shape model;
  policy_config policy;
  /// B: tokens each KV head keeps (or a compression ratio of its tokens), counting the
  /// policy's protected tokens as its configuration says (protected_mode).
  budget per_head = budget::ratio(0.5);
  head_allocation heads = head_allocation::uniform;
  adakv_params adakv;  ///< with head_allocation::adakv
  layer_allocation layers = layer_allocation::uniform;
  double pyramid_beta = 20.0;  ///< with layer_allocation::pyramidkv
  /// Which heads share a keep set (selection/scope.hpp), and how their scores combine.
  selection_scope scope = selection_scope::per_head;
  scope_combine combine = scope_combine::normalized_max;
  length_mode lengths = length_mode::per_head;
  compaction compact = compaction::in_place;
  /// How the engine shares paged blocks between sequences: required (marked or none) to
  /// compact a paged cache in place.
  block_sharing sharing = block_sharing::undeclared;
  compressor_limits limits;
  /// The engine prefills a sequence in chunks (vLLM v1, SGLang) and hands each chunk that is
  /// not the last as sequence_event::prefill_chunk: the compressor keeps the chunks' last
  /// queries in the sequence's state (each layer: the policy's window, H2O max_queries rows;
  /// sequence_state_size() grows by [Hq, rows, d] queries per layer), so the last chunk may
  /// hold fewer than the window and the keep set is the unchunked one.
  bool chunked_prefill = false;
  /// Long generation: compress each layer again while decoding, every interval tokens, back to
  /// a target, with a decode scorer (compressor/decode_budget.hpp). Off by default. Each
  /// layer's state keeps the scorer's last decode queries (sequence_state_size() grows by
  /// [Hq, rows, d] queries per layer, as for chunked_prefill; the two share the rows).
  decode_budget decoding;
  executor exec;  ///< heads run through it; scratch is sized for its workers
  compressor_tracer tracer;
  /// Tensor parallelism (design.md §15): the engine's group of ranks that split the model's KV
  /// heads, or null for one process holding them all. Then `model` is this rank's part (its KV
  /// heads, its query heads), the ranks' heads tile the layer in rank order, and plan() and
  /// every run() are collective: every rank of the group calls them, in the same order. The
  /// group must outlive the compressor.
  const collective* tensor_parallel = nullptr;
};

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_OPTIONS_HPP
