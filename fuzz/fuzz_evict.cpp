// Differential fuzzing of eviction against a reference gather computed from explicit
// offset formulas: K and V in independent layouts and storage types (and head dims),
// random keep-lists (empty heads, full heads, runs, single tokens), key positions, a
// permuting executor; ragged batches (HF padded, vLLM 2-D tables, FlashInfer CSR, NHD and
// HND pools); flatten_varlen out of place and in place; keep_list_positions. The whole
// buffer is compared bit for bit: kept rows moved, every other element untouched.
#include "common.hpp"

namespace {
using namespace fuzz;

/// A keep-list of one head over [0, n): one of several shapes.
std::vector<i64> fuzz_head(FuzzedDataProvider& in, i64 n) {
  std::vector<i64> kept;
  switch (in.ConsumeIntegralInRange<int>(0, 5)) {
    case 0:
      break;  // empty
    case 1:
      for (i64 j = 0; j < n; ++j) kept.push_back(j);  // identity
      break;
    case 2:
      if (n > 0) kept.push_back(in.ConsumeIntegralInRange<i64>(0, n - 1));
      break;
    case 3: {  // a suffix (SnapKV window) plus a prefix (sinks)
      const i64 a = in.ConsumeIntegralInRange<i64>(0, n), b = in.ConsumeIntegralInRange<i64>(0, n);
      for (i64 j = 0; j < n; ++j)
        if (j < std::min(a, b) || j >= std::max(a, b)) kept.push_back(j);
      break;
    }
    default: {
      const std::uint32_t density = in.ConsumeIntegralInRange<std::uint32_t>(0, 255);
      const std::uint32_t seed = in.ConsumeIntegral<std::uint32_t>();
      for (i64 j = 0; j < n; ++j)
        if (((static_cast<std::uint32_t>(j) * 2654435761u) ^ seed) % 256 < density) kept.push_back(j);
    }
  }
  return kept;
}

struct host_keep {
  std::vector<i64> offsets{0}, indices;
  void add(const std::vector<i64>& head) {
    indices.insert(indices.end(), head.begin(), head.end());
    offsets.push_back(static_cast<i64>(indices.size()));
  }
  kvevict::const_keep_list_view view() const {
    return {static_cast<i64>(offsets.size()) - 1, offsets.data(), indices.empty() ? nullptr : indices.data(),
            static_cast<i64>(indices.size())};
  }
};

/// The buffer after compacting: row i of head h takes row keep[h][i]'s old contents.
template <class T, class Offset>
std::vector<T> gathered(const std::vector<T>& before, const host_keep& keep, i64 dim, Offset offset) {
  std::vector<T> out = before;
  for (std::size_t h = 0; h + 1 < keep.offsets.size(); ++h)
    for (i64 i = 0; i < keep.offsets[h + 1] - keep.offsets[h]; ++i)
      for (i64 c = 0; c < dim; ++c)
        out[static_cast<std::size_t>(offset(static_cast<i64>(h), i, c))] = before[static_cast<std::size_t>(
            offset(static_cast<i64>(h), keep.indices[static_cast<std::size_t>(keep.offsets[h] + i)], c))];
  return out;
}

template <class T>
bool same(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class KT, class VT>
void single(FuzzedDataProvider& in, const kvevict::executor& exec) {
  const i64 heads = in.ConsumeIntegralInRange<i64>(1, 4);
  const i64 l = in.ConsumeIntegralInRange<i64>(0, 64);
  const i64 dk = in.ConsumeIntegralInRange<i64>(1, 12),
            dv = in.ConsumeBool() ? dk : in.ConsumeIntegralInRange<i64>(1, 12);
  static const i64 blocks[] = {1, 2, 3, 8, 16};
  const i64 kb = in.PickValueInArray(blocks), vb = in.PickValueInArray(blocks);
  const test::layout kl = in.PickValueInArray(test::kAllLayouts), vl = in.PickValueInArray(test::kAllLayouts);
  const std::uint64_t seed = in.ConsumeIntegral<std::uint16_t>();
  auto k =
      test::make_cache<KT>(kl, heads, l, dk, test::normal(static_cast<std::size_t>(heads * l * dk), seed), kb, seed);
  auto v = test::make_cache<VT>(vl, heads, l, dv, test::normal(static_cast<std::size_t>(heads * l * dv), seed + 1), vb,
                                seed + 2);
  host_keep keep;
  for (i64 h = 0; h < heads; ++h) keep.add(fuzz_head(in, l));
  std::vector<i64> kpos;
  if (in.ConsumeBool())
    for (i64 j = 0; j < l; ++j) kpos.push_back(in.ConsumeIntegralInRange<i64>(-5, 1000));
  const std::vector<KT> kbefore = k.buffer;
  const std::vector<VT> vbefore = v.buffer;

  kvevict::eviction_result result;
  std::vector<i64> lengths(static_cast<std::size_t>(heads) + 1, -1), positions(keep.indices.size() + 1, -1);
  if (in.ConsumeBool()) result.head_lengths = lengths.data();
  if (in.ConsumeBool()) result.positions = positions.data();
  std::vector<unsigned char> ws(kvevict::evict_workspace_size(k.view, v.view, exec) + 3, 0x77);
  const kvevict::status st = kvevict::evict(k.view, v.view, keep.view(), result, {ws.data() + 3, ws.size() - 3},
                                            kpos.empty() ? nullptr : kpos.data(), exec);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  FUZZ_REQUIRE(same(k.buffer, gathered(kbefore, keep, dk, [&](i64 h, i64 j, i64 c) { return k.offset(h, j, c); })),
               "K compaction differs (%s, L=%lld)", test::name(kl).c_str(), static_cast<long long>(l));
  FUZZ_REQUIRE(same(v.buffer, gathered(vbefore, keep, dv, [&](i64 h, i64 j, i64 c) { return v.offset(h, j, c); })),
               "V compaction differs (%s, L=%lld)", test::name(vl).c_str(), static_cast<long long>(l));
  i64 longest = 0;
  for (i64 h = 0; h < heads; ++h) {
    const i64 n = keep.offsets[static_cast<std::size_t>(h + 1)] - keep.offsets[static_cast<std::size_t>(h)];
    longest = std::max(longest, n);
    if (result.head_lengths != nullptr) FUZZ_REQUIRE(lengths[static_cast<std::size_t>(h)] == n, "head length");
  }
  FUZZ_REQUIRE(lengths.back() == -1 && positions.back() == -1, "wrote past the result arrays");
  FUZZ_REQUIRE(result.max_length == longest, "max_length");
  if (result.positions != nullptr)
    for (std::size_t i = 0; i < keep.indices.size(); ++i)
      FUZZ_REQUIRE(positions[i] == (kpos.empty() ? keep.indices[i] : kpos[static_cast<std::size_t>(keep.indices[i])]),
                   "positions[%zu]", i);
  const auto freed = [&](const auto& view) {
    return view.is_paged()
               ? (l + view.block_size - 1) / view.block_size - (longest + view.block_size - 1) / view.block_size
               : 0;
  };
  FUZZ_REQUIRE(result.freed_blocks == (k.view.is_paged() ? freed(k.view) : freed(v.view)), "freed_blocks");

  // keep_list_positions: the same positions, without a cache.
  std::vector<i64> pos2(keep.indices.size() + 1, -1);
  FUZZ_REQUIRE(kvevict::keep_list_positions(keep.view(), l, kpos.empty() ? nullptr : kpos.data(), pos2.data()).ok(),
               "keep_list_positions");
  for (std::size_t i = 0; i < keep.indices.size(); ++i)
    FUZZ_REQUIRE(pos2[i] == (kpos.empty() ? keep.indices[i] : kpos[static_cast<std::size_t>(keep.indices[i])]),
                 "keep_list_positions[%zu]", i);

  // flatten_varlen out of place (from the compacted-before copy: rebuild K).
  auto src = test::make_cache<KT>(kl, heads, l, dk, test::normal(static_cast<std::size_t>(heads * l * dk), seed + 5),
                                  kb, seed + 6);
  const i64 stride = dk + in.ConsumeIntegralInRange<i64>(0, 3);
  const i64 total = static_cast<i64>(keep.indices.size());
  std::vector<KT> flat(static_cast<std::size_t>(total * stride + 1), test::sentinel<KT>());
  std::vector<i64> cu(static_cast<std::size_t>(heads + 1), -1);
  FUZZ_REQUIRE(kvevict::flatten_varlen(src.view, keep.view(), flat.data(), total, stride, cu.data(), exec).ok(),
               "flatten_varlen");
  std::vector<KT> want(flat.size(), test::sentinel<KT>());
  for (i64 h = 0; h < heads; ++h)
    for (i64 i = keep.offsets[static_cast<std::size_t>(h)]; i < keep.offsets[static_cast<std::size_t>(h + 1)]; ++i)
      for (i64 c = 0; c < dk; ++c)
        want[static_cast<std::size_t>(i * stride + c)] = src.at(h, keep.indices[static_cast<std::size_t>(i)], c);
  FUZZ_REQUIRE(same(flat, want), "flatten_varlen rows (%s)", test::name(kl).c_str());
  FUZZ_REQUIRE(cu == keep.offsets, "cu_lengths");
  // In place over an HF [Hkv, L, d] cache.
  if (kl == test::layout::contiguous || kl == test::layout::padded) {
    const std::vector<KT> before = src.buffer;
    const i64 ts = src.view.token_stride;
    FUZZ_REQUIRE(kvevict::flatten_varlen(src.view, keep.view(), src.buffer.data(), total, ts, nullptr).ok(),
                 "flatten_varlen in place");
    for (i64 h = 0; h < heads; ++h)
      for (i64 i = keep.offsets[static_cast<std::size_t>(h)]; i < keep.offsets[static_cast<std::size_t>(h + 1)]; ++i)
        for (i64 c = 0; c < dk; ++c) {
          const KT got = src.buffer[static_cast<std::size_t>(i * ts + c)];
          const KT exp = before[static_cast<std::size_t>(src.offset(h, keep.indices[static_cast<std::size_t>(i)], c))];
          FUZZ_REQUIRE(std::memcmp(&got, &exp, sizeof(KT)) == 0, "in-place flat row %lld", static_cast<long long>(i));
        }
  }
}

/// A ragged batch with explicit offsets: strided (HF padded), or paged with a 2-D table or a
/// CSR page list, NHD or HND pools; K and V with their own pools and tables.
template <class T>
void batch(FuzzedDataProvider& in, const kvevict::executor& exec) {
  const i64 seqs = in.ConsumeIntegralInRange<i64>(1, 4);
  const i64 heads = in.ConsumeIntegralInRange<i64>(1, 3);
  const i64 d = in.ConsumeIntegralInRange<i64>(1, 8);
  const i64 max_len = in.ConsumeIntegralInRange<i64>(0, 40);
  static const i64 blocks[] = {1, 2, 4, 8};
  const i64 bs = in.PickValueInArray(blocks);
  const int kind = in.ConsumeIntegralInRange<int>(0, 2);  // 0 strided, 1 2-D table, 2 CSR
  std::vector<i64> lens;
  for (i64 s = 0; s < seqs; ++s) lens.push_back(in.ConsumeIntegralInRange<i64>(0, max_len));
  const i64 maxb = (max_len + bs - 1) / bs;

  struct side {
    bool hnd = false;
    std::vector<T> buf;
    std::vector<std::int32_t> table, indptr;
    i64 pool = 0;
  } sides[2];
  kvevict::batch_cache_view<T> views[2];
  std::uint32_t mix = in.ConsumeIntegral<std::uint32_t>();
  for (int x = 0; x < 2; ++x) {
    side& sd = sides[x];
    sd.hnd = in.ConsumeBool();
    if (kind == 0) {
      sd.buf.resize(static_cast<std::size_t>(seqs * heads * std::max<i64>(max_len, 1) * d) + 1);
      views[x] = kvevict::hf_contiguous_batch(sd.buf.data(), seqs, heads, std::max<i64>(max_len, 1), d, lens.data());
    } else {
      i64 used_total = 0;
      for (i64 s = 0; s < seqs; ++s) used_total += (lens[static_cast<std::size_t>(s)] + bs - 1) / bs;
      sd.pool = used_total + in.ConsumeIntegralInRange<i64>(1, 3);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(sd.pool));
      std::iota(ids.begin(), ids.end(), 0);
      for (std::size_t i = ids.size(); i > 1; --i) {  // a fuzz-chosen permutation
        mix = mix * 1664525u + 1013904223u;
        std::swap(ids[i - 1], ids[mix % i]);
      }
      sd.buf.resize(static_cast<std::size_t>(sd.pool * bs * heads * d));
      std::size_t next = 0;
      if (kind == 1) {
        sd.table.assign(static_cast<std::size_t>(seqs * std::max<i64>(maxb, 1)), -1);
        for (i64 s = 0; s < seqs; ++s)
          for (i64 b = 0; b < (lens[static_cast<std::size_t>(s)] + bs - 1) / bs; ++b)
            sd.table[static_cast<std::size_t>(s * std::max<i64>(maxb, 1) + b)] = ids[next++];
      } else {
        sd.indptr.push_back(0);
        for (i64 s = 0; s < seqs; ++s) {
          for (i64 b = 0; b < (lens[static_cast<std::size_t>(s)] + bs - 1) / bs; ++b) sd.table.push_back(ids[next++]);
          sd.indptr.push_back(static_cast<std::int32_t>(sd.table.size()));
        }
        if (sd.table.empty()) sd.table.push_back(0);
      }
      const kvevict::cache_view<T> pool_layout =
          sd.hnd ? kvevict::paged_hnd(sd.buf.data(), sd.pool, bs, heads, d, nullptr, 0)
                 : kvevict::paged_nhd(sd.buf.data(), sd.pool, bs, heads, d, nullptr, 0);
      views[x] =
          kind == 1
              ? kvevict::vllm_paged_batch(pool_layout, seqs, sd.table.data(), std::max<i64>(maxb, 1), lens.data())
              : kvevict::flashinfer_paged_batch(pool_layout, seqs, sd.indptr.data(), sd.table.data(), lens.data());
    }
    const std::vector<double> vals = test::normal(sd.buf.size(), 40 + static_cast<std::uint64_t>(x) + mix % 1000);
    for (std::size_t i = 0; i < sd.buf.size(); ++i) sd.buf[i] = test::store<T>(vals[i]);
  }
  const auto offset = [&](int x, i64 s, i64 h, i64 j, i64 c) -> i64 {
    const side& sd = sides[x];
    if (kind == 0) return ((s * heads + h) * std::max<i64>(max_len, 1) + j) * d + c;
    const i64 row = kind == 1 ? s * std::max<i64>(maxb, 1) : sd.indptr[static_cast<std::size_t>(s)];
    const i64 blk = sd.table[static_cast<std::size_t>(row + j / bs)];
    return sd.hnd ? ((blk * heads + h) * bs + j % bs) * d + c : ((blk * bs + j % bs) * heads + h) * d + c;
  };
  std::vector<host_keep> keeps(static_cast<std::size_t>(seqs));
  std::vector<kvevict::const_keep_list_view> kviews;
  for (i64 s = 0; s < seqs; ++s) {
    for (i64 h = 0; h < heads; ++h)
      keeps[static_cast<std::size_t>(s)].add(fuzz_head(in, lens[static_cast<std::size_t>(s)]));
  }
  for (const host_keep& k : keeps) kviews.push_back(k.view());
  std::vector<std::vector<T>> want(2);
  for (int x = 0; x < 2; ++x) {
    want[static_cast<std::size_t>(x)] = sides[x].buf;
    for (i64 s = 0; s < seqs; ++s) {
      const host_keep& k = keeps[static_cast<std::size_t>(s)];
      for (i64 h = 0; h < heads; ++h)
        for (i64 i = 0; i < k.offsets[static_cast<std::size_t>(h + 1)] - k.offsets[static_cast<std::size_t>(h)]; ++i)
          for (i64 c = 0; c < d; ++c)
            want[static_cast<std::size_t>(x)][static_cast<std::size_t>(offset(x, s, h, i, c))] =
                sides[x].buf[static_cast<std::size_t>(offset(
                    x, s, h, k.indices[static_cast<std::size_t>(k.offsets[static_cast<std::size_t>(h)] + i)], c))];
    }
  }
  std::vector<kvevict::eviction_result> results(static_cast<std::size_t>(seqs));
  std::vector<unsigned char> ws(kvevict::evict_batch_workspace_size(views[0], views[1], exec) + 1);
  const kvevict::status st = kvevict::evict_batch(views[0], views[1], kviews.data(), results.data(),
                                                  {ws.data() + 1, ws.size() - 1}, nullptr, exec);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  FUZZ_REQUIRE(same(sides[0].buf, want[0]) && same(sides[1].buf, want[1]), "batch compaction differs (kind %d)", kind);
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  shuffled_executor shuffled{in.ConsumeIntegralInRange<int>(2, 4), in.ConsumeIntegral<std::uint8_t>()};
  const kvevict::executor exec = in.ConsumeBool() ? shuffled.get() : kvevict::executor{};
  const int kt = in.ConsumeIntegral<std::uint8_t>(), vt = in.ConsumeIntegral<std::uint8_t>();
  if (in.ConsumeBool()) {
    with_dtype(kt, [&](auto k) { with_dtype(vt, [&](auto v) { single<decltype(k), decltype(v)>(in, exec); }); });
  } else {
    with_dtype(kt, [&](auto k) { batch<decltype(k)>(in, exec); });
  }
  return 0;
}
