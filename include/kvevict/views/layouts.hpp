// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_LAYOUTS_HPP
#define KVEVICT_VIEWS_LAYOUTS_HPP

// Named factories for the cache layouts of common engines. Each returns a view over the
// engine's own memory; nothing is copied. Shapes are listed outermost first; all strides
// are derived here so an engine never computes one by hand. Validation happens when a
// view is used (every public entry checks its views), not here.

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/views/batch_cache_view.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/layer_cache.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN

/// Any strided [Hkv, L, d] layout. Strides in elements.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> strided_cache(T* data, std::int64_t num_heads, std::int64_t num_tokens,
                                                std::int64_t head_dim, std::int64_t head_stride,
                                                std::int64_t token_stride, std::int64_t dim_stride = 1) noexcept {
  cache_view<T> v;
  v.data = data;
  v.num_heads = num_heads;
  v.num_tokens = num_tokens;
  v.head_dim = head_dim;
  v.head_stride = head_stride;
  v.token_stride = token_stride;
  v.dim_stride = dim_stride;
  return v;
}

/// HF transformers: one sequence of a contiguous [batch, Hkv, max_tokens, d] tensor, `data`
/// pointing at that sequence; its first `num_tokens` tokens are in use. Follows
/// src/transformers/cache_utils.py (DynamicLayer: [batch, heads, seq_len, head_dim], the KV
/// heads, concatenated on the token axis; StaticLayer pre-allocates max_cache_len rows).
/// max_tokens < 0 means max_tokens == num_tokens.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> hf_contiguous(T* data, std::int64_t num_heads, std::int64_t num_tokens,
                                                std::int64_t head_dim, std::int64_t max_tokens = -1) noexcept {
  const std::int64_t capacity = max_tokens < 0 ? num_tokens : max_tokens;
  return strided_cache(data, num_heads, num_tokens, head_dim, capacity * head_dim, head_dim, 1);
}

/// HF transformers, ragged batch: [num_seqs, Hkv, max_tokens, d]; sequence s holds
/// seq_lens[s] tokens (left-aligned: tokens 0..seq_lens[s]-1).
template <class T>
KVEVICT_HOST_DEVICE batch_cache_view<T> hf_contiguous_batch(T* data, std::int64_t num_seqs, std::int64_t num_heads,
                                                            std::int64_t max_tokens, std::int64_t head_dim,
                                                            index_ptr seq_lens) noexcept {
  batch_cache_view<T> b;
  b.layout = hf_contiguous(data, num_heads, max_tokens, head_dim, max_tokens);
  b.num_seqs = num_seqs;
  b.seq_lens = seq_lens;
  b.seq_stride = num_heads * max_tokens * head_dim;
  return b;
}

/// Paged pool [num_blocks, block_size, Hkv, d] ("NHD": FlashInfer NHD, vLLM); the sequence's
/// logical block i is physical block block_table[i].
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> paged_nhd(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                            std::int64_t num_heads, std::int64_t head_dim, index_ptr block_table,
                                            std::int64_t num_tokens) noexcept {
  cache_view<T> v = strided_cache(pool, num_heads, num_tokens, head_dim, head_dim, num_heads * head_dim, 1);
  v.block_table = block_table;
  v.block_size = block_size;
  v.block_stride = block_size * num_heads * head_dim;
  v.num_pool_blocks = num_blocks;
  return v;
}

/// Paged pool [num_blocks, Hkv, block_size, d] ("HND": FlashInfer HND, vLLM HND).
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> paged_hnd(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                            std::int64_t num_heads, std::int64_t head_dim, index_ptr block_table,
                                            std::int64_t num_tokens) noexcept {
  cache_view<T> v = strided_cache(pool, num_heads, num_tokens, head_dim, block_size * head_dim, head_dim, 1);
  v.block_table = block_table;
  v.block_size = block_size;
  v.block_stride = num_heads * block_size * head_dim;
  v.num_pool_blocks = num_blocks;
  return v;
}

/// FlashInfer paged K or V cache, NHD: [max_num_pages, page_size, Hkv, d]; the sequence's
/// pages are page_indices[0 .. ceil(num_tokens / page_size)). Follows FlashInfer's
/// docs/tutorials/kv_layout.rst (separate K and V tensors).
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> flashinfer_paged_nhd(T* pool, std::int64_t num_pages, std::int64_t page_size,
                                                       std::int64_t num_heads, std::int64_t head_dim,
                                                       index_ptr page_indices, std::int64_t num_tokens) noexcept {
  return paged_nhd(pool, num_pages, page_size, num_heads, head_dim, page_indices, num_tokens);
}

/// FlashInfer paged K or V cache, HND: [max_num_pages, Hkv, page_size, d].
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> flashinfer_paged_hnd(T* pool, std::int64_t num_pages, std::int64_t page_size,
                                                       std::int64_t num_heads, std::int64_t head_dim,
                                                       index_ptr page_indices, std::int64_t num_tokens) noexcept {
  return paged_hnd(pool, num_pages, page_size, num_heads, head_dim, page_indices, num_tokens);
}

/// FlashInfer ragged batch over a CSR page table: sequence s uses pages
/// indices[indptr[s] .. indptr[s+1]) and holds seq_lens[s] tokens
/// (= (pages - 1) * page_size + last_page_len[s] in FlashInfer's terms). indptr, indices and
/// seq_lens as FlashInfer keeps them (int32) or int64, each as it is: nothing is widened.
template <class T>
KVEVICT_HOST_DEVICE batch_cache_view<T> flashinfer_paged_batch(cache_view<T> pool_layout, std::int64_t num_seqs,
                                                               index_ptr indptr, index_ptr indices,
                                                               index_ptr seq_lens) noexcept {
  batch_cache_view<T> b;
  b.layout = pool_layout;
  b.num_seqs = num_seqs;
  b.seq_lens = seq_lens;
  b.block_tables = indices;
  b.block_indptr = indptr;
  return b;
}

/// vLLM paged K or V cache [num_blocks, block_size, Hkv, d]; `block_table` is the
/// sequence's row of the block table. Follows vllm/v1/attention/backends/flash_attn.py
/// (get_kv_cache_shape: (2, num_blocks, block_size, Hkv, d), K = [0], V = [1]). vLLM's HND
/// setting keeps these extents and permutes the strides: use vllm_paged_hnd then.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> vllm_paged(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                             std::int64_t num_heads, std::int64_t head_dim, index_ptr block_table,
                                             std::int64_t num_tokens) noexcept {
  return paged_nhd(pool, num_blocks, block_size, num_heads, head_dim, block_table, num_tokens);
}

/// vLLM paged cache, HND variant [num_blocks, Hkv, block_size, d].
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> vllm_paged_hnd(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                                 std::int64_t num_heads, std::int64_t head_dim, index_ptr block_table,
                                                 std::int64_t num_tokens) noexcept {
  return paged_hnd(pool, num_blocks, block_size, num_heads, head_dim, block_table, num_tokens);
}

/// vLLM ragged batch: block table [num_seqs, max_blocks_per_seq] (row-major), seq_lens[s].
template <class T>
KVEVICT_HOST_DEVICE batch_cache_view<T> vllm_paged_batch(cache_view<T> pool_layout, std::int64_t num_seqs,
                                                         index_ptr block_tables, std::int64_t max_blocks_per_seq,
                                                         index_ptr seq_lens) noexcept {
  batch_cache_view<T> b;
  b.layout = pool_layout;
  b.num_seqs = num_seqs;
  b.seq_lens = seq_lens;
  b.block_tables = block_tables;
  b.block_table_stride = max_blocks_per_seq;
  return b;
}

/// TensorRT-LLM paged cache: every block is [Hkv][tokens_per_block][d] and the pool is an
/// array of such blocks; K and V of a sequence have separate block-offset lists into the
/// same pool (make one view with the K offsets and one with the V offsets). Follows
/// cpp/tensorrt_llm/kernels/kvCacheUtils.h (KVBlockArray::getKVLocalIdx: a block is
/// [numHeads, tokensPerBlock, sizePerHead]; offsets of K and V per sequence, V's = K's + 1 in
/// a pool allocated by kvCacheManager.cpp). Its int32 KVCacheIndex offsets widen losslessly.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> trtllm_paged(T* pool, std::int64_t num_pool_blocks, std::int64_t tokens_per_block,
                                               std::int64_t num_heads, std::int64_t head_dim,
                                               const std::int32_t* block_offsets, std::int64_t num_tokens) noexcept {
  return paged_hnd(pool, num_pool_blocks, tokens_per_block, num_heads, head_dim, block_offsets, num_tokens);
}

/// llama.cpp K cache: [kv_size][row_stride] rows, one per cell, channels head-major
/// (head h's d channels at h*d). row_stride < 0 means Hkv*d. The first num_tokens cells
/// are the sequence's tokens in order. Follows src/llama-kv-cache.cpp (per layer
/// ggml_new_tensor_3d(type_k, n_embd_k_gqa, kv_size, n_stream): one stream, unquantised types).
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> llamacpp_k(T* data, std::int64_t num_heads, std::int64_t num_tokens,
                                             std::int64_t head_dim, std::int64_t row_stride = -1) noexcept {
  const std::int64_t stride = row_stride < 0 ? num_heads * head_dim : row_stride;
  return strided_cache(data, num_heads, num_tokens, head_dim, head_dim, stride, 1);
}

/// llama.cpp V cache when not transposed: the same layout as K.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> llamacpp_v(T* data, std::int64_t num_heads, std::int64_t num_tokens,
                                             std::int64_t head_dim, std::int64_t row_stride = -1) noexcept {
  return llamacpp_k(data, num_heads, num_tokens, head_dim, row_stride);
}

/// llama.cpp transposed V cache (no flash attention): channel-major, element
/// (cell i, channel c) at c*kv_size + i, with channel c = h*d + dim. Follows
/// src/llama-kv-cache.cpp (get_v's view when v_trans = !flash_attn).
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> llamacpp_v_transposed(T* data, std::int64_t kv_size, std::int64_t num_heads,
                                                        std::int64_t num_tokens, std::int64_t head_dim) noexcept {
  return strided_cache(data, num_heads, num_tokens, head_dim, head_dim * kv_size, 1, kv_size);
}

/// A paged pool with a block table per head [num_blocks, block_size, d] (each block holds one
/// head's rows): head h's table is block_tables + h * table_stride (the engine's
/// [Hkv, table_stride] array of one sequence). Heads keep different lengths (AdaKV) and free
/// their own blocks: the paged form of length_mode::per_head.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> paged_per_head(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                                 std::int64_t num_heads, std::int64_t head_dim, index_ptr block_tables,
                                                 std::int64_t table_stride, std::int64_t num_tokens) noexcept {
  cache_view<T> v = strided_cache(pool, num_heads, num_tokens, head_dim, 0, head_dim, 1);
  v.block_table = block_tables;
  v.block_size = block_size;
  v.block_stride = block_size * head_dim;
  v.num_pool_blocks = num_blocks;
  v.head_table_stride = table_stride;
  return v;
}

/// Axis order inside one block (page) of a paged pool: tokens then heads (NHD) or heads then
/// tokens (HND). The packed factories take it explicitly: both orders have the same extents,
/// so no check could tell a wrong one, and engines choose it at run time (vLLM:
/// VLLM_KV_CACHE_LAYOUT, HND for FlashInfer on SM 10.x; FlashInfer: kv_layout).
enum class block_order : std::int32_t { nhd, hnd };

/// vLLM's packed K|V pool: each block holds K and V side by side in the last axis,
/// (num_blocks, Hkv, block_size, 2*d) (block_order::hnd) or (num_blocks, block_size, Hkv, 2*d)
/// (block_order::nhd): K is channels [0, d), V channels [d, 2d). One block table serves both
/// (they share every block), so kvevict checks the table once. Follows vLLM's per-layer
/// (B, H, N, 2*D) tensor split into K and V in the last axis (v1 flash_attn backend, the
/// KVCacheLayout of vllm/v1/kv_cache_layout.py; the physical order is the engine's setting).
template <class T>
KVEVICT_HOST_DEVICE layer_cache<T> vllm_packed_kv(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                                  std::int64_t num_heads, std::int64_t head_dim, index_ptr block_table,
                                                  std::int64_t num_tokens, block_order order) noexcept {
  const std::int64_t row = 2 * head_dim;
  cache_view<T> k = order == block_order::hnd
                        ? strided_cache(pool, num_heads, num_tokens, head_dim, block_size * row, row, 1)
                        : strided_cache(pool, num_heads, num_tokens, head_dim, row, num_heads * row, 1);
  k.block_table = block_table;
  k.block_size = block_size;
  k.block_stride = num_heads * block_size * row;
  k.num_pool_blocks = num_blocks;
  cache_view<T> v = k;
  v.data = pool + head_dim;
  return layer_cache<T>(k, v);
}

/// FlashInfer's single-tensor paged cache [max_pages, 2, page_size, Hkv, d] (block_order::nhd)
/// or [max_pages, 2, Hkv, page_size, d] (block_order::hnd): page p's K half, then its V half;
/// the sequence's pages are page_indices[0 .. ceil(num_tokens / page_size)). Follows
/// FlashInfer's docs/tutorials/kv_layout.rst and flashinfer/page.py (NHD is its default); vLLM's
/// FlashInfer backend allocates this shape per layer (vllm/v1/attention/backends/flashinfer.py,
/// get_kv_cache_shape).
template <class T>
KVEVICT_HOST_DEVICE layer_cache<T> flashinfer_paged_kv(T* pool, std::int64_t num_pages, std::int64_t page_size,
                                                       std::int64_t num_heads, std::int64_t head_dim,
                                                       index_ptr page_indices, std::int64_t num_tokens,
                                                       block_order order) noexcept {
  cache_view<T> k = order == block_order::nhd
                        ? paged_nhd(pool, num_pages, page_size, num_heads, head_dim, page_indices, num_tokens)
                        : paged_hnd(pool, num_pages, page_size, num_heads, head_dim, page_indices, num_tokens);
  const std::int64_t half = page_size * num_heads * head_dim;
  k.block_stride = 2 * half;
  cache_view<T> v = k;
  v.data = pool + half;
  return layer_cache<T>(k, v);
}

/// llama.cpp with several sequences in one cache: K as [kv_size][row_stride] cell rows
/// (head h's channels at h*d; row_stride < 0 means Hkv*d), the sequence's tokens in
/// cells[0 .. num_tokens) in token order (the cells whose seq_id set holds it, sorted by pos).
/// A paged view with one-token blocks: block id = cell index.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> llamacpp_cells_k(T* data, std::int64_t kv_size, std::int64_t num_heads,
                                                   std::int64_t head_dim, index_ptr cells, std::int64_t num_tokens,
                                                   std::int64_t row_stride = -1) noexcept {
  const std::int64_t stride = row_stride < 0 ? num_heads * head_dim : row_stride;
  cache_view<T> v = strided_cache(data, num_heads, num_tokens, head_dim, head_dim, stride, 1);
  v.block_table = cells;
  v.block_size = 1;
  v.block_stride = stride;
  v.num_pool_blocks = kv_size;
  return v;
}

/// llama.cpp's transposed V with several sequences: element (cell i, channel c = h*d + dim) at
/// c*kv_size + i, the sequence's tokens in cells[0 .. num_tokens). One-token blocks one element
/// apart, interleaved across the channel rows.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> llamacpp_cells_v_transposed(T* data, std::int64_t kv_size, std::int64_t num_heads,
                                                              std::int64_t head_dim, index_ptr cells,
                                                              std::int64_t num_tokens) noexcept {
  cache_view<T> v = strided_cache(data, num_heads, num_tokens, head_dim, head_dim * kv_size, 1, kv_size);
  v.block_table = cells;
  v.block_size = 1;
  v.block_stride = 1;
  v.num_pool_blocks = kv_size;
  return v;
}

/// Observation queries [Hq, W, d] contiguous (HF's query states of one sequence).
template <class T>
KVEVICT_HOST_DEVICE query_view<T> contiguous_queries(T* data, std::int64_t num_heads, std::int64_t num_queries,
                                                     std::int64_t head_dim, index_ptr positions) noexcept {
  query_view<T> q;
  q.data = data;
  q.num_heads = num_heads;
  q.num_queries = num_queries;
  q.head_dim = head_dim;
  q.head_stride = num_queries * head_dim;
  q.query_stride = head_dim;
  q.dim_stride = 1;
  q.positions = positions;
  return q;
}

/// Observation queries laid out token-major [W, Hq, d] (what most engines' Q projection
/// writes: one row of Hq*d channels per token).
template <class T>
KVEVICT_HOST_DEVICE query_view<T> token_major_queries(T* data, std::int64_t num_heads, std::int64_t num_queries,
                                                      std::int64_t head_dim, index_ptr positions) noexcept {
  query_view<T> q = contiguous_queries(data, num_heads, num_queries, head_dim, positions);
  q.head_stride = head_dim;
  q.query_stride = num_heads * head_dim;
  return q;
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_LAYOUTS_HPP
