// Storage types: fp16 and bf16 conversions against an independent reference over all
// 65,536 bit patterns, every tie, and a million random floats.
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kvevict/detail/widen.hpp"
#include "kvevict/dtype.hpp"

namespace {

float bits_to_float(std::uint32_t b) {
  float f;
  std::memcpy(&f, &b, 4);
  return f;
}
std::uint32_t float_to_bits(float f) {
  std::uint32_t b;
  std::memcpy(&b, &f, 4);
  return b;
}

// Reference decode of binary16 straight from the IEEE 754 definition, in double.
double ref_fp16_value(std::uint16_t h) {
  const int sign = (h >> 15) & 1, exponent = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  double magnitude;
  if (exponent == 0x1f) {
    magnitude = mantissa == 0 ? std::numeric_limits<double>::infinity() : std::numeric_limits<double>::quiet_NaN();
  } else if (exponent == 0) {
    magnitude = std::ldexp(static_cast<double>(mantissa), -24);
  } else {
    magnitude = std::ldexp(1.0 + mantissa / 1024.0, exponent - 15);
  }
  return sign ? -magnitude : magnitude;
}

// Reference round-to-nearest-even by search over the table of representable values.
// `values` are the non-negative finite values of the format in encoding order, `overflow`
// the first value past the largest finite one (rounds to Inf).
std::uint16_t ref_round(double x, const std::vector<double>& values, double overflow, std::uint16_t inf_bits,
                        std::uint16_t sign_bit) {
  const double a = std::fabs(x);
  const std::uint16_t sign = std::signbit(x) ? sign_bit : 0;
  if (a >= overflow) return sign | inf_bits;
  const auto it = std::upper_bound(values.begin(), values.end(), a);  // first value > a
  const std::size_t hi = static_cast<std::size_t>(it - values.begin());
  if (hi == values.size()) {
    // Between the largest finite value and `overflow`: nearer one wins, ties go to the
    // even encoding (Inf is even).
    const double lo_v = values.back();
    const double d_lo = a - lo_v, d_hi = overflow - a;
    if (d_lo < d_hi) return sign | static_cast<std::uint16_t>(values.size() - 1);
    if (d_hi < d_lo) return sign | inf_bits;
    return ((values.size() - 1) & 1) ? (sign | inf_bits) : (sign | static_cast<std::uint16_t>(values.size() - 1));
  }
  const std::size_t lo = hi - 1;  // a >= values[0] == 0 always
  const double d_lo = a - values[lo], d_hi = values[hi] - a;
  std::size_t pick;
  if (d_lo < d_hi)
    pick = lo;
  else if (d_hi < d_lo)
    pick = hi;
  else
    pick = (lo & 1) ? hi : lo;
  return sign | static_cast<std::uint16_t>(pick);
}

std::vector<double> fp16_table() {
  std::vector<double> v;
  for (std::uint32_t b = 0; b < 0x7c00; ++b) v.push_back(ref_fp16_value(static_cast<std::uint16_t>(b)));
  return v;
}
std::vector<double> bf16_table() {
  std::vector<double> v;
  for (std::uint32_t b = 0; b < 0x7f80; ++b) v.push_back(static_cast<double>(bits_to_float(b << 16)));
  return v;
}

}  // namespace

TEST_CASE("fp16 widening is exact for all 65536 bit patterns", "[dtype]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float got = kvevict::to_float(kvevict::fp16::from_bits(h));
    const double want = ref_fp16_value(h);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
      REQUIRE(std::signbit(got) == ((h & 0x8000) != 0));
    } else {
      REQUIRE(static_cast<double>(got) == want);
      REQUIRE(std::signbit(got) == std::signbit(want));
    }
  }
}

TEST_CASE("fp16 narrowing rounds to nearest even", "[dtype]") {
  const std::vector<double> table = fp16_table();
  const double overflow = 65536.0;
  auto check = [&](float f) {
    const std::uint16_t got = kvevict::fp16(f).bits;
    if (std::isnan(f)) {
      REQUIRE((got & 0x7c00) == 0x7c00);
      REQUIRE((got & 0x3ff) != 0);
      REQUIRE(((got & 0x8000) != 0) == std::signbit(f));
      return;
    }
    const std::uint16_t want = std::isinf(f) ? static_cast<std::uint16_t>((std::signbit(f) ? 0x8000 : 0) | 0x7c00)
                                             : ref_round(static_cast<double>(f), table, overflow, 0x7c00, 0x8000);
    INFO("float bits 0x" << std::hex << float_to_bits(f));
    REQUIRE(got == want);
  };
  // Every representable value round-trips; every midpoint is a tie; one float ulp either
  // side of every midpoint must round away from the tie.
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const auto h = static_cast<std::uint16_t>(b);
    const float f = kvevict::to_float(kvevict::fp16::from_bits(h));
    check(f);
    if ((b & 0x7fff) < 0x7c00) {
      if (!std::isnan(f)) REQUIRE(kvevict::fp16(f).bits == h);
      const double next =
          (b & 0x7fff) + 1 < 0x7c00 ? ref_fp16_value(static_cast<std::uint16_t>((b & 0x7fff) + 1)) : overflow;
      const double mid = (std::fabs(static_cast<double>(f)) + next) / 2;
      const float m = static_cast<float>((b & 0x8000) ? -mid : mid);  // exact in float
      REQUIRE(static_cast<double>(std::fabs(m)) == mid);
      check(m);
      check(std::nextafter(m, 0.0f));
      check(std::nextafter(m, m * 2));
    }
  }
  std::mt19937 rng(1234);
  for (int i = 0; i < 1000000; ++i) check(bits_to_float(static_cast<std::uint32_t>(rng())));
  check(std::numeric_limits<float>::infinity());
  check(-std::numeric_limits<float>::infinity());
  check(std::numeric_limits<float>::quiet_NaN());
  check(bits_to_float(0x7f800001u));  // signalling NaN whose payload lives in low bits only
  check(bits_to_float(0xff800001u));
}

TEST_CASE("bf16 widening is exact for all 65536 bit patterns", "[dtype]") {
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float got = kvevict::to_float(kvevict::bf16::from_bits(static_cast<std::uint16_t>(b)));
    REQUIRE(float_to_bits(got) == (b << 16));
  }
}

TEST_CASE("bf16 narrowing rounds to nearest even", "[dtype]") {
  const std::vector<double> table = bf16_table();
  // The value just past the largest finite bf16 (0x7f7f): 2^128, which rounds to Inf.
  const double past_max = std::ldexp(1.0, 128);
  auto check = [&](float f) {
    const std::uint16_t got = kvevict::bf16(f).bits;
    if (std::isnan(f)) {
      REQUIRE((got & 0x7f80) == 0x7f80);
      REQUIRE((got & 0x7f) != 0);
      REQUIRE(((got & 0x8000) != 0) == std::signbit(f));
      return;
    }
    const std::uint16_t want = std::isinf(f) ? static_cast<std::uint16_t>((std::signbit(f) ? 0x8000 : 0) | 0x7f80)
                                             : ref_round(static_cast<double>(f), table, past_max, 0x7f80, 0x8000);
    INFO("float bits 0x" << std::hex << float_to_bits(f));
    REQUIRE(got == want);
  };
  for (std::uint32_t b = 0; b < 65536; ++b) {
    const float f = bits_to_float(b << 16);
    check(f);
    if ((b & 0x7fff) < 0x7f80) {
      REQUIRE(kvevict::bf16(f).bits == b);
      const float mid = bits_to_float((b << 16) | 0x8000u);  // exact midpoint to the next bf16
      check(mid);
      check(bits_to_float((b << 16) | 0x7fffu));
      check(bits_to_float((b << 16) | 0x8001u));
    }
  }
  std::mt19937 rng(99);
  for (int i = 0; i < 1000000; ++i) check(bits_to_float(static_cast<std::uint32_t>(rng())));
  check(bits_to_float(0x7f800001u));
  check(bits_to_float(0xff800001u));
}

namespace {
/// An OCP 8-bit float's value from its fields (independent of the library): bias, mantissa
/// bits, and whether the all-ones exponent holds infinities/NaNs (e5m2) or values (e4m3fn,
/// where only S.1111.111 is NaN).
double fp8_reference(std::uint8_t b, int man, int bias, bool ieee_specials) {
  const int exp_bits = 7 - man;
  const int e = (b >> man) & ((1 << exp_bits) - 1), m = b & ((1 << man) - 1);
  const double sign = (b & 0x80) ? -1.0 : 1.0;
  if (ieee_specials && e == (1 << exp_bits) - 1) return m == 0 ? sign * INFINITY : NAN;
  if (!ieee_specials && (b & 0x7f) == 0x7f) return NAN;
  if (e == 0) return sign * std::ldexp(m, 1 - bias - man);
  return sign * std::ldexp(1.0 + std::ldexp(m, -man), e - bias);
}

template <class T>
void check_fp8(int man, int bias, bool ieee_specials, double max_finite) {
  std::vector<double> finite;  // every finite value, to find the nearest by brute force
  for (int b = 0; b < 256; ++b) {
    const auto x = T::from_bits(static_cast<std::uint8_t>(b));
    const double want = fp8_reference(static_cast<std::uint8_t>(b), man, bias, ieee_specials);
    const float got = kvevict::to_float(x);
    INFO("bits " << b);
    if (std::isnan(want)) {
      REQUIRE(std::isnan(got));
      REQUIRE(std::isnan(kvevict::to_float(T(got))));  // NaN stays NaN through narrowing
      continue;
    }
    REQUIRE(static_cast<double>(got) == want);
    REQUIRE(std::signbit(got) == ((b & 0x80) != 0));
    // Narrowing is exact on representable values (zeros keep their sign).
    REQUIRE(T(got).bits == static_cast<std::uint8_t>(b));
    if (std::isfinite(want)) finite.push_back(want);
  }
  REQUIRE(std::find(finite.begin(), finite.end(), max_finite) != finite.end());
  std::sort(finite.begin(), finite.end());
  // Round to nearest, ties to the even code, finite overflow saturates.
  std::mt19937_64 rng(5);
  std::uniform_real_distribution<double> mag(-1.2 * max_finite, 1.2 * max_finite);
  std::vector<double> probes;
  for (std::size_t i = 0; i + 1 < finite.size(); ++i) probes.push_back((finite[i] + finite[i + 1]) / 2);  // ties
  for (int i = 0; i < 20000; ++i) probes.push_back(mag(rng) * std::pow(2.0, -static_cast<double>(rng() % 24)));
  for (const double p : probes) {
    const float f = static_cast<float>(p);
    if (static_cast<double>(f) != p) continue;  // probes must be float32 values
    const float got = kvevict::to_float(T(f));
    double want;
    if (std::fabs(p) >= max_finite) {
      want = std::copysign(max_finite, p);
    } else {
      auto hi = std::lower_bound(finite.begin(), finite.end(), p);
      auto lo = hi == finite.begin() ? hi : hi - 1;
      if (*hi == p) {
        want = p;
      } else {
        const double dl = p - *lo, dh = *hi - p;
        if (dl != dh) {
          want = dl < dh ? *lo : *hi;
        } else {  // a tie: the value whose code is even
          const std::uint8_t cl = T(static_cast<float>(*lo)).bits;
          want = (cl & 1) == 0 ? *lo : *hi;
        }
      }
    }
    INFO("probe " << p);
    REQUIRE(static_cast<double>(got) == want);
  }
  REQUIRE(kvevict::to_float(T(1e30f)) == static_cast<float>(max_finite));
  REQUIRE(kvevict::to_float(T(-1e30f)) == -static_cast<float>(max_finite));
}
}  // namespace

TEST_CASE("fp8 e4m3 and e5m2: exact widening of all 256 codes, nearest-even saturating narrowing", "[dtype][fp8]") {
  check_fp8<kvevict::fp8_e4m3>(3, 7, false, 448.0);
  check_fp8<kvevict::fp8_e5m2>(2, 15, true, 57344.0);
  // Infinities: e4m3 has none (saturates), e5m2 keeps them.
  REQUIRE(kvevict::to_float(kvevict::fp8_e4m3(INFINITY)) == 448.0f);
  REQUIRE(std::isinf(kvevict::to_float(kvevict::fp8_e5m2(-INFINITY))));
  REQUIRE(kvevict::to_float(kvevict::fp8_e5m2(-INFINITY)) < 0);
}

TEST_CASE("fp8 rows widen the same on every kernel path (SIMD bodies, tails, strides)", "[dtype][fp8]") {
  std::vector<kvevict::fp8_e4m3> a(3 * 256);
  std::vector<kvevict::fp8_e5m2> b(3 * 256);
  for (int i = 0; i < 3 * 256; ++i) {
    a[static_cast<std::size_t>(i)] = kvevict::fp8_e4m3::from_bits(static_cast<std::uint8_t>(i * 7 + i / 256));
    b[static_cast<std::size_t>(i)] = kvevict::fp8_e5m2::from_bits(static_cast<std::uint8_t>(i * 7 + i / 256));
  }
  for (const std::int64_t n : {std::int64_t{1}, std::int64_t{7}, std::int64_t{16}, std::int64_t{37}, std::int64_t{256}})
    for (const std::int64_t stride : {std::int64_t{1}, std::int64_t{3}}) {
      std::vector<float> wa(static_cast<std::size_t>(n)), wb(static_cast<std::size_t>(n));
      kvevict::detail::widen_row(a.data(), stride, wa.data(), n);
      kvevict::detail::widen_row(b.data(), stride, wb.data(), n);
      for (std::int64_t i = 0; i < n; ++i) {
        const float ea = kvevict::to_float(a[static_cast<std::size_t>(i * stride)]);
        const float eb = kvevict::to_float(b[static_cast<std::size_t>(i * stride)]);
        INFO("n " << n << " stride " << stride << " i " << i);
        if (std::isnan(ea))
          REQUIRE(std::isnan(wa[static_cast<std::size_t>(i)]));
        else
          REQUIRE(std::memcmp(&ea, &wa[static_cast<std::size_t>(i)], 4) == 0);
        if (std::isnan(eb))
          REQUIRE(std::isnan(wb[static_cast<std::size_t>(i)]));
        else
          REQUIRE(std::memcmp(&eb, &wb[static_cast<std::size_t>(i)], 4) == 0);
      }
    }
}
