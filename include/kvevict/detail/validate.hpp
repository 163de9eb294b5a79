// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_DETAIL_VALIDATE_HPP
#define KVEVICT_DETAIL_VALIDATE_HPP

// Argument validation shared by every public entry point. Each check runs before any
// memory of the caller is read or written, and names the offending argument/field.

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <limits>

#include "kvevict/config.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/error.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/selection/budget.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace detail {

/// "arg.field" for error messages.
struct field_name {
  char text[status::max_argument];
  field_name(const char* arg, const char* field) noexcept { std::snprintf(text, sizeof(text), "%s.%s", arg, field); }
  operator const char*() const noexcept { return text; }
};

struct strided_dim {
  std::int64_t extent;
  std::int64_t stride;
  const char* name;
};

/// Checks that a box of strided dims maps distinct indices to distinct offsets (the usual
/// sufficient condition: sorted by stride, every stride exceeds the span of the smaller
/// dims) and computes its span (largest offset + 1). Dims of extent 1 never overlap.
inline status check_box(const char* fn, const char* arg, strided_dim* dims, int n, std::int64_t* span) noexcept {
  std::sort(dims, dims + n, [](const strided_dim& a, const strided_dim& b) { return a.stride < b.stride; });
  std::int64_t reach = 0;  // largest offset reachable by the dims seen so far
  for (int i = 0; i < n; ++i) {
    if (dims[i].extent <= 1) continue;
    if (dims[i].stride <= reach) {
      return status::error(errc::invalid_stride, fn, field_name(arg, dims[i].name),
                           "expected a stride > %lld so that elements do not overlap, got %lld",
                           static_cast<long long>(reach), static_cast<long long>(dims[i].stride));
    }
    std::int64_t extra = 0;
    if (!checked_mul(dims[i].extent - 1, dims[i].stride, &extra) || !checked_add(reach, extra, &reach)) {
      return status::error(errc::overflow, fn, arg, "the view spans 2^63 elements or more");
    }
  }
  if (reach == std::numeric_limits<std::int64_t>::max())  // the span, reach + 1, would not fit
    return status::error(errc::overflow, fn, arg, "the view spans 2^63 elements or more");
  *span = reach + 1;
  return status();
}

/// Every cache_view check that reads only the view itself (no element, no block-table
/// entry), so it also serves views of device memory (the CUDA host API).
template <class T>
status validate_cache_view_metadata(const cache_view<T>& v, const char* fn, const char* arg) noexcept {
  if (v.num_heads < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "num_heads"), "expected >= 1, got %lld",
                         static_cast<long long>(v.num_heads));
  if (v.head_dim < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "head_dim"), "expected >= 1, got %lld",
                         static_cast<long long>(v.head_dim));
  if (v.num_tokens < 0)
    return status::error(errc::invalid_shape, fn, field_name(arg, "num_tokens"), "expected >= 0, got %lld",
                         static_cast<long long>(v.num_tokens));
  if (!(v.scale > 0.0f) || v.scale == std::numeric_limits<float>::infinity())
    return status::error(errc::invalid_argument, fn, field_name(arg, "scale"),
                         "expected a finite dequantisation scale > 0, got %g", static_cast<double>(v.scale));
  if (v.head_stride < 0 || v.token_stride < 0 || v.dim_stride < 0) {
    const char* which = v.head_stride < 0 ? "head_stride" : (v.token_stride < 0 ? "token_stride" : "dim_stride");
    const std::int64_t value = v.head_stride < 0 ? v.head_stride : (v.token_stride < 0 ? v.token_stride : v.dim_stride);
    return status::error(errc::invalid_stride, fn, field_name(arg, which), "expected >= 0, got %lld",
                         static_cast<long long>(value));
  }
  if (v.data == nullptr) return status::error(errc::null_pointer, fn, field_name(arg, "data"), "expected non-null");
  if (v.head_table_stride < 0 || (v.head_table_stride != 0 && !v.is_paged()))
    return status::error(errc::invalid_stride, fn, field_name(arg, "head_table_stride"),
                         "expected 0, or > 0 with a block table (one table per head), got %lld",
                         static_cast<long long>(v.head_table_stride));
  if (v.num_tokens == 0) return status();  // no element is addressed (an empty HF cache has head_stride 0)
  if (!v.is_paged()) {
    strided_dim dims[3] = {{v.num_heads, v.head_stride, "head_stride"},
                           {v.num_tokens, v.token_stride, "token_stride"},
                           {v.head_dim, v.dim_stride, "dim_stride"}};
    std::int64_t span = 0;
    return check_box(fn, arg, dims, 3, &span);
  }
  if (v.block_size < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "block_size"), "expected >= 1, got %lld",
                         static_cast<long long>(v.block_size));
  if (v.num_pool_blocks < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "num_pool_blocks"), "expected >= 1, got %lld",
                         static_cast<long long>(v.num_pool_blocks));
  // Block ids travel as int32 (changed-block lists, vLLM's and TensorRT-LLM's tables) whatever
  // the table's width.
  if (v.num_pool_blocks > std::numeric_limits<std::int32_t>::max())
    return status::error(errc::out_of_range, fn, field_name(arg, "num_pool_blocks"),
                         "expected at most 2^31 - 1 blocks (block ids are int32), got %lld",
                         static_cast<long long>(v.num_pool_blocks));
  if (v.block_stride < 0)
    return status::error(errc::invalid_stride, fn, field_name(arg, "block_stride"), "expected >= 0, got %lld",
                         static_cast<long long>(v.block_stride));
  if (v.head_table_stride != 0 && v.num_heads > 1 && v.head_table_stride < v.num_used_blocks())
    return status::error(errc::invalid_stride, fn, field_name(arg, "head_table_stride"),
                         "expected 0 (one table) or >= %lld (the blocks a head uses) so that head tables do not "
                         "overlap, got %lld",
                         static_cast<long long>(v.num_used_blocks()), static_cast<long long>(v.head_table_stride));
  const std::int64_t in_block = std::min(v.block_size, std::max<std::int64_t>(v.num_tokens, 1));
  const std::int64_t heads_in_block = v.head_table_stride != 0 ? 1 : v.num_heads;  // per-head tables: one head a block
  strided_dim dims[4] = {{heads_in_block, v.head_stride, "head_stride"},
                         {in_block, v.token_stride, "token_stride"},
                         {v.head_dim, v.dim_stride, "dim_stride"},
                         {v.num_pool_blocks, v.block_stride, "block_stride"}};
  std::int64_t block_span = 0;
  KVEVICT_RETURN_IF_ERROR(check_box(fn, arg, dims, 3, &block_span));
  std::int64_t pool_span = 0;
  if (v.num_pool_blocks > 1 && v.block_stride < block_span) {
    // Blocks may interleave (llama.cpp's transposed V paged by cells puts block i at element i
    // of every channel row) as long as no (block, head, token, channel) pair of elements meet:
    // the pool as a fourth strided dimension.
    strided_dim pool[4] = {{heads_in_block, v.head_stride, "block_stride"},
                           {in_block, v.token_stride, "block_stride"},
                           {v.head_dim, v.dim_stride, "block_stride"},
                           {v.num_pool_blocks, v.block_stride, "block_stride"}};
    if (!check_box(fn, arg, pool, 4, &pool_span).ok())
      return status::error(errc::invalid_stride, fn, field_name(arg, "block_stride"),
                           "expected blocks that do not overlap: >= %lld (the extent of one block), or an "
                           "interleaving that reaches no element twice, got %lld",
                           static_cast<long long>(block_span), static_cast<long long>(v.block_stride));
    return status();
  }
  if (!checked_mul(v.num_pool_blocks - 1, v.block_stride, &pool_span) ||
      !checked_add(pool_span, block_span, &pool_span))
    return status::error(errc::overflow, fn, arg, "the block pool spans 2^63 elements or more");
  return status();
}

/// validate_cache_view_metadata plus the block table's entries: every used block id in the pool.
template <class T>
status validate_cache_view(const cache_view<T>& v, const char* fn, const char* arg) noexcept {
  KVEVICT_RETURN_IF_ERROR(validate_cache_view_metadata(v, fn, arg));
  if (!v.is_paged() || v.num_tokens == 0) return status();
  const std::int64_t used = v.num_used_blocks();
  for (std::int64_t e = 0; e < v.num_tables() * used; ++e) {
    const std::int64_t b = (e / used) * v.head_table_stride + e % used;  // the entry's index in block_table
    const std::int64_t id = v.block_table[b];
    if (id < 0 || id >= v.num_pool_blocks) {
      char name[status::max_argument];
      std::snprintf(name, sizeof(name), "%s.block_table[%lld]", arg, static_cast<long long>(b));
      if (id < 0)  // bit 31 set: TensorRT-LLM's KVCacheIndex marks a block of its secondary (host) pool so
        return status::error(errc::out_of_range, fn, name,
                             "expected a block id in [0, %lld), got %lld (negative: in an int32 table, bit 31 is "
                             "TensorRT-LLM's secondary-pool flag; blocks offloaded to another pool are not read)",
                             static_cast<long long>(v.num_pool_blocks), static_cast<long long>(id));
      return status::error(errc::out_of_range, fn, name, "expected a block id in [0, %lld), got %lld",
                           static_cast<long long>(v.num_pool_blocks), static_cast<long long>(id));
    }
  }
  return status();
}

/// Every query_view check that reads only the view itself (not the positions' values).
template <class T>
status validate_query_view_metadata(const query_view<T>& q, const char* fn, const char* arg) noexcept {
  if (q.num_heads < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "num_heads"), "expected >= 1, got %lld",
                         static_cast<long long>(q.num_heads));
  if (q.num_queries < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "num_queries"), "expected >= 1, got %lld",
                         static_cast<long long>(q.num_queries));
  if (q.head_dim < 1)
    return status::error(errc::invalid_shape, fn, field_name(arg, "head_dim"), "expected >= 1, got %lld",
                         static_cast<long long>(q.head_dim));
  if (q.head_stride < 0 || q.query_stride < 0 || q.dim_stride < 0)
    return status::error(errc::invalid_stride, fn, arg, "expected non-negative strides, got (%lld, %lld, %lld)",
                         static_cast<long long>(q.head_stride), static_cast<long long>(q.query_stride),
                         static_cast<long long>(q.dim_stride));
  if (q.data == nullptr) return status::error(errc::null_pointer, fn, field_name(arg, "data"), "expected non-null");
  if (q.positions == nullptr)
    return status::error(errc::null_pointer, fn, field_name(arg, "positions"),
                         "expected the absolute position of each of the %lld observations",
                         static_cast<long long>(q.num_queries));
  strided_dim dims[3] = {{q.num_heads, q.head_stride, "head_stride"},
                         {q.num_queries, q.query_stride, "query_stride"},
                         {q.head_dim, q.dim_stride, "dim_stride"}};
  std::int64_t span = 0;
  return check_box(fn, arg, dims, 3, &span);
}

/// validate_query_view_metadata plus the positions: every observation at a position >= 0.
template <class T>
status validate_query_view(const query_view<T>& q, const char* fn, const char* arg) noexcept {
  KVEVICT_RETURN_IF_ERROR(validate_query_view_metadata(q, fn, arg));
  for (std::int64_t t = 0; t < q.num_queries; ++t) {
    if (q.positions[t] < 0) {
      char name[status::max_argument];
      std::snprintf(name, sizeof(name), "%s.positions[%lld]", arg, static_cast<long long>(t));
      return status::error(errc::out_of_range, fn, name, "expected >= 0, got %lld",
                           static_cast<long long>(q.positions[t]));
    }
  }
  return status();
}

/// A float matrix the call reads or writes: rows x cols with row_stride >= cols.
template <class T>
status validate_matrix_view(const matrix_view<T>& m, std::int64_t rows, std::int64_t cols, const char* fn,
                            const char* arg) noexcept {
  if (m.rows != rows || m.cols != cols)
    return status::error(errc::invalid_shape, fn, arg, "expected [%lld, %lld], got [%lld, %lld]",
                         static_cast<long long>(rows), static_cast<long long>(cols), static_cast<long long>(m.rows),
                         static_cast<long long>(m.cols));
  if (rows > 1 && m.row_stride < cols)
    return status::error(errc::invalid_stride, fn, field_name(arg, "row_stride"),
                         "expected >= %lld (the number of columns), got %lld", static_cast<long long>(cols),
                         static_cast<long long>(m.row_stride));
  if (rows > 0 && cols > 0 && m.data == nullptr)
    return status::error(errc::null_pointer, fn, field_name(arg, "data"), "expected non-null");
  return status();
}

/// Keep-list structure: offsets[0] == 0, non-decreasing, within capacity; every head's
/// indices strictly ascending and in [0, num_tokens).
inline status validate_keep_list(const const_keep_list_view& keep, std::int64_t num_heads, std::int64_t num_tokens,
                                 const char* fn, const char* arg) noexcept {
  if (keep.num_heads != num_heads)
    return status::error(errc::invalid_shape, fn, field_name(arg, "num_heads"), "expected %lld, got %lld",
                         static_cast<long long>(num_heads), static_cast<long long>(keep.num_heads));
  if (keep.offsets == nullptr)
    return status::error(errc::null_pointer, fn, field_name(arg, "offsets"), "expected non-null");
  if (keep.offsets[0] != 0)
    return status::error(errc::invalid_keep_list, fn, field_name(arg, "offsets"), "expected offsets[0] == 0, got %lld",
                         static_cast<long long>(keep.offsets[0]));
  for (std::int64_t h = 0; h < num_heads; ++h) {
    const std::int64_t begin = keep.offsets[h], end = keep.offsets[h + 1];
    if (end < begin || end > keep.capacity)
      return status::error(errc::invalid_keep_list, fn, field_name(arg, "offsets"),
                           "expected non-decreasing offsets within capacity %lld, got offsets[%lld..%lld] = %lld, %lld",
                           static_cast<long long>(keep.capacity), static_cast<long long>(h),
                           static_cast<long long>(h + 1), static_cast<long long>(begin), static_cast<long long>(end));
    if (end > begin && keep.indices == nullptr)
      return status::error(errc::null_pointer, fn, field_name(arg, "indices"), "expected non-null");
    std::int64_t previous = -1;
    for (std::int64_t i = begin; i < end; ++i) {
      const std::int64_t j = keep.indices[i];
      if (j < 0 || j >= num_tokens)
        return status::error(errc::invalid_keep_list, fn, field_name(arg, "indices"),
                             "head %lld: expected token indices in [0, %lld), got %lld", static_cast<long long>(h),
                             static_cast<long long>(num_tokens), static_cast<long long>(j));
      if (j <= previous)
        return status::error(errc::invalid_keep_list, fn, field_name(arg, "indices"),
                             "head %lld: expected strictly ascending indices, got %lld after %lld",
                             static_cast<long long>(h), static_cast<long long>(j), static_cast<long long>(previous));
      previous = j;
    }
  }
  return status();
}

/// Scoring parameters: every enum in range, an odd pooling kernel, a protected tail >= 0.
inline status validate_scoring_params(const scoring_params& p, const char* fn) noexcept {
  if (static_cast<unsigned>(p.domain) > 1u)
    return status::error(errc::invalid_argument, fn, "params.domain", "expected a softmax_domain value, got %d",
                         static_cast<int>(p.domain));
  if (static_cast<unsigned>(p.window) > 4u)
    return status::error(errc::invalid_argument, fn, "params.window", "expected a window_aggregation value, got %d",
                         static_cast<int>(p.window));
  if (static_cast<unsigned>(p.gqa) > 2u)
    return status::error(errc::invalid_argument, fn, "params.gqa", "expected a gqa_reduction value, got %d",
                         static_cast<int>(p.gqa));
  if (static_cast<unsigned>(p.order) > 1u)
    return status::error(errc::invalid_argument, fn, "params.order", "expected a gqa_order value, got %d",
                         static_cast<int>(p.order));
  if (static_cast<unsigned>(p.pool.kind) > 2u)
    return status::error(errc::invalid_argument, fn, "params.pool.kind", "expected a pooling_kind value, got %d",
                         static_cast<int>(p.pool.kind));
  if (p.pool.kind != pooling_kind::none && (p.pool.kernel < 1 || p.pool.kernel % 2 == 0))
    return status::error(errc::invalid_argument, fn, "params.pool.kernel", "expected an odd kernel >= 1, got %lld",
                         static_cast<long long>(p.pool.kernel));
  if (p.protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "params.protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(p.protected_tail));
  return status();
}

/// A selection's protected tail and mode, as every selection (CPU and device) checks them.
inline status check_selection_params(const selection_params& params, const char* fn) noexcept {
  if (params.protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "params.protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(params.protected_tail));
  if (static_cast<unsigned>(params.mode) > 1u)
    return status::error(errc::invalid_argument, fn, "params.mode", "expected a protected_mode value, got %d",
                         static_cast<int>(params.mode));
  return status();
}

}  // namespace detail
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_DETAIL_VALIDATE_HPP
