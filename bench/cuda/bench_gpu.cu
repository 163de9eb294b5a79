// GPU benchmarks of kvevict::cuda at the reference shape of design.md §10
// (Llama-3.1-8B layer: Hq = 32, Hkv = 8, d = 128, L = 32K, W = 32, B = 2048, bf16).
// Prints a markdown report: each API call's median time over repetitions (cudaEvents),
// achieved bandwidth against the K-read lower bound (K read once at the measured
// device-to-device copy bandwidth), selection over a whole model's rows in one launch, and
// every kernel of every call timed alone (the call captured into a CUDA graph, each captured
// node replayed in a graph of its own), for scripts/gpu-model.py's per-kernel comparison.
// Timings are measurements, never assertions.
// Usage: kvevict_cuda_bench [--quick] [--tokens L] [--window W]
#include <cuda_runtime.h>
#include <cxxabi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kvevict/cuda.cuh"

namespace {

#define BENCH_CHECK(expr)                                                                         \
  do {                                                                                            \
    const cudaError_t e_ = (expr);                                                                \
    if (e_ != cudaSuccess) {                                                                      \
      std::fprintf(stderr, "%s:%d: %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                               \
    }                                                                                             \
  } while (0)

void require_ok(const kvevict::status& s) {
  if (!s.ok()) {
    std::fprintf(stderr, "kvevict error: %s\n", s.message());
    std::exit(1);
  }
}

/// Deterministic pseudo-random values in [-1, 1) from an index (splitmix64).
__device__ __forceinline__ float hash_unit(std::uint64_t i, std::uint64_t seed) {
  std::uint64_t z = i + seed * 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  z ^= z >> 31;
  return static_cast<float>(z >> 40) * (2.0f / 16777216.0f) - 1.0f;
}

template <class T>
__global__ void fill_kernel(T* p, std::int64_t n, std::uint64_t seed, float scale) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<std::int64_t>(gridDim.x) * blockDim.x)
    p[i] = T(hash_unit(static_cast<std::uint64_t>(i), seed) * scale);
}

template <class T>
T* device_random(std::int64_t n, std::uint64_t seed, float scale = 1.0f) {
  T* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, static_cast<std::size_t>(n) * sizeof(T)));
  fill_kernel<T><<<1024, 256>>>(p, n, seed, scale);
  BENCH_CHECK(cudaGetLastError());
  return p;
}

template <class T>
T* device_copy(const std::vector<T>& v) {
  T* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, std::max<std::size_t>(v.size(), 1) * sizeof(T)));
  BENCH_CHECK(cudaMemcpy(p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  return p;
}

void* device_bytes(std::size_t n) {
  void* p = nullptr;
  BENCH_CHECK(cudaMalloc(&p, std::max<std::size_t>(n, 1)));
  return p;
}

/// Median time in microseconds of `reps` runs of fn (after warm-up), each timed with events.
template <class Fn>
double median_us(Fn&& fn, int reps) {
  for (int i = 0; i < 3; ++i) fn();
  BENCH_CHECK(cudaDeviceSynchronize());
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    BENCH_CHECK(cudaEventRecord(a));
    fn();
    BENCH_CHECK(cudaEventRecord(b));
    BENCH_CHECK(cudaEventSynchronize(b));
    float ms = 0;
    BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
    t.push_back(static_cast<double>(ms) * 1000.0);
  }
  BENCH_CHECK(cudaEventDestroy(a));
  BENCH_CHECK(cudaEventDestroy(b));
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

/// A machine-readable line for scripts/gpu-check ("@@ key value"; not part of the markdown).
void result(const char* key, double value) {
  std::printf("@@ %s %.3f\n", key, value);
}

/// The kernel's function name without namespaces, template arguments or parameters
/// ("obs_tile_kernel"), as scripts/gpu-model.py names the kernels it models.
std::string kernel_name(const void* func) {
  std::string name = "kernel";
#if CUDART_VERSION >= 12030
  const char* mangled = nullptr;
  if (cudaFuncGetName(&mangled, func) == cudaSuccess && mangled != nullptr) {
    int st = 0;
    char* plain = abi::__cxa_demangle(mangled, nullptr, nullptr, &st);
    name = (st == 0 && plain != nullptr) ? plain : mangled;
    std::free(plain);
    name = name.substr(0, name.find_first_of("<("));
    const std::size_t colon = name.rfind("::");
    if (colon != std::string::npos) name = name.substr(colon + 2);
    const std::size_t space = name.rfind(' ');
    if (space != std::string::npos) name = name.substr(space + 1);
  }
#else
  (void)func;
#endif
  return name;
}

/// Rows of the per-kernel table, printed at the end of the report.
std::string& kernel_rows() {
  static std::string rows;
  return rows;
}

/// The nodes of a graph captured from one stream, in stream order (a chain).
std::vector<cudaGraphNode_t> chain_order(cudaGraph_t graph) {
  std::vector<cudaGraphNode_t> order;
  std::size_t n = 0;
  BENCH_CHECK(cudaGraphGetRootNodes(graph, nullptr, &n));
  if (n != 1) return order;
  cudaGraphNode_t node = nullptr;
  BENCH_CHECK(cudaGraphGetRootNodes(graph, &node, &n));
  while (node != nullptr) {
    order.push_back(node);
    std::size_t m = 0;
#if CUDART_VERSION >= 13000
    BENCH_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, nullptr, &m));
    if (m != 1) break;
    BENCH_CHECK(cudaGraphNodeGetDependentNodes(node, &node, nullptr, &m));
#else
    BENCH_CHECK(cudaGraphNodeGetDependentNodes(node, nullptr, &m));
    if (m != 1) break;
    BENCH_CHECK(cudaGraphNodeGetDependentNodes(node, &node, &m));
#endif
  }
  return order;
}

/// Times every kernel (and memset) `enqueue` puts on `stream`, each alone: the call is
/// captured into a graph, and each captured node is replayed as a graph of `copies` chained
/// copies of itself; the median graph time over `reps` launches, divided by `copies`, is the
/// node's time (it includes the gap between dependent kernels in a graph, about a
/// microsecond, not a launch from the host). Prints "@@k key index name us" lines and a table.
template <class Enqueue>
void time_each_kernel(const char* key, cudaStream_t stream, Enqueue&& enqueue, int reps) {
  constexpr int copies = 10;
  cudaGraph_t captured = nullptr;
  BENCH_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeRelaxed));
  enqueue();
  BENCH_CHECK(cudaStreamEndCapture(stream, &captured));
  const std::vector<cudaGraphNode_t> nodes = chain_order(captured);
  cudaEvent_t a, b;
  BENCH_CHECK(cudaEventCreate(&a));
  BENCH_CHECK(cudaEventCreate(&b));
  for (std::size_t i = 0; i < nodes.size(); ++i) {
    cudaGraphNodeType type{};
    BENCH_CHECK(cudaGraphNodeGetType(nodes[i], &type));
    cudaGraph_t g = nullptr;
    BENCH_CHECK(cudaGraphCreate(&g, 0));
    std::string name;
    cudaGraphNode_t prev = nullptr;
    for (int c = 0; c < copies; ++c) {
      cudaGraphNode_t added = nullptr;
      if (type == cudaGraphNodeTypeKernel) {
        cudaKernelNodeParams p{};
        BENCH_CHECK(cudaGraphKernelNodeGetParams(nodes[i], &p));
        name = kernel_name(p.func);
        BENCH_CHECK(cudaGraphAddKernelNode(&added, g, prev != nullptr ? &prev : nullptr, prev != nullptr ? 1 : 0, &p));
      } else if (type == cudaGraphNodeTypeMemset) {
        cudaMemsetParams p{};
        BENCH_CHECK(cudaGraphMemsetNodeGetParams(nodes[i], &p));
        name = "memset";
        BENCH_CHECK(cudaGraphAddMemsetNode(&added, g, prev != nullptr ? &prev : nullptr, prev != nullptr ? 1 : 0, &p));
      } else {
        name = "other";
        BENCH_CHECK(cudaGraphAddEmptyNode(&added, g, prev != nullptr ? &prev : nullptr, prev != nullptr ? 1 : 0));
      }
      prev = added;
    }
    cudaGraphExec_t exec = nullptr;
    BENCH_CHECK(cudaGraphInstantiate(&exec, g, 0));
    BENCH_CHECK(cudaGraphLaunch(exec, stream));
    BENCH_CHECK(cudaStreamSynchronize(stream));
    std::vector<double> t;
    for (int r = 0; r < reps; ++r) {
      BENCH_CHECK(cudaEventRecord(a, stream));
      BENCH_CHECK(cudaGraphLaunch(exec, stream));
      BENCH_CHECK(cudaEventRecord(b, stream));
      BENCH_CHECK(cudaEventSynchronize(b));
      float ms = 0;
      BENCH_CHECK(cudaEventElapsedTime(&ms, a, b));
      t.push_back(static_cast<double>(ms) * 1000.0 / copies);
    }
    std::sort(t.begin(), t.end());
    const double us = t[t.size() / 2];
    std::printf("@@k %s %zu %s %.3f\n", key, i, name.c_str(), us);
    char line[256];
    std::snprintf(line, sizeof line, "| `%s` | %zu | %s | %.1f |\n", key, i, name.c_str(), us);
    kernel_rows() += line;
    BENCH_CHECK(cudaGraphExecDestroy(exec));
    BENCH_CHECK(cudaGraphDestroy(g));
  }
  BENCH_CHECK(cudaEventDestroy(a));
  BENCH_CHECK(cudaEventDestroy(b));
  BENCH_CHECK(cudaGraphDestroy(captured));
  if (nodes.empty()) std::printf("@@k %s 0 capture_failed 0\n", key);
}

struct machine {
  double peak_gbs = 0;  // from the memory clock and bus width attributes
  double copy_gbs = 0;  // measured: device-to-device copy, bytes read + written per second
};

machine measure_machine(int reps) {
  machine m;
  int dev = 0, clock_khz = 0, bus_bits = 0;
  BENCH_CHECK(cudaGetDevice(&dev));
  if (cudaDeviceGetAttribute(&clock_khz, cudaDevAttrMemoryClockRate, dev) == cudaSuccess &&
      cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev) == cudaSuccess)
    m.peak_gbs = 2.0 * clock_khz * 1e3 * (bus_bits / 8.0) / 1e9;
  const std::size_t bytes = std::size_t{1} << 30;
  void* a = device_bytes(bytes);
  void* b = device_bytes(bytes);
  const double us = median_us([&] { BENCH_CHECK(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice)); }, reps);
  m.copy_gbs = 2.0 * static_cast<double>(bytes) / (us * 1e-6) / 1e9;
  BENCH_CHECK(cudaFree(a));
  BENCH_CHECK(cudaFree(b));
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  bool quick = false;
  std::int64_t L = 32768, W = 32;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "--quick") == 0) quick = true;
    if (std::strcmp(argv[i], "--tokens") == 0 && i + 1 < argc) L = std::atoll(argv[++i]);
    if (std::strcmp(argv[i], "--window") == 0 && i + 1 < argc) W = std::atoll(argv[++i]);
  }
  const int reps = quick ? 5 : 20;
  const std::int64_t hq = 32, hkv = 8, d = 128, B = 2048, layers = 32;
  if (L <= W || W < 1 || B <= W || B > L) {
    std::fprintf(stderr, "expected 1 <= W < B = %lld <= L, got L = %lld, W = %lld\n", static_cast<long long>(B),
                 static_cast<long long>(L), static_cast<long long>(W));
    return 1;
  }
  using kvevict::bf16;

  cudaDeviceProp prop{};
  int dev = 0;
  BENCH_CHECK(cudaGetDevice(&dev));
  BENCH_CHECK(cudaGetDeviceProperties(&prop, dev));
  const machine mach = measure_machine(reps);
  int sm_clock_khz = 0;
  BENCH_CHECK(cudaDeviceGetAttribute(&sm_clock_khz, cudaDevAttrClockRate, dev));
  result("tokens", static_cast<double>(L));
  result("window", static_cast<double>(W));
  result("hq", static_cast<double>(hq));
  result("hkv", static_cast<double>(hkv));
  result("d", static_cast<double>(d));
  result("budget", static_cast<double>(B));
  result("sm_count", prop.multiProcessorCount);
  result("sm_clock_mhz", sm_clock_khz / 1000.0);
  std::printf("### kvevict::cuda on %s (sm_%d%d, %d SMs)\n\n", prop.name, prop.major, prop.minor,
              prop.multiProcessorCount);
  std::printf(
      "Shape: Hq=%lld Hkv=%lld d=%lld L=%lld W=%lld B=%lld, bf16 K/V, float32 scores. "
      "Median of %d runs.\n\n",
      static_cast<long long>(hq), static_cast<long long>(hkv), static_cast<long long>(d), static_cast<long long>(L),
      static_cast<long long>(W), static_cast<long long>(B), reps);
  std::printf(
      "HBM: %.0f GB/s theoretical (clock x bus width), %.0f GB/s measured device-to-device copy "
      "(read + write).\n\n",
      mach.peak_gbs, mach.copy_gbs);

  const std::int64_t k_elems = hkv * L * d;
  const double k_bytes = static_cast<double>(k_elems) * sizeof(bf16);
  const double k_bound_us = k_bytes / (mach.copy_gbs * 1e9) * 1e6;  // K read once
  bf16* keys = device_random<bf16>(k_elems, 1);
  bf16* values = device_random<bf16>(k_elems, 2);
  bf16* queries = device_random<bf16>(hq * W * d, 3, 2.0f);
  std::vector<std::int64_t> qpos_h;
  for (std::int64_t t = 0; t < W; ++t) qpos_h.push_back(L - W + t);
  std::int64_t* qpos = device_copy(qpos_h);
  const auto kview = kvevict::hf_contiguous(keys, hkv, L, d);
  const auto vview = kvevict::hf_contiguous(values, hkv, L, d);
  const auto qview = kvevict::contiguous_queries(queries, hq, W, d, qpos);
  float* scores = nullptr;
  BENCH_CHECK(cudaMalloc(&scores, static_cast<std::size_t>(hkv * L) * sizeof(float)));
  const kvevict::score_view sview{scores, hkv, L, L};
  kvevict::scoring_params params;  // kvpress_snapkv conventions
  params.protected_tail = W;
  kvevict::cuda::launch_options opt;
  // Per-kernel timing captures each call on its own stream (the legacy stream cannot be
  // captured); pointers were checked by the timed calls before.
  cudaStream_t capture_stream = nullptr;
  BENCH_CHECK(cudaStreamCreateWithFlags(&capture_stream, cudaStreamNonBlocking));
  kvevict::cuda::launch_options capture_opt;
  capture_opt.stream = capture_stream;
  capture_opt.check_pointers = false;

  std::printf("| operation | time (us) | achieved | reference |\n|---|---:|---:|---|\n");

  // Fused observation scoring, two passes (no engine LSE).
  {
    const kvevict::layer_shape shape{hq, hkv, d, L, W};
    const std::size_t wsb = kvevict::cuda::observation_scores_workspace_size(shape, params);
    void* ws = device_bytes(wsb);
    const auto run2 = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::observation_scores(qview, kview, params, sview, {ws, wsb}, {}, o));
    };
    const double us = median_us([&] { run2(opt); }, reps);
    time_each_kernel(
        "obs_2pass", capture_stream, [&] { run2(capture_opt); }, reps);
    const double flops = 2.0 * 2.0 * static_cast<double>(hq * W) * static_cast<double>(L) * static_cast<double>(d);
    std::printf(
        "| observation_scores, 2 passes (G*W=%lld rows/KV head) | %.1f | %.0f GB/s of K (2 reads), %.1f TFLOP/s "
        "| K-read bound %.1f us (x%.1f) |\n",
        static_cast<long long>(hq / hkv * W), us, 2.0 * k_bytes / (us * 1e-6) / 1e9, flops / (us * 1e-6) / 1e12,
        k_bound_us, us / k_bound_us);
    result("obs_2pass_us", us);
    // Engine LSE: one pass.
    std::vector<float> lse_h(static_cast<std::size_t>(hq * W), 10.0f);
    float* lse = device_copy(lse_h);
    const std::size_t wsb1 = kvevict::cuda::observation_scores_workspace_size(shape, params, true);
    kvevict::cuda::observation_inputs in;
    in.lse = lse;
    const auto run1 = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::observation_scores(qview, kview, params, sview, {ws, wsb1}, in, o));
    };
    const double us1 = median_us([&] { run1(opt); }, reps);
    time_each_kernel(
        "obs_1pass", capture_stream, [&] { run1(capture_opt); }, reps);
    std::printf(
        "| observation_scores, engine LSE (1 pass) | %.1f | %.0f GB/s of K, %.1f TFLOP/s | K-read bound %.1f us "
        "(x%.1f) |\n",
        us1, k_bytes / (us1 * 1e-6) / 1e9, flops / 2.0 / (us1 * 1e-6) / 1e12, k_bound_us, us1 / k_bound_us);
    result("obs_1pass_us", us1);
    // DeferKV's prefill observation (the window's attention folded into a running state) and
    // the eviction-time finalisation of that state.
    float* state = nullptr;
    BENCH_CHECK(cudaMalloc(&state, static_cast<std::size_t>(hkv * (L - W)) * sizeof(float)));
    const kvevict::score_view st{state, hkv, L - W, L - W};
    kvevict::scoring_params sum_params = params;
    sum_params.window = kvevict::window_aggregation::sum;
    const auto run_state = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::observation_state(qview, kview, sum_params, 0.0f, st, {ws, wsb}, {}, o));
    };
    const double us_state = median_us([&] { run_state(opt); }, reps);
    time_each_kernel(
        "obs_state", capture_stream, [&] { run_state(capture_opt); }, reps);
    std::printf("| observation_state (DeferKV prefill), 2 passes | %.1f | | |\n", us_state);
    result("obs_state_us", us_state);
    const auto run_fin = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::finalize_state_scores({state, hkv, L - W, L - W}, hq / hkv,
                                                      1.0f / static_cast<float>(W), params, sview, o));
    };
    const double us_fin = median_us([&] { run_fin(opt); }, reps);
    time_each_kernel(
        "finalize_state", capture_stream, [&] { run_fin(capture_opt); }, reps);
    std::printf("| finalize_state_scores | %.1f | | |\n", us_fin);
    result("finalize_state_us", us_fin);
    // KNorm's scores: the keys read once, one thread per row (cuda/key_scores.cuh).
    const auto run_norm = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::key_norm_scores(kview, W, sview, o));
    };
    const double us_norm = median_us([&] { run_norm(opt); }, reps);
    time_each_kernel(
        "key_norm", capture_stream, [&] { run_norm(capture_opt); }, reps);
    std::printf("| key_norm_scores (KNorm) | %.1f | %.0f GB/s of K | K-read bound %.1f us (x%.1f) |\n", us_norm,
                k_bytes / (us_norm * 1e-6) / 1e9, k_bound_us, us_norm / k_bound_us);
    result("key_norm_us", us_norm);
    // KeyDiff's scores: norms, chunked channel sums, anchor, cosines (cuda/keydiff_scores.cuh).
    const std::size_t kd_bytes = kvevict::cuda::keydiff_scores_workspace_size(hkv, L, d);
    void* kd_ws = nullptr;
    BENCH_CHECK(cudaMalloc(&kd_ws, kd_bytes));
    const auto run_keydiff = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::keydiff_scores(kview, W, sview, {kd_ws, kd_bytes}, o));
    };
    const double us_keydiff = median_us([&] { run_keydiff(opt); }, reps);
    time_each_kernel(
        "keydiff", capture_stream, [&] { run_keydiff(capture_opt); }, reps);
    std::printf("| keydiff_scores (KeyDiff), 4 launches | %.1f | %.0f GB/s of K | K-read bound %.1f us (x%.1f) |\n",
                us_keydiff, k_bytes / (us_keydiff * 1e-6) / 1e9, k_bound_us, us_keydiff / k_bound_us);
    result("keydiff_us", us_keydiff);
    // DapQ's re-rotated window: the W window queries moved W positions on (cuda/rerotate.cuh).
    kvevict::rope_config rope;
    rope.head_dim = d;
    rope.theta = 500000.0;
    std::vector<double> table_h(static_cast<std::size_t>(kvevict::cuda::rotation_table_size(rope)));
    kvevict::cuda::rotation_table(rope, W, table_h.data());
    double* table = device_copy(table_h);
    bf16* rotated = device_random<bf16>(hq * W * d, 11);
    std::int64_t* rotated_pos = nullptr;
    BENCH_CHECK(cudaMalloc(&rotated_pos, static_cast<std::size_t>(W) * sizeof(std::int64_t)));
    const auto run_rot = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::dapq_rerotate(qview, rope, table, W, rotated, rotated_pos, o));
    };
    const double us_rot = median_us([&] { run_rot(opt); }, reps);
    time_each_kernel(
        "rerotate", capture_stream, [&] { run_rot(capture_opt); }, reps);
    std::printf("| dapq_rerotate (DapQ's re-rotated window, %lld x %lld queries) | %.1f | | |\n",
                static_cast<long long>(hq), static_cast<long long>(W), us_rot);
    result("rerotate_us", us_rot);
    // TOVA's mean across KV heads, in place over the scores.
    const auto run_mean = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::head_mean_scores(sview, W, o));
    };
    const double us_mean = median_us([&] { run_mean(opt); }, reps);
    time_each_kernel(
        "head_mean", capture_stream, [&] { run_mean(capture_opt); }, reps);
    std::printf("| head_mean_scores (TOVA) | %.1f | | |\n", us_mean);
    result("head_mean_us", us_mean);
    BENCH_CHECK(cudaFree(kd_ws));
    BENCH_CHECK(cudaFree(rotated_pos));
    BENCH_CHECK(cudaFree(rotated));
    BENCH_CHECK(cudaFree(table));
    BENCH_CHECK(cudaFree(state));
    BENCH_CHECK(cudaFree(lse));
    BENCH_CHECK(cudaFree(ws));
  }

  // A ragged-free batch of 8 sequences of L / 8 tokens each (the same K bytes as one L-token
  // layer): one batched call against 8 single-sequence calls.
  {
    constexpr std::int64_t n = 8;
    const std::int64_t ls = L / n;
    kvevict::scoring_params bp = params;
    bp.protected_tail = W < ls ? W : 0;
    std::vector<std::int64_t> bpos_h;
    for (std::int64_t t = 0; t < W; ++t) bpos_h.push_back(ls - W + t);
    std::int64_t* bpos = device_copy(bpos_h);
    const auto bq = kvevict::contiguous_queries(queries, hq, W, d, bpos);
    std::vector<kvevict::cuda::scoring_sequence<bf16, bf16>> seqs(n);
    for (std::int64_t s = 0; s < n; ++s) {
      seqs[static_cast<std::size_t>(s)].queries = bq;
      seqs[static_cast<std::size_t>(s)].keys = kvevict::hf_contiguous(keys + s * hkv * ls * d, hkv, ls, d);
      seqs[static_cast<std::size_t>(s)].scores = {scores + s * hkv * ls, hkv, ls, ls};
    }
    const kvevict::layer_shape shape{hq, hkv, d, ls, W};
    const std::size_t wsb = kvevict::cuda::observation_scores_batch_workspace_size<bf16, bf16>(n, shape, bp);
    void* ws = device_bytes(wsb);
    const std::size_t stb = kvevict::cuda::observation_scores_batch_staging_size<bf16, bf16>(n);
    void* staging = nullptr;
    BENCH_CHECK(cudaMallocHost(&staging, stb));
    const auto run_batch = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::observation_scores_batch(seqs.data(), n, bp, {ws, wsb}, staging, stb, o));
    };
    const double us = median_us([&] { run_batch(opt); }, reps);
    time_each_kernel(
        "obs_batch", capture_stream, [&] { run_batch(capture_opt); }, reps);
    const std::size_t one = kvevict::cuda::observation_scores_workspace_size(shape, bp);
    const auto run_loop = [&](const kvevict::cuda::launch_options& o) {
      for (std::int64_t s = 0; s < n; ++s)
        require_ok(kvevict::cuda::observation_scores(seqs[static_cast<std::size_t>(s)].queries,
                                                     seqs[static_cast<std::size_t>(s)].keys, bp,
                                                     seqs[static_cast<std::size_t>(s)].scores, {ws, one}, {}, o));
    };
    const double us_loop = median_us([&] { run_loop(opt); }, reps);
    std::printf(
        "| observation_scores_batch, %lld sequences x %lld tokens (one call) | %.1f | %.2fx the %lld single calls "
        "(%.1f us) | K-read bound %.1f us (x%.1f) |\n",
        static_cast<long long>(n), static_cast<long long>(ls), us, us_loop / us, static_cast<long long>(n), us_loop,
        k_bound_us, us / k_bound_us);
    result("obs_batch_us", us);
    result("obs_batch_loop_us", us_loop);
    BENCH_CHECK(cudaFreeHost(staging));
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(bpos));
  }

  // fp8 (e4m3) keys with bf16 queries (CUDA cores): half the K bytes of bf16.
  {
    using kvevict::fp8_e4m3;
    fp8_e4m3* k8 = device_random<fp8_e4m3>(k_elems, 11, 8.0f);
    auto k8view = kvevict::hf_contiguous(k8, hkv, L, d);
    k8view.scale = 0.125f;
    const kvevict::layer_shape shape{hq, hkv, d, L, W};
    const std::size_t wsb = kvevict::cuda::observation_scores_workspace_size(shape, params);
    void* ws = device_bytes(wsb);
    const auto run = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::observation_scores(qview, k8view, params, sview, {ws, wsb}, {}, o));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        "obs_2pass_fp8", capture_stream, [&] { run(capture_opt); }, reps);
    std::printf(
        "| observation_scores, fp8 e4m3 keys (scale 0.125), bf16 queries, 2 passes | %.1f | %.0f GB/s of K | |\n", us,
        k_bytes / (us * 1e-6) / 1e9);
    result("obs_2pass_fp8_us", us);
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(k8));
  }

  // DeferKV decode step (W = 1): bandwidth-bound.
  {
    std::vector<std::int64_t> dpos_h{L + 1};
    std::int64_t* dpos = device_copy(dpos_h);
    const auto dq = kvevict::contiguous_queries(queries, hq, 1, d, dpos);
    float* state = nullptr;
    BENCH_CHECK(cudaMalloc(&state, static_cast<std::size_t>(hkv * L) * sizeof(float)));
    BENCH_CHECK(cudaMemset(state, 0, static_cast<std::size_t>(hkv * L) * sizeof(float)));
    kvevict::cuda::decode_params dp;
    dp.eta = 0.9f;
    const kvevict::layer_shape shape{hq, hkv, d, L, 1};
    const std::size_t wsb = kvevict::cuda::decode_observation_workspace_size(shape, dp);
    void* ws = device_bytes(wsb);
    const kvevict::score_view st{state, hkv, L, L};
    const auto run2 = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::decode_observation(dq, kview, dp, st, {ws, wsb}, {}, o));
    };
    const double us = median_us([&] { run2(opt); }, reps);
    time_each_kernel(
        "decode_2pass", capture_stream, [&] { run2(capture_opt); }, reps);
    const double moved = k_bytes + 2.0 * static_cast<double>(hq * L) * 4.0 + 2.0 * static_cast<double>(hkv * L) * 4.0;
    std::printf(
        "| decode_observation (DeferKV step), 2 passes | %.1f | %.0f GB/s of K, %.0f GB/s all traffic | "
        "K-read bound %.1f us (x%.2f) |\n",
        us, k_bytes / (us * 1e-6) / 1e9, moved / (us * 1e-6) / 1e9, k_bound_us, us / k_bound_us);
    result("decode_2pass_us", us);
    result("decode_2pass_k_gbs", k_bytes / (us * 1e-6) / 1e9);
    std::vector<float> lse_h(static_cast<std::size_t>(hq), 10.0f);
    float* lse = device_copy(lse_h);
    kvevict::cuda::decode_inputs din;
    din.lse = lse;
    const auto run1 = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::decode_observation(dq, kview, dp, st, {}, din, o));
    };
    const double us1 = median_us([&] { run1(opt); }, reps);
    time_each_kernel(
        "decode_1pass", capture_stream, [&] { run1(capture_opt); }, reps);
    std::printf("| decode_observation, engine LSE (1 pass) | %.1f | %.0f GB/s of K | K-read bound %.1f us (x%.2f) |\n",
                us1, k_bytes / (us1 * 1e-6) / 1e9, k_bound_us, us1 / k_bound_us);
    result("decode_1pass_us", us1);
    result("decode_1pass_k_gbs", k_bytes / (us1 * 1e-6) / 1e9);
    // The same step planned once (decode_plan) and replayed from a captured graph, the
    // token count read on the device.
    std::int32_t* dlen = device_copy(std::vector<std::int32_t>{static_cast<std::int32_t>(L)});
    kvevict::cuda::decode_plan<bf16, bf16> plan;
    require_ok(plan.init(dq, kview, dp, st, {ws, wsb}, dlen, {}, nullptr, opt));
    cudaGraph_t graph = nullptr;
    BENCH_CHECK(cudaStreamBeginCapture(capture_stream, cudaStreamCaptureModeRelaxed));
    require_ok(plan.run(capture_stream));
    BENCH_CHECK(cudaStreamEndCapture(capture_stream, &graph));
    cudaGraphExec_t exec = nullptr;
    BENCH_CHECK(cudaGraphInstantiate(&exec, graph, 0));
    const double us_plan = median_us([&] { BENCH_CHECK(cudaGraphLaunch(exec, nullptr)); }, reps);
    time_each_kernel(
        "decode_plan", capture_stream, [&] { require_ok(plan.run(capture_stream)); }, reps);
    std::printf(
        "| decode_plan step, replayed CUDA graph, 2 passes | %.1f | %.0f GB/s of K | decode_observation %.1f us |\n",
        us_plan, k_bytes / (us_plan * 1e-6) / 1e9, us);
    result("decode_plan_us", us_plan);
    BENCH_CHECK(cudaGraphExecDestroy(exec));
    BENCH_CHECK(cudaGraphDestroy(graph));
    BENCH_CHECK(cudaFree(dlen));
    BENCH_CHECK(cudaFree(lse));
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(state));
    BENCH_CHECK(cudaFree(dpos));
  }

  // Selection: one layer's [Hkv, L], and a whole model's rows in one launch.
  for (std::int64_t rows : {hkv, layers * hkv}) {
    float* s = device_random<float>(rows * L, 7);
    std::int64_t* offsets = nullptr;
    std::int64_t* indices = nullptr;
    const kvevict::selection_params sp{W, kvevict::protected_mode::inside_budget};
    const std::int64_t cap = rows * kvevict::tokens_kept(B, L, sp);
    BENCH_CHECK(cudaMalloc(&offsets, static_cast<std::size_t>(rows + 1) * sizeof(std::int64_t)));
    BENCH_CHECK(cudaMalloc(&indices, static_cast<std::size_t>(cap) * sizeof(std::int64_t)));
    const std::size_t wsb = kvevict::cuda::select_workspace_size(rows);
    void* ws = device_bytes(wsb);
    const auto run = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::select({s, rows, L, L}, kvevict::budget::tokens(B), sp, {rows, offsets, indices, cap},
                                       {ws, wsb}, o));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        rows == hkv ? "select_layer" : "select_model", capture_stream, [&] { run(capture_opt); }, reps);
    std::printf("| select top-%lld, %lld rows x %lld (one launch) | %.1f | %.2f ns/element | %s |\n",
                static_cast<long long>(B), static_cast<long long>(rows), static_cast<long long>(L), us,
                us * 1e3 / static_cast<double>(rows * L), rows == hkv ? "one layer" : "32 layers x 8 KV heads");
    result(rows == hkv ? "select_layer_us" : "select_model_us", us);
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(indices));
    BENCH_CHECK(cudaFree(offsets));
    BENCH_CHECK(cudaFree(s));
  }

  // AdaKV: the layer's head budgets on the device (the paper's rule, then AdaKVPress's, then the
  // paper's normalised).
  for (int variant : {0, 1, 2}) {
    const kvevict::adakv_rule rule = variant == 1 ? kvevict::adakv_rule::kvpress_safeguard : kvevict::adakv_rule::paper;
    const char* name = variant == 0 ? "adakv" : variant == 1 ? "adakv_kvpress" : "adakv_normalised";
    const char* label = variant == 0 ? "" : variant == 1 ? " (AdaKVPress's rule)" : " (normalised)";
    float* s = device_random<float>(hkv * L, 9);
    std::int64_t* budgets = nullptr;
    BENCH_CHECK(cudaMalloc(&budgets, static_cast<std::size_t>(hkv) * sizeof(std::int64_t)));
    const std::size_t wsb = kvevict::cuda::adakv_workspace_size(hkv, L);
    void* ws = device_bytes(wsb);
    kvevict::adakv_params ada;
    ada.rule = rule;
    ada.normalize = variant == 2;
    const auto run = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::adakv_head_budgets({s, hkv, L, L}, W, B, ada, budgets, {ws, wsb}, o));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        name, capture_stream, [&] { run(capture_opt); }, reps);
    std::printf("| adakv_head_budgets%s, %lld heads x %lld (global top-%lld on the device) | %.1f | | |\n", label,
                static_cast<long long>(hkv), static_cast<long long>(L), static_cast<long long>(hkv * B), us);
    result((std::string(name) + "_us").c_str(), us);
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(budgets));
    BENCH_CHECK(cudaFree(s));
  }

  // The wide selection alone: AdaKV's flattened layer (8 x (L - W) keys, one row), its global
  // top 8 x B, many blocks per row.
  {
    const std::int64_t n = hkv * (L - W);
    float* s = device_random<float>(n, 11);
    std::int64_t* out = nullptr;
    BENCH_CHECK(cudaMalloc(&out, static_cast<std::size_t>(hkv * B) * sizeof(std::int64_t)));
    kvevict::cuda::select_row row;
    row.scores = s;
    row.length = n;
    row.budget = hkv * B;
    row.out = out;
    kvevict::cuda::select_row* rows = nullptr;
    BENCH_CHECK(cudaMalloc(&rows, sizeof(row)));
    BENCH_CHECK(cudaMemcpy(rows, &row, sizeof(row), cudaMemcpyHostToDevice));
    const std::size_t wsb = kvevict::cuda::select_rows_wide_workspace_size(1);
    void* ws = device_bytes(wsb);
    const auto run = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::select_rows_wide(rows, 1, n, {ws, wsb}, o));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        "select_wide", capture_stream, [&] { run(capture_opt); }, reps);
    std::printf(
        "| select_rows_wide, one row of %lld keys, top-%lld (many blocks per row) | %.1f | %.2f ns/element | |\n",
        static_cast<long long>(n), static_cast<long long>(hkv * B), us, us * 1e3 / static_cast<double>(n));
    result("select_wide_us", us);
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(rows));
    BENCH_CHECK(cudaFree(out));
    BENCH_CHECK(cudaFree(s));
  }

  // One keep set per layer: the heads' scores combined (normalised max, exact normalisers),
  // then one selection copied to every head.
  {
    float* s = device_random<float>(hkv * L, 10);
    float* row = nullptr;
    std::int64_t *offsets = nullptr, *indices = nullptr;
    const kvevict::selection_params sp{W, kvevict::protected_mode::inside_budget};
    const std::int64_t cap = hkv * kvevict::tokens_kept(B, L, sp);
    BENCH_CHECK(cudaMalloc(&row, static_cast<std::size_t>(L) * sizeof(float)));
    BENCH_CHECK(cudaMalloc(&offsets, static_cast<std::size_t>(hkv + 1) * sizeof(std::int64_t)));
    BENCH_CHECK(cudaMalloc(&indices, static_cast<std::size_t>(cap) * sizeof(std::int64_t)));
    const std::size_t cwb = kvevict::cuda::combine_head_scores_workspace_size(hkv);
    const std::size_t swb = kvevict::cuda::select_shared_workspace_size();
    void* cws = device_bytes(cwb);
    void* sws = device_bytes(swb);
    const auto run = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::combine_head_scores({s, hkv, L, L}, W, kvevict::scope_combine::normalized_max, row,
                                                    {cws, cwb}, o));
      require_ok(kvevict::cuda::select_shared({row, 1, L, L}, kvevict::budget::tokens(B), sp,
                                              {hkv, offsets, indices, cap}, {sws, swb}, o));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        "scope_layer", capture_stream, [&] { run(capture_opt); }, reps);
    std::printf("| one keep set per layer (combine %lld heads x %lld, normalised max; select_shared) | %.1f | | |\n",
                static_cast<long long>(hkv), static_cast<long long>(L), us);
    result("scope_layer_us", us);
    BENCH_CHECK(cudaFree(sws));
    BENCH_CHECK(cudaFree(cws));
    BENCH_CHECK(cudaFree(indices));
    BENCH_CHECK(cudaFree(offsets));
    BENCH_CHECK(cudaFree(row));
    BENCH_CHECK(cudaFree(s));
  }

  // Compaction of K and V by a keep-list of B tokens per head (random, ascending).
  {
    std::mt19937_64 rng(5);
    std::vector<std::int64_t> off{0}, idx;
    for (std::int64_t h = 0; h < hkv; ++h) {
      std::vector<std::int64_t> all(static_cast<std::size_t>(L - W));
      for (std::int64_t j = 0; j < L - W; ++j) all[static_cast<std::size_t>(j)] = j;
      std::shuffle(all.begin(), all.end(), rng);
      all.resize(static_cast<std::size_t>(B - W));
      std::sort(all.begin(), all.end());
      for (std::int64_t j = L - W; j < L; ++j) all.push_back(j);
      idx.insert(idx.end(), all.begin(), all.end());
      off.push_back(static_cast<std::int64_t>(idx.size()));
    }
    std::int64_t* doff = device_copy(off);
    std::int64_t* didx = device_copy(idx);
    const std::int64_t cap = static_cast<std::int64_t>(idx.size());
    const std::size_t wsb = kvevict::cuda::compact_workspace_size(kview, vview, cap);
    void* ws = device_bytes(wsb);
    const kvevict::const_keep_list_view keep{hkv, doff, didx, cap};
    const auto run = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::compact(kview, vview, keep, {ws, wsb}, {}, o));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        "compact", capture_stream, [&] { run(capture_opt); }, reps);
    const double moved = 2.0 * 2.0 * static_cast<double>(cap) * static_cast<double>(d) * sizeof(bf16);  // K+V, r+w
    std::printf(
        "| compact K and V, %lld of %lld tokens per head (staged: 2x the copy) | %.1f | %.0f GB/s of kept rows "
        "(read + write) | device copy %.0f GB/s |\n",
        static_cast<long long>(B), static_cast<long long>(L), us, 2.0 * moved / (us * 1e-6) / 1e9, mach.copy_gbs);
    result("compact_us", us);
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(didx));
    BENCH_CHECK(cudaFree(doff));
  }
  // Batched compaction: 8 sequences of L/8 tokens (slices of the same caches, so the bytes
  // moved equal the single call's), each keeping B/8 per head, in one call.
  {
    constexpr std::int64_t batch = 8;
    const std::int64_t ls = L / batch, bs = B / batch;
    std::mt19937_64 rng(6);
    std::vector<kvevict::cuda::compaction_sequence<bf16, bf16>> seqs(static_cast<std::size_t>(batch));
    std::vector<std::int64_t*> owned;
    std::int64_t max_cap = 0;
    for (std::int64_t s = 0; s < batch; ++s) {
      std::vector<std::int64_t> off{0}, idx;
      for (std::int64_t h = 0; h < hkv; ++h) {
        std::vector<std::int64_t> all(static_cast<std::size_t>(ls));
        for (std::int64_t j = 0; j < ls; ++j) all[static_cast<std::size_t>(j)] = j;
        std::shuffle(all.begin(), all.end(), rng);
        all.resize(static_cast<std::size_t>(bs));
        std::sort(all.begin(), all.end());
        idx.insert(idx.end(), all.begin(), all.end());
        off.push_back(static_cast<std::int64_t>(idx.size()));
      }
      owned.push_back(device_copy(off));
      owned.push_back(device_copy(idx));
      auto& q = seqs[static_cast<std::size_t>(s)];
      q.keys = kview;
      q.values = vview;
      q.keys.data += s * ls * d;  // tokens [s * ls, (s + 1) * ls) of every head
      q.values.data += s * ls * d;
      q.keys.num_tokens = q.values.num_tokens = ls;
      q.keep = {hkv, owned[owned.size() - 2], owned.back(), static_cast<std::int64_t>(idx.size())};
      max_cap = std::max<std::int64_t>(max_cap, static_cast<std::int64_t>(idx.size()));
    }
    const std::size_t wsb = kvevict::cuda::compact_batch_workspace_size(seqs[0].keys, seqs[0].values, batch, max_cap);
    void* ws = device_bytes(wsb);
    const std::size_t stb = kvevict::cuda::compact_batch_staging_size(batch);
    void* staging = nullptr;
    BENCH_CHECK(cudaMallocHost(&staging, stb));
    const auto run = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::compact_batch(seqs.data(), batch, {ws, wsb}, staging, stb, o));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        "compact_batch", capture_stream, [&] { run(capture_opt); }, reps);
    std::printf("| compact_batch, %lld sequences x %lld tokens keeping %lld per head (one call) | %.1f | | |\n",
                static_cast<long long>(batch), static_cast<long long>(ls), static_cast<long long>(bs), us);
    result("compact_batch_us", us);

    // The same keep-lists into fresh memory (compact_into_batch): the source stays intact.
    bf16 *dk = nullptr, *dvv = nullptr;
    const std::size_t dst_elems = static_cast<std::size_t>(batch * hkv * bs * d);
    BENCH_CHECK(cudaMalloc(&dk, dst_elems * sizeof(bf16)));
    BENCH_CHECK(cudaMalloc(&dvv, dst_elems * sizeof(bf16)));
    std::vector<kvevict::cuda::compaction_into_sequence<bf16, bf16>> into(static_cast<std::size_t>(batch));
    for (std::int64_t s = 0; s < batch; ++s) {
      auto& q = into[static_cast<std::size_t>(s)];
      const auto& src = seqs[static_cast<std::size_t>(s)];
      q.src_keys = src.keys;
      q.src_values = src.values;
      q.dst_keys = kvevict::hf_contiguous(dk + s * hkv * bs * d, hkv, bs, d);
      q.dst_values = kvevict::hf_contiguous(dvv + s * hkv * bs * d, hkv, bs, d);
      q.keep = src.keep;
    }
    const std::size_t iwsb = kvevict::cuda::compact_into_batch_workspace_size<bf16, bf16>(
        into[0].src_keys, into[0].src_values, into[0].dst_keys, into[0].dst_values, batch);
    void* iws = device_bytes(iwsb);
    const std::size_t istb = kvevict::cuda::compact_into_batch_staging_size(batch);
    void* istaging = nullptr;
    BENCH_CHECK(cudaMallocHost(&istaging, istb));
    const auto run_into = [&](const kvevict::cuda::launch_options& o) {
      require_ok(kvevict::cuda::compact_into_batch(into.data(), batch, {iws, iwsb}, istaging, istb, o));
    };
    const double ius = median_us([&] { run_into(opt); }, reps);
    time_each_kernel(
        "compact_into_batch", capture_stream, [&] { run_into(capture_opt); }, reps);
    std::printf("| compact_into_batch, the same into fresh memory (one call) | %.1f | | |\n", ius);
    result("compact_into_batch_us", ius);
    BENCH_CHECK(cudaFreeHost(istaging));
    BENCH_CHECK(cudaFree(iws));
    BENCH_CHECK(cudaFree(dvv));
    BENCH_CHECK(cudaFree(dk));
    BENCH_CHECK(cudaFreeHost(staging));
    BENCH_CHECK(cudaFree(ws));
    for (std::int64_t* p : owned) BENCH_CHECK(cudaFree(p));
  }
  // The compressor's one call per layer (cuda::compressor, SnapKV, in place): 8 sequences of
  // L/8 tokens at prefill_end, each keeping B/8 per head -- the batched scoring, the selection
  // (uniform heads: every head's row in one launch; AdaKV heads: every sequence's budgets and
  // sets in one launch per step; one keep set per layer, normalised max: every sequence's
  // combined row, the same) and the batched compaction.
  struct compressor_case {
    const char* key;
    const char* title;
    kvevict::head_allocation heads;
    kvevict::selection_scope scope;
  };
  for (const compressor_case& cc :
       {compressor_case{"compressor_layer", "uniform heads", kvevict::head_allocation::uniform,
                        kvevict::selection_scope::per_head},
        compressor_case{"compressor_layer_adakv", "AdaKV heads", kvevict::head_allocation::adakv,
                        kvevict::selection_scope::per_head},
        compressor_case{"compressor_layer_scope", "one keep set per layer", kvevict::head_allocation::uniform,
                        kvevict::selection_scope::per_layer}}) {
    constexpr std::int64_t batch = 8;
    const std::int64_t ls = L / batch;
    kvevict::compressor_options o;
    o.model = {1, hq, hkv, d, d, kvevict::dtype::bf16, kvevict::dtype::bf16};
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = W;
    o.policy = kvevict::policy::snapkv(w);
    o.per_head = kvevict::budget::tokens(B / batch);
    o.heads = cc.heads;
    o.scope = cc.scope;
    o.combine = kvevict::scope_combine::normalized_max;
    o.limits.max_sequences = batch;
    o.limits.max_tokens = ls;
    o.sharing = kvevict::block_sharing::none;  // the sequences share no block
    kvevict::cuda::compressor c;
    require_ok(kvevict::cuda::compressor::plan(o, &c));
    std::vector<std::int64_t> cpos_h;
    for (std::int64_t t = 0; t < W; ++t) cpos_h.push_back(ls - W + t);
    std::int64_t* cpos = device_copy(cpos_h);
    std::vector<kvevict::cuda::sequence_io<bf16, bf16>> seqs(static_cast<std::size_t>(batch));
    for (std::int64_t s = 0; s < batch; ++s) {
      auto& q = seqs[static_cast<std::size_t>(s)];
      q.event = kvevict::sequence_event::prefill_end;
      q.keys = kvevict::hf_contiguous(keys + s * hkv * ls * d, hkv, ls, d);
      q.values = kvevict::hf_contiguous(values + s * hkv * ls * d, hkv, ls, d);
      q.queries = kvevict::contiguous_queries(queries, hq, W, d, cpos);
    }
    std::vector<kvevict::sequence_report> reports(static_cast<std::size_t>(batch));
    void* ws = device_bytes(c.workspace_size());
    void* staging = nullptr;
    BENCH_CHECK(cudaMallocHost(&staging, c.staging_size()));
    const auto run = [&](const kvevict::cuda::launch_options& lo) {
      require_ok(c.run(0, seqs.data(), batch, reports.data(), {ws, c.workspace_size()}, staging, c.staging_size(), lo));
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        cc.key, capture_stream, [&] { run(capture_opt); }, reps);
    std::printf(
        "| cuda::compressor run, one layer of %lld sequences x %lld tokens (SnapKV, %s, in place) | %.1f | | |\n",
        static_cast<long long>(batch), static_cast<long long>(ls), cc.title, us);
    result((std::string(cc.key) + "_us").c_str(), us);
    BENCH_CHECK(cudaFreeHost(staging));
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(cpos));
  }
  // Chunked prefill (cuda::compressor, SnapKV, in place): 8 sequences of L/8 tokens; a prompt
  // chunk of W queries into each sequence's window ("compressor_chunk", repeated: its order
  // check flags the repeats, which changes nothing timed), then a chunk and a prefill_end of W/2
  // queries whose window takes W/2 of the chunk's rows ("compressor_layer_chunked").
  {
    constexpr std::int64_t batch = 8;
    const std::int64_t ls = L / batch, half = W / 2;
    kvevict::compressor_options o;
    o.model = {1, hq, hkv, d, d, kvevict::dtype::bf16, kvevict::dtype::bf16};
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = W;
    o.policy = kvevict::policy::snapkv(w);
    o.per_head = kvevict::budget::tokens(B / batch);
    o.chunked_prefill = true;
    o.limits.max_sequences = batch;
    o.limits.max_tokens = ls;
    o.sharing = kvevict::block_sharing::none;
    kvevict::cuda::compressor c;
    require_ok(kvevict::cuda::compressor::plan(o, &c));
    std::vector<std::int64_t> chunk_h, end_h;
    for (std::int64_t t = 0; t < W; ++t) chunk_h.push_back(ls - half - W + t);
    for (std::int64_t t = 0; t < half; ++t) end_h.push_back(ls - half + t);
    std::int64_t* chunk_pos = device_copy(chunk_h);
    std::int64_t* end_pos = device_copy(end_h);
    std::vector<kvevict::cuda::sequence_io<bf16, bf16>> chunk(static_cast<std::size_t>(batch));
    void* state = device_bytes(static_cast<std::size_t>(batch) * c.sequence_state_size());
    std::vector<std::vector<std::uint64_t>> host_states(static_cast<std::size_t>(batch),
                                                        std::vector<std::uint64_t>(c.host_state_size() / 8 + 1));
    for (std::int64_t s = 0; s < batch; ++s) {
      auto& q = chunk[static_cast<std::size_t>(s)];
      q.event = kvevict::sequence_event::prefill_chunk;
      q.keys = kvevict::hf_contiguous(keys + s * hkv * ls * d, hkv, ls, d);
      q.values = kvevict::hf_contiguous(values + s * hkv * ls * d, hkv, ls, d);
      q.queries = kvevict::contiguous_queries(queries, hq, W, d, chunk_pos);
      q.state = static_cast<unsigned char*>(state) + static_cast<std::size_t>(s) * c.sequence_state_size();
      q.host_state = host_states[static_cast<std::size_t>(s)].data();
      require_ok(c.reset_sequence(q.host_state, host_states[static_cast<std::size_t>(s)].size() * 8));
    }
    std::vector<kvevict::cuda::sequence_io<bf16, bf16>> end = chunk;
    for (auto& q : end) {
      q.event = kvevict::sequence_event::prefill_end;
      q.queries = kvevict::contiguous_queries(queries, hq, half, d, end_pos);
    }
    std::vector<kvevict::sequence_report> reports(static_cast<std::size_t>(batch));
    void* ws = device_bytes(c.workspace_size());
    void* staging = nullptr;
    BENCH_CHECK(cudaMallocHost(&staging, c.staging_size()));
    const auto call = [&](const std::vector<kvevict::cuda::sequence_io<bf16, bf16>>& seqs,
                          const kvevict::cuda::launch_options& lo) {
      require_ok(c.run(0, seqs.data(), batch, reports.data(), {ws, c.workspace_size()}, staging, c.staging_size(), lo));
    };
    const double chunk_us = median_us([&] { call(chunk, opt); }, reps);
    time_each_kernel(
        "compressor_chunk", capture_stream, [&] { call(chunk, capture_opt); }, reps);
    std::printf(
        "| cuda::compressor, a prompt chunk of %lld sequences (%lld queries each) into their windows | %.1f | | |\n",
        static_cast<long long>(batch), static_cast<long long>(W), chunk_us);
    result("compressor_chunk_us", chunk_us);
    for (auto& h : host_states) require_ok(c.reset_sequence(h.data(), h.size() * 8));
    const auto both = [&](const kvevict::cuda::launch_options& lo) {
      call(chunk, lo);
      call(end, lo);
    };
    const double us = median_us([&] { both(opt); }, reps);
    time_each_kernel(
        "compressor_layer_chunked", capture_stream, [&] { both(capture_opt); }, reps);
    std::printf(
        "| cuda::compressor, a chunk then prefill_end (window across them), %lld sequences x %lld tokens | %.1f | | "
        "|\n",
        static_cast<long long>(batch), static_cast<long long>(ls), us);
    result("compressor_layer_chunked_us", us);
    BENCH_CHECK(cudaFreeHost(staging));
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(state));
    BENCH_CHECK(cudaFree(end_pos));
    BENCH_CHECK(cudaFree(chunk_pos));
  }
  // The per-sequence scope (one keep set for every layer): one step of the 32 layers' calls for
  // 8 sequences of L/8 tokens at prefill_end -- 31 calls that fold each layer's combined row
  // into the sequences' rows, then the last, which selects and compacts every layer's caches.
  {
    constexpr std::int64_t batch = 8;
    const std::int64_t ls = L / batch;
    kvevict::compressor_options o;
    o.model = {layers, hq, hkv, d, d, kvevict::dtype::bf16, kvevict::dtype::bf16};
    kvevict::window_config w = kvevict::presets::kvpress_snapkv();
    w.window = W;
    o.policy = kvevict::policy::snapkv(w);
    o.per_head = kvevict::budget::tokens(B / batch);
    o.scope = kvevict::selection_scope::per_sequence;
    o.limits.max_sequences = batch;
    o.limits.max_tokens = ls;
    o.sharing = kvevict::block_sharing::none;
    kvevict::cuda::compressor c;
    require_ok(kvevict::cuda::compressor::plan(o, &c));
    std::vector<std::int64_t> cpos_h;
    for (std::int64_t t = 0; t < W; ++t) cpos_h.push_back(ls - W + t);
    std::int64_t* cpos = device_copy(cpos_h);
    std::vector<bf16*> layer_k, layer_v;  // every layer's caches of its own
    for (std::int64_t l = 0; l < layers; ++l) {
      layer_k.push_back(device_random<bf16>(k_elems, 40 + 2 * static_cast<std::uint64_t>(l)));
      layer_v.push_back(device_random<bf16>(k_elems, 41 + 2 * static_cast<std::uint64_t>(l)));
    }
    std::vector<std::vector<kvevict::layer_cache<bf16>>> caches(static_cast<std::size_t>(batch));
    std::vector<kvevict::cuda::sequence_io<bf16, bf16>> seqs(static_cast<std::size_t>(batch));
    void* state = device_bytes(static_cast<std::size_t>(batch) * c.sequence_state_size());
    std::vector<std::vector<std::uint64_t>> host_states(static_cast<std::size_t>(batch),
                                                        std::vector<std::uint64_t>(c.host_state_size() / 8 + 1));
    for (std::int64_t s = 0; s < batch; ++s) {
      auto& q = seqs[static_cast<std::size_t>(s)];
      for (std::int64_t l = 0; l < layers; ++l)
        caches[static_cast<std::size_t>(s)].emplace_back(
            kvevict::hf_contiguous(layer_k[static_cast<std::size_t>(l)] + s * hkv * ls * d, hkv, ls, d),
            kvevict::hf_contiguous(layer_v[static_cast<std::size_t>(l)] + s * hkv * ls * d, hkv, ls, d));
      q.event = kvevict::sequence_event::prefill_end;
      q.queries = kvevict::contiguous_queries(queries, hq, W, d, cpos);
      q.layers = caches[static_cast<std::size_t>(s)].data();
      q.state = static_cast<unsigned char*>(state) + static_cast<std::size_t>(s) * c.sequence_state_size();
      q.host_state = host_states[static_cast<std::size_t>(s)].data();
    }
    std::vector<kvevict::sequence_report> reports(static_cast<std::size_t>(batch));
    void* ws = device_bytes(c.workspace_size());
    void* staging = nullptr;
    BENCH_CHECK(cudaMallocHost(&staging, c.staging_size()));
    const auto run = [&](const kvevict::cuda::launch_options& lo) {
      for (auto& h : host_states) require_ok(c.reset_sequence(h.data(), h.size() * 8));
      for (std::int64_t l = 0; l < layers; ++l) {
        for (auto& q : seqs) {
          q.keys = q.layers[l].keys;
          q.values = q.layers[l].values;
        }
        require_ok(
            c.run(l, seqs.data(), batch, reports.data(), {ws, c.workspace_size()}, staging, c.staging_size(), lo));
      }
    };
    const double us = median_us([&] { run(opt); }, reps);
    time_each_kernel(
        "sequence_scope_step", capture_stream, [&] { run(capture_opt); }, reps);
    std::printf(
        "| cuda::compressor, one keep set for every layer: %lld layers x %lld sequences x %lld tokens | %.1f | | |\n",
        static_cast<long long>(layers), static_cast<long long>(batch), static_cast<long long>(ls), us);
    result("sequence_scope_step_us", us);
    BENCH_CHECK(cudaFreeHost(staging));
    BENCH_CHECK(cudaFree(ws));
    BENCH_CHECK(cudaFree(state));
    for (std::int64_t l = 0; l < layers; ++l) {
      BENCH_CHECK(cudaFree(layer_k[static_cast<std::size_t>(l)]));
      BENCH_CHECK(cudaFree(layer_v[static_cast<std::size_t>(l)]));
    }
    BENCH_CHECK(cudaFree(cpos));
  }
  std::printf("\nK-read lower bound: %.1f MiB of K read once at the measured copy bandwidth.\n",
              k_bytes / (1024.0 * 1024.0));
  std::printf(
      "\nEvery kernel of every call timed alone (median per kernel of a graph of 10 chained copies; "
      "scripts/gpu-model.py compares them with the model):\n\n| call | # | kernel | time (us) "
      "|\n|---|---:|---|---:|\n%s",
      kernel_rows().c_str());
  BENCH_CHECK(cudaStreamDestroy(capture_stream));
  result("copy_gbs", mach.copy_gbs);
  result("peak_gbs", mach.peak_gbs);
  result("k_bound_us", k_bound_us);
  BENCH_CHECK(cudaFree(scores));
  BENCH_CHECK(cudaFree(qpos));
  BENCH_CHECK(cudaFree(queries));
  BENCH_CHECK(cudaFree(values));
  BENCH_CHECK(cudaFree(keys));
  return 0;
}
