// kvevict::cuda::compressor against kvevict::compressor at an engine's scale: max_tokens in
// the thousands (prompts past 16 key tiles, so the row-LSE fold and the selection's tiles
// run long), per-head block tables (every KV head its own table over one pool), and fp16 and
// fp8 e5m2 storage. Compared call for call as in test_gpu_compressor.cpp: reports, the
// device outputs and every cache buffer afterwards.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <vector>

#include "compressor_runner.hpp"
#include "kvevict/compressor/compressor.hpp"
#include "kvevict/scoring/presets.hpp"
#include "shared_pool.hpp"
#include "support/test_cache.hpp"

using kvevict::fp16;
using kvevict::fp8_e5m2;

namespace {

constexpr std::int64_t kLayers = 2, kHq = 4, kHkv = 2, kDim = 32, kValueDim = 16;

/// Sanitizer runs of the simulator (KVEVICT_GPU_SWEEP_STRIDE > 1, as test_gpu.cpp's sweeps)
/// take shorter prompts, still past 16 key tiles.
bool trimmed() {
  const char* env = std::getenv("KVEVICT_GPU_SWEEP_STRIDE");
  return env != nullptr && std::strtol(env, nullptr, 10) > 1;
}

kvevict::compressor_options scale_options(kvevict::dtype storage, kvevict::dtype queries) {
  kvevict::compressor_options o;
  o.model = {kLayers, kHq, kHkv, kDim, kValueDim, storage, queries};
  kvevict::window_config w = kvevict::presets::kvpress_snapkv();
  w.window = 6;
  o.policy = kvevict::policy::snapkv(w);
  o.per_head = kvevict::budget::tokens(300);
  o.limits.max_sequences = 3;
  o.limits.max_tokens = 2100;
  o.limits.max_pool_blocks = 1024;
  o.sharing = kvevict::block_sharing::none;
  return o;
}

/// K and V of the given layouts: a paged layout is one pool per layer shared by the sequences
/// (never a block: block_sharing::none), as a batch's paged views must be; otherwise every
/// sequence owns its cache. Sequence 1 is idle. Calls: every layer at prefill_end, then `steps` decode steps of every
/// layer, then one more (after eviction).
template <class T, class Q>
struct scale_scenario {
  kvevict::compressor_options options;
  std::vector<std::int64_t> prompts =
      trimmed() ? std::vector<std::int64_t>{1100, 0, 1030} : std::vector<std::int64_t>{1500, 0, 2040};
  std::int64_t steps = 0;
  std::vector<gpu::shared_pool<T>> kpools, vpools;  // [layer]
  std::vector<test::test_cache<T>> k, v;            // [layer * seqs + s], unpaged layouts
  std::vector<test::test_queries<Q>> queries;       // [(layer * seqs + s) * (1 + steps) + step]
  std::vector<gpu::compressor_call<T, Q>> calls;

  std::size_t seqs() const { return prompts.size(); }
  std::size_t at(std::int64_t layer, std::size_t s) const { return static_cast<std::size_t>(layer) * seqs() + s; }

  scale_scenario(const kvevict::compressor_options& o, test::layout klay, test::layout vlay, std::int64_t decode_steps,
                 std::uint64_t seed)
      : options(o), steps(decode_steps) {
    const bool defer = options.policy.kind() == kvevict::policy_kind::deferkv;
    std::vector<std::int64_t> lengths;
    for (std::int64_t p : prompts) lengths.push_back(std::max<std::int64_t>(p + steps, 1));
    for (std::int64_t l = 0; l < kLayers; ++l) {
      const std::uint64_t ls = seed + 1000 * static_cast<std::uint64_t>(l);
      if (paged(klay)) kpools.emplace_back(klay, kHkv, lengths, kDim, ls);
      if (paged(vlay)) vpools.emplace_back(vlay, kHkv, lengths, kValueDim, ls + 10);
    }
    for (std::int64_t l = 0; l < kLayers; ++l)
      for (std::size_t s = 0; s < seqs(); ++s) {
        const std::int64_t n = std::max<std::int64_t>(prompts[s] + steps, 1);
        const std::uint64_t ss = seed + 1000 * static_cast<std::uint64_t>(l) + 100 * (s + 1);
        k.push_back(test::make_cache<T>(klay, kHkv, n, kDim,
                                        test::normal(static_cast<std::size_t>(kHkv * n * kDim), ss), 16, ss + 5));
        v.push_back(test::make_cache<T>(vlay, kHkv, n, kValueDim,
                                        test::normal(static_cast<std::size_t>(kHkv * n * kValueDim), ss + 1), 16,
                                        ss + 6));
        const std::int64_t w = std::min<std::int64_t>(prompts[s], 9);
        std::vector<std::int64_t> pos;
        for (std::int64_t t = 0; t < w; ++t) pos.push_back(prompts[s] - w + t);
        queries.push_back(test::make_queries<Q>(kHq, std::max<std::int64_t>(w, 1), kDim,
                                                test::normal(static_cast<std::size_t>(kHq * 9 * kDim), ss + 2, 2.0),
                                                pos.empty() ? std::vector<std::int64_t>{0} : pos));
        for (std::int64_t step = 1; step <= steps; ++step)
          queries.push_back(test::make_queries<Q>(
              kHq, 1, kDim, test::normal(static_cast<std::size_t>(kHq * kDim), ss + 10 + step, 2.0),
              {prompts[s] + step - 1}));
      }
    for (std::int64_t step = 0; step <= steps + 1; ++step)
      for (std::int64_t l = 0; l < kLayers; ++l) {
        gpu::compressor_call<T, Q> call;
        call.layer = l;
        for (std::size_t s = 0; s < seqs(); ++s) {
          gpu::compressor_sequence<T, Q> q;
          if (prompts[s] > 0) {
            const std::int64_t kstep = std::min(step, steps);
            const std::int64_t n = prompts[s] + kstep;
            q.event = step == 0 ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
            q.k = paged(klay) ? kpools[static_cast<std::size_t>(l)].side(s, n) : side(k[at(l, s)], n);
            q.v = paged(vlay) ? vpools[static_cast<std::size_t>(l)].side(s, n) : side(v[at(l, s)], n);
            const test::test_queries<Q>& tq =
                queries[at(l, s) * static_cast<std::size_t>(1 + steps) + static_cast<std::size_t>(kstep)];
            q.queries = tq.view;
            q.qbuf = gpu::buffer_of(tq.buffer);
            if (s == 2)  // unsorted, spaced positions
              for (std::int64_t j = 0; j < n; ++j) q.key_positions.push_back(3 * ((j * 7) % n) + 1);
          }
          q.state = defer ? static_cast<int>(s) : -1;
          call.seqs.push_back(q);
        }
        calls.push_back(call);
      }
  }

  static bool paged(test::layout lay) {
    return lay == test::layout::paged_per_head || lay == test::layout::paged_nhd || lay == test::layout::paged_hnd;
  }
  static gpu::side<T> side(test::test_cache<T>& c, std::int64_t n) {
    gpu::side<T> out{c.view, gpu::buffer_of(c.buffer), &c.table};
    out.view.num_tokens = n;
    return out;
  }
};

template <class T>
void require_bytes(const std::vector<unsigned char>& got, const gpu::host_buffer& want) {
  REQUIRE(got.size() == want.bytes);
  REQUIRE(std::memcmp(got.data(), want.data, want.bytes) == 0);
}

/// The GPU session, then the CPU compressor call by call over the host caches; compares.
template <class T, class Q>
void check_scale(scale_scenario<T, Q>& sc) {
  const gpu::compressor_session_result g = gpu::compressor_session<T, Q>(sc.options, sc.calls, 3);
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
        padded(n, std::vector<std::int64_t>(static_cast<std::size_t>(kHkv * head_cap), -7));
    for (std::size_t s = 0; s < n; ++s) {
      const gpu::compressor_sequence<T, Q>& q = call.seqs[s];
      io[s].event = q.event;
      io[s].keys = q.k.view;
      io[s].values = q.v.view;
      io[s].queries = q.queries;
      io[s].key_positions = q.key_positions.empty() ? kvevict::index_ptr(nullptr) : q.key_positions.data();
      io[s].state = q.state >= 0 ? states[static_cast<std::size_t>(q.state)].data() : nullptr;
      io[s].head_lengths = lengths[s].data();
      io[s].kept_positions = kept[s].data();
      io[s].padded_indices = padded[s].data();
    }
    std::vector<kvevict::sequence_report> reports(n);
    const kvevict::status st = cpu.run(call.layer, io.data(), static_cast<std::int64_t>(n), reports.data(), ws);
    INFO(st.message());
    REQUIRE(st.ok());
    for (std::size_t s = 0; s < n; ++s) {
      INFO("seqs[" << s << "]");
      const kvevict::sequence_report &c = reports[s], &r = gc.reports[s];
      REQUIRE(r.action == c.action);
      const gpu::compressor_sequence_result& out = gc.seqs[s];
      if (c.action != kvevict::sequence_action::evicted) {
        REQUIRE(r.length == c.length);
        continue;
      }
      ++evictions;
      if (sc.options.heads == kvevict::head_allocation::adakv) {  // lengths on the device only
        REQUIRE(*std::max_element(out.head_lengths.begin(), out.head_lengths.end()) == c.length);
      } else {
        REQUIRE(r.kept == c.kept);
        REQUIRE(r.length == c.length);
        REQUIRE(r.freed_blocks == c.freed_blocks);
      }
      REQUIRE(out.head_lengths == lengths[s]);
      REQUIRE(out.kept_positions == kept[s]);
      REQUIRE(out.padded == padded[s]);
    }
    for (std::size_t s = 0; s < n; ++s) {
      const gpu::compressor_sequence<T, Q>& q = call.seqs[s];
      if (q.k.buf.data == nullptr) continue;
      require_bytes<T>(gc.seqs[s].keys, q.k.buf);
      require_bytes<T>(gc.seqs[s].values, q.v.buf);
    }
  }
  REQUIRE(evictions == kLayers * 2);  // every layer of the two active sequences, once
}

}  // namespace

TEST_CASE("GPU compressor at scale: thousands of tokens, per-head block tables, fp16 and fp8 e5m2",
          "[gpu][gpu_compressor]") {
  using kvevict::dtype;
  using test::layout;
  SECTION("fp16, SnapKV, per-head K and V tables, in place") {
    scale_scenario<fp16, fp16> sc(scale_options(dtype::f16, dtype::f16), layout::paged_per_head, layout::paged_per_head,
                                  0, 41);
    check_scale(sc);
  }
  SECTION("fp8 e5m2 keys and values, fp16 queries, AdaKV heads, per-head K table, transposed V") {
    kvevict::compressor_options o = scale_options(dtype::f8_e5m2, dtype::f16);
    o.heads = kvevict::head_allocation::adakv;
    o.per_head = kvevict::budget::ratio(0.25);
    scale_scenario<fp8_e5m2, fp16> sc(o, layout::paged_per_head, layout::transposed, 0, 42);
    check_scale(sc);
  }
  SECTION("fp16, DeferKV with decode steps, one keep set per layer, per-head tables") {
    kvevict::compressor_options o = scale_options(dtype::f16, dtype::f16);
    kvevict::deferkv_config d;
    d.window = 5;
    d.delay = 2;
    d.eta = 0.8;
    o.policy = kvevict::policy::deferkv(d);
    o.scope = kvevict::selection_scope::per_layer;
    o.combine = kvevict::scope_combine::normalized_mean;
    scale_scenario<fp16, fp16> sc(o, layout::paged_per_head, layout::paged_hnd, 2, 43);
    check_scale(sc);
  }
}
