// Differential fuzzing of selection and the budget allocators over arbitrary score rows:
// NaN (quiet, signalling, negative), +-inf, +-0, subnormals, long runs of exact ties, rows
// shorter and longer than the sampling threshold (4096), uniform, ratio and per-head
// budgets, either protected mode, a permuting executor. Checks:
//   * select equals the reference top-B (NaN last, ties to the smaller index, ascending)
//     for every head, and the per-head overload agrees with the uniform one;
//   * adakv_head_budgets: deterministic, each head in [0, C], the sum within Hkv of Hkv*B;
//   * pyramidkv_layer_budgets: each layer in [0, L - w], the mean exactly C - w when the
//     schedule is feasible.
#include "common.hpp"

namespace {
using namespace fuzz;

float row_value(FuzzedDataProvider& in, int palette, i64 j, std::uint32_t mix) {
  switch (palette) {
    case 0:  // few distinct values: ties everywhere
      return static_cast<float>((j * 2654435761u + mix) % 5);
    case 1:  // specials
      return fuzz_float(in, true);
    case 2: {  // raw bits, any float including NaN payloads
      std::uint32_t bits = static_cast<std::uint32_t>(j) * 2246822519u ^ mix;
      bits ^= bits >> 13;
      bits *= 3266489917u;
      float f;
      std::memcpy(&f, &bits, 4);
      return f;
    }
    default:  // sorted descending or ascending runs
      return static_cast<float>((mix & 1) ? j / 3 : -(j / 3));
  }
}
}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  FuzzedDataProvider in(data, size);
  const i64 heads0 = in.ConsumeIntegralInRange<i64>(1, 6);
  const int length_class = in.ConsumeIntegralInRange<int>(0, 9);
  const i64 n = length_class < 7 ? in.ConsumeIntegralInRange<i64>(0, 64)
                                 : (length_class < 9 ? in.ConsumeIntegralInRange<i64>(4000, 4200)
                                                     : in.ConsumeIntegralInRange<i64>(0, 9000));
  const i64 heads = n > 64 ? std::min<i64>(heads0, 2) : heads0;  // long rows: fewer heads, more runs
  std::vector<float> scores(static_cast<std::size_t>(heads * n));
  for (i64 h = 0; h < heads; ++h) {
    const int palette = in.ConsumeIntegralInRange<int>(0, 3);
    const std::uint32_t mix = in.ConsumeIntegral<std::uint32_t>();
    for (i64 j = 0; j < n; ++j) scores[static_cast<std::size_t>(h * n + j)] = row_value(in, palette, j, mix);
    const int pokes = in.ConsumeIntegralInRange<int>(0, 6);
    for (int k = 0; k < pokes && n > 0; ++k)
      scores[static_cast<std::size_t>(h * n + in.ConsumeIntegralInRange<i64>(0, n - 1))] = fuzz_float(in, true);
  }
  const kvevict::selection_params sp{
      in.ConsumeIntegralInRange<i64>(0, n + 2),
      in.ConsumeBool() ? kvevict::protected_mode::inside_budget : kvevict::protected_mode::on_top_of_budget};
  const bool inside = sp.mode == kvevict::protected_mode::inside_budget;
  const bool ratio = in.ConsumeBool();
  const kvevict::budget b = ratio ? kvevict::budget::ratio(in.ConsumeIntegralInRange<int>(0, 100) / 100.0)
                                  : kvevict::budget::tokens(in.ConsumeIntegralInRange<i64>(0, n + 3));
  const i64 per_head = b.resolve(n);
  shuffled_executor shuffled{in.ConsumeIntegralInRange<int>(2, 5), in.ConsumeIntegral<std::uint8_t>()};
  const kvevict::executor exec = in.ConsumeBool() ? shuffled.get() : kvevict::executor{};
  const kvevict::const_score_view view{scores.data(), heads, n, n};

  std::vector<unsigned char> ws(kvevict::select_workspace_size(n, exec), 0xee);
  kvevict::keep_list keep(heads, kvevict::select_capacity(heads, n, b, sp));
  kvevict::status st = kvevict::select(view, b, sp, keep, {ws.data(), ws.size()}, exec);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  std::vector<i64> budgets(static_cast<std::size_t>(heads));
  i64 capacity = 0;
  for (i64 h = 0; h < heads; ++h) {
    const ref::vec row(scores.begin() + h * n, scores.begin() + (h + 1) * n);
    FUZZ_REQUIRE(keep.head(h) == ref::keep(row, per_head, sp.protected_tail, inside), "head %lld of %lld tokens",
                 static_cast<long long>(h), static_cast<long long>(n));
    budgets[static_cast<std::size_t>(h)] = in.ConsumeIntegralInRange<i64>(0, n + 2);
    capacity += kvevict::tokens_kept(budgets[static_cast<std::size_t>(h)], n, sp);
  }
  kvevict::keep_list per(heads, capacity);
  st = kvevict::select(view, budgets.data(), sp, per, {ws.data(), ws.size()}, exec);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  for (i64 h = 0; h < heads; ++h) {
    const ref::vec row(scores.begin() + h * n, scores.begin() + (h + 1) * n);
    FUZZ_REQUIRE(per.head(h) == ref::keep(row, budgets[static_cast<std::size_t>(h)], sp.protected_tail, inside),
                 "per-head budget, head %lld", static_cast<long long>(h));
  }

  // AdaKV head budgets.
  const i64 tail = in.ConsumeIntegralInRange<i64>(0, n + 1);
  const i64 avg = in.ConsumeIntegralInRange<i64>(0, n + 1);
  const kvevict::adakv_params ap{in.ConsumeIntegralInRange<int>(0, 10) / 10.0, in.ConsumeBool()};
  std::vector<unsigned char> aws(kvevict::adakv_workspace_size(heads, n));
  std::vector<i64> a(static_cast<std::size_t>(heads), -1), a2(static_cast<std::size_t>(heads), -2);
  st = kvevict::adakv_head_budgets(view, tail, avg, ap, a.data(), {aws.data(), aws.size()});
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  st = kvevict::adakv_head_budgets(view, tail, avg, ap, a2.data(), {aws.data(), aws.size()});
  FUZZ_REQUIRE(st.ok() && a == a2, "adakv not deterministic");
  const i64 cand = std::max<i64>(0, n - tail);
  i64 total = 0;
  for (i64 x : a) {
    FUZZ_REQUIRE(x >= 0 && x <= cand, "adakv budget %lld outside [0, %lld]", static_cast<long long>(x),
                 static_cast<long long>(cand));
    total += x;
  }
  // floor(alpha*B) and round-half-even each move a head by < 1: within 2*Hkv of Hkv*B.
  if (avg < cand)
    FUZZ_REQUIRE(std::llabs(total - heads * avg) <= 2 * heads, "adakv total %lld for %lld x %lld",
                 static_cast<long long>(total), static_cast<long long>(heads), static_cast<long long>(avg));

  // PyramidKV layer budgets.
  const i64 window = in.ConsumeIntegralInRange<i64>(0, 64);
  const i64 cap = window + in.ConsumeIntegralInRange<i64>(0, 5000);
  const i64 layers = in.ConsumeIntegralInRange<i64>(1, 80);
  const i64 tokens = in.ConsumeIntegralInRange<i64>(0, 20000);
  const double beta = 1.0 + in.ConsumeIntegralInRange<int>(0, 60);
  std::vector<i64> lb(static_cast<std::size_t>(layers), -1);
  st = kvevict::pyramidkv_layer_budgets(cap, window, layers, tokens, lb.data(), beta);
  FUZZ_REQUIRE(st.ok(), "%s", st.message());
  const i64 available = std::max<i64>(0, tokens - window), mean = cap - window;
  i64 sum = 0;
  for (i64 x : lb) {
    FUZZ_REQUIRE(x >= 0 && x <= available, "pyramid budget %lld outside [0, %lld]", static_cast<long long>(x),
                 static_cast<long long>(available));
    sum += x;
  }
  if (mean < available)
    FUZZ_REQUIRE(sum == layers * mean, "pyramid total %lld, expected %lld x %lld", static_cast<long long>(sum),
                 static_cast<long long>(layers), static_cast<long long>(mean));
  return 0;
}
