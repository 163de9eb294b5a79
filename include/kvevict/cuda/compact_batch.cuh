// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_COMPACT_BATCH_CUH
#define KVEVICT_CUDA_COMPACT_BATCH_CUH

// In-place compaction of every sequence of a batch for one layer in one launch per kernel:
// compact's kernels with the sequence as blockIdx.y, reading their arguments from a
// descriptor array copied once from the caller's staging buffer. A memset, a copy and three
// kernels per call whatever the batch size, instead of four stream operations per sequence.
//
// All or nothing, as one call of compact: the sequences share one status word, so a problem
// the device finds in any of them (a bad keep-list, a block id outside the pool, a physical
// block reached twice -- within a sequence or by two sequences) moves no row of any sequence.
// Paged views of a batch live in the layer's pool (one K pool, one V pool, possibly the same):
// one bitmap per pool sees every sequence's blocks, so a block two sequences share (prefix
// caching) is refused here; such sequences compact into fresh blocks: compact_into_batch,
// compact_into's kernels batched the same way. There the sources may share blocks (they are
// only read); every source block is marked before any destination is checked, so a
// destination block that any sequence of the batch reads, or that two destinations reach,
// cancels the batch.

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/compact.cuh"
#include "kvevict/cuda/compact_into.cuh"
#include "kvevict/cuda/detail/launch.cuh"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/error.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {

/// One sequence of a batched compaction: device views and keep-list, as compact takes them.
/// Every sequence of a batch has the layer's Hkv, dk and dv; L varies.
template <class KT, class VT>
struct compaction_sequence {
  cache_view<KT> keys;        ///< [Hkv, L_s, dk] mutable
  cache_view<VT> values;      ///< [Hkv, L_s, dv] mutable
  const_keep_list_view keep;  ///< offsets [Hkv + 1], indices [capacity], device
  compact_outputs out;        ///< optional: head lengths [Hkv], positions [capacity]
};

namespace detail {

constexpr std::size_t compact_batch_align = 256;

inline std::size_t compact_round_up(std::size_t n) noexcept {
  return (n + compact_batch_align - 1) / compact_batch_align * compact_batch_align;
}

/// The batch's workspace: descriptors, then the shared words (status and the pools' bitmaps,
/// cleared by one memset), then each sequence's staged rows.
struct compact_batch_layout {
  std::size_t words = 0;       // offset of the status word
  std::size_t word_bytes = 0;  // status word and bitmaps
  std::size_t rows = 0;        // offset of the first sequence's staged rows
  std::int64_t key_ids = 0, value_ids = 0;
};

inline compact_batch_layout compact_batch_plan(std::int64_t n, std::int64_t key_ids, std::int64_t value_ids) noexcept {
  compact_batch_layout l;
  l.key_ids = key_ids;
  l.value_ids = value_ids;
  l.words = compact_round_up(static_cast<std::size_t>(n < 0 ? 0 : n) * sizeof(compact_args));
  l.word_bytes = 4u * static_cast<std::size_t>(1 + (key_ids > 0 ? bitmap_words(key_ids) : 0) +
                                               (value_ids > 0 ? bitmap_words(value_ids) : 0));
  l.rows = l.words + compact_round_up(l.word_bytes);
  return l;
}

inline std::size_t staged_bytes(const compact_dims& d) noexcept {
  using kvevict::detail::saturating_mul;
  const auto k = static_cast<std::size_t>(saturating_mul(d.capacity, d.key_row_bytes));
  const auto v = static_cast<std::size_t>(saturating_mul(d.capacity, d.value_row_bytes));
  return compact_round_up(k) + compact_round_up(v);
}

/// A non-paged view's base pointer, for the host's check that no memory a call writes is
/// another view's (sources of compact_into_batch only read: they may share).
struct base_entry {
  const void* data;
  std::int64_t seq;
  const char* field;
  bool writes;
};

/// Refuses a base pointer shared by two entries of which one is written (sorted in place:
/// n log n, no allocation). The error names the last sequence's written view on a shared
/// pointer and the first other view there; of several shared pointers, the one whose named
/// view comes first (sequence, then field name), whatever the addresses.
inline status check_distinct_bases(base_entry* bases, std::int64_t nb, const char* fn) {
  std::sort(bases, bases + nb, [](const base_entry& x, const base_entry& y) {
    return std::less<const void*>()(x.data, y.data) || (x.data == y.data && x.seq < y.seq);
  });
  std::int64_t named = -1, other = -1;
  for (std::int64_t i = 0; i < nb;) {
    std::int64_t end = i + 1, writer = bases[i].writes ? i : -1;  // the group's last written entry
    for (; end < nb && bases[end].data == bases[i].data; ++end)
      if (bases[end].writes) writer = end;
    if (end - i > 1 && writer >= 0 &&
        (named < 0 || bases[writer].seq < bases[named].seq ||
         (bases[writer].seq == bases[named].seq && std::strcmp(bases[writer].field, bases[named].field) < 0))) {
      named = writer;
      other = writer == i ? i + 1 : i;
    }
    i = end;
  }
  if (named < 0) return status();
  return status::error(errc::invalid_argument, fn, kvevict::detail::io_name(bases[named].seq, bases[named].field),
                       "expected memory of its own, got the base pointer of seqs[%lld].%s",
                       static_cast<long long>(bases[other].seq), bases[other].field);
}

/// Which pool a batch's paged views live in (the first paged view's), and whether `v` is in it.
struct pool_id {
  const void* data = nullptr;
  std::int64_t blocks = 0, block_stride = 0;
  std::size_t element_bytes = 0;
  template <class T>
  status admit(const cache_view<T>& v, std::int64_t s, const char* field, const char* fn) noexcept {
    if (!v.is_paged() || v.num_tokens == 0) return status();
    if (data == nullptr) {
      data = v.data;
      blocks = v.num_pool_blocks;
      block_stride = v.block_stride;
      element_bytes = sizeof(T);
      return status();
    }
    // The whole geometry: the bitmaps' sharing (relate_tables, same_pool) compares it too.
    if (static_cast<const void*>(v.data) != data || v.num_pool_blocks != blocks || v.block_stride != block_stride ||
        sizeof(T) != element_bytes)
      return status::error(errc::invalid_argument, fn, kvevict::detail::io_name(s, field),
                           "expected the batch's one pool (the first paged view's base, block count and block "
                           "stride: every paged view of a batch in the layer's pool)");
    return status();
  }
};

}  // namespace detail

namespace detail {

/// A validated batched compaction: its descriptors in the staging buffer, its workspace
/// carved (descriptors at `base`, then the status word and bitmaps), its grid.
struct batch_launch {
  unsigned char* base = nullptr;
  std::uint32_t* words = nullptr;
  std::size_t word_bytes = 0;
  const void* staging = nullptr;
  std::size_t desc_bytes = 0;
  std::int64_t blocks = 1;
  std::int64_t n = 0;
};

/// The enqueue both batched compactions begin with: the status word and bitmaps cleared, the
/// descriptors copied from the staging buffer.
inline status enqueue_batch_words(const batch_launch& l, const launch_options& opt, const char* fn) {
  KVEVICT_RETURN_IF_ERROR(cuda_status(cudaMemsetAsync(l.words, 0, l.word_bytes, opt.stream), fn, "cudaMemsetAsync"));
  return cuda_status(cudaMemcpyAsync(l.base, l.staging, l.desc_bytes, cudaMemcpyHostToDevice, opt.stream), fn,
                     "cudaMemcpyAsync");
}

/// The status word a batch starts from: 0, or a caller's word (device memory) holding what
/// the stream found before the compaction -- non-zero cancels it (the compressor's checks of
/// device data that the CPU refuses, such as DapQ's pseudo-token positions).
inline status start_status(const batch_launch& l, const std::uint32_t* cancel, const launch_options& opt,
                           const char* fn) {
  if (cancel == nullptr)
    return cuda_status(cudaMemsetAsync(l.words, 0, sizeof(std::uint32_t), opt.stream), fn, "cudaMemsetAsync");
  return cuda_status(cudaMemcpyAsync(l.words, cancel, sizeof(std::uint32_t), cudaMemcpyDeviceToDevice, opt.stream), fn,
                     "cudaMemcpyAsync");
}

/// Grid (blocks, sequences): every sequence's kernels run as blockIdx.y.
inline launch_config batch_config(const batch_launch& l, const launch_options& opt) noexcept {
  return {dim3(static_cast<unsigned>(l.blocks), static_cast<unsigned>(l.n)), dim3(compact_threads), 0, opt.stream};
}

/// Several prepared batches of the same sequences over one workspace (a layer's pools each:
/// the per-sequence scope compacts every layer with one keep set) as one all-or-nothing
/// compaction. They share the status word (same workspace, same sequence count: the same
/// address), cleared once; each batch's bitmaps are cleared, its descriptors copied and its
/// validation run before any batch moves a row; then, in order, each batch's descriptors are
/// copied again and its rows moved. A problem the device finds in any layer moves nothing in
/// any layer.
template <class Validate, class Move>
status enqueue_batches(const batch_launch* l, std::int64_t count, const std::uint32_t* cancel,
                       const launch_options& opt, const char* fn, Validate validate, Move move) {
  if (count < 1 || l[0].n == 0) return status();
  for (std::int64_t i = 1; i < count; ++i)
    if (l[i].words != l[0].words || l[i].n != l[0].n)
      return status::error(errc::invalid_state, fn, "ws", "the layers' batches do not share one status word");
  KVEVICT_RETURN_IF_ERROR(start_status(l[0], cancel, opt, fn));
  const auto copy = [&](const batch_launch& b) {
    return cuda_status(cudaMemcpyAsync(b.base, b.staging, b.desc_bytes, cudaMemcpyHostToDevice, opt.stream), fn,
                       "cudaMemcpyAsync");
  };
  for (std::int64_t i = 0; i < count; ++i) {
    const batch_launch& b = l[i];
    if (b.word_bytes > sizeof(std::uint32_t))
      KVEVICT_RETURN_IF_ERROR(cuda_status(
          cudaMemsetAsync(b.words + 1, 0, b.word_bytes - sizeof(std::uint32_t), opt.stream), fn, "cudaMemsetAsync"));
    KVEVICT_RETURN_IF_ERROR(copy(b));
    KVEVICT_RETURN_IF_ERROR(validate(b));
  }
  for (std::int64_t i = 0; i < count; ++i) {  // in layer order, as the CPU compressor compacts them
    KVEVICT_RETURN_IF_ERROR(copy(l[i]));
    KVEVICT_RETURN_IF_ERROR(move(l[i]));
  }
  return status();
}

}  // namespace detail

/// Host staging bytes `compact_batch` needs for n sequences (the descriptors it copies).
inline std::size_t compact_batch_staging_size(std::int64_t num_sequences) noexcept {
  return static_cast<std::size_t>(num_sequences < 0 ? 0 : num_sequences) * sizeof(detail::compact_args);
}

/// Device workspace for up to `max_sequences` sequences whose views have the layouts, types
/// and pools of `keys` and `values`, with keep-lists of up to `max_keep_capacity` entries.
template <class KT, class VT>
std::size_t compact_batch_workspace_size(const cache_view<KT>& keys, const cache_view<VT>& values,
                                         std::int64_t max_sequences, std::int64_t max_keep_capacity) noexcept {
  const detail::compact_dims d = detail::make_compact_dims(keys, values, max_keep_capacity);
  const detail::compact_batch_layout l =
      detail::compact_batch_plan(max_sequences, d.key_bitmap_ids, d.value_bitmap_ids);
  return detail::compact_batch_align - 1 + l.rows +
         static_cast<std::size_t>(max_sequences < 0 ? 0 : max_sequences) * detail::staged_bytes(d);
}

namespace detail {

/// compact_batch's host half: every check, the descriptors written to the staging buffer and
/// the workspace carved; nothing enqueued (a caller with more to validate, such as the
/// compressor, enqueues once everything passed).
template <class KT, class VT>
status prepare_compact_batch(const compaction_sequence<KT, VT>* seqs, std::int64_t n, workspace_span ws, void* staging,
                             std::size_t staging_bytes, const launch_options& opt, const char* fn, batch_launch* out) {
  static_assert(!std::is_const<KT>::value && !std::is_const<VT>::value,
                "kvevict::cuda::compact_batch writes the cache: pass views of mutable elements");
  static_assert(std::is_trivially_copyable<detail::compact_args>::value, "descriptors are copied as bytes");
  static_assert(sizeof(detail::compact_args) >= 2 * sizeof(detail::base_entry), "staging holds the base check");
  static_assert(alignof(detail::compact_args) >= alignof(detail::base_entry), "staging holds the base check");
  *out = batch_launch{};
  KVEVICT_RETURN_IF_ERROR(detail::check_batch_count(seqs, n, fn));
  if (n == 0) return status();
  const std::size_t desc_bytes = compact_batch_staging_size(n);
  KVEVICT_RETURN_IF_ERROR(detail::check_staging(staging, staging_bytes, desc_bytes, alignof(detail::compact_args), fn,
                                                "compact_batch_staging_size"));

  // Rows of non-paged views (own buffers) must not be another sequence's: equal bases are
  // refused. Checked first, in the staging buffer the descriptors then overwrite.
  auto* bases = static_cast<detail::base_entry*>(staging);
  std::int64_t nb = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    if (!seqs[s].keys.is_paged() && seqs[s].keys.num_tokens > 0)
      bases[nb++] = {seqs[s].keys.data, s, "keys.data", true};
    if (!seqs[s].values.is_paged() && seqs[s].values.num_tokens > 0)
      bases[nb++] = {seqs[s].values.data, s, "values.data", true};
  }
  KVEVICT_RETURN_IF_ERROR(detail::check_distinct_bases(bases, nb, fn));

  // Each sequence as compact checks it, one layer's shapes, one pool per side.
  const std::int64_t hkv = seqs[0].keys.num_heads, dk = seqs[0].keys.head_dim, dv = seqs[0].values.head_dim;
  detail::pool_id key_pool, value_pool;
  std::int64_t key_ids = 0, value_ids = 0, blocks = 1;
  std::size_t rows_bytes = 0;
  auto* desc = static_cast<detail::compact_args*>(staging);
  for (std::int64_t s = 0; s < n; ++s) {
    const compaction_sequence<KT, VT>& q = seqs[s];
    const detail::batch_field layer[] = {{"keys.num_heads", q.keys.num_heads, hkv},
                                         {"keys.head_dim", q.keys.head_dim, dk},
                                         {"values.head_dim", q.values.head_dim, dv}};
    KVEVICT_RETURN_IF_ERROR(detail::check_batch_fields(s, layer, fn));
    KVEVICT_RETURN_IF_ERROR(kvevict::detail::in_sequence(
        detail::prepare_compact(q.keys, q.values, q.keep, q.out, opt, fn, &desc[s]), s, fn));
    KVEVICT_RETURN_IF_ERROR(key_pool.admit(q.keys, s, "keys.data", fn));
    KVEVICT_RETURN_IF_ERROR(value_pool.admit(q.values, s, "values.data", fn));
    const detail::compact_dims d = detail::make_compact_dims(q.keys, q.values, q.keep.capacity);
    if (q.keys.num_tokens > 0) {  // an empty sequence's ids are never checked: no bitmap for them
      key_ids = d.key_bitmap_ids > key_ids ? d.key_bitmap_ids : key_ids;
      value_ids = d.value_bitmap_ids > value_ids ? d.value_bitmap_ids : value_ids;
    }
    rows_bytes += detail::staged_bytes(d);
    const std::int64_t b = detail::compact_blocks(q.keys, q.values, q.keep);
    blocks = b > blocks ? b : blocks;
  }
  const detail::compact_batch_layout l = detail::compact_batch_plan(n, key_ids, value_ids);
  const std::size_t need = l.rows + rows_bytes;
  const detail::aligned_workspace aws = detail::align_workspace(ws, detail::compact_batch_align);
  if (aws.base == nullptr || aws.size < need)
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes for this batch (compact_batch_workspace_size), got %zu",
                         need + detail::compact_batch_align - 1, ws.data == nullptr ? std::size_t{0} : ws.size);
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(ws.data, opt, fn, "ws"));

  // Each descriptor's slices of the workspace.
  unsigned char* base = aws.base;
  auto* status_word = reinterpret_cast<std::uint32_t*>(base + l.words);
  std::uint32_t* key_bitmap = key_ids > 0 ? status_word + 1 : nullptr;
  std::uint32_t* value_bitmap =
      value_ids > 0 ? status_word + 1 + (key_ids > 0 ? detail::bitmap_words(key_ids) : 0) : nullptr;
  std::size_t offset = l.rows;
  for (std::int64_t s = 0; s < n; ++s) {
    const compaction_sequence<KT, VT>& q = seqs[s];
    detail::compact_args& a = desc[s];
    const detail::compact_dims d = detail::make_compact_dims(q.keys, q.values, q.keep.capacity);
    a.ws.status = status_word;
    a.ws.key_bitmap = key_bitmap;
    a.ws.value_bitmap = value_bitmap;
    a.ws.staged_keys = base + offset;
    a.ws.staged_values =
        base + offset + detail::compact_round_up(static_cast<std::size_t>(d.capacity * d.key_row_bytes));
    offset += detail::staged_bytes(d);
  }

  *out = batch_launch{base, status_word, l.word_bytes, staging, desc_bytes, blocks, n};
  return status();
}

inline status validate_compact_batch(const batch_launch& l, const launch_options& opt, const char* fn) {
  return launch(fn, "compact_validate_batch_kernel", batch_config(l, opt), compact_validate_batch_kernel<>,
                reinterpret_cast<const compact_args*>(l.base));
}
inline status move_compact_batch(const batch_launch& l, const launch_options& opt, const char* fn) {
  const auto* dev = reinterpret_cast<const compact_args*>(l.base);
  const launch_config cfg = batch_config(l, opt);
  KVEVICT_RETURN_IF_ERROR(launch(fn, "compact_move_batch_kernel<gather>", cfg, compact_move_batch_kernel<>, dev, true));
  return launch(fn, "compact_move_batch_kernel<scatter>", cfg, compact_move_batch_kernel<>, dev, false);
}

/// compact_batch's device half: a memset, the descriptor copy and three kernels (and, with a
/// cancel word, its copy into the status word).
inline status enqueue_compact_batch(const batch_launch& l, const launch_options& opt, const char* fn,
                                    const std::uint32_t* cancel = nullptr) {
  if (l.n == 0) return status();
  KVEVICT_RETURN_IF_ERROR(enqueue_batch_words(l, opt, fn));
  if (cancel != nullptr) KVEVICT_RETURN_IF_ERROR(start_status(l, cancel, opt, fn));
  KVEVICT_RETURN_IF_ERROR(validate_compact_batch(l, opt, fn));
  return move_compact_batch(l, opt, fn);
}

/// Prepared in-place batches of every layer as one all-or-nothing compaction (enqueue_batches).
inline status enqueue_compact_batches(const batch_launch* l, std::int64_t count, const std::uint32_t* cancel,
                                      const launch_options& opt, const char* fn) {
  if (count == 1) return enqueue_compact_batch(l[0], opt, fn, cancel);
  return enqueue_batches(
      l, count, cancel, opt, fn, [&](const batch_launch& b) { return validate_compact_batch(b, opt, fn); },
      [&](const batch_launch& b) { return move_compact_batch(b, opt, fn); });
}

}  // namespace detail

/// Compacts every sequence of a batch in place, for one layer, as compact does for one.
///
///   seqs:    [n] host array of compaction_sequence (device views and keep-lists)
///   ws:      device memory, >= compact_batch_workspace_size(a sequence's views, n, the
///            largest keep capacity)
///   staging: host memory, >= compact_batch_staging_size(n) bytes; page-locked for the copy
///            to be asynchronous; kept alive and unchanged until the stream passes this call
///
/// Every sequence is validated on the host first (errors name "seqs[i]...."), and nothing
/// is enqueued if one fails. Then a memset, one copy and three kernels. A problem found on
/// the device in any sequence raises its flag and moves nothing in any sequence.
template <class KT, class VT>
status compact_batch(const compaction_sequence<KT, VT>* seqs, std::int64_t n, workspace_span ws, void* staging,
                     std::size_t staging_bytes, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::compact_batch";
  detail::batch_launch l;
  KVEVICT_RETURN_IF_ERROR(detail::prepare_compact_batch(seqs, n, ws, staging, staging_bytes, opt, fn, &l));
  return detail::enqueue_compact_batch(l, opt, fn);
}

/// One sequence of a batched out-of-place compaction: as compact_into takes it.
template <class KT, class VT>
struct compaction_into_sequence {
  cache_view<const KT> src_keys;    ///< [Hkv, L_s, dk] read only
  cache_view<const VT> src_values;  ///< [Hkv, L_s, dv] read only
  cache_view<KT> dst_keys;          ///< [Hkv, L'_s, dk] fresh memory or blocks
  cache_view<VT> dst_values;        ///< [Hkv, L'_s, dv]
  const_keep_list_view keep;        ///< over the source's L_s tokens
  compact_outputs out;
};

/// Host staging bytes `compact_into_batch` needs for n sequences.
inline std::size_t compact_into_batch_staging_size(std::int64_t num_sequences) noexcept {
  return static_cast<std::size_t>(num_sequences < 0 ? 0 : num_sequences) * sizeof(detail::compact_into_args);
}

/// Device workspace for up to `max_sequences` sequences whose views are in the pools of
/// these (a sequence's views: the bitmaps cover their pools' blocks).
template <class KT, class VT>
std::size_t compact_into_batch_workspace_size(const cache_view<const KT>& src_keys,
                                              const cache_view<const VT>& src_values, const cache_view<KT>& dst_keys,
                                              const cache_view<VT>& dst_values, std::int64_t max_sequences) noexcept {
  const detail::compact_into_plan p = detail::plan_bitmaps(src_keys, src_values, dst_keys, dst_values);
  const auto descriptors =
      static_cast<std::size_t>(max_sequences < 0 ? 0 : max_sequences) * sizeof(detail::compact_into_args);
  return detail::compact_batch_align - 1 + detail::compact_round_up(descriptors) +
         4u * static_cast<std::size_t>(1 + (p.key_bits > 0 ? detail::bitmap_words(p.key_bits) : 0) +
                                       (p.value_bits > 0 ? detail::bitmap_words(p.value_bits) : 0));
}

namespace detail {

/// compact_into_batch's host half (see prepare_compact_batch).
template <class KT, class VT>
status prepare_compact_into_batch(const compaction_into_sequence<KT, VT>* seqs, std::int64_t n, workspace_span ws,
                                  void* staging, std::size_t staging_bytes, const launch_options& opt, const char* fn,
                                  batch_launch* out) {
  *out = batch_launch{};
  static_assert(!std::is_const<KT>::value && !std::is_const<VT>::value,
                "kvevict::cuda::compact_into_batch: name the element types without const");
  static_assert(std::is_trivially_copyable<detail::compact_into_args>::value, "descriptors are copied as bytes");
  KVEVICT_RETURN_IF_ERROR(detail::check_batch_count(seqs, n, fn));
  if (n == 0) return status();
  const std::size_t desc_bytes = compact_into_batch_staging_size(n);
  KVEVICT_RETURN_IF_ERROR(detail::check_staging(staging, staging_bytes, desc_bytes, alignof(detail::compact_into_args),
                                                fn, "compact_into_batch_staging_size"));

  // Destinations in memory of their own (non-paged) must not be another sequence's destination
  // or source: checked first, in the staging buffer the descriptors then overwrite.
  static_assert(sizeof(detail::compact_into_args) >= 4 * sizeof(detail::base_entry), "staging holds the check");
  static_assert(alignof(detail::compact_into_args) >= alignof(detail::base_entry), "staging holds the check");
  auto* bases = static_cast<detail::base_entry*>(staging);
  std::int64_t nb = 0;
  for (std::int64_t s = 0; s < n; ++s) {
    const compaction_into_sequence<KT, VT>& q = seqs[s];
    if (!q.src_keys.is_paged() && q.src_keys.num_tokens > 0) bases[nb++] = {q.src_keys.data, s, "src_keys.data", false};
    if (!q.src_values.is_paged() && q.src_values.num_tokens > 0)
      bases[nb++] = {q.src_values.data, s, "src_values.data", false};
    if (!q.dst_keys.is_paged() && q.dst_keys.num_tokens > 0) bases[nb++] = {q.dst_keys.data, s, "dst_keys.data", true};
    if (!q.dst_values.is_paged() && q.dst_values.num_tokens > 0)
      bases[nb++] = {q.dst_values.data, s, "dst_values.data", true};
  }
  KVEVICT_RETURN_IF_ERROR(detail::check_distinct_bases(bases, nb, fn));

  const std::int64_t hkv = seqs[0].src_keys.num_heads, dk = seqs[0].src_keys.head_dim, dv = seqs[0].src_values.head_dim;
  detail::pool_id key_pool, value_pool;
  std::int64_t key_bits = 0, value_bits = 0, blocks = 1;
  auto* desc = static_cast<detail::compact_into_args*>(staging);
  for (std::int64_t s = 0; s < n; ++s) {
    const compaction_into_sequence<KT, VT>& q = seqs[s];
    const detail::batch_field layer[] = {{"src_keys.num_heads", q.src_keys.num_heads, hkv},
                                         {"src_keys.head_dim", q.src_keys.head_dim, dk},
                                         {"src_values.head_dim", q.src_values.head_dim, dv}};
    KVEVICT_RETURN_IF_ERROR(detail::check_batch_fields(s, layer, fn));
    detail::compact_into_plan plan;
    KVEVICT_RETURN_IF_ERROR(
        kvevict::detail::in_sequence(detail::prepare_compact_into(q.src_keys, q.src_values, q.dst_keys, q.dst_values,
                                                                  q.keep, q.out, opt, fn, &desc[s], &plan),
                                     s, fn));
    KVEVICT_RETURN_IF_ERROR(key_pool.admit(q.dst_keys, s, "dst_keys.data", fn));
    KVEVICT_RETURN_IF_ERROR(value_pool.admit(q.dst_values, s, "dst_values.data", fn));
    key_bits = plan.key_bits > key_bits ? plan.key_bits : key_bits;
    value_bits = plan.value_bits > value_bits ? plan.value_bits : value_bits;
    const std::int64_t b = detail::compact_into_blocks(q.src_keys, q.src_values, q.dst_keys, q.keep);
    blocks = b > blocks ? b : blocks;
  }

  const std::size_t words = detail::compact_round_up(desc_bytes);
  const std::size_t word_bytes = 4u * static_cast<std::size_t>(1 + (key_bits > 0 ? detail::bitmap_words(key_bits) : 0) +
                                                               (value_bits > 0 ? detail::bitmap_words(value_bits) : 0));
  const detail::aligned_workspace aws = detail::align_workspace(ws, detail::compact_batch_align);
  if (aws.base == nullptr || aws.size < words + word_bytes)
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes for this batch (compact_into_batch_workspace_size), got %zu",
                         words + word_bytes + detail::compact_batch_align - 1,
                         ws.data == nullptr ? std::size_t{0} : ws.size);
  KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(ws.data, opt, fn, "ws"));
  unsigned char* base = aws.base;
  auto* status_word = reinterpret_cast<std::uint32_t*>(base + words);
  std::uint32_t* key_bitmap = key_bits > 0 ? status_word + 1 : nullptr;
  std::uint32_t* value_bitmap =
      value_bits > 0 ? status_word + 1 + (key_bits > 0 ? detail::bitmap_words(key_bits) : 0) : nullptr;
  for (std::int64_t s = 0; s < n; ++s) {
    detail::compact_into_args& a = desc[s];
    const detail::compact_into_plan plan =
        detail::plan_bitmaps(seqs[s].src_keys, seqs[s].src_values, seqs[s].dst_keys, seqs[s].dst_values);
    a.status = status_word;
    a.k.bitmap = plan.key_bits > 0 ? key_bitmap : nullptr;
    a.v.bitmap = plan.value_shares_key_bitmap ? key_bitmap : (plan.value_bits > 0 ? value_bitmap : nullptr);
  }

  *out = batch_launch{base, status_word, word_bytes, staging, desc_bytes, blocks, n};
  return status();
}

inline status validate_compact_into_batch(const batch_launch& l, const launch_options& opt, const char* fn) {
  const auto* dev = reinterpret_cast<const compact_into_args*>(l.base);
  const launch_config cfg = batch_config(l, opt);
  KVEVICT_RETURN_IF_ERROR(
      launch(fn, "compact_into_validate_batch_kernel<source>", cfg, compact_into_validate_batch_kernel<>, dev, true));
  return launch(fn, "compact_into_validate_batch_kernel<destination>", cfg, compact_into_validate_batch_kernel<>, dev,
                false);
}
inline status copy_compact_into_batch(const batch_launch& l, const launch_options& opt, const char* fn) {
  return launch(fn, "compact_into_copy_batch_kernel", batch_config(l, opt), compact_into_copy_batch_kernel<>,
                reinterpret_cast<const compact_into_args*>(l.base));
}

/// compact_into_batch's device half: a memset, the descriptor copy and three kernels (and,
/// with a cancel word, its copy into the status word).
inline status enqueue_compact_into_batch(const batch_launch& l, const launch_options& opt, const char* fn,
                                         const std::uint32_t* cancel = nullptr) {
  if (l.n == 0) return status();
  KVEVICT_RETURN_IF_ERROR(enqueue_batch_words(l, opt, fn));
  if (cancel != nullptr) KVEVICT_RETURN_IF_ERROR(start_status(l, cancel, opt, fn));
  KVEVICT_RETURN_IF_ERROR(validate_compact_into_batch(l, opt, fn));
  return copy_compact_into_batch(l, opt, fn);
}

/// Prepared batches into fresh blocks of every layer as one all-or-nothing compaction
/// (enqueue_batches).
inline status enqueue_compact_into_batches(const batch_launch* l, std::int64_t count, const std::uint32_t* cancel,
                                           const launch_options& opt, const char* fn) {
  if (count == 1) return enqueue_compact_into_batch(l[0], opt, fn, cancel);
  return enqueue_batches(
      l, count, cancel, opt, fn, [&](const batch_launch& b) { return validate_compact_into_batch(b, opt, fn); },
      [&](const batch_launch& b) { return copy_compact_into_batch(b, opt, fn); });
}

}  // namespace detail

/// Copies the kept rows of every sequence of a batch into fresh memory, for one layer, as
/// compact_into does for one: a memset, one copy and three kernels per call.
///
///   seqs:    [n] host array of compaction_into_sequence (device views and keep-lists);
///            paged destinations of a batch in one K pool and one V pool
///   ws:      device memory, >= compact_into_batch_workspace_size(a sequence's views, n)
///   staging: host memory, >= compact_into_batch_staging_size(n); page-locked; kept alive and
///            unchanged until the stream passes this call
///
/// Host errors name "seqs[i]...." and enqueue nothing. On the device, all or nothing: a bad
/// keep-list, an id out of range, a head keeping more rows than its destination holds, or a
/// destination block that a source of the batch uses or that two destinations reach raises
/// its flag and writes no destination row and no output of any sequence. Sources are never
/// written.
template <class KT, class VT>
status compact_into_batch(const compaction_into_sequence<KT, VT>* seqs, std::int64_t n, workspace_span ws,
                          void* staging, std::size_t staging_bytes, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::compact_into_batch";
  detail::batch_launch l;
  KVEVICT_RETURN_IF_ERROR(detail::prepare_compact_into_batch(seqs, n, ws, staging, staging_bytes, opt, fn, &l));
  return detail::enqueue_compact_into_batch(l, opt, fn);
}

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_COMPACT_BATCH_CUH
