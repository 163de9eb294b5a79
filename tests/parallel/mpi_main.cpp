// Tensor parallelism with real processes (design.md §15), under
//   mpirun --allow-run-as-root --oversubscribe -np N kvevict_tp_mpi   (ctest tp.mpi.N, N = 1, 2, 3, 4)
// Each rank holds a contiguous, uneven share of the model's KV heads, talks to the others only
// through kvevict/mpi.hpp over MPI_COMM_WORLD, and checks that its keep sets, kept positions and
// compacted K and V equal, bit for bit, those of a single-process compressor over every head
// (which it also runs): SnapKV and KNorm with AdaKV (ties across heads, NaN and -0 scores,
// PyramidKV layers), one keep set per layer under the four combining rules, one per sequence,
// DeferKV with AdaKV and per sequence, in f32, fp16 and bf16. Then ranks that disagree or fail
// (different token counts, layers or budgets, a rank without queries) must all return an error
// and change nothing, and a rank that comes late makes the others' bounded wait time out.
// Every rank makes the same calls whatever it finds; the failures are summed over the ranks at
// the end, and the exit code is 0 only when every rank found none.

#include <mpi.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "kvevict/mpi.hpp"
#include "parallel/scenario.hpp"

namespace {

/// Uneven splits of 8 and of 7 KV heads over n ranks.
std::vector<std::vector<int>> splits_for(int n) {
  switch (n) {
    case 1:
      return {{8}};
    case 2:
      return {{5, 3}, {1, 6}};
    case 3:
      return {{3, 3, 2}, {1, 2, 4}};
    case 4:
      return {{3, 2, 2, 1}, {2, 1, 3, 1}};
    default: {
      std::vector<int> s(static_cast<std::size_t>(n), 1);
      s[0] = 2;  // n + 1 heads, the first rank holding two
      return {s};
    }
  }
}

/// A rank that calls late: the others, waiting at most 0.3 s, get a timeout error and drain.
int bounded_wait(const kvevict::collective& world) {
  if (world.world_size < 2) return 0;
  std::uint32_t staging[4];
  kvevict::mpi_group g;
  g.comm = MPI_COMM_WORLD;
  g.timeout_seconds = 0.3;
  g.staging = staging;
  g.staging_words = 4;
  kvevict::collective c;
  if (!kvevict::make_mpi_collective(&g, &c).ok()) return 1;
  const bool late = c.rank == c.world_size - 1;
  if (late) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
  std::uint32_t words[3] = {1, 2, static_cast<std::uint32_t>(c.rank)};
  const kvevict::status st = c.all_reduce(c.context, words, 3, kvevict::reduce_op::sum);
  int failures = 0;
  if (late) {
    if (!st.ok()) {
      std::fprintf(stderr, "[rank %d] bounded wait: the late rank failed: %s\n", c.rank, st.message());
      ++failures;
    }
  } else {
    if (st.code() != kvevict::errc::collective_error || std::string(st.argument()) != "timeout_seconds") {
      std::fprintf(stderr, "[rank %d] bounded wait: expected a timeout, got %s\n", c.rank,
                   st.ok() ? "ok" : st.message());
      ++failures;
    }
    std::uint32_t again[3] = {};
    if (c.all_reduce(c.context, again, 3, kvevict::reduce_op::sum).ok()) {
      std::fprintf(stderr, "[rank %d] bounded wait: a group with a pending request accepted a call\n", c.rank);
      ++failures;
    }
    if (!kvevict::mpi_group_drain(&g).ok()) ++failures;
  }
  MPI_Barrier(MPI_COMM_WORLD);
  return failures;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const auto start = std::chrono::steady_clock::now();
  kvevict::mpi_group group;
  group.comm = MPI_COMM_WORLD;
  kvevict::collective world;
  const kvevict::status made = kvevict::make_mpi_collective(&group, &world);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.message());
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const bool verbose = argc > 1 && std::string(argv[1]) == "--verbose";
  long failures = 0, scenarios = 0, evictions = 0;
  std::uint64_t seed = 1000;
  for (const std::vector<int>& split : splits_for(world.world_size)) {
    for (tp_test::scenario sc : tp_test::scenarios()) {
      for (kvevict::dtype t : {kvevict::dtype::f32, kvevict::dtype::f16, kvevict::dtype::bf16}) {
        sc.storage = t;
        const tp_test::result r = tp_test::run_scenario(world, split, sc, ++seed);
        for (const std::string& f : r.failures)
          std::fprintf(stderr, "FAIL %s (%s)\n", f.c_str(), kvevict::to_string(t));
        failures += static_cast<long>(r.failures.size());
        evictions += r.evictions;
        ++scenarios;
        if (verbose && world.rank == 0 && t == kvevict::dtype::f32)
          std::printf("  %-44s rank 0: %lld all-reduces, %lld words\n", sc.name.c_str(),
                      static_cast<long long>(r.rounds), static_cast<long long>(r.words));
      }
    }
    if (world.world_size > 1)  // one rank has nobody to disagree with
      for (const std::string& f : tp_test::error_scenarios(world, split)) {
        std::fprintf(stderr, "FAIL %s\n", f.c_str());
        ++failures;
      }
  }
  failures += bounded_wait(world);

  long total = 0, compared = 0;
  MPI_Allreduce(&failures, &total, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  MPI_Allreduce(&evictions, &compared, 1, MPI_LONG, MPI_SUM, MPI_COMM_WORLD);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  if (world.rank == 0)
    std::printf(
        "kvevict tensor-parallel test, %d ranks: %ld scenarios per rank, %ld (sequence, layer) evictions "
        "compared over all ranks, %ld failures, %.1f s\n",
        world.world_size, scenarios, compared, total, seconds);
  MPI_Finalize();
  return total == 0 ? 0 : 1;
}
