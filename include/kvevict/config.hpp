// kvevict: KV-cache eviction policies for LLM inference engines.
// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CONFIG_HPP
#define KVEVICT_CONFIG_HPP

// Library-wide configuration: version, the versioned inline namespace, host/device
// annotations and feature detection. Included by every public header; includes only
// <type_traits>.

#define KVEVICT_VERSION_MAJOR 0
#define KVEVICT_VERSION_MINOR 1
#define KVEVICT_VERSION_PATCH 0
#define KVEVICT_VERSION (KVEVICT_VERSION_MAJOR * 10000 + KVEVICT_VERSION_MINOR * 100 + KVEVICT_VERSION_PATCH)

#include "kvevict/detail/abi.hpp"

// The inline namespace carries the ABI: the version (two kvevict versions linked into one
// program, say an engine and a plugin, get distinct symbols) and the translation unit's
// instruction-set baseline (detail/abi.hpp: TUs built with different -march never share a
// kvevict symbol, so a generic caller can never run a -march=native copy).
#define KVEVICT_NAMESPACE_BEGIN \
  namespace kvevict {           \
  inline namespace KVEVICT_ABI_NAMESPACE {
#define KVEVICT_NAMESPACE_END \
  }                           \
  }

#if defined(__CUDACC__) || defined(__HIPCC__)
#define KVEVICT_HOST_DEVICE __host__ __device__
#else
#define KVEVICT_HOST_DEVICE
#endif

#if defined(__cpp_exceptions) || defined(__EXCEPTIONS) || defined(_CPPUNWIND)
#define KVEVICT_HAS_EXCEPTIONS 1
#else
#define KVEVICT_HAS_EXCEPTIONS 0
#endif

#if defined(__GNUC__) || defined(__clang__)
#define KVEVICT_ALWAYS_INLINE inline __attribute__((always_inline))
#define KVEVICT_RESTRICT __restrict__
#else
#define KVEVICT_ALWAYS_INLINE inline
#define KVEVICT_RESTRICT
#endif

// One machine-code copy of a function for every caller: never inlined or cloned. The
// tensor-parallel folds (design.md §15) rely on it to give the single-process bits: with FMA
// contraction on (GCC's default), an inlined scale-and-add may fuse in one caller and not in
// another.
#if defined(__clang__)
#define KVEVICT_NOINLINE inline __attribute__((noinline))
#elif defined(__GNUC__)
#define KVEVICT_NOINLINE inline __attribute__((noipa))
#elif defined(_MSC_VER)
#define KVEVICT_NOINLINE inline __declspec(noinline)
#else
#define KVEVICT_NOINLINE inline
#endif

// No FMA contraction in a function whose products and sums another implementation repeats
// operation by operation (the GPU's __fmul_rn/__fadd_rn, design.md §14): GCC's default
// (-ffp-contract=fast) would otherwise fuse a scale-and-add under -march flags with FMA.
// KVEVICT_FP_CONTRACT_OFF goes on the declaration, KVEVICT_FP_CONTRACT_OFF_BODY first in the
// body (clang's form).
#if defined(__clang__)
#define KVEVICT_FP_CONTRACT_OFF
#define KVEVICT_FP_CONTRACT_OFF_BODY _Pragma("clang fp contract(off)")
#elif defined(__GNUC__)
#define KVEVICT_FP_CONTRACT_OFF __attribute__((optimize("fp-contract=off")))
#define KVEVICT_FP_CONTRACT_OFF_BODY
#else
#define KVEVICT_FP_CONTRACT_OFF
#define KVEVICT_FP_CONTRACT_OFF_BODY
#endif

// KVEVICT_EXTERN_KERNELS=1 (on every translation unit of a program, before any kvevict header):
// the CPU kernels are compiled in one translation unit, the one that includes
// kvevict/instantiate_kernels.hpp, instead of in every one that calls a policy (docs/compile-cost.md).
// The default, 0, is header-only.
#ifndef KVEVICT_EXTERN_KERNELS
#define KVEVICT_EXTERN_KERNELS 0
#endif

#include <type_traits>

KVEVICT_NAMESPACE_BEGIN
namespace detail {
/// Target of a view's "to read-only" conversion: the const view, or, when the view is already
/// read-only, a type nothing converts to (declaring a conversion to the class itself draws
/// clang's -Wclass-conversion).
template <class>
struct no_conversion {};
template <class Element, class ConstView>
using const_view_t = std::conditional_t<std::is_const<Element>::value, no_conversion<ConstView>, ConstView>;
}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CONFIG_HPP
