// The compressor against the building blocks it promises to equal bit for bit: for every
// policy (and ChunkKV on top), every head and layer allocation, token and ratio budgets, all
// three storage types and strided, transposed-V and paged layouts, a multi-layer batch of
// ragged sequences run through compressor::run (prefill_end, then decode steps) must leave
// exactly the caches, lengths and kept positions that policy.score -> PyramidKV / AdaKV
// budgets -> select -> evict leave, called by hand. Plus: sizes from shapes alone, reports,
// the tracer, lifecycle rules and all-or-nothing batches.
#include <catch2/catch.hpp>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/checksum.hpp"
#include "support/test_cache.hpp"
#include "unit/compile_once_lists.hpp"

using kvevict::bf16;
using kvevict::fp16;

namespace {

using i64 = std::int64_t;

constexpr i64 kLayers = 3, kHkv = 2, kGroup = 3, kHq = kHkv * kGroup, kDim = 24, kSteps = 3;

enum class alloc { uniform, adakv, pyramid, pyramid_adakv };
const alloc kAllocs[] = {alloc::uniform, alloc::adakv, alloc::pyramid, alloc::pyramid_adakv};

struct layouts {
  test::layout keys, values;
  i64 block = 16;
};

/// One sequence's data at one layer: K/V with room for the tokens after the prompt, all prompt
/// queries, the decode steps' queries and (DapQ) the pseudo tokens' queries.
template <class T>
struct layer_data {
  test::test_cache<T> k, v;
  test::test_queries<T> prompt_q;               // [Hq, Lp, d], positions 0 .. Lp-1
  std::vector<test::test_queries<T>> decode_q;  // per step [Hq, 1, d], position Lp + step
  test::test_queries<T> pseudo_q;               // [Hq, N, d], positions Lp ..
};

template <class T>
struct sequence_data {
  i64 prompt = 0, extra = 0;  // the cache holds prompt + extra tokens at most
  std::vector<layer_data<T>> layers;
};

template <class T>
sequence_data<T> make_sequence(i64 prompt, i64 extra, const layouts& lay, std::uint64_t seed) {
  sequence_data<T> s;
  s.prompt = prompt;
  s.extra = extra;
  const i64 total = prompt + extra;
  for (i64 l = 0; l < kLayers; ++l) {
    const std::uint64_t base = seed * 1000 + static_cast<std::uint64_t>(l) * 10;
    layer_data<T> d;
    d.k = test::make_cache<T>(lay.keys, kHkv, total, kDim, test::normal(kHkv * total * kDim, base), lay.block, base);
    d.v = test::make_cache<T>(lay.values, kHkv, total, kDim, test::normal(kHkv * total * kDim, base + 1), lay.block,
                              base + 1);
    std::vector<i64> pos(static_cast<std::size_t>(prompt));
    for (i64 t = 0; t < prompt; ++t) pos[static_cast<std::size_t>(t)] = t;
    d.prompt_q = test::make_queries<T>(kHq, prompt, kDim, test::normal(kHq * prompt * kDim, base + 2, 1.5), pos);
    for (i64 k = 0; k < kSteps; ++k)
      d.decode_q.push_back(
          test::make_queries<T>(kHq, 1, kDim, test::normal(kHq * kDim, base + 3 + k, 1.5), {prompt + k}));
    if (extra > 0) {
      std::vector<i64> ppos;
      for (i64 t = 0; t < extra; ++t) ppos.push_back(prompt + t);
      d.pseudo_q = test::make_queries<T>(kHq, extra, kDim, test::normal(kHq * extra * kDim, base + 9, 1.5), ppos);
    }
    s.layers.push_back(std::move(d));
  }
  return s;
}

/// The last n observations of a query view (what the compressor hands a windowed policy).
template <class T>
kvevict::query_view<const T> last(kvevict::query_view<const T> q, i64 n) {
  if (q.num_queries <= n) return q;
  q.data += (q.num_queries - n) * q.query_stride;
  q.positions += q.num_queries - n;
  q.num_queries = n;
  return q;
}

struct outcome {
  std::vector<std::vector<i64>> lengths, positions;  // per (sequence, layer)
  std::vector<std::uint64_t> caches;                 // checksum per (sequence, layer)
  std::vector<i64> next_positions;                   // per sequence (at its eviction)
  std::vector<i64> evicted_at;                       // per sequence: step of eviction (0 prefill, k+1 decode k)
};

/// The plan's budget rule written out with the building blocks: select for uniform layers,
/// otherwise PyramidKV layer candidates and/or AdaKV head budgets with the tail on top.
inline kvevict::status select_by_hand(const kvevict::const_score_view& scores, const kvevict::selection_params& sel,
                                      kvevict::budget b, alloc a, i64 layer, kvevict::keep_list& keep) {
  const i64 l = scores.cols;
  std::vector<unsigned char> ws(kvevict::select_workspace_size(l) + kvevict::adakv_workspace_size(kHkv, l));
  const kvevict::workspace_span span{ws.data(), ws.size()};
  if (a == alloc::uniform) {
    keep.resize(kHkv, kvevict::select_capacity(kHkv, l, b, sel));
    return kvevict::select(scores, b, sel, keep, span);
  }
  const i64 protect = std::min(sel.protected_tail, l);
  i64 cand = kvevict::candidates_kept(b.resolve(l), l, sel);
  if (a == alloc::pyramid || a == alloc::pyramid_adakv) {
    std::vector<i64> per_layer(kLayers);
    KVEVICT_RETURN_IF_ERROR(kvevict::pyramidkv_layer_budgets(cand + protect, protect, kLayers, l, per_layer.data()));
    cand = per_layer[static_cast<std::size_t>(layer)];
  }
  const kvevict::selection_params on_top{sel.protected_tail, kvevict::protected_mode::on_top_of_budget};
  if (a == alloc::adakv || a == alloc::pyramid_adakv) {
    std::vector<i64> heads(kHkv);
    KVEVICT_RETURN_IF_ERROR(kvevict::adakv_head_budgets(scores, sel.protected_tail, cand, {}, heads.data(), span));
    i64 cap = 0;
    for (i64 h : heads) cap += kvevict::tokens_kept(h, l, on_top);
    keep.resize(kHkv, cap);
    return kvevict::select(scores, heads.data(), on_top, keep, span);
  }
  keep.resize(kHkv, kvevict::select_capacity(kHkv, l, kvevict::budget::tokens(cand), on_top));
  return kvevict::select(scores, kvevict::budget::tokens(cand), on_top, keep, span);
}

/// Scores of a stateless policy configuration, through the policy classes' score().
template <class T>
kvevict::status score_by_hand(const kvevict::policy_config& pc, const kvevict::layer_inputs<T>& in,
                              kvevict::score_view out, kvevict::selection_params* sel) {
  std::vector<unsigned char> ws(1 << 22);
  const kvevict::workspace_span span{ws.data(), ws.size()};
  auto run = [&](const auto& base) {
    *sel = base.selection();
    if (pc.chunk_length > 0) {
      using B = std::decay_t<decltype(base)>;
      return kvevict::chunkkv<B>(base, {pc.chunk_length}).score(in, out, span);
    }
    return base.score(in, out, span);
  };
  // Every stateless policy of the compressor's list, each built from its own configuration.
  kvevict::status st = kvevict::status::error(kvevict::errc::unsupported, "test", "kind", "stateful");
  kvevict::detail::for_each_policy(kvevict::default_policies{}, [&](auto traits) {
    using Tr = decltype(traits);
    if constexpr (!Tr::deferred) {
      using P = typename Tr::template policy<T, kvevict::default_query_type_t<T>>;
      if (pc.kind() == kvevict::policy_kind_of<Tr>()) st = run(P(Tr::config(pc)));
    }
  });
  return st;
}

/// The prompt queries a stateless policy observes at prefill end, as its traits say: none,
/// every prompt query, or the last `window` of them (DapQ's window is replaced by the caller).
template <class T>
kvevict::query_view<const T> observed_queries(const kvevict::policy_config& pc, kvevict::query_view<const T> prompt) {
  kvevict::query_view<const T> q;
  kvevict::detail::for_each_policy(kvevict::default_policies{}, [&](auto traits) {
    using Tr = decltype(traits);
    if (pc.kind() != kvevict::policy_kind_of<Tr>() || !Tr::reads_queries) return;
    if (Tr::every_prompt_query) {
      q = prompt;
      return;
    }
    kvevict::compressor_options o;
    o.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype_of<T>::value};
    o.policy = pc;
    i64 window = 0;
    REQUIRE(Tr::check(&o, &window, "test").ok());
    q = last<T>(prompt, window);
  });
  return q;
}

template <class T>
void record(outcome& o, const layer_data<T>& d, const std::vector<i64>& lengths, const std::vector<i64>& positions) {
  o.lengths.push_back(lengths);
  o.positions.push_back(positions);
  std::uint64_t x = test::fnv_seed;
  x = test::fnv(x, d.k.buffer);
  x = test::fnv(x, d.v.buffer);
  o.caches.push_back(x);
}

/// The building-block path.
template <class T>
outcome by_hand(std::vector<sequence_data<T>>& seqs, const kvevict::policy_config& pc, kvevict::budget b, alloc a) {
  outcome o;
  for (auto& s : seqs) {
    o.next_positions.push_back(-1);
    o.evicted_at.push_back(-1);
    for (i64 l = 0; l < kLayers; ++l) {
      layer_data<T>& d = s.layers[static_cast<std::size_t>(l)];
      std::vector<i64> lengths(kHkv, -1), positions(static_cast<std::size_t>(kHkv * (s.prompt + s.extra)), -1);
      kvevict::eviction_result result;
      result.head_lengths = lengths.data();
      result.positions = positions.data();
      std::vector<unsigned char> ews(1 << 16);
      kvevict::keep_list keep;
      if (pc.kind() == kvevict::policy_kind::deferkv) {
        kvevict::deferkv_state<T> st(pc.config<kvevict::deferkv_traits>(), l);
        REQUIRE(st.reserve(kHkv, s.prompt + s.extra).ok());
        std::vector<unsigned char> ws(1 << 22);
        kvevict::layer_inputs<T> in;
        in.keys = d.k.view.first_tokens(s.prompt);
        in.queries = last<T>(d.prompt_q.view, pc.config<kvevict::deferkv_traits>().window);
        REQUIRE(st.observe_prefill(l, in, {ws.data(), ws.size()}).ok());
        i64 step = 0;
        for (; !st.ready() && step < kSteps; ++step) {
          in.keys = d.k.view.first_tokens(s.prompt + step + 1);
          in.queries = d.decode_q[static_cast<std::size_t>(step)].view;
          REQUIRE(st.observe_decode(l, step, in, {ws.data(), ws.size()}).ok());
        }
        REQUIRE(st.ready());
        const i64 n = st.num_tokens();
        std::vector<float> scores(static_cast<std::size_t>(kHkv * n));
        REQUIRE(st.scores({scores.data(), kHkv, n, n}, {ws.data(), ws.size()}).ok());
        REQUIRE(select_by_hand({scores.data(), kHkv, n, n}, st.selection(), b, a, l, keep).ok());
        REQUIRE(
            kvevict::evict(d.k.view.first_tokens(n), d.v.view.first_tokens(n), keep, result, {ews.data(), ews.size()})
                .ok());
        REQUIRE(st.mark_evicted().ok());
        o.next_positions.back() = n;
        o.evicted_at.back() = step;
      } else {
        const bool dapq = pc.kind() == kvevict::policy_kind::dapq;
        const bool pseudo = dapq && pc.config<kvevict::dapq_traits>().source == kvevict::dapq_source::pseudo_tokens;
        const i64 tokens = pseudo ? s.prompt + s.extra : s.prompt;
        kvevict::layer_inputs<T> in;
        in.keys = d.k.view.first_tokens(tokens);
        i64 scored = tokens;
        const i64 pseudo_tokens = dapq ? pc.config<kvevict::dapq_traits>().pseudo_tokens : 0;
        std::vector<T> rotated(static_cast<std::size_t>(kHq * pseudo_tokens * kDim));
        std::vector<i64> rotated_pos(static_cast<std::size_t>(pseudo_tokens));
        in.queries = observed_queries<T>(pc, d.prompt_q.view);
        if (pseudo) {
          in.queries = d.pseudo_q.view;
          scored = s.prompt;
        } else if (dapq) {
          kvevict::query_view<const T> moved;
          const auto window = last<T>(d.prompt_q.view, pc.config<kvevict::dapq_traits>().pseudo_tokens);
          REQUIRE(kvevict::dapq_rerotate(window, pc.config<kvevict::dapq_traits>().rope, window.num_queries,
                                         rotated.data(), rotated_pos.data(), &moved)
                      .ok());
          in.queries = moved;
        }
        std::vector<float> scores(static_cast<std::size_t>(kHkv * scored));
        kvevict::selection_params sel;
        const kvevict::status st = score_by_hand<T>(pc, in, {scores.data(), kHkv, scored, scored}, &sel);
        INFO(st.message());
        REQUIRE(st.ok());
        REQUIRE(select_by_hand({scores.data(), kHkv, scored, scored}, sel, b, a, l, keep).ok());
        REQUIRE(kvevict::evict(d.k.view.first_tokens(tokens), d.v.view.first_tokens(tokens), keep, result,
                               {ews.data(), ews.size()})
                    .ok());
        o.next_positions.back() = dapq ? s.prompt : tokens;
        o.evicted_at.back() = 0;
      }
      positions.resize(static_cast<std::size_t>(keep.view().total()));
      record(o, d, lengths, positions);
    }
  }
  return o;
}

struct call_counter {
  i64 calls = 0, evicted = 0, observed = 0;
  static void on_run(void* ctx, const kvevict::run_trace& t) {
    auto* c = static_cast<call_counter*>(ctx);
    ++c->calls;
    c->evicted += t.evicted;
    c->observed += t.observed;
  }
};

/// Observations t in [from, to) of a query view.
template <class T>
kvevict::query_view<const T> slice(kvevict::query_view<const T> q, i64 from, i64 to) {
  q.data += from * q.query_stride;
  q.positions += from;
  q.num_queries = to - from;
  return q;
}

/// The compressor path: one run() per layer at prefill end, then per layer per decode step.
/// chunk > 0: the prompt is prefilled in chunks of that many tokens, every one but the last
/// handed as prefill_chunk (a sequence with fewer chunks is idle meanwhile), the last one's
/// queries at prefill_end.
template <class T, class Compressor = kvevict::compressor>
outcome by_compressor(std::vector<sequence_data<T>>& seqs, const kvevict::policy_config& pc, kvevict::budget b, alloc a,
                      call_counter* counter = nullptr, i64 chunk = 0) {
  kvevict::compressor_options opt;
  opt.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype_of<T>::value};
  opt.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
  opt.policy = pc;
  opt.per_head = b;
  opt.heads = (a == alloc::adakv || a == alloc::pyramid_adakv) ? kvevict::head_allocation::adakv
                                                               : kvevict::head_allocation::uniform;
  opt.layers = (a == alloc::pyramid || a == alloc::pyramid_adakv) ? kvevict::layer_allocation::pyramidkv
                                                                  : kvevict::layer_allocation::uniform;
  i64 most = 0;
  for (const auto& s : seqs) most = std::max(most, s.prompt + s.extra);
  opt.limits.max_sequences = static_cast<i64>(seqs.size());
  opt.limits.max_tokens = most;
  opt.limits.max_queries = most;
  if (counter != nullptr) opt.tracer = {counter, &call_counter::on_run};
  opt.chunked_prefill = chunk > 0;
  Compressor c;
  const kvevict::status planned = Compressor::plan(opt, &c);
  INFO(planned.message());
  REQUIRE(planned.ok());
  kvevict::workspace ws(c.workspace_size());
  const std::size_t n = seqs.size();
  std::vector<std::vector<std::uint64_t>> states(n, std::vector<std::uint64_t>(c.sequence_state_size() / 8 + 1));
  for (auto& st : states) REQUIRE(c.reset_sequence(st.data(), st.size() * 8).ok());
  std::vector<std::vector<std::vector<i64>>> lengths(n), positions(n);
  for (std::size_t s = 0; s < n; ++s) {
    lengths[s].assign(kLayers, std::vector<i64>(kHkv, -1));
    positions[s].assign(kLayers, std::vector<i64>(static_cast<std::size_t>(c.keep_capacity()), -1));
  }
  outcome o;
  o.next_positions.assign(n, -1);
  o.evicted_at.assign(n, -1);
  std::vector<std::vector<kvevict::sequence_report>> evict_reports(n, std::vector<kvevict::sequence_report>(kLayers));
  const bool pseudo = pc.kind() == kvevict::policy_kind::dapq &&
                      pc.config<kvevict::dapq_traits>().source == kvevict::dapq_source::pseudo_tokens;
  // The tokens each sequence's last chunk starts at (0: one chunk, no prefill_chunk).
  std::vector<i64> last_chunk(n, 0);
  if (chunk > 0) {
    for (std::size_t s = 0; s < n; ++s) last_chunk[s] = (seqs[s].prompt - 1) / chunk * chunk;
    for (i64 from = 0;; from += chunk) {
      bool any = false;
      for (i64 l = 0; l < kLayers; ++l) {
        std::vector<kvevict::sequence_io<T>> io(n);
        for (std::size_t s = 0; s < n; ++s) {
          if (from >= last_chunk[s]) continue;  // idle: its prompt ends in its last chunk
          any = true;
          layer_data<T>& d = seqs[s].layers[static_cast<std::size_t>(l)];
          io[s].event = kvevict::sequence_event::prefill_chunk;
          io[s].keys = d.k.view.first_tokens(from + chunk);
          io[s].values = d.v.view.first_tokens(from + chunk);
          io[s].queries = slice<T>(d.prompt_q.view, from, from + chunk);
          io[s].state = c.sequence_state_size() > 0 ? states[s].data() : nullptr;
        }
        std::vector<kvevict::sequence_report> reports(n);
        const kvevict::status st = c.run(l, io.data(), static_cast<i64>(n), reports.data(), ws);
        INFO(st.message());
        REQUIRE(st.ok());
        for (std::size_t s = 0; s < n; ++s) {
          REQUIRE(reports[s].action != kvevict::sequence_action::evicted);
          if (io[s].event == kvevict::sequence_event::prefill_chunk) REQUIRE(reports[s].length == from + chunk);
        }
      }
      if (!any) break;
    }
  }
  for (i64 step = 0; step <= kSteps; ++step) {
    for (i64 l = 0; l < kLayers; ++l) {
      std::vector<kvevict::sequence_io<T>> io(n);
      for (std::size_t s = 0; s < n; ++s) {
        layer_data<T>& d = seqs[s].layers[static_cast<std::size_t>(l)];
        const i64 tokens =
            step == 0 ? (pseudo ? seqs[s].prompt + seqs[s].extra : seqs[s].prompt) : seqs[s].prompt + step;
        io[s].event = step == 0 ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
        io[s].keys = d.k.view.first_tokens(tokens);
        io[s].values = d.v.view.first_tokens(tokens);
        io[s].queries = step == 0
                            ? (pseudo ? d.pseudo_q.view : slice<T>(d.prompt_q.view, last_chunk[s], seqs[s].prompt))
                            : kvevict::query_view<const T>(d.decode_q[static_cast<std::size_t>(step - 1)].view);
        io[s].state = c.sequence_state_size() > 0 ? states[s].data() : nullptr;
        io[s].head_lengths = lengths[s][static_cast<std::size_t>(l)].data();
        io[s].kept_positions = positions[s][static_cast<std::size_t>(l)].data();
      }
      std::vector<kvevict::sequence_report> reports(n);
      const kvevict::status st = c.run(l, io.data(), static_cast<i64>(n), reports.data(), ws);
      INFO(st.message());
      REQUIRE(st.ok());
      for (std::size_t s = 0; s < n; ++s)
        if (reports[s].action == kvevict::sequence_action::evicted) {
          evict_reports[s][static_cast<std::size_t>(l)] = reports[s];
          o.next_positions[s] = reports[s].next_position;
          o.evicted_at[s] = step;
          REQUIRE(reports[s].next_slot == reports[s].length);
          REQUIRE(reports[s].kept <= c.keep_capacity());
        }
    }
  }
  for (std::size_t s = 0; s < n; ++s)
    for (i64 l = 0; l < kLayers; ++l) {
      auto pos = positions[s][static_cast<std::size_t>(l)];
      pos.resize(static_cast<std::size_t>(evict_reports[s][static_cast<std::size_t>(l)].kept));
      i64 longest = 0;
      for (i64 x : lengths[s][static_cast<std::size_t>(l)]) longest = std::max(longest, x);
      REQUIRE(evict_reports[s][static_cast<std::size_t>(l)].length == longest);
      record(o, seqs[s].layers[static_cast<std::size_t>(l)], lengths[s][static_cast<std::size_t>(l)], pos);
    }
  return o;
}

std::vector<kvevict::policy_config> all_policies() {
  std::vector<kvevict::policy_config> p;
  p.push_back(kvevict::policy::streaming_llm({4}));
  p.push_back(kvevict::policy::knorm({5, kvevict::protected_mode::inside_budget}));
  p.push_back(kvevict::policy::h2o({6, kvevict::protected_mode::inside_budget, kvevict::gqa_reduction::mean}));
  kvevict::window_config press = kvevict::presets::kvpress_snapkv();
  press.window = 8;
  p.push_back(kvevict::policy::snapkv(press));
  kvevict::window_config paper = kvevict::presets::snapkv_paper();
  paper.window = 6;
  p.push_back(kvevict::policy::snapkv(paper));
  p.push_back(kvevict::policy::snapkv(press).chunked(5));
  p.push_back(kvevict::policy::knorm({3, kvevict::protected_mode::on_top_of_budget}).chunked(4));
  p.push_back(kvevict::policy::tova());
  p.push_back(kvevict::policy::tova({4, kvevict::protected_mode::on_top_of_budget}).chunked(3));
  p.push_back(kvevict::policy::keydiff({2, kvevict::protected_mode::inside_budget}));
  p.push_back(kvevict::policy::keydiff({5, kvevict::protected_mode::on_top_of_budget}).chunked(4));
  kvevict::deferkv_config d;
  d.window = 7;
  d.delay = 2;
  p.push_back(kvevict::policy::deferkv(d));
  d.delay = 1;
  d.eta = 0.7;
  d.protect = kvevict::protected_mode::inside_budget;
  p.push_back(kvevict::policy::deferkv(d));
  d.decode_feedback = false;
  p.push_back(kvevict::policy::deferkv(d));
  kvevict::dapq_config q;
  q.pseudo_tokens = 6;
  q.first = 2;
  q.last = 4;
  p.push_back(kvevict::policy::dapq(q));
  q.source = kvevict::dapq_source::rerotated_window;
  q.rope.head_dim = kDim;
  q.rope.theta = 5000.0;
  p.push_back(kvevict::policy::dapq(q));
  return p;
}

std::string describe(const kvevict::policy_config& pc, alloc a, kvevict::budget b) {
  std::string s = kvevict::to_string(pc.kind());
  if (pc.chunk_length > 0) s += "+chunks";
  if (pc.kind() == kvevict::policy_kind::deferkv)
    s += " d=" + std::to_string(pc.config<kvevict::deferkv_traits>().delay) +
         (pc.config<kvevict::deferkv_traits>().decode_feedback ? "" : " no-feedback");
  if (pc.kind() == kvevict::policy_kind::dapq)
    s += pc.config<kvevict::dapq_traits>().source == kvevict::dapq_source::pseudo_tokens ? " pseudo" : " rerotated";
  const char* names[] = {"uniform", "adakv", "pyramid", "pyramid+adakv"};
  s += std::string(" ") + names[static_cast<int>(a)];
  s += b.type == kvevict::budget::kind::tokens ? " tokens" : " ratio";
  return s;
}

template <class T>
void check_all(const layouts& lay, std::uint64_t seed) {
  for (const auto& pc : all_policies())
    for (alloc a : kAllocs)
      for (kvevict::budget b : {kvevict::budget::tokens(14), kvevict::budget::ratio(0.6)}) {
        INFO(describe(pc, a, b));
        const i64 extra =
            pc.kind() == kvevict::policy_kind::dapq ? pc.config<kvevict::dapq_traits>().pseudo_tokens : kSteps;
        const i64 prompts[] = {37, 50, 23};
        std::vector<sequence_data<T>> hand, comp;
        for (int s = 0; s < 3; ++s) {
          hand.push_back(make_sequence<T>(prompts[s], extra, lay, seed + static_cast<std::uint64_t>(s)));
          comp.push_back(make_sequence<T>(prompts[s], extra, lay, seed + static_cast<std::uint64_t>(s)));
        }
        const outcome want = by_hand(hand, pc, b, a);
        const outcome got = by_compressor(comp, pc, b, a);
        REQUIRE(got.evicted_at == want.evicted_at);
        REQUIRE(got.next_positions == want.next_positions);
        REQUIRE(got.lengths == want.lengths);
        REQUIRE(got.positions == want.positions);
        REQUIRE(got.caches == want.caches);
      }
}

}  // namespace

TEST_CASE("compressor equals the building blocks bit for bit: f32, contiguous K, transposed V", "[compressor]") {
  check_all<float>({test::layout::contiguous, test::layout::transposed}, 11);
}

TEST_CASE("compressor equals the building blocks bit for bit: bf16, paged NHD", "[compressor]") {
  check_all<bf16>({test::layout::paged_nhd, test::layout::paged_hnd, 5}, 21);
}

TEST_CASE("compressor equals the building blocks bit for bit: fp16, token-major", "[compressor]") {
  check_all<fp16>({test::layout::token_major, test::layout::padded}, 31);
}

// Issue 26: vLLM v1 always chunks prefill. Each chunk but the last is handed as prefill_chunk
// and folds its last queries into the sequence's state; the keep set after the last chunk is
// the unchunked one bit for bit for every chunking, whatever the last chunk holds (1 query,
// fewer than the window, the window, more), every policy and allocation.
TEST_CASE("chunked prefill: every chunking keeps what the unchunked prompt keeps, bit for bit", "[compressor]") {
  const layouts lay{test::layout::paged_nhd, test::layout::paged_hnd, 5};
  for (const auto& pc : all_policies())
    for (alloc a : {alloc::uniform, alloc::pyramid_adakv}) {
      const kvevict::budget b = kvevict::budget::tokens(14);
      const i64 extra =
          pc.kind() == kvevict::policy_kind::dapq ? pc.config<kvevict::dapq_traits>().pseudo_tokens : kSteps;
      const i64 prompts[] = {37, 50, 23};
      const auto sequences = [&] {
        std::vector<sequence_data<bf16>> seqs;
        for (int s = 0; s < 3; ++s) seqs.push_back(make_sequence<bf16>(prompts[s], extra, lay, 41 + 7 * s));
        return seqs;
      };
      auto hand = sequences();
      const outcome want = by_hand(hand, pc, b, a);
      kvevict::compressor_options o;
      o.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype::bf16};
      o.policy = pc;
      o.limits.max_tokens = 64;
      kvevict::compressor probe;
      REQUIRE(kvevict::compressor::plan(o, &probe).ok());
      const i64 w = std::max<i64>(1, probe.observation_window());
      for (i64 chunk : {i64{1}, i64{7}, std::max<i64>(1, w - 1), w, i64{49}, i64{64}}) {
        INFO(describe(pc, a, b) << " chunk " << chunk);
        auto comp = sequences();
        const outcome got = by_compressor(comp, pc, b, a, nullptr, chunk);
        REQUIRE(got.evicted_at == want.evicted_at);
        REQUIRE(got.next_positions == want.next_positions);
        REQUIRE(got.lengths == want.lengths);
        REQUIRE(got.positions == want.positions);
        REQUIRE(got.caches == want.caches);
      }
    }
}

namespace {
/// DeferKV through the compressor for one sequence of kLayers layers: prefill_end, then decode
/// steps of `steps[i]` tokens each until it evicts. Returns every layer's kept positions and
/// cache checksum, and the tokens observed when it evicted (-1: never).
struct multi_token_outcome {
  std::vector<std::vector<i64>> positions;
  std::vector<std::uint64_t> caches;
  i64 observed = -1;
};
multi_token_outcome run_deferkv_steps(const kvevict::deferkv_config& dc, const std::vector<i64>& steps) {
  const layouts lay{test::layout::paged_nhd, test::layout::paged_hnd, 5};
  const i64 prompt = 30, extra = 8;
  sequence_data<bf16> seq = make_sequence<bf16>(prompt, extra, lay, 123);
  std::vector<test::test_queries<bf16>> decode_q;  // per layer [Hq, extra, d], positions prompt ..
  for (i64 l = 0; l < kLayers; ++l) {
    std::vector<i64> pos;
    for (i64 t = 0; t < extra; ++t) pos.push_back(prompt + t);
    decode_q.push_back(test::make_queries<bf16>(
        kHq, extra, kDim, test::normal(kHq * extra * kDim, 900 + static_cast<std::uint64_t>(l), 1.5), pos));
  }
  kvevict::compressor_options opt;
  opt.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype::bf16};
  opt.sharing = kvevict::block_sharing::none;
  opt.policy = kvevict::policy::deferkv(dc);
  opt.per_head = kvevict::budget::tokens(9);
  opt.heads = kvevict::head_allocation::adakv;
  opt.limits.max_tokens = prompt + extra;
  opt.limits.max_queries = 6;  // the window, and steps of up to 6 tokens
  kvevict::compressor c;
  REQUIRE(kvevict::compressor::plan(opt, &c).ok());
  kvevict::workspace ws(c.workspace_size());
  std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
  REQUIRE(c.reset_sequence(state.data(), c.sequence_state_size()).ok());
  multi_token_outcome out;
  out.positions.assign(kLayers, std::vector<i64>(static_cast<std::size_t>(c.keep_capacity()), -1));
  i64 done = 0;  // decoded tokens in the cache
  for (std::size_t step = 0; step <= steps.size() && out.observed < 0; ++step) {
    const i64 n = step == 0 ? 0 : steps[step - 1];
    for (i64 l = 0; l < kLayers; ++l) {
      layer_data<bf16>& d = seq.layers[static_cast<std::size_t>(l)];
      kvevict::sequence_io<bf16> io;
      io.event = step == 0 ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
      io.keys = d.k.view.first_tokens(prompt + done + n);
      io.values = d.v.view.first_tokens(prompt + done + n);
      io.queries = step == 0 ? kvevict::query_view<const bf16>(d.prompt_q.view)
                             : slice<bf16>(decode_q[static_cast<std::size_t>(l)].view, done, done + n);
      io.state = state.data();
      io.kept_positions = out.positions[static_cast<std::size_t>(l)].data();
      kvevict::sequence_report r;
      const kvevict::status st = c.run(l, &io, 1, &r, ws);
      INFO(st.message());
      REQUIRE(st.ok());
      if (r.action == kvevict::sequence_action::evicted) {
        out.observed = done + n;
        out.positions[static_cast<std::size_t>(l)].resize(static_cast<std::size_t>(r.kept));
        REQUIRE(r.next_position == prompt + done + n);
      }
    }
    done += n;
  }
  for (const auto& d : seq.layers) out.caches.push_back(test::fnv(test::fnv(test::fnv_seed, d.k.buffer), d.v.buffer));
  return out;
}
}  // namespace

// Issue 26: speculative verification and multi-token prediction decode k tokens in one step.
// DeferKV's d counts decoded tokens; a step of k tokens equals the same tokens in k one-token
// steps, and one that carries the count past d evicts with all of them, as one-token steps
// with that many tokens do.
TEST_CASE("DeferKV: a decode step of k tokens equals the same tokens in k steps", "[compressor]") {
  kvevict::deferkv_config dc;
  dc.window = 6;
  const std::vector<std::vector<i64>> patterns = {{1, 1, 1, 1, 1, 1}, {2, 1, 3}, {3, 3}, {4, 2}, {1, 4, 1}, {2, 2, 2}};
  for (i64 delay : {1, 2, 3, 4, 5})
    for (const auto& p : patterns) {
      INFO("d = " << delay << ", steps " << p[0] << " " << p[1]);
      dc.delay = delay;
      const multi_token_outcome got = run_deferkv_steps(dc, p);
      i64 want_tokens = 0;
      for (i64 k : p)
        if (want_tokens < delay) want_tokens += k;
      REQUIRE(got.observed == want_tokens);  // d, or past it with the step that crossed it
      dc.delay = want_tokens;
      const multi_token_outcome want =
          run_deferkv_steps(dc, std::vector<i64>(static_cast<std::size_t>(want_tokens), 1));
      REQUIRE(want.observed == want_tokens);
      REQUIRE(got.positions == want.positions);
      REQUIRE(got.caches == want.caches);
    }
}

/// Compressor C called through its runtime-dtype run() (by_compressor hands it typed views).
template <class C>
struct through_any_run : C {
  static kvevict::status plan(const kvevict::compressor_options& o, through_any_run* c) { return C::plan(o, c); }
  std::size_t workspace_size() const noexcept { return C::any_workspace_size(); }
  template <class T, class Q>
  kvevict::status run(i64 layer, const kvevict::sequence_io<T, Q>* seqs, i64 n, kvevict::sequence_report* reports,
                      kvevict::workspace_span ws) const {
    std::vector<kvevict::any_sequence_io> erased(static_cast<std::size_t>(n));
    for (std::size_t s = 0; s < erased.size(); ++s) {
      kvevict::any_sequence_io& e = erased[s];
      e.event = seqs[s].event;
      e.keys = seqs[s].keys.template with_element<kvevict::any_element>();
      e.values = seqs[s].values.template with_element<kvevict::any_element>();
      e.queries = seqs[s].queries.template with_element<const kvevict::any_element>();
      e.key_positions = seqs[s].key_positions;
      e.state = seqs[s].state;
      e.head_lengths = seqs[s].head_lengths;
      e.kept_positions = seqs[s].kept_positions;
    }
    return C::run(layer, erased.data(), n, reports, ws);
  }
};

// The lists' run() entries are compiled once, in test_compile_once.cpp (unit/compile_once_lists.hpp).
TEST_CASE("a compressor over a list of policies serves them as kvevict::compressor does, and refuses others",
          "[compressor]") {
  using test::deferkv_knorm;
  using test::snapkv_only;
  const layouts lay{test::layout::paged_nhd, test::layout::paged_hnd};
  kvevict::window_config press = kvevict::presets::kvpress_snapkv();
  press.window = 8;
  kvevict::deferkv_config d;
  d.window = 7;
  d.delay = 2;
  const kvevict::policy_config snap = kvevict::policy::snapkv(press).chunked(5), knorm = kvevict::policy::knorm({5}),
                               defer = kvevict::policy::deferkv(d), stream = kvevict::policy::streaming_llm({3});
  for (alloc a : kAllocs) {
    const kvevict::budget b = kvevict::budget::tokens(14);
    const auto run = [&](const kvevict::policy_config& pc, auto compressor_tag) {
      using C = typename decltype(compressor_tag)::type;
      std::vector<sequence_data<bf16>> seqs;
      for (int s = 0; s < 3; ++s)
        seqs.push_back(make_sequence<bf16>(30 + 9 * s, kSteps, lay, 77 + static_cast<std::uint64_t>(s)));
      return by_compressor<bf16, C>(seqs, pc, b, a);
    };
    const outcome want_snap = run(snap, kvevict::detail::type_tag<kvevict::compressor>{});
    const outcome got_snap = run(snap, kvevict::detail::type_tag<snapkv_only>{});
    REQUIRE(got_snap.positions == want_snap.positions);
    REQUIRE(got_snap.caches == want_snap.caches);
    const outcome want_stream = run(stream, kvevict::detail::type_tag<kvevict::compressor>{});
    const outcome got_stream = run(stream, kvevict::detail::type_tag<through_any_run<test::streaming_only>>{});
    REQUIRE(got_stream.positions == want_stream.positions);
    REQUIRE(got_stream.caches == want_stream.caches);
    for (const kvevict::policy_config& pc : {knorm, defer}) {
      INFO(kvevict::to_string(pc.kind()));
      const outcome want = run(pc, kvevict::detail::type_tag<kvevict::compressor>{});
      const outcome got = run(pc, kvevict::detail::type_tag<deferkv_knorm>{});
      REQUIRE(got.evicted_at == want.evicted_at);
      REQUIRE(got.positions == want.positions);
      REQUIRE(got.caches == want.caches);
    }
  }
  // A kind outside the list: refused at plan time by name, the compressor left unplanned.
  kvevict::compressor_options opt;
  opt.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype::bf16};
  opt.limits.max_tokens = 64;
  opt.policy = kvevict::policy::h2o();
  snapkv_only c;
  const kvevict::status st = snapkv_only::plan(opt, &c);
  REQUIRE(st.code() == kvevict::errc::unsupported);
  REQUIRE(std::string(st.argument()) == "policy.kind");
  REQUIRE_FALSE(c.planned());
  opt.policy = kvevict::policy::snapkv();
  REQUIRE(snapkv_only::plan(opt, &c).ok());
  REQUIRE(c.sequence_state_size() == 0);
  opt.policy = kvevict::policy::deferkv();
  deferkv_knorm dk;
  REQUIRE(deferkv_knorm::plan(opt, &dk).ok());
  kvevict::compressor every;
  REQUIRE(kvevict::compressor::plan(opt, &every).ok());
  REQUIRE(dk.sequence_state_size() == every.sequence_state_size());
  REQUIRE(dk.workspace_size() == every.workspace_size());
}

TEST_CASE("compressor: one run() per layer per step; the tracer counts them", "[compressor]") {
  kvevict::deferkv_config d;
  d.window = 7;
  d.delay = 2;
  std::vector<sequence_data<float>> seqs;
  for (int s = 0; s < 3; ++s)
    seqs.push_back(make_sequence<float>(30 + s, kSteps, {test::layout::contiguous, test::layout::contiguous}, 40 + s));
  call_counter counter;
  (void)by_compressor(seqs, kvevict::policy::deferkv(d), kvevict::budget::tokens(12), alloc::adakv, &counter);
  REQUIRE(counter.calls == kLayers * (1 + kSteps));
  REQUIRE(counter.evicted == kLayers * 3);       // each sequence at each layer, once
  REQUIRE(counter.observed == kLayers * 3 * 2);  // prefill and decode step 0 observe; step 1 evicts
}
