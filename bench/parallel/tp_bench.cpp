// SPDX-License-Identifier: Apache-2.0
// What tensor-parallel selection costs per layer (design.md §15, docs/benchmarks.md "Tensor
// parallelism"), at the reference shape of design.md §10 (Llama-3.1-8B layer: Hq = 32, Hkv = 8,
// d = 128, L = 32K, W = 32, B = 2048, bf16), its KV heads split evenly over the MPI ranks:
//
//   mpirun --allow-run-as-root --oversubscribe -np 2 build/bench/parallel/kvevict_bench_tp [--tokens L] [--reps n]
//
// For each selection that needs the other ranks (AdaKV's layer-wide top Hkv*B; one keep set per
// layer under a max and a mean rule), per layer call of compressor::run on one rank: the
// all-reduce calls ("rounds", the run's agreement round included) and the bytes kvevict hands
// the engine's collective; the transport time of exactly those calls (replayed through MPI
// after a barrier, so no rank's compute is in it); the whole sharded selection (wall time, which
// also holds waits for slower ranks); the same rank's selection with no group (its heads alone);
// and this rank's SnapKV scoring of its heads, the cost the layer pays anyway. Medians over
// repetitions; rank 0 prints. The transport here is Open MPI over shared memory on one machine;
// docs/benchmarks.md models 8 GPUs from the same counts.

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <utility>
#include <vector>

#include "../common.hpp"
#include "kvevict/mpi.hpp"

namespace {

using i64 = std::int64_t;
using clock_type = std::chrono::steady_clock;

/// The engine's collective with counters around it; it records each call's size and op so that
/// the transport alone can be replayed.
struct recording_group {
  const kvevict::collective* inner = nullptr;
  std::vector<std::pair<i64, kvevict::reduce_op>> calls;
  static kvevict::status all_reduce(void* ctx, std::uint32_t* data, i64 count, kvevict::reduce_op op) {
    auto* g = static_cast<recording_group*>(ctx);
    g->calls.emplace_back(count, op);
    return g->inner->all_reduce(g->inner->context, data, count, op);
  }
  kvevict::collective wrap() {
    kvevict::collective c = *inner;
    c.context = this;
    c.all_reduce = &recording_group::all_reduce;
    return c;
  }
};

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(clock_type::time_point t0) {
  return std::chrono::duration<double>(clock_type::now() - t0).count();
}

struct row {
  const char* name;
  kvevict::layer_budget budget;
};

/// compressor::run's agreement round per call (parallel/agreement.hpp: 1 + 4 words per field,
/// 4 fields), which select_layer under the compressor skips.
constexpr i64 run_agreement_words = 1 + 4 * 4;

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
    score_s.push_back(seconds_since(t0));
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
    std::printf("%d ranks (Open MPI, shared memory), %lld KV heads each; %s; medians of %d, rank 0\n", world.world_size,
                static_cast<long long>(mine), kb::build_line().c_str(), reps);
    std::printf("this rank's SnapKV scoring of its %lld heads: %.3f ms\n\n", static_cast<long long>(mine),
                1e3 * median(score_s));
    std::printf("%-36s %6s %10s %12s %12s %12s %11s\n", "selection (per layer, per rank)", "rounds", "bytes",
                "transport", "sharded sel", "local sel", "transp/score");
  }
  const kvevict::selection_params sel = policy.selection();
  std::vector<std::uint32_t> replay;
  for (const row& r : rows) {
    recording_group recorder{&world, {}};
    const kvevict::collective recorded = recorder.wrap();
    kvevict::layer_budget b = r.budget;
    b.shard = {&recorded, first, whole.hkv, false};  // as compressor::run calls it (batch agreed once)
    kvevict::keep_list keep(mine, kvevict::select_layer_capacity(mine, tokens, sel, b));
    kvevict::workspace ws(kvevict::select_layer_workspace_size(mine, tokens, b));
    kvevict::layer_budget alone = r.budget;  // this rank's heads as if they were the whole layer
    kvevict::keep_list keep_alone(mine, kvevict::select_layer_capacity(mine, tokens, sel, alone));
    kvevict::workspace ws_alone(kvevict::select_layer_workspace_size(mine, tokens, alone));
    std::vector<double> sharded_s, alone_s, transport_s;
    std::vector<std::pair<i64, kvevict::reduce_op>> calls;
    for (int rep = 0; rep < reps; ++rep) {
      recorder.calls.clear();
      recorder.calls.emplace_back(run_agreement_words, kvevict::reduce_op::max);  // run()'s, made before
      MPI_Barrier(MPI_COMM_WORLD);
      auto t0 = clock_type::now();
      kb::die("select_layer", kvevict::select_layer({scores.data(), mine, tokens, tokens}, sel, b, keep, ws));
      sharded_s.push_back(seconds_since(t0));
      calls = recorder.calls;
      t0 = clock_type::now();
      kb::die("select_layer",
              kvevict::select_layer({scores.data(), mine, tokens, tokens}, sel, alone, keep_alone, ws_alone));
      alone_s.push_back(seconds_since(t0));
      // The same calls through the transport alone, every rank entering together.
      MPI_Barrier(MPI_COMM_WORLD);
      t0 = clock_type::now();
      for (const auto& call : calls) {
        replay.assign(static_cast<std::size_t>(call.first), 0u);
        kb::die("all_reduce", world.all_reduce(world.context, replay.data(), call.first, call.second));
      }
      transport_s.push_back(seconds_since(t0));
    }
    i64 words = 0;
    for (const auto& call : calls) words += call.first;
    if (world.rank == 0)
      std::printf("%-36s %6lld %10lld %9.3f ms %9.3f ms %9.3f ms %10.2f%%\n", r.name,
                  static_cast<long long>(calls.size()), static_cast<long long>(4 * words), 1e3 * median(transport_s),
                  1e3 * median(sharded_s), 1e3 * median(alone_s), 100.0 * median(transport_s) / median(score_s));
  }
  if (world.rank == 0)
    std::printf(
        "\nrounds and bytes include compressor::run's agreement round (%lld words); per-head budgets make "
        "no collective in run()\n",
        static_cast<long long>(run_agreement_words));
  MPI_Finalize();
  return 0;
}
