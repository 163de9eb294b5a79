// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ISA_TARGET_HPP
#define KVEVICT_DETAIL_ISA_TARGET_HPP

// Regions of code compiled for one instruction-set target whatever the translation unit's
// -march (docs/cpu-dispatch.md). Every function defined between KVEVICT_TARGET_<X>_BEGIN and
// KVEVICT_TARGET_END gets that target (GCC: #pragma GCC target; clang: #pragma clang
// attribute), so the AVX2 and AVX-512 kernels exist in every build and are chosen at run time
// from what the CPU supports (kvevict/cpu_isa.hpp). Code in a region may run only after that
// check. The regions contain definitions only: headers are included outside them.
//
// The target strings list every extension the run-time check requires (cpu_isa.hpp), and no
// more: a compiler may use any of them anywhere in the region.

#if (defined(__x86_64__) || defined(_M_X64)) && (defined(__GNUC__) || defined(__clang__)) && \
    !defined(KVEVICT_NO_SIMD_DISPATCH)
#define KVEVICT_X86_DISPATCH 1
#else
#define KVEVICT_X86_DISPATCH 0
#endif

#if KVEVICT_X86_DISPATCH && defined(__linux__) && !defined(KVEVICT_NO_AMX)
#define KVEVICT_AMX_DISPATCH 1
#else
#define KVEVICT_AMX_DISPATCH 0
#endif

#define KVEVICT_TARGET_STRING_AVX2 "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt"
#define KVEVICT_TARGET_STRING_AVX512 "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd"
#define KVEVICT_TARGET_STRING_AVX512BF16 \
  "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512bf16"
#define KVEVICT_TARGET_STRING_AMX \
  "avx2,fma,f16c,bmi,bmi2,lzcnt,popcnt,avx512f,avx512bw,avx512vl,avx512dq,avx512cd,avx512bf16,amx-tile,amx-bf16"

#define KVEVICT_TARGET_PRAGMA_(x) _Pragma(#x)
#if defined(__clang__)
#define KVEVICT_TARGET_BEGIN_(s) \
  KVEVICT_TARGET_PRAGMA_(clang attribute push(__attribute__((target(s))), apply_to = function))
#define KVEVICT_TARGET_END KVEVICT_TARGET_PRAGMA_(clang attribute pop)
#else
#define KVEVICT_TARGET_BEGIN_(s) KVEVICT_TARGET_PRAGMA_(GCC push_options) KVEVICT_TARGET_PRAGMA_(GCC target(s))
#define KVEVICT_TARGET_END KVEVICT_TARGET_PRAGMA_(GCC pop_options)
#endif

// Before a loop over a few registers (rows of a micro-kernel, lanes of a transpose): fully
// unrolled even at -O2 (CMake's RelWithDebInfo), so the accumulators stay in registers.
#define KVEVICT_UNROLL KVEVICT_TARGET_PRAGMA_(GCC unroll 16)

#define KVEVICT_TARGET_AVX2_BEGIN KVEVICT_TARGET_BEGIN_(KVEVICT_TARGET_STRING_AVX2)
#define KVEVICT_TARGET_AVX512_BEGIN KVEVICT_TARGET_BEGIN_(KVEVICT_TARGET_STRING_AVX512)
#define KVEVICT_TARGET_AVX512BF16_BEGIN KVEVICT_TARGET_BEGIN_(KVEVICT_TARGET_STRING_AVX512BF16)
#define KVEVICT_TARGET_AMX_BEGIN KVEVICT_TARGET_BEGIN_(KVEVICT_TARGET_STRING_AMX)

#if KVEVICT_X86_DISPATCH
#include <immintrin.h>
#endif

#endif  // KVEVICT_DETAIL_ISA_TARGET_HPP
