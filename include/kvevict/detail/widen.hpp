// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_WIDEN_HPP
#define KVEVICT_DETAIL_WIDEN_HPP

// Widening rows of storage elements to float32, one row at a time: kvevict never converts
// a whole cache. Contiguous rows take the SIMD kernel set of the process's CPU path
// (cpu_isa.hpp); every path converts exactly.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cpu_isa.hpp"
#include "kvevict/detail/isa/avx2.hpp"
#include "kvevict/detail/isa/avx512.hpp"
#include "kvevict/detail/isa/scalar.hpp"
#include "kvevict/detail/isa/target.hpp"
#include "kvevict/detail/kernel_instances.hpp"
#include "kvevict/dtype.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// dst[i] = float(src[i * stride]) for i in [0, n).
template <class T>
void widen_row(const T* src, std::int64_t stride, float* dst, std::int64_t n) noexcept {
#if KVEVICT_X86_DISPATCH
  switch (active_cpu_isa()) {
    case cpu_isa::scalar:
      break;
    case cpu_isa::avx2:
      isa_avx2::widen_row(src, stride, dst, n);
      return;
    default:
      isa_avx512::widen_row(src, stride, dst, n);
      return;
  }
#endif
  isa_scalar::widen_row(src, stride, dst, n);
}

/// widen_row's instance for T (as KVEVICT_DETAIL_OBSERVE_HEAD_INSTANCE in detail/observe.hpp).
#define KVEVICT_DETAIL_WIDEN_ROW_INSTANCE(T) void widen_row<T>(const T*, std::int64_t, float*, std::int64_t) noexcept
#if KVEVICT_EXTERN_KERNELS
#define KVEVICT_DETAIL_EXTERN_WIDEN_ROW(T) extern template KVEVICT_DETAIL_WIDEN_ROW_INSTANCE(T);
KVEVICT_DETAIL_FOR_EACH_STORAGE_TYPE(KVEVICT_DETAIL_EXTERN_WIDEN_ROW)
#undef KVEVICT_DETAIL_EXTERN_WIDEN_ROW
#endif

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_WIDEN_HPP
