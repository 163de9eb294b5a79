// The memory-access hooks of the interleaving schedule (interleave.hpp), and its settings.
//
// With CUDA_SIM_INTERLEAVE_HOOKS this file defines the entry points that the compiler's
// ThreadSanitizer instrumentation calls (__tsan_read4, __tsan_atomic32_fetch_add, ...), in
// place of the TSan runtime, which is then not linked: a build has either these hooks or
// TSan, never both. The file itself is compiled without instrumentation.
#include "interleave.hpp"

#include <cstdint>
#include <cstdlib>
#include <cstring>

namespace cudasim {
namespace detail {

namespace {

constexpr unsigned kRecentReads = 4;

/// The running simulated thread's view of the hooks (one per host thread: one simulated
/// thread runs at a time on it).
struct access_window {
  bool armed = false;
  unsigned countdown = 0;  // accesses until the next random switch
  unsigned reads = 0;
  std::uintptr_t recent[kRecentReads] = {};  // addresses read since the thread last ran
  std::uintptr_t stack_lo = 0, stack_hi = 0;
  interleave_schedule* schedule = nullptr;
};

thread_local access_window tls_window;

unsigned parse_unsigned(const char* name, unsigned fallback, unsigned lo, unsigned hi) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  char* end = nullptr;
  const unsigned long x = std::strtoul(v, &end, 10);
  if (*end != '\0' || x < lo || x > hi) return fallback;
  return static_cast<unsigned>(x);
}

interleave_settings read_settings() noexcept {
  interleave_settings s;
  s.enabled = interleave_hooks_linked() && parse_unsigned("CUDA_SIM_INTERLEAVE", 1, 0, 1) == 1;
  const char* seed = std::getenv("CUDA_SIM_SEED");
  if (seed != nullptr && *seed != '\0') s.seed = std::strtoull(seed, nullptr, 10);
  s.resident = parse_unsigned("CUDA_SIM_RESIDENT_BLOCKS", 4, 1, 4);
  return s;
}

#if defined(CUDA_SIM_INTERLEAVE_HOOKS)  // what the hooks below call
inline bool private_address(const access_window& w, const void* p) noexcept {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  return a >= w.stack_lo && a < w.stack_hi;
}

inline void count_access(access_window& w) noexcept {
  if (--w.countdown == 0) preempt_current();  // interleave_arm draws the next gap on resume
}

inline void on_read(const void* p) noexcept {
  access_window& w = tls_window;
  if (!w.armed || private_address(w, p)) return;
  w.recent[w.reads++ % kRecentReads] = reinterpret_cast<std::uintptr_t>(p);
  count_access(w);
}

inline void on_write(const void* p) noexcept {
  access_window& w = tls_window;
  if (!w.armed || private_address(w, p)) return;
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  const unsigned n = w.reads < kRecentReads ? w.reads : kRecentReads;
  for (unsigned i = 0; i < n; ++i) {
    if (w.recent[i] == a) {
      preempt_current();  // between the load and the store of a read-modify-write
      return;
    }
  }
  count_access(w);
}

inline void on_atomic() noexcept {
  access_window& w = tls_window;
  if (w.armed) count_access(w);
}

#endif

}  // namespace

const interleave_settings& interleave_config() noexcept {
  static const interleave_settings settings = read_settings();
  return settings;
}

bool interleave_hooks_linked() noexcept {
#if defined(CUDA_SIM_INTERLEAVE_HOOKS)
  return true;
#else
  return false;
#endif
}

void interleave_arm(const void* stack_lo, std::size_t stack_bytes, interleave_schedule* schedule) noexcept {
  access_window& w = tls_window;
  w.armed = true;
  w.reads = 0;
  w.stack_lo = reinterpret_cast<std::uintptr_t>(stack_lo);
  w.stack_hi = w.stack_lo + stack_bytes;
  w.schedule = schedule;
  const unsigned gap = interleave_config().mean_gap;
  w.countdown = 1 + schedule->next() % (2 * gap - 1);
}

void interleave_disarm() noexcept {
  tls_window.armed = false;
}

}  // namespace detail
}  // namespace cudasim

#if defined(CUDA_SIM_INTERLEAVE_HOOKS)
// The instrumentation's entry points. Plain accesses go to on_read / on_write; atomics are
// performed here (the instrumentation replaces the compiler's atomic builtins with these
// calls) and are never split.
using cudasim::detail::on_atomic;
using cudasim::detail::on_read;
using cudasim::detail::on_write;

#define CUDA_SIM_ACCESS_HOOKS(n)                     \
  void __tsan_read##n(void* p) {                     \
    on_read(p);                                      \
  }                                                  \
  void __tsan_write##n(void* p) {                    \
    on_write(p);                                     \
  }                                                  \
  void __tsan_unaligned_read##n(void* p) {           \
    on_read(p);                                      \
  }                                                  \
  void __tsan_unaligned_write##n(void* p) {          \
    on_write(p);                                     \
  }                                                  \
  void __tsan_volatile_read##n(void* p) {            \
    on_read(p);                                      \
  }                                                  \
  void __tsan_volatile_write##n(void* p) {           \
    on_write(p);                                     \
  }                                                  \
  void __tsan_unaligned_volatile_read##n(void* p) {  \
    on_read(p);                                      \
  }                                                  \
  void __tsan_unaligned_volatile_write##n(void* p) { \
    on_write(p);                                     \
  }

#define CUDA_SIM_ATOMIC_HOOKS(n, T)                                                                \
  T __tsan_atomic##n##_load(const volatile T* a, int) {                                            \
    on_atomic();                                                                                   \
    return __atomic_load_n(a, __ATOMIC_SEQ_CST);                                                   \
  }                                                                                                \
  void __tsan_atomic##n##_store(volatile T* a, T v, int) {                                         \
    on_atomic();                                                                                   \
    __atomic_store_n(a, v, __ATOMIC_SEQ_CST);                                                      \
  }                                                                                                \
  T __tsan_atomic##n##_exchange(volatile T* a, T v, int) {                                         \
    on_atomic();                                                                                   \
    return __atomic_exchange_n(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                                \
  T __tsan_atomic##n##_fetch_add(volatile T* a, T v, int) {                                        \
    on_atomic();                                                                                   \
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  T __tsan_atomic##n##_fetch_sub(volatile T* a, T v, int) {                                        \
    on_atomic();                                                                                   \
    return __atomic_fetch_sub(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  T __tsan_atomic##n##_fetch_and(volatile T* a, T v, int) {                                        \
    on_atomic();                                                                                   \
    return __atomic_fetch_and(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  T __tsan_atomic##n##_fetch_or(volatile T* a, T v, int) {                                         \
    on_atomic();                                                                                   \
    return __atomic_fetch_or(a, v, __ATOMIC_SEQ_CST);                                              \
  }                                                                                                \
  T __tsan_atomic##n##_fetch_xor(volatile T* a, T v, int) {                                        \
    on_atomic();                                                                                   \
    return __atomic_fetch_xor(a, v, __ATOMIC_SEQ_CST);                                             \
  }                                                                                                \
  T __tsan_atomic##n##_fetch_nand(volatile T* a, T v, int) {                                       \
    on_atomic();                                                                                   \
    return __atomic_fetch_nand(a, v, __ATOMIC_SEQ_CST);                                            \
  }                                                                                                \
  int __tsan_atomic##n##_compare_exchange_strong(volatile T* a, T* expected, T v, int, int) {      \
    on_atomic();                                                                                   \
    return __atomic_compare_exchange_n(a, expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                                \
  int __tsan_atomic##n##_compare_exchange_weak(volatile T* a, T* expected, T v, int, int) {        \
    on_atomic();                                                                                   \
    return __atomic_compare_exchange_n(a, expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST); \
  }                                                                                                \
  T __tsan_atomic##n##_compare_exchange_val(volatile T* a, T expected, T v, int, int) {            \
    on_atomic();                                                                                   \
    __atomic_compare_exchange_n(a, &expected, v, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);       \
    return expected;                                                                               \
  }

extern "C" {
void __tsan_init() {}
void __tsan_func_entry(void*) {}
void __tsan_func_exit() {}
void __tsan_vptr_update(void** p, void*) {
  on_write(p);
}
void __tsan_vptr_read(void** p) {
  on_read(p);
}
void __tsan_read_range(void* p, unsigned long) {
  on_read(p);
}
void __tsan_write_range(void* p, unsigned long) {
  on_write(p);
}
CUDA_SIM_ACCESS_HOOKS(1)
CUDA_SIM_ACCESS_HOOKS(2)
CUDA_SIM_ACCESS_HOOKS(4)
CUDA_SIM_ACCESS_HOOKS(8)
CUDA_SIM_ACCESS_HOOKS(16)
CUDA_SIM_ATOMIC_HOOKS(8, char)
CUDA_SIM_ATOMIC_HOOKS(16, short)
CUDA_SIM_ATOMIC_HOOKS(32, int)
CUDA_SIM_ATOMIC_HOOKS(64, long)
void __tsan_atomic_thread_fence(int) {
  __atomic_thread_fence(__ATOMIC_SEQ_CST);
}
void __tsan_atomic_signal_fence(int) {
  __atomic_signal_fence(__ATOMIC_SEQ_CST);
}
}
#endif
