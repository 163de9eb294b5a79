// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_WORKSPACE_HPP
#define KVEVICT_WORKSPACE_HPP

// Scratch memory. Every call that needs scratch has a `*_workspace_size(...)` query and
// takes a `workspace_span` the caller owns; kvevict never allocates behind the caller's
// back. `workspace` is an optional owning buffer for callers that do not pool memory.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <limits>
#include <new>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Caller-owned scratch: `size` bytes at `data` (any alignment; kvevict aligns inside).
struct workspace_span {
  void* data = nullptr;
  std::size_t size = 0;
};

/// Alignment of every sub-buffer kvevict carves from a workspace.
constexpr std::size_t workspace_alignment = 64;

/// An owning, 64-byte aligned scratch buffer that grows on `reserve` (the only call that
/// allocates). Move-only.
class workspace {
 public:
  workspace() = default;
  explicit workspace(std::size_t bytes) { reserve(bytes); }
  workspace(const workspace&) = delete;
  workspace& operator=(const workspace&) = delete;
  workspace(workspace&& other) noexcept : data_(other.data_), size_(other.size_) {
    other.data_ = nullptr;
    other.size_ = 0;
  }
  workspace& operator=(workspace&& other) noexcept {
    if (this != &other) {
      release();
      data_ = other.data_;
      size_ = other.size_;
      other.data_ = nullptr;
      other.size_ = 0;
    }
    return *this;
  }
  ~workspace() { release(); }

  /// Ensures at least `bytes` of capacity. Returns false (leaving the old buffer intact)
  /// when the allocation fails.
  bool reserve(std::size_t bytes) noexcept {
    if (bytes <= size_) return true;
    if (bytes > std::numeric_limits<std::size_t>::max() - (workspace_alignment - 1)) return false;  // e.g. SIZE_MAX
    const std::size_t rounded = (bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
    void* p = ::operator new(rounded, std::align_val_t(workspace_alignment), std::nothrow);
    if (p == nullptr) return false;
    release();
    data_ = p;
    size_ = rounded;
    return true;
  }

  std::size_t size() const noexcept { return size_; }
  workspace_span span() const noexcept { return {data_, size_}; }
  operator workspace_span() const noexcept { return span(); }

 private:
  void release() noexcept {
    if (data_ != nullptr) ::operator delete(data_, std::align_val_t(workspace_alignment));
    data_ = nullptr;
    size_ = 0;
  }
  void* data_ = nullptr;
  std::size_t size_ = 0;
};

namespace detail {
/// Carves aligned sub-buffers from a workspace. Constructed without memory it only
/// measures, so size queries and the run share one carving sequence and cannot drift.
class arena {
 public:
  arena() = default;  // measuring arena
  explicit arena(workspace_span ws) noexcept
      : base_(static_cast<unsigned char*>(ws.data)), capacity_(ws.size), measuring_(false) {}

  /// Sizes saturate at SIZE_MAX instead of wrapping: a count no memory can hold makes the
  /// measured size SIZE_MAX and the carving fail (overflowed()), whatever the capacity.
  template <class T>
  T* take(std::int64_t count) noexcept {
    const std::size_t bytes = detail::saturating_mul(static_cast<std::size_t>(count < 0 ? 0 : count), sizeof(T));
    // Reserve room to align even when the base pointer is unaligned.
    std::size_t start = used_;
    if (!measuring_) {
      const std::uintptr_t addr = reinterpret_cast<std::uintptr_t>(base_) + used_;
      const std::uintptr_t aligned = (addr + workspace_alignment - 1) & ~(workspace_alignment - 1);
      start = detail::saturating_add(used_, static_cast<std::size_t>(aligned - addr));
    } else {
      start = detail::saturating_add(used_, workspace_alignment);  // worst-case padding, so measured >= needed
    }
    const std::size_t rounded = bytes > std::numeric_limits<std::size_t>::max() - (workspace_alignment - 1)
                                    ? std::numeric_limits<std::size_t>::max()
                                    : (bytes + workspace_alignment - 1) / workspace_alignment * workspace_alignment;
    const std::size_t end = detail::saturating_add(start, rounded);
    used_ = end;
    if (measuring_ || end > capacity_) {
      overflowed_ = overflowed_ || !measuring_;
      return nullptr;
    }
    return reinterpret_cast<T*>(base_ + start);
  }

  std::size_t used() const noexcept { return used_; }
  bool overflowed() const noexcept { return overflowed_; }

 private:
  unsigned char* base_ = nullptr;
  std::size_t capacity_ = 0;
  std::size_t used_ = 0;
  bool measuring_ = true;
  bool overflowed_ = false;
};

/// `bytes` carved from `a` when `present` (nothing taken otherwise, not even alignment).
inline workspace_span take_bytes(arena& a, std::size_t bytes, bool present) noexcept {
  if (!present) return {};
  const auto n = bytes > static_cast<std::size_t>(INT64_MAX) ? INT64_MAX : static_cast<std::int64_t>(bytes);
  return {a.take<unsigned char>(n), bytes};
}
}  // namespace detail

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_WORKSPACE_HPP
