// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ABI_STD_HPP
#define KVEVICT_DETAIL_ABI_STD_HPP

// The standard library's templates, instantiated under kvevict's name.
//
// kvevict's own symbols are separated by instruction-set baseline (detail/abi.hpp), but a
// std::vector<std::int64_t> member, or std::sort on int32 ids, would instantiate the
// standard library's functions under std's name alone: a -march=native translation unit's
// copy (say, of the fill in vector::assign, vectorised with AVX) could then serve a generic
// one. tests/odr caught exactly this on a CPU without AVX. With kvevict's allocator and
// comparators among the template arguments, the instantiations are named after kvevict's
// inline namespace and separated like everything else. (An engine's own std containers
// carry the same hazard across its -march boundaries; that part is the engine's.)

#include <cstddef>
#include <memory>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

template <class T>
struct abi_allocator : std::allocator<T> {
  using value_type = T;
  abi_allocator() noexcept = default;
  template <class U>
  abi_allocator(const abi_allocator<U>&) noexcept {}
  template <class U>
  struct rebind {
    using other = abi_allocator<U>;
  };
};

template <class T, class U>
bool operator==(const abi_allocator<T>&, const abi_allocator<U>&) noexcept {
  return true;
}
template <class T, class U>
bool operator!=(const abi_allocator<T>&, const abi_allocator<U>&) noexcept {
  return false;
}

/// std::less for kvevict's std::sort / std::lower_bound calls.
struct abi_less {
  template <class T>
  bool operator()(const T& a, const T& b) const noexcept {
    return a < b;
  }
};

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_ABI_STD_HPP
