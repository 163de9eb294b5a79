// Independent RoPE for the tests and fuzzers, written from the Hugging Face formulation in
// long double: inv_freq_i = theta^(-2i/rot); llama3: _compute_llama3_parameters; NeoX
// applies q*cos + rotate_half(q)*sin with cos/sin repeated over both halves; GPT-J
// interleaves.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kvevict/rope/rope.hpp"

namespace ref {

inline std::vector<long double> ref_inv_freq(const kvevict::rope_config& c) {
  const std::int64_t rot = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim;
  std::vector<long double> f;
  for (std::int64_t i = 0; i < rot; i += 2) {
    long double inv = 1.0L / std::pow(static_cast<long double>(c.theta), static_cast<long double>(i) / rot);
    if (c.llama3.enabled) {
      const long double pi = 3.141592653589793238462643383279L;
      const long double old_ctx = c.llama3.original_max_position;
      const long double low_wl = old_ctx / c.llama3.low_freq_factor, high_wl = old_ctx / c.llama3.high_freq_factor;
      const long double wl = 2 * pi / inv;
      if (wl > low_wl) {
        inv = inv / c.llama3.factor;
      } else if (wl >= high_wl) {
        const long double smooth =
            (old_ctx / wl - c.llama3.low_freq_factor) / (c.llama3.high_freq_factor - c.llama3.low_freq_factor);
        inv = (1 - smooth) * inv / c.llama3.factor + smooth * inv;
      }
    }
    f.push_back(inv);
  }
  return f;
}

inline std::vector<double> ref_rope(const kvevict::rope_config& c, const std::vector<double>& x, long double position) {
  const std::int64_t rot = c.rotary_dim == 0 ? c.head_dim : c.rotary_dim, half = rot / 2;
  const auto f = ref_inv_freq(c);
  std::vector<double> out = x;
  if (c.pairing == kvevict::rope_pairing::neox) {
    // rotate_half(x) = [-x2, x1]; emb = cat(freqs, freqs)
    for (std::int64_t i = 0; i < rot; ++i) {
      const long double ang = position * f[static_cast<std::size_t>(i % half)];
      const long double rh = i < half ? -static_cast<long double>(x[static_cast<std::size_t>(i + half)])
                                      : x[static_cast<std::size_t>(i - half)];
      out[static_cast<std::size_t>(i)] =
          static_cast<double>(x[static_cast<std::size_t>(i)] * std::cos(ang) + rh * std::sin(ang));
    }
  } else {
    for (std::int64_t i = 0; i < half; ++i) {
      const long double ang = position * f[static_cast<std::size_t>(i)];
      const long double a = x[static_cast<std::size_t>(2 * i)], b = x[static_cast<std::size_t>(2 * i + 1)];
      out[static_cast<std::size_t>(2 * i)] = static_cast<double>(a * std::cos(ang) - b * std::sin(ang));
      out[static_cast<std::size_t>(2 * i + 1)] = static_cast<double>(a * std::sin(ang) + b * std::cos(ang));
    }
  }
  return out;
}

}  // namespace ref
