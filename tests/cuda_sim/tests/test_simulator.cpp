// The simulator against CUDA's definitions ([cuda_sim_self]): warp functions lane by lane
// (widths, partial masks, two half-warp collectives at once), block barriers with their
// reductions, 2-D/3-D grids and blocks, per-block static and dynamic shared memory,
// atomics, and the runtime's checks (pointer attributes, copy directions and bounds, the
// shared-memory attribute, launch configurations, streams, graph capture, the launch log)
// and concurrent host threads. The classes of bugs it reports (aborts, ASan, TSan) are
// tested as expected failures (broken/broken_kernels.cpp).
#include <cuda_runtime.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <thread>
#include <vector>

#include "cuda_sim/sim.hpp"
#include "kvevict/cuda/detail/mma.cuh"
#include "kvevict/cuda/detail/shared_memory.cuh"
#include "kvevict/dtype.hpp"
#include "sim_support.hpp"

using simtest::device_vector;
using simtest::launch;

namespace {

__global__ void shuffles_kernel(int* out, int width) {
  const int lane = static_cast<int>(threadIdx.x) % 32;
  const int v = 100 + lane;
  int* row = out + 5 * threadIdx.x;
  row[0] = __shfl_sync(0xffffffffu, v, (lane + 3) % 32, width);
  row[1] = __shfl_up_sync(0xffffffffu, v, 2, width);
  row[2] = __shfl_down_sync(0xffffffffu, v, 3, width);
  row[3] = __shfl_xor_sync(0xffffffffu, v, 5, width);
  row[4] = __shfl_xor_sync(0xffffffffu, v, 16, width);
}

__global__ void votes_kernel(unsigned* out) {
  const unsigned lane = threadIdx.x % 32;
  unsigned* row = out + 8 * threadIdx.x;
  row[0] = __ballot_sync(0xffffffffu, lane % 3 == 0);
  row[1] = static_cast<unsigned>(__any_sync(0xffffffffu, lane == 7));
  row[2] = static_cast<unsigned>(__all_sync(0xffffffffu, lane < 31));
  row[3] = __match_any_sync(0xffffffffu, lane / 4);
  int pred = -1;
  row[4] = __match_all_sync(0xffffffffu, 42u, &pred);
  row[5] = static_cast<unsigned>(pred);
  row[6] = __reduce_add_sync(0xffffffffu, lane);
  row[7] = static_cast<unsigned>(__reduce_min_sync(0xffffffffu, static_cast<int>(lane) - 10));
}

/// Lanes 0-15 and 16-31 run separate collectives with disjoint masks at the same time.
__global__ void half_warps_kernel(int* out) {
  const unsigned lane = threadIdx.x % 32;
  const int v = static_cast<int>(lane);
  if (lane < 16) {
    out[threadIdx.x] = __shfl_xor_sync(0x0000ffffu, v, 1);
  } else {
    out[threadIdx.x] = static_cast<int>(__ballot_sync(0xffff0000u, lane % 2));
  }
}

__global__ void block_reductions_kernel(int* out) {
  const int t = static_cast<int>(threadIdx.x);
  const int count = __syncthreads_count(t % 3 == 0);
  const int any = __syncthreads_or(t == 17);
  const int all = __syncthreads_and(t < 1000);
  const int none = __syncthreads_or(0);
  if (t == 0) {
    out[0] = count;
    out[1] = any;
    out[2] = all;
    out[3] = none;
  }
}

__global__ void indices_kernel(unsigned* out) {
  const unsigned block = (blockIdx.z * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x;
  const unsigned thread = (threadIdx.z * blockDim.y + threadIdx.y) * blockDim.x + threadIdx.x;
  const unsigned per_block = blockDim.x * blockDim.y * blockDim.z;
  out[block * per_block + thread] += block * 1000 + thread + 1;
}

/// Static shared memory belongs to one block; dynamic shared memory is the launch's size.
__global__ void shared_memory_kernel(unsigned* out, unsigned* first_word) {
  KVEVICT_SHARED(unsigned, owner);
  KVEVICT_SHARED_ARRAY(unsigned, partial, 64);
  KVEVICT_DYNAMIC_SHARED(unsigned, scratch);
  const unsigned t = threadIdx.x;
  if (t == 0) {
    first_word[blockIdx.x] = owner;  // never written yet in this block: the 0xff fill
    owner = blockIdx.x;
  }
  partial[t] = t + blockIdx.x;
  scratch[t] = 2 * t;
  __syncthreads();
  out[blockIdx.x * 64 + t] = owner * 10000 + partial[63 - t] + scratch[(t + 1) % 64];
}

__global__ void atomics_kernel(unsigned* counters, float* fsum, int* imax) {
  atomicAdd(&counters[0], 1u);
  atomicOr(&counters[1], 1u << (threadIdx.x % 32));
  atomicMax(imax, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
  atomicAdd(fsum, 0.5f);
  atomicInc(&counters[2], 9u);
  atomicCAS(&counters[3], 0u, 77u);
}

__global__ void big_shared_kernel(float* out) {
  KVEVICT_DYNAMIC_SHARED(float, tile);
  tile[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = tile[(threadIdx.x + 1) % blockDim.x];
}

__global__ void add_kernel(int* data, int value) {
  data[threadIdx.x] += value;
}

__global__ void barrier_heavy_kernel(int* out, int rounds) {
  KVEVICT_SHARED_ARRAY(int, cell, 128);
  const int t = static_cast<int>(threadIdx.x);
  int acc = 0;
  for (int r = 0; r < rounds; ++r) {
    cell[t] = t * r;
    __syncthreads();
    acc += cell[(t + r) % 128];
    __syncthreads();
  }
  out[blockIdx.x * 128 + t] = acc;
}

int expected_shfl(int lane, int width, int which) {
  const int seg = lane & ~(width - 1);
  const int v = 100 + lane;
  switch (which) {
    case 0:
      return 100 + seg + ((lane + 3) % 32) % width;
    case 1:
      return lane - seg >= 2 ? v - 2 : v;
    case 2:
      return lane - seg + 3 < width ? v + 3 : v;
    case 3: {
      const int src = lane ^ 5;
      return (src & ~(width - 1)) > seg ? v : 100 + src;
    }
    default: {
      const int src = lane ^ 16;
      return (src & ~(width - 1)) > seg ? v : 100 + src;
    }
  }
}

/// One m16n8k16 MMA per warp; lane l's fragments are a[4l..4l+3], b[2l..2l+1], d[4l..4l+3].
/// Warp 1 repeats warp 0's operands (d holds C twice) through the portable (shuffle) version.
template <class T>
__global__ void mma_kernel(const std::uint32_t* a, const std::uint32_t* b, float* d) {
  const unsigned lane = threadIdx.x % 32;
  const std::uint32_t fa[4] = {a[4 * lane], a[4 * lane + 1], a[4 * lane + 2], a[4 * lane + 3]};
  const std::uint32_t fb[2] = {b[2 * lane], b[2 * lane + 1]};
  float* mine = d + 4 * threadIdx.x;
  float acc[4] = {mine[0], mine[1], mine[2], mine[3]};
  if (threadIdx.x < 32)
    kvevict::cuda::detail::mma_m16n8k16<T>(acc, fa, fb);
  else
    kvevict::cuda::detail::mma_m16n8k16_portable<T>(acc, fa, fb);
  for (int i = 0; i < 4; ++i) mine[i] = acc[i];
}

}  // namespace

TEST_CASE("simulator: shuffles follow CUDA's lane rules for every width", "[cuda_sim_self]") {
  for (int width : {32, 16, 8, 4}) {
    device_vector<int> out(64 * 5);
    REQUIRE(launch(dim3(1), dim3(64), 0, shuffles_kernel, out.get(), width) == cudaSuccess);
    const auto h = out.host();
    for (int t = 0; t < 64; ++t)
      for (int k = 0; k < 5; ++k) {
        INFO("width " << width << " thread " << t << " op " << k);
        REQUIRE(h[static_cast<std::size_t>(5 * t + k)] == expected_shfl(t % 32, width, k));
      }
  }
}

TEST_CASE("simulator: votes, matches and reductions", "[cuda_sim_self]") {
  device_vector<unsigned> out(32 * 8);
  REQUIRE(launch(dim3(1), dim3(32), 0, votes_kernel, out.get()) == cudaSuccess);
  const auto h = out.host();
  unsigned ballot = 0;
  for (unsigned l = 0; l < 32; l += 3) ballot |= 1u << l;
  for (unsigned l = 0; l < 32; ++l) {
    const unsigned* row = &h[8 * l];
    REQUIRE(row[0] == ballot);
    REQUIRE(row[1] == 1u);
    REQUIRE(row[2] == 0u);
    REQUIRE(row[3] == (0xfu << (4 * (l / 4))));
    REQUIRE(row[4] == 0xffffffffu);
    REQUIRE(row[5] == 1u);
    REQUIRE(row[6] == 496u);
    REQUIRE(static_cast<int>(row[7]) == -10);
  }
}

TEST_CASE("simulator: disjoint half-warp collectives run side by side", "[cuda_sim_self]") {
  device_vector<int> out(32);
  REQUIRE(launch(dim3(1), dim3(32), 0, half_warps_kernel, out.get()) == cudaSuccess);
  const auto h = out.host();
  for (int l = 0; l < 16; ++l) REQUIRE(h[static_cast<std::size_t>(l)] == (l ^ 1));
  for (int l = 16; l < 32; ++l) REQUIRE(static_cast<unsigned>(h[static_cast<std::size_t>(l)]) == 0xaaaa0000u);
}

TEST_CASE("simulator: __syncthreads_count/_or/_and", "[cuda_sim_self]") {
  device_vector<int> out(4);
  REQUIRE(launch(dim3(1), dim3(100), 0, block_reductions_kernel, out.get()) == cudaSuccess);
  REQUIRE(out.host() == std::vector<int>{34, 1, 1, 0});
}

TEST_CASE("simulator: 3-D grids and blocks cover every thread once", "[cuda_sim_self]") {
  const dim3 grid(3, 2, 2), block(4, 3, 2);
  const unsigned blocks = 12, per_block = 24;
  device_vector<unsigned> out(blocks * per_block, 0u);
  REQUIRE(launch(grid, block, 0, indices_kernel, out.get()) == cudaSuccess);
  const auto h = out.host();
  for (unsigned b = 0; b < blocks; ++b)
    for (unsigned t = 0; t < per_block; ++t) REQUIRE(h[b * per_block + t] == b * 1000 + t + 1);
}

TEST_CASE("simulator: shared memory is per block, static and dynamic", "[cuda_sim_self]") {
  device_vector<unsigned> out(3 * 64), first(3);
  REQUIRE(launch(dim3(3), dim3(64), 64 * sizeof(unsigned), shared_memory_kernel, out.get(), first.get()) ==
          cudaSuccess);
  const auto h = out.host();
  for (unsigned b = 0; b < 3; ++b) {
    REQUIRE(first.host()[b] == 0xffffffffu);  // fresh per block, never the previous block's value
    for (unsigned t = 0; t < 64; ++t) REQUIRE(h[b * 64 + t] == b * 10000 + (63 - t + b) + 2 * ((t + 1) % 64));
  }
  const auto log = cudasim::launch_log();
  REQUIRE(!log.empty());
  REQUIRE(log.back().static_smem == sizeof(unsigned) * 65);
  REQUIRE(log.back().dynamic_smem == 64 * sizeof(unsigned));
}

TEST_CASE("simulator: atomics across blocks", "[cuda_sim_self]") {
  device_vector<unsigned> counters(4, 0u);
  device_vector<float> fsum(1, 0.0f);
  device_vector<int> imax(1, -5);
  REQUIRE(launch(dim3(5), dim3(64), 0, atomics_kernel, counters.get(), fsum.get(), imax.get()) == cudaSuccess);
  const auto c = counters.host();
  REQUIRE(c[0] == 320u);
  REQUIRE(c[1] == 0xffffffffu);
  REQUIRE(c[2] == 320u % 10u);
  REQUIRE(c[3] == 77u);
  REQUIRE(fsum.host()[0] == 160.0f);
  REQUIRE(imax.host()[0] == 319);
}

TEST_CASE("simulator: cudaFuncSetAttribute is recorded and enforced", "[cuda_sim_self]") {
  const int optin = static_cast<int>(cudasim::get_device_profile().shared_per_block_optin);
  device_vector<float> out(256);
  const std::size_t big = 64 * 1024;
  cudaGetLastError();
  // Above 48 KiB without the attribute: the launch fails as on the driver, and nothing runs.
  REQUIRE(launch(dim3(1), dim3(256), big, big_shared_kernel, out.get()) == cudaErrorInvalidValue);
  REQUIRE(cudaGetLastError() == cudaErrorInvalidValue);
  REQUIRE(cudaGetLastError() == cudaSuccess);
  REQUIRE(cudaFuncSetAttribute(big_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 60 * 1024) ==
          cudaSuccess);
  REQUIRE(launch(dim3(1), dim3(256), big, big_shared_kernel, out.get()) == cudaErrorInvalidValue);
  REQUIRE(cudaFuncSetAttribute(big_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 64 * 1024) ==
          cudaSuccess);
  REQUIRE(launch(dim3(1), dim3(256), big, big_shared_kernel, out.get()) == cudaSuccess);
  REQUIRE(out.host()[255] == 0.0f);
  REQUIRE(out.host()[3] == 4.0f);
  cudaFuncAttributes attr{};
  REQUIRE(cudaFuncGetAttributes(&attr, big_shared_kernel) == cudaSuccess);
  REQUIRE(attr.maxDynamicSharedSizeBytes == 64 * 1024);
  REQUIRE(cudaFuncSetAttribute(big_shared_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, optin + 1) ==
          cudaErrorInvalidValue);
  cudaGetLastError();
}

TEST_CASE("simulator: launch configurations outside CUDA's limits fail", "[cuda_sim_self]") {
  device_vector<int> data(1024, 0);
  cudaGetLastError();
  REQUIRE(launch(dim3(1), dim3(1025), 0, add_kernel, data.get(), 1) == cudaErrorInvalidConfiguration);
  REQUIRE(launch(dim3(1), dim3(32, 32, 2), 0, add_kernel, data.get(), 1) == cudaErrorInvalidConfiguration);
  REQUIRE(launch(dim3(1, 65536), dim3(1), 0, add_kernel, data.get(), 1) == cudaErrorInvalidConfiguration);
  REQUIRE(launch(dim3(0), dim3(1), 0, add_kernel, data.get(), 1) == cudaErrorInvalidConfiguration);
  REQUIRE(cudaGetLastError() == cudaErrorInvalidConfiguration);
  for (int x : data.host()) REQUIRE(x == 0);  // nothing ran
}

TEST_CASE("simulator: pointer attributes and copies tell the truth", "[cuda_sim_self]") {
  device_vector<float> d(16, 1.0f);
  std::vector<float> host(16, 2.0f);
  cudaPointerAttributes a{};
  REQUIRE(cudaPointerGetAttributes(&a, d.get() + 3) == cudaSuccess);
  REQUIRE(a.type == cudaMemoryTypeDevice);
  REQUIRE(a.devicePointer == d.get() + 3);
  REQUIRE(cudaPointerGetAttributes(&a, host.data()) == cudaSuccess);
  REQUIRE(a.type == cudaMemoryTypeUnregistered);
  float* managed = nullptr;
  REQUIRE(cudaMallocManaged(&managed, 64) == cudaSuccess);
  REQUIRE(cudaPointerGetAttributes(&a, managed) == cudaSuccess);
  REQUIRE(a.type == cudaMemoryTypeManaged);
  managed[0] = 3.0f;  // managed memory is host-accessible
  REQUIRE(cudaFree(managed) == cudaSuccess);
  void* pinned = nullptr;
  REQUIRE(cudaHostAlloc(&pinned, 64, cudaHostAllocMapped) == cudaSuccess);
  REQUIRE(cudaPointerGetAttributes(&a, pinned) == cudaSuccess);
  REQUIRE(a.type == cudaMemoryTypeHost);
  REQUIRE(a.devicePointer == pinned);
  REQUIRE(cudaFreeHost(pinned) == cudaSuccess);

  cudaGetLastError();
  // Direction and bounds: a host pointer named as the device side, a copy past the allocation.
  REQUIRE(cudaMemcpy(host.data(), host.data() + 8, 16, cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  REQUIRE(cudaMemcpy(host.data(), d.get(), 16, cudaMemcpyHostToHost) == cudaErrorInvalidValue);
  REQUIRE(cudaMemcpy(d.get() + 8, host.data(), 9 * sizeof(float), cudaMemcpyHostToDevice) == cudaErrorInvalidValue);
  REQUIRE(cudaMemset(d.get() + 15, 0, 2 * sizeof(float)) == cudaErrorInvalidValue);
  REQUIRE(cudaFree(d.get() + 1) == cudaErrorInvalidValue);
  REQUIRE(cudaMemcpy(d.get(), host.data(), 16 * sizeof(float), cudaMemcpyDefault) == cudaSuccess);
  REQUIRE(d.host() == host);
  cudaGetLastError();
}

TEST_CASE("simulator: registered host memory and its device pointer", "[cuda_sim_self]") {
  std::vector<float> host(32, 1.0f);
  const cudasim::device_profile saved = cudasim::get_device_profile();
  for (bool same : {true, false}) {
    cudasim::device_profile p = saved;
    p.host_pointer_for_registered_memory = same;
    cudasim::set_device_profile(p);
    REQUIRE(cudaHostRegister(host.data(), host.size() * sizeof(float), cudaHostRegisterMapped) == cudaSuccess);
    cudaPointerAttributes a{};
    REQUIRE(cudaPointerGetAttributes(&a, host.data() + 2) == cudaSuccess);
    REQUIRE(a.type == cudaMemoryTypeHost);
    void* dp = nullptr;
    REQUIRE(cudaHostGetDevicePointer(&dp, host.data() + 2, 0) == cudaSuccess);
    REQUIRE(dp == a.devicePointer);
    REQUIRE((dp == static_cast<void*>(host.data() + 2)) == same);
    REQUIRE(cudaHostUnregister(host.data()) == cudaSuccess);
  }
  cudasim::set_device_profile(saved);
}

TEST_CASE("simulator: streams are synchronous queues; graphs replay what was captured", "[cuda_sim_self]") {
  device_vector<int> data(32, 0);
  cudaStream_t s = nullptr;
  REQUIRE(cudaStreamCreate(&s) == cudaSuccess);
  REQUIRE(simtest::launch_on(s, dim3(1), dim3(32), add_kernel, data.get(), 1) == cudaSuccess);
  REQUIRE(data.host()[5] == 1);  // ran when enqueued

  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  REQUIRE(simtest::launch_on(s, dim3(1), dim3(32), add_kernel, data.get(), 10) == cudaSuccess);
  REQUIRE(cudaMemsetAsync(data.get(), 0, sizeof(int), s) == cudaSuccess);
  REQUIRE(simtest::launch_on(s, dim3(1), dim3(32), add_kernel, data.get(), 100) == cudaSuccess);
  cudaStreamCaptureStatus st{};
  REQUIRE(cudaStreamIsCapturing(s, &st) == cudaSuccess);
  REQUIRE(st == cudaStreamCaptureStatusActive);
  cudaGraph_t graph = nullptr;
  REQUIRE(cudaStreamEndCapture(s, &graph) == cudaSuccess);
  REQUIRE(data.host()[5] == 1);  // captured, not run
  cudaGraphExec_t exec = nullptr;
  REQUIRE(cudaGraphInstantiate(&exec, graph, 0) == cudaSuccess);
  REQUIRE(cudaGraphDestroy(graph) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  REQUIRE(cudaGraphLaunch(exec, s) == cudaSuccess);
  const auto h = data.host();
  REQUIRE(h[0] == 100);
  REQUIRE(h[5] == 1 + 2 * 110);
  REQUIRE(cudaGraphExecDestroy(exec) == cudaSuccess);

  // A synchronisation inside a capture is an error and invalidates the capture.
  cudaGetLastError();
  REQUIRE(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal) == cudaSuccess);
  REQUIRE(cudaStreamSynchronize(s) == cudaErrorStreamCaptureUnsupported);
  REQUIRE(cudaStreamEndCapture(s, &graph) == cudaErrorStreamCaptureInvalidated);
  REQUIRE(graph == nullptr);
  cudaGetLastError();

  REQUIRE(cudaStreamDestroy(s) == cudaSuccess);
  REQUIRE(simtest::launch_on(s, dim3(1), dim3(32), add_kernel, data.get(), 1) == cudaErrorInvalidResourceHandle);
  cudaGetLastError();
}

TEST_CASE("simulator: the launch log and the after-launch hook", "[cuda_sim_self]") {
  device_vector<int> data(64, 0);
  cudasim::clear_launch_log();
  std::vector<int> seen;
  cudasim::set_after_launch_hook([&](const cudasim::launch_record& r) {
    REQUIRE(r.kernel == reinterpret_cast<std::uintptr_t>(&add_kernel));
    std::vector<int> h(64);
    cudaMemcpy(h.data(), data.get(), sizeof(int) * 64, cudaMemcpyDeviceToHost);
    seen.push_back(h[0]);
  });
  REQUIRE(launch(dim3(1), dim3(64), 0, add_kernel, data.get(), 3) == cudaSuccess);
  REQUIRE(launch(dim3(1), dim3(64), 0, add_kernel, data.get(), 4) == cudaSuccess);
  cudasim::set_after_launch_hook(nullptr);
  REQUIRE(seen == std::vector<int>{3, 7});
  const auto log = cudasim::launch_log();
  REQUIRE(log.size() == 2);
  REQUIRE(log[1].block.x == 64);
}

TEST_CASE("simulator: host threads launch concurrently", "[cuda_sim_self]") {
  constexpr int kThreads = 3, kBlocks = 4;
  std::vector<std::vector<int>> results(kThreads);
  std::vector<std::thread> pool;
  for (int i = 0; i < kThreads; ++i)
    pool.emplace_back([i, &results] {
      device_vector<int> out(kBlocks * 128, 0);
      cudaStream_t s = nullptr;
      cudaStreamCreate(&s);
      cudaLaunchConfig_t cfg{};
      cfg.gridDim = dim3(kBlocks);
      cfg.blockDim = dim3(128);
      cfg.stream = s;
      if (cudaLaunchKernelEx(&cfg, barrier_heavy_kernel, out.get(), 5 + i) == cudaSuccess) results[i] = out.host();
      cudaStreamDestroy(s);
    });
  for (auto& t : pool) t.join();
  for (int i = 0; i < kThreads; ++i) {
    const int rounds = 5 + i;
    REQUIRE(results[static_cast<std::size_t>(i)].size() == static_cast<std::size_t>(kBlocks * 128));
    for (int t = 0; t < 128; ++t) {
      int want = 0;
      for (int r = 0; r < rounds; ++r) want += ((t + r) % 128) * r;
      REQUIRE(results[static_cast<std::size_t>(i)][static_cast<std::size_t>(t)] == want);
    }
  }
}

namespace {

/// Operands of one m16n8k16 MMA as matrices, and the lane fragments PTX's ISA lays them out
/// in ("Matrix Fragments for mma.m16n8k16 with floating point type").
template <class T>
struct mma_case {
  std::uint16_t a[16][16], b[16][8];
  float c[16][8];

  std::vector<std::uint32_t> a_fragments() const {
    std::vector<std::uint32_t> f(128);
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      const int rows[4] = {g, g + 8, g, g + 8}, cols[4] = {2 * t, 2 * t, 2 * t + 8, 2 * t + 8};
      for (int i = 0; i < 4; ++i)
        f[static_cast<std::size_t>(4 * lane + i)] =
            a[rows[i]][cols[i]] | static_cast<std::uint32_t>(a[rows[i]][cols[i] + 1]) << 16;
    }
    return f;
  }
  std::vector<std::uint32_t> b_fragments() const {
    std::vector<std::uint32_t> f(64);
    for (int lane = 0; lane < 32; ++lane) {
      const int g = lane / 4, t = lane % 4;
      for (int i = 0; i < 2; ++i)
        f[static_cast<std::size_t>(2 * lane + i)] =
            b[2 * t + 8 * i][g] | static_cast<std::uint32_t>(b[2 * t + 8 * i + 1][g]) << 16;
    }
    return f;
  }
  /// D's element of lane l, register i.
  static int row_of(int lane, int i) { return lane / 4 + (i >= 2 ? 8 : 0); }
  static int col_of(int lane, int i) { return 2 * (lane % 4) + (i % 2); }
  std::vector<float> c_fragments() const {
    std::vector<float> f(128);
    for (int lane = 0; lane < 32; ++lane)
      for (int i = 0; i < 4; ++i) f[static_cast<std::size_t>(4 * lane + i)] = c[row_of(lane, i)][col_of(lane, i)];
    return f;
  }
  static float value(std::uint16_t bits) {
    T x;
    x.bits = bits;
    return static_cast<float>(x);
  }
};

template <class T>
void check_mma(const mma_case<T>& m, bool special) {
  device_vector<std::uint32_t> a(m.a_fragments()), b(m.b_fragments());
  std::vector<float> c = m.c_fragments();
  std::vector<float> c2(c);
  c2.insert(c2.end(), c.begin(), c.end());
  device_vector<float> d(c2);
  REQUIRE(launch(dim3(1), dim3(64), 0, mma_kernel<T>, a.get(), b.get(), d.get()) == cudaSuccess);
  const auto out = d.host();
  for (int lane = 0; lane < 32; ++lane)
    for (int i = 0; i < 4; ++i) {
      const int row = mma_case<T>::row_of(lane, i), col = mma_case<T>::col_of(lane, i);
      double exact = m.c[row][col], magnitude = std::fabs(exact);
      for (int k = 0; k < 16; ++k) {
        const double p = static_cast<double>(mma_case<T>::value(m.a[row][k])) * mma_case<T>::value(m.b[k][col]);
        exact += p;
        magnitude += std::fabs(p);
      }
      const float sim = out[static_cast<std::size_t>(4 * lane + i)];
      const float portable = out[static_cast<std::size_t>(128 + 4 * lane + i)];
      INFO("lane " << lane << " register " << i << " (D[" << row << "][" << col << "]) sim " << sim << " portable "
                   << portable << " exact " << exact);
      // The simulator and the portable version add the same exact products in the same order.
      REQUIRE(std::memcmp(&sim, &portable, sizeof(float)) == 0);
      if (std::isnan(exact)) {
        REQUIRE(std::isnan(sim));
      } else if (std::isinf(exact) || special) {
        REQUIRE((sim == static_cast<float>(exact) || (std::isnan(sim) && std::isnan(exact))));
      } else {
        // 16 float32 additions of exact products: within 17 roundings of the magnitudes.
        REQUIRE(std::fabs(sim - exact) <= 17 * 0x1p-24 * magnitude + 1e-30);
      }
    }
}

template <class T>
void run_mma_cases() {
  std::mt19937 rng(7);
  std::normal_distribution<float> normal(0.0f, 3.0f);
  for (int rep = 0; rep < 4; ++rep) {
    mma_case<T> m;
    for (auto& row : m.a)
      for (auto& x : row) x = T(normal(rng)).bits;
    for (auto& row : m.b)
      for (auto& x : row) x = T(normal(rng)).bits;
    for (auto& row : m.c)
      for (auto& x : row) x = rep == 0 ? 0.0f : normal(rng);
    check_mma(m, false);
  }
  // NaN and infinity propagate through their rows and columns; 0 * inf is NaN.
  mma_case<T> m;
  for (auto& row : m.a)
    for (auto& x : row) x = T(1.0f).bits;
  for (auto& row : m.b)
    for (auto& x : row) x = T(0.5f).bits;
  for (auto& row : m.c)
    for (auto& x : row) x = 0.0f;
  const std::uint16_t nan = std::is_same<T, kvevict::bf16>::value ? 0x7fc0 : 0x7e00;
  const std::uint16_t inf = std::is_same<T, kvevict::bf16>::value ? 0x7f80 : 0x7c00;
  m.a[3][5] = nan;
  m.b[9][6] = inf;
  m.a[11][9] = 0;
  m.c[12][1] = -HUGE_VALF;
  check_mma(m, true);
}

}  // namespace

TEST_CASE("simulator: tensor-core MMA (m16n8k16) follows PTX's fragment layouts", "[cuda_sim_self]") {
  SECTION("bf16") {
    run_mma_cases<kvevict::bf16>();
  }
  SECTION("fp16") {
    run_mma_cases<kvevict::fp16>();
  }
}
