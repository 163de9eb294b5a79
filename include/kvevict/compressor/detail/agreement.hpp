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
#include "kvevict/compressor/detail/plan_agreement.hpp"
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

  /// Tensor parallelism, plan round 1 (detail/plan_agreement.hpp).
  status learn_heads(const status& local, const char* fn) noexcept {
    return detail::learn_heads(options_, local, fn, &first_head_, &total_heads_);
  }

  /// Tensor parallelism, plan round 2: every rank planned the same configuration.
  template <class List>
  status agree_plan(const status& local, const char* fn) const noexcept {
    std::int64_t delay = 0;
    bool feedback = false;
    if constexpr (has_deferred_v<List>) {
      if (defers<List>()) {
        delay = deferred_traits<List>::config(options_.policy).delay;
        feedback = deferred_traits<List>::config(options_.policy).decode_feedback;
      }
    }
    return detail::agree_plan(
        options_, plan_policy_digest(window_, largest_selection(), defers<List>(), delay, feedback), local, fn);
  }
  /// Tensor parallelism: run()'s agreement round. Every rank passes the same layer, batch size
  /// and, per sequence, the same event, action, token counts and protected tail, or every rank
  /// gets the same error; a rank whose checks failed makes every rank return.
  template <class List, class T, class Q>
  status agree_run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t num_seqs, const status& local,
                   std::int64_t* layer_budgets) const {
    static constexpr const char* fn = "kvevict::compressor::run";
    digest batch;
    std::uint64_t tokens = 0;
    if (local.ok()) {
      for (std::int64_t s = 0; s < num_seqs; ++s) {
        const sequence_io<T, Q>& io = seqs[s];
        plan_step what;
        (void)decide<List>(layer, io, s, &what, layer_budgets);  // checked: cannot fail
        batch.add(static_cast<std::uint64_t>(io.event));
        batch.add(what.observe ? 1u : 0u);
        batch.add(what.decode_round ? 1u : 0u);
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
