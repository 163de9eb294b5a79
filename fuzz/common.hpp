// Shared pieces of kvevict's libFuzzer harnesses: reading fuzz bytes, the failure macro,
// checksums, score comparison against the scalar reference, and an explicit offset model
// of cache views (the definition of a view, written out independently of the library).
#pragma once

#include <fuzzer/FuzzedDataProvider.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <numeric>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "reference/reference.hpp"
#include "support/checksum.hpp"
#include "support/near_tie.hpp"
#include "support/test_cache.hpp"

namespace fuzz {

using i64 = std::int64_t;

/// A harness finding: print and abort (libFuzzer saves the input as crash-*).
#define FUZZ_REQUIRE(cond, ...)                                                           \
  do {                                                                                    \
    if (!(cond)) {                                                                        \
      std::fprintf(stderr, "FUZZ_REQUIRE failed %s:%d: %s: ", __FILE__, __LINE__, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                                  \
      std::fprintf(stderr, "\n");                                                         \
      std::abort();                                                                       \
    }                                                                                     \
  } while (0)

using test::fnv;
using test::fnv_seed;

/// Values that break validators: zero, one, negatives, powers of two around 2^31, 2^32,
/// 2^62 and the int64 extremes.
inline i64 interesting(FuzzedDataProvider& in) {
  static const i64 values[] = {0,
                               1,
                               -1,
                               2,
                               3,
                               7,
                               8,
                               16,
                               17,
                               64,
                               -2,
                               (i64{1} << 31) - 1,
                               i64{1} << 31,
                               (i64{1} << 32) - 1,
                               i64{1} << 32,
                               (i64{1} << 32) + 1,
                               i64{1} << 40,
                               i64{1} << 62,
                               std::numeric_limits<i64>::max(),
                               std::numeric_limits<i64>::min(),
                               -(i64{1} << 31)};
  return in.PickValueInArray(values);
}

/// a + b, or a when that overflows (fuzz-chosen nudges of fuzz-chosen extremes).
inline i64 nudge(i64 a, i64 b) {
  i64 r = 0;
  return __builtin_add_overflow(a, b, &r) ? a : r;
}

/// A float from the bytes: mostly moderate numbers, sometimes a special value.
inline float fuzz_float(FuzzedDataProvider& in, bool allow_special) {
  const int kind = in.ConsumeIntegralInRange<int>(0, allow_special ? 15 : 11);
  switch (kind) {
    case 12:
      return std::numeric_limits<float>::quiet_NaN();
    case 13:
      return std::numeric_limits<float>::infinity();
    case 14:
      return -std::numeric_limits<float>::infinity();
    case 15:
      return in.ConsumeBool() ? -0.0f : std::numeric_limits<float>::denorm_min();
    default:
      return static_cast<float>(in.ConsumeIntegralInRange<int>(-64, 64)) / 16.0f;
  }
}

/// Relative-plus-scale tolerance of the unit tests (tests/support/compare.hpp), widened by the
/// float rounding of the logits: a probability exp(logit - lse) computed from a float logit
/// (or a float engine LSE) of magnitude m is off by up to about m * FLT_EPSILON relative, which
/// passes 2e-4 once m is in the thousands (fp8 keys at a scale of 3 reach that).
inline bool scores_close(const float* got, const std::vector<ref::vec>& want, i64 cols, i64* bad_row, i64* bad_col,
                         double logit_magnitude = 0) {
  const double rel = 2e-4 + 4.0 * logit_magnitude * static_cast<double>(std::numeric_limits<float>::epsilon());
  for (std::size_t h = 0; h < want.size(); ++h) {
    double scale = 0;
    for (double x : want[h])
      if (std::isfinite(x)) scale = std::max(scale, std::fabs(x));
    for (i64 j = 0; j < cols; ++j) {
      const double g = got[static_cast<i64>(h) * cols + j], e = want[h][static_cast<std::size_t>(j)];
      bool ok;
      if (std::isnan(e)) {
        ok = std::isnan(g);
      } else if (std::isinf(e)) {
        ok = g == e;
      } else {
        ok = std::fabs(g - e) <= rel * std::fabs(e) + 2e-6 * scale + 1e-30;
      }
      if (!ok) {
        *bad_row = static_cast<i64>(h);
        *bad_col = j;
        return false;
      }
    }
  }
  return true;
}

/// Whether the reference's k-th and (k+1)-th best candidates are too close to call (looser
/// than the unit tests: fuzzed data reaches larger magnitudes and float32 rounding).
inline bool near_tie(const ref::vec& row, i64 candidates, i64 k) {
  return test::near_tie_at(row, candidates, k, 1e-3, 1e-5);
}

/// A serial executor that claims several workers and runs tasks in a permuted order.
struct shuffled_executor {
  int workers = 3;
  std::uint32_t seed = 0;
  static void parallel_for(void* context, std::int64_t n, kvevict::task_fn fn, void* arg) {
    const auto* self = static_cast<const shuffled_executor*>(context);
    std::int64_t stride = 1 + static_cast<std::int64_t>(self->seed % 13);
    while (n > 1 && std::gcd(stride, n) != 1) ++stride;
    for (std::int64_t k = 0; k < n; ++k) fn(arg, (k * stride + self->seed) % n, static_cast<int>(k % self->workers));
  }
  kvevict::executor get() {
    kvevict::executor e;
    e.num_workers = workers;
    e.context = this;
    e.parallel_for = &shuffled_executor::parallel_for;
    return e;
  }
};

/// Picks a storage type and calls fn(T{}).
template <class Fn>
void with_dtype(int which, Fn&& fn) {
  switch (which % 3) {
    case 0:
      fn(float{});
      break;
    case 1:
      fn(kvevict::fp16{});
      break;
    default:
      fn(kvevict::bf16{});
  }
}

/// Picks a cache storage type, fp8 included, and calls fn(T{}) (queries: default_query_type_t<T>).
template <class Fn>
void with_cache_dtype(int which, Fn&& fn) {
  switch (which % 5) {
    case 3:
      fn(kvevict::fp8_e4m3{});
      break;
    case 4:
      fn(kvevict::fp8_e5m2{});
      break;
    default:
      with_dtype(which % 5, fn);
  }
}

}  // namespace fuzz
