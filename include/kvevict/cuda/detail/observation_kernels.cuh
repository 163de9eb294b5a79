// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_OBSERVATION_KERNELS_CUH
#define KVEVICT_CUDA_DETAIL_OBSERVATION_KERNELS_CUH

// The kernels of GPU observation scoring (cuda/observation_scores.cuh says what they compute and
// in which order), their arguments, shared-memory sizes and launch limits.

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
#include "kvevict/cuda/detail/mma.cuh"
#include "kvevict/cuda/detail/row_lse.cuh"
#include "kvevict/cuda/detail/score_logic.hpp"
#include "kvevict/cuda/detail/tiling.hpp"
#include "kvevict/cuda/detail/workspace_plan.hpp"
#include "kvevict/cuda/finalize.cuh"
#include "kvevict/error.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/shape.hpp"
#include "kvevict/views/cache_view.hpp"
#include "kvevict/views/index_ptr.hpp"
#include "kvevict/views/matrix_view.hpp"
#include "kvevict/views/query_view.hpp"
#include "kvevict/workspace.hpp"

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

constexpr int obs_threads = 256;

template <class QT, class KT>
struct obs_args {
  query_view<const QT> q;
  cache_view<const KT> k;
  index_ptr key_positions = nullptr;
  const float* weights = nullptr;
  const float* engine_lse = nullptr;
  std::int64_t engine_lse_stride = 0;
  softmax_partial* partials = nullptr;  // [Hkv * R, stat_tiles]
  float* row_lse = nullptr;             // [Hkv * R] (written by the row-LSE pass)
  float* acc = nullptr;                 // [Hq, C]
  std::uint32_t* flags = nullptr;
  float scale = 1.0f;
  int group = 1, window = 1, dim = 1, rows = 1;
  int tokens = 0, candidates = 0, softmax_end = 0, stat_tiles = 0;
  bool max_window = false;
};

/// Tensor cores score when the queries are bf16 or fp16 and the keys are of the same type, or
/// fp8 (widened to the query type in shared memory: every e4m3 and e5m2 value is exact in
/// bf16 and in fp16); float32 and other mixes stay on the CUDA cores.
template <class QT, class KT>
struct uses_tensor_cores : std::integral_constant<bool, is_mma_operand<QT>::value &&
                                                            (std::is_same<QT, KT>::value || is_fp8_type<KT>::value)> {};

/// A key element as the MMA's operand type Q: the stored bits, or an fp8 value widened.
template <class Q, class K>
__device__ __forceinline__ std::uint32_t operand_bits(const K* p) {
  if (std::is_same<Q, K>::value) return __ldg(reinterpret_cast<const unsigned short*>(p));
  const float v = load_float(p);
  return std::is_same<Q, bf16>::value ? kvevict::detail::float_to_bf16_bits(v) : kvevict::detail::float_to_fp16_bits(v);
}

/// Channels of the query tile staged per step (the whole head_dim is held for the keys).
constexpr int obs_mma_chunk = 64;
/// 32-bit words per row of the tensor-core tiles: 16-bit channels in pairs, head_dim padded
/// to a multiple of 16 (one MMA step), plus 4 words so that the 8 rows x 4 words a fragment
/// load touches fall in 32 different banks.
KVEVICT_HOST_DEVICE constexpr int mma_key_words(int dim) noexcept {
  return (dim + 15) / 16 * 8 + 4;
}
constexpr int mma_query_words = obs_mma_chunk / 2 + 4;

/// Shared memory of the tile kernel, in carving order: query positions [W] and key
/// positions and row offsets [64] (int64), the K tile, a scratch tile, then (accumulate)
/// acc [G][64] and weights [W]. CUDA cores: the K tile widened to float [64][d + 1], the
/// scratch the union of the query chunk [64][33] and the probability tile [64][65] (the +1
/// pads make the row-strided reads of the register tile conflict-free). Tensor cores: the K
/// tile as 16-bit pairs [64][mma_key_words(d)], the scratch the union of the query chunk
/// [64][mma_query_words] and the logit tile [64][65].
inline std::size_t obs_shared_bytes(std::int64_t dim, std::int64_t group, std::int64_t window, bool accumulate,
                                    bool tensor_cores) noexcept {
  const std::int64_t tk = obs_tile_keys, rt = obs_tile_rows, dc = obs_tile_dims;
  std::int64_t bytes = (window + 2 * tk) * 8;
  const std::int64_t ptile = rt * (tk + 1);
  if (tensor_cores) {
    bytes += tk * mma_key_words(static_cast<int>(dim)) * 4;
    const std::int64_t qchunk = rt * mma_query_words;
    bytes += (qchunk > ptile ? qchunk : ptile) * 4;
  } else {
    bytes += tk * (dim + 1) * 4;
    const std::int64_t qchunk = rt * (dc + 1);
    bytes += (accumulate ? (qchunk > ptile ? qchunk : ptile) : qchunk) * 4;
  }
  if (accumulate) bytes += (group * tk + window) * 4;
  return static_cast<std::size_t>(bytes);
}

/// The K tile of keys [j0, j0 + nk) of head h in shared memory, widened once. A key behind a
/// bad block id (rowoff < 0) reads as NaN: its logits are NaN, which the mask turns into "no
/// attention", as for any NaN key. CUDA cores: floats [64][d + 1].
template <class QT, class KT>
__device__ void stage_key_tile(std::false_type, const obs_args<QT, KT>& a, void* tile, const std::int64_t* rowoff,
                               int nk, int tid) {
  constexpr int TK = static_cast<int>(obs_tile_keys);
  const int d = a.dim;
  float* ks = static_cast<float*>(tile);
  for (int e = tid; e < TK * d; e += obs_threads) {
    const int i = e / d, c = e - i * d;
    float v = 0.0f;
    if (i < nk) {
      const std::int64_t off = rowoff[i];
      v = off < 0 ? __int_as_float(0x7fc00000) : load_float(a.k.data + off + c * a.k.dim_stride);
    }
    ks[i * (d + 1) + c] = v;
  }
}

template <class T>
__device__ __forceinline__ std::uint32_t load_bits(const T* p) {
  return __ldg(reinterpret_cast<const unsigned short*>(p));
}

/// Tensor cores: the keys as 16-bit operands of the query type, two channels per word,
/// [64][mma_key_words(d)]; channels past d are zero.
template <class QT, class KT>
__device__ void stage_key_tile(std::true_type, const obs_args<QT, KT>& a, void* tile, const std::int64_t* rowoff,
                               int nk, int tid) {
  constexpr int TK = static_cast<int>(obs_tile_keys);
  constexpr std::uint32_t nan_bits = std::is_same<QT, bf16>::value ? 0x7fc0u : 0x7e00u;
  const int d = a.dim, kw = mma_key_words(d), pairs = (d + 1) / 2;
  std::uint32_t* ks = static_cast<std::uint32_t*>(tile);
  for (int e = tid; e < TK * kw; e += obs_threads) {
    const int i = e / kw, w = e - i * kw, c = 2 * w;
    std::uint32_t v = 0;
    if (i < nk && w < pairs) {
      const std::int64_t off = rowoff[i];
      const KT* row = a.k.data + off;
      const std::uint32_t lo = off < 0 ? nan_bits : operand_bits<QT>(row + c * a.k.dim_stride);
      const std::uint32_t hi =
          c + 1 >= d ? 0u : (off < 0 ? nan_bits : operand_bits<QT>(row + (c + 1) * a.k.dim_stride));
      v = lo | hi << 16;
    }
    ks[i * kw + w] = v;
  }
}

/// Logits of observation rows [r0, r0 + 64) of head h against the K tile, scaled by
/// 1/sqrt(d), in the epilogue's register layout: logit[i][k] is row r0 + ty + 16 i, key
/// tx + 16 k. CUDA cores: a 4x4 register tile per thread over query chunks of 32 channels.
template <class QT, class KT>
__device__ void tile_logits(std::false_type, const obs_args<QT, KT>& a, const void* tile, float* scratch, int h, int r0,
                            int tid, float (&logit)[4][4]) {
  constexpr int RT = static_cast<int>(obs_tile_rows);
  constexpr int DC = static_cast<int>(obs_tile_dims);
  const int d = a.dim, W = a.window, G = a.group, R = a.rows;
  const int tx = tid & 15, ty = tid >> 4;
  const float* ks = static_cast<const float*>(tile);
  float* qs = scratch;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) logit[i][k] = 0.0f;
  for (int c0 = 0; c0 < d; c0 += DC) {
    const int dc = d - c0 < DC ? d - c0 : DC;
    for (int e = tid; e < RT * DC; e += obs_threads) {
      const int rr = e / DC, cc = e - rr * DC;
      const int r = r0 + rr;
      float v = 0.0f;
      if (r < R && cc < dc) {
        const int g = r / W, t = r - g * W;
        v = load_float(a.q.data + a.q.offset(static_cast<std::int64_t>(h) * G + g, t, c0 + cc)) * a.scale;
      }
      qs[rr * (DC + 1) + cc] = v;
    }
    __syncthreads();
#pragma unroll 4
    for (int cc = 0; cc < dc; ++cc) {
      float qv[4], kv[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) qv[i] = qs[(ty + 16 * i) * (DC + 1) + cc];
#pragma unroll
      for (int k = 0; k < 4; ++k) kv[k] = ks[(tx + 16 * k) * (d + 1) + c0 + cc];
#pragma unroll
      for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) logit[i][k] = fmaf(qv[i], kv[k], logit[i][k]);
    }
    __syncthreads();
  }
}

/// Tensor cores: warp w computes rows [16 (w / 2), +16) x keys [32 (w % 2), +32) of the
/// 64x64 tile as four m16n8k16 accumulators over query chunks of 64 channels, scales them
/// and passes them through the scratch tile into the epilogue's layout. Leaves the block
/// synchronised with the scratch free.
template <class QT, class KT>
__device__ void tile_logits(std::true_type, const obs_args<QT, KT>& a, const void* tile, float* scratch, int h, int r0,
                            int tid, float (&logit)[4][4]) {
  constexpr int RT = static_cast<int>(obs_tile_rows);
  constexpr int TK = static_cast<int>(obs_tile_keys);
  constexpr int QW = mma_query_words;
  const int d = a.dim, W = a.window, G = a.group, R = a.rows, kw = mma_key_words(d);
  const int padded = (d + 15) / 16 * 16;
  const int warp = tid / 32, lane = tid % 32, g = lane / 4, t = lane % 4;
  const int m0 = 16 * (warp / 2), n0 = 32 * (warp % 2);
  const std::uint32_t* ks = static_cast<const std::uint32_t*>(tile);
  std::uint32_t* qs = reinterpret_cast<std::uint32_t*>(scratch);
  float acc[4][4];
#pragma unroll
  for (int n = 0; n < 4; ++n)
#pragma unroll
    for (int k = 0; k < 4; ++k) acc[n][k] = 0.0f;
  for (int c0 = 0; c0 < padded; c0 += obs_mma_chunk) {
    const int chunk = padded - c0 < obs_mma_chunk ? padded - c0 : obs_mma_chunk;
    for (int e = tid; e < RT * (obs_mma_chunk / 2); e += obs_threads) {
      const int rr = e / (obs_mma_chunk / 2), w = e - rr * (obs_mma_chunk / 2), c = c0 + 2 * w;
      const int r = r0 + rr;
      std::uint32_t v = 0;
      if (r < R && c < d) {
        const int gq = r / W, tq = r - gq * W;
        const QT* q = a.q.data + a.q.offset(static_cast<std::int64_t>(h) * G + gq, tq, c);
        v = load_bits(q) | (c + 1 < d ? load_bits(q + a.q.dim_stride) << 16 : 0u);
      }
      qs[rr * QW + w] = v;
    }
    __syncthreads();
    for (int k0 = 0; k0 < chunk / 2; k0 += 8) {
      const std::uint32_t fa[4] = {qs[(m0 + g) * QW + k0 + t], qs[(m0 + g + 8) * QW + k0 + t],
                                   qs[(m0 + g) * QW + k0 + t + 4], qs[(m0 + g + 8) * QW + k0 + t + 4]};
      const int kword = c0 / 2 + k0 + t;
#pragma unroll
      for (int n = 0; n < 4; ++n) {
        const int key = n0 + 8 * n + g;
        const std::uint32_t fb[2] = {ks[key * kw + kword], ks[key * kw + kword + 4]};
        mma_m16n8k16<QT>(acc[n], fa, fb);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int n = 0; n < 4; ++n) {
    const int key = n0 + 8 * n + 2 * t;
    scratch[(m0 + g) * (TK + 1) + key] = acc[n][0] * a.scale;
    scratch[(m0 + g) * (TK + 1) + key + 1] = acc[n][1] * a.scale;
    scratch[(m0 + g + 8) * (TK + 1) + key] = acc[n][2] * a.scale;
    scratch[(m0 + g + 8) * (TK + 1) + key + 1] = acc[n][3] * a.scale;
  }
  __syncthreads();
  const int tx = tid & 15, ty = tid >> 4;
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) logit[i][k] = scratch[(ty + 16 * i) * (TK + 1) + tx + 16 * k];
  __syncthreads();
}

/// Key tile blockIdx.x of KV head blockIdx.y, one pass (stats or accumulate); the whole
/// block calls it (it synchronises).
template <class QT, class KT, bool Accumulate>
__device__ void obs_tile(const obs_args<QT, KT>& a) {
  constexpr int TK = static_cast<int>(obs_tile_keys);
  constexpr int RT = static_cast<int>(obs_tile_rows);
  constexpr int DC = static_cast<int>(obs_tile_dims);
  using tensor_cores = uses_tensor_cores<QT, KT>;
  KVEVICT_DYNAMIC_SHARED(float4, obs_smem_raw);
  const int d = a.dim, W = a.window, G = a.group, R = a.rows;
  std::int64_t* qpos = reinterpret_cast<std::int64_t*>(obs_smem_raw);
  std::int64_t* kpos = qpos + W;
  std::int64_t* rowoff = kpos + TK;
  float* ktile = reinterpret_cast<float*>(rowoff + TK);
  float* scratch = ktile + TK * (tensor_cores::value ? mma_key_words(d) : d + 1);
  float* ps = scratch;  // [RT][TK + 1]
  const int scratch_floats = tensor_cores::value
                                 ? (RT * (TK + 1) > RT * mma_query_words ? RT * (TK + 1) : RT * mma_query_words)
                                 : (RT * (TK + 1) > RT * (DC + 1) ? RT * (TK + 1) : RT * (DC + 1));
  float* accs = scratch + scratch_floats;  // [G][TK]
  float* wts = accs + G * TK;              // [W]

  const int tid = static_cast<int>(threadIdx.x);
  const int tx = tid & 15, ty = tid >> 4;
  const int h = static_cast<int>(blockIdx.y);
  const int end = Accumulate ? a.candidates : a.softmax_end;
  const int j0 = static_cast<int>(blockIdx.x) * TK;
  const int nk = end - j0 < TK ? end - j0 : TK;

  for (int t = tid; t < W; t += obs_threads) {
    const std::int64_t p = a.q.positions[t];
    if (p < 0 && blockIdx.x == 0 && blockIdx.y == 0) raise_flag(a.flags, flag_negative_position);
    qpos[t] = p;
    if (Accumulate) wts[t] = a.weights != nullptr ? a.weights[t] : 1.0f;
  }
  for (int i = tid; i < TK; i += obs_threads) {
    if (i < nk) {
      const std::int64_t j = j0 + i;
      kpos[i] = a.key_positions != nullptr ? a.key_positions[j] : j;
      rowoff[i] = checked_row_offset(a.k, h, j, a.flags);
    } else {
      kpos[i] = 0;
      rowoff[i] = -1;
    }
  }
  if (Accumulate)
    for (int i = tid; i < G * TK; i += obs_threads) accs[i] = 0.0f;
  __syncthreads();
  stage_key_tile(tensor_cores(), a, ktile, rowoff, nk, tid);
  __syncthreads();

  for (int r0 = 0; r0 < R; r0 += RT) {
    float logit[4][4];
    tile_logits(tensor_cores(), a, ktile, scratch, h, r0, tid, logit);

    if (!Accumulate) {
      // Softmax partial of this tile per row: max, then sum of exp(x - max), each reduced
      // over the 16 lanes that share a row (a fixed butterfly: deterministic).
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int r = r0 + ty + 16 * i;
        const bool row_ok = r < R;
        const std::int64_t pos = row_ok ? qpos[r % W] : 0;
        float x[4];
        float m = neg_infinity();
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int key = tx + 16 * k;
          const bool visible = row_ok && key < nk && kpos[key] <= pos;
          x[k] = masked_logit(logit[i][k], visible);
          m = x[k] > m ? x[k] : m;
        }
        m = group_max(m, 16);
        float s = 0.0f;
#pragma unroll
        for (int k = 0; k < 4; ++k) s += softmax_term(x[k], m);
        s = group_sum(s, 16);
        if (tx == 0 && row_ok) {
          softmax_partial p;
          p.max = m;
          p.sum = s;
          a.partials[(static_cast<std::int64_t>(h) * R + r) * a.stat_tiles + blockIdx.x] = p;
        }
      }
    } else {
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int rr = ty + 16 * i;
        const int r = r0 + rr;
        const bool row_ok = r < R;
        float lse = neg_infinity();
        std::int64_t pos = 0;
        if (row_ok) {
          const int g = r / W, t = r - g * W;
          pos = qpos[t];
          lse = a.engine_lse != nullptr ? a.engine_lse[(static_cast<std::int64_t>(h) * G + g) * a.engine_lse_stride + t]
                                        : a.row_lse[static_cast<std::int64_t>(h) * R + r];
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int key = tx + 16 * k;
          const bool visible = row_ok && key < nk && kpos[key] <= pos;
          ps[rr * (TK + 1) + key] = visible ? attention_prob(masked_logit(logit[i][k], true), lse) : 0.0f;
        }
      }
      __syncthreads();
      // Window aggregation: each (query head, key) pair of this chunk belongs to one thread,
      // which walks the chunk's observations of that head in ascending t, continuing the
      // running value of earlier chunks: the CPU's order.
      const int r_end = r0 + RT < R ? r0 + RT : R;
      const int g_lo = r0 / W, g_hi = (r_end - 1) / W;
      const int pairs = (g_hi - g_lo + 1) * TK;
      for (int e = tid; e < pairs; e += obs_threads) {
        const int g = g_lo + e / TK, key = e % TK;
        if (key >= nk) continue;
        const int rb = g * W > r0 ? g * W : r0;
        const int re = (g + 1) * W < r_end ? (g + 1) * W : r_end;
        float v = accs[g * TK + key];
        for (int r = rb; r < re; ++r) v = window_step(v, ps[(r - r0) * (TK + 1) + key], wts[r - g * W], a.max_window);
        accs[g * TK + key] = v;
      }
      __syncthreads();
    }
  }

  if (Accumulate) {
    for (int e = tid; e < G * TK; e += obs_threads) {
      const int g = e / TK, key = e % TK;
      if (key < nk) a.acc[(static_cast<std::int64_t>(h) * G + g) * a.candidates + j0 + key] = accs[e];
    }
  }
}

template <class QT, class KT, bool Accumulate>
__global__ void __launch_bounds__(obs_threads) obs_tile_kernel(obs_args<QT, KT> a) {
  obs_tile<QT, KT, Accumulate>(a);
}

/// A batch of sequences of one layer: sequence blockIdx.z with seqs[blockIdx.z]. The grid
/// covers the longest sequence; blocks past a sequence's tiles return at once (whole blocks),
/// as does the stats pass of a sequence with an engine LSE.
template <class QT, class KT, bool Accumulate>
__global__ void __launch_bounds__(obs_threads) obs_tile_batch_kernel(const obs_args<QT, KT>* seqs) {
  const obs_args<QT, KT>& a = seqs[blockIdx.z];
  if (!Accumulate && (a.engine_lse != nullptr || a.candidates == 0)) return;
  const int keys = Accumulate ? a.candidates : a.softmax_end;
  if (static_cast<std::int64_t>(blockIdx.x) >= num_tiles(keys, obs_tile_keys)) return;
  obs_tile<QT, KT, Accumulate>(a);
}

/// The row LSEs of a batch: warp w of block x folds row 8x + w of sequence blockIdx.z.
template <class QT, class KT>
__global__ void __launch_bounds__(row_lse_threads)
    obs_row_lse_batch_kernel(const obs_args<QT, KT>* seqs, std::int64_t kv_heads) {
  const obs_args<QT, KT>& a = seqs[blockIdx.z];
  const std::int64_t row = static_cast<std::int64_t>(blockIdx.x) * row_lse_rows_per_block + (threadIdx.x >> 5);
  if (a.engine_lse != nullptr || a.candidates == 0 || a.softmax_end == 0 || row >= kv_heads * a.rows)
    return;  // whole warps
  fold_row_lse(a.partials, a.stat_tiles, row, a.row_lse);
}

/// Shapes and 32-bit limits checked before anything is launched.
inline status check_obs_limits(const obs_dims& d, std::int64_t dim, const char* fn) noexcept {
  if (!fits_int32(d.tokens, 2 * obs_tile_keys))
    return status::error(errc::overflow, fn, "keys.num_tokens", "expected < 2^31 - 128 tokens on the GPU, got %lld",
                         static_cast<long long>(d.tokens));
  const std::int64_t all_rows = kvevict::detail::saturating_mul(d.kv_heads, d.rows());
  if (!fits_int32(d.rows(), obs_tile_rows) || !fits_int32(all_rows))
    return status::error(errc::overflow, fn, "queries", "expected Hq * W < 2^31 observation rows, got %lld",
                         static_cast<long long>(all_rows));
  if (!grid_fits(num_tiles(d.tokens, obs_tile_keys), d.kv_heads))
    return status::error(errc::overflow, fn, "keys.num_heads", "expected Hkv <= 65535 on the GPU, got %lld",
                         static_cast<long long>(d.kv_heads));
  if (dim > 4096)
    return status::error(errc::unsupported, fn, "keys.head_dim", "expected head_dim <= 4096 on the GPU, got %lld",
                         static_cast<long long>(dim));
  return status();
}

/// Folds the per-query-head aggregated rows into a running per-KV-head state:
/// state[h, j] <- eta * state[h, j] + reduce_g acc[h * G + g, j] (sum for mean/sum, max).
template <int Unused = 0>
__global__ void __launch_bounds__(256)
    obs_state_kernel(const float* acc, std::int64_t candidates, int group, gqa_reduction r, float* state,
                     std::int64_t state_stride, float eta, std::int64_t kv_heads) {
  const std::int64_t n = kv_heads * candidates;
  for (std::int64_t i = static_cast<std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t h = i / candidates, j = i - h * candidates;
    float v = 0.0f;
    for (int g = 0; g < group; ++g) v = gqa_step(v, acc[(h * group + g) * candidates + j], r, g == 0);
    float* s = state + h * state_stride + j;
    *s = decayed(*s, eta, v);
  }
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_OBSERVATION_KERNELS_CUH
