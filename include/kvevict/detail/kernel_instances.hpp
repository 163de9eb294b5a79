// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_KERNEL_INSTANCES_HPP
#define KVEVICT_DETAIL_KERNEL_INSTANCES_HPP

// The CPU kernels' instances, listed once: the explicit instantiation declarations of
// KVEVICT_EXTERN_KERNELS (detail/observe.hpp, detail/widen.hpp) and the definitions in
// kvevict/instantiate_kernels.hpp expand the same lists. The kernel sets (portable, AVX2,
// AVX-512) are reached through these two entry points, so an instance compiled once carries
// every path's code; only top-B's small survivor sweep (detail/topk.hpp, filter_at_least, an
// inline non-template function) is still compiled where it is called.

/// X(QT, KT) for every query type and key storage type (dtype.hpp: is_query_type, is_storage_type).
// clang-format off
#define KVEVICT_DETAIL_FOR_EACH_QUERY_KEY_TYPE(X)                  \
  X(float, float)    X(fp16, float)    X(bf16, float)              \
  X(float, fp16)     X(fp16, fp16)     X(bf16, fp16)               \
  X(float, bf16)     X(fp16, bf16)     X(bf16, bf16)               \
  X(float, fp8_e4m3) X(fp16, fp8_e4m3) X(bf16, fp8_e4m3)           \
  X(float, fp8_e5m2) X(fp16, fp8_e5m2) X(bf16, fp8_e5m2)
// clang-format on

/// X(T) for every storage type.
#define KVEVICT_DETAIL_FOR_EACH_STORAGE_TYPE(X) X(float) X(fp16) X(bf16) X(fp8_e4m3) X(fp8_e5m2)

#endif  // KVEVICT_DETAIL_KERNEL_INSTANCES_HPP
