// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_ROPE_ROPE_HPP
#define KVEVICT_ROPE_ROPE_HPP

// Rotary position embedding helpers, for DapQ's re-rotation: moving a query to another
// position without another forward pass. RoPE rotates each channel pair i by the angle
// position * inv_freq[i]; rotations compose, so a post-RoPE query at position p moves to
// p + delta by one more rotation of delta * inv_freq[i].
//
// Variants: NeoX pairing (channel i with i + rotary_dim/2: HF Llama/Qwen/Mistral's
// rotate_half) or GPT-J pairing (2i with 2i+1); partial rotary dimension (only the first
// rotary_dim channels rotate); Llama-3 frequency scaling. Angles are computed in double,
// so large positions keep full float accuracy.

#include <cmath>
#include <cstdint>

#include "kvevict/config.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/error.hpp"

KVEVICT_NAMESPACE_BEGIN

enum class rope_pairing : std::int32_t {
  neox,  ///< (i, i + rotary_dim/2): HF "rotate_half" (Llama, Qwen, Mistral)
  gptj,  ///< (2i, 2i + 1): GPT-J, GPT-NeoX-interleaved, llama.cpp's LLAMA_ROPE_TYPE_NORM
};

/// Llama-3.x "rope_type: llama3" frequency scaling.
struct rope_llama3_scaling {
  bool enabled = false;
  double factor = 8.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  double original_max_position = 8192.0;
};

struct rope_config {
  std::int64_t head_dim = 128;
  std::int64_t rotary_dim = 0;  ///< 0 means head_dim; must be even and <= head_dim
  double theta = 10000.0;       ///< base (500000 for Llama-3, 1000000 for Qwen2.5/3)
  rope_pairing pairing = rope_pairing::neox;
  rope_llama3_scaling llama3;

  constexpr std::int64_t rotated() const noexcept { return rotary_dim == 0 ? head_dim : rotary_dim; }
};

/// Validates a rope_config.
inline status validate_rope_config(const rope_config& c, const char* fn) noexcept {
  if (c.head_dim < 2)
    return status::error(errc::invalid_argument, fn, "rope.head_dim", "expected >= 2, got %lld",
                         static_cast<long long>(c.head_dim));
  const std::int64_t r = c.rotated();
  if (r < 2 || r > c.head_dim || r % 2 != 0)
    return status::error(errc::invalid_argument, fn, "rope.rotary_dim", "expected an even value in [2, %lld], got %lld",
                         static_cast<long long>(c.head_dim), static_cast<long long>(r));
  if (!(c.theta > 1.0) || std::isinf(c.theta))
    return status::error(errc::invalid_argument, fn, "rope.theta", "expected a finite base > 1, got %g", c.theta);
  if (c.llama3.enabled && (!(c.llama3.factor >= 1.0) || !(c.llama3.high_freq_factor > c.llama3.low_freq_factor) ||
                           !(c.llama3.low_freq_factor > 0.0) || !(c.llama3.original_max_position > 0.0)))
    return status::error(errc::invalid_argument, fn, "rope.llama3",
                         "expected factor >= 1, 0 < low_freq_factor < high_freq_factor, original_max_position > 0");
  return status();
}

/// Inverse frequency of pair i (0 <= i < rotary_dim/2), with Llama-3 scaling if enabled.
inline double rope_inv_freq(const rope_config& c, std::int64_t i) noexcept {
  constexpr double pi = 3.14159265358979323846;
  const double inv = std::pow(c.theta, -2.0 * static_cast<double>(i) / static_cast<double>(c.rotated()));
  if (!c.llama3.enabled) return inv;
  const double wavelen = 2.0 * pi / inv;
  const double low_wavelen = c.llama3.original_max_position / c.llama3.low_freq_factor;
  const double high_wavelen = c.llama3.original_max_position / c.llama3.high_freq_factor;
  if (wavelen < high_wavelen) return inv;
  if (wavelen > low_wavelen) return inv / c.llama3.factor;
  const double smooth = (c.llama3.original_max_position / wavelen - c.llama3.low_freq_factor) /
                        (c.llama3.high_freq_factor - c.llama3.low_freq_factor);
  return (1.0 - smooth) * inv / c.llama3.factor + smooth * inv;
}

/// Rotates one vector x[head_dim] by `position` (an absolute position for a pre-RoPE vector,
/// or a position delta for a post-RoPE one) into out (may alias x). Channels past
/// rotary_dim are copied unchanged. The config must be valid (validate_rope_config).
template <class In>
void rope_rotate(const rope_config& c, const In* x, std::int64_t x_stride, double position, float* out) noexcept {
  const std::int64_t half = c.rotated() / 2;
  for (std::int64_t i = 0; i < half; ++i) {
    const std::int64_t a = c.pairing == rope_pairing::neox ? i : 2 * i;
    const std::int64_t b = c.pairing == rope_pairing::neox ? i + half : 2 * i + 1;
    const double angle = position * rope_inv_freq(c, i);
    const double cs = std::cos(angle), sn = std::sin(angle);
    const double x1 = static_cast<double>(to_float(x[a * x_stride]));
    const double x2 = static_cast<double>(to_float(x[b * x_stride]));
    out[a] = static_cast<float>(x1 * cs - x2 * sn);
    out[b] = static_cast<float>(x1 * sn + x2 * cs);
  }
  for (std::int64_t i = c.rotated(); i < c.head_dim; ++i) out[i] = to_float(x[i * x_stride]);
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_ROPE_ROPE_HPP
