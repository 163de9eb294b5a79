// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_COMPRESSOR_DETAIL_PREFILL_WINDOW_HPP
#define KVEVICT_COMPRESSOR_DETAIL_PREFILL_WINDOW_HPP

// The queries a sequence observes with at prefill_end, and at a decode-time compression. With
// chunked prefill (compressor_options::chunked_prefill) each layer's state keeps the last
// queries of the chunks handed so far (prefill_chunk), and prefill_end's window is those rows
// followed by the last chunk's: the rows the unchunked prompt would have handed, in the same
// order, so the keep set is the unchunked one bit for bit. Without chunks it is a view of the
// call's last queries. After prefill_end the same rows keep the last decode queries, a ring
// (compressor_options::decoding), and a decode-time compression observes with the newest of
// them followed by the step's own.

#include <cstdint>
#include <cstring>

#include "kvevict/compressor/detail/compressor_core.hpp"
#include "kvevict/compressor/detail/state_layout.hpp"
#include "kvevict/compressor/plan.hpp"
#include "kvevict/compressor/sequence.hpp"
#include "kvevict/config.hpp"
#include "kvevict/policies/policy_list.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// Query row (h, t) of `q` into `dst` (head_dim elements): one memcpy when its channels are
/// contiguous (every decode step buffers Hq rows; element by element that was most of a step's
/// cost), element by element otherwise.
template <class Q>
void copy_query_row(const query_view<const Q>& q, std::int64_t h, std::int64_t t, Q* dst) noexcept {
  if (q.dim_stride == 1) {
    std::memcpy(dst, q.row(h, t), static_cast<std::size_t>(q.head_dim) * sizeof(Q));
    return;
  }
  for (std::int64_t c = 0; c < q.head_dim; ++c) dst[c] = q.at(h, t, c);
}

class compressor_window : protected compressor_core {
 protected:
  window_state* window_header(void* state, std::int64_t layer) const noexcept {
    return reinterpret_cast<window_state*>(static_cast<unsigned char*>(state) + sequence_state_offset + scope_bytes_ +
                                           static_cast<std::size_t>(options_.model.num_layers) * layer_state_bytes_ +
                                           static_cast<std::size_t>(layer) * window_bytes_);
  }
  static std::int64_t* window_positions(window_state* w) noexcept { return reinterpret_cast<std::int64_t*>(w + 1); }
  template <class Q>
  Q* window_rows(window_state* w) const noexcept {
    return reinterpret_cast<Q*>(window_positions(w) + window_capacity_);
  }
  /// The rows a prefill_end call finds buffered by earlier chunks (0 without chunks).
  template <class T, class Q>
  std::int64_t buffered_rows(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    if (window_bytes_ == 0 || io.event != sequence_event::prefill_end || io.state == nullptr) return 0;
    const window_state* w = window_header(io.state, layer);
    return w->decoding != 0 ? 0 : w->count;  // a new prompt turn after decoding: the decode rows are not its
  }
  /// How many queries a prefill_end observation uses: the policy's window (H2O: all) of the
  /// buffered rows followed by this call's.
  template <class T, class Q>
  std::int64_t prefill_query_count(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    const std::int64_t n = buffered_rows(io, layer) + io.queries.num_queries;
    return every_prompt_query(options_.policy.kind()) || n < window_ ? n : window_;
  }
  /// Whether prefill_end's window takes rows earlier chunks buffered (then it is assembled and
  /// normalised by kvevict), or is the call's own last queries (the engine's LSE applies).
  template <class T, class Q>
  bool assembles_window(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    return buffered_rows(io, layer) > 0 && io.queries.num_queries < prefill_query_count(io, layer);
  }
  /// The queries a prefill_end observation uses: the last prefill_query_count() of the buffered
  /// rows and this call's, assembled in the workspace when it needs buffered rows (at most the
  /// window's capacity: checked), else a view of this call's.
  template <class T, class Q>
  query_view<const Q> prefill_queries(const sequence_io<T, Q>& io, std::int64_t layer,
                                      const run_layout& lay) const noexcept {
    const std::int64_t total = prefill_query_count(io, layer);
    if (!assembles_window(io, layer)) return last_queries(io.queries, total);
    window_state* w = window_header(io.state, layer);
    const std::int64_t from_call = io.queries.num_queries < total ? io.queries.num_queries : total;
    const std::int64_t from_state = total - from_call;
    const std::int64_t heads = options_.model.num_query_heads, d = options_.model.head_dim, cap = window_capacity_;
    const Q* kept = window_rows<Q>(w);
    Q* out = static_cast<Q*>(lay.window_queries);
    const query_view<const Q> tail = last_queries(io.queries, from_call);
    for (std::int64_t h = 0; h < heads; ++h) {
      std::memcpy(out + h * cap * d, kept + (h * cap + w->count - from_state) * d,
                  static_cast<std::size_t>(from_state * d) * sizeof(Q));
      for (std::int64_t t = 0; t < from_call; ++t) copy_query_row(tail, h, t, out + (h * cap + from_state + t) * d);
    }
    const std::int64_t* kept_positions = window_positions(w);
    for (std::int64_t t = 0; t < from_state; ++t) lay.window_positions[t] = kept_positions[w->count - from_state + t];
    for (std::int64_t t = 0; t < from_call; ++t) lay.window_positions[from_state + t] = tail.positions[t];
    query_view<const Q> v;
    v.data = out;
    v.num_heads = heads;
    v.num_queries = total;
    v.head_dim = d;
    v.head_stride = cap * d;
    v.query_stride = d;
    v.dim_stride = 1;
    v.positions = lay.window_positions;
    return v;
  }
  /// prefill_chunk: the chunk's last rows join the layer's window (the oldest leave it).
  template <class T, class Q>
  void buffer_chunk(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    window_state* w = window_header(io.state, layer);
    if (w->decoding != 0) *w = window_state{};  // a new prompt turn after decoding: its chunks start anew
    const std::int64_t cap = window_capacity_, d = options_.model.head_dim;
    const std::int64_t n = io.queries.num_queries;
    const std::int64_t take = n < cap ? n : cap;
    const std::int64_t keep = w->count < cap - take ? w->count : cap - take;
    Q* rows = window_rows<Q>(w);
    std::int64_t* positions = window_positions(w);
    const query_view<const Q> tail = last_queries(io.queries, take);
    for (std::int64_t h = 0; h < options_.model.num_query_heads; ++h) {
      Q* head = rows + h * cap * d;
      std::memmove(head, head + (w->count - keep) * d, static_cast<std::size_t>(keep * d) * sizeof(Q));
      for (std::int64_t t = 0; t < take; ++t) copy_query_row(tail, h, t, head + (keep + t) * d);
    }
    std::memmove(positions, positions + (w->count - keep), static_cast<std::size_t>(keep) * sizeof(std::int64_t));
    for (std::int64_t t = 0; t < take; ++t) positions[keep + t] = tail.positions[t];
    w->count = keep + take;
    w->seen += n;
    w->last_position = tail.positions[take - 1];
  }
  /// A layer's window header as buffer_chunk and buffer_decode leave it: rows within the
  /// capacity and within the queries seen, the ring's start within it (an overwritten state
  /// would send the copies out of bounds).
  bool window_intact(void* state, std::int64_t layer) const noexcept {
    const window_state* w = window_header(state, layer);
    return w->count >= 0 && w->count <= window_capacity_ && w->count <= w->seen && w->seen >= 0 && w->oldest >= 0 &&
           (w->oldest == 0 || w->oldest < window_capacity_) && (w->decoding == 0 || w->decoding == 1);
  }
  /// prefill_end: the window was used; the next prompt starts from none, and decode queries
  /// (decode-time budgets) from an empty ring.
  template <class T, class Q>
  void clear_window(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    if (window_bytes_ == 0 || io.event != sequence_event::prefill_end) return;
    window_state* w = window_header(io.state, layer);
    *w = window_state{};
    w->decoding = 1;
  }
  /// Whether the layer's prefill_end ran (decode-time budgets start after it).
  bool decoding_started(void* state, std::int64_t layer) const noexcept {
    return window_header(state, layer)->decoding == 1;
  }

  /// A decode step's queries join the layer's ring of decode queries (the oldest leave it).
  template <class T, class Q>
  void buffer_decode(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    window_state* w = window_header(io.state, layer);
    const std::int64_t cap = window_capacity_, d = options_.model.head_dim, n = io.queries.num_queries;
    if (cap > 0 && n > 0) {
      const std::int64_t take = n < cap ? n : cap;
      const query_view<const Q> tail = last_queries(io.queries, take);
      Q* rows = window_rows<Q>(w);
      std::int64_t* positions = window_positions(w);
      for (std::int64_t t = 0; t < take; ++t) {
        std::int64_t slot = w->oldest + w->count;
        if (w->count == cap) {  // full: the newest replaces the oldest
          slot = w->oldest;
          w->oldest = w->oldest + 1 == cap ? 0 : w->oldest + 1;
        } else {
          ++w->count;
        }
        slot = slot >= cap ? slot - cap : slot;
        for (std::int64_t h = 0; h < options_.model.num_query_heads; ++h)
          copy_query_row(tail, h, t, rows + (h * cap + slot) * d);
        positions[slot] = tail.positions[t];
      }
    }
    w->seen += n;
    if (n > 0 && io.queries.positions != nullptr) w->last_position = io.queries.positions[n - 1];
  }
  /// The queries a decode-time compression observes with: the newest decode_window_ of the
  /// ring's rows followed by this step's (fewer early in the generation), assembled in the
  /// workspace. The ring is not changed (buffer_decode adds the step's after the compression).
  template <class T, class Q>
  query_view<const Q> decode_queries(const sequence_io<T, Q>& io, std::int64_t layer,
                                     const run_layout& lay) const noexcept {
    const std::int64_t heads = options_.model.num_query_heads, d = options_.model.head_dim, cap = window_capacity_;
    query_view<const Q> v;
    v.num_heads = heads;
    v.head_dim = d;
    v.head_stride = cap * d;
    v.query_stride = d;
    v.dim_stride = 1;
    if (decode_window_ == 0) return v;  // the scorer reads no queries
    const window_state* w = window_header(io.state, layer);
    const std::int64_t n = io.queries.num_queries;
    const std::int64_t total = w->count + n < decode_window_ ? w->count + n : decode_window_;
    const std::int64_t from_call = n < total ? n : total;
    const std::int64_t from_state = total - from_call;
    const Q* kept = window_rows<Q>(const_cast<window_state*>(w));
    const std::int64_t* kept_positions = window_positions(const_cast<window_state*>(w));
    Q* out = static_cast<Q*>(lay.window_queries);
    const query_view<const Q> tail = last_queries(io.queries, from_call);
    for (std::int64_t t = 0; t < from_state; ++t) {
      std::int64_t slot = w->oldest + (w->count - from_state + t);
      slot = slot >= cap ? slot - cap : slot;
      for (std::int64_t h = 0; h < heads; ++h)
        std::memcpy(out + (h * cap + t) * d, kept + (h * cap + slot) * d, static_cast<std::size_t>(d) * sizeof(Q));
      lay.window_positions[t] = kept_positions[slot];
    }
    for (std::int64_t t = 0; t < from_call; ++t) {
      for (std::int64_t h = 0; h < heads; ++h) copy_query_row(tail, h, t, out + (h * cap + from_state + t) * d);
      lay.window_positions[from_state + t] = tail.positions[t];
    }
    v.data = out;
    v.num_queries = total;
    v.positions = lay.window_positions;
    return v;
  }

  /// Tokens the layer's scores cover: L, or DapQ's prompt length.
  template <class List, class T, class Q>
  std::int64_t scored_tokens(const sequence_io<T, Q>& io, std::int64_t layer) const noexcept {
    const std::int64_t tokens = io.keys.num_tokens;
    return visit_listed(
        List{}, static_cast<std::size_t>(options_.policy.kind()), tokens, [&](auto traits) -> std::int64_t {
          using Tr = decltype(traits);
          if constexpr (Tr::deferred) {
            return tokens;
          } else {
            using P = typename Tr::template policy<T, Q>;
            return Tr::scored_tokens(P(Tr::config(options_.policy)), tokens, prefill_query_count(io, layer));
          }
        });
  }
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_COMPRESSOR_DETAIL_PREFILL_WINDOW_HPP
