// kvevict/nccl.hpp on a GPU (ctest tp.nccl, label gpu; exit code 77 where no GPU is visible).
// NCCL refuses two ranks on one device, so this is a group of one: the adapter's copies, its
// pieces (scratch smaller than the call), both reduce ops and its scratch-size check run for
// real, and the sharded compressor over that group equals the single-process one. The
// multi-rank logic is what tests/parallel/mpi_main.cpp checks with real processes.

#include <cuda_runtime.h>
#include <nccl.h>

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "kvevict/nccl.hpp"
#include "parallel/scenario.hpp"

int main() {
  int devices = 0;
  if (cudaGetDeviceCount(&devices) != cudaSuccess || devices < 1) {
    std::printf("kvevict NCCL adapter check: no GPU visible, skipped\n");
    return 77;
  }
  int failures = 0;
  ncclComm_t comm = nullptr;
  int device = 0;
  if (ncclCommInitAll(&comm, 1, &device) != ncclSuccess) {
    std::fprintf(stderr, "ncclCommInitAll failed\n");
    return 1;
  }
  std::uint32_t* scratch = nullptr;
  const std::int64_t capacity = 1000;  // smaller than the sharded runs' calls: they go in pieces
  if (cudaMalloc(&scratch, capacity * sizeof(std::uint32_t)) != cudaSuccess) return 1;
  kvevict::nccl_group group;
  group.comm = comm;
  group.device_words = scratch;
  group.device_capacity = capacity;
  group.timeout_seconds = 30.0;
  kvevict::collective c;
  const kvevict::status made = kvevict::make_nccl_collective(&group, &c);
  if (!made.ok()) {
    std::fprintf(stderr, "%s\n", made.message());
    return 1;
  }
  std::vector<std::uint32_t> words(2500);
  for (std::size_t i = 0; i < words.size(); ++i) words[i] = static_cast<std::uint32_t>(i * 2654435761u);
  const std::vector<std::uint32_t> before = words;
  for (kvevict::reduce_op op : {kvevict::reduce_op::sum, kvevict::reduce_op::max}) {
    const kvevict::status st = c.all_reduce(c.context, words.data(), static_cast<std::int64_t>(words.size()), op);
    if (!st.ok() || words != before) {  // one rank: the reduction is the identity
      std::fprintf(stderr, "all_reduce over one rank changed the words: %s\n", st.ok() ? "" : st.message());
      ++failures;
    }
  }
  std::uint64_t seed = 7;
  for (tp_test::scenario sc : tp_test::scenarios()) {
    const tp_test::result r = tp_test::run_scenario(c, {8}, sc, ++seed);
    for (const std::string& f : r.failures) std::fprintf(stderr, "FAIL %s\n", f.c_str());
    failures += static_cast<int>(r.failures.size());
  }
  cudaFree(scratch);
  ncclCommDestroy(comm);
  std::printf("kvevict NCCL adapter check: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
