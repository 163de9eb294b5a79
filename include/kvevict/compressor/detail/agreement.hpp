// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_AGREEMENT_HPP
#define KVEVICT_COMPRESSOR_DETAIL_AGREEMENT_HPP

// Tensor parallelism's rounds in the compressor (design.md §15): at plan time each rank learns
// where its KV heads start and every rank checks that the group planned the same
// configuration; at run time one round per call checks that every rank runs the same batch.
// A rank that failed makes every rank return the same error. Single-process plans make none.

#include <cstdint>
#include <cstring>

#include "kvevict/compressor/detail/lifecycle.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/error.hpp"
#include "kvevict/parallel/agreement.hpp"
#include "kvevict/parallel/collective.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

class compressor_agreement : protected compressor_lifecycle {
 protected:
  // ---- planning ----------------------------------------------------------------------

  /// Tensor parallelism, plan round 1 (u32 sum): every rank's KV head count in its slot, and
  /// whether it failed so far. Each rank learns where its heads start and how many there are.
  status learn_heads(const status& local, const char* fn) noexcept {
    const collective& g = *options_.tensor_parallel;
    std::uint32_t words[max_world_size + 1] = {};
    const std::int64_t heads = options_.model.num_kv_heads;
    if (local.ok()) words[g.rank] = static_cast<std::uint32_t>(heads > 0xffff ? 0xffff : heads);
    words[g.world_size] = local.ok() ? 0u : 1u;
    KVEVICT_RETURN_IF_ERROR(all_reduce(g, words, g.world_size + 1, reduce_op::sum, fn, "tensor_parallel"));
    KVEVICT_RETURN_IF_ERROR(after_round(g, fn, "tensor_parallel", local, words[g.world_size]));
    first_head_ = 0;
    total_heads_ = 0;
    for (std::int32_t r = 0; r < g.world_size; ++r) {
      if (r == g.rank) first_head_ = total_heads_;
      total_heads_ += words[r];
    }
    return status();
  }

  /// Tensor parallelism, plan round 2 (max): every rank planned the same configuration.
  template <class List>
  status agree_plan(const status& local, const char* fn) const noexcept {
    const compressor_options& o = options_;
    const model_shape& m = o.model;
    const auto bits = [](double x) {
      std::uint64_t u = 0;
      std::memcpy(&u, &x, sizeof(u));
      return u;
    };
    digest budget, policy;
    budget.add(static_cast<std::uint64_t>(o.per_head.type));
    budget.add(static_cast<std::uint64_t>(o.per_head.count));
    budget.add(bits(o.per_head.compression_ratio));
    const selection_params tail = largest_selection();
    policy.add(static_cast<std::uint64_t>(window_));
    policy.add(static_cast<std::uint64_t>(tail.protected_tail));
    policy.add(static_cast<std::uint64_t>(tail.mode));
    if constexpr (has_deferred_v<List>) {
      if (defers<List>()) {
        policy.add(static_cast<std::uint64_t>(deferred_traits<List>::config(o.policy).delay));
        policy.add(deferred_traits<List>::config(o.policy).decode_feedback ? 1u : 0u);
      }
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
        {"policy", policy.h, true},
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
    };
    static_assert(sizeof(fields) / sizeof(fields[0]) <= max_agreement_fields, "one agreement round");
    return agree(*o.tensor_parallel, fn, "tensor_parallel", local, fields,
                 static_cast<int>(sizeof(fields) / sizeof(fields[0])));
  }
  /// Tensor parallelism: run()'s agreement round. Every rank passes the same layer, batch size
  /// and, per sequence, the same event, action, token counts and protected tail, or every rank
  /// gets the same error; a rank whose checks failed makes every rank return.
  template <class List, class T, class Q>
  status agree_run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs,
                   const status& local) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    digest batch;
    std::uint64_t tokens = 0;
    if (local.ok()) {
      for (std::int64_t s = 0; s < num_seqs; ++s) {
        const sequence_io<T, Q>& io = seqs[s];
        plan_step what;
        (void)decide<List>(layer, io, s, &what);  // checked: cannot fail
        batch.add(static_cast<std::uint64_t>(io.event));
        batch.add(what.observe ? 1u : 0u);
        batch.add(static_cast<std::uint64_t>(what.action));
        if (!what.observe && what.action == act::none) continue;
        tokens += static_cast<std::uint64_t>(io.keys.num_tokens);
        batch.add(static_cast<std::uint64_t>(io.keys.num_tokens));
        if (defers<List>()) {
          if constexpr (has_deferred_v<List>) {
            const policy_state st = layer_state(io.state, layer);
            const deferred_policy<List, T, Q> d(deferred_config<List>());
            batch.add(static_cast<std::uint64_t>(d.prompt_tokens(st)));
            batch.add(static_cast<std::uint64_t>(d.steps_observed(st)));
          }
        } else if (what.action != act::none) {
          batch.add(static_cast<std::uint64_t>(scored_tokens<List>(io, layer)));
        }
      }
    }
    const agreement_field fields[] = {
        {"layer", static_cast<std::uint64_t>(layer)},
        {"num_seqs", static_cast<std::uint64_t>(num_seqs)},
        {"seqs[].keys.num_tokens", tokens},
        {"seqs", batch.h, true},
    };
    return agree(*options_.tensor_parallel, fn, "tensor_parallel", local, fields,
                 static_cast<int>(sizeof(fields) / sizeof(fields[0])));
  }
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_AGREEMENT_HPP
