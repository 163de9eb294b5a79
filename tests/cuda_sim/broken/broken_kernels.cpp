// Deliberately broken kernels, one per class of bug the simulator claims to catch. Each
// ctest `cuda_sim.catches.<case>` runs `kvevict_cuda_sim_broken <case>` as a subprocess
// and requires it to fail with the matching report on stderr (expect_failure.cmake);
// `cuda_sim.catches.<case>.control` runs `<case> fixed`, the same kernel with the bug
// removed, under the same sanitizer, and requires a clean exit. So a pass means the report
// came from the bug and nothing else.
//
// The kernels are ordinary CUDA (shared memory through kvevict's macros, launches through
// cudaLaunchKernelEx): what they do wrong is what a GPU would do wrong.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "kvevict/cuda/detail/shared_memory.cuh"

namespace {

bool g_fixed = false;  // host: run the corrected kernel

constexpr unsigned kThreads = 64;

__global__ void missing_barrier_kernel(int* out, bool fixed) {
  KVEVICT_SHARED_ARRAY(int, values, kThreads);
  const unsigned t = threadIdx.x;
  values[t] = static_cast<int>(t) * 3;
  if (fixed) __syncthreads();
  // Reads a neighbour's slot: without the barrier nothing orders its write before this read.
  out[t] = values[(t + 1) % kThreads];
}

/// A per-warp buffer reused every round: one barrier after writing it, and none after reading
/// it, so the next round's writes race with this round's reads by slower warps (the shape of
/// a block-wide scan called in a loop).
__global__ void reused_shared_buffer_kernel(int* out, bool fixed) {
  constexpr unsigned warps = kThreads / 32;
  KVEVICT_SHARED_ARRAY(int, partial, warps);
  const unsigned t = threadIdx.x, warp = t / 32;
  int acc = 0;
  for (int round = 1; round <= 2; ++round) {
    if (t % 32 == 31) partial[warp] = static_cast<int>(t) * round;
    __syncthreads();
    acc += partial[(warp + 1) % warps];
    if (fixed) __syncthreads();  // the buffer is written again next round
  }
  out[t] = acc;
}

__global__ void cross_block_race_kernel(int* total, bool fixed) {
  if (threadIdx.x != 0) return;
  if (fixed) {
    atomicAdd(total, static_cast<int>(blockIdx.x) + 1);
  } else {
    *total += static_cast<int>(blockIdx.x) + 1;  // every block's thread 0: a plain read-modify-write
  }
}

/// Real block sizes, with barriers: every thread stages a value through shared memory (two
/// barriers), then the blocks `racing_blocks` selects add it to out[t] with a plain
/// read-modify-write instead of an atomic (a cross-block reduction that forgot its atomic).
/// Which blocks race is chosen so that no simple pool rule hides the pair: consecutive
/// blocks, blocks of a 2-D or 3-D grid whose coordinates sum to the same parity, blocks a
/// multiple of two or of the pool count apart.
struct race_shape {
  dim3 grid;
  unsigned threads;
  unsigned first;  // linear indices (x fastest) of the two racing blocks
  unsigned second;
};

__global__ void block_race_kernel(int* out, bool fixed, unsigned first, unsigned second) {
  KVEVICT_SHARED_ARRAY(int, staged, 1024);
  const unsigned n = blockDim.x * blockDim.y * blockDim.z;
  const unsigned t = threadIdx.x + blockDim.x * (threadIdx.y + blockDim.y * threadIdx.z);
  const unsigned b = blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
  staged[t] = static_cast<int>(t + b);
  __syncthreads();
  const int v = staged[(t + 1) % n];
  __syncthreads();
  if (b != first && b != second) return;
  if (fixed) {
    atomicAdd(&out[t], v);
  } else {
    out[t] += v;
  }
}

/// Lost updates (interleaving builds: no TSan, the result is checked). Inside one block: a
/// shared-memory histogram whose increments forgot their atomic.
constexpr unsigned kBins = 8;
__global__ void lost_update_in_block_kernel(unsigned* out, bool fixed) {
  KVEVICT_SHARED_ARRAY(unsigned, bins, kBins);
  const unsigned t = threadIdx.x;
  if (t < kBins) bins[t] = 0;
  __syncthreads();
  if (fixed) {
    atomicAdd(&bins[t % kBins], 1u);
  } else {
    bins[t % kBins] += 1u;
  }
  __syncthreads();
  if (t < kBins) out[t] = bins[t];
}

/// Between blocks: each block's thread 0, after a barrier, adds its block's contribution to
/// one global total (the shape of a cross-block reduction or a block counter).
__global__ void lost_update_across_blocks_kernel(unsigned* total, bool fixed) {
  KVEVICT_SHARED_ARRAY(unsigned, staged, 1);
  if (threadIdx.x == 0) staged[0] = blockIdx.x + gridDim.x * blockIdx.y + 1u;
  __syncthreads();
  if (threadIdx.x != 0) return;
  if (fixed) {
    atomicAdd(total, staged[0]);
  } else {
    *total += staged[0];
  }
}

/// Runs a lost-update kernel and checks every counter against `expected`.
int run_counting(void (*kernel)(unsigned*, bool), dim3 grid, unsigned threads, unsigned n,
                 unsigned (*expected)(unsigned)) {
  unsigned* buffer = nullptr;
  if (cudaMalloc(&buffer, n * sizeof(unsigned)) != cudaSuccess) return 2;
  cudaMemset(buffer, 0, n * sizeof(unsigned));
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, buffer, g_fixed);
  unsigned got[kBins] = {};
  cudaMemcpy(got, buffer, n * sizeof(unsigned), cudaMemcpyDeviceToHost);
  cudaFree(buffer);
  if (e != cudaSuccess) return 2;
  for (unsigned i = 0; i < n; ++i) {
    if (got[i] != expected(i)) {
      std::fprintf(stderr, "lost update: counter %u expected %u, got %u\n", i, expected(i), got[i]);
      return 1;
    }
  }
  return 0;
}

__global__ void shared_overrun_kernel(float* out, bool fixed) {
  KVEVICT_DYNAMIC_SHARED(float, tile);  // the launch gives kThreads floats
  const unsigned t = threadIdx.x;
  const unsigned slot = fixed ? t : t + 1;  // off by one: the last thread writes past the tile
  tile[slot] = static_cast<float>(t);
  __syncthreads();
  out[t] = tile[t];
}

/// A 16-byte vector load from an address that is only 4-byte aligned: a misaligned-address
/// fault on a GPU.
__global__ void misaligned_vector_load_kernel(float* data, bool fixed) {
  const float4 v = __ldg(reinterpret_cast<const float4*>(data + (fixed ? 4 : 1)));
  data[32 + threadIdx.x] = v.x + v.w;  // the second half: no thread writes what another reads
}

__global__ void divergent_barrier_kernel(int* out, bool fixed) {
  KVEVICT_SHARED_ARRAY(int, values, kThreads);
  const unsigned t = threadIdx.x;
  values[t] = static_cast<int>(t);
  if (fixed || t < 32) {
    __syncthreads();
  } else {
    __syncthreads();  // a different barrier: only the first warp waits at the one above
  }
  out[t] = values[kThreads - 1 - t];
}

__global__ void barrier_after_exit_kernel(int* out, bool fixed) {
  KVEVICT_SHARED_ARRAY(int, values, kThreads);
  const unsigned t = threadIdx.x;
  if (!fixed && t >= 48) return;  // early exit, then a barrier the others wait at
  values[t] = static_cast<int>(t);
  __syncthreads();
  out[t] = values[(t + 1) % 48];
}

__global__ void exited_lane_kernel(float* out, bool fixed) {
  const unsigned lane = threadIdx.x % 32;
  if (!fixed && lane < 16) return;  // half the warp leaves, the shuffle still names it
  out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, static_cast<float>(lane), 1);
}

__global__ void mismatched_collective_kernel(unsigned* out, bool fixed) {
  const unsigned lane = threadIdx.x % 32;
  if (fixed || lane < 16) {
    out[threadIdx.x] = __shfl_xor_sync(0xffffffffu, lane, 1);
  } else {
    out[threadIdx.x] = __ballot_sync(0xffffffffu, 1);  // the other half calls a different function
  }
}

__global__ void deadlock_kernel(int* out, bool fixed) {
  const unsigned lane = threadIdx.x % 32;
  int v = static_cast<int>(lane);
  // Lane 0 waits for lane 1 in a shuffle, lane 1 waits for lane 0 at the barrier.
  if (fixed || lane < 2) {
    if (fixed || lane == 0) v = __shfl_sync(fixed ? 0xffffffffu : 0x3u, v, 1);
  }
  __syncthreads();
  out[threadIdx.x] = v;
}

template <class T>
T* device_buffer(std::size_t n) {
  T* p = nullptr;
  if (cudaMalloc(&p, n * sizeof(T)) != cudaSuccess) return nullptr;
  cudaMemset(p, 0, n * sizeof(T));
  return p;
}

/// Launches kernel(buffer of n T, g_fixed) on blocks x threads and frees the buffer.
template <class T>
int run(void (*kernel)(T*, bool), unsigned blocks, unsigned threads, std::size_t smem, std::size_t n) {
  T* buffer = device_buffer<T>(n);
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(blocks);
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kernel, buffer, g_fixed);
  const cudaError_t s = cudaDeviceSynchronize();
  cudaFree(buffer);
  if (e != cudaSuccess || s != cudaSuccess) {
    std::fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(e != cudaSuccess ? e : s));
    return 2;
  }
  return 0;
}

int run_block_race(const race_shape& shape, int prior_launches) {
  const unsigned n = shape.threads;
  int* out = device_buffer<int>(n);
  cudaLaunchConfig_t cfg{};
  cudaError_t e = cudaSuccess;
  // Many clean launches first (every block size, several grids): detection must not depend
  // on what ran before in the process.
  for (int i = 0; i < prior_launches && e == cudaSuccess; ++i) {
    cfg.gridDim = dim3(1u + static_cast<unsigned>(i % 3), 1u + static_cast<unsigned>(i % 2));
    cfg.blockDim = dim3(32u << (i % 6));
    e = cudaLaunchKernelEx(&cfg, block_race_kernel, out, true, 0u, 1u);
  }
  if (shape.grid.z > 1) {
    cfg.blockDim = dim3(n / 4, 2, 2);  // a 3-D grid of 3-D blocks
  } else if (shape.grid.y > 1) {
    cfg.blockDim = dim3(n / 2, 2);
  } else {
    cfg.blockDim = dim3(n);
  }
  cfg.gridDim = shape.grid;
  if (e == cudaSuccess) e = cudaLaunchKernelEx(&cfg, block_race_kernel, out, g_fixed, shape.first, shape.second);
  const cudaError_t s = cudaDeviceSynchronize();
  cudaFree(out);
  if (e != cudaSuccess || s != cudaSuccess) {
    std::fprintf(stderr, "launch failed: %s\n", cudaGetErrorString(e != cudaSuccess ? e : s));
    return 2;
  }
  return 0;
}

int host_dereferences_device_memory() {
  int* p = device_buffer<int>(16);
  int v = 0;
  if (g_fixed) {
    cudaMemcpy(&v, p + 3, sizeof(int), cudaMemcpyDeviceToHost);
  } else {
    v = p[3];  // a device pointer read on the host: faults on a GPU
  }
  cudaFree(p);
  return v == 0 ? 0 : 3;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) {
    std::fprintf(stderr, "usage: %s <case> [fixed]\n", argv[0]);
    return 2;
  }
  const std::string which = argv[1];
  g_fixed = argc > 2 && std::strcmp(argv[2], "fixed") == 0;
  int rc = 2;
  if (which == "missing_barrier") rc = run<int>(missing_barrier_kernel, 1, kThreads, 0, kThreads);
  if (which == "reused_shared_buffer") rc = run<int>(reused_shared_buffer_kernel, 1, kThreads, 0, kThreads);
  if (which == "cross_block_race") rc = run<int>(cross_block_race_kernel, 2, kThreads, 0, 1);
  if (which == "shared_overrun")
    rc = run<float>(shared_overrun_kernel, 1, kThreads, kThreads * sizeof(float), kThreads);
  if (which == "misaligned_vector_load") rc = run<float>(misaligned_vector_load_kernel, 1, 32, 0, 64);
  if (which == "divergent_barrier") rc = run<int>(divergent_barrier_kernel, 1, kThreads, 0, kThreads);
  if (which == "barrier_after_exit") rc = run<int>(barrier_after_exit_kernel, 1, kThreads, 0, kThreads);
  if (which == "exited_lane") rc = run<float>(exited_lane_kernel, 1, 32, 0, 32);
  if (which == "mismatched_collective") rc = run<unsigned>(mismatched_collective_kernel, 1, 32, 0, 32);
  if (which == "deadlock") rc = run<int>(deadlock_kernel, 1, 32, 0, 32);
  // Cross-block races at real block sizes (TSan): name -> grid, threads per block, racing pair.
  const struct {
    const char* name;
    race_shape shape;
    int prior_launches;
  } races[] = {
      {"cross_block_race_256", {dim3(2), 256, 0, 1}, 0},
      {"cross_block_race_512", {dim3(2), 512, 0, 1}, 0},
      {"cross_block_race_1024", {dim3(2), 1024, 0, 1}, 0},
      {"cross_block_race_2d", {dim3(2, 2), 256, 1, 2}, 0},     // (1,0) and (0,1): x + y both odd
      {"cross_block_race_3d", {dim3(2, 2, 2), 256, 3, 5}, 0},  // (1,1,0) and (1,0,1)
      {"cross_block_race_stride2", {dim3(3), 512, 0, 2}, 0},   // two blocks apart
      {"cross_block_race_stride3", {dim3(5), 1024, 1, 4}, 0},  // three apart
      {"cross_block_race_after_launches", {dim3(4), 1024, 1, 2}, 60},
  };
  for (const auto& r : races)
    if (which == r.name) rc = run_block_race(r.shape, r.prior_launches);
  if (which == "host_dereference") rc = host_dereferences_device_memory();
  if (which == "lost_update_in_block")
    rc = run_counting(lost_update_in_block_kernel, dim3(1), 512, kBins, [](unsigned) { return 512u / kBins; });
  if (which == "lost_update_across_blocks")
    rc = run_counting(lost_update_across_blocks_kernel, dim3(4, 2), 256, 1, [](unsigned) { return 8u * 9u / 2u; });
  if (rc == 0) std::printf("%s%s: completed\n", which.c_str(), g_fixed ? " (fixed)" : "");
  return rc;
}
