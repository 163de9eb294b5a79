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
//   SnapKV, H2O, DapQ, TOVA: one batched scoring of every sequence (observation_scores_batch;
//            H2O's window is every prompt query, DapQ's its N pseudo tokens over the prompt before
//            them, or its last N prompt queries moved N positions on by dapq_rerotate first,
//            TOVA's the last prompt query, its scores then averaged across KV heads by
//            head_mean_scores)
//   DeferKV: its observation (observation_state at prefill_end, the decode step's
//            decode_observation after it) and, at the eviction step, finalize_state_scores
//   KNorm, StreamingLLM, KeyDiff: their scores from the keys or positions, per sequence
//            (cuda/key_scores.cuh, cuda/keydiff_scores.cuh; hooked up by
//            cuda/detail/key_scorers.cuh)
//   ChunkKV on top (policy.chunk_length): chunk_scores per sequence
//   then the selection -- every evicting sequence's rows in one select_rows launch when the
//   host knows their counts (uniform heads, per-head sets: B or PyramidKV's share); with a keep
//   set shared by the heads, every sequence's heads combined and its row selected in one launch
//   per kernel (detail/shared_batch.cuh); AdaKV's budgets and sets for every sequence in one
//   launch per step (detail/adakv_batch.cuh) -- and the padded
//   keep-list output, then one batched compaction of
//   the layer (compact_batch in place, compact_into_batch into fresh blocks; none for
//   keep_list_only). No synchronisation, no allocation, no host read of device memory.
//   The per-sequence scope (one keep set for every layer) folds each layer's combined row
//   into a row in the sequence's device state (the same batch); the last layer selects from
//   it and compacts every layer's caches
//   (sequence_io::layers): one batch per layer, every one validated before any moves.
//
// The keep-lists equal kvevict::compressor's for the same scores; the scores are the GPU
// scoring's (equal to the CPU's to float32 rounding, docs/cuda.md), so keep sets agree
// except where two tokens' scores are within that rounding.
//
// All or nothing on the host: every sequence is checked and every batched call prepared
// before the first operation is enqueued, so a refused call changes no cache, state, output
// or report. On the device, the compactions are all or nothing per layer (a bad block id, a
// block reached twice or a block marked shared by block_refcounts / shared_blocks moves
// nothing and raises its flag in launch_options::device_flags).
//
// Decode-time budgets (compressor_options::decoding): a decode step's queries join the layer's
// ring; the step that leaves a layer more than N rows over the target compresses it again,
// scored by the decode scorer (its own batched scoring when it reads queries and is not the
// prompt policy), selected and compacted as above.
// Chunked prefill (compressor_options::chunked_prefill): each layer keeps the last queries of a
// sequence's prompt chunks in its device state (cuda/detail/prefill_window.cuh), and prefill_end
// observes with the CPU's window; the chunks' order is checked on the device.
// Tensor parallelism (compressor_options::tensor_parallel): plan() makes the CPU plan's two
// rounds with the group; per-head keep sets under uniform or PyramidKV budgets then run on each
// rank's heads alone. Not on the GPU yet (refused by plan(), by name): AdaKV and keep sets
// shared by heads across tensor-parallel ranks.
// DapQ's pseudo-token positions are device data: positions below the prompt, which the CPU
// refuses, raise flag_query_position and cancel the layer's outputs and compaction.

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
#include "kvevict/compressor/detail/plan_agreement.hpp"
#include "kvevict/compressor/options.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/cuda/chunk_scores.cuh"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/compact_batch.cuh"
#include "kvevict/cuda/decode_observation.cuh"
#include "kvevict/cuda/detail/compressor_checks.cuh"
#include "kvevict/cuda/detail/key_scorers.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/cuda/observation_scores.cuh"
#include "kvevict/cuda/observation_scores_batch.cuh"
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
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

class compressor : private detail::compressor_checks {
 public:
  compressor() = default;

  /// Plans from the options kvevict::compressor takes: every check of its plan, with the same
  /// errors (compressor/plan.hpp); then refuses by name what the GPU path does not implement
  /// (errc::unsupported) and sizes the device workspace, the host staging and the per-sequence
  /// states from the limits alone. limits.max_pool_blocks bounds the pools of paged caches.
  /// On error `out` is unchanged.
  static status plan(const compressor_options& options, compressor* out) {
    static constexpr const char* fn = "kvevict::cuda::compressor::plan";
    const collective* group = options.tensor_parallel;
    // A rank that cannot reach the group cannot tell it it failed: this returns at once.
    if (group != nullptr) KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_collective(*group, fn, "tensor_parallel"));
    compressor c;
    c.options_ = options;  // normalised by the checks: value_head_dim, query_storage, max_queries
    status st = out == nullptr ? status::error(errc::null_pointer, fn, "out", "expected a compressor to plan")
                               : c.check_plan(fn);
    // Tensor parallelism: the CPU plan's two rounds, so every rank fails together (design.md §15).
    if (group != nullptr)
      KVEVICT_RETURN_IF_ERROR(kvevict::detail::learn_heads(c.options_, st, fn, &c.first_head_, &c.total_heads_));
    KVEVICT_RETURN_IF_ERROR(st);
    if (group == nullptr) c.total_heads_ = c.options_.model.num_kv_heads;
    const compressor_options& o = c.options_;
    kvevict::detail::keep_capacities(o, c.base_budget(), &c.keep_capacity_, &c.head_capacity_);
    if (c.maintains()) {  // a decode-time compression may keep more (its target) than the prompt's
      std::int64_t keep = 0, per_head = 0;
      kvevict::detail::keep_capacities(c.decode_options_, c.decode_base_budget(), &keep, &per_head);
      c.keep_capacity_ = keep > c.keep_capacity_ ? keep : c.keep_capacity_;
      c.head_capacity_ = per_head > c.head_capacity_ ? per_head : c.head_capacity_;
    }
    (void)kvevict::detail::with_types(o.model.storage, o.model.query_storage, [&c](auto t, auto q) {
      c.size<typename decltype(t)::type, typename decltype(q)::type>();
      return 0;
    });
    const std::size_t most = std::numeric_limits<std::size_t>::max();
    if (c.workspace_bytes_ == most || c.staging_bytes_ == most || c.state_bytes_ == most)
      st = status::error(errc::overflow, fn, "options.limits",
                         "the workspace, staging or state for these limits does not fit in memory");
    if (group != nullptr) {
      std::int64_t delay = 0;
      bool feedback = false;
      if (c.defers()) {
        delay = o.policy.config<deferkv_traits>().delay;
        feedback = o.policy.config<deferkv_traits>().decode_feedback;
      }
      KVEVICT_RETURN_IF_ERROR(kvevict::detail::agree_plan(
          o,
          kvevict::detail::plan_policy_digest(c.window_, kvevict::detail::largest_selection(o), c.defers(), delay,
                                              feedback),
          st, fn));
    }
    KVEVICT_RETURN_IF_ERROR(st);
    c.planned_ = true;
    *out = c;
    return status();
  }

  /// Tensor parallelism: the global index of this rank's first KV head, and the KV heads of a
  /// layer over the group (0 and model.num_kv_heads in one process), as kvevict::compressor's.
  std::int64_t first_kv_head() const noexcept { return first_head_; }
  std::int64_t total_kv_heads() const noexcept { return total_heads_; }

  bool planned() const noexcept { return planned_; }
  const compressor_options& options() const noexcept { return options_; }

  /// Device bytes of workspace one run() needs (any layer, any batch within the limits).
  std::size_t workspace_size() const noexcept { return workspace_bytes_; }
  /// Host bytes of staging one run() needs: page-locked (cudaMallocHost) for its copies to be
  /// asynchronous, 64-byte aligned, and left unchanged until the stream has passed the run
  /// (one staging buffer per run in flight).
  std::size_t staging_size() const noexcept { return staging_bytes_; }
  /// Device bytes of state per sequence: DeferKV's running sums [layers, Hkv, max_tokens]
  /// floats, then the per-sequence scope's folded row [max_tokens], then with chunked_prefill
  /// each layer's window of the chunks' queries; 0 for SnapKV with another scope and no chunks
  /// (sequence_io::state may be null then). Needs no initialisation.
  std::size_t sequence_state_size() const noexcept { return state_bytes_; }
  /// Host bytes of bookkeeping per sequence (sequence_io::host_state: DeferKV's layers, the
  /// per-sequence scope's record, each layer's chunk window counts); 0 when the device state
  /// is (both are then needed on every call that is not idle).
  std::size_t host_state_size() const noexcept { return host_state_bytes_; }
  /// Entries of sequence_io::kept_positions one eviction may write.
  std::int64_t keep_capacity() const noexcept { return keep_capacity_; }
  /// Columns of sequence_io::padded_indices: the most tokens one head may keep.
  std::int64_t keep_capacity_per_head() const noexcept { return head_capacity_; }
  /// Entries of sequence_io::changed_blocks: K and V, one block per token at most, per head
  /// with per-head block tables (the CPU compressor's bound), and the -1 that ends the
  /// device's list.
  std::int64_t changed_blocks_capacity() const noexcept {
    return kvevict::detail::saturating_add(
        kvevict::detail::saturating_mul(kvevict::detail::saturating_mul(std::int64_t{2}, options_.model.num_kv_heads),
                                        options_.limits.max_tokens),
        std::int64_t{1});
  }
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
    *scope_record(host_state) = {};
    if (buffers_windows() || maintains())
      for (std::int64_t l = 0; l < options_.model.num_layers; ++l) *window_record(host_state, l) = {};
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
    rope_config rope;
    const bool rotate = rerotates(&rope);
    std::int64_t scored = 0, rounds_scored = 0, compacted = 0;
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
      if (!p.scores()) continue;
      if (scores_in_batch(scorer_of(p))) {  // the plan policy's batch, or the decode scorer's own
        const bool own = batch_of(p) == 1;
        scoring_sequence<Q, T>& q = own ? host.round_scoring[rounds_scored] : host.scoring[scored];
        q = scoring_sequence<Q, T>{};
        q.queries = window_of(io, p, s, dev);
        if (rotate && !p.round) {  // DapQ's re-rotated window: its W queries moved W positions on (as the CPU's)
          const std::int64_t delta = q.queries.num_queries, d = options_.model.head_dim;
          rotation_table(rope, delta, host.rotation_tables + s * rotation_table_doubles());
          new (&host.rotation_sources[s]) query_view<const Q>(q.queries);
          q.queries = contiguous_queries<const Q>(rotated_queries_of<Q>(dev, s), options_.model.num_query_heads, delta,
                                                  d, dev.rotated_positions + s * window_);
        }
        q.keys = io.keys.first_tokens(p.tokens);  // DapQ: the prompt before its pseudo tokens
        q.scores = scores_of(dev, s, p.tokens);
        q.inputs.key_positions = io.key_positions;
        // an assembled window is normalised here, as on the CPU; decode steps never read the LSE
        if (io.lse != nullptr && p.held == 0 && io.event == sequence_event::prefill_end) {
          const std::int64_t stride = io.lse_head_stride != 0 ? io.lse_head_stride : io.queries.num_queries;
          q.inputs.lse = io.lse + (io.queries.num_queries - q.queries.num_queries);
          q.inputs.lse_head_stride = stride;
        }
        if (own)
          host.round_scored_seq[rounds_scored++] = s;
        else
          host.scored_seq[scored++] = s;
      }
      if (p.evict && options_.compact != compaction::keep_list_only) host.compacted_seq[compacted++] = s;
    }
    std::int64_t batches = 0;
    KVEVICT_RETURN_IF_ERROR(prepare_compactions(seqs, layer, compacted, dev, host, &batches, opt, fn));

    // 3. Enqueue. The scorings come first: the windows assembled from earlier chunks, DapQ's
    //    rotations, the plan policy's batch and the decode scorer's (each checks and enqueues in
    //    one call), the key scorers; they write only the workspace, so that a refusal among them
    //    still leaves every cache, state and output as it was.
    for (std::int64_t s = 0; s < n; ++s)
      if (host.steps[s].held > 0) KVEVICT_RETURN_IF_ERROR(enqueue_assemble(seqs[s], host.steps[s], s, layer, dev, opt));
    if (rotate && scored > 0) {  // (DapQ is never a decode scorer: every entry is a prompt's)
      KVEVICT_RETURN_IF_ERROR(
          detail::cuda_status(cudaMemcpyAsync(dev.rotation_tables, host.rotation_tables, host.rotation_tables_bytes,
                                              cudaMemcpyHostToDevice, opt.stream),
                              fn, "cudaMemcpyAsync"));
      for (std::int64_t i = 0; i < scored; ++i) {
        const std::int64_t s = host.scored_seq[i];
        const scoring_sequence<Q, T>& q = host.scoring[i];
        KVEVICT_RETURN_IF_ERROR(kvevict::detail::in_sequence(
            cuda::dapq_rerotate(host.rotation_sources[s], rope, dev.rotation_tables + s * rotation_table_doubles(),
                                q.queries.num_queries, rotated_queries_of<Q>(dev, s),
                                dev.rotated_positions + s * window_, opt),
            s, fn));
      }
    }
    if (scored > 0)
      KVEVICT_RETURN_IF_ERROR(
          detail::renumbered(cuda::observation_scores_batch(host.scoring, scored, scoring_params_of(), dev.scoring,
                                                            host.scoring_staging, host.scoring_staging_bytes, opt),
                             host.scored_seq, scored, fn));
    if (rounds_scored > 0)
      KVEVICT_RETURN_IF_ERROR(detail::renumbered(
          cuda::observation_scores_batch(host.round_scoring, rounds_scored, scoring_params_of(options_.decoding.policy),
                                         dev.scoring, host.round_staging, host.round_staging_bytes, opt),
          host.round_scored_seq, rounds_scored, fn));
    for (std::int64_t s = 0; s < n; ++s) {  // the policies that read no queries: a launch per sequence
      const detail::sequence_step& p = host.steps[s];
      const policy_config& scorer = scorer_of(p);
      if (p.scores() && !kvevict::detail::defers(scorer.kind()) && !scores_in_batch(scorer))
        KVEVICT_RETURN_IF_ERROR(
            enqueue_key_scores(scorer, seqs[s].keys, scores_of(dev, s, p.tokens), dev.scoring, opt, fn));
    }
    // DapQ's pseudo-token positions, which the CPU refuses below the prompt, and the order of
    // the prompt chunks: device data, so the device checks them, and a raised word cancels the
    // outputs and the compaction below. (The chunks' windows are state: written from here on,
    // where no host check is left to refuse the call.)
    if (dev.cancel != nullptr) {
      KVEVICT_RETURN_IF_ERROR(detail::cuda_status(cudaMemsetAsync(dev.cancel, 0, sizeof(std::uint32_t), opt.stream), fn,
                                                  "cudaMemsetAsync"));
      if (buffers_windows())
        for (std::int64_t s = 0; s < n; ++s)
          KVEVICT_RETURN_IF_ERROR(enqueue_window(seqs[s], host.steps[s], layer, dev, opt));
      for (std::int64_t i = 0; i < scored && checks_positions(); ++i) {
        const query_view<const Q>& q = host.scoring[i].queries;
        KVEVICT_RETURN_IF_ERROR(detail::enqueue_position_check(
            q.positions, q.num_queries, host.steps[host.scored_seq[i]].tokens, dev.cancel, opt, fn));
      }
    }
    if (weights_used)
      KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
          cudaMemcpyAsync(dev.weights, host.weights, host.weights_bytes, cudaMemcpyHostToDevice, opt.stream), fn,
          "cudaMemcpyAsync"));
    const bool batched = selects_in_one_launch();
    std::int64_t rows = 0, jobs = 0, longest = 0;
    for (std::int64_t s = 0; s < n; ++s) {
      const detail::sequence_step& p = host.steps[s];
      if (p.observe == detail::sequence_step::prefill)
        KVEVICT_RETURN_IF_ERROR(detail::enqueue_observation_state(host.prefill[s], opt, fn));
      if (p.observe == detail::sequence_step::decode)
        KVEVICT_RETURN_IF_ERROR(detail::launch_step(host.decode[s], opt.stream, fn));
      if (!p.scores()) continue;
      const policy_config& scorer = scorer_of(p);
      if (defer && !p.round) {  // (a decode-time compression scores anew, with the decode scorer)
        scoring_params params = options_.policy.config<deferkv_traits>().params();
        params.protected_tail = p.tokens - p.candidates;
        KVEVICT_RETURN_IF_ERROR(cuda::finalize_state_scores(
            state_of(seqs[s], layer, p.candidates), options_.model.num_query_heads / options_.model.num_kv_heads,
            static_cast<float>(1.0 / p.after.z), params, scores_of(dev, s, p.tokens), opt));
      }
      if (scores_in_batch(scorer))  // what follows the batched scoring (TOVA: the mean across KV heads)
        KVEVICT_RETURN_IF_ERROR(finish_scores(scorer, scores_of(dev, s, p.tokens), p.sel.protected_tail, opt));
      if (scorer.chunk_length > 0)  // ChunkKV on top of the policy's scores
        KVEVICT_RETURN_IF_ERROR(
            cuda::chunk_scores(scores_of(dev, s, p.tokens), p.sel.protected_tail, scorer.chunk_length, opt));
      if (shares_heads()) {  // combined (per-sequence scope: and folded) with the others below
        const float* row = describe_job(seqs[s], s, p, layer, dev, host.jobs[jobs++]);
        if (p.evict) rows += describe_rows(dev, host, s, p, rows, row);
        longest = p.tokens > longest ? p.tokens : longest;
        continue;
      }
      if (batched) {
        rows += describe_rows(dev, host, s, p, rows);
        continue;
      }
      describe_adakv(s, p, dev, host.adakv_jobs[jobs++]);  // AdaKV: every sequence's heads below
      longest = p.tokens > longest ? p.tokens : longest;
    }
    if (jobs > 0 && shares_heads())
      KVEVICT_RETURN_IF_ERROR(enqueue_shared_rows(host.jobs, jobs, longest, dev, opt, fn));
    if (jobs > 0 && allocates_heads())
      KVEVICT_RETURN_IF_ERROR(enqueue_adakv(host.adakv_jobs, jobs, longest, dev, opt, fn));
    if (rows > 0) {  // every evicting sequence's rows, selected in one launch
      KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
          cudaMemcpyAsync(dev.rows, host.rows, selection_block_bytes(), cudaMemcpyHostToDevice, opt.stream), fn,
          "cudaMemcpyAsync"));
      if (shares_heads())
        KVEVICT_RETURN_IF_ERROR(enqueue_shared_selection(rows, jobs, longest, dev, opt, fn));
      else
        KVEVICT_RETURN_IF_ERROR(cuda::select_rows(dev.rows, rows, options_.limits.max_tokens, opt));
    }
    for (std::int64_t s = 0; s < n; ++s)
      if (host.steps[s].evict)
        KVEVICT_RETURN_IF_ERROR(enqueue_keep_outputs(seqs[s], keep_of(dev, s), dev.cancel, opt, fn));
    if (options_.compact == compaction::in_place)
      KVEVICT_RETURN_IF_ERROR(detail::enqueue_compact_batches(host.batches, batches, dev.cancel, opt, fn));
    else if (options_.compact == compaction::out_of_place)
      KVEVICT_RETURN_IF_ERROR(detail::enqueue_compact_into_batches(host.batches, batches, dev.cancel, opt, fn));

    // 4. Commit the bookkeeping and report.
    run_trace trace;
    trace.layer = layer;
    trace.sequences = n;
    for (std::int64_t s = 0; s < n; ++s) {
      const detail::sequence_step& p = host.steps[s];
      reports[s] = report_of(seqs[s], layer, p);
      if (defer && (p.observe != detail::sequence_step::none || p.scores()))
        *layer_record(seqs[s].host_state, layer) = p.after;
      if (p.fold) commit_fold(seqs[s].host_state, layer, p);
      if (buffers_windows() || maintains()) commit_window(seqs[s], layer, p);
      trace.observed += reports[s].action == sequence_action::observed ? 1 : 0;
      trace.evicted += reports[s].action == sequence_action::evicted ? 1 : 0;
    }
    if (options_.tracer.on_run != nullptr) options_.tracer.on_run(options_.tracer.context, trace);
    return status();
  }

 private:
  /// plan()'s checks of the options: every check of the CPU plan, with the same errors
  /// (compressor/plan.hpp), then what the GPU path does not implement (errc::unsupported) and
  /// the kernels' 32-bit limits, refused here so that no run() stops half-way through its
  /// enqueues (selection tiles rows of L keys; AdaKV ranks a layer's Hkv * L candidates in one
  /// row; grids put the KV heads on y).
  status check_plan(const char* fn) {
    if (options_.limits.max_pool_blocks < 0)
      return status::error(errc::invalid_shape, fn, "limits.max_pool_blocks", "expected >= 0, got %lld",
                           static_cast<long long>(options_.limits.max_pool_blocks));
    KVEVICT_RETURN_IF_ERROR(kvevict::detail::check_compressor_options(&options_, base_budget(), &window_, fn));
    const compressor_options& o = options_;
    KVEVICT_RETURN_IF_ERROR(check_gpu_policy(o.policy, fn));
    // Tensor parallelism: per-head keep sets under uniform or PyramidKV budgets need nothing
    // from the other ranks (each head's set is its own scores'), as on the CPU, whose run() then
    // makes no collective; AdaKV and keep sets shared by heads exchange scores between ranks.
    if (o.tensor_parallel != nullptr && (o.heads == head_allocation::adakv || o.scope != selection_scope::per_head))
      return status::error(errc::unsupported, fn, "tensor_parallel",
                           "AdaKV and keep sets shared by heads select across tensor-parallel ranks, which the GPU "
                           "does not (per-head keep sets under uniform or PyramidKV budgets need no exchange)");
    // Decode-time budgets (compressor_options::decoding): the decode scorer's compressions are
    // scored by its own kernels (a second scoring batch when it reads queries and is not the
    // plan's policy); the ring of decode queries is the chunk window's.
    decode_options_ = kvevict::detail::decoding_options(o);
    decode_window_ = kvevict::detail::decoding_window(o);
    if (o.decoding.enabled()) {
      const policy_config& d = o.decoding.policy;
      KVEVICT_RETURN_IF_ERROR(kvevict::detail::decoding_named(check_gpu_policy(d, fn), fn));
      KVEVICT_RETURN_IF_ERROR(
          kvevict::detail::decoding_named(detail::check_pooling_fits(scoring_params_of(d).pool, fn), fn));
      if (decode_window_ > o.limits.max_queries)
        return status::error(errc::invalid_shape, fn, "decoding.window",
                             "expected at most limits.max_queries = %lld decode queries on the GPU, got %lld",
                             static_cast<long long>(o.limits.max_queries), static_cast<long long>(decode_window_));
    }
    // Chunked prefill: each layer keeps the window's rows (H2O: every prompt query it may see),
    // as the CPU compressor; DapQ's pseudo queries come whole with prefill_end.
    if (o.chunked_prefill && kvevict::detail::reads_queries(o.policy.kind()) &&
        !kvevict::detail::fixed_window(o.policy))
      chunk_window_ = kvevict::detail::every_prompt_query(o.policy.kind()) ? o.limits.max_queries : window_;
    window_capacity_ = chunk_window_ > decode_window_ ? chunk_window_ : decode_window_;
    KVEVICT_RETURN_IF_ERROR(detail::check_pooling_fits(scoring_params_of().pool, fn));
    if (o.model.num_kv_heads > 65535)
      return status::error(errc::overflow, fn, "model.num_kv_heads", "expected at most 65535 on the GPU, got %lld",
                           static_cast<long long>(o.model.num_kv_heads));
    if (buffers_windows() && o.model.num_query_heads > 65535)  // the window kernels' grid y
      return status::error(errc::overflow, fn, "model.num_query_heads",
                           "expected at most 65535 on the GPU with chunked_prefill, got %lld",
                           static_cast<long long>(o.model.num_query_heads));
    // The batched selections put a call's sequences (the shared scopes) or their heads (AdaKV)
    // on a grid dimension of at most 65,535 blocks.
    const std::int64_t batched_rows =
        allocates_heads() ? kvevict::detail::saturating_mul(o.limits.max_sequences, o.model.num_kv_heads)
                          : (shares_heads() ? o.limits.max_sequences : 0);
    if (batched_rows > 65535)
      return status::error(errc::overflow, fn, "limits.max_sequences", "expected %s at most 65535 on the GPU, got %lld",
                           allocates_heads() ? "max_sequences x Hkv (AdaKV)" : "max_sequences (a shared keep set)",
                           static_cast<long long>(batched_rows));
    const std::int64_t rows = o.heads == head_allocation::adakv ? o.model.num_kv_heads : 1;
    if (!detail::fits_int32(kvevict::detail::saturating_mul(rows, o.limits.max_tokens), detail::select_tile))
      return status::error(errc::overflow, fn, "limits.max_tokens",
                           "expected %s below 2^31 - %lld on the GPU, got %lld tokens",
                           rows > 1 ? "Hkv x max_tokens (AdaKV)" : "max_tokens",
                           static_cast<long long>(detail::select_tile), static_cast<long long>(o.limits.max_tokens));
    return status();
  }

  /// Whether the GPU serves policy p (its traits state on_gpu), and its observation scorer's
  /// plan check: for the prompt policy and the decode scorer alike (errors name `policy.`; the
  /// decode scorer's are renamed under `decoding.`).
  static status check_gpu_policy(const policy_config& p, const char* fn) {
    if (!kvevict::detail::with_policy_traits(p.kind(), false, [](auto traits) { return decltype(traits)::on_gpu; }))
      return status::error(errc::unsupported, fn, "policy.kind",
                           "%s is not implemented on the GPU compressor (its traits do not state on_gpu)",
                           to_string(p.kind()));
    return kvevict::detail::with_policy_traits(p.kind(), status(), [&](auto traits) {
      using Tr = decltype(traits);
      if constexpr (detail::observation_scorer<Tr>::exists) {
        return detail::observation_scorer<Tr>::plan_check(Tr::config(p), fn);
      } else {
        return status();
      }
    });
  }

  /// The queries a prefill_end observes with: its own last ones, or the window assembled from
  /// the rows earlier chunks buffered and its own (chunked prefill).
  template <class T, class Q>
  query_view<const Q> window_of(const sequence_io<T, Q>& io, const detail::sequence_step& p, std::int64_t s,
                                const device_layout& dev) const noexcept {
    if (p.held == 0) return kvevict::detail::last_queries(io.queries, p.observed);
    return assembled_window_of<Q>(dev, s, p.observed);
  }

  /// A layer's window once a chunk of `n` queries joined it: its newest rows, the oldest leaving
  /// (kvevict::compressor's buffer_chunk); *slot: where the chunk's first kept row goes.
  detail::host_window_state after_chunk(const detail::host_window_state& w, std::int64_t n,
                                        std::int64_t* slot) const noexcept {
    const std::int64_t cap = window_capacity_;
    const std::int64_t take = n < cap ? n : cap;
    const std::int64_t keep = w.count < cap - take ? w.count : cap - take;
    detail::host_window_state next;
    next.decoding = w.decoding;
    next.start = (w.start + w.count - keep) % cap;
    next.count = keep + take;
    next.seen = w.seen + n;
    *slot = (next.start + keep) % cap;
    return next;
  }

  /// prefill_end's window from the layer's ring and the call's last queries, into the workspace.
  template <class T, class Q>
  status enqueue_assemble(const sequence_io<T, Q>& io, const detail::sequence_step& p, std::int64_t s,
                          std::int64_t layer, const device_layout& dev, const launch_options& opt) const {
    const detail::host_window_state w = *window_record(io.host_state, layer);
    const std::int64_t oldest = (w.start + w.count - p.held) % window_capacity_;
    const query_view<const Q> out = assembled_window_of<Q>(dev, s, p.observed);
    return detail::launch(
        "kvevict::cuda::compressor::run", "window_assemble_kernel",
        {dim3(static_cast<unsigned>(p.observed), static_cast<unsigned>(options_.model.num_query_heads)),
         dim3(detail::window_threads(options_.model.head_dim)), 0, opt.stream},
        detail::window_assemble_kernel<Q>, ring_of(io, layer), oldest, p.held,
        kvevict::detail::last_queries(io.queries, p.observed - p.held), const_cast<Q*>(out.data),
        dev.window_positions + s * window_capacity_);
  }

  /// The chunked-prefill window's device side of one sequence's step: a chunk's order check and
  /// its rows into the ring; prefill_end's order check (its verdict kept for a later eviction);
  /// an eviction fed by windows of earlier calls (DeferKV's step d, the per-sequence scope's last
  /// layer) cancelled when one of them came out of order.
  template <class T, class Q>
  status enqueue_window(const sequence_io<T, Q>& io, const detail::sequence_step& p, std::int64_t layer,
                        const device_layout& dev, const launch_options& opt) const {
    static constexpr const char* fn = "kvevict::cuda::compressor::run";
    const std::int64_t n = io.queries.num_queries;
    // (the prompt's order is checked where its chunks are buffered: the policies that read no
    // queries, and DapQ's pseudo tokens, hand queries the CPU does not read)
    const bool prefill = buffers_chunks() && io.event == sequence_event::prefill_end &&
                         (p.observe != detail::sequence_step::none || p.scores());
    const detail::host_window_state w = p.buffer || prefill ? ring_record(io, layer) : detail::host_window_state{};
    // (a new turn's first chunk still comes after the decode steps: checked against their newest)
    const bool earlier = p.buffer || prefill ? window_record(io.host_state, layer)->seen > 0 : false;
    if (p.buffer) {
      std::int64_t slot = 0;
      (void)after_chunk(w, n, &slot);
      const std::int64_t take = n < window_capacity_ ? n : window_capacity_;  // the chunk's rows it keeps
      const query_view<const Q> chunk(io.queries);
      // DeferKV's decode steps before its step d: its prompt window's verdict waits in the header.
      const bool keep = buffers_chunks() && defers() && io.event == sequence_event::decode &&
                        layer_record(io.host_state, layer)->phase != detail::phase_evicted;
      KVEVICT_RETURN_IF_ERROR(
          detail::launch(fn, "window_append_kernel",
                         {dim3(static_cast<unsigned>(take), static_cast<unsigned>(options_.model.num_query_heads)),
                          dim3(detail::window_threads(options_.model.head_dim)), 0, opt.stream},
                         detail::window_append_kernel<Q>, chunk, kvevict::detail::last_queries(io.queries, take),
                         ring_of(io, layer), slot, earlier, opt.device_flags, keep));
    }
    // A prefill_end that only observes (DeferKV fed back, a fold before the last layer) keeps
    // its verdict for the call that evicts, whose cancel word is its own (window_verdicts_kernel).
    if (prefill)
      KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "window_order_kernel", {dim3(1), dim3(1), 0, opt.stream},
                                             detail::window_order_kernel<>, ring_of(io, layer).header,
                                             io.queries.positions, n - 1, earlier, p.evict ? dev.cancel : nullptr,
                                             opt.device_flags));
    // (the verdicts at prefill_end are the chunks': a ring of decode rows alone has none yet)
    if (!p.evict || (!p.fold && io.event != sequence_event::decode) ||
        (io.event != sequence_event::decode && !buffers_chunks()))
      return status();
    const std::int64_t first = p.fold ? 0 : layer, layers = p.fold ? options_.model.num_layers : 1;
    return detail::launch(fn, "window_verdicts_kernel", {dim3(1), dim3(32), 0, opt.stream},
                          detail::window_verdicts_kernel<>,
                          reinterpret_cast<const unsigned char*>(ring_of(io, first).header), window_layer_bytes_,
                          layers, dev.cancel, opt.device_flags);
  }

  /// The ring's host record as a call's rows find it: a prompt chunk after decoding (a new turn)
  /// starts from an empty ring, the decode rows not being its.
  template <class T, class Q>
  detail::host_window_state ring_record(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    const detail::host_window_state w = *window_record(io.host_state, layer);
    return io.event == sequence_event::prefill_chunk && w.decoding != 0 ? detail::host_window_state{} : w;
  }

  /// The window's host record once the call succeeded: a chunk's rows joined it; prefill_end
  /// used it, and the next prompt starts from none (kvevict::compressor's clear_window).
  template <class T, class Q>
  void commit_window(const sequence_io<T, Q>& io, std::int64_t layer, const detail::sequence_step& p) const noexcept {
    if (!p.buffer && io.event != sequence_event::prefill_end) return;  // (an idle sequence has no host state)
    detail::host_window_state* w = window_record(io.host_state, layer);
    std::int64_t slot = 0;
    if (p.buffer) {
      *w = after_chunk(ring_record(io, layer), io.queries.num_queries, &slot);
      return;
    }
    *w = detail::host_window_state{};
    w->decoding = maintains() ? 1 : 0;  // decode-time budgets: the decode steps' ring starts empty
  }

  /// The scores of policy p, which reads no queries, by its key_scorer (validated arguments).
  template <class T>
  static status enqueue_key_scores(const policy_config& p, const cache_view<T>& keys, score_view scores,
                                   workspace_span ws, const launch_options& opt, const char* fn) {
    return kvevict::detail::with_policy_traits(p.kind(), status(), [&](auto traits) -> status {
      using Tr = decltype(traits);
      if constexpr (detail::key_scorer<Tr>::exists) {
        return detail::key_scorer<Tr>::enqueue(Tr::config(p), cache_view<const T>(keys), scores, ws, opt);
      } else {
        return status::error(errc::invalid_state, fn, "policy.kind", "%s has no GPU scorer", Tr::name);
      }
    });
  }

  template <class T, class Q, class H>
  status prepare_prefill(const sequence_io<T, Q>& io, const detail::sequence_step& p, std::int64_t s,
                         std::int64_t layer, const device_layout& dev, H& host, const launch_options& opt,
                         const char* fn) const {
    const query_view<const Q> q = window_of(io, p, s, dev);
    float* w = host.weights + s * window_;
    for (std::int64_t t = 0; t < q.num_queries; ++t)
      w[t] = static_cast<float>(std::pow(options_.policy.config<deferkv_traits>().effective_eta(),
                                         static_cast<double>(q.num_queries - 1 - t)));
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
    const deferkv_config& cfg = options_.policy.config<deferkv_traits>();
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

  /// padded_indices, and when nothing is compacted what the compactions write on success
  /// (head_lengths, kept_positions, head_freed_blocks, and the changed-block list, empty).
  /// padded_indices is the selected keep set even when the device then refuses the compaction
  /// (its flag says so); none is written when the call's cancel word is raised.
  template <class T, class Q>
  status enqueue_keep_outputs(const sequence_io<T, Q>& io, const keep_list_view& keep, const std::uint32_t* cancel,
                              const launch_options& opt, const char* fn) const {
    detail::listed_outputs listed;
    if (options_.compact == compaction::keep_list_only) {
      // K's table is the one an engine reclaims from; V's when K is strided (as the CPU's).
      const cache_view<T>& reclaimed = io.keys.is_paged() ? io.keys : io.values;
      listed.head_lengths = io.head_lengths;
      listed.positions = io.kept_positions;
      listed.head_freed_blocks = io.head_freed_blocks;
      listed.block_size = reclaimed.is_paged() ? reclaimed.block_size : 0;
      listed.head_tables = reclaimed.has_head_tables();
      listed.changed_blocks = io.changed_blocks;
    }
    if (io.padded_indices == nullptr && listed.head_lengths == nullptr && listed.positions == nullptr &&
        listed.head_freed_blocks == nullptr && listed.changed_blocks == nullptr)
      return status();
    const std::int64_t cap = head_capacity_ > 0 ? head_capacity_ : 1;
    const unsigned chunks = static_cast<unsigned>(detail::stride_grid(cap, 256, 64));
    return detail::launch(fn, "keep_outputs_kernel",
                          {dim3(chunks, static_cast<unsigned>(keep.num_heads)), dim3(256), 0, opt.stream},
                          detail::keep_outputs_kernel<>, keep.offsets, keep.indices, head_capacity_, io.keys.num_tokens,
                          io.key_positions, io.padded_indices, listed, cancel);
  }

  template <class T, class Q>
  sequence_report report_of(const sequence_io<T, Q>& io, std::int64_t layer,
                            const detail::sequence_step& p) const noexcept {
    sequence_report r;
    r.length = io.keys.num_tokens;
    r.next_slot = io.keys.num_tokens;
    r.next_position = -1;  // the positions are device data; the engine's own counter applies
    if (p.observe != detail::sequence_step::none || p.fold || p.buffer) r.action = sequence_action::observed;
    if (!p.evict) return r;
    r.action = sequence_action::evicted;
    const std::int64_t heads = options_.model.num_kv_heads, L = p.tokens;
    const std::int64_t protect = p.sel.protected_tail < L ? p.sel.protected_tail : L;
    const layer_budget& b = p.budget;
    const bool allocates = kvevict::detail::allocates(b);
    const std::int64_t mean = allocates ? kvevict::detail::mean_candidates(b, L, p.sel) : 0;
    // AdaKV's per-head counts (and their sum: each head's share is rounded) are the device's;
    // one keep set for every layer gives every head the same count.
    const std::int64_t per_head = b.heads == head_allocation::adakv && !p.fold
                                      ? -1
                                      : (allocates ? mean + protect : tokens_kept(b.per_head.resolve(L), L, p.sel));
    r.kept = per_head >= 0 ? heads * per_head : -1;
    r.length = per_head;
    r.next_slot = per_head;
    r.dropped = per_head >= 0 ? io.keys.num_tokens - per_head : -1;  // DapQ's pseudo rows too
    if (kvevict::detail::reuses_positions(options_.policy.kind()) && !p.round) r.next_position = L;  // DapQ: Lp
    // The changed blocks depend on which rows move: the device's list ends at its first -1
    // (keep-lists only: nothing moves, the list is empty, as the CPU reports).
    if (options_.compact != compaction::keep_list_only && io.changed_blocks != nullptr) r.num_changed_blocks = -1;
    // The per-sequence scope compacts this layer through its entry of io.layers (as the CPU's).
    const layer_cache<T> c = p.fold && options_.compact != compaction::keep_list_only ? io.layers[layer] : io.cache();
    if (options_.compact == compaction::out_of_place) {
      r.freed_blocks = c.keys.is_paged() ? c.keys.num_used_blocks() : c.values.num_used_blocks();
    } else {
      r.freed_blocks =
          per_head < 0 ? -1 : (c.keys.is_paged() ? c.keys.blocks_beyond(per_head) : c.values.blocks_beyond(per_head));
    }
    return r;
  }

  /// The per-sequence scope's bookkeeping once the call succeeded: the layer folded; at the
  /// last, the keep set applied and (DeferKV) every layer's record evicted.
  void commit_fold(void* host_state, std::int64_t layer, const detail::sequence_step& p) const noexcept {
    detail::host_scope_state* sc = scope_record(host_state);
    sc->folded = layer + 1;
    sc->tokens = p.tokens;
    sc->done = p.evict ? 1 : 0;  // (a decode-time round folds again after the prompt's set was applied)
    if (!p.evict) return;
    if (defers())
      for (std::int64_t l = 0; l < options_.model.num_layers; ++l)
        layer_record(host_state, l)->phase = detail::phase_evicted;
  }

  /// Sequence s's part of the shared scopes' batch (detail/shared_batch.cuh): its scores
  /// combined across heads (kvevict::compressor's combine) into its row of the workspace, and
  /// under the per-sequence scope folded into the sequence's row (layer 0 overwrites it, the
  /// last divides a mean by the layer count). Returns the row its keep set is selected from.
  template <class T, class Q>
  const float* describe_job(const sequence_io<T, Q>& io, std::int64_t s, const detail::sequence_step& p,
                            std::int64_t layer, const device_layout& dev, detail::shared_job& job) const noexcept {
    const score_view sc = scores_of(dev, s, p.tokens);
    const bool by_max = kvevict::detail::combines_by_max(options_.combine);
    job = detail::shared_job{};
    job.scores = sc.data;
    job.tokens = p.tokens;
    job.row_stride = sc.row_stride;
    job.candidates = p.tokens > p.sel.protected_tail ? p.tokens - p.sel.protected_tail : 0;
    job.combined = dev.layer_rows + s * options_.limits.max_tokens;
    if (p.fold) {
      job.folded = scope_row_of(io);
      job.first = layer == 0 ? 1 : 0;
      job.mean_of = !by_max && layer == options_.model.num_layers - 1 ? options_.model.num_layers : 0;
    }
    if (p.evict) {
      job.indices = dev.indices + s * keep_capacity_;
      job.kept = kept_per_head(p);
    }
    return p.fold ? job.folded : job.combined;
  }

  /// Sequence s's part of AdaKV's batch (detail/adakv_batch.cuh): adakv_head_budgets'
  /// arguments as select_layer passes them (the mean candidates B on top of the tail), and the
  /// counts that function derives from them.
  void describe_adakv(std::int64_t s, const detail::sequence_step& p, const device_layout& dev,
                      detail::adakv_job& job) const noexcept {
    const std::int64_t heads = options_.model.num_kv_heads, tokens = options_.limits.max_tokens;
    const adakv_params& params = options_.adakv;
    const score_view sc = scores_of(dev, s, p.tokens);
    job = detail::adakv_job{};
    job.scores = sc.data;
    job.row_stride = sc.row_stride;
    job.tokens = p.tokens;
    job.tail = p.sel.protected_tail;
    job.candidates = p.tokens > job.tail ? p.tokens - job.tail : 0;
    job.budget = kvevict::detail::mean_candidates(p.budget, p.tokens, p.sel);
    if (job.budget < job.candidates) {  // else every head keeps all its candidates
      job.forced = params.rule == adakv_rule::kvpress_safeguard
                       ? kvevict::detail::adakv_safeguard(job.budget, job.tail, params)
                       : 0;
      job.global = heads * (job.budget - job.forced);
      job.normalises = params.normalize && job.budget > 0;
      job.own = job.normalises ? job.budget : job.forced;
    }
    job.flat = dev.flat + s * heads * tokens;
    job.picked = dev.picked + s * heads * tokens;
    job.factors = dev.factors + s * heads;
    job.budgets = dev.head_budgets + s * heads;
    job.out = keep_of(dev, s);
  }

  /// AdaKV's per-head sets of every evicting sequence, one launch per step (adakv_head_budgets'
  /// then select's, each with the sequence on a grid dimension): the descriptors copied; each
  /// head's own top (the safeguard's f or the normalisation's B) in one selection; the factors;
  /// the flattened candidates and their global top in one selection; the budgets; the heads'
  /// rows and offsets, and every head's selection in one launch.
  status enqueue_adakv(const detail::adakv_job* jobs, std::int64_t count, std::int64_t longest,
                       const device_layout& dev, const launch_options& opt, const char* fn) const {
    const std::int64_t heads = options_.model.num_kv_heads;
    KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
        cudaMemcpyAsync(dev.adakv_jobs, jobs, static_cast<std::size_t>(count) * sizeof(detail::adakv_job),
                        cudaMemcpyHostToDevice, opt.stream),
        fn, "cudaMemcpyAsync"));
    std::int64_t own = 0, global = 0, normalises = 0, flat = 0;
    for (std::int64_t i = 0; i < count; ++i) {
      own = jobs[i].own > own ? jobs[i].own : own;
      global = jobs[i].global > global ? jobs[i].global : global;
      normalises += jobs[i].normalises ? 1 : 0;
      const std::int64_t n = heads * (jobs[i].candidates - jobs[i].forced);
      flat = jobs[i].global > 0 && n > flat ? n : flat;
    }
    const unsigned seqs = static_cast<unsigned>(count);
    if (own > 0) {
      KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "adakv_head_rows_batch_kernel", {dim3(seqs), dim3(256), 0, opt.stream},
                                             detail::adakv_head_rows_batch_kernel<>, dev.adakv_jobs, heads,
                                             dev.head_rows));
      KVEVICT_RETURN_IF_ERROR(
          detail::enqueue_select_rows(dev.head_rows, count * heads, longest, nullptr, dev.adakv_wide, opt, fn));
    }
    if (normalises > 0)
      KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "adakv_factor_batch_kernel", {dim3(seqs), dim3(256), 0, opt.stream},
                                             detail::adakv_factor_batch_kernel<>, dev.adakv_jobs, heads));
    if (global > 0) {
      KVEVICT_RETURN_IF_ERROR(detail::launch(
          fn, "adakv_flatten_batch_kernel",
          {dim3(static_cast<unsigned>(detail::stride_grid(flat, 256, 4096)), seqs), dim3(256), 0, opt.stream},
          detail::adakv_flatten_batch_kernel<>, dev.adakv_jobs, heads, dev.flat_rows));
      KVEVICT_RETURN_IF_ERROR(
          detail::enqueue_select_rows(dev.flat_rows, count, flat, nullptr, dev.adakv_wide, opt, fn));
    }
    KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "adakv_count_batch_kernel", {dim3(seqs), dim3(256), 0, opt.stream},
                                           detail::adakv_count_batch_kernel<>, dev.adakv_jobs, heads, options_.adakv));
    KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "adakv_prepare_batch_kernel", {dim3(seqs), dim3(1024), 0, opt.stream},
                                           detail::adakv_prepare_batch_kernel<>, dev.adakv_jobs, heads, dev.head_rows,
                                           opt.device_flags));
    return detail::enqueue_select_rows(dev.head_rows, count * heads, longest, nullptr, dev.adakv_wide, opt, fn);
  }

  /// Every sequence's combined (and folded) row in one launch per kernel: the descriptors
  /// copied, then for the normalised rules the heads' exact magnitude sums (a memset and two
  /// kernels), then one kernel that combines and folds.
  status enqueue_shared_rows(const detail::shared_job* jobs, std::int64_t count, std::int64_t longest,
                             const device_layout& dev, const launch_options& opt, const char* fn) const {
    const scope_combine rule = options_.combine;  // the plan's rule, for both steps
    const std::int64_t heads = options_.model.num_kv_heads;
    KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
        cudaMemcpyAsync(dev.jobs, jobs, static_cast<std::size_t>(count) * sizeof(detail::shared_job),
                        cudaMemcpyHostToDevice, opt.stream),
        fn, "cudaMemcpyAsync"));
    if (longest == 0) return status();
    const float* scales = nullptr;
    if (kvevict::detail::normalizes(rule)) {
      const std::int64_t rows = count * heads;
      KVEVICT_RETURN_IF_ERROR(detail::cuda_status(
          cudaMemsetAsync(dev.scope.bins, 0,
                          static_cast<std::size_t>(rows) * kvevict::detail::magnitude_bins * sizeof(unsigned long long),
                          opt.stream),
          fn, "cudaMemsetAsync"));
      const auto chunks = static_cast<unsigned>((longest + detail::scope_chunk - 1) / detail::scope_chunk);
      KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "magnitude_bins_batch_kernel",
                                             {dim3(chunks, static_cast<unsigned>(heads), static_cast<unsigned>(count)),
                                              dim3(detail::scope_threads), 0, opt.stream},
                                             detail::magnitude_bins_batch_kernel<>, dev.jobs, dev.scope.bins));
      KVEVICT_RETURN_IF_ERROR(detail::launch(
          fn, "row_scales_kernel", {dim3(detail::token_blocks(rows)), dim3(detail::scope_threads), 0, opt.stream},
          detail::row_scales_kernel<>, dev.scope.bins, rows, dev.scope.scales));
      scales = dev.scope.scales;
    }
    return detail::launch(
        fn, "combine_fold_batch_kernel",
        {dim3(detail::token_blocks(longest), static_cast<unsigned>(count)), dim3(detail::scope_threads), 0, opt.stream},
        detail::combine_fold_batch_kernel<>, dev.jobs, heads, kvevict::detail::combines_by_max(rule), scales);
  }

  /// The evicting sequences' shared rows (described in the selection block, copied) selected in
  /// one launch -- the wide selection from 16 Ki keys, as select_shared's -- then each set
  /// copied to the sequence's other heads.
  status enqueue_shared_selection(std::int64_t rows, std::int64_t jobs, std::int64_t longest, const device_layout& dev,
                                  const launch_options& opt, const char* fn) const {
    KVEVICT_RETURN_IF_ERROR(detail::enqueue_select_rows(dev.rows, rows, longest, nullptr, dev.wide, opt, fn));
    const std::int64_t heads = options_.model.num_kv_heads;
    if (heads == 1) return status();
    const unsigned chunks =
        static_cast<unsigned>(detail::stride_grid(head_capacity_ > 0 ? head_capacity_ : 1, detail::scope_threads, 64));
    return detail::launch(fn, "broadcast_keep_batch_kernel",
                          {dim3(chunks, static_cast<unsigned>(heads - 1), static_cast<unsigned>(jobs)),
                           dim3(detail::scope_threads), 0, opt.stream},
                          detail::broadcast_keep_batch_kernel<>, dev.jobs);
  }

  /// The compaction batches of the call's evicting sequences (host.compacted_seq), prepared:
  /// the layer's own, or under the per-sequence scope every layer's (io.layers), each in its
  /// own staging region, outputs written by this layer's only (as the CPU compressor).
  template <class T, class Q, class H>
  status prepare_compactions(const sequence_io<T, Q>* seqs, std::int64_t layer, std::int64_t compacted,
                             const device_layout& dev, H& host, std::int64_t* batches, const launch_options& opt,
                             const char* fn) const {
    *batches = 0;
    if (compacted == 0 || options_.compact == compaction::keep_list_only) return status();
    const std::int64_t count = compaction_batches();
    for (std::int64_t b = 0; b < count; ++b) {
      const bool own = !folds_layers() || b == layer;
      for (std::int64_t i = 0; i < compacted; ++i) {
        const sequence_io<T, Q>& io = seqs[host.compacted_seq[i]];
        const layer_cache<T> c = folds_layers() ? io.layers[b] : io.cache();
        const const_keep_list_view keep = keep_of(dev, host.compacted_seq[i]);
        compact_outputs out{own ? io.head_lengths : nullptr, own ? io.kept_positions : nullptr, io.key_positions};
        out.block_refcounts = c.block_refcounts;
        out.shared_blocks = c.shared_blocks;
        out.shared_check = shared_block_check::used;  // the CPU compressor's rule (below for out of place)
        out.changed_blocks = own ? io.changed_blocks : nullptr;
        out.head_freed_blocks = own ? io.head_freed_blocks : nullptr;
        if (options_.compact == compaction::in_place) {
          host.in_place[i] = compaction_sequence<T, T>{c.keys, c.values, keep, out};
          continue;
        }
        // The CPU compressor checks the marks of the destination rows a head of this length may
        // keep at most: the destination cut there (no head writes past it) is checked whole.
        const std::int64_t rows = head_rows_bound(c.keys.num_tokens);
        compaction_into_sequence<T, T>& into = host.into[i];
        into = compaction_into_sequence<T, T>{};
        into.src_keys = c.keys;
        into.src_values = c.values;
        into.dst_keys = c.dst_keys.first_tokens(rows);
        into.dst_values = c.dst_values.first_tokens(rows);
        into.keep = keep;
        into.out = out;
      }
      void* staging = static_cast<unsigned char*>(host.compact_staging) + b * host.compact_staging_bytes;
      detail::batch_launch* l = new (&host.batches[b]) detail::batch_launch();
      char inserted[40] = "";
      if (folds_layers()) std::snprintf(inserted, sizeof(inserted), ".layers[%lld]", static_cast<long long>(b));
      const status prepared = options_.compact == compaction::in_place
                                  ? detail::prepare_compact_batch(host.in_place, compacted, dev.compact, staging,
                                                                  host.compact_staging_bytes, opt, fn, l)
                                  : detail::prepare_compact_into_batch(host.into, compacted, dev.compact, staging,
                                                                       host.compact_staging_bytes, opt, fn, l);
      KVEVICT_RETURN_IF_ERROR(detail::renumbered(prepared, host.compacted_seq, compacted, fn, inserted));
    }
    *batches = count;
    return status();
  }
};

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_COMPRESSOR_CUH
