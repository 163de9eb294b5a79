// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_INSTANTIATE_KERNELS_HPP
#define KVEVICT_INSTANTIATE_KERNELS_HPP

// The CPU kernels, compiled here once for a program built with KVEVICT_EXTERN_KERNELS=1
// (config.hpp): include this header in exactly one of its translation units, compiled with
// the same -march as the others (the inline namespace names the instruction-set baseline, so
// an -march mismatch is a link error) and the same KVEVICT_NO_SIMD_DISPATCH / KVEVICT_NO_AMX
// (detail/isa/target.hpp: they change the kernels but not the namespace, so the program would
// take this TU's choice). Every query and storage type is
// instantiated, with every kernel set (portable, AVX2, AVX-512) the dispatch can choose.
// docs/compile-cost.md says what it saves.

#include "kvevict/config.hpp"
#include "kvevict/detail/kernel_instances.hpp"
#include "kvevict/detail/observe.hpp"
#include "kvevict/detail/widen.hpp"
#include "kvevict/dtype.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

#define KVEVICT_DETAIL_INSTANTIATE_OBSERVE_HEAD(QT, KT) template KVEVICT_DETAIL_OBSERVE_HEAD_INSTANCE(QT, KT);
KVEVICT_DETAIL_FOR_EACH_QUERY_KEY_TYPE(KVEVICT_DETAIL_INSTANTIATE_OBSERVE_HEAD)
#undef KVEVICT_DETAIL_INSTANTIATE_OBSERVE_HEAD

#define KVEVICT_DETAIL_INSTANTIATE_WIDEN_ROW(T) template KVEVICT_DETAIL_WIDEN_ROW_INSTANCE(T);
KVEVICT_DETAIL_FOR_EACH_STORAGE_TYPE(KVEVICT_DETAIL_INSTANTIATE_WIDEN_ROW)
#undef KVEVICT_DETAIL_INSTANTIATE_WIDEN_ROW

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_INSTANTIATE_KERNELS_HPP
