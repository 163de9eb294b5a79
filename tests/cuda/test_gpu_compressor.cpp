// kvevict::cuda::compressor against kvevict::compressor: the same model, options and calls
// (every layer of a batch of sequences with ragged prompts, an idle sequence, DeferKV's decode
// steps), compared call for call -- reports, the device outputs (head lengths, kept positions,
// padded indices) and every cache buffer afterwards -- and its refusals, which must leave
// every cache, state, output and report as it was.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include "compressor_runner.hpp"
#include "kvevict/compressor/compressor.hpp"
#include "kvevict/scoring/presets.hpp"
#include "parallel/thread_group.hpp"
#include "shared_pool.hpp"
#include "support/test_cache.hpp"

using kvevict::bf16;
using kvevict::fp8_e4m3;

namespace {

constexpr std::int64_t kLayers = 2, kHq = 4, kHkv = 2, kDim = 40, kValueDim = 24;

/// The model and the sequences of a scenario; options.policy and the budgets vary.
kvevict::compressor_options base_options(kvevict::dtype storage, kvevict::dtype queries) {
  kvevict::compressor_options o;
  o.model = {kLayers, kHq, kHkv, kDim, kValueDim, storage, queries};
  kvevict::window_config w = kvevict::presets::kvpress_snapkv();
  w.window = 6;
  o.policy = kvevict::policy::snapkv(w);
  o.per_head = kvevict::budget::tokens(20);
  o.limits.max_sequences = 4;
  o.limits.max_tokens = 80;
  o.limits.max_pool_blocks = 64;
  // The sequences of a layer share a pool but never a block (no prefix caching).
  o.sharing = kvevict::block_sharing::none;
  return o;
}

/// Caches, queries and the calls of one scenario: every layer at prefill_end, then `steps`
/// decode steps of every layer. Sequence 1 is idle throughout. Paged: the sequences of a layer
/// share a K pool (vLLM NHD) and a V pool (FlashInfer HND); otherwise each has its own
/// contiguous K and transposed V. Out of place: destinations of the same kinds.
template <class T, class Q>
struct scenario {
  kvevict::compressor_options options;
  bool paged = true;
  std::vector<std::int64_t> prompts{61, 0, 37, 16};
  /// Sequence 3 starts a step late: its prefill_end shares a batch with the others' first
  /// decode step, and their calls after eviction (decode steps that do nothing) share one with
  /// its last.
  std::vector<std::int64_t> offsets{0, 0, 0, 1};
  std::int64_t steps = 0;
  std::vector<gpu::shared_pool<T>> kpools, vpools, dkpools, dvpools;  // [layer]
  std::vector<test::test_cache<T>> own_k, own_v, own_dk, own_dv;      // [layer * seqs + s]
  std::vector<test::test_queries<Q>> queries;                         // [(layer * seqs + s) * (1 + steps) + k]
  std::vector<gpu::compressor_call<T, Q>> calls;

  std::size_t seqs() const { return prompts.size(); }
  std::size_t at(std::int64_t layer, std::size_t s) const { return static_cast<std::size_t>(layer) * seqs() + s; }
  bool out_of_place() const { return options.compact == kvevict::compaction::out_of_place; }
  bool idle(std::size_t s) const { return prompts[s] == 0; }

  scenario(const kvevict::compressor_options& o, bool paged_caches, std::int64_t decode_steps, std::uint64_t seed,
           bool engine_lse = false, std::vector<std::int64_t> prompt_lengths = {61, 0, 37, 16},
           std::vector<std::int64_t> start_offsets = {0, 0, 0, 1}, std::int64_t window_rows = 9)
      : options(o),
        paged(paged_caches),
        prompts(std::move(prompt_lengths)),
        offsets(std::move(start_offsets)),
        steps(decode_steps) {
    std::vector<std::int64_t> lengths;
    for (std::int64_t p : prompts) lengths.push_back(std::max<std::int64_t>(p + steps, 1));
    for (std::int64_t l = 0; l < kLayers; ++l) {
      const std::uint64_t ls = seed + 1000 * static_cast<std::uint64_t>(l);
      if (paged) {
        kpools.emplace_back(test::layout::paged_nhd, kHkv, lengths, kDim, ls);
        vpools.emplace_back(test::layout::paged_hnd, kHkv, lengths, kValueDim, ls + 10);
        if (out_of_place()) {  // fresh blocks: destinations pools of their own
          dkpools.emplace_back(test::layout::paged_nhd, kHkv, lengths, kDim, ls + 20);
          dvpools.emplace_back(test::layout::paged_hnd, kHkv, lengths, kValueDim, ls + 30);
        }
      }
      for (std::size_t s = 0; s < seqs(); ++s) {
        const std::int64_t n = lengths[s];
        const std::uint64_t ss = ls + 100 * (s + 1);
        const auto dense = [&](std::int64_t dim, std::uint64_t sd) {
          return test::normal(static_cast<std::size_t>(kHkv * n * dim), sd);
        };
        own_k.push_back(test::make_cache<T>(test::layout::contiguous, kHkv, n, kDim, dense(kDim, ss)));
        own_v.push_back(test::make_cache<T>(test::layout::transposed, kHkv, n, kValueDim, dense(kValueDim, ss + 1)));
        own_dk.push_back(test::make_cache<T>(test::layout::contiguous, kHkv, n, kDim, dense(kDim, ss + 2)));
        own_dv.push_back(test::make_cache<T>(test::layout::transposed, kHkv, n, kValueDim, dense(kValueDim, ss + 3)));
        // More rows than the window (the last are used); H2O's scenarios hand every prompt query.
        const std::int64_t w = std::min<std::int64_t>(prompts[s], window_rows);
        std::vector<std::int64_t> pos;
        for (std::int64_t t = 0; t < w; ++t) pos.push_back(prompts[s] - w + t);
        queries.push_back(
            test::make_queries<Q>(kHq, std::max<std::int64_t>(w, 1), kDim,
                                  test::normal(static_cast<std::size_t>(kHq * window_rows * kDim), ss + 4, 2.0),
                                  pos.empty() ? std::vector<std::int64_t>{0} : pos));
        for (std::int64_t k = 1; k <= steps; ++k)
          queries.push_back(test::make_queries<Q>(kHq, 1, kDim,
                                                  test::normal(static_cast<std::size_t>(kHq * kDim), ss + 10 + k, 2.0),
                                                  {prompts[s] + k - 1}));
      }
    }
    const bool defer = options.policy.kind() == kvevict::policy_kind::deferkv;
    for (std::int64_t step = 0; step <= steps + 1; ++step)
      for (std::int64_t l = 0; l < kLayers; ++l) {
        gpu::compressor_call<T, Q> call;
        call.layer = l;
        for (std::size_t s = 0; s < seqs(); ++s) {
          gpu::compressor_sequence<T, Q> q;
          const std::int64_t k = std::min(step - offsets[s], steps);  // past `steps`: a decode after eviction
          if (!idle(s) && k >= 0) {
            const std::int64_t n = prompts[s] + k;
            q.event = step == offsets[s] ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
            q.k = kside(l, s, n);
            q.v = vside(l, s, n);
            if (out_of_place()) {
              q.dst_k = dside(l, s, true);
              q.dst_v = dside(l, s, false);
            }
            if (options.scope == kvevict::selection_scope::per_sequence)  // every layer's caches
              for (std::int64_t l2 = 0; l2 < kLayers; ++l2) {
                gpu::layer_sides<T> ls{kside(l2, s, n), vside(l2, s, n), {}, {}, {}};
                if (out_of_place()) {
                  ls.dst_k = dside(l2, s, true);
                  ls.dst_v = dside(l2, s, false);
                }
                q.layers.push_back(ls);
              }
            const test::test_queries<Q>& tq =
                queries[at(l, s) * static_cast<std::size_t>(1 + steps) + static_cast<std::size_t>(k)];
            q.queries = tq.view;
            q.qbuf = gpu::buffer_of(tq.buffer);
            if (s == 2 && prompts[s] == 37)  // unsorted, spaced positions (llama.cpp cells after a shift)
              for (std::int64_t j = 0; j < n; ++j) q.key_positions.push_back(3 * ((j * 7) % n) + 1);
            if (engine_lse && step == offsets[s]) {  // rows W' + 2 apart: the last window rows must be picked
              const std::int64_t rows = tq.view.num_queries, stride = rows + 2;
              for (std::int64_t h = 0; h < kHq; ++h)
                for (std::int64_t t = 0; t < stride; ++t)
                  q.lse.push_back(3.0f + 0.25f * static_cast<float>(h) + 0.125f * static_cast<float>(t % 5));
              q.lse_head_stride = stride;
            }
          }
          q.state = defer || options.scope == kvevict::selection_scope::per_sequence ? static_cast<int>(s) : -1;
          call.seqs.push_back(q);
        }
        calls.push_back(call);
      }
  }

  gpu::side<T> kside(std::int64_t l, std::size_t s, std::int64_t n) {
    if (paged) return kpools[static_cast<std::size_t>(l)].side(s, n);
    test::test_cache<T>& c = own_k[at(l, s)];
    gpu::side<T> out{c.view, gpu::buffer_of(c.buffer), &c.table};
    out.view.num_tokens = n;
    return out;
  }
  gpu::side<T> vside(std::int64_t l, std::size_t s, std::int64_t n) {
    if (paged) return vpools[static_cast<std::size_t>(l)].side(s, n);
    test::test_cache<T>& c = own_v[at(l, s)];
    gpu::side<T> out{c.view, gpu::buffer_of(c.buffer), &c.table};
    out.view.num_tokens = n;
    return out;
  }
  gpu::side<T> dside(std::int64_t l, std::size_t s, bool keys) {
    const std::int64_t n = std::max<std::int64_t>(prompts[s] + steps, 1);
    if (paged) return (keys ? dkpools : dvpools)[static_cast<std::size_t>(l)].side(s, n);
    test::test_cache<T>& c = (keys ? own_dk : own_dv)[at(l, s)];
    return gpu::side<T>{c.view, gpu::buffer_of(c.buffer), &c.table};
  }
};

template <class T>
void require_bytes(const std::vector<unsigned char>& got, const gpu::host_buffer& want) {
  REQUIRE(got.size() == want.bytes);
  REQUIRE(std::memcmp(got.data(), want.data, want.bytes) == 0);
}

/// The CPU compressor's inputs for a call of the GPU session: the host views, the sequences'
/// states (`states`, by slot) and, for the per-sequence scope, their layers' caches (held in
/// `layers`); no outputs.
template <class T, class Q>
void cpu_inputs(const gpu::compressor_call<T, Q>& call, std::vector<std::vector<std::uint64_t>>* states,
                std::vector<std::vector<kvevict::layer_cache<T>>>* layers, kvevict::sequence_io<T, Q>* io) {
  for (std::size_t s = 0; s < call.seqs.size(); ++s) {
    const gpu::compressor_sequence<T, Q>& q = call.seqs[s];
    io[s].event = q.event;
    io[s].keys = q.k.view;
    io[s].values = q.v.view;
    io[s].dst_keys = q.dst_k.view;
    io[s].dst_values = q.dst_v.view;
    io[s].queries = q.queries;
    io[s].key_positions = q.key_positions.empty() ? kvevict::index_ptr(nullptr) : q.key_positions.data();
    io[s].lse = q.lse.empty() ? nullptr : q.lse.data();
    io[s].lse_head_stride = q.lse_head_stride;
    io[s].state = q.state >= 0 ? (*states)[static_cast<std::size_t>(q.state)].data() : nullptr;
    io[s].block_refcounts = q.block_refcounts.empty() ? nullptr : q.block_refcounts.data();
    io[s].shared_blocks = q.shared_blocks.empty() ? nullptr : q.shared_blocks.data();
    for (const gpu::layer_sides<T>& l : q.layers) {
      kvevict::layer_cache<T> c(l.k.view, l.v.view);
      c.dst_keys = l.dst_k.view;
      c.dst_values = l.dst_v.view;
      c.block_refcounts = l.block_refcounts.empty() ? io[s].block_refcounts : l.block_refcounts.data();
      c.shared_blocks = io[s].shared_blocks;
      (*layers)[s].push_back(c);
    }
    if (!q.layers.empty()) io[s].layers = (*layers)[s].data();
  }
}

/// Runs the scenario on the GPU (device copies), then on the CPU over the host caches, call
/// by call, and compares.
template <class T, class Q>
void check_against_cpu(scenario<T, Q>& sc, std::int64_t expected_evictions = -1) {
  const gpu::compressor_session_result g = gpu::compressor_session<T, Q>(sc.options, sc.calls, 4);
  INFO(g.plan.message());
  REQUIRE(g.plan.ok());
  REQUIRE(g.calls.size() == sc.calls.size());

  kvevict::compressor cpu;
  REQUIRE(kvevict::compressor::plan(sc.options, &cpu).ok());
  REQUIRE(cpu.keep_capacity() == g.keep_capacity);
  REQUIRE(cpu.keep_capacity_per_head() == g.keep_capacity_per_head);
  kvevict::workspace ws(cpu.workspace_size());
  std::vector<std::vector<std::uint64_t>> states(sc.seqs());
  for (auto& st : states) {
    st.assign(cpu.sequence_state_size() / 8 + 1, 0);
    REQUIRE(cpu.reset_sequence(st.data(), st.size() * 8).ok());
  }
  const std::int64_t cap = cpu.keep_capacity(), head_cap = cpu.keep_capacity_per_head();
  const bool one_set = sc.options.scope == kvevict::selection_scope::per_sequence;
  std::int64_t evictions = 0;
  for (std::size_t i = 0; i < sc.calls.size(); ++i) {
    const gpu::compressor_call<T, Q>& call = sc.calls[i];
    const gpu::compressor_call_result& gc = g.calls[i];
    INFO("call " << i << " (layer " << call.layer << "): " << gc.st.message());
    REQUIRE(gc.st.ok());
    REQUIRE(gc.flags == 0u);
    const std::size_t n = call.seqs.size();
    std::vector<kvevict::sequence_io<T, Q>> io(n);
    std::vector<std::vector<std::int64_t>> lengths(n, std::vector<std::int64_t>(kHkv, -7)),
        kept(n, std::vector<std::int64_t>(static_cast<std::size_t>(cap), -7)),
        padded(n, std::vector<std::int64_t>(static_cast<std::size_t>(kHkv * head_cap), -7)),
        freed(n, std::vector<std::int64_t>(kHkv, -7));
    std::vector<std::vector<std::int32_t>> changed(
        n, std::vector<std::int32_t>(static_cast<std::size_t>(cpu.changed_blocks_capacity()), 77));
    std::vector<std::vector<kvevict::layer_cache<T>>> layers(n);
    cpu_inputs(call, &states, &layers, io.data());
    for (std::size_t s = 0; s < n; ++s) {
      io[s].head_lengths = lengths[s].data();
      io[s].kept_positions = kept[s].data();
      io[s].padded_indices = padded[s].data();
      if (call.seqs[s].block_outputs) {
        io[s].changed_blocks = changed[s].data();
        io[s].head_freed_blocks = freed[s].data();
      }
    }
    std::vector<kvevict::sequence_report> reports(n);
    const kvevict::status st = cpu.run(call.layer, io.data(), static_cast<std::int64_t>(n), reports.data(), ws);
    INFO(st.message());
    REQUIRE(st.ok());
    for (std::size_t s = 0; s < n; ++s) {
      INFO("seqs[" << s << "]");
      const kvevict::sequence_report &c = reports[s], &r = gc.reports[s];
      REQUIRE(r.action == c.action);
      // The positions are device data, but DapQ's resumption point (the prompt's length) is the
      // host's (at its prompt's compression, not at a decode-time one).
      const bool resumes = sc.options.policy.kind() == kvevict::policy_kind::dapq &&
                           c.action == kvevict::sequence_action::evicted &&
                           call.seqs[s].event == kvevict::sequence_event::prefill_end;
      REQUIRE(r.next_position == (resumes ? c.next_position : -1));
      const gpu::compressor_sequence_result& out = gc.seqs[s];
      if (c.action != kvevict::sequence_action::evicted) {
        REQUIRE(r.length == c.length);
        for (std::int64_t x : out.head_lengths) REQUIRE(x == -7);
        for (std::int64_t x : out.padded) REQUIRE(x == -7);
        continue;
      }
      ++evictions;
      if (sc.options.heads == kvevict::head_allocation::adakv && !one_set) {  // on the device only
        REQUIRE(r.length == -1);
        REQUIRE(r.kept == -1);
        REQUIRE(*std::max_element(out.head_lengths.begin(), out.head_lengths.end()) == c.length);
        std::int64_t total = 0;
        for (std::int64_t x : out.head_lengths) total += x;
        REQUIRE(total == c.kept);
      } else {
        REQUIRE(r.kept == c.kept);
        REQUIRE(r.length == c.length);
        REQUIRE(r.next_slot == c.next_slot);
        REQUIRE(r.dropped == c.dropped);
        REQUIRE(r.freed_blocks == c.freed_blocks);
      }
      REQUIRE(out.head_lengths == lengths[s]);
      REQUIRE(out.kept_positions == kept[s]);  // the kept entries, then -7 (untouched) past them
      REQUIRE(out.padded == padded[s]);
      if (call.seqs[s].block_outputs) {  // the device's list ends at its first -1
        // (keep-lists only: nothing moves, the host knows the list is empty)
        REQUIRE(r.num_changed_blocks ==
                (sc.options.compact == kvevict::compaction::keep_list_only ? c.num_changed_blocks : -1));
        for (std::int64_t b = 0; b < c.num_changed_blocks; ++b)
          REQUIRE(out.changed_blocks[static_cast<std::size_t>(b)] == changed[s][static_cast<std::size_t>(b)]);
        REQUIRE(out.changed_blocks[static_cast<std::size_t>(c.num_changed_blocks)] == -1);
        REQUIRE(out.head_freed_blocks == freed[s]);
      }
    }
    // Every buffer the call saw, as the CPU left it.
    for (std::size_t s = 0; s < n; ++s) {
      const gpu::compressor_sequence<T, Q>& q = call.seqs[s];
      if (q.k.buf.data == nullptr) continue;
      require_bytes<T>(gc.seqs[s].keys, q.k.buf);
      require_bytes<T>(gc.seqs[s].values, q.v.buf);
      if (q.dst_k.buf.data != nullptr) {
        require_bytes<T>(gc.seqs[s].dst_keys, q.dst_k.buf);
        require_bytes<T>(gc.seqs[s].dst_values, q.dst_v.buf);
      }
      for (std::size_t l = 0; l < q.layers.size(); ++l) {  // the per-sequence scope: every layer
        require_bytes<T>(gc.seqs[s].layer_keys[l], q.layers[l].k.buf);
        require_bytes<T>(gc.seqs[s].layer_values[l], q.layers[l].v.buf);
        if (q.layers[l].dst_k.buf.data != nullptr) {
          require_bytes<T>(gc.seqs[s].layer_dst_keys[l], q.layers[l].dst_k.buf);
          require_bytes<T>(gc.seqs[s].layer_dst_values[l], q.layers[l].dst_v.buf);
        }
      }
    }
  }
  // Every layer of the three active sequences, once; one keep set per sequence: at its last layer.
  REQUIRE(evictions == (expected_evictions >= 0 ? expected_evictions : (one_set ? 1 : kLayers) * 3));
}

kvevict::compressor_options deferkv_options(kvevict::dtype storage, kvevict::dtype queries, std::int64_t delay) {
  kvevict::compressor_options o = base_options(storage, queries);
  kvevict::deferkv_config d;
  d.window = 5;
  d.delay = delay;
  d.eta = 0.8;
  o.policy = kvevict::policy::deferkv(d);
  return o;
}

/// The CPU compressor over `calls` in order, from fresh states: the first refusal (its call in
/// *at), or ok.
template <class T, class Q>
kvevict::status cpu_calls(const kvevict::compressor_options& o, const std::vector<gpu::compressor_call<T, Q>>& calls,
                          std::size_t* at) {
  kvevict::compressor cpu;
  REQUIRE(kvevict::compressor::plan(o, &cpu).ok());
  kvevict::workspace ws(cpu.workspace_size());
  std::vector<std::vector<std::uint64_t>> states(4);
  for (auto& st : states) {
    st.assign(cpu.sequence_state_size() / 8 + 1, 0);
    REQUIRE(cpu.reset_sequence(st.data(), st.size() * 8).ok());
  }
  for (*at = 0; *at < calls.size(); ++*at) {
    const gpu::compressor_call<T, Q>& call = calls[*at];
    std::vector<kvevict::sequence_io<T, Q>> io(call.seqs.size());
    std::vector<std::vector<kvevict::layer_cache<T>>> layers(io.size());
    cpu_inputs(call, &states, &layers, io.data());
    std::vector<kvevict::sequence_report> reports(io.size());
    const kvevict::status st = cpu.run(call.layer, io.data(), static_cast<std::int64_t>(io.size()), reports.data(), ws);
    if (!st.ok()) return st;
  }
  return kvevict::status();
}

/// Rows [from, to) of a call's queries.
template <class Q>
kvevict::query_view<const Q> query_rows(kvevict::query_view<const Q> v, std::int64_t from, std::int64_t to) {
  v.data += from * v.query_stride;
  v.positions = v.positions + from;
  v.num_queries = to - from;
  return v;
}

/// The scenario's prompts handed in chunks (compressor_options::chunked_prefill; the scenario
/// hands every prompt query): cuts[s] split sequence s's prompt queries at those rows, each
/// chunk a prefill_chunk call of every layer, round by round, before the first step; its
/// prefill_end hands the rows after the last cut. Every active sequence keeps a state.
template <class T, class Q>
void chunk_prompts(scenario<T, Q>& sc, const std::vector<std::vector<std::int64_t>>& cuts) {
  std::size_t rounds = 0;
  for (const auto& c : cuts) rounds = std::max(rounds, c.size());
  std::vector<gpu::compressor_call<T, Q>> chunks;
  for (std::size_t r = 0; r < rounds; ++r)
    for (std::int64_t l = 0; l < kLayers; ++l) {
      gpu::compressor_call<T, Q> call;
      call.layer = l;
      for (std::size_t s = 0; s < sc.seqs(); ++s) {
        gpu::compressor_sequence<T, Q> q;
        if (r < cuts[s].size())
          for (const gpu::compressor_call<T, Q>& c : sc.calls)
            if (c.layer == l && c.seqs[s].event == kvevict::sequence_event::prefill_end) {
              q = c.seqs[s];  // the prompt's cache so far: the chunk reads only its queries
              q.event = kvevict::sequence_event::prefill_chunk;
              q.lse.clear();
              q.lse_head_stride = 0;
              q.queries = query_rows(q.queries, r == 0 ? 0 : cuts[s][r - 1], cuts[s][r]);
            }
        q.state = static_cast<int>(s);
        call.seqs.push_back(q);
      }
      chunks.push_back(call);
    }
  for (gpu::compressor_call<T, Q>& c : sc.calls)
    for (std::size_t s = 0; s < sc.seqs(); ++s) {
      gpu::compressor_sequence<T, Q>& q = c.seqs[s];
      q.state = static_cast<int>(s);
      if (q.event == kvevict::sequence_event::prefill_end && !cuts[s].empty())
        q.queries = query_rows(q.queries, cuts[s].back(), q.queries.num_queries);
    }
  sc.calls.insert(sc.calls.begin(), chunks.begin(), chunks.end());
}

}  // namespace

TEST_CASE("GPU compressor: SnapKV equals kvevict::compressor, call for call", "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  SECTION("bf16, shared paged pools, uniform budget, in place") {
    scenario<bf16, bf16> sc(base_options(dtype::bf16, dtype::bf16), true, 0, 11);
    check_against_cpu(sc);
  }
  SECTION("bf16, shared paged pools, PyramidKV layers and AdaKV heads, ratio budget, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.per_head = kvevict::budget::ratio(0.4);
    o.heads = kvevict::head_allocation::adakv;
    o.layers = kvevict::layer_allocation::pyramidkv;
    scenario<bf16, bf16> sc(o, true, 0, 12);
    check_against_cpu(sc);
  }
  SECTION("float, own strided caches, one keep set per layer, keep-list only") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    o.scope = kvevict::selection_scope::per_layer;
    o.combine = kvevict::scope_combine::normalized_mean;
    o.compact = kvevict::compaction::keep_list_only;
    o.lengths = kvevict::length_mode::uniform;
    scenario<float, float> sc(o, false, 0, 13);
    check_against_cpu(sc);
  }
  SECTION("bf16, own strided caches, the engine's log-sum-exp (one pass), rows a stride apart") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.per_head = kvevict::budget::ratio(0.3);
    scenario<bf16, bf16> sc(o, false, 0, 15, true);
    check_against_cpu(sc);
  }
  SECTION("fp8 e4m3 keys and values, bf16 queries, into fresh paged blocks") {
    kvevict::compressor_options o = base_options(dtype::f8_e4m3, dtype::bf16);
    o.compact = kvevict::compaction::out_of_place;
    o.per_head = kvevict::budget::tokens(12);
    scenario<fp8_e4m3, bf16> sc(o, true, 0, 14);
    check_against_cpu(sc);
  }
}

namespace {
/// block_sharing::marked: every active sequence marks its pools' blocks (no block shared:
/// references of 1; sequence 2 by an empty bitmap) and asks for the changed and freed blocks.
template <class T, class Q>
void mark_blocks(scenario<T, Q>& sc) {
  for (auto& c : sc.calls)
    for (std::size_t s = 0; s < c.seqs.size(); ++s) {
      auto& q = c.seqs[s];
      if (q.k.buf.data == nullptr) continue;
      const std::int64_t pool = std::max(std::max(q.k.view.num_pool_blocks, q.v.view.num_pool_blocks),
                                         std::max(q.dst_k.view.num_pool_blocks, q.dst_v.view.num_pool_blocks));
      if (s == 2) {
        q.shared_blocks.assign(static_cast<std::size_t>((pool + 31) / 32), 0u);
      } else {
        q.block_refcounts.assign(static_cast<std::size_t>(pool), 1);
      }
      q.block_outputs = true;
    }
}
}  // namespace

TEST_CASE("GPU compressor: prefix-shared block marks, changed blocks and freed blocks as kvevict::compressor",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  SECTION("SnapKV, bf16, shared paged pools, block_sharing::marked, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.sharing = kvevict::block_sharing::marked;
    scenario<bf16, bf16> sc(o, true, 0, 43);
    mark_blocks(sc);
    check_against_cpu(sc);
  }
  SECTION("DeferKV delay 1, float, shared paged pools, AdaKV, block_sharing::marked, in place") {
    kvevict::compressor_options o = deferkv_options(dtype::f32, dtype::f32, 1);
    o.heads = kvevict::head_allocation::adakv;
    o.sharing = kvevict::block_sharing::marked;
    scenario<float, float> sc(o, true, 1, 44);
    mark_blocks(sc);
    check_against_cpu(sc);
  }
  SECTION("SnapKV, bf16, shared paged pools, PyramidKV, block_sharing::marked, into fresh paged blocks") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.per_head = kvevict::budget::ratio(0.4);
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.sharing = kvevict::block_sharing::marked;
    o.compact = kvevict::compaction::out_of_place;
    scenario<bf16, bf16> sc(o, true, 0, 46);
    mark_blocks(sc);
    check_against_cpu(sc);
  }
  SECTION("KNorm, bf16, shared paged pools, keep-lists only: the freed blocks and an empty changed list") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.policy = kvevict::policy::knorm();
    o.per_head = kvevict::budget::ratio(0.3);
    o.compact = kvevict::compaction::keep_list_only;
    scenario<bf16, bf16> sc(o, true, 0, 47);
    mark_blocks(sc);
    check_against_cpu(sc);
  }
  SECTION("DeferKV delay 1, float, own strided caches, one keep set for every layer, keep-lists only") {
    kvevict::compressor_options o = deferkv_options(dtype::f32, dtype::f32, 1);
    o.scope = kvevict::selection_scope::per_sequence;
    o.compact = kvevict::compaction::keep_list_only;
    scenario<float, float> sc(o, false, 1, 48);
    mark_blocks(sc);
    check_against_cpu(sc);
  }
  SECTION("a marked block is refused on the device, where the CPU refuses the call") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.sharing = kvevict::block_sharing::marked;
    scenario<bf16, bf16> sc(o, true, 0, 45);
    mark_blocks(sc);
    std::vector<gpu::compressor_call<bf16, bf16>> calls{sc.calls[0]};  // layer 0 at prefill_end
    gpu::compressor_call<bf16, bf16>& c = calls[0];
    REQUIRE(c.seqs[0].event == kvevict::sequence_event::prefill_end);
    c.seqs[0].block_refcounts[static_cast<std::size_t>(c.seqs[0].k.view.block_table[1])] = 2;  // prefix-shared
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
    REQUIRE(g.plan.ok());
    INFO(g.calls[0].st.message());
    REQUIRE(g.calls[0].st.ok());  // the host cannot read the block tables: the device refuses
    REQUIRE(g.calls[0].flags == kvevict::cuda::flag_shared_block);
    for (std::size_t s = 0; s < c.seqs.size(); ++s) {  // the layer's compaction moved nothing
      if (c.seqs[s].k.buf.data == nullptr) continue;
      require_bytes<bf16>(g.calls[0].seqs[s].keys, c.seqs[s].k.buf);
      require_bytes<bf16>(g.calls[0].seqs[s].values, c.seqs[s].v.buf);
      for (std::int64_t x : g.calls[0].seqs[s].head_lengths) REQUIRE(x == -7);
      for (std::int32_t x : g.calls[0].seqs[s].changed_blocks) REQUIRE(x == 77);
      for (std::int64_t x : g.calls[0].seqs[s].head_freed_blocks) REQUIRE(x == -7);
    }
    // The CPU compressor refuses the same call by name.
    kvevict::compressor cpu;
    REQUIRE(kvevict::compressor::plan(o, &cpu).ok());
    kvevict::workspace ws(cpu.workspace_size());
    std::vector<kvevict::sequence_io<bf16, bf16>> io(c.seqs.size());
    for (std::size_t s = 0; s < c.seqs.size(); ++s) {
      io[s].event = c.seqs[s].event;
      io[s].keys = c.seqs[s].k.view;
      io[s].values = c.seqs[s].v.view;
      io[s].queries = c.seqs[s].queries;
      io[s].block_refcounts = c.seqs[s].block_refcounts.empty() ? nullptr : c.seqs[s].block_refcounts.data();
      io[s].shared_blocks = c.seqs[s].shared_blocks.empty() ? nullptr : c.seqs[s].shared_blocks.data();
    }
    std::vector<kvevict::sequence_report> reports(c.seqs.size());
    const kvevict::status st = cpu.run(0, io.data(), static_cast<std::int64_t>(io.size()), reports.data(), ws);
    INFO(st.message());
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()).rfind("seqs[0].keys.block_table[", 0) == 0);
  }
}

TEST_CASE("GPU compressor: H2O, DapQ, TOVA, KNorm, KeyDiff, StreamingLLM, ChunkKV equal the CPU's, call for call",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  // H2O observes every prompt query (the scenarios hand them all); KNorm and StreamingLLM read
  // none (the queries are handed as an engine would).
  SECTION("H2O, bf16, shared paged pools, a recent window of 4, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::h2o_config h;
    h.recent_window = 4;
    o.policy = kvevict::policy::h2o(h);
    scenario<bf16, bf16> sc(o, true, 0, 26, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    check_against_cpu(sc);
  }
  SECTION(
      "H2O, float, own strided caches, the engine's log-sum-exp, AdaKVPress's rule, ratio budget, into fresh memory") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    o.policy = kvevict::policy::h2o();
    o.per_head = kvevict::budget::ratio(0.35);
    o.heads = kvevict::head_allocation::adakv;
    o.adakv.rule = kvevict::adakv_rule::kvpress_safeguard;  // kvpress's AdaKVPress rule
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 0, 27, true, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    check_against_cpu(sc);
  }
  SECTION("KNorm, bf16, shared paged pools, a protected tail inside the budget, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::knorm_config k;
    k.protected_tail = 3;
    o.policy = kvevict::policy::knorm(k);
    scenario<bf16, bf16> sc(o, true, 0, 21);
    check_against_cpu(sc);
  }
  SECTION(
      "KNorm, fp8 e4m3 (scaled), bf16 queries, PyramidKV and normalised AdaKV, tail on top, into fresh paged blocks") {
    kvevict::compressor_options o = base_options(dtype::f8_e4m3, dtype::bf16);
    kvevict::knorm_config k;
    k.protected_tail = 2;
    k.protect = kvevict::protected_mode::on_top_of_budget;
    o.policy = kvevict::policy::knorm(k);
    o.per_head = kvevict::budget::ratio(0.4);
    o.heads = kvevict::head_allocation::adakv;
    o.adakv.normalize = true;  // the paper rule's per-head normalisation
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<fp8_e4m3, bf16> sc(o, true, 0, 22);
    for (auto& c : sc.calls)
      for (auto& q : c.seqs) q.k.view.scale = 0.75f;  // the norms are of scale * k
    check_against_cpu(sc);
  }
  SECTION("KNorm, float, own strided caches, one keep set per layer, keep-list only") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    o.policy = kvevict::policy::knorm();
    o.scope = kvevict::selection_scope::per_layer;
    o.combine = kvevict::scope_combine::normalized_mean;
    o.compact = kvevict::compaction::keep_list_only;
    o.lengths = kvevict::length_mode::uniform;
    scenario<float, float> sc(o, false, 0, 23);
    check_against_cpu(sc);
  }
  SECTION("KeyDiff, bf16, shared paged pools, a protected tail inside the budget, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::keydiff_config k;
    k.protected_tail = 3;
    o.policy = kvevict::policy::keydiff(k);
    scenario<bf16, bf16> sc(o, true, 0, 37);
    check_against_cpu(sc);
  }
  SECTION(
      "ChunkKV on KeyDiff, fp8 e4m3 (scaled), bf16 queries, chunks of 3, PyramidKV and AdaKVPress's rule, "
      "into fresh paged blocks") {
    kvevict::compressor_options o = base_options(dtype::f8_e4m3, dtype::bf16);
    kvevict::keydiff_config k;
    k.protected_tail = 2;
    k.protect = kvevict::protected_mode::on_top_of_budget;
    o.policy = kvevict::policy::keydiff(k).chunked(3);
    o.per_head = kvevict::budget::ratio(0.4);
    o.heads = kvevict::head_allocation::adakv;
    o.adakv.rule = kvevict::adakv_rule::kvpress_safeguard;
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<fp8_e4m3, bf16> sc(o, true, 0, 38);
    for (auto& c : sc.calls)
      for (auto& q : c.seqs) q.k.view.scale = 0.75f;  // no cosine changes under it
    check_against_cpu(sc);
  }
  SECTION("KeyDiff, float, own strided caches, one keep set per layer, keep-list only") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    o.policy = kvevict::policy::keydiff();
    o.scope = kvevict::selection_scope::per_layer;
    o.compact = kvevict::compaction::keep_list_only;
    scenario<float, float> sc(o, false, 0, 39);
    check_against_cpu(sc);
  }
  // DapQ: each prompt is the prompt and its N = 6 pseudo tokens; the last 6 of the 9 query rows
  // are the pseudo tokens' (positions past the prompt). They are scored over the prompt before
  // them, and every pseudo row is dropped.
  SECTION("DapQ pseudo tokens, bf16, shared paged pools, N 6, uniform budget, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    o.policy = kvevict::policy::dapq(d);
    scenario<bf16, bf16> sc(o, true, 0, 31);
    check_against_cpu(sc);
  }
  SECTION("DapQ pseudo tokens, float, own strided caches, N 6, a protected tail, AdaKV, into fresh memory") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    d.scoring.protected_tail = 2;
    o.policy = kvevict::policy::dapq(d);
    o.per_head = kvevict::budget::ratio(0.4);
    o.heads = kvevict::head_allocation::adakv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 0, 32);
    check_against_cpu(sc);
  }
  // DapQ's re-rotated window: the cache is the prompt; its last N = 6 queries (of the 9 rows)
  // are moved 6 positions on with the model's RoPE on the device, as the CPU moves them.
  SECTION("DapQ re-rotated window, bf16, shared paged pools, GPT-J pairs over 24 of 40 dims, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    d.source = kvevict::dapq_source::rerotated_window;
    d.rope.head_dim = kDim;
    d.rope.rotary_dim = 24;
    d.rope.pairing = kvevict::rope_pairing::gptj;
    o.policy = kvevict::policy::dapq(d);
    scenario<bf16, bf16> sc(o, true, 0, 33);
    check_against_cpu(sc);
  }
  SECTION("DapQ re-rotated window, float, own strided caches, Llama-3 scaling, PyramidKV, into fresh memory") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    d.source = kvevict::dapq_source::rerotated_window;
    d.rope.head_dim = kDim;
    d.rope.theta = 500000.0;
    d.rope.llama3.enabled = true;
    d.rope.llama3.original_max_position = 64.0;
    o.policy = kvevict::policy::dapq(d);
    o.per_head = kvevict::budget::ratio(0.4);
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 0, 34);
    check_against_cpu(sc);
  }
  // TOVA: the last prompt query's attention, averaged over every query head (the batched
  // scoring, then the mean across KV heads on the device).
  SECTION("TOVA, bf16, shared paged pools, uniform budget, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.policy = kvevict::policy::tova();
    scenario<bf16, bf16> sc(o, true, 0, 35);
    check_against_cpu(sc);
  }
  SECTION("TOVA, float, own strided caches, a tail of 3, PyramidKV and AdaKV, chunks of 4, into fresh memory") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    kvevict::tova_config t;
    t.protected_tail = 3;
    o.policy = kvevict::policy::tova(t).chunked(4);
    o.per_head = kvevict::budget::ratio(0.4);
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.heads = kvevict::head_allocation::adakv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 0, 36);
    check_against_cpu(sc);
  }
  SECTION("ChunkKV on SnapKV, bf16, shared paged pools, chunks of 5, uniform budget, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.policy = o.policy.chunked(5);
    scenario<bf16, bf16> sc(o, true, 0, 28);
    check_against_cpu(sc);
  }
  SECTION("ChunkKV on KNorm, float, own strided caches, chunks of 7, one keep set per layer, keep-list only") {
    kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
    kvevict::knorm_config k;
    k.protected_tail = 2;
    o.policy = kvevict::policy::knorm(k).chunked(7);
    o.scope = kvevict::selection_scope::per_layer;
    o.compact = kvevict::compaction::keep_list_only;
    scenario<float, float> sc(o, false, 0, 29);
    check_against_cpu(sc);
  }
  SECTION("ChunkKV on H2O, bf16, shared paged pools, chunks of 4, PyramidKV and AdaKV, ratio budget") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::h2o_config h;
    h.recent_window = 3;
    o.policy = kvevict::policy::h2o(h).chunked(4);
    o.per_head = kvevict::budget::ratio(0.45);
    o.heads = kvevict::head_allocation::adakv;
    o.layers = kvevict::layer_allocation::pyramidkv;
    scenario<bf16, bf16> sc(o, true, 0, 30, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    check_against_cpu(sc);
  }
  SECTION("StreamingLLM, bf16, shared paged pools, 4 sinks, uniform budget, in place") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.policy = kvevict::policy::streaming_llm();
    scenario<bf16, bf16> sc(o, true, 0, 24);
    check_against_cpu(sc);
  }
  SECTION("StreamingLLM, fp16, own strided caches, more sinks than a short prompt, ratio budget, PyramidKV") {
    kvevict::compressor_options o = base_options(dtype::f16, dtype::f16);
    kvevict::streaming_llm_config c;
    c.sinks = 20;  // sequence 3's prompt of 16 is all sinks
    o.policy = kvevict::policy::streaming_llm(c);
    o.per_head = kvevict::budget::ratio(0.5);
    o.layers = kvevict::layer_allocation::pyramidkv;
    scenario<kvevict::fp16, kvevict::fp16> sc(o, false, 0, 25);
    check_against_cpu(sc);
  }
}

TEST_CASE("GPU compressor: DeferKV observes prefill and decode steps, then evicts as the CPU does",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  SECTION("bf16, shared paged pools, delay 2, PyramidKV, in place") {
    kvevict::compressor_options o = deferkv_options(dtype::bf16, dtype::bf16, 2);
    o.layers = kvevict::layer_allocation::pyramidkv;
    scenario<bf16, bf16> sc(o, true, 2, 21);
    check_against_cpu(sc);
  }
  SECTION("float, own strided caches, delay 1, AdaKV, into fresh memory") {
    kvevict::compressor_options o = deferkv_options(dtype::f32, dtype::f32, 1);
    o.heads = kvevict::head_allocation::adakv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 1, 22);
    check_against_cpu(sc);
  }
  SECTION("float, shared paged pools, delay 3, uniform ratio budget, keep-lists only") {
    kvevict::compressor_options o = deferkv_options(dtype::f32, dtype::f32, 3);
    o.per_head = kvevict::budget::ratio(0.5);
    o.compact = kvevict::compaction::keep_list_only;
    scenario<float, float> sc(o, true, 3, 24);
    check_against_cpu(sc);
  }
  SECTION("fp8 keys, no decode feedback: evicted at the end of prefill, one keep set per layer") {
    kvevict::compressor_options o = deferkv_options(dtype::f8_e4m3, dtype::bf16, 1);
    o.policy.config<kvevict::deferkv_traits>().decode_feedback = false;
    o.scope = kvevict::selection_scope::per_layer;
    scenario<fp8_e4m3, bf16> sc(o, true, 0, 23);
    check_against_cpu(sc);
  }
}

// One keep set for every layer (llama.cpp-style cells): each layer's call folds its scores
// into the sequence's row on the device, the last layer's selects the set and compacts every
// layer's cache with it (each layer's pools its own batch, all or nothing across layers).
TEST_CASE("GPU compressor: one keep set for every layer (the per-sequence scope) equals the CPU's, call for call",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  const auto one_set = [](kvevict::compressor_options o, kvevict::scope_combine rule) {
    o.scope = kvevict::selection_scope::per_sequence;
    o.combine = rule;
    return o;
  };
  SECTION("SnapKV, bf16, shared paged pools, normalised mean, in place") {
    scenario<bf16, bf16> sc(one_set(base_options(dtype::bf16, dtype::bf16), kvevict::scope_combine::normalized_mean),
                            true, 0, 71);
    check_against_cpu(sc);
  }
  SECTION("DeferKV delay 2, float, own strided caches, raw max, AdaKV heads, into fresh memory") {
    kvevict::compressor_options o = one_set(deferkv_options(dtype::f32, dtype::f32, 2), kvevict::scope_combine::max);
    o.heads = kvevict::head_allocation::adakv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 3, 72);
    check_against_cpu(sc);
  }
  SECTION("ChunkKV on KNorm, fp16, own strided caches, chunks of 4, ratio budget, raw mean, keep-lists only") {
    kvevict::compressor_options o = one_set(base_options(dtype::f16, dtype::f16), kvevict::scope_combine::mean);
    o.policy = kvevict::policy::knorm().chunked(4);
    o.per_head = kvevict::budget::ratio(0.35);
    o.compact = kvevict::compaction::keep_list_only;
    scenario<kvevict::fp16, kvevict::fp16> sc(o, false, 0, 73);
    check_against_cpu(sc);
  }
  SECTION("DapQ pseudo tokens, bf16, shared paged pools, normalised max, block_sharing::marked, in place") {
    kvevict::compressor_options o =
        one_set(base_options(dtype::bf16, dtype::bf16), kvevict::scope_combine::normalized_max);
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    o.policy = kvevict::policy::dapq(d);
    o.sharing = kvevict::block_sharing::marked;
    scenario<bf16, bf16> sc(o, true, 0, 74);
    mark_blocks(sc);
    check_against_cpu(sc);
  }
  SECTION("TOVA, fp8 e4m3 keys and values, bf16 queries, shared paged pools, into fresh paged blocks") {
    kvevict::compressor_options o =
        one_set(base_options(dtype::f8_e4m3, dtype::bf16), kvevict::scope_combine::normalized_mean);
    o.policy = kvevict::policy::tova();
    o.compact = kvevict::compaction::out_of_place;
    scenario<fp8_e4m3, bf16> sc(o, true, 0, 75);
    check_against_cpu(sc);
  }
}

// Chunked prefill: every layer keeps the last queries of a sequence's prompt chunks in its
// device state (a ring), and prefill_end observes with those rows and its own -- the CPU's
// window. The cuts put the window across chunks, wrap the ring (sequence 2: 4 + 4 rows into a
// window of 6, then a chunk longer than it) and leave a last chunk holding the whole window
// (sequence 3 under H2O's cuts).
TEST_CASE("GPU compressor: chunked prefill observes with the CPU's window, call for call", "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  const std::vector<std::vector<std::int64_t>> wrapping{{25, 58}, {}, {4, 8, 35}, {4, 8, 15}};
  const auto chunked = [](kvevict::compressor_options o) {
    o.chunked_prefill = true;
    return o;
  };
  SECTION("SnapKV, bf16, shared paged pools, the engine's log-sum-exp, in place") {
    scenario<bf16, bf16> sc(chunked(base_options(dtype::bf16, dtype::bf16)), true, 0, 81, true, {61, 0, 37, 16},
                            {0, 0, 0, 1}, 80);
    chunk_prompts(sc, wrapping);
    check_against_cpu(sc);
  }
  SECTION("H2O, float, own strided caches, AdaKVPress's rule, into fresh memory") {
    kvevict::compressor_options o = chunked(base_options(dtype::f32, dtype::f32));
    o.policy = kvevict::policy::h2o();
    o.heads = kvevict::head_allocation::adakv;
    o.adakv.rule = kvevict::adakv_rule::kvpress_safeguard;
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 0, 82, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, {{25, 58}, {}, {15, 35}, {10}});
    check_against_cpu(sc);
  }
  SECTION("DeferKV delay 2, bf16, shared paged pools, PyramidKV, in place") {
    kvevict::compressor_options o = chunked(deferkv_options(dtype::bf16, dtype::bf16, 2));
    o.layers = kvevict::layer_allocation::pyramidkv;
    scenario<bf16, bf16> sc(o, true, 2, 83, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, wrapping);
    check_against_cpu(sc);
  }
  SECTION("SnapKV, one keep set for every layer, fp16, own strided caches, normalised mean, keep-lists only") {
    kvevict::compressor_options o = chunked(base_options(dtype::f16, dtype::f16));
    o.scope = kvevict::selection_scope::per_sequence;
    o.combine = kvevict::scope_combine::normalized_mean;
    o.compact = kvevict::compaction::keep_list_only;
    scenario<kvevict::fp16, kvevict::fp16> sc(o, false, 0, 84, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, wrapping);
    check_against_cpu(sc);
  }
  SECTION("DapQ re-rotated window, bf16, shared paged pools, in place") {
    kvevict::compressor_options o = chunked(base_options(dtype::bf16, dtype::bf16));
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    d.source = kvevict::dapq_source::rerotated_window;
    d.rope.head_dim = kDim;
    o.policy = kvevict::policy::dapq(d);
    scenario<bf16, bf16> sc(o, true, 0, 85, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, wrapping);
    check_against_cpu(sc);
  }
  SECTION("KNorm (reads no queries: the chunks do nothing), float, shared paged pools, in place") {
    kvevict::compressor_options o = chunked(base_options(dtype::f32, dtype::f32));
    o.policy = kvevict::policy::knorm();
    scenario<float, float> sc(o, true, 0, 86, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, wrapping);
    check_against_cpu(sc);
  }
}

namespace {

/// Nothing of call i's sequences written: their caches as the host made them, no output.
template <class T, class Q>
void require_untouched(const scenario<T, Q>& sc, const gpu::compressor_session_result& g, std::size_t i) {
  const gpu::compressor_call<T, Q>& call = sc.calls[i];
  for (std::size_t s = 0; s < call.seqs.size(); ++s) {
    const gpu::compressor_sequence<T, Q>& c = call.seqs[s];
    if (c.k.buf.data == nullptr) continue;
    require_bytes<T>(g.calls[i].seqs[s].keys, c.k.buf);
    require_bytes<T>(g.calls[i].seqs[s].values, c.v.buf);
    for (const auto* v :
         {&g.calls[i].seqs[s].head_lengths, &g.calls[i].seqs[s].kept_positions, &g.calls[i].seqs[s].padded})
      for (std::int64_t x : *v) REQUIRE(x == -7);
  }
}

}  // namespace

namespace {
/// Sequence s of a long generation's call at layer l: its views at n tokens, the step's queries
/// (k: 0 the prompt's window, else decode step k), its state slot.
template <class T, class Q>
gpu::compressor_sequence<T, Q> generation_sequence(scenario<T, Q>& sc, std::int64_t l, std::size_t s,
                                                   kvevict::sequence_event e, std::int64_t n, std::int64_t k) {
  gpu::compressor_sequence<T, Q> q;
  q.event = e;
  q.k = sc.kside(l, s, n);
  q.v = sc.vside(l, s, n);
  if (sc.out_of_place()) {
    q.dst_k = sc.dside(l, s, true);
    q.dst_v = sc.dside(l, s, false);
  }
  if (sc.options.scope == kvevict::selection_scope::per_sequence)
    for (std::int64_t l2 = 0; l2 < kLayers; ++l2)
      q.layers.push_back({sc.kside(l2, s, n), sc.vside(l2, s, n), {}, {}, {}});
  const test::test_queries<Q>& tq =
      sc.queries[sc.at(l, s) * static_cast<std::size_t>(1 + sc.steps) + static_cast<std::size_t>(k)];
  q.queries = tq.view;
  q.qbuf = gpu::buffer_of(tq.buffer);
  q.state = static_cast<int>(s);
  return q;
}

/// A long generation under decode-time budgets as `sc`'s calls: every sequence decodes
/// sc.steps tokens after its prompt (sequence 3 a step late, sequence 1 idle), and each call's
/// views hold the lengths the generation leaves, learned by running the CPU compressor on
/// `twin` (the same scenario). A decode step's token is what its row already holds: a
/// compaction writes only the rows it keeps, below the length it leaves (so the rows between
/// the target and target + N bring the same keys again at every period).
template <class T, class Q>
std::int64_t build_generation(scenario<T, Q>& twin, scenario<T, Q>& sc, std::int64_t* evictions,
                              std::size_t* first_round = nullptr,
                              std::vector<test::test_queries<Q>>* turn_queries = nullptr,
                              const std::vector<test::test_queries<Q>>* decode_queries = nullptr,
                              std::int64_t decode_steps = 0) {
  // decode_queries: [layer][seq][steps] the steps' queries of a generation longer than the
  // scenario's own (decode_steps of them); its caches hold what a step appends (see above).
  const std::int64_t steps = decode_queries != nullptr ? decode_steps : sc.steps;
  kvevict::compressor cpu;
  REQUIRE(kvevict::compressor::plan(sc.options, &cpu).ok());
  kvevict::workspace ws(cpu.workspace_size());
  std::vector<std::vector<std::uint64_t>> states(sc.seqs());
  for (auto& st : states) {
    st.assign(cpu.sequence_state_size() / 8 + 1, 0);
    REQUIRE(cpu.reset_sequence(st.data(), st.size() * 8).ok());
  }
  std::vector<std::vector<std::int64_t>> length(kLayers, sc.prompts);
  // whether the prompt's compression is done (DeferKV's at its step d): the budget holds from then
  std::vector<std::vector<bool>> compressed(kLayers, std::vector<bool>(sc.seqs(), false));
  std::int64_t rounds = 0;
  *evictions = 0;
  sc.calls.clear();
  const bool pyramid = sc.options.layers == kvevict::layer_allocation::pyramidkv;
  const bool defer = sc.options.policy.kind() == kvevict::policy_kind::deferkv;
  // The CPU's call on the twin, its lengths kept for the next call's views.
  const auto play = [&](std::int64_t l, gpu::compressor_call<T, Q>& mine, gpu::compressor_call<T, Q>& theirs) {
    std::vector<kvevict::sequence_io<T, Q>> io(sc.seqs());
    std::vector<std::vector<kvevict::layer_cache<T>>> layers(sc.seqs());
    cpu_inputs(theirs, &states, &layers, io.data());
    std::vector<kvevict::sequence_report> reports(sc.seqs());
    const kvevict::status st = cpu.run(l, io.data(), static_cast<std::int64_t>(sc.seqs()), reports.data(), ws);
    INFO(st.message());
    REQUIRE(st.ok());
    for (std::size_t s = 0; s < sc.seqs(); ++s) {
      if (theirs.seqs[s].event == kvevict::sequence_event::idle) continue;
      const kvevict::sequence_report& r = reports[s];
      const bool evicted = r.action == kvevict::sequence_action::evicted;
      const bool decode = theirs.seqs[s].event == kvevict::sequence_event::decode;
      length[static_cast<std::size_t>(l)][s] = r.next_slot;
      if (evicted && sc.options.scope == kvevict::selection_scope::per_sequence)  // every layer compacted
        for (auto& layer_lengths : length) layer_lengths[s] = r.next_slot;
      // a decode-time compression (DeferKV's step d is its prompt's)
      const bool round = evicted && decode && compressed[static_cast<std::size_t>(l)][s];
      rounds += round ? 1 : 0;
      if (first_round != nullptr && *first_round == 0 && s == 0 && round)
        *first_round = sc.calls.size();  // (this call's index once pushed)
      *evictions += evicted ? 1 : 0;
      // the target, and the target + N between compressions (PyramidKV: each layer's share)
      if (!pyramid && round) REQUIRE(r.next_slot <= 24);
      if (!pyramid && !evicted && decode && compressed[static_cast<std::size_t>(l)][s] &&
          sc.options.scope != kvevict::selection_scope::per_sequence)
        REQUIRE(r.next_slot <= 24 + 5);
      if (evicted || (!decode && !defer)) compressed[static_cast<std::size_t>(l)][s] = true;
    }
    sc.calls.push_back(mine);
  };
  for (std::int64_t step = 0; step <= steps; ++step)
    for (std::int64_t l = 0; l < kLayers; ++l) {
      gpu::compressor_call<T, Q> mine, theirs;
      mine.layer = theirs.layer = l;
      for (std::size_t s = 0; s < sc.seqs(); ++s) {
        const std::int64_t k = step - sc.offsets[s];
        if (sc.idle(s) || k < 0 || k > steps) {
          mine.seqs.emplace_back();
          theirs.seqs.emplace_back();
          continue;
        }
        const auto e = k == 0 ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
        const std::int64_t n = length[static_cast<std::size_t>(l)][s] + (k == 0 ? 0 : 1);
        const bool own = decode_queries == nullptr || k == 0;
        mine.seqs.push_back(generation_sequence(sc, l, s, e, n, own ? k : 0));
        theirs.seqs.push_back(generation_sequence(twin, l, s, e, n, own ? k : 0));
        if (own) continue;
        const test::test_queries<Q>& tq =
            (*decode_queries)[(sc.at(l, s) * static_cast<std::size_t>(steps)) + static_cast<std::size_t>(k - 1)];
        for (auto* q : {&mine.seqs.back(), &theirs.seqs.back()}) {
          q->queries = tq.view;
          q->qbuf = gpu::buffer_of(tq.buffer);
        }
      }
      play(l, mine, theirs);
    }
  if (turn_queries == nullptr) return rounds;
  // A new prompt turn of 9 tokens after the answer, compressed at its prefill_end with the
  // window of its own last queries (the ring's decode rows are not its).
  const std::int64_t turn = 9, w = std::max<std::int64_t>(1, cpu.observation_window());
  turn_queries->clear();
  turn_queries->reserve(static_cast<std::size_t>(kLayers) * sc.seqs());
  for (std::int64_t l = 0; l < kLayers; ++l)
    for (std::size_t s = 0; s < sc.seqs(); ++s) {
      const std::int64_t first = sc.prompts[s] + steps + turn - w;
      std::vector<std::int64_t> pos;
      for (std::int64_t t = 0; t < w; ++t) pos.push_back(first + t);
      turn_queries->push_back(test::make_queries<Q>(
          kHq, w, kDim,
          test::normal(static_cast<std::size_t>(kHq * w * kDim), 700 + 10 * static_cast<std::uint64_t>(l) + s, 2.0),
          pos));
    }
  for (std::int64_t l = 0; l < kLayers; ++l) {
    gpu::compressor_call<T, Q> mine, theirs;
    mine.layer = theirs.layer = l;
    for (std::size_t s = 0; s < sc.seqs(); ++s) {
      if (sc.idle(s)) {
        mine.seqs.emplace_back();
        theirs.seqs.emplace_back();
        continue;
      }
      const std::int64_t n = length[static_cast<std::size_t>(l)][s] + turn;
      mine.seqs.push_back(generation_sequence(sc, l, s, kvevict::sequence_event::prefill_end, n, 0));
      theirs.seqs.push_back(generation_sequence(twin, l, s, kvevict::sequence_event::prefill_end, n, 0));
      const test::test_queries<Q>& tq = (*turn_queries)[static_cast<std::size_t>(l) * sc.seqs() + s];
      for (auto* q : {&mine.seqs.back(), &theirs.seqs.back()}) {
        q->queries = tq.view;
        q->qbuf = gpu::buffer_of(tq.buffer);
      }
    }
    play(l, mine, theirs);
  }
  return rounds;
}
}  // namespace

// Issue 29: decode-time budgets, the GPU's one call per layer against the CPU's over a long
// generation (the decode scorer the prompt policy, or another).
TEST_CASE("GPU compressor: decode-time budgets hold a long generation at target + N, call for call as the CPU's",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  const auto generation = [](kvevict::compressor_options o, bool paged, std::uint64_t seed, std::int64_t min_rounds) {
    o.decoding.target = kvevict::budget::tokens(24);
    o.decoding.interval = 5;
    o.decoding.policy = o.policy;
    scenario<bf16, bf16> twin(o, paged, 40, seed), sc(o, paged, 40, seed);
    std::int64_t evictions = 0;
    CHECK(build_generation(twin, sc, &evictions) >= min_rounds);
    check_against_cpu(sc, evictions);
  };
  SECTION("SnapKV, per-head keep sets, paged") {
    // The rows a decode step appends repeat (see build_generation), so duplicate keys score
    // alike: without pooling their ties are exact on both sides (pooled, their neighbours'
    // sums differ in the last ulp between the CPU's and the GPU's kernels).
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 6;
    w.scoring.pool = {kvevict::pooling_kind::none, 1, true};
    o.policy = kvevict::policy::snapkv(w);
    generation(o, true, 61, 12);
  }
  SECTION("TOVA, one keep set per layer, PyramidKV, strided") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.policy = kvevict::policy::tova();
    o.scope = kvevict::selection_scope::per_layer;
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.pyramid_beta = 3;
    generation(o, false, 62, 12);
  }
  SECTION("KNorm, one keep set per sequence (every layer folds at the compressing step), paged") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::knorm_config k;
    k.protected_tail = 2;
    o.policy = kvevict::policy::knorm(k);
    o.scope = kvevict::selection_scope::per_sequence;
    generation(o, true, 63, 6);
  }
  // A decode scorer other than the prompt policy: the decode-time compressions are scored by
  // its kernels, in a batch of their own when it reads queries. Sequence 3's prompt_end comes
  // at step 10 (an offset of 10), where sequences 0 and 2 (20 rows kept at their prompt's end)
  // make their first decode-time compression: with DapQ + H2O and TOVA + SnapKV the prompt
  // policy's batch and the decode scorer's share that call. (DeferKV keeps 27 rows at its step
  // d, so its rounds come at steps 5, 11, ...; KNorm scores from the keys, a launch each.)
  const auto composed = [](kvevict::compressor_options o, const kvevict::policy_config& decoder, std::int64_t window,
                           bool paged, std::uint64_t seed, bool prompt_queries = true) {
    o.decoding.target = kvevict::budget::tokens(24);
    o.decoding.interval = 5;
    o.decoding.policy = decoder;
    o.decoding.window = window;
    scenario<bf16, bf16> twin(o, paged, 34, seed, false, {61, 0, 37, 16}, {0, 0, 0, 10});
    scenario<bf16, bf16> sc(o, paged, 34, seed, false, {61, 0, 37, 16}, {0, 0, 0, 10});
    std::int64_t evictions = 0;
    CHECK(build_generation(twin, sc, &evictions) >= 8);
    if (!prompt_queries)  // a prompt policy that reads none: prefill_end hands no queries (the CPU reads none)
      for (auto& call : sc.calls)
        for (auto& q : call.seqs)
          if (q.event == kvevict::sequence_event::prefill_end) q.queries = {}, q.qbuf = {};
    check_against_cpu(sc, evictions);
  };
  SECTION("DapQ's pseudo tokens at the prompt, H2O over 4 decode queries while decoding, per-head sets, paged") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    o.policy = kvevict::policy::dapq(d);
    composed(o, kvevict::policy::h2o(), 4, true, 67);
  }
  SECTION("DeferKV delay 2 at the prompt, KNorm (from the keys) while decoding, one keep set per layer, strided") {
    kvevict::compressor_options o = deferkv_options(dtype::bf16, dtype::bf16, 2);
    o.scope = kvevict::selection_scope::per_layer;
    composed(o, kvevict::policy::knorm(), 0, false, 68);
  }
  SECTION("DeferKV delay 2 at the prompt, SnapKV over 4 decode queries (its ring filled from the first decode step)") {
    kvevict::compressor_options o = deferkv_options(dtype::bf16, dtype::bf16, 2);
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 4;
    w.scoring.pool = {kvevict::pooling_kind::none, 1, true};
    composed(o, kvevict::policy::snapkv(w), 0, true, 71);
  }
  SECTION("KNorm at the prompt (prefill_end hands no queries), SnapKV over 4 decode queries, per-head sets, paged") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.policy = kvevict::policy::knorm();
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 4;
    w.scoring.pool = {kvevict::pooling_kind::none, 1, true};
    composed(o, kvevict::policy::snapkv(w), 0, true, 70, false);
  }
  SECTION("TOVA at the prompt, SnapKV as ChunkKV (chunks of 3) while decoding, one keep set per sequence, paged") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.policy = kvevict::policy::tova();
    o.scope = kvevict::selection_scope::per_sequence;
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 5;
    w.scoring.pool = {kvevict::pooling_kind::none, 1, true};
    kvevict::policy_config decoder = kvevict::policy::snapkv(w);
    decoder.chunk_length = 3;
    composed(o, decoder, 0, true, 69);
  }
  SECTION("a 4,096-token generation (under a sanitizer's sweep stride, 4,096 / stride tokens)") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 6;
    w.scoring.pool = {kvevict::pooling_kind::none, 1, true};
    o.policy = kvevict::policy::snapkv(w);
    o.decoding.target = kvevict::budget::tokens(24);
    o.decoding.interval = 5;
    o.decoding.policy = o.policy;
    o.limits.max_sequences = 1;
    const char* stride = std::getenv("KVEVICT_GPU_SWEEP_STRIDE");
    const std::int64_t steps = 4096 / (stride != nullptr ? std::max(1, std::atoi(stride)) : 1);
    // One sequence of 16 prompt tokens: its caches hold the 30 rows the generation reaches.
    scenario<bf16, bf16> twin(o, false, 14, 66, false, {16}, {0}), sc(o, false, 14, 66, false, {16}, {0});
    std::vector<test::test_queries<bf16>> queries;
    queries.reserve(static_cast<std::size_t>(kLayers * steps));
    for (std::int64_t l = 0; l < kLayers; ++l)
      for (std::int64_t k = 1; k <= steps; ++k)
        queries.push_back(test::make_queries<bf16>(
            kHq, 1, kDim,
            test::normal(static_cast<std::size_t>(kHq * kDim),
                         5000 + 7919 * static_cast<std::uint64_t>(l) + static_cast<std::uint64_t>(k), 2.0),
            {16 + k - 1}));
    std::int64_t evictions = 0;
    const std::int64_t rounds = build_generation<bf16, bf16>(twin, sc, &evictions, nullptr, nullptr, &queries, steps);
    CHECK(rounds == kLayers * ((steps - (24 + 5 + 1 - 16)) / 6 + 1));
    check_against_cpu(sc, evictions);
  }
  SECTION("a new prompt turn after the answer observes with its own window, not the decode rows") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 6;
    w.scoring.pool = {kvevict::pooling_kind::none, 1, true};
    o.policy = kvevict::policy::snapkv(w);
    o.decoding.target = kvevict::budget::tokens(24);
    o.decoding.interval = 5;
    o.decoding.policy = o.policy;
    scenario<bf16, bf16> twin(o, true, 40, 65), sc(o, true, 40, 65);
    std::int64_t evictions = 0;
    std::vector<test::test_queries<bf16>> turn;
    CHECK(build_generation(twin, sc, &evictions, nullptr, &turn) >= 12);
    check_against_cpu(sc, evictions);
  }
  SECTION("a decode query out of order raises flag_query_position and cancels the compression it feeds") {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.decoding.target = kvevict::budget::tokens(24);
    o.decoding.interval = 5;
    o.decoding.policy = o.policy;
    scenario<bf16, bf16> twin(o, true, 40, 64), sc(o, true, 40, 64);
    std::int64_t evictions = 0;
    std::size_t round = 0;
    build_generation(twin, sc, &evictions, &round);
    REQUIRE(round > 2);
    REQUIRE(sc.calls[round].layer == 0);
    // The compressing step hands the previous step's query (its position again).
    sc.calls[round].seqs[0].queries = sc.calls[round - 2].seqs[0].queries;
    sc.calls[round].seqs[0].qbuf = sc.calls[round - 2].seqs[0].qbuf;
    const std::vector<gpu::compressor_call<bf16, bf16>> calls(
        sc.calls.begin(), sc.calls.begin() + static_cast<std::ptrdiff_t>(round + 1));
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
    for (std::size_t i = 0; i <= round; ++i) {
      INFO("call " << i << ": " << g.calls[i].st.message());
      REQUIRE(g.calls[i].st.ok());  // the positions are device data
      REQUIRE(g.calls[i].flags == (i == round ? kvevict::cuda::flag_query_position : 0u));
    }
    // The call's compressions cancelled: layer 0's pools as the previous step left them, no output.
    for (std::size_t s = 0; s < calls[round].seqs.size(); ++s) {
      if (calls[round].seqs[s].event == kvevict::sequence_event::idle) continue;
      REQUIRE(g.calls[round].seqs[s].keys == g.calls[round - 2].seqs[s].keys);
      REQUIRE(g.calls[round].seqs[s].values == g.calls[round - 2].seqs[s].values);
      for (std::int64_t x : g.calls[round].seqs[s].head_lengths) REQUIRE(x == -7);
    }
    std::size_t at = 0;
    const kvevict::status st = cpu_calls(o, calls, &at);
    REQUIRE(at == round);  // the CPU refuses the step by name
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()) == "seqs[0].queries.positions[0]");
  }
}

TEST_CASE("GPU compressor: chunked prefill refuses as the CPU does; a chunk out of order cancels what it feeds",
          "[gpu][gpu_errors][gpu_compressor]") {
  using kvevict::dtype;
  kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
  o.chunked_prefill = true;
  const std::vector<std::vector<std::int64_t>> cuts{{25, 58}, {}, {}, {}};
  SECTION("a prefill chunk without chunked_prefill in the plan") {
    kvevict::compressor_options plain = base_options(dtype::bf16, dtype::bf16);
    scenario<bf16, bf16> sc(plain, true, 0, 91, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, cuts);
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(plain, sc.calls, 4);
    REQUIRE(g.plan.ok());
    INFO(g.calls[0].st.message());
    REQUIRE(g.calls[0].st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(g.calls[0].st.argument()) == "seqs[0].event");
    std::size_t at = 0;
    const kvevict::status st = cpu_calls(plain, sc.calls, &at);
    REQUIRE(at == 0);
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()) == "seqs[0].event");
  }
  SECTION("H2O: prefill_end with fewer than every prompt query, the chunks' included") {
    kvevict::compressor_options h = o;
    h.policy = kvevict::policy::h2o();
    scenario<bf16, bf16> sc(h, true, 0, 92, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, cuts);
    sc.calls.erase(sc.calls.begin() + 2, sc.calls.begin() + 4);  // the chunk [25, 58) never handed
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(h, sc.calls, 4);
    INFO(g.calls[2].st.message());
    REQUIRE(g.calls[2].st.code() == kvevict::errc::invalid_shape);
    REQUIRE(std::string(g.calls[2].st.argument()) == "seqs[0].queries.num_queries");
    require_untouched(sc, g, 2);
    std::size_t at = 0;
    const kvevict::status st = cpu_calls(h, sc.calls, &at);
    REQUIRE(at == 2);
    REQUIRE(st.code() == kvevict::errc::invalid_shape);
    REQUIRE(std::string(st.argument()) == "seqs[0].queries.num_queries");
  }
  SECTION("DeferKV: a chunk after prefill_end") {
    const kvevict::compressor_options d = [] {
      kvevict::compressor_options x = deferkv_options(dtype::bf16, dtype::bf16, 2);
      x.chunked_prefill = true;
      return x;
    }();
    scenario<bf16, bf16> sc(d, true, 2, 93, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, cuts);
    sc.calls.insert(sc.calls.begin() + 5, sc.calls[0]);  // layer 0's first chunk again after its prefill_end
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(d, sc.calls, 4);
    INFO(g.calls[5].st.message());
    REQUIRE(g.calls[4].st.ok());
    REQUIRE(g.calls[5].st.code() == kvevict::errc::invalid_state);
    REQUIRE(std::string(g.calls[5].st.argument()) == "seqs[0].host_state");
    REQUIRE(g.calls[6].st.ok());  // the session goes on
    std::size_t at = 0;
    const kvevict::status st = cpu_calls(d, sc.calls, &at);
    REQUIRE(at == 5);
    REQUIRE(st.code() == kvevict::errc::invalid_state);
  }
  SECTION("SnapKV: chunks out of order raise flag_query_position; prefill_end's eviction is cancelled") {
    scenario<bf16, bf16> sc(o, true, 0, 94, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, cuts);
    std::swap(sc.calls[0].seqs[0].queries, sc.calls[2].seqs[0].queries);  // [25, 58) before [0, 25)
    std::swap(sc.calls[1].seqs[0].queries, sc.calls[3].seqs[0].queries);
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, sc.calls, 4);
    for (std::size_t i = 0; i < 6; ++i) {
      INFO("call " << i << ": " << g.calls[i].st.message());
      REQUIRE(g.calls[i].st.ok());  // the positions are device data
      REQUIRE(g.calls[i].flags == (i < 2 ? 0u : kvevict::cuda::flag_query_position));
    }
    require_untouched(sc, g, 4);  // the layer's prefill_end: nothing moved, no output
    require_untouched(sc, g, 5);
    std::size_t at = 0;
    const kvevict::status st = cpu_calls(o, sc.calls, &at);
    REQUIRE(at == 2);  // the CPU refuses the late chunk by name
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()) == "seqs[0].queries.positions[0]");
  }
  SECTION("DeferKV delay 1: a chunk out of order cancels the eviction at the decode step") {
    kvevict::compressor_options d = deferkv_options(dtype::bf16, dtype::bf16, 1);
    d.chunked_prefill = true;
    scenario<bf16, bf16> sc(d, true, 1, 95, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, cuts);
    std::swap(sc.calls[0].seqs[0].queries, sc.calls[2].seqs[0].queries);
    std::swap(sc.calls[1].seqs[0].queries, sc.calls[3].seqs[0].queries);
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(d, sc.calls, 4);
    for (std::size_t i = 0; i < 8; ++i) {  // the late chunk, then the eviction (prefill_end only observes)
      INFO("call " << i << ": " << g.calls[i].st.message());
      REQUIRE(g.calls[i].st.ok());
      const bool flagged = i == 2 || i == 3 || i == 6 || i == 7;
      REQUIRE(g.calls[i].flags == (flagged ? kvevict::cuda::flag_query_position : 0u));
    }
    REQUIRE(sc.calls[6].seqs[0].event == kvevict::sequence_event::decode);  // step 1 evicts every layer
    require_untouched(sc, g, 6);
    require_untouched(sc, g, 7);
  }
  SECTION("DeferKV delay 1, a decode scorer reading queries: a chunk out of order still cancels the eviction") {
    // The decode steps' queries join the ring from the first one on: its rows, checked against no
    // earlier row, must not clear the prompt window's verdict before step d reads it.
    kvevict::compressor_options d = deferkv_options(dtype::bf16, dtype::bf16, 1);
    d.chunked_prefill = true;
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 4;
    d.decoding.target = kvevict::budget::tokens(24);
    d.decoding.interval = 5;
    d.decoding.policy = kvevict::policy::snapkv(w);
    scenario<bf16, bf16> sc(d, true, 1, 95, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, cuts);
    std::swap(sc.calls[0].seqs[0].queries, sc.calls[2].seqs[0].queries);
    std::swap(sc.calls[1].seqs[0].queries, sc.calls[3].seqs[0].queries);
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(d, sc.calls, 4);
    for (std::size_t i = 0; i < 8; ++i) {
      INFO("call " << i << ": " << g.calls[i].st.message());
      REQUIRE(g.calls[i].st.ok());
      const bool flagged = i == 2 || i == 3 || i == 6 || i == 7;
      REQUIRE(g.calls[i].flags == (flagged ? kvevict::cuda::flag_query_position : 0u));
    }
    REQUIRE(sc.calls[6].seqs[0].event == kvevict::sequence_event::decode);
    require_untouched(sc, g, 6);
    require_untouched(sc, g, 7);
  }
  SECTION("DeferKV delay 1: a late chunk of a sequence that only observes cancels only its own eviction") {
    kvevict::compressor_options d = deferkv_options(dtype::bf16, dtype::bf16, 1);
    d.chunked_prefill = true;
    scenario<bf16, bf16> sc(d, false, 2, 96, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
    chunk_prompts(sc, {{25, 58}, {}, {}, {4, 8}});
    std::swap(sc.calls[0].seqs[3].queries, sc.calls[2].seqs[3].queries);  // sequence 3: [4, 8) before [0, 4)
    std::swap(sc.calls[1].seqs[3].queries, sc.calls[3].seqs[3].queries);
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(d, sc.calls, 4);
    // Calls 6 and 7 (step 1): sequences 0 and 2 evict, sequence 3's prefill_end only observes.
    REQUIRE(sc.calls[6].seqs[3].event == kvevict::sequence_event::prefill_end);
    for (std::size_t i = 0; i < sc.calls.size(); ++i) {
      INFO("call " << i << ": " << g.calls[i].st.message());
      REQUIRE(g.calls[i].st.ok());
      const bool flagged = i == 2 || i == 3 || i == 8 || i == 9;  // the late chunk, then its eviction
      REQUIRE(g.calls[i].flags == (flagged ? kvevict::cuda::flag_query_position : 0u));
    }
    for (std::size_t i : {std::size_t{6}, std::size_t{7}})  // the others' sets written
      for (std::size_t s : {std::size_t{0}, std::size_t{2}}) REQUIRE(g.calls[i].seqs[s].head_lengths[0] >= 0);
    for (std::size_t i : {std::size_t{8}, std::size_t{9}}) {  // sequence 3's eviction: nothing of it written
      const gpu::compressor_sequence<bf16, bf16>& q = sc.calls[i].seqs[3];
      REQUIRE(q.event == kvevict::sequence_event::decode);
      require_bytes<bf16>(g.calls[i].seqs[3].keys, q.k.buf);
      require_bytes<bf16>(g.calls[i].seqs[3].values, q.v.buf);
      for (std::int64_t x : g.calls[i].seqs[3].head_lengths) REQUIRE(x == -7);
    }
  }
}

namespace {

/// A rank's collective that records what its group's all-reduces returned, then replays them:
/// the group plans in threads (the rounds are collective), and each rank's session, which
/// plans again and then runs on its own (per-head keep sets make no collective at run time),
/// gets the same answers without its peers.
struct replayed_rounds {
  kvevict::collective inner;
  std::vector<std::vector<std::uint32_t>> answers;
  std::size_t next = 0;
  bool replay = false;

  static kvevict::status all_reduce(void* context, std::uint32_t* data, std::int64_t count, kvevict::reduce_op op) {
    auto* r = static_cast<replayed_rounds*>(context);
    if (!r->replay) {
      const kvevict::status st = r->inner.all_reduce(r->inner.context, data, count, op);
      if (st.ok()) r->answers.emplace_back(data, data + count);
      return st;
    }
    if (r->next >= r->answers.size() || static_cast<std::int64_t>(r->answers[r->next].size()) != count)
      return kvevict::status::error(kvevict::errc::collective_error, "replayed_rounds", "all_reduce",
                                    "a round the group did not make");
    std::copy(r->answers[r->next].begin(), r->answers[r->next].end(), data);
    r->next = (r->next + 1) % r->answers.size();  // each session plans once
    return kvevict::status();
  }
  kvevict::collective member() {
    kvevict::collective c = inner;
    c.context = this;
    c.all_reduce = &replayed_rounds::all_reduce;
    return c;
  }
};

/// Rank r's part of a view: `count` heads from `first`.
template <class V>
V heads_of(V v, std::int64_t first, std::int64_t count) {
  v.data += first * v.head_stride;
  v.num_heads = count;
  return v;
}

/// The scenario (own strided caches: contiguous K, transposed V) over `ranks` tensor-parallel
/// ranks, each holding kHkv / ranks KV heads and their query heads: every rank's session on its
/// heads, against kvevict::compressor on all of them, call for call -- each rank's outputs,
/// reports and heads' rows are the one process's.
template <class T, class Q>
void check_ranks_against_cpu(scenario<T, Q>& sc, int ranks) {
  const std::int64_t kv = kHkv / ranks, q = kHq / ranks;
  tp_test::thread_group group(ranks);
  std::vector<replayed_rounds> rounds(static_cast<std::size_t>(ranks));
  std::vector<kvevict::collective> members(static_cast<std::size_t>(ranks));
  std::vector<kvevict::compressor_options> options(static_cast<std::size_t>(ranks), sc.options);
  for (int r = 0; r < ranks; ++r) {
    rounds[static_cast<std::size_t>(r)].inner = group.member(r);
    members[static_cast<std::size_t>(r)] = rounds[static_cast<std::size_t>(r)].member();
    kvevict::compressor_options& o = options[static_cast<std::size_t>(r)];
    o.model.num_kv_heads = kv;
    o.model.num_query_heads = q;
    o.tensor_parallel = &members[static_cast<std::size_t>(r)];
  }
  std::vector<kvevict::status> planned(static_cast<std::size_t>(ranks));
  group.run([&](int r) {
    planned[static_cast<std::size_t>(r)] = gpu::compressor_plan(options[static_cast<std::size_t>(r)]);
  });
  for (const kvevict::status& st : planned) {
    INFO(st.message());
    REQUIRE(st.ok());
  }
  std::vector<gpu::compressor_session_result> results;
  for (int r = 0; r < ranks; ++r) {
    rounds[static_cast<std::size_t>(r)].replay = true;
    std::vector<gpu::compressor_call<T, Q>> calls = sc.calls;
    for (auto& call : calls)
      for (auto& s : call.seqs) {
        if (s.k.view.data == nullptr) continue;
        s.k.view = heads_of(s.k.view, r * kv, kv);
        s.v.view = heads_of(s.v.view, r * kv, kv);
        if (s.dst_k.view.data != nullptr) {
          s.dst_k.view = heads_of(s.dst_k.view, r * kv, kv);
          s.dst_v.view = heads_of(s.dst_v.view, r * kv, kv);
        }
        s.queries = heads_of(s.queries, r * q, q);
      }
    results.push_back(gpu::compressor_session<T, Q>(options[static_cast<std::size_t>(r)], calls, 4));
    INFO("rank " << r << ": " << results.back().plan.message());
    REQUIRE(results.back().plan.ok());
  }

  kvevict::compressor cpu;
  REQUIRE(kvevict::compressor::plan(sc.options, &cpu).ok());
  kvevict::workspace ws(cpu.workspace_size());
  std::vector<std::vector<std::uint64_t>> states(sc.seqs());
  for (auto& st : states) {
    st.assign(cpu.sequence_state_size() / 8 + 1, 0);
    REQUIRE(cpu.reset_sequence(st.data(), st.size() * 8).ok());
  }
  const std::int64_t cap = cpu.keep_capacity(), head_cap = cpu.keep_capacity_per_head();
  std::int64_t evicted = 0;
  for (std::size_t i = 0; i < sc.calls.size(); ++i) {
    const gpu::compressor_call<T, Q>& call = sc.calls[i];
    const std::size_t n = call.seqs.size();
    std::vector<kvevict::sequence_io<T, Q>> io(n);
    std::vector<std::vector<std::int64_t>> lengths(n, std::vector<std::int64_t>(kHkv, -7)),
        kept(n, std::vector<std::int64_t>(static_cast<std::size_t>(cap), -7)),
        padded(n, std::vector<std::int64_t>(static_cast<std::size_t>(kHkv * head_cap), -7));
    std::vector<std::vector<kvevict::layer_cache<T>>> layers(n);
    cpu_inputs(call, &states, &layers, io.data());
    for (std::size_t s = 0; s < n; ++s) {
      io[s].head_lengths = lengths[s].data();
      io[s].kept_positions = kept[s].data();
      io[s].padded_indices = padded[s].data();
    }
    std::vector<kvevict::sequence_report> reports(n);
    REQUIRE(cpu.run(call.layer, io.data(), static_cast<std::int64_t>(n), reports.data(), ws).ok());
    for (int r = 0; r < ranks; ++r) {
      const gpu::compressor_call_result& gc = results[static_cast<std::size_t>(r)].calls[i];
      INFO("call " << i << ", rank " << r << ": " << gc.st.message());
      REQUIRE(gc.st.ok());
      REQUIRE(gc.flags == 0u);
      for (std::size_t s = 0; s < n; ++s) {
        INFO("seqs[" << s << "]");
        const kvevict::sequence_report &c = reports[s], &g = gc.reports[s];
        REQUIRE(g.action == c.action);
        const gpu::compressor_sequence_result& out = gc.seqs[s];
        if (c.action == kvevict::sequence_action::evicted) {
          evicted += r == 0 ? 1 : 0;
          REQUIRE(g.length == c.length);  // uniform heads: every head keeps the same count
          REQUIRE(g.kept * ranks == c.kept);
          std::int64_t at_cpu = 0, at_rank = 0;  // where this rank's heads' entries start in each list
          for (std::int64_t h = 0; h < r * kv; ++h) at_cpu += lengths[s][static_cast<std::size_t>(h)];
          for (std::int64_t h = 0; h < kv; ++h) {
            const std::int64_t all = r * kv + h, len = lengths[s][static_cast<std::size_t>(all)];
            REQUIRE(out.head_lengths[static_cast<std::size_t>(h)] == len);
            for (std::int64_t j = 0; j < head_cap; ++j)
              REQUIRE(out.padded[static_cast<std::size_t>(h * head_cap + j)] ==
                      padded[s][static_cast<std::size_t>(all * head_cap + j)]);
            for (std::int64_t j = 0; j < len; ++j)
              REQUIRE(out.kept_positions[static_cast<std::size_t>(at_rank + j)] ==
                      kept[s][static_cast<std::size_t>(at_cpu + j)]);
            at_cpu += len;
            at_rank += len;
          }
        }
        // This rank's heads' rows, as the one process left them.
        const gpu::compressor_sequence<T, Q>& sq = call.seqs[s];
        if (sq.k.buf.data == nullptr) continue;
        std::vector<std::tuple<const std::vector<unsigned char>*, gpu::host_buffer, kvevict::cache_view<T>>> sides{
            {&out.keys, sq.k.buf, sq.k.view}, {&out.values, sq.v.buf, sq.v.view}};
        if (sq.dst_k.buf.data != nullptr) {
          sides.emplace_back(&out.dst_keys, sq.dst_k.buf, sq.dst_k.view);
          sides.emplace_back(&out.dst_values, sq.dst_v.buf, sq.dst_v.view);
        }
        for (const auto& [got, want, view] : sides) {
          const std::size_t per_head = static_cast<std::size_t>(view.head_stride) * sizeof(T);
          REQUIRE(got->size() == want.bytes);
          REQUIRE(
              std::memcmp(got->data() + static_cast<std::size_t>(r * kv) * per_head,
                          static_cast<const unsigned char*>(want.data) + static_cast<std::size_t>(r * kv) * per_head,
                          static_cast<std::size_t>(kv) * per_head) == 0);
        }
      }
    }
  }
  REQUIRE(evicted == kLayers * 3);
}

}  // namespace

// Tensor parallelism: ranks split a layer's KV heads (and their query heads); a per-head keep
// set under a uniform or PyramidKV budget is each head's own, so each rank's GPU compressor
// runs alone after the group's plan rounds -- the CPU plan's rounds, so a group may mix CPU
// and GPU compressors.
TEST_CASE("GPU compressor: tensor-parallel ranks keep what one process holding every head keeps",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  SECTION("SnapKV, bf16, two ranks, in place") {
    scenario<bf16, bf16> sc(base_options(dtype::bf16, dtype::bf16), false, 0, 101);
    check_ranks_against_cpu(sc, 2);
  }
  SECTION("DeferKV delay 1, float, two ranks, PyramidKV, into fresh memory") {
    kvevict::compressor_options o = deferkv_options(dtype::f32, dtype::f32, 1);
    o.layers = kvevict::layer_allocation::pyramidkv;
    o.compact = kvevict::compaction::out_of_place;
    scenario<float, float> sc(o, false, 1, 102);
    check_ranks_against_cpu(sc, 2);
  }
  SECTION("a group mixing a CPU and a GPU compressor plans together, and fails together") {
    for (const bool same : {true, false}) {
      tp_test::thread_group group(2);
      std::vector<kvevict::collective> members{group.member(0), group.member(1)};
      std::vector<kvevict::compressor_options> o(2, base_options(dtype::bf16, dtype::bf16));
      for (int r = 0; r < 2; ++r) {
        o[static_cast<std::size_t>(r)].model.num_kv_heads = 1;
        o[static_cast<std::size_t>(r)].model.num_query_heads = 2;
        o[static_cast<std::size_t>(r)].tensor_parallel = &members[static_cast<std::size_t>(r)];
      }
      if (!same) o[1].per_head = kvevict::budget::tokens(21);
      kvevict::status st[2];
      kvevict::compressor cpu;
      group.run([&](int r) { st[r] = r == 0 ? kvevict::compressor::plan(o[0], &cpu) : gpu::compressor_plan(o[1]); });
      INFO(st[0].message() << " / " << st[1].message());
      REQUIRE(st[0].ok() == same);
      REQUIRE(st[1].ok() == same);
      if (!same) {
        REQUIRE(st[0].code() == st[1].code());
        REQUIRE(std::string(st[0].argument()) == std::string(st[1].argument()));
      } else {
        REQUIRE(cpu.first_kv_head() == 0);
        REQUIRE(cpu.total_kv_heads() == 2);
      }
    }
  }
}

TEST_CASE("GPU compressor: the per-sequence scope refuses as the CPU does; a layer refused on the device moves none",
          "[gpu][gpu_errors][gpu_compressor]") {
  using kvevict::dtype;
  kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
  o.scope = kvevict::selection_scope::per_sequence;
  o.sharing = kvevict::block_sharing::marked;
  // Calls: layer 0 (folds sequences 0 and 2), layer 1 (selects their keep set and compacts
  // both layers), then step 1's (sequence 3's prefill_end).
  scenario<bf16, bf16> sc(o, true, 0, 81);
  mark_blocks(sc);
  const gpu::compressor_session_result ref = gpu::compressor_session<bf16, bf16>(o, sc.calls, 4);
  REQUIRE(ref.plan.ok());
  const auto unchanged = [&sc](const gpu::compressor_call_result& r, const gpu::compressor_call<bf16, bf16>& c) {
    for (std::size_t s = 0; s < c.seqs.size(); ++s) {  // every layer's pools as the prompt left them
      for (std::size_t l = 0; l < c.seqs[s].layers.size(); ++l) {
        require_bytes<bf16>(r.seqs[s].layer_keys[l], sc.calls[1].seqs[s].layers[l].k.buf);
        require_bytes<bf16>(r.seqs[s].layer_values[l], sc.calls[1].seqs[s].layers[l].v.buf);
      }
      for (std::int64_t x : r.seqs[s].head_lengths) REQUIRE(x == -7);
      for (std::int32_t x : r.seqs[s].changed_blocks) REQUIRE(x == 77);
    }
  };
  SECTION("refused on the host by name: nothing changes, and the session goes on") {
    struct bad_call {
      const char* what;
      std::function<void(gpu::compressor_call<bf16, bf16>*)> spoil;
      kvevict::errc code;
      std::string arg;
    };
    const std::vector<bad_call> cases = {
        {"no layer caches", [](gpu::compressor_call<bf16, bf16>* c) { c->seqs[2].layers.clear(); },
         kvevict::errc::null_pointer, "seqs[2].layers"},
        {"a layer cache holding another token count",
         [](gpu::compressor_call<bf16, bf16>* c) { c->seqs[2].layers[0].k.view.num_tokens -= 1; },
         kvevict::errc::invalid_shape, "seqs[2].layers[0].keys.num_tokens"},
        {"a layer's pool larger than limits.max_pool_blocks",
         [](gpu::compressor_call<bf16, bf16>* c) { c->seqs[0].layers[0].v.view.num_pool_blocks = 65; },
         kvevict::errc::invalid_shape, "seqs[0].layers[0].values.num_pool_blocks"},
        {"a layer's values aliasing its keys (found by the layer's compaction batch)",
         [](gpu::compressor_call<bf16, bf16>* c) {
           c->seqs[2].layers[0].v.view.data = c->seqs[2].layers[0].k.view.data;
           c->seqs[2].layers[0].v.buf = c->seqs[2].layers[0].k.buf;
         },
         kvevict::errc::invalid_argument, "seqs[2].layers[0].values.data"},
        {"no host state", [](gpu::compressor_call<bf16, bf16>* c) { c->seqs[0].state = -1; },
         kvevict::errc::null_pointer, "seqs[0].host_state"},
        {"the folded row in host memory (refused before any sequence is enqueued)",
         [](gpu::compressor_call<bf16, bf16>* c) {
           static std::uint64_t host_row[128];  // pageable host memory
           c->seqs[2].raw_state = host_row;
         },
         kvevict::errc::invalid_argument, "seqs[2].state"},
        {"the last layer scoring another token count than layer 0",
         [](gpu::compressor_call<bf16, bf16>* c) {
           auto& q = c->seqs[2];
           q.k.view.num_tokens -= 1, q.v.view.num_tokens -= 1;
           for (auto& l : q.layers) l.k.view.num_tokens -= 1, l.v.view.num_tokens -= 1;
         },
         kvevict::errc::invalid_shape, "seqs[2].keys.num_tokens"},
    };
    for (const bad_call& b : cases) {
      INFO(b.what);
      std::vector<gpu::compressor_call<bf16, bf16>> calls = sc.calls;
      gpu::compressor_call<bf16, bf16> spoiled = sc.calls[1];
      b.spoil(&spoiled);
      calls.insert(calls.begin() + 1, spoiled);
      const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
      REQUIRE(g.plan.ok());
      const gpu::compressor_call_result& bad = g.calls[1];
      INFO(bad.st.message());
      REQUIRE(bad.st.code() == b.code);
      REQUIRE(std::string(bad.st.argument()).rfind(b.arg, 0) == 0);
      REQUIRE(bad.states == g.calls[0].states);  // no folded row moved
      for (std::size_t s = 0; s < spoiled.seqs.size(); ++s) REQUIRE(bad.reports[s].length == -9);
      if (b.code != kvevict::errc::invalid_argument) unchanged(bad, spoiled);
      REQUIRE(g.calls.size() == ref.calls.size() + 1);
      for (std::size_t i = 1; i < ref.calls.size(); ++i) {
        INFO("call " << i);
        const gpu::compressor_call_result &x = g.calls[i + 1], &y = ref.calls[i];
        REQUIRE(x.st.ok());
        REQUIRE(x.states == y.states);
        for (std::size_t s = 0; s < y.seqs.size(); ++s) {
          REQUIRE(x.reports[s].action == y.reports[s].action);
          REQUIRE(x.seqs[s].layer_keys == y.seqs[s].layer_keys);
          REQUIRE(x.seqs[s].layer_values == y.seqs[s].layer_values);
          REQUIRE(x.seqs[s].padded == y.seqs[s].padded);
        }
      }
    }
  }
  SECTION("the layers fold in order, and not again once the keep set was applied") {
    std::vector<gpu::compressor_call<bf16, bf16>> calls{sc.calls[1]};  // layer 1 before layer 0
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
    INFO(g.calls[0].st.message());
    REQUIRE(g.calls[0].st.code() == kvevict::errc::invalid_state);
    REQUIRE(std::string(g.calls[0].st.argument()) == "seqs[0].state");
    calls = {sc.calls[0], sc.calls[1], sc.calls[0], sc.calls[1]};  // a second prefill_end: nothing
    const gpu::compressor_session_result again = gpu::compressor_session<bf16, bf16>(o, calls, 4);
    for (std::size_t i = 2; i < 4; ++i) {
      REQUIRE(again.calls[i].st.ok());
      REQUIRE(again.calls[i].states == again.calls[1].states);
      for (std::size_t s : {0u, 2u}) {
        REQUIRE(again.calls[i].reports[s].action == kvevict::sequence_action::none);
        REQUIRE(again.calls[i].seqs[s].keys ==
                again.calls[1].seqs[s].layer_keys[static_cast<std::size_t>(calls[i].layer)]);
      }
    }
  }
  SECTION("a block marked shared in one layer's pool: the device refuses, no layer moves; the CPU refuses by name") {
    std::vector<gpu::compressor_call<bf16, bf16>> calls{sc.calls[0], sc.calls[1]};
    gpu::compressor_sequence<bf16, bf16>& q = calls[1].seqs[0];
    REQUIRE(q.event == kvevict::sequence_event::prefill_end);
    // Layer 0's pool only (layer 1's marks stay the sequence's own): its validation passes.
    q.layers[0].block_refcounts = q.block_refcounts;
    q.layers[0].block_refcounts[static_cast<std::size_t>(q.layers[0].k.view.block_table[1])] = 2;
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
    REQUIRE(g.plan.ok());
    INFO(g.calls[1].st.message());
    REQUIRE(g.calls[1].st.ok());  // the host cannot read the block tables: the device refuses
    REQUIRE(g.calls[1].flags == kvevict::cuda::flag_shared_block);
    unchanged(g.calls[1], calls[1]);
    // The CPU compressor refuses the same call by name.
    std::size_t at = 0;
    const kvevict::status st = cpu_calls(o, calls, &at);
    INFO(st.message());
    REQUIRE(at == 1);
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()).rfind("seqs[0].layers[0].keys.block_table[", 0) == 0);
  }
}

// DapQ's pseudo tokens sit after the prompt; the CPU refuses a position below its length by
// name. Positions are device data: the device refuses (flag_query_position) and nothing of the
// layer is written -- no cache row, no keep-list output.
TEST_CASE("GPU compressor: DapQ's pseudo-token positions below the prompt are refused on the device",
          "[gpu][gpu_errors][gpu_compressor]") {
  using kvevict::dtype;
  const kvevict::compaction modes[] = {kvevict::compaction::in_place, kvevict::compaction::out_of_place,
                                       kvevict::compaction::keep_list_only, kvevict::compaction::in_place};
  for (const kvevict::compaction mode : modes) {
    // The last run: the re-rotated window, whose queries are the prompt's last N moved N
    // positions on (the CPU refuses the moved positions below the prompt too).
    const bool rotated = &mode == &modes[3];
    INFO("compaction " << static_cast<int>(mode) << (rotated ? ", re-rotated window" : ", pseudo tokens"));
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    kvevict::dapq_config d;
    d.pseudo_tokens = 6;
    if (rotated) {
      d.source = kvevict::dapq_source::rerotated_window;
      d.rope.head_dim = kDim;
    }
    o.policy = kvevict::policy::dapq(d);
    o.compact = mode;
    o.sharing = kvevict::block_sharing::marked;
    scenario<bf16, bf16> sc(o, true, 0, 91);
    mark_blocks(sc);
    std::vector<gpu::compressor_call<bf16, bf16>> calls{sc.calls[0]};  // layer 0: sequences 0 and 2 evict
    gpu::compressor_sequence<bf16, bf16>& q = calls[0].seqs[2];
    REQUIRE(q.event == kvevict::sequence_event::prefill_end);
    std::vector<std::int64_t> positions(static_cast<std::size_t>(q.queries.num_queries));
    for (std::size_t t = 0; t < positions.size(); ++t) positions[t] = q.queries.positions[static_cast<std::int64_t>(t)];
    positions.back() = 3;  // inside the prompt (moved on: 9, still inside)
    q.queries.positions = positions.data();
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
    REQUIRE(g.plan.ok());
    INFO(g.calls[0].st.message());
    REQUIRE(g.calls[0].st.ok());  // the host cannot read the positions
    REQUIRE(g.calls[0].flags == kvevict::cuda::flag_query_position);
    for (std::size_t s = 0; s < calls[0].seqs.size(); ++s) {  // nothing of the layer written
      const gpu::compressor_sequence<bf16, bf16>& c = calls[0].seqs[s];
      if (c.k.buf.data == nullptr) continue;
      require_bytes<bf16>(g.calls[0].seqs[s].keys, c.k.buf);
      require_bytes<bf16>(g.calls[0].seqs[s].values, c.v.buf);
      if (c.dst_k.buf.data != nullptr) {
        require_bytes<bf16>(g.calls[0].seqs[s].dst_keys, c.dst_k.buf);
        require_bytes<bf16>(g.calls[0].seqs[s].dst_values, c.dst_v.buf);
      }
      for (const auto* v : {&g.calls[0].seqs[s].head_lengths, &g.calls[0].seqs[s].kept_positions,
                            &g.calls[0].seqs[s].padded, &g.calls[0].seqs[s].head_freed_blocks})
        for (std::int64_t x : *v) REQUIRE(x == -7);
      for (std::int32_t x : g.calls[0].seqs[s].changed_blocks) REQUIRE(x == 77);
    }
    // The CPU compressor refuses the same call by name.
    kvevict::compressor cpu;
    REQUIRE(kvevict::compressor::plan(o, &cpu).ok());
    kvevict::workspace ws(cpu.workspace_size());
    std::vector<std::vector<std::uint64_t>> states(4);
    std::vector<kvevict::sequence_io<bf16, bf16>> io(calls[0].seqs.size());
    std::vector<std::vector<kvevict::layer_cache<bf16>>> layers(io.size());
    cpu_inputs(calls[0], &states, &layers, io.data());
    std::vector<kvevict::sequence_report> reports(io.size());
    const kvevict::status st = cpu.run(0, io.data(), static_cast<std::int64_t>(io.size()), reports.data(), ws);
    INFO(st.message());
    REQUIRE(st.code() == kvevict::errc::out_of_range);
    REQUIRE(std::string(st.argument()) == "seqs[2].queries.positions");
  }
}

TEST_CASE("GPU compressor: idle, late and observing sequences before, between and after the evicting ones",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  // The batch's order must not matter: the idle sequence (prompt 0) first and last, the
  // sequence that starts a step late (its prefill_end shares a call with the others' decode
  // steps) first, between and last, under SnapKV (idle / evicting) and DeferKV delay 2
  // (sequences observing decode steps next to evicting ones).
  const struct {
    const char* what;
    std::vector<std::int64_t> prompts, offsets;
  } orders[] = {
      {"idle first, late last", {0, 61, 37, 16}, {0, 0, 0, 1}},
      {"idle last, late first", {16, 61, 37, 0}, {1, 0, 0, 0}},
      {"late between, idle between", {61, 16, 0, 37}, {0, 1, 0, 0}},
  };
  std::uint64_t seed = 60;
  for (const auto& order : orders) {
    INFO(order.what);
    scenario<bf16, bf16> snap(base_options(dtype::bf16, dtype::bf16), true, 0, seed++, false, order.prompts,
                              order.offsets);
    check_against_cpu(snap);
    scenario<bf16, bf16> defer(deferkv_options(dtype::bf16, dtype::bf16, 2), true, 3, seed++, false, order.prompts,
                               order.offsets);
    check_against_cpu(defer);
  }
}

TEST_CASE("GPU compressor: plan refuses what the GPU path does not implement, by name",
          "[gpu][gpu_errors][gpu_compressor]") {
  using kvevict::dtype;
  const kvevict::compressor_options base = base_options(dtype::bf16, dtype::bf16);
  struct expect {
    kvevict::compressor_options o;
    kvevict::errc code;
    std::string arg;
  };
  std::vector<expect> cases;
  // Every policy of the list the GPU path does not implement, by its traits.
  kvevict::detail::for_each_policy(kvevict::default_policies{}, [&](auto traits) {
    using Tr = decltype(traits);
    if (Tr::on_gpu) return;
    cases.push_back({base, kvevict::errc::unsupported, "policy.kind"});
    cases.back().o.policy = kvevict::policy_config::of<Tr>({});
  });
  cases.push_back({base, kvevict::errc::invalid_argument, "policy.deferkv.window"});  // the CPU's limit too
  {
    kvevict::deferkv_config d;
    d.window = 4097;
    cases.back().o.policy = kvevict::policy::deferkv(d);
    cases.back().o.limits.max_queries = 4097;
  }
  cases.push_back({base, kvevict::errc::unsupported, "layers"});  // the CPU plan's: one count per sequence
  cases.back().o.scope = kvevict::selection_scope::per_sequence;
  cases.back().o.layers = kvevict::layer_allocation::pyramidkv;
  cases.push_back({base, kvevict::errc::invalid_shape, "limits.max_pool_blocks"});
  cases.back().o.limits.max_pool_blocks = -1;
  cases.push_back({base, kvevict::errc::invalid_shape, "model.num_kv_heads"});  // the CPU plan's checks first
  cases.back().o.model.num_kv_heads = 0;
  cases.push_back({base, kvevict::errc::overflow, "model.num_kv_heads"});  // the kernels' limits
  cases.back().o.model.num_kv_heads = cases.back().o.model.num_query_heads = 70000;
  cases.push_back({base, kvevict::errc::overflow, "model.num_query_heads"});  // chunked prefill: the window's grid
  cases.back().o.chunked_prefill = true;
  cases.back().o.model.num_query_heads = 70000;
  cases.push_back({base, kvevict::errc::overflow, "limits.max_tokens"});
  cases.back().o.limits.max_tokens = std::int64_t{1} << 31;
  cases.push_back({base, kvevict::errc::overflow, "limits.max_sequences"});  // AdaKV: every head on a grid dimension
  cases.back().o.heads = kvevict::head_allocation::adakv;
  cases.back().o.limits.max_sequences = 32768;                               // x 2 KV heads
  cases.push_back({base, kvevict::errc::overflow, "limits.max_sequences"});  // a shared set: every sequence
  cases.back().o.scope = kvevict::selection_scope::per_layer;
  cases.back().o.limits.max_sequences = 65536;
  cases.push_back({base, kvevict::errc::overflow, "limits.max_tokens"});  // AdaKV ranks Hkv x L in one row
  cases.back().o.heads = kvevict::head_allocation::adakv;
  cases.back().o.limits.max_tokens = std::int64_t{1} << 30;
  // Tensor parallelism: a group of one (its rounds are the rank's own words); AdaKV and keep
  // sets shared by heads exchange scores between ranks, which the GPU does not.
  static const kvevict::collective alone = [] {
    kvevict::collective c;
    c.all_reduce = [](void*, std::uint32_t*, std::int64_t, kvevict::reduce_op) { return kvevict::status(); };
    return c;
  }();
  static const kvevict::collective broken{};
  cases.push_back({base, kvevict::errc::null_pointer, "tensor_parallel"});  // no all_reduce
  cases.back().o.tensor_parallel = &broken;
  cases.push_back({base, kvevict::errc::unsupported, "tensor_parallel"});
  cases.back().o.tensor_parallel = &alone;
  cases.back().o.heads = kvevict::head_allocation::adakv;
  cases.push_back({base, kvevict::errc::unsupported, "tensor_parallel"});
  cases.back().o.tensor_parallel = &alone;
  cases.back().o.scope = kvevict::selection_scope::per_layer;
  // Decode-time budgets: the decode window within limits.max_queries (the scoring batch's
  // workspace is sized by it), where the CPU accepts a longer one.
  cases.push_back({base, kvevict::errc::invalid_shape, "decoding.window"});
  cases.back().o.decoding.target = kvevict::budget::tokens(16);
  cases.back().o.decoding.interval = 8;
  cases.back().o.decoding.policy = kvevict::policy::h2o();
  cases.back().o.decoding.window = 17;
  cases.back().o.limits.max_queries = 16;
  for (const expect& c : cases) {
    const kvevict::status st = gpu::compressor_plan(c.o);
    INFO(c.arg << ": " << st.message());
    REQUIRE(st.code() == c.code);
    REQUIRE(std::string(st.argument()) == c.arg);
    if (c.arg == "policy.kind")
      REQUIRE(std::string(st.message()).find(kvevict::to_string(c.o.policy.kind())) != std::string::npos);
  }
  REQUIRE(gpu::compressor_plan(base).ok());
  kvevict::compressor_options one_rank = base;
  one_rank.tensor_parallel = &alone;
  REQUIRE(gpu::compressor_plan(one_rank).ok());
}

TEST_CASE("GPU compressor: a refused call changes nothing, and the next call goes on as the CPU's",
          "[gpu][gpu_errors][gpu_compressor]") {
  using kvevict::dtype;
  // DeferKV with delay 2: the call of layer 0 at decode step 2 evicts sequences 0 and 2 and
  // observes sequence 3's first step; spoiled, it must change nothing, and the session must go
  // on as if it had never been made.
  kvevict::compressor_options o = deferkv_options(dtype::bf16, dtype::bf16, 2);
  scenario<bf16, bf16> sc(o, true, 2, 31);
  const std::size_t at = 2 * kLayers;  // [prefill, step 1, step 2, step 3] x layers
  struct bad_call {
    const char* what;
    std::function<void(gpu::compressor_call<bf16, bf16>*)> spoil;
    kvevict::errc code;
    std::string arg;
  };
  const std::vector<bad_call> cases = {
      {"a decode step with the wrong token count",
       [](gpu::compressor_call<bf16, bf16>* c) {
         c->seqs[3].k.view.num_tokens += 1, c->seqs[3].v.view.num_tokens += 1;
       },
       kvevict::errc::invalid_shape, "seqs[3].keys.num_tokens"},
      {"a pool larger than limits.max_pool_blocks",
       [](gpu::compressor_call<bf16, bf16>* c) { c->seqs[2].v.view.num_pool_blocks = 65; },
       kvevict::errc::invalid_shape, "seqs[2].values.num_pool_blocks"},
      {"shared-block marks in host memory",
       [](gpu::compressor_call<bf16, bf16>* c) {
         static std::uint32_t host_bits[2];  // pageable host memory: refused before anything is enqueued
         c->seqs[0].raw_shared_blocks = host_bits;
       },
       kvevict::errc::invalid_argument, "seqs[0].shared_blocks"},
      {"two sequences on one state", [](gpu::compressor_call<bf16, bf16>* c) { c->seqs[2].state = 0; },
       kvevict::errc::invalid_argument, "seqs[2].state"},
      {"K outside device memory (found when sequence 2's step is prepared, after sequence 0's)",
       [](gpu::compressor_call<bf16, bf16>* c) {
         static bf16 host_keys[1];  // pageable host memory: passed through to the device call as is
         c->seqs[2].k.view.data = host_keys;
       },
       kvevict::errc::invalid_argument, "seqs[2].keys.data"},
  };
  const gpu::compressor_session_result ref = gpu::compressor_session<bf16, bf16>(o, sc.calls, 4);
  REQUIRE(ref.plan.ok());
  for (const bad_call& b : cases) {
    INFO(b.what);
    std::vector<gpu::compressor_call<bf16, bf16>> calls = sc.calls;
    gpu::compressor_call<bf16, bf16> spoiled = sc.calls[at];
    b.spoil(&spoiled);
    calls.insert(calls.begin() + static_cast<std::ptrdiff_t>(at), spoiled);
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
    REQUIRE(g.plan.ok());
    const gpu::compressor_call_result& bad = g.calls[at];
    INFO(bad.st.message());
    REQUIRE(bad.st.code() == b.code);
    REQUIRE(std::string(bad.st.argument()) == b.arg);
    REQUIRE(bad.states == g.calls[at - 1].states);  // no device state moved
    // The layer's pools as the same layer's previous call left them (step 1; the other layer's
    // call in between does not touch them).
    const gpu::compressor_call_result& before = ref.calls[at - kLayers];
    for (std::size_t s = 0; s < spoiled.seqs.size(); ++s) {
      REQUIRE(bad.reports[s].length == -9);  // untouched
      if (spoiled.seqs[s].k.buf.data == nullptr) continue;
      REQUIRE(bad.seqs[s].keys == before.seqs[s].keys);
      REQUIRE(bad.seqs[s].values == before.seqs[s].values);
      for (const auto* v : {&bad.seqs[s].head_lengths, &bad.seqs[s].kept_positions, &bad.seqs[s].padded})
        for (std::int64_t x : *v) REQUIRE(x == -7);
    }
    // Every later call as in the session without the refused one (host states untouched too:
    // a decode step's token count is checked against them).
    REQUIRE(g.calls.size() == ref.calls.size() + 1);
    for (std::size_t i = at; i < ref.calls.size(); ++i) {
      INFO("call " << i);
      const gpu::compressor_call_result &x = g.calls[i + 1], &y = ref.calls[i];
      REQUIRE(x.st.ok());
      REQUIRE(x.states == y.states);
      for (std::size_t s = 0; s < y.seqs.size(); ++s) {
        REQUIRE(x.reports[s].action == y.reports[s].action);
        REQUIRE(x.seqs[s].keys == y.seqs[s].keys);
        REQUIRE(x.seqs[s].values == y.seqs[s].values);
        REQUIRE(x.seqs[s].padded == y.seqs[s].padded);
      }
    }
  }
}

TEST_CASE("GPU compressor: errors found by a batched call name the run's sequence",
          "[gpu][gpu_errors][gpu_compressor]") {
  using kvevict::dtype;
  // SnapKV in place over caches of their own: sequence 3's K a view of sequence 2's buffer. The
  // compaction batch (sequences 0, 2, 3 of the run: its 0, 1, 2) refuses the shared buffer
  // before anything is enqueued, and the error names the run's sequence 3.
  scenario<bf16, bf16> sc(base_options(dtype::bf16, dtype::bf16), false, 0, 41);
  std::vector<gpu::compressor_call<bf16, bf16>> calls{sc.calls[static_cast<std::size_t>(kLayers)]};  // step 1, layer 0
  gpu::compressor_call<bf16, bf16>& c = calls[0];
  REQUIRE(c.seqs[3].event == kvevict::sequence_event::prefill_end);
  c.seqs[0].event = c.seqs[2].event = kvevict::sequence_event::prefill_end;  // all three evict here
  c.seqs[0].k.view.num_tokens = c.seqs[0].v.view.num_tokens = sc.prompts[0];
  c.seqs[2].k.view.num_tokens = c.seqs[2].v.view.num_tokens = sc.prompts[2];
  gpu::compressor_call<bf16, bf16> good = c;
  c.seqs[3].k = c.seqs[2].k;  // the first 16 tokens of sequence 2's K buffer
  c.seqs[3].k.view.num_tokens = sc.prompts[3];
  const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(sc.options, calls, 4);
  REQUIRE(g.plan.ok());
  INFO(g.calls[0].st.message());
  REQUIRE(g.calls[0].st.code() == kvevict::errc::invalid_argument);
  REQUIRE(std::string(g.calls[0].st.argument()) == "seqs[3].keys.data");
  for (std::size_t s = 0; s < c.seqs.size(); ++s) {
    REQUIRE(g.calls[0].reports[s].length == -9);
    if (c.seqs[s].k.buf.data == nullptr) continue;
    require_bytes<bf16>(g.calls[0].seqs[s].keys, c.seqs[s].k.buf);
    for (std::int64_t x : g.calls[0].seqs[s].padded) REQUIRE(x == -7);
  }
  // The unspoiled batch passes.
  REQUIRE(gpu::compressor_session<bf16, bf16>(sc.options, {good}, 4).calls[0].st.ok());
}

TEST_CASE("GPU compressor: refuses a paged in-place run with undeclared sharing or missing marks, and a short window",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  // As the CPU compressor: undeclared sharing, or block_sharing::marked without a sequence's
  // marks, is refused on the first call that compacts a paged cache in place (layer 0 at
  // prefill_end), whose buffers stay as they were.
  for (const kvevict::block_sharing sharing : {kvevict::block_sharing::undeclared, kvevict::block_sharing::marked}) {
    kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
    o.sharing = sharing;
    scenario<bf16, bf16> sc(o, true, 0, 41);
    const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, sc.calls, 4);
    REQUIRE(g.plan.ok());
    const gpu::compressor_call_result& first = g.calls[0];
    INFO(first.st.message());
    const bool marked = sharing == kvevict::block_sharing::marked;
    REQUIRE(first.st.code() == (marked ? kvevict::errc::null_pointer : kvevict::errc::invalid_argument));
    REQUIRE(std::string(first.st.argument()) == (marked ? "seqs[0].block_refcounts" : "sharing"));
    for (const auto& r : first.reports) REQUIRE(r.length == -9);  // untouched
  }
  // A prefill chunk with fewer queries than the window (6) is refused by name, as on the CPU.
  kvevict::compressor_options o = base_options(dtype::bf16, dtype::bf16);
  scenario<bf16, bf16> sc(o, true, 0, 42);
  std::vector<gpu::compressor_call<bf16, bf16>> calls = sc.calls;
  calls[0].seqs[0].queries.num_queries = 3;
  const gpu::compressor_session_result g = gpu::compressor_session<bf16, bf16>(o, calls, 4);
  REQUIRE(g.plan.ok());
  INFO(g.calls[0].st.message());
  REQUIRE(g.calls[0].st.code() == kvevict::errc::invalid_shape);
  REQUIRE(std::string(g.calls[0].st.argument()) == "seqs[0].queries.num_queries");
  // H2O observes every query of the call: more than limits.max_queries is refused by name (the
  // CPU compressor's error, run_checks.hpp) and the call changes nothing.
  kvevict::compressor_options h = base_options(dtype::bf16, dtype::bf16);
  h.policy = kvevict::policy::h2o();
  h.limits.max_queries = 40;  // sequence 0 hands its 61 prompt queries at prefill_end
  scenario<bf16, bf16> hs(h, true, 0, 44, false, {61, 0, 37, 16}, {0, 0, 0, 1}, 80);
  const gpu::compressor_session_result hg = gpu::compressor_session<bf16, bf16>(h, {hs.calls[0]}, 4);
  REQUIRE(hg.plan.ok());
  INFO(hg.calls[0].st.message());
  REQUIRE(hg.calls[0].st.code() == kvevict::errc::invalid_shape);
  REQUIRE(std::string(hg.calls[0].st.argument()) == "seqs[0].queries.num_queries");
  for (std::size_t s = 0; s < hs.calls[0].seqs.size(); ++s) {
    REQUIRE(hg.calls[0].reports[s].length == -9);
    if (hs.calls[0].seqs[s].k.buf.data != nullptr)
      require_bytes<bf16>(hg.calls[0].seqs[s].keys, hs.calls[0].seqs[s].k.buf);
  }
}

TEST_CASE("GPU compressor: a keep-list-only call checks the values view, as the CPU's does",
          "[gpu][gpu_errors][gpu_compressor]") {
  using kvevict::dtype;
  // keep_list_only never moves V, but a null values view is the engine's bug all the same: the
  // CPU compressor refuses it (it checks both views on every call), and so must the device.
  kvevict::compressor_options o = base_options(dtype::f32, dtype::f32);
  o.compact = kvevict::compaction::keep_list_only;
  scenario<float, float> sc(o, false, 0, 43);
  std::vector<gpu::compressor_call<float, float>> calls{sc.calls[0]};
  std::size_t evicting = calls[0].seqs.size();
  for (std::size_t s = 0; s < calls[0].seqs.size() && evicting == calls[0].seqs.size(); ++s)
    if (calls[0].seqs[s].event == kvevict::sequence_event::prefill_end) evicting = s;
  REQUIRE(evicting < calls[0].seqs.size());
  const gpu::compressor_session_result good = gpu::compressor_session<float, float>(o, calls, 4);
  REQUIRE(good.plan.ok());
  REQUIRE(good.calls[0].st.ok());
  calls[0].seqs[evicting].v.view.data = nullptr;
  const gpu::compressor_session_result g = gpu::compressor_session<float, float>(o, calls, 4);
  REQUIRE(g.plan.ok());
  INFO(g.calls[0].st.message());
  REQUIRE(!g.calls[0].st.ok());
  REQUIRE(std::string(g.calls[0].st.argument()) == "seqs[" + std::to_string(evicting) + "].values.data");
  for (const auto& r : g.calls[0].reports) REQUIRE(r.length == -9);  // no keep list written
}
