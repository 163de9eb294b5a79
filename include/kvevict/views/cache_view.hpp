// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_CACHE_VIEW_HPP
#define KVEVICT_VIEWS_CACHE_VIEW_HPP

// A non-owning view of one layer's K (or V) cache for one sequence: element (head h,
// token j, channel c) of a [Hkv, L, d] tensor, wherever the engine keeps it.
//
//   strided:  data + h*head_stride + j*token_stride + c*dim_stride
//   paged:    data + block_table[j / block_size] * block_stride
//                  + (j % block_size)*token_stride + h*head_stride + c*dim_stride
//
// Strides are in elements, never bytes. dim_stride is 1 for every layout except a
// transposed V (llama.cpp), where tokens are contiguous and channels are kv_size apart.
// Views are trivially copyable values usable in host and device code; they never own or
// copy memory. See views/layouts.hpp for named factories of engine layouts.

#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/views/index_ptr.hpp"

KVEVICT_NAMESPACE_BEGIN

template <class T>
struct cache_view {
  static_assert(is_storage_type<T>::value || is_any_element<T>::value,
                "cache_view<T>: T must be float, fp16, bf16, fp8_e4m3 or fp8_e5m2 (maybe const)");
  using element_type = T;
  using value_type = std::remove_cv_t<T>;

  T* data = nullptr;            ///< element (0,0,0), or the pool base when paged
  std::int64_t num_heads = 0;   ///< Hkv
  std::int64_t num_tokens = 0;  ///< L: tokens currently in this sequence's cache
  std::int64_t head_dim = 0;    ///< d
  std::int64_t head_stride = 0;
  std::int64_t token_stride = 0;  ///< between consecutive tokens (inside a block when paged)
  std::int64_t dim_stride = 1;
  /// Per-tensor dequantisation scale (vLLM's k_scale / v_scale for fp8 caches): element x
  /// stands for to_float(x) * scale. Scoring applies it; compaction copies stored bytes and
  /// leaves it to the engine. Must be finite and > 0; 1 for unscaled caches.
  float scale = 1.0f;

  // Paged caches only (block_table == nullptr means strided).
  index_ptr block_table = nullptr;   ///< logical block -> physical block id
  std::int64_t block_size = 0;       ///< tokens per block
  std::int64_t block_stride = 0;     ///< elements between physical blocks
  std::int64_t num_pool_blocks = 0;  ///< physical blocks in the pool (ids must be below)
  /// A block table per head (per-head lengths, each head freeing its own blocks): head h's
  /// table is block_table + h * head_table_stride and every block holds one head (head_stride
  /// is then unused). 0: one table for every head.
  std::int64_t head_table_stride = 0;

  KVEVICT_HOST_DEVICE bool is_paged() const noexcept { return block_table != nullptr; }
  KVEVICT_HOST_DEVICE bool has_head_tables() const noexcept { return is_paged() && head_table_stride != 0; }
  /// Head h's block table (every head's, without per-head tables).
  KVEVICT_HOST_DEVICE index_ptr table_of(std::int64_t h) const noexcept { return block_table + h * head_table_stride; }
  /// Tables the view uses: Hkv with per-head tables, else 1.
  KVEVICT_HOST_DEVICE std::int64_t num_tables() const noexcept { return has_head_tables() ? num_heads : 1; }

  /// Blocks of the table this sequence uses: ceil(num_tokens / block_size); 0 when strided,
  /// empty, or block_size < 1 (a malformed view: validation rejects it). Never overflows.
  KVEVICT_HOST_DEVICE std::int64_t num_used_blocks() const noexcept {
    if (!is_paged() || num_tokens < 1 || block_size < 1) return 0;
    return num_tokens / block_size + (num_tokens % block_size != 0 ? 1 : 0);
  }

  /// Blocks of the table beyond what the first `n` tokens need: what a sequence cut to `n`
  /// tokens hands back to the engine's allocator (0 when strided).
  KVEVICT_HOST_DEVICE std::int64_t blocks_beyond(std::int64_t n) const noexcept {
    cache_view v = *this;
    v.num_tokens = n;
    return num_used_blocks() - v.num_used_blocks();
  }

  /// Offset in elements of (h, j, c) from `data`.
  KVEVICT_HOST_DEVICE std::int64_t offset(std::int64_t h, std::int64_t j, std::int64_t c) const noexcept {
    if (block_table != nullptr) {
      const std::int64_t block = j / block_size;
      const std::int64_t in_block = j - block * block_size;
      if (head_table_stride != 0)
        return static_cast<std::int64_t>(block_table[h * head_table_stride + block]) * block_stride +
               in_block * token_stride + c * dim_stride;
      return static_cast<std::int64_t>(block_table[block]) * block_stride + in_block * token_stride + h * head_stride +
             c * dim_stride;
    }
    return h * head_stride + j * token_stride + c * dim_stride;
  }

  KVEVICT_HOST_DEVICE T& at(std::int64_t h, std::int64_t j, std::int64_t c) const noexcept {
    return data[offset(h, j, c)];
  }

  /// Pointer to channel 0 of token j of head h; channels follow at dim_stride.
  KVEVICT_HOST_DEVICE T* row(std::int64_t h, std::int64_t j) const noexcept { return data + offset(h, j, 0); }

  /// The same memory seen through the first `n` tokens (n <= num_tokens is the caller's
  /// promise; validation checks it where it matters).
  KVEVICT_HOST_DEVICE cache_view first_tokens(std::int64_t n) const noexcept {
    cache_view v = *this;
    v.num_tokens = n;
    return v;
  }

  /// The same view with elements of type U (data reinterpreted, every other field as is): the
  /// read-only conversion, and the runtime-dtype entry's typed views (any_element <-> T).
  template <class U>
  KVEVICT_HOST_DEVICE cache_view<U> with_element() const noexcept {
    cache_view<U> v;
    v.data = static_cast<U*>(const_cast<void*>(static_cast<const void*>(data)));
    v.num_heads = num_heads;
    v.num_tokens = num_tokens;
    v.head_dim = head_dim;
    v.head_stride = head_stride;
    v.token_stride = token_stride;
    v.dim_stride = dim_stride;
    v.scale = scale;
    v.block_table = block_table;
    v.block_size = block_size;
    v.block_stride = block_stride;
    v.num_pool_blocks = num_pool_blocks;
    v.head_table_stride = head_table_stride;
    return v;
  }

  /// Read-only view of the same memory.
  template <class U = T, std::enable_if_t<!std::is_const<U>::value, int> = 0>
  KVEVICT_HOST_DEVICE operator detail::const_view_t<T, cache_view<const value_type>>() const noexcept {
    return with_element<const value_type>();
  }
};

static_assert(std::is_trivially_copyable<cache_view<float>>::value, "views are trivially copyable");
static_assert(std::is_trivially_copyable<cache_view<const bf16>>::value, "views are trivially copyable");

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_CACHE_VIEW_HPP
