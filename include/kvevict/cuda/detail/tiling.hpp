// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_TILING_HPP
#define KVEVICT_CUDA_DETAIL_TILING_HPP

// Tile ranges, grid sizes, 32-bit limits and vector-load eligibility of the CUDA kernels, in
// host+device functions so the CPU test binary checks them (coverage without gaps or
// overlap, grid limits, overflow boundaries). Includes no CUDA header.

#include <cstdint>

#include "kvevict/config.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Largest grid.x and grid.y/z CUDA accepts.
constexpr std::int64_t max_grid_x = 2147483647;
constexpr std::int64_t max_grid_yz = 65535;

/// Kernels index tokens, rows and in-tile offsets with 32-bit ints. A size "fits" when every
/// index a kernel forms from it, including one tile past the end, stays below 2^31.
constexpr std::int64_t int32_limit = 2147483647;

KVEVICT_HOST_DEVICE constexpr std::int64_t ceil_div(std::int64_t a, std::int64_t b) noexcept {
  return (a + b - 1) / b;
}

/// Tiles of `tile` elements covering [0, n).
KVEVICT_HOST_DEVICE constexpr std::int64_t num_tiles(std::int64_t n, std::int64_t tile) noexcept {
  return n <= 0 ? 0 : ceil_div(n, tile);
}

/// [begin, end) of tile `t` of [0, n): tiles are disjoint, ascending, cover [0, n) exactly;
/// only the last one may be short.
struct index_range {
  std::int64_t begin = 0;
  std::int64_t end = 0;
  KVEVICT_HOST_DEVICE constexpr std::int64_t size() const noexcept { return end - begin; }
};

KVEVICT_HOST_DEVICE constexpr index_range tile_range(std::int64_t t, std::int64_t tile, std::int64_t n) noexcept {
  const std::int64_t b = t * tile;
  const std::int64_t e = b + tile < n ? b + tile : n;
  return {b < n ? b : n, e};
}

/// Whether n elements, padded up to a whole tile, index below 2^31.
KVEVICT_HOST_DEVICE constexpr bool fits_int32(std::int64_t n, std::int64_t tile = 1) noexcept {
  return n >= 0 && n <= int32_limit - tile;
}

/// Whether a grid of (x, y) blocks is launchable.
KVEVICT_HOST_DEVICE constexpr bool grid_fits(std::int64_t x, std::int64_t y) noexcept {
  return x >= 0 && x <= max_grid_x && y >= 1 && y <= max_grid_yz;
}

/// Window of inputs a pooled output tile reads: keys [j0 - radius, j1 + radius) clipped to
/// [0, n). The finalize kernel stages this window (the tile plus its halo) in shared memory.
KVEVICT_HOST_DEVICE constexpr index_range halo_range(index_range tile, std::int64_t radius, std::int64_t n) noexcept {
  const std::int64_t b = tile.begin - radius;
  const std::int64_t e = tile.end + radius;
  return {b < 0 ? 0 : b, e > n ? n : e};
}

/// Vector width (elements per load of `load_bytes`, 16 by default) usable for the rows of a
/// view: the rows must be contiguous (dim_stride 1), hold whole loads, and every row start be
/// aligned to the load, which holds when the base address and every stride a row start is built
/// from are multiples of `load_bytes`. Returns 1 (scalar loads) otherwise. (The decode kernel
/// loads fp8 keys 8 bytes at a time: rows of d % 16 == 8 take them too.)
KVEVICT_HOST_DEVICE constexpr std::int64_t vector_width(std::uintptr_t base, std::int64_t element_bytes,
                                                        std::int64_t head_dim, std::int64_t dim_stride,
                                                        std::int64_t head_stride, std::int64_t token_stride,
                                                        std::int64_t block_stride,
                                                        std::int64_t load_bytes = 16) noexcept {
  if (element_bytes <= 0 || load_bytes <= 0 || load_bytes % element_bytes != 0 || dim_stride != 1) return 1;
  const std::int64_t v = load_bytes / element_bytes;
  const bool aligned = base % static_cast<std::uintptr_t>(load_bytes) == 0 && head_dim % v == 0 &&
                       head_stride % v == 0 && token_stride % v == 0 && block_stride % v == 0;
  return aligned ? v : 1;
}

/// Blocks for a grid-stride loop over n items: enough to fill the device a few times over,
/// never more than the items need, never zero.
KVEVICT_HOST_DEVICE constexpr std::int64_t stride_grid(std::int64_t n, std::int64_t per_block,
                                                       std::int64_t cap = 65535) noexcept {
  const std::int64_t need = n <= 0 ? 1 : ceil_div(n, per_block);
  return need < cap ? need : cap;
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_TILING_HPP
