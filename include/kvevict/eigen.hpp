// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_EIGEN_HPP
#define KVEVICT_EIGEN_HPP

// Optional adapter for engines that keep their KV cache and queries in Eigen tensors or
// matrices: views over an Eigen::TensorMap / Eigen::Tensor of rank 3 or an Eigen::Map of a
// matrix, with the strides Eigen gives them (row- or column-major, any outer stride), over the
// same memory. Nothing is copied. The library itself needs no Eigen: only code that includes
// this header does (Eigen 3.3 or later, <Eigen/Core> and its Tensor module; CMake: link
// Eigen3::Eigen). Eigen::half and Eigen::bfloat16 elements are viewed as kvevict::fp16 and
// kvevict::bf16 (the same 16 bits).
//
//   Eigen::TensorMap<Eigen::Tensor<float, 3, Eigen::RowMajor>> k(data, Hkv, L, d);
//   kvevict::cache_view<float> keys = kvevict::eigen::cache_view_of(k);   // [Hkv, L, d]
//   Eigen::Map<Eigen::Matrix<float, -1, -1, Eigen::RowMajor>> kt(data, L, Hkv * d);
//   kvevict::cache_view<float> keys2 = kvevict::eigen::token_major_cache_view_of(kt, Hkv);

#include <Eigen/Core>
#include <cstdint>
#include <type_traits>
#include <unsupported/Eigen/CXX11/Tensor>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/layouts.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace eigen {
namespace detail {
/// kvevict's element type for an Eigen scalar (const kept).
template <class S>
struct element {
  using type = S;
};
template <>
struct element<Eigen::half> {
  using type = fp16;
};
#if EIGEN_VERSION_AT_LEAST(3, 4, 0)  // Eigen::bfloat16 came with 3.4
template <>
struct element<Eigen::bfloat16> {
  using type = bf16;
};
#endif
template <class S>
struct element<const S> {
  using type = const typename element<S>::type;
};
template <class S>
using element_t = typename element<S>::type;

template <class S>
element_t<S>* data_of(S* p) noexcept {
  static_assert(sizeof(element_t<S>) == sizeof(S), "the same bits");
  return reinterpret_cast<element_t<S>*>(p);
}

/// Strides of a rank-3 tensor of extents e in Eigen's layout (row-major: the last index is
/// contiguous; column-major: the first).
struct strides3 {
  std::int64_t s0 = 0, s1 = 0, s2 = 0;
};
inline strides3 tensor_strides(std::int64_t e0, std::int64_t e1, std::int64_t e2, bool row_major) noexcept {
  (void)e0;
  return row_major ? strides3{e1 * e2, e2, 1} : strides3{1, e0, e0 * e1};
}

template <class M>
constexpr bool row_major_tensor() noexcept {
  return (static_cast<int>(M::Layout) & static_cast<int>(Eigen::RowMajor)) != 0;
}
}  // namespace detail

/// [Hkv, L, d] from a rank-3 Eigen tensor or tensor map whose dimensions are (heads, tokens,
/// channels), in its own layout. Its element type: float, Eigen::half, Eigen::bfloat16 (or
/// kvevict's fp16 / bf16 / fp8).
template <class TensorLike>
auto cache_view_of(TensorLike& t) noexcept {
  static_assert(TensorLike::NumDimensions == 3, "cache_view_of: a rank-3 tensor [heads, tokens, channels]");
  using S = std::remove_reference_t<decltype(*t.data())>;
  const std::int64_t e0 = t.dimension(0), e1 = t.dimension(1), e2 = t.dimension(2);
  const detail::strides3 st = detail::tensor_strides(e0, e1, e2, detail::row_major_tensor<TensorLike>());
  return strided_cache(detail::data_of<S>(t.data()), e0, e1, e2, st.s0, st.s1, st.s2);
}

/// [Hq, W, d] queries from a rank-3 Eigen tensor or tensor map (heads, queries, channels),
/// with each query's absolute position.
template <class TensorLike>
auto query_view_of(TensorLike& t, index_ptr positions) noexcept {
  static_assert(TensorLike::NumDimensions == 3, "query_view_of: a rank-3 tensor [heads, queries, channels]");
  using S = std::remove_reference_t<decltype(*t.data())>;
  const std::int64_t e0 = t.dimension(0), e1 = t.dimension(1), e2 = t.dimension(2);
  const detail::strides3 st = detail::tensor_strides(e0, e1, e2, detail::row_major_tensor<TensorLike>());
  query_view<detail::element_t<S>> q;
  q.data = detail::data_of<S>(t.data());
  q.num_heads = e0;
  q.num_queries = e1;
  q.head_dim = e2;
  q.head_stride = st.s0;
  q.query_stride = st.s1;
  q.dim_stride = st.s2;
  q.positions = positions;
  return q;
}

/// A token-major layer cache held as a matrix [L, Hkv * d] (one row per token, head h's
/// channels at columns h*d .. h*d + d - 1; TinyLM's and llama.cpp's K rows), in either storage
/// order, with the map's outer stride.
template <class MatrixLike>
auto token_major_cache_view_of(MatrixLike& m, std::int64_t num_heads) noexcept {
  using S = std::remove_reference_t<decltype(*m.data())>;
  const std::int64_t tokens = m.rows(), d = num_heads > 0 ? m.cols() / num_heads : 0;
  const std::int64_t row = m.rowStride(), col = m.colStride();
  return strided_cache(detail::data_of<S>(m.data()), num_heads, tokens, d, d * col, row, col);
}

}  // namespace eigen
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EIGEN_HPP
