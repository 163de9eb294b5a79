// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_KERNEL_INSTANCES_HPP
#define KVEVICT_DETAIL_KERNEL_INSTANCES_HPP

// The CPU kernels' instances, listed once: the explicit instantiation declarations of
// KVEVICT_EXTERN_KERNELS (detail/observe.hpp, detail/widen.hpp) and the definitions in
// kvevict/instantiate_kernels.hpp expand the same lists. Every kernel set (portable, AVX2,
// AVX-512) is reached only through these two entry points, so an instance compiled once
// carries every path's code.

/// X(QT, KT) for every query type and key storage type (dtype.hpp: is_query_type, is_storage_type).
#define KVEVICT_DETAIL_FOR_EACH_QUERY_KEY_TYPE(X)                                                                     \
  X(float, float)                                                                                                     \
  X(fp16, float) X(bf16, float) X(float, fp16) X(fp16, fp16) X(bf16, fp16) X(float, bf16) X(fp16, bf16) X(bf16, bf16) \
      X(float, fp8_e4m3) X(fp16, fp8_e4m3) X(bf16, fp8_e4m3) X(float, fp8_e5m2) X(fp16, fp8_e5m2) X(bf16, fp8_e5m2)

/// X(T) for every storage type.
#define KVEVICT_DETAIL_FOR_EACH_STORAGE_TYPE(X) X(float) X(fp16) X(bf16) X(fp8_e4m3) X(fp8_e5m2)

#endif  // KVEVICT_DETAIL_KERNEL_INSTANCES_HPP
