// Regression tests for bugs the simulator found in kvevict::cuda ([cuda_sim_regression]).
// Each names the bug it pins; most run through the GPU runner of tests/cuda, the rest call
// kvevict::cuda directly where they need the simulator's controls (the launch log and
// after-launch hook, the device's registered-memory mode, the FPU's flush-to-zero mode).
#include <cuda_runtime.h>
#include <catch2/catch.hpp>

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <random>
#include <thread>
#include <vector>

#if defined(__SSE__) || defined(__x86_64__)
#include <xmmintrin.h>
#endif

#include "cuda_sim/sim.hpp"
#include "gpu_runner.hpp"
#include "kvevict/cuda.cuh"
#include "kvevict/selection/select.hpp"
#include "sim_support.hpp"
#include "support/test_cache.hpp"

using simtest::device_vector;

namespace {

template <class T>
void require_bytes(const std::vector<unsigned char>& got, const std::vector<T>& want) {
  REQUIRE(got.size() == want.size() * sizeof(T));
  REQUIRE(std::memcmp(got.data(), want.data(), got.size()) == 0);
}

std::vector<float> iota_floats(std::size_t n) {
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = static_cast<float>(i % 1009) * 0.25f;
  return v;
}

}  // namespace

// Bug 1: with V using K's block table (vLLM: one table, two pools), V's ids were checked
// only against K's pool size, so a V pool smaller than K's was read and written out of range.
TEST_CASE("compact: V sharing K's block table is checked against V's own pool", "[cuda_sim_regression]") {
  const std::int64_t heads = 2, bs = 16, d = 16, tokens = 64;
  std::vector<float> kpool = iota_floats(static_cast<std::size_t>(8 * bs * heads * d));
  std::vector<float> vpool = iota_floats(static_cast<std::size_t>(4 * bs * heads * d));
  std::vector<std::int32_t> table{0, 6, 2, 7};  // ids 6 and 7 exist in K's pool only
  const auto k = kvevict::vllm_paged(kpool.data(), 8, bs, heads, d, table.data(), tokens);
  const auto v = kvevict::vllm_paged(vpool.data(), 4, bs, heads, d, table.data(), tokens);
  const std::vector<std::int64_t> offsets{0, 3, 5}, indices{1, 20, 40, 0, 63};
  const auto g = gpu::compact(k, gpu::buffer_of(kpool), table, v, gpu::buffer_of(vpool), table, offsets, indices, 5);
  REQUIRE(g.st.ok());
  REQUIRE((g.flags & kvevict::cuda::flag_block_id_out_of_range) != 0);
  require_bytes(g.keys, kpool);
  require_bytes(g.values, vpool);
  for (std::int64_t x : g.head_lengths) REQUIRE(x == -7);

  SECTION("the same views with ids inside both pools compact normally") {
    table = {0, 3, 2, 1};
    const auto ok = gpu::compact(k, gpu::buffer_of(kpool), table, v, gpu::buffer_of(vpool), table, offsets, indices, 5);
    REQUIRE(ok.st.ok());
    REQUIRE(ok.flags == 0);
    REQUIRE(ok.head_lengths == std::vector<std::int64_t>{3, 2});
  }
}

// Bug 2: K and V in one pool (TensorRT-LLM) share the duplicate-block bitmap, which was
// sized by K's block count while V's ids were checked against V's: atomicOr past the bitmap
// into the caller's workspace.
TEST_CASE("compact: a shared pool's bitmap covers V's ids when V's pool is larger", "[cuda_sim_regression]") {
  const std::int64_t heads = 2, bs = 8, d = 16, tokens = 30, kblocks = 4, vblocks = 4096;
  std::vector<kvevict::bf16> pool(static_cast<std::size_t>(vblocks * heads * bs * d));
  for (std::size_t i = 0; i < pool.size(); ++i) pool[i] = kvevict::bf16(static_cast<float>(i % 251));
  std::vector<std::int32_t> ktab{0, 1, 2, 3}, vtab{4000, 4001, 4090, 4095};
  const auto kv = kvevict::trtllm_paged(pool.data(), kblocks, bs, heads, d, ktab.data(), tokens);
  auto vv = kvevict::trtllm_paged(pool.data(), vblocks, bs, heads, d, vtab.data(), tokens);
  const std::vector<std::int64_t> offsets{0, 3, 6}, indices{2, 9, 29, 0, 17, 28};
  const auto g = gpu::compact(kv, gpu::buffer_of(pool), ktab, vv, gpu::buffer_of(pool), vtab, offsets, indices, 6);
  REQUIRE(g.st.ok());
  REQUIRE(g.flags == 0);
  std::vector<kvevict::bf16> want = pool;
  for (std::int64_t h = 0; h < heads; ++h)
    for (std::int64_t i = 0; i < 3; ++i)
      for (std::int64_t c = 0; c < d; ++c) {
        const std::int64_t src = indices[static_cast<std::size_t>(h * 3 + i)];
        want[static_cast<std::size_t>(kv.offset(h, i, c))] = pool[static_cast<std::size_t>(kv.offset(h, src, c))];
        want[static_cast<std::size_t>(vv.offset(h, i, c))] = pool[static_cast<std::size_t>(vv.offset(h, src, c))];
      }
  require_bytes(g.keys, want);

  SECTION("a block in both tables is still a duplicate") {
    vtab[1] = 2;
    vv.block_table = vtab.data();
    const auto dup = gpu::compact(kv, gpu::buffer_of(pool), ktab, vv, gpu::buffer_of(pool), vtab, offsets, indices, 6);
    REQUIRE((dup.flags & kvevict::cuda::flag_duplicate_block) != 0);
    require_bytes(dup.keys, pool);
  }
}

// Bug 3: corrupt keep-list offsets (offsets[0] != 0, negative) made the validation kernel
// read indices[-1] for the first entry.
TEST_CASE("compact: corrupt keep-list offsets are flagged without reading before the indices",
          "[cuda_sim_regression]") {
  const std::int64_t heads = 2, tokens = 64, d = 32;
  auto k = test::make_cache<float>(test::layout::contiguous, heads, tokens, d,
                                   test::normal(static_cast<std::size_t>(heads * tokens * d), 1));
  auto v = test::make_cache<float>(test::layout::paged_nhd, heads, tokens, d,
                                   test::normal(static_cast<std::size_t>(heads * tokens * d), 2), 16, 9);
  const std::vector<std::int64_t> indices{1, 20, 40, 0, 63};
  for (const std::vector<std::int64_t>& offsets :
       {std::vector<std::int64_t>{2, 3, 5}, std::vector<std::int64_t>{-1, 3, 5},
        std::vector<std::int64_t>{-9, -4, 5}}) {
    INFO("offsets " << offsets[0] << ", " << offsets[1] << ", " << offsets[2]);
    const auto g = gpu::compact(k.view, gpu::buffer_of(k.buffer), k.table, v.view, gpu::buffer_of(v.buffer), v.table,
                                offsets, indices, 5);
    REQUIRE(g.st.ok());
    REQUIRE(g.flags == kvevict::cuda::flag_invalid_keep_list);
    require_bytes(g.keys, k.buffer);
    require_bytes(g.values, v.buffer);
  }
}

namespace {

__global__ void needs_shared_kernel(float* out) {
  KVEVICT_DYNAMIC_SHARED(float, tile);
  tile[threadIdx.x] = static_cast<float>(threadIdx.x);
  __syncthreads();
  out[threadIdx.x] = tile[31 - threadIdx.x];
}

cudaError_t launch_with_shared(std::size_t bytes, float* out) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(1);
  cfg.blockDim = dim3(32);
  cfg.dynamicSmemBytes = bytes;
  return cudaLaunchKernelEx(&cfg, needs_shared_kernel, out);
}

}  // namespace

// Bug 4: the dynamic shared-memory limit was set to each call's own need, so two host
// threads with different shapes lowered it under each other between one's
// cudaFuncSetAttribute and its launch.
TEST_CASE("a smaller shape cannot lower another call's shared-memory limit", "[cuda_sim_regression]") {
  namespace kd = kvevict::cuda::detail;
  device_vector<float> out(32);
  cudaGetLastError();
  // The interleaving that broke: A raises for 100 KiB, B raises for 60 KiB, A launches.
  REQUIRE(kd::allow_shared_bytes(needs_shared_kernel, 100 * 1024, "test").ok());
  REQUIRE(kd::allow_shared_bytes(needs_shared_kernel, 60 * 1024, "test").ok());
  REQUIRE(launch_with_shared(100 * 1024, out.get()) == cudaSuccess);
  REQUIRE(out.host()[0] == 31.0f);
  cudaFuncAttributes attr{};
  REQUIRE(cudaFuncGetAttributes(&attr, needs_shared_kernel) == cudaSuccess);
  REQUIRE(static_cast<std::size_t>(attr.maxDynamicSharedSizeBytes) ==
          cudasim::get_device_profile().shared_per_block_optin - attr.sharedSizeBytes);
  // More than the device has: unsupported, named, nothing set.
  const auto too_big =
      kd::allow_shared_bytes(needs_shared_kernel, cudasim::get_device_profile().shared_per_block_optin + 1, "test");
  REQUIRE(too_big.code() == kvevict::errc::unsupported);

  SECTION("concurrent host threads with different needs") {
    std::atomic<int> failures{0};
    auto worker = [&](std::size_t bytes) {
      device_vector<float> o(32);
      for (int i = 0; i < 50; ++i) {
        if (!kd::allow_shared_bytes(needs_shared_kernel, bytes, "test").ok() ||
            launch_with_shared(bytes, o.get()) != cudaSuccess)
          ++failures;
      }
    };
    std::thread a(worker, std::size_t{120 * 1024}), b(worker, std::size_t{50 * 1024});
    a.join();
    b.join();
    REQUIRE(failures.load() == 0);
  }
}

namespace {

struct decode_problem {
  std::int64_t hkv = 2, group = 4, d = 64, tokens = 3000;
  std::int64_t hq() const { return hkv * group; }
};

/// One two-pass decode_observation step on device data; returns the state. `on_workspace`
/// gets the device address of the tile partials before anything is launched.
std::vector<float> decode_step(const decode_problem& p, const std::vector<float>& kh, const std::vector<float>& qh,
                               const std::function<void(kvevict::cuda::detail::softmax_partial*)>& on_workspace = {}) {
  namespace kd = kvevict::cuda::detail;
  device_vector<float> keys(kh), queries(qh), state(static_cast<std::size_t>(p.hkv * p.tokens), 0.5f);
  device_vector<std::int64_t> pos(std::vector<std::int64_t>{p.tokens + 2});
  kvevict::cuda::decode_params params;
  params.eta = 0.75f;
  const kvevict::layer_shape shape{p.hq(), p.hkv, p.d, p.tokens, 1};
  const std::size_t bytes = kvevict::cuda::decode_observation_workspace_size(shape, params);
  device_vector<unsigned char> ws(bytes);
  if (on_workspace) {
    kvevict::detail::arena arena({ws.get(), bytes});
    kd::decode_workspace w;
    kd::carve_decode_workspace(arena, kd::make_obs_dims(p.hkv, p.hq(), 1, p.tokens, kvevict::scoring_params{}), false,
                               &w);
    on_workspace(w.partials);
  }
  const auto q = kvevict::contiguous_queries<const float>(queries.get(), p.hq(), 1, p.d, pos.get());
  const auto k = kvevict::hf_contiguous<const float>(keys.get(), p.hkv, p.tokens, p.d);
  const kvevict::status st =
      kvevict::cuda::decode_observation(q, k, params, {state.get(), p.hkv, p.tokens, p.tokens}, {ws.get(), bytes});
  REQUIRE(st.ok());
  return state.host();
}

}  // namespace

// Bug 5: every block of the update kernel re-combined all of its heads' softmax partials,
// O(L^2 / tile^2) work and traffic (4 GiB at a million tokens). The partials are now folded
// once per query head by a row-LSE kernel, and the update kernel never reads them.
TEST_CASE("decode: the tile partials are folded once per query head, not per update block", "[cuda_sim_regression]") {
  namespace kd = kvevict::cuda::detail;
  const decode_problem p;
  const auto kh = test::normal(static_cast<std::size_t>(p.hkv * p.tokens * p.d), 5);
  const auto qh = test::normal(static_cast<std::size_t>(p.hq() * p.d), 6, 1.5);
  std::vector<float> kf(kh.begin(), kh.end()), qf(qh.begin(), qh.end());
  cudasim::clear_launch_log();
  const std::vector<float> reference = decode_step(p, kf, qf);
  const auto log = cudasim::launch_log();
  REQUIRE(log.size() == 3);
  REQUIRE(log[0].kernel == reinterpret_cast<std::uintptr_t>(&kd::decode_logits_kernel<float, float, 4, 4, false>));
  REQUIRE(log[1].kernel == reinterpret_cast<std::uintptr_t>(&kd::row_lse_kernel<>));
  REQUIRE(log[1].grid.x * log[1].grid.y == static_cast<unsigned>(kd::ceil_div(p.hq(), 8)));
  REQUIRE(log[2].kernel == reinterpret_cast<std::uintptr_t>(&kd::decode_update_kernel<float, float>));

  // Overwrite the partials with NaN once the row LSEs exist: the state must not change.
  kd::softmax_partial* partials = nullptr;
  const std::size_t tiles = static_cast<std::size_t>(kd::num_tiles(p.tokens, kd::decode_tile_keys));
  bool poisoned = false;
  cudasim::set_after_launch_hook([&](const cudasim::launch_record& r) {
    if (r.kernel != reinterpret_cast<std::uintptr_t>(&kd::row_lse_kernel<>)) return;
    REQUIRE(cudaMemset(partials, 0xff, static_cast<std::size_t>(p.hq()) * tiles * sizeof(kd::softmax_partial)) ==
            cudaSuccess);
    poisoned = true;
  });
  const std::vector<float> after = decode_step(p, kf, qf, [&](kd::softmax_partial* at) { partials = at; });
  cudasim::set_after_launch_hook(nullptr);
  REQUIRE(poisoned);
  REQUIRE(std::memcmp(after.data(), reference.data(), after.size() * sizeof(float)) == 0);
}

// Bug 6a: finalize_state_scores cast the group size to int unchecked: 2^32 + 2 became 2.
TEST_CASE("finalize_state_scores rejects a group size beyond 32 bits", "[cuda_sim_regression]") {
  device_vector<float> state(8, 1.0f), scores(8, 0.0f);
  kvevict::scoring_params params;
  const auto st = kvevict::cuda::finalize_state_scores({state.get(), 1, 8, 8}, (std::int64_t{1} << 32) + 2, 1.0f,
                                                       params, {scores.get(), 1, 8, 8});
  REQUIRE(st.code() == kvevict::errc::overflow);
  REQUIRE(std::string(st.argument()) == "group");
  for (float x : scores.host()) REQUIRE(x == 0.0f);
  REQUIRE(kvevict::cuda::finalize_state_scores({state.get(), 1, 8, 8}, 2, 1.0f, params, {scores.get(), 1, 8, 8}).ok());
}

// Bug 6b: radix_key canonicalised -0 with `x += 0.0f`, which flushes denormal scores to
// zero under --use_fast_math (FTZ/DAZ): they tied with 0 and the selection differed from
// the CPU's. Emulated here with the host FPU's FTZ and DAZ bits, which the simulated
// threads share with the calling thread.
TEST_CASE("select ranks denormal scores exactly under flush-to-zero", "[cuda_sim_regression]") {
#if defined(__SSE__) || defined(__x86_64__)
  const std::int64_t rows = 2, cols = 300;
  std::vector<float> scores(static_cast<std::size_t>(rows * cols));
  std::mt19937 rng(7);
  for (auto& x : scores) {
    const float denormal = std::numeric_limits<float>::denorm_min() * static_cast<float>(rng() % 100000 + 1);
    x = (rng() % 5 == 0) ? -denormal : denormal;
    if (rng() % 17 == 0) x = rng() % 2 ? 0.0f : -0.0f;
  }
  const kvevict::selection_params params{8, kvevict::protected_mode::inside_budget};
  const std::int64_t capacity = kvevict::select_capacity(rows, cols, kvevict::budget::tokens(40), params);
  kvevict::keep_list cpu(rows, capacity);
  kvevict::workspace ws(kvevict::select_workspace_size(cols));
  REQUIRE(kvevict::select({scores.data(), rows, cols, cols}, kvevict::budget::tokens(40), params, cpu, ws).ok());

  const unsigned saved = _mm_getcsr();
  _mm_setcsr(saved | 0x8040u);  // FTZ (bit 15) and DAZ (bit 6), as --use_fast_math's code runs
  const auto g = gpu::select(scores, rows, cols, kvevict::budget::tokens(40), {}, params, capacity);
  _mm_setcsr(saved);
  REQUIRE(g.st.ok());
  for (std::int64_t i = 0; i < capacity; ++i) {
    INFO("entry " << i);
    REQUIRE(g.indices[static_cast<std::size_t>(i)] == cpu.view().indices[i]);
  }
#else
  SUCCEED("no SSE control register on this host");
#endif
}

// Bug 6c: decode_observation formed Hq * L in 64 bits before checking it against 2^31:
// signed overflow (undefined; UBSan aborts) for shapes whose views are each valid.
TEST_CASE("decode_observation's 32-bit limit check cannot overflow", "[cuda_sim_regression]") {
  device_vector<float> q(4), k(4), state(4);
  device_vector<std::int64_t> pos(1, 5);
  const std::int64_t hq = std::int64_t{1} << 33, tokens = (std::int64_t{1} << 31) - 600;
  const auto queries = kvevict::contiguous_queries<const float>(q.get(), hq, 1, 1, pos.get());
  const auto keys = kvevict::hf_contiguous<const float>(k.get(), 1, tokens, 1);
  const auto st = kvevict::cuda::decode_observation(queries, keys, {}, {state.get(), 1, tokens, tokens}, {}, {});
  REQUIRE(st.code() == kvevict::errc::overflow);
}

// Bug 6d: mapped host memory was accepted whenever it had any device pointer, without
// checking that the device pointer is the pointer the kernels will dereference.
TEST_CASE("registered host memory whose device pointer differs is rejected", "[cuda_sim_regression]") {
  const std::int64_t hkv = 1, hq = 2, d = 16, tokens = 32, w = 2;
  std::vector<float> keys_host(static_cast<std::size_t>(hkv * tokens * d), 0.25f);
  device_vector<float> q(static_cast<std::size_t>(hq * w * d), 0.5f), scores(static_cast<std::size_t>(tokens), 0.0f);
  device_vector<std::int64_t> pos(std::vector<std::int64_t>{30, 31});
  const kvevict::scoring_params params;
  const std::size_t bytes = kvevict::cuda::observation_scores_workspace_size({hq, hkv, d, tokens, w}, params);
  device_vector<unsigned char> ws(bytes);
  const auto queries = kvevict::contiguous_queries<const float>(q.get(), hq, w, d, pos.get());
  const cudasim::device_profile saved = cudasim::get_device_profile();
  for (bool same : {false, true}) {
    cudasim::device_profile prof = saved;
    prof.host_pointer_for_registered_memory = same;
    cudasim::set_device_profile(prof);
    REQUIRE(cudaHostRegister(keys_host.data(), keys_host.size() * sizeof(float), cudaHostRegisterMapped) ==
            cudaSuccess);
    const auto keys = kvevict::hf_contiguous<const float>(keys_host.data(), hkv, tokens, d);
    const auto st = kvevict::cuda::observation_scores(queries, keys, params, {scores.get(), hkv, tokens, tokens},
                                                      {ws.get(), bytes});
    REQUIRE(cudaHostUnregister(keys_host.data()) == cudaSuccess);
    INFO("host pointer usable on the device: " << same << "; " << st.message());
    if (same) {
      REQUIRE(st.ok());  // mapped memory the kernels can use as it is
    } else {
      REQUIRE(st.code() == kvevict::errc::invalid_argument);
      REQUIRE(std::string(st.argument()) == "keys.data");
    }
  }
  cudasim::set_device_profile(saved);
}
