// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_COMPACT_INTO_CUH
#define KVEVICT_CUDA_COMPACT_INTO_CUH

// Out-of-place compaction on the GPU (kvevict::evict_into's device counterpart): the kept rows
// of one layer's K and V copied into fresh memory the engine supplies (paged caches: fresh
// blocks through destination block tables), the source left exactly as it was. This is how a
// sequence whose first blocks are shared by prefix caching is compressed on the device: the
// shared blocks keep their content (and their prefix-cache hashes), the sequence switches to
// the destination tables. Afterwards head h's destination rows [0, keep.size(h)) hold its kept
// tokens in ascending order.
//
// Kernels, in stream order (after clearing a status word and the block bitmaps):
//   1. validate the source: keep-list structure (as compact), source block ids in range, and
//      each source block marked in its pool's bitmap (a block the source reaches twice is
//      fine: it is only read);
//   2. validate the destination: block ids in range, each head's kept count within the
//      destination's tokens, and no destination block that the source uses or that another
//      destination row of this call reaches (when source and destination share a pool);
//   3. copy, if the status word is clear: destination row (h, i) <- source row (h, keep[e]);
//      head lengths and positions out.
// No staging (source and destination are disjoint), so one pass moves the rows.

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/compact.cuh"
#include "kvevict/cuda/detail/compact_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// One source-destination pair of views (K, or V) and the bitmap of the destination's pool.
struct copy_pair {
  byte_view src, dst;
  std::uint32_t* bitmap = nullptr;  // null: not paged, or V through K's tables
  bool source_in_pool = false;      // the source's blocks are in that pool: mark them first
};

struct compact_into_args {
  copy_pair k, v;
  const std::int64_t* offsets = nullptr;
  const std::int64_t* indices = nullptr;
  std::int64_t num_heads = 0;
  std::int64_t capacity = 0;
  std::uint32_t* status = nullptr;
  compact_outputs out;
  bool v_same_table = false;  // the destination's V reads K's tables: K's blocks cover it
  std::uint32_t* flags = nullptr;
};

__device__ __forceinline__ void compact_into_fail(const compact_into_args& a, std::uint32_t bits) {
  fail_call(a.status, a.flags, bits);
}

/// The destination blocks written through table t of v: head t's rows [0, keep.size(t)) with
/// per-head tables, [0, longest) with one table (evict_into's rule), in logical blocks.
__device__ __forceinline__ written_range destination_blocks_written(const compact_into_args& a, const byte_view& v,
                                                                    std::int64_t t) {
  std::int64_t n = 0;
  for (std::int64_t h = v.head_table_stride != 0 ? t : 0; h < (v.head_table_stride != 0 ? t + 1 : a.num_heads); ++h) {
    const std::int64_t kept = a.offsets[h + 1] - a.offsets[h];
    n = kept > n ? kept : n;
  }
  return written_range{0, ceil_div(n, v.block_size)};
}

/// Ids of the table entries covering v's num_tokens (every head's table), each in range, and
/// recorded in `bitmap` when given; for the destination (source == false) an id already
/// recorded is a block the source uses or that another destination entry reaches, and one
/// marked shared (out.block_refcounts / shared_blocks) among every table's blocks of the
/// longest head's rows (evict_into's rule; all of the view's under shared_block_check::used)
/// cancels the copy.
__device__ __forceinline__ void check_ids(const compact_into_args& a, const byte_view& v, std::uint32_t* bitmap,
                                          bool source, std::int64_t gtid, std::int64_t nthreads) {
  if (v.block_table == nullptr || v.num_tokens == 0) return;
  const std::int64_t used = ceil_div(v.num_tokens, v.block_size);
  const bool marks = !source && (a.out.block_refcounts != nullptr || a.out.shared_blocks != nullptr);
  const std::int64_t checked = a.out.shared_check == shared_block_check::used
                                   ? used
                                   : (marks ? ceil_div(longest_kept(a.offsets, a.num_heads), v.block_size) : 0);
  for (std::int64_t e = gtid; e < v.num_tables * used; e += nthreads) {
    const std::int64_t id = v.block_table[(e / used) * v.head_table_stride + e % used];
    if (id < 0 || id >= v.num_pool_blocks) {
      compact_into_fail(a, flag_block_id_out_of_range);
      continue;
    }
    if (marks && e % used < checked && block_marked_shared(a.out, id)) compact_into_fail(a, flag_shared_block);
    if (bitmap == nullptr) continue;
    const std::uint32_t bit = bitmap_bit(id);
    const std::uint32_t before = atomicOr(bitmap + bitmap_word(id), bit);
    if (!source && (before & bit)) compact_into_fail(a, flag_duplicate_block);
  }
}

/// out.changed_blocks (the destination blocks written, K's tables then V's own, as
/// evict_into lists them, then one -1) and out.head_freed_blocks (as evict_into reports them: the
/// destination cut to the longest head), after the copy.
__device__ __forceinline__ void write_destination_blocks(const compact_into_args& a, std::int64_t gtid,
                                                         std::int64_t nthreads) {
  const byte_view& kd = a.k.dst;
  const byte_view& vd = a.v.dst;
  const std::int64_t k_tables = kd.block_table != nullptr ? kd.num_tables : 0;
  const std::int64_t v_tables = vd.block_table != nullptr && !a.v_same_table ? vd.num_tables : 0;
  if (a.out.changed_blocks != nullptr) {
    const auto before = [&](std::int64_t x) {  // entries of the tables before table x (K's, then V's)
      std::int64_t n = 0;
      for (std::int64_t u = 0; u < x; ++u)
        n += u < k_tables ? destination_blocks_written(a, kd, u).end
                          : destination_blocks_written(a, vd, u - k_tables).end;
      return n;
    };
    for (std::int64_t x = gtid; x < k_tables + v_tables; x += nthreads) {
      const bool is_values = x >= k_tables;
      const byte_view& v = is_values ? vd : kd;
      const std::int64_t t = is_values ? x - k_tables : x;
      std::int32_t* out = a.out.changed_blocks + before(x);
      for (std::int64_t b = 0; b < destination_blocks_written(a, v, t).end; ++b)
        *out++ = static_cast<std::int32_t>(v.block_table[t * v.head_table_stride + b]);
    }
    if (gtid == 0) a.out.changed_blocks[before(k_tables + v_tables)] = -1;  // the list's end
  }
  // The destination cut to the longest head, as evict_into reports it.
  write_head_freed_blocks(a.out.head_freed_blocks, a.offsets, a.num_heads, kd.block_table != nullptr ? kd : vd,
                          longest_kept(a.offsets, a.num_heads), gtid, nthreads);
}

__device__ __forceinline__ void compact_into_validate(const compact_into_args& a, bool source) {
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t nthreads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  if (source) {
    check_keep_list(a.offsets, a.indices, a.num_heads, a.capacity, a.k.src.num_tokens, a.status, a.flags, gtid,
                    nthreads);
    check_ids(a, a.k.src, a.k.source_in_pool ? a.k.bitmap : nullptr, true, gtid, nthreads);
    check_ids(a, a.v.src, a.v.source_in_pool ? a.v.bitmap : nullptr, true, gtid, nthreads);
    return;
  }
  // A head keeping more rows than the destination holds (offsets are valid when this runs
  // after a clean source pass; otherwise the copy is cancelled anyway).
  for (std::int64_t h = gtid; h < a.num_heads; h += nthreads)
    if (a.offsets[h + 1] - a.offsets[h] > a.k.dst.num_tokens) compact_into_fail(a, flag_capacity_exceeded);
  check_ids(a, a.k.dst, a.k.bitmap, false, gtid, nthreads);
  check_ids(a, a.v.dst, a.v.bitmap, false, gtid, nthreads);
}

template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads) compact_into_validate_kernel(compact_into_args a, bool source) {
  compact_into_validate(a, source);
}

/// The batch (compact_into_batch): sequence blockIdx.y. Every sequence's source blocks are
/// marked (source pass) before any destination block is checked (destination pass).
template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads)
    compact_into_validate_batch_kernel(const compact_into_args* seqs, bool source) {
  compact_into_validate(seqs[blockIdx.y], source);
}

/// Copies one pair's kept rows: a warp per entry for contiguous rows (the narrower unit of the
/// two views), a thread per (channel, entry) otherwise.
__device__ __forceinline__ void copy_pair_rows(const compact_into_args& a, const copy_pair& p, std::int64_t total) {
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const std::int64_t nthreads = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  if (p.src.unit != 0 && p.dst.unit != 0) {
    const int unit = p.src.unit < p.dst.unit ? p.src.unit : p.dst.unit;
    const int lane = static_cast<int>(threadIdx.x) & 31;
    for (std::int64_t e = gtid >> 5; e < total; e += nthreads >> 5) {
      const std::int64_t h = head_of_entry(a.offsets, a.num_heads, e);
      const std::int64_t i = e - a.offsets[h];
      warp_copy(p.dst.data + p.dst.row_offset(h, i), p.src.data + p.src.row_offset(h, a.indices[e]), p.src.row_bytes,
                unit, lane);
    }
    return;
  }
  const auto t32 = static_cast<unsigned>(total);
  for (std::int64_t x = gtid; x < total * p.src.head_dim; x += nthreads) {
    const auto c = static_cast<unsigned>(x) / t32, e = static_cast<unsigned>(x) % t32;
    const std::int64_t h = head_of_entry(a.offsets, a.num_heads, e);
    const std::int64_t i = e - a.offsets[h];
    copy_element(p.dst.data + p.dst.row_offset(h, i) + c * p.dst.dim_stride,
                 p.src.data + p.src.row_offset(h, a.indices[e]) + c * p.src.dim_stride, p.src.element_bytes);
  }
}

__device__ __forceinline__ void compact_into_copy(const compact_into_args& a) {
  if (*a.status != 0) return;
  const std::int64_t total = a.offsets[a.num_heads];
  copy_pair_rows(a, a.k, total);
  copy_pair_rows(a, a.v, total);
  write_outputs(a.out, a.offsets, a.indices, a.num_heads, total);
  const std::int64_t gtid = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  write_destination_blocks(a, gtid, static_cast<std::int64_t>(gridDim.x) * blockDim.x);
}

template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads) compact_into_copy_kernel(compact_into_args a) {
  compact_into_copy(a);
}

template <int Unused = 0>
__global__ void __launch_bounds__(compact_threads) compact_into_copy_batch_kernel(const compact_into_args* seqs) {
  compact_into_copy(seqs[blockIdx.y]);
}

/// Whether two paged views index one pool (same base, block geometry): their ids share a
/// bitmap.
template <class A, class B>
bool same_pool(const cache_view<A>& x, const cache_view<B>& y) noexcept {
  return x.is_paged() && y.is_paged() && sizeof(A) == sizeof(B) &&
         static_cast<const void*>(x.data) == static_cast<const void*>(y.data) && x.block_stride == y.block_stride;
}

struct compact_into_plan {
  std::int64_t key_bits = 0, value_bits = 0;  // bitmap sizes (block ids), 0: none
  bool value_shares_key_bitmap = false;
  bool key_source_in_pool = false, value_source_in_pool = false;
};

/// A bitmap per destination pool catches a destination block reached twice; where the source
/// lives in the same pool, its blocks are marked first, so a destination block the source
/// uses is caught too.
template <class SK, class SV, class DK, class DV>
compact_into_plan plan_bitmaps(const cache_view<SK>& sk, const cache_view<SV>& sv, const cache_view<DK>& dk,
                               const cache_view<DV>& dv) noexcept {
  compact_into_plan p;
  // Each bitmap covers every view whose ids it records: views of one pool may declare
  // different block counts (each view's ids are checked against its own).
  const auto cover = [](std::int64_t* bits, std::int64_t blocks) { *bits = blocks > *bits ? blocks : *bits; };
  if (dk.is_paged()) p.key_bits = dk.num_pool_blocks;
  p.key_source_in_pool = same_pool(sk, dk);
  if (p.key_source_in_pool) cover(&p.key_bits, sk.num_pool_blocks);
  // V reached through K's tables on both sides (vLLM) repeats K's ids: K's check covers it.
  const bool v_through_k = sv.block_table == sk.block_table && dv.block_table == dk.block_table &&
                           sv.block_size == sk.block_size && dv.block_size == dk.block_size;
  if (dv.is_paged() && !v_through_k) {
    p.value_shares_key_bitmap = same_pool(dk, dv);  // TensorRT-LLM: K and V blocks in one pool
    std::int64_t* bits = p.value_shares_key_bitmap ? &p.key_bits : &p.value_bits;
    cover(bits, dv.num_pool_blocks);
    p.value_source_in_pool = same_pool(sv, dv);
    if (p.value_source_in_pool) cover(bits, sv.num_pool_blocks);
  }
  return p;
}

/// Blocks of compact_into's grid-stride kernels.
template <class SK, class SV, class DK>
std::int64_t compact_into_blocks(const cache_view<SK>& src_keys, const cache_view<SV>& src_values,
                                 const cache_view<DK>& dst_keys, const const_keep_list_view& keep) noexcept {
  const std::int64_t widest = src_keys.head_dim > src_values.head_dim ? src_keys.head_dim : src_values.head_dim;
  return stride_grid(
      keep.capacity * (widest > 32 ? widest : 32) + src_keys.num_heads + src_keys.num_tokens + dst_keys.num_tokens,
      compact_threads, 8192);
}

/// compact_into's host checks, its kernel arguments but the status word and bitmaps, and the
/// bitmaps it needs.
template <class SK, class SV, class DK, class DV>
status prepare_compact_into(const cache_view<SK>& src_keys, const cache_view<SV>& src_values,
                            const cache_view<DK>& dst_keys, const cache_view<DV>& dst_values,
                            const const_keep_list_view& keep, const compact_outputs& out, const launch_options& opt,
                            const char* fn, compact_into_args* args, compact_into_plan* plan_out) {
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(src_keys, opt, fn, "src_keys"));
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(src_values, opt, fn, "src_values"));
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(dst_keys, opt, fn, "dst_keys"));
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(dst_values, opt, fn, "dst_values"));
  if (src_values.num_heads != src_keys.num_heads || src_values.num_tokens != src_keys.num_tokens)
    return status::error(errc::invalid_shape, fn, "src_values", "expected src_keys' [%lld heads, %lld tokens]",
                         static_cast<long long>(src_keys.num_heads), static_cast<long long>(src_keys.num_tokens));
  if (dst_keys.num_heads != src_keys.num_heads || dst_keys.head_dim != src_keys.head_dim)
    return status::error(errc::invalid_shape, fn, "dst_keys", "expected the source's [%lld heads, d = %lld]",
                         static_cast<long long>(src_keys.num_heads), static_cast<long long>(src_keys.head_dim));
  if (dst_values.num_heads != src_values.num_heads || dst_values.head_dim != src_values.head_dim ||
      dst_values.num_tokens != dst_keys.num_tokens)
    return status::error(errc::invalid_shape, fn, "dst_values",
                         "expected the source's [%lld heads, d = %lld] and dst_keys' %lld tokens",
                         static_cast<long long>(src_values.num_heads), static_cast<long long>(src_values.head_dim),
                         static_cast<long long>(dst_keys.num_tokens));
  if ((!dst_keys.is_paged() && static_cast<const void*>(dst_keys.data) == static_cast<const void*>(src_keys.data)) ||
      (!dst_values.is_paged() &&
       static_cast<const void*>(dst_values.data) == static_cast<const void*>(src_values.data)))
    return status::error(errc::invalid_argument, fn, "dst_keys.data",
                         "expected fresh memory, got the source's base pointer (use compact for in place)");
  const std::int64_t widest = src_keys.head_dim > src_values.head_dim ? src_keys.head_dim : src_values.head_dim;
  KVEVICT_RETURN_IF_ERROR(
      validate_keep_and_outputs(keep, src_keys.num_heads, src_keys.num_tokens, widest, out, opt, fn));

  const compact_into_plan plan = plan_bitmaps(src_keys, src_values, dst_keys, dst_values);
  compact_into_args& a = *args;
  a.k.src = make_byte_view(src_keys);
  a.k.dst = make_byte_view(dst_keys);
  a.k.source_in_pool = plan.key_source_in_pool;
  a.v.src = make_byte_view(src_values);
  a.v.dst = make_byte_view(dst_values);
  a.v.source_in_pool = plan.value_source_in_pool;
  a.offsets = keep.offsets;
  a.indices = keep.indices;
  a.num_heads = keep.num_heads;
  a.capacity = keep.capacity;
  a.out = out;
  a.v_same_table = relate_tables(dst_keys, dst_values).same_table;
  a.flags = opt.device_flags;

  *plan_out = plan;
  return status();
}

}  // namespace detail

/// Bytes of device workspace `compact_into` needs: a status word and a bitmap of each paged
/// destination pool's blocks.
template <class SK, class SV, class DK, class DV>
std::size_t compact_into_workspace_size(const cache_view<SK>& src_keys, const cache_view<SV>& src_values,
                                        const cache_view<DK>& dst_keys, const cache_view<DV>& dst_values) noexcept {
  const detail::compact_into_plan p = detail::plan_bitmaps(src_keys, src_values, dst_keys, dst_values);
  kvevict::detail::arena a;
  (void)a.take<std::uint32_t>(1);
  if (p.key_bits > 0) (void)a.take<std::uint32_t>(detail::bitmap_words(p.key_bits));
  if (p.value_bits > 0) (void)a.take<std::uint32_t>(detail::bitmap_words(p.value_bits));
  return a.used();
}

/// Copies the kept rows of one layer's K and V into destination views on the GPU, leaving the
/// source as it was.
///
///   src_keys, src_values: [Hkv, L, dk] / [Hkv, L, dv] device views of the layer (read only)
///   dst_keys, dst_values: [Hkv, L', dk] / [Hkv, L', dv] device views of fresh memory, same
///                         element types and head_dims, L' >= every head's kept count (checked
///                         on the device); paged: tables of fresh blocks, in the source's pool
///                         or another
///   keep:                 CSR keep-list over the source's L tokens (device), as for compact
///   ws:                   device memory, >= compact_into_workspace_size(...)
///   out:                  optional device head lengths [Hkv], positions [capacity]
///
/// Enqueues up to three memsets and three kernels on opt.stream. A bad keep-list, a block id
/// out of range, a destination block the source uses or that two destination rows reach, a
/// destination block marked shared by out.block_refcounts / shared_blocks (evict_into's rule),
/// or a head keeping more rows than the destination holds sets the matching device flag and
/// writes nothing (destination and outputs untouched); the source is never written.
template <class SK, class SV, class DK, class DV>
status compact_into(cache_view<SK> src_keys, cache_view<SV> src_values, cache_view<DK> dst_keys,
                    cache_view<DV> dst_values, const_keep_list_view keep, workspace_span ws,
                    const compact_outputs& out = {}, const launch_options& opt = {}) {
  static_assert(!std::is_const<DK>::value && !std::is_const<DV>::value,
                "kvevict::cuda::compact_into writes the destination: pass views of mutable elements");
  static_assert(std::is_same<std::remove_const_t<SK>, DK>::value && std::is_same<std::remove_const_t<SV>, DV>::value,
                "kvevict::cuda::compact_into copies elements: destination and source have the same element types");
  static constexpr const char* fn = "kvevict::cuda::compact_into";
  detail::compact_into_args a;
  detail::compact_into_plan plan;
  KVEVICT_RETURN_IF_ERROR(
      detail::prepare_compact_into(src_keys, src_values, dst_keys, dst_values, keep, out, opt, fn, &a, &plan));
  kvevict::detail::arena arena(ws);
  a.status = arena.take<std::uint32_t>(1);
  std::uint32_t* key_bitmap =
      plan.key_bits > 0 ? arena.take<std::uint32_t>(detail::bitmap_words(plan.key_bits)) : nullptr;
  std::uint32_t* value_bitmap =
      plan.value_bits > 0 ? arena.take<std::uint32_t>(detail::bitmap_words(plan.value_bits)) : nullptr;
  KVEVICT_RETURN_IF_ERROR(detail::check_workspace(arena, ws, opt, fn, "compact_into_workspace_size"));
  a.k.bitmap = key_bitmap;
  a.v.bitmap = plan.value_shares_key_bitmap ? key_bitmap : value_bitmap;
  KVEVICT_RETURN_IF_ERROR(detail::clear_compaction_words(a.status, key_bitmap, plan.key_bits, value_bitmap,
                                                         plan.value_bits, opt.stream, fn));
  const detail::launch_config cfg{
      dim3(static_cast<unsigned>(detail::compact_into_blocks(src_keys, src_values, dst_keys, keep))),
      dim3(detail::compact_threads), 0, opt.stream};
  KVEVICT_RETURN_IF_ERROR(
      detail::launch(fn, "compact_into_validate_kernel<source>", cfg, detail::compact_into_validate_kernel<>, a, true));
  KVEVICT_RETURN_IF_ERROR(detail::launch(fn, "compact_into_validate_kernel<destination>", cfg,
                                         detail::compact_into_validate_kernel<>, a, false));
  return detail::launch(fn, "compact_into_copy_kernel", cfg, detail::compact_into_copy_kernel<>, a);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_COMPACT_INTO_CUH
