// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_SELECT_ROW_HPP
#define KVEVICT_CUDA_SELECT_ROW_HPP

// One row of a batched GPU selection: a score row of some (sequence, layer, head) and where
// its keep-list goes. An array of these in device memory describes a whole batch of ragged
// rows, selected in one launch by kvevict::cuda::select_rows. CUDA-free and trivially
// copyable, so engines fill it on the host or in their own kernels.

#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/detail/radix_logic.hpp"
#include "kvevict/selection/budget.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

struct select_row {
  const float* scores = nullptr;    ///< [length] device scores (+inf / NaN allowed; NaN ranks last)
  std::int64_t length = 0;          ///< L of this row: candidates [0, L - P), protected tail [L - P, L)
  std::int64_t budget = 0;          ///< B tokens (resolved; AdaKV: this head's budget)
  std::int64_t protected_tail = 0;  ///< P
  protected_mode mode = protected_mode::inside_budget;
  std::int64_t* out = nullptr;  ///< [kept_tokens(row)] device: ascending kept indices
};

static_assert(std::is_trivially_copyable<select_row>::value, "select_row is copied to the device as bytes");

/// Tokens a row keeps (its keep-list length): top candidates plus the protected tail,
/// exactly kvevict::tokens_kept.
KVEVICT_HOST_DEVICE inline std::int64_t kept_tokens(const select_row& r) noexcept {
  return detail::select_tokens_kept(r.budget, r.length, r.protected_tail, static_cast<int>(r.mode));
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_SELECT_ROW_HPP
