// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_COMPACT_CUH
#define KVEVICT_CUDA_COMPACT_CUH

// In-place compaction of one layer's K and V caches on the GPU (design.md §7):
// afterwards head h's row i holds what its row keep[h][i] held, for contiguous, strided
// (including llama.cpp's transposed V) and paged layouts; rows at or beyond a head's new
// length keep their old contents. Element copies only, no conversion.
//
// The in-place hazard and how it is avoided (detail/compact_logic.hpp): a destination row
// can be another kept entry's source row, so the copy is staged. Kernels, in stream order:
//   1. validate: keep-list structure (CSR offsets, indices strictly ascending in [0, L)),
//      block ids in range, no physical block reached twice (a bitmap per pool in the
//      workspace), no block it will write marked shared by the engine (optional). Problems go
//      to a private status word and to launch_options::device_flags.
//   2. gather: if the status word is clear, every moving entry's source row -> workspace.
//   3. scatter: if clear, staged rows -> destination rows; head lengths, positions, changed
//      blocks and freed blocks out.
// So on any device-detected problem nothing in the cache changes. Kernels of one stream run
// in order, which is the barrier between reading all sources and writing any destination.
//
// Rows are copied as bytes through a type-erased view: contiguous rows a warp per row with
// the widest aligned unit (16/8/4/2 bytes); channel-strided rows (transposed V) a thread per
// (channel, entry), entries fastest, so a warp reads consecutive tokens of one channel.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/compact_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// Which blocks compact checks against the shared-block marks: those it writes (as
/// kvevict::evict: a kept prefix that stays in place may be shared), or every block the
/// sequence uses (as kvevict::compressor in place, which refuses a sequence holding any marked
/// block; cuda::compressor passes it so that both accept the same calls).
enum class shared_block_check : std::int32_t { written, used };

/// Optional device outputs of `compact`, and its optional inputs about the tokens and blocks
/// (original key positions; blocks shared by prefix caching).
struct compact_outputs {
  std::int64_t* head_lengths = nullptr;  ///< [Hkv] out: keep.size(h)
  std::int64_t* positions = nullptr;     ///< [keep.capacity] out, aligned with keep.indices
  index_ptr key_positions = nullptr;     ///< [L] original positions, or null: position j
  /// Paged views, in device memory: references to each block of the pool (vLLM's ref_cnt; > 1
  /// is shared), or a bitmap of shared blocks (bit id % 32 of word id / 32). A block the
  /// compaction would write that is shared raises flag_shared_block and nothing moves, as the
  /// CPU's evict refuses it; the kept prefix of each head that stays in place is not written.
  const std::int32_t* block_refcounts = nullptr;
  const std::uint32_t* shared_blocks = nullptr;
  shared_block_check shared_check = shared_block_check::written;
  /// [used blocks of K + used blocks of V with a table of its own + 1] out: the physical
  /// blocks the compaction writes (K's tables, then V's), ascending by logical block per
  /// table, as the CPU's eviction_result::changed_blocks lists them, then one -1 (the count
  /// is device data).
  std::int32_t* changed_blocks = nullptr;
  /// [Hkv] out: head h's trailing block-table entries it no longer uses (per-head tables: its
  /// own; one table: those beyond the longest head), as eviction_result::head_freed_blocks.
  std::int64_t* head_freed_blocks = nullptr;
};

namespace detail {

constexpr int compact_threads = 256;

struct compact_args {
  byte_view k, v;
  const std::int64_t* offsets = nullptr;
  const std::int64_t* indices = nullptr;
  std::int64_t num_heads = 0;
  std::int64_t capacity = 0;
  compact_workspace ws;
  bool v_same_table = false;  // V's block ids are K's: checking K covers V
  bool shared_pool = false;   // K and V in one pool: their ids share one bitmap
  compact_outputs out;
  std::uint32_t* flags = nullptr;
};

/// Records a device-detected problem in the call's private status word (which cancels the
/// moves) and in the caller's flag word.
__device__ __forceinline__ void fail_call(std::uint32_t* status, std::uint32_t* flags, std::uint32_t bits) {
  atomicOr(status, bits);
  raise_flag(flags, bits);
}

__device__ __forceinline__ void compact_fail(const compact_args& a, std::uint32_t bits) {
  fail_call(a.ws.status, a.flags, bits);
}

/// The keep-list's structure (CSR offsets within capacity, indices strictly ascending in
/// [0, num_tokens) per head), checked by a grid-stride loop.
__device__ __forceinline__ void check_keep_list(const std::int64_t* offsets, const std::int64_t* indices,
                                                std::int64_t num_heads, std::int64_t capacity, std::int64_t num_tokens,
                                                std::uint32_t* status, std::uint32_t* flags, std::int64_t gtid,
                                                std::int64_t nthreads) {
  for (std::int64_t h = gtid; h < num_heads; h += nthreads)
    if (!offsets_ok(offsets, h, capacity)) fail_call(status, flags, flag_invalid_keep_list);
  std::int64_t total = offsets[num_heads];
  total = total < 0 ? 0 : (total > capacity ? capacity : total);
  for (std::int64_t e = gtid; e < total; e += nthreads) {
    const std::int64_t h = head_of_entry(offsets, num_heads, e);
    const bool first = entry_starts_head(offsets, h, e);
    if (!entry_ok(indices[e], first ? -1 : indices[e - 1], first, num_tokens))
      fail_call(status, flags, flag_invalid_keep_list);
  }
}

/// Every id of v's table must lie in v's own pool; with a bitmap, an id seen before (by this
/// table or by another table sharing the bitmap) is a duplicate.
__device__ __forceinline__ void check_table(const compact_args& a, const byte_view& v, std::uint32_t* bitmap,
                                            std::int64_t gtid, std::int64_t nthreads) {
  if (v.block_table == nullptr || v.num_tokens == 0) return;  // an empty view may have any geometry
  const std::int64_t used = ceil_div(v.num_tokens, v.block_size);
  for (std::int64_t e = gtid; e < v.num_tables * used; e += nthreads) {
    const std::int64_t id = v.block_table[(e / used) * v.head_table_stride + e % used];  // every head's table
    if (id < 0 || id >= v.num_pool_blocks) {
      compact_fail(a, flag_block_id_out_of_range);
      continue;
    }
    if (bitmap == nullptr) continue;
    const std::uint32_t bit = bitmap_bit(id);
    if (atomicOr(bitmap + bitmap_word(id), bit) & bit) compact_fail(a, flag_duplicate_block);
  }
}

/// Whether pool block `id` is marked shared by the engine (out.block_refcounts above 1, or its
/// bit in out.shared_blocks), as kvevict::evict reads the marks.
__device__ __forceinline__ bool block_marked_shared(const compact_outputs& out, std::int64_t id) {
  return out.block_refcounts != nullptr
             ? out.block_refcounts[id] > 1
             : out.shared_blocks != nullptr && ((out.shared_blocks[id >> 5] >> (id & 31)) & 1u);
}

/// The most tokens a head of the keep-list keeps.
__device__ __forceinline__ std::int64_t longest_kept(const std::int64_t* offsets, std::int64_t num_heads) {
  std::int64_t n = 0;
  for (std::int64_t h = 0; h < num_heads; ++h) {
    const std::int64_t kept = offsets[h + 1] - offsets[h];
    n = kept > n ? kept : n;
  }
  return n;
}

/// eviction_result::head_freed_blocks of `v` (the view an engine reclaims from) holding
/// `tokens` rows before: head h's trailing entries beyond its kept rows (per-head tables) or
/// beyond the longest head's (one table); 0 for a strided view.
__device__ __forceinline__ void write_head_freed_blocks(std::int64_t* out, const std::int64_t* offsets,
                                                        std::int64_t num_heads, const byte_view& v, std::int64_t tokens,
                                                        std::int64_t gtid, std::int64_t nthreads) {
  if (out == nullptr) return;
  const std::int64_t longest = longest_kept(offsets, num_heads);
  for (std::int64_t h = gtid; h < num_heads; h += nthreads) {
    const std::int64_t n = v.head_table_stride != 0 ? offsets[h + 1] - offsets[h] : longest;
    out[h] = v.block_table == nullptr ? 0 : ceil_div(tokens, v.block_size) - ceil_div(n, v.block_size);
  }
}

/// Head h's first row the compaction writes: the kept prefix with keep[i] == i stays in
/// place. Kept indices ascend strictly, so keep[i] - i never decreases: a binary search. The
/// validation runs it while the keep-list is still being checked, so its reads stay within
/// [0, capacity) whatever the offsets say (a bad keep-list is refused anyway).
__device__ __forceinline__ std::int64_t first_written_row(const compact_args& a, std::int64_t h) {
  const auto clamp = [&a](std::int64_t x) { return x < 0 ? std::int64_t{0} : (x > a.capacity ? a.capacity : x); };
  const std::int64_t begin = clamp(a.offsets[h]), end = clamp(a.offsets[h + 1]);
  const std::int64_t* kept = a.indices + begin;
  std::int64_t lo = 0, hi = end > begin ? end - begin : 0;
  while (lo < hi) {
    const std::int64_t mid = lo + (hi - lo) / 2;
    if (kept[mid] == mid) {
      lo = mid + 1;
    } else {
      hi = mid;
    }
  }
  return lo;
}

/// The rows written through table t of v (empty: first == end): head t's with per-head
/// tables, every head's together with one table (the CPU's rows_written).
struct written_range {
  std::int64_t first = 0, end = 0;
};
__device__ __forceinline__ written_range table_rows_written(const compact_args& a, const byte_view& v, std::int64_t t) {
  written_range w{0, 0};
  bool any = false;
  for (std::int64_t h = v.head_table_stride != 0 ? t : 0; h < (v.head_table_stride != 0 ? t + 1 : a.num_heads); ++h) {
    const std::int64_t first = first_written_row(a, h), n = a.offsets[h + 1] - a.offsets[h];
    if (first >= n) continue;
    w.first = any && w.first < first ? w.first : first;
    w.end = any && w.end > n ? w.end : n;
    any = true;
  }
  return w;
}

/// Blocks of table t that the compaction writes: [first, end) in logical blocks.
__device__ __forceinline__ written_range table_blocks_written(const compact_args& a, const byte_view& v,
                                                              std::int64_t t) {
  const written_range r = table_rows_written(a, v, t);
  if (r.end <= r.first) return written_range{0, 0};
  return written_range{r.first / v.block_size, ceil_div(r.end, v.block_size)};
}

/// The paged views whose blocks the compaction writes through their own table: K, and V
/// unless it reads K's table (vLLM), whose blocks K's pass covers.
__device__ __forceinline__ bool writes_own_table(const compact_args& a, const byte_view& v, bool is_values) {
  return v.block_table != nullptr && v.num_tokens > 0 && !(is_values && a.v_same_table);
}

/// Raises flag_shared_block (cancelling the moves) for a written block marked shared. Part of
/// the validation (no kernel that reads the status word may write it): ids outside the pool
/// are skipped (check_table flags them), and the rows come from first_written_row's bounded
/// reads.
__device__ __forceinline__ void check_shared_writes(const compact_args& a, const byte_view& v, bool is_values,
                                                    std::int64_t gtid, std::int64_t nthreads) {
  if ((a.out.block_refcounts == nullptr && a.out.shared_blocks == nullptr) || !writes_own_table(a, v, is_values))
    return;
  const std::int64_t used = ceil_div(v.num_tokens, v.block_size);
  for (std::int64_t e = gtid; e < v.num_tables * used; e += nthreads) {
    const std::int64_t t = e / used, b = e % used;
    if (a.out.shared_check == shared_block_check::written) {
      const written_range blocks = table_blocks_written(a, v, t);
      if (b < blocks.first || b >= blocks.end) continue;
    }
    const std::int64_t id = v.block_table[t * v.head_table_stride + b];
    if (id < 0 || id >= v.num_pool_blocks) continue;
    if (block_marked_shared(a.out, id)) compact_fail(a, flag_shared_block);
  }
}

__device__ __forceinline__ void compact_validate(const compact_args& a) {
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t nthreads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  check_keep_list(a.offsets, a.indices, a.num_heads, a.capacity, a.k.num_tokens, a.ws.status, a.flags, gtid, nthreads);
  check_table(a, a.k, a.ws.key_bitmap, gtid, nthreads);
  // V through K's table (vLLM) repeats K's ids, whose duplicates K's pass has caught; the ids
  // must still lie in V's pool, which may be smaller than K's.
  std::uint32_t* v_bitmap = a.v_same_table ? nullptr : (a.shared_pool ? a.ws.key_bitmap : a.ws.value_bitmap);
  check_table(a, a.v, v_bitmap, gtid, nthreads);
  check_shared_writes(a, a.k, false, gtid, nthreads);
  check_shared_writes(a, a.v, true, gtid, nthreads);
}

template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads) compact_validate_kernel(compact_args a) {
  compact_validate(a);
}

/// The batch: sequence blockIdx.y's descriptor (compact_batch).
template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads) compact_validate_batch_kernel(const compact_args* seqs) {
  compact_validate(seqs[blockIdx.y]);
}

/// The written blocks of table t of v (the tables of K, then V's own, in order) go to
/// out.changed_blocks from the sum of the earlier tables' counts on: a thread per table.
__device__ __forceinline__ std::int64_t changed_blocks_before(const compact_args& a, bool is_values, std::int64_t t) {
  std::int64_t n = 0;
  const auto count = [&](const byte_view& v, std::int64_t tables) {
    for (std::int64_t u = 0; u < tables; ++u) {
      const written_range r = table_blocks_written(a, v, u);
      n += r.end - r.first;
    }
  };
  if (writes_own_table(a, a.k, false)) count(a.k, is_values ? a.k.num_tables : t);
  if (is_values && writes_own_table(a, a.v, true)) count(a.v, t);
  return n;
}

__device__ __forceinline__ void write_changed_blocks(const compact_args& a, std::int64_t gtid, std::int64_t nthreads) {
  if (a.out.changed_blocks == nullptr) return;
  const std::int64_t k_tables = writes_own_table(a, a.k, false) ? a.k.num_tables : 0;
  const std::int64_t v_tables = writes_own_table(a, a.v, true) ? a.v.num_tables : 0;
  for (std::int64_t x = gtid; x < k_tables + v_tables; x += nthreads) {
    const bool is_values = x >= k_tables;
    const byte_view& v = is_values ? a.v : a.k;
    const std::int64_t t = is_values ? x - k_tables : x;
    const written_range r = table_blocks_written(a, v, t);
    std::int32_t* out = a.out.changed_blocks + changed_blocks_before(a, is_values, t);
    for (std::int64_t b = r.first; b < r.end; ++b)
      *out++ = static_cast<std::int32_t>(v.block_table[t * v.head_table_stride + b]);
  }
  if (gtid == 0) a.out.changed_blocks[changed_blocks_before(a, true, v_tables)] = -1;  // the list's end
}

/// Copies row_bytes bytes from src to dst with one warp, `unit` bytes per lane and copy.
__device__ __forceinline__ void warp_copy(unsigned char* dst, const unsigned char* src, std::int64_t row_bytes,
                                          int unit, int lane) {
  switch (unit) {
    case 16:
      for (std::int64_t o = lane * 16; o < row_bytes; o += 32 * 16)
        *reinterpret_cast<uint4*>(dst + o) = *reinterpret_cast<const uint4*>(src + o);
      break;
    case 8:
      for (std::int64_t o = lane * 8; o < row_bytes; o += 32 * 8)
        *reinterpret_cast<uint2*>(dst + o) = *reinterpret_cast<const uint2*>(src + o);
      break;
    case 4:
      for (std::int64_t o = lane * 4; o < row_bytes; o += 32 * 4)
        *reinterpret_cast<unsigned*>(dst + o) = *reinterpret_cast<const unsigned*>(src + o);
      break;
    case 2:
      for (std::int64_t o = lane * 2; o < row_bytes; o += 32 * 2)
        *reinterpret_cast<unsigned short*>(dst + o) = *reinterpret_cast<const unsigned short*>(src + o);
      break;
    default:  // fp8 rows of odd length or alignment
      for (std::int64_t o = lane; o < row_bytes; o += 32) dst[o] = src[o];
      break;
  }
}

__device__ __forceinline__ void copy_element(unsigned char* dst, const unsigned char* src, std::int64_t bytes) {
  if (bytes == 4) {
    *reinterpret_cast<unsigned*>(dst) = *reinterpret_cast<const unsigned*>(src);
  } else if (bytes == 2) {
    *reinterpret_cast<unsigned short*>(dst) = *reinterpret_cast<const unsigned short*>(src);
  } else {
    *dst = *src;
  }
}

/// Moves one view's moving entries between the cache and the staging area. Gather: cache
/// row (h, keep[e]) -> stage[e]; scatter: stage[e] -> cache row (h, i).
__device__ __forceinline__ void move_view(const compact_args& a, const byte_view& v, unsigned char* stage,
                                          std::int64_t total, bool gather) {
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t nthreads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  if (v.unit != 0) {
    const int lane = static_cast<int>(threadIdx.x) & 31;
    for (std::int64_t e = gtid >> 5; e < total; e += nthreads >> 5) {  // a warp per entry
      const std::int64_t h = head_of_entry(a.offsets, a.num_heads, e);
      const std::int64_t i = e - a.offsets[h], src = a.indices[e];
      if (!entry_moves(src, i)) continue;
      unsigned char* row = v.data + v.row_offset(h, gather ? src : i);
      unsigned char* staged = stage + e * v.row_bytes;
      if (gather) {
        warp_copy(staged, row, v.row_bytes, v.unit, lane);
      } else {
        warp_copy(row, staged, v.row_bytes, v.unit, lane);
      }
    }
    return;
  }
  // Channel-strided rows: a thread per (channel, entry), entries fastest. total * head_dim
  // < 2^31 is checked on the host, so 32-bit division is exact.
  const auto t32 = static_cast<unsigned>(total);
  for (std::int64_t x = gtid; x < total * v.head_dim; x += nthreads) {
    const auto c = static_cast<unsigned>(x) / t32, e = static_cast<unsigned>(x) % t32;
    const std::int64_t h = head_of_entry(a.offsets, a.num_heads, e);
    const std::int64_t i = e - a.offsets[h], src = a.indices[e];
    if (!entry_moves(src, i)) continue;
    unsigned char* cell = v.data + v.row_offset(h, gather ? src : i) + c * v.dim_stride;
    unsigned char* staged = stage + e * v.row_bytes + c * v.element_bytes;
    if (gather) {
      copy_element(staged, cell, v.element_bytes);
    } else {
      copy_element(cell, staged, v.element_bytes);
    }
  }
}

/// Head lengths and the kept tokens' original positions (grid-stride), once rows have moved.
__device__ __forceinline__ void write_outputs(const compact_outputs& out, const std::int64_t* offsets,
                                              const std::int64_t* indices, std::int64_t num_heads, std::int64_t total) {
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t nthreads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  if (out.head_lengths != nullptr)
    for (std::int64_t h = gtid; h < num_heads; h += nthreads) out.head_lengths[h] = offsets[h + 1] - offsets[h];
  if (out.positions != nullptr)
    for (std::int64_t e = gtid; e < total; e += nthreads)
      out.positions[e] = out.key_positions != nullptr ? out.key_positions[indices[e]] : indices[e];
}

/// Gather, when validation flagged nothing: the sources staged; scatter: the staged rows
/// written and the outputs with them.
__device__ __forceinline__ void compact_move(const compact_args& a, bool gather) {
  if (*a.ws.status != 0) return;
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t nthreads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  const std::int64_t total = a.offsets[a.num_heads];
  move_view(a, a.k, a.ws.staged_keys, total, gather);
  move_view(a, a.v, a.ws.staged_values, total, gather);
  if (gather) return;
  write_outputs(a.out, a.offsets, a.indices, a.num_heads, total);
  write_changed_blocks(a, gtid, nthreads);
  // K's table is the one an engine reclaims from; V's when K is strided.
  const byte_view& reclaimed = a.k.block_table != nullptr ? a.k : a.v;
  write_head_freed_blocks(a.out.head_freed_blocks, a.offsets, a.num_heads, reclaimed, reclaimed.num_tokens, gtid,
                          nthreads);
}

template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads) compact_move_kernel(compact_args a, bool gather) {
  compact_move(a, gather);
}

/// The batch: sequence blockIdx.y's moves. The sequences share one status word, so a problem
/// in any of them cancels every move of the batch.
template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads) compact_move_batch_kernel(const compact_args* seqs, bool gather) {
  compact_move(seqs[blockIdx.y], gather);
}

/// Host checks of a compaction's keep-list (shape, pointers, 32-bit limits; its contents are
/// checked on the device) and optional outputs.
inline status validate_keep_and_outputs(const const_keep_list_view& keep, std::int64_t num_heads,
                                        std::int64_t num_tokens, std::int64_t widest_head_dim,
                                        const compact_outputs& out, const launch_options& opt, const char* fn) {
  if (keep.num_heads != num_heads)
    return status::error(errc::invalid_shape, fn, "keep.num_heads", "expected %lld, got %lld",
                         static_cast<long long>(num_heads), static_cast<long long>(keep.num_heads));
  if (keep.offsets == nullptr) return status::error(errc::null_pointer, fn, "keep.offsets", "expected non-null");
  if (keep.capacity < 0)
    return status::error(errc::invalid_shape, fn, "keep.capacity", "expected >= 0, got %lld",
                         static_cast<long long>(keep.capacity));
  if (keep.capacity > 0 && keep.indices == nullptr)
    return status::error(errc::null_pointer, fn, "keep.indices", "expected non-null");
  if (!fits_int32(num_tokens) || keep.capacity > int32_limit / widest_head_dim - 1)
    return status::error(errc::overflow, fn, "keep.capacity",
                         "expected capacity * head_dim < 2^31 on the GPU, got %lld * %lld",
                         static_cast<long long>(keep.capacity), static_cast<long long>(widest_head_dim));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(keep.offsets, opt, fn, "keep.offsets"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(keep.indices, opt, fn, "keep.indices"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.head_lengths, opt, fn, "out.head_lengths"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.positions, opt, fn, "out.positions"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.block_refcounts, opt, fn, "out.block_refcounts"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.shared_blocks, opt, fn, "out.shared_blocks"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.changed_blocks, opt, fn, "out.changed_blocks"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(out.head_freed_blocks, opt, fn, "out.head_freed_blocks"));
  return check_device_pointer(out.key_positions, opt, fn, "out.key_positions");
}

/// Clears a status word and up to two block bitmaps on the stream (the start of every
/// compaction).
inline status clear_compaction_words(std::uint32_t* status_word, std::uint32_t* bitmap_a, std::int64_t ids_a,
                                     std::uint32_t* bitmap_b, std::int64_t ids_b, cudaStream_t stream,
                                     const char* fn) noexcept {
  KVEVICT_RETURN_IF_ERROR(
      cuda_status(cudaMemsetAsync(status_word, 0, sizeof(std::uint32_t), stream), fn, "cudaMemsetAsync"));
  if (bitmap_a != nullptr)
    KVEVICT_RETURN_IF_ERROR(
        cuda_status(cudaMemsetAsync(bitmap_a, 0, static_cast<std::size_t>(bitmap_words(ids_a)) * 4, stream), fn,
                    "cudaMemsetAsync"));
  if (bitmap_b != nullptr)
    KVEVICT_RETURN_IF_ERROR(
        cuda_status(cudaMemsetAsync(bitmap_b, 0, static_cast<std::size_t>(bitmap_words(ids_b)) * 4, stream), fn,
                    "cudaMemsetAsync"));
  return status();
}

/// Blocks of a compaction's grid-stride kernels.
template <class KT, class VT>
std::int64_t compact_blocks(const cache_view<KT>& keys, const cache_view<VT>& values,
                            const const_keep_list_view& keep) {
  const std::int64_t widest = keys.head_dim > values.head_dim ? keys.head_dim : values.head_dim;
  return stride_grid(keep.capacity * (widest > 32 ? widest : 32) + keys.num_heads + keys.num_tokens, compact_threads,
                     8192);
}

/// compact's host checks, and its kernel arguments but the workspace (`a->ws`).
template <class KT, class VT>
status prepare_compact(const cache_view<KT>& keys, const cache_view<VT>& values, const const_keep_list_view& keep,
                       const compact_outputs& out, const launch_options& opt, const char* fn, compact_args* a) {
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(keys, opt, fn, "keys"));
  KVEVICT_RETURN_IF_ERROR(detail::validate_device_cache_view(values, opt, fn, "values"));
  if (values.num_heads != keys.num_heads)
    return status::error(errc::invalid_shape, fn, "values.num_heads", "expected keys.num_heads = %lld, got %lld",
                         static_cast<long long>(keys.num_heads), static_cast<long long>(values.num_heads));
  if (values.num_tokens != keys.num_tokens)
    return status::error(errc::invalid_shape, fn, "values.num_tokens", "expected keys.num_tokens = %lld, got %lld",
                         static_cast<long long>(keys.num_tokens), static_cast<long long>(values.num_tokens));
  if (!keys.is_paged() && !values.is_paged() && keys.num_tokens > 0 &&
      static_cast<const void*>(keys.data) == static_cast<const void*>(values.data))
    return status::error(errc::invalid_argument, fn, "values.data",
                         "expected a V cache distinct from the K cache, got the same base pointer");
  const std::int64_t widest = keys.head_dim > values.head_dim ? keys.head_dim : values.head_dim;
  KVEVICT_RETURN_IF_ERROR(
      detail::validate_keep_and_outputs(keep, keys.num_heads, keys.num_tokens, widest, out, opt, fn));
  a->k = detail::make_byte_view(keys);
  a->v = detail::make_byte_view(values);
  a->offsets = keep.offsets;
  a->indices = keep.indices;
  a->num_heads = keep.num_heads;
  a->capacity = keep.capacity;
  const detail::kv_tables rel = detail::relate_tables(keys, values);
  a->v_same_table = rel.same_table;
  a->shared_pool = rel.shared_pool;
  a->out = out;
  a->flags = opt.device_flags;
  return status();
}

}  // namespace detail

/// Bytes of device workspace `compact` needs: the staged rows of keep_capacity entries of K
/// and of V (capacity * (dk * sizeof(KT) + dv * sizeof(VT))), a status word and, for paged
/// views, a bitmap of the pool's blocks.
template <class KT, class VT>
std::size_t compact_workspace_size(const cache_view<KT>& keys, const cache_view<VT>& values,
                                   std::int64_t keep_capacity) noexcept {
  kvevict::detail::arena a;
  detail::compact_workspace w;
  detail::carve_compact_workspace(a, detail::make_compact_dims(keys, values, keep_capacity), &w);
  return a.used();
}

/// Compacts one layer's K and V caches in place by a device keep-list.
///
///   keys:   [Hkv, L, dk] device cache_view (any layout, mutable)
///   values: [Hkv, L, dv] device cache_view (same Hkv and L; own layout and type)
///   keep:   CSR keep-list, offsets [Hkv + 1] and indices [capacity] in device memory;
///           num_heads and capacity are host-known. Contents are checked on the device.
///   ws:     device memory, >= compact_workspace_size(keys, values, keep.capacity)
///   out:    optional device outputs: head lengths [Hkv], positions [capacity]
///
/// Enqueues a memset and three kernels on opt.stream; no synchronisation, no allocation. A
/// bad keep-list, a block id out of range, a block reached twice or (with out.block_refcounts
/// or out.shared_blocks) a shared block it would write sets the matching device flag and
/// leaves the cache and the outputs untouched. K and V must not share
/// elements (the same base pointer is rejected on the host; blocks shared through one
/// pool are caught on the device).
template <class KT, class VT>
status compact(cache_view<KT> keys, cache_view<VT> values, const_keep_list_view keep, workspace_span ws,
               const compact_outputs& out = {}, const launch_options& opt = {}) {
  static_assert(!std::is_const<KT>::value && !std::is_const<VT>::value,
                "kvevict::cuda::compact writes the cache: pass views of mutable elements");
  static constexpr const char* fn = "kvevict::cuda::compact";
  detail::compact_args a;
  KVEVICT_RETURN_IF_ERROR(detail::prepare_compact(keys, values, keep, out, opt, fn, &a));
  const detail::compact_dims dims = detail::make_compact_dims(keys, values, keep.capacity);
  kvevict::detail::arena arena(ws);
  detail::carve_compact_workspace(arena, dims, &a.ws);
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(arena, ws, opt, fn, "compact_workspace_size"));

  // Clear the status word and the bitmaps (the staged rows need no clearing).
  KVEVICT_RETURN_IF_ERROR(detail::clear_compaction_words(a.ws.status, a.ws.key_bitmap, dims.key_bitmap_ids,
                                                         a.ws.value_bitmap, dims.value_bitmap_ids, opt.stream, fn));
  const detail::launch_config cfg{dim3(static_cast<unsigned>(detail::compact_blocks(keys, values, keep))),
                                  dim3(detail::compact_threads), 0, opt.stream};
  KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "compact_validate_kernel", cfg, detail::compact_validate_kernel<>, a));
  KVEVICT_RETURN_IF_ERROR(
      detail::launch(fn, "compact_move_kernel<gather>", cfg, detail::compact_move_kernel<>, a, true));
  return detail::launch(fn, "compact_move_kernel<scatter>", cfg, detail::compact_move_kernel<>, a, false);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_COMPACT_CUH
