// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_EVICTION_EVICT_BATCH_HPP
#define KVEVICT_EVICTION_EVICT_BATCH_HPP

// Eviction over a ragged batch (HF padded batches, vLLM block tables, FlashInfer CSR page
// tables): every sequence is validated before any sequence moves, so one bad keep-list
// leaves the whole batch as it was. Then each sequence is compacted exactly as `evict`
// would compact it (see eviction/evict.hpp for the contract).

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/detail/validate.hpp"
#include "kvevict/detail/validate_eviction.hpp"
#include "kvevict/error.hpp"
#include "kvevict/eviction/evict.hpp"
#include "kvevict/executor.hpp"
#include "kvevict/selection/keep_list.hpp"
#include "kvevict/views/batch_cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN

namespace detail {
/// A batch's sequence views, or a default view past a malformed batch (size queries run
/// before validation and must not read a null seq_lens).
template <class T>
cache_view<T> sequence_or_empty(const batch_cache_view<T>& b, std::int64_t s) noexcept {
  if (b.seq_lens == nullptr || s >= b.num_seqs) return cache_view<T>{};
  return b.sequence(s);
}

template <class KT, class VT>
bool same_block_tables(const batch_cache_view<KT>& keys, const batch_cache_view<VT>& values) noexcept {
  return keys.is_paged() && values.block_tables == keys.block_tables && values.block_indptr == keys.block_indptr &&
         (keys.block_indptr != nullptr || values.block_table_stride == keys.block_table_stride) &&
         values.layout.block_size == keys.layout.block_size;
}

/// "keys[2]" and the like.
struct sequence_name {
  char text[status::max_argument];
  sequence_name(const char* arg, std::int64_t s) noexcept {
    std::snprintf(text, sizeof(text), "%s[%lld]", arg, static_cast<long long>(s));
  }
  operator const char*() const noexcept { return text; }
};
}  // namespace detail

/// Bytes of workspace `evict_batch` needs: 0 for strided batches; for paged ones 4 bytes per
/// used block of every sequence's K and V, plus alignment.
template <class KT, class VT>
std::size_t evict_batch_workspace_size(const batch_cache_view<KT>& keys, const batch_cache_view<VT>& values,
                                       const executor& exec = {}) noexcept {
  (void)exec;
  const std::int64_t n = keys.num_seqs < 0 ? 0 : keys.num_seqs;
  const auto kseq = [&keys](std::int64_t s) { return detail::sequence_or_empty(keys, s); };
  const auto vseq = [&values](std::int64_t s) { return detail::sequence_or_empty(values, s); };
  detail::arena a;
  std::int32_t* ids = nullptr;
  detail::carve_evict_layout(a, detail::block_id_scratch(n, kseq, vseq), &ids);
  return a.used();
}

/// Compacts every sequence of a ragged batch in place by its own keep-list.
///
///   keys, values:  batches of [Hkv, L_s, d] caches (same num_seqs, same seq_lens values;
///                  head_dim of K and V may differ)
///   keeps:         [num_seqs] keep-lists; keeps[s] is over sequence s's L_s tokens
///   results:       [num_seqs]; results[s] as `evict` fills it for sequence s
///   ws:            at least evict_batch_workspace_size(keys, values) bytes
///   key_positions: null, or [num_seqs] pointers each null or [L_s] positions
///   exec:          (sequence, head) pairs may be compacted in parallel through it
///
/// Paged batches must not share a physical block between sequences (checked).
template <class KT, class VT>
status evict_batch(batch_cache_view<KT> keys, batch_cache_view<VT> values, const const_keep_list_view* keeps,
                   eviction_result* results, workspace_span ws = {}, const index_ptr* key_positions = nullptr,
                   const executor& exec = {}) {
  static_assert(!std::is_const<KT>::value && !std::is_const<VT>::value,
                "kvevict::evict_batch writes the cache: pass views of mutable elements");
  static constexpr const char* fn = "kvevict::evict_batch";
  KVEVICT_RETURN_IF_ERROR(detail::validate_batch_layout(keys, fn, "keys"));
  KVEVICT_RETURN_IF_ERROR(detail::validate_batch_layout(values, fn, "values"));
  if (values.num_seqs != keys.num_seqs)
    return status::error(errc::invalid_shape, fn, "values.num_seqs", "expected keys.num_seqs = %lld, got %lld",
                         static_cast<long long>(keys.num_seqs), static_cast<long long>(values.num_seqs));
  const std::int64_t num_seqs = keys.num_seqs;
  if (num_seqs == 0) return status();
  if (keeps == nullptr)
    return status::error(errc::null_pointer, fn, "keeps", "expected [%lld] keep-lists",
                         static_cast<long long>(num_seqs));
  if (results == nullptr)
    return status::error(errc::null_pointer, fn, "results", "expected [%lld] results",
                         static_cast<long long>(num_seqs));
  for (std::int64_t s = 0; s < num_seqs; ++s) {
    if (values.seq_lens[s] != keys.seq_lens[s]) {
      char name[status::max_argument];
      std::snprintf(name, sizeof(name), "values.seq_lens[%lld]", static_cast<long long>(s));
      return status::error(errc::invalid_shape, fn, name, "expected keys.seq_lens[%lld] = %lld, got %lld",
                           static_cast<long long>(s), static_cast<long long>(keys.seq_lens[s]),
                           static_cast<long long>(values.seq_lens[s]));
    }
    KVEVICT_RETURN_IF_ERROR(detail::validate_eviction_sequence(
        keys.sequence(s), values.sequence(s), keeps[s], fn, detail::sequence_name("keys", s),
        detail::sequence_name("values", s), detail::sequence_name("keeps", s)));
  }
  const auto kseq = [&keys](std::int64_t s) { return keys.sequence(s); };
  const auto vseq = [&values](std::int64_t s) { return values.sequence(s); };
  detail::arena a(ws);
  std::int32_t* ids = nullptr;
  detail::carve_evict_layout(a, detail::block_id_scratch(num_seqs, kseq, vseq), &ids);
  if (a.overflowed())
    return status::error(errc::workspace_too_small, fn, "ws",
                         "expected at least %zu bytes (evict_batch_workspace_size), got %zu", a.used(), ws.size);
  if (keys.is_paged() || values.is_paged()) {
    const bool same_pool = detail::same_block_pool(keys.sequence(0), values.sequence(0));
    KVEVICT_RETURN_IF_ERROR(detail::check_block_ids(num_seqs, kseq, vseq, detail::same_block_tables(keys, values),
                                                    same_pool, ids, fn, true));
  }

  for (std::int64_t s = 0; s < num_seqs; ++s)
    detail::report_eviction(keys.sequence(s), values.sequence(s), keeps[s],
                            key_positions != nullptr ? key_positions[s] : index_ptr{}, results[s]);
  struct task_context {
    batch_cache_view<KT> keys;
    batch_cache_view<VT> values;
    const const_keep_list_view* keeps;
    std::int64_t heads;
  } ctx{keys, values, keeps, keys.layout.num_heads};
  exec.run(
      num_seqs * ctx.heads,
      [](void* arg, std::int64_t task, int) {
        const auto& c = *static_cast<const task_context*>(arg);
        const std::int64_t s = task / c.heads, h = task - s * c.heads;
        const const_keep_list_view& keep = c.keeps[s];
        const std::int64_t* kept = keep.indices + keep.offsets[h];
        const std::int64_t n = keep.size(h);
        detail::compact_head(c.keys.sequence(s), h, kept, n);
        detail::compact_head(c.values.sequence(s), h, kept, n);
      },
      &ctx);
  return status();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_EVICTION_EVICT_BATCH_HPP
