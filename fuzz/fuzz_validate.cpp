// Arbitrary bytes as view metadata and keep-lists, fed to the validators and to eviction,
// flatten_varlen, keep_list_positions, observation_scores and select. The harness models
// the caller's memory exactly: every buffer is allocated to precisely what its metadata
// claims (so ASan flags any access outside it), and a claim too large to back is either
// one the library must reject by its metadata alone (then it is made over a 16-element
// buffer) or the input is skipped. An independent validity predicate, written from the
// documented rules, says which inputs must be rejected. Checks:
//   * never a crash, an out-of-bounds access or undefined behaviour;
//   * every input the predicate calls invalid is rejected;
//   * a rejected call leaves every buffer bit for bit as it was;
//   * an accepted eviction equals the reference gather (explicit offsets) and an accepted
//     flatten_varlen equals the reference rows.
#include <string>

#include "common.hpp"

namespace {
using namespace fuzz;
__extension__ typedef __int128 i128;  // exact arithmetic on claims past 2^63
constexpr i64 kCap = i64{1} << 18;    // largest buffer (elements) the harness backs

/// A cache view's claims, kept separately from any library type.
struct meta {
  i64 heads = 1, tokens = 0, dim = 1, hs = 0, ts = 0, ds = 1;
  bool paged = false;
  i64 bs = 1, bstride = 0, pool = 1;
  std::vector<std::int32_t> table;
  bool null_data = false;

  i64 used_blocks() const { return paged && bs >= 1 && tokens >= 1 ? (tokens - 1) / bs + 1 : 0; }
  i128 offset(i64 h, i64 j, i64 c) const {
    if (paged)
      return static_cast<i128>(table[static_cast<std::size_t>(j / bs)]) * bstride + static_cast<i128>(j % bs) * ts +
             static_cast<i128>(h) * hs + static_cast<i128>(c) * ds;
    return static_cast<i128>(h) * hs + static_cast<i128>(j) * ts + static_cast<i128>(c) * ds;
  }
};

/// The metadata, for a finding's message.
std::string describe(const meta& m) {
  char buf[512];
  std::snprintf(
      buf, sizeof(buf),
      "[H %lld L %lld d %lld | strides %lld %lld %lld | paged %d bs %lld bstride %lld pool %lld | null %d | table",
      static_cast<long long>(m.heads), static_cast<long long>(m.tokens), static_cast<long long>(m.dim),
      static_cast<long long>(m.hs), static_cast<long long>(m.ts), static_cast<long long>(m.ds), m.paged ? 1 : 0,
      static_cast<long long>(m.bs), static_cast<long long>(m.bstride), static_cast<long long>(m.pool),
      m.null_data ? 1 : 0);
  std::string s = buf;
  for (std::size_t i = 0; i < m.table.size() && i < 16; ++i) s += " " + std::to_string(m.table[i]);
  return s + "]";
}

/// The documented overlap rule: sorted by stride, every stride of a dim with extent > 1
/// exceeds the largest offset of the smaller dims; the span fits in int64.
bool box_ok(std::vector<std::pair<i64, i64>> dims, i128* span) {
  std::stable_sort(dims.begin(), dims.end(), [](const auto& a, const auto& b) { return a.second < b.second; });
  i128 reach = 0;
  for (const auto& [extent, stride] : dims) {
    if (extent <= 1) continue;
    if (static_cast<i128>(stride) <= reach) return false;
    reach += static_cast<i128>(extent - 1) * stride;
    if (reach >= std::numeric_limits<i64>::max()) return false;  // the span, reach + 1, is an int64
  }
  *span = reach + 1;
  return true;
}

/// Whether the library must accept the view (given the memory it claims exists), and the
/// elements it claims (from its base pointer).
bool view_valid(const meta& m, i128* extent) {
  *extent = 0;
  if (m.heads < 1 || m.dim < 1 || m.tokens < 0) return false;
  if (m.hs < 0 || m.ts < 0 || m.ds < 0) return false;
  if (m.null_data) return false;
  if (m.tokens == 0) return true;
  if (!m.paged) return box_ok({{m.heads, m.hs}, {m.tokens, m.ts}, {m.dim, m.ds}}, extent);
  if (m.bs < 1 || m.pool < 1 || m.bstride < 0) return false;
  i128 block = 0;
  if (!box_ok({{m.heads, m.hs}, {std::min(m.bs, m.tokens), m.ts}, {m.dim, m.ds}}, &block)) return false;
  i128 pool_span = static_cast<i128>(m.pool - 1) * m.bstride + block;
  // Interleaved pools (llama.cpp's transposed V paged by cells) are valid when no two
  // (block, head, token, channel) tuples meet: the pool as a fourth strided dimension.
  if (m.pool > 1 && m.bstride < block &&
      !box_ok({{m.heads, m.hs}, {std::min(m.bs, m.tokens), m.ts}, {m.dim, m.ds}, {m.pool, m.bstride}}, &pool_span))
    return false;
  if (pool_span > std::numeric_limits<i64>::max()) return false;
  for (i64 b = 0; b < m.used_blocks(); ++b) {
    const std::int32_t id = m.table[static_cast<std::size_t>(b)];
    if (id < 0 || id >= m.pool) return false;
  }
  *extent = pool_span;
  return true;
}

/// A sane view of one of the test layouts, then a few fuzz-chosen field mutations.
meta fuzz_meta(FuzzedDataProvider& in, const meta* like) {
  meta m;
  m.heads = like ? like->heads : in.ConsumeIntegralInRange<i64>(1, 3);
  m.tokens = like ? like->tokens : in.ConsumeIntegralInRange<i64>(0, 24);
  m.dim = in.ConsumeIntegralInRange<i64>(1, 6);
  const int kind = in.ConsumeIntegralInRange<int>(0, 5);
  // Strides come from a sane shape even when `like` was mutated to extremes (its heads and
  // tokens are kept: V must match K's, and the library must then reject or cope).
  const i64 sh = std::clamp<i64>(m.heads, 1, 3), st = std::clamp<i64>(m.tokens, 0, 24);
  const i64 cap_tokens = std::max<i64>(st, 1) + in.ConsumeIntegralInRange<i64>(0, 3);
  switch (kind) {
    case 0:  // [Hkv, L, d]
      m.hs = cap_tokens * m.dim, m.ts = m.dim, m.ds = 1;
      break;
    case 1:  // token-major [L, Hkv, d]
      m.hs = m.dim, m.ts = sh * m.dim, m.ds = 1;
      break;
    case 2:  // transposed V: (cell j, channel h*d + c) at (h*d + c)*kv_size + j
      m.hs = m.dim * cap_tokens, m.ts = 1, m.ds = cap_tokens;
      break;
    default: {  // paged NHD (3) / HND (4, 5)
      m.paged = true;
      m.bs = in.ConsumeIntegralInRange<i64>(1, 8);
      if (kind == 3) {
        m.hs = m.dim, m.ts = sh * m.dim, m.ds = 1;
      } else {
        m.hs = m.bs * m.dim, m.ts = m.dim, m.ds = 1;
      }
      m.bstride = m.bs * sh * m.dim;
      const i64 used = (st + m.bs - 1) / m.bs;  // the table is built for the sane length
      m.pool = used + in.ConsumeIntegralInRange<i64>(1, 3);
      std::vector<std::int32_t> ids(static_cast<std::size_t>(m.pool));
      std::iota(ids.begin(), ids.end(), 0);
      std::uint32_t mix = in.ConsumeIntegral<std::uint32_t>();
      for (std::size_t i = ids.size(); i > 1; --i) {
        mix = mix * 1664525u + 1013904223u;
        std::swap(ids[i - 1], ids[mix % i]);
      }
      m.table.assign(ids.begin(), ids.begin() + used);
    }
  }
  const int mutations = in.ConsumeIntegralInRange<int>(0, 3);
  for (int k = 0; k < mutations; ++k) {
    const int field = in.ConsumeIntegralInRange<int>(0, 11);
    const int how = in.ConsumeIntegralInRange<int>(0, 2);
    const auto value = [&](i64 old) -> i64 {
      if (how == 0) return interesting(in);
      i64 moved = 0;
      if (how == 1) return __builtin_add_overflow(old, in.ConsumeIntegralInRange<i64>(-2, 2), &moved) ? old : moved;
      return in.ConsumeIntegralInRange<i64>(-3, 40);
    };
    switch (field) {
      case 0:
        m.heads = value(m.heads);
        break;
      case 1:
        m.tokens = value(m.tokens);
        break;
      case 2:
        m.dim = value(m.dim);
        break;
      case 3:
        m.hs = value(m.hs);
        break;
      case 4:
        m.ts = value(m.ts);
        break;
      case 5:
        m.ds = value(m.ds);
        break;
      case 6:
        m.bs = value(m.bs);
        break;
      case 7:
        m.bstride = value(m.bstride);
        break;
      case 8:
        m.pool = value(m.pool);
        break;
      case 9:
        if (!m.table.empty())
          m.table[in.ConsumeIntegralInRange<std::size_t>(0, m.table.size() - 1)] =
              // (pool may already be mutated to a negative count: keep the range non-empty)
              static_cast<std::int32_t>(
                  in.ConsumeIntegralInRange<i64>(-2, std::max<i64>(0, std::min<i64>(m.pool, 1 << 30)) + 2));
        break;
      case 10:
        m.null_data = true;
        break;
      default:
        m.paged = !m.paged && m.bs >= 1;
    }
  }
  return m;
}

/// A keep-list's claims: num_heads, offsets (num_heads + 1 of them), indices, capacity.
struct keep_meta {
  i64 heads = 0, capacity = 0;
  std::vector<i64> offsets, indices;
  bool null_offsets = false, null_indices = false;
};

keep_meta fuzz_keep(FuzzedDataProvider& in, i64 heads, i64 tokens) {
  keep_meta k;
  k.heads = heads;
  k.offsets.push_back(0);
  const i64 t = std::min<i64>(std::max<i64>(tokens, 0), 64);
  for (i64 h = 0; h < std::min<i64>(heads, 64); ++h) {
    for (i64 j = 0; j < t; ++j)
      if (in.ConsumeIntegralInRange<int>(0, 3) == 0) k.indices.push_back(j);
    k.offsets.push_back(static_cast<i64>(k.indices.size()));
  }
  k.capacity = static_cast<i64>(k.indices.size());
  const int mutations = in.ConsumeIntegralInRange<int>(0, 2);
  for (int m = 0; m < mutations; ++m) {
    switch (in.ConsumeIntegralInRange<int>(0, 7)) {
      case 0:
        k.heads = in.ConsumeBool() ? interesting(in) : nudge(k.heads, in.ConsumeIntegralInRange<i64>(-1, 1));
        break;
      case 1:
        if (!k.offsets.empty()) {
          i64& o = k.offsets[in.ConsumeIntegralInRange<std::size_t>(0, k.offsets.size() - 1)];
          o = nudge(o, in.ConsumeIntegralInRange<i64>(-2, 2));
        }
        break;
      case 2:
        if (!k.indices.empty())
          k.indices[in.ConsumeIntegralInRange<std::size_t>(0, k.indices.size() - 1)] =
              in.ConsumeBool() ? interesting(in) : in.ConsumeIntegralInRange<i64>(-2, t + 2);
        break;
      case 3:
        k.capacity = in.ConsumeBool() ? interesting(in) : nudge(k.capacity, in.ConsumeIntegralInRange<i64>(-2, 2));
        break;
      case 4:
        k.null_offsets = true;
        break;
      case 5:
        k.null_indices = true;
        break;
      case 6:
        if (k.indices.size() >= 2) {  // a duplicate
          const std::size_t i = in.ConsumeIntegralInRange<std::size_t>(1, k.indices.size() - 1);
          k.indices[i] = k.indices[i - 1];
        }
        break;
      default:
        if (k.indices.size() >= 2) std::swap(k.indices[0], k.indices[1]);  // unsorted
    }
  }
  return k;
}

/// Whether validate_keep_list must accept it for `heads` x `tokens`.
bool keep_valid(const keep_meta& k, i64 heads, i64 tokens) {
  if (k.heads != heads || k.null_offsets || k.offsets.empty() || k.offsets[0] != 0) return false;
  if (static_cast<i64>(k.offsets.size()) - 1 < heads) return false;
  for (i64 h = 0; h < heads; ++h) {
    const i64 b = k.offsets[static_cast<std::size_t>(h)], e = k.offsets[static_cast<std::size_t>(h + 1)];
    if (e < b || e > k.capacity) return false;
    if (e > b && k.null_indices) return false;
    if (e > static_cast<i64>(k.indices.size())) return false;  // (the harness never claims more)
    i64 prev = -1;
    for (i64 i = b; i < e; ++i) {
      const i64 j = k.indices[static_cast<std::size_t>(i)];
      if (j < 0 || j >= tokens || j <= prev) return false;
      prev = j;
    }
  }
  return true;
}

/// Whether the library might read past the keep-list arrays the harness allocated: it
/// reads offsets[0..heads] once num_heads matches, and indices up to the offsets (bounded by
/// capacity). Such inputs break the caller's side of the contract and are skipped.
bool keep_backed(const keep_meta& k, i64 heads) {
  if (k.heads != heads || k.null_offsets) return true;  // rejected before reading
  if (heads < 0 || static_cast<i64>(k.offsets.size()) - 1 < heads) return false;
  if (k.offsets[0] != 0) return true;  // rejected before reading more
  const i64 have = k.null_indices ? 0 : static_cast<i64>(k.indices.size());
  for (i64 h = 0; h < heads; ++h) {
    const i64 b = k.offsets[static_cast<std::size_t>(h)], e = k.offsets[static_cast<std::size_t>(h + 1)];
    if (e < b || e > k.capacity) return true;  // rejected before head h's indices are read
    if (e > b && k.null_indices) return true;  // rejected: null indices
    if (e > have) return false;                // would read past the indices the caller has
  }
  return true;
}

template <class T>
struct backed_view {
  std::vector<T> buf;  // exactly the claimed extent (or 16 elements for a view that must fail)
  kvevict::cache_view<T> view;
};

template <class T>
kvevict::cache_view<T> make_view(const meta& m, T* data) {
  kvevict::cache_view<T> v;
  v.data = m.null_data ? nullptr : data;
  v.num_heads = m.heads;
  v.num_tokens = m.tokens;
  v.head_dim = m.dim;
  v.head_stride = m.hs;
  v.token_stride = m.ts;
  v.dim_stride = m.ds;
  if (m.paged) {
    v.block_table = m.table.data();
    v.block_size = m.bs;
    v.block_stride = m.bstride;
    v.num_pool_blocks = m.pool;
  }
  return v;
}

template <class T>
void fill(std::vector<T>& v, std::uint32_t seed) {
  for (std::size_t i = 0; i < v.size(); ++i)
    v[i] = test::store<T>(static_cast<double>((i * 2654435761u + seed) % 1000) / 8.0);
}

template <class T>
void run(FuzzedDataProvider& in) {
  meta km = fuzz_meta(in, nullptr);
  const int vmode = in.ConsumeIntegralInRange<int>(0, 5);
  meta vm = fuzz_meta(in, &km);                                 // same heads and tokens before mutation
  const bool shared_pool = vmode == 0 && km.paged && vm.paged;  // TensorRT-LLM: one pool, two tables
  const bool aliased = vmode == 1;                              // V's base pointer is K's
  if (aliased) vm = km;
  // Block tables must hold the used blocks the metadata claims (the caller's promise).
  for (meta* m : {&km, &vm}) {
    if (!m->paged) continue;
    const i64 used = m->used_blocks();
    if (used > 4096) return;
    while (static_cast<i64>(m->table.size()) < used) m->table.push_back(static_cast<std::int32_t>(m->table.size()));
    if (m->table.empty()) m->table.push_back(0);  // a paged view's table pointer is never null
  }
  if (aliased) vm = km;
  keep_meta keep = fuzz_keep(in, km.heads, km.tokens);
  if (!keep_backed(keep, km.heads)) return;

  // Memory: the claimed extent when the view is valid and small enough, else 16 elements
  // (then the library must reject by metadata alone: checked below).
  i128 kext = 0, vext = 0;
  const bool kvalid = view_valid(km, &kext), vvalid = view_valid(vm, &vext);
  // Eviction touches rows up to the largest kept index only; size a valid view's buffer to
  // what it may touch when its full extent is too large to back.
  if ((kvalid && kext > kCap) || (vvalid && vext > kCap)) return;
  std::vector<T> kbuf(static_cast<std::size_t>(kvalid ? std::max<i128>(kext, 1) : 16));
  std::vector<T> vbuf_own(static_cast<std::size_t>(vvalid ? std::max<i128>(vext, 1) : 16));
  if (shared_pool) kbuf.resize(std::max(kbuf.size(), vbuf_own.size()));
  fill(kbuf, 1);
  fill(vbuf_own, 2);
  T* vdata = (aliased || shared_pool) ? kbuf.data() : vbuf_own.data();
  const kvevict::cache_view<T> kv = make_view(km, kbuf.data());
  const kvevict::cache_view<T> vv = make_view(vm, vdata);
  const kvevict::const_keep_list_view kl{keep.heads, keep.null_offsets ? nullptr : keep.offsets.data(),
                                         keep.null_indices || keep.indices.empty() ? nullptr : keep.indices.data(),
                                         keep.capacity};
  std::uint64_t before = fnv(fnv(fnv(fnv(fnv(fnv_seed, kbuf), vbuf_own), keep.offsets), keep.indices), km.table);
  before = fnv(before, vm.table);
  const auto unchanged = [&] {
    return fnv(fnv(fnv(fnv(fnv(fnv(fnv_seed, kbuf), vbuf_own), keep.offsets), keep.indices), km.table), vm.table) ==
           before;
  };

  // ---- evict ----
  {
    bool must_reject =
        !kvalid || !vvalid || vm.heads != km.heads || vm.tokens != km.tokens || !keep_valid(keep, km.heads, km.tokens);
    if (!km.paged && !vm.paged && km.tokens > 0 && static_cast<void*>(kbuf.data()) == static_cast<void*>(vdata))
      must_reject = true;
    // Repeated physical blocks (within a table, or shared by K and V of one pool).
    if (!must_reject) {
      std::vector<std::int32_t> kids(km.table.begin(), km.table.begin() + km.used_blocks());
      std::vector<std::int32_t> vids(vm.table.begin(), vm.table.begin() + vm.used_blocks());
      std::sort(kids.begin(), kids.end());
      std::sort(vids.begin(), vids.end());
      // (The harness never hands K and V the same table pointer, so V's ids are always checked.)
      if (std::adjacent_find(kids.begin(), kids.end()) != kids.end()) must_reject = true;
      if (std::adjacent_find(vids.begin(), vids.end()) != vids.end()) must_reject = true;
      if (km.paged && vm.paged && (aliased || shared_pool) && km.bstride == vm.bstride) {
        std::vector<std::int32_t> common;
        std::set_intersection(kids.begin(), kids.end(), vids.begin(), vids.end(), std::back_inserter(common));
        if (!common.empty()) must_reject = true;
      }
      // K and V over one buffer other than these cases overlap only if their claims do;
      // the harness never makes such a call (the caller's promise).
      if (!must_reject && (aliased || shared_pool) && !(km.paged && vm.paged && km.bstride == vm.bstride)) return;
    }
    // Expected result (on copies) when it must succeed.
    std::vector<T> kwant = kbuf, vwant = vbuf_own;
    if (!must_reject) {
      std::vector<T>& vtarget = (aliased || shared_pool) ? kwant : vwant;
      const std::vector<T> kold = kbuf, vold = (aliased || shared_pool) ? kbuf : vbuf_own;
      for (i64 h = 0; h < km.heads; ++h)
        for (i64 i = 0; i < keep.offsets[static_cast<std::size_t>(h + 1)] - keep.offsets[static_cast<std::size_t>(h)];
             ++i) {
          const i64 j = keep.indices[static_cast<std::size_t>(keep.offsets[static_cast<std::size_t>(h)] + i)];
          for (i64 c = 0; c < km.dim; ++c)
            kwant[static_cast<std::size_t>(km.offset(h, i, c))] = kold[static_cast<std::size_t>(km.offset(h, j, c))];
          for (i64 c = 0; c < vm.dim; ++c)
            vtarget[static_cast<std::size_t>(vm.offset(h, i, c))] = vold[static_cast<std::size_t>(vm.offset(h, j, c))];
        }
    }
    kvevict::eviction_result result;
    std::vector<unsigned char> ws(std::min<std::size_t>(kvevict::evict_workspace_size(kv, vv), 1 << 20));
    const kvevict::status st = kvevict::evict(kv, vv, kl, result, {ws.data(), ws.size()});
    if (must_reject) {
      FUZZ_REQUIRE(!st.ok(),
                   "evict accepted an input that breaks the documented rules: K %s V %s (valid %d %d, aliased %d, "
                   "shared pool %d), keep valid %d",
                   describe(km).c_str(), describe(vm).c_str(), kvalid, vvalid, aliased, shared_pool,
                   keep_valid(keep, km.heads, km.tokens));
    } else {
      FUZZ_REQUIRE(st.ok(), "evict rejected a valid input: %s; K %s V %s", st.message(), describe(km).c_str(),
                   describe(vm).c_str());
    }
    if (!st.ok()) {
      FUZZ_REQUIRE(st.argument()[0] != '\0' && std::strncmp(st.message(), "kvevict::evict", 14) == 0, "error text");
      FUZZ_REQUIRE(unchanged(), "a failed evict changed memory (%s)", st.message());
    } else {
      const bool k_ok = std::memcmp(kbuf.data(), kwant.data(), kbuf.size() * sizeof(T)) == 0;
      const bool v_ok = std::memcmp(vbuf_own.data(), vwant.data(), vbuf_own.size() * sizeof(T)) == 0;
      FUZZ_REQUIRE(k_ok && v_ok, "evict result differs from the reference gather");
      fill(kbuf, 1);
      fill(vbuf_own, 2);
    }
  }

  // ---- keep_list_positions ----
  {
    const i64 tokens = in.ConsumeBool() ? km.tokens : interesting(in);
    std::vector<i64> out(keep.indices.size() + 1, -4);
    const bool must_reject = tokens < 0 || keep.heads < 1 || !keep_valid(keep, keep.heads, tokens);
    const bool backed = keep_backed(keep, keep.heads);
    if (backed) {
      const kvevict::status st = kvevict::keep_list_positions(kl, tokens, nullptr, out.data());
      if (must_reject) FUZZ_REQUIRE(!st.ok(), "keep_list_positions accepted an invalid keep-list");
      if (!st.ok()) FUZZ_REQUIRE(out.back() == -4 && out.front() == -4, "failed call wrote positions");
    }
  }

  // ---- flatten_varlen ----
  {
    i64 rows = std::max<i64>(static_cast<i64>(keep.indices.size()), 0);
    i64 stride = std::max<i64>(km.dim, 1);
    if (in.ConsumeBool())
      rows = in.ConsumeBool() ? interesting(in) : nudge(rows, in.ConsumeIntegralInRange<i64>(-2, 2));
    if (in.ConsumeBool())
      stride = in.ConsumeBool() ? interesting(in) : nudge(stride, in.ConsumeIntegralInRange<i64>(-2, 2));
    const i64 total = keep_valid(keep, km.heads, km.tokens) ? keep.offsets[static_cast<std::size_t>(km.heads)] : 0;
    const i128 need =
        total > 0 ? static_cast<i128>(total - 1) * std::max<i64>(stride, 0) + std::max<i64>(km.dim, 0) : 0;
    // A dst no address space can hold must be rejected (errc::overflow) whatever memory is
    // behind it; other dst claims past kCap cannot be backed by the harness.
    const bool dst_impossible = need > static_cast<i128>(PTRDIFF_MAX / sizeof(T));
    if (need > kCap && !dst_impossible) return;  // the caller's dst would have to be this large
    std::vector<T> dst(static_cast<std::size_t>(dst_impossible ? 1 : std::max<i128>(need, 1)));
    fill(dst, 3);
    const std::uint64_t dst_before = fnv(fnv_seed, dst);
    const bool must_reject =
        !kvalid || !keep_valid(keep, km.heads, km.tokens) || rows < total || stride < km.dim || dst_impossible;
    const kvevict::status st = kvevict::flatten_varlen(kv, kl, dst.data(), rows, stride);
    if (must_reject) FUZZ_REQUIRE(!st.ok(), "flatten_varlen accepted an invalid input");
    if (!must_reject) FUZZ_REQUIRE(st.ok(), "flatten_varlen rejected a valid input: %s", st.message());
    if (!st.ok()) {
      FUZZ_REQUIRE(fnv(fnv_seed, dst) == dst_before && unchanged(), "a failed flatten_varlen changed memory");
    } else {
      for (i64 h = 0; h < km.heads; ++h)
        for (i64 i = keep.offsets[static_cast<std::size_t>(h)]; i < keep.offsets[static_cast<std::size_t>(h + 1)]; ++i)
          for (i64 c = 0; c < km.dim; ++c) {
            const T got = dst[static_cast<std::size_t>(i * stride + c)];
            const T want = kbuf[static_cast<std::size_t>(km.offset(h, keep.indices[static_cast<std::size_t>(i)], c))];
            FUZZ_REQUIRE(std::memcmp(&got, &want, sizeof(T)) == 0, "flatten_varlen row %lld",
                         static_cast<long long>(i));
          }
    }
  }

  // ---- observation_scores over the fuzzed keys, with fuzzed queries and scores views ----
  {
    meta qm;
    if (__builtin_mul_overflow(km.heads, in.ConsumeIntegralInRange<i64>(1, 3), &qm.heads)) return;
    qm.tokens = in.ConsumeIntegralInRange<i64>(1, 6);  // W
    qm.dim = km.dim;
    const bool tm = in.ConsumeBool();
    const i64 sh = std::clamp<i64>(qm.heads, 1, 64), sd = std::clamp<i64>(qm.dim, 1, 4096);  // sane strides
    qm.hs = tm ? sd : qm.tokens * sd;
    qm.ts = tm ? sh * sd : sd;
    qm.ds = 1;
    if (in.ConsumeBool()) {
      switch (in.ConsumeIntegralInRange<int>(0, 5)) {
        case 0:
          qm.heads = interesting(in);
          break;
        case 1:
          qm.tokens = in.ConsumeIntegralInRange<i64>(-1, 8);
          break;
        case 2:
          qm.dim = in.ConsumeIntegralInRange<i64>(-1, 8);
          break;
        case 3:
          qm.hs = interesting(in);
          break;
        case 4:
          qm.ts = in.ConsumeIntegralInRange<i64>(-1, 8);
          break;
        default:
          qm.null_data = true;
      }
    }
    if (qm.tokens > 64) return;
    std::vector<i64> qpos(static_cast<std::size_t>(std::max<i64>(qm.tokens, 1)));
    for (i64& p : qpos) p = in.ConsumeIntegralInRange<i64>(-1, std::min<i64>(std::max<i64>(km.tokens, 0), 1 << 30) + 2);
    i128 qext = 0;
    bool qvalid = qm.heads >= 1 && qm.tokens >= 1 && qm.dim >= 1 && qm.hs >= 0 && qm.ts >= 0 && !qm.null_data &&
                  box_ok({{qm.heads, qm.hs}, {qm.tokens, qm.ts}, {qm.dim, qm.ds}}, &qext);
    for (i64 p : qpos) qvalid = qvalid && p >= 0;
    if (qvalid && qext > kCap) return;
    std::vector<T> qbuf(static_cast<std::size_t>(qvalid ? qext : 16));
    fill(qbuf, 4);
    kvevict::query_view<const T> qv;
    qv.data = qm.null_data ? nullptr : qbuf.data();
    qv.num_heads = qm.heads;
    qv.num_queries = qm.tokens;
    qv.head_dim = qm.dim;
    qv.head_stride = qm.hs;
    qv.query_stride = qm.ts;
    qv.dim_stride = qm.ds;
    qv.positions = qpos.data();
    i64 rows = km.heads, cols = km.tokens, rstride = std::max<i64>(km.tokens, 0);
    if (in.ConsumeBool()) {
      rows = in.ConsumeBool() ? nudge(rows, in.ConsumeIntegralInRange<i64>(-1, 1)) : rows;
      cols = in.ConsumeBool() ? interesting(in) : cols;
      rstride = in.ConsumeBool() ? interesting(in) : rstride;
    }
    const bool shape_ok = rows == km.heads && cols == km.tokens && (rows <= 1 || rstride >= cols);
    const i128 sneed = shape_ok && rows > 0 && cols > 0 ? static_cast<i128>(rows - 1) * rstride + cols : 0;
    if (sneed > kCap) return;
    std::vector<float> sbuf(static_cast<std::size_t>(std::max<i128>(sneed, 1)), 1.5f);
    const kvevict::scoring_params sp = kvevict::presets::adakv().params();
    const kvevict::layer_shape shape{std::max<i64>(qm.heads, 1), std::max<i64>(km.heads, 1), std::max<i64>(km.dim, 1),
                                     std::max<i64>(km.tokens, 0), std::max<i64>(qm.tokens, 1)};
    std::vector<unsigned char> ws(
        std::min<std::size_t>(kvevict::observation_scores_workspace_size(shape, sp), 1 << 22));
    const bool must_reject =
        !qvalid || !kvalid || qm.dim != km.dim || km.heads < 1 || qm.heads % km.heads != 0 || !shape_ok;
    const std::uint64_t sbefore = fnv(fnv_seed, sbuf);
    const kvevict::status st = kvevict::observation_scores(qv, kvevict::cache_view<const T>(kv), sp,
                                                           {sbuf.data(), rows, cols, rstride}, {ws.data(), ws.size()});
    if (must_reject) FUZZ_REQUIRE(!st.ok(), "observation_scores accepted an invalid input");
    if (!st.ok()) FUZZ_REQUIRE(fnv(fnv_seed, sbuf) == sbefore && unchanged(), "a failed observation_scores wrote");
  }

  // ---- select over a fuzzed scores view into a fuzzed keep-list ----
  {
    i64 rows = in.ConsumeIntegralInRange<i64>(-1, 4), cols = in.ConsumeIntegralInRange<i64>(-1, 40);
    i64 rstride = cols;
    if (in.ConsumeBool()) cols = interesting(in);
    if (in.ConsumeBool()) rstride = interesting(in);
    const i128 sneed = rows > 0 && cols > 0 ? static_cast<i128>(rows - 1) * std::max<i64>(rstride, 0) + cols : 0;
    const bool shape_ok = rows >= 1 && cols >= 0 && (rows <= 1 || rstride >= cols) && cols < (i64{1} << 32);
    std::vector<float> sbuf(static_cast<std::size_t>(shape_ok && sneed <= kCap ? std::max<i128>(sneed, 1) : 16));
    for (std::size_t i = 0; i < sbuf.size(); ++i) sbuf[i] = static_cast<float>((i * 7919) % 13);
    const i64 budget = in.ConsumeBool() ? interesting(in) : in.ConsumeIntegralInRange<i64>(0, 50);
    const kvevict::selection_params sp{in.ConsumeBool() ? in.ConsumeIntegralInRange<i64>(-1, 8) : interesting(in),
                                       static_cast<kvevict::protected_mode>(in.ConsumeIntegralInRange<int>(0, 2))};
    i64 out_heads = rows, capacity = in.ConsumeIntegralInRange<i64>(-1, 300);
    if (in.ConsumeBool()) out_heads = interesting(in);
    if (out_heads == rows && (rows > 64 || rows < 0)) return;  // offsets[] could not be backed
    // (A mismatched out.num_heads is rejected before offsets[] is touched: back 65 at most.)
    std::vector<i64> offsets(static_cast<std::size_t>(std::clamp<i64>(out_heads, 0, 64) + 1), -9);
    std::vector<i64> indices(static_cast<std::size_t>(std::max<i64>(std::min<i64>(capacity, 300), 1)), -9);
    const bool params_ok = budget >= 0 && sp.protected_tail >= 0 && static_cast<int>(sp.mode) <= 1;
    i128 total = 0;
    if (shape_ok && params_ok)
      for (i64 h = 0; h < rows; ++h) total += kvevict::tokens_kept(budget, cols, sp);
    const bool must_reject = !shape_ok || !params_ok || out_heads != rows || total > capacity;
    // An accepted call reads the whole scores claim: only backed claims may be accepted.
    const bool backed = shape_ok && sneed <= kCap;
    // (Rows of 2^32 tokens or more are rejected before the workspace is looked at; the size
    // query itself is not asked about them: see the size-query bug in docs/reliability.md.)
    const std::size_t wneed = cols < (i64{1} << 32) ? kvevict::select_workspace_size(std::max<i64>(cols, 0)) : 0;
    std::vector<unsigned char> ws(backed ? wneed : std::min<std::size_t>(wneed, 4096));
    if (!backed && !must_reject && ws.size() >= wneed) return;  // would be accepted over memory it does not have
    const std::uint64_t obefore = fnv(fnv(fnv_seed, offsets), indices);
    const kvevict::status st =
        kvevict::select(kvevict::const_score_view{sbuf.data(), rows, cols, rstride}, kvevict::budget::tokens(budget),
                        sp, {out_heads, offsets.data(), indices.data(), capacity}, {ws.data(), ws.size()});
    if (must_reject || !backed) FUZZ_REQUIRE(!st.ok(), "select accepted an invalid or unbacked input");
    if (!must_reject && backed) FUZZ_REQUIRE(st.ok(), "select rejected a valid input: %s", st.message());
    if (!st.ok()) FUZZ_REQUIRE(fnv(fnv(fnv_seed, offsets), indices) == obefore, "a failed select wrote its keep-list");
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  if (in.ConsumeBool()) {
    run<float>(in);
  } else {
    run<kvevict::bf16>(in);
  }
  return 0;
}
