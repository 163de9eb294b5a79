// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_GEMM_HPP
#define KVEVICT_DETAIL_GEMM_HPP

// The one matrix product of scoring: logits[R, T] = Q[R, d] * K[T, d]^T, on Eigen's GEMM.
// Callers bound R*d and T*d (see tile_plan) so that Eigen's packing buffers stay on the
// stack (below EIGEN_STACK_ALLOCATION_LIMIT) and the hot path never reaches the heap.

#include <cstdint>

#include <Eigen/Core>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

using row_matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

inline void logits_tile(const float* q, std::int64_t rows, std::int64_t dim, const float* k, std::int64_t cols,
                        float* out) {
  const Eigen::Map<const row_matrix> Q(q, rows, dim);
  const Eigen::Map<const row_matrix> K(k, cols, dim);
  Eigen::Map<row_matrix> O(out, rows, cols);
  O.noalias() = Q * K.transpose();
}

/// Tile sizes for a head dimension: keys per tile and query rows per GEMM call, chosen so
/// that Eigen's packed blocks (rows*d and keys*d floats) stay within 64 KiB and 128 KiB.
struct tile_plan {
  std::int64_t keys;
  std::int64_t rows;
  explicit tile_plan(std::int64_t head_dim) noexcept {
    keys = head_dim > 0 ? 32768 / head_dim : 256;
    keys = keys < 16 ? 16 : (keys > 512 ? 512 : keys);
    keys -= keys % 16;
    rows = head_dim > 0 ? 16384 / head_dim : 128;
    rows = rows < 8 ? 8 : (rows > 256 ? 256 : rows);
  }
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_GEMM_HPP
