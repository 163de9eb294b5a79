// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DTYPE_HPP
#define KVEVICT_DTYPE_HPP

// Storage element types. K/V caches and queries are stored as float32, IEEE binary16
// (`fp16`) or bfloat16 (`bf16`); all arithmetic is float32. The 16-bit types are plain
// 2-byte values with exact widening and round-to-nearest-even narrowing that preserves
// NaN (quietened) and infinities. Usable in host and device code.

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

static_assert(sizeof(fp16) == 2 && std::is_trivially_copyable<fp16>::value, "fp16 layout");
static_assert(sizeof(bf16) == 2 && std::is_trivially_copyable<bf16>::value, "bf16 layout");

/// Runtime tag of a storage type, for engines that pick the type at run time.
enum class dtype : std::int32_t { f32 = 0, f16 = 1, bf16 = 2 };

inline const char* to_string(dtype t) noexcept {
  switch (t) {
    case dtype::f32:
      return "f32";
    case dtype::f16:
      return "f16";
    case dtype::bf16:
      return "bf16";
  }
  return "unknown";
}

/// True for the storage types kvevict accepts (cv-qualifiers ignored).
template <class T>
struct is_storage_type : std::integral_constant<bool, std::is_same<std::remove_cv_t<T>, float>::value ||
                                                          std::is_same<std::remove_cv_t<T>, fp16>::value ||
                                                          std::is_same<std::remove_cv_t<T>, bf16>::value> {};

template <class T>
struct dtype_of;
template <>
struct dtype_of<float> : std::integral_constant<dtype, dtype::f32> {};
template <>
struct dtype_of<fp16> : std::integral_constant<dtype, dtype::f16> {};
template <>
struct dtype_of<bf16> : std::integral_constant<dtype, dtype::bf16> {};
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

/// Narrowing from float32 with round-to-nearest-even.
template <class T>
KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE T from_float(float x) noexcept {
  return T(x);
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DTYPE_HPP
