// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_DECODE_KERNELS_CUH
#define KVEVICT_CUDA_DETAIL_DECODE_KERNELS_CUH

// The kernels of a GPU decode observation step (cuda/decode_observation.cuh says what they
// compute), their arguments, shared-memory sizes and launchers.

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
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_DECODE_KERNELS_CUH
