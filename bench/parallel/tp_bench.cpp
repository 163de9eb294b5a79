// SPDX-License-Identifier: Apache-2.0
// What tensor-parallel selection costs per layer (design.md §15, docs/parallel.md), at the
// reference shape of design.md §10 (Llama-3.1-8B layer: Hq = 32, Hkv = 8, d = 128, L = 32K,
// W = 32, B = 2048, bf16), its KV heads split evenly over the MPI ranks:
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/bench/parallel/kvevict_bench_tp [--tokens L]
//
// For each selection that needs the other ranks (AdaKV's layer-wide top Hkv*B; one keep set per
// layer under a max and a mean rule), per layer and per rank: the all-reduce calls ("rounds")
// and bytes kvevict hands the engine's collective, the wall time spent inside them, the whole
// sharded selection, and this rank's SnapKV scoring of its heads (what the layer costs anyway).
// Medians over repetitions, ranks lined up by a barrier before each; rank 0 prints. The
// transport here is Open MPI over shared memory on one machine; docs/parallel.md models 8 GPUs
// on NVLink from the same counts.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "../common.hpp"
#include "kvevict/mpi.hpp"

namespace {

using i64 = std::int64_t;
using clock_type = std::chrono::steady_clock;

/// The engine's collective with a stopwatch and counters around it.
struct timed_group {
  const kvevict::collective* inner = nullptr;
  i64 rounds = 0, words = 0;
  double seconds = 0.0;
  static kvevict::status all_reduce(void* ctx, std::uint32_t* data, i64 count, kvevict::reduce_op op) {
    auto* g = static_cast<timed_group*>(ctx);
    const auto t0 = clock_type::now();
    const kvevict::status st = g->inner->all_reduce(g->inner->context, data, count, op);
    g->seconds += std::chrono::duration<double>(clock_type::now() - t0).count();
    ++g->rounds;
    g->words += count;
    return st;
  }
  kvevict::collective wrap() {
    kvevict::collective c = *inner;
    c.context = this;
    c.all_reduce = &timed_group::all_reduce;
    return c;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

struct row {
  const char* name;
  kvevict::layer_budget budget;
};

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  i64 tokens = 32768;
  int reps = 7;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokens" && i + 1 < argc) tokens = std::atoll(argv[++i]);
    if (a == "--reps" && i + 1 < argc) reps = std::atoi(argv[++i]);
  }
  kvevict::mpi_group group;
  group.comm = MPI_COMM_WORLD;
  kvevict::collective world;
  kb::die("make_mpi_collective", kvevict::make_mpi_collective(&group, &world));
  const kb::model_shape whole = kb::reference_model;
  if (whole.hkv % world.world_size != 0) {
    if (world.rank == 0)
      std::fprintf(stderr, "run with a rank count that divides %lld\n", static_cast<long long>(whole.hkv));
    MPI_Abort(MPI_COMM_WORLD, 2);
  }
  const i64 mine = whole.hkv / world.world_size, first = mine * world.rank;
  const kb::model_shape shard{"shard", whole.hq / world.world_size, mine, whole.d};
  using T = kvevict::bf16;
  kb::layer<T> layer(shard, tokens, kb::reference_window, 0, 1 + static_cast<std::uint64_t>(world.rank));
  const kvevict::snapkv<T> policy(kb::reference_snapkv());
  const kvevict::layer_shape shape{shard.hq, shard.hkv, shard.d, tokens, kb::reference_window};
  kvevict::workspace score_ws(policy.workspace_size(shape));
  std::vector<float> scores(static_cast<std::size_t>(mine * tokens));
  const kvevict::score_view sv{scores.data(), mine, tokens, tokens};

  // This rank's share of the layer's scoring, the cost the selection is set against.
  std::vector<double> score_s;
  for (int r = 0; r < reps; ++r) {
    MPI_Barrier(MPI_COMM_WORLD);
    const auto t0 = clock_type::now();
    kb::die("score", policy.score(layer.inputs(), sv, score_ws));
    score_s.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
  }

  std::vector<row> rows;
  kvevict::layer_budget base;
  base.per_head = kvevict::budget::tokens(kb::reference_budget);
  row ada{"AdaKV (alpha 0.2)", base};
  ada.budget.heads = kvevict::head_allocation::adakv;
  rows.push_back(ada);
  row layer_max{"one set per layer, normalized_max", base};
  layer_max.budget.scope = kvevict::selection_scope::per_layer;
  rows.push_back(layer_max);
  row layer_mean{"one set per layer, normalized_mean", base};
  layer_mean.budget.scope = kvevict::selection_scope::per_layer;
  layer_mean.budget.combine = kvevict::scope_combine::normalized_mean;
  rows.push_back(layer_mean);

  if (world.rank == 0) {
    std::printf(
        "kvevict tensor-parallel selection per layer: %s layer, Hq=%lld Hkv=%lld d=%lld, L=%lld, W=%lld, "
        "B=%lld, bf16\n",
        whole.name, static_cast<long long>(whole.hq), static_cast<long long>(whole.hkv),
        static_cast<long long>(whole.d), static_cast<long long>(tokens), static_cast<long long>(kb::reference_window),
        static_cast<long long>(kb::reference_budget));
    std::printf("%d ranks (Open MPI, shared memory), %lld KV heads each; %s; medians of %d, wall time\n",
                world.world_size, static_cast<long long>(mine), kb::build_line().c_str(), reps);
    std::printf("this rank's SnapKV scoring of its heads: %.3f ms\n\n", 1e3 * median(score_s));
    std::printf("%-36s %7s %12s %14s %14s %12s\n", "selection", "rounds", "bytes/rank", "collectives", "selection",
                "coll/score");
  }
  const kvevict::selection_params sel = policy.selection();
  for (const row& r : rows) {
    timed_group timed{&world};
    const kvevict::collective counted = timed.wrap();
    kvevict::layer_budget b = r.budget;
    b.shard = {&counted, first, whole.hkv, false};  // as compressor::run calls it (batch agreed once)
    kvevict::keep_list keep(mine, kvevict::select_layer_capacity(mine, tokens, sel, b));
    kvevict::workspace ws(kvevict::select_layer_workspace_size(mine, tokens, b));
    std::vector<double> coll_s, total_s;
    i64 rounds = 0, words = 0;
    for (int rep = 0; rep < reps; ++rep) {
      timed.rounds = timed.words = 0;
      timed.seconds = 0.0;
      MPI_Barrier(MPI_COMM_WORLD);
      const auto t0 = clock_type::now();
      kb::die("select_layer", kvevict::select_layer({scores.data(), mine, tokens, tokens}, sel, b, keep, ws));
      total_s.push_back(std::chrono::duration<double>(clock_type::now() - t0).count());
      coll_s.push_back(timed.seconds);
      rounds = timed.rounds;
      words = timed.words;
    }
    if (world.rank == 0)
      std::printf("%-36s %7lld %12lld %11.3f ms %11.3f ms %11.2f%%\n", r.name, static_cast<long long>(rounds),
                  static_cast<long long>(4 * words), 1e3 * median(coll_s), 1e3 * median(total_s),
                  100.0 * median(coll_s) / median(score_s));
  }
  if (world.rank == 0)
    std::printf("\ncompressor::run adds one agreement round per layer call: %d words (%d bytes)\n", 1 + 4 * 4,
                4 * (1 + 4 * 4));
  MPI_Finalize();
  return 0;
}
