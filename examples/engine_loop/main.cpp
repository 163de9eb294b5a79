// A tiny serving-engine loop around kvevict's compressor, run the way production engines run:
// a 4-layer GQA decoder with synthetic weights, a vLLM-style paged bf16 KV cache (one pool per
// layer, [blocks, block_size, Hkv, d], one block table per sequence shared by every layer) and
//   - chunked prefill: prompts go through in chunks of 128 tokens (vLLM v1 always chunks); each
//     chunk but the last is a sequence_event::prefill_chunk, the last one prefill_end, and
//     sequences whose prompt is done wait idle while others finish theirs;
//   - prefix caching: sequence 1's prompt starts with sequence 0's first 256 tokens; once those
//     are computed, its block table takes sequence 0's first 16 blocks (reference count 2) and
//     its prefill starts after them;
//   - a speculative step: sequence 2 verifies 3 tokens in one decode step, all accepted;
//   - DeferKV (d = 2) with AdaKV head budgets, compacted out of place into fresh blocks, so the
//     shared prefix blocks stay intact for the other sequence; the engine hands the pool's
//     reference counts and swaps in the new blocks when a sequence was evicted.
// Every layer's attention hook makes one compressor.run() for the whole batch at every step.
// The same requests then run the simple way (each prompt in one step, no sharing): the keep
// sets of every sequence and layer, the generated tokens and the lengths must be identical.
// Exit status 0 only if they are and the compressor was called once per layer per step.
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
constexpr i64 kBlock = 16, kChunk = 128, kShared = 256, kSteps = 6, kDraft = 3;

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

i64 blocks_for(i64 rows) {
  return (rows + kBlock - 1) / kBlock;
}

/// The engine's paged KV cache: per layer a K pool and a V pool of the same blocks, and one
/// reference count per block (prefix caching shares blocks between sequences).
struct paged_cache {
  i64 num_blocks = 0;
  std::vector<std::vector<bf16>> k, v;  // [layer] -> [blocks, block, Hkv, d]
  std::vector<std::int32_t> refs;       // [blocks]: sequences using the block
  std::vector<std::int32_t> free_list;

  explicit paged_cache(i64 blocks) : num_blocks(blocks), refs(static_cast<std::size_t>(blocks), 0) {
    const auto size = static_cast<std::size_t>(blocks * kBlock * kHkv * kDim);
    k.assign(kLayers, std::vector<bf16>(size, bf16(0.0f)));
    v = k;
    for (i64 b = blocks - 1; b >= 0; --b) free_list.push_back(static_cast<std::int32_t>(b));
  }
  std::int32_t allocate() {
    const std::int32_t b = free_list.back();
    free_list.pop_back();
    refs[static_cast<std::size_t>(b)] = 1;
    return b;
  }
  void release(std::int32_t b) {
    if (--refs[static_cast<std::size_t>(b)] == 0) free_list.push_back(b);
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
  i64 prompt = 0;                              // prompt tokens
  i64 done = 0;                                // tokens whose K/V are in the cache
  std::vector<std::int32_t> table;             // block table (every layer)
  std::vector<std::int32_t> fresh;             // out of place: where an eviction at this step goes
  std::vector<std::vector<i64>> head_lengths;  // [layer][Hkv]: rows each head holds
  i64 position = 0;                            // RoPE position of the next token
  std::vector<std::uint64_t> state;            // the compressor's per-sequence state
  bool evicted = false;
  std::vector<std::vector<i64>> kept;  // [layer]: the kept positions, head after head
};

i64 longest(const sequence& s) {
  i64 most = 0;
  for (const auto& layer : s.head_lengths)
    for (i64 x : layer) most = std::max(most, x);
  return most;
}

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
  i64 steps = 0;

  /// One step: sequence s feeds count[s] tokens from its `done` on (0: idle) under event[s].
  /// Returns false (after printing) on a kvevict error.
  bool step(const std::vector<i64>& count, const std::vector<kvevict::sequence_event>& event) {
    ++steps;
    const auto n = static_cast<i64>(seqs.size());
    std::vector<std::vector<float>> x(static_cast<std::size_t>(n));  // [tokens, model] per sequence
    for (i64 s = 0; s < n; ++s) {
      sequence& q = seqs[static_cast<std::size_t>(s)];
      const i64 c = count[static_cast<std::size_t>(s)];
      for (i64 t = 0; t < c; ++t) {
        const auto id = q.tokens[static_cast<std::size_t>(q.done + t)];
        x[static_cast<std::size_t>(s)].insert(x[static_cast<std::size_t>(s)].end(), m.embed.begin() + id * kModel,
                                              m.embed.begin() + (id + 1) * kModel);
      }
      // Blocks for the rows this step writes (every head writes at its own length), and, out
      // of place, fresh blocks for what an eviction at this step may keep.
      const i64 rows = longest(q) + c;
      while (static_cast<i64>(q.table.size()) < blocks_for(rows)) q.table.push_back(cache.allocate());
      const kvevict::sequence_event e = event[static_cast<std::size_t>(s)];
      if (!q.evicted && (e == kvevict::sequence_event::decode || e == kvevict::sequence_event::prefill_end))
        while (static_cast<i64>(q.fresh.size()) < blocks_for(compressor.keep_capacity_per_head(rows)))
          q.fresh.push_back(cache.allocate());
    }
    std::vector<bool> evicted_now(static_cast<std::size_t>(n), false);
    for (i64 l = 0; l < kLayers; ++l) {
      const layer_weights& w = m.layers[static_cast<std::size_t>(l)];
      std::vector<std::vector<bf16>> queries(static_cast<std::size_t>(n));  // [Hq, count, d] post-RoPE
      std::vector<std::vector<i64>> qpos(static_cast<std::size_t>(n));
      for (i64 s = 0; s < n; ++s) {
        sequence& q = seqs[static_cast<std::size_t>(s)];
        const i64 c = count[static_cast<std::size_t>(s)];
        if (c == 0) continue;
        auto& hs = x[static_cast<std::size_t>(s)];
        auto& lens = q.head_lengths[static_cast<std::size_t>(l)];
        auto kview = cache.view(true, l, q.table, longest(q) + c);
        auto vview = cache.view(false, l, q.table, longest(q) + c);
        queries[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(kHq * c * kDim));
        std::vector<float> qrow(kHq * kDim), krow(kHkv * kDim), vrow(kHkv * kDim), attn(kHq * kDim);
        std::vector<float> kf, vf, p;  // one KV head's rows in float, one query head's weights
        std::vector<float> out(static_cast<std::size_t>(c * kModel));
        for (i64 t = 0; t < c; ++t) {
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
            for (i64 ch = 0; ch < kDim; ++ch)
              queries[static_cast<std::size_t>(s)][static_cast<std::size_t>((j * c + t) * kDim + ch)] =
                  bf16(qrow[static_cast<std::size_t>(j * kDim + ch)]);
          for (i64 h2 = 0; h2 < kHkv; ++h2) {  // K/V land at each head's next slot
            i64& len = lens[static_cast<std::size_t>(h2)];
            for (i64 ch = 0; ch < kDim; ++ch) {
              kview.at(h2, len, ch) = bf16(krow[static_cast<std::size_t>(h2 * kDim + ch)]);
              vview.at(h2, len, ch) = bf16(vrow[static_cast<std::size_t>(h2 * kDim + ch)]);
            }
            ++len;
          }
          // Causal attention of this token over each head's rows (its own length). The rows are
          // read once per KV head into float (a row's d elements are contiguous in a block).
          for (i64 h2 = 0; h2 < kHkv; ++h2) {
            const i64 rows = lens[static_cast<std::size_t>(h2)];
            kf.resize(static_cast<std::size_t>(rows * kDim));
            vf.resize(static_cast<std::size_t>(rows * kDim));
            for (i64 r = 0; r < rows; ++r) {
              const bf16* krow_r = &kview.at(h2, r, 0);
              const bf16* vrow_r = &vview.at(h2, r, 0);
              for (i64 ch = 0; ch < kDim; ++ch) {
                kf[static_cast<std::size_t>(r * kDim + ch)] = static_cast<float>(krow_r[ch]);
                vf[static_cast<std::size_t>(r * kDim + ch)] = static_cast<float>(vrow_r[ch]);
              }
            }
            for (i64 j = h2 * kGroup; j < (h2 + 1) * kGroup; ++j) {
              const float* qj = qrow.data() + j * kDim;
              p.resize(static_cast<std::size_t>(rows));
              float mx = -1e30f;
              for (i64 r = 0; r < rows; ++r) {
                const float* kr = kf.data() + r * kDim;
                float dot = 0.0f;
                for (i64 ch = 0; ch < kDim; ++ch) dot += qj[ch] * kr[ch];
                p[static_cast<std::size_t>(r)] = dot / std::sqrt(float(kDim));
                mx = std::max(mx, p[static_cast<std::size_t>(r)]);
              }
              float z = 0.0f;
              for (float& e : p) z += (e = std::exp(e - mx));
              float* aj = attn.data() + j * kDim;
              std::fill(aj, aj + kDim, 0.0f);
              for (i64 r = 0; r < rows; ++r) {
                const float* vr = vf.data() + r * kDim;
                const float pr = p[static_cast<std::size_t>(r)];
                for (i64 ch = 0; ch < kDim; ++ch) aj[ch] += pr * vr[ch];
              }
              for (i64 ch = 0; ch < kDim; ++ch) aj[ch] /= z;
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
      std::vector<std::vector<i64>> kept(static_cast<std::size_t>(n),
                                         std::vector<i64>(static_cast<std::size_t>(compressor.keep_capacity())));
      for (i64 s = 0; s < n; ++s) {
        sequence& q = seqs[static_cast<std::size_t>(s)];
        auto& e = io[static_cast<std::size_t>(s)];
        e.event = event[static_cast<std::size_t>(s)];  // the compressor knows what each phase needs
        if (e.event == kvevict::sequence_event::idle) continue;
        const i64 rows = q.head_lengths[static_cast<std::size_t>(l)][0];  // equal until AdaKV evicts
        e.keys = cache.view(true, l, q.table, rows);
        e.values = cache.view(false, l, q.table, rows);
        e.queries = kvevict::contiguous_queries<const bf16>(queries[static_cast<std::size_t>(s)].data(), kHq,
                                                            count[static_cast<std::size_t>(s)], kDim,
                                                            qpos[static_cast<std::size_t>(s)].data());
        e.state = q.state.data();
        e.block_refcounts = cache.refs.data();  // prefix caching: the shared blocks count 2
        if (!q.fresh.empty()) {                 // out of place: the kept rows go to fresh blocks
          const i64 room = static_cast<i64>(q.fresh.size()) * kBlock;
          e.dst_keys = cache.view(true, l, q.fresh, room);
          e.dst_values = cache.view(false, l, q.fresh, room);
        }
        e.head_lengths = lengths[static_cast<std::size_t>(s)].data();
        e.kept_positions = kept[static_cast<std::size_t>(s)].data();
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
        kept[static_cast<std::size_t>(s)].resize(static_cast<std::size_t>(r.kept));
        q.kept[static_cast<std::size_t>(l)] = kept[static_cast<std::size_t>(s)];
        evicted_now[static_cast<std::size_t>(s)] = true;  // every layer evicts at the same step
      }
    }
    // After the last layer: an evicted sequence now lives in its fresh blocks (the old ones go
    // back, a shared one only when no sequence uses it any more), one that was not gives the
    // fresh blocks back; positions advance; after a prompt's last chunk and after each decode
    // step the next token is sampled (greedy).
    for (i64 s = 0; s < n; ++s) {
      sequence& q = seqs[static_cast<std::size_t>(s)];
      if (evicted_now[static_cast<std::size_t>(s)]) {
        for (std::int32_t b : q.table) cache.release(b);
        q.table.assign(q.fresh.begin(), q.fresh.begin() + blocks_for(longest(q)));
        for (std::size_t b = q.table.size(); b < q.fresh.size(); ++b) cache.release(q.fresh[b]);
        q.evicted = true;
      } else {
        for (std::int32_t b : q.fresh) cache.release(b);
      }
      q.fresh.clear();
      const i64 c = count[static_cast<std::size_t>(s)];
      if (c == 0) continue;
      q.position += c;  // RoPE positions never move back
      q.done += c;
      if (event[static_cast<std::size_t>(s)] == kvevict::sequence_event::prefill_chunk) continue;
      const float* h = x[static_cast<std::size_t>(s)].data() + (c - 1) * kModel;
      std::vector<float> logits(kVocab);
      matvec(m.out, h, kVocab, kModel, logits.data());
      q.tokens.push_back(static_cast<std::int32_t>(std::max_element(logits.begin(), logits.end()) - logits.begin()));
    }
    return true;
  }
};

/// What a run of the requests left: per sequence every layer's kept positions and head
/// lengths, and every token.
struct run_result {
  bool ok = false;
  std::vector<std::vector<std::vector<i64>>> kept, lengths;
  std::vector<std::vector<std::int32_t>> tokens;
  i64 calls = 0, steps = 0, evicted = 0;
  i64 blocks_after_prefill = 0, blocks_after = 0;
};

/// The three requests, served the realistic way (chunks, a shared prefix) or the simple way.
run_result serve(const model& m, bool realistic) {
  const std::vector<i64> prompts = {300, 517, 190};
  const auto n = static_cast<i64>(prompts.size());
  run_result res;
  kvevict::deferkv_config defer;  // evict at the 2nd decoded token
  defer.window = 32;
  defer.delay = 2;
  kvevict::compressor_options opt;
  opt.model = {kLayers, kHq, kHkv, kDim, 0, kvevict::dtype::bf16};
  opt.policy = kvevict::policy::deferkv(defer);
  opt.per_head = kvevict::budget::tokens(48);  // prompt candidates per head; window and decoded on top
  opt.heads = kvevict::head_allocation::adakv;
  opt.compact = kvevict::compaction::out_of_place;  // shared prefix blocks stay intact
  opt.sharing = kvevict::block_sharing::marked;     // refcounts on every call
  opt.chunked_prefill = realistic;
  opt.limits.max_sequences = n;
  opt.limits.max_tokens = 517 + kSteps + kDraft;
  call_counter counter;
  opt.tracer = {&counter, &call_counter::on_run};
  kvevict::compressor compressor;
  const kvevict::status st = kvevict::compressor::plan(opt, &compressor);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message());
    return res;
  }

  paged_cache cache(320);
  std::vector<sequence> seqs(static_cast<std::size_t>(n));
  std::mt19937 rng(5);
  for (i64 s = 0; s < n; ++s) {
    sequence& q = seqs[static_cast<std::size_t>(s)];
    q.prompt = prompts[static_cast<std::size_t>(s)];
    for (i64 t = 0; t < q.prompt; ++t)
      q.tokens.push_back(s == 1 && t < kShared ? seqs[0].tokens[static_cast<std::size_t>(t)]
                                               : static_cast<std::int32_t>(rng() % kVocab));
    q.head_lengths.assign(kLayers, std::vector<i64>(kHkv, 0));
    q.kept.assign(kLayers, {});
    q.state.assign(compressor.sequence_state_size() / 8 + 1, 0);
    if (!compressor.reset_sequence(q.state.data(), q.state.size() * 8).ok()) return res;
  }
  engine e{m, cache, compressor, kvevict::workspace(compressor.workspace_size()), seqs};
  using ev = kvevict::sequence_event;
  if (realistic) {
    for (;;) {  // one chunk of every prompt still in prefill per step
      std::vector<i64> count(static_cast<std::size_t>(n), 0);
      std::vector<ev> event(static_cast<std::size_t>(n), ev::idle);
      bool any = false;
      for (i64 s = 0; s < n; ++s) {
        sequence& q = seqs[static_cast<std::size_t>(s)];
        if (q.done == q.prompt) continue;
        if (s == 1 && q.done == 0) {             // prefix caching: wait for sequence 0's first 256 tokens,
          if (seqs[0].done < kShared) continue;  // then take its 16 blocks
          q.table.assign(seqs[0].table.begin(), seqs[0].table.begin() + kShared / kBlock);
          for (std::int32_t b : q.table) ++cache.refs[static_cast<std::size_t>(b)];
          q.done = q.position = kShared;
          for (auto& layer : q.head_lengths) std::fill(layer.begin(), layer.end(), kShared);
        }
        count[static_cast<std::size_t>(s)] = std::min(kChunk, q.prompt - q.done);
        event[static_cast<std::size_t>(s)] =
            q.done + count[static_cast<std::size_t>(s)] == q.prompt ? ev::prefill_end : ev::prefill_chunk;
        any = true;
      }
      if (!any) break;
      if (!e.step(count, event)) return res;
    }
  } else if (!e.step(prompts, std::vector<ev>(static_cast<std::size_t>(n), ev::prefill_end))) {
    return res;
  }
  res.blocks_after_prefill = cache.used();
  for (i64 k = 0; k < kSteps; ++k) {
    std::vector<i64> count(static_cast<std::size_t>(n), 1);
    if (k == 0) {  // sequence 2 verifies a draft of 2 more tokens with its next one: all accepted
      sequence& q = seqs[2];
      for (i64 j = 1; j < kDraft; ++j)
        q.tokens.push_back(static_cast<std::int32_t>((q.tokens.back() * 7 + j) % kVocab));
      count[2] = kDraft;
    }
    if (!e.step(count, std::vector<ev>(static_cast<std::size_t>(n), ev::decode))) return res;
  }
  res.blocks_after = cache.used();
  for (const sequence& q : seqs) {
    res.kept.push_back(q.kept);
    res.lengths.push_back(q.head_lengths);
    res.tokens.push_back(q.tokens);
  }
  res.calls = counter.calls;
  res.evicted = counter.evicted;
  res.steps = e.steps;
  res.ok = true;
  return res;
}

}  // namespace

int main() {
  const model m = make_model();
  std::printf(
      "engine_loop: %lld layers, Hq=%lld Hkv=%lld d=%lld, paged bf16 (block %lld), 3 sequences of 300, 517 "
      "and 190 prompt tokens; DeferKV d=2 + AdaKV B=48, out of place\n",
      static_cast<long long>(kLayers), static_cast<long long>(kHq), static_cast<long long>(kHkv),
      static_cast<long long>(kDim), static_cast<long long>(kBlock));
  const run_result real = serve(m, true);
  const run_result simple = serve(m, false);
  if (!real.ok || !simple.ok) return 1;
  const paged_cache sizes(0);
  std::printf(
      "realistic: chunks of %lld, sequence 1 shares sequence 0's first %lld tokens, sequence 2 verifies %lld "
      "tokens in one step: %lld steps, %lld compressor calls\n",
      static_cast<long long>(kChunk), static_cast<long long>(kShared), static_cast<long long>(kDraft),
      static_cast<long long>(real.steps), static_cast<long long>(real.calls));
  std::printf("  K+V after prefill %.2f MiB (%lld blocks, the prefix stored once), after eviction %.2f MiB\n",
              sizes.mib(real.blocks_after_prefill), static_cast<long long>(real.blocks_after_prefill),
              sizes.mib(real.blocks_after));
  std::printf(
      "simple: whole prompts in one step, nothing shared: %lld steps; K+V after prefill %.2f MiB, after "
      "eviction %.2f MiB\n",
      static_cast<long long>(simple.steps), sizes.mib(simple.blocks_after_prefill), sizes.mib(simple.blocks_after));
  bool same = real.kept == simple.kept && real.lengths == simple.lengths && real.tokens == simple.tokens;
  for (std::size_t s = 0; s < real.kept.size(); ++s) {
    std::size_t kept = 0;
    for (const auto& layer : real.kept[s]) kept += layer.size();
    same = same && kept > 0;
    std::printf("  seq %zu: %zu tokens kept over %lld layers x %lld heads, layer 0 head rows %lld/%lld: %s\n", s, kept,
                static_cast<long long>(kLayers), static_cast<long long>(kHkv),
                static_cast<long long>(real.lengths[s][0][0]), static_cast<long long>(real.lengths[s][0][1]),
                real.kept[s] == simple.kept[s] ? "the same keep sets as the simple run" : "DIFFERENT keep sets");
  }
  const bool calls = real.calls == kLayers * real.steps && simple.calls == kLayers * simple.steps &&
                     real.evicted == kLayers * 3 && simple.evicted == kLayers * 3;
  std::printf("keep sets, lengths and generated tokens %s; one compressor call per layer per step: %s\n",
              same ? "identical" : "DIFFER", calls ? "yes" : "NO");
  return same && calls && real.blocks_after < real.blocks_after_prefill ? 0 : 2;
}
