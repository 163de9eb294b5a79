// Differential fuzzing of the compressor (one planned call per layer) across its three
// compaction modes. A fuzz-chosen model, policy (StreamingLLM, KNorm, H2O, SnapKV, DeferKV,
// TOVA, KeyDiff; not DapQ, whose prefill hands its pseudo tokens' queries),
// budget, allocation (uniform, AdaKV, PyramidKV), selection scope, combining rule and length
// mode runs over a batch of sequences whose K and V caches take independent layouts (every
// layout of tests/support/test_cache.hpp) and storage types, three times: keep-list only, in
// place and out of place. It checks:
//   - the keep sets (padded indices, head lengths, kept positions, reports) are the same in
//     every mode; indices ascend, lie inside the cache and are -1 padded; shared scopes give
//     every head (and, per sequence, every layer) the same set; uniform lengths one count;
//   - keep-list only moves nothing; in place, every buffer equals the gather of its kept rows
//     and is otherwise untouched, and every paged block whose bytes changed is listed in
//     changed_blocks; out of place, the sources are untouched and the destinations hold the
//     gathered rows;
//   - DeferKV's decode step carries 1 to 3 tokens (speculative verification);
//   - chunked prefill: in the in-place run the first rows of each prompt's window are handed
//     earlier as a prefill_chunk (chunked_prefill planned), the rest at prefill_end; the keep
//     sets must still equal the other runs', which hand the whole window at once;
//   - a fuzz-chosen corruption of one call (shapes, block tables, queries, state, a block
//     marked shared, a short destination, the layer index) fails with an error and leaves
//     every byte of every sequence as it was, or succeeds with every check above holding
//     (a block marked shared is then unchanged).
#include "common.hpp"

namespace {
using namespace fuzz;

constexpr kvevict::compaction kModes[] = {kvevict::compaction::keep_list_only, kvevict::compaction::in_place,
                                          kvevict::compaction::out_of_place};

/// The block of a paged test cache holding flat element `offset`, or -1 (not paged by blocks).
template <class T>
i64 block_of(const test::test_cache<T>& c, i64 offset) {
  const i64 bs = c.block_size, h = c.heads, d = c.dim;
  switch (c.kind) {
    case test::layout::paged_nhd:
    case test::layout::paged_hnd:
      return offset / (bs * h * d);
    case test::layout::packed_hnd:
    case test::layout::packed_nhd:
    case test::layout::flashinfer_kv:
      return offset / (2 * bs * h * d);
    case test::layout::paged_per_head:
      return offset / (bs * d);
    default:
      return -1;
  }
}

/// A TOVA or KeyDiff configuration (the same two fields): a protected tail of 0..3 tokens,
/// inside or on top of the budget.
template <class Config>
Config protected_tail_config(FuzzedDataProvider& in, Config c) {
  c.protected_tail = in.ConsumeIntegralInRange<i64>(0, 3);
  if (in.ConsumeBool()) c.protect = kvevict::protected_mode::on_top_of_budget;
  return c;
}

/// What the fuzz input chose, shared by the three runs.
struct choice {
  i64 layers = 1, hkv = 1, group = 1, d = 1, seqs = 1, block = 4;
  std::vector<i64> lengths;  ///< prompt tokens per sequence
  std::vector<test::layout> klayout, vlayout;
  kvevict::compressor_options options;
  bool decode = false;    ///< DeferKV: one decode step after prefill
  i64 decode_tokens = 1;  ///< of that many tokens (speculative verification: 1 .. 3)
  i64 chunk_rows = 0;     ///< in place: rows of each prompt window handed first as a prefill_chunk
  // Corruption of one call.
  int corrupt = 0;
  i64 corrupt_seq = 0, corrupt_layer = 0, corrupt_step = 0;
  std::uint32_t corrupt_value = 0;
  std::uint64_t seed = 0;
};

template <class T>
struct sequence_world {
  std::vector<test::test_cache<T>> k, v, dk, dv;  ///< per layer
  std::vector<test::test_queries<T>> prompt_q, decode_q;
  std::vector<std::uint64_t> state;
  std::vector<std::int32_t> refcounts;  ///< for the corruption that marks a block shared
  std::vector<kvevict::layer_cache<T>> layers;
};

/// One call's outputs for one sequence.
struct outputs {
  std::vector<i64> head_lengths, kept_positions, padded, head_freed;
  std::vector<std::int32_t> changed;
  kvevict::sequence_report report;
};

template <class T>
std::uint64_t checksum(const std::vector<sequence_world<T>>& w, const std::vector<outputs>& out) {
  std::uint64_t x = fnv_seed;
  for (const auto& s : w) {
    for (const auto* caches : {&s.k, &s.v, &s.dk, &s.dv})
      for (const auto& c : *caches) x = fnv(x, c.buffer.data(), c.buffer.size() * sizeof(T));
    x = fnv(x, s.state.data(), s.state.size() * sizeof(std::uint64_t));
  }
  for (const auto& o : out) {
    x = fnv(x, o.head_lengths.data(), o.head_lengths.size() * sizeof(i64));
    x = fnv(x, o.kept_positions.data(), o.kept_positions.size() * sizeof(i64));
    x = fnv(x, o.padded.data(), o.padded.size() * sizeof(i64));
    x = fnv(x, o.head_freed.data(), o.head_freed.size() * sizeof(i64));
    x = fnv(x, o.changed.data(), o.changed.size() * sizeof(std::int32_t));
    x = fnv(x, &o.report, sizeof(o.report));
  }
  return x;
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

/// An evicting call's keep set, as the outputs state it.
struct keep_set {
  i64 layer = -1;  ///< -1: every layer (sequence scope)
  std::vector<i64> lengths, padded, positions;
  i64 capacity = 0;
  std::vector<std::int32_t> changed;
  kvevict::sequence_report report;
  bool operator==(const keep_set& o) const {
    return layer == o.layer && lengths == o.lengths && padded == o.padded && positions == o.positions &&
           report.length == o.report.length && report.kept == o.report.kept && report.dropped == o.report.dropped &&
           report.next_position == o.report.next_position;
  }
};

/// The result of one mode's run: per sequence, the keep sets applied (empty when it failed).
struct run_result {
  bool ok = true;
  std::vector<std::vector<keep_set>> sets;
};

template <class T>
run_result run_mode(const choice& ch, kvevict::compaction mode) {
  run_result res;
  res.sets.resize(static_cast<std::size_t>(ch.seqs));
  kvevict::compressor_options o = ch.options;
  o.compact = mode;
  const bool chunked = ch.chunk_rows > 0 && mode == kvevict::compaction::in_place;
  o.chunked_prefill = chunked;
  if (std::getenv("KVEVICT_FUZZ_VERBOSE") != nullptr)
    std::fprintf(stderr,
                 "mode %d policy %s chunk %lld scope %d combine %d lengths %d heads %d layers %d: %lld layers, "
                 "Hkv %lld x %lld, d %lld, %lld seqs (first %s/%s, L %lld), corrupt %d\n",
                 static_cast<int>(mode), kvevict::to_string(o.policy.kind()),
                 static_cast<long long>(o.policy.chunk_length), static_cast<int>(o.scope), static_cast<int>(o.combine),
                 static_cast<int>(o.lengths), static_cast<int>(o.heads), static_cast<int>(o.layers),
                 static_cast<long long>(ch.layers), static_cast<long long>(ch.hkv), static_cast<long long>(ch.group),
                 static_cast<long long>(ch.d), static_cast<long long>(ch.seqs), test::name(ch.klayout[0]).c_str(),
                 test::name(ch.vlayout[0]).c_str(), static_cast<long long>(ch.lengths[0]), ch.corrupt);
  kvevict::compressor comp;
  const kvevict::status planned = kvevict::compressor::plan(o, &comp);
  if (!planned.ok()) {
    FUZZ_REQUIRE(std::string(planned.message()).rfind("kvevict::", 0) == 0, "plan message: %s", planned.message());
    res.ok = false;
    return res;
  }
  const i64 hq = ch.hkv * ch.group, window = comp.observation_window();
  std::vector<sequence_world<T>> world(static_cast<std::size_t>(ch.seqs));
  for (i64 s = 0; s < ch.seqs; ++s) {
    sequence_world<T>& w = world[static_cast<std::size_t>(s)];
    const i64 len = ch.lengths[static_cast<std::size_t>(s)], cap = len + ch.decode_tokens;
    for (i64 l = 0; l < ch.layers; ++l) {
      const std::uint64_t seed = ch.seed + static_cast<std::uint64_t>(s * 101 + l * 7);
      const auto kl = ch.klayout[static_cast<std::size_t>(s)], vl = ch.vlayout[static_cast<std::size_t>(s)];
      const auto n = static_cast<std::size_t>(ch.hkv * cap * ch.d);
      w.k.push_back(test::make_cache<T>(kl, ch.hkv, cap, ch.d, test::normal(n, seed), ch.block, seed));
      w.v.push_back(test::make_cache<T>(vl, ch.hkv, cap, ch.d, test::normal(n, seed + 1), ch.block, seed + 2));
      w.dk.push_back(test::make_cache<T>(kl, ch.hkv, cap, ch.d, test::normal(n, seed + 3), ch.block, seed + 4));
      w.dv.push_back(test::make_cache<T>(vl, ch.hkv, cap, ch.d, test::normal(n, seed + 5), ch.block, seed + 6));
      // H2O counts every prompt query; the windowed policies the last W (all of a shorter prompt),
      // handed with up to 2 earlier ones (they use the last W; a chunk's window drops them).
      const bool every = o.policy.kind() == kvevict::policy_kind::h2o;
      const i64 last = every ? len : std::max<i64>(1, std::min(window, len));
      const i64 rows = last + (every ? 0 : std::min<i64>(len - last, 2));
      std::vector<i64> qpos;
      for (i64 t = 0; t < rows; ++t) qpos.push_back(len - rows + t);
      w.prompt_q.push_back(test::make_queries<T>(
          hq, rows, ch.d, test::normal(static_cast<std::size_t>(hq * rows * ch.d), seed + 8), qpos, (seed & 1) != 0));
      std::vector<i64> dpos;
      for (i64 t = 0; t < ch.decode_tokens; ++t) dpos.push_back(len + t);
      w.decode_q.push_back(test::make_queries<T>(
          hq, ch.decode_tokens, ch.d, test::normal(static_cast<std::size_t>(hq * ch.decode_tokens * ch.d), seed + 9),
          dpos, false));
    }
    w.state.assign(comp.sequence_state_size() / 8 + 1, 0);
    if (comp.sequence_state_size() > 0)
      FUZZ_REQUIRE(comp.reset_sequence(w.state.data(), w.state.size() * 8).ok(), "reset_sequence");
    w.refcounts.assign(4096, 1);
  }
  // Each (sequence, call) writes its own outputs.
  std::vector<outputs> out(static_cast<std::size_t>(ch.seqs));
  const auto fresh_outputs = [&] {
    for (auto& x : out) {
      x.head_lengths.assign(static_cast<std::size_t>(ch.hkv), -9);
      x.kept_positions.assign(static_cast<std::size_t>(comp.keep_capacity()) + 1, -9);
      x.padded.assign(static_cast<std::size_t>(ch.hkv * comp.keep_capacity_per_head()) + 1, -9);
      x.head_freed.assign(static_cast<std::size_t>(ch.hkv), -9);
      x.changed.assign(static_cast<std::size_t>(comp.changed_blocks_capacity()) + 1, -9);
      x.report = kvevict::sequence_report{kvevict::sequence_action::observed, -1, -1, -1, -1, -1, -1, -1};
    }
  };
  std::vector<unsigned char> ws(comp.workspace_size() + 1);
  const int steps = ch.decode ? 2 : 1;
  for (int step = 0; step < steps; ++step) {
    for (i64 l = 0; l < ch.layers; ++l) {
      // Chunked prefill: the first rows of each window go first, as a prompt chunk.
      std::vector<i64> split(static_cast<std::size_t>(ch.seqs), 0);
      if (step == 0 && chunked) {
        std::vector<kvevict::sequence_io<T>> cio(static_cast<std::size_t>(ch.seqs));
        for (i64 s = 0; s < ch.seqs; ++s) {
          sequence_world<T>& w = world[static_cast<std::size_t>(s)];
          kvevict::sequence_io<T>& x = cio[static_cast<std::size_t>(s)];
          const kvevict::query_view<const T> q = w.prompt_q[static_cast<std::size_t>(l)].view;
          const i64 rows = std::min(ch.chunk_rows, q.num_queries - 1);
          const i64 tokens = ch.lengths[static_cast<std::size_t>(s)] - q.num_queries + rows;
          x.keys = w.k[static_cast<std::size_t>(l)].view;
          x.values = w.v[static_cast<std::size_t>(l)].view;
          x.keys.num_tokens = x.values.num_tokens = tokens;
          if (rows <= 0) continue;  // idle: a one-query window is handed whole
          split[static_cast<std::size_t>(s)] = rows;
          x.event = kvevict::sequence_event::prefill_chunk;
          x.queries = q;
          x.queries.num_queries = rows;
          x.state = comp.sequence_state_size() > 0 ? w.state.data() : nullptr;
        }
        std::vector<kvevict::sequence_report> creports(static_cast<std::size_t>(ch.seqs));
        const kvevict::status cst = comp.run(l, cio.data(), ch.seqs, creports.data(), {ws.data() + 1, ws.size() - 1});
        FUZZ_REQUIRE(cst.ok(), "a prompt chunk: %s", cst.message());
      }
      fresh_outputs();
      std::vector<kvevict::sequence_io<T>> io(static_cast<std::size_t>(ch.seqs));
      for (i64 s = 0; s < ch.seqs; ++s) {
        sequence_world<T>& w = world[static_cast<std::size_t>(s)];
        const i64 tokens = ch.lengths[static_cast<std::size_t>(s)] + (step > 0 ? ch.decode_tokens : 0);
        w.layers.clear();
        for (i64 m = 0; m < ch.layers; ++m) {
          kvevict::layer_cache<T> c(w.k[static_cast<std::size_t>(m)].view, w.v[static_cast<std::size_t>(m)].view);
          c.keys.num_tokens = c.values.num_tokens = tokens;
          if (mode == kvevict::compaction::out_of_place) {
            c.dst_keys = w.dk[static_cast<std::size_t>(m)].view;
            c.dst_values = w.dv[static_cast<std::size_t>(m)].view;
          }
          w.layers.push_back(c);
        }
        kvevict::sequence_io<T>& x = io[static_cast<std::size_t>(s)];
        const kvevict::layer_cache<T>& mine = w.layers[static_cast<std::size_t>(l)];
        x.event = step == 0 ? kvevict::sequence_event::prefill_end : kvevict::sequence_event::decode;
        x.keys = mine.keys;
        x.values = mine.values;
        x.dst_keys = mine.dst_keys;
        x.dst_values = mine.dst_values;
        x.queries =
            step == 0 ? w.prompt_q[static_cast<std::size_t>(l)].view : w.decode_q[static_cast<std::size_t>(l)].view;
        if (const i64 first = split[static_cast<std::size_t>(s)]) {  // the rest of a chunked window
          x.queries.data += first * x.queries.query_stride;
          x.queries.positions += first;
          x.queries.num_queries -= first;
        }
        x.state = comp.sequence_state_size() > 0 ? w.state.data() : nullptr;
        x.layers = w.layers.data();
        outputs& ou = out[static_cast<std::size_t>(s)];
        x.head_lengths = ou.head_lengths.data();
        x.kept_positions = ou.kept_positions.data();
        x.padded_indices = ou.padded.data();
        x.head_freed_blocks = ou.head_freed.data();
        x.changed_blocks = ou.changed.data();
      }
      i64 layer_arg = l;
      i64 shared_block = -1;
      if (ch.corrupt != 0 && step == ch.corrupt_step && l == ch.corrupt_layer) {
        kvevict::sequence_io<T>& x = io[static_cast<std::size_t>(ch.corrupt_seq)];
        sequence_world<T>& w = world[static_cast<std::size_t>(ch.corrupt_seq)];
        switch (ch.corrupt) {
          case 1:  // (more tokens than the block table maps would be the caller's overrun, not an error)
            x.values.num_tokens -= 1;
            break;
          case 2:
            x.keys.head_dim = 0;
            break;
          case 3:
            x.queries.data = nullptr;
            break;
          case 4:
            x.queries.num_heads += 1;
            break;
          case 5:
            layer_arg = ch.corrupt_value % 2 ? -1 : ch.layers;
            break;
          case 6:
            if (!w.state.empty()) w.state[ch.corrupt_value % w.state.size()] ^= 0x5a5a;
            break;
          case 7: {  // a block of the sequence's K marked shared by prefix caching
            const auto& c = w.k[static_cast<std::size_t>(ch.corrupt_layer)];
            if (!c.table.empty() && block_of(c, 0) >= 0 && c.table[ch.corrupt_value % c.table.size()] >= 0) {
              shared_block = c.table[ch.corrupt_value % c.table.size()];  // (per-head tables pad with -1)
              w.refcounts[static_cast<std::size_t>(shared_block)] = 2;
              x.block_refcounts = w.refcounts.data();
            }
            break;
          }
          case 8:
            if (x.dst_keys.data != nullptr) x.dst_keys.num_tokens = ch.corrupt_value % 2;
            break;
          case 9:  // a block-table entry out of range
            if (!w.k[static_cast<std::size_t>(ch.corrupt_layer)].table.empty()) {
              auto& c = w.k[static_cast<std::size_t>(ch.corrupt_layer)];
              c.set_table(ch.corrupt_value % c.table.size(), static_cast<std::int32_t>(c.pool_blocks + 3));
            }
            break;
          default:
            x.keys.token_stride = -x.keys.token_stride - 1;
        }
      }
      // What every buffer held before the call, to check the call against.
      const std::uint64_t before = checksum(world, out);
      std::vector<std::vector<T>> kb, vb, dkb, dvb;
      for (const auto& w : world)
        for (i64 m = 0; m < ch.layers; ++m) {
          kb.push_back(w.k[static_cast<std::size_t>(m)].buffer);
          vb.push_back(w.v[static_cast<std::size_t>(m)].buffer);
          dkb.push_back(w.dk[static_cast<std::size_t>(m)].buffer);
          dvb.push_back(w.dv[static_cast<std::size_t>(m)].buffer);
        }
      std::vector<kvevict::sequence_report> reports(static_cast<std::size_t>(ch.seqs));
      for (i64 s = 0; s < ch.seqs; ++s) reports[static_cast<std::size_t>(s)] = out[static_cast<std::size_t>(s)].report;
      const kvevict::status st =
          comp.run(layer_arg, io.data(), ch.seqs, reports.data(), {ws.data() + 1, ws.size() - 1});
      if (!st.ok()) {
        FUZZ_REQUIRE(std::string(st.message()).rfind("kvevict::", 0) == 0, "message: %s", st.message());
        FUZZ_REQUIRE(*st.argument() != '\0', "an error names its argument");
        FUZZ_REQUIRE(checksum(world, out) == before, "a failed call (%s) changed memory", st.message());
        res.ok = false;
        return res;
      }
      // Check every sequence against what its report says happened.
      std::size_t flat = 0;
      for (i64 s = 0; s < ch.seqs; ++s) {
        const sequence_world<T>& w = world[static_cast<std::size_t>(s)];
        const kvevict::sequence_report& r = reports[static_cast<std::size_t>(s)];
        const outputs& ou = out[static_cast<std::size_t>(s)];
        const i64 tokens = io[static_cast<std::size_t>(s)].keys.num_tokens;
        const bool evicted = r.action == kvevict::sequence_action::evicted;
        const bool every_layer = o.scope == kvevict::selection_scope::per_sequence;
        const i64 per_head = comp.keep_capacity_per_head();
        keep_set ks;
        ks.layer = every_layer ? -1 : l;
        ks.report = r;
        if (evicted) {
          i64 total = 0, longest = 0;
          for (i64 h = 0; h < ch.hkv; ++h) {
            const i64 n = ou.head_lengths[static_cast<std::size_t>(h)];
            FUZZ_REQUIRE(n >= 0 && n <= tokens && n <= per_head, "head_lengths[%lld] = %lld", static_cast<long long>(h),
                         static_cast<long long>(n));
            for (i64 i = 0; i < per_head; ++i) {
              const i64 idx = ou.padded[static_cast<std::size_t>(h * per_head + i)];
              if (i < n) {
                FUZZ_REQUIRE(idx >= 0 && idx < tokens, "padded index %lld", static_cast<long long>(idx));
                if (i > 0) FUZZ_REQUIRE(idx > ou.padded[static_cast<std::size_t>(h * per_head + i - 1)], "ascending");
                FUZZ_REQUIRE(ou.kept_positions[static_cast<std::size_t>(total + i)] == idx, "kept position");
              } else {
                FUZZ_REQUIRE(idx == -1, "padding is -1");
              }
              if (o.scope != kvevict::selection_scope::per_head)
                FUZZ_REQUIRE(idx == ou.padded[static_cast<std::size_t>(i)], "a shared scope: head %lld differs",
                             static_cast<long long>(h));
            }
            if (o.lengths == kvevict::length_mode::uniform)
              FUZZ_REQUIRE(n == ou.head_lengths[0], "uniform lengths differ");
            total += n;
            longest = std::max(longest, n);
          }
          FUZZ_REQUIRE(r.kept == total && r.length == longest && r.dropped == tokens - longest, "report counts");
          FUZZ_REQUIRE(r.num_changed_blocks >= 0 && r.num_changed_blocks <= comp.changed_blocks_capacity(),
                       "num_changed_blocks");
          FUZZ_REQUIRE(ou.kept_positions[static_cast<std::size_t>(total)] == -9, "wrote past kept_positions");
          ks.lengths = ou.head_lengths;
          ks.padded = ou.padded;
          ks.positions.assign(ou.kept_positions.begin(), ou.kept_positions.begin() + total);
          ks.changed.assign(ou.changed.begin(), ou.changed.begin() + r.num_changed_blocks);
          res.sets[static_cast<std::size_t>(s)].push_back(ks);
        } else {
          FUZZ_REQUIRE(ou.head_lengths[0] == -9 && ou.padded[0] == -9, "outputs written without eviction");
        }
        // Buffers: what moved must be exactly the keep set's gather.
        for (i64 m = 0; m < ch.layers; ++m, ++flat) {
          const bool compacted = evicted && (every_layer || m == l) && mode != kvevict::compaction::keep_list_only;
          const auto gather = [&](const test::test_cache<T>& src, const std::vector<T>& src_before,
                                  const std::vector<T>& dst_before, const test::test_cache<T>& dst) {
            std::vector<T> want = dst_before;
            for (i64 h = 0; h < ch.hkv; ++h)
              for (i64 i = 0; i < ou.head_lengths[static_cast<std::size_t>(h)]; ++i)
                for (i64 c = 0; c < ch.d; ++c)
                  want[static_cast<std::size_t>(dst.offset(h, i, c))] = src_before[static_cast<std::size_t>(
                      src.offset(h, ou.padded[static_cast<std::size_t>(h * per_head + i)], c))];
            return want;
          };
          const auto& k = w.k[static_cast<std::size_t>(m)];
          const auto& v = w.v[static_cast<std::size_t>(m)];
          const auto& dk = w.dk[static_cast<std::size_t>(m)];
          const auto& dv = w.dv[static_cast<std::size_t>(m)];
          if (!compacted) {
            FUZZ_REQUIRE(same_bytes(k.buffer, kb[flat]) && same_bytes(v.buffer, vb[flat]) &&
                             same_bytes(dk.buffer, dkb[flat]) && same_bytes(dv.buffer, dvb[flat]),
                         "seq %lld layer %lld changed without its eviction", static_cast<long long>(s),
                         static_cast<long long>(m));
          } else if (mode == kvevict::compaction::in_place) {
            FUZZ_REQUIRE(same_bytes(k.buffer, gather(k, kb[flat], kb[flat], k)), "K in place (%s)",
                         test::name(k.kind).c_str());
            FUZZ_REQUIRE(same_bytes(v.buffer, gather(v, vb[flat], vb[flat], v)), "V in place (%s)",
                         test::name(v.kind).c_str());
            // Every block whose bytes changed is reported (in the K or V pool).
            const auto listed = [&](i64 b) {
              return std::find(ou.changed.begin(), ou.changed.begin() + r.num_changed_blocks,
                               static_cast<std::int32_t>(b)) != ou.changed.begin() + r.num_changed_blocks;
            };
            for (const auto* pair : {&k, &v}) {
              const std::vector<T>& was = pair == &k ? kb[flat] : vb[flat];
              for (std::size_t e = 0; e < was.size(); ++e)
                if (std::memcmp(&was[e], &pair->buffer[e], sizeof(T)) != 0) {
                  const i64 b = block_of(*pair, static_cast<i64>(e));
                  // One list per call: the calling layer's blocks (every layer's when they share a table).
                  if (b >= 0 && m == l)
                    FUZZ_REQUIRE(listed(b), "block %lld changed but was not listed", static_cast<long long>(b));
                  if (shared_block >= 0 && pair == &k && s == ch.corrupt_seq && m == ch.corrupt_layer)
                    FUZZ_REQUIRE(b != shared_block, "a block marked shared was written");
                }
            }
          } else {
            FUZZ_REQUIRE(same_bytes(k.buffer, kb[flat]) && same_bytes(v.buffer, vb[flat]),
                         "out of place wrote a source");
            FUZZ_REQUIRE(same_bytes(dk.buffer, gather(k, kb[flat], dkb[flat], dk)), "K out of place (%s)",
                         test::name(k.kind).c_str());
            FUZZ_REQUIRE(same_bytes(dv.buffer, gather(v, vb[flat], dvb[flat], dv)), "V out of place (%s)",
                         test::name(v.kind).c_str());
          }
        }
      }
    }
  }
  return res;
}

template <class T>
void one_type(FuzzedDataProvider& in) {
  choice ch;
  ch.layers = in.ConsumeIntegralInRange<i64>(1, 3);
  ch.hkv = in.ConsumeIntegralInRange<i64>(1, 3);
  ch.group = in.ConsumeIntegralInRange<i64>(1, 2);
  ch.d = in.ConsumeIntegralInRange<i64>(1, 6);
  ch.seqs = in.ConsumeIntegralInRange<i64>(1, 3);
  static const i64 blocks[] = {1, 2, 4, 8};
  ch.block = in.PickValueInArray(blocks);
  for (i64 s = 0; s < ch.seqs; ++s) {
    ch.lengths.push_back(in.ConsumeIntegralInRange<i64>(1, 40));
    ch.klayout.push_back(in.PickValueInArray(test::kAllLayouts));
    ch.vlayout.push_back(in.PickValueInArray(test::kAllLayouts));
  }
  kvevict::compressor_options& o = ch.options;
  o.model = {ch.layers, ch.hkv * ch.group, ch.hkv, ch.d, 0, kvevict::dtype_of<T>::value};
  o.sharing = kvevict::block_sharing::none;  // each sequence has its own pools
  switch (in.ConsumeIntegralInRange<int>(0, 6)) {
    case 0: {
      kvevict::streaming_llm_config c;
      c.sinks = in.ConsumeIntegralInRange<i64>(0, 4);
      o.policy = kvevict::policy::streaming_llm(c);
      break;
    }
    case 1: {
      kvevict::knorm_config c;
      c.protected_tail = in.ConsumeIntegralInRange<i64>(0, 3);
      o.policy = kvevict::policy::knorm(c);
      break;
    }
    case 2: {
      kvevict::h2o_config c;
      c.recent_window = in.ConsumeIntegralInRange<i64>(0, 3);
      o.policy = kvevict::policy::h2o(c);
      break;
    }
    case 3: {
      kvevict::window_config c = kvevict::presets::kvpress_snapkv();
      c.window = in.ConsumeIntegralInRange<i64>(1, 4);
      if (in.ConsumeBool()) c.protect = kvevict::protected_mode::on_top_of_budget;
      o.policy = kvevict::policy::snapkv(c);
      break;
    }
    case 5:
      o.policy = kvevict::policy::tova(protected_tail_config(in, kvevict::tova_config{}));
      break;
    case 6:
      o.policy = kvevict::policy::keydiff(protected_tail_config(in, kvevict::keydiff_config{}));
      break;
    default: {
      kvevict::deferkv_config c;
      c.window = in.ConsumeIntegralInRange<i64>(1, 4);
      c.delay = 1;
      o.policy = kvevict::policy::deferkv(c);
      ch.decode = true;
    }
  }
  if (in.ConsumeBool()) o.policy = o.policy.chunked(in.ConsumeIntegralInRange<i64>(1, 5));
  o.per_head = in.ConsumeBool() ? kvevict::budget::tokens(in.ConsumeIntegralInRange<i64>(0, 24))
                                : kvevict::budget::ratio(in.ConsumeIntegralInRange<int>(0, 10) / 10.0);
  const int alloc = in.ConsumeIntegralInRange<int>(0, 5);
  if (alloc == 4) o.heads = kvevict::head_allocation::adakv;
  if (alloc == 5) o.layers = kvevict::layer_allocation::pyramidkv;
  o.scope = static_cast<kvevict::selection_scope>(in.ConsumeIntegralInRange<int>(0, 2));
  o.combine = static_cast<kvevict::scope_combine>(in.ConsumeIntegralInRange<int>(0, 3));
  o.lengths = in.ConsumeBool() ? kvevict::length_mode::per_head : kvevict::length_mode::uniform;
  o.limits.max_sequences = ch.seqs;
  o.limits.max_tokens = 48;
  if (in.ConsumeIntegralInRange<int>(0, 2) == 0) {
    ch.corrupt = in.ConsumeIntegralInRange<int>(1, 10);
    ch.corrupt_seq = in.ConsumeIntegralInRange<i64>(0, ch.seqs - 1);
    ch.corrupt_layer = in.ConsumeIntegralInRange<i64>(0, ch.layers - 1);
    ch.corrupt_step = ch.decode ? in.ConsumeIntegralInRange<i64>(0, 1) : 0;
    ch.corrupt_value = in.ConsumeIntegral<std::uint32_t>();
  }
  ch.seed = in.ConsumeIntegral<std::uint16_t>();
  // A flipped state word lands elsewhere in a state that also holds windows: no chunks then.
  if (ch.corrupt != 6) ch.chunk_rows = in.ConsumeIntegralInRange<i64>(0, 3);
  if (ch.decode) {  // a decode step of 1 .. 3 tokens (DeferKV's limits.max_queries covers it)
    ch.decode_tokens = in.ConsumeIntegralInRange<i64>(1, 3);
    o.limits.max_queries = std::max(o.policy.config<kvevict::deferkv_traits>().window, ch.decode_tokens);
  }

  std::vector<run_result> runs;
  for (kvevict::compaction mode : kModes) runs.push_back(run_mode<T>(ch, mode));
  // The keep sets do not depend on where the rows go.
  if (runs[0].ok && runs[1].ok && runs[2].ok)
    for (i64 s = 0; s < ch.seqs; ++s)
      for (std::size_t m = 1; m < 3; ++m)
        FUZZ_REQUIRE(runs[m].sets[static_cast<std::size_t>(s)] == runs[0].sets[static_cast<std::size_t>(s)],
                     "sequence %lld: the keep set differs between compaction modes", static_cast<long long>(s));
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  with_dtype(in.ConsumeIntegral<std::uint8_t>(), [&](auto t) { one_type<decltype(t)>(in); });
  return 0;
}
