// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_BENCH_LONG_GENERATION_HPP
#define KVEVICT_BENCH_LONG_GENERATION_HPP

// One period of a long generation under decode-time budgets (compressor_options::decoding):
// N + 1 decode steps of one layer at the reference shape, from a cache at the target to the
// step that compresses it back. N steps put their query in the layer's window; the last one
// also scores, selects and compacts. The period's time over N + 1 is the compressor's cost per
// decoded token; the benchmark sets it against the time a decode step's attention needs at
// least (reading the layer's K and V once at the measured read bandwidth).

#include <cstring>
#include <ctime>
#include <vector>

#include "cases.hpp"
#include "common.hpp"

namespace kb {

/// This thread's CPU time in seconds (the period's own, whatever else the machine runs).
inline double thread_seconds() {
  timespec t{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

template <class T>
struct decode_period {
  model_shape shape;
  std::int64_t target = 0, interval = 0, capacity = 0, window = 8;
  buffer<T> k, v, k0, v0, q;
  std::int64_t length = 0;
  kvevict::compressor compressor;
  kvevict::workspace ws;
  std::vector<std::uint64_t> state, state0;
  std::vector<std::int64_t> positions;

  /// `scorer`: the decode scorer (SnapKV over the last `window` decode queries by default).
  decode_period(const model_shape& s, std::int64_t b, std::int64_t n, const kvevict::policy_config* scorer = nullptr)
      : shape(s), target(b), interval(n), capacity(b + n + 1) {
    const std::size_t rows = static_cast<std::size_t>(s.hkv * capacity * s.d);
    k.resize(rows);
    v.resize(rows);
    q.resize(static_cast<std::size_t>(s.hq * (n + 1) * s.d));
    fill_normal(k, 21, 1.0f);
    fill_normal(v, 22, 1.0f);
    fill_normal(q, 23, 2.0f);
    k0 = k;
    v0 = v;
    kvevict::compressor_options opt;
    opt.model = {1, s.hq, s.hkv, s.d, 0, kvevict::dtype_of<T>::value};
    opt.policy = kvevict::policy::snapkv(reference_snapkv(reference_window));
    opt.per_head = kvevict::budget::tokens(b);
    opt.limits.max_tokens = capacity;
    opt.decoding.policy = scorer != nullptr ? *scorer : kvevict::policy::snapkv(reference_snapkv(window));
    opt.decoding.target = kvevict::budget::tokens(b);
    opt.decoding.interval = n;
    die("compressor::plan", kvevict::compressor::plan(opt, &compressor));
    ws.reserve(compressor.workspace_size());
    state.assign(compressor.sequence_state_size() / 8 + 1, 0);
    die("compressor::reset_sequence", compressor.reset_sequence(state.data(), state.size() * 8));
    // The prompt: B rows, compressed to B (nothing dropped), then one period to fill the window.
    for (std::int64_t t = 0; t < n + 1; ++t) positions.push_back(b + t);
    length = b;
    std::vector<std::int64_t> prompt_pos;
    for (std::int64_t t = 0; t < reference_window; ++t) prompt_pos.push_back(b - reference_window + t);
    buffer<T> prompt_q(static_cast<std::size_t>(s.hq * reference_window * s.d));
    fill_normal(prompt_q, 24, 2.0f);
    kvevict::sequence_io<T> io = call(kvevict::sequence_event::prefill_end);
    io.queries = kvevict::contiguous_queries<const T>(prompt_q.data(), s.hq, reference_window, s.d, prompt_pos.data());
    kvevict::sequence_report r;
    die("compressor::run", compressor.run(0, &io, 1, &r, ws));
    state0 = state;
  }
  kvevict::sequence_io<T> call(kvevict::sequence_event e) {
    kvevict::sequence_io<T> io;
    io.event = e;
    io.keys = kvevict::hf_contiguous(k.data(), shape.hkv, length, shape.d, capacity);
    io.values = kvevict::hf_contiguous(v.data(), shape.hkv, length, shape.d, capacity);
    io.state = state.data();
    return io;
  }
  /// Back to the period's start: the cache at B rows, the window as the prompt left it.
  void restart() {
    std::memcpy(k.data(), k0.data(), k.size() * sizeof(T));
    std::memcpy(v.data(), v0.data(), v.size() * sizeof(T));
    state = state0;
    length = target;
  }
  /// The timed period: N + 1 steps (the rows are the engine's: already written by restart()).
  void run() {
    kvevict::sequence_report r;
    for (std::int64_t t = 0; t <= interval; ++t) {
      ++length;
      kvevict::sequence_io<T> io = call(kvevict::sequence_event::decode);
      io.queries =
          kvevict::contiguous_queries<const T>(q.data() + t * shape.d, shape.hq, 1, shape.d, positions.data() + t);
      io.queries.head_stride = (interval + 1) * shape.d;  // step t's query of every head
      die("compressor::run", compressor.run(0, &io, 1, &r, ws));
      length = r.next_slot;
    }
    if (r.action != kvevict::sequence_action::evicted || length != target)
      die("decode_period", kvevict::status::error(kvevict::errc::invalid_state, "bench", "period",
                                                  "the period's last step did not compress to the target"));
  }
  /// K and V bytes a decode step's attention reads, averaged over the period's steps.
  double attention_bytes() const {
    const double rows = static_cast<double>(target) + static_cast<double>(interval + 2) / 2.0;
    return 2.0 * rows * static_cast<double>(shape.hkv * shape.d) * sizeof(T);
  }
};

}  // namespace kb

#endif  // KVEVICT_BENCH_LONG_GENERATION_HPP
