// One SnapKV-family scoring configuration, as the library's scoring_params and as the
// reference's params, built from the same enum values so the two cannot drift.
#pragma once

#include <cstdint>

#include "kvevict/scoring/params.hpp"
#include "reference/reference.hpp"

namespace test {

struct scoring_config {
  kvevict::scoring_params lib;
  ref::params ref;
};

inline scoring_config make_config(kvevict::softmax_domain dom, kvevict::window_aggregation win,
                                  kvevict::gqa_reduction red, kvevict::gqa_order order, kvevict::pooling_kind pool,
                                  std::int64_t kernel, bool count_padding, std::int64_t protected_tail) {
  scoring_config c;
  c.lib.domain = dom;
  c.lib.window = win;
  c.lib.gqa = red;
  c.lib.order = order;
  c.lib.pool = {pool, kernel, count_padding};
  c.lib.protected_tail = protected_tail;
  c.ref.dom = dom == kvevict::softmax_domain::visible ? ref::domain::visible : ref::domain::candidates;
  c.ref.window = static_cast<ref::agg>(static_cast<int>(win));
  c.ref.reduce = static_cast<ref::gqa>(static_cast<int>(red));
  c.ref.reduce_before_pool = order == kvevict::gqa_order::before_pooling;
  c.ref.kind = static_cast<ref::pool>(static_cast<int>(pool));
  c.ref.kernel = kernel;
  c.ref.count_padding = count_padding;
  c.ref.protected_tail = protected_tail;
  return c;
}

/// Padding counted in pooling averages (every preset's convention).
inline scoring_config make_config(kvevict::softmax_domain dom, kvevict::window_aggregation win,
                                  kvevict::gqa_reduction red, kvevict::gqa_order order, kvevict::pooling_kind pool,
                                  std::int64_t kernel, std::int64_t protected_tail) {
  return make_config(dom, win, red, order, pool, kernel, true, protected_tail);
}

}  // namespace test
