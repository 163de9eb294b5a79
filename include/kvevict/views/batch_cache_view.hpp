// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_VIEWS_BATCH_CACHE_VIEW_HPP
#define KVEVICT_VIEWS_BATCH_CACHE_VIEW_HPP

// A ragged batch of sequences sharing one cache layout (HF padded batches, vLLM block
// tables, FlashInfer CSR page tables). Each sequence is an ordinary cache_view.

#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"

KVEVICT_NAMESPACE_BEGIN

/// A ragged batch: the same layout for every sequence, each with its own length (and, when
/// paged, its own block-table row). `sequence(s)` is an ordinary cache_view.
template <class T>
struct batch_cache_view {
  /// Layout shared by all sequences; `layout.data` is sequence 0 (strided) or the pool
  /// (paged). `layout.num_tokens` is ignored; `layout.block_table` is ignored when
  /// `block_tables` is set.
  cache_view<T> layout;
  std::int64_t num_seqs = 0;
  /// [num_seqs] tokens in each sequence (int32, as FlashInfer and vLLM keep them, or int64)
  index_ptr seq_lens = nullptr;

  std::int64_t seq_stride = 0;  ///< strided: elements between consecutive sequences

  /// Paged: sequence s uses block ids block_tables[block_indptr[s] ...] when block_indptr is
  /// set (FlashInfer CSR), else block_tables[s * block_table_stride ...] (vLLM 2-D table).
  index_ptr block_tables = nullptr;
  std::int64_t block_table_stride = 0;
  index_ptr block_indptr = nullptr;

  KVEVICT_HOST_DEVICE bool is_paged() const noexcept { return block_tables != nullptr; }

  KVEVICT_HOST_DEVICE cache_view<T> sequence(std::int64_t s) const noexcept {
    cache_view<T> v = layout;
    v.num_tokens = seq_lens[s];
    if (block_tables != nullptr) {
      v.block_table = block_tables +
                      (block_indptr != nullptr ? static_cast<std::int64_t>(block_indptr[s]) : s * block_table_stride);
    } else {
      v.data = layout.data + s * seq_stride;
    }
    return v;
  }
};

static_assert(std::is_trivially_copyable<batch_cache_view<bf16>>::value, "views are trivially copyable");

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_VIEWS_BATCH_CACHE_VIEW_HPP
