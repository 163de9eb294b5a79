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
/// pointing at that sequence; its first `num_tokens` tokens are in use.
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
                                                            const std::int64_t* seq_lens) noexcept {
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
                                            std::int64_t num_heads, std::int64_t head_dim,
                                            const std::int32_t* block_table, std::int64_t num_tokens) noexcept {
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
                                            std::int64_t num_heads, std::int64_t head_dim,
                                            const std::int32_t* block_table, std::int64_t num_tokens) noexcept {
  cache_view<T> v = strided_cache(pool, num_heads, num_tokens, head_dim, block_size * head_dim, head_dim, 1);
  v.block_table = block_table;
  v.block_size = block_size;
  v.block_stride = num_heads * block_size * head_dim;
  v.num_pool_blocks = num_blocks;
  return v;
}

/// FlashInfer paged K or V cache, NHD: [max_num_pages, page_size, Hkv, d]; the sequence's
/// pages are page_indices[0 .. ceil(num_tokens / page_size)).
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> flashinfer_paged_nhd(T* pool, std::int64_t num_pages, std::int64_t page_size,
                                                       std::int64_t num_heads, std::int64_t head_dim,
                                                       const std::int32_t* page_indices,
                                                       std::int64_t num_tokens) noexcept {
  return paged_nhd(pool, num_pages, page_size, num_heads, head_dim, page_indices, num_tokens);
}

/// FlashInfer paged K or V cache, HND: [max_num_pages, Hkv, page_size, d].
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> flashinfer_paged_hnd(T* pool, std::int64_t num_pages, std::int64_t page_size,
                                                       std::int64_t num_heads, std::int64_t head_dim,
                                                       const std::int32_t* page_indices,
                                                       std::int64_t num_tokens) noexcept {
  return paged_hnd(pool, num_pages, page_size, num_heads, head_dim, page_indices, num_tokens);
}

/// FlashInfer ragged batch over a CSR page table: sequence s uses pages
/// indices[indptr[s] .. indptr[s+1]) and holds seq_lens[s] tokens
/// (= (pages - 1) * page_size + last_page_len[s] in FlashInfer's terms).
template <class T>
KVEVICT_HOST_DEVICE batch_cache_view<T> flashinfer_paged_batch(cache_view<T> pool_layout, std::int64_t num_seqs,
                                                               const std::int32_t* indptr, const std::int32_t* indices,
                                                               const std::int64_t* seq_lens) noexcept {
  batch_cache_view<T> b;
  b.layout = pool_layout;
  b.num_seqs = num_seqs;
  b.seq_lens = seq_lens;
  b.block_tables = indices;
  b.block_indptr = indptr;
  return b;
}

/// vLLM paged K or V cache [num_blocks, block_size, Hkv, d]; `block_table` is the
/// sequence's row of the block table.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> vllm_paged(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                             std::int64_t num_heads, std::int64_t head_dim,
                                             const std::int32_t* block_table, std::int64_t num_tokens) noexcept {
  return paged_nhd(pool, num_blocks, block_size, num_heads, head_dim, block_table, num_tokens);
}

/// vLLM paged cache, HND variant [num_blocks, Hkv, block_size, d].
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> vllm_paged_hnd(T* pool, std::int64_t num_blocks, std::int64_t block_size,
                                                 std::int64_t num_heads, std::int64_t head_dim,
                                                 const std::int32_t* block_table, std::int64_t num_tokens) noexcept {
  return paged_hnd(pool, num_blocks, block_size, num_heads, head_dim, block_table, num_tokens);
}

/// vLLM ragged batch: block table [num_seqs, max_blocks_per_seq] (row-major), seq_lens[s].
template <class T>
KVEVICT_HOST_DEVICE batch_cache_view<T> vllm_paged_batch(cache_view<T> pool_layout, std::int64_t num_seqs,
                                                         const std::int32_t* block_tables,
                                                         std::int64_t max_blocks_per_seq,
                                                         const std::int64_t* seq_lens) noexcept {
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
/// same pool (make one view with the K offsets and one with the V offsets).
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> trtllm_paged(T* pool, std::int64_t num_pool_blocks, std::int64_t tokens_per_block,
                                               std::int64_t num_heads, std::int64_t head_dim,
                                               const std::int32_t* block_offsets, std::int64_t num_tokens) noexcept {
  return paged_hnd(pool, num_pool_blocks, tokens_per_block, num_heads, head_dim, block_offsets, num_tokens);
}

/// llama.cpp K cache: [kv_size][row_stride] rows, one per cell, channels head-major
/// (head h's d channels at h*d). row_stride < 0 means Hkv*d. The first num_tokens cells
/// are the sequence's tokens in order.
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
/// (cell i, channel c) at c*kv_size + i, with channel c = h*d + dim.
template <class T>
KVEVICT_HOST_DEVICE cache_view<T> llamacpp_v_transposed(T* data, std::int64_t kv_size, std::int64_t num_heads,
                                                        std::int64_t num_tokens, std::int64_t head_dim) noexcept {
  return strided_cache(data, num_heads, num_tokens, head_dim, head_dim * kv_size, 1, kv_size);
}

/// Observation queries [Hq, W, d] contiguous (HF's query states of one sequence).
template <class T>
KVEVICT_HOST_DEVICE query_view<T> contiguous_queries(T* data, std::int64_t num_heads, std::int64_t num_queries,
                                                     std::int64_t head_dim, const std::int64_t* positions) noexcept {
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
                                                      std::int64_t head_dim, const std::int64_t* positions) noexcept {
  query_view<T> q = contiguous_queries(data, num_heads, num_queries, head_dim, positions);
  q.head_stride = head_dim;
  q.query_stride = num_heads * head_dim;
  return q;
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_LAYOUTS_HPP
