// Concurrency (design.md §9: "concurrent calls on different layers are safe"):
//   A. several threads, each owning one layer (its caches, queries, scores, keep-list,
//      workspace and DeferKV state; nothing shared), run the whole pipeline -- score with
//      every policy, select, evict, flatten, the DeferKV lifecycle -- over and over;
//   B. kvevict's executor hook on a real std::thread pool, heads in parallel, for every
//      entry point that takes an executor;
//   C. both at once: layer threads each with their own pool, and layer threads sharing one
//      pool (the pool serialises its parallel_for calls);
//   D. the compressor: one plan, one sequence state, run() of each layer on its own thread.
// Every result must equal the single-threaded one bit for bit. Built as `kvevict_tsan`;
// under -fsanitize=thread (scripts/test's tsan stage) any data race fails the run, and in
// ordinary builds it is a threaded correctness test. Exit status 0 on success.
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/checksum.hpp"
#include "support/test_cache.hpp"
#include "tsan/thread_pool.hpp"

namespace {

using i64 = std::int64_t;
std::atomic<int> failures{0};
std::mutex print_mutex;

#define TSAN_CHECK(cond, ...)                                       \
  do {                                                              \
    if (!(cond)) {                                                  \
      std::lock_guard<std::mutex> lock_(print_mutex);               \
      std::printf("FAILED %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::printf(__VA_ARGS__);                                     \
      std::printf("\n");                                            \
      ++failures;                                                   \
    }                                                               \
  } while (0)

using test::fnv;

/// One layer's whole eviction pipeline. Everything it touches is its own.
template <class T>
struct layer_job {
  static constexpr i64 hkv = 4, group = 2, d = 32, lp = 240, w = 16, delay = 2;
  int id;
  test::layout kind;
  std::vector<double> kd, vd, qd, dq0, dq1;
  std::vector<i64> qpos;

  layer_job(int id_, test::layout kind_) : id(id_), kind(kind_) {
    const std::uint64_t seed = 1000 + static_cast<std::uint64_t>(id_) * 17;
    kd = test::normal(static_cast<std::size_t>(hkv * (lp + delay) * d), seed);
    vd = test::normal(static_cast<std::size_t>(hkv * (lp + delay) * d), seed + 1);
    qd = test::normal(static_cast<std::size_t>(hkv * group * w * d), seed + 2, 1.5);
    dq0 = test::normal(static_cast<std::size_t>(hkv * group * d), seed + 3);
    dq1 = test::normal(static_cast<std::size_t>(hkv * group * d), seed + 4);
    for (i64 t = 0; t < w; ++t) qpos.push_back(lp - w + t);
  }

  /// Runs the pipeline with `exec` and returns a checksum of every output.
  std::uint64_t run(const kvevict::executor& exec) const {
    std::uint64_t sum = test::fnv_seed;
    auto keys = test::make_cache<T>(kind, hkv, lp + delay, d, kd, 16, 3 + static_cast<std::uint64_t>(id));
    auto values = test::make_cache<T>(kind, hkv, lp + delay, d, vd, 16, 4 + static_cast<std::uint64_t>(id));
    auto queries = test::make_queries<T>(hkv * group, w, d, qd, qpos);
    const kvevict::layer_shape shape{hkv * group, hkv, d, lp + delay, w};
    kvevict::layer_inputs<T> in;
    in.keys = keys.view.first_tokens(lp);
    in.queries = queries.view;
    std::vector<float> scores(static_cast<std::size_t>(hkv * lp));
    const kvevict::score_view sv{scores.data(), hkv, lp, lp};

    // Every policy's scores.
    kvevict::workspace ws;
    auto score_with = [&](const auto& policy) {
      ws.reserve(policy.workspace_size(shape, exec));
      const kvevict::status st = policy.score(in, sv, ws, exec);
      TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
      sum = fnv(sum, scores);
    };
    kvevict::window_config factory = kvevict::presets::kvcache_factory_longbench();
    factory.window = in.queries.num_queries;  // the window is the observations handed in
    score_with(kvevict::snapkv<T>(factory));
    score_with(kvevict::h2o<T>(kvevict::h2o_config{4}));
    score_with(kvevict::knorm<T>());
    score_with(kvevict::keydiff<T>());
    score_with(kvevict::streaming_llm<T>());
    score_with(kvevict::chunkkv<kvevict::knorm<T>>(kvevict::knorm<T>(), {8}));
    kvevict::window_config press = kvevict::presets::kvpress_snapkv();
    press.window = in.queries.num_queries;
    const kvevict::snapkv<T> snap(press);
    score_with(snap);

    // Select (uniform and per head), then evict and flatten.
    const kvevict::selection_params sp{w, kvevict::protected_mode::inside_budget};
    kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, lp, kvevict::budget::ratio(0.5), sp));
    kvevict::workspace sws(kvevict::select_workspace_size(lp, exec));
    kvevict::status st = kvevict::select(sv, kvevict::budget::ratio(0.5), sp, keep, sws, exec);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    std::vector<i64> budgets{30, 60, 90, 120};
    kvevict::keep_list keep2(hkv, 30 + 60 + 90 + 120);
    st = kvevict::select(sv, budgets.data(), sp, keep2, sws, exec);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    for (i64 h = 0; h < hkv; ++h) {
      const std::vector<i64> a = keep.head(h), b = keep2.head(h);
      sum = fnv(fnv(sum, a), b);
    }
    std::vector<T> flat(static_cast<std::size_t>(hkv * lp * d));
    std::vector<i64> cu(static_cast<std::size_t>(hkv + 1));
    st = kvevict::flatten_varlen(keys.view.first_tokens(lp), keep2, flat.data(), hkv * lp, d, cu.data(), exec);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    sum = fnv(fnv(sum, flat), cu);
    kvevict::eviction_result result;
    std::vector<i64> lengths(static_cast<std::size_t>(hkv)), positions(static_cast<std::size_t>(keep.view().total()));
    result.head_lengths = lengths.data();
    result.positions = positions.data();
    auto k_l = keys.view.first_tokens(lp);
    auto v_l = values.view.first_tokens(lp);
    kvevict::workspace ews(kvevict::evict_workspace_size(k_l, v_l, exec));
    st = kvevict::evict(k_l, v_l, keep, result, ews, nullptr, exec);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    sum = fnv(fnv(fnv(fnv(sum, keys.buffer), values.buffer), lengths), positions);

    // The DeferKV lifecycle on fresh caches.
    auto dkeys = test::make_cache<T>(kind, hkv, lp + delay, d, kd, 16, 5 + static_cast<std::uint64_t>(id));
    kvevict::deferkv_config cfg;
    cfg.window = w;
    cfg.delay = delay;
    kvevict::deferkv_state<T> state(cfg, id);
    st = state.reserve(hkv, lp);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    ws.reserve(state.workspace_size(shape, exec));
    kvevict::layer_inputs<T> pre;
    pre.keys = dkeys.view.first_tokens(lp);
    pre.queries = queries.view;
    st = state.observe_prefill(id, pre, ws, exec);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    const std::vector<double>* dq[2] = {&dq0, &dq1};
    for (i64 step = 0; step < delay; ++step) {
      auto q1 = test::make_queries<T>(hkv * group, 1, d, *dq[step], {lp + step});
      kvevict::layer_inputs<T> dec;
      dec.keys = dkeys.view.first_tokens(lp + step + 1);
      dec.queries = q1.view;
      st = state.observe_decode(id, step, dec, ws, exec);
      TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    }
    const i64 n = state.num_tokens();
    std::vector<float> dscores(static_cast<std::size_t>(hkv * n));
    st = state.scores({dscores.data(), hkv, n, n}, ws);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    sum = fnv(sum, dscores);
    kvevict::keep_list dkeep(hkv, kvevict::select_capacity(hkv, n, kvevict::budget::tokens(64), state.selection()));
    st = kvevict::select(kvevict::const_score_view{dscores.data(), hkv, n, n}, kvevict::budget::tokens(64),
                         state.selection(), dkeep, sws, exec);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    auto dv = test::make_cache<T>(kind, hkv, lp + delay, d, vd, 16, 6 + static_cast<std::uint64_t>(id));
    kvevict::workspace dws(kvevict::evict_workspace_size(dkeys.view, dv.view, exec));
    st = kvevict::evict(dkeys.view, dv.view, dkeep, result, dws, nullptr, exec);
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    st = state.mark_evicted();
    TSAN_CHECK(st.ok(), "layer %d: %s", id, st.message());
    sum = fnv(fnv(sum, dkeys.buffer), dv.buffer);
    return sum;
  }
};

/// Type-erased jobs over several dtypes and layouts.
struct any_job {
  std::function<std::uint64_t(const kvevict::executor&)> run;
  std::string name;
};

std::vector<any_job> make_jobs() {
  std::vector<any_job> jobs;
  const test::layout kinds[] = {test::layout::contiguous, test::layout::paged_nhd,   test::layout::transposed,
                                test::layout::paged_hnd,  test::layout::token_major, test::layout::padded};
  for (int i = 0; i < 6; ++i) {
    const test::layout kind = kinds[i];
    const std::string name = "layer " + std::to_string(i) + " (" + test::name(kind) + ")";
    if (i % 3 == 0) {
      auto job = std::make_shared<layer_job<float>>(i, kind);
      jobs.push_back({[job](const kvevict::executor& e) { return job->run(e); }, name + " f32"});
    } else if (i % 3 == 1) {
      auto job = std::make_shared<layer_job<kvevict::bf16>>(i, kind);
      jobs.push_back({[job](const kvevict::executor& e) { return job->run(e); }, name + " bf16"});
    } else {
      auto job = std::make_shared<layer_job<kvevict::fp16>>(i, kind);
      jobs.push_back({[job](const kvevict::executor& e) { return job->run(e); }, name + " f16"});
    }
  }
  return jobs;
}

/// D. One compressor and one DeferKV sequence state shared by layer threads: each thread
/// runs its own layer's calls (prefill_end, two decode steps: observe, then evict) on its own
/// caches and workspace, touching only its layer's part of the state. Returns the checksum
/// of every layer's cache and state afterwards.
std::uint64_t compressor_layers(bool threaded, const kvevict::executor& exec) {
  constexpr i64 layers = 4, hkv = 2, group = 3, d = 24, lp = 150, w = 12;
  kvevict::deferkv_config cfg;
  cfg.window = w;
  cfg.delay = 2;
  kvevict::compressor_options opt;
  opt.model = {layers, hkv * group, hkv, d, 0, kvevict::dtype::bf16};
  opt.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
  opt.policy = kvevict::policy::deferkv(cfg);
  opt.per_head = kvevict::budget::tokens(40);
  opt.heads = kvevict::head_allocation::adakv;
  opt.limits.max_tokens = lp + 2;
  opt.exec = exec;
  kvevict::compressor c;
  kvevict::status st = kvevict::compressor::plan(opt, &c);
  TSAN_CHECK(st.ok(), "compressor: %s", st.message());
  std::vector<std::uint64_t> state(c.sequence_state_size() / 8 + 1);
  st = c.reset_sequence(state.data(), state.size() * 8);
  TSAN_CHECK(st.ok(), "compressor: %s", st.message());
  std::vector<test::test_cache<kvevict::bf16>> k, v;
  std::vector<test::test_queries<kvevict::bf16>> q, dq0, dq1;
  std::vector<i64> qpos;
  for (i64 t = 0; t < w; ++t) qpos.push_back(lp - w + t);
  for (i64 l = 0; l < layers; ++l) {
    const auto seed = static_cast<std::uint64_t>(500 + 10 * l);
    k.push_back(test::make_cache<kvevict::bf16>(test::layout::paged_nhd, hkv, lp + 2, d,
                                                test::normal(static_cast<std::size_t>(hkv * (lp + 2) * d), seed), 16,
                                                seed));
    v.push_back(test::make_cache<kvevict::bf16>(test::layout::contiguous, hkv, lp + 2, d,
                                                test::normal(static_cast<std::size_t>(hkv * (lp + 2) * d), seed + 1)));
    q.push_back(test::make_queries<kvevict::bf16>(
        hkv * group, w, d, test::normal(static_cast<std::size_t>(hkv * group * w * d), seed + 2), qpos));
    dq0.push_back(test::make_queries<kvevict::bf16>(
        hkv * group, 1, d, test::normal(static_cast<std::size_t>(hkv * group * d), seed + 3), {lp}));
    dq1.push_back(test::make_queries<kvevict::bf16>(
        hkv * group, 1, d, test::normal(static_cast<std::size_t>(hkv * group * d), seed + 4), {lp + 1}));
  }
  auto run_layer = [&](i64 l) {
    kvevict::workspace ws(c.workspace_size());
    kvevict::sequence_io<kvevict::bf16> io;
    io.state = state.data();
    kvevict::sequence_report r;
    for (i64 step = 0; step < 3; ++step) {
      const i64 n = lp + step;
      io.event = step == 0 ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
      io.keys = k[static_cast<std::size_t>(l)].view.first_tokens(n);
      io.values = v[static_cast<std::size_t>(l)].view.first_tokens(n);
      io.queries =
          step == 0 ? q[static_cast<std::size_t>(l)].view : (step == 1 ? dq0 : dq1)[static_cast<std::size_t>(l)].view;
      const kvevict::status s = c.run(l, &io, 1, &r, ws);
      TSAN_CHECK(s.ok(), "compressor layer %lld: %s", static_cast<long long>(l), s.message());
    }
    TSAN_CHECK(r.action == kvevict::sequence_action::evicted, "compressor layer %lld did not evict",
               static_cast<long long>(l));
  };
  if (threaded) {
    std::vector<std::thread> threads;
    for (i64 l = 0; l < layers; ++l) threads.emplace_back(run_layer, l);
    for (std::thread& t : threads) t.join();
  } else {
    for (i64 l = 0; l < layers; ++l) run_layer(l);
  }
  std::uint64_t sum = fnv(test::fnv_seed, state);
  for (i64 l = 0; l < layers; ++l)
    sum = fnv(fnv(sum, k[static_cast<std::size_t>(l)].buffer), v[static_cast<std::size_t>(l)].buffer);
  return sum;
}

}  // namespace

int main() {
  const std::vector<any_job> jobs = make_jobs();
  const std::size_t n = jobs.size();
  std::vector<std::uint64_t> expected(n);
  for (std::size_t i = 0; i < n; ++i) expected[i] = jobs[i].run(kvevict::executor{});

  // A. One thread per layer, serial executors, several rounds each.
  {
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < n; ++i)
      threads.emplace_back([&, i] {
        for (int round = 0; round < 2; ++round)
          TSAN_CHECK(jobs[i].run(kvevict::executor{}) == expected[i], "%s, round %d (threads)", jobs[i].name.c_str(),
                     round);
      });
    for (std::thread& t : threads) t.join();
  }
  std::printf("A. %zu layers on %zu threads: done\n", n, n);

  // B. The executor hook on a real pool: heads in parallel.
  {
    test::thread_pool pool(4, test::thread_pool::order::interleaved);
    for (std::size_t i = 0; i < n; ++i)
      TSAN_CHECK(jobs[i].run(pool.executor()) == expected[i], "%s (pool of 4)", jobs[i].name.c_str());
    i64 tasks = 0, busy = 0;
    for (i64 t : pool.tasks_per_worker()) {
      tasks += t;
      busy += t > 0 ? 1 : 0;
    }
    std::printf("B. executor hook on a 4-thread pool: %lld tasks over %lld workers\n", static_cast<long long>(tasks),
                static_cast<long long>(busy));
    TSAN_CHECK(tasks > 0, "the pool ran no task");
  }

  // C1. Layer threads, each with its own pool of 2.
  {
    std::vector<std::thread> threads;
    for (std::size_t i = 0; i < n; i += 2)
      threads.emplace_back([&, i] {
        test::thread_pool pool(2, i % 4 == 0 ? test::thread_pool::order::reverse : test::thread_pool::order::forward);
        TSAN_CHECK(jobs[i].run(pool.executor()) == expected[i], "%s (own pool)", jobs[i].name.c_str());
      });
    for (std::thread& t : threads) t.join();
  }
  // C2. Layer threads sharing one pool.
  {
    test::thread_pool shared(3);
    std::vector<std::thread> threads;
    for (std::size_t i = 1; i < n; i += 2)
      threads.emplace_back([&, i] {
        TSAN_CHECK(jobs[i].run(shared.executor()) == expected[i], "%s (shared pool)", jobs[i].name.c_str());
      });
    for (std::thread& t : threads) t.join();
  }
  std::printf("C. layer threads with own and shared pools: done\n");

  // D. The compressor: layer threads on one sequence state, with and without a pool.
  {
    const std::uint64_t serial = compressor_layers(false, kvevict::executor{});
    TSAN_CHECK(compressor_layers(true, kvevict::executor{}) == serial, "compressor: layer threads");
    test::thread_pool pool(2);
    TSAN_CHECK(compressor_layers(true, pool.executor()) == serial, "compressor: layer threads on a shared pool");
  }
  std::printf("D. compressor run() per layer on 4 threads, one sequence state: done\n");

  if (failures.load() != 0) {
    std::printf("kvevict_tsan: %d check(s) failed\n", failures.load());
    return 1;
  }
  std::printf("kvevict_tsan: all concurrent results equal the serial ones\n");
  return 0;
}
