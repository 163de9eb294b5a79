// Tensor-parallel scenarios shared by the unit tests (ranks as threads, tests/unit/test_parallel.cpp)
// and the multi-process test (ranks as MPI processes, tests/parallel/mpi_main.cpp). Catch2-free:
// each function returns the failures it found as text, so that a failed comparison never makes
// one rank skip collectives the others make.
//
// A scenario is a small model (3 layers, a batch of two sequences of different lengths) whose KV
// heads are split over the group's ranks as `split` says. Every rank builds the whole model's data
// from fixed seeds, runs a single-process compressor over every head (the reference), runs the
// sharded compressor over its own heads (copies of its slice), and compares, for its heads: the
// kept lengths, the kept positions and the K and V bytes after eviction, bit for bit.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/checksum.hpp"
#include "support/test_cache.hpp"

namespace tp_test {

using i64 = std::int64_t;

enum class data_kind {
  random,  ///< normal keys and queries: distinct scores (the radix search usually stops early)
  ties,    ///< every head sees the same few key rows, some zero, some NaN: exact ties across heads
};

struct scenario {
  std::string name;
  kvevict::policy_config policy;
  kvevict::head_allocation heads = kvevict::head_allocation::uniform;
  kvevict::adakv_params adakv;
  kvevict::layer_allocation layers = kvevict::layer_allocation::uniform;
  kvevict::selection_scope scope = kvevict::selection_scope::per_head;
  kvevict::scope_combine combine = kvevict::scope_combine::normalized_max;
  kvevict::compaction compact = kvevict::compaction::in_place;
  kvevict::budget budget = kvevict::budget::tokens(12);
  kvevict::dtype storage = kvevict::dtype::f32;
  data_kind data = data_kind::random;
};

constexpr i64 kLayers = 3, kGroup = 2, kDim = 16, kSteps = 3;
constexpr i64 kPrompts[] = {41, 29};
constexpr int kSequences = 2;

/// Counts a group's collectives (rank-local: each rank counts its own calls).
struct counting_group {
  const kvevict::collective* inner = nullptr;
  i64 rounds = 0, words = 0;
  i64 largest = 0;  ///< the most words one call passed (reset by the caller)
  static kvevict::status all_reduce(void* ctx, std::uint32_t* data, i64 count, kvevict::reduce_op op) {
    auto* c = static_cast<counting_group*>(ctx);
    ++c->rounds;
    c->words += count;
    c->largest = std::max(c->largest, count);
    return c->inner->all_reduce(c->inner->context, data, count, op);
  }
  kvevict::collective wrap() {
    kvevict::collective c = *inner;
    c.context = this;
    c.all_reduce = &counting_group::all_reduce;
    return c;
  }
};

struct result {
  std::vector<std::string> failures;
  i64 rounds = 0, words = 0;  ///< this rank's collectives during the sharded plan and runs
  i64 run_rounds = 0;         ///< those made by run() calls
  i64 evictions = 0;          ///< (sequence, layer) evictions compared
};

inline i64 first_head_of(const std::vector<int>& split, int rank) {
  i64 f = 0;
  for (int r = 0; r < rank; ++r) f += split[static_cast<std::size_t>(r)];
  return f;
}
inline i64 total_heads(const std::vector<int>& split) {
  return first_head_of(split, static_cast<int>(split.size()));
}

/// The whole model's data for one sequence, [H][L][d] per layer, as doubles.
struct sequence_data {
  i64 prompt = 0, tokens = 0;                    // tokens: prompt + room for the decode steps
  std::vector<std::vector<double>> k, v, q, dq;  // per layer; q [Hq][prompt][d], dq [steps][Hq][d]
};

inline sequence_data make_data(i64 heads, i64 prompt, data_kind kind, std::uint64_t seed) {
  sequence_data s;
  s.prompt = prompt;
  s.tokens = prompt + kSteps;
  const i64 hq = heads * kGroup, n = s.tokens;
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (i64 l = 0; l < kLayers; ++l) {
    const std::uint64_t base = seed * 100 + static_cast<std::uint64_t>(l) * 10;
    std::vector<double> k = test::normal(static_cast<std::size_t>(heads * n * kDim), base);
    std::vector<double> v = test::normal(static_cast<std::size_t>(heads * n * kDim), base + 1);
    std::vector<double> q = test::normal(static_cast<std::size_t>(hq * prompt * kDim), base + 2, 1.5);
    std::vector<double> dq = test::normal(static_cast<std::size_t>(kSteps * hq * kDim), base + 3, 1.5);
    if (kind == data_kind::ties) {
      // Four key rows shared by every head (identical scores across heads), a zero row
      // (KNorm: -0), NaN in a few rows; every query head the same.
      const std::vector<double> rows = test::normal(static_cast<std::size_t>(4 * kDim), base + 4);
      for (i64 h = 0; h < heads; ++h)
        for (i64 j = 0; j < n; ++j)
          for (i64 c = 0; c < kDim; ++c) {
            double x = rows[static_cast<std::size_t>(((j * 5) % 4) * kDim + c)];
            if (j % 11 == 3) x = 0.0;
            if ((j * 7 + h * 3) % 17 == 5 && c == 0) x = nan;
            k[static_cast<std::size_t>((h * n + j) * kDim + c)] = x;
          }
      for (i64 h = 1; h < hq; ++h)
        for (i64 t = 0; t < prompt * kDim; ++t)
          q[static_cast<std::size_t>(h * prompt * kDim + t)] = q[static_cast<std::size_t>(t)];
    }
    s.k.push_back(std::move(k));
    s.v.push_back(std::move(v));
    s.q.push_back(std::move(q));
    s.dq.push_back(std::move(dq));
  }
  return s;
}

/// Heads [first, first + count) of [H][n][d] data.
inline std::vector<double> slice(const std::vector<double>& x, i64 first, i64 count, i64 per_head) {
  return {x.begin() + first * per_head, x.begin() + (first + count) * per_head};
}

/// One rank's copy of a batch: caches and queries of heads [first, first + count).
template <class T>
struct batch {
  i64 first = 0, heads = 0;
  std::vector<std::vector<test::test_cache<T>>> k, v;               // [sequence][layer]
  std::vector<std::vector<test::test_queries<T>>> q;                // [sequence][layer] prompt queries
  std::vector<std::vector<std::vector<test::test_queries<T>>>> dq;  // [sequence][layer][step]
  std::vector<std::vector<kvevict::layer_cache<T>>> layers;         // [sequence][layer]

  std::uint64_t checksum() const {
    std::uint64_t x = test::fnv_seed;
    for (const auto& s : k)
      for (const auto& c : s) x = test::fnv(x, c.buffer);
    for (const auto& s : v)
      for (const auto& c : s) x = test::fnv(x, c.buffer);
    return x;
  }
};

template <class T>
batch<T> make_batch(const std::vector<sequence_data>& data, i64 total, i64 first, i64 count) {
  batch<T> b;
  b.first = first;
  b.heads = count;
  for (const sequence_data& s : data) {
    std::vector<test::test_cache<T>> ks, vs;
    std::vector<test::test_queries<T>> qs;
    std::vector<std::vector<test::test_queries<T>>> dqs;
    std::vector<i64> pos(static_cast<std::size_t>(s.prompt));
    for (i64 t = 0; t < s.prompt; ++t) pos[static_cast<std::size_t>(t)] = t;
    for (i64 l = 0; l < kLayers; ++l) {
      const auto L = static_cast<std::size_t>(l);
      ks.push_back(test::make_cache<T>(test::layout::contiguous, count, s.tokens, kDim,
                                       slice(s.k[L], first, count, s.tokens * kDim)));
      vs.push_back(test::make_cache<T>(test::layout::contiguous, count, s.tokens, kDim,
                                       slice(s.v[L], first, count, s.tokens * kDim)));
      qs.push_back(test::make_queries<T>(count * kGroup, s.prompt, kDim,
                                         slice(s.q[L], first * kGroup, count * kGroup, s.prompt * kDim), pos));
      std::vector<test::test_queries<T>> steps;
      for (i64 st = 0; st < kSteps; ++st) {
        const std::vector<double> all(s.dq[L].begin() + st * total * kGroup * kDim,
                                      s.dq[L].begin() + (st + 1) * total * kGroup * kDim);
        steps.push_back(test::make_queries<T>(count * kGroup, 1, kDim, slice(all, first * kGroup, count * kGroup, kDim),
                                              {s.prompt + st}));
      }
      dqs.push_back(std::move(steps));
    }
    b.k.push_back(std::move(ks));
    b.v.push_back(std::move(vs));
    b.q.push_back(std::move(qs));
    b.dq.push_back(std::move(dqs));
  }
  return b;
}

inline kvevict::compressor_options options_for(const scenario& sc, i64 heads, const kvevict::collective* group) {
  kvevict::compressor_options o;
  o.model = {kLayers, heads * kGroup, heads, kDim, 0, sc.storage};
  o.policy = sc.policy;
  o.per_head = sc.budget;
  o.heads = sc.heads;
  o.adakv = sc.adakv;
  o.layers = sc.layers;
  o.scope = sc.scope;
  o.combine = sc.combine;
  o.compact = sc.compact;
  o.limits.max_sequences = kSequences;
  o.limits.max_tokens = kPrompts[0] + kSteps;
  o.limits.max_queries = kPrompts[0];
  o.tensor_parallel = group;
  return o;
}

/// What one compressor run over a batch left: per (sequence, layer) lengths and positions, and
/// the reports of the call that evicted it.
struct outcome {
  std::vector<std::vector<std::vector<i64>>> lengths, positions;  // [s][l][...]
  std::vector<std::vector<kvevict::sequence_report>> reports;     // [s][l] at eviction
  kvevict::status error;                                          // the first failed call
  i64 run_rounds = 0, largest_call = 0;  // the counted group's calls from run(), and the largest
  i64 collective_words = 0;              // what the plan said the largest would be at most
};

/// Steps the engine makes: prefill_end, then decode steps while some sequence has not evicted.
/// `counter`, when given, is the group's counting wrapper: run()'s calls are told apart from plan()'s.
template <class T>
outcome run_batch(const scenario& sc, batch<T>& b, const kvevict::collective* group,
                  counting_group* counter = nullptr) {
  outcome o;
  kvevict::compressor c;
  o.error = kvevict::compressor::plan(options_for(sc, b.heads, group), &c);
  if (!o.error.ok()) return o;
  o.collective_words = c.collective_words();
  const i64 plan_rounds = counter != nullptr ? counter->rounds : 0;
  if (counter != nullptr) counter->largest = 0;
  const auto tally = [&o, counter, plan_rounds]() -> outcome& {  // at every return below
    if (counter != nullptr) {
      o.run_rounds = counter->rounds - plan_rounds;
      o.largest_call = counter->largest;
    }
    return o;
  };
  kvevict::workspace ws(c.workspace_size());
  std::vector<std::vector<std::uint64_t>> states(kSequences,
                                                 std::vector<std::uint64_t>(c.sequence_state_size() / 8 + 1));
  for (auto& st : states) {
    o.error = c.reset_sequence(st.data(), st.size() * 8);
    if (!o.error.ok()) return tally();
  }
  o.lengths.assign(kSequences,
                   std::vector<std::vector<i64>>(kLayers, std::vector<i64>(static_cast<std::size_t>(b.heads), -1)));
  o.positions.assign(kSequences, std::vector<std::vector<i64>>(
                                     kLayers, std::vector<i64>(static_cast<std::size_t>(c.keep_capacity()), -1)));
  o.reports.assign(kSequences, std::vector<kvevict::sequence_report>(kLayers));
  b.layers.assign(kSequences, {});
  const bool defer = sc.policy.kind() == kvevict::policy_kind::deferkv;
  const i64 steps = defer && sc.policy.config<kvevict::deferkv_traits>().decode_feedback
                        ? sc.policy.config<kvevict::deferkv_traits>().delay
                        : 0;
  for (i64 step = 0; step <= steps; ++step) {
    for (int s = 0; s < kSequences; ++s) {
      b.layers[static_cast<std::size_t>(s)].clear();
      for (i64 l = 0; l < kLayers; ++l)
        b.layers[static_cast<std::size_t>(s)].push_back(kvevict::layer_cache<T>(
            b.k[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)].view.first_tokens(kPrompts[s] + step),
            b.v[static_cast<std::size_t>(s)][static_cast<std::size_t>(l)].view.first_tokens(kPrompts[s] + step)));
    }
    for (i64 l = 0; l < kLayers; ++l) {
      std::vector<kvevict::sequence_io<T>> io(kSequences);
      for (int s = 0; s < kSequences; ++s) {
        const auto S = static_cast<std::size_t>(s), L = static_cast<std::size_t>(l);
        const i64 tokens = kPrompts[s] + step;
        io[S].event = step == 0 ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
        io[S].keys = b.k[S][L].view.first_tokens(tokens);
        io[S].values = b.v[S][L].view.first_tokens(tokens);
        io[S].queries = step == 0 ? kvevict::query_view<const T>(b.q[S][L].view)
                                  : kvevict::query_view<const T>(b.dq[S][L][static_cast<std::size_t>(step - 1)].view);
        io[S].state = c.sequence_state_size() > 0 ? states[S].data() : nullptr;
        io[S].layers = b.layers[S].data();
        io[S].head_lengths = o.lengths[S][L].data();
        io[S].kept_positions = o.positions[S][L].data();
      }
      std::vector<kvevict::sequence_report> reports(kSequences);
      o.error = c.run(l, io.data(), kSequences, reports.data(), ws);
      if (!o.error.ok()) return tally();
      for (int s = 0; s < kSequences; ++s) {
        const auto S = static_cast<std::size_t>(s);
        if (reports[S].action != kvevict::sequence_action::evicted) continue;
        if (sc.scope == kvevict::selection_scope::per_sequence) {
          // The last layer's call evicts every layer: the same keep set, the lengths and
          // positions of that call.
          for (i64 m = 0; m < kLayers; ++m) {
            o.reports[S][static_cast<std::size_t>(m)] = reports[S];
            o.lengths[S][static_cast<std::size_t>(m)] = o.lengths[S][static_cast<std::size_t>(l)];
            o.positions[S][static_cast<std::size_t>(m)] = o.positions[S][static_cast<std::size_t>(l)];
          }
        } else {
          o.reports[S][static_cast<std::size_t>(l)] = reports[S];
        }
      }
    }
  }
  return tally();
}

template <class T>
bool same_bits(const T* a, const T* b, i64 n) {
  return std::memcmp(a, b, static_cast<std::size_t>(n) * sizeof(T)) == 0;
}

/// The scenario on this rank: sharded run against the single-process run, for this rank's heads.
template <class T>
result run_scenario_typed(const kvevict::collective& group, const std::vector<int>& split, const scenario& sc,
                          std::uint64_t seed) {
  result res;
  const i64 total = total_heads(split);
  const i64 first = first_head_of(split, group.rank), mine = split[static_cast<std::size_t>(group.rank)];
  std::vector<sequence_data> data;
  for (int s = 0; s < kSequences; ++s)
    data.push_back(make_data(total, kPrompts[s], sc.data, seed + static_cast<std::uint64_t>(s)));
  batch<T> whole = make_batch<T>(data, total, 0, total);
  batch<T> part = make_batch<T>(data, total, first, mine);
  const outcome want = run_batch(sc, whole, nullptr);
  counting_group counter{&group};
  const kvevict::collective counted = counter.wrap();
  const outcome got = run_batch(sc, part, &counted, &counter);
  res.rounds = counter.rounds;
  res.words = counter.words;
  res.run_rounds = got.run_rounds;
  const std::string tag = sc.name + " [rank " + std::to_string(group.rank) + "]: ";
  if (!want.error.ok()) {
    res.failures.push_back(tag + "reference failed: " + want.error.message());
    return res;
  }
  if (!got.error.ok()) {
    res.failures.push_back(tag + "sharded run failed: " + got.error.message());
    return res;
  }
  // What the plan tells the engine to size its adapter for (compressor::collective_words), and
  // no collective at all from run() when every head keeps its own budget (design.md §15).
  if (got.largest_call > got.collective_words)
    res.failures.push_back(tag + "run() passed " + std::to_string(got.largest_call) +
                           " words in one all-reduce, collective_words() said at most " +
                           std::to_string(got.collective_words));
  const bool across = sc.heads == kvevict::head_allocation::adakv || sc.scope != kvevict::selection_scope::per_head;
  if (!across && got.run_rounds != 0)
    res.failures.push_back(tag + "per-head budgets, yet run() made " + std::to_string(got.run_rounds) + " all-reduces");
  if (across && got.run_rounds == 0) res.failures.push_back(tag + "run() made no all-reduce");
  for (int s = 0; s < kSequences; ++s)
    for (i64 l = 0; l < kLayers; ++l) {
      const auto S = static_cast<std::size_t>(s), L = static_cast<std::size_t>(l);
      const std::string where = tag + "sequence " + std::to_string(s) + " layer " + std::to_string(l) + ": ";
      const kvevict::sequence_report &wr = want.reports[S][L], &gr = got.reports[S][L];
      if (wr.action != kvevict::sequence_action::evicted || gr.action != wr.action) {
        res.failures.push_back(where + "not evicted by both runs");
        continue;
      }
      ++res.evictions;
      const std::vector<i64>& wl = want.lengths[S][L];
      const std::vector<i64>& gl = got.lengths[S][L];
      i64 offset = 0, longest = 0, kept = 0;
      for (i64 h = 0; h < first; ++h) offset += wl[static_cast<std::size_t>(h)];
      for (i64 h = 0; h < mine; ++h) {
        const i64 n = gl[static_cast<std::size_t>(h)];
        longest = std::max(longest, n);
        if (n != wl[static_cast<std::size_t>(first + h)]) {
          res.failures.push_back(where + "head " + std::to_string(first + h) + " keeps " + std::to_string(n) +
                                 " tokens, one process " + std::to_string(wl[static_cast<std::size_t>(first + h)]));
          continue;
        }
        if (!same_bits(got.positions[S][L].data() + kept, want.positions[S][L].data() + offset, n))
          res.failures.push_back(where + "head " + std::to_string(first + h) + ": different kept positions");
        kept += n;
        offset += n;
        const auto& wk = whole.k[S][L].buffer;
        const auto& gk = part.k[S][L].buffer;
        const auto& wv = whole.v[S][L].buffer;
        const auto& gv = part.v[S][L].buffer;
        const i64 per_head = data[S].tokens * kDim;
        if (!same_bits(gk.data() + h * per_head, wk.data() + (first + h) * per_head, per_head) ||
            !same_bits(gv.data() + h * per_head, wv.data() + (first + h) * per_head, per_head))
          res.failures.push_back(where + "head " + std::to_string(first + h) + ": K or V differs after eviction");
      }
      const i64 before = wr.dropped + wr.length;  // the tokens the cache held when it was evicted
      if (gr.length != longest || gr.kept != kept || gr.next_position != wr.next_position ||
          gr.dropped != before - longest)
        res.failures.push_back(where + "report (length, kept, next position or dropped) is wrong");
    }
  return res;
}

inline result run_scenario(const kvevict::collective& group, const std::vector<int>& split, const scenario& sc,
                           std::uint64_t seed) {
  switch (sc.storage) {
    case kvevict::dtype::f32:
      return run_scenario_typed<float>(group, split, sc, seed);
    case kvevict::dtype::f16:
      return run_scenario_typed<kvevict::fp16>(group, split, sc, seed);
    case kvevict::dtype::bf16:
      return run_scenario_typed<kvevict::bf16>(group, split, sc, seed);
    case kvevict::dtype::f8_e4m3:  // the scenarios draw f32, f16 and bf16 caches only
    case kvevict::dtype::f8_e5m2:
      break;
  }
  result unsupported;
  unsupported.failures.push_back("run_scenario: no fp8 scenarios");
  return unsupported;
}

/// Whether `text` is the same on every rank that takes part (one max all-reduce of its hash and
/// complement; a rank that does not take part adds zeros, but still makes the call).
inline bool same_on_every_rank(const kvevict::collective& g, const std::string& text, bool take_part = true) {
  const std::uint64_t h = test::fnv(test::fnv_seed, text.data(), text.size());
  std::uint32_t w[4] = {static_cast<std::uint32_t>(h >> 32), static_cast<std::uint32_t>(h),
                        ~static_cast<std::uint32_t>(h >> 32), ~static_cast<std::uint32_t>(h)};
  if (!take_part) w[0] = w[1] = w[2] = w[3] = 0;
  if (!g.all_reduce(g.context, w, 4, kvevict::reduce_op::max).ok()) return false;
  return w[0] == ~w[2] && w[1] == ~w[3];
}

/// Ranks that disagree, or one rank that fails: every rank must return an error from the same
/// call (no rank waits forever), the same one when the shapes disagree, and nothing may change.
inline std::vector<std::string> error_scenarios(const kvevict::collective& g, const std::vector<int>& split) {
  std::vector<std::string> failures;
  const i64 total = total_heads(split);
  const i64 first = first_head_of(split, g.rank), mine = split[static_cast<std::size_t>(g.rank)];
  const bool last = g.rank == g.world_size - 1;
  const std::string tag = "[rank " + std::to_string(g.rank) + "] ";
  std::vector<sequence_data> data;
  for (int s = 0; s < kSequences; ++s) data.push_back(make_data(total, kPrompts[s], data_kind::random, 900 + s));
  scenario sc;
  sc.policy = kvevict::policy::snapkv([] {
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = 8;
    return w;
  }());
  sc.heads = kvevict::head_allocation::adakv;

  // Both comparisons run on every rank before any branch: a rank that skipped one would leave
  // the others waiting in it. `same_message`: this rank's message must equal those of the other
  // ranks that pass true.
  const auto expect = [&](const char* what, const kvevict::status& st, kvevict::errc code, const std::string& arg,
                          bool same_message) {
    const bool all_failed = same_on_every_rank(g, st.ok() ? "ok" : "failed");
    const bool same_text = same_on_every_rank(g, st.ok() ? "" : st.message(), same_message);
    if (st.ok() || !all_failed) {
      failures.push_back(tag + what + ": expected an error on every rank, got " + (st.ok() ? "ok" : st.message()));
      return;
    }
    if (st.code() != code || arg != st.argument())
      failures.push_back(tag + what + ": expected " + kvevict::to_string(code) + " about " + arg + ", got " +
                         st.message());
    if (same_message && !same_text)
      failures.push_back(tag + what + ": the ranks got different messages: " + st.message());
  };

  // A compressor::run batch where `mutate` changes this rank's part before the call.
  const auto run_case = [&](const char* what, auto&& mutate, auto&& check) {
    batch<float> b = make_batch<float>(data, total, first, mine);
    kvevict::compressor c;
    const kvevict::status planned = kvevict::compressor::plan(options_for(sc, mine, &g), &c);
    if (!planned.ok()) {
      failures.push_back(tag + what + ": plan failed: " + planned.message());
      return;
    }
    kvevict::workspace ws(c.workspace_size());
    std::vector<kvevict::sequence_io<float>> io(kSequences);
    std::vector<i64> lengths(static_cast<std::size_t>(kSequences * mine), -5);
    for (int s = 0; s < kSequences; ++s) {
      const auto S = static_cast<std::size_t>(s);
      io[S].event = kvevict::sequence_event::prefill_end;
      io[S].keys = b.k[S][0].view.first_tokens(kPrompts[s]);
      io[S].values = b.v[S][0].view.first_tokens(kPrompts[s]);
      io[S].queries = b.q[S][0].view;
      io[S].head_lengths = lengths.data() + s * mine;
    }
    i64 layer = 0;
    mutate(io, layer);
    std::vector<kvevict::sequence_report> reports(kSequences);
    reports[0].length = -9;
    const std::uint64_t before = b.checksum();
    const kvevict::status st = c.run(layer, io.data(), kSequences, reports.data(), ws);
    check(st);
    if (b.checksum() != before || reports[0].length != -9 || lengths[0] != -5)
      failures.push_back(tag + what + ": the failed call changed a cache, a report or an output");
  };

  run_case(
      "one rank passes fewer tokens",
      [&](std::vector<kvevict::sequence_io<float>>& io, i64&) {
        if (!last) return;
        io[0].keys.num_tokens = io[0].values.num_tokens = kPrompts[0] - 1;
        io[0].queries.num_queries = kPrompts[0] - 1;  // its queries end one token earlier too
      },
      [&](const kvevict::status& st) {
        expect("fewer tokens", st, kvevict::errc::invalid_shape, "seqs[].keys.num_tokens", true);
      });
  run_case(
      "one rank calls another layer",
      [&](std::vector<kvevict::sequence_io<float>>&, i64& layer) { layer = last ? 1 : 0; },
      [&](const kvevict::status& st) { expect("layer", st, kvevict::errc::invalid_shape, "layer", true); });
  run_case(
      "rank 0 passes no queries",
      [&](std::vector<kvevict::sequence_io<float>>& io, i64&) {
        if (g.rank == 0) io[1].queries.data = nullptr;
      },
      [&](const kvevict::status& st) {
        if (g.rank == 0)
          expect("no queries", st, kvevict::errc::null_pointer, "seqs[1].queries.data", false);
        else
          expect("no queries", st, kvevict::errc::collective_error, "tensor_parallel", true);
      });

  // Plans that differ: every rank refuses, naming the field.
  {
    kvevict::compressor c;
    scenario other = sc;
    if (last) other.budget = kvevict::budget::tokens(13);
    const kvevict::status st = kvevict::compressor::plan(options_for(other, mine, &g), &c);
    expect("plans with different budgets", st, kvevict::errc::invalid_shape, "per_head", true);
    if (c.planned()) failures.push_back(tag + "a refused plan wrote its output");
  }
  // The building block: select_layer over this rank's heads, one rank with a shorter row.
  {
    const i64 l = last ? 30 : 31;
    std::vector<float> scores(static_cast<std::size_t>(mine * l), 1.0f);
    kvevict::layer_budget lb;
    lb.per_head = kvevict::budget::tokens(5);
    lb.heads = kvevict::head_allocation::adakv;
    lb.shard = {&g, first, total, true};
    kvevict::keep_list keep(mine, kvevict::select_layer_capacity(mine, 31, {}, lb));
    std::vector<unsigned char> ws(kvevict::select_layer_workspace_size(mine, 31, lb));
    const kvevict::status st = kvevict::select_layer({scores.data(), mine, l, l}, {}, lb, keep, {ws.data(), ws.size()});
    expect("select_layer rows of different lengths", st, kvevict::errc::invalid_shape, "scores.cols", true);
  }
  return failures;
}

/// The scenarios every group size runs (each in every storage type).
inline std::vector<scenario> scenarios() {
  std::vector<scenario> out;
  kvevict::window_config press = kvevict::presets::kvpress_snapkv();
  press.window = 8;
  const kvevict::policy_config snap = kvevict::policy::snapkv(press);
  kvevict::deferkv_config dc;
  dc.window = 7;
  dc.delay = 2;
  const kvevict::policy_config defer = kvevict::policy::deferkv(dc);
  const kvevict::policy_config knorm = kvevict::policy::knorm({4, kvevict::protected_mode::on_top_of_budget});
  auto add = [&](std::string name, kvevict::policy_config p, auto&& tweak) {
    scenario sc;
    sc.name = std::move(name);
    sc.policy = p;
    tweak(sc);
    out.push_back(sc);
  };
  using kvevict::head_allocation;
  using kvevict::scope_combine;
  using kvevict::selection_scope;
  add("snapkv adakv", snap, [](scenario& s) { s.heads = head_allocation::adakv; });
  add("snapkv adakv normalised alpha 0.5 ratio", snap, [](scenario& s) {
    s.heads = head_allocation::adakv;
    s.adakv = {0.5, true};
    s.budget = kvevict::budget::ratio(0.7);
  });
  add("snapkv adakv ties", snap, [](scenario& s) {
    s.heads = head_allocation::adakv;
    s.data = data_kind::ties;
  });
  add("snapkv pyramidkv adakv", snap, [](scenario& s) {
    s.heads = head_allocation::adakv;
    s.layers = kvevict::layer_allocation::pyramidkv;
  });
  add("knorm adakv ties (zero and NaN scores)", knorm, [](scenario& s) {
    s.heads = head_allocation::adakv;
    s.data = data_kind::ties;
    s.budget = kvevict::budget::tokens(9);
  });
  add("snapkv per head (no collectives)", snap, [](scenario&) {});
  for (scope_combine rule :
       {scope_combine::normalized_max, scope_combine::normalized_mean, scope_combine::max, scope_combine::mean})
    add(std::string("snapkv per layer ") + kvevict::to_string(rule), snap, [rule](scenario& s) {
      s.scope = selection_scope::per_layer;
      s.combine = rule;
    });
  add("knorm per layer max ties", knorm, [](scenario& s) {
    s.scope = selection_scope::per_layer;
    s.combine = scope_combine::max;
    s.data = data_kind::ties;
  });
  for (scope_combine rule : {scope_combine::normalized_max, scope_combine::mean})
    add(std::string("snapkv per sequence ") + kvevict::to_string(rule), snap, [rule](scenario& s) {
      s.scope = selection_scope::per_sequence;
      s.combine = rule;
    });
  add("snapkv per sequence keep-list only", snap, [](scenario& s) {
    s.scope = selection_scope::per_sequence;
    s.combine = scope_combine::normalized_mean;
    s.compact = kvevict::compaction::keep_list_only;
  });
  add("deferkv d=2 adakv", defer, [](scenario& s) { s.heads = head_allocation::adakv; });
  add("deferkv d=2 per sequence", defer, [](scenario& s) {
    s.scope = selection_scope::per_sequence;
    s.combine = scope_combine::normalized_mean;
  });
  return out;
}

}  // namespace tp_test
