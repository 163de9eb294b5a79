// SPDX-License-Identifier: Apache-2.0
// This machine's rooflines, measured in the same run as the kernels they bound, one per CPU
// path kvevict can take (kvevict/cpu_isa.hpp), each compiled for that path's target whatever
// the benchmark's own -march:
//   - fp32 FMA peak of one core per path: a register-blocked loop of 12 independent FMA
//     chains (enough to hide the FMA latency on two FMA ports): 8 lanes (AVX2) or 16 lanes
//     (AVX-512), 2 FLOP per lane per FMA. The scalar path's "peak" is the same loop written
//     in portable C++ (12 x 16 independent multiply-adds) as the baseline compiler vectorises
//     it: what the portable kernels can reach at best.
//   - VDPBF16PS peak (avx512bf16): the same loop of bf16 pair dot products, 64 FLOP per
//     instruction (16 lanes x 2 products x 2).
//   - AMX bf16 peak (amx): a loop of independent TDPBF16PS on tiles in registers
//     (16 x 16 x 32 multiply-adds each, 2 FLOP apiece).
//   - read bandwidth: a vector sum over a buffer much larger than the last-level cache.
//   - memcpy bandwidth: std::memcpy between two such buffers, reported as bytes copied per
//     second (each byte is read once and written once), the unit compaction reports too.
#ifndef KVEVICT_BENCH_ROOFLINE_HPP
#define KVEVICT_BENCH_ROOFLINE_HPP

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <new>

#include "common.hpp"
#include "kvevict/cpu_isa.hpp"
#include "kvevict/detail/isa/amx.hpp"
#include "kvevict/detail/isa/target.hpp"

namespace kb {

/// Portable: 12 independent chains x 16 lanes the compiler may vectorise for the baseline.
/// FLOPs: iterations * 12 * 16 * 2.
__attribute__((noinline)) inline float fma_kernel_portable(std::int64_t iterations, float seed) {
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
}

/// Portable sum of n floats (n a multiple of 64) with 64 independent accumulators.
__attribute__((noinline)) inline float read_kernel_portable(const float* p, std::size_t n) {
  float a[64] = {};
  for (std::size_t i = 0; i < n; i += 64)
    for (int l = 0; l < 64; ++l) a[l] += p[i + static_cast<std::size_t>(l)];
  float s = 0.0f;
  for (float x : a) s += x;
  return s;
}

#if KVEVICT_X86_DISPATCH
KVEVICT_TARGET_AVX2_BEGIN
/// 12 independent 8-lane FMA chains. FLOPs: iterations * 12 * 8 * 2.
__attribute__((noinline)) inline float fma_kernel_avx2(std::int64_t iterations, float seed) {
  __m256 a[12];
  for (int j = 0; j < 12; ++j) a[j] = _mm256_set1_ps(seed + static_cast<float>(j));
  const __m256 m = _mm256_set1_ps(0.99999f), c = _mm256_set1_ps(1e-6f);
  for (std::int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < 12; ++j) a[j] = _mm256_fmadd_ps(a[j], m, c);
  alignas(32) float lanes[8];
  __m256 s = a[0];
  for (int j = 1; j < 12; ++j) s = _mm256_add_ps(s, a[j]);
  _mm256_store_ps(lanes, s);
  float t = 0.0f;
  for (float x : lanes) t += x;
  return t;
}
KVEVICT_TARGET_END

KVEVICT_TARGET_AVX512_BEGIN
/// 12 independent 16-lane FMA chains. FLOPs: iterations * 12 * 16 * 2.
__attribute__((noinline)) inline float fma_kernel_avx512(std::int64_t iterations, float seed) {
  __m512 a[12];
  for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_ps(seed + static_cast<float>(j));
  const __m512 m = _mm512_set1_ps(0.99999f), c = _mm512_set1_ps(1e-6f);
  for (std::int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < 12; ++j) a[j] = _mm512_fmadd_ps(a[j], m, c);
  alignas(64) float lanes[16];
  __m512 s = a[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, a[j]);
  _mm512_store_ps(lanes, s);
  float t = 0.0f;
  for (float x : lanes) t += x;
  return t;
}

/// Sum of n floats (n a multiple of 64) with four independent vector accumulators.
__attribute__((noinline)) inline float read_kernel_avx512(const float* p, std::size_t n) {
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (std::size_t i = 0; i < n; i += 64) {
    a0 = _mm512_add_ps(a0, _mm512_load_ps(p + i));
    a1 = _mm512_add_ps(a1, _mm512_load_ps(p + i + 16));
    a2 = _mm512_add_ps(a2, _mm512_load_ps(p + i + 32));
    a3 = _mm512_add_ps(a3, _mm512_load_ps(p + i + 48));
  }
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, _mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
  float t = 0.0f;
  for (float x : lanes) t += x;
  return t;
}
KVEVICT_TARGET_END

KVEVICT_TARGET_AVX512BF16_BEGIN
/// 12 independent VDPBF16PS chains. FLOPs: iterations * 12 * 16 * 2 * 2.
__attribute__((noinline)) inline float bf16_dot_kernel(std::int64_t iterations, float seed) {
  __m512 a[12];
  for (int j = 0; j < 12; ++j) a[j] = _mm512_set1_ps(seed + static_cast<float>(j));
  const __m512i x = _mm512_set1_epi32(0x3f803f80);  // bf16 pair (1, 1)
  const __m512i y = _mm512_set1_epi32(0x21802180);  // (2^-60, 2^-60): the sums stay finite
  for (std::int64_t i = 0; i < iterations; ++i)
    for (int j = 0; j < 12; ++j) a[j] = _mm512_dpbf16_ps(a[j], (__m512bh)x, (__m512bh)y);
  alignas(64) float lanes[16];
  __m512 s = a[0];
  for (int j = 1; j < 12; ++j) s = _mm512_add_ps(s, a[j]);
  _mm512_store_ps(lanes, s);
  float t = 0.0f;
  for (float v : lanes) t += v;
  return t;
}
KVEVICT_TARGET_END
#endif

#if KVEVICT_AMX_DISPATCH
KVEVICT_TARGET_AMX_BEGIN
/// `iterations` rounds of four independent TDPBF16PS, operands resident in tile registers.
__attribute__((noinline)) inline void amx_kernel(std::int64_t iterations) {
  const kvevict::detail::isa_avx512::amx_tile_config cfg(8);
  alignas(64) static std::uint16_t operand[16 * 32];
  for (auto& x : operand) x = 0x3f80;                  // bf16 1.0
  kvevict::detail::isa_avx512::load_tile_config(cfg);  // not _tile_loadconfig: see there
  _tile_zero(0);                                       // tile numbers must be constants
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  _tile_loadd(4, operand, 64);
  _tile_loadd(5, operand, 64);
  _tile_loadd(6, operand, 64);
  _tile_loadd(7, operand, 64);
  for (std::int64_t i = 0; i < iterations; ++i) {
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_release();
}
KVEVICT_TARGET_END
#endif

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
  double scalar_gflops = 0.0;    ///< portable multiply-add loop as the baseline compiles it
  double avx2_gflops = 0.0;      ///< 8-lane FMA peak (0 where the CPU has no AVX2 path)
  double avx512_gflops = 0.0;    ///< 16-lane FMA peak (0 where the CPU has no AVX-512 path)
  double bf16_dot_gflops = 0.0;  ///< VDPBF16PS peak (0 below avx512bf16)
  double amx_gflops = 0.0;       ///< TDPBF16PS peak (0 unless the process runs the amx path)
  double read_gbs = 0.0;         ///< DRAM read, bytes read per second
  double memcpy_gbs = 0.0;       ///< memcpy, bytes copied per second

  /// The float32 FMA peak of the path the process runs: what its scoring GEMM is measured
  /// against (bf16 x bf16 products on avx512bf16 and amx are also given against their own).
  double fma_gflops() const {
    switch (kvevict::active_cpu_isa()) {
      case kvevict::cpu_isa::scalar:
        return scalar_gflops;
      case kvevict::cpu_isa::avx2:
        return avx2_gflops;
      default:
        return avx512_gflops;
    }
  }
};

template <class Kernel>
double measure_peak(Kernel kernel, double flops_per_iteration, double seconds) {
  const std::int64_t block = 1 << 20;
  volatile float seed = 1.0f;                     // read per call, so the (pure) kernel call cannot be hoisted
  volatile float sink = kernel(block / 8, seed);  // warm up (clock ramps)
  const double t = median_seconds([&] { sink = kernel(block, seed); }, 5, seconds, 200);
  (void)sink;
  return static_cast<double>(block) * flops_per_iteration / t * 1e-9;
}

inline double measure_read_gbs(std::size_t bytes, double seconds) {
  big_buffer b(bytes);
  volatile float sink = 0.0f;
  float* volatile data = b.data();  // re-read per call, so the pure kernel call cannot be hoisted
  const bool wide = kvevict::cpu_isa_supported(kvevict::cpu_isa::avx512);
  const double t = median_seconds(
      [&] {
#if KVEVICT_X86_DISPATCH
        if (wide) {
          sink = read_kernel_avx512(data, b.floats());
          return;
        }
#endif
        sink = read_kernel_portable(data, b.floats());
      },
      3, seconds, 50);
  (void)sink, (void)wide;
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

inline double measure_amx_gflops(double seconds) {
#if KVEVICT_AMX_DISPATCH
  if (kvevict::active_cpu_isa() != kvevict::cpu_isa::amx) return 0.0;  // tile state granted only then
  const std::int64_t block = 1 << 16;
  volatile std::int64_t n = block;
  const double t = median_seconds([&] { amx_kernel(n); }, 5, seconds, 200);
  return static_cast<double>(block) * 4.0 * 16 * 16 * 32 * 2 / t * 1e-9;
#else
  (void)seconds;
  return 0.0;
#endif
}

inline rooflines measure_rooflines(std::size_t bytes = roofline_buffer_bytes, double seconds = 0.3) {
  using kvevict::cpu_isa;
  rooflines r;
  r.scalar_gflops = measure_peak(fma_kernel_portable, 12.0 * 16 * 2, seconds);
#if KVEVICT_X86_DISPATCH
  if (kvevict::cpu_isa_supported(cpu_isa::avx2)) r.avx2_gflops = measure_peak(fma_kernel_avx2, 12.0 * 8 * 2, seconds);
  if (kvevict::cpu_isa_supported(cpu_isa::avx512))
    r.avx512_gflops = measure_peak(fma_kernel_avx512, 12.0 * 16 * 2, seconds);
  if (kvevict::cpu_isa_supported(cpu_isa::avx512bf16))
    r.bf16_dot_gflops = measure_peak(bf16_dot_kernel, 12.0 * 16 * 4, seconds);
#endif
  r.amx_gflops = measure_amx_gflops(seconds);
  r.read_gbs = measure_read_gbs(bytes, seconds);
  r.memcpy_gbs = measure_memcpy_gbs(bytes, seconds);
  return r;
}

}  // namespace kb

#endif  // KVEVICT_BENCH_ROOFLINE_HPP
