// A tiny serving-engine loop around kvevict's compressor: a 4-layer GQA decoder with synthetic
// weights, a vLLM-style paged bf16 KV cache (one pool per layer, [blocks, block_size, Hkv, d],
// one block table per sequence shared by every layer), a batch of ragged prompts prefilled
// together and then decoded together. Eviction is DeferKV (d = 2) with AdaKV head budgets:
// the attention hook of every layer makes exactly one compressor.run() for the whole batch at
// every step -- the prefill step and each decode step -- and the engine applies what it
// reports: per-head lengths (attention reads each head's own length), the next K/V slot, the
// next RoPE position (not the row count), and blocks no layer needs any more, which go back to
// the allocator. It prints memory before and after, and checks the call count with the
// compressor's tracer (exit status 0 only if one call per layer per step was made).
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>

using kvevict::bf16;
using i64 = std::int64_t;

namespace {

constexpr i64 kLayers = 4, kModel = 128, kHq = 8, kHkv = 2, kDim = 32, kGroup = kHq / kHkv, kVocab = 256;
constexpr i64 kBlock = 16, kSteps = 8;

struct layer_weights {
  std::vector<float> wq, wk, wv, wo;  // [out, in] row-major
};

struct model {
  std::vector<float> embed, out;  // [vocab, model]
  std::vector<layer_weights> layers;
  kvevict::rope_config rope;
};

model make_model() {
  std::mt19937 rng(2024);
  std::normal_distribution<float> n(0.0f, 0.08f);
  auto fill = [&](i64 count) {
    std::vector<float> w(static_cast<std::size_t>(count));
    for (float& x : w) x = n(rng);
    return w;
  };
  model m;
  m.embed = fill(kVocab * kModel);
  m.out = fill(kVocab * kModel);
  for (i64 l = 0; l < kLayers; ++l)
    m.layers.push_back(
        {fill(kHq * kDim * kModel), fill(kHkv * kDim * kModel), fill(kHkv * kDim * kModel), fill(kModel * kHq * kDim)});
  m.rope.head_dim = kDim;
  m.rope.theta = 10000.0;
  return m;
}

void matvec(const std::vector<float>& w, const float* x, i64 rows, i64 cols, float* y) {
  for (i64 r = 0; r < rows; ++r) {
    float s = 0.0f;
    for (i64 c = 0; c < cols; ++c) s += w[static_cast<std::size_t>(r * cols + c)] * x[c];
    y[r] = s;
  }
}

/// The engine's paged KV cache: per layer a K pool and a V pool of the same blocks; per
/// sequence a block table (shared by layers) and each layer's per-head lengths.
struct paged_cache {
  i64 num_blocks = 0;
  std::vector<std::vector<bf16>> k, v;  // [layer] -> [blocks, block, Hkv, d]
  std::vector<std::int32_t> free_list;

  explicit paged_cache(i64 blocks) : num_blocks(blocks) {
    const auto size = static_cast<std::size_t>(blocks * kBlock * kHkv * kDim);
    k.assign(kLayers, std::vector<bf16>(size, bf16(0.0f)));
    v = k;
    for (i64 b = blocks - 1; b >= 0; --b) free_list.push_back(static_cast<std::int32_t>(b));
  }
  std::int32_t allocate() {
    const std::int32_t b = free_list.back();
    free_list.pop_back();
    return b;
  }
  i64 used() const { return num_blocks - static_cast<i64>(free_list.size()); }
  double mib(i64 blocks) const {  // K + V of every layer
    return static_cast<double>(2 * kLayers * blocks * kBlock * kHkv * kDim) * sizeof(bf16) / (1024.0 * 1024.0);
  }
  kvevict::cache_view<bf16> view(bool keys, i64 layer, const std::vector<std::int32_t>& table, i64 tokens) {
    auto& pool = keys ? k[static_cast<std::size_t>(layer)] : v[static_cast<std::size_t>(layer)];
    return kvevict::vllm_paged(pool.data(), num_blocks, kBlock, kHkv, kDim, table.data(), tokens);
  }
};

struct sequence {
  std::vector<std::int32_t> tokens;            // prompt, then generated
  std::vector<std::int32_t> table;             // block table (every layer)
  std::vector<std::vector<i64>> head_lengths;  // [layer][Hkv]: rows each head holds
  i64 position = 0;                            // RoPE position of the next token
  std::vector<std::uint64_t> state;            // the compressor's per-sequence state
  i64 freed = -1;                              // this step: blocks every evicting layer freed
};

i64 longest(const sequence& s) {
  i64 most = 0;
  for (const auto& layer : s.head_lengths)
    for (i64 x : layer) most = std::max(most, x);
  return most;
}

/// One step of the model for a batch: seq s feeds tokens[first[s] .. first[s] + count[s]) at
/// positions starting at its `position`; the hook runs after each layer's attention.
struct step_input {
  std::vector<i64> first, count;
  kvevict::sequence_event event;
};

struct call_counter {
  i64 calls = 0, evicted = 0;
  static void on_run(void* ctx, const kvevict::run_trace& t) {
    auto* c = static_cast<call_counter*>(ctx);
    ++c->calls;
    c->evicted += t.evicted;
  }
};

struct engine {
  const model& m;
  paged_cache& cache;
  const kvevict::compressor& compressor;
  kvevict::workspace ws;
  std::vector<sequence>& seqs;

  /// Runs one step; returns false (after printing) on a kvevict error.
  bool step(const step_input& in) {
    const i64 n = static_cast<i64>(seqs.size());
    std::vector<std::vector<float>> x(static_cast<std::size_t>(n));  // [tokens, model] per sequence
    for (i64 s = 0; s < n; ++s)
      for (i64 t = 0; t < in.count[static_cast<std::size_t>(s)]; ++t) {
        const auto id = seqs[static_cast<std::size_t>(s)].tokens[static_cast<std::size_t>(in.first[s] + t)];
        x[static_cast<std::size_t>(s)].insert(x[static_cast<std::size_t>(s)].end(), m.embed.begin() + id * kModel,
                                              m.embed.begin() + (id + 1) * kModel);
      }
    // Blocks for the rows this step writes (every head writes at its own length).
    for (i64 s = 0; s < n; ++s) {
      sequence& q = seqs[static_cast<std::size_t>(s)];
      const i64 need = (longest(q) + in.count[static_cast<std::size_t>(s)] + kBlock - 1) / kBlock;
      while (static_cast<i64>(q.table.size()) < need) q.table.push_back(cache.allocate());
    }
    for (i64 l = 0; l < kLayers; ++l) {
      const layer_weights& w = m.layers[static_cast<std::size_t>(l)];
      std::vector<std::vector<bf16>> queries(static_cast<std::size_t>(n));  // [Hq, count, d] post-RoPE
      std::vector<std::vector<i64>> qpos(static_cast<std::size_t>(n));
      for (i64 s = 0; s < n; ++s) {
        sequence& q = seqs[static_cast<std::size_t>(s)];
        const i64 count = in.count[static_cast<std::size_t>(s)];
        auto& hs = x[static_cast<std::size_t>(s)];
        auto& lens = q.head_lengths[static_cast<std::size_t>(l)];
        auto kview = cache.view(true, l, q.table, longest(q) + count);
        auto vview = cache.view(false, l, q.table, longest(q) + count);
        queries[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(kHq * count * kDim));
        std::vector<float> qrow(kHq * kDim), krow(kHkv * kDim), vrow(kHkv * kDim), attn(kHq * kDim);
        std::vector<float> out(static_cast<std::size_t>(count * kModel));
        for (i64 t = 0; t < count; ++t) {
          const float* h = hs.data() + t * kModel;
          const i64 pos = q.position + t;
          qpos[static_cast<std::size_t>(s)].push_back(pos);
          matvec(w.wq, h, kHq * kDim, kModel, qrow.data());
          matvec(w.wk, h, kHkv * kDim, kModel, krow.data());
          matvec(w.wv, h, kHkv * kDim, kModel, vrow.data());
          for (i64 j = 0; j < kHq; ++j)
            kvevict::rope_rotate(m.rope, qrow.data() + j * kDim, 1, double(pos), qrow.data() + j * kDim);
          for (i64 j = 0; j < kHkv; ++j)
            kvevict::rope_rotate(m.rope, krow.data() + j * kDim, 1, double(pos), krow.data() + j * kDim);
          for (i64 j = 0; j < kHq; ++j)
            for (i64 c = 0; c < kDim; ++c)
              queries[static_cast<std::size_t>(s)][static_cast<std::size_t>((j * count + t) * kDim + c)] =
                  bf16(qrow[static_cast<std::size_t>(j * kDim + c)]);
          for (i64 h2 = 0; h2 < kHkv; ++h2) {  // K/V land at each head's next slot
            i64& len = lens[static_cast<std::size_t>(h2)];
            for (i64 c = 0; c < kDim; ++c) {
              kview.at(h2, len, c) = bf16(krow[static_cast<std::size_t>(h2 * kDim + c)]);
              vview.at(h2, len, c) = bf16(vrow[static_cast<std::size_t>(h2 * kDim + c)]);
            }
            ++len;
          }
          // Causal attention of this token over each head's rows (its own length).
          for (i64 j = 0; j < kHq; ++j) {
            const i64 h2 = j / kGroup, rows = lens[static_cast<std::size_t>(h2)];
            std::vector<float> p(static_cast<std::size_t>(rows));
            float mx = -1e30f;
            for (i64 r = 0; r < rows; ++r) {
              float dot = 0.0f;
              for (i64 c = 0; c < kDim; ++c)
                dot += qrow[static_cast<std::size_t>(j * kDim + c)] * static_cast<float>(kview.at(h2, r, c));
              p[static_cast<std::size_t>(r)] = dot / std::sqrt(float(kDim));
              mx = std::max(mx, p[static_cast<std::size_t>(r)]);
            }
            float z = 0.0f;
            for (float& e : p) z += (e = std::exp(e - mx));
            for (i64 c = 0; c < kDim; ++c) {
              float acc = 0.0f;
              for (i64 r = 0; r < rows; ++r)
                acc += p[static_cast<std::size_t>(r)] * static_cast<float>(vview.at(h2, r, c));
              attn[static_cast<std::size_t>(j * kDim + c)] = acc / z;
            }
          }
          matvec(w.wo, attn.data(), kModel, kHq * kDim, out.data() + t * kModel);
        }
        for (std::size_t e = 0; e < hs.size(); ++e) hs[e] += out[e];
      }

      // The attention hook: one compressor call for the whole batch at this layer.
      std::vector<kvevict::sequence_io<bf16>> io(static_cast<std::size_t>(n));
      std::vector<kvevict::sequence_report> reports(static_cast<std::size_t>(n));
      std::vector<std::vector<i64>> lengths(static_cast<std::size_t>(n), std::vector<i64>(kHkv));
      for (i64 s = 0; s < n; ++s) {
        sequence& q = seqs[static_cast<std::size_t>(s)];
        const i64 rows = q.head_lengths[static_cast<std::size_t>(l)][0];  // equal until AdaKV evicts
        auto& e = io[static_cast<std::size_t>(s)];
        e.event = in.event;  // the compressor knows what each sequence's phase needs
        e.keys = cache.view(true, l, q.table, rows);
        e.values = cache.view(false, l, q.table, rows);
        e.queries = kvevict::contiguous_queries<const bf16>(queries[static_cast<std::size_t>(s)].data(), kHq,
                                                            in.count[static_cast<std::size_t>(s)], kDim,
                                                            qpos[static_cast<std::size_t>(s)].data());
        e.state = q.state.data();
        e.head_lengths = lengths[static_cast<std::size_t>(s)].data();
      }
      const kvevict::status st = compressor.run(l, io.data(), n, reports.data(), ws);
      if (!st.ok()) {
        std::fprintf(stderr, "layer %lld: %s\n", static_cast<long long>(l), st.message());
        return false;  // nothing changed at this layer; the engine would fail these requests
      }
      for (i64 s = 0; s < n; ++s) {
        const kvevict::sequence_report& r = reports[static_cast<std::size_t>(s)];
        if (r.action != kvevict::sequence_action::evicted) continue;
        sequence& q = seqs[static_cast<std::size_t>(s)];
        q.head_lengths[static_cast<std::size_t>(l)] = lengths[static_cast<std::size_t>(s)];  // per head
        q.freed = q.freed < 0 ? r.freed_blocks : std::min(q.freed, r.freed_blocks);          // the table is shared
      }
    }
    // After the last layer: positions advance, evicted sequences give back the blocks no layer
    // uses any more, and the next token is sampled (greedy).
    for (i64 s = 0; s < n; ++s) {
      sequence& q = seqs[static_cast<std::size_t>(s)];
      q.position += in.count[static_cast<std::size_t>(s)];  // RoPE positions never move back
      for (; q.freed > 0; --q.freed) {                      // trailing blocks no layer's head uses any more
        cache.free_list.push_back(q.table.back());
        q.table.pop_back();
      }
      q.freed = -1;
      const float* h = x[static_cast<std::size_t>(s)].data() + (in.count[static_cast<std::size_t>(s)] - 1) * kModel;
      std::vector<float> logits(kVocab);
      matvec(m.out, h, kVocab, kModel, logits.data());
      q.tokens.push_back(static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    }
    return true;
  }
};

}  // namespace

int main() {
  const model m = make_model();
  const std::vector<i64> prompts = {300, 517, 190, 421};
  const i64 n = static_cast<i64>(prompts.size());
  i64 max_tokens = 0;
  for (i64 p : prompts) max_tokens = std::max(max_tokens, p + kSteps);

  // Once per model: DeferKV (evict at the 2nd decode step) with AdaKV head budgets.
  kvevict::deferkv_config defer;
  defer.window = 32;
  defer.delay = 2;
  kvevict::compressor_options opt;
  opt.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype::bf16};
  opt.sharing = kvevict::block_sharing::none;  // no block is shared between sequences
  opt.policy = kvevict::policy::deferkv(defer);
  opt.per_head = kvevict::budget::tokens(48);  // prompt candidates per head; window and decoded on top
  opt.heads = kvevict::head_allocation::adakv;
  opt.limits.max_sequences = n;
  opt.limits.max_tokens = max_tokens;
  call_counter counter;
  opt.tracer = {&counter, &call_counter::on_run};
  kvevict::compressor compressor;
  kvevict::status st = kvevict::compressor::plan(opt, &compressor);
  if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;

  paged_cache cache(256);
  std::vector<sequence> seqs(static_cast<std::size_t>(n));
  std::mt19937 rng(5);
  for (i64 s = 0; s < n; ++s) {
    sequence& q = seqs[static_cast<std::size_t>(s)];
    for (i64 t = 0; t < prompts[static_cast<std::size_t>(s)]; ++t)
      q.tokens.push_back(static_cast<std::int32_t>(rng() % kVocab));
    q.head_lengths.assign(kLayers, std::vector<i64>(kHkv, 0));
    q.state.assign(compressor.sequence_state_size() / 8 + 1, 0);
    st = compressor.reset_sequence(q.state.data(), q.state.size() * 8);
    if (!st.ok()) return std::fprintf(stderr, "%s\n", st.message()), 1;
  }
  engine e{m, cache, compressor, kvevict::workspace(compressor.workspace_size()), seqs};
  std::printf("engine_loop: %lld layers, Hq=%lld Hkv=%lld d=%lld, paged bf16 (block %lld), %lld sequences\n",
              static_cast<long long>(kLayers), static_cast<long long>(kHq), static_cast<long long>(kHkv),
              static_cast<long long>(kDim), static_cast<long long>(kBlock), static_cast<long long>(n));
  std::printf("compressor: DeferKV d=2 + AdaKV, B=48; workspace %.1f KiB, state %.1f KiB per sequence\n",
              static_cast<double>(compressor.workspace_size()) / 1024.0,
              static_cast<double>(compressor.sequence_state_size()) / 1024.0);

  step_input prefill{std::vector<i64>(static_cast<std::size_t>(n), 0), prompts, kvevict::sequence_event::prefill_end};
  if (!e.step(prefill)) return 1;
  const i64 blocks_before = cache.used();
  std::printf("after prefill: %lld blocks, %.2f MiB of K+V\n", static_cast<long long>(blocks_before),
              cache.mib(blocks_before));
  i64 peak = blocks_before;
  for (i64 k = 0; k < kSteps; ++k) {
    step_input decode;
    decode.event = kvevict::sequence_event::decode;
    for (const auto& q : seqs) {
      decode.first.push_back(static_cast<i64>(q.tokens.size()) - 1);
      decode.count.push_back(1);
    }
    if (!e.step(decode)) return 1;
    peak = std::max(peak, cache.used());
    if (k == defer.delay - 1)
      std::printf("decode step %lld: evicted at every layer: %lld blocks, %.2f MiB of K+V\n", static_cast<long long>(k),
                  static_cast<long long>(cache.used()), cache.mib(cache.used()));
  }
  for (i64 s = 0; s < n; ++s) {
    const sequence& q = seqs[static_cast<std::size_t>(s)];
    std::printf("  seq %lld: prompt %lld, next position %lld, layer 0 head rows %lld/%lld, %zu blocks\n",
                static_cast<long long>(s), static_cast<long long>(prompts[static_cast<std::size_t>(s)]),
                static_cast<long long>(q.position), static_cast<long long>(q.head_lengths[0][0]),
                static_cast<long long>(q.head_lengths[0][1]), q.table.size());
  }
  const i64 expected = kLayers * (1 + kSteps);
  std::printf("memory: %.2f MiB -> %.2f MiB of K+V; compressor calls: %lld (one per layer per step: %lld)\n",
              cache.mib(blocks_before), cache.mib(cache.used()), static_cast<long long>(counter.calls),
              static_cast<long long>(expected));
  const bool ok = counter.calls == expected && counter.evicted == kLayers * n && cache.used() < blocks_before;
  return ok ? 0 : 2;
}
