// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CUDA_DETAIL_SCORE_LOGIC_HPP
#define KVEVICT_CUDA_DETAIL_SCORE_LOGIC_HPP

// Element-wise scoring math of the CUDA kernels in host+device functions: the online
// softmax partials and their combination, the masking rule, window normalisation, GQA
// reduction and pooling at one output index. Each mirrors the CPU code (detail/observe.hpp,
// detail/finalize.hpp, detail/pooling.hpp) operation for operation, so that, given the same
// aggregated rows, the GPU finalisation equals the CPU's bit for bit (tested on the host in
// tests/unit/test_cuda_logic.cpp).

#include <cmath>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/scoring/params.hpp"
#include "kvevict/views/index_ptr.hpp"
#if defined(KVEVICT_CUDA_SIMULATOR)
#include <cuda_runtime.h>  // the simulator's __fadd_rn, __fmul_rn
#endif

KVEVICT_NAMESPACE_BEGIN
namespace cuda {
namespace detail {

// The device branches below also compile in the CPU simulator (KVEVICT_CUDA_SIMULATOR), whose
// intrinsics are exact host versions, so the branch nvcc's device pass takes is the one the
// simulator runs; the host branches serve nvcc's host pass and the host-only tests.
#if defined(__CUDA_ARCH__) || defined(KVEVICT_CUDA_SIMULATOR)
#define KVEVICT_CUDA_EXP(x) ::expf(x)
#define KVEVICT_CUDA_LOG(x) ::logf(x)
#else
#define KVEVICT_CUDA_EXP(x) std::exp(x)
#define KVEVICT_CUDA_LOG(x) std::log(x)
#endif

KVEVICT_HOST_DEVICE inline float neg_infinity() noexcept {
  return -HUGE_VALF;
}
KVEVICT_HOST_DEVICE inline float pos_infinity() noexcept {
  return HUGE_VALF;
}

/// max that propagates NaN, as kvevict::detail::nan_max (torch.max semantics).
KVEVICT_HOST_DEVICE inline float nan_max(float a, float b) noexcept {
  return (b != b || b > a) ? b : a;
}

/// A logit as the softmax sees it: -inf when the key is not visible to the observation or
/// when the logit is NaN (a NaN key or query gets no attention instead of poisoning the row).
KVEVICT_HOST_DEVICE inline float masked_logit(float logit, bool visible) noexcept {
  return (!visible || logit != logit) ? neg_infinity() : logit;
}

/// Softmax statistics of a set of logits: the maximum and the sum of exp(x - max). An empty
/// or fully masked set is (-inf, 0).
struct softmax_partial {
  float max = -HUGE_VALF;
  float sum = 0.0f;
};

/// sum of exp(x - m) contribution of one masked logit given the set's maximum m.
KVEVICT_HOST_DEVICE inline float softmax_term(float x, float m) noexcept {
  return m == neg_infinity() ? 0.0f : KVEVICT_CUDA_EXP(x - m);
}

/// Combines partials a and b (of disjoint key sets) into the partial of their union. The
/// result does not depend on which keys went into which partial beyond rounding; the
/// kernels always combine in a fixed order, so results are deterministic.
KVEVICT_HOST_DEVICE inline softmax_partial combine(softmax_partial a, softmax_partial b) noexcept {
  softmax_partial r;
  r.max = b.max > a.max ? b.max : a.max;
  if (r.max == neg_infinity()) return r;
  // A partial at -inf holds no key: it contributes nothing (exp(-inf - m) * 0).
  const float ta = a.max == neg_infinity() ? 0.0f : a.sum * KVEVICT_CUDA_EXP(a.max - r.max);
  const float tb = b.max == neg_infinity() ? 0.0f : b.sum * KVEVICT_CUDA_EXP(b.max - r.max);
  r.sum = ta + tb;
  return r;
}

/// Natural-log log-sum-exp from a partial, with the CPU's conventions: -inf when no key is
/// visible, NaN when the sum is NaN (a +inf logit makes exp(inf - inf) NaN, as on the CPU).
KVEVICT_HOST_DEVICE inline float partial_lse(softmax_partial p) noexcept {
  return p.sum > 0.0f ? p.max + KVEVICT_CUDA_LOG(p.sum) : (p.sum == 0.0f ? neg_infinity() : p.sum);
}

/// Attention probability of a masked logit given its row's log-sum-exp, with the CPU's rule
/// (accumulate_row): a masked key (not visible, or a NaN logit) gets exactly 0 whatever the
/// lse, so a NaN lse (a +inf logit in the row) makes the visible keys' probabilities NaN and
/// leaves the masked ones at 0. A row whose lse is -inf sees no key of its domain.
KVEVICT_HOST_DEVICE inline float attention_prob(float masked, float lse) noexcept {
  if (masked == neg_infinity() || lse == neg_infinity()) return 0.0f;
  return KVEVICT_CUDA_EXP(masked - lse);
}

/// Window aggregation step over observations in ascending t, as the CPU's accumulator:
/// acc starts at 0; max takes nan_max, the sums add w_t * p (w_t = 1 unless weighted).
KVEVICT_HOST_DEVICE inline float window_step(float acc, float prob, float weight, bool max_over_window) noexcept {
  if (max_over_window) return nan_max(acc, prob);
  return weight == 1.0f ? acc + prob : acc + weight * prob;
}

/// A running state's update, state <- eta * state + v, with eta == 0 overwriting (the old
/// state may hold anything then, NaN included). Two roundings, never a fused multiply-add,
/// so host and device agree.
KVEVICT_HOST_DEVICE inline float decayed(float old, float eta, float v) noexcept {
  if (eta == 0.0f) return v;
#if defined(__CUDA_ARCH__) || defined(KVEVICT_CUDA_SIMULATOR)
  return __fadd_rn(__fmul_rn(eta, old), v);
#else
  const volatile float scaled = eta * old;  // keeps the compiler from contracting into an FMA
  return scaled + v;
#endif
}

/// Window normalisation of an aggregated value (kvevict::detail::window_normaliser): divide
/// by the number of observations that see the key (visible_mean, count >= 0), or multiply by
/// a scale (1/W for mean, 1/sum(w) for weighted; 1 leaves the value untouched).
KVEVICT_HOST_DEVICE inline float normalise(float v, float scale, bool per_key, float count) noexcept {
  if (per_key) return count > 0.0f ? v / count : 0.0f;
  return scale != 1.0f ? v * scale : v;
}

/// GQA reduction step (kvevict::detail::reduce_into): the first row is copied, then max
/// takes nan_max and mean/sum add (mean divides once at the end, see gqa_mean_scale).
KVEVICT_HOST_DEVICE inline float gqa_step(float acc, float v, gqa_reduction r, bool first) noexcept {
  if (first) return v;
  return r == gqa_reduction::max ? nan_max(acc, v) : acc + v;
}

/// The 1/G of a mean reduction, applied as the CPU applies it (only when G > 1).
KVEVICT_HOST_DEVICE inline float gqa_mean_scale(float v, gqa_reduction r, std::int64_t group) noexcept {
  if (r != gqa_reduction::mean || group <= 1) return v;
  const float inv = 1.0f / static_cast<float>(group);
  return v * inv;
}

/// 1-D pooling at output j of a row of n values (kvevict::detail::pool_row at one index,
/// same operation order). The row is read through `x`, which holds logical indices
/// [x_begin, x_begin + ...): the caller passes the shared-memory window of a tile and its
/// halo, and only indices inside [max(0, j - k/2), min(n, j + k/2 + 1)) are read.
KVEVICT_HOST_DEVICE inline float pool_at(const float* x, std::int64_t x_begin, std::int64_t n, std::int64_t j,
                                         pooling p) noexcept {
  const std::int64_t radius = p.kernel / 2;
  if (p.kind == pooling_kind::none || radius == 0) return x[j - x_begin];
  if (p.kind == pooling_kind::max) {
    float y = neg_infinity();
    for (std::int64_t o = -radius; o <= radius; ++o) {
      const std::int64_t i = j + o;
      if (i >= 0 && i < n) y = nan_max(y, x[i - x_begin]);
    }
    return y;
  }
  float y = 0.0f;
  for (std::int64_t o = -radius; o <= radius; ++o) {
    const std::int64_t i = j + o;
    if (i >= 0 && i < n) y += x[i - x_begin];
  }
  if (p.count_padding) {
    const float inv = 1.0f / static_cast<float>(p.kernel);
    return y * inv;
  }
  const std::int64_t lo = j - radius < 0 ? 0 : j - radius;
  const std::int64_t hi = j + radius >= n ? n - 1 : j + radius;
  return y / static_cast<float>(hi - lo + 1);
}

/// Number of observations that see a key at `key_position` (visible_mean's divisor).
KVEVICT_HOST_DEVICE inline float visible_count(std::int64_t key_position, index_ptr query_positions,
                                               std::int64_t window) noexcept {
  std::int64_t n = 0;
  for (std::int64_t t = 0; t < window; ++t) n += key_position <= query_positions[t] ? 1 : 0;
  return static_cast<float>(n);
}

}  // namespace detail
}  // namespace cuda
KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CUDA_DETAIL_SCORE_LOGIC_HPP
