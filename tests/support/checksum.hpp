// FNV-1a checksums of test buffers: "nothing was written" checks in the bad-input tests,
// the fuzzers and the concurrency test. Catch2-free, so the fuzzers can include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

namespace test {

constexpr std::uint64_t fnv_seed = 1469598103934665603ull;

inline std::uint64_t fnv(std::uint64_t x, const void* data, std::size_t bytes) {
  const auto* p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < bytes; ++i) {
    x ^= p[i];
    x *= 1099511628211ull;
  }
  return x;
}

/// The bytes of a vector's elements (not its size).
template <class T>
std::uint64_t fnv(std::uint64_t x, const std::vector<T>& v) {
  return fnv(x, v.data(), v.size() * sizeof(T));
}

}  // namespace test
