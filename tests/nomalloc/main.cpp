// No allocation in the hot path (design.md §1): once workspaces, keep-lists and the
// DeferKV state are sized, score / select / evict / DeferKV observe calls -- successful and
// failing -- must not touch the heap. Two independent detectors:
//   * Eigen's own: EIGEN_RUNTIME_NO_MALLOC with set_is_malloc_allowed(false) flags any
//     heap allocation inside Eigen (its GEMM packing buffers above the stack limit);
//   * global counters: operator new (every form) is replaced, and malloc/calloc/realloc/
//     aligned allocation are interposed where no sanitizer owns them.
// Its own executable (EIGEN_RUNTIME_NO_MALLOC changes Eigen's inline functions, so it must
// not share a binary with the other tests). Head dims 64, 128, 256; observation sets from
// one decode query (cached logits) to more rows than one GEMM call takes. Exit 0 on success.
#define EIGEN_RUNTIME_NO_MALLOC
#if defined(__GNUC__) && !defined(__clang__)
// The replaced operator delete frees what the replaced operator new malloc'ed; GCC cannot
// see that pairing once the operators are inlined.
#pragma GCC diagnostic ignored "-Wmismatched-new-delete"
#endif
#include <atomic>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <new>

namespace nomalloc {
std::atomic<bool> counting{false}, quiet{false};
std::atomic<long> news{0}, mallocs{0}, eigen_flags{0};
void record_eigen_assert(const char* what, const char* file, int line) {
  if (counting.load()) {
    ++eigen_flags;
    if (!quiet.load()) std::fprintf(stderr, "Eigen assertion while counting: %s (%s:%d)\n", what, file, line);
  }
}
}  // namespace nomalloc

// Every eigen_assert (including "heap allocation is forbidden") is recorded, never fatal,
// and active even with NDEBUG.
#define eigen_assert(x)                                                               \
  do {                                                                                \
    if (!static_cast<bool>(x)) nomalloc::record_eigen_assert(#x, __FILE__, __LINE__); \
  } while (false)

#include <Eigen/Core>

#include <algorithm>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "support/test_cache.hpp"
#include "tsan/thread_pool.hpp"

// ---- operator new / delete, every form, counted while `counting` ----
namespace {
void* counted_alloc(std::size_t n, std::size_t align) {
  if (nomalloc::counting.load(std::memory_order_relaxed)) ++nomalloc::news;
  if (n == 0) n = 1;
  void* p = nullptr;
  if (align <= alignof(std::max_align_t)) {
    p = std::malloc(n);
  } else if (posix_memalign(&p, align, n) != 0) {
    p = nullptr;
  }
  return p;
}
}  // namespace

void* operator new(std::size_t n) {
  void* p = counted_alloc(n, 0);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t n) {
  void* p = counted_alloc(n, 0);
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc(n, 0);
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  return counted_alloc(n, 0);
}
void* operator new(std::size_t n, std::align_val_t a) {
  void* p = counted_alloc(n, static_cast<std::size_t>(a));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new[](std::size_t n, std::align_val_t a) {
  void* p = counted_alloc(n, static_cast<std::size_t>(a));
  if (p == nullptr) throw std::bad_alloc();
  return p;
}
void* operator new(std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void* operator new[](std::size_t n, std::align_val_t a, const std::nothrow_t&) noexcept {
  return counted_alloc(n, static_cast<std::size_t>(a));
}
void operator delete(void* p) noexcept {
  std::free(p);
}
void operator delete[](void* p) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t) noexcept {
  std::free(p);
}
void operator delete(void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept {
  std::free(p);
}
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept {
  std::free(p);
}

// ---- malloc and friends (glibc, no sanitizer): forwarded to glibc's own entry points ----
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(thread_sanitizer) || __has_feature(memory_sanitizer)
#define KVEVICT_NOMALLOC_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__) || defined(__SANITIZE_THREAD__)
#define KVEVICT_NOMALLOC_SANITIZED 1
#endif
#if defined(__GLIBC__) && !defined(KVEVICT_NOMALLOC_SANITIZED)
#define KVEVICT_NOMALLOC_MALLOC_HOOKS 1
extern "C" {
void* __libc_malloc(std::size_t) noexcept;
void* __libc_calloc(std::size_t, std::size_t) noexcept;
void* __libc_realloc(void*, std::size_t) noexcept;
void* __libc_memalign(std::size_t, std::size_t) noexcept;
void* malloc(std::size_t n) noexcept {
  if (nomalloc::counting.load(std::memory_order_relaxed)) ++nomalloc::mallocs;
  return __libc_malloc(n);
}
void* calloc(std::size_t n, std::size_t m) noexcept {
  if (nomalloc::counting.load(std::memory_order_relaxed)) ++nomalloc::mallocs;
  return __libc_calloc(n, m);
}
void* realloc(void* p, std::size_t n) noexcept {
  if (nomalloc::counting.load(std::memory_order_relaxed)) ++nomalloc::mallocs;
  return __libc_realloc(p, n);
}
void* aligned_alloc(std::size_t a, std::size_t n) noexcept {
  if (nomalloc::counting.load(std::memory_order_relaxed)) ++nomalloc::mallocs;
  return __libc_memalign(a, n);
}
void* memalign(std::size_t a, std::size_t n) noexcept {
  if (nomalloc::counting.load(std::memory_order_relaxed)) ++nomalloc::mallocs;
  return __libc_memalign(a, n);
}
int posix_memalign(void** out, std::size_t a, std::size_t n) noexcept {
  if (nomalloc::counting.load(std::memory_order_relaxed)) ++nomalloc::mallocs;
  void* p = __libc_memalign(a, n);
  if (p == nullptr) return 12;  // ENOMEM
  *out = p;
  return 0;
}
}
#endif

namespace {

using i64 = std::int64_t;
int failures = 0;

/// Runs `fn` with both detectors armed; reports and counts any allocation.
void no_alloc(const std::string& what, const std::function<bool()>& fn) {
  const long n0 = nomalloc::news.load(), m0 = nomalloc::mallocs.load(), e0 = nomalloc::eigen_flags.load();
  Eigen::internal::set_is_malloc_allowed(false);
  nomalloc::counting.store(true);
  const bool ok = fn();
  nomalloc::counting.store(false);
  Eigen::internal::set_is_malloc_allowed(true);
  const long dn = nomalloc::news.load() - n0, dm = nomalloc::mallocs.load() - m0,
             de = nomalloc::eigen_flags.load() - e0;
  if (!ok || dn != 0 || dm != 0 || de != 0) {
    std::printf("FAILED %s: %s, %ld operator new, %ld malloc, %ld Eigen heap/assert\n", what.c_str(),
                ok ? "result ok" : "unexpected status", dn, dm, de);
    ++failures;
  }
}

template <class T>
void run_shape(i64 d, i64 group, i64 w, i64 l) {
  const i64 hkv = 2, hq = hkv * group;
  const std::string tag = "d=" + std::to_string(d) + " G*W=" + std::to_string(group * w) + " L=" + std::to_string(l);
  // ---- everything sized up front ----
  auto keys = test::make_cache<T>(test::layout::contiguous, hkv, l + 2, d,
                                  test::normal(static_cast<std::size_t>(hkv * (l + 2) * d), 1), 16, 1);
  auto values = test::make_cache<T>(test::layout::paged_nhd, hkv, l + 2, d,
                                    test::normal(static_cast<std::size_t>(hkv * (l + 2) * d), 2), 16, 2);
  auto paged_keys = test::make_cache<T>(test::layout::paged_hnd, hkv, l + 2, d,
                                        test::normal(static_cast<std::size_t>(hkv * (l + 2) * d), 3), 16, 3);
  std::vector<i64> qpos;
  for (i64 t = 0; t < w; ++t) qpos.push_back(l - w + t);
  auto queries = test::make_queries<T>(hq, w, d, test::normal(static_cast<std::size_t>(hq * w * d), 4), qpos);
  auto decode_q = test::make_queries<T>(hq, 1, d, test::normal(static_cast<std::size_t>(hq * d), 5), {l});
  std::vector<float> scores(static_cast<std::size_t>(hkv * (l + 2))), lse(static_cast<std::size_t>(hq * w), 3.0f);
  std::vector<float> weights(static_cast<std::size_t>(w), 0.5f), attn(static_cast<std::size_t>(hq * w * l), 0.01f);
  const kvevict::score_view sv{scores.data(), hkv, l, l};
  const kvevict::layer_shape shape{hq, hkv, d, l + 2, w};
  test::thread_pool pool(2);
  const kvevict::executor serial{}, pooled = pool.executor();

  kvevict::layer_inputs<T> in;
  in.keys = keys.view.first_tokens(l);
  in.queries = queries.view;
  kvevict::layer_inputs<T> with_attn = in;
  with_attn.attention = kvevict::contiguous_attention(attn.data(), hq, w, l, qpos.data());
  const auto with_window = [w](kvevict::window_config c) {
    c.window = std::max<std::int64_t>(c.window, w);  // at least the observations handed in
    return c;
  };
  const kvevict::snapkv<T> snap(with_window(kvevict::presets::kvpress_snapkv()));
  const kvevict::snapkv<T> paper(with_window(kvevict::presets::snapkv_paper()));
  const kvevict::h2o<T> h2o(kvevict::h2o_config{8});
  const kvevict::knorm<T> knorm;
  const kvevict::keydiff<T> keydiff;
  const kvevict::tova<T> tova;
  kvevict::layer_inputs<T> last_query = in;  // TOVA observes the last query only
  last_query.queries.data += (last_query.queries.num_queries - 1) * last_query.queries.query_stride;
  last_query.queries.positions += last_query.queries.num_queries - 1;
  last_query.queries.num_queries = 1;
  const kvevict::streaming_llm<T> streaming;
  const kvevict::chunkkv<kvevict::snapkv<T>> chunk(snap);
  const kvevict::dapq<T> dapq;
  kvevict::scoring_params weighted = kvevict::presets::adakv().params();
  weighted.window = kvevict::window_aggregation::weighted;

  std::size_t ws_bytes = 0;
  for (const kvevict::executor* e : {&serial, &pooled}) {
    ws_bytes = std::max(
        {ws_bytes, snap.workspace_size(shape, *e), paper.workspace_size(shape, *e), h2o.workspace_size(shape, *e),
         knorm.workspace_size(shape, *e), keydiff.workspace_size(shape, *e), tova.workspace_size(shape, *e),
         chunk.workspace_size(shape, *e), dapq.workspace_size(shape, *e),
         kvevict::observation_scores_workspace_size(shape, weighted, *e), kvevict::select_workspace_size(l + 2, *e),
         kvevict::adakv_workspace_size(hkv, l), kvevict::evict_workspace_size(keys.view, values.view, *e),
         kvevict::evict_workspace_size(paged_keys.view, values.view, *e)});
  }
  kvevict::deferkv_config dcfg;
  dcfg.window = w;
  dcfg.delay = 2;
  kvevict::deferkv_state<T> state(dcfg, 0);
  if (!state.reserve(hkv, l).ok()) ++failures;
  for (const kvevict::executor* e : {&serial, &pooled}) ws_bytes = std::max(ws_bytes, state.workspace_size(shape, *e));
  // The compressor's run() (both layers share these caches: values do not matter here).
  auto compressor_keys = test::make_cache<T>(test::layout::paged_nhd, hkv, l + 2, d,
                                             test::normal(static_cast<std::size_t>(hkv * (l + 2) * d), 6), 16, 6);
  auto compressor_values = test::make_cache<T>(test::layout::contiguous, hkv, l + 2, d,
                                               test::normal(static_cast<std::size_t>(hkv * (l + 2) * d), 7), 16, 7);
  std::vector<std::uint64_t> compressor_state(static_cast<std::size_t>(2 * (hkv * (l + 2) + 64) + 64));
  ws_bytes = std::max<std::size_t>(ws_bytes, std::size_t{1} << 22);
  kvevict::workspace ws(ws_bytes);
  const kvevict::selection_params sp = snap.selection();
  kvevict::keep_list keep(hkv, hkv * (l + 2));
  std::vector<i64> budgets{l / 3, l / 2}, adakv_out(static_cast<std::size_t>(hkv)), layer_budgets(32);
  std::vector<i64> lengths(static_cast<std::size_t>(hkv)), positions(static_cast<std::size_t>(hkv * (l + 2)));
  std::vector<i64> cu(static_cast<std::size_t>(hkv + 1));
  std::vector<T> flat(static_cast<std::size_t>(hkv * (l + 2) * d));
  std::vector<T> rotated(static_cast<std::size_t>(hq * w * d));
  std::vector<i64> rotated_pos(static_cast<std::size_t>(w));
  std::vector<std::int32_t> prompt_ids(static_cast<std::size_t>(l), 7), pseudo_ids(32);
  kvevict::eviction_result result;
  result.head_lengths = lengths.data();
  result.positions = positions.data();
  kvevict::rope_config rope;
  rope.head_dim = d;
  rope.llama3.enabled = true;
  const auto view = [&] { return kvevict::const_score_view{scores.data(), hkv, l, l}; };

  // ---- the hot path, with both detectors armed ----
  for (const kvevict::executor* e : {&serial, &pooled}) {
    const std::string x = tag + (e == &serial ? " serial" : " pool");
    no_alloc("snapkv kvpress " + x, [&] { return snap.score(in, sv, ws, *e).ok(); });
    no_alloc("snapkv paper " + x, [&] { return paper.score(in, sv, ws, *e).ok(); });
    no_alloc("h2o queries " + x, [&] { return h2o.score(in, sv, ws, *e).ok(); });
    no_alloc("h2o attention " + x, [&] { return h2o.score(with_attn, sv, ws, *e).ok(); });
    no_alloc("knorm " + x, [&] { return knorm.score(in, sv, ws, *e).ok(); });
    no_alloc("keydiff " + x, [&] { return keydiff.score(in, sv, ws, *e).ok(); });
    no_alloc("tova " + x, [&] { return tova.score(last_query, sv, ws, *e).ok(); });
    no_alloc("streaming_llm " + x, [&] { return streaming.score(in, sv, ws, *e).ok(); });
    no_alloc("chunkkv " + x, [&] { return chunk.score(in, sv, ws, *e).ok(); });
    no_alloc("weighted + lse " + x, [&] {
      kvevict::observation_inputs oi;
      oi.weights = weights.data();
      oi.lse = lse.data();
      return kvevict::observation_scores(queries.view, in.keys, weighted, sv, ws, oi, *e).ok();
    });
    no_alloc("dapq rerotate + score " + x, [&] {
      kvevict::query_view<const T> pseudo;
      if (!kvevict::dapq_rerotate(queries.view, rope, w, rotated.data(), rotated_pos.data(), &pseudo).ok())
        return false;
      kvevict::layer_inputs<T> dq = in;
      dq.queries = pseudo;
      return dapq.score(dq, sv, ws, *e).ok() &&
             kvevict::dapq_pseudo_tokens_first_last(prompt_ids.data(), l, 8, 24, pseudo_ids.data()).ok();
    });
    no_alloc("select " + x, [&] {
      return kvevict::select(view(), kvevict::budget::ratio(0.6), sp, keep, ws, *e).ok() &&
             kvevict::select(view(), budgets.data(), sp, keep, ws, *e).ok();
    });
    no_alloc("adakv + pyramidkv " + x, [&] {
      return kvevict::adakv_head_budgets(view(), w, l / 4, {0.2, true}, adakv_out.data(), ws).ok() &&
             kvevict::pyramidkv_layer_budgets(l / 2, w, 32, l, layer_budgets.data()).ok();
    });
    no_alloc("evict strided K, paged V " + x, [&] {
      if (!kvevict::select(view(), kvevict::budget::ratio(0.5), sp, keep, ws, *e).ok()) return false;
      return kvevict::evict(keys.view.first_tokens(l), values.view.first_tokens(l), keep, result, ws, nullptr, *e).ok();
    });
    no_alloc("evict paged K " + x, [&] {
      return kvevict::evict(paged_keys.view.first_tokens(l), values.view.first_tokens(l), keep, result, ws, nullptr, *e)
          .ok();
    });
    no_alloc("flatten_varlen + keep_list_positions " + x, [&] {
      return kvevict::flatten_varlen(keys.view.first_tokens(l), keep, flat.data(), hkv * (l + 2), d, cu.data(), *e)
                 .ok() &&
             kvevict::keep_list_positions(keep, l, nullptr, positions.data()).ok();
    });
    no_alloc("deferkv lifecycle " + x, [&] {
      state.reset();
      kvevict::layer_inputs<T> pre = in;
      pre.keys = keys.view.first_tokens(l);
      if (!state.observe_prefill(0, pre, ws, *e).ok()) return false;
      for (i64 step = 0; step < 2; ++step) {
        const i64 pos = l + step;
        kvevict::query_view<const T> q1 = decode_q.view;
        q1.positions = &pos;
        kvevict::layer_inputs<T> dec;
        dec.keys = keys.view.first_tokens(l + step + 1);
        dec.queries = q1;
        const kvevict::status st = state.observe_decode(0, step, dec, ws, *e);
        if (!st.ok()) {
          std::printf("  %s\n", st.message());
          return false;
        }
      }
      return state.scores({scores.data(), hkv, l + 2, l + 2}, ws).ok() && state.mark_evicted().ok();
    });
    no_alloc("compressor: DeferKV + AdaKV + PyramidKV, prefill and two decode steps " + x, [&] {
      kvevict::compressor_options opt;
      opt.model = {2, hq, hkv, d, 0, kvevict::dtype_of<T>::value};
      opt.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
      opt.policy = kvevict::policy::deferkv(dcfg);
      opt.per_head = kvevict::budget::tokens(l / 4);
      opt.heads = kvevict::head_allocation::adakv;
      opt.layers = kvevict::layer_allocation::pyramidkv;
      opt.limits.max_tokens = l + 2;
      opt.exec = *e;
      kvevict::compressor c;
      if (!kvevict::compressor::plan(opt, &c).ok() || c.workspace_size() > ws.size() ||
          c.sequence_state_size() > compressor_state.size() * 8 ||
          !c.reset_sequence(compressor_state.data(), compressor_state.size() * 8).ok())
        return false;
      kvevict::sequence_io<T> io;
      io.event = kvevict::sequence_event::prefill_end;
      io.keys = compressor_keys.view.first_tokens(l);
      io.values = compressor_values.view.first_tokens(l);
      io.queries = queries.view;
      io.state = compressor_state.data();
      io.head_lengths = lengths.data();
      kvevict::sequence_report report;
      for (i64 layer = 0; layer < 2; ++layer)
        if (!c.run(layer, &io, 1, &report, ws).ok()) return false;
      io.event = kvevict::sequence_event::decode;
      for (i64 step = 0; step < 2; ++step) {
        const i64 pos = l + step;
        io.queries = decode_q.view;
        io.queries.positions = &pos;
        io.keys = compressor_keys.view.first_tokens(l + step + 1);
        io.values = compressor_values.view.first_tokens(l + step + 1);
        for (i64 layer = 0; layer < 2; ++layer)
          if (!c.run(layer, &io, 1, &report, ws).ok()) return false;
      }
      return report.action == kvevict::sequence_action::evicted;
    });
    // Decode-time budgets: the compressor planned and its state sized outside the count.
    kvevict::compressor_options dopt;
    dopt.model = {1, hq, hkv, d, 0, kvevict::dtype_of<T>::value};
    dopt.sharing = kvevict::block_sharing::none;
    dopt.policy = kvevict::policy::snapkv(kvevict::presets::snapkv_paper());
    dopt.policy.config<kvevict::snapkv_traits>().window = w;
    dopt.per_head = kvevict::budget::tokens(l / 2);
    kvevict::window_config dw = kvevict::presets::kvpress_snapkv();
    dw.window = 2;
    dopt.decoding.policy = kvevict::policy::snapkv(dw);
    dopt.decoding.target = kvevict::budget::tokens(l / 4);
    dopt.decoding.interval = 1;
    dopt.limits.max_tokens = l + 2;
    dopt.exec = *e;
    kvevict::compressor decoding;
    if (!kvevict::compressor::plan(dopt, &decoding).ok() || decoding.workspace_size() > ws.size()) ++failures;
    std::vector<std::uint64_t> decoding_state(decoding.sequence_state_size() / 8 + 1);
    no_alloc("compressor: decode-time budgets, prefill and three decode steps with rounds " + x, [&] {
      if (!decoding.reset_sequence(decoding_state.data(), decoding_state.size() * 8).ok()) return false;
      kvevict::sequence_io<T> io;
      io.event = kvevict::sequence_event::prefill_end;
      io.keys = compressor_keys.view.first_tokens(l);
      io.values = compressor_values.view.first_tokens(l);
      io.queries = queries.view;
      io.state = decoding_state.data();
      kvevict::sequence_report report;
      if (!decoding.run(0, &io, 1, &report, ws).ok()) return false;
      io.event = kvevict::sequence_event::decode;
      i64 rounds = 0;
      for (i64 step = 0; step < 3; ++step) {
        const i64 pos = l + step;
        io.queries = decode_q.view;
        io.queries.positions = &pos;
        io.keys = compressor_keys.view.first_tokens(report.length + 1);
        io.values = compressor_values.view.first_tokens(report.length + 1);
        if (!decoding.run(0, &io, 1, &report, ws).ok()) return false;
        rounds += report.action == kvevict::sequence_action::evicted ? 1 : 0;
      }
      return rounds > 0;
    });
    // Failing calls build their message in the status itself: no allocation either.
    no_alloc("errors " + x, [&] {
      kvevict::layer_inputs<T> bad = in;
      bad.queries.num_heads = hq + 1;
      return !snap.score(bad, sv, ws, *e).ok() &&
             !kvevict::select(view(), kvevict::budget::tokens(-1), sp, keep, ws, *e).ok() &&
             !state.observe_decode(3, 0, in, ws, *e).ok() &&
             !kvevict::evict(keys.view, keys.view, keep, result, ws, nullptr, *e).ok();
    });
  }
}

}  // namespace

/// The detectors detect: an operator new, a malloc and an Eigen heap matrix are each seen.
bool detectors_work() {
  const long n0 = nomalloc::news.load(), m0 = nomalloc::mallocs.load(), e0 = nomalloc::eigen_flags.load();
  nomalloc::quiet.store(true);
  Eigen::internal::set_is_malloc_allowed(false);
  nomalloc::counting.store(true);
  int* volatile p = new int(3);
  void* volatile q = std::malloc(24);
  {
    Eigen::MatrixXf m(64, 64);
    m.setZero();
  }
  nomalloc::counting.store(false);
  Eigen::internal::set_is_malloc_allowed(true);
  nomalloc::quiet.store(false);
  delete p;
  std::free(q);
  bool ok = nomalloc::news.load() > n0 && nomalloc::eigen_flags.load() > e0;
#if defined(KVEVICT_NOMALLOC_MALLOC_HOOKS)
  ok = ok && nomalloc::mallocs.load() > m0;
#else
  (void)m0;
#endif
  return ok;
}

int main() {
  if (!detectors_work()) {
    std::printf("kvevict_nomalloc: the allocation detectors do not detect (self-test failed)\n");
    return 1;
  }
  // Shapes: one decode query (G*W <= 16, cached logits), a small window (cached), a prompt
  // window (two sweeps) and more rows than one GEMM call takes (chunked), for d = 64, 128, 256.
  for (std::int64_t d : {64, 128, 256}) {
    run_shape<kvevict::bf16>(d, 4, 1, 700);
    run_shape<kvevict::bf16>(d, 2, 8, 700);
    run_shape<float>(d, 4, 32, 600);
    run_shape<kvevict::fp16>(d, 8, 64, 300);
  }
#if defined(KVEVICT_NOMALLOC_MALLOC_HOOKS)
  const char* detectors = "operator new, malloc family and Eigen";
#else
  const char* detectors = "operator new and Eigen (malloc is the sanitizer's)";
#endif
  if (failures != 0) {
    std::printf("kvevict_nomalloc: %d hot-path call(s) allocated or failed (%s)\n", failures, detectors);
    return 1;
  }
  std::printf("kvevict_nomalloc: no allocation in any hot-path call (%s)\n", detectors);
  return 0;
}
