// SPDX-License-Identifier: Apache-2.0
// The observation kernel's per-head loop (detail/observe.hpp), compiled once per kernel set:
// detail/observe.hpp includes this file inside namespace isa_scalar, isa_avx2 and isa_avx512,
// each within that set's target region, so that the loop, the softmax pieces and the GEMM
// micro-kernels of one set are compiled for one target and inline into each other. Names
// resolve to the enclosing set's kernels (detail/isa/common.hpp lists them) and to the shared
// helpers of detail/observe.hpp. No include guard: included once per set, by observe.hpp only.

/// Gathers head h's group of query rows, widened and scaled by 1/sqrt(d), into q [R, d].
template <class QT>
void gather_queries(const query_view<const QT>& queries, std::int64_t h, const observation_problem& p, float* q) {
  const float scale = p.logit_scale();
  for (std::int64_t g = 0; g < p.group; ++g)
    for (std::int64_t t = 0; t < p.window; ++t) {
      float* dst = q + (g * p.window + t) * p.dim;
      widen_row(queries.row(h * p.group + g, t), queries.dim_stride, dst, p.dim);
      for (std::int64_t c = 0; c < p.dim; ++c) dst[c] *= scale;
    }
}

/// Rows [r0, r0 + nr) (nr <= the cache's rows) of head h in one sweep: their logits over the
/// whole softmax domain into s.cached, straight from the cache (keys read once, no packing)
/// where a kernel applies, then each row's softmax from the cache into s.acc. Rows are
/// accumulated in order, so any split into such chunks gives the same bits.
template <class KT>
void observe_rows_cached(const cache_view<const KT>& keys, std::int64_t h, const observation_problem& p,
                         const observation_scratch& s, const bf16* qb, bool amx, std::int64_t r0, std::int64_t nr) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const tile_plan plan(p.dim);
  const std::int64_t end = p.softmax_end();
  const float scale = p.logit_scale();
  for (std::int64_t r = r0; r < r0 + nr; ++r) {
    s.row_max[r] = neg_inf;
    s.row_lse[r] = 0.0f;
  }
  narrow_queries nq;
  nq.q = s.q + r0 * p.dim;
  nq.qb = qb != nullptr ? qb + r0 * p.dim : nullptr;
  nq.scale = scale;
  if (amx) {  // bf16 x bf16 on a strided cache with AMX: tile products for whole groups of 16 keys
    const std::uint16_t* qrows[16];
    for (std::int64_t r = 0; r < 16; ++r)
      qrows[r] = r < nr ? reinterpret_cast<const std::uint16_t*>(nq.qb + r * p.dim) : nullptr;
    pack_key_group_pairs(qrows, p.dim, s.qpanel);
  }
  for (std::int64_t j0 = 0; j0 < end; j0 += plan.keys) {
    const std::int64_t n = std::min(plan.keys, end - j0);
    float* tile = s.cached + j0;  // row i of this tile starts at tile + i * end
    std::int64_t done = 0;
    if (amx) {
      done = n / 16 * 16;
      if (done > 0)
        narrow_logits_amx(reinterpret_cast<const std::uint16_t*>(keys.row(h, j0)), keys.token_stride, n / 16, p.dim,
                          s.qpanel, nr, scale, tile, end);
    }
    if (done < n && !narrow_logits(keys, h, j0 + done, n - done, nq, nr, p.dim, tile + done, end)) {
      pack_key_panels(keys, h, j0, n, p.dim, s.k);
      const std::int64_t ld = padded_keys(n);
      logits_panels(nq.q, nr, p.dim, s.k, n, s.logits, ld);
      // memcpy, not std::copy: no std template instantiated per kernel set (detail/abi_std.hpp).
      for (std::int64_t i = 0; i < nr; ++i)
        std::memcpy(tile + i * end, s.logits + i * ld, static_cast<std::size_t>(n) * sizeof(float));
    }
    for (std::int64_t i = 0; i < nr; ++i) {
      const std::int64_t r = r0 + i;
      float* row = tile + i * end;
      const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[r % p.window]);
      for (std::int64_t c = live; c < n; ++c) row[c] = neg_inf;
      lse_update(row, live, &s.row_max[r], &s.row_lse[r]);
    }
  }
  for (std::int64_t i = 0; i < nr; ++i) {
    const std::int64_t r = r0 + i;
    const float lse = finish_lse(s.row_max[r], s.row_lse[r]);
    if (lse == neg_inf || p.candidates == 0) continue;
    accumulate_row(p.max_over_window, s.cached + i * end, p.candidates, lse, window_weight(p, r),
                   s.acc + (r / p.window) * p.candidates);
  }
}

/// Computes s.acc ([G, C]) for KV head h. `products` says which bf16 x bf16 kernels the
/// process may use (none, VDPBF16PS or AMX); only the AVX-512 set has them.
template <class QT, class KT>
void observe_head(const query_view<const QT>& queries, const cache_view<const KT>& keys, std::int64_t h,
                  const observation_problem& p, const observation_scratch& s, bf16_products products) {
  constexpr float neg_inf = -std::numeric_limits<float>::infinity();
  const tile_plan plan(p.dim);
  const std::int64_t rows = p.rows();
  const std::int64_t chunk_rows = std::min(rows, plan.rows);
  const std::int64_t end = p.softmax_end();
  const float scale = p.logit_scale();
  gather_queries(queries, h, p, s.q);
  for (std::int64_t i = 0; i < p.group * p.candidates; ++i) s.acc[i] = 0.0f;  // probabilities are >= 0

  // bf16 queries and keys with contiguous channels may take bf16 pair products: VDPBF16PS
  // (avx512bf16) or AMX tiles (amx), the latter for d a multiple of 32 only.
  const bool pairs = products != bf16_products::none && bf16_pair_types<QT, KT>() && keys.dim_stride == 1;
  const bool tiles = pairs && products == bf16_products::amx && p.dim % 32 == 0;
  const bf16* qb = pairs ? gather_queries_bf16(queries, h, p, s.qb) : nullptr;

  // One sweep wherever the logit cache is there (it holds up to cached_logit_rows rows) and
  // no engine LSE saves the first sweep: decode-sized sets at once, prompt windows in chunks
  // of rows when the keys can be read without packing (computing each logit once, where two
  // sweeps compute it twice; the cache's rows are reread, not recomputed). bf16 pair products
  // (VDPBF16PS, AMX) keep two sweeps for prompt windows: their packed GEMMs cost less than
  // reading the keys once per chunk (measured: 121 against 149 ms per layer, VDPBF16PS).
  const std::int64_t cache_rows = s.cached != nullptr ? cached_rows_bound(p) : 0;
  if (cache_rows > 0 && p.lse == nullptr &&
      (rows <= cache_rows || (reads_keys_unpacked && keys.dim_stride == 1 && !pairs))) {
    const bool amx = tiles && !keys.is_paged();
    for (std::int64_t r0 = 0; r0 < rows; r0 += cache_rows)
      observe_rows_cached(keys, h, p, s, qb, amx, r0, std::min(cache_rows, rows - r0));
    return;
  }

  // Two sweeps: the logits of one key tile at a time, from float32 panels (FMA chains), bf16
  // pair panels (VDPBF16PS) or AMX tiles on the same pair panels.
  const bool pair_gemm = pairs && p.dim % 32 == 0;
  auto* panels = reinterpret_cast<std::uint32_t*>(s.k);

  // Sweep 1: each row's log-sum-exp over the softmax domain (online max and normaliser).
  if (p.lse != nullptr) {
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t g = r / p.window, t = r % p.window;
      s.row_lse[r] = p.lse[(h * p.group + g) * p.lse_head_stride + t];
    }
  } else {
    for (std::int64_t r = 0; r < rows; ++r) {
      s.row_max[r] = neg_inf;
      s.row_lse[r] = 0.0f;
    }
  }
  for (int sweep = p.lse != nullptr ? 1 : 0; sweep < 2; ++sweep) {
    const std::int64_t sweep_end = sweep == 0 ? end : p.candidates;
    for (std::int64_t j0 = 0; j0 < sweep_end; j0 += plan.keys) {
      const std::int64_t n = std::min(plan.keys, sweep_end - j0);
      if (pair_gemm)
        pack_key_tile_pairs(keys, h, j0, n, p.dim, panels);
      else
        pack_key_panels(keys, h, j0, n, p.dim, s.k);
      for (std::int64_t r0 = 0; r0 < rows; r0 += chunk_rows) {
        const std::int64_t nr = std::min(chunk_rows, rows - r0);
        const std::int64_t ld = padded_keys(n);
        if (tiles)
          logits_tile_amx(reinterpret_cast<const std::uint16_t*>(qb + r0 * p.dim), round_up(nr, 32), p.dim, panels, ld,
                          scale, s.logits, ld);
        else if (pair_gemm)
          logits_pairs(qb + r0 * p.dim, nr, p.dim, panels, n, scale, s.logits, ld);
        else
          logits_panels(s.q + r0 * p.dim, nr, p.dim, s.k, n, s.logits, ld);
        for (std::int64_t i = 0; i < nr; ++i) {
          const std::int64_t r = r0 + i;
          float* row = s.logits + i * ld;
          if (sweep == 0) {
            const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[r % p.window]);
            lse_update(row, live, &s.row_max[r], &s.row_lse[r]);
            continue;
          }
          const float lse = s.row_lse[r];
          if (lse == neg_inf) continue;  // the row sees no key of its domain
          const std::int64_t live = mask_row(p, row, j0, n, p.query_positions[r % p.window]);
          if (live == 0) continue;
          accumulate_row(p.max_over_window, row, live, lse, window_weight(p, r),
                         s.acc + (r / p.window) * p.candidates + j0);
        }
      }
    }
    if (sweep == 0)
      for (std::int64_t r = 0; r < rows; ++r) s.row_lse[r] = finish_lse(s.row_max[r], s.row_lse[r]);
  }
}
