// Eviction test support: host keep-lists, random keep-lists, checksums, and the expected
// state of a raw buffer after compaction, computed from explicit offset functions (never
// through the library's views).
#pragma once

#include <catch2/catch.hpp>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <random>
#include <vector>

#include "kvevict/selection/keep_list.hpp"

namespace test {

/// A keep-list the test owns.
struct host_keep {
  std::vector<std::int64_t> offsets{0};
  std::vector<std::int64_t> indices;

  void add_head(const std::vector<std::int64_t>& kept) {
    indices.insert(indices.end(), kept.begin(), kept.end());
    offsets.push_back(static_cast<std::int64_t>(indices.size()));
  }
  std::int64_t heads() const { return static_cast<std::int64_t>(offsets.size()) - 1; }
  std::int64_t size(std::int64_t h) const {
    return offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)];
  }
  std::int64_t at(std::int64_t h, std::int64_t i) const {
    return indices[static_cast<std::size_t>(offsets[static_cast<std::size_t>(h)] + i)];
  }
  std::int64_t max_size() const {
    std::int64_t m = 0;
    for (std::int64_t h = 0; h < heads(); ++h) m = std::max(m, size(h));
    return m;
  }
  kvevict::const_keep_list_view view() const {
    return {heads(), offsets.data(), indices.empty() ? nullptr : indices.data(),
            static_cast<std::int64_t>(indices.size())};
  }
};

/// Random ascending subsets of [0, tokens): some heads empty, some full, the rest random
/// densities (so per-head lengths differ).
inline host_keep random_keep(std::int64_t heads, std::int64_t tokens, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  host_keep k;
  for (std::int64_t h = 0; h < heads; ++h) {
    const std::uint64_t kind = rng() % 6;
    std::vector<std::int64_t> kept;
    const double density = kind < 2 ? (kind == 0 ? 0.0 : 1.0) : std::uniform_real_distribution<double>(0.05, 0.95)(rng);
    for (std::int64_t j = 0; j < tokens; ++j)
      if (std::uniform_real_distribution<double>(0.0, 1.0)(rng) < density) kept.push_back(j);
    k.add_head(kept);
  }
  return k;
}

/// The same indices for every head (a uniform budget selected head-independently).
inline host_keep uniform_keep(std::int64_t heads, const std::vector<std::int64_t>& kept) {
  host_keep k;
  for (std::int64_t h = 0; h < heads; ++h) k.add_head(kept);
  return k;
}

/// FNV-1a over raw bytes.
template <class T>
std::uint64_t checksum(const std::vector<T>& v) {
  std::uint64_t x = 1469598103934665603ull;
  const unsigned char* p = reinterpret_cast<const unsigned char*>(v.data());
  for (std::size_t i = 0; i < v.size() * sizeof(T); ++i) {
    x ^= p[i];
    x *= 1099511628211ull;
  }
  return x;
}

/// The buffer after compacting head h of one cache: `offset(h, j, c)` gives an element's
/// index in the buffer; row i takes row keep[h][i]'s old contents, everything else stays.
template <class T, class Offset>
void apply_expected(std::vector<T>& expected, const std::vector<T>& before, const host_keep& keep, std::int64_t dim,
                    Offset offset) {
  const std::int64_t n = static_cast<std::int64_t>(before.size());
  for (std::int64_t h = 0; h < keep.heads(); ++h)
    for (std::int64_t i = 0; i < keep.size(h); ++i)
      for (std::int64_t c = 0; c < dim; ++c) {
        const std::int64_t to = offset(h, i, c), from = offset(h, keep.at(h, i), c);
        if (to < 0 || from < 0 || to >= n || from >= n || static_cast<std::int64_t>(expected.size()) != n)
          FAIL("offset outside the buffer");
        expected[static_cast<std::size_t>(to)] = before[static_cast<std::size_t>(from)];
      }
}

/// Bitwise equality of two buffers, reporting the first differing element.
template <class T>
void require_same_bits(const std::vector<T>& got, const std::vector<T>& want) {
  REQUIRE(got.size() == want.size());
  if (std::memcmp(got.data(), want.data(), got.size() * sizeof(T)) == 0) return;
  for (std::size_t i = 0; i < got.size(); ++i) {
    if (std::memcmp(&got[i], &want[i], sizeof(T)) != 0) {
      INFO("first differing element at buffer index " << i);
      REQUIRE(false);
    }
  }
}

}  // namespace test
