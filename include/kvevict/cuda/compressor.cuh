// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_COMPRESSOR_CUH
#define KVEVICT_CUDA_COMPRESSOR_CUH

// The compressor on the GPU: planned once per model from the same compressor_options as
// kvevict::compressor, called once per layer at the attention hook for a batch of sequences
// whose caches live in device memory (design.md §13, docs/cuda.md "Compressor").
//
//   cuda::compressor c;
//   status st = cuda::compressor::plan(options, &c);     // the CPU plan's checks, then the GPU's
//   device workspace: c.workspace_size() bytes; pinned host staging: c.staging_size() bytes
//   per sequence: c.sequence_state_size() device bytes, c.host_state_size() host bytes,
//                 c.reset_sequence(host_state, bytes) when it starts
//   per step, per layer:  st = c.run(layer, seqs, n, reports, ws, staging, bytes, launch);
//
// A run() enqueues, for the sequences whose event needs it, in stream order:
//   SnapKV:  one batched scoring of every sequence (observation_scores_batch)
//   DeferKV: its observation (observation_state at prefill_end, the decode step's
//            decode_observation after it) and, at the eviction step, finalize_state_scores
//   then the selection -- every evicting sequence's rows in one select_rows launch when the
//   host knows their counts (uniform heads, per-head sets: B or PyramidKV's share), else one
//   select_layer per sequence (AdaKV, per-layer sets) -- and the padded keep-list output, then
//   one batched compaction of
//   the layer (compact_batch in place, compact_into_batch into fresh blocks; none for
//   keep_list_only). No synchronisation, no allocation, no host read of device memory.
//
// The keep-lists equal kvevict::compressor's for the same scores; the scores are the GPU
// scoring's (equal to the CPU's to float32 rounding, docs/cuda.md), so keep sets agree
// except where two tokens' scores are within that rounding.
//
// All or nothing on the host: every sequence is checked and every batched call prepared
// before the first operation is enqueued, so a refused call changes no cache, state, output
// or report. On the device, the compactions are all or nothing per layer (a bad block id or
// a block reached twice moves nothing and raises its flag in launch_options::device_flags).
//
// Not on the GPU yet (refused by plan() or run(), by name): the StreamingLLM, KNorm, H2O and
// DapQ policies, ChunkKV, the per-sequence scope, AdaKV's normalize, tensor parallelism,
// block reference counts (in-place compaction of prefix-shared blocks: use out_of_place),
// and the changed_blocks / head_freed_blocks outputs.

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
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/compact_batch.cuh"
#include "kvevict/cuda/decode_observation.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/cuda/observation_scores.cuh"
#include "kvevict/cuda/observation_scores_batch.cuh"
#include "kvevict/cuda/select_layer.cuh"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/detail/memory_ranges.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

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
constexpr std::uint64_t host_state_magic = 0x6863757376656b76ull;  // "vkevsuch"

/// What one sequence's event does at this layer, decided and checked before anything runs.
struct sequence_step {
  enum observe_kind : std::int32_t { none = 0, prefill = 1, decode = 2 };
  observe_kind observe = none;
  bool evict = false;
  std::int64_t tokens = 0;      ///< L
  std::int64_t candidates = 0;  ///< DeferKV's C (prompt tokens before the window)
  selection_params sel;
  layer_budget budget;
  host_layer_state after;  ///< the layer's bookkeeping once this call succeeded
};

/// padded_indices [Hkv, cap] (and, when nothing is compacted, head_lengths and positions)
/// from a CSR keep-list: grid (chunks of the row, Hkv).
template <int Unused = 0>
__global__ void keep_outputs_kernel(const std::int64_t* offsets, const std::int64_t* indices, std::int64_t cap,
                                    std::int64_t tokens, index_ptr key_positions, std::int64_t* padded,
                                    std::int64_t* head_lengths, std::int64_t* positions) {
  const std::int64_t h = blockIdx.y;
  const std::int64_t begin = offsets[h], n = offsets[h + 1] - begin;
  if (head_lengths != nullptr && blockIdx.x == 0 && threadIdx.x == 0) head_lengths[h] = n;
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
inline void renumber_text(const char* text, const std::int64_t* seq_of, std::int64_t n, char* out,
                          std::size_t size) noexcept {
  std::size_t o = 0;
  while (*text != '\0' && o + 1 < size) {
    char* end = nullptr;
    const long long i = std::strncmp(text, "seqs[", 5) == 0 ? std::strtoll(text + 5, &end, 10) : -1;
    if (end != nullptr && end != text + 5 && *end == ']' && i >= 0 && i < n) {
      const int w = std::snprintf(out + o, size - o, "seqs[%lld]", static_cast<long long>(seq_of[i]));
      o = w < 0 ? o : (o + static_cast<std::size_t>(w) < size ? o + static_cast<std::size_t>(w) : size - 1);
      text = end + 1;
    } else {
      out[o++] = *text++;
    }
  }
  out[o] = '\0';
}

/// `st`, from a batched call over a subset of the sequences (its "seqs[i]" the subset's i, in
/// the argument and in the message), renamed to the run's sequences seq_of[i].
inline status renumbered(const status& st, const std::int64_t* seq_of, std::int64_t n, const char* fn) noexcept {
  if (st.ok()) return st;
  const char* text = std::strstr(st.message(), ": ");
  text = text != nullptr ? std::strstr(text + 2, ": ") : nullptr;  // past "function: argument: "
  char arg[2 * status::max_argument], message[512];
  renumber_text(st.argument(), seq_of, n, arg, sizeof(arg));
  renumber_text(text != nullptr ? text + 2 : st.message(), seq_of, n, message, sizeof(message));
  return status::error(st.code(), fn, arg, "%s", message);
}

}  // namespace detail

class compressor {
 public:
  compressor() = default;

  /// Plans from the options kvevict::compressor takes: every check of its plan, with the same
  /// errors (compressor/plan.hpp); then refuses by name what the GPU path does not implement
  /// (errc::unsupported) and sizes the device workspace, the host staging and the per-sequence
  /// states from the limits alone. limits.max_pool_blocks bounds the pools of paged caches.
  /// On error `out` is unchanged.
  static status plan(const compressor_options& options, compressor* out) {
    static constexpr const char* fn = "kvevict::cuda::compressor::plan";
    if (out == nullptr) return status::error(errc::null_pointer, fn, "out", "expected a compressor to plan");
    if (options.tensor_parallel != nullptr)
      return status::error(errc::unsupported, fn, "tensor_parallel",
                           "selection across tensor-parallel ranks is not implemented on the GPU");
    if (options.limits.max_pool_blocks < 0)
      return status::error(errc::invalid_shape, fn, "limits.max_pool_blocks", "expected >= 0, got %lld",
                           static_cast<long long>(options.limits.max_pool_blocks));
    compressor c;
    c.options_ = options;  // normalised by the checks: value_head_dim, query_storage, max_queries
    KVEVICT_RETURN_IF_ERROR(kvevict::detail::check_compressor_options(&c.options_, c.base_budget(), &c.window_, fn));
    const compressor_options& o = c.options_;
    if (!kvevict::detail::with_policy_traits(o.policy.kind, false,
                                             [](auto traits) { return decltype(traits)::on_gpu; }))
      return status::error(errc::unsupported, fn, "policy.kind",
                           "%s is not implemented on the GPU compressor (snapkv and deferkv are)",
                           to_string(o.policy.kind));
    if (o.policy.chunk_length > 0)
      return status::error(errc::unsupported, fn, "policy.chunk_length", "ChunkKV is not implemented on the GPU");
    if (options.chunked_prefill)
      return status::error(errc::unsupported, fn, "chunked_prefill",
                           "prefill_chunk is not implemented on the GPU (hand the earlier chunks as idle and the whole "
                           "window at prefill_end)");
    if (o.scope == selection_scope::per_sequence)
      return status::error(errc::unsupported, fn, "scope",
                           "the per-sequence keep set is not implemented on the GPU compressor (per_head and "
                           "per_layer are; fold_layer_scores and select_shared are its blocks)");
    if (o.heads == head_allocation::adakv && o.adakv.normalize)
      return status::error(errc::unsupported, fn, "adakv.normalize",
                           "AdaKV's per-head normalisation is not implemented on the GPU");
    KVEVICT_RETURN_IF_ERROR(detail::check_pooling_fits(c.scoring_params_of().pool, fn));
    // The kernels' 32-bit limits, refused here so that no run() stops half-way through its
    // enqueues (selection tiles rows of L keys; AdaKV ranks a layer's Hkv * L candidates in
    // one row; grids put the KV heads on y).
    if (o.model.num_kv_heads > 65535)
      return status::error(errc::overflow, fn, "model.num_kv_heads", "expected at most 65535 on the GPU, got %lld",
                           static_cast<long long>(o.model.num_kv_heads));
    const std::int64_t rows = o.heads == head_allocation::adakv ? o.model.num_kv_heads : 1;
    if (!detail::fits_int32(kvevict::detail::saturating_mul(rows, o.limits.max_tokens), detail::select_tile))
      return status::error(errc::overflow, fn, "limits.max_tokens",
                           "expected %s below 2^31 - %lld on the GPU, got %lld tokens",
                           rows > 1 ? "Hkv x max_tokens (AdaKV)" : "max_tokens",
                           static_cast<long long>(detail::select_tile), static_cast<long long>(o.limits.max_tokens));
    kvevict::detail::keep_capacities(o, c.base_budget(), &c.keep_capacity_, &c.head_capacity_);
    (void)kvevict::detail::with_types(o.model.storage, o.model.query_storage, [&c](auto t, auto q) {
      c.size<typename decltype(t)::type, typename decltype(q)::type>();
      return 0;
    });
    const std::size_t most = std::numeric_limits<std::size_t>::max();
    if (c.workspace_bytes_ == most || c.staging_bytes_ == most || c.state_bytes_ == most)
      return status::error(errc::overflow, fn, "options.limits",
                           "the workspace, staging or state for these limits does not fit in memory");
    c.planned_ = true;
    *out = c;
    return status();
  }

  bool planned() const noexcept { return planned_; }
  const compressor_options& options() const noexcept { return options_; }

  /// Device bytes of workspace one run() needs (any layer, any batch within the limits).
  std::size_t workspace_size() const noexcept { return workspace_bytes_; }
  /// Host bytes of staging one run() needs: page-locked (cudaMallocHost) for its copies to be
  /// asynchronous, 64-byte aligned, and left unchanged until the stream has passed the run
  /// (one staging buffer per run in flight).
  std::size_t staging_size() const noexcept { return staging_bytes_; }
  /// Device bytes of state per sequence: DeferKV's running sums [layers, Hkv, max_tokens]
  /// floats; 0 for SnapKV (sequence_io::state may be null then). Needs no initialisation.
  std::size_t sequence_state_size() const noexcept { return state_bytes_; }
  /// Host bytes of bookkeeping per sequence (sequence_io::host_state); 0 for SnapKV.
  std::size_t host_state_size() const noexcept { return host_state_bytes_; }
  /// Entries of sequence_io::kept_positions one eviction may write.
  std::int64_t keep_capacity() const noexcept { return keep_capacity_; }
  /// Columns of sequence_io::padded_indices: the most tokens one head may keep.
  std::int64_t keep_capacity_per_head() const noexcept { return head_capacity_; }
  /// How many of its last queries a sequence hands in at prefill_end.
  std::int64_t observation_window() const noexcept { return window_; }

  /// Sets up a sequence's host state before its first call (and to reuse it for a new one).
  status reset_sequence(void* host_state, std::size_t bytes) const noexcept {
    static constexpr const char* fn = "kvevict::cuda::compressor::reset_sequence";
    KVEVICT_RETURN_IF_ERROR(check_planned(fn));
    if (host_state_bytes_ == 0) return status();
    KVEVICT_RETURN_IF_ERROR(
        kvevict::detail::check_state_memory(host_state, bytes, host_state_bytes_, fn, "host_state", "host_state_size"));
    detail::host_state_header h;
    h.magic = detail::host_state_magic;
    h.layers = options_.model.num_layers;
    std::memcpy(host_state, &h, sizeof(h));
    for (std::int64_t l = 0; l < options_.model.num_layers; ++l) *layer_record(host_state, l) = {};
    return status();
  }

  /// One layer's hook for a batch of sequences whose caches live on the device.
  ///
  ///   layer:   0 .. num_layers - 1
  ///   seqs:    [n] host array (n <= limits.max_sequences) of device views (cuda::sequence_io)
  ///   reports: [n] host out. As kvevict::compressor reports, except what only the device
  ///            knows: next_position is -1 (the engine's position counter applies), and under
  ///            AdaKV length, next_slot, kept, dropped and (unless out_of_place) freed_blocks
  ///            are -1 (the kept lengths are in the device's head_lengths).
  ///   ws:      device memory, >= workspace_size()
  ///   staging: host memory, >= staging_size() (see there)
  ///   opt:     stream, device flag word, pointer checks
  ///
  /// T must be the plan's storage type and Q its query type. On a host-side error nothing is
  /// enqueued and nothing changed: no cache, state, host state, output or report.
  template <class T, class Q>
  status run(std::int64_t layer, const sequence_io<T, Q>* seqs, std::int64_t n, sequence_report* reports,
             workspace_span ws, void* staging, std::size_t staging_bytes, const launch_options& opt = {}) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    static_assert(is_storage_type<T>::value && !std::is_const<T>::value,
                  "run<T, Q>: T is float, fp16, bf16, fp8_e4m3 or fp8_e5m2");
    static_assert(is_query_type<Q>::value && !std::is_const<Q>::value, "run<T, Q>: Q is float, fp16 or bf16");
    KVEVICT_RETURN_IF_ERROR(check_planned(fn));
    KVEVICT_RETURN_IF_ERROR(
        kvevict::detail::check_run_call(options_, dtype_of<T>::value, dtype_of<Q>::value, layer, n, seqs, reports, fn));
    if (n == 0) return status();
    device_layout dev;
    kvevict::detail::arena da(ws);
    carve_device<T, Q>(da, &dev);
    if (da.overflowed() || ws.data == nullptr)
      return status::error(ws.data == nullptr ? errc::null_pointer : errc::workspace_too_small, fn, "ws",
                           "expected at least %zu bytes of device workspace (workspace_size), got %zu",
                           workspace_bytes_, ws.data == nullptr ? std::size_t{0} : ws.size);
    KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(ws.data, opt, fn, "ws"));
    if (staging == nullptr || staging_bytes < staging_bytes_)
      return status::error(staging == nullptr ? errc::null_pointer : errc::workspace_too_small, fn, "staging",
                           "expected %zu bytes of host staging (staging_size), got %zu", staging_bytes_,
                           staging == nullptr ? std::size_t{0} : staging_bytes);
    if (reinterpret_cast<std::uintptr_t>(staging) % workspace_alignment != 0)
      return status::error(errc::invalid_argument, fn, "staging", "expected %zu-byte alignment", workspace_alignment);
    host_layout<T, Q> host;
    kvevict::detail::arena ha(workspace_span{staging, staging_bytes});
    carve_host<T, Q>(ha, &host);
    for (std::int64_t s = 0; s < n; ++s) new (&host.steps[s]) detail::sequence_step();

    // 1. Decide and check every sequence: states first (one sequence's step must never write
    //    another's), then each against the plan.
    KVEVICT_RETURN_IF_ERROR(check_distinct_states(seqs, n));
    for (std::int64_t s = 0; s < n; ++s)
      KVEVICT_RETURN_IF_ERROR(check_sequence(layer, seqs[s], s, host, opt, &host.steps[s]));

    // 2. Prepare every enqueue: the DeferKV observations, the scoring batch's list, the
    //    compaction batch (its host checks and descriptors).
    const bool defer = defers();
    std::int64_t scored = 0, compacted = 0;
    bool weights_used = false;
    for (std::int64_t s = 0; s < n; ++s) {
      const detail::sequence_step& p = host.steps[s];
      const sequence_io<T, Q>& io = seqs[s];
      if (p.observe == detail::sequence_step::prefill) {
        weights_used = true;
        KVEVICT_RETURN_IF_ERROR(prepare_prefill(io, p, s, layer, dev, host, opt, fn));
      } else if (p.observe == detail::sequence_step::decode) {
        KVEVICT_RETURN_IF_ERROR(prepare_decode(io, p, s, layer, dev, host, opt, fn));
      }
      if (!p.evict) continue;
      if (!defer) {
        scoring_sequence<Q, T>& q = host.scoring[scored];
        q = scoring_sequence<Q, T>{};
        q.queries = kvevict::detail::last_queries(io.queries, window_);
        q.keys = io.keys;
        q.scores = scores_of(dev, s, p.tokens);
        q.inputs.key_positions = io.key_positions;
        if (io.lse != nullptr) {
          const std::int64_t stride = io.lse_head_stride != 0 ? io.lse_head_stride : io.queries.num_queries;
          q.inputs.lse = io.lse + (io.queries.num_queries - q.queries.num_queries);
          q.inputs.lse_head_stride = stride;
        }
        host.scored_seq[scored++] = s;
      }
      if (options_.compact == compaction::keep_list_only) continue;
      const const_keep_list_view keep = keep_of(dev, s);
      const compact_outputs out{io.head_lengths, io.kept_positions, io.key_positions};
      if (options_.compact == compaction::in_place) {
        host.in_place[compacted] = compaction_sequence<T, T>{io.keys, io.values, keep, out};
      } else {
        compaction_into_sequence<T, T>& c = host.into[compacted];
        c = compaction_into_sequence<T, T>{};
        c.src_keys = io.keys;
        c.src_values = io.values;
        c.dst_keys = io.dst_keys;
        c.dst_values = io.dst_values;
        c.keep = keep;
        c.out = out;
      }
      host.compacted_seq[compacted++] = s;
    }
    detail::batch_launch compaction;
    if (options_.compact == compaction::in_place)
      KVEVICT_RETURN_IF_ERROR(
          detail::renumbered(detail::prepare_compact_batch(host.in_place, compacted, dev.compact, host.compact_staging,
                                                           host.compact_staging_bytes, opt, fn, &compaction),
                             host.compacted_seq, compacted, fn));
    else if (options_.compact == compaction::out_of_place)
      KVEVICT_RETURN_IF_ERROR(
          detail::renumbered(detail::prepare_compact_into_batch(host.into, compacted, dev.compact, host.compact_staging,
                                                                host.compact_staging_bytes, opt, fn, &compaction),
                             host.compacted_seq, compacted, fn));

    // 3. Enqueue. The scoring batch checks and enqueues in one call: first, so that its
    //    refusal still leaves everything as it was.
    if (scored > 0)
      KVEVICT_RETURN_IF_ERROR(
          detail::renumbered(cuda::observation_scores_batch(host.scoring, scored, scoring_params_of(), dev.scoring,
                                                            host.scoring_staging, host.scoring_staging_bytes, opt),
                             host.scored_seq, scored, fn));
    if (weights_used)
      KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
          cudaMemcpyAsync(dev.weights, host.weights, host.weights_bytes, cudaMemcpyHostToDevice, opt.stream), fn,
          "cudaMemcpyAsync"));
    const bool batched = selects_in_one_launch();
    std::int64_t rows = 0;
    for (std::int64_t s = 0; s < n; ++s) {
      const detail::sequence_step& p = host.steps[s];
      if (p.observe == detail::sequence_step::prefill)
        KVEVICT_RETURN_IF_ERROR(detail::enqueue_observation_state(host.prefill[s], opt, fn));
      if (p.observe == detail::sequence_step::decode)
        KVEVICT_RETURN_IF_ERROR(detail::launch_step(host.decode[s], opt.stream, fn));
      if (!p.evict) continue;
      if (defer) {
        scoring_params params = options_.policy.deferkv.params();
        params.protected_tail = p.tokens - p.candidates;
        KVEVICT_RETURN_IF_ERROR(cuda::finalize_state_scores(
            state_of(seqs[s], layer, p.candidates), options_.model.num_query_heads / options_.model.num_kv_heads,
            static_cast<float>(1.0 / p.after.z), params, scores_of(dev, s, p.tokens), opt));
      }
      if (batched) {
        rows += describe_rows(dev, host, s, p, rows);
        continue;
      }
      const score_view scores = scores_of(dev, s, p.tokens);
      KVEVICT_RETURN_IF_ERROR(
          cuda::select_layer(const_score_view{scores.data, scores.rows, scores.cols, scores.row_stride}, p.sel,
                             p.budget, keep_of(dev, s), dev.select, opt));
    }
    if (rows > 0) {  // every evicting sequence's rows, selected in one launch
      KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
          cudaMemcpyAsync(dev.rows, host.rows, selection_block_bytes(), cudaMemcpyHostToDevice, opt.stream), fn,
          "cudaMemcpyAsync"));
      KVEVICT_RETURN_IF_ERROR(cuda::select_rows(dev.rows, rows, options_.limits.max_tokens, opt));
    }
    for (std::int64_t s = 0; s < n; ++s)
      if (host.steps[s].evict) KVEVICT_RETURN_IF_ERROR(enqueue_keep_outputs(seqs[s], keep_of(dev, s), opt, fn));
    if (options_.compact == compaction::in_place)
      KVEVICT_RETURN_IF_ERROR(detail::enqueue_compact_batch(compaction, opt, fn));
    else if (options_.compact == compaction::out_of_place)
      KVEVICT_RETURN_IF_ERROR(detail::enqueue_compact_into_batch(compaction, opt, fn));

    // 4. Commit the bookkeeping and report.
    run_trace trace;
    trace.layer = layer;
    trace.sequences = n;
    for (std::int64_t s = 0; s < n; ++s) {
      const detail::sequence_step& p = host.steps[s];
      reports[s] = report_of(seqs[s], p);
      if (defer && (p.observe != detail::sequence_step::none || p.evict))
        *layer_record(seqs[s].host_state, layer) = p.after;
      trace.observed += reports[s].action == sequence_action::observed ? 1 : 0;
      trace.evicted += reports[s].action == sequence_action::evicted ? 1 : 0;
    }
    if (options_.tracer.on_run != nullptr) options_.tracer.on_run(options_.tracer.context, trace);
    return status();
  }

 private:
  struct device_layout {
    float* scores = nullptr;  ///< [max_seq][Hkv * max_tokens]
    /// The selection block, copied from its host mirror in one piece: the row descriptors
    /// [max_seq * Hkv] of a batched selection, then the keep-lists' offsets [max_seq][Hkv + 1].
    select_row* rows = nullptr;
    std::int64_t* offsets = nullptr;
    std::int64_t* indices = nullptr;  ///< [max_seq][keep capacity]
    float* weights = nullptr;         ///< [max_seq][window] DeferKV's prefill weights
    workspace_span scoring;           ///< the scoring batch (SnapKV) or one observation (DeferKV)
    workspace_span select;            ///< select_layer
    workspace_span compact;           ///< the compaction batch
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
    compaction_sequence<T, T>* in_place = nullptr;
    compaction_into_sequence<T, T>* into = nullptr;
    std::int64_t* compacted_seq = nullptr;
    detail::state_observation<Q, T>* prefill = nullptr;  ///< [max_seq], by sequence
    detail::decode_launch<Q, T>* decode = nullptr;       ///< [max_seq], by sequence
    std::int64_t* layer_budgets = nullptr;               ///< [layers] PyramidKV
    void* scoring_staging = nullptr;
    std::size_t scoring_staging_bytes = 0;
    void* compact_staging = nullptr;
    std::size_t compact_staging_bytes = 0;
  };

  bool defers() const noexcept { return kvevict::detail::defers(options_.policy.kind); }

  scoring_params scoring_params_of() const noexcept {
    return defers() ? options_.policy.deferkv.params() : options_.policy.snapkv.params();
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
  /// all their rows; AdaKV and the per-layer scope select per sequence (select_layer).
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

  /// Sequence s's rows in the batched selection (from `first` on) and its offsets, on the host:
  /// row h keeps tokens_kept(b, L, sel) tokens at h * that in its keep-list.
  template <class H>
  std::int64_t describe_rows(const device_layout& dev, H& host, std::int64_t s, const detail::sequence_step& p,
                             std::int64_t first) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads;
    const bool allocates = kvevict::detail::allocates(p.budget);
    const std::int64_t b =
        allocates ? kvevict::detail::mean_candidates(p.budget, p.tokens, p.sel) : p.budget.per_head.resolve(p.tokens);
    const selection_params sel{p.sel.protected_tail, allocates ? protected_mode::on_top_of_budget : p.sel.mode};
    const std::int64_t kept = tokens_kept(b, p.tokens, sel);
    const score_view scores = scores_of(dev, s, p.tokens);
    std::int64_t* offsets = host.offsets + s * (heads + 1);
    for (std::int64_t h = 0; h < heads; ++h) {
      select_row& r = host.rows[first + h];
      r = select_row{};
      r.scores = scores.data + h * scores.row_stride;
      r.length = p.tokens;
      r.budget = b;
      r.protected_tail = sel.protected_tail;
      r.mode = sel.mode;
      r.out = dev.indices + s * keep_capacity_ + h * kept;
      offsets[h] = h * kept;
    }
    offsets[heads] = heads * kept;
    return heads;
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
    std::size_t scoring = 0;
    const layer_shape shape = max_shape();
    if (defers()) {
      const scoring_params params = scoring_params_of();
      decode_params dp;
      dp.domain = params.domain;
      scoring = cuda::observation_scores_workspace_size(shape, params);
      const std::size_t step = cuda::decode_observation_workspace_size(shape, dp);
      scoring = step > scoring ? step : scoring;
    } else {
      const std::size_t two =
          cuda::observation_scores_batch_workspace_size<Q, T>(seqs, shape, scoring_params_of(), false);
      const std::size_t one =
          cuda::observation_scores_batch_workspace_size<Q, T>(seqs, shape, scoring_params_of(), true);
      scoring = two > one ? two : one;
    }
    out->scoring = kvevict::detail::take_bytes(a, scoring, true);
    layer_budget b = base_budget();
    if (options_.layers == layer_allocation::pyramidkv) b.layer_candidates = tokens;
    out->select = kvevict::detail::take_bytes(a, cuda::select_layer_workspace_size(m.num_kv_heads, tokens, b), true);
    out->compact = kvevict::detail::take_bytes(a, compaction_workspace_size<T>(), true);
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
    out->scoring = defers() ? nullptr : a.take<scoring_sequence<Q, T>>(seqs);
    out->scored_seq = a.take<std::int64_t>(seqs);
    out->in_place = options_.compact == compaction::in_place ? a.take<compaction_sequence<T, T>>(seqs) : nullptr;
    out->into = options_.compact == compaction::out_of_place ? a.take<compaction_into_sequence<T, T>>(seqs) : nullptr;
    out->compacted_seq = a.take<std::int64_t>(seqs);
    out->prefill = defers() ? a.take<detail::state_observation<Q, T>>(seqs) : nullptr;
    out->decode = defers() ? a.take<detail::decode_launch<Q, T>>(seqs) : nullptr;
    out->layer_budgets = a.take<std::int64_t>(options_.model.num_layers);
    out->scoring_staging_bytes = defers() ? 0 : cuda::observation_scores_batch_staging_size<Q, T>(seqs);
    out->scoring_staging = a.take<unsigned char>(static_cast<std::int64_t>(out->scoring_staging_bytes));
    out->compact_staging_bytes = options_.compact == compaction::in_place ? cuda::compact_batch_staging_size(seqs)
                                 : options_.compact == compaction::out_of_place
                                     ? cuda::compact_into_batch_staging_size(seqs)
                                     : 0;
    out->compact_staging = a.take<unsigned char>(static_cast<std::int64_t>(out->compact_staging_bytes));
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
    state_bytes_ =
        defers() ? saturating_mul(
                       saturating_mul(static_cast<std::size_t>(m.num_layers), static_cast<std::size_t>(m.num_kv_heads)),
                       saturating_mul(static_cast<std::size_t>(options_.limits.max_tokens), sizeof(float)))
                 : 0;
    host_state_bytes_ =
        defers()
            ? saturating_add(sizeof(detail::host_state_header),
                             saturating_mul(static_cast<std::size_t>(m.num_layers), sizeof(detail::host_layer_state)))
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

  score_view scores_of(const device_layout& dev, std::int64_t s, std::int64_t tokens) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads;
    return score_view{dev.scores + s * heads * options_.limits.max_tokens, heads, tokens, tokens};
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

  /// What the event does, as kvevict::compressor decides it, with every host check of the
  /// sequence against the plan.
  template <class T, class Q, class H>
  status check_sequence(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s, const H& host,
                        const launch_options& opt, detail::sequence_step* out) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    if (io.event == sequence_event::prefill_chunk)
      return status::error(errc::unsupported, fn, io_name(s, "event"),
                           "prefill_chunk is not implemented on the GPU (hand the earlier chunks as idle and the whole "
                           "window at prefill_end)");
    if (static_cast<unsigned>(io.event) > 2u)
      return status::error(errc::invalid_argument, fn, io_name(s, "event"), "expected a sequence_event value, got %d",
                           static_cast<int>(io.event));
    if (io.event == sequence_event::idle) return status();
    const model_shape& m = options_.model;
    const std::int64_t L = io.keys.num_tokens;
    detail::sequence_step& p = *out;
    p.tokens = L;
    if (defers()) {
      KVEVICT_RETURN_IF_ERROR(decide_deferkv(layer, io, s, &p));
    } else {
      p.evict = io.event == sequence_event::prefill_end;
      p.sel = options_.policy.snapkv.selection();
    }
    if (p.observe == detail::sequence_step::none && !p.evict) return status();

    // Fields the GPU path does not implement.
    if (io.block_refcounts != nullptr || io.shared_blocks != nullptr)
      return status::error(errc::unsupported, fn,
                           io_name(s, io.block_refcounts != nullptr ? "block_refcounts" : "shared_blocks"),
                           "the GPU compressor does not read block reference counts: compact sequences with "
                           "prefix-shared blocks out of place (compaction::out_of_place); its batch refuses a "
                           "destination any source uses");
    if (io.changed_blocks != nullptr || io.head_freed_blocks != nullptr)
      return status::error(errc::unsupported, fn,
                           io_name(s, io.changed_blocks != nullptr ? "changed_blocks" : "head_freed_blocks"),
                           "not written on the GPU path: pass null");
    if (io.layers != nullptr)
      return status::error(errc::unsupported, fn, io_name(s, "layers"),
                           "only the per-sequence scope reads them, which the GPU compressor does not implement");

    // Both views, whatever the call does with them (as the CPU compressor: a keep-list-only
    // call still refuses a null or malformed values view).
    KVEVICT_RETURN_IF_ERROR(detail::validate_device_cache_view(io.keys, opt, fn, io_name(s, "keys")));
    KVEVICT_RETURN_IF_ERROR(detail::validate_device_cache_view(io.values, opt, fn, io_name(s, "values")));
    // The views against the plan.
    if (io.keys.num_heads != m.num_kv_heads || io.keys.head_dim != m.head_dim)
      return status::error(errc::invalid_shape, fn, io_name(s, "keys"),
                           "expected the model's [%lld heads, d = %lld], got [%lld, %lld]",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(m.head_dim),
                           static_cast<long long>(io.keys.num_heads), static_cast<long long>(io.keys.head_dim));
    if (io.values.num_heads != m.num_kv_heads || io.values.head_dim != m.value_head_dim || io.values.num_tokens != L)
      return status::error(errc::invalid_shape, fn, io_name(s, "values"),
                           "expected [%lld heads, %lld tokens, dv = %lld], got [%lld, %lld, %lld]",
                           static_cast<long long>(m.num_kv_heads), static_cast<long long>(L),
                           static_cast<long long>(m.value_head_dim), static_cast<long long>(io.values.num_heads),
                           static_cast<long long>(io.values.num_tokens), static_cast<long long>(io.values.head_dim));
    if (L < 0 || L > options_.limits.max_tokens)
      return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                           "expected 0 .. limits.max_tokens = %lld, got %lld",
                           static_cast<long long>(options_.limits.max_tokens), static_cast<long long>(L));
    if (p.evict && options_.compact == compaction::in_place) {  // the bitmaps' bound
      KVEVICT_RETURN_IF_ERROR(check_pool(io.keys, s, "keys.num_pool_blocks"));
      KVEVICT_RETURN_IF_ERROR(check_pool(io.values, s, "values.num_pool_blocks"));
    }
    if (p.evict && options_.compact == compaction::out_of_place) {
      if (io.dst_keys.data == nullptr || io.dst_values.data == nullptr)
        return status::error(errc::null_pointer, fn,
                             io_name(s, io.dst_keys.data == nullptr ? "dst_keys" : "dst_values"),
                             "compaction::out_of_place: expected destination views (fresh blocks)");
      if (io.dst_keys.num_heads != m.num_kv_heads || io.dst_keys.head_dim != m.head_dim ||
          io.dst_values.num_heads != m.num_kv_heads || io.dst_values.head_dim != m.value_head_dim)
        return status::error(errc::invalid_shape, fn, io_name(s, "dst_keys"),
                             "expected the source's heads and head dims");
      const std::int64_t most = L < head_capacity_ ? L : head_capacity_;
      if (io.dst_keys.num_tokens < most || io.dst_values.num_tokens < most)
        return status::error(
            errc::invalid_shape, fn, io_name(s, "dst_keys.num_tokens"),
            "expected room for %lld rows (the most a head may keep), got %lld", static_cast<long long>(most),
            static_cast<long long>(io.dst_keys.num_tokens < io.dst_values.num_tokens ? io.dst_keys.num_tokens
                                                                                     : io.dst_values.num_tokens));
      KVEVICT_RETURN_IF_ERROR(check_pool(io.keys, s, "keys.num_pool_blocks"));  // sources are marked too
      KVEVICT_RETURN_IF_ERROR(check_pool(io.values, s, "values.num_pool_blocks"));
      KVEVICT_RETURN_IF_ERROR(check_pool(io.dst_keys, s, "dst_keys.num_pool_blocks"));
      KVEVICT_RETURN_IF_ERROR(check_pool(io.dst_values, s, "dst_values.num_pool_blocks"));
    }

    // The queries the call reads.
    const bool reads_queries = defers() ? p.observe != detail::sequence_step::none : p.evict;
    if (reads_queries) {
      const bool decode = io.event == sequence_event::decode;
      KVEVICT_RETURN_IF_ERROR(kvevict::detail::check_sequence_queries(options_, scoring_params_of().domain, io.queries,
                                                                      decode, io.lse, io.lse_head_stride, s, fn));
      // As on the CPU: a prefill chunk holding fewer than the window's queries is refused,
      // never scored with fewer (chunked prefill: the engine hands the whole window).
      const std::int64_t need = io.keys.num_tokens < window_ ? io.keys.num_tokens : window_;
      if (!decode && (io.queries.num_queries < need || io.queries.num_queries < 1))
        return status::error(errc::invalid_shape, fn, io_name(s, "queries.num_queries"),
                             "expected observation_window() = %lld queries at prefill_end (or every prompt query "
                             "of a shorter prompt), got %lld (chunked prefill: keep the earlier chunks' last "
                             "queries, hand the whole window)",
                             static_cast<long long>(window_), static_cast<long long>(io.queries.num_queries));
    }
    // Blocks shared with sequences outside the call are invisible to the device, which reads no
    // block refcounts yet: a paged in-place compaction needs the engine's word that it shares
    // none (the CPU compressor also accepts block_sharing::marked with refcounts).
    if (p.evict && options_.compact == compaction::in_place && (io.keys.is_paged() || io.values.is_paged()) &&
        options_.sharing != block_sharing::none)
      return status::error(options_.sharing == block_sharing::marked ? errc::unsupported : errc::invalid_argument, fn,
                           "sharing",
                           "%s is paged, compacted in place on the device: expected block_sharing::none, got "
                           "block_sharing::%s",
                           static_cast<const char*>(io_name(s, "keys")),
                           options_.sharing == block_sharing::marked ? "marked" : "undeclared");
    if (p.evict)
      p.budget = kvevict::detail::layer_budget_for(options_, base_budget(), layer, L, p.sel, host.layer_budgets);
    return status();
  }

  /// DeferKV's lifecycle at this layer (kvevict::compressor's decide), from the host state.
  template <class T, class Q>
  status decide_deferkv(std::int64_t layer, const sequence_io<T, Q>& io, std::int64_t s,
                        detail::sequence_step* p) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    using kvevict::detail::io_name;
    if (io.host_state == nullptr)
      return status::error(errc::null_pointer, fn, io_name(s, "host_state"),
                           "expected host_state_size() = %zu bytes set up by reset_sequence()", host_state_bytes_);
    if (reinterpret_cast<std::uintptr_t>(io.host_state) % 8 != 0)
      return status::error(errc::invalid_argument, fn, io_name(s, "host_state"), "expected 8-byte alignment");
    detail::host_state_header h;
    std::memcpy(&h, io.host_state, sizeof(h));
    if (h.magic != detail::host_state_magic || h.layers != options_.model.num_layers)
      return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                           "not a state of this plan: call reset_sequence() when the sequence starts");
    if (io.state == nullptr)
      return status::error(errc::null_pointer, fn, io_name(s, "state"),
                           "expected sequence_state_size() = %zu bytes of device memory", state_bytes_);
    const deferkv_config& cfg = options_.policy.deferkv;
    const detail::host_layer_state now = *layer_record(io.host_state, layer);
    const bool started = now.phase != detail::phase_empty;
    if (now.phase < detail::phase_empty || now.phase > detail::phase_evicted || now.prompt_tokens < 0 ||
        now.steps < 0 || now.prompt_tokens + now.steps > options_.limits.max_tokens ||
        (started && !(now.z > 0.0 && now.z <= std::numeric_limits<double>::max())))
      return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                           "layer %lld's record was overwritten: reset_sequence() when the sequence starts",
                           static_cast<long long>(layer));
    const bool fed_back = cfg.decode_feedback && cfg.delay > 0;
    const std::int64_t L = io.keys.num_tokens;
    p->after = now;
    if (io.event == sequence_event::prefill_end) {
      if (now.phase != detail::phase_empty)
        return status::error(errc::invalid_state, fn, io_name(s, "host_state"),
                             "layer %lld already observed this sequence's prefill; reset_sequence() for a new one",
                             static_cast<long long>(layer));
      const std::int64_t w = io.queries.num_queries < window_ ? io.queries.num_queries : window_;
      p->observe = detail::sequence_step::prefill;
      p->evict = !fed_back;
      p->after.prompt_tokens = L;
      p->after.steps = 0;
      double z = 0.0;
      for (std::int64_t t = 0; t < w; ++t)
        z += static_cast<double>(static_cast<float>(std::pow(cfg.effective_eta(), static_cast<double>(w - 1 - t))));
      p->after.z = z;
      p->after.phase = fed_back ? detail::phase_prefilled : detail::phase_ready;
    } else if (now.phase == detail::phase_evicted) {
      return status();                              // decoding goes on after eviction
    } else if (now.phase == detail::phase_ready) {  // (run() evicts in the call that makes a layer ready)
      if (L != now.prompt_tokens + now.steps)
        return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                             "expected prompt + decoded tokens = %lld, got %lld",
                             static_cast<long long>(now.prompt_tokens + now.steps), static_cast<long long>(L));
      p->evict = true;
    } else if (now.phase == detail::phase_empty) {
      return status::error(errc::invalid_state, fn, io_name(s, "event"),
                           "a decode step before this sequence's prefill_end at layer %lld",
                           static_cast<long long>(layer));
    } else {
      if (L != now.prompt_tokens + now.steps + 1)
        return status::error(errc::invalid_shape, fn, io_name(s, "keys.num_tokens"),
                             "expected prompt + decoded tokens = %lld, got %lld (wrong layer or step?)",
                             static_cast<long long>(now.prompt_tokens + now.steps + 1), static_cast<long long>(L));
      p->observe = detail::sequence_step::decode;
      p->after.z = cfg.effective_eta() * now.z + 1.0;
      p->after.steps = now.steps + 1;
      if (p->after.steps >= cfg.delay) p->after.phase = detail::phase_ready;
      p->evict = p->after.steps >= cfg.delay;
    }
    const std::int64_t prompt = p->after.prompt_tokens;
    const std::int64_t w = cfg.window < prompt ? cfg.window : prompt;
    p->candidates = prompt - w;
    p->sel = selection_params{w + p->after.steps, cfg.protect};
    if (p->evict) p->after.phase = detail::phase_evicted;
    return status();
  }

  template <class V>
  status check_pool(const cache_view<V>& v, std::int64_t s, const char* field) const noexcept {
    if (v.is_paged() && v.num_pool_blocks > options_.limits.max_pool_blocks)
      return status::error(errc::invalid_shape, "kvevict::cuda::compressor::run", kvevict::detail::io_name(s, field),
                           "expected at most limits.max_pool_blocks = %lld (the plan sizes its bitmaps by it), got "
                           "%lld",
                           static_cast<long long>(options_.limits.max_pool_blocks),
                           static_cast<long long>(v.num_pool_blocks));
    return status();
  }

  /// One sequence's device state and host state are its own (byte ranges, not only pointers).
  template <class T, class Q>
  status check_distinct_states(const sequence_io<T, Q>* seqs, std::int64_t n) const noexcept {
    if (!defers()) return status();
    for (std::int64_t s = 1; s < n; ++s)
      for (std::int64_t t = 0; t < s; ++t) {
        if (seqs[s].event == sequence_event::idle || seqs[t].event == sequence_event::idle) continue;
        const auto overlap = [](const void* a, const void* b, std::size_t bytes) {  // null: refused later
          return a != nullptr && b != nullptr && kvevict::detail::byte_ranges_overlap(a, bytes, b, bytes);
        };
        const bool device = overlap(seqs[s].state, seqs[t].state, state_bytes_);
        if (device || overlap(seqs[s].host_state, seqs[t].host_state, host_state_bytes_))
          return status::error(errc::invalid_argument, "kvevict::cuda::compressor::run",
                               kvevict::detail::io_name(s, device ? "state" : "host_state"),
                               "expected one state per sequence, got memory that overlaps the state of seqs[%lld]",
                               static_cast<long long>(t));
      }
    return status();
  }

  template <class T, class Q, class H>
  status prepare_prefill(const sequence_io<T, Q>& io, const detail::sequence_step& p, std::int64_t s,
                         std::int64_t layer, const device_layout& dev, H& host, const launch_options& opt,
                         const char* fn) const {
    const query_view<const Q> q = kvevict::detail::last_queries(io.queries, window_);
    float* w = host.weights + s * window_;
    for (std::int64_t t = 0; t < q.num_queries; ++t)
      w[t] = static_cast<float>(
          std::pow(options_.policy.deferkv.effective_eta(), static_cast<double>(q.num_queries - 1 - t)));
    scoring_params params = scoring_params_of();
    params.protected_tail = p.tokens - p.candidates;
    observation_inputs in;
    in.key_positions = io.key_positions;
    in.weights = dev.weights + s * window_;
    new (&host.prefill[s]) detail::state_observation<Q, T>();
    return kvevict::detail::in_sequence(detail::prepare_observation_state(q, cache_view<const T>(io.keys), params, 0.0f,
                                                                          state_of(io, layer, p.candidates),
                                                                          dev.scoring, in, opt, fn, &host.prefill[s]),
                                        s, fn);
  }

  template <class T, class Q, class H>
  status prepare_decode(const sequence_io<T, Q>& io, const detail::sequence_step& p, std::int64_t s, std::int64_t layer,
                        const device_layout& dev, H& host, const launch_options& opt, const char* fn) const {
    const deferkv_config& cfg = options_.policy.deferkv;
    decode_params dp;
    dp.eta = static_cast<float>(cfg.effective_eta());
    dp.gqa = cfg.gqa;
    dp.domain = cfg.domain;
    dp.protected_tail = p.tokens - p.candidates;
    decode_inputs in;
    in.key_positions = io.key_positions;
    new (&host.decode[s]) detail::decode_launch<Q, T>();
    return kvevict::detail::in_sequence(
        detail::decode_prepare(query_view<const Q>(io.queries), cache_view<const T>(io.keys), dp,
                               state_of(io, layer, p.candidates), dev.scoring, in, opt, fn, &host.decode[s]),
        s, fn);
  }

  /// padded_indices, and head_lengths / kept_positions when nothing is compacted (the
  /// compactions write those, on success only). padded_indices is the selected keep set even
  /// when the device then refuses the compaction (its flag says so).
  template <class T, class Q>
  status enqueue_keep_outputs(const sequence_io<T, Q>& io, const keep_list_view& keep, const launch_options& opt,
                              const char* fn) const {
    const bool listed = options_.compact == compaction::keep_list_only;
    std::int64_t* lengths = listed ? io.head_lengths : nullptr;
    std::int64_t* positions = listed ? io.kept_positions : nullptr;
    if (io.padded_indices == nullptr && lengths == nullptr && positions == nullptr) return status();
    const std::int64_t cap = head_capacity_ > 0 ? head_capacity_ : 1;
    const unsigned chunks = static_cast<unsigned>(detail::stride_grid(cap, 256, 64));
    return detail::launch(fn, "keep_outputs_kernel",
                          {dim3(chunks, static_cast<unsigned>(keep.num_heads)), dim3(256), 0, opt.stream},
                          detail::keep_outputs_kernel<>, keep.offsets, keep.indices, head_capacity_, io.keys.num_tokens,
                          io.key_positions, io.padded_indices, lengths, positions);
  }

  template <class T, class Q>
  sequence_report report_of(const sequence_io<T, Q>& io, const detail::sequence_step& p) const noexcept {
    sequence_report r;
    r.length = io.keys.num_tokens;
    r.next_slot = io.keys.num_tokens;
    r.next_position = -1;
    if (p.observe != detail::sequence_step::none) r.action = sequence_action::observed;
    if (!p.evict) return r;
    r.action = sequence_action::evicted;
    const std::int64_t heads = options_.model.num_kv_heads, L = p.tokens;
    const std::int64_t protect = p.sel.protected_tail < L ? p.sel.protected_tail : L;
    const layer_budget& b = p.budget;
    const bool allocates = kvevict::detail::allocates(b);
    const std::int64_t mean = allocates ? kvevict::detail::mean_candidates(b, L, p.sel) : 0;
    // AdaKV's per-head counts (and their sum: each head's share is rounded) are the device's.
    const std::int64_t per_head = b.heads == head_allocation::adakv
                                      ? -1
                                      : (allocates ? mean + protect : tokens_kept(b.per_head.resolve(L), L, p.sel));
    r.kept = per_head >= 0 ? heads * per_head : -1;
    r.length = per_head;
    r.next_slot = per_head;
    r.dropped = per_head >= 0 ? L - per_head : -1;
    if (options_.compact == compaction::out_of_place) {
      r.freed_blocks = io.keys.is_paged() ? io.keys.num_used_blocks() : io.values.num_used_blocks();
    } else {
      r.freed_blocks = per_head < 0 ? -1
                                    : (io.keys.is_paged() ? kvevict::detail::freed_blocks_of(io.keys, per_head)
                                                          : kvevict::detail::freed_blocks_of(io.values, per_head));
    }
    return r;
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
};

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_COMPRESSOR_CUH
