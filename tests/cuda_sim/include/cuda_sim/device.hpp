// Device-side CUDA for the simulator: qualifiers, the thread-index builtins, block barriers,
// warp collectives, atomics, load/store and math intrinsics, and the shared-memory
// declarations (CUDA_SIM_SHARED*; kvevict reaches them through its KVEVICT_SHARED* macros).
//
// Every simulated CUDA thread is a fiber; the scheduler (src/scheduler.cpp) sets threadIdx
// and friends before it resumes one. __syncthreads and the *_sync warp functions are where a
// thread can wait for others: they check that the whole block (or every lane the mask names)
// takes part, and abort with a message naming the kernel source line otherwise.
#pragma once

#include <math.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <ctime>
#include <type_traits>

#include "cuda_sim/types.hpp"

#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Shared memory is per block and needs the simulator's allocation: a plain `__shared__` would
// silently become one object for every block. Declare it with CUDA_SIM_SHARED* instead.
#define __shared__ __shared___is_not_simulated_declare_shared_memory_with_CUDA_SIM_SHARED

// ---- thread-index builtins (set by the scheduler for the running fiber) ----------------
inline thread_local uint3 threadIdx{0, 0, 0};
inline thread_local uint3 blockIdx{0, 0, 0};
inline thread_local dim3 blockDim{1, 1, 1};
inline thread_local dim3 gridDim{1, 1, 1};
constexpr int warpSize = 32;

namespace cudasim {
namespace detail {

enum class barrier_op : int { sync, count, all, any };
int barrier(barrier_op op, int predicate, const char* file, int line) noexcept;

enum class warp_op : int {
  shfl,
  shfl_up,
  shfl_down,
  shfl_xor,
  ballot,
  any,
  all,
  match_any,
  match_all,
  reduce_add,
  reduce_min_signed,
  reduce_max_signed,
  reduce_min_unsigned,
  reduce_max_unsigned,
  reduce_and,
  reduce_or,
  reduce_xor,
  syncwarp,
  mma_bf16,
  mma_f16
};
struct warp_result {
  std::uint64_t value;
  int predicate;
};
warp_result warp_collective(warp_op op, unsigned mask, std::uint64_t value, int bytes, int param, int width,
                            const char* file, int line) noexcept;
unsigned active_mask() noexcept;

void* static_shared(const void* site, std::size_t bytes, std::size_t align, const char* name) noexcept;
void* dynamic_shared(std::size_t align, const char* name) noexcept;
[[noreturn]] void device_trap(const char* file, int line) noexcept;

template <class T>
std::uint64_t to_bits(T v) noexcept {
  static_assert(
      std::is_trivially_copyable<T>::value && (sizeof(T) == 1 || sizeof(T) == 2 || sizeof(T) == 4 || sizeof(T) == 8),
      "warp functions exchange 1-, 2-, 4- or 8-byte trivially copyable values");
  std::uint64_t b = 0;
  std::memcpy(&b, &v, sizeof(T));
  return b;
}
template <class T>
T from_bits(std::uint64_t b) noexcept {
  T v;
  std::memcpy(&v, &b, sizeof(T));
  return v;
}
template <class T>
T exchange(warp_op op, unsigned mask, T var, int param, int width, const char* file, int line) noexcept {
  return from_bits<T>(
      warp_collective(op, mask, to_bits(var), static_cast<int>(sizeof(T)), param, width, file, line).value);
}

}  // namespace detail
}  // namespace cudasim

// ---- block barriers --------------------------------------------------------------------
inline void __syncthreads(const char* file = __builtin_FILE(), int line = __builtin_LINE()) noexcept {
  cudasim::detail::barrier(cudasim::detail::barrier_op::sync, 0, file, line);
}
inline int __syncthreads_count(int predicate, const char* file = __builtin_FILE(),
                               int line = __builtin_LINE()) noexcept {
  return cudasim::detail::barrier(cudasim::detail::barrier_op::count, predicate, file, line);
}
inline int __syncthreads_and(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) noexcept {
  return cudasim::detail::barrier(cudasim::detail::barrier_op::all, predicate, file, line);
}
inline int __syncthreads_or(int predicate, const char* file = __builtin_FILE(), int line = __builtin_LINE()) noexcept {
  return cudasim::detail::barrier(cudasim::detail::barrier_op::any, predicate, file, line);
}

// ---- warp functions --------------------------------------------------------------------
inline void __syncwarp(unsigned mask = 0xffffffffu, const char* file = __builtin_FILE(),
                       int line = __builtin_LINE()) noexcept {
  cudasim::detail::warp_collective(cudasim::detail::warp_op::syncwarp, mask, 0, 0, 0, warpSize, file, line);
}
inline unsigned __activemask() noexcept {
  return cudasim::detail::active_mask();
}

template <class T>
T __shfl_sync(unsigned mask, T var, int src_lane, int width = warpSize, const char* file = __builtin_FILE(),
              int line = __builtin_LINE()) noexcept {
  return cudasim::detail::exchange(cudasim::detail::warp_op::shfl, mask, var, src_lane, width, file, line);
}
template <class T>
T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                 int line = __builtin_LINE()) noexcept {
  return cudasim::detail::exchange(cudasim::detail::warp_op::shfl_up, mask, var, static_cast<int>(delta), width, file,
                                   line);
}
template <class T>
T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = warpSize, const char* file = __builtin_FILE(),
                   int line = __builtin_LINE()) noexcept {
  return cudasim::detail::exchange(cudasim::detail::warp_op::shfl_down, mask, var, static_cast<int>(delta), width, file,
                                   line);
}
template <class T>
T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = warpSize, const char* file = __builtin_FILE(),
                  int line = __builtin_LINE()) noexcept {
  return cudasim::detail::exchange(cudasim::detail::warp_op::shfl_xor, mask, var, lane_mask, width, file, line);
}
inline unsigned __ballot_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                              int line = __builtin_LINE()) noexcept {
  return static_cast<unsigned>(cudasim::detail::warp_collective(cudasim::detail::warp_op::ballot, mask,
                                                                predicate != 0 ? 1u : 0u, 4, 0, warpSize, file, line)
                                   .value);
}
inline int __any_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) noexcept {
  return cudasim::detail::warp_collective(cudasim::detail::warp_op::any, mask, predicate != 0 ? 1u : 0u, 4, 0, warpSize,
                                          file, line)
      .predicate;
}
inline int __all_sync(unsigned mask, int predicate, const char* file = __builtin_FILE(),
                      int line = __builtin_LINE()) noexcept {
  return cudasim::detail::warp_collective(cudasim::detail::warp_op::all, mask, predicate != 0 ? 1u : 0u, 4, 0, warpSize,
                                          file, line)
      .predicate;
}
template <class T>
unsigned __match_any_sync(unsigned mask, T value, const char* file = __builtin_FILE(),
                          int line = __builtin_LINE()) noexcept {
  static_assert(std::is_integral<T>::value || std::is_floating_point<T>::value, "__match_any_sync takes a number");
  return static_cast<unsigned>(cudasim::detail::warp_collective(cudasim::detail::warp_op::match_any, mask,
                                                                cudasim::detail::to_bits(value),
                                                                static_cast<int>(sizeof(T)), 0, warpSize, file, line)
                                   .value);
}
template <class T>
unsigned __match_all_sync(unsigned mask, T value, int* pred, const char* file = __builtin_FILE(),
                          int line = __builtin_LINE()) noexcept {
  static_assert(std::is_integral<T>::value || std::is_floating_point<T>::value, "__match_all_sync takes a number");
  const auto r =
      cudasim::detail::warp_collective(cudasim::detail::warp_op::match_all, mask, cudasim::detail::to_bits(value),
                                       static_cast<int>(sizeof(T)), 0, warpSize, file, line);
  *pred = r.predicate;
  return static_cast<unsigned>(r.value);
}

#define CUDA_SIM_REDUCE(name, op, T)                                                                                 \
  inline T name(unsigned mask, T value, const char* file = __builtin_FILE(), int line = __builtin_LINE()) noexcept { \
    return cudasim::detail::exchange(cudasim::detail::warp_op::op, mask, value, 0, warpSize, file, line);            \
  }
CUDA_SIM_REDUCE(__reduce_add_sync, reduce_add, unsigned)
CUDA_SIM_REDUCE(__reduce_add_sync, reduce_add, int)
CUDA_SIM_REDUCE(__reduce_min_sync, reduce_min_unsigned, unsigned)
CUDA_SIM_REDUCE(__reduce_min_sync, reduce_min_signed, int)
CUDA_SIM_REDUCE(__reduce_max_sync, reduce_max_unsigned, unsigned)
CUDA_SIM_REDUCE(__reduce_max_sync, reduce_max_signed, int)
CUDA_SIM_REDUCE(__reduce_and_sync, reduce_and, unsigned)
CUDA_SIM_REDUCE(__reduce_or_sync, reduce_or, unsigned)
CUDA_SIM_REDUCE(__reduce_xor_sync, reduce_xor, unsigned)
#undef CUDA_SIM_REDUCE

// ---- tensor cores ----------------------------------------------------------------------
// CUDA C++ has no intrinsic for the warp-level MMA; kernels issue the PTX instruction
// `mma.sync.aligned.m16n8k16.row.col.f32.{bf16,f16}.{bf16,f16}.f32`, which a host compiler
// cannot run. Kernels built for the simulator call this function in its place (kvevict keeps
// the instruction behind one device function, kvevict/cuda/detail/mma.cuh). It is a warp
// collective of all 32 lanes, with PTX's fragment layouts (g = lane / 4, t = lane % 4):
//   a[0] = A[g][2t, 2t+1]    a[1] = A[g+8][2t, 2t+1]   a[2] = A[g][2t+8, 2t+9]   a[3] = A[g+8][2t+8, 2t+9]
//   b[0] = B[2t, 2t+1][g]    b[1] = B[2t+8, 2t+9][g]                (low 16 bits: the lower index)
//   d[0] = D[g][2t]  d[1] = D[g][2t+1]  d[2] = D[g+8][2t]  d[3] = D[g+8][2t+1]
// D = A (16x16) * B (16x8) + D. Products of 16-bit operands are exact in float32; the
// simulator adds them to D in ascending k in float32. The hardware's adder tree rounds the
// sum differently (not specified by NVIDIA), so results agree with a GPU to float32 rounding
// of the sum, not bit for bit.
namespace cudasim {
enum class mma_operands : int { bf16, f16 };
void mma_m16n8k16(mma_operands type, float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
                  const char* file = __builtin_FILE(), int line = __builtin_LINE()) noexcept;
}  // namespace cudasim

// ---- atomics ---------------------------------------------------------------------------
// CUDA's atomics are relaxed: they never race with each other and order nothing else, which
// is what relaxed compiler atomics tell ThreadSanitizer. Only one simulated thread runs at a
// time, so the read-modify-write itself cannot tear.
#define CUDA_SIM_ATOMIC(name, builtin, T)             \
  inline T name(T* address, T value) noexcept {       \
    return builtin(address, value, __ATOMIC_RELAXED); \
  }
#define CUDA_SIM_ATOMIC_INTEGERS(name, builtin) \
  CUDA_SIM_ATOMIC(name, builtin, int)           \
  CUDA_SIM_ATOMIC(name, builtin, unsigned)      \
  CUDA_SIM_ATOMIC(name, builtin, unsigned long long)
CUDA_SIM_ATOMIC_INTEGERS(atomicAdd, __atomic_fetch_add)
CUDA_SIM_ATOMIC_INTEGERS(atomicAnd, __atomic_fetch_and)
CUDA_SIM_ATOMIC_INTEGERS(atomicOr, __atomic_fetch_or)
CUDA_SIM_ATOMIC_INTEGERS(atomicXor, __atomic_fetch_xor)
CUDA_SIM_ATOMIC_INTEGERS(atomicExch, __atomic_exchange_n)
CUDA_SIM_ATOMIC(atomicSub, __atomic_fetch_sub, int)
CUDA_SIM_ATOMIC(atomicSub, __atomic_fetch_sub, unsigned)
#undef CUDA_SIM_ATOMIC_INTEGERS
#undef CUDA_SIM_ATOMIC

template <class T>
T cudasim_atomic_update(T* address, T (*update)(T, T), T value) noexcept {
  T old = __atomic_load_n(address, __ATOMIC_RELAXED);
  while (!__atomic_compare_exchange_n(address, &old, update(old, value), false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
  }
  return old;
}
#define CUDA_SIM_ATOMIC_MINMAX(T)                                \
  inline T atomicMin(T* address, T value) noexcept {             \
    return cudasim_atomic_update<T>(                             \
        address, [](T a, T b) { return b < a ? b : a; }, value); \
  }                                                              \
  inline T atomicMax(T* address, T value) noexcept {             \
    return cudasim_atomic_update<T>(                             \
        address, [](T a, T b) { return b > a ? b : a; }, value); \
  }
CUDA_SIM_ATOMIC_MINMAX(int)
CUDA_SIM_ATOMIC_MINMAX(unsigned)
CUDA_SIM_ATOMIC_MINMAX(long long)
CUDA_SIM_ATOMIC_MINMAX(unsigned long long)
#undef CUDA_SIM_ATOMIC_MINMAX

template <class T, class Bits>
T cudasim_atomic_add_float(T* address, T value) noexcept {
  static_assert(sizeof(T) == sizeof(Bits), "bit pattern of the same width");
  Bits* bits = reinterpret_cast<Bits*>(address);
  Bits old = __atomic_load_n(bits, __ATOMIC_RELAXED);
  for (;;) {
    T current;
    std::memcpy(&current, &old, sizeof(T));
    const T next = current + value;
    Bits next_bits;
    std::memcpy(&next_bits, &next, sizeof(T));
    if (__atomic_compare_exchange_n(bits, &old, next_bits, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) return current;
  }
}
inline float atomicAdd(float* address, float value) noexcept {
  return cudasim_atomic_add_float<float, std::uint32_t>(address, value);
}
inline double atomicAdd(double* address, double value) noexcept {
  return cudasim_atomic_add_float<double, std::uint64_t>(address, value);
}
inline int atomicCAS(int* address, int compare, int value) noexcept {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
inline unsigned atomicCAS(unsigned* address, unsigned compare, unsigned value) noexcept {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
inline unsigned long long atomicCAS(unsigned long long* address, unsigned long long compare,
                                    unsigned long long value) noexcept {
  __atomic_compare_exchange_n(address, &compare, value, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
  return compare;
}
inline unsigned atomicInc(unsigned* address, unsigned limit) noexcept {
  return cudasim_atomic_update<unsigned>(
      address, [](unsigned old, unsigned lim) { return old >= lim ? 0u : old + 1u; }, limit);
}
inline unsigned atomicDec(unsigned* address, unsigned limit) noexcept {
  return cudasim_atomic_update<unsigned>(
      address, [](unsigned old, unsigned lim) { return (old == 0u || old > lim) ? lim : old - 1u; }, limit);
}

// Fences order this thread's accesses for observers that also synchronise; ThreadSanitizer
// does not model stand-alone fences, so fence-only protocols may be reported as races.
inline void __threadfence() noexcept {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline void __threadfence_block() noexcept {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
inline void __threadfence_system() noexcept {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}

// ---- loads and stores with cache hints (plain accesses here) ---------------------------
// A GPU faults on an access not aligned to its size (vector types included); these check it.
// A plain dereference cannot be checked here: UBSan's alignment check covers scalar loads and
// member accesses, not whole-struct copies through a misaligned pointer.
namespace cudasim {
namespace detail {
[[noreturn]] void misaligned(const void* p, std::size_t align, const char* what, const char* file, int line) noexcept;
template <class T>
inline void check_aligned(const T* p, const char* what, const char* file, int line) noexcept {
  if (reinterpret_cast<std::uintptr_t>(p) % alignof(T) != 0) misaligned(p, alignof(T), what, file, line);
}
}  // namespace detail
}  // namespace cudasim

#define CUDA_SIM_LOAD(name)                                                                       \
  template <class T>                                                                              \
  T name(const T* p, const char* file = __builtin_FILE(), int line = __builtin_LINE()) noexcept { \
    cudasim::detail::check_aligned(p, #name, file, line);                                         \
    return *p;                                                                                    \
  }
#define CUDA_SIM_STORE(name)                                                                        \
  template <class T>                                                                                \
  void name(T* p, T v, const char* file = __builtin_FILE(), int line = __builtin_LINE()) noexcept { \
    cudasim::detail::check_aligned(p, #name, file, line);                                           \
    *p = v;                                                                                         \
  }
CUDA_SIM_LOAD(__ldg)
CUDA_SIM_LOAD(__ldcg)
CUDA_SIM_LOAD(__ldcs)
CUDA_SIM_LOAD(__ldlu)
CUDA_SIM_LOAD(__ldcv)
CUDA_SIM_STORE(__stcg)
CUDA_SIM_STORE(__stcs)
CUDA_SIM_STORE(__stwb)
CUDA_SIM_STORE(__stwt)
#undef CUDA_SIM_LOAD
#undef CUDA_SIM_STORE

// ---- integer and bit intrinsics --------------------------------------------------------
inline int __ffs(int x) noexcept {
  return __builtin_ffs(x);
}
inline int __ffsll(long long x) noexcept {
  return __builtin_ffsll(x);
}
inline int __popc(unsigned x) noexcept {
  return __builtin_popcount(x);
}
inline int __popcll(unsigned long long x) noexcept {
  return __builtin_popcountll(x);
}
inline int __clz(int x) noexcept {
  return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x));
}
inline int __clzll(long long x) noexcept {
  return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x));
}
inline unsigned __brev(unsigned x) noexcept {
  unsigned r = 0;
  for (int i = 0; i < 32; ++i) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline unsigned __umulhi(unsigned a, unsigned b) noexcept {
  return static_cast<unsigned>((static_cast<unsigned long long>(a) * b) >> 32);
}
inline long long clock64() noexcept {
  return static_cast<long long>(std::clock());
}
inline void __nanosleep(unsigned) noexcept {}
#define __trap() ::cudasim::detail::device_trap(__FILE__, __LINE__)

// ---- float intrinsics: IEEE results (no fast-math approximations, no flush to zero) ----
inline float __int_as_float(int x) noexcept {
  return cudasim::detail::from_bits<float>(static_cast<unsigned>(x));
}
inline int __float_as_int(float x) noexcept {
  return static_cast<int>(cudasim::detail::to_bits(x));
}
inline float __uint_as_float(unsigned x) noexcept {
  return cudasim::detail::from_bits<float>(x);
}
inline unsigned __float_as_uint(float x) noexcept {
  return static_cast<unsigned>(cudasim::detail::to_bits(x));
}
inline float __fadd_rn(float a, float b) noexcept {
  const volatile float r = a + b;  // a separate rounding: never contracted with a neighbouring multiply
  return r;
}
inline float __fmul_rn(float a, float b) noexcept {
  const volatile float r = a * b;
  return r;
}
inline double __dadd_rn(double a, double b) noexcept {
  const volatile double r = a + b;  // as __fadd_rn: one rounding per operation, never fused
  return r;
}
inline double __dsub_rn(double a, double b) noexcept {
  const volatile double r = a - b;
  return r;
}
inline double __dmul_rn(double a, double b) noexcept {
  const volatile double r = a * b;
  return r;
}
inline double __fma_rn(double a, double b, double c) noexcept {
  return std::fma(a, b, c);  // one rounding, as the instruction
}
inline float __frcp_rn(float x) noexcept {
  return 1.0f / x;  // IEEE division: correctly rounded, as the instruction
}
inline float __fmaf_rn(float a, float b, float c) noexcept {
  return std::fma(a, b, c);
}
inline float __fdividef(float a, float b) noexcept {
  return a / b;
}
inline float __expf(float x) noexcept {
  return std::exp(x);
}
inline float __logf(float x) noexcept {
  return std::log(x);
}
inline float __powf(float x, float y) noexcept {
  return std::pow(x, y);
}
inline float __saturatef(float x) noexcept {
  return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : (x == x ? x : 0.0f));
}
inline float rsqrtf(float x) noexcept {
  return 1.0f / std::sqrt(x);
}

// ---- shared memory ---------------------------------------------------------------------
// `site` identifies the declaration: every thread of a block that reaches it gets the same
// storage, allocated for that block alone, exactly sized and filled with 0xff.
#define CUDA_SIM_SHARED(T, name)             \
  static const char name##_cudasim_site = 0; \
  T& name = *static_cast<T*>(::cudasim::detail::static_shared(&name##_cudasim_site, sizeof(T), alignof(T), #name))
#define CUDA_SIM_SHARED_ARRAY(T, name, count)                     \
  static const char name##_cudasim_site = 0;                      \
  using name##_cudasim_type = T[count];                           \
  name##_cudasim_type& name = *static_cast<name##_cudasim_type*>( \
      ::cudasim::detail::static_shared(&name##_cudasim_site, sizeof(name##_cudasim_type), alignof(T), #name))
#define CUDA_SIM_DYNAMIC_SHARED(T, name) \
  T* const name = static_cast<T*>(::cudasim::detail::dynamic_shared(alignof(T), #name))
