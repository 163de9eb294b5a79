// Test caches: dense [H][L][d] data laid out in every engine layout by explicit offset
// formulas (not through the library's view code), with the matching library view.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvevict/dtype.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/layouts.hpp"
#include "kvevict/views/query_view.hpp"

namespace test {

/// Every layout the library describes. packed_* and flashinfer_kv are the K half of a pool that
/// holds K and V together (vLLM packed K|V, FlashInfer's single tensor; the other half holds a
/// sentinel here); cells and cells_transposed are llama.cpp caches shared by several sequences
/// (the sequence's tokens in scattered cells). paged_int64 is paged_nhd with an int64 block
/// table (as PyTorch builds index tensors); every other paged layout keeps int32 tables.
enum class layout {
  contiguous,
  padded,
  token_major,
  transposed,
  paged_nhd,
  paged_hnd,
  packed_hnd,
  packed_nhd,
  flashinfer_kv,
  cells,
  cells_transposed,
  paged_per_head,
  paged_int64
};
inline const layout kAllLayouts[] = {
    layout::contiguous,       layout::padded,         layout::token_major, layout::transposed,    layout::paged_nhd,
    layout::paged_hnd,        layout::packed_hnd,     layout::packed_nhd,  layout::flashinfer_kv, layout::cells,
    layout::cells_transposed, layout::paged_per_head, layout::paged_int64};
inline std::string name(layout l) {
  switch (l) {
    case layout::contiguous:
      return "contiguous";
    case layout::padded:
      return "padded";
    case layout::token_major:
      return "token_major";
    case layout::transposed:
      return "transposed";
    case layout::paged_nhd:
      return "paged_nhd";
    case layout::paged_hnd:
      return "paged_hnd";
    case layout::packed_hnd:
      return "packed_hnd";
    case layout::packed_nhd:
      return "packed_nhd";
    case layout::flashinfer_kv:
      return "flashinfer_kv";
    case layout::cells:
      return "cells";
    case layout::cells_transposed:
      return "cells_transposed";
    case layout::paged_per_head:
      return "paged_per_head";
    case layout::paged_int64:
      return "paged_int64";
  }
  return "?";
}

/// Whether the layout's engine keeps positions in int32 (llama.cpp's llama_pos); queries and
/// key positions of such tests are int32 arrays, all others int64.
inline bool int32_positions(layout l) {
  return l == layout::token_major || l == layout::transposed || l == layout::cells || l == layout::cells_transposed;
}

/// Whether a layout is paged (a block table; one-token blocks for llama.cpp's cells).
inline bool is_paged(layout l) {
  return l != layout::contiguous && l != layout::padded && l != layout::token_major && l != layout::transposed;
}

template <class T>
inline T store(double x) {
  return kvevict::from_float<T>(static_cast<float>(x));
}
template <class T>
inline double load(T x) {
  return static_cast<double>(kvevict::to_float(x));
}
template <class T>
inline T sentinel() {
  return store<T>(-777.0);
}

/// Dense values rounded to what T can store (so the reference sees exactly the stored data).
template <class T>
std::vector<double> rounded(std::vector<double> v) {
  for (double& x : v) x = load(store<T>(x));
  return v;
}

inline std::vector<double> normal(std::size_t n, std::uint64_t seed, double scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> dist(0.0, scale);
  std::vector<double> v(n);
  for (double& x : v) x = dist(rng);
  return v;
}

template <class T>
struct test_cache {
  layout kind = layout::contiguous;
  std::int64_t heads = 0, tokens = 0, dim = 0, block_size = 0, kv_size = 0;
  std::vector<T> buffer;
  std::vector<std::int32_t> table;
  std::vector<std::int64_t> table64;  ///< paged_int64: the table the view reads (a copy of `table`)
  std::int64_t pool_blocks = 0;
  kvevict::cache_view<T> view;

  std::int64_t offset(std::int64_t h, std::int64_t j, std::int64_t c) const {
    switch (kind) {
      case layout::contiguous:
        return (h * tokens + j) * dim + c;
      case layout::padded:
        return h * (tokens + 3) * (dim + 5) + j * (dim + 5) + c;
      case layout::token_major:
        return j * (heads * dim) + h * dim + c;
      case layout::transposed:
        return (h * dim + c) * kv_size + j;
      case layout::paged_nhd:
      case layout::paged_int64: {
        const std::int64_t blk = table[static_cast<std::size_t>(j / block_size)];
        return ((blk * block_size + j % block_size) * heads + h) * dim + c;
      }
      case layout::paged_hnd: {
        const std::int64_t blk = table[static_cast<std::size_t>(j / block_size)];
        return ((blk * heads + h) * block_size + j % block_size) * dim + c;
      }
      case layout::packed_hnd: {
        const std::int64_t blk = table[static_cast<std::size_t>(j / block_size)];
        return ((blk * heads + h) * block_size + j % block_size) * (2 * dim) + c;
      }
      case layout::packed_nhd: {
        const std::int64_t blk = table[static_cast<std::size_t>(j / block_size)];
        return ((blk * block_size + j % block_size) * heads + h) * (2 * dim) + c;
      }
      case layout::flashinfer_kv: {
        const std::int64_t blk = table[static_cast<std::size_t>(j / block_size)];
        return blk * (2 * block_size * heads * dim) + ((j % block_size) * heads + h) * dim + c;
      }
      case layout::cells:
        return table[static_cast<std::size_t>(j)] * (heads * dim) + h * dim + c;
      case layout::cells_transposed:
        return (h * dim + c) * kv_size + table[static_cast<std::size_t>(j)];
      case layout::paged_per_head: {
        const std::int64_t blk = table[static_cast<std::size_t>(h * table_stride() + j / block_size)];
        return (blk * block_size + j % block_size) * dim + c;
      }
    }
    return 0;  // unreachable (every layout returns above); in bounds for GCC's -Warray-bounds
  }
  /// paged_per_head: entries between heads' tables (room for every block a head uses, plus 2).
  std::int64_t table_stride() const { return (tokens + block_size - 1) / block_size + 2; }
  /// Sets table entry i (tests that corrupt a table go through here so that int64 views see it).
  void set_table(std::size_t i, std::int32_t id) {
    table[i] = id;
    if (!table64.empty()) table64[i] = id;
  }
  T& at(std::int64_t h, std::int64_t j, std::int64_t c) { return buffer[static_cast<std::size_t>(offset(h, j, c))]; }
  T at(std::int64_t h, std::int64_t j, std::int64_t c) const {
    return buffer[static_cast<std::size_t>(offset(h, j, c))];
  }

  /// Dense [H][L][d] copy of the first `n` tokens of each head (as stored).
  std::vector<double> dense(std::int64_t n) const {
    std::vector<double> out(static_cast<std::size_t>(heads * n * dim));
    for (std::int64_t h = 0; h < heads; ++h)
      for (std::int64_t j = 0; j < n; ++j)
        for (std::int64_t c = 0; c < dim; ++c) out[static_cast<std::size_t>((h * n + j) * dim + c)] = load(at(h, j, c));
    return out;
  }
};

/// Lays dense [H][L][d] out in `kind`. Paged layouts get a shuffled block table over a pool
/// with spare blocks; all unused memory holds a sentinel.
template <class T>
test_cache<T> make_cache(layout kind, std::int64_t heads, std::int64_t tokens, std::int64_t dim,
                         const std::vector<double>& dense, std::int64_t block_size = 16, std::uint64_t seed = 7) {
  test_cache<T> c;
  c.kind = kind;
  c.heads = heads;
  c.tokens = tokens;
  c.dim = dim;
  c.block_size = block_size;
  c.kv_size = tokens + 7;
  std::size_t size = 0;
  switch (kind) {
    case layout::contiguous:
      size = static_cast<std::size_t>(heads * tokens * dim);
      break;
    case layout::padded:
      size = static_cast<std::size_t>(heads * (tokens + 3) * (dim + 5));
      break;
    case layout::token_major:
      size = static_cast<std::size_t>(tokens * heads * dim);
      break;
    case layout::transposed:
      size = static_cast<std::size_t>(heads * dim * c.kv_size);
      break;
    case layout::paged_nhd:
    case layout::paged_int64:
    case layout::paged_hnd:
    case layout::packed_hnd:
    case layout::packed_nhd:
    case layout::flashinfer_kv: {
      const std::int64_t used = (tokens + block_size - 1) / block_size;
      c.pool_blocks = used + 3;
      std::vector<std::int32_t> ids(static_cast<std::size_t>(c.pool_blocks));
      std::iota(ids.begin(), ids.end(), 0);
      std::mt19937_64 rng(seed);
      std::shuffle(ids.begin(), ids.end(), rng);
      c.table.assign(ids.begin(), ids.begin() + used);
      if (c.table.empty()) c.table.push_back(0);
      const bool both_halves =
          kind == layout::packed_hnd || kind == layout::packed_nhd || kind == layout::flashinfer_kv;
      size = static_cast<std::size_t>(c.pool_blocks * block_size * heads * dim * (both_halves ? 2 : 1));
      break;
    }
    case layout::paged_per_head: {  // every head its own table over one pool of one-head blocks
      const std::int64_t used = (tokens + block_size - 1) / block_size, stride = c.table_stride();
      c.pool_blocks = heads * used + 3;
      std::vector<std::int32_t> ids(static_cast<std::size_t>(c.pool_blocks));
      std::iota(ids.begin(), ids.end(), 0);
      std::mt19937_64 rng(seed);
      std::shuffle(ids.begin(), ids.end(), rng);
      c.table.assign(static_cast<std::size_t>(heads * stride), -1);  // unused entries: never read
      for (std::int64_t h = 0; h < heads; ++h)
        for (std::int64_t b = 0; b < used; ++b)
          c.table[static_cast<std::size_t>(h * stride + b)] = ids[static_cast<std::size_t>(h * used + b)];
      size = static_cast<std::size_t>(c.pool_blocks * block_size * dim);
      break;
    }
    case layout::cells:
    case layout::cells_transposed: {  // the sequence's tokens in scattered cells of a shared cache
      c.pool_blocks = c.kv_size;
      std::vector<std::int32_t> ids(static_cast<std::size_t>(c.kv_size));
      std::iota(ids.begin(), ids.end(), 0);
      std::mt19937_64 rng(seed);
      std::shuffle(ids.begin(), ids.end(), rng);
      c.table.assign(ids.begin(), ids.begin() + tokens);
      if (c.table.empty()) c.table.push_back(0);
      size = static_cast<std::size_t>(c.kv_size * heads * dim);
      break;
    }
  }
  c.buffer.assign(std::max<std::size_t>(size, 1), sentinel<T>());
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t j = 0; j < tokens; ++j)
      for (std::int64_t d = 0; d < dim; ++d)
        c.at(h, j, d) = store<T>(dense[static_cast<std::size_t>((h * tokens + j) * dim + d)]);
  T* p = c.buffer.data();
  switch (kind) {
    case layout::contiguous:
      c.view = kvevict::hf_contiguous(p, heads, tokens, dim);
      break;
    case layout::padded:
      c.view = kvevict::strided_cache(p, heads, tokens, dim, (tokens + 3) * (dim + 5), dim + 5, 1);
      break;
    case layout::token_major:
      c.view = kvevict::llamacpp_k(p, heads, tokens, dim);
      break;
    case layout::transposed:
      c.view = kvevict::llamacpp_v_transposed(p, c.kv_size, heads, tokens, dim);
      break;
    case layout::paged_nhd:
      c.view = kvevict::vllm_paged(p, c.pool_blocks, block_size, heads, dim, c.table.data(), tokens);
      break;
    case layout::paged_hnd:
      c.view = kvevict::flashinfer_paged_hnd(p, c.pool_blocks, block_size, heads, dim, c.table.data(), tokens);
      break;
    case layout::packed_hnd:
    case layout::packed_nhd:
      c.view =
          kvevict::vllm_packed_kv(p, c.pool_blocks, block_size, heads, dim, c.table.data(), tokens,
                                  kind == layout::packed_hnd ? kvevict::block_order::hnd : kvevict::block_order::nhd)
              .keys;
      break;
    case layout::flashinfer_kv:
      c.view = kvevict::flashinfer_paged_kv(p, c.pool_blocks, block_size, heads, dim, c.table.data(), tokens,
                                            kvevict::block_order::nhd)
                   .keys;
      break;
    case layout::cells:
      c.view = kvevict::llamacpp_cells_k(p, c.kv_size, heads, dim, c.table.data(), tokens);
      break;
    case layout::cells_transposed:
      c.view = kvevict::llamacpp_cells_v_transposed(p, c.kv_size, heads, dim, c.table.data(), tokens);
      break;
    case layout::paged_per_head:
      c.view =
          kvevict::paged_per_head(p, c.pool_blocks, block_size, heads, dim, c.table.data(), c.table_stride(), tokens);
      break;
    case layout::paged_int64:
      c.table64.assign(c.table.begin(), c.table.end());
      c.view = kvevict::vllm_paged(p, c.pool_blocks, block_size, heads, dim, c.table64.data(), tokens);
      break;
  }
  return c;
}

/// Queries [Hq][W][d] stored as T, head-major or token-major.
template <class T>
struct test_queries {
  std::vector<T> buffer;
  std::vector<std::int64_t> positions;
  std::vector<std::int32_t> positions32;  ///< the view's positions when made with int32 positions
  kvevict::query_view<T> view;
};

template <class T>
test_queries<T> make_queries(std::int64_t hq, std::int64_t w, std::int64_t d, const std::vector<double>& dense,
                             std::vector<std::int64_t> positions, bool token_major = false,
                             bool int32_positions = false) {
  test_queries<T> q;
  q.buffer.resize(static_cast<std::size_t>(hq * w * d));
  q.positions = std::move(positions);
  for (std::int64_t h = 0; h < hq; ++h)
    for (std::int64_t t = 0; t < w; ++t)
      for (std::int64_t c = 0; c < d; ++c) {
        const std::int64_t off = token_major ? (t * hq + h) * d + c : (h * w + t) * d + c;
        q.buffer[static_cast<std::size_t>(off)] = store<T>(dense[static_cast<std::size_t>((h * w + t) * d + c)]);
      }
  q.view = token_major ? kvevict::token_major_queries(q.buffer.data(), hq, w, d, q.positions.data())
                       : kvevict::contiguous_queries(q.buffer.data(), hq, w, d, q.positions.data());
  if (int32_positions) {
    for (const std::int64_t p : q.positions) q.positions32.push_back(static_cast<std::int32_t>(p));
    q.view.positions = q.positions32.data();
  }
  return q;
}

}  // namespace test
