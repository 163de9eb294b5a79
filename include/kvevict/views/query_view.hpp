// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_QUERY_VIEW_HPP
#define KVEVICT_VIEWS_QUERY_VIEW_HPP

// Observation queries: the post-RoPE query vectors that observe a layer's keys, with the
// absolute position of each observation (causal visibility is decided by positions).

#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/index_ptr.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Observation queries [Hq, W, d] (post-RoPE), each observation t with its absolute
/// position positions[t] (shared by all query heads): query t sees key j iff
/// key_position(j) <= positions[t].
template <class T>
struct query_view {
  static_assert(is_query_type<T>::value || is_any_element<T>::value,
                "query_view<T>: T must be float, fp16 or bf16 (maybe const)");
  using element_type = T;
  using value_type = std::remove_cv_t<T>;

  T* data = nullptr;
  std::int64_t num_heads = 0;    ///< Hq
  std::int64_t num_queries = 0;  ///< W
  std::int64_t head_dim = 0;     ///< d
  std::int64_t head_stride = 0;
  std::int64_t query_stride = 0;
  std::int64_t dim_stride = 1;
  index_ptr positions = nullptr;  ///< [W] absolute positions

  KVEVICT_HOST_DEVICE std::int64_t offset(std::int64_t q, std::int64_t t, std::int64_t c) const noexcept {
    return q * head_stride + t * query_stride + c * dim_stride;
  }
  KVEVICT_HOST_DEVICE T& at(std::int64_t q, std::int64_t t, std::int64_t c) const noexcept {
    return data[offset(q, t, c)];
  }
  KVEVICT_HOST_DEVICE T* row(std::int64_t q, std::int64_t t) const noexcept { return data + offset(q, t, 0); }
  /// The same view with elements of type U (data reinterpreted, every other field as is).
  template <class U>
  KVEVICT_HOST_DEVICE query_view<U> with_element() const noexcept {
    query_view<U> v;
    v.data = static_cast<U*>(const_cast<void*>(static_cast<const void*>(data)));
    v.num_heads = num_heads;
    v.num_queries = num_queries;
    v.head_dim = head_dim;
    v.head_stride = head_stride;
    v.query_stride = query_stride;
    v.dim_stride = dim_stride;
    v.positions = positions;
    return v;
  }
  template <class U = T, std::enable_if_t<!std::is_const<U>::value, int> = 0>
  KVEVICT_HOST_DEVICE operator detail::const_view_t<T, query_view<const value_type>>() const noexcept {
    return with_element<const value_type>();
  }
};

static_assert(std::is_trivially_copyable<query_view<const fp16>>::value, "views are trivially copyable");

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_QUERY_VIEW_HPP
