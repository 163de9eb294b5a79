// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DTYPE_HPP
#define KVEVICT_DTYPE_HPP

// Storage element types. K/V caches and queries are stored as float32, IEEE binary16
// (`fp16`) or bfloat16 (`bf16`); K/V caches also as 8-bit floats (`fp8_e4m3`, `fp8_e5m2`,
// the OCP formats of vLLM's `kv_cache_dtype=fp8*`, with a per-tensor scale on the view).
// All arithmetic is float32. The narrow types are plain bit patterns with exact widening
// and round-to-nearest-even narrowing that preserves NaN (quietened) and infinities (fp8
// saturates finite overflow, as engines quantise). Usable in host and device code.

#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {
template <class To, class From>
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE To bit_cast(const From& from) noexcept {
  static_assert(sizeof(To) == sizeof(From), "bit_cast needs equal sizes");
  To to;
  std::memcpy(&to, &from, sizeof(To));
  return to;
}

KVEVICT_HOST_DEVICE inline float fp16_bits_to_float(std::uint16_t h) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  const std::uint32_t exponent = (h >> 10) & 0x1fu;
  const std::uint32_t mantissa = h & 0x3ffu;
  std::uint32_t bits;
  if (exponent == 0x1fu) {
    bits = sign | 0x7f800000u | (mantissa << 13);  // Inf, or NaN keeping its payload
  } else if (exponent == 0) {
    // Zero or subnormal: mantissa * 2^-24 is exact in float32.
    const float magnitude = static_cast<float>(mantissa) * 5.9604644775390625e-8f;
    bits = sign | bit_cast<std::uint32_t>(magnitude);
  } else {
    bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
  }
  return bit_cast<float>(bits);
}

KVEVICT_HOST_DEVICE inline std::uint16_t float_to_fp16_bits(float value) noexcept {
  std::uint32_t x = bit_cast<std::uint32_t>(value);
  const std::uint16_t sign = static_cast<std::uint16_t>((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) {
    if (x == 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
    // NaN: quiet it and keep the top payload bits, so it can never turn into Inf.
    return static_cast<std::uint16_t>(sign | 0x7e00u | ((x >> 13) & 0x3ffu));
  }
  if (x >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // >= 65520 rounds to Inf
  if (x < 0x38800000u) {
    // Result is subnormal or zero. 2^-25 and below round to zero (2^-25 is a tie to even 0).
    if (x <= 0x33000000u) return sign;
    const std::uint32_t exponent = x >> 23;
    const std::uint32_t mantissa = (x & 0x7fffffu) | 0x800000u;
    const std::uint32_t shift = 126u - exponent;  // 14..24
    std::uint32_t r = mantissa >> shift;
    const std::uint32_t rest = mantissa & ((1u << shift) - 1u);
    const std::uint32_t halfway = 1u << (shift - 1u);
    if (rest > halfway || (rest == halfway && (r & 1u))) ++r;
    return static_cast<std::uint16_t>(sign | r);
  }
  std::uint32_t r = (x >> 13) - (112u << 10);
  const std::uint32_t rest = x & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (r & 1u))) ++r;  // a carry into the exponent is right
  return static_cast<std::uint16_t>(sign | r);
}

/// OCP FP8 E4M3 ("e4m3fn": bias 7, no infinities, S.1111.111 is NaN, largest 448).
KVEVICT_HOST_DEVICE inline float fp8_e4m3_bits_to_float(std::uint8_t b) noexcept {
  const std::uint32_t sign = static_cast<std::uint32_t>(b & 0x80u) << 24;
  const std::uint32_t mag = b & 0x7fu;
  if (mag == 0x7fu) return bit_cast<float>(sign | 0x7fc00000u);
  const std::uint32_t exponent = mag >> 3, mantissa = mag & 0x7u;
  if (exponent == 0)  // zero or subnormal: mantissa * 2^-9, exact in float32
    return bit_cast<float>(sign | bit_cast<std::uint32_t>(static_cast<float>(mantissa) * 0.001953125f));
  return bit_cast<float>(sign | ((exponent + 120u) << 23) | (mantissa << 20));
}

/// OCP FP8 E5M2 (bias 15, IEEE-like infinities and NaNs): the top byte of an fp16.
KVEVICT_HOST_DEVICE inline float fp8_e5m2_bits_to_float(std::uint8_t b) noexcept {
  return fp16_bits_to_float(static_cast<std::uint16_t>(b << 8));
}

/// Round-to-nearest-even narrowing to an 8-bit float with `man` mantissa bits, exponent bias
/// `bias` and largest finite magnitude `max_finite` (code `max_code`); finite values beyond it
/// saturate to it. `inf_code`: the infinity's code, or 0 for a format without one (then
/// infinities saturate too). NaN becomes `nan_code` with the sign kept.
KVEVICT_HOST_DEVICE inline std::uint8_t float_to_fp8_bits(float value, int man, int bias, float max_finite,
                                                          std::uint8_t max_code, std::uint8_t inf_code,
                                                          std::uint8_t nan_code) noexcept {
  const std::uint8_t sign = (bit_cast<std::uint32_t>(value) >> 31) != 0 ? 0x80u : 0u;
  if (value != value) return static_cast<std::uint8_t>(sign | nan_code);
  const float a = std::fabs(value);
  if (a == INFINITY && inf_code != 0) return static_cast<std::uint8_t>(sign | inf_code);
  if (a >= max_finite) return static_cast<std::uint8_t>(sign | max_code);  // saturate (and infinities of e4m3)
  const int emin = 1 - bias;                                               // smallest normal exponent
  int e = 0;
  (void)std::frexp(a, &e);  // a = f * 2^e with f in [0.5, 1): a's exponent is e - 1
  const int quantum_exp = (e - 1 < emin ? emin : e - 1) - man;
  // a / quantum is exact (a power-of-two scaling); nearbyint rounds half to even.
  const float units = std::nearbyint(std::ldexp(a, -quantum_exp));
  const float rounded = std::ldexp(units, quantum_exp);
  if (rounded >= max_finite) return static_cast<std::uint8_t>(sign | max_code);
  if (rounded < std::ldexp(1.0f, emin))  // subnormal (or zero): the units are the mantissa
    return static_cast<std::uint8_t>(sign | static_cast<std::uint32_t>(units));
  int re = 0;
  const float frac = std::frexp(rounded, &re);  // rounded = frac * 2^re, frac in [0.5, 1)
  const std::uint32_t mantissa = static_cast<std::uint32_t>(std::ldexp(frac, man + 1)) - (1u << man);
  return static_cast<std::uint8_t>(sign | (static_cast<std::uint32_t>(re - 1 + bias) << man) | mantissa);
}

KVEVICT_HOST_DEVICE inline float bf16_bits_to_float(std::uint16_t b) noexcept {
  return bit_cast<float>(static_cast<std::uint32_t>(b) << 16);
}

KVEVICT_HOST_DEVICE inline std::uint16_t float_to_bf16_bits(float value) noexcept {
  const std::uint32_t x = bit_cast<std::uint32_t>(value);
  if ((x & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((x >> 16) | 0x0040u);
  return static_cast<std::uint16_t>((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}
}  // namespace detail

/// IEEE 754 binary16. Stored as its bit pattern; converts exactly to float.
struct fp16 {
  std::uint16_t bits;

  fp16() = default;
  KVEVICT_HOST_DEVICE explicit fp16(float value) noexcept : bits(detail::float_to_fp16_bits(value)) {}
  KVEVICT_HOST_DEVICE static fp16 from_bits(std::uint16_t b) noexcept {
    fp16 h;
    h.bits = b;
    return h;
  }
  KVEVICT_HOST_DEVICE explicit operator float() const noexcept { return detail::fp16_bits_to_float(bits); }
};

/// bfloat16: the top half of a float32. Stored as its bit pattern.
struct bf16 {
  std::uint16_t bits;

  bf16() = default;
  KVEVICT_HOST_DEVICE explicit bf16(float value) noexcept : bits(detail::float_to_bf16_bits(value)) {}
  KVEVICT_HOST_DEVICE static bf16 from_bits(std::uint16_t b) noexcept {
    bf16 h;
    h.bits = b;
    return h;
  }
  KVEVICT_HOST_DEVICE explicit operator float() const noexcept { return detail::bf16_bits_to_float(bits); }
};

/// OCP FP8 E4M3 (vLLM's `fp8`/`fp8_e4m3`; no infinities, largest finite 448): a K/V storage
/// type. Narrowing saturates finite overflow and infinities to +-448.
struct fp8_e4m3 {
  std::uint8_t bits;

  fp8_e4m3() = default;
  KVEVICT_HOST_DEVICE explicit fp8_e4m3(float value) noexcept
      : bits(detail::float_to_fp8_bits(value, 3, 7, 448.0f, 0x7eu, 0u, 0x7fu)) {}
  KVEVICT_HOST_DEVICE static fp8_e4m3 from_bits(std::uint8_t b) noexcept {
    fp8_e4m3 x;
    x.bits = b;
    return x;
  }
  KVEVICT_HOST_DEVICE explicit operator float() const noexcept { return detail::fp8_e4m3_bits_to_float(bits); }
};

/// OCP FP8 E5M2 (vLLM's `fp8_e5m2`; infinities and NaNs as IEEE, largest finite 57344): a
/// K/V storage type. Narrowing saturates finite overflow to +-57344 and keeps infinities.
struct fp8_e5m2 {
  std::uint8_t bits;

  fp8_e5m2() = default;
  KVEVICT_HOST_DEVICE explicit fp8_e5m2(float value) noexcept
      : bits(detail::float_to_fp8_bits(value, 2, 15, 57344.0f, 0x7bu, 0x7cu, 0x7eu)) {}
  KVEVICT_HOST_DEVICE static fp8_e5m2 from_bits(std::uint8_t b) noexcept {
    fp8_e5m2 x;
    x.bits = b;
    return x;
  }
  KVEVICT_HOST_DEVICE explicit operator float() const noexcept { return detail::fp8_e5m2_bits_to_float(bits); }
};

static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable<fp16>::value, "fp16 layout");
static_assert(sizeof(fp8_e4m3) == 1 && std::is_trivially_copyable<fp8_e4m3>::value, "fp8 layout");
static_assert(sizeof(fp8_e5m2) == 1 && std::is_trivially_copyable<fp8_e5m2>::value, "fp8 layout");
static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable<bf16>::value, "bf16 layout");

/// Runtime tag of a storage type, for engines that pick the type at run time.
enum class dtype : std::int32_t { f32 = 0, f16 = 1, bf16 = 2, f8_e4m3 = 3, f8_e5m2 = 4 };

inline const char* to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
    case dtype::f8_e4m3:
      return "f8_e4m3";
    case dtype::f8_e5m2:
      return "f8_e5m2";
  }
  return "unknown";
}

/// The element type of views whose type is known at run time only (the runtime-dtype entry:
/// compressor::run over any_sequence_io, with the plan's dtype tags). Incomplete on purpose:
/// such a view can be described and converted (cache_view::with_element), never read.
struct any_element;

/// True for any_element (maybe const).
template <class T>
struct is_any_element : std::is_same<std::remove_cv_t<T>, any_element> {};

/// True for the types queries may be stored in (cv-qualifiers ignored): float, fp16, bf16.
template <class T>
struct is_query_type : std::integral_constant<bool, std::is_same<std::remove_cv_t<T>, float>::value ||
                                                        std::is_same<std::remove_cv_t<T>, fp16>::value ||
                                                        std::is_same<std::remove_cv_t<T>, bf16>::value> {};

/// True for 8-bit float storage (K/V caches only; read through the view's per-tensor scale).
template <class T>
struct is_fp8_type : std::integral_constant<bool, std::is_same<std::remove_cv_t<T>, fp8_e4m3>::value ||
                                                      std::is_same<std::remove_cv_t<T>, fp8_e5m2>::value> {};

/// True for the types a K/V cache may be stored in (cv-qualifiers ignored).
template <class T>
struct is_storage_type : std::integral_constant<bool, is_query_type<T>::value || is_fp8_type<T>::value> {};

/// The query type that goes with a cache type by default: the cache's own type, and bf16 (the
/// usual model dtype) for fp8 caches; name another as the second template argument of a
/// policy or of sequence_io (e.g. `snapkv<fp8_e4m3, fp16>` for an fp16 model).
template <class T>
struct default_query_type {
  using type = std::conditional_t<is_fp8_type<T>::value, bf16, std::remove_cv_t<T>>;
};
template <class T>
using default_query_type_t = typename default_query_type<T>::type;

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct dtype_of<fp16> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct dtype_of<bf16> : std::integral_constant<dtype, dtype::bf16> {};
template <>
struct dtype_of<fp8_e4m3> : std::integral_constant<dtype, dtype::f8_e4m3> {};
template <>
struct dtype_of<fp8_e5m2> : std::integral_constant<dtype, dtype::f8_e5m2> {};
template <class T>
struct dtype_of<const T> : dtype_of<T> {};

/// Widening to float32 (exact for every storage type).
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE float to_float(float x) noexcept {
  return x;
}
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE float to_float(fp16 x) noexcept {
  return detail::fp16_bits_to_float(x.bits);
}
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE float to_float(bf16 x) noexcept {
  return detail::bf16_bits_to_float(x.bits);
}
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE float to_float(fp8_e4m3 x) noexcept {
  return detail::fp8_e4m3_bits_to_float(x.bits);
}
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE float to_float(fp8_e5m2 x) noexcept {
  return detail::fp8_e5m2_bits_to_float(x.bits);
}

/// Narrowing from float32 with round-to-nearest-even.
template <class T>
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE T from_float(float x) noexcept {
  return T(x);
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DTYPE_HPP
