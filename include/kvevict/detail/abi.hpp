// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_ABI_HPP
#define KVEVICT_DETAIL_ABI_HPP

// The name of kvevict's inline namespace, chosen by the translation unit's instruction-set
// baseline (docs/cpu-dispatch.md).
//
// kvevict is header-only: every function is an inline (weak) symbol compiled with the flags
// of the translation unit that uses it, and the linker keeps one copy per symbol. Had a TU
// built with -march=native and a TU built for generic x86-64 shared a symbol, the linker
// could hand the generic caller the native copy (AVX-512 instructions: SIGILL on a CPU
// without them). So the namespace name encodes the baseline exactly: TUs compiled for
// different sets of x86 extensions never share a kvevict symbol, and TUs compiled for the
// same set share code that is valid for all of them. The SIMD kernels themselves do not
// depend on the baseline: they carry target attributes and are chosen at run time.
//
// The name is `v0` for the x86-64 baseline (SSE2) and for other architectures; otherwise
// `v0_x` followed by eight hex digits, one bit per extension below that a compiler may use in
// ordinary code (vectorised loops, bit manipulation), in this order, four bits per digit,
// the first extension the lowest bit of the first digit:
//   SSE3 SSSE3 SSE4.1 SSE4.2 | POPCNT AVX AVX2 FMA | F16C BMI BMI2 LZCNT | MOVBE AVX512F BW DQ
//   VL CD VBMI VBMI2 | VNNI BITALG VPOPCNTDQ IFMA | BF16 FP16 AVX-VNNI GFNI | VAES VPCLMULQDQ FMA4 XOP
// For example -march=haswell gives v0_xfff10000. The version digit (0) carries the source
// ABI as before: two kvevict versions in one program get distinct symbols too.
//
// Consequence for engines: kvevict's types in TUs of different baselines are different types
// (as they must be: their member functions are compiled differently). Pass raw pointers and
// shapes across such boundaries, not kvevict objects.

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64) || defined(_M_IX86)

#if defined(__SSE3__)
#define KVEVICT_ABI_B0 1
#else
#define KVEVICT_ABI_B0 0
#endif
#if defined(__SSSE3__)
#define KVEVICT_ABI_B1 1
#else
#define KVEVICT_ABI_B1 0
#endif
#if defined(__SSE4_1__)
#define KVEVICT_ABI_B2 1
#else
#define KVEVICT_ABI_B2 0
#endif
#if defined(__SSE4_2__)
#define KVEVICT_ABI_B3 1
#else
#define KVEVICT_ABI_B3 0
#endif
#if defined(__POPCNT__)
#define KVEVICT_ABI_B4 1
#else
#define KVEVICT_ABI_B4 0
#endif
#if defined(__AVX__)
#define KVEVICT_ABI_B5 1
#else
#define KVEVICT_ABI_B5 0
#endif
#if defined(__AVX2__)
#define KVEVICT_ABI_B6 1
#else
#define KVEVICT_ABI_B6 0
#endif
#if defined(__FMA__)
#define KVEVICT_ABI_B7 1
#else
#define KVEVICT_ABI_B7 0
#endif
#if defined(__F16C__)
#define KVEVICT_ABI_B8 1
#else
#define KVEVICT_ABI_B8 0
#endif
#if defined(__BMI__)
#define KVEVICT_ABI_B9 1
#else
#define KVEVICT_ABI_B9 0
#endif
#if defined(__BMI2__)
#define KVEVICT_ABI_B10 1
#else
#define KVEVICT_ABI_B10 0
#endif
#if defined(__LZCNT__)
#define KVEVICT_ABI_B11 1
#else
#define KVEVICT_ABI_B11 0
#endif
#if defined(__MOVBE__)
#define KVEVICT_ABI_B12 1
#else
#define KVEVICT_ABI_B12 0
#endif
#if defined(__AVX512F__)
#define KVEVICT_ABI_B13 1
#else
#define KVEVICT_ABI_B13 0
#endif
#if defined(__AVX512BW__)
#define KVEVICT_ABI_B14 1
#else
#define KVEVICT_ABI_B14 0
#endif
#if defined(__AVX512DQ__)
#define KVEVICT_ABI_B15 1
#else
#define KVEVICT_ABI_B15 0
#endif
#if defined(__AVX512VL__)
#define KVEVICT_ABI_B16 1
#else
#define KVEVICT_ABI_B16 0
#endif
#if defined(__AVX512CD__)
#define KVEVICT_ABI_B17 1
#else
#define KVEVICT_ABI_B17 0
#endif
#if defined(__AVX512VBMI__)
#define KVEVICT_ABI_B18 1
#else
#define KVEVICT_ABI_B18 0
#endif
#if defined(__AVX512VBMI2__)
#define KVEVICT_ABI_B19 1
#else
#define KVEVICT_ABI_B19 0
#endif
#if defined(__AVX512VNNI__)
#define KVEVICT_ABI_B20 1
#else
#define KVEVICT_ABI_B20 0
#endif
#if defined(__AVX512BITALG__)
#define KVEVICT_ABI_B21 1
#else
#define KVEVICT_ABI_B21 0
#endif
#if defined(__AVX512VPOPCNTDQ__)
#define KVEVICT_ABI_B22 1
#else
#define KVEVICT_ABI_B22 0
#endif
#if defined(__AVX512IFMA__)
#define KVEVICT_ABI_B23 1
#else
#define KVEVICT_ABI_B23 0
#endif
#if defined(__AVX512BF16__)
#define KVEVICT_ABI_B24 1
#else
#define KVEVICT_ABI_B24 0
#endif
#if defined(__AVX512FP16__)
#define KVEVICT_ABI_B25 1
#else
#define KVEVICT_ABI_B25 0
#endif
#if defined(__AVXVNNI__)
#define KVEVICT_ABI_B26 1
#else
#define KVEVICT_ABI_B26 0
#endif
#if defined(__GFNI__)
#define KVEVICT_ABI_B27 1
#else
#define KVEVICT_ABI_B27 0
#endif
#if defined(__VAES__)
#define KVEVICT_ABI_B28 1
#else
#define KVEVICT_ABI_B28 0
#endif
#if defined(__VPCLMULQDQ__)
#define KVEVICT_ABI_B29 1
#else
#define KVEVICT_ABI_B29 0
#endif
#if defined(__FMA4__)
#define KVEVICT_ABI_B30 1
#else
#define KVEVICT_ABI_B30 0
#endif
#if defined(__XOP__)
#define KVEVICT_ABI_B31 1
#else
#define KVEVICT_ABI_B31 0
#endif

// One hex digit from four bits (b3 the highest).
#define KVEVICT_ABI_HEX_0000 0
#define KVEVICT_ABI_HEX_0001 1
#define KVEVICT_ABI_HEX_0010 2
#define KVEVICT_ABI_HEX_0011 3
#define KVEVICT_ABI_HEX_0100 4
#define KVEVICT_ABI_HEX_0101 5
#define KVEVICT_ABI_HEX_0110 6
#define KVEVICT_ABI_HEX_0111 7
#define KVEVICT_ABI_HEX_1000 8
#define KVEVICT_ABI_HEX_1001 9
#define KVEVICT_ABI_HEX_1010 a
#define KVEVICT_ABI_HEX_1011 b
#define KVEVICT_ABI_HEX_1100 c
#define KVEVICT_ABI_HEX_1101 d
#define KVEVICT_ABI_HEX_1110 e
#define KVEVICT_ABI_HEX_1111 f
#define KVEVICT_ABI_HEX_(b3, b2, b1, b0) KVEVICT_ABI_HEX_##b3##b2##b1##b0
#define KVEVICT_ABI_HEX(b3, b2, b1, b0) KVEVICT_ABI_HEX_(b3, b2, b1, b0)
#define KVEVICT_ABI_DIGIT(i0, i1, i2, i3) \
  KVEVICT_ABI_HEX(KVEVICT_ABI_B##i3, KVEVICT_ABI_B##i2, KVEVICT_ABI_B##i1, KVEVICT_ABI_B##i0)
#define KVEVICT_ABI_NAME_(d0, d1, d2, d3, d4, d5, d6, d7) v0_x##d0##d1##d2##d3##d4##d5##d6##d7
#define KVEVICT_ABI_NAME(d0, d1, d2, d3, d4, d5, d6, d7) KVEVICT_ABI_NAME_(d0, d1, d2, d3, d4, d5, d6, d7)

#if KVEVICT_ABI_B0 || KVEVICT_ABI_B1 || KVEVICT_ABI_B2 || KVEVICT_ABI_B3 || KVEVICT_ABI_B4 || KVEVICT_ABI_B5 ||       \
    KVEVICT_ABI_B6 || KVEVICT_ABI_B7 || KVEVICT_ABI_B8 || KVEVICT_ABI_B9 || KVEVICT_ABI_B10 || KVEVICT_ABI_B11 ||     \
    KVEVICT_ABI_B12 || KVEVICT_ABI_B13 || KVEVICT_ABI_B14 || KVEVICT_ABI_B15 || KVEVICT_ABI_B16 || KVEVICT_ABI_B17 || \
    KVEVICT_ABI_B18 || KVEVICT_ABI_B19 || KVEVICT_ABI_B20 || KVEVICT_ABI_B21 || KVEVICT_ABI_B22 || KVEVICT_ABI_B23 || \
    KVEVICT_ABI_B24 || KVEVICT_ABI_B25 || KVEVICT_ABI_B26 || KVEVICT_ABI_B27 || KVEVICT_ABI_B28 || KVEVICT_ABI_B29 || \
    KVEVICT_ABI_B30 || KVEVICT_ABI_B31
#define KVEVICT_ABI_NAMESPACE                                                                                     \
  KVEVICT_ABI_NAME(KVEVICT_ABI_DIGIT(0, 1, 2, 3), KVEVICT_ABI_DIGIT(4, 5, 6, 7), KVEVICT_ABI_DIGIT(8, 9, 10, 11), \
                   KVEVICT_ABI_DIGIT(12, 13, 14, 15), KVEVICT_ABI_DIGIT(16, 17, 18, 19),                          \
                   KVEVICT_ABI_DIGIT(20, 21, 22, 23), KVEVICT_ABI_DIGIT(24, 25, 26, 27),                          \
                   KVEVICT_ABI_DIGIT(28, 29, 30, 31))
#else
#define KVEVICT_ABI_NAMESPACE v0
#endif
#else
#define KVEVICT_ABI_NAMESPACE v0
#endif

#define KVEVICT_ABI_STRINGIFY_(x) #x
#define KVEVICT_ABI_STRINGIFY(x) KVEVICT_ABI_STRINGIFY_(x)
/// The inline namespace's name as a string, e.g. "v0" or "v0_xfff10000".
#define KVEVICT_ABI_NAMESPACE_NAME KVEVICT_ABI_STRINGIFY(KVEVICT_ABI_NAMESPACE)

#endif  // KVEVICT_DETAIL_ABI_HPP
