// A layer's paged pool shared by several sequences, for the GPU tests of batched calls
// (test_gpu.cpp, test_gpu_compressor.cpp).
#pragma once

#include <cstdint>
#include <vector>

#include "gpu_runner.hpp"
#include "support/test_cache.hpp"

namespace gpu {

/// A layer's paged pool shared by several sequences: sequence s owns the table entries
/// [first[s], first[s] + ceil(L_s / 16)), so its token j is the pool's token 16 * first[s] + j.
template <class T>
struct shared_pool {
  test::test_cache<T> pool;
  std::vector<std::int64_t> first;

  shared_pool(test::layout lay, std::int64_t heads, const std::vector<std::int64_t>& lengths, std::int64_t dim,
              std::uint64_t seed) {
    std::int64_t blocks = 0;
    for (std::int64_t l : lengths) {
      first.push_back(blocks);
      blocks += (l + 15) / 16;
    }
    pool = test::make_cache<T>(lay, heads, blocks * 16, dim,
                               test::normal(static_cast<std::size_t>(heads * blocks * 16 * dim), seed), 16, seed + 1);
  }
  gpu::side<T> side(std::size_t s, std::int64_t tokens) {
    gpu::side<T> out{pool.view, gpu::buffer_of(pool.buffer), &pool.table};
    out.view.num_tokens = tokens;
    out.view.block_table = pool.table.data() + first[s];
    return out;
  }
  /// The pool after compacting sequence s by (offsets, indices), applied to `buf`.
  void apply(std::vector<T>* buf, std::size_t s, const std::vector<std::int64_t>& offsets,
             const std::vector<std::int64_t>& indices) const {
    const std::int64_t base = 16 * first[s];
    for (std::int64_t h = 0; h < pool.heads; ++h)
      for (std::int64_t i = 0; i < offsets[static_cast<std::size_t>(h + 1)] - offsets[static_cast<std::size_t>(h)]; ++i)
        for (std::int64_t c = 0; c < pool.dim; ++c) {
          const std::int64_t src = indices[static_cast<std::size_t>(offsets[static_cast<std::size_t>(h)] + i)];
          (*buf)[static_cast<std::size_t>(pool.offset(h, base + i, c))] =
              pool.buffer[static_cast<std::size_t>(pool.offset(h, base + src, c))];
        }
  }
};

}  // namespace gpu
