// Tensor parallelism (design.md §15) with the group's ranks as threads of this process: the
// sharded compressor and select_layer give every rank, for its heads, the single-process keep
// sets bit for bit (uneven head splits, AdaKV with ties across heads, NaN and -0 scores, the
// shared scopes under every combining rule, DeferKV); the number of collective rounds is what
// the design says; and ranks that disagree or fail all return an error instead of waiting.
// tests/parallel/mpi_main.cpp runs the same scenarios as real processes under mpirun.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "parallel/scenario.hpp"
#include "parallel/thread_group.hpp"

// The adapters stay optional: the core headers never pull in MPI or NCCL (this file builds
// without either installed).
#if defined(KVEVICT_MPI_HPP) || defined(KVEVICT_NCCL_HPP)
#error "kvevict/kvevict.hpp included kvevict/mpi.hpp or kvevict/nccl.hpp"
#endif

namespace {

using i64 = std::int64_t;

/// Runs f(collective, rank) on every rank of a thread group and gathers the failures each
/// rank reports (Catch2 assertions stay on the main thread).
template <class F>
std::vector<std::string> on_group(const std::vector<int>& split, F&& f) {
  tp_test::thread_group group(static_cast<int>(split.size()));
  std::vector<std::vector<std::string>> failures(split.size());
  group.run([&](int rank) {
    const kvevict::collective c = group.member(rank);
    failures[static_cast<std::size_t>(rank)] = f(c);
  });
  std::vector<std::string> all;
  for (const auto& v : failures) all.insert(all.end(), v.begin(), v.end());
  return all;
}

/// Scores with what makes selection hard: ties within and across heads, NaN, -0 and +0, inf.
std::vector<float> hard_scores(i64 heads, i64 tokens, int kind, std::uint64_t seed) {
  std::vector<float> s(static_cast<std::size_t>(heads * tokens));
  const std::vector<double> x = test::normal(s.size(), seed);
  const float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (i64 h = 0; h < heads; ++h)
    for (i64 j = 0; j < tokens; ++j) {
      const std::size_t i = static_cast<std::size_t>(h * tokens + j);
      float v = static_cast<float>(x[i]);
      if (kind == 1) v = static_cast<float>((j * 7 + h) % 5) * 0.25f;  // five values, every head
      if (kind == 2) {                                                 // specials among distinct values
        if (j % 9 == 2) v = nan;
        if (j % 13 == 4) v = (h % 2 == 0) ? -0.0f : 0.0f;
        if (j % 17 == 6) v = inf;
        if (j % 19 == 8) v = -inf;
      }
      if (kind == 3) v = 1.0f;  // one value: every key ties
      s[i] = v;
    }
  return s;
}

struct select_case {
  kvevict::layer_budget budget;
  kvevict::selection_params sel;
  std::string name;
};

std::vector<select_case> select_cases() {
  std::vector<select_case> out;
  for (i64 b : {0, 1, 4, 9, 50}) {
    for (bool normalize : {false, true}) {
      select_case c;
      c.budget.per_head = kvevict::budget::tokens(b);
      c.budget.heads = kvevict::head_allocation::adakv;
      c.budget.adakv = {0.2, normalize};
      c.sel = {3, kvevict::protected_mode::inside_budget};
      c.name = "adakv B=" + std::to_string(b) + (normalize ? " normalised" : "");
      out.push_back(c);
    }
    select_case c;  // kvpress's rule: each head's own top f, then the global top of the rest
    c.budget.per_head = kvevict::budget::tokens(b);
    c.budget.heads = kvevict::head_allocation::adakv;
    c.budget.adakv = {0.5, false, kvevict::adakv_rule::kvpress_safeguard};
    c.sel = {3, kvevict::protected_mode::inside_budget};
    c.name = "adakv kvpress_safeguard B=" + std::to_string(b);
    out.push_back(c);
  }
  for (auto rule : {kvevict::scope_combine::normalized_max, kvevict::scope_combine::normalized_mean,
                    kvevict::scope_combine::max, kvevict::scope_combine::mean}) {
    select_case c;
    c.budget.per_head = kvevict::budget::tokens(10);
    c.budget.scope = kvevict::selection_scope::per_layer;
    c.budget.combine = rule;
    c.sel = {2, kvevict::protected_mode::on_top_of_budget};
    c.name = std::string("per layer ") + kvevict::to_string(rule);
    out.push_back(c);
  }
  select_case uniform;
  uniform.budget.per_head = kvevict::budget::ratio(0.5);
  uniform.name = "per head, uniform";
  out.push_back(uniform);
  return out;
}

}  // namespace

TEST_CASE("sharded select_layer equals one process for every rank's heads", "[parallel]") {
  const i64 tokens = 40;
  for (const std::vector<int>& split : std::vector<std::vector<int>>{{8}, {5, 3}, {3, 3, 2}, {3, 2, 2, 1}, {1, 1, 6}})
    for (int kind = 0; kind < 4; ++kind)
      for (const select_case& c : select_cases()) {
        const i64 total = tp_test::total_heads(split);
        const std::vector<float> scores = hard_scores(total, tokens, kind, 7 + static_cast<std::uint64_t>(kind));
        kvevict::keep_list want(total, kvevict::select_layer_capacity(total, tokens, c.sel, c.budget));
        std::vector<unsigned char> ws(kvevict::select_layer_workspace_size(total, tokens, c.budget));
        REQUIRE(
            kvevict::select_layer({scores.data(), total, tokens, tokens}, c.sel, c.budget, want, {ws.data(), ws.size()})
                .ok());
        std::vector<i64> rounds(split.size());
        const auto failures = on_group(split, [&](const kvevict::collective& g) {
          std::vector<std::string> f;
          tp_test::counting_group counter{&g};
          const kvevict::collective counted = counter.wrap();
          const i64 first = tp_test::first_head_of(split, g.rank), mine = split[static_cast<std::size_t>(g.rank)];
          kvevict::layer_budget b = c.budget;
          b.shard = {&counted, first, total, true};
          kvevict::keep_list got(mine, kvevict::select_layer_capacity(mine, tokens, c.sel, b));
          std::vector<unsigned char> w(kvevict::select_layer_workspace_size(mine, tokens, b));
          const kvevict::status st = kvevict::select_layer({scores.data() + first * tokens, mine, tokens, tokens},
                                                           c.sel, b, got, {w.data(), w.size()});
          rounds[static_cast<std::size_t>(g.rank)] = counter.rounds;
          if (!st.ok()) return std::vector<std::string>{c.name + ": " + st.message()};
          for (i64 h = 0; h < mine; ++h)
            if (got.head(h) != want.head(first + h))
              f.push_back(c.name + " kind " + std::to_string(kind) + ": head " + std::to_string(first + h) +
                          " differs (rank " + std::to_string(g.rank) + ")");
          return f;
        });
        INFO(c.name << ", scores of kind " << kind << ", " << split.size() << " ranks");
        for (const auto& f : failures) FAIL_CHECK(f);
        // Rounds: none for per-head budgets; the agreement, then 1 gather (per layer) or at most
        // 4 radix rounds and 1 tie round (AdaKV; none when B is 0 or keeps everything).
        for (i64 r : rounds) {
          CHECK(r == rounds[0]);
          if (c.budget.scope == kvevict::selection_scope::per_layer) CHECK(r == 2);
          if (c.budget.heads == kvevict::head_allocation::uniform &&
              c.budget.scope == kvevict::selection_scope::per_head)
            CHECK(r == 0);
          if (c.budget.heads == kvevict::head_allocation::adakv) CHECK(r <= 6);
        }
      }
}

TEST_CASE("the combined row of a sharded layer has the single-process bits under every rule", "[parallel]") {
  // Long rows of heads with different scales: a sum in another order rounds differently in
  // many tokens, so this sees an order the keep-lists of small layers would hide.
  const i64 tokens = 4096, tail = 3;
  for (const std::vector<int>& split : std::vector<std::vector<int>>{{8}, {5, 3}, {3, 3, 2}, {1, 2, 4, 1}}) {
    const i64 total = tp_test::total_heads(split);
    std::vector<float> scores = hard_scores(total, tokens, 0, 11);
    for (i64 h = 0; h < total; ++h)
      for (i64 j = 0; j < tokens; ++j) {
        float& x = scores[static_cast<std::size_t>(h * tokens + j)];
        x = std::exp(x) * static_cast<float>(h + 1) * 0.37f;  // positive, like attention mass
        if (j % 97 == 5 && h % 3 == 1) x = std::numeric_limits<float>::quiet_NaN();
      }
    for (auto rule : {kvevict::scope_combine::normalized_max, kvevict::scope_combine::normalized_mean,
                      kvevict::scope_combine::max, kvevict::scope_combine::mean}) {
      std::vector<float> want(static_cast<std::size_t>(tokens));
      REQUIRE(kvevict::combine_head_scores({scores.data(), total, tokens, tokens}, tail, rule, want.data()).ok());
      const auto failures = on_group(split, [&](const kvevict::collective& g) {
        const i64 first = tp_test::first_head_of(split, g.rank), mine = split[static_cast<std::size_t>(g.rank)];
        kvevict::head_shard shard{&g, first, total, false};
        std::vector<unsigned char> ws(kvevict::detail::sharded_combine_workspace_size(tokens, rule, shard));
        std::vector<float> got(static_cast<std::size_t>(tokens), -1.0f);
        const kvevict::status st = kvevict::detail::combine_head_scores_sharded(
            {scores.data() + first * tokens, mine, tokens, tokens}, tail, rule, shard, got.data(),
            {ws.data(), ws.size()}, kvevict::status(), "test");
        if (!st.ok()) return std::vector<std::string>{st.message()};
        i64 differ = 0;
        for (i64 j = 0; j < tokens; ++j)
          differ +=
              std::memcmp(&got[static_cast<std::size_t>(j)], &want[static_cast<std::size_t>(j)], sizeof(float)) != 0;
        if (differ == 0) return std::vector<std::string>{};
        return std::vector<std::string>{std::string(kvevict::to_string(rule)) + ", rank " + std::to_string(g.rank) +
                                        ": " + std::to_string(differ) + " tokens differ in their bits"};
      });
      INFO(split.size() << " ranks");
      for (const auto& f : failures) FAIL_CHECK(f);
    }
  }
}

TEST_CASE("AdaKV across ranks: ties at the threshold need the tie round, distinct scores stop early", "[parallel]") {
  const i64 tokens = 64, total = 6;
  const std::vector<int> split{2, 4};
  for (int kind : {0, 3}) {
    const std::vector<float> scores = hard_scores(total, tokens, kind, 3);
    std::vector<i64> rounds(split.size());
    const auto failures = on_group(split, [&](const kvevict::collective& g) {
      tp_test::counting_group counter{&g};
      const kvevict::collective counted = counter.wrap();
      const i64 first = tp_test::first_head_of(split, g.rank), mine = split[static_cast<std::size_t>(g.rank)];
      kvevict::layer_budget b;
      b.per_head = kvevict::budget::tokens(10);
      b.heads = kvevict::head_allocation::adakv;
      b.shard = {&counted, first, total, false};
      kvevict::keep_list got(mine, kvevict::select_layer_capacity(mine, tokens, {}, b));
      std::vector<unsigned char> w(kvevict::select_layer_workspace_size(mine, tokens, b));
      const kvevict::status st = kvevict::select_layer({scores.data() + first * tokens, mine, tokens, tokens}, {}, b,
                                                       got, {w.data(), w.size()});
      rounds[static_cast<std::size_t>(g.rank)] = counter.rounds;
      return st.ok() ? std::vector<std::string>{} : std::vector<std::string>{st.message()};
    });
    for (const auto& f : failures) FAIL_CHECK(f);
    // Every key equal: 4 radix rounds cannot split the ties, so the tie round runs. Normal
    // scores: the top byte's bin is rarely taken whole, but the tie round never runs.
    if (kind == 3) CHECK(rounds[0] == 5);
    if (kind == 0) CHECK(rounds[0] <= 4);
  }
}

TEST_CASE("sharded compressor equals one process bit for bit (ranks as threads)", "[parallel]") {
  const std::vector<std::vector<int>> splits{{5, 3}, {3, 3, 2}, {3, 2, 2, 1}};
  std::uint64_t seed = 100;
  for (const auto& split : splits)
    for (tp_test::scenario sc : tp_test::scenarios()) {
      for (kvevict::dtype t : {kvevict::dtype::f32, kvevict::dtype::bf16}) {
        sc.storage = t;
        ++seed;
        i64 evictions = 0;
        std::vector<i64> rounds(split.size());
        const auto failures = on_group(split, [&](const kvevict::collective& g) {
          tp_test::result r = tp_test::run_scenario(g, split, sc, seed);
          rounds[static_cast<std::size_t>(g.rank)] = r.rounds;
          if (g.rank == 0) evictions = r.evictions;
          return r.failures;
        });
        INFO(sc.name << " " << kvevict::to_string(t) << " over " << split.size() << " ranks");
        for (const auto& f : failures) FAIL_CHECK(f);
        CHECK(evictions == tp_test::kSequences * tp_test::kLayers);
        for (i64 r : rounds) CHECK(r == rounds[0]);  // every rank made the same calls
      }
    }
}

TEST_CASE("ranks that disagree or fail all get an error, and nothing changes (ranks as threads)", "[parallel]") {
  for (const auto& split : std::vector<std::vector<int>>{{2, 1}, {3, 3, 2}, {1, 2, 2, 3}}) {
    const auto failures =
        on_group(split, [&](const kvevict::collective& g) { return tp_test::error_scenarios(g, split); });
    INFO(split.size() << " ranks");
    for (const auto& f : failures) FAIL_CHECK(f);
  }
}

TEST_CASE("a plan learns where its heads start and how many words run() passes at most", "[parallel]") {
  const std::vector<int> split{3, 1, 4};
  std::vector<i64> first(3), total(3), most(3);
  std::vector<std::string> errors(3);
  tp_test::thread_group group(3);
  group.run([&](int rank) {
    const kvevict::collective c = group.member(rank);
    tp_test::scenario sc;
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 8;
    sc.policy = kvevict::policy::snapkv(w);
    sc.scope = kvevict::selection_scope::per_layer;
    sc.combine = kvevict::scope_combine::mean;
    kvevict::compressor comp;
    const auto r = static_cast<std::size_t>(rank);
    const kvevict::status st = kvevict::compressor::plan(tp_test::options_for(sc, split[r], &c), &comp);
    if (!st.ok()) {
      errors[r] = st.message();
      return;
    }
    first[r] = comp.first_kv_head();
    total[r] = comp.total_kv_heads();
    most[r] = comp.collective_words();
  });
  for (const std::string& e : errors) CHECK(e.empty());
  CHECK(first == std::vector<i64>{0, 3, 4});
  CHECK(total == std::vector<i64>{8, 8, 8});
  // The mean rule exchanges every head's row: 8 x max_tokens words and the failure word (the
  // scenarios check that run() stays within it).
  for (i64 m : most) CHECK(m == 8 * (tp_test::kPrompts[0] + tp_test::kSteps) + 1);
}

TEST_CASE("TOVA under tensor parallelism: every rank's plan refuses it by name", "[parallel]") {
  // TOVA averages every query head of a layer; no rank holds them all, so the ranks' keep sets
  // would disagree: the plan refuses it on every rank, naming the option.
  const std::vector<int> split{2, 2};
  std::vector<std::string> arguments(split.size());
  std::vector<bool> planned(split.size(), true);
  tp_test::thread_group group(static_cast<int>(split.size()));
  group.run([&](int rank) {
    const kvevict::collective c = group.member(rank);
    tp_test::scenario sc;
    sc.policy = kvevict::policy::tova();
    kvevict::compressor comp;
    const auto r = static_cast<std::size_t>(rank);
    const kvevict::status st = kvevict::compressor::plan(tp_test::options_for(sc, split[r], &c), &comp);
    arguments[r] = st.ok() ? "" : st.argument();
    planned[r] = comp.planned();
  });
  CHECK(arguments == std::vector<std::string>{"tensor_parallel", "tensor_parallel"});
  CHECK(planned == std::vector<bool>{false, false});
}

TEST_CASE("a policy's evict() over a sharded layer: one process's caches, or an error on every rank", "[parallel]") {
  // The building block under the compressor: KNorm with AdaKV, each rank compacting its heads.
  const i64 tokens = 48, dim = 8;
  const std::vector<int> split{3, 2, 3};
  const i64 total = tp_test::total_heads(split);
  const std::vector<double> k = test::normal(static_cast<std::size_t>(total * tokens * dim), 31);
  const std::vector<double> v = test::normal(static_cast<std::size_t>(total * tokens * dim), 32);
  kvevict::layer_budget budget;
  budget.per_head = kvevict::budget::tokens(10);
  budget.heads = kvevict::head_allocation::adakv;
  const kvevict::knorm<float> policy({2, kvevict::protected_mode::inside_budget});

  test::test_cache<float> wk = test::make_cache<float>(test::layout::contiguous, total, tokens, dim, k);
  test::test_cache<float> wv = test::make_cache<float>(test::layout::contiguous, total, tokens, dim, v);
  std::vector<i64> want_lengths(static_cast<std::size_t>(total)),
      want_positions(static_cast<std::size_t>(total * tokens));
  {
    kvevict::eviction_result r;
    r.head_lengths = want_lengths.data();
    r.positions = want_positions.data();
    kvevict::workspace ws(policy.evict_workspace_size({total, total, dim, tokens, 1}, budget));
    REQUIRE(policy.evict({wk.view, wv.view}, {}, budget, r, ws).ok());
  }

  for (int failing : {-1, 1}) {  // -1: every rank well; 1: rank 1 passes too small a workspace
    const auto failures = on_group(split, [&](const kvevict::collective& g) {
      std::vector<std::string> f;
      const std::string tag = "rank " + std::to_string(g.rank) + (failing < 0 ? "" : " (rank 1 failing)") + ": ";
      const i64 first = tp_test::first_head_of(split, g.rank), mine = split[static_cast<std::size_t>(g.rank)];
      const auto part = [&](const std::vector<double>& x) {
        return std::vector<double>(x.begin() + first * tokens * dim, x.begin() + (first + mine) * tokens * dim);
      };
      test::test_cache<float> pk = test::make_cache<float>(test::layout::contiguous, mine, tokens, dim, part(k));
      test::test_cache<float> pv = test::make_cache<float>(test::layout::contiguous, mine, tokens, dim, part(v));
      const std::vector<float> k_before = pk.buffer, v_before = pv.buffer;
      kvevict::layer_budget b = budget;
      b.shard = {&g, first, total, true};
      std::vector<i64> lengths(static_cast<std::size_t>(mine), -1), positions(static_cast<std::size_t>(mine * tokens));
      kvevict::eviction_result r;
      r.head_lengths = lengths.data();
      r.positions = positions.data();
      kvevict::workspace ws(policy.evict_workspace_size({mine, mine, dim, tokens, 1}, b));
      kvevict::workspace_span span = ws;
      if (g.rank == failing) span.size /= 2;
      const kvevict::status st = policy.evict({pk.view, pv.view}, {}, b, r, span);
      if (failing >= 0) {
        const kvevict::errc want =
            g.rank == failing ? kvevict::errc::workspace_too_small : kvevict::errc::collective_error;
        if (st.code() != want)
          f.push_back(tag + "expected " + kvevict::to_string(want) + ", got " +
                      (st.ok() ? std::string("ok") : st.message()));
        if (pk.buffer != k_before || pv.buffer != v_before || lengths[0] != -1)
          f.push_back(tag + "the failed call changed the cache or an output");
        return f;
      }
      if (!st.ok()) return std::vector<std::string>{tag + st.message()};
      i64 offset = 0;
      for (i64 h = 0; h < first; ++h) offset += want_lengths[static_cast<std::size_t>(h)];
      i64 kept = 0;
      for (i64 h = 0; h < mine; ++h) {
        const i64 n = lengths[static_cast<std::size_t>(h)];
        if (n != want_lengths[static_cast<std::size_t>(first + h)] ||
            !std::equal(positions.begin() + kept, positions.begin() + kept + n, want_positions.begin() + offset))
          f.push_back(tag + "head " + std::to_string(first + h) + " keeps other tokens than one process");
        kept += n;
        offset += n;
      }
      if (std::memcmp(pk.buffer.data(), wk.buffer.data() + first * tokens * dim, pk.buffer.size() * sizeof(float)) !=
              0 ||
          std::memcmp(pv.buffer.data(), wv.buffer.data() + first * tokens * dim, pv.buffer.size() * sizeof(float)) != 0)
        f.push_back(tag + "K or V differs from one process's after eviction");
      return f;
    });
    for (const auto& f : failures) FAIL_CHECK(f);
  }
}
