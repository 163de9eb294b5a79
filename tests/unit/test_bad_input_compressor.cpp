// The bad-input matrix (design.md §9) for the planned entry points: compressor::plan,
// reset_sequence and run, every policy's evict(), DeferKV's state over caller memory and
// select_layer. As in test_bad_input.cpp, every row makes one argument bad and requires the
// error code, the argument's name in status::argument() and the message, and that every cache,
// state, report, output buffer and the compressor itself are byte for byte what they were.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/checksum.hpp"
#include "support/test_cache.hpp"

namespace {

using kvevict::errc;
using i64 = std::int64_t;

// A policy kvevict's compressors do not list: its configuration can be built, never planned.
struct unlisted_traits {
  static constexpr kvevict::policy_kind kind = static_cast<kvevict::policy_kind>(9);
  using config_type = kvevict::streaming_llm_config;
};
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// A planned SnapKV and DeferKV compressor over two layers and three sequences (two strided,
/// one paged), with valid inputs for a prefill_end call, and every buffer a call may write.
struct world {
  static constexpr i64 layers = 2, hq = 4, hkv = 2, d = 8, l = 24, w = 4, block = 8, pool = 6;

  std::vector<float> k0, v0, k1, v1, pool_k, pool_v, q, dq;
  std::vector<std::int32_t> table_k{4, 0, 2, 5}, table_v{1, 5, 3, 0};  // 4 blocks: room for decode
  std::vector<i64> qpos, dqpos{l};
  std::vector<std::uint64_t> state0, state1, state2;
  std::vector<kvevict::sequence_report> reports;
  std::vector<i64> lengths, kept;
  std::vector<unsigned char> ws;
  kvevict::compressor snap, defer, unplanned;
  kvevict::compressor target;  ///< what plan() rows plan into (must stay as it was)

  static std::vector<float> data(std::size_t n, std::uint64_t seed) {
    const std::vector<double> x = test::normal(n, seed);
    return std::vector<float>(x.begin(), x.end());
  }
  static kvevict::compressor_options options(kvevict::policy_config p) {
    kvevict::compressor_options o;
    o.model = {layers, hq, hkv, d, 0, kvevict::dtype::f32};
    o.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
    o.policy = p;
    o.per_head = kvevict::budget::tokens(10);
    o.limits.max_sequences = 3;
    o.limits.max_tokens = l + 2;
    return o;
  }
  static kvevict::policy_config snapkv_policy() {
    kvevict::window_config c = kvevict::presets::kvpress_snapkv();
    c.window = w;
    return kvevict::policy::snapkv(c);
  }
  static kvevict::policy_config deferkv_policy() {
    kvevict::deferkv_config c;
    c.window = w;
    c.delay = 2;
    return kvevict::policy::deferkv(c);
  }

  world() {
    k0 = data(hkv * (l + 2) * d, 1);
    v0 = data(hkv * (l + 2) * d, 2);
    k1 = data(hkv * (l + 2) * d, 3);
    v1 = data(hkv * (l + 2) * d, 4);
    pool_k = data(pool * block * hkv * d, 5);
    pool_v = data(pool * block * hkv * d, 6);
    q = data(hq * w * d, 7);
    dq = data(hq * d, 8);
    for (i64 t = 0; t < w; ++t) qpos.push_back(l - w + t);
    REQUIRE(kvevict::compressor::plan(options(snapkv_policy()), &snap).ok());
    REQUIRE(kvevict::compressor::plan(options(deferkv_policy()), &defer).ok());
    target = snap;
    for (auto* s : {&state0, &state1, &state2}) {
      s->assign(defer.sequence_state_size() / 8 + 1, 0);
      REQUIRE(defer.reset_sequence(s->data(), s->size() * 8).ok());
    }
    reports.assign(3, kvevict::sequence_report{kvevict::sequence_action::observed, -1, -2, -3, -4, -5});
    lengths.assign(3 * hkv, -6);
    kept.assign(3 * static_cast<std::size_t>(defer.keep_capacity()), -7);
    ws.assign(std::max(snap.workspace_size(), defer.workspace_size()), 0);
  }

  kvevict::cache_view<float> strided(std::vector<float>& buf, i64 n) {
    return kvevict::hf_contiguous(buf.data(), hkv, n, d, l + 2);
  }
  /// A valid prefill_end batch: two strided sequences and a paged one.
  std::vector<kvevict::sequence_io<float>> prefill(bool with_state) {
    std::vector<kvevict::sequence_io<float>> io(3);
    io[0].keys = strided(k0, l);
    io[0].values = strided(v0, l);
    io[1].keys = strided(k1, l);
    io[1].values = strided(v1, l);
    io[2].keys = kvevict::vllm_paged(pool_k.data(), pool, block, hkv, d, table_k.data(), l);
    io[2].values = kvevict::vllm_paged(pool_v.data(), pool, block, hkv, d, table_v.data(), l);
    std::uint64_t* states[] = {state0.data(), state1.data(), state2.data()};
    for (std::size_t s = 0; s < 3; ++s) {
      io[s].event = kvevict::sequence_event::prefill_end;
      io[s].queries = kvevict::contiguous_queries<const float>(q.data(), hq, w, d, qpos.data());
      io[s].state = with_state ? states[s] : nullptr;
      io[s].head_lengths = lengths.data() + s * hkv;
      io[s].kept_positions = kept.data() + s * static_cast<std::size_t>(defer.keep_capacity());
    }
    return io;
  }
  /// The DeferKV batch after every sequence's prefill was observed: one decode step.
  std::vector<kvevict::sequence_io<float>> decode_after_prefill() {
    auto io = prefill(true);
    for (i64 layer = 0; layer < layers; ++layer) REQUIRE(defer.run(layer, io.data(), 3, reports.data(), span()).ok());
    reports.assign(3, kvevict::sequence_report{kvevict::sequence_action::observed, -1, -2, -3, -4, -5});
    for (auto& s : io) {
      s.event = kvevict::sequence_event::decode;
      s.keys.num_tokens = s.values.num_tokens = l + 1;
      s.queries = kvevict::contiguous_queries<const float>(dq.data(), hq, 1, d, dqpos.data());
    }
    io[2].keys.num_tokens = io[2].values.num_tokens = l + 1;
    return io;
  }
  kvevict::workspace_span span() { return {ws.data(), ws.size()}; }

  std::uint64_t checksum() const {
    std::uint64_t x = test::fnv_seed;
    for (const auto* f : {&k0, &v0, &k1, &v1, &pool_k, &pool_v, &q, &dq}) x = test::fnv(x, *f);
    for (const auto* f : {&state0, &state1, &state2}) x = test::fnv(x, *f);
    x = test::fnv(x, reports.data(), reports.size() * sizeof(kvevict::sequence_report));
    x = test::fnv(x, lengths);
    x = test::fnv(x, kept);
    x = test::fnv(x, &target, sizeof(target));
    return x;
  }
};

kvevict::workspace_span world_tiny() {
  static unsigned char bytes[16];
  return {bytes, sizeof(bytes)};
}

using call_fn = std::function<kvevict::status()>;
struct bad_case {
  std::string name;
  errc code;
  std::string argument;
  std::function<call_fn(world&)> prepare;
};

void run_table(const char* entry, const std::vector<bad_case>& rows) {
  for (const bad_case& c : rows) {
    world wd;
    const call_fn call = c.prepare(wd);
    const std::uint64_t before = wd.checksum();
    const kvevict::status st = call();
    INFO(entry << " / " << c.name << " -> " << kvevict::to_string(st.code()) << " [" << st.argument() << "] "
               << st.message());
    CHECK(st.code() == c.code);
    CHECK(std::string(st.argument()) == c.argument);
    const std::string message = st.message();
    CHECK(message.rfind("kvevict::", 0) == 0);
    CHECK(message.find(c.argument) != std::string::npos);
    CHECK(wd.checksum() == before);
  }
}

using mutate_options = std::function<void(kvevict::compressor_options&)>;
bad_case plan_row(std::string name, errc code, std::string arg, kvevict::policy_config p, mutate_options m) {
  return {std::move(name), code, std::move(arg), [p, m](world& wd) -> call_fn {
            kvevict::compressor_options o = world::options(p);
            m(o);
            return [&wd, o] { return kvevict::compressor::plan(o, &wd.target); };
          }};
}

using mutate_batch = std::function<void(world&, std::vector<kvevict::sequence_io<float>>&)>;
/// A row that runs `c` (snap or defer) at layer 1 on a batch prepared by `m`.
bad_case run_row(std::string name, errc code, std::string arg, bool deferred, bool decode, mutate_batch m) {
  return {std::move(name), code, std::move(arg), [deferred, decode, m](world& wd) -> call_fn {
            auto io = std::make_shared<std::vector<kvevict::sequence_io<float>>>(decode ? wd.decode_after_prefill()
                                                                                        : wd.prefill(deferred));
            m(wd, *io);
            const kvevict::compressor* c = deferred ? &wd.defer : &wd.snap;
            return [&wd, io, c] { return c->run(1, io->data(), 3, wd.reports.data(), wd.span()); };
          }};
}

}  // namespace

TEST_CASE("bad-input matrix: the unmutated compressor world is accepted", "[errors]") {
  world wd;
  auto io = wd.prefill(false);
  REQUIRE(wd.snap.run(1, io.data(), 3, wd.reports.data(), wd.span()).ok());
  REQUIRE(wd.reports[2].action == kvevict::sequence_action::evicted);
  world wd2;
  auto dio = wd2.decode_after_prefill();
  REQUIRE(wd2.defer.run(0, dio.data(), 3, wd2.reports.data(), wd2.span()).ok());
  REQUIRE(wd2.reports[1].action == kvevict::sequence_action::observed);
}

TEST_CASE("bad input: compressor::plan", "[errors]") {
  using kvevict::policy_config;
  const policy_config snap = world::snapkv_policy(), defer = world::deferkv_policy();
  auto r = [](std::string n, errc e, std::string a, policy_config p, mutate_options m) {
    return plan_row(std::move(n), e, std::move(a), p, std::move(m));
  };
  kvevict::dapq_config rerotate;
  rerotate.source = kvevict::dapq_source::rerotated_window;
  rerotate.rope.head_dim = world::d + 2;
  run_table(
      "compressor::plan",
      {
          {"null out", errc::null_pointer, "out",
           [](world&) -> call_fn { return [] { return kvevict::compressor::plan(world::options({}), nullptr); }; }},
          r("no layers", errc::invalid_shape, "model.num_layers", snap, [](auto& o) { o.model.num_layers = 0; }),
          r("no KV heads", errc::invalid_shape, "model.num_kv_heads", snap, [](auto& o) { o.model.num_kv_heads = 0; }),
          r("Hq not a multiple", errc::invalid_shape, "model.num_query_heads", snap,
            [](auto& o) { o.model.num_query_heads = 5; }),
          r("head_dim 0", errc::invalid_shape, "model.head_dim", snap, [](auto& o) { o.model.head_dim = 0; }),
          r("negative value head_dim", errc::invalid_shape, "model.value_head_dim", snap,
            [](auto& o) { o.model.value_head_dim = -1; }),
          r("unknown dtype", errc::invalid_argument, "model.storage", snap,
            [](auto& o) { o.model.storage = static_cast<kvevict::dtype>(7); }),
          r("no sequences", errc::invalid_shape, "limits.max_sequences", snap,
            [](auto& o) { o.limits.max_sequences = 0; }),
          r("no tokens", errc::invalid_shape, "limits.max_tokens", snap, [](auto& o) { o.limits.max_tokens = 0; }),
          r("2^32 tokens", errc::invalid_shape, "limits.max_tokens", snap,
            [](auto& o) { o.limits.max_tokens = i64{1} << 32; }),
          r("AdaKV: Hkv * L >= 2^32", errc::invalid_shape, "limits.max_tokens", snap,
            [](auto& o) {
              o.heads = kvevict::head_allocation::adakv;
              o.limits.max_tokens = (i64{1} << 31) + 1;
            }),
          r("negative max_queries", errc::invalid_shape, "limits.max_queries", snap,
            [](auto& o) { o.limits.max_queries = -1; }),
          r("max_queries below the window", errc::invalid_shape, "limits.max_queries", snap,
            [](auto& o) { o.limits.max_queries = world::w - 1; }),
          r("a policy outside the list", errc::invalid_argument, "policy.kind",
            kvevict::policy_config::of<unlisted_traits>({}), [](auto&) {}),
          r("negative chunk length", errc::invalid_argument, "policy.chunk_length", snap,
            [](auto& o) { o.policy.chunk_length = -1; }),
          r("chunks on DeferKV", errc::unsupported, "policy.chunk_length", defer,
            [](auto& o) { o.policy.chunk_length = 8; }),
          r("StreamingLLM: negative sinks", errc::invalid_argument, "policy.streaming_llm.sinks",
            kvevict::policy::streaming_llm({-1}), [](auto&) {}),
          r("StreamingLLM: above 2^24 tokens", errc::overflow, "limits.max_tokens", kvevict::policy::streaming_llm(),
            [](auto& o) { o.limits.max_tokens = (i64{1} << 24) + 1; }),
          r("KNorm: negative tail", errc::invalid_argument, "policy.knorm.protected_tail",
            kvevict::policy::knorm({-1, kvevict::protected_mode::inside_budget}), [](auto&) {}),
          r("KNorm: unknown mode", errc::invalid_argument, "policy.knorm.protect",
            kvevict::policy::knorm({2, static_cast<kvevict::protected_mode>(4)}), [](auto&) {}),
          r("TOVA: tail 0", errc::invalid_argument, "policy.tova.protected_tail",
            kvevict::policy::tova({0, kvevict::protected_mode::inside_budget}), [](auto&) {}),
          r("TOVA: unknown mode", errc::invalid_argument, "policy.tova.protect",
            kvevict::policy::tova({1, static_cast<kvevict::protected_mode>(4)}), [](auto&) {}),
          r("KeyDiff: negative tail", errc::invalid_argument, "policy.keydiff.protected_tail",
            kvevict::policy::keydiff({-1, kvevict::protected_mode::inside_budget}), [](auto&) {}),
          r("KeyDiff: unknown mode", errc::invalid_argument, "policy.keydiff.protect",
            kvevict::policy::keydiff({2, static_cast<kvevict::protected_mode>(4)}), [](auto&) {}),
          r("H2O: negative window", errc::invalid_argument, "policy.h2o.recent_window", kvevict::policy::h2o({-2}),
            [](auto&) {}),
          r("SnapKV: window 0", errc::invalid_argument, "policy.snapkv.window", snap,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::snapkv_traits>().window = 0; }),
          r("SnapKV: even pooling kernel", errc::invalid_argument, "params.pool.kernel", snap,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::snapkv_traits>().scoring.pool.kernel = 4; }),
          r("SnapKV: weighted window", errc::unsupported, "policy.snapkv.scoring.window", snap,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::snapkv_traits>().scoring.window = kvevict::window_aggregation::weighted; }),
          r("DeferKV: eta 0", errc::invalid_argument, "config.eta", defer, [](kvevict::compressor_options& o) { o.policy.config<kvevict::deferkv_traits>().eta = 0.0; }),
          r("DeferKV: eta NaN", errc::invalid_argument, "config.eta", defer,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::deferkv_traits>().eta = kNaN; }),
          r("DeferKV: max GQA", errc::unsupported, "config.gqa", defer,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::deferkv_traits>().gqa = kvevict::gqa_reduction::max; }),
          r("DeferKV: negative delay", errc::invalid_argument, "config.delay", defer,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::deferkv_traits>().delay = -1; }),
          r("DeferKV: window 0", errc::invalid_argument, "policy.deferkv.window", defer,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::deferkv_traits>().window = 0; }),
          r("DeferKV: window past 4096 (the CPU's and the GPU's limit)", errc::invalid_argument,
            "policy.deferkv.window", defer,
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::deferkv_traits>().window = 4097; }),
          r("DapQ: no pseudo tokens", errc::invalid_argument, "policy.dapq.pseudo_tokens", kvevict::policy::dapq(),
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::dapq_traits>().pseudo_tokens = 0; }),
          r("DapQ: unknown source", errc::invalid_argument, "policy.dapq.source", kvevict::policy::dapq(),
            [](kvevict::compressor_options& o) { o.policy.config<kvevict::dapq_traits>().source = static_cast<kvevict::dapq_source>(3); }),
          r("DapQ re-rotated: RoPE head_dim differs", errc::invalid_shape, "policy.dapq.rope.head_dim",
            kvevict::policy::dapq(rerotate), [](auto&) {}),
          r("DapQ re-rotated: odd rotary_dim", errc::invalid_argument, "rope.rotary_dim",
            kvevict::policy::dapq(rerotate),
            [](kvevict::compressor_options& o) {
              o.policy.config<kvevict::dapq_traits>().rope.head_dim = world::d;
              o.policy.config<kvevict::dapq_traits>().rope.rotary_dim = 3;
            }),
          r("ratio NaN", errc::invalid_argument, "per_head", snap,
            [](auto& o) { o.per_head = kvevict::budget::ratio(kNaN); }),
          r("ratio 1.5", errc::invalid_argument, "per_head", snap,
            [](auto& o) { o.per_head = kvevict::budget::ratio(1.5); }),
          r("negative tokens", errc::invalid_argument, "per_head", snap,
            [](auto& o) { o.per_head = kvevict::budget::tokens(-3); }),
          r("unknown head allocation", errc::invalid_argument, "heads", snap,
            [](auto& o) { o.heads = static_cast<kvevict::head_allocation>(5); }),
          r("AdaKV alpha 2", errc::invalid_argument, "adakv.alpha", snap,
            [](auto& o) {
              o.heads = kvevict::head_allocation::adakv;
              o.adakv.alpha = 2.0;
            }),
          r("unknown layer allocation", errc::invalid_argument, "layers", snap,
            [](auto& o) { o.layers = static_cast<kvevict::layer_allocation>(3); }),
          r("PyramidKV beta 0.5", errc::invalid_argument, "pyramid_beta", snap,
            [](auto& o) {
              o.layers = kvevict::layer_allocation::pyramidkv;
              o.pyramid_beta = 0.5;
            }),
          r("PyramidKV beta inf", errc::invalid_argument, "pyramid_beta", snap,
            [](auto& o) {
              o.layers = kvevict::layer_allocation::pyramidkv;
              o.pyramid_beta = std::numeric_limits<double>::infinity();
            }),
      });
}

TEST_CASE("bad input: compressor::reset_sequence", "[errors]") {
  run_table("compressor::reset_sequence",
            {
                {"unplanned", errc::invalid_state, "compressor",
                 [](world& wd) -> call_fn {
                   return [&wd] { return wd.unplanned.reset_sequence(wd.state0.data(), wd.state0.size() * 8); };
                 }},
                {"null state", errc::null_pointer, "state",
                 [](world& wd) -> call_fn {
                   return [&wd] { return wd.defer.reset_sequence(nullptr, wd.state0.size() * 8); };
                 }},
                {"misaligned state", errc::invalid_argument, "state",
                 [](world& wd) -> call_fn {
                   return [&wd] {
                     return wd.defer.reset_sequence(reinterpret_cast<unsigned char*>(wd.state0.data()) + 4,
                                                    wd.state0.size() * 8 - 4);
                   };
                 }},
                {"too small", errc::invalid_shape, "bytes",
                 [](world& wd) -> call_fn {
                   return
                       [&wd] { return wd.defer.reset_sequence(wd.state0.data(), wd.defer.sequence_state_size() - 1); };
                 }},
            });
}

TEST_CASE("bad input: compressor::run", "[errors]") {
  auto r = [](std::string n, errc e, std::string a, mutate_batch m) {
    return run_row(std::move(n), e, std::move(a), false, false, std::move(m));
  };
  auto d = [](std::string n, errc e, std::string a, mutate_batch m) {
    return run_row(std::move(n), e, std::move(a), true, false, std::move(m));
  };
  auto dd = [](std::string n, errc e, std::string a, mutate_batch m) {
    return run_row(std::move(n), e, std::move(a), true, true, std::move(m));
  };
  using io_vec = std::vector<kvevict::sequence_io<float>>;
  static std::vector<i64> negative_pos{20, -1, 22, 23}, early_pos{0, 1, 2, 3};
  static std::vector<float> lse(world::hq * world::w, 2.0f);
  static std::vector<float> bf16_pool(10);
  static std::vector<float> long_step(world::hq * (world::w + 1) * world::d, 0.5f);
  static std::vector<i64> long_step_pos{24, 25, 26, 27, 28};
  run_table(
      "compressor::run",
      {
          {"unplanned", errc::invalid_state, "compressor",
           [](world& wd) -> call_fn {
             return [&wd] {
               auto io = wd.prefill(false);
               return wd.unplanned.run(0, io.data(), 3, wd.reports.data(), wd.span());
             };
           }},
          {"views of another type", errc::invalid_argument, "seqs",
           [](world& wd) -> call_fn {
             return [&wd] {
               kvevict::sequence_io<kvevict::bf16> io;
               return wd.snap.run(0, &io, 1, wd.reports.data(), wd.span());
             };
           }},
          {"layer -1", errc::out_of_range, "layer",
           [](world& wd) -> call_fn {
             return [&wd] {
               auto io = wd.prefill(false);
               return wd.snap.run(-1, io.data(), 3, wd.reports.data(), wd.span());
             };
           }},
          {"layer past the model", errc::out_of_range, "layer",
           [](world& wd) -> call_fn {
             return [&wd] {
               auto io = wd.prefill(false);
               return wd.snap.run(world::layers, io.data(), 3, wd.reports.data(), wd.span());
             };
           }},
          {"more sequences than planned", errc::invalid_shape, "num_seqs",
           [](world& wd) -> call_fn {
             return [&wd] {
               auto io = wd.prefill(false);
               io.push_back(io[0]);
               return wd.snap.run(0, io.data(), 4, wd.reports.data(), wd.span());
             };
           }},
          {"negative count", errc::invalid_shape, "num_seqs",
           [](world& wd) -> call_fn {
             return [&wd] {
               auto io = wd.prefill(false);
               return wd.snap.run(0, io.data(), -1, wd.reports.data(), wd.span());
             };
           }},
          {"null seqs", errc::null_pointer, "seqs",
           [](world& wd) -> call_fn {
             return [&wd] { return wd.snap.run<float, float>(0, nullptr, 2, wd.reports.data(), wd.span()); };
           }},
          {"null reports", errc::null_pointer, "reports",
           [](world& wd) -> call_fn {
             return [&wd] {
               auto io = wd.prefill(false);
               return wd.snap.run(0, io.data(), 3, nullptr, wd.span());
             };
           }},
          {"workspace too small", errc::workspace_too_small, "ws",
           [](world& wd) -> call_fn {
             return [&wd] {
               auto io = wd.prefill(false);
               return wd.snap.run(0, io.data(), 3, wd.reports.data(), {wd.ws.data(), wd.snap.workspace_size() / 2});
             };
           }},
          r("unknown event", errc::invalid_argument, "seqs[1].event",
            [](world&, io_vec& io) { io[1].event = static_cast<kvevict::sequence_event>(7); }),
          r("a prompt chunk in a plan without chunked_prefill", errc::invalid_argument, "seqs[1].event",
            [](world&, io_vec& io) { io[1].event = kvevict::sequence_event::prefill_chunk; }),
          r("keys: wrong head count", errc::invalid_shape, "seqs[0].values.num_heads",
            [](world&, io_vec& io) { io[0].keys.num_heads = 1; }),
          r("keys and values: both wrong head count", errc::invalid_shape, "seqs[0].keys",
            [](world&, io_vec& io) { io[0].keys.num_heads = io[0].values.num_heads = 1; }),
          r("keys: head_dim differs from the model", errc::invalid_shape, "seqs[2].keys",
            [](world&, io_vec& io) { io[2].keys.head_dim = 4; }),
          r("values: head_dim differs from the model", errc::invalid_shape, "seqs[2].values.head_dim",
            [](world&, io_vec& io) { io[2].values.head_dim = 4; }),
          r("more tokens than planned", errc::invalid_shape, "seqs[1].keys.num_tokens",
            [](world& wd, io_vec& io) {
              io[1].keys = kvevict::hf_contiguous(wd.k1.data(), world::hkv, world::l + 3, world::d, world::l + 3);
              io[1].values = kvevict::hf_contiguous(wd.v1.data(), world::hkv, world::l + 3, world::d, world::l + 3);
            }),
          r("K and V lengths differ", errc::invalid_shape, "seqs[1].values.num_tokens",
            [](world&, io_vec& io) { io[1].values.num_tokens = world::l - 1; }),
          r("K and V are one buffer", errc::invalid_argument, "seqs[0].values.data",
            [](world&, io_vec& io) { io[0].values = io[0].keys; }),
          r("overlapping key strides", errc::invalid_stride, "seqs[0].keys.token_stride",
            [](world&, io_vec& io) { io[0].keys.token_stride = 2; }),
          r("null key data", errc::null_pointer, "seqs[1].keys.data",
            [](world&, io_vec& io) { io[1].keys.data = nullptr; }),
          r("block id outside the pool", errc::out_of_range, "seqs[2].keys.block_table[1]",
            [](world& wd, io_vec&) { wd.table_k[1] = world::pool; }),
          r("block id repeated", errc::invalid_argument, "seqs[2].keys.block_table[2]",
            [](world& wd, io_vec&) { wd.table_k[2] = wd.table_k[0]; }),
          r("no queries", errc::invalid_shape, "seqs[0].queries.num_heads",
            [](world&, io_vec& io) { io[0].queries = {}; }),
          r("queries of another model", errc::invalid_shape, "seqs[1].queries",
            [](world& wd, io_vec& io) {
              io[1].queries =
                  kvevict::contiguous_queries<const float>(wd.q.data(), 2, world::w, world::d, wd.qpos.data());
            }),
          r("negative query position", errc::out_of_range, "seqs[2].queries.positions[1]",
            [](world&, io_vec& io) { io[2].queries.positions = negative_pos.data(); }),
          r("null query positions", errc::null_pointer, "seqs[0].queries.positions",
            [](world&, io_vec& io) { io[0].queries.positions = nullptr; }),
          r("LSE rows closer than W", errc::invalid_stride, "seqs[0].lse_head_stride",
            [](world&, io_vec& io) {
              io[0].lse = lse.data();
              io[0].lse_head_stride = world::w - 1;
            }),
          {"more queries than planned (H2O over at most 4)", errc::invalid_shape, "seqs[0].queries.num_queries",
           [](world& wd) -> call_fn {
             kvevict::compressor_options o = world::options(kvevict::policy::h2o());
             o.limits.max_queries = world::w - 1;
             auto c = std::make_shared<kvevict::compressor>();
             REQUIRE(kvevict::compressor::plan(o, c.get()).ok());
             return [&wd, c] {
               auto io = wd.prefill(false);
               return c->run(0, io.data(), 3, wd.reports.data(), wd.span());
             };
           }},
          {"DapQ: pseudo positions inside the prompt", errc::out_of_range, "seqs[0].queries.positions",
           [](world& wd) -> call_fn {
             kvevict::dapq_config q;
             q.pseudo_tokens = world::w;
             auto c = std::make_shared<kvevict::compressor>();
             REQUIRE(kvevict::compressor::plan(world::options(kvevict::policy::dapq(q)), c.get()).ok());
             return [&wd, c] {
               auto io = wd.prefill(false);
               io[0].queries.positions = early_pos.data();
               return c->run(0, io.data(), 3, wd.reports.data(), wd.span());
             };
           }},
          // DapQ normalises over the prompt's keys, for queries the engine's attention normalised
          // otherwise (or never saw: the re-rotated window): an engine LSE is refused, both sources.
          {"DapQ: LSE passed (pseudo tokens)", errc::unsupported, "seqs[0].lse",
           [](world& wd) -> call_fn {
             kvevict::dapq_config q;
             q.pseudo_tokens = world::w;
             auto c = std::make_shared<kvevict::compressor>();
             REQUIRE(kvevict::compressor::plan(world::options(kvevict::policy::dapq(q)), c.get()).ok());
             return [&wd, c] {
               auto io = wd.prefill(false);
               io[0].lse = lse.data();
               return c->run(0, io.data(), 3, wd.reports.data(), wd.span());
             };
           }},
          {"DapQ: LSE passed (re-rotated window)", errc::unsupported, "seqs[2].lse",
           [](world& wd) -> call_fn {
             kvevict::dapq_config q;
             q.pseudo_tokens = world::w;
             q.source = kvevict::dapq_source::rerotated_window;
             q.rope.head_dim = world::d;
             auto c = std::make_shared<kvevict::compressor>();
             REQUIRE(kvevict::compressor::plan(world::options(kvevict::policy::dapq(q)), c.get()).ok());
             auto ws = std::make_shared<kvevict::workspace>(c->workspace_size());  // the rotation's too
             return [&wd, c, ws] {
               auto io = wd.prefill(false);
               io[2].lse = lse.data();
               return c->run(0, io.data(), 3, wd.reports.data(), *ws);
             };
           }},
          // Chunked prefill: a last chunk with fewer queries than the window must not score.
          r("SnapKV: fewer queries than its window at prefill_end", errc::invalid_shape, "seqs[1].queries.num_queries",
            [](world&, io_vec& io) { io[1].queries.num_queries = world::w - 1; }),
          d("DeferKV: fewer queries than its window at prefill_end", errc::invalid_shape, "seqs[2].queries.num_queries",
            [](world&, io_vec& io) { io[2].queries.num_queries = 1; }),
          {"DapQ: fewer pseudo queries than N", errc::invalid_shape, "seqs[0].queries.num_queries",
           [](world& wd) -> call_fn {
             kvevict::dapq_config q;
             q.pseudo_tokens = world::w;
             auto c = std::make_shared<kvevict::compressor>();
             REQUIRE(kvevict::compressor::plan(world::options(kvevict::policy::dapq(q)), c.get()).ok());
             return [&wd, c] {
               auto io = wd.prefill(false);
               io[0].queries.num_queries = world::w - 1;
               io[0].queries.positions += 1;  // still the last ones, past the prompt
               return c->run(0, io.data(), 3, wd.reports.data(), wd.span());
             };
           }},
          {"H2O: fewer than every prompt query", errc::invalid_shape, "seqs[0].queries.num_queries",
           [](world& wd) -> call_fn {
             auto c = std::make_shared<kvevict::compressor>();
             REQUIRE(kvevict::compressor::plan(world::options(kvevict::policy::h2o()), c.get()).ok());
             return [&wd, c] {
               auto io = wd.prefill(false);  // the last W = 4 of 24 prompt queries
               std::vector<unsigned char> ws(c->workspace_size());
               return c->run(0, io.data(), 3, wd.reports.data(), {ws.data(), ws.size()});
             };
           }},
          d("DeferKV: null state", errc::null_pointer, "seqs[1].state",
            [](world&, io_vec& io) { io[1].state = nullptr; }),
          d("DeferKV: state never reset", errc::invalid_state, "seqs[2].state",
            [](world& wd, io_vec&) { std::fill(wd.state2.begin(), wd.state2.end(), 0); }),
          d("DeferKV: misaligned state", errc::invalid_argument, "seqs[0].state",
            [](world&, io_vec& io) { io[0].state = static_cast<unsigned char*>(io[0].state) + 4; }),
          d("DeferKV: one state for two sequences", errc::invalid_argument, "seqs[2].state",
            [](world&, io_vec& io) { io[2].state = io[0].state; }),
          d("DeferKV: a state overlapping another sequence's", errc::invalid_argument, "seqs[2].state",
            [](world&, io_vec& io) { io[2].state = static_cast<unsigned char*>(io[0].state) + 64; }),
          d("DeferKV: a decode step before prefill", errc::invalid_state, "seqs[1].event",
            [](world& wd, io_vec& io) {
              io[1].event = kvevict::sequence_event::decode;
              io[1].queries =
                  kvevict::contiguous_queries<const float>(wd.dq.data(), world::hq, 1, world::d, wd.dqpos.data());
            }),
          d("DeferKV: LSE passed", errc::unsupported, "seqs[0].lse",
            [](world&, io_vec& io) { io[0].lse = lse.data(); }),
          dd("DeferKV: prefill twice", errc::invalid_state, "seqs[0].state",
             [](world&, io_vec& io) { io[0].event = kvevict::sequence_event::prefill_end; }),
          dd("DeferKV: a step of two queries, one new token in the cache", errc::invalid_shape,
             "seqs[1].keys.num_tokens",
             [](world& wd, io_vec& io) {
               io[1].queries =
                   kvevict::contiguous_queries<const float>(wd.q.data(), world::hq, 2, world::d, wd.qpos.data());
             }),
          dd("DeferKV: a step of more tokens than limits.max_queries", errc::invalid_shape,
             "seqs[1].queries.num_queries",
             [](world&, io_vec& io) {
               io[1].queries = kvevict::contiguous_queries<const float>(long_step.data(), world::hq, world::w + 1,
                                                                        world::d, long_step_pos.data());
             }),
          dd("DeferKV: decode without the new token", errc::invalid_shape, "seqs[2].keys.num_tokens",
             [](world&, io_vec& io) { io[2].keys.num_tokens = io[2].values.num_tokens = world::l; }),
      });
}

TEST_CASE("bad input: policy evict(), select_layer and deferkv over caller memory", "[errors]") {
  struct evict_world {
    std::vector<float> k, v, q;
    std::vector<i64> pos;
    std::vector<i64> lengths;
    kvevict::eviction_result result;
    std::vector<unsigned char> ws;
  };
  auto c = [](std::string n, errc e, std::string a, std::function<kvevict::status(world&)> f) {
    return bad_case{std::move(n), e, std::move(a), [f](world& wd) -> call_fn { return [&wd, f] { return f(wd); }; }};
  };
  auto cache = [](world& wd) {
    return kvevict::layer_cache<float>{wd.strided(wd.k0, world::l), wd.strided(wd.v0, world::l)};
  };
  auto observed = [](world& wd) {
    kvevict::layer_observations<float> o;
    o.queries = kvevict::contiguous_queries<const float>(wd.q.data(), world::hq, world::w, world::d, wd.qpos.data());
    return o;
  };
  auto result = [](world& wd) {
    kvevict::eviction_result r;
    r.head_lengths = wd.lengths.data();
    r.positions = wd.kept.data();
    return r;
  };
  auto budget = [](kvevict::budget b) {
    kvevict::layer_budget lb;
    lb.per_head = b;
    return lb;
  };
  kvevict::window_config press = kvevict::presets::kvpress_snapkv();
  press.window = world::w;
  run_table(
      "policy evict()",
      {
          c("snapkv: ratio NaN", errc::invalid_argument, "budget.per_head",
            [=](world& wd) {
              auto r = result(wd);
              return kvevict::snapkv<float>(press).evict(cache(wd), observed(wd), budget(kvevict::budget::ratio(kNaN)),
                                                         r, wd.span());
            }),
          c("snapkv: negative layer candidates", errc::invalid_argument, "budget.layer_candidates",
            [=](world& wd) {
              auto r = result(wd);
              kvevict::layer_budget b = budget(kvevict::budget::tokens(8));
              b.layer_candidates = -2;
              return kvevict::snapkv<float>(press).evict(cache(wd), observed(wd), b, r, wd.span());
            }),
          c("snapkv: workspace too small", errc::workspace_too_small, "ws",
            [=](world& wd) {
              auto r = result(wd);
              const kvevict::snapkv<float> p(press);
              const auto b = budget(kvevict::budget::tokens(8));
              const std::size_t need = p.evict_workspace_size({world::hq, world::hkv, world::d, world::l, world::w}, b);
              return p.evict(cache(wd), observed(wd), b, r, {wd.ws.data(), need / 2});
            }),
          c("snapkv: more queries than W", errc::invalid_shape, "queries.num_queries",
            [=](world& wd) {
              auto r = result(wd);
              kvevict::window_config small = press;
              small.window = world::w - 1;
              return kvevict::snapkv<float>(small).evict(cache(wd), observed(wd), budget(kvevict::budget::tokens(8)), r,
                                                         wd.span());
            }),
          c("knorm: V shorter than K", errc::invalid_shape, "cache.values.num_tokens",
            [=](world& wd) {
              auto r = result(wd);
              auto kv = cache(wd);
              kv.values.num_tokens -= 1;
              return kvevict::knorm<float>().evict(kv, {}, budget(kvevict::budget::tokens(8)), r, wd.span());
            }),
          c("streaming_llm: K and V one buffer", errc::invalid_argument, "cache.values.data",
            [=](world& wd) {
              auto r = result(wd);
              auto kv = cache(wd);
              kv.values = kv.keys;
              return kvevict::streaming_llm<float>().evict(kv, {}, budget(kvevict::budget::tokens(8)), r, wd.span());
            }),
          c("h2o: AdaKV alpha NaN", errc::invalid_argument, "budget.adakv.alpha",
            [=](world& wd) {
              auto r = result(wd);
              kvevict::layer_budget b = budget(kvevict::budget::tokens(8));
              b.heads = kvevict::head_allocation::adakv;
              b.adakv.alpha = kNaN;
              return kvevict::h2o<float>().evict(cache(wd), observed(wd), b, r, wd.span());
            }),
          c("chunkkv: chunk length 0", errc::invalid_argument, "config.chunk_length",
            [=](world& wd) {
              auto r = result(wd);
              return kvevict::chunkkv<kvevict::knorm<float>>(kvevict::knorm<float>(), {0})
                  .evict(cache(wd), {}, budget(kvevict::budget::tokens(8)), r, wd.span());
            }),
          c("dapq: fewer tokens than pseudo queries", errc::invalid_shape, "cache.keys.num_tokens",
            [=](world& wd) {
              auto r = result(wd);
              auto kv = cache(wd);
              kv.keys.num_tokens = kv.values.num_tokens = world::w - 1;
              return kvevict::dapq<float>().evict(kv, observed(wd), budget(kvevict::budget::tokens(8)), r, wd.span());
            }),
          c("dapq re-rotated: RoPE of another head_dim", errc::invalid_shape, "rope.head_dim",
            [=](world& wd) {
              auto r = result(wd);
              kvevict::dapq_config q;
              q.source = kvevict::dapq_source::rerotated_window;
              q.rope.head_dim = world::d * 2;
              return kvevict::dapq<float>(q).evict(cache(wd), observed(wd), budget(kvevict::budget::tokens(8)), r,
                                                   wd.span());
            }),
          c("deferkv: evict before ready", errc::invalid_state, "state",
            [=](world& wd) {
              auto r = result(wd);
              kvevict::layer_observations<float> o;
              o.state = {wd.state0.data() + 8, wd.state0.size() * 8 - 64};  // layer 0's state (empty)
              return kvevict::deferkv<float>(world::deferkv_policy().config<kvevict::deferkv_traits>())
                  .evict(cache(wd), o, budget(kvevict::budget::tokens(8)), r, wd.span());
            }),
          c("deferkv: uninitialised memory", errc::invalid_state, "state",
            [=](world& wd) {
              auto r = result(wd);
              kvevict::layer_observations<float> o;
              o.state = {wd.state0.data(), 256};  // the sequence header, not a layer state
              return kvevict::deferkv<float>().evict(cache(wd), o, budget(kvevict::budget::tokens(8)), r, wd.span());
            }),
          c("deferkv: init_state into too little memory", errc::invalid_shape, "state.size",
            [=](world& wd) {
              // Writes nothing: the state is too small for 2 x 24.
              return kvevict::deferkv<float>().init_state({wd.kept.data(), 64}, world::hkv, world::l);
            }),
          c("deferkv: observe_decode before prefill", errc::invalid_state, "state",
            [=](world& wd) {
              kvevict::layer_inputs<float> in;
              in.keys = wd.strided(wd.k0, world::l + 1);
              in.queries =
                  kvevict::contiguous_queries<const float>(wd.dq.data(), world::hq, 1, world::d, wd.dqpos.data());
              in.state = {wd.state0.data() + 8, wd.state0.size() * 8 - 64};
              return kvevict::deferkv<float>(world::deferkv_policy().config<kvevict::deferkv_traits>())
                  .observe_decode(in, wd.span());
            }),
          c("select_layer: no heads", errc::invalid_shape, "scores.rows",
            [=](world& wd) {
              std::vector<float> s(4);
              kvevict::keep_list keep(1, 4);
              return kvevict::select_layer({s.data(), 0, 4, 4}, {}, budget(kvevict::budget::tokens(2)), keep,
                                           wd.span());
            }),
          c("select_layer: negative tail", errc::invalid_argument, "sel.protected_tail",
            [=](world& wd) {
              std::vector<float> s(8);
              kvevict::keep_list keep(2, 8);
              return kvevict::select_layer({s.data(), 2, 4, 4}, {-1, kvevict::protected_mode::inside_budget},
                                           budget(kvevict::budget::tokens(2)), keep, wd.span());
            }),
      });
}

TEST_CASE("regression: select_capacity is defined for NaN and out-of-range ratios", "[errors]") {
  const kvevict::selection_params sel{4, kvevict::protected_mode::inside_budget};
  // Before the fix, budget::resolve cast L * (1 - ratio) to int64 unchecked: UB under UBSan.
  CHECK(kvevict::select_capacity(8, 1000, kvevict::budget::ratio(kNaN), sel) == 8 * 4);
  CHECK(kvevict::select_capacity(8, 1000, kvevict::budget::ratio(-1e300), sel) == 8 * 1000);
  CHECK(kvevict::select_capacity(8, 1000, kvevict::budget::ratio(2.0), sel) == 8 * 4);
  CHECK(kvevict::select_capacity(8, 1000, kvevict::budget::ratio(0.25), sel) == 8 * 750);
  CHECK(kvevict::budget::ratio(kNaN).resolve(1000) == 0);
  CHECK(kvevict::select_capacity(i64{1} << 40, i64{1} << 40, kvevict::budget::ratio(0.0)) == INT64_MAX);
}

TEST_CASE("regression: snapkv::score rejects more window queries than W", "[errors]") {
  world wd;
  std::vector<float> scores(world::hkv * world::l, 5.0f);
  kvevict::window_config c = kvevict::presets::kvpress_snapkv();
  c.window = world::w - 1;
  kvevict::layer_inputs<float> in;
  in.keys = wd.strided(wd.k0, world::l);
  in.queries = kvevict::contiguous_queries<const float>(wd.q.data(), world::hq, world::w, world::d, wd.qpos.data());
  const kvevict::status st =
      kvevict::snapkv<float>(c).score(in, {scores.data(), world::hkv, world::l, world::l}, wd.span());
  CHECK(st.code() == errc::invalid_shape);
  CHECK(std::string(st.argument()) == "queries.num_queries");
  for (float x : scores) CHECK(x == 5.0f);
}

TEST_CASE("bad input: engine contracts (evict_into, shared blocks, scopes, per-head tables)", "[errors]") {
  auto c = [](std::string n, errc e, std::string a, std::function<kvevict::status(world&)> f) {
    return bad_case{std::move(n), e, std::move(a), [f](world& wd) -> call_fn { return [&wd, f] { return f(wd); }; }};
  };
  // A keep-list over the strided sequence 0 (24 tokens, 2 heads).
  static std::vector<i64> off{0, 3, 6}, idx{1, 5, 20, 0, 7, 23};
  const kvevict::const_keep_list_view keep{2, off.data(), idx.data(), 6};
  auto src_k = [](world& wd) { return wd.strided(wd.k0, world::l); };
  auto src_v = [](world& wd) { return wd.strided(wd.v0, world::l); };
  auto dst_k = [](world& wd) { return wd.strided(wd.k1, 3); };
  auto dst_v = [](world& wd) { return wd.strided(wd.v1, 3); };
  auto paged = [](world& wd, std::vector<float>& pool, std::vector<std::int32_t>& table, i64 n) {
    (void)wd;
    return kvevict::vllm_paged(pool.data(), world::pool, world::block, world::hkv, world::d, table.data(), n);
  };
  static std::vector<std::int32_t> refs(world::pool, 1), fresh{3}, reused{0};
  refs[4] = 2;  // block 4 (sequence 2's first K block) is shared
  auto run_opts = [](world& wd, kvevict::compressor_options o,
                     std::function<void(world&, std::vector<kvevict::sequence_io<float>>&)> m, bool state, bool warm,
                     std::function<void(std::vector<kvevict::sequence_io<float>>&)> last) {
    kvevict::compressor cc;
    REQUIRE(kvevict::compressor::plan(o, &cc).ok());
    std::vector<std::uint64_t> st(cc.sequence_state_size() / 8 + 1);
    auto io = wd.prefill(false);
    if (state)
      for (auto& s : io) {
        s.state = st.data();
        REQUIRE(cc.reset_sequence(st.data(), st.size() * 8).ok());
      }
    m(wd, io);
    std::vector<unsigned char> ws(cc.workspace_size());
    const i64 n = state ? 1 : 3;
    if (warm) {  // layer 0 runs first (its own reports): the failing call is the last layer's
      std::vector<kvevict::sequence_report> own(3);
      REQUIRE(cc.run(0, io.data(), n, own.data(), {ws.data(), ws.size()}).ok());
    }
    if (last) last(io);  // what only the last layer's call sees
    return cc.run(1, io.data(), n, wd.reports.data(), {ws.data(), ws.size()});
  };
  run_table(
      "engine contracts",
      {
          c("evict_into: destination too short", errc::invalid_shape, "dst_keys.num_tokens",
            [=](world& wd) {
              kvevict::eviction_result r;
              return kvevict::evict_into(src_k(wd), src_v(wd), wd.strided(wd.k1, 2), wd.strided(wd.v1, 2), keep, r,
                                         wd.span());
            }),
          c("evict_into: destination is the source", errc::invalid_argument, "dst_keys.data",
            [=](world& wd) {
              kvevict::eviction_result r;
              return kvevict::evict_into(src_k(wd), src_v(wd), wd.strided(wd.k0, 3), dst_v(wd), keep, r, wd.span());
            }),
          c("evict_into: destination K and V one buffer", errc::invalid_argument, "dst_values.data",
            [=](world& wd) {
              kvevict::eviction_result r;
              return kvevict::evict_into(src_k(wd), src_v(wd), dst_k(wd), dst_k(wd), keep, r, wd.span());
            }),
          c("evict_into: destination head_dim differs", errc::invalid_shape, "dst_values.head_dim",
            [=](world& wd) {
              kvevict::eviction_result r;
              auto dv = dst_v(wd);
              dv.head_dim = 4;
              return kvevict::evict_into(src_k(wd), src_v(wd), dst_k(wd), dv, keep, r, wd.span());
            }),
          c("evict_into: bad keep-list", errc::invalid_keep_list, "keep.indices",
            [=](world& wd) {
              static std::vector<i64> bad{1, 5, 20, 0, 7, 24};
              kvevict::eviction_result r;
              return kvevict::evict_into(src_k(wd), src_v(wd), dst_k(wd), dst_v(wd),
                                         kvevict::const_keep_list_view{2, off.data(), bad.data(), 6}, r, wd.span());
            }),
          c("evict_into: a fresh block the source uses", errc::invalid_argument, "dst_keys.block_table",
            [=](world& wd) {
              kvevict::eviction_result r;
              const auto sk = paged(wd, wd.pool_k, wd.table_k, world::l),
                         sv = paged(wd, wd.pool_v, wd.table_v, world::l);
              return kvevict::evict_into(sk, sv, paged(wd, wd.pool_k, reused, 3), paged(wd, wd.pool_v, fresh, 3), keep,
                                         r, wd.span());
            }),
          c("evict_into: a shared destination block", errc::invalid_argument, "dst_keys.block_table[0]",
            [=](world& wd) {
              static std::vector<std::int32_t> shared_dst{4};  // block 4 of the V pool's table is free of V ids
              kvevict::eviction_result r;
              kvevict::eviction_options o;
              o.block_refcounts = refs.data();
              return kvevict::evict_into(src_k(wd), src_v(wd), paged(wd, wd.pool_k, shared_dst, 3),
                                         paged(wd, wd.pool_v, fresh, 3), keep, r, wd.span(), o);
            }),
          c("evict_into: workspace too small", errc::workspace_too_small, "ws",
            [=](world& wd) {
              kvevict::eviction_result r;
              const auto sk = paged(wd, wd.pool_k, wd.table_k, world::l),
                         sv = paged(wd, wd.pool_v, wd.table_v, world::l);
              return kvevict::evict_into(sk, sv, paged(wd, wd.pool_k, fresh, 3), paged(wd, wd.pool_v, fresh, 3), keep,
                                         r, world_tiny());
            }),
          c("evict in place: a shared block would change", errc::invalid_argument, "keys.block_table[0]",
            [=](world& wd) {
              kvevict::eviction_result r;
              kvevict::eviction_options o;
              o.block_refcounts = refs.data();
              return kvevict::evict(paged(wd, wd.pool_k, wd.table_k, world::l),
                                    paged(wd, wd.pool_v, wd.table_v, world::l), keep, r, wd.span(), o);
            }),
          c("per-head tables: negative stride", errc::invalid_stride, "keys.head_table_stride",
            [=](world& wd) {
              kvevict::eviction_result r;
              auto k = paged(wd, wd.pool_k, wd.table_k, world::l);
              k.head_table_stride = -1;
              return kvevict::evict(k, paged(wd, wd.pool_v, wd.table_v, world::l), keep, r, wd.span());
            }),
          c("per-head tables: overlapping tables", errc::invalid_stride, "keys.head_table_stride",
            [=](world& wd) {
              kvevict::eviction_result r;
              auto k = paged(wd, wd.pool_k, wd.table_k, world::l);
              k.head_table_stride = 1;  // head 1's table starts inside head 0's three entries
              return kvevict::evict(k, paged(wd, wd.pool_v, wd.table_v, world::l), keep, r, wd.span());
            }),
          c("per-head tables on a strided view", errc::invalid_stride, "keys.head_table_stride",
            [=](world& wd) {
              kvevict::eviction_result r;
              auto k = src_k(wd);
              k.head_table_stride = 4;
              return kvevict::evict(k, src_v(wd), keep, r, wd.span());
            }),
          c("combine_head_scores: no rows", errc::invalid_shape, "scores.rows",
            [=](world& wd) {
              return kvevict::combine_head_scores({wd.k0.data(), 0, 4, 4}, 0, kvevict::scope_combine::max,
                                                  wd.k1.data());
            }),
          c("combine_head_scores: null out", errc::null_pointer, "out",
            [=](world& wd) {
              return kvevict::combine_head_scores({wd.k0.data(), 2, 4, 4}, 0, kvevict::scope_combine::max, nullptr);
            }),
          c("combine_head_scores: negative tail", errc::invalid_argument, "protected_tail",
            [=](world& wd) {
              return kvevict::combine_head_scores({wd.k0.data(), 2, 4, 4}, -1, kvevict::scope_combine::max,
                                                  wd.k1.data());
            }),
          c("combine_head_scores: unknown rule", errc::invalid_argument, "rule",
            [=](world& wd) {
              return kvevict::combine_head_scores({wd.k0.data(), 2, 4, 4}, 0, static_cast<kvevict::scope_combine>(9),
                                                  wd.k1.data());
            }),
          c("select_layer: a sequence scope", errc::unsupported, "budget.scope",
            [=](world& wd) {
              kvevict::layer_budget b;
              b.per_head = kvevict::budget::tokens(3);
              b.scope = kvevict::selection_scope::per_sequence;
              kvevict::keep_list_view out{2, wd.lengths.data(), wd.kept.data(), 6};
              return kvevict::select_layer({wd.k0.data(), 2, 8, 8}, {}, b, out, wd.span());
            }),
          c("select_layer: AdaKV with a shared set", errc::unsupported, "budget.heads",
            [=](world& wd) {
              kvevict::layer_budget b;
              b.per_head = kvevict::budget::tokens(3);
              b.scope = kvevict::selection_scope::per_layer;
              b.heads = kvevict::head_allocation::adakv;
              kvevict::keep_list_view out{2, wd.lengths.data(), wd.kept.data(), 6};
              return kvevict::select_layer({wd.k0.data(), 2, 8, 8}, {}, b, out, wd.span());
            }),
          c("select_layer: unknown combine", errc::invalid_argument, "budget.combine",
            [=](world& wd) {
              kvevict::layer_budget b;
              b.combine = static_cast<kvevict::scope_combine>(7);
              kvevict::keep_list_view out{2, wd.lengths.data(), wd.kept.data(), 6};
              return kvevict::select_layer({wd.k0.data(), 2, 8, 8}, {}, b, out, wd.span());
            }),
      });

  using kvevict::compressor_options;
  const kvevict::policy_config snap = world::snapkv_policy();
  auto r = [](std::string n, errc e, std::string a, std::function<void(compressor_options&)> m) {
    return plan_row(std::move(n), e, std::move(a), world::snapkv_policy(), std::move(m));
  };
  run_table("compressor::plan (contracts)", {
                                                r("unknown length mode", errc::invalid_argument, "lengths",
                                                  [](auto& o) { o.lengths = static_cast<kvevict::length_mode>(4); }),
                                                r("unknown compaction", errc::invalid_argument, "compact",
                                                  [](auto& o) { o.compact = static_cast<kvevict::compaction>(4); }),
                                                r("unknown block sharing", errc::invalid_argument, "sharing",
                                                  [](auto& o) { o.sharing = static_cast<kvevict::block_sharing>(3); }),
                                                r("unknown scope", errc::invalid_argument, "scope",
                                                  [](auto& o) { o.scope = static_cast<kvevict::selection_scope>(4); }),
                                                r("unknown combine", errc::invalid_argument, "combine",
                                                  [](auto& o) { o.combine = static_cast<kvevict::scope_combine>(4); }),
                                                r("uniform lengths with AdaKV", errc::unsupported, "heads",
                                                  [](auto& o) {
                                                    o.lengths = kvevict::length_mode::uniform;
                                                    o.heads = kvevict::head_allocation::adakv;
                                                  }),
                                                r("uniform lengths with PyramidKV", errc::unsupported, "layers",
                                                  [](auto& o) {
                                                    o.lengths = kvevict::length_mode::uniform;
                                                    o.layers = kvevict::layer_allocation::pyramidkv;
                                                  }),
                                                r("a sequence scope with PyramidKV", errc::unsupported, "layers",
                                                  [](auto& o) {
                                                    o.scope = kvevict::selection_scope::per_sequence;
                                                    o.layers = kvevict::layer_allocation::pyramidkv;
                                                  }),
                                                r("a layer scope with AdaKV", errc::unsupported, "heads",
                                                  [](auto& o) {
                                                    o.scope = kvevict::selection_scope::per_layer;
                                                    o.heads = kvevict::head_allocation::adakv;
                                                  }),
                                            });

  using io_vec = std::vector<kvevict::sequence_io<float>>;
  auto rr = [run_opts, snap](std::string n, errc e, std::string a, std::function<void(compressor_options&)> plan,
                             std::function<void(world&, io_vec&)> m, bool state = false, bool warm = false,
                             std::function<void(io_vec&)> last = nullptr) {
    return bad_case{std::move(n), e, std::move(a), [=](world& wd) -> call_fn {
                      compressor_options o = world::options(snap);
                      plan(o);
                      return [=, &wd] { return run_opts(wd, o, m, state, warm, last); };
                    }};
  };
  auto out_of_place = [](compressor_options& o) { o.compact = kvevict::compaction::out_of_place; };
  auto per_sequence = [](compressor_options& o) { o.scope = kvevict::selection_scope::per_sequence; };
  run_table(
      "compressor::run (contracts)",
      {
          rr("out of place without a destination", errc::null_pointer, "seqs[0].dst_keys", out_of_place,
             [](world&, io_vec&) {}),
          rr("out of place, destination too short", errc::invalid_shape, "seqs[0].dst_keys.num_tokens", out_of_place,
             [](world& wd, io_vec& io) {
               for (auto& s : io) {
                 s.dst_keys = wd.strided(wd.k1, 2);
                 s.dst_values = wd.strided(wd.v1, 2);
               }
             }),
          rr("out of place into the source's own blocks", errc::invalid_argument, "seqs[2].dst_values.block_table",
             out_of_place,
             [](world& wd, io_vec& io) {
               static std::vector<float> dk0(world::hkv * (world::l + 2) * world::d), dv0 = dk0, dk1 = dk0, dv1 = dk0;
               io[0].dst_keys = kvevict::hf_contiguous(dk0.data(), world::hkv, world::l, world::d);
               io[0].dst_values = kvevict::hf_contiguous(dv0.data(), world::hkv, world::l, world::d);
               io[1].dst_keys = kvevict::hf_contiguous(dk1.data(), world::hkv, world::l, world::d);
               io[1].dst_values = kvevict::hf_contiguous(dv1.data(), world::hkv, world::l, world::d);
               static std::vector<std::int32_t> own{5, 1, 3};  // V uses blocks 1, 5, 3 (K only 4, 0, 2 of its four)
               io[2].dst_keys = kvevict::vllm_paged(wd.pool_k.data(), world::pool, world::block, world::hkv, world::d,
                                                    own.data(), world::l);
               io[2].dst_values = kvevict::vllm_paged(wd.pool_v.data(), world::pool, world::block, world::hkv, world::d,
                                                      own.data(), world::l);
             }),
          rr(
              "in place with a shared block", errc::invalid_argument, "seqs[2].keys.block_table[0]",
              [](compressor_options&) {},
              [](world&, io_vec& io) {
                static std::vector<std::int32_t> counts(world::pool, 1);
                counts[4] = 3;
                io[2].block_refcounts = counts.data();
              }),
          rr(
              "paged in place, block sharing undeclared", errc::invalid_argument, "sharing",
              [](compressor_options& o) { o.sharing = kvevict::block_sharing::undeclared; }, [](world&, io_vec&) {}),
          rr(
              "paged in place, block_sharing::marked without marks", errc::null_pointer, "seqs[2].block_refcounts",
              [](compressor_options& o) { o.sharing = kvevict::block_sharing::marked; }, [](world&, io_vec&) {}),
          rr(
              "two sequences of the call share a block, no marks", errc::invalid_argument,
              "seqs[1].keys.block_table[2]", [](compressor_options&) {},
              [](world& wd, io_vec& io) {
                static std::vector<std::int32_t> prefix{1, 3, 2};  // block 2 is sequence 2's third K block
                io[1].keys = kvevict::vllm_paged(wd.pool_k.data(), world::pool, world::block, world::hkv, world::d,
                                                 prefix.data(), world::l);
              }),
          rr(
              "an idle sequence shares a block with one compacted in place", errc::invalid_argument,
              "seqs[2].keys.block_table[2]", [](compressor_options&) {},
              [](world& wd, io_vec& io) {
                static std::vector<std::int32_t> prefix{1, 3, 2};
                io[1].event = kvevict::sequence_event::idle;
                io[1].keys = kvevict::vllm_paged(wd.pool_k.data(), world::pool, world::block, world::hkv, world::d,
                                                 prefix.data(), world::l);
              }),
          rr("out of place, a destination block repeated", errc::invalid_argument, "seqs[2].dst_keys.block_table[1]",
             out_of_place,
             [](world& wd, io_vec& io) {
               static std::vector<float> dk0(world::hkv * (world::l + 2) * world::d), dv0 = dk0, dk1 = dk0, dv1 = dk0;
               io[0].dst_keys = kvevict::hf_contiguous(dk0.data(), world::hkv, world::l, world::d);
               io[0].dst_values = kvevict::hf_contiguous(dv0.data(), world::hkv, world::l, world::d);
               io[1].dst_keys = kvevict::hf_contiguous(dk1.data(), world::hkv, world::l, world::d);
               io[1].dst_values = kvevict::hf_contiguous(dv1.data(), world::hkv, world::l, world::d);
               static std::vector<std::int32_t> repeated{1, 1, 3}, fresh_v{0, 2, 4};  // free blocks of each pool
               io[2].dst_keys = kvevict::vllm_paged(wd.pool_k.data(), world::pool, world::block, world::hkv, world::d,
                                                    repeated.data(), world::l);
               io[2].dst_values = kvevict::vllm_paged(wd.pool_v.data(), world::pool, world::block, world::hkv, world::d,
                                                      fresh_v.data(), world::l);
             }),
          rr(
              "a sequence scope without every layer's cache", errc::null_pointer, "seqs[0].layers", per_sequence,
              [](world&, io_vec&) {}, true, true),
          rr(
              "a sequence scope, layers out of order", errc::invalid_state, "seqs[0].state", per_sequence,
              [](world&, io_vec&) {}, true, false),
          // The last layer folds into the row layer 0 started: as many scored tokens.
          rr(
              "a sequence scope, the last layer holding another token count", errc::invalid_shape,
              "seqs[0].keys.num_tokens", per_sequence, [](world&, io_vec&) {}, true, true,
              [](io_vec& io) {
                io[0].keys.num_tokens -= 1;
                io[0].values.num_tokens -= 1;
              }),
          // Chunked prefill: a chunk handed twice (or chunks out of order) would observe with the
          // wrong queries. The first chunk is taken; the same chunk again is refused, and the
          // sequence's state keeps the first one.
          {"a prompt chunk handed twice", errc::invalid_argument, "seqs[0].queries.positions[0]",
           [snap](world& wd) -> call_fn {
             compressor_options o = world::options(snap);
             o.chunked_prefill = true;
             auto cc = std::make_shared<kvevict::compressor>();
             REQUIRE(kvevict::compressor::plan(o, cc.get()).ok());
             auto st = std::make_shared<std::vector<std::uint64_t>>(cc->sequence_state_size() / 8 + 1);
             REQUIRE(cc->reset_sequence(st->data(), st->size() * 8).ok());
             auto io = std::make_shared<io_vec>(wd.prefill(false));
             (*io)[0].event = kvevict::sequence_event::prefill_chunk;
             (*io)[0].state = st->data();
             auto ws = std::make_shared<std::vector<unsigned char>>(cc->workspace_size());
             std::vector<kvevict::sequence_report> first(1);
             REQUIRE(cc->run(0, io->data(), 1, first.data(), {ws->data(), ws->size()}).ok());
             return [=, &wd] {
               const std::vector<std::uint64_t> held = *st;
               const kvevict::status refused = cc->run(0, io->data(), 1, wd.reports.data(), {ws->data(), ws->size()});
               CHECK(*st == held);  // the sequence's state keeps the first chunk
               return refused;
             };
           }},
      });
}

// Found by fuzz_compressor: a policy that reads no queries (StreamingLLM, KNorm) was handed
// more queries than its window with null data and positions, and the compressor offset the
// null pointers (undefined behaviour UBSan reports).
TEST_CASE("regression: policies that read no queries accept null query data through the compressor", "[errors]") {
  constexpr i64 hq = 4, hkv = 2, d = 8, l = 20;
  std::vector<kvevict::policy_config> query_free;
  kvevict::detail::for_each_policy(kvevict::default_policies{}, [&](auto traits) {
    using Tr = decltype(traits);
    if (Tr::reads_queries) return;
    const kvevict::policy_config p = kvevict::policy_config::of<Tr>({});  // its default configuration
    query_free.push_back(p);
  });
  REQUIRE(query_free.size() >= 2);
  for (const kvevict::policy_config& p : query_free) {
    INFO(kvevict::to_string(p.kind()));
    kvevict::compressor_options o;
    o.model = {1, hq, hkv, d, 0, kvevict::dtype::f32};
    o.policy = p;
    o.per_head = kvevict::budget::tokens(6);
    o.limits.max_tokens = l;
    kvevict::compressor c;
    REQUIRE(kvevict::compressor::plan(o, &c).ok());
    std::vector<float> k = world::data(hkv * l * d, 11), v = world::data(hkv * l * d, 12);
    kvevict::sequence_io<float> io;
    io.event = kvevict::sequence_event::prefill_end;
    io.keys = kvevict::hf_contiguous(k.data(), hkv, l, d, l);
    io.values = kvevict::hf_contiguous(v.data(), hkv, l, d, l);
    io.queries = kvevict::contiguous_queries<const float>(nullptr, hq, 5, d, nullptr);
    kvevict::workspace ws(c.workspace_size());
    kvevict::sequence_report r;
    const kvevict::status st = c.run(0, &io, 1, &r, ws);
    INFO(st.message());
    REQUIRE(st.ok());
    CHECK(r.length == 6);
  }
}

// Found by fuzz_compressor: compaction with per-head block tables checks up to one block per
// token of every head's table (K and V, and their destinations out of place), but the plan
// sized that scratch for one table: a valid call was refused with workspace_too_small.
TEST_CASE("regression: per-head tables fit the planned workspace, in place and out of place", "[errors]") {
  constexpr i64 hq = 8, hkv = 4, d = 4, l = 13, w = 3, stride = l + 1, blocks = 4 * hkv * stride;
  // Sources and destinations of K and V: four disjoint sets of one-token blocks per head, in
  // one pool whose blocks are all private (refcount 1: the shared-block check walks them all).
  std::vector<std::vector<std::int32_t>> tables(4, std::vector<std::int32_t>(hkv * stride));
  for (std::size_t t = 0; t < 4; ++t)
    for (i64 i = 0; i < hkv * stride; ++i)
      tables[t][static_cast<std::size_t>(i)] = static_cast<std::int32_t>(4 * i) + static_cast<std::int32_t>(t);
  const std::vector<std::int32_t> refcounts(static_cast<std::size_t>(blocks), 1);
  for (const kvevict::compaction mode : {kvevict::compaction::in_place, kvevict::compaction::out_of_place})
    for (const kvevict::length_mode lengths : {kvevict::length_mode::uniform, kvevict::length_mode::per_head}) {
      std::vector<float> pool = world::data(blocks * d, 13);
      const auto view = [&](std::size_t t) {
        return kvevict::paged_per_head(pool.data(), blocks, 1, hkv, d, tables[t].data(), stride, l);
      };
      kvevict::compressor_options o;
      o.model = {1, hq, hkv, d, 0, kvevict::dtype::f32};
      o.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
      kvevict::window_config wc = kvevict::presets::kvpress_snapkv();
      wc.window = w;
      o.policy = kvevict::policy::snapkv(wc);
      o.per_head = kvevict::budget::tokens(5);
      o.lengths = lengths;
      if (lengths == kvevict::length_mode::per_head) o.heads = kvevict::head_allocation::adakv;  // ragged heads
      o.compact = mode;
      o.limits.max_tokens = l;
      kvevict::compressor c;
      REQUIRE(kvevict::compressor::plan(o, &c).ok());
      std::vector<float> q = world::data(hq * w * d, 14);
      std::vector<i64> qpos{l - 3, l - 2, l - 1};
      kvevict::sequence_io<float> io;
      io.event = kvevict::sequence_event::prefill_end;
      io.keys = view(0);
      io.values = view(1);
      if (mode == kvevict::compaction::out_of_place) {
        io.dst_keys = view(2);
        io.dst_values = view(3);
      }
      io.block_refcounts = refcounts.data();
      io.queries = kvevict::contiguous_queries<const float>(q.data(), hq, w, d, qpos.data());
      std::vector<std::int32_t> changed(static_cast<std::size_t>(c.changed_blocks_capacity()));
      io.changed_blocks = changed.data();
      // The exact planned size, in a vector: ASan sees a byte past it.
      std::vector<unsigned char> ws(c.workspace_size());
      kvevict::sequence_report r;
      const kvevict::status st = c.run(0, &io, 1, &r, {ws.data(), ws.size()});
      INFO(static_cast<int>(mode) << " " << static_cast<int>(lengths) << " " << st.message());
      REQUIRE(st.ok());
      CHECK(r.action == kvevict::sequence_action::evicted);
    }
}

// Found by fuzz_compressor: a DeferKV state whose header the engine overwrote between steps
// (heads, capacity or phase out of range) was read as if intact; it is refused naming the
// state, and a decode step whose head counts differ from the prefill's is refused before any
// sequence of the batch changes.
TEST_CASE("regression: an overwritten DeferKV state or changed head count is refused, nothing changes", "[errors]") {
  {
    world w;
    auto io = w.decode_after_prefill();
    // Layer 0's DeferKV header in the first sequence's state: the first u64 holding its magic
    // (heads follow capacity: fields 3 and 4 after it). The engine overwrote its head count.
    constexpr std::uint64_t magic = 0x6b76657672644b56ull;
    const auto at = std::find(w.state0.begin(), w.state0.end(), magic);
    REQUIRE(at != w.state0.end());
    at[3] = 1000;
    const std::uint64_t before = w.checksum();
    const kvevict::status st = w.defer.run(0, io.data(), 3, w.reports.data(), w.span());
    INFO(st.message());
    CHECK(st.code() == kvevict::errc::invalid_state);
    CHECK(std::string(st.argument()) == "seqs[0].state");
    CHECK(w.checksum() == before);
  }
  {
    world w;
    auto io = w.decode_after_prefill();
    // The last sequence's decode step claims fewer heads than its prefill had.
    io[2].keys.num_heads = io[2].values.num_heads = 1;
    io[2].queries.num_heads = 2;
    const std::uint64_t before = w.checksum();
    const kvevict::status st = w.defer.run(0, io.data(), 3, w.reports.data(), w.span());
    INFO(st.message());
    CHECK_FALSE(st.ok());
    CHECK(std::string(st.argument()).rfind("seqs[2].", 0) == 0);
    CHECK(w.checksum() == before);
  }
}
