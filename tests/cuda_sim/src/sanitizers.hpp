// The sanitizer runtimes' fiber, poisoning and synchronisation APIs, declared weak: a call
// happens only when that runtime is linked in, so one simulator source serves plain, ASan
// and TSan builds alike.
#pragma once

#include <cstddef>

extern "C" {
void __sanitizer_start_switch_fiber(void** fake_stack_save, const void* bottom, std::size_t size) __attribute__((weak));
void __sanitizer_finish_switch_fiber(void* fake_stack_save, const void** bottom_old, std::size_t* size_old)
    __attribute__((weak));
void __asan_poison_memory_region(void const volatile* addr, std::size_t size) __attribute__((weak));
void __asan_unpoison_memory_region(void const volatile* addr, std::size_t size) __attribute__((weak));
void* __tsan_get_current_fiber() __attribute__((weak));
void* __tsan_create_fiber(unsigned flags) __attribute__((weak));
void __tsan_destroy_fiber(void* fiber) __attribute__((weak));
void __tsan_switch_to_fiber(void* fiber, unsigned flags) __attribute__((weak));
void __tsan_set_fiber_name(void* fiber, const char* name) __attribute__((weak));
void __tsan_acquire(void* addr) __attribute__((weak));
void __tsan_release(void* addr) __attribute__((weak));
void __tsan_ignore_thread_begin() __attribute__((weak));
void __tsan_ignore_thread_end() __attribute__((weak));
}

namespace cudasim {
namespace detail {

inline bool tsan_active() noexcept {
  return __tsan_switch_to_fiber != nullptr;
}
inline bool asan_active() noexcept {
  return __asan_poison_memory_region != nullptr;
}

/// A happens-before edge from every release on `addr` to a later acquire on it.
inline void tsan_release(void* addr) noexcept {
  if (__tsan_release != nullptr) __tsan_release(addr);
}
inline void tsan_acquire(void* addr) noexcept {
  if (__tsan_acquire != nullptr) __tsan_acquire(addr);
}

/// Memory the simulator allocates or fills on behalf of the device (shared-memory arenas,
/// synchronisation words) is not an access of whichever thread or fiber happens to run the
/// allocation: inside this scope TSan resets the range instead of recording a write.
struct tsan_ignore_scope {
  tsan_ignore_scope() noexcept {
    if (__tsan_ignore_thread_begin != nullptr) __tsan_ignore_thread_begin();
  }
  ~tsan_ignore_scope() {
    if (__tsan_ignore_thread_end != nullptr) __tsan_ignore_thread_end();
  }
  tsan_ignore_scope(const tsan_ignore_scope&) = delete;
  tsan_ignore_scope& operator=(const tsan_ignore_scope&) = delete;
};

inline void asan_poison(const void* p, std::size_t n) noexcept {
  if (__asan_poison_memory_region != nullptr && n > 0) __asan_poison_memory_region(p, n);
}
inline void asan_unpoison(const void* p, std::size_t n) noexcept {
  if (__asan_unpoison_memory_region != nullptr && n > 0) __asan_unpoison_memory_region(p, n);
}

}  // namespace detail
}  // namespace cudasim
