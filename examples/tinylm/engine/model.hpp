// TinyLM (examples/tinylm/MODEL.md): a 2-layer Llama-architecture decoder (RMSNorm, RoPE,
// GQA 8 query / 2 KV heads, SwiGLU) run in float32 with Eigen, with a KV cache whose heads
// may hold different numbers of tokens (AdaKV budgets) and whose memory kvevict compacts.
#pragma once

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

#include <kvevict/rope/rope.hpp>
#include <kvevict/views/layouts.hpp>

#include "safetensors.hpp"

namespace tinylm {

using matrix = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
using vector = Eigen::VectorXf;

struct config {
  std::int64_t vocab = 256, layers = 2, d_model = 128, heads = 8, kv_heads = 2, head_dim = 32, ffn = 256;
  double theta = 1e6;
  float eps = 1e-5f;
  std::int64_t group() const { return heads / kv_heads; }
};

struct layer_weights {
  vector attention_norm, ffn_norm;
  matrix wq, wk, wv, wo, w1, w2, w3;
};

struct model {
  config cfg;
  matrix embed, output;
  vector norm;
  std::vector<layer_weights> layers;
  kvevict::rope_config rope;

  static model load(const std::string& path) {
    const auto t = load_safetensors(path);
    auto mat = [&](const std::string& name, std::int64_t rows, std::int64_t cols) {
      const auto it = t.find(name);
      if (it == t.end() || it->second.numel() != rows * cols)
        throw std::runtime_error("weights: bad or missing " + name);
      return matrix(Eigen::Map<const matrix>(it->second.data.data(), rows, cols));
    };
    auto vec = [&](const std::string& name, std::int64_t n) {
      const auto it = t.find(name);
      if (it == t.end() || it->second.numel() != n) throw std::runtime_error("weights: bad or missing " + name);
      return vector(Eigen::Map<const vector>(it->second.data.data(), n));
    };
    model m;
    // The depth is the file's: layers 0 .. n-1 must all be there (the 2-layer and the 4-layer
    // models share every other dimension), and a tensor of a layer past them is an error, not
    // a layer silently left out.
    std::int64_t n = 0;
    while (t.count("layers." + std::to_string(n) + ".attention_norm.weight") != 0) ++n;
    if (n == 0) throw std::runtime_error("weights: no layers.0.* tensors in " + path);
    for (const auto& entry : t) {
      if (entry.first.rfind("layers.", 0) != 0) continue;
      const std::int64_t index = std::stoll(entry.first.substr(7));
      if (index >= n)
        throw std::runtime_error("weights: " + entry.first + " without layers." + std::to_string(n) +
                                 ".attention_norm.weight (layers must be numbered 0 .. n-1)");
    }
    m.cfg.layers = n;
    const config& c = m.cfg;
    m.embed = mat("tok_embeddings.weight", c.vocab, c.d_model);
    m.output = mat("output.weight", c.vocab, c.d_model);
    m.norm = vec("norm.weight", c.d_model);
    for (std::int64_t l = 0; l < c.layers; ++l) {
      const std::string p = "layers." + std::to_string(l) + ".";
      layer_weights w;
      w.attention_norm = vec(p + "attention_norm.weight", c.d_model);
      w.ffn_norm = vec(p + "ffn_norm.weight", c.d_model);
      w.wq = mat(p + "attention.wq.weight", c.heads * c.head_dim, c.d_model);
      w.wk = mat(p + "attention.wk.weight", c.kv_heads * c.head_dim, c.d_model);
      w.wv = mat(p + "attention.wv.weight", c.kv_heads * c.head_dim, c.d_model);
      w.wo = mat(p + "attention.wo.weight", c.d_model, c.heads * c.head_dim);
      w.w1 = mat(p + "feed_forward.w1.weight", c.ffn, c.d_model);
      w.w2 = mat(p + "feed_forward.w2.weight", c.d_model, c.ffn);
      w.w3 = mat(p + "feed_forward.w3.weight", c.ffn, c.d_model);
      m.layers.push_back(std::move(w));
    }
    m.rope.head_dim = c.head_dim;
    m.rope.theta = c.theta;
    m.rope.pairing = kvevict::rope_pairing::neox;
    return m;
  }
};

/// The engine's KV cache: per layer, K and V as HF-contiguous float32 [Hkv, capacity, d];
/// head h of layer l holds lengths[l][h] tokens (all equal until a head-adaptive eviction).
struct kv_cache {
  std::int64_t capacity = 0, kv_heads = 0, head_dim = 0;
  std::vector<std::vector<float>> k, v;
  std::vector<std::vector<std::int64_t>> lengths;

  kv_cache() = default;
  kv_cache(const config& c, std::int64_t cap)
      : capacity(cap),
        kv_heads(c.kv_heads),
        head_dim(c.head_dim),
        k(static_cast<std::size_t>(c.layers),
          std::vector<float>(static_cast<std::size_t>(c.kv_heads * cap * c.head_dim))),
        v(k),
        lengths(static_cast<std::size_t>(c.layers),
                std::vector<std::int64_t>(static_cast<std::size_t>(c.kv_heads), 0)) {}

  /// kvevict's view of layer l's keys / values, first n tokens of every head.
  kvevict::cache_view<float> keys(std::int64_t l, std::int64_t n) {
    return kvevict::hf_contiguous(k[static_cast<std::size_t>(l)].data(), kv_heads, n, head_dim, capacity);
  }
  kvevict::cache_view<float> values(std::int64_t l, std::int64_t n) {
    return kvevict::hf_contiguous(v[static_cast<std::size_t>(l)].data(), kv_heads, n, head_dim, capacity);
  }
  std::int64_t length(std::int64_t l) const {  // uniform length (before head-adaptive eviction)
    return lengths[static_cast<std::size_t>(l)][0];
  }
  float* row(std::vector<float>& buf, std::int64_t h, std::int64_t j) {
    return buf.data() + (h * capacity + j) * head_dim;
  }
};

inline matrix rmsnorm(const matrix& x, const vector& w, float eps) {
  matrix out(x.rows(), x.cols());
  for (Eigen::Index t = 0; t < x.rows(); ++t) {
    const float ms = x.row(t).squaredNorm() / static_cast<float>(x.cols());
    out.row(t) = x.row(t).cwiseProduct(w.transpose()) / std::sqrt(ms + eps);
  }
  return out;
}

/// Called after each layer's attention: the layer and its post-RoPE queries of this step,
/// token-major [n, Hq * d] (the cache already holds the step's K/V). Engines put the KV-cache
/// compressor here.
using attention_hook = std::function<void(std::int64_t layer, const float* queries, std::int64_t n)>;

/// Runs ids[0..n) at positions first_position.. through the model. Their K/V are appended
/// to every head of every layer at that head's current length. Returns logits [n, vocab].
/// queries (optional): per layer, the post-RoPE queries [Hq, n, d] (head-major).
inline matrix forward(const model& m, kv_cache& cache, const std::int32_t* ids, std::int64_t n,
                      std::int64_t first_position, std::vector<std::vector<float>>* queries = nullptr,
                      const attention_hook& hook = nullptr) {
  const config& c = m.cfg;
  const std::int64_t d = c.head_dim, g = c.group();
  const float scale = 1.0f / std::sqrt(static_cast<float>(d));
  matrix x(n, c.d_model);
  for (std::int64_t t = 0; t < n; ++t) x.row(t) = m.embed.row(ids[t]);
  if (queries != nullptr) queries->assign(static_cast<std::size_t>(c.layers), {});
  std::vector<float> rotated(static_cast<std::size_t>(d));
  for (std::int64_t l = 0; l < c.layers; ++l) {
    const layer_weights& w = m.layers[static_cast<std::size_t>(l)];
    const matrix h = rmsnorm(x, w.attention_norm, c.eps);
    matrix q = h * w.wq.transpose(), k = h * w.wk.transpose(), v = h * w.wv.transpose();
    for (std::int64_t t = 0; t < n; ++t) {
      const double pos = static_cast<double>(first_position + t);
      for (std::int64_t j = 0; j < c.heads; ++j) {
        float* qr = q.data() + t * q.cols() + j * d;
        kvevict::rope_rotate(m.rope, qr, 1, pos, qr);
      }
      for (std::int64_t i = 0; i < c.kv_heads; ++i) {
        float* kr = k.data() + t * k.cols() + i * d;
        kvevict::rope_rotate(m.rope, kr, 1, pos, kr);
      }
    }
    if (queries != nullptr) {
      auto& out = (*queries)[static_cast<std::size_t>(l)];
      out.resize(static_cast<std::size_t>(c.heads * n * d));
      for (std::int64_t j = 0; j < c.heads; ++j)
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t e = 0; e < d; ++e) out[static_cast<std::size_t>((j * n + t) * d + e)] = q(t, j * d + e);
    }
    auto& kbuf = cache.k[static_cast<std::size_t>(l)];
    auto& vbuf = cache.v[static_cast<std::size_t>(l)];
    auto& lens = cache.lengths[static_cast<std::size_t>(l)];
    for (std::int64_t i = 0; i < c.kv_heads; ++i) {
      if (lens[static_cast<std::size_t>(i)] + n > cache.capacity) throw std::runtime_error("kv cache full");
      for (std::int64_t t = 0; t < n; ++t)
        for (std::int64_t e = 0; e < d; ++e) {
          cache.row(kbuf, i, lens[static_cast<std::size_t>(i)] + t)[e] = k(t, i * d + e);
          cache.row(vbuf, i, lens[static_cast<std::size_t>(i)] + t)[e] = v(t, i * d + e);
        }
    }
    matrix attended(n, c.heads * d);
    for (std::int64_t j = 0; j < c.heads; ++j) {
      const std::int64_t i = j / g, past = lens[static_cast<std::size_t>(i)], total = past + n;
      const Eigen::Map<const matrix> K(cache.row(kbuf, i, 0), total, d), V(cache.row(vbuf, i, 0), total, d);
      matrix s = (q.block(0, j * d, n, d) * K.transpose()) * scale;  // [n, total]
      for (std::int64_t t = 0; t < n; ++t) {
        for (std::int64_t u = past + t + 1; u < total; ++u) s(t, u) = -std::numeric_limits<float>::infinity();
        const float mx = s.row(t).maxCoeff();
        s.row(t) = (s.row(t).array() - mx).exp().matrix();
        s.row(t) /= s.row(t).sum();
      }
      attended.block(0, j * d, n, d) = s * V;
    }
    for (std::int64_t i = 0; i < c.kv_heads; ++i) lens[static_cast<std::size_t>(i)] += n;
    if (hook) hook(l, q.data(), n);
    x += attended * w.wo.transpose();
    const matrix h2 = rmsnorm(x, w.ffn_norm, c.eps);
    matrix gate = h2 * w.w1.transpose();
    const matrix up = h2 * w.w3.transpose();
    gate = (gate.array() / (1.0f + (-gate.array()).exp()) * up.array()).matrix();
    x += gate * w.w2.transpose();
  }
  return rmsnorm(x, m.norm, c.eps) * m.output.transpose();
}

inline std::int32_t argmax(const matrix& logits, std::int64_t row) {
  Eigen::Index best = 0;
  logits.row(row).maxCoeff(&best);
  return static_cast<std::int32_t>(best);
}

}  // namespace tinylm
