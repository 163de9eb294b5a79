// GPU side of the compressor tests (see compressor_runner.hpp).
#include "compressor_runner.hpp"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "device_mirror.hpp"
#include "kvevict/cuda/compressor.cuh"

namespace gpu {

kvevict::status compressor_plan(const kvevict::compressor_options& options) {
  kvevict::cuda::compressor c;
  return kvevict::cuda::compressor::plan(options, &c);
}

template <class T, class Q>
compressor_session_result compressor_session(const kvevict::compressor_options& options,
                                             const std::vector<compressor_call<T, Q>>& calls, int num_states) {
  compressor_session_result r;
  kvevict::cuda::compressor c;
  r.plan = kvevict::cuda::compressor::plan(options, &c);
  if (!r.plan.ok()) return r;
  r.keep_capacity = c.keep_capacity();
  r.keep_capacity_per_head = c.keep_capacity_per_head();
  const std::int64_t heads = c.options().model.num_kv_heads;

  mirror session;  // what outlives the calls: the workspace and the sequences' states
  const kvevict::workspace_span ws{session.alloc_bytes(c.workspace_size()), c.workspace_size()};
  if (ws.data != nullptr) cudaMemset(ws.data, 0xff, ws.size);
  void* staging = nullptr;
  if (cudaMallocHost(&staging, std::max<std::size_t>(c.staging_size(), 1)) != cudaSuccess) {
    r.plan = status::error(errc::unsupported, "gpu::compressor_session", "staging", "cudaMallocHost failed");
    return r;
  }
  std::vector<void*> states(static_cast<std::size_t>(num_states));
  std::vector<std::vector<std::uint64_t>> host_states(static_cast<std::size_t>(num_states));
  for (std::size_t i = 0; i < states.size(); ++i) {
    states[i] = c.sequence_state_size() > 0 ? session.alloc_bytes(c.sequence_state_size()) : nullptr;
    if (states[i] != nullptr) cudaMemset(states[i], 0xff, c.sequence_state_size());
    host_states[i].assign(c.host_state_size() / 8 + 1, 0);
    const status reset = c.reset_sequence(host_states[i].data(), host_states[i].size() * 8);
    if (!reset.ok()) r.plan = reset;
  }
  static const std::vector<std::int32_t> no_table;
  const auto table = [](const auto& s) -> const std::vector<std::int32_t>& {
    return s.table != nullptr ? *s.table : no_table;
  };

  for (const compressor_call<T, Q>& call : calls) {
    compressor_call_result cr;
    mirror m;
    const std::size_t n = call.seqs.size();
    std::vector<kvevict::cuda::sequence_io<T, Q>> ios(n);
    std::vector<std::int64_t*> lengths(n, nullptr), kept(n, nullptr), padded(n, nullptr), freed(n, nullptr);
    std::vector<std::int32_t*> changed(n, nullptr);
    std::vector<std::vector<kvevict::layer_cache<T>>> layer_caches(n);
    const auto changed_size = static_cast<std::size_t>(c.changed_blocks_capacity());
    const auto cap = static_cast<std::size_t>(std::max<std::int64_t>(c.keep_capacity(), 1));
    const auto padded_size = static_cast<std::size_t>(heads * std::max<std::int64_t>(c.keep_capacity_per_head(), 1));
    for (std::size_t s = 0; s < n; ++s) {
      const compressor_sequence<T, Q>& q = call.seqs[s];
      kvevict::cuda::sequence_io<T, Q>& io = ios[s];
      io.event = q.event;
      // The caches live on the device for the whole session (an engine's), so that every
      // call sees what the earlier ones did to them.
      io.keys = device_view(session, q.k.view, q.k.buf, table(q.k));
      io.values = device_view(session, q.v.view, q.v.buf, table(q.v));
      if (q.dst_k.view.data != nullptr) {
        io.dst_keys = device_view(session, q.dst_k.view, q.dst_k.buf, table(q.dst_k));
        io.dst_values = device_view(session, q.dst_v.view, q.dst_v.buf, table(q.dst_v));
      }
      if (q.qbuf.data != nullptr) io.queries = device_queries(m, q.queries, q.qbuf);
      if (!q.key_positions.empty()) io.key_positions = m.fresh_copy(q.key_positions);
      io.lse = m.fresh_copy(q.lse);
      io.lse_head_stride = q.lse_head_stride;
      io.block_refcounts = m.fresh_copy(q.block_refcounts);
      io.shared_blocks = q.raw_shared_blocks != nullptr ? q.raw_shared_blocks : m.fresh_copy(q.shared_blocks);
      if (q.block_outputs) {
        changed[s] = m.alloc<std::int32_t>(changed_size);
        freed[s] = m.alloc<std::int64_t>(static_cast<std::size_t>(heads));
        m.fill(changed[s], changed_size, std::int32_t{77});
        m.fill(freed[s], static_cast<std::size_t>(heads), std::int64_t{-7});
        io.changed_blocks = changed[s];
        io.head_freed_blocks = freed[s];
      }
      for (const layer_sides<T>& l : q.layers) {
        kvevict::layer_cache<T> lc(device_view(session, l.k.view, l.k.buf, table(l.k)),
                                   device_view(session, l.v.view, l.v.buf, table(l.v)));
        if (l.dst_k.view.data != nullptr) {
          lc.dst_keys = device_view(session, l.dst_k.view, l.dst_k.buf, table(l.dst_k));
          lc.dst_values = device_view(session, l.dst_v.view, l.dst_v.buf, table(l.dst_v));
        }
        lc.block_refcounts = l.block_refcounts.empty() ? io.block_refcounts : m.fresh_copy(l.block_refcounts);
        lc.shared_blocks = io.shared_blocks;
        layer_caches[s].push_back(lc);
      }
      if (!q.layers.empty()) io.layers = layer_caches[s].data();
      if (q.state >= 0) {
        io.state = states[static_cast<std::size_t>(q.state)];
        io.host_state = host_states[static_cast<std::size_t>(q.state)].data();
      }
      if (q.raw_state != nullptr) io.state = q.raw_state;
      if (q.outputs) {
        lengths[s] = m.alloc<std::int64_t>(static_cast<std::size_t>(heads));
        kept[s] = m.alloc<std::int64_t>(cap);
        padded[s] = m.alloc<std::int64_t>(padded_size);
        m.fill(lengths[s], static_cast<std::size_t>(heads), std::int64_t{-7});
        m.fill(kept[s], cap, std::int64_t{-7});
        m.fill(padded[s], padded_size, std::int64_t{-7});
        io.head_lengths = lengths[s];
        io.kept_positions = kept[s];
        io.padded_indices = padded[s];
      }
    }
    cr.reports.assign(n, kvevict::sequence_report{});
    for (kvevict::sequence_report& rep : cr.reports) rep.length = -9;  // unwritten reports show up
    cr.st = m.finish(c.run(call.layer, ios.data(), static_cast<std::int64_t>(n), cr.reports.data(), ws, staging,
                           c.staging_size(), m.options()));
    for (std::size_t s = 0; s < n; ++s) {
      const compressor_sequence<T, Q>& q = call.seqs[s];
      compressor_sequence_result out;
      const auto back = [&session](const host_buffer& b) {
        return b.data == nullptr ? std::vector<unsigned char>{}
                                 : session.get(static_cast<const unsigned char*>(session.put(b)), b.bytes);
      };
      out.keys = back(q.k.buf);
      out.values = back(q.v.buf);
      out.dst_keys = back(q.dst_k.buf);
      out.dst_values = back(q.dst_v.buf);
      for (const layer_sides<T>& l : q.layers) {
        out.layer_keys.push_back(back(l.k.buf));
        out.layer_values.push_back(back(l.v.buf));
        out.layer_dst_keys.push_back(back(l.dst_k.buf));
        out.layer_dst_values.push_back(back(l.dst_v.buf));
      }
      if (q.outputs) {
        out.head_lengths = m.get(lengths[s], static_cast<std::size_t>(heads));
        out.kept_positions = m.get(kept[s], cap);
        out.padded = m.get(padded[s], padded_size);
      }
      if (q.block_outputs) {
        out.changed_blocks = m.get(changed[s], changed_size);
        out.head_freed_blocks = m.get(freed[s], static_cast<std::size_t>(heads));
      }
      cr.seqs.push_back(std::move(out));
    }
    for (void* st : states)
      cr.states.push_back(st == nullptr ? std::vector<unsigned char>{}
                                        : m.get(static_cast<const unsigned char*>(st), c.sequence_state_size()));
    cr.flags = m.read_flags();
    r.calls.push_back(std::move(cr));
  }
  cudaFreeHost(staging);
  return r;
}

template compressor_session_result compressor_session<kvevict::bf16, kvevict::bf16>(
    const kvevict::compressor_options&, const std::vector<compressor_call<kvevict::bf16, kvevict::bf16>>&, int);
template compressor_session_result compressor_session<float, float>(const kvevict::compressor_options&,
                                                                    const std::vector<compressor_call<float, float>>&,
                                                                    int);
template compressor_session_result compressor_session<kvevict::fp8_e4m3, kvevict::bf16>(
    const kvevict::compressor_options&, const std::vector<compressor_call<kvevict::fp8_e4m3, kvevict::bf16>>&, int);
template compressor_session_result compressor_session<kvevict::fp16, kvevict::fp16>(
    const kvevict::compressor_options&, const std::vector<compressor_call<kvevict::fp16, kvevict::fp16>>&, int);
template compressor_session_result compressor_session<kvevict::fp8_e5m2, kvevict::fp16>(
    const kvevict::compressor_options&, const std::vector<compressor_call<kvevict::fp8_e5m2, kvevict::fp16>>&, int);

}  // namespace gpu
