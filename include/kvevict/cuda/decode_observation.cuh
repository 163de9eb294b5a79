// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DECODE_OBSERVATION_CUH
#define KVEVICT_CUDA_DECODE_OBSERVATION_CUH

// DeferKV's decode observation on the GPU: one query per query head (W = 1) folded into the
// running state of a layer,
//
//   state[h, j] <- eta * state[h, j] + reduce_g A[g, j]          for candidates j < C
//
// where A[g, .] is query head (h, g)'s softmax over its domain and reduce is the sum over
// the G heads (gqa_reduction::mean and ::sum; mean's 1/G is applied at finalisation) or
// their NaN-propagating max. eta == 0 overwrites the state (it may hold anything then).
// Scores come from the state with finalize_state_scores (scale 1/Z). This is the library's
// own definition of DeferKV's running state (design.md §5).
//
// One query per head makes this bandwidth-bound: the kernels stream K once, built to keep
// HBM busy (docs/cuda.md, "Decode observation").
//   1. logits: grid (key tiles of 256, Hkv). Half a warp per key, 4 keys in flight per
//      half-warp; a lane owns 8 channels per 128-channel panel (one 16-byte load of 16-bit
//      keys, two of float, one 8-byte load of fp8, or 8 scalar loads; tiling.hpp
//      vector_width) and keeps its slice of the group's scaled queries in registers. G is a
//      compile-time bucket (1, 2, 4, 8; chunks of 8 beyond): no FMA or shuffle is spent past
//      the bucket (G = 3, 5..7 and a last partial chunk pad it with zero queries); the 4 x GB
//      partial dots of a lane are
//      transpose-reduced (each step sends half of the remaining values), leaving each lane
//      with finished logits. With an engine LSE this kernel also applies the softmax and
//      updates the state: one pass. Without it, it writes the masked logits [Hq, L] (4 bytes
//      per query head and key, against 2*d bytes of K per KV head and key) and per-tile
//      softmax partials, folded once per block per query head.
//   2. row LSE (two-pass only, detail/row_lse.cuh): one warp per query head folds its tile
//      partials into its LSE (fixed order), once.
//   3. update (two-pass only): each block turns its keys' logits into probabilities with the
//      G LSEs of its KV head and updates the state.

#include <cuda_runtime.h>

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "kvevict/config.hpp"
#include "kvevict/cuda/common.cuh"
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

/// Parameters of one decode observation step.
struct decode_params {
  float eta = 1.0f;  ///< decay of the state, in [0, 1]; 0 overwrites it
  gqa_reduction gqa = gqa_reduction::mean;
  softmax_domain domain = softmax_domain::visible;
  std::int64_t protected_tail = 0;  ///< P: the state covers candidates [0, L - P)
};

/// Optional device inputs of a decode step.
struct decode_inputs {
  index_ptr key_positions = nullptr;  ///< [L], or null: key j at position j
  /// [Hq] natural-log LSE of each query head's decode query (flash-decoding returns it);
  /// softmax_domain::visible only. Makes the step a single pass over K.
  const float* lse = nullptr;
  std::int64_t lse_head_stride = 0;  ///< elements between query heads; 0 means 1
};

namespace detail {

constexpr int decode_threads = 256;
/// Head-dimension channels per panel: 16 lanes (half a warp, one key) x 8 channels each.
constexpr int decode_panel = 128;
constexpr int decode_lane_channels = decode_panel / 16;
/// Keys each half-warp has in flight per sweep: 16 half-warps x 4 keys x 256 bytes (d = 128,
/// 16-bit keys) are 16 KiB of loads outstanding per block.
constexpr int decode_keys_in_flight = 4;

/// Query heads per register chunk for a group of G: the next power of two up to 8 (G <= 8
/// runs one chunk: with d <= 128 the queries are loaded into registers once per block), else
/// chunks of 8.
constexpr int decode_group_bucket(std::int64_t group) noexcept {
  return group <= 1 ? 1 : group <= 2 ? 2 : group <= 4 ? 4 : 8;
}

template <class QT, class KT>
struct decode_args {
  query_view<const QT> q;
  cache_view<const KT> k;
  index_ptr key_positions = nullptr;
  const float* engine_lse = nullptr;
  std::int64_t engine_lse_stride = 1;
  float* logits = nullptr;              // [Hq, softmax_end] (softmax_end of the capacity)
  softmax_partial* partials = nullptr;  // [Hq, tiles]
  float* row_lse = nullptr;             // [Hq]
  float* state = nullptr;
  std::int64_t state_stride = 0;
  float eta = 1.0f;
  gqa_reduction gqa = gqa_reduction::mean;
  std::uint32_t* flags = nullptr;
  float scale = 1.0f;
  // Host-known sizes; for a plan, those of its capacity (grids and workspace strides).
  int group = 1, dim = 1, tokens = 0, candidates = 0, softmax_end = 0, tiles = 0;
  // A plan's per-step inputs on the device: the token count (null: `tokens` is the length)
  // and the counter of folded steps (null: not counted).
  const std::int32_t* device_tokens = nullptr;
  std::int32_t* steps = nullptr;
  int protected_tail = 0;
  bool visible_domain = true;
};

/// The lengths one step works on: the host's, or a plan's device-side token count checked
/// against its capacity (outside it: nothing to do, flagged once).
struct decode_extent {
  int tokens = 0, candidates = 0, softmax_end = 0;
  bool valid = true;
};

template <class QT, class KT>
__device__ __forceinline__ decode_extent step_extent(const decode_args<QT, KT>& a, bool report) {
  decode_extent e;
  if (a.device_tokens == nullptr) {
    e.tokens = a.tokens;
    e.candidates = a.candidates;
    e.softmax_end = a.softmax_end;
    return e;
  }
  const std::int32_t n = *a.device_tokens;
  if (n < 0 || n > a.tokens) {
    if (report) raise_flag(a.flags, flag_length_out_of_range);
    e.valid = false;
    return e;
  }
  e.tokens = n;
  e.candidates = n > a.protected_tail ? n - a.protected_tail : 0;
  e.softmax_end = a.visible_domain ? n : e.candidates;
  return e;
}

/// Counts a folded step (one thread of the step's last kernel).
template <class QT, class KT>
__device__ __forceinline__ void count_step(const decode_args<QT, KT>& a, const decode_extent& e) {
  if (a.steps != nullptr && e.valid && threadIdx.x == 0 && blockIdx.x == 0 && blockIdx.y == 0) atomicAdd(a.steps, 1);
}

/// Row stride of the tile's logits in shared memory: 8 words past the 256 keys put the rows
/// of a transpose-reduce's writers (8 g + key, 4 keys per half-warp) in distinct banks.
constexpr std::int64_t decode_logit_stride = decode_tile_keys + 8;

/// Dynamic shared memory of the logits kernel: the scaled queries zero-padded to whole
/// chunks and panels, [chunks * GB][panels * 128], and the tile's masked logits [G][264].
inline std::size_t decode_shared_bytes(std::int64_t dim, std::int64_t group) noexcept {
  const std::int64_t gb = decode_group_bucket(group);
  const std::int64_t rows = ceil_div(group, gb) * gb, cols = ceil_div(dim, decode_panel) * decode_panel;
  return static_cast<std::size_t>(rows * cols + group * decode_logit_stride) * sizeof(float);
}

/// state <- eta * state + v (eta == 0 overwrites).
__device__ __forceinline__ void update_state(float* s, float eta, float v) {
  *s = decayed(*s, eta, v);
}

/// Channel of the `v`-th element of a lane's `it`-th load in a panel: the 16 lanes of a key
/// cover 16 * Vec consecutive channels per load, so every load is one coalesced segment.
template <int Vec>
__device__ __forceinline__ int decode_channel(int panel, int it, int lane16, int v) {
  return panel * decode_panel + it * 16 * Vec + lane16 * Vec + v;
}

/// Where channel `c` of a query row sits in shared memory. With 8 channels per lane in one
/// load (Vec = 8) a lane's two 4-channel halves are stored 64 words apart, lanes 4 words
/// apart, so each of its two LDS.128 reads 256 contiguous bytes across the half-warp
/// (2 wavefronts, not 4); Vec = 1 and 4 are already laid out that way.
template <int Vec>
__device__ __forceinline__ int decode_query_slot(int c) {
  if constexpr (Vec == 8) {
    const int x = c % decode_panel;
    return c - x + (x & 4) * 16 + (x >> 3) * 4 + (x & 3);
  } else {
    return c;
  }
}

/// A lane's slice of chunk rows [g0, g0 + GB) of the scaled queries, panel `panel`, into
/// registers (rows and channels past G and d are zero in shared memory).
template <int Vec, int GB>
__device__ __forceinline__ void load_query_slice(const float* qs, int stride, int g0, int panel, int lane16,
                                                 float (&q)[GB][decode_lane_channels]) {
  constexpr int loads = decode_lane_channels / Vec;
#pragma unroll
  for (int g = 0; g < GB; ++g)
#pragma unroll
    for (int it = 0; it < loads; ++it)
#pragma unroll
      for (int v = 0; v < Vec; ++v)
        q[g][it * Vec + v] = qs[(g0 + g) * stride + decode_query_slot<Vec>(decode_channel<Vec>(panel, it, lane16, v))];
}

/// The stored bytes of a lane's 8 channels of one key row with 8-element loads: 16 for 16-bit
/// keys, 8 for fp8 (a 128-channel fp8 row is 16 lanes x 8 bytes, so no lane idles at d = 128).
template <class KT>
using decode_key_words = std::conditional_t<sizeof(KT) == 1, uint2, uint4>;

/// Loads a lane's words of one key row in a panel without widening them (zero past d or for
/// a row that is not read), so that the load can be issued a sweep before its use.
template <class KT>
__device__ __forceinline__ decode_key_words<KT> load_key_words(const cache_view<const KT>& k, std::int64_t off,
                                                               int panel, int lane16, int d) {
  const int c = decode_channel<8>(panel, 0, lane16, 0);
  decode_key_words<KT> w{};
  if (off >= 0 && c < d) w = __ldg(reinterpret_cast<const decode_key_words<KT>*>(k.data + off + c));
  return w;
}

/// Widens a lane's words to its 8 channels (exact): 16 bytes of bf16/fp16 (common.cuh's
/// widening), 8 bytes of fp8.
template <class KT>
__device__ __forceinline__ void widen_key_words(const uint4& w, float* out) {
  widen_16bit_words<KT>(w, out);
}

template <class KT>
__device__ __forceinline__ void widen_key_words(const uint2& w, float* out) {
  const unsigned words[2] = {w.x, w.y};
#pragma unroll
  for (int i = 0; i < 8; ++i) {
    const auto b = static_cast<std::uint8_t>(words[i / 4] >> (8 * (i % 4)));
    out[i] = std::is_same<KT, fp8_e4m3>::value ? kvevict::detail::fp8_e4m3_bits_to_float(b)
                                               : kvevict::detail::fp8_e5m2_bits_to_float(b);
  }
}

/// A lane's 8 channels of one key row in a panel (zero past d or for a row that is not read).
template <int Vec, class KT>
__device__ __forceinline__ void load_key_slice(const cache_view<const KT>& k, std::int64_t off, int panel, int lane16,
                                               int d, float (&out)[decode_lane_channels]) {
  if constexpr (Vec == 8) {
    widen_key_words<KT>(load_key_words(k, off, panel, lane16, d), out);
  } else {
    constexpr int loads = decode_lane_channels / Vec;
#pragma unroll
    for (int it = 0; it < loads; ++it) {
      const int c = decode_channel<Vec>(panel, it, lane16, 0);
      float* o = out + it * Vec;
      if (off < 0 || c >= d) {  // Vec divides d when Vec > 1: a load is wholly in or out
#pragma unroll
        for (int v = 0; v < Vec; ++v) o[v] = 0.0f;
      } else if constexpr (Vec == 1) {
        o[0] = load_float(k.data + off + static_cast<std::int64_t>(c) * k.dim_stride);
      } else {
        static_assert(Vec == 4 && sizeof(KT) == 4, "float keys load 16 bytes twice");
        load_vector(k.data + off + c, o);
      }
    }
  }
}

/// Row offsets of a half-warp's keys i0 .. i0 + U - 1 (-1 past nk or for a block id outside
/// the pool, flagged by lane 0) and the mask of those that are read and visible.
template <int U, class QT, class KT>
__device__ __forceinline__ unsigned sweep_rows(const decode_args<QT, KT>& a, int h, int j0, int i0, int nk,
                                               std::int64_t pos, int lane16, std::int64_t (&off)[U]) {
  unsigned seen = 0;
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const bool valid = i0 + u < nk;
    const std::int64_t j = static_cast<std::int64_t>(j0) + i0 + u;
    off[u] = valid ? checked_row_offset(a.k, h, j, lane16 == 0 ? a.flags : nullptr) : -1;
    if (off[u] >= 0 && (a.key_positions != nullptr ? a.key_positions[j] : j) <= pos) seen |= 1u << u;
  }
  return seen;
}

/// Transpose-reduce over the 16 lanes of a half-warp: each lane holds N partial sums, value n
/// wanted summed over the 16 lanes. At each of the 4 steps (lane offsets 8, 4, 2, 1) a lane
/// keeps one half of its remaining values and sends the other half to its partner, which
/// adds it to the same half: N/2 + N/4 + ... shuffles instead of 4 * N. Once one value is
/// left the remaining steps are a plain butterfly. Afterwards x[0 .. max(N/16, 1)) hold
/// complete sums: of values lane16 * N/16 + r when N >= 16, else of value lane16 * N / 16
/// (the same on 16 / N neighbouring lanes). Fixed order: deterministic.
template <int N, int O>
__device__ __forceinline__ void transpose_reduce(float* x, int lane16) {
  if constexpr (O > 0) {
    if constexpr (N >= 2) {
      const bool upper = (lane16 & O) != 0;
#pragma unroll
      for (int i = 0; i < N / 2; ++i) {
        const float send = upper ? x[i] : x[i + N / 2];
        const float keep = upper ? x[i + N / 2] : x[i];
        x[i] = keep + __shfl_xor_sync(full_warp, send, O);
      }
      transpose_reduce<N / 2, O / 2>(x, lane16);
    } else {
      x[0] += __shfl_xor_sync(full_warp, x[0], O);
      transpose_reduce<1, O / 2>(x, lane16);
    }
  }
}

/// Logits of one 256-key tile and one KV head. Half a warp per key, 4 keys in flight: each
/// lane owns 8 channels per 128-channel panel and keeps its slice of GB scaled queries in
/// registers (loaded once per block when G <= 8 and d <= 128; otherwise reloaded from
/// shared memory per chunk and panel), so the inner loop reads only K. The GB x 4 partial
/// dots are transpose-reduced; the lanes that end with a finished logit write it to shared
/// memory, from which the tile's softmax partials (two passes) or probabilities (engine LSE)
/// are made once per block. Two blocks per SM for buckets <= 4 (at most 128 registers; left
/// to itself ptxas picked 64-80 registers with small spills for some of them); bucket 8
/// holds 64 query registers and runs one block per SM.
template <class QT, class KT, int Vec, int GB, bool OnePass>
__global__ void __launch_bounds__(decode_threads, GB <= 4 ? 2 : 1) decode_logits_kernel(decode_args<QT, KT> a) {
  constexpr int TK = static_cast<int>(decode_tile_keys);
  constexpr int U = decode_keys_in_flight, N = GB * U;
  constexpr int per_lane = N >= 16 ? N / 16 : 1;
  constexpr int LS = static_cast<int>(decode_logit_stride);
  static_assert(TK % (decode_threads / 16 * U) == 0, "every half-warp sweeps the tile the same number of times");
  KVEVICT_DYNAMIC_SHARED(float4, decode_smem_raw);
  const int d = a.dim, G = a.group;
  const int chunks = GB < 8 ? 1 : (G + GB - 1) / GB, panels = (d + decode_panel - 1) / decode_panel;
  const int qstride = panels * decode_panel;
  float* qs = reinterpret_cast<float*>(decode_smem_raw);  // [chunks * GB][qstride] scaled, zero-padded, slots
  float* ls = qs + chunks * GB * qstride;                 // [G][LS] masked logits of the tile
  const int tid = static_cast<int>(threadIdx.x);
  const int h = static_cast<int>(blockIdx.y);
  const bool first_block = blockIdx.x == 0 && blockIdx.y == 0;
  const decode_extent ext = step_extent(a, tid == 0 && first_block);
  const int end = OnePass ? ext.candidates : ext.softmax_end;
  const int j0 = static_cast<int>(blockIdx.x) * TK;
  const int nk = end - j0 < TK ? end - j0 : TK;
  const std::int64_t pos = a.q.positions[0];
  if (pos < 0 && tid == 0 && first_block) raise_flag(a.flags, flag_negative_position);

  for (int e = tid; e < chunks * GB * qstride; e += decode_threads) {
    const int g = e / qstride, c = e - g * qstride;
    qs[g * qstride + decode_query_slot<Vec>(c)] =
        g < G && c < d ? load_float(a.q.data + a.q.offset(static_cast<std::int64_t>(h) * G + g, 0, c)) * a.scale : 0.0f;
  }
  __syncthreads();

  const int half = tid >> 4, l16 = tid & 15;
  const bool resident = chunks == 1 && panels == 1;
  float q[GB][decode_lane_channels];
  load_query_slice<Vec, GB>(qs, qstride, 0, 0, l16, q);  // the only load when resident
  // Half-warp `half` takes keys i0 .. i0 + U - 1 of each sweep. Both halves of a warp run the
  // same sweeps (the stop test looks at the warp's first key, w0; nk <= TK), so every shuffle
  // sees all 32 lanes; blocks past a plan's current length sweep nothing. The next sweep's
  // row offsets (block-table reads) are loaded before this sweep computes, and so, for bucket
  // 8 with 8-element loads, are its first panel's key words: two sweeps of K in flight per
  // half-warp make up for the one block per SM its registers allow. (Smaller buckets run
  // two blocks per SM instead; their prefetch would not fit in 128 registers.)
  constexpr bool prefetch = Vec == 8 && GB == 8;
  constexpr int step = decode_threads / 16 * U;
  const int odd = (half & 1) * U;
  std::int64_t off[U];
  unsigned seen = 0;
  decode_key_words<KT> next[U] = {};
  int w0 = (half & ~1) * U;
  if (w0 < nk) {
    seen = sweep_rows<U>(a, h, j0, w0 + odd, nk, pos, l16, off);
    if constexpr (prefetch) {
#pragma unroll
      for (int u = 0; u < U; ++u) next[u] = load_key_words(a.k, off[u], 0, l16, d);
    }
  }
  for (; w0 < nk; w0 += step) {
    const int i0 = w0 + odd;
    std::int64_t row[U];
    decode_key_words<KT> words[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
      row[u] = off[u];
      if constexpr (prefetch) words[u] = next[u];
    }
    const unsigned visible = seen;
    if (w0 + step < nk) {
      seen = sweep_rows<U>(a, h, j0, w0 + step + odd, nk, pos, l16, off);
      if constexpr (prefetch) {
#pragma unroll
        for (int u = 0; u < U; ++u) next[u] = load_key_words(a.k, off[u], 0, l16, d);
      }
    }
    // With one panel the keys' slices stay in registers for every chunk: K is read once.
    float kv[U][decode_lane_channels];
    for (int c0 = 0; c0 < chunks; ++c0) {
      float dot[N];
#pragma unroll
      for (int n = 0; n < N; ++n) dot[n] = 0.0f;
      for (int p = 0; p < panels; ++p) {
        if (!resident) load_query_slice<Vec, GB>(qs, qstride, c0 * GB, p, l16, q);
        if constexpr (prefetch) {
          if (p == 0) {
#pragma unroll
            for (int u = 0; u < U; ++u) widen_key_words<KT>(words[u], kv[u]);
          } else {
#pragma unroll
            for (int u = 0; u < U; ++u) load_key_slice<Vec>(a.k, row[u], p, l16, d, kv[u]);
          }
        } else if (c0 == 0 || panels > 1) {
#pragma unroll
          for (int u = 0; u < U; ++u) load_key_slice<Vec>(a.k, row[u], p, l16, d, kv[u]);
        }
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
          for (int g = 0; g < GB; ++g)
#pragma unroll
            for (int c = 0; c < decode_lane_channels; ++c) dot[u * GB + g] = fmaf(q[g][c], kv[u][c], dot[u * GB + g]);
      }
      transpose_reduce<N, 8>(dot, l16);
      constexpr int spread = N >= 16 ? 1 : 16 / N;  // never 0: clang checks the % in every instantiation
      const bool writer = N >= 16 || l16 % spread == 0;
#pragma unroll
      for (int r = 0; r < per_lane; ++r) {
        const int idx = N >= 16 ? l16 * per_lane + r : l16 * N / 16;
        const int u = idx / GB, g = c0 * GB + idx % GB;
        if (writer && g < G && i0 + u < nk) ls[g * LS + i0 + u] = masked_logit(dot[r], ((visible >> u) & 1u) != 0);
      }
    }
  }
  __syncthreads();

  if (OnePass) {
    for (int i = tid; i < nk; i += decode_threads) {
      const std::int64_t j = static_cast<std::int64_t>(j0) + i;
      float v = 0.0f;
      for (int g = 0; g < G; ++g) {
        const float lse = a.engine_lse[(static_cast<std::int64_t>(h) * G + g) * a.engine_lse_stride];
        v = gqa_step(v, attention_prob(ls[g * LS + i], lse), a.gqa, g == 0);
      }
      update_state(a.state + h * a.state_stride + j, a.eta, v);
    }
    count_step(a, ext);
    return;
  }
  // Two-pass: per query head, this tile's softmax partial (one warp per head) and the logits.
  const int warp = tid >> 5, lane = tid & 31;
  for (int g = warp; g < G; g += decode_threads / 32) {
    float m = neg_infinity();
    for (int i = lane; i < nk; i += 32) m = ls[g * LS + i] > m ? ls[g * LS + i] : m;
    m = group_max(m, 32);
    float s = 0.0f;
    for (int i = lane; i < nk; i += 32) s += softmax_term(ls[g * LS + i], m);
    s = group_sum(s, 32);
    const std::int64_t qh = static_cast<std::int64_t>(h) * G + g;
    if (lane == 0) {
      softmax_partial p;
      p.max = m;
      p.sum = s;
      a.partials[qh * a.tiles + blockIdx.x] = p;
    }
    for (int i = lane; i < nk; i += 32) a.logits[qh * a.softmax_end + j0 + i] = ls[g * LS + i];
    // A tile past a plan's current length holds no key: its partial is (-inf, 0), which the
    // row LSE folds exactly as if the tile did not exist.
  }
}

template <class QT, class KT>
__global__ void __launch_bounds__(decode_threads) decode_update_kernel(decode_args<QT, KT> a) {
  constexpr int TK = static_cast<int>(decode_tile_keys);
  KVEVICT_DYNAMIC_SHARED(float4, decode_smem_raw);
  float* lse = reinterpret_cast<float*>(decode_smem_raw);  // [G]
  const int tid = static_cast<int>(threadIdx.x);
  const int h = static_cast<int>(blockIdx.y), G = a.group;
  for (int g = tid; g < G; g += decode_threads) lse[g] = a.row_lse[static_cast<std::int64_t>(h) * G + g];
  __syncthreads();
  const decode_extent ext = step_extent(a, false);
  const int j0 = static_cast<int>(blockIdx.x) * TK;
  const int nk = ext.candidates - j0 < TK ? ext.candidates - j0 : TK;
  for (int i = tid; i < nk; i += decode_threads) {
    const std::int64_t j = static_cast<std::int64_t>(j0) + i;
    float v = 0.0f;
    for (int g = 0; g < G; ++g) {
      const std::int64_t qh = static_cast<std::int64_t>(h) * G + g;
      v = gqa_step(v, attention_prob(a.logits[qh * a.softmax_end + j], lse[g]), a.gqa, g == 0);
    }
    update_state(a.state + h * a.state_stride + j, a.eta, v);
  }
  count_step(a, ext);
}

template <class QT, class KT, int Vec, int GB>
status launch_decode(const decode_args<QT, KT>& a, bool one_pass, unsigned hkv, cudaStream_t stream, const char* fn) {
  const std::size_t smem = decode_shared_bytes(a.dim, a.group);
  const unsigned tiles_c = static_cast<unsigned>(num_tiles(a.candidates, decode_tile_keys));
  if (one_pass) {
    if (tiles_c == 0) return status();
    return launch(fn, "decode_logits_kernel<one pass>", {dim3(tiles_c, hkv), dim3(decode_threads), smem, stream},
                  decode_logits_kernel<QT, KT, Vec, GB, true>, a);
  }
  if (a.tiles == 0 || tiles_c == 0) return status();
  KVEVICT_RETURN_IF_ERROR(launch(fn, "decode_logits_kernel",
                                 {dim3(static_cast<unsigned>(a.tiles), hkv), dim3(decode_threads), smem, stream},
                                 decode_logits_kernel<QT, KT, Vec, GB, false>, a));
  KVEVICT_RETURN_IF_ERROR(
      launch_row_lse(a.partials, a.tiles, static_cast<std::int64_t>(hkv) * a.group, a.row_lse, stream, fn));
  const std::size_t smem2 = static_cast<std::size_t>(a.group) * sizeof(float);
  return launch(fn, "decode_update_kernel", {dim3(tiles_c, hkv), dim3(decode_threads), smem2, stream},
                decode_update_kernel<QT, KT>, a);
}

/// The group bucket as a template argument.
template <class QT, class KT, int Vec>
status launch_decode_group(const decode_args<QT, KT>& a, bool one_pass, unsigned hkv, cudaStream_t stream,
                           const char* fn) {
  switch (decode_group_bucket(a.group)) {
    case 1:
      return launch_decode<QT, KT, Vec, 1>(a, one_pass, hkv, stream, fn);
    case 2:
      return launch_decode<QT, KT, Vec, 2>(a, one_pass, hkv, stream, fn);
    case 4:
      return launch_decode<QT, KT, Vec, 4>(a, one_pass, hkv, stream, fn);
    default:
      return launch_decode<QT, KT, Vec, 8>(a, one_pass, hkv, stream, fn);
  }
}

}  // namespace detail

/// Bytes of device workspace `decode_observation` needs (0 with an engine LSE): the masked
/// logits [Hq, L'], tile partials [Hq, ceil(L' / 256)] and LSEs [Hq], L' = L (visible
/// domain) or C.
inline std::size_t decode_observation_workspace_size(const layer_shape& shape, const decode_params& p,
                                                     bool engine_lse = false) noexcept {
  scoring_params sp;
  sp.domain = p.domain;
  sp.protected_tail = p.protected_tail;
  const detail::obs_dims d = detail::make_obs_dims(shape.num_kv_heads, shape.num_query_heads, 1, shape.num_tokens, sp);
  if (engine_lse) return 0;
  kvevict::detail::arena a;
  detail::decode_workspace w;
  detail::carve_decode_workspace(a, d, false, &w);
  return a.used();
}

namespace detail {

/// A validated decode step: kernel arguments, pass count and vector width.
template <class Q, class K>
struct decode_launch {
  decode_args<Q, K> args;
  bool one_pass = false;
  bool vectorised = false;
};

template <class Q, class K>
status launch_step(const decode_launch<Q, K>& l, cudaStream_t stream, const char* fn) {
  const unsigned hkv = static_cast<unsigned>(l.args.k.num_heads);
  // A lane owns 8 channels of a key per panel: one 16-byte load of 16-bit keys, two of float
  // keys, one 8-byte load of fp8 keys, or eight scalar loads when the rows do not allow vectors.
  constexpr int vec = 16 / sizeof(K) < 8 ? static_cast<int>(16 / sizeof(K)) : 8;
  if (l.vectorised) return launch_decode_group<Q, K, vec>(l.args, l.one_pass, hkv, stream, fn);
  return launch_decode_group<Q, K, 1>(l.args, l.one_pass, hkv, stream, fn);
}

/// Host validation of a decode step (or of a plan at its capacity) and its kernel arguments.
template <class Q, class K>
status decode_prepare(const query_view<const Q>& queries, const cache_view<const K>& keys, const decode_params& p,
                      score_view state, workspace_span ws, const decode_inputs& in, const launch_options& opt,
                      const char* fn, decode_launch<Q, K>* out) {
  KVEVICT_RETURN_IF_ERROR(validate_device_query_view(queries, opt, fn, "queries"));
  KVEVICT_RETURN_IF_ERROR(validate_device_cache_view(keys, opt, fn, "keys"));
  if (queries.num_queries != 1)
    return status::error(errc::invalid_shape, fn, "queries.num_queries", "expected 1 decode query per head, got %lld",
                         static_cast<long long>(queries.num_queries));
  if (queries.head_dim != keys.head_dim)
    return status::error(errc::invalid_shape, fn, "queries.head_dim", "expected keys.head_dim = %lld, got %lld",
                         static_cast<long long>(keys.head_dim), static_cast<long long>(queries.head_dim));
  if (queries.num_heads % keys.num_heads != 0)
    return status::error(errc::invalid_shape, fn, "queries.num_heads",
                         "expected a multiple of keys.num_heads = %lld (GQA), got %lld",
                         static_cast<long long>(keys.num_heads), static_cast<long long>(queries.num_heads));
  if (!(p.eta >= 0.0f && p.eta <= 1.0f))
    return status::error(errc::invalid_argument, fn, "p.eta", "expected eta in [0, 1], got %g",
                         static_cast<double>(p.eta));
  if (static_cast<unsigned>(p.gqa) > 2u)
    return status::error(errc::invalid_argument, fn, "p.gqa", "expected a gqa_reduction value, got %d",
                         static_cast<int>(p.gqa));
  if (static_cast<unsigned>(p.domain) > 1u)
    return status::error(errc::invalid_argument, fn, "p.domain", "expected a softmax_domain value, got %d",
                         static_cast<int>(p.domain));
  if (p.protected_tail < 0)
    return status::error(errc::invalid_argument, fn, "p.protected_tail", "expected >= 0, got %lld",
                         static_cast<long long>(p.protected_tail));
  scoring_params sp;
  sp.domain = p.domain;
  sp.protected_tail = p.protected_tail;
  const obs_dims dims = make_obs_dims(keys.num_heads, queries.num_heads, 1, keys.num_tokens, sp);
  KVEVICT_RETURN_IF_ERROR(kvevict::detail::validate_matrix_view(state, keys.num_heads, dims.candidates, fn, "state"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(state.data, opt, fn, "state.data"));
  KVEVICT_RETURN_IF_ERROR(check_device_pointer(in.key_positions, opt, fn, "inputs.key_positions"));
  const std::int64_t lse_stride = in.lse_head_stride != 0 ? in.lse_head_stride : 1;
  if (in.lse != nullptr) {
    if (p.domain != softmax_domain::visible)
      return status::error(errc::unsupported, fn, "inputs.lse",
                           "an engine log-sum-exp covers every visible key; it cannot be used with "
                           "softmax_domain::candidates");
    if (lse_stride < 1)
      return status::error(errc::invalid_stride, fn, "inputs.lse_head_stride", "expected >= 1, got %lld",
                           static_cast<long long>(lse_stride));
    KVEVICT_RETURN_IF_ERROR(check_device_pointer(in.lse, opt, fn, "inputs.lse"));
  }
  if (!fits_int32(dims.tokens, 2 * decode_tile_keys) ||
      !fits_int32(kvevict::detail::saturating_mul(queries.num_heads, dims.softmax_end())))
    return status::error(errc::overflow, fn, "keys.num_tokens",
                         "expected L < 2^31 - 512 and Hq * L < 2^31 on the GPU, got L = %lld",
                         static_cast<long long>(dims.tokens));
  if (!grid_fits(1, keys.num_heads))
    return status::error(errc::overflow, fn, "keys.num_heads", "expected Hkv <= 65535 on the GPU, got %lld",
                         static_cast<long long>(keys.num_heads));
  if (keys.head_dim > 8192)
    return status::error(errc::unsupported, fn, "keys.head_dim", "expected head_dim <= 8192 on the GPU, got %lld",
                         static_cast<long long>(keys.head_dim));

  out->one_pass = in.lse != nullptr;
  kvevict::detail::arena arena(ws);
  decode_workspace w;
  carve_decode_workspace(arena, dims, out->one_pass, &w);
  if (!out->one_pass) KVEVICT_RETURN_IF_ERROR(check_workspace(arena, ws, opt, fn, "decode_observation_workspace_size"));

  decode_args<Q, K>& a = out->args;
  a.q = queries;
  a.k = keys;
  a.key_positions = in.key_positions;
  a.engine_lse = in.lse;
  a.engine_lse_stride = lse_stride;
  a.logits = w.logits;
  a.partials = w.partials;
  a.row_lse = w.row_lse;
  a.state = state.data;
  a.state_stride = state.row_stride;
  a.eta = p.eta;
  a.gqa = p.gqa;
  a.flags = opt.device_flags;
  a.scale = (1.0f / std::sqrt(static_cast<float>(keys.head_dim))) * keys.scale;  // as the CPU's logit_scale()
  a.group = static_cast<int>(dims.group);
  a.dim = static_cast<int>(keys.head_dim);
  a.tokens = static_cast<int>(dims.tokens);
  a.candidates = static_cast<int>(dims.candidates);
  a.softmax_end = static_cast<int>(dims.softmax_end());
  a.tiles = static_cast<int>(decode_tiles(dims));
  // A tail longer than the capacity protects everything; clamped so that it fits an int.
  a.protected_tail = static_cast<int>(p.protected_tail < dims.tokens ? p.protected_tail : dims.tokens);
  a.visible_domain = dims.visible_domain;
  const std::int64_t vec =
      vector_width(reinterpret_cast<std::uintptr_t>(keys.data), static_cast<std::int64_t>(sizeof(K)), keys.head_dim,
                   keys.dim_stride, keys.head_stride, keys.token_stride, keys.is_paged() ? keys.block_stride : 0);
  out->vectorised = vec == 16 / static_cast<std::int64_t>(sizeof(K));
  return status();
}

}  // namespace detail

/// Folds one decode step's attention into a layer's DeferKV running state.
///
///   queries: [Hq, 1, d] post-RoPE decode queries (device; positions[0] is the step's position)
///   keys:    [Hkv, L, d] (device cache_view, any layout)
///   p:       eta in [0, 1], GQA reduction, softmax domain, protected tail P
///   state:   [Hkv, C] float32 device, C = max(0, L - P), updated in place
///   ws:      device memory, >= decode_observation_workspace_size(shape, p, in.lse != null)
///   in:      optional device key positions and engine LSE [Hq]
///
/// Enqueues one or three kernels on opt.stream; no synchronisation, no allocation. The
/// shapes and pointers are checked on every call: inside a captured CUDA graph, use
/// decode_plan instead.
template <class QT, class KT>
status decode_observation(query_view<QT> queries_in, cache_view<KT> keys_in, const decode_params& p, score_view state,
                          workspace_span ws, const decode_inputs& in = {}, const launch_options& opt = {}) {
  static constexpr const char* fn = "kvevict::cuda::decode_observation";
  using Q = std::remove_cv_t<QT>;
  using K = std::remove_cv_t<KT>;
  const query_view<const Q> queries = queries_in;
  const cache_view<const K> keys = keys_in;
  detail::decode_launch<Q, K> l;
  KVEVICT_RETURN_IF_ERROR(detail::decode_prepare(queries, keys, p, state, ws, in, opt, fn, &l));
  return detail::launch_step(l, opt.stream, fn);
}

/// A decode observation planned once and run every step without host checks, so that an
/// engine can capture the step in a CUDA graph (vLLM, SGLang and TensorRT-LLM capture decode)
/// and replay it while the cache grows.
///
/// `init` validates everything decode_observation would, at the plan's capacity: `keys`
/// describes the cache with num_tokens = the most tokens any step will see (its block table,
/// key positions, the state [Hkv, capacity - P] and the workspace sized for it). Per step the
/// engine writes, on the device, the current token count to `*num_tokens` (in [0, capacity];
/// outside it the step changes nothing and raises flag_length_out_of_range), the step's
/// position to queries.positions[0], the query, the engine LSE if any, and the new keys and
/// table entries; none of the pointers may change (a graph replays the same ones). `run`
/// enqueues the same kernels with the same launch shapes every time (sized for the capacity;
/// blocks past the current length return at once) and touches nothing on the host but the
/// launches. A step folds the keys [0, n) exactly as decode_observation over a view of n
/// tokens would, bit for bit.
///
/// `steps`, when given, is a device int32 incremented once per step whose token count was
/// valid: the engine (or a later kernel) knows how many decode observations the state holds
/// without host bookkeeping, e.g. for DeferKV's normaliser Z at finalisation.
template <class Q, class K>
class decode_plan {
 public:
  /// Validates and records the step (see the class comment). Nothing is launched. On an
  /// error the plan is left unusable (run refuses it).
  status init(query_view<const Q> queries, cache_view<const K> keys, const decode_params& p, score_view state,
              workspace_span ws, const std::int32_t* num_tokens, const decode_inputs& in = {},
              std::int32_t* steps = nullptr, const launch_options& opt = {}) {
    static constexpr const char* fn = "kvevict::cuda::decode_plan::init";
    ready_ = false;
    if (num_tokens == nullptr)
      return status::error(errc::null_pointer, fn, "num_tokens", "a plan reads the step's token count on the device");
    KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(num_tokens, opt, fn, "num_tokens"));
    KVEVICT_RETURN_IF_ERROR(detail::check_device_pointer(steps, opt, fn, "steps"));
    detail::decode_launch<Q, K> l;
    KVEVICT_RETURN_IF_ERROR(detail::decode_prepare(queries, keys, p, state, ws, in, opt, fn, &l));
    if (l.args.candidates == 0)
      return status::error(errc::invalid_shape, fn, "keys.num_tokens",
                           "the capacity (%lld tokens) leaves no candidate past the protected tail (%lld)",
                           static_cast<long long>(keys.num_tokens), static_cast<long long>(p.protected_tail));
    l.args.device_tokens = num_tokens;
    l.args.steps = steps;
    launch_ = l;
    ready_ = true;
    return status();
  }

  /// Enqueues one step on `stream` (capturable). Fails only for a plan that init did not
  /// accept, or when a launch fails.
  status run(cudaStream_t stream) const {
    static constexpr const char* fn = "kvevict::cuda::decode_plan::run";
    if (!ready_) return status::error(errc::invalid_argument, fn, "plan", "init has not succeeded on this plan");
    return detail::launch_step(launch_, stream, fn);
  }

  bool ready() const noexcept { return ready_; }

 private:
  detail::decode_launch<Q, K> launch_;
  bool ready_ = false;
};

}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DECODE_OBSERVATION_CUH
