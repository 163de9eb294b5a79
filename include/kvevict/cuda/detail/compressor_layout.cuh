// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_COMPRESSOR_LAYOUT_CUH
#define KVEVICT_CUDA_DETAIL_COMPRESSOR_LAYOUT_CUH

// cuda::compressor's plan data and layouts (cuda/compressor.cuh), with the host bookkeeping of
// its sequences and the helpers its run() shares with the checks.

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <new>
#include <type_traits>

#include "kvevict/budgets/layer_budget_params.hpp"
#include "kvevict/budgets/pyramidkv.hpp"
#include "kvevict/compressor/detail/state_layout.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/compact_batch.cuh"
#include "kvevict/cuda/decode_observation.cuh"
#include "kvevict/cuda/detail/adakv_batch.cuh"
#include "kvevict/cuda/detail/key_scorers.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/observation_scorers.cuh"
#include "kvevict/cuda/detail/prefill_window.cuh"
#include "kvevict/cuda/detail/shared_batch.cuh"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/cuda/observation_scores.cuh"
#include "kvevict/cuda/observation_scores_batch.cuh"
#include "kvevict/cuda/rerotate.cuh"
#include "kvevict/cuda/scope.cuh"
#include "kvevict/cuda/select_layer.cuh"
#include "kvevict/cuda/sequence.cuh"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/layouts.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

namespace detail {

/// Where a layer of a sequence is in DeferKV's lifecycle (as deferkv's phases).
enum layer_phase : std::int32_t { phase_empty = 0, phase_prefilled = 1, phase_ready = 2, phase_evicted = 3 };

/// One layer's bookkeeping in a sequence's host state (DeferKV's header, host side).
struct host_layer_state {
  std::int32_t phase = phase_empty;
  std::int32_t reserved = 0;
  std::int64_t prompt_tokens = 0;
  std::int64_t steps = 0;
  double z = 0.0;  ///< sum of the observations' weights
};
struct host_state_header {
  std::uint64_t magic = 0;
  std::int64_t layers = 0;
};
/// The per-sequence scope's bookkeeping, after the layers' records: layers folded so far, the
/// tokens they scored, whether the keep set was applied (kvevict::compressor's scope state).
struct host_scope_state {
  std::int64_t folded = 0;
  std::int64_t tokens = 0;
  std::int64_t done = 0;
};
constexpr std::uint64_t host_state_magic = 0x6863757376656b76ull;  // "vkevsuch"

/// What one sequence's event does at this layer, decided and checked before anything runs.
struct sequence_step {
  enum observe_kind : std::int32_t { none = 0, prefill = 1, decode = 2 };
  observe_kind observe = none;
  bool evict = false;  ///< selects this layer's keep set and applies it
  /// The per-sequence scope: this layer's scores fold into the sequence's row (and, with
  /// evict, at the last layer, the keep set selected from it is applied to every layer).
  bool fold = false;
  /// prefill_chunk under chunked_prefill: the chunk's last queries join the layer's window (a
  /// decode step under decode-time budgets: its queries join the ring of decode queries)
  bool buffer = false;
  /// a decode-time compression (compressor_options::decoding): the decode target's budget, the
  /// window the ring's newest rows and the step's queries
  bool round = false;
  std::int64_t observed = 0;    ///< prefill_end: the queries observed (the window's, H2O every one)
  std::int64_t held = 0;        ///< of which the window buffered by earlier chunks holds (chunked prefill)
  std::int64_t tokens = 0;      ///< L
  std::int64_t candidates = 0;  ///< DeferKV's C (prompt tokens before the window)
  selection_params sel;
  layer_budget budget;
  host_layer_state after;  ///< the layer's bookkeeping once this call succeeded

  /// Whether the call scores this layer (to evict it, or to fold the scores).
  bool scores() const noexcept { return evict || fold; }
};

/// What keep_outputs_kernel writes when nothing is compacted (compaction::keep_list_only), as
/// the CPU's report of a keep set: head lengths, positions, each head's freed blocks of the
/// view an engine reclaims from (block_size 0: strided) and the empty changed-block list.
struct listed_outputs {
  std::int64_t* head_lengths = nullptr;
  std::int64_t* positions = nullptr;
  std::int64_t* head_freed_blocks = nullptr;
  std::int64_t block_size = 0;
  bool head_tables = false;
  std::int32_t* changed_blocks = nullptr;
};

/// padded_indices [Hkv, cap] (and, when nothing is compacted, the listed outputs) from a CSR
/// keep-list: grid (chunks of the row, Hkv). Nothing when the call's cancel word is raised.
template <int Unused = 0>
__global__ void keep_outputs_kernel(const std::int64_t* offsets, const std::int64_t* indices, std::int64_t cap,
                                    std::int64_t tokens, index_ptr key_positions, std::int64_t* padded,
                                    listed_outputs listed, const std::uint32_t* cancel) {
  if (cancel != nullptr && *cancel != 0) return;
  const std::int64_t h = blockIdx.y;
  const std::int64_t begin = offsets[h], n = offsets[h + 1] - begin;
  std::int64_t* head_lengths = listed.head_lengths;
  std::int64_t* positions = listed.positions;
  if (head_lengths != nullptr && blockIdx.x == 0 && threadIdx.x == 0) head_lengths[h] = n;
  if (listed.head_freed_blocks != nullptr && blockIdx.x == 0 && threadIdx.x == 0) {
    std::int64_t longest = 0;
    for (std::int64_t g = 0; g < static_cast<std::int64_t>(gridDim.y); ++g)
      longest = offsets[g + 1] - offsets[g] > longest ? offsets[g + 1] - offsets[g] : longest;
    const std::int64_t bs = listed.block_size, kept = listed.head_tables ? n : longest;
    listed.head_freed_blocks[h] = bs < 1 ? 0 : (tokens + bs - 1) / bs - (kept + bs - 1) / bs;
  }
  if (listed.changed_blocks != nullptr && h == 0 && blockIdx.x == 0 && threadIdx.x == 0)
    listed.changed_blocks[0] = -1;  // nothing written: the list is empty
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < cap;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t index = i < n ? indices[begin + i] : -1;
    if (padded != nullptr) padded[h * cap + i] = index;
    // (An index outside [0, L) -- a selection flagged and not written -- is not looked up.)
    if (positions != nullptr && i < n)
      positions[begin + i] = key_positions != nullptr && index >= 0 && index < tokens ? key_positions[index] : index;
  }
}

/// `text` with every "seqs[i]" (i < n, an index into a subset of the run's sequences) written
/// as "seqs[seq_of[i]]", into out[size].
inline void renumber_text(const char* text, const std::int64_t* seq_of, std::int64_t n, const char* inserted, char* out,
                          std::size_t size) noexcept {
  std::size_t o = 0;
  while (*text != '\0' && o + 1 < size) {
    char* end = nullptr;
    const long long i = std::strncmp(text, "seqs[", 5) == 0 ? std::strtoll(text + 5, &end, 10) : -1;
    if (end != nullptr && end != text + 5 && *end == ']' && i >= 0 && i < n) {
      const int w = std::snprintf(out + o, size - o, "seqs[%lld]%s", static_cast<long long>(seq_of[i]), inserted);
      o = w < 0 ? o : (o + static_cast<std::size_t>(w) < size ? o + static_cast<std::size_t>(w) : size - 1);
      text = end + 1;
    } else {
      out[o++] = *text++;
    }
  }
  out[o] = '\0';
}

/// `st`, from a batched call over a subset of the sequences (its "seqs[i]" the subset's i, in
/// the argument and in the message), renamed to the run's sequences seq_of[i], followed by
/// `inserted` (".layers[2]": a batch of another layer's caches).
inline status renumbered(const status& st, const std::int64_t* seq_of, std::int64_t n, const char* fn,
                         const char* inserted = "") noexcept {
  if (st.ok()) return st;
  const char* text = std::strstr(st.message(), ": ");
  text = text != nullptr ? std::strstr(text + 2, ": ") : nullptr;  // past "function: argument: "
  char arg[2 * status::max_argument], message[512];
  renumber_text(st.argument(), seq_of, n, inserted, arg, sizeof(arg));
  renumber_text(text != nullptr ? text + 2 : st.message(), seq_of, n, inserted, message, sizeof(message));
  return status::error(st.code(), fn, arg, "%s", message);
}

}  // namespace detail

namespace detail {

/// The plan of cuda::compressor: what it was planned from, its sizes, and how the device
/// workspace and the host staging are carved (the same carving sizes them at plan time).
class compressor_layout {
 protected:
  struct device_layout {
    float* scores = nullptr;  ///< [max_seq][Hkv * max_tokens]
    /// The selection block, copied from its host mirror in one piece: the row descriptors
    /// [max_seq * Hkv] of a batched selection, then the keep-lists' offsets [max_seq][Hkv + 1].
    select_row* rows = nullptr;
    std::int64_t* offsets = nullptr;
    std::int64_t* indices = nullptr;  ///< [max_seq][keep capacity]
    float* weights = nullptr;         ///< [max_seq][window] DeferKV's prefill weights
    workspace_span scoring;           ///< the scoring batch (SnapKV) or one observation (DeferKV)
    /// DapQ's re-rotated window: each sequence's rotated queries [Hq, W, d] (of Q), their
    /// positions [W] and its rotation table (copied from the host staging's).
    void* rotated_queries = nullptr;
    std::int64_t* rotated_positions = nullptr;
    double* rotation_tables = nullptr;
    /// AdaKV's per-head sets, every sequence at once (detail/adakv_batch.cuh): the batch's
    /// descriptors [max_seq]; row descriptors for each head [max_seq * Hkv] and each sequence's
    /// flattened row [max_seq]; per sequence the flattened candidates [Hkv * max_tokens] (float),
    /// the picks [Hkv * max_tokens], the normalisation's factors [Hkv], the head budgets [Hkv];
    /// the wide selection's words [max_seq * Hkv].
    detail::adakv_job* adakv_jobs = nullptr;
    select_row* head_rows = nullptr;
    select_row* flat_rows = nullptr;
    float* flat = nullptr;
    std::int64_t* picked = nullptr;
    double* factors = nullptr;
    std::int64_t* head_budgets = nullptr;
    detail::wide_row_words* adakv_wide = nullptr;
    workspace_span compact;  ///< the compaction batch (every layer's in turn: the per-sequence scope)
    /// Keep sets shared by heads (the per-layer and per-sequence scopes), every sequence in one
    /// launch per kernel (detail/shared_batch.cuh): each sequence's combined row
    /// [max_seq][max_tokens], the batch's descriptors [max_seq] (copied from the staging's),
    /// the normalised rules' bins and scales for [max_seq * Hkv] rows, and the wide selection's
    /// words for [max_seq] rows.
    float* layer_rows = nullptr;
    detail::shared_job* jobs = nullptr;
    detail::scope_workspace scope;
    detail::wide_row_words* wide = nullptr;
    /// What the stream found in device data the CPU refuses (DapQ's pseudo-token positions, a
    /// prompt chunk out of order): non-zero cancels the call's keep-list outputs and compaction.
    std::uint32_t* cancel = nullptr;
    /// Chunked prefill: each sequence's prefill_end window assembled from its layer's ring and
    /// its own queries [Hq, window capacity, d] (of Q), and their positions [window capacity].
    void* windows = nullptr;
    std::int64_t* window_positions = nullptr;
  };

  template <class T, class Q>
  struct host_layout {
    select_row* rows = nullptr;              ///< the selection block's host mirror (device_layout::rows)
    std::int64_t* offsets = nullptr;         ///< its offsets part
    detail::sequence_step* steps = nullptr;  ///< [max_seq]
    float* weights = nullptr;                ///< [max_seq][window], copied to device_layout::weights
    std::size_t weights_bytes = 0;
    scoring_sequence<Q, T>* scoring = nullptr;
    std::int64_t* scored_seq = nullptr;  ///< the run's sequence of each scoring entry
    /// The decode scorer's own batch (scores_rounds_apart), its sequences and its staging.
    scoring_sequence<Q, T>* round_scoring = nullptr;
    std::int64_t* round_scored_seq = nullptr;
    void* round_staging = nullptr;
    std::size_t round_staging_bytes = 0;
    compaction_sequence<T, T>* in_place = nullptr;
    compaction_into_sequence<T, T>* into = nullptr;
    std::int64_t* compacted_seq = nullptr;
    detail::state_observation<Q, T>* prefill = nullptr;  ///< [max_seq], by sequence
    detail::decode_launch<Q, T>* decode = nullptr;       ///< [max_seq], by sequence
    std::int64_t* layer_budgets = nullptr;               ///< [layers] PyramidKV
    void* scoring_staging = nullptr;
    std::size_t scoring_staging_bytes = 0;
    void* compact_staging = nullptr;          ///< [compaction_batches()] regions of compact_staging_bytes
    std::size_t compact_staging_bytes = 0;    ///< one batch's
    detail::batch_launch* batches = nullptr;  ///< [compaction_batches()]
    double* rotation_tables = nullptr;        ///< [max_seq][rotation_table_size], copied to the device's
    std::size_t rotation_tables_bytes = 0;
    query_view<const Q>* rotation_sources = nullptr;  ///< [max_seq] the windows to rotate, by sequence
    detail::shared_job* jobs = nullptr;               ///< [max_seq] the shared scopes' batch, copied to the device's
    detail::adakv_job* adakv_jobs = nullptr;          ///< [max_seq] AdaKV's batch, copied to the device's
  };

  bool defers() const noexcept { return kvevict::detail::defers(options_.policy.kind()); }
  /// One keep set for every layer of a sequence (selection_scope::per_sequence).
  bool folds_layers() const noexcept { return options_.scope == selection_scope::per_sequence; }
  /// Whether each layer of a sequence has a ring of queries in its state: the prompt chunks'
  /// (buffers_chunks) or the decode steps' (decode-time budgets with a decode scorer that reads
  /// queries), or both.
  bool buffers_windows() const noexcept { return window_capacity_ > 0; }
  /// Whether each layer of a sequence keeps the last queries of its prompt chunks
  /// (chunked_prefill, for a prompt policy that observes prompt queries: not DapQ's pseudo
  /// tokens, not the policies that read none), as the CPU compressor's chunk rows.
  bool buffers_chunks() const noexcept { return chunk_window_ > 0; }
  /// Whether each head keeps its own AdaKV share (AdaKV heads, per-head keep sets).
  bool allocates_heads() const noexcept {
    return options_.heads == head_allocation::adakv && options_.scope == selection_scope::per_head;
  }
  /// Whether a layer's heads share one keep set (the per-layer and per-sequence scopes).
  bool shares_heads() const noexcept { return options_.scope != selection_scope::per_head; }
  /// Whether a sequence keeps host bookkeeping (DeferKV's layers, the per-sequence scope, the
  /// chunked-prefill windows).
  bool keeps_host_state() const noexcept { return defers() || folds_layers() || buffers_windows() || maintains(); }
  /// Decode-time budgets (compressor_options::decoding): each layer compressed again while the
  /// sequence decodes, by the decode scorer over the ring of the last decode queries.
  bool maintains() const noexcept { return options_.decoding.enabled(); }
  /// The policy that scores a step: the decode scorer for a decode-time compression, the
  /// plan's policy otherwise.
  const policy_config& scorer_of(const detail::sequence_step& p) const noexcept {
    return p.round ? options_.decoding.policy : options_.policy;
  }
  /// The budget a decode-time compression of a layer starts from: the plan's, with the target.
  layer_budget decode_base_budget() const noexcept { return kvevict::detail::base_layer_budget(decode_options_); }
  /// The most rows a head keeps at a call of `tokens` tokens: the prompt's compression or a
  /// decode-time one (kvevict::compressor's keep_capacity_per_head(tokens)).
  std::int64_t head_rows_bound(std::int64_t tokens) const noexcept {
    std::int64_t most = kvevict::detail::head_keep_bound(options_, base_budget(), tokens);
    if (maintains()) {
      const std::int64_t decoded = kvevict::detail::head_keep_bound(decode_options_, decode_base_budget(), tokens);
      most = decoded > most ? decoded : most;
    }
    return most < head_capacity_ ? most : head_capacity_;
  }
  /// Compaction batches one run() may prepare: every layer's under the per-sequence scope
  /// (its last layer compacts them all), else the layer's own.
  std::int64_t compaction_batches() const noexcept {
    if (options_.compact == compaction::keep_list_only) return 0;
    return folds_layers() ? options_.model.num_layers : 1;
  }
  /// Whether `p`'s evicting sequences are scored from their queries in one batch (SnapKV); the
  /// policies that read no queries are scored by their key_scorer, one launch per sequence.
  static bool scores_in_batch(const policy_config& p) noexcept {
    return !kvevict::detail::defers(p.kind()) && kvevict::detail::reads_queries(p.kind());
  }
  bool scores_in_batch() const noexcept { return scores_in_batch(options_.policy); }
  /// Whether the decode scorer's compressions are scored in a batch of their own (a decode
  /// scorer that reads queries and is not the plan's policy: one batch, one policy's kernels).
  bool scores_rounds_apart() const noexcept {
    return maintains() && scores_in_batch(options_.decoding.policy) &&
           !kvevict::detail::same_policy(options_.decoding.policy, options_.policy);
  }
  /// The scoring batch a step joins: 0 for the plan policy's, 1 for the decode scorer's own.
  std::int64_t batch_of(const detail::sequence_step& p) const noexcept {
    return p.round && scores_rounds_apart() ? 1 : 0;
  }

  /// The observation scoring's parameters: the policy's observation_scorer (unused by the
  /// policies that read no queries).
  scoring_params scoring_params_of() const noexcept { return scoring_params_of(options_.policy); }
  static scoring_params scoring_params_of(const policy_config& p) noexcept {
    return kvevict::detail::with_policy_traits(p.kind(), scoring_params{}, [&](auto traits) {
      using Tr = decltype(traits);
      if constexpr (detail::observation_scorer<Tr>::exists) {
        return detail::observation_scorer<Tr>::params(Tr::config(p));
      } else {
        return scoring_params{};
      }
    });
  }
  /// The device workspace of the key_scorer of a policy that reads no queries, for `shape`.
  static std::size_t key_scorer_workspace_size(const policy_config& p, const layer_shape& shape) noexcept {
    return kvevict::detail::with_policy_traits(p.kind(), std::size_t{0}, [&](auto traits) {
      using Tr = decltype(traits);
      if constexpr (detail::key_scorer<Tr>::exists) {
        return detail::key_scorer<Tr>::workspace_size(shape);
      } else {
        return std::size_t{0};
      }
    });
  }
  /// Policy p's step after the batched scoring (observation_scorer::finish), on one sequence's
  /// scores.
  static status finish_scores(const policy_config& p, score_view scores, std::int64_t protected_tail,
                              const launch_options& opt) {
    return kvevict::detail::with_policy_traits(p.kind(), status(), [&](auto traits) -> status {
      using Tr = decltype(traits);
      if constexpr (detail::observation_scorer<Tr>::exists) {
        return detail::observation_scorer<Tr>::finish(Tr::config(p), scores, protected_tail, opt);
      } else {
        return status();
      }
    });
  }

  /// Whether the policy's query positions must lie at or after the scored prompt (DapQ's pseudo
  /// tokens, and its re-rotated window once moved), checked on the device.
  bool checks_positions() const noexcept {
    const policy_config& p = options_.policy;
    return kvevict::detail::with_policy_traits(p.kind(), false, [&](auto traits) {
      using Tr = decltype(traits);
      if constexpr (detail::observation_scorer<Tr>::exists) {
        return detail::observation_scorer<Tr>::checks_positions(Tr::config(p));
      } else {
        return false;
      }
    });
  }

  /// Whether the policy's window is re-rotated before scoring (DapQ's rerotated_window), and
  /// with which RoPE.
  bool rerotates(rope_config* rope = nullptr) const noexcept {
    const policy_config& p = options_.policy;
    rope_config r;
    const bool yes = kvevict::detail::with_policy_traits(p.kind(), false, [&](auto traits) {
      using Tr = decltype(traits);
      if constexpr (detail::observation_scorer<Tr>::exists) {
        return detail::observation_scorer<Tr>::rerotation(Tr::config(p), &r);
      } else {
        return false;
      }
    });
    if (yes && rope != nullptr) *rope = r;
    return yes;
  }
  std::int64_t rotation_table_doubles() const noexcept {
    rope_config r;
    return rerotates(&r) ? cuda::rotation_table_size(r) : 0;
  }

  /// The rows earlier chunks of this prompt left in the layer's ring (none after decoding: a new
  /// prompt turn's window is its own, the decode rows are not its).
  template <class T, class Q>
  std::int64_t chunk_rows(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    if (!buffers_chunks()) return 0;
    const detail::host_window_state* w = window_record(io.host_state, layer);
    return w->decoding == 0 ? w->count : 0;
  }
  /// How many queries observe at prefill_end: the window's, or every one for a policy whose
  /// every prompt query observes (H2O; at most limits.max_queries, checked), of the rows earlier
  /// chunks buffered (chunked_prefill) followed by the call's; *from_ring: how many of them the
  /// layer's window holds (0: the call's last queries are the window).
  template <class T, class Q>
  std::int64_t prefill_queries(const sequence_io<T, Q>& io, std::int64_t layer,
                               std::int64_t* from_ring) const noexcept {
    const std::int64_t held = chunk_rows(io, layer);
    const std::int64_t n = io.queries.num_queries, all = held + n;
    const std::int64_t total =
        kvevict::detail::every_prompt_query(options_.policy.kind()) || all < window_ ? all : window_;
    *from_ring = total - (n < total ? n : total);
    return total;
  }

  /// The largest layer shape a call may see.
  layer_shape max_shape() const noexcept {
    const model_shape& m = options_.model;
    return {m.num_query_heads, m.num_kv_heads, m.head_dim, options_.limits.max_tokens, options_.limits.max_queries};
  }

  /// The budget select_layer sees, sized for the largest call (PyramidKV may give a layer any
  /// share of its candidates).
  layer_budget base_budget() const noexcept { return kvevict::detail::base_layer_budget(options_); }

  /// Whether every evicting sequence's keep counts are known on the host (uniform heads, one
  /// keep set per head: B, or PyramidKV's share, plus the tail), so that one launch selects
  /// all their rows; the shared scopes select every sequence's row in one launch too
  /// (describe_rows with its row, detail/shared_batch.cuh), and AdaKV every sequence's heads
  /// once their budgets are on the device (detail/adakv_batch.cuh).
  bool selects_in_one_launch() const noexcept {
    return options_.heads == head_allocation::uniform && options_.scope == selection_scope::per_head;
  }

  /// The selection block, the same carving on the device and in the staging buffer.
  void carve_selection_block(kvevict::detail::arena& a, select_row** rows, std::int64_t** offsets) const noexcept {
    using kvevict::detail::saturating_mul;
    const std::int64_t seqs = options_.limits.max_sequences, heads = options_.model.num_kv_heads;
    unsigned char* block = a.take<unsigned char>(static_cast<std::int64_t>(selection_block_bytes()));
    *rows = reinterpret_cast<select_row*>(block);
    *offsets = block == nullptr
                   ? nullptr
                   : reinterpret_cast<std::int64_t*>(
                         block + detail::compact_round_up(saturating_mul(
                                     static_cast<std::size_t>(saturating_mul(seqs, heads)), sizeof(select_row))));
  }
  std::size_t selection_block_bytes() const noexcept {
    using kvevict::detail::saturating_add;
    using kvevict::detail::saturating_mul;
    const auto seqs = static_cast<std::size_t>(options_.limits.max_sequences);
    const auto heads = static_cast<std::size_t>(options_.model.num_kv_heads);
    return saturating_add(detail::compact_round_up(saturating_mul(saturating_mul(seqs, heads), sizeof(select_row))),
                          saturating_mul(saturating_mul(seqs, heads + 1), sizeof(std::int64_t)));
  }

  /// What each head of an evicting sequence keeps when the host knows the count (uniform heads,
  /// or one set for every head): the budget b of its candidates, the selection, and the tokens.
  std::int64_t kept_per_head(const detail::sequence_step& p, std::int64_t* b = nullptr,
                             selection_params* sel = nullptr) const noexcept {
    const bool allocates = kvevict::detail::allocates(p.budget);
    const std::int64_t budget =
        allocates ? kvevict::detail::mean_candidates(p.budget, p.tokens, p.sel) : p.budget.per_head.resolve(p.tokens);
    const selection_params how{p.sel.protected_tail, allocates ? protected_mode::on_top_of_budget : p.sel.mode};
    if (b != nullptr) *b = budget;
    if (sel != nullptr) *sel = how;
    return tokens_kept(budget, p.tokens, how);
  }

  /// Sequence s's rows in the batched selection (from `first` on) and its offsets, on the host:
  /// row h keeps tokens_kept(b, L, sel) tokens at h * that in its keep-list. With `shared` (the
  /// sequence's combined or folded row, a keep set shared by its heads) one row selects head 0's
  /// part, and the other heads' copies (broadcast_keep_batch_kernel) follow at the same offsets.
  /// Returns the rows described.
  template <class H>
  std::int64_t describe_rows(const device_layout& dev, H& host, std::int64_t s, const detail::sequence_step& p,
                             std::int64_t first, const float* shared = nullptr) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads;
    std::int64_t b = 0;
    selection_params sel;
    const std::int64_t kept = kept_per_head(p, &b, &sel);
    const score_view scores = scores_of(dev, s, p.tokens);
    std::int64_t* offsets = host.offsets + s * (heads + 1);
    for (std::int64_t h = 0; h < heads; ++h) {
      offsets[h] = h * kept;
      if (shared != nullptr && h > 0) continue;
      select_row& r = host.rows[first + h];
      r = select_row{};
      r.scores = shared != nullptr ? shared : scores.data + h * scores.row_stride;
      r.length = p.tokens;
      r.budget = b;
      r.protected_tail = sel.protected_tail;
      r.mode = sel.mode;
      r.out = dev.indices + s * keep_capacity_ + h * kept;
    }
    offsets[heads] = heads * kept;
    return shared != nullptr ? 1 : heads;
  }

  template <class T, class Q>
  void carve_device(kvevict::detail::arena& a, device_layout* out) const noexcept {
    using kvevict::detail::saturating_add;
    using kvevict::detail::saturating_mul;
    const model_shape& m = options_.model;
    const std::int64_t seqs = options_.limits.max_sequences, tokens = options_.limits.max_tokens;
    out->scores = a.take<float>(saturating_mul(seqs, saturating_mul(m.num_kv_heads, tokens)));
    carve_selection_block(a, &out->rows, &out->offsets);
    out->indices = a.take<std::int64_t>(saturating_mul(seqs, keep_capacity_));
    out->weights = defers() ? a.take<float>(saturating_mul(seqs, window_)) : nullptr;
    // The plan policy's scoring and the decode scorer's take turns on the stream: they share it.
    std::size_t scoring = scoring_workspace_size<T, Q>(options_.policy);
    if (maintains()) {
      const std::size_t rounds = scoring_workspace_size<T, Q>(options_.decoding.policy);
      scoring = rounds > scoring ? rounds : scoring;
    }
    out->scoring = kvevict::detail::take_bytes(a, scoring, true);
    if (rerotates()) {
      out->rotated_queries =
          a.take<Q>(saturating_mul(seqs, saturating_mul(saturating_mul(m.num_query_heads, window_), m.head_dim)));
      out->rotated_positions = a.take<std::int64_t>(saturating_mul(seqs, window_));
      out->rotation_tables = a.take<double>(saturating_mul(seqs, rotation_table_doubles()));
    }
    if (allocates_heads()) {
      const std::int64_t rows = saturating_mul(seqs, m.num_kv_heads);
      const std::int64_t keys = saturating_mul(rows, tokens);
      out->adakv_jobs = a.take<detail::adakv_job>(seqs);
      out->head_rows = a.take<select_row>(rows);
      out->flat_rows = a.take<select_row>(seqs);
      out->flat = a.take<float>(keys);
      out->picked = a.take<std::int64_t>(keys);
      out->factors = a.take<double>(rows);
      out->head_budgets = a.take<std::int64_t>(rows);
      detail::carve_wide_workspace(a, rows, &out->adakv_wide);
    }
    out->compact = kvevict::detail::take_bytes(a, compaction_workspace_size<T>(), true);
    out->cancel = checks_positions() || buffers_windows() ? a.take<std::uint32_t>(1) : nullptr;
    if (buffers_windows()) {
      out->windows = a.take<Q>(
          saturating_mul(seqs, saturating_mul(saturating_mul(m.num_query_heads, window_capacity_), m.head_dim)));
      out->window_positions = a.take<std::int64_t>(saturating_mul(seqs, window_capacity_));
    }
    if (shares_heads()) {
      out->layer_rows = a.take<float>(saturating_mul(seqs, tokens));
      out->jobs = a.take<detail::shared_job>(seqs);
      detail::carve_scope_workspace(a, saturating_mul(seqs, m.num_kv_heads), &out->scope);
      detail::carve_wide_workspace(a, seqs, &out->wide);
    }
  }

  /// The device workspace policy p's scoring takes for the limits: DeferKV's observations, the
  /// batched scoring, or a key_scorer's (one sequence at a time on the stream: they share it).
  template <class T, class Q>
  std::size_t scoring_workspace_size(const policy_config& p) const noexcept {
    const std::int64_t seqs = options_.limits.max_sequences;
    const layer_shape shape = max_shape();
    const scoring_params params = scoring_params_of(p);
    if (kvevict::detail::defers(p.kind())) {
      decode_params dp;
      dp.domain = params.domain;
      const std::size_t prompt = cuda::observation_scores_workspace_size(shape, params);
      const std::size_t step = cuda::decode_observation_workspace_size(shape, dp);
      return step > prompt ? step : prompt;
    }
    if (scores_in_batch(p)) {
      const std::size_t two = cuda::observation_scores_batch_workspace_size<Q, T>(seqs, shape, params, false);
      const std::size_t one = cuda::observation_scores_batch_workspace_size<Q, T>(seqs, shape, params, true);
      return two > one ? two : one;
    }
    return key_scorer_workspace_size(p, shape);
  }

  /// The compaction batch's workspace for the limits: every view's pool of at most
  /// limits.max_pool_blocks blocks (run() refuses larger ones), keep-lists of keep_capacity().
  template <class T>
  std::size_t compaction_workspace_size() const noexcept {
    using kvevict::detail::saturating_add;
    using kvevict::detail::saturating_mul;
    const std::int64_t seqs = options_.limits.max_sequences, blocks = options_.limits.max_pool_blocks;
    const std::size_t bitmaps = 4u * static_cast<std::size_t>(1 + 2 * (blocks > 0 ? detail::bitmap_words(blocks) : 0));
    if (options_.compact == compaction::keep_list_only) return 0;
    if (options_.compact == compaction::out_of_place)
      return saturating_add(
          detail::compact_batch_align - 1 + detail::compact_round_up(cuda::compact_into_batch_staging_size(seqs)),
          bitmaps);
    detail::compact_dims d;
    d.capacity = keep_capacity_;
    d.key_row_bytes = saturating_mul(options_.model.head_dim, static_cast<std::int64_t>(sizeof(T)));
    d.value_row_bytes = saturating_mul(options_.model.value_head_dim, static_cast<std::int64_t>(sizeof(T)));
    const detail::compact_batch_layout l = detail::compact_batch_plan(seqs, blocks, blocks);
    return saturating_add(detail::compact_batch_align - 1 + l.rows,
                          saturating_mul(static_cast<std::size_t>(seqs), detail::staged_bytes(d)));
  }

  template <class T, class Q>
  void carve_host(kvevict::detail::arena& a, host_layout<T, Q>* out) const noexcept {
    using kvevict::detail::saturating_mul;
    const std::int64_t seqs = options_.limits.max_sequences;
    carve_selection_block(a, &out->rows, &out->offsets);
    out->steps = a.take<detail::sequence_step>(seqs);
    out->weights = defers() ? a.take<float>(saturating_mul(seqs, window_)) : nullptr;
    out->weights_bytes = defers() ? static_cast<std::size_t>(saturating_mul(seqs, window_)) * sizeof(float) : 0;
    out->scoring = scores_in_batch() ? a.take<scoring_sequence<Q, T>>(seqs) : nullptr;
    out->scored_seq = a.take<std::int64_t>(seqs);
    out->round_scoring = scores_rounds_apart() ? a.take<scoring_sequence<Q, T>>(seqs) : nullptr;
    out->round_scored_seq = scores_rounds_apart() ? a.take<std::int64_t>(seqs) : nullptr;
    out->in_place = options_.compact == compaction::in_place ? a.take<compaction_sequence<T, T>>(seqs) : nullptr;
    out->into = options_.compact == compaction::out_of_place ? a.take<compaction_into_sequence<T, T>>(seqs) : nullptr;
    out->compacted_seq = a.take<std::int64_t>(seqs);
    out->prefill = defers() ? a.take<detail::state_observation<Q, T>>(seqs) : nullptr;
    out->decode = defers() ? a.take<detail::decode_launch<Q, T>>(seqs) : nullptr;
    out->layer_budgets = a.take<std::int64_t>(options_.model.num_layers);
    out->scoring_staging_bytes = scores_in_batch() ? cuda::observation_scores_batch_staging_size<Q, T>(seqs) : 0;
    out->scoring_staging = a.take<unsigned char>(static_cast<std::int64_t>(out->scoring_staging_bytes));
    // (a batch's descriptors are copied when the stream reaches it: each batch has its own)
    out->round_staging_bytes =
        scores_rounds_apart() ? cuda::observation_scores_batch_staging_size<Q, T>(seqs) : std::size_t{0};
    out->round_staging = a.take<unsigned char>(static_cast<std::int64_t>(out->round_staging_bytes));
    out->compact_staging_bytes = options_.compact == compaction::in_place ? cuda::compact_batch_staging_size(seqs)
                                 : options_.compact == compaction::out_of_place
                                     ? cuda::compact_into_batch_staging_size(seqs)
                                     : 0;
    const std::int64_t batches = compaction_batches();
    out->compact_staging = a.take<unsigned char>(
        saturating_mul(batches, static_cast<std::int64_t>(detail::compact_round_up(out->compact_staging_bytes))));
    out->compact_staging_bytes = detail::compact_round_up(out->compact_staging_bytes);
    out->batches = a.take<detail::batch_launch>(batches);
    out->jobs = shares_heads() ? a.take<detail::shared_job>(seqs) : nullptr;
    out->adakv_jobs = allocates_heads() ? a.take<detail::adakv_job>(seqs) : nullptr;
    if (rerotates()) {
      const std::int64_t doubles = saturating_mul(seqs, rotation_table_doubles());
      out->rotation_tables = a.take<double>(doubles);
      out->rotation_tables_bytes = static_cast<std::size_t>(doubles) * sizeof(double);
      out->rotation_sources = a.take<query_view<const Q>>(seqs);
    }
  }

  template <class T, class Q>
  void size() noexcept {
    using kvevict::detail::saturating_add;
    using kvevict::detail::saturating_mul;
    kvevict::detail::arena d;
    device_layout dl;
    carve_device<T, Q>(d, &dl);
    workspace_bytes_ = d.used();
    kvevict::detail::arena h;
    host_layout<T, Q> hl;
    carve_host<T, Q>(h, &hl);
    staging_bytes_ = h.used();
    const model_shape& m = options_.model;
    const auto tokens = static_cast<std::size_t>(options_.limits.max_tokens);
    state_bytes_ = saturating_add(saturating_mul(scope_row_offset(), sizeof(float)),
                                  folds_layers() ? saturating_mul(tokens, sizeof(float)) : 0);
    window_offset_ = 0;
    window_layer_bytes_ = 0;
    if (buffers_windows()) {  // each layer's ring after the rest, 64-byte aligned
      const auto cap = static_cast<std::size_t>(window_capacity_);
      window_offset_ = kvevict::detail::round_up_64(state_bytes_);
      window_layer_bytes_ = saturating_add(
          saturating_add(sizeof(detail::device_window_header), kvevict::detail::round_up_64(saturating_mul(cap, 8))),
          kvevict::detail::round_up_64(
              saturating_mul(saturating_mul(static_cast<std::size_t>(m.num_query_heads), cap),
                             saturating_mul(static_cast<std::size_t>(m.head_dim), sizeof(Q)))));
      state_bytes_ =
          saturating_add(window_offset_, saturating_mul(static_cast<std::size_t>(m.num_layers), window_layer_bytes_));
    }
    host_state_bytes_ =
        keeps_host_state()
            ? saturating_add(saturating_add(saturating_add(sizeof(detail::host_state_header),
                                                           saturating_mul(static_cast<std::size_t>(m.num_layers),
                                                                          sizeof(detail::host_layer_state))),
                                            sizeof(detail::host_scope_state)),
                             saturating_mul(static_cast<std::size_t>(m.num_layers), sizeof(detail::host_window_state)))
            : 0;
  }

  /// Where a sequence's folded row starts in its device state, in floats: after DeferKV's
  /// running sums [layers, Hkv, max_tokens].
  std::size_t scope_row_offset() const noexcept {
    using kvevict::detail::saturating_mul;
    const model_shape& m = options_.model;
    return defers() ? saturating_mul(saturating_mul(static_cast<std::size_t>(m.num_layers),
                                                    static_cast<std::size_t>(m.num_kv_heads)),
                                     static_cast<std::size_t>(options_.limits.max_tokens))
                    : 0;
  }

  status check_planned(const char* fn) const noexcept {
    if (!planned_)
      return status::error(errc::invalid_state, fn, "compressor", "not planned: call cuda::compressor::plan");
    return status();
  }

  static detail::host_layer_state* layer_record(void* host_state, std::int64_t layer) noexcept {
    return reinterpret_cast<detail::host_layer_state*>(static_cast<unsigned char*>(host_state) +
                                                       sizeof(detail::host_state_header)) +
           layer;
  }

  detail::host_scope_state* scope_record(void* host_state) const noexcept {
    return reinterpret_cast<detail::host_scope_state*>(layer_record(host_state, options_.model.num_layers));
  }
  /// Layer `layer`'s chunked-prefill record in a sequence's host state, after the scope's.
  detail::host_window_state* window_record(void* host_state, std::int64_t layer) const noexcept {
    return reinterpret_cast<detail::host_window_state*>(scope_record(host_state) + 1) + layer;
  }
  /// Layer `layer`'s ring in a sequence's device state.
  template <class T, class Q>
  detail::window_ring<Q> ring_of(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    unsigned char* base =
        static_cast<unsigned char*>(io.state) + window_offset_ + static_cast<std::size_t>(layer) * window_layer_bytes_;
    detail::window_ring<Q> r;
    r.header = reinterpret_cast<detail::device_window_header*>(base);
    r.positions = reinterpret_cast<std::int64_t*>(base + sizeof(detail::device_window_header));
    r.rows = reinterpret_cast<Q*>(base + sizeof(detail::device_window_header) +
                                  kvevict::detail::round_up_64(static_cast<std::size_t>(window_capacity_) * 8));
    r.capacity = window_capacity_;
    return r;
  }
  /// Sequence s's assembled prefill_end window [Hq, rows, d] in the workspace.
  template <class Q>
  query_view<const Q> assembled_window_of(const device_layout& dev, std::int64_t s, std::int64_t rows) const noexcept {
    const std::int64_t cap = window_capacity_, heads = options_.model.num_query_heads, d = options_.model.head_dim;
    return contiguous_queries<const Q>(static_cast<const Q*>(dev.windows) + s * heads * cap * d, heads, rows, d,
                                       dev.window_positions + s * cap);
  }

  /// The per-sequence scope's folded row [max_tokens] in a sequence's device state.
  template <class T, class Q>
  float* scope_row_of(const sequence_io<T, Q>& io) const noexcept {
    return static_cast<float*>(io.state) + scope_row_offset();
  }

  score_view scores_of(const device_layout& dev, std::int64_t s, std::int64_t tokens) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads;
    return score_view{dev.scores + s * heads * options_.limits.max_tokens, heads, tokens, tokens};
  }
  /// Sequence s's re-rotated window [Hq, W, d] in the workspace (DapQ's rerotated_window).
  template <class Q>
  Q* rotated_queries_of(const device_layout& dev, std::int64_t s) const noexcept {
    return static_cast<Q*>(dev.rotated_queries) +
           s * options_.model.num_query_heads * window_ * options_.model.head_dim;
  }
  keep_list_view keep_of(const device_layout& dev, std::int64_t s) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads;
    return keep_list_view{heads, dev.offsets + s * (heads + 1), dev.indices + s * keep_capacity_, keep_capacity_};
  }
  /// Layer `layer`'s running sums in a sequence's device state: [Hkv, C], rows max_tokens apart.
  template <class T, class Q>
  score_view state_of(const sequence_io<T, Q>& io, std::int64_t layer, std::int64_t candidates) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads, tokens = options_.limits.max_tokens;
    return score_view{static_cast<float*>(io.state) + layer * heads * tokens, heads, candidates, tokens};
  }

  compressor_options options_;
  bool planned_ = false;
  std::int64_t window_ = 0;
  std::int64_t keep_capacity_ = 0;
  std::int64_t head_capacity_ = 0;
  std::size_t workspace_bytes_ = 0;
  std::size_t staging_bytes_ = 0;
  std::size_t state_bytes_ = 0;
  std::size_t host_state_bytes_ = 0;
  std::int64_t first_head_ = 0;         ///< tensor parallelism: this rank's first KV head
  std::int64_t total_heads_ = 0;        ///< tensor parallelism: the group's KV heads
  std::int64_t window_capacity_ = 0;    ///< rows of a layer's ring: chunk queries, then decode queries (0: none)
  std::int64_t chunk_window_ = 0;       ///< the prompt chunks' rows a layer keeps (0: none buffered)
  std::int64_t decode_window_ = 0;      ///< decode queries a decode-time compression observes with
  compressor_options decode_options_;   ///< kvevict::detail::decoding_options(options_)
  std::size_t window_offset_ = 0;       ///< where layer 0's window starts in the device state
  std::size_t window_layer_bytes_ = 0;  ///< a layer's window in the device state
};

}  // namespace detail

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_COMPRESSOR_LAYOUT_CUH
