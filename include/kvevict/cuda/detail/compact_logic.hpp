// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_COMPACT_LOGIC_HPP
#define KVEVICT_CUDA_DETAIL_COMPACT_LOGIC_HPP

// The pure logic of GPU compaction (cuda/compact.cuh) in host+device functions: which head
// a flattened keep-list entry belongs to, the per-entry keep-list checks the validation
// kernel runs, and which entries actually move.
//
// The in-place hazard: head h's destination row i may be the source row of another kept
// entry (keep[b] == i for some b < i), so copying all entries in parallel races. Staging
// avoids it: one kernel copies every moving entry's source row into the workspace, a second
// (launched after the first has finished, on the same stream) copies the staged rows to
// their destinations. An entry with keep[i] == i does not move, and no other entry reads or
// writes its row: keep-lists are strictly ascending, so keep[b] == i only for b == i, and
// row i is written only by entry i. Such entries are neither staged nor written back.

#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Head of flattened entry e: the h with offsets[h] <= e < offsets[h + 1] (offsets
/// non-decreasing, offsets[0] == 0, e < offsets[num_heads]). Empty heads are skipped.
KVEVICT_HOST_DEVICE inline std::int64_t head_of_entry(const std::int64_t* offsets, std::int64_t num_heads,
                                                      std::int64_t e) noexcept {
  std::int64_t lo = 0, hi = num_heads;  // answer in [lo, hi)
  while (hi - lo > 1) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (offsets[mid] <= e) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// Checks of the offsets array: offsets[0] == 0, non-decreasing, the last within capacity.
/// `h` in [0, num_heads): checks offsets[h] against offsets[h + 1].
KVEVICT_HOST_DEVICE inline bool offsets_ok(const std::int64_t* offsets, std::int64_t h,
                                           std::int64_t capacity) noexcept {
  if (h == 0 && offsets[0] != 0) return false;
  return offsets[h] <= offsets[h + 1] && offsets[h + 1] <= capacity;
}

/// Whether flattened entry e of head h (head_of_entry) is compared with no predecessor: the
/// first of its head, and always entry 0. With corrupt offsets (offsets[0] != 0, negative)
/// the head found for entry 0 need not start there, and its predecessor would be index -1.
KVEVICT_HOST_DEVICE inline bool entry_starts_head(const std::int64_t* offsets, std::int64_t h,
                                                  std::int64_t e) noexcept {
  return e == 0 || e == offsets[h];
}

/// Check of one entry: index in [0, num_tokens) and strictly above its predecessor in the
/// same head (`first_of_head` when e == offsets[h]).
KVEVICT_HOST_DEVICE inline bool entry_ok(std::int64_t index, std::int64_t previous, bool first_of_head,
                                         std::int64_t num_tokens) noexcept {
  if (index < 0 || index >= num_tokens) return false;
  return first_of_head || index > previous;
}

/// Whether the entry at position i of its head moves (its source row differs from its
/// destination row).
KVEVICT_HOST_DEVICE constexpr bool entry_moves(std::int64_t index, std::int64_t i) noexcept {
  return index != i;
}

/// Bitmap word and bit of a physical block id (the duplicate-block check).
KVEVICT_HOST_DEVICE constexpr std::int64_t bitmap_word(std::int64_t id) noexcept {
  return id >> 5;
}
KVEVICT_HOST_DEVICE constexpr std::uint32_t bitmap_bit(std::int64_t id) noexcept {
  return 1u << static_cast<std::uint32_t>(id & 31);
}
KVEVICT_HOST_DEVICE constexpr std::int64_t bitmap_words(std::int64_t ids) noexcept {
  return (ids + 31) >> 5;
}

/// A cache view with the element type erased: byte strides, and how rows are copied.
struct byte_view {
  unsigned char* data = nullptr;
  std::int64_t head_stride = 0, token_stride = 0, dim_stride = 0;  // bytes
  std::int64_t element_bytes = 0;
  std::int64_t head_dim = 0;
  std::int64_t row_bytes = 0;  // head_dim * element_bytes
  index_ptr block_table = nullptr;
  std::int64_t block_size = 0, block_stride = 0, num_pool_blocks = 0;
  std::int64_t head_table_stride = 0;  // entries between heads' tables; 0: one table for every head
  std::int64_t num_tables = 1;         // tables to check: num_heads with per-head tables, else 1
  std::int64_t num_tokens = 0;
  int unit = 0;  // contiguous rows: bytes per lane and copy (16, 8, 4, 2, 1); 0: channel-strided

  KVEVICT_HOST_DEVICE std::int64_t row_offset(std::int64_t h, std::int64_t j) const noexcept {
    if (block_table != nullptr) {
      const std::int64_t block = j / block_size;
      return static_cast<std::int64_t>(block_table[h * head_table_stride + block]) * block_stride +
             (j - block * block_size) * token_stride + h * head_stride;
    }
    return h * head_stride + j * token_stride;
  }
};

/// Widest unit (bytes) every row start and row length of the view is a multiple of.
inline int copy_unit(std::uintptr_t base, std::int64_t row_bytes, std::int64_t head_stride, std::int64_t token_stride,
                     std::int64_t block_stride, std::int64_t element_bytes) noexcept {
  for (int u = 16; u >= 2; u /= 2) {
    if (u < element_bytes) break;
    if (base % static_cast<unsigned>(u) == 0 && row_bytes % u == 0 && head_stride % u == 0 && token_stride % u == 0 &&
        block_stride % u == 0)
      return u;
  }
  return static_cast<int>(element_bytes);
}

template <class T>
byte_view make_byte_view(const cache_view<T>& v) noexcept {
  const auto e = static_cast<std::int64_t>(sizeof(T));
  byte_view b;
  b.data = reinterpret_cast<unsigned char*>(const_cast<std::remove_const_t<T>*>(v.data));
  b.head_stride = v.head_stride * e;
  b.token_stride = v.token_stride * e;
  b.dim_stride = v.dim_stride * e;
  b.element_bytes = e;
  b.head_dim = v.head_dim;
  b.row_bytes = v.head_dim * e;
  b.block_table = v.block_table;
  b.block_size = v.block_size;
  b.block_stride = v.block_stride * e;
  b.num_pool_blocks = v.num_pool_blocks;
  b.head_table_stride = v.head_table_stride;
  b.num_tables = v.num_tables();
  b.num_tokens = v.num_tokens;
  b.unit = (v.dim_stride == 1 || v.head_dim == 1)
               ? copy_unit(reinterpret_cast<std::uintptr_t>(v.data), b.row_bytes, b.head_stride, b.token_stride,
                           v.is_paged() ? b.block_stride : 0, e)
               : 0;
  return b;
}

/// How V's block tables relate to K's. A pool shared by K and V (one base pointer, one block
/// geometry: TensorRT-LLM) puts both tables' ids in one bitmap, so a block in both is caught;
/// otherwise a V table that is K's table (vLLM: one table, two pools) needs no second check.
struct kv_tables {
  bool shared_pool = false;
  bool same_table = false;
};

template <class KT, class VT>
kv_tables relate_tables(const cache_view<KT>& keys, const cache_view<VT>& values) noexcept {
  kv_tables r;
  r.shared_pool = keys.is_paged() && values.is_paged() && sizeof(KT) == sizeof(VT) &&
                  static_cast<const void*>(keys.data) == static_cast<const void*>(values.data) &&
                  keys.block_stride == values.block_stride;
  r.same_table = !r.shared_pool && keys.is_paged() && values.block_table == keys.block_table &&
                 values.block_size == keys.block_size && values.head_table_stride == keys.head_table_stride &&
                 values.num_heads == keys.num_heads;
  return r;
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_COMPACT_LOGIC_HPP
