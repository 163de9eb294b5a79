// Selection against a full sort: random rows, heavy ties, all-equal rows, NaN and +-Inf,
// short rows and long rows (the sampled-threshold path), both protected-tail modes.
#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "kvevict/selection/select.hpp"
#include "reference/reference.hpp"

namespace {

enum class fill { random, heavy_ties, all_equal, specials, sorted_up, sorted_down, negatives };

std::vector<float> make_row(fill f, std::int64_t n, std::uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<float> v(static_cast<std::size_t>(n));
  for (std::int64_t j = 0; j < n; ++j) {
    float x = u(rng);
    switch (f) {
      case fill::random:
        break;
      case fill::heavy_ties:
        x = static_cast<float>(static_cast<int>((x + 1.0f) * 3.0f));
        break;  // 0..6
      case fill::all_equal:
        x = 0.25f;
        break;
      case fill::specials: {
        const std::uint64_t r = rng() % 10;
        if (r == 0) x = std::numeric_limits<float>::quiet_NaN();
        if (r == 1) x = std::numeric_limits<float>::infinity();
        if (r == 2) x = -std::numeric_limits<float>::infinity();
        if (r == 3) x = -0.0f;
        if (r == 4) x = 0.0f;
        break;
      }
      case fill::sorted_up:
        x = static_cast<float>(j);
        break;
      case fill::sorted_down:
        x = static_cast<float>(n - j);
        break;
      case fill::negatives:
        x = -std::fabs(x) - 1.0f;
        break;
    }
    v[static_cast<std::size_t>(j)] = x;
  }
  return v;
}

void check_rows(const std::vector<std::vector<float>>& rows, std::int64_t budget_tokens, kvevict::selection_params sp,
                int workers = 1) {
  const std::int64_t heads = static_cast<std::int64_t>(rows.size()), n = static_cast<std::int64_t>(rows[0].size());
  std::vector<float> flat;
  for (const auto& r : rows) flat.insert(flat.end(), r.begin(), r.end());
  const kvevict::const_score_view scores{flat.data(), heads, n, n};
  kvevict::keep_list keep(heads, kvevict::select_capacity(heads, n, kvevict::budget::tokens(budget_tokens), sp));
  kvevict::executor exec;
  exec.num_workers = workers;
  exec.parallel_for = workers > 1 ? +[](void*, std::int64_t count, kvevict::task_fn fn, void* arg) {
    // Reverse order with alternating workers: results must not depend on scheduling.
    for (std::int64_t i = count - 1; i >= 0; --i) fn(arg, i, static_cast<int>(i % 2));
  }
                                  : nullptr;
  kvevict::workspace ws(kvevict::select_workspace_size(n, exec));
  const auto st = kvevict::select(scores, kvevict::budget::tokens(budget_tokens), sp, keep, ws, exec);
  INFO(st.message());
  REQUIRE(st.ok());
  for (std::int64_t h = 0; h < heads; ++h) {
    ref::vec row(rows[static_cast<std::size_t>(h)].begin(), rows[static_cast<std::size_t>(h)].end());
    INFO("head " << h << " n " << n << " budget " << budget_tokens);
    REQUIRE(keep.head(h) ==
            ref::keep(row, budget_tokens, sp.protected_tail, sp.mode == kvevict::protected_mode::inside_budget));
  }
}

}  // namespace

TEST_CASE("select matches a full sort", "[selection]") {
  const fill fills[] = {fill::random,    fill::heavy_ties,  fill::all_equal, fill::specials,
                        fill::sorted_up, fill::sorted_down, fill::negatives};
  const std::int64_t lengths[] = {1, 2, 17, 100, 4095, 4096, 5000, 40000};
  std::uint64_t seed = 1;
  for (fill f : fills)
    for (std::int64_t n : lengths)
      for (std::int64_t b : {std::int64_t{0}, std::int64_t{1}, n / 50, n / 3, n - 1, n, n + 10}) {
        INFO("fill " << static_cast<int>(f));
        std::vector<std::vector<float>> rows = {make_row(f, n, seed), make_row(f, n, seed + 1)};
        seed += 2;
        check_rows(rows, b, {0, kvevict::protected_mode::inside_budget});
      }
}

TEST_CASE("select keeps the protected tail inside or on top of the budget", "[selection]") {
  const std::int64_t n = 300;
  std::vector<std::vector<float>> rows = {make_row(fill::random, n, 9), make_row(fill::heavy_ties, n, 10),
                                          make_row(fill::specials, n, 11)};
  for (std::int64_t protect : {std::int64_t{0}, std::int64_t{1}, std::int64_t{32}, n, n + 5})
    for (std::int64_t b : {std::int64_t{0}, std::int64_t{16}, std::int64_t{32}, std::int64_t{100}, n})
      for (auto mode : {kvevict::protected_mode::inside_budget, kvevict::protected_mode::on_top_of_budget}) {
        INFO("protect " << protect << " mode " << static_cast<int>(mode));
        check_rows(rows, b, {protect, mode});
      }
}

TEST_CASE("select results do not depend on the executor", "[selection]") {
  std::vector<std::vector<float>> rows;
  for (int h = 0; h < 8; ++h) rows.push_back(make_row(fill::heavy_ties, 9000, 50 + static_cast<std::uint64_t>(h)));
  check_rows(rows, 700, {64, kvevict::protected_mode::inside_budget}, 2);
}

TEST_CASE("select resolves ratio budgets as int(L * (1 - r))", "[selection]") {
  REQUIRE(kvevict::budget::ratio(0.5).resolve(101) == 50);
  REQUIRE(kvevict::budget::ratio(0.0).resolve(7) == 7);
  REQUIRE(kvevict::budget::ratio(1.0).resolve(7) == 0);
  REQUIRE(kvevict::budget::ratio(0.75).resolve(4096) == 1024);
  const std::vector<float> row = make_row(fill::random, 101, 3);
  kvevict::keep_list keep(1, 101);
  kvevict::workspace ws(kvevict::select_workspace_size(101));
  REQUIRE(kvevict::select(kvevict::const_score_view{row.data(), 1, 101, 101}, kvevict::budget::ratio(0.5), {}, keep, ws)
              .ok());
  REQUIRE(keep.size(0) == 50);
}

TEST_CASE("select with per-head budgets", "[selection]") {
  const std::int64_t n = 500;
  std::vector<float> flat;
  std::vector<std::vector<float>> rows;
  for (int h = 0; h < 4; ++h) {
    rows.push_back(make_row(fill::random, n, 77 + static_cast<std::uint64_t>(h)));
    flat.insert(flat.end(), rows.back().begin(), rows.back().end());
  }
  const std::int64_t budgets[4] = {0, 10, 250, 600};
  const kvevict::selection_params sp{20, kvevict::protected_mode::on_top_of_budget};
  kvevict::keep_list keep(4, 4 * n);
  kvevict::workspace ws(kvevict::select_workspace_size(n));
  REQUIRE(kvevict::select(kvevict::const_score_view{flat.data(), 4, n, n}, budgets, sp, keep, ws).ok());
  for (std::int64_t h = 0; h < 4; ++h) {
    ref::vec row(rows[static_cast<std::size_t>(h)].begin(), rows[static_cast<std::size_t>(h)].end());
    REQUIRE(keep.head(h) == ref::keep(row, budgets[h], 20, false));
  }
}

TEST_CASE("select rejects bad arguments without writing", "[selection][errors]") {
  std::vector<float> row(64, 1.0f);
  const kvevict::const_score_view scores{row.data(), 1, 64, 64};
  kvevict::keep_list keep(1, 64);
  auto view = keep.view();
  view.offsets[1] = 99;
  kvevict::workspace ws(kvevict::select_workspace_size(64));
  SECTION("negative budget") {
    const auto st = kvevict::select(scores, kvevict::budget::tokens(-1), {}, view, ws);
    REQUIRE(st.code() == kvevict::errc::invalid_argument);
    REQUIRE(std::string(st.argument()) == "budget");
  }
  SECTION("ratio outside [0, 1]") {
    const auto st = kvevict::select(scores, kvevict::budget::ratio(1.5), {}, view, ws);
    REQUIRE(std::string(st.argument()) == "budget");
  }
  SECTION("capacity too small") {
    view.capacity = 3;
    const auto st = kvevict::select(scores, kvevict::budget::tokens(10), {}, view, ws);
    REQUIRE(st.code() == kvevict::errc::invalid_keep_list);
    REQUIRE(std::string(st.argument()) == "out.capacity");
  }
  SECTION("workspace too small") {
    const auto st = kvevict::select(scores, kvevict::budget::tokens(10), {}, view, {ws.span().data, 10});
    REQUIRE(st.code() == kvevict::errc::workspace_too_small);
  }
  SECTION("negative protected tail") {
    const auto st =
        kvevict::select(scores, kvevict::budget::tokens(10), {-1, kvevict::protected_mode::inside_budget}, view, ws);
    REQUIRE(std::string(st.argument()) == "params.protected_tail");
  }
  REQUIRE(view.offsets[1] == 99);  // nothing written
}
