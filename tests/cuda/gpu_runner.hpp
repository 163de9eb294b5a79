// The GPU side of the CUDA tests, behind a CUDA-free interface: the test cases (compiled by
// the host compiler, with Eigen and the CPU library) hand host views and buffers to these
// functions, which mirror them to the device, run kvevict::cuda, and copy the results back.
// Implemented in gpu_runner.cu, the only CUDA translation unit of the tests.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvevict/budgets/adakv_params.hpp"
#include "kvevict/cuda/device_flags.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"
#include "kvevict/rope/rope.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/scope.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/query_view.hpp"

namespace gpu {

/// Whether a CUDA device is usable; `why` says what failed otherwise.
bool available(std::string* why = nullptr);
std::string device_name();

/// A host buffer a view points into (the runner copies [data, data + bytes) to the device and
/// rebases the view's pointers into the copy).
struct host_buffer {
  const void* data = nullptr;
  std::size_t bytes = 0;
};

template <class T>
host_buffer buffer_of(const std::vector<T>& v) {
  return {v.data(), v.size() * sizeof(T)};
}

struct obs_inputs {
  std::vector<std::int64_t> key_positions;  ///< empty: position j
  std::vector<float> weights;               ///< empty: none
  std::vector<float> lse;                   ///< empty: two-pass
  std::int64_t lse_head_stride = 0;
  bool check_pointers = true;
};

struct scores_result {
  kvevict::status st;
  std::vector<float> scores;  ///< [Hkv * L]
  std::uint32_t flags = 0;
};

/// kvevict::cuda::observation_scores on device copies of the views. `table` is the key
/// view's block table when paged (the view's pointer into it is rebased).
template <class QT, class KT>
scores_result observation_scores(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                                 const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                                 const std::vector<std::int32_t>& table, const kvevict::scoring_params& params,
                                 const obs_inputs& in = {});

struct rerotate_result {
  kvevict::status st;
  std::vector<float> queries;           ///< [Hq, W, d] as float
  std::vector<std::int64_t> positions;  ///< [W]
};
/// kvevict::cuda::dapq_rerotate of device copies of `q` (its table from rotation_table on the
/// host), output elements OutT (the query type).
template <class QT>
rerotate_result dapq_rerotate(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                              const kvevict::rope_config& rope, std::int64_t delta);

/// The scores that read no queries: key_norm_scores, streaming_scores, keydiff_scores.
enum class key_scorer_kind { knorm, streaming_llm, keydiff };
/// One of them on a device copy of the key view; `param` is the protected tail (KNorm,
/// KeyDiff) or the sinks (StreamingLLM).
template <class KT>
scores_result key_scores(const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                         const std::vector<std::int32_t>& table, key_scorer_kind kind, std::int64_t param);

/// kvevict::cuda::chunk_scores on a device copy of `scores` [rows * cols] (in place).
scores_result chunk_scores(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols,
                           std::int64_t protected_tail, std::int64_t chunk_length);

/// One sequence of a batched scoring call, as host buffers.
template <class QT, class KT>
struct batch_sequence {
  kvevict::query_view<const QT> q;
  host_buffer qbuf;
  kvevict::cache_view<const KT> k;
  host_buffer kbuf;
  const std::vector<std::int32_t>* table = nullptr;  ///< the one k.block_table points into
  obs_inputs in;
};

struct batch_result {
  kvevict::status st;
  std::vector<std::vector<float>> scores;  ///< [Hkv * L_s] per sequence
  std::uint32_t flags = 0;
};

/// kvevict::cuda::observation_scores_batch over the sequences, with pinned staging.
template <class QT, class KT>
batch_result observation_scores_batch(const std::vector<batch_sequence<QT, KT>>& seqs,
                                      const kvevict::scoring_params& params);

struct state_result {
  kvevict::status st;
  std::vector<float> state;  ///< [Hkv * C]
  std::uint32_t flags = 0;
};

/// kvevict::cuda::observation_state on a device copy of `state` ([Hkv * C]).
template <class QT, class KT>
state_result observation_state(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                               const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                               const std::vector<std::int32_t>& table, const kvevict::scoring_params& params, float eta,
                               const std::vector<float>& state, const obs_inputs& in = {});

struct decode_step {
  float eta = 1.0f;
  kvevict::gqa_reduction gqa = kvevict::gqa_reduction::mean;
  kvevict::softmax_domain domain = kvevict::softmax_domain::visible;
  std::int64_t protected_tail = 0;
  std::vector<float> lse;  ///< [Hq] engine LSE, empty: two-pass
  std::vector<std::int64_t> key_positions;
};

/// One decode_observation step on a device copy of `state` ([Hkv * C]).
template <class QT, class KT>
state_result decode_observation(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                                const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                                const std::vector<std::int32_t>& table, const decode_step& step,
                                const std::vector<float>& state);

struct plan_result {
  kvevict::status st;                      ///< init's status, else the first failing step's
  std::vector<std::vector<float>> states;  ///< the state [Hkv * (capacity - P)] after each step
  std::uint32_t flags = 0;
  std::int32_t steps = 0;  ///< the plan's device step counter at the end
};

/// A kvevict::cuda::decode_plan at the capacity k.num_tokens, run once per entry of `lengths`
/// (written to the plan's device-side token count before the step), directly or, with
/// `graph`, through one captured CUDA graph replayed every step.
template <class QT, class KT>
plan_result decode_plan_steps(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                              const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                              const std::vector<std::int32_t>& table, const decode_step& step,
                              const std::vector<std::int32_t>& lengths, const std::vector<float>& state, bool graph);

/// finalize_state_scores of a host state [Hkv * C] into scores [Hkv * L].
scores_result finalize_state(const std::vector<float>& state, std::int64_t kv_heads, std::int64_t tokens,
                             std::int64_t group, float scale, const kvevict::scoring_params& params);

struct keep_result {
  kvevict::status st;
  std::vector<std::int64_t> offsets;
  std::vector<std::int64_t> indices;  ///< [capacity]; untouched entries hold -7
  std::uint32_t flags = 0;
};

/// kvevict::cuda::select over a [rows, cols] host matrix; head_budgets empty: uniform b.
keep_result select(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols, kvevict::budget b,
                   const std::vector<std::int64_t>& head_budgets, const kvevict::selection_params& params,
                   std::int64_t capacity);

struct adakv_result {
  kvevict::status st;
  std::vector<std::int64_t> budgets;  ///< [rows]
  keep_result keep;                   ///< the head-budget selection fed by those device budgets
};

/// kvevict::cuda::adakv_head_budgets over a host matrix [rows, cols], then (when it
/// succeeded) kvevict::cuda::select with the device budgets it wrote, in the same stream, no
/// host round trip in between; `capacity` is the keep-list's.
adakv_result adakv(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols, std::int64_t per_head_budget,
                   const kvevict::adakv_params& params, const kvevict::selection_params& selection,
                   std::int64_t capacity);

/// kvevict::cuda::combine_head_scores over a host matrix [rows, cols] with row_stride
/// elements between rows, into a row [cols] (untouched entries hold -7).
struct row_result {
  kvevict::status st;
  std::vector<float> row;
  std::uint32_t flags = 0;
};
row_result combine_head_scores(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols,
                               std::int64_t row_stride, std::int64_t protected_tail, kvevict::scope_combine rule,
                               std::size_t workspace_bytes = SIZE_MAX);

/// The sequence scope on the device: each layer's [rows, cols] matrix combined by `rule`
/// (combine_head_scores) and folded into one row (fold_layer_scores), then that row's keep
/// set given to `heads` heads (select_shared); `keep.st` is select_shared's status.
struct sequence_result {
  row_result combined;
  keep_result keep;
};
sequence_result sequence_scope(const std::vector<std::vector<float>>& layers, std::int64_t rows, std::int64_t cols,
                               std::int64_t protected_tail, kvevict::scope_combine rule, kvevict::budget b,
                               const kvevict::selection_params& params, std::int64_t heads, std::int64_t capacity);

/// kvevict::cuda::fold_layer_scores with the given arguments (device rows of `tokens` each, or
/// null ones when `null_rows`), for the argument checks.
kvevict::status fold_layer_scores_call(std::int64_t tokens, std::int64_t protected_tail, kvevict::scope_combine rule,
                                       std::int64_t layer, std::int64_t num_layers, bool null_rows);

/// kvevict::cuda::select_shared over a host row [1, cols] viewed with `rows` rows.
keep_result select_shared(const std::vector<float>& row, std::int64_t rows, kvevict::budget b,
                          const kvevict::selection_params& params, std::int64_t heads, std::int64_t capacity);

/// One ragged row for select_rows.
struct row_spec {
  std::vector<float> scores;
  std::int64_t length = -1;  ///< -1: scores.size()
  std::int64_t budget = 0;
  std::int64_t protected_tail = 0;
  kvevict::protected_mode mode = kvevict::protected_mode::inside_budget;
};

struct rows_result {
  kvevict::status st;
  std::vector<std::vector<std::int64_t>> out;  ///< per row; untouched entries hold -7
  std::uint32_t flags = 0;
};

/// kvevict::cuda::select_rows over all rows in one launch, or (`wide`) select_rows_wide.
rows_result select_rows(const std::vector<row_spec>& rows, std::int64_t max_length, bool wide = false);

struct compact_result {
  kvevict::status st;
  std::vector<unsigned char> keys, values;  ///< the buffers afterwards
  std::vector<std::int64_t> head_lengths, positions;
  std::vector<std::int32_t> changed_blocks;     ///< when asked for (compact_blocks::changed)
  std::vector<std::int64_t> head_freed_blocks;  ///< when asked for (compact_blocks::freed)
  std::uint32_t flags = 0;
};

/// compact's block inputs and outputs (prefix-shared blocks).
struct compact_blocks {
  std::vector<std::int32_t> refcounts;     ///< per pool block, or empty
  std::vector<std::uint32_t> shared_bits;  ///< bitmap words, or empty
  bool every_used_block = false;           ///< shared_block_check::used (else written)
  bool changed = false, freed = false;     ///< ask for changed_blocks / head_freed_blocks
  std::int64_t changed_entries = 0;        ///< changed_blocks' length but its end (the runner fills it with 77)
};

struct compact_into_result {
  kvevict::status st;
  std::vector<unsigned char> src_keys, src_values, dst_keys, dst_values;  ///< the buffers afterwards
  std::vector<std::int64_t> head_lengths, positions;
  std::vector<std::int32_t> changed_blocks;     ///< when asked for (compact_blocks::changed)
  std::vector<std::int64_t> head_freed_blocks;  ///< when asked for (compact_blocks::freed)
  std::uint32_t flags = 0;
};

/// One side of compact_into: a view, its host buffer and the host table it points into.
template <class T>
struct side {
  kvevict::cache_view<T> view;
  host_buffer buf;
  const std::vector<std::int32_t>* table = nullptr;
};

/// kvevict::cuda::compact_into on device copies; buffers given by the same host pointer
/// become one device buffer (a destination in the source's pool).
template <class KT, class VT>
compact_into_result compact_into(const side<KT>& src_k, const side<VT>& src_v, const side<KT>& dst_k,
                                 const side<VT>& dst_v, const std::vector<std::int64_t>& offsets,
                                 const std::vector<std::int64_t>& indices, std::int64_t capacity,
                                 const std::vector<std::int64_t>& key_positions, const compact_blocks& blocks = {});

/// kvevict::cuda::compact on device copies. K and V buffers (and tables) given by the same
/// host pointer become one device buffer (shared pools, shared tables).
template <class KT, class VT>
compact_result compact(const kvevict::cache_view<KT>& k, host_buffer kbuf, const std::vector<std::int32_t>& ktable,
                       const kvevict::cache_view<VT>& v, host_buffer vbuf, const std::vector<std::int32_t>& vtable,
                       const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& indices,
                       std::int64_t capacity, const std::vector<std::int64_t>& key_positions = {},
                       const compact_blocks& blocks = {});

/// One sequence of a batched compaction: its K and V sides (views may point into a pool
/// shared with other sequences: buffers and tables given by the same host pointer become one
/// device buffer) and its keep-list.
template <class KT, class VT>
struct batch_compaction {
  side<KT> k;
  side<VT> v;
  std::vector<std::int64_t> offsets, indices;
  std::int64_t capacity = 0;
  std::vector<std::int64_t> key_positions;
};

struct compact_batch_result {
  kvevict::status st;
  /// Per sequence: its K and V buffers afterwards (a shared pool appears in each), head
  /// lengths and positions (-7 where untouched).
  std::vector<std::vector<unsigned char>> keys, values;
  std::vector<std::vector<std::int64_t>> head_lengths, positions;
  std::uint32_t flags = 0;
};

/// kvevict::cuda::compact_batch over device copies, with pinned staging; `workspace_bytes`
/// overrides the workspace size (SIZE_MAX: compact_batch_workspace_size's).
/// `misalign` offsets the workspace pointer by that many bytes (the call must cope).
template <class KT, class VT>
compact_batch_result compact_batch(const std::vector<batch_compaction<KT, VT>>& seqs,
                                   std::size_t workspace_bytes = SIZE_MAX, std::size_t misalign = 0);

/// One sequence of a batched out-of-place compaction (sides as for compact_into).
template <class KT, class VT>
struct batch_compaction_into {
  side<KT> src_k, dst_k;
  side<VT> src_v, dst_v;
  std::vector<std::int64_t> offsets, indices;
  std::int64_t capacity = 0;
  std::vector<std::int64_t> key_positions;
};

/// kvevict::cuda::compact_into_batch over device copies (pinned staging); per sequence its
/// source and destination buffers afterwards (shared buffers appear in each).
compact_batch_result compact_into_batch_bf16(
    const std::vector<batch_compaction_into<kvevict::bf16, kvevict::bf16>>& seqs);

/// Host-side validation cases that need real device memory: each returns the status of one
/// call expected to fail (name says which).
kvevict::status observation_with_host_keys();
kvevict::status observation_with_small_workspace();
kvevict::status compact_with_aliased_kv();
kvevict::status select_with_small_capacity();
kvevict::status decode_with_two_queries();
/// run() of a decode_plan whose init never succeeded.
kvevict::status decode_plan_unplanned_run();

}  // namespace gpu
