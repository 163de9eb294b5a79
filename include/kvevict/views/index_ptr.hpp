// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_INDEX_PTR_HPP
#define KVEVICT_VIEWS_INDEX_PTR_HPP

// A read-only pointer to the engine's integer indices (positions, block tables, CSR offsets)
// in whichever width the engine keeps them: llama.cpp and TensorRT-LLM keep positions in
// int32, PyTorch-built tables are int64, vLLM's block tables are int32. It converts
// implicitly from `const std::int32_t*` and `const std::int64_t*`, so a view's field takes
// either pointer as it is, and every read widens to int64 (exact). Nothing is copied.

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN

class index_ptr {
 public:
  index_ptr() = default;
  KVEVICT_HOST_DEVICE constexpr index_ptr(std::nullptr_t) noexcept {}      // NOLINT: a null pointer
  KVEVICT_HOST_DEVICE constexpr index_ptr(const std::int32_t* p) noexcept  // NOLINT: implicit by design
      : data_(p), width_(p != nullptr ? 4 : 0) {}
  KVEVICT_HOST_DEVICE constexpr index_ptr(const std::int64_t* p) noexcept  // NOLINT: implicit by design
      : data_(p), width_(p != nullptr ? 8 : 0) {}

  /// Element i, widened.
  KVEVICT_HOST_DEVICE KVEVICT_ALWAYS_INLINE std::int64_t operator[](std::int64_t i) const noexcept {
    return width_ == 4 ? static_cast<std::int64_t>(static_cast<const std::int32_t*>(data_)[i])
                       : static_cast<const std::int64_t*>(data_)[i];
  }
  /// The indices from element n on (n may be negative within the array, as for pointers).
  KVEVICT_HOST_DEVICE index_ptr operator+(std::int64_t n) const noexcept {
    index_ptr p = *this;
    if (width_ == 4) p.data_ = static_cast<const std::int32_t*>(data_) + n;
    if (width_ == 8) p.data_ = static_cast<const std::int64_t*>(data_) + n;
    return p;
  }
  KVEVICT_HOST_DEVICE index_ptr& operator+=(std::int64_t n) noexcept { return *this = *this + n; }

  KVEVICT_HOST_DEVICE constexpr const void* data() const noexcept { return data_; }
  /// Bytes per index: 4 or 8; 0 when null.
  KVEVICT_HOST_DEVICE constexpr int width() const noexcept { return width_; }
  /// The int32 array, or null when the indices are int64 (or absent).
  KVEVICT_HOST_DEVICE const std::int32_t* int32() const noexcept {
    return width_ == 4 ? static_cast<const std::int32_t*>(data_) : nullptr;
  }
  /// The int64 array, or null when the indices are int32 (or absent).
  KVEVICT_HOST_DEVICE const std::int64_t* int64() const noexcept {
    return width_ == 8 ? static_cast<const std::int64_t*>(data_) : nullptr;
  }

  KVEVICT_HOST_DEVICE constexpr explicit operator bool() const noexcept { return data_ != nullptr; }
  KVEVICT_HOST_DEVICE friend constexpr bool operator==(index_ptr a, std::nullptr_t) noexcept {
    return a.data_ == nullptr;
  }
  KVEVICT_HOST_DEVICE friend constexpr bool operator!=(index_ptr a, std::nullptr_t) noexcept {
    return a.data_ != nullptr;
  }
  KVEVICT_HOST_DEVICE friend constexpr bool operator==(std::nullptr_t, index_ptr a) noexcept {
    return a.data_ == nullptr;
  }
  KVEVICT_HOST_DEVICE friend constexpr bool operator!=(std::nullptr_t, index_ptr a) noexcept {
    return a.data_ != nullptr;
  }
  /// Same memory and width.
  KVEVICT_HOST_DEVICE friend constexpr bool operator==(index_ptr a, index_ptr b) noexcept {
    return a.data_ == b.data_ && a.width_ == b.width_;
  }
  KVEVICT_HOST_DEVICE friend constexpr bool operator!=(index_ptr a, index_ptr b) noexcept { return !(a == b); }

 private:
  const void* data_ = nullptr;
  int width_ = 0;
};

static_assert(std::is_trivially_copyable<index_ptr>::value, "index_ptr is a value");

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_INDEX_PTR_HPP
