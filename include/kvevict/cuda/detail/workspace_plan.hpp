// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_WORKSPACE_PLAN_HPP
#define KVEVICT_CUDA_DETAIL_WORKSPACE_PLAN_HPP

// How each CUDA operation carves the caller's device workspace. Carving is pointer
// arithmetic on the host (kvevict::detail::arena never dereferences), so a measuring arena
// gives the size query and a real one gives the run: one sequence, no drift. Host-only and
// CUDA-free, so the CPU tests check sizes and disjointness. Products saturate, so an
// impossible shape asks for a size no workspace meets (never a wrapped, small one).

#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/cuda/detail/compact_logic.hpp"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/select_row.hpp"
#include "kvevict/detail/checked.hpp"
#include "kvevict/detail/in_sequence.hpp"
#include "kvevict/error.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

/// Keys per block of the fused observation kernels (the K tile held in shared memory).
constexpr std::int64_t obs_tile_keys = 64;
/// Observation rows (query head x observation) per register tile of the fused kernels.
constexpr std::int64_t obs_tile_rows = 64;
/// Head-dim chunk of the query tile staged in shared memory.
constexpr std::int64_t obs_tile_dims = 32;
/// Keys per block of the decode (W = 1) streaming kernels.
constexpr std::int64_t decode_tile_keys = 256;
/// Keys per block of the finalisation kernel.
constexpr std::int64_t finalize_tile_keys = 256;

/// Sizes of one observation-scoring problem (section 4), as the kernels see them.
struct obs_dims {
  std::int64_t kv_heads = 0;    ///< Hkv
  std::int64_t group = 1;       ///< G
  std::int64_t window = 1;      ///< W
  std::int64_t tokens = 0;      ///< L
  std::int64_t candidates = 0;  ///< C = max(0, L - P)
  bool visible_domain = true;   ///< softmax over every visible key (else over candidates)

  std::int64_t rows() const noexcept { return kvevict::detail::saturating_mul(group, window); }  ///< R per KV head
  std::int64_t softmax_end() const noexcept { return visible_domain ? tokens : candidates; }
  std::int64_t stat_tiles() const noexcept { return num_tiles(softmax_end(), obs_tile_keys); }
};

inline obs_dims make_obs_dims(std::int64_t hkv, std::int64_t hq, std::int64_t window, std::int64_t tokens,
                              const scoring_params& params) noexcept {
  obs_dims d;
  d.kv_heads = hkv;
  d.group = hkv > 0 && hq >= hkv ? hq / hkv : 1;
  d.window = window;
  d.tokens = tokens;
  d.candidates = tokens > params.protected_tail ? tokens - params.protected_tail : 0;
  d.visible_domain = params.domain == softmax_domain::visible;
  return d;
}

struct obs_workspace {
  softmax_partial* partials = nullptr;  ///< [Hkv * R, stat_tiles] (two-pass only)
  float* row_lse = nullptr;             ///< [Hkv * R] (two-pass only)
  float* acc = nullptr;                 ///< [Hq, C] window-aggregated rows per query head
};

inline void carve_obs_workspace(kvevict::detail::arena& a, const obs_dims& d, bool engine_lse,
                                obs_workspace* out) noexcept {
  using kvevict::detail::saturating_mul;
  const std::int64_t rows = saturating_mul(d.kv_heads, d.rows());
  out->partials = engine_lse ? nullptr : a.take<softmax_partial>(saturating_mul(rows, d.stat_tiles()));
  out->row_lse = engine_lse ? nullptr : a.take<float>(rows);
  out->acc = a.take<float>(saturating_mul(saturating_mul(d.kv_heads, d.group), d.candidates));
}

struct decode_workspace {
  float* logits = nullptr;              ///< [Hq, softmax_end] masked logits (two-pass only)
  softmax_partial* partials = nullptr;  ///< [Hq, tiles] (two-pass only)
  float* row_lse = nullptr;             ///< [Hq] (two-pass only)
};

inline std::int64_t decode_tiles(const obs_dims& d) noexcept {
  return num_tiles(d.softmax_end(), decode_tile_keys);
}

inline void carve_decode_workspace(kvevict::detail::arena& a, const obs_dims& d, bool engine_lse,
                                   decode_workspace* out) noexcept {
  using kvevict::detail::saturating_mul;
  const std::int64_t hq = saturating_mul(d.kv_heads, d.group);
  out->logits = engine_lse ? nullptr : a.take<float>(saturating_mul(hq, d.softmax_end()));
  out->partials = engine_lse ? nullptr : a.take<softmax_partial>(saturating_mul(hq, decode_tiles(d)));
  out->row_lse = engine_lse ? nullptr : a.take<float>(hq);
}

/// Compaction: a private status word, the staged rows of K and V, and (paged caches) one
/// bitmap per block pool for the duplicate-block check.
struct compact_dims {
  std::int64_t capacity = 0;         ///< keep-list entries (keep.capacity)
  std::int64_t key_row_bytes = 0;    ///< dk * sizeof(KT)
  std::int64_t value_row_bytes = 0;  ///< dv * sizeof(VT)
  std::int64_t key_bitmap_ids =
      0;  ///< pool blocks of K when paged (of K or V, whichever has more, when shared), else 0
  std::int64_t value_bitmap_ids = 0;  ///< pool blocks of V when paged with its own pool, else 0
};

/// Sizes of one compaction's workspace for these views and keep-list capacity.
template <class KT, class VT>
compact_dims make_compact_dims(const cache_view<KT>& keys, const cache_view<VT>& values,
                               std::int64_t capacity) noexcept {
  const kv_tables rel = relate_tables(keys, values);
  compact_dims d;
  d.capacity = capacity < 0 ? 0 : capacity;
  d.key_row_bytes = kvevict::detail::saturating_mul(keys.head_dim, static_cast<std::int64_t>(sizeof(KT)));
  d.value_row_bytes = kvevict::detail::saturating_mul(values.head_dim, static_cast<std::int64_t>(sizeof(VT)));
  // A pool shared by K and V puts both tables' ids in K's bitmap: it covers the larger of
  // the two views' block counts (each view's ids are checked against its own count).
  const std::int64_t shared_ids =
      values.num_pool_blocks > keys.num_pool_blocks ? values.num_pool_blocks : keys.num_pool_blocks;
  d.key_bitmap_ids = keys.is_paged() ? (rel.shared_pool ? shared_ids : keys.num_pool_blocks) : 0;
  d.value_bitmap_ids = values.is_paged() && !rel.same_table && !rel.shared_pool ? values.num_pool_blocks : 0;
  return d;
}

struct compact_workspace {
  std::uint32_t* status = nullptr;
  unsigned char* staged_keys = nullptr;    ///< [capacity, key_row_bytes]
  unsigned char* staged_values = nullptr;  ///< [capacity, value_row_bytes]
  std::uint32_t* key_bitmap = nullptr;
  std::uint32_t* value_bitmap = nullptr;
};

inline void carve_compact_workspace(kvevict::detail::arena& a, const compact_dims& d, compact_workspace* out) noexcept {
  using kvevict::detail::saturating_mul;
  out->status = a.take<std::uint32_t>(1);
  out->staged_keys = a.take<unsigned char>(saturating_mul(d.capacity, d.key_row_bytes));
  out->staged_values = a.take<unsigned char>(saturating_mul(d.capacity, d.value_row_bytes));
  out->key_bitmap = d.key_bitmap_ids > 0 ? a.take<std::uint32_t>(bitmap_words(d.key_bitmap_ids)) : nullptr;
  out->value_bitmap = d.value_bitmap_ids > 0 ? a.take<std::uint32_t>(bitmap_words(d.value_bitmap_ids)) : nullptr;
}

/// Batched calls place their descriptors, words and rows at fixed offsets from one base:
/// ws.data rounded up to `align` bytes (the size queries include the padding), and the bytes
/// left after it (0 when the padding does not fit).
struct aligned_workspace {
  unsigned char* base = nullptr;
  std::size_t size = 0;
};

inline aligned_workspace align_workspace(workspace_span ws, std::size_t align) noexcept {
  aligned_workspace a;
  if (ws.data == nullptr) return a;
  const auto addr = reinterpret_cast<std::uintptr_t>(ws.data);
  const std::size_t pad = static_cast<std::size_t>((align - addr % align) % align);
  if (pad > ws.size) return a;
  a.base = static_cast<unsigned char*>(ws.data) + pad;
  a.size = ws.size - pad;
  return a;
}

/// A batched call's sequence count: n >= 0, seqs given when n > 0, n within one grid dimension.
inline status check_batch_count(const void* seqs, std::int64_t n, const char* fn) noexcept {
  if (n < 0)
    return status::error(errc::invalid_shape, fn, "num_sequences", "expected >= 0, got %lld",
                         static_cast<long long>(n));
  if (n == 0) return status();
  if (seqs == nullptr)
    return status::error(errc::null_pointer, fn, "seqs", "expected [%lld] sequences", static_cast<long long>(n));
  if (n > max_grid_yz)
    return status::error(errc::overflow, fn, "num_sequences", "expected <= 65535 sequences per call, got %lld",
                         static_cast<long long>(n));
  return status();
}

/// One of a sequence's sizes that must equal the batch's (seqs[0]'s).
struct batch_field {
  const char* field;
  std::int64_t got, want;
};

template <std::size_t N>
status check_batch_fields(std::int64_t s, const batch_field (&fields)[N], const char* fn) noexcept {
  for (const batch_field& f : fields)
    if (f.got != f.want)
      return status::error(errc::invalid_shape, fn, kvevict::detail::io_name(s, f.field),
                           "expected the batch's %lld (seqs[0]), got %lld", static_cast<long long>(f.want),
                           static_cast<long long>(f.got));
  return status();
}

/// A batched call's host staging: present, large enough, aligned for the descriptors written
/// into it (cudaMallocHost memory always is).
inline status check_staging(const void* staging, std::size_t staging_bytes, std::size_t need, std::size_t align,
                            const char* fn, const char* size_fn) noexcept {
  if (staging == nullptr || staging_bytes < need)
    return status::error(staging == nullptr ? errc::null_pointer : errc::workspace_too_small, fn, "staging",
                         "expected %zu bytes of host staging (%s), got %zu", need, size_fn,
                         staging == nullptr ? std::size_t{0} : staging_bytes);
  if (reinterpret_cast<std::uintptr_t>(staging) % align != 0)
    return status::error(errc::invalid_argument, fn, "staging", "expected %zu-byte alignment (as cudaMallocHost's)",
                         align);
  return status();
}

/// Selection of one scores matrix: the row descriptors built on the device, and a status
/// word for the capacity check of per-row budgets.
struct select_workspace {
  select_row* rows = nullptr;
  std::uint32_t* status = nullptr;
};

inline void carve_select_workspace(kvevict::detail::arena& a, std::int64_t num_rows, select_workspace* out) noexcept {
  out->rows = a.take<select_row>(num_rows);
  out->status = a.take<std::uint32_t>(1);
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_WORKSPACE_PLAN_HPP
