// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_PLAN_AGREEMENT_HPP
#define KVEVICT_COMPRESSOR_DETAIL_PLAN_AGREEMENT_HPP

// Tensor parallelism's two plan rounds (design.md §15), the same for kvevict::compressor and
// cuda::compressor, so that a group may mix them only where they agree: each rank learns where
// its KV heads start, then every rank checks that the group planned the same configuration. A
// rank that failed makes every rank return the same error.

#include <cstdint>
#include <cstring>

#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/agreement.hpp"
#include "kvevict/parallel/collective.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Plan round 1 (u32 sum): every rank's KV head count in its slot, and whether it failed so
/// far. *first_head: where this rank's heads start; *total_heads: the group's.
inline status learn_heads(const compressor_options& o, const status& local, const char* fn, std::int64_t* first_head,
                          std::int64_t* total_heads) noexcept {
  const collective& g = *o.tensor_parallel;
  std::uint32_t words[max_world_size + 1] = {};
  const std::int64_t heads = o.model.num_kv_heads;
  if (local.ok()) words[g.rank] = static_cast<std::uint32_t>(heads > 0xffff ? 0xffff : heads);
  words[g.world_size] = local.ok() ? 0u : 1u;
  KVEVICT_RETURN_IF_ERROR(all_reduce(g, words, g.world_size + 1, reduce_op::sum, fn, "tensor_parallel"));
  KVEVICT_RETURN_IF_ERROR(after_round(g, fn, "tensor_parallel", local, words[g.world_size]));
  *first_head = 0;
  *total_heads = 0;
  for (std::int32_t r = 0; r < g.world_size; ++r) {
    if (r == g.rank) *first_head = *total_heads;
    *total_heads += words[r];
  }
  return status();
}

/// The policy's part of plan round 2: its observation window, its largest protected tail and
/// mode, and for a policy that defers eviction its delay and whether decode steps feed back.
inline std::uint64_t plan_policy_digest(std::int64_t window, const selection_params& tail, bool deferred,
                                        std::int64_t delay, bool feedback) noexcept {
  digest policy;
  policy.add(static_cast<std::uint64_t>(window));
  policy.add(static_cast<std::uint64_t>(tail.protected_tail));
  policy.add(static_cast<std::uint64_t>(tail.mode));
  if (deferred) {
    policy.add(static_cast<std::uint64_t>(delay));
    policy.add(feedback ? 1u : 0u);
  }
  return policy.h;
}

/// Plan round 2 (max): every rank planned the same configuration (`policy`: plan_policy_digest).
inline status agree_plan(const compressor_options& o, std::uint64_t policy, const status& local,
                         const char* fn) noexcept {
  const model_shape& m = o.model;
  const auto bits = [](double x) {
    std::uint64_t u = 0;
    std::memcpy(&u, &x, sizeof(u));
    return u;
  };
  digest budget;
  budget.add(static_cast<std::uint64_t>(o.per_head.type));
  budget.add(static_cast<std::uint64_t>(o.per_head.count));
  budget.add(bits(o.per_head.compression_ratio));
  digest decoding;  // decode-time budgets: the target, N and the scorer's window and protected tail
  if (o.decoding.enabled()) {
    const selection_params tail = largest_selection(decoding_options(o));
    decoding.add(static_cast<std::uint64_t>(o.decoding.target.type));
    decoding.add(static_cast<std::uint64_t>(o.decoding.target.count));
    decoding.add(bits(o.decoding.target.compression_ratio));
    decoding.add(static_cast<std::uint64_t>(o.decoding.interval));
    decoding.add(static_cast<std::uint64_t>(o.decoding.policy.kind()));
    decoding.add(static_cast<std::uint64_t>(o.decoding.policy.chunk_length));
    decoding.add(static_cast<std::uint64_t>(decoding_window(o)));
    decoding.add(static_cast<std::uint64_t>(tail.protected_tail));
    decoding.add(static_cast<std::uint64_t>(tail.mode));
  }
  const agreement_field fields[] = {
      {"model.num_layers", static_cast<std::uint64_t>(m.num_layers)},
      {"model.num_query_heads",
       static_cast<std::uint64_t>(m.num_kv_heads > 0 ? m.num_query_heads / m.num_kv_heads : 0)},
      {"model.head_dim", static_cast<std::uint64_t>(m.head_dim)},
      {"model.value_head_dim", static_cast<std::uint64_t>(m.value_head_dim)},
      {"model.storage", static_cast<std::uint64_t>(m.storage)},
      {"model.query_storage", static_cast<std::uint64_t>(m.query_storage)},
      {"policy.kind", static_cast<std::uint64_t>(o.policy.kind())},
      {"policy", policy, true},
      {"per_head", budget.h, true},
      {"heads", static_cast<std::uint64_t>(o.heads)},
      {"adakv.alpha", bits(o.adakv.alpha)},
      {"adakv.normalize", o.adakv.normalize ? 1u : 0u},
      {"adakv.rule", static_cast<std::uint64_t>(o.adakv.rule)},
      {"layers", static_cast<std::uint64_t>(o.layers)},
      {"pyramid_beta", bits(o.pyramid_beta)},
      {"scope", static_cast<std::uint64_t>(o.scope)},
      {"combine", static_cast<std::uint64_t>(o.combine)},
      {"lengths", static_cast<std::uint64_t>(o.lengths)},
      {"compact", static_cast<std::uint64_t>(o.compact)},
      {"limits.max_sequences", static_cast<std::uint64_t>(o.limits.max_sequences)},
      {"limits.max_tokens", static_cast<std::uint64_t>(o.limits.max_tokens)},
      {"limits.max_queries", static_cast<std::uint64_t>(o.limits.max_queries)},
      {"chunked_prefill", o.chunked_prefill ? 1u : 0u},
      {"decoding", decoding.h, true},
  };
  static_assert(sizeof(fields) / sizeof(fields[0]) <= max_agreement_fields, "one agreement round");
  return agree(*o.tensor_parallel, fn, "tensor_parallel", local, fields,
               static_cast<int>(sizeof(fields) / sizeof(fields[0])));
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_PLAN_AGREEMENT_HPP
