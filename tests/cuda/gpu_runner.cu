// GPU side of the CUDA tests (see gpu_runner.hpp): mirrors host views to the device, runs
// kvevict::cuda on a non-default stream with a device flag word, and copies results back.
// Tests may allocate; the library calls under test never do.
#include "gpu_runner.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <utility>

#include "device_mirror.hpp"
#include "kvevict/cuda.cuh"

namespace gpu {

bool available(std::string* why) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess || n == 0) {
    if (why != nullptr) *why = e != cudaSuccess ? cudaGetErrorString(e) : "no CUDA device";
    return false;
  }
  return true;
}

std::string device_name() {
  cudaDeviceProp p{};
  int dev = 0;
  if (cudaGetDevice(&dev) != cudaSuccess || cudaGetDeviceProperties(&p, dev) != cudaSuccess) return "?";
  return p.name;
}

template <class QT, class KT>
scores_result observation_scores(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                                 const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                                 const std::vector<std::int32_t>& table, const kvevict::scoring_params& params,
                                 const obs_inputs& in) {
  scores_result r;
  mirror m;
  const auto dq = device_queries(m, q, qbuf);
  const auto dk = device_view(m, k, kbuf, table);
  const std::size_t n = static_cast<std::size_t>(k.num_heads * k.num_tokens);
  float* scores = m.alloc<float>(n);
  m.fill(scores, n, 12345.0f);  // unwritten entries show up
  kvevict::cuda::observation_inputs din;
  din.key_positions = m.put_vector(in.key_positions);
  din.weights = m.put_vector(in.weights);
  din.lse = m.put_vector(in.lse);
  din.lse_head_stride = in.lse_head_stride;
  const kvevict::layer_shape shape{q.num_heads, k.num_heads, k.head_dim, k.num_tokens, q.num_queries};
  const std::size_t bytes = kvevict::cuda::observation_scores_workspace_size(shape, params, !in.lse.empty());
  void* ws = m.alloc_bytes(bytes);
  r.st = m.finish(kvevict::cuda::observation_scores(dq, dk, params, {scores, k.num_heads, k.num_tokens, k.num_tokens},
                                                    {ws, bytes}, din, m.options(in.check_pointers)));
  r.scores = m.get(scores, n);
  r.flags = m.read_flags();
  return r;
}

template <class QT>
rerotate_result dapq_rerotate(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                              const kvevict::rope_config& rope, std::int64_t delta) {
  rerotate_result r;
  mirror m;
  const auto dq = device_queries(m, q, qbuf);
  std::vector<double> table(static_cast<std::size_t>(kvevict::cuda::rotation_table_size(rope)) + 1);
  kvevict::cuda::rotation_table(rope, delta, table.data());
  const double* dt = m.put_vector(table);
  const std::size_t n = static_cast<std::size_t>(q.num_heads * q.num_queries * q.head_dim);
  QT* out = m.alloc<QT>(n + 1);
  std::int64_t* positions = m.alloc<std::int64_t>(static_cast<std::size_t>(q.num_queries) + 1);
  r.st = m.finish(kvevict::cuda::dapq_rerotate(dq, rope, dt, delta, out, positions, m.options()));
  for (const QT& x : m.get(out, n)) r.queries.push_back(kvevict::to_float(x));
  r.positions = m.get(positions, static_cast<std::size_t>(q.num_queries));
  return r;
}

template <class KT>
scores_result key_scores(const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                         const std::vector<std::int32_t>& table, key_scorer_kind kind, std::int64_t param) {
  scores_result r;
  mirror m;
  const auto dk = device_view(m, k, kbuf, table);
  const std::size_t n = static_cast<std::size_t>(std::max<std::int64_t>(k.num_heads * k.num_tokens, 1));
  float* scores = m.alloc<float>(n);
  m.fill(scores, n, 12345.0f);  // unwritten entries show up
  const kvevict::score_view out{scores, k.num_heads, k.num_tokens, k.num_tokens};
  kvevict::status st;
  if (kind == key_scorer_kind::knorm) {
    st = kvevict::cuda::key_norm_scores(dk, param, out, m.options());
  } else if (kind == key_scorer_kind::streaming_llm) {
    st = kvevict::cuda::streaming_scores(param, out, m.options());
  } else {
    const std::size_t bytes = kvevict::cuda::keydiff_scores_workspace_size(k.num_heads, k.num_tokens, k.head_dim);
    unsigned char* ws = m.alloc<unsigned char>(bytes + 1);
    m.fill(ws, bytes + 1, static_cast<unsigned char>(0xff));  // NaN doubles: an unwritten read shows up
    st = kvevict::cuda::keydiff_scores(dk, param, out, kvevict::workspace_span{ws, bytes}, m.options());
  }
  r.st = m.finish(st);
  r.scores = m.get(scores, static_cast<std::size_t>(k.num_heads * k.num_tokens));
  r.flags = m.read_flags();
  return r;
}

scores_result chunk_scores(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols,
                           std::int64_t protected_tail, std::int64_t chunk_length) {
  scores_result r;
  mirror m;
  float* d = m.put_vector(scores);
  if (d == nullptr) d = m.alloc<float>(1);
  r.st = m.finish(kvevict::cuda::chunk_scores({d, rows, cols, cols}, protected_tail, chunk_length, m.options()));
  r.scores = m.get(d, scores.size());
  r.flags = m.read_flags();
  return r;
}

template <class QT, class KT>
batch_result observation_scores_batch(const std::vector<batch_sequence<QT, KT>>& seqs,
                                      const kvevict::scoring_params& params) {
  batch_result r;
  mirror m;
  std::vector<kvevict::cuda::scoring_sequence<QT, KT>> ds(seqs.size());
  std::vector<float*> outs(seqs.size());
  kvevict::layer_shape largest{0, 0, 0, 0, 0};
  bool lse = false;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const batch_sequence<QT, KT>& b = seqs[i];
    kvevict::cuda::scoring_sequence<QT, KT>& d = ds[i];
    d.queries = device_queries(m, b.q, b.qbuf);
    static const std::vector<std::int32_t> no_table;
    d.keys = device_view(m, b.k, b.kbuf, b.table != nullptr ? *b.table : no_table);
    const std::size_t n = static_cast<std::size_t>(b.k.num_heads * b.k.num_tokens);
    outs[i] = m.alloc<float>(n);
    m.fill(outs[i], n, 12345.0f);
    d.scores = {outs[i], b.k.num_heads, b.k.num_tokens, b.k.num_tokens};
    d.inputs.key_positions = m.fresh_copy(b.in.key_positions);
    d.inputs.weights = m.fresh_copy(b.in.weights);
    d.inputs.lse = m.fresh_copy(b.in.lse);
    d.inputs.lse_head_stride = b.in.lse_head_stride;
    largest = {b.q.num_heads, b.k.num_heads, b.k.head_dim, std::max(largest.num_tokens, b.k.num_tokens),
               std::max(largest.num_queries, b.q.num_queries)};
    lse = lse || !b.in.lse.empty();
  }
  const auto n = static_cast<std::int64_t>(seqs.size());
  const std::size_t bytes = kvevict::cuda::observation_scores_batch_workspace_size<QT, KT>(n, largest, params, lse);
  void* ws = m.alloc_bytes(bytes);
  const std::size_t staging_bytes = kvevict::cuda::observation_scores_batch_staging_size<QT, KT>(n);
  void* staging = nullptr;
  cudaMallocHost(&staging, staging_bytes == 0 ? 1 : staging_bytes);
  r.st = m.finish(
      kvevict::cuda::observation_scores_batch(ds.data(), n, params, {ws, bytes}, staging, staging_bytes, m.options()));
  cudaFreeHost(staging);
  for (std::size_t i = 0; i < seqs.size(); ++i)
    r.scores.push_back(m.get(outs[i], static_cast<std::size_t>(seqs[i].k.num_heads * seqs[i].k.num_tokens)));
  r.flags = m.read_flags();
  return r;
}

template <class QT, class KT>
state_result observation_state(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                               const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                               const std::vector<std::int32_t>& table, const kvevict::scoring_params& params, float eta,
                               const std::vector<float>& state, const obs_inputs& in) {
  state_result r;
  mirror m;
  const auto dq = device_queries(m, q, qbuf);
  const auto dk = device_view(m, k, kbuf, table);
  const std::int64_t c = std::max<std::int64_t>(0, k.num_tokens - params.protected_tail);
  float* dstate = m.alloc<float>(state.size());
  if (!state.empty()) cudaMemcpy(dstate, state.data(), state.size() * sizeof(float), cudaMemcpyHostToDevice);
  kvevict::cuda::observation_inputs din;
  din.key_positions = m.put_vector(in.key_positions);
  din.weights = m.put_vector(in.weights);
  din.lse = m.put_vector(in.lse);
  din.lse_head_stride = in.lse_head_stride;
  const kvevict::layer_shape shape{q.num_heads, k.num_heads, k.head_dim, k.num_tokens, q.num_queries};
  const std::size_t bytes = kvevict::cuda::observation_scores_workspace_size(shape, params, !in.lse.empty());
  void* ws = m.alloc_bytes(bytes);
  r.st = m.finish(kvevict::cuda::observation_state(dq, dk, params, eta, {dstate, k.num_heads, c, c}, {ws, bytes}, din,
                                                   m.options()));
  r.state = m.get(dstate, state.size());
  r.flags = m.read_flags();
  return r;
}

template <class QT, class KT>
state_result decode_observation(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                                const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                                const std::vector<std::int32_t>& table, const decode_step& step,
                                const std::vector<float>& state) {
  state_result r;
  mirror m;
  const auto dq = device_queries(m, q, qbuf);
  const auto dk = device_view(m, k, kbuf, table);
  const std::int64_t c = std::max<std::int64_t>(0, k.num_tokens - step.protected_tail);
  float* dstate = m.alloc<float>(state.size());
  if (!state.empty()) cudaMemcpy(dstate, state.data(), state.size() * sizeof(float), cudaMemcpyHostToDevice);
  kvevict::cuda::decode_params p;
  p.eta = step.eta;
  p.gqa = step.gqa;
  p.domain = step.domain;
  p.protected_tail = step.protected_tail;
  kvevict::cuda::decode_inputs din;
  din.lse = m.put_vector(step.lse);
  din.key_positions = m.put_vector(step.key_positions);
  const kvevict::layer_shape shape{q.num_heads, k.num_heads, k.head_dim, k.num_tokens, 1};
  const std::size_t bytes = kvevict::cuda::decode_observation_workspace_size(shape, p, !step.lse.empty());
  void* ws = m.alloc_bytes(bytes);
  r.st = m.finish(
      kvevict::cuda::decode_observation(dq, dk, p, {dstate, k.num_heads, c, c}, {ws, bytes}, din, m.options()));
  r.state = m.get(dstate, state.size());
  r.flags = m.read_flags();
  return r;
}

template <class QT, class KT>
plan_result decode_plan_steps(const kvevict::query_view<const QT>& q, host_buffer qbuf,
                              const kvevict::cache_view<const KT>& k, host_buffer kbuf,
                              const std::vector<std::int32_t>& table, const decode_step& step,
                              const std::vector<std::int32_t>& lengths, const std::vector<float>& state, bool graph) {
  plan_result r;
  mirror m;
  const auto dq = device_queries(m, q, qbuf);
  const auto dk = device_view(m, k, kbuf, table);
  const std::int64_t c = std::max<std::int64_t>(0, k.num_tokens - step.protected_tail);
  float* dstate = m.alloc<float>(state.size());
  if (!state.empty()) cudaMemcpy(dstate, state.data(), state.size() * sizeof(float), cudaMemcpyHostToDevice);
  kvevict::cuda::decode_params p;
  p.eta = step.eta;
  p.gqa = step.gqa;
  p.domain = step.domain;
  p.protected_tail = step.protected_tail;
  kvevict::cuda::decode_inputs din;
  din.lse = m.put_vector(step.lse);
  din.key_positions = m.put_vector(step.key_positions);
  auto* length = m.alloc<std::int32_t>(1);
  auto* steps = m.alloc<std::int32_t>(1);
  m.fill(steps, 1, std::int32_t{0});
  const kvevict::layer_shape shape{q.num_heads, k.num_heads, k.head_dim, k.num_tokens, 1};
  const std::size_t bytes = kvevict::cuda::decode_observation_workspace_size(shape, p, !step.lse.empty());
  void* ws = m.alloc_bytes(bytes);
  const kvevict::cuda::launch_options opt = m.options();
  kvevict::cuda::decode_plan<QT, KT> plan;
  r.st = m.finish(plan.init(dq, dk, p, {dstate, k.num_heads, c, c}, {ws, bytes}, length, din, steps, opt));
  if (!r.st.ok()) return r;
  cudaGraph_t g = nullptr;
  cudaGraphExec_t exec = nullptr;
  if (graph) {
    cudaStreamBeginCapture(opt.stream, cudaStreamCaptureModeThreadLocal);
    const kvevict::status captured = plan.run(opt.stream);
    const cudaError_t end = cudaStreamEndCapture(opt.stream, &g);
    if (!captured.ok() || end != cudaSuccess || cudaGraphInstantiate(&exec, g) != cudaSuccess) {
      r.st = captured.ok() ? kvevict::status::error(kvevict::errc::device_error, "gpu_runner", "graph",
                                                    "capture or instantiation failed")
                           : captured;
      if (g != nullptr) cudaGraphDestroy(g);
      return r;
    }
  }
  for (std::int32_t n : lengths) {
    cudaMemcpy(length, &n, sizeof(n), cudaMemcpyHostToDevice);
    const kvevict::status st =
        graph ? kvevict::cuda::detail::cuda_status(cudaGraphLaunch(exec, opt.stream), "gpu_runner", "cudaGraphLaunch")
              : plan.run(opt.stream);
    r.st = m.finish(st);
    if (!r.st.ok()) break;
    r.states.push_back(m.get(dstate, state.size()));
  }
  if (exec != nullptr) cudaGraphExecDestroy(exec);
  if (g != nullptr) cudaGraphDestroy(g);
  r.flags = m.read_flags();
  r.steps = m.get(steps, 1)[0];
  return r;
}

scores_result finalize_state(const std::vector<float>& state, std::int64_t kv_heads, std::int64_t tokens,
                             std::int64_t group, float scale, const kvevict::scoring_params& params) {
  scores_result r;
  mirror m;
  const std::int64_t c = std::max<std::int64_t>(0, tokens - params.protected_tail);
  const float* dstate = m.put_vector(state);
  if (dstate == nullptr) dstate = m.alloc<float>(1);
  const std::size_t n = static_cast<std::size_t>(kv_heads * tokens);
  float* scores = m.alloc<float>(n);
  m.fill(scores, n, 12345.0f);
  r.st = m.finish(kvevict::cuda::finalize_state_scores({dstate, kv_heads, c, c}, group, scale, params,
                                                       {scores, kv_heads, tokens, tokens}, m.options()));
  r.scores = m.get(scores, n);
  r.flags = m.read_flags();
  return r;
}

keep_result select(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols, kvevict::budget b,
                   const std::vector<std::int64_t>& head_budgets, const kvevict::selection_params& params,
                   std::int64_t capacity) {
  keep_result r;
  mirror m;
  const float* dscores = m.put_vector(scores);
  if (dscores == nullptr) dscores = m.alloc<float>(1);
  auto* offsets = m.alloc<std::int64_t>(static_cast<std::size_t>(rows + 1));
  auto* indices = m.alloc<std::int64_t>(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)));
  m.fill(offsets, static_cast<std::size_t>(rows + 1), std::int64_t{-7});
  m.fill(indices, static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)), std::int64_t{-7});
  const std::size_t bytes = kvevict::cuda::select_workspace_size(rows);
  void* ws = m.alloc_bytes(bytes);
  const kvevict::const_score_view sv{dscores, rows, cols, cols};
  const kvevict::keep_list_view out{rows, offsets, indices, capacity};
  status st;
  if (head_budgets.empty()) {
    st = kvevict::cuda::select(sv, b, params, out, {ws, bytes}, m.options());
  } else {
    st = kvevict::cuda::select(sv, m.put_vector(head_budgets), params, out, {ws, bytes}, m.options());
  }
  r.st = m.finish(st);
  r.offsets = m.get(offsets, static_cast<std::size_t>(rows + 1));
  r.indices = m.get(indices, static_cast<std::size_t>(std::max<std::int64_t>(capacity, 0)));
  r.flags = m.read_flags();
  return r;
}

adakv_result adakv(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols, std::int64_t per_head_budget,
                   const kvevict::adakv_params& params, const kvevict::selection_params& selection,
                   std::int64_t capacity) {
  adakv_result r;
  mirror m;
  const float* dscores = m.put_vector(scores);
  if (dscores == nullptr) dscores = m.alloc<float>(1);
  auto* budgets = m.alloc<std::int64_t>(static_cast<std::size_t>(rows));
  m.fill(budgets, static_cast<std::size_t>(rows), std::int64_t{-7});
  const std::size_t bytes = kvevict::cuda::adakv_workspace_size(rows, cols);
  void* ws = m.alloc_bytes(bytes);
  const kvevict::const_score_view sv{dscores, rows, cols, cols};
  const kvevict::cuda::launch_options opt = m.options();
  kvevict::status st = kvevict::cuda::adakv_head_budgets(sv, selection.protected_tail, per_head_budget, params, budgets,
                                                         {ws, bytes}, opt);
  if (st.ok()) {
    auto* offsets = m.alloc<std::int64_t>(static_cast<std::size_t>(rows + 1));
    auto* indices = m.alloc<std::int64_t>(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)));
    m.fill(indices, static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)), std::int64_t{-7});
    const std::size_t sbytes = kvevict::cuda::select_workspace_size(rows);
    void* sws = m.alloc_bytes(sbytes);
    const kvevict::keep_list_view out{rows, offsets, indices, capacity};
    r.keep.st = kvevict::cuda::select(sv, budgets, selection, out, {sws, sbytes}, opt);
    st = m.finish(r.keep.st);
    r.keep.offsets = m.get(offsets, static_cast<std::size_t>(rows + 1));
    r.keep.indices = m.get(indices, static_cast<std::size_t>(std::max<std::int64_t>(capacity, 0)));
  }
  r.st = m.finish(st);
  r.budgets = m.get(budgets, static_cast<std::size_t>(rows));
  r.keep.flags = m.read_flags();
  return r;
}

row_result combine_head_scores(const std::vector<float>& scores, std::int64_t rows, std::int64_t cols,
                               std::int64_t row_stride, std::int64_t protected_tail, kvevict::scope_combine rule,
                               std::size_t workspace_bytes) {
  row_result r;
  mirror m;
  const float* dscores = m.put_vector(scores);
  if (dscores == nullptr) dscores = m.alloc<float>(1);
  const std::size_t n = static_cast<std::size_t>(std::max<std::int64_t>(cols, 1));
  auto* out = m.alloc<float>(n);
  m.fill(out, n, -7.0f);
  const std::size_t need = kvevict::cuda::combine_head_scores_workspace_size(std::max<std::int64_t>(rows, 0));
  const std::size_t bytes = workspace_bytes == SIZE_MAX ? need : workspace_bytes;
  void* ws = m.alloc_bytes(bytes);
  r.st = m.finish(kvevict::cuda::combine_head_scores({dscores, rows, cols, row_stride}, protected_tail, rule, out,
                                                     {ws, bytes}, m.options()));
  r.row = m.get(out, static_cast<std::size_t>(std::max<std::int64_t>(cols, 0)));
  r.flags = m.read_flags();
  return r;
}

sequence_result sequence_scope(const std::vector<std::vector<float>>& layers, std::int64_t rows, std::int64_t cols,
                               std::int64_t protected_tail, kvevict::scope_combine rule, kvevict::budget b,
                               const kvevict::selection_params& params, std::int64_t heads, std::int64_t capacity) {
  sequence_result r;
  mirror m;
  const std::size_t n = static_cast<std::size_t>(std::max<std::int64_t>(cols, 1));
  auto* layer_row = m.alloc<float>(n);
  auto* sequence_row = m.alloc<float>(n);
  m.fill(sequence_row, n, -7.0f);
  const std::size_t bytes = kvevict::cuda::combine_head_scores_workspace_size(rows);
  void* ws = m.alloc_bytes(bytes);
  const auto num_layers = static_cast<std::int64_t>(layers.size());
  status st;
  for (std::int64_t l = 0; l < num_layers && st.ok(); ++l) {
    const float* d = m.fresh_copy(layers[static_cast<std::size_t>(l)]);
    st = kvevict::cuda::combine_head_scores({d, rows, cols, cols}, protected_tail, rule, layer_row, {ws, bytes},
                                            m.options());
    if (st.ok())
      st = kvevict::cuda::fold_layer_scores(layer_row, sequence_row, cols, protected_tail, rule, l, num_layers,
                                            m.options());
  }
  r.combined.st = m.finish(st);
  r.combined.row = m.get(sequence_row, static_cast<std::size_t>(cols));
  if (!st.ok()) return r;
  auto* offsets = m.alloc<std::int64_t>(static_cast<std::size_t>(heads + 1));
  const std::size_t cap = static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1));
  auto* indices = m.alloc<std::int64_t>(cap);
  m.fill(offsets, static_cast<std::size_t>(heads + 1), std::int64_t{-7});
  m.fill(indices, cap, std::int64_t{-7});
  const std::size_t sbytes = kvevict::cuda::select_shared_workspace_size();
  void* sws = m.alloc_bytes(sbytes);
  r.keep.st = m.finish(kvevict::cuda::select_shared({sequence_row, 1, cols, cols}, b, params,
                                                    {heads, offsets, indices, capacity}, {sws, sbytes}, m.options()));
  r.keep.offsets = m.get(offsets, static_cast<std::size_t>(heads + 1));
  r.keep.indices = m.get(indices, static_cast<std::size_t>(std::max<std::int64_t>(capacity, 0)));
  r.keep.flags = m.read_flags();
  return r;
}

status fold_layer_scores_call(std::int64_t tokens, std::int64_t protected_tail, kvevict::scope_combine rule,
                              std::int64_t layer, std::int64_t num_layers, bool null_rows) {
  mirror m;
  const std::size_t n = static_cast<std::size_t>(std::max<std::int64_t>(tokens, 1));
  float* a = null_rows ? nullptr : m.alloc<float>(n);
  float* b = null_rows ? nullptr : m.alloc<float>(n);
  return m.finish(kvevict::cuda::fold_layer_scores(a, b, tokens, protected_tail, rule, layer, num_layers, m.options()));
}

keep_result select_shared(const std::vector<float>& row, std::int64_t rows, kvevict::budget b,
                          const kvevict::selection_params& params, std::int64_t heads, std::int64_t capacity) {
  keep_result r;
  mirror m;
  const float* drow = m.put_vector(row);
  if (drow == nullptr) drow = m.alloc<float>(1);
  const auto cols = static_cast<std::int64_t>(row.size());
  const std::size_t h1 = static_cast<std::size_t>(std::max<std::int64_t>(heads + 1, 1));
  auto* offsets = m.alloc<std::int64_t>(h1);
  const std::size_t cap = static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1));
  auto* indices = m.alloc<std::int64_t>(cap);
  m.fill(offsets, h1, std::int64_t{-7});
  m.fill(indices, cap, std::int64_t{-7});
  const std::size_t bytes = kvevict::cuda::select_shared_workspace_size();
  void* ws = m.alloc_bytes(bytes);
  r.st = m.finish(kvevict::cuda::select_shared({drow, rows, cols, cols}, b, params, {heads, offsets, indices, capacity},
                                               {ws, bytes}, m.options()));
  r.offsets = m.get(offsets, h1);
  r.indices = m.get(indices, static_cast<std::size_t>(std::max<std::int64_t>(capacity, 0)));
  r.flags = m.read_flags();
  return r;
}

rows_result select_rows(const std::vector<row_spec>& rows, std::int64_t max_length, bool wide) {
  rows_result r;
  mirror m;
  std::vector<kvevict::cuda::select_row> desc(rows.size());
  std::vector<std::int64_t*> outs(rows.size());
  std::vector<std::size_t> sizes(rows.size());
  for (std::size_t i = 0; i < rows.size(); ++i) {
    const row_spec& s = rows[i];
    kvevict::cuda::select_row& d = desc[i];
    d.scores = m.put_vector(s.scores);
    d.length = s.length >= 0 ? s.length : static_cast<std::int64_t>(s.scores.size());
    d.budget = s.budget;
    d.protected_tail = s.protected_tail;
    d.mode = s.mode;
    sizes[i] = s.scores.size() + 1;
    outs[i] = m.alloc<std::int64_t>(sizes[i]);
    m.fill(outs[i], sizes[i], std::int64_t{-7});
    d.out = outs[i];
  }
  auto* ddesc = m.put_vector(desc);
  const auto n = static_cast<std::int64_t>(rows.size());
  if (wide) {
    const std::size_t bytes = kvevict::cuda::select_rows_wide_workspace_size(n);
    r.st = m.finish(kvevict::cuda::select_rows_wide(ddesc, n, max_length, {m.alloc_bytes(bytes), bytes}, m.options()));
  } else {
    r.st = m.finish(kvevict::cuda::select_rows(ddesc, n, max_length, m.options()));
  }
  for (std::size_t i = 0; i < rows.size(); ++i) r.out.push_back(m.get(outs[i], sizes[i]));
  r.flags = m.read_flags();
  return r;
}

namespace {
/// compact_blocks' inputs attached to `out` as device copies, and its outputs allocated and
/// filled (changed blocks 77, freed blocks -7) so that unwritten entries show.
void attach_blocks(mirror& m, const compact_blocks& blocks, std::int64_t heads, kvevict::cuda::compact_outputs* out) {
  out->block_refcounts = m.put_vector(blocks.refcounts);
  out->shared_blocks = m.put_vector(blocks.shared_bits);
  out->shared_check =
      blocks.every_used_block ? kvevict::cuda::shared_block_check::used : kvevict::cuda::shared_block_check::written;
  const auto n = static_cast<std::size_t>(blocks.changed_entries) + 1;
  if (blocks.changed) {
    out->changed_blocks = m.alloc<std::int32_t>(n);
    m.fill(out->changed_blocks, n, std::int32_t{77});
  }
  if (blocks.freed) {
    out->head_freed_blocks = m.alloc<std::int64_t>(static_cast<std::size_t>(heads));
    m.fill(out->head_freed_blocks, static_cast<std::size_t>(heads), std::int64_t{-7});
  }
}

/// The block outputs attach_blocks allocated, copied back.
template <class R>
void read_blocks(mirror& m, const compact_blocks& blocks, std::int64_t heads, const kvevict::cuda::compact_outputs& out,
                 R* r) {
  if (blocks.changed)
    r->changed_blocks = m.get(out.changed_blocks, static_cast<std::size_t>(blocks.changed_entries) + 1);
  if (blocks.freed) r->head_freed_blocks = m.get(out.head_freed_blocks, static_cast<std::size_t>(heads));
}
}  // namespace

template <class KT, class VT>
compact_result compact(const kvevict::cache_view<KT>& k, host_buffer kbuf, const std::vector<std::int32_t>& ktable,
                       const kvevict::cache_view<VT>& v, host_buffer vbuf, const std::vector<std::int32_t>& vtable,
                       const std::vector<std::int64_t>& offsets, const std::vector<std::int64_t>& indices,
                       std::int64_t capacity, const std::vector<std::int64_t>& key_positions,
                       const compact_blocks& blocks) {
  compact_result r;
  mirror m;
  const auto dk = device_view(m, k, kbuf, ktable);
  const auto dv = device_view(m, v, vbuf, vtable);
  auto* doff = m.put_vector(offsets);
  std::vector<std::int64_t> idx = indices;
  idx.resize(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)), 0);
  auto* didx = m.put_vector(idx);
  auto* lengths = m.alloc<std::int64_t>(static_cast<std::size_t>(k.num_heads));
  auto* positions = m.alloc<std::int64_t>(idx.size());
  m.fill(lengths, static_cast<std::size_t>(k.num_heads), std::int64_t{-7});
  m.fill(positions, idx.size(), std::int64_t{-7});
  kvevict::cuda::compact_outputs out;
  out.head_lengths = lengths;
  out.positions = positions;
  out.key_positions = m.put_vector(key_positions);
  attach_blocks(m, blocks, k.num_heads, &out);
  const std::size_t bytes = kvevict::cuda::compact_workspace_size(dk, dv, capacity);
  void* ws = m.alloc_bytes(bytes);
  const kvevict::const_keep_list_view keep{k.num_heads, doff, didx, capacity};
  r.st = m.finish(kvevict::cuda::compact(dk, dv, keep, {ws, bytes}, out, m.options()));
  auto* kd = static_cast<const unsigned char*>(m.put(kbuf));
  auto* vd = static_cast<const unsigned char*>(m.put(vbuf));
  r.keys = m.get(kd, kbuf.bytes);
  r.values = m.get(vd, vbuf.bytes);
  r.head_lengths = m.get(lengths, static_cast<std::size_t>(k.num_heads));
  r.positions = m.get(positions, idx.size());
  read_blocks(m, blocks, k.num_heads, out, &r);
  r.flags = m.read_flags();
  return r;
}

template <class KT, class VT>
compact_batch_result compact_batch(const std::vector<batch_compaction<KT, VT>>& seqs, std::size_t workspace_bytes,
                                   std::size_t misalign) {
  compact_batch_result r;
  mirror m;
  static const std::vector<std::int32_t> no_table;
  const auto table = [](const auto& s) -> const std::vector<std::int32_t>& {
    return s.table != nullptr ? *s.table : no_table;
  };
  const auto n = static_cast<std::int64_t>(seqs.size());
  std::vector<kvevict::cuda::compaction_sequence<KT, VT>> desc(seqs.size());
  std::vector<std::int64_t*> lengths(seqs.size()), positions(seqs.size());
  std::int64_t max_capacity = 0;
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const batch_compaction<KT, VT>& b = seqs[i];
    kvevict::cuda::compaction_sequence<KT, VT>& d = desc[i];
    d.keys = device_view(m, b.k.view, b.k.buf, table(b.k));
    d.values = device_view(m, b.v.view, b.v.buf, table(b.v));
    std::vector<std::int64_t> idx = b.indices;
    idx.resize(static_cast<std::size_t>(std::max<std::int64_t>(b.capacity, 1)), 0);
    d.keep = {b.k.view.num_heads, m.fresh_copy(b.offsets), m.fresh_copy(idx), b.capacity};
    lengths[i] = m.alloc<std::int64_t>(static_cast<std::size_t>(b.k.view.num_heads));
    positions[i] = m.alloc<std::int64_t>(idx.size());
    m.fill(lengths[i], static_cast<std::size_t>(b.k.view.num_heads), std::int64_t{-7});
    m.fill(positions[i], idx.size(), std::int64_t{-7});
    d.out.head_lengths = lengths[i];
    d.out.positions = positions[i];
    d.out.key_positions = m.fresh_copy(b.key_positions);
    max_capacity = std::max(max_capacity, b.capacity);
  }
  const std::size_t need =
      n > 0 ? kvevict::cuda::compact_batch_workspace_size(desc[0].keys, desc[0].values, n, max_capacity) : 0;
  const std::size_t bytes = workspace_bytes == SIZE_MAX ? need : workspace_bytes;
  void* ws = static_cast<unsigned char*>(m.alloc_bytes(bytes + misalign)) + misalign;
  const std::size_t staging_bytes = kvevict::cuda::compact_batch_staging_size(n);
  void* staging = nullptr;
  if (cudaMallocHost(&staging, std::max<std::size_t>(staging_bytes, 1)) != cudaSuccess) {
    r.st = kvevict::status::error(errc::unsupported, "gpu::compact_batch", "staging", "cudaMallocHost failed");
    return r;
  }
  r.st = m.finish(kvevict::cuda::compact_batch(desc.data(), n, {ws, bytes}, staging, staging_bytes, m.options()));
  cudaFreeHost(staging);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const batch_compaction<KT, VT>& b = seqs[i];
    r.keys.push_back(m.get(static_cast<const unsigned char*>(m.put(b.k.buf)), b.k.buf.bytes));
    r.values.push_back(m.get(static_cast<const unsigned char*>(m.put(b.v.buf)), b.v.buf.bytes));
    r.head_lengths.push_back(m.get(lengths[i], static_cast<std::size_t>(b.k.view.num_heads)));
    r.positions.push_back(m.get(positions[i], static_cast<std::size_t>(std::max<std::int64_t>(b.capacity, 1))));
  }
  r.flags = m.read_flags();
  return r;
}

compact_batch_result compact_into_batch_bf16(
    const std::vector<batch_compaction_into<kvevict::bf16, kvevict::bf16>>& seqs) {
  using T = kvevict::bf16;
  compact_batch_result r;
  mirror m;
  const auto n = static_cast<std::int64_t>(seqs.size());
  std::vector<kvevict::cuda::compaction_into_sequence<T, T>> desc(seqs.size());
  std::vector<std::int64_t*> lengths(seqs.size()), positions(seqs.size());
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const auto& b = seqs[i];
    auto& d = desc[i];
    d.src_keys = device_view(m, b.src_k.view, b.src_k.buf, *b.src_k.table);
    d.src_values = device_view(m, b.src_v.view, b.src_v.buf, *b.src_v.table);
    d.dst_keys = device_view(m, b.dst_k.view, b.dst_k.buf, *b.dst_k.table);
    d.dst_values = device_view(m, b.dst_v.view, b.dst_v.buf, *b.dst_v.table);
    std::vector<std::int64_t> idx = b.indices;
    idx.resize(static_cast<std::size_t>(std::max<std::int64_t>(b.capacity, 1)), 0);
    const std::int64_t heads = b.src_k.view.num_heads;
    d.keep = {heads, m.fresh_copy(b.offsets), m.fresh_copy(idx), b.capacity};
    lengths[i] = m.alloc<std::int64_t>(static_cast<std::size_t>(heads));
    positions[i] = m.alloc<std::int64_t>(idx.size());
    m.fill(lengths[i], static_cast<std::size_t>(heads), std::int64_t{-7});
    m.fill(positions[i], idx.size(), std::int64_t{-7});
    d.out.head_lengths = lengths[i];
    d.out.positions = positions[i];
    d.out.key_positions = m.fresh_copy(b.key_positions);
  }
  const std::size_t bytes = n > 0 ? kvevict::cuda::compact_into_batch_workspace_size<T, T>(
                                        desc[0].src_keys, desc[0].src_values, desc[0].dst_keys, desc[0].dst_values, n)
                                  : 0;
  void* ws = m.alloc_bytes(bytes);
  const std::size_t staging_bytes = kvevict::cuda::compact_into_batch_staging_size(n);
  void* staging = nullptr;
  if (cudaMallocHost(&staging, std::max<std::size_t>(staging_bytes, 1)) != cudaSuccess) {
    r.st = kvevict::status::error(errc::unsupported, "gpu::compact_into_batch", "staging", "cudaMallocHost failed");
    return r;
  }
  r.st = m.finish(kvevict::cuda::compact_into_batch(desc.data(), n, {ws, bytes}, staging, staging_bytes, m.options()));
  cudaFreeHost(staging);
  for (std::size_t i = 0; i < seqs.size(); ++i) {
    const auto& b = seqs[i];
    r.keys.push_back(m.get(static_cast<const unsigned char*>(m.put(b.dst_k.buf)), b.dst_k.buf.bytes));
    r.values.push_back(m.get(static_cast<const unsigned char*>(m.put(b.dst_v.buf)), b.dst_v.buf.bytes));
    r.head_lengths.push_back(m.get(lengths[i], static_cast<std::size_t>(b.src_k.view.num_heads)));
    r.positions.push_back(m.get(positions[i], static_cast<std::size_t>(std::max<std::int64_t>(b.capacity, 1))));
  }
  r.flags = m.read_flags();
  return r;
}

template <class KT, class VT>
compact_into_result compact_into(const side<KT>& src_k, const side<VT>& src_v, const side<KT>& dst_k,
                                 const side<VT>& dst_v, const std::vector<std::int64_t>& offsets,
                                 const std::vector<std::int64_t>& indices, std::int64_t capacity,
                                 const std::vector<std::int64_t>& key_positions, const compact_blocks& blocks) {
  compact_into_result r;
  mirror m;
  static const std::vector<std::int32_t> no_table;
  const auto table = [](const auto& s) -> const std::vector<std::int32_t>& {
    return s.table != nullptr ? *s.table : no_table;
  };
  const kvevict::cache_view<const KT> sk = device_view(m, src_k.view, src_k.buf, table(src_k));
  const kvevict::cache_view<const VT> sv = device_view(m, src_v.view, src_v.buf, table(src_v));
  const auto dk = device_view(m, dst_k.view, dst_k.buf, table(dst_k));
  const auto dv = device_view(m, dst_v.view, dst_v.buf, table(dst_v));
  auto* doff = m.put_vector(offsets);
  std::vector<std::int64_t> idx = indices;
  idx.resize(static_cast<std::size_t>(std::max<std::int64_t>(capacity, 1)), 0);
  auto* didx = m.put_vector(idx);
  auto* lengths = m.alloc<std::int64_t>(static_cast<std::size_t>(src_k.view.num_heads));
  auto* positions = m.alloc<std::int64_t>(idx.size());
  m.fill(lengths, static_cast<std::size_t>(src_k.view.num_heads), std::int64_t{-7});
  m.fill(positions, idx.size(), std::int64_t{-7});
  kvevict::cuda::compact_outputs out;
  out.head_lengths = lengths;
  out.positions = positions;
  out.key_positions = m.put_vector(key_positions);
  attach_blocks(m, blocks, src_k.view.num_heads, &out);
  const std::size_t bytes = kvevict::cuda::compact_into_workspace_size(sk, sv, dk, dv);
  void* ws = m.alloc_bytes(bytes);
  const kvevict::const_keep_list_view keep{src_k.view.num_heads, doff, didx, capacity};
  r.st = m.finish(kvevict::cuda::compact_into(sk, sv, dk, dv, keep, {ws, bytes}, out, m.options()));
  std::vector<unsigned char>* outs[4] = {&r.src_keys, &r.src_values, &r.dst_keys, &r.dst_values};
  const host_buffer bufs[4] = {src_k.buf, src_v.buf, dst_k.buf, dst_v.buf};
  for (int i = 0; i < 4; ++i) *outs[i] = m.get(static_cast<const unsigned char*>(m.put(bufs[i])), bufs[i].bytes);
  r.head_lengths = m.get(lengths, static_cast<std::size_t>(src_k.view.num_heads));
  r.positions = m.get(positions, idx.size());
  read_blocks(m, blocks, src_k.view.num_heads, out, &r);
  r.flags = m.read_flags();
  return r;
}

status observation_with_host_keys() {
  mirror m;
  std::vector<float> host_keys(2 * 8 * 16, 1.0f);
  std::vector<float> qh(4 * 2 * 16, 1.0f);
  std::vector<std::int64_t> pos{6, 7};
  auto q = kvevict::contiguous_queries<const float>(m.put_vector(qh), 4, 2, 16, m.put_vector(pos));
  auto k = kvevict::hf_contiguous<const float>(host_keys.data(), 2, 8, 16);
  float* scores = m.alloc<float>(16);
  kvevict::scoring_params p;
  const std::size_t bytes = kvevict::cuda::observation_scores_workspace_size({4, 2, 16, 8, 2}, p);
  void* ws = m.alloc_bytes(bytes);
  return m.finish(kvevict::cuda::observation_scores(q, k, p, {scores, 2, 8, 8}, {ws, bytes}, {}, m.options()));
}

status observation_with_small_workspace() {
  mirror m;
  std::vector<float> kh(2 * 8 * 16, 1.0f), qh(4 * 2 * 16, 1.0f);
  std::vector<std::int64_t> pos{6, 7};
  auto q = kvevict::contiguous_queries<const float>(m.put_vector(qh), 4, 2, 16, m.put_vector(pos));
  auto k = kvevict::hf_contiguous<const float>(m.put_vector(kh), 2, 8, 16);
  float* scores = m.alloc<float>(16);
  kvevict::scoring_params p;
  const std::size_t bytes = kvevict::cuda::observation_scores_workspace_size({4, 2, 16, 8, 2}, p);
  void* ws = m.alloc_bytes(bytes);
  return m.finish(kvevict::cuda::observation_scores(q, k, p, {scores, 2, 8, 8}, {ws, bytes / 2}, {}, m.options()));
}

status compact_with_aliased_kv() {
  mirror m;
  std::vector<float> kh(2 * 8 * 16, 1.0f);
  float* d = m.put_vector(kh);
  auto k = kvevict::hf_contiguous(d, 2, 8, 16);
  std::vector<std::int64_t> off{0, 1, 2}, idx{3, 4};
  const kvevict::const_keep_list_view keep{2, m.put_vector(off), m.put_vector(idx), 2};
  const std::size_t bytes = kvevict::cuda::compact_workspace_size(k, k, 2);
  void* ws = m.alloc_bytes(bytes);
  return m.finish(kvevict::cuda::compact(k, k, keep, {ws, bytes}, {}, m.options()));
}

status select_with_small_capacity() {
  mirror m;
  std::vector<float> s(3 * 50, 1.0f);
  auto* off = m.alloc<std::int64_t>(4);
  auto* idx = m.alloc<std::int64_t>(20);
  const std::size_t bytes = kvevict::cuda::select_workspace_size(3);
  void* ws = m.alloc_bytes(bytes);
  return m.finish(kvevict::cuda::select({m.put_vector(s), 3, 50, 50}, kvevict::budget::tokens(10), {},
                                        {3, off, idx, 20}, {ws, bytes}, m.options()));
}

status decode_plan_unplanned_run() {
  mirror m;
  const kvevict::cuda::decode_plan<float, float> plan;
  return m.finish(plan.run(m.options().stream));
}

status decode_with_two_queries() {
  mirror m;
  std::vector<float> kh(2 * 8 * 16, 1.0f), qh(4 * 2 * 16, 1.0f), st(16, 0.0f);
  std::vector<std::int64_t> pos{6, 7};
  auto q = kvevict::contiguous_queries<const float>(m.put_vector(qh), 4, 2, 16, m.put_vector(pos));
  auto k = kvevict::hf_contiguous<const float>(m.put_vector(kh), 2, 8, 16);
  return m.finish(kvevict::cuda::decode_observation(q, k, {}, {m.put_vector(st), 2, 8, 8}, {}, {}, m.options()));
}

// The combinations the tests use.
#define KVEVICT_GPU_OBS(QT, KT)                                                                                     \
  template batch_result observation_scores_batch<QT, KT>(const std::vector<batch_sequence<QT, KT>>&,                \
                                                         const kvevict::scoring_params&);                           \
  template scores_result observation_scores<QT, KT>(                                                                \
      const kvevict::query_view<const QT>&, host_buffer, const kvevict::cache_view<const KT>&, host_buffer,         \
      const std::vector<std::int32_t>&, const kvevict::scoring_params&, const obs_inputs&);                         \
  template state_result observation_state<QT, KT>(const kvevict::query_view<const QT>&, host_buffer,                \
                                                  const kvevict::cache_view<const KT>&, host_buffer,                \
                                                  const std::vector<std::int32_t>&, const kvevict::scoring_params&, \
                                                  float, const std::vector<float>&, const obs_inputs&);             \
  template state_result decode_observation<QT, KT>(                                                                 \
      const kvevict::query_view<const QT>&, host_buffer, const kvevict::cache_view<const KT>&, host_buffer,         \
      const std::vector<std::int32_t>&, const decode_step&, const std::vector<float>&);                             \
  template plan_result decode_plan_steps<QT, KT>(const kvevict::query_view<const QT>&, host_buffer,                 \
                                                 const kvevict::cache_view<const KT>&, host_buffer,                 \
                                                 const std::vector<std::int32_t>&, const decode_step&,              \
                                                 const std::vector<std::int32_t>&, const std::vector<float>&, bool);
KVEVICT_GPU_OBS(float, float)
KVEVICT_GPU_OBS(kvevict::fp16, kvevict::fp16)
KVEVICT_GPU_OBS(kvevict::bf16, kvevict::bf16)
KVEVICT_GPU_OBS(float, kvevict::bf16)
KVEVICT_GPU_OBS(kvevict::bf16, kvevict::fp8_e4m3)
KVEVICT_GPU_OBS(kvevict::fp16, kvevict::fp8_e5m2)
#undef KVEVICT_GPU_OBS

template rerotate_result dapq_rerotate<float>(const kvevict::query_view<const float>&, host_buffer,
                                              const kvevict::rope_config&, std::int64_t);
template rerotate_result dapq_rerotate<kvevict::fp16>(const kvevict::query_view<const kvevict::fp16>&, host_buffer,
                                                      const kvevict::rope_config&, std::int64_t);
template rerotate_result dapq_rerotate<kvevict::bf16>(const kvevict::query_view<const kvevict::bf16>&, host_buffer,
                                                      const kvevict::rope_config&, std::int64_t);
template scores_result key_scores<float>(const kvevict::cache_view<const float>&, host_buffer,
                                         const std::vector<std::int32_t>&, key_scorer_kind, std::int64_t);
template scores_result key_scores<kvevict::fp16>(const kvevict::cache_view<const kvevict::fp16>&, host_buffer,
                                                 const std::vector<std::int32_t>&, key_scorer_kind, std::int64_t);
template scores_result key_scores<kvevict::bf16>(const kvevict::cache_view<const kvevict::bf16>&, host_buffer,
                                                 const std::vector<std::int32_t>&, key_scorer_kind, std::int64_t);
template scores_result key_scores<kvevict::fp8_e5m2>(const kvevict::cache_view<const kvevict::fp8_e5m2>&, host_buffer,
                                                     const std::vector<std::int32_t>&, key_scorer_kind, std::int64_t);

#define KVEVICT_GPU_COMPACT(KT, VT)                                                                                  \
  template compact_into_result compact_into<KT, VT>(                                                                 \
      const side<KT>&, const side<VT>&, const side<KT>&, const side<VT>&, const std::vector<std::int64_t>&,          \
      const std::vector<std::int64_t>&, std::int64_t, const std::vector<std::int64_t>&, const compact_blocks&);      \
  template compact_result compact<KT, VT>(                                                                           \
      const kvevict::cache_view<KT>&, host_buffer, const std::vector<std::int32_t>&, const kvevict::cache_view<VT>&, \
      host_buffer, const std::vector<std::int32_t>&, const std::vector<std::int64_t>&,                               \
      const std::vector<std::int64_t>&, std::int64_t, const std::vector<std::int64_t>&, const compact_blocks&);
KVEVICT_GPU_COMPACT(float, float)
template compact_batch_result compact_batch<kvevict::bf16, kvevict::bf16>(
    const std::vector<batch_compaction<kvevict::bf16, kvevict::bf16>>&, std::size_t, std::size_t);
template compact_batch_result compact_batch<float, kvevict::fp8_e4m3>(
    const std::vector<batch_compaction<float, kvevict::fp8_e4m3>>&, std::size_t, std::size_t);
KVEVICT_GPU_COMPACT(kvevict::fp16, kvevict::fp16)
KVEVICT_GPU_COMPACT(kvevict::bf16, kvevict::bf16)
KVEVICT_GPU_COMPACT(kvevict::bf16, float)
KVEVICT_GPU_COMPACT(kvevict::fp8_e4m3, kvevict::fp8_e4m3)
KVEVICT_GPU_COMPACT(kvevict::fp8_e5m2, kvevict::bf16)
#undef KVEVICT_GPU_COMPACT

}  // namespace gpu
