// SPDX-License-Identifier: Apache-2.0
// This machine's rooflines, measured in the same run as the kernels they bound:
//   - fp32 FMA peak of one core: a register-blocked loop of independent AVX-512 FMAs
//     (12 accumulators hide the FMA latency on both FMA ports); 2 FLOP per lane per FMA.
//   - read bandwidth: a vector sum over a buffer much larger than the last-level cache.
//   - memcpy bandwidth: std::memcpy between two such buffers, reported as bytes copied per
//     second (each byte is read once and written once), the unit compaction reports too.
//   - where kvevict uses AMX (bf16 scoring), the AMX bf16 peak: a loop of independent
//     TDPBF16PS on tiles in registers (16 x 16 x 32 multiply-adds each, 2 FLOP apiece).
#ifndef KVEVICT_BENCH_ROOFLINE_HPP
#define KVEVICT_BENCH_ROOFLINE_HPP

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common.hpp"
#include "kvevict/detail/gemm.hpp"  // KVEVICT_DETAIL_AMX, amx_usable()

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace kb {

#if defined(__AVX512F__)
/// Horizontal sum through memory (GCC 12's _mm512_reduce_add_ps trips -Wuninitialized).
inline float hsum(__m512 v) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, v);
  float s = 0.0f;
  for (float x : lanes) s += x;
  return s;
}
#endif

/// `iterations` rounds of 12 independent 16-lane FMAs; returns a value that depends on all
/// of them so nothing is optimised away. FLOPs: iterations * 12 * lanes * 2.
__attribute__((noinline)) inline float fma_kernel(std::int64_t iterations, float seed) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_set1_ps(seed), a1 = _mm512_set1_ps(seed + 1), a2 = _mm512_set1_ps(seed + 2),
         a3 = _mm512_set1_ps(seed + 3), a4 = _mm512_set1_ps(seed + 4), a5 = _mm512_set1_ps(seed + 5),
         a6 = _mm512_set1_ps(seed + 6), a7 = _mm512_set1_ps(seed + 7), a8 = _mm512_set1_ps(seed + 8),
         a9 = _mm512_set1_ps(seed + 9), a10 = _mm512_set1_ps(seed + 10), a11 = _mm512_set1_ps(seed + 11);
  const __m512 m = _mm512_set1_ps(0.99999f), c = _mm512_set1_ps(1e-6f);
  for (std::int64_t i = 0; i < iterations; ++i) {
    a0 = _mm512_fmadd_ps(a0, m, c);
    a1 = _mm512_fmadd_ps(a1, m, c);
    a2 = _mm512_fmadd_ps(a2, m, c);
    a3 = _mm512_fmadd_ps(a3, m, c);
    a4 = _mm512_fmadd_ps(a4, m, c);
    a5 = _mm512_fmadd_ps(a5, m, c);
    a6 = _mm512_fmadd_ps(a6, m, c);
    a7 = _mm512_fmadd_ps(a7, m, c);
    a8 = _mm512_fmadd_ps(a8, m, c);
    a9 = _mm512_fmadd_ps(a9, m, c);
    a10 = _mm512_fmadd_ps(a10, m, c);
    a11 = _mm512_fmadd_ps(a11, m, c);
  }
  const __m512 s = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)),
                                 _mm512_add_ps(_mm512_add_ps(a4, a5), _mm512_add_ps(a6, a7)));
  return hsum(_mm512_add_ps(s, _mm512_add_ps(_mm512_add_ps(a8, a9), _mm512_add_ps(a10, a11))));
#else
  // Portable fallback: 12 independent scalar chains x 16 lanes the compiler may vectorise.
  float a[12][16];
  for (int j = 0; j < 12; ++j)
    for (int l = 0; l < 16; ++l) a[j][l] = seed + static_cast<float>(j);
  for (std::int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < 12; ++j)
      for (int l = 0; l < 16; ++l) a[j][l] = a[j][l] * 0.99999f + 1e-6f;
  float s = 0.0f;
  for (int j = 0; j < 12; ++j)
    for (int l = 0; l < 16; ++l) s += a[j][l];
  return s;
#endif
}
constexpr double fma_kernel_flops_per_iteration = 12.0 * 16.0 * 2.0;

/// Sum of n floats (n a multiple of 64) with four independent vector accumulators.
__attribute__((noinline)) inline float read_kernel(const float* p, std::size_t n) {
#if defined(__AVX512F__)
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i < n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  return hsum(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
  float a[64] = {};
  for (std::size_t i = 0; i < n; i += 64)
    for (int l = 0; l < 64; ++l) a[l] += p[i + static_cast<std::size_t>(l)];
  float s = 0.0f;
  for (float x : a) s += x;
  return s;
#endif
}

/// A page-touched, 64-byte aligned buffer.
class big_buffer {
 public:
  explicit big_buffer(std::size_t bytes) : bytes_(bytes) {
    p_ = static_cast<float*>(::operator new(bytes, std::align_val_t(64)));
    std::memset(p_, 0x3c, bytes);
  }
  big_buffer(const big_buffer&) = delete;
  big_buffer& operator=(const big_buffer&) = delete;
  ~big_buffer() { ::operator delete(p_, std::align_val_t(64)); }
  float* data() const { return p_; }
  std::size_t bytes() const { return bytes_; }
  std::size_t floats() const { return bytes_ / sizeof(float); }

 private:
  float* p_;
  std::size_t bytes_;
};

/// Buffer size of the bandwidth rooflines: well beyond the last-level cache a core can use.
constexpr std::size_t roofline_buffer_bytes = std::size_t{512} << 20;

struct rooflines {
  double fma_gflops = 0.0;  ///< fp32 FMA peak, one core
  double amx_gflops = 0.0;  ///< bf16 AMX peak, one core (0 where kvevict does not use AMX)
  double read_gbs = 0.0;    ///< DRAM read, bytes read per second
  double memcpy_gbs = 0.0;  ///< memcpy, bytes copied per second
};

inline double measure_fma_gflops(double seconds) {
  const std::int64_t block = 1 << 20;
  volatile float seed = 1.0f;                         // read per call, so the (pure) kernel call cannot be hoisted
  volatile float sink = fma_kernel(block / 8, seed);  // warm up (clock ramps)
  const double t = median_seconds([&] { sink = fma_kernel(block, seed); }, 5, seconds, 200);
  (void)sink;
  return static_cast<double>(block) * fma_kernel_flops_per_iteration / t * 1e-9;
}

inline double measure_read_gbs(std::size_t bytes, double seconds) {
  big_buffer b(bytes);
  volatile float sink = 0.0f;
  float* volatile data = b.data();  // re-read per call, so the pure kernel call cannot be hoisted
  const double t = median_seconds([&] { sink = read_kernel(data, b.floats()); }, 3, seconds, 50);
  (void)sink;
  return static_cast<double>(bytes) / t * 1e-9;
}

inline double measure_memcpy_gbs(std::size_t bytes, double seconds) {
  big_buffer src(bytes), dst(bytes);
  int flip = 0;
  const double t = median_seconds(
      [&] {
        std::memcpy(dst.data(), src.data(), bytes);
        src.data()[flip++ & 1023] = dst.data()[7];  // a dependency, so no copy is elided
      },
      3, seconds, 50);
  return static_cast<double>(bytes) / t * 1e-9;
}

/// TDPBF16PS peak: four independent accumulator tiles, operands resident in tile registers.
inline double measure_amx_gflops(double seconds) {
#if KVEVICT_DETAIL_AMX
  if (!kvevict::detail::amx_usable()) return 0.0;
  struct alignas(64) tile_config {
    std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
    std::uint16_t colsb[16] = {};
    std::uint8_t rows[16] = {};
  } cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.colsb[t] = 64;
    cfg.rows[t] = 16;
  }
  alignas(64) static std::uint16_t operand[16 * 32];
  for (auto& x : operand) x = 0x3f80;  // bf16 1.0
  const std::int64_t block = 1 << 16;
  volatile std::int64_t n = block;
  const double t = median_seconds(
      [&] {
        _tile_loadconfig(&cfg);
        _tile_zero(0);  // tile numbers must be constants
        _tile_zero(1);
        _tile_zero(2);
        _tile_zero(3);
        _tile_loadd(4, operand, 64);
        _tile_loadd(5, operand, 64);
        _tile_loadd(6, operand, 64);
        _tile_loadd(7, operand, 64);
        for (std::int64_t i = 0; i < n; ++i) {
          _tile_dpbf16ps(0, 4, 6);
          _tile_dpbf16ps(1, 4, 7);
          _tile_dpbf16ps(2, 5, 6);
          _tile_dpbf16ps(3, 5, 7);
        }
        _tile_release();
      },
      5, seconds, 200);
  return static_cast<double>(block) * 4.0 * 16 * 16 * 32 * 2 / t * 1e-9;
#else
  (void)seconds;
  return 0.0;
#endif
}

inline rooflines measure_rooflines(std::size_t bytes = roofline_buffer_bytes, double seconds = 0.3) {
  rooflines r;
  r.fma_gflops = measure_fma_gflops(seconds);
  r.amx_gflops = measure_amx_gflops(seconds);
  r.read_gbs = measure_read_gbs(bytes, seconds);
  r.memcpy_gbs = measure_memcpy_gbs(bytes, seconds);
  return r;
}

}  // namespace kb

#endif  // KVEVICT_BENCH_ROOFLINE_HPP
