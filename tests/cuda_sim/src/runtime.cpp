// The simulator's CUDA runtime: device memory (host memory in a registry, so pointer
// queries tell the truth and copies check direction and bounds), errors, the device's
// properties and limits, per-kernel attributes (cudaFuncSetAttribute recorded and enforced),
// synchronous streams with graph capture, events, and the checks every launch gets before
// the scheduler runs it.
//
// Under ASan, device allocations are poisoned whenever no kernel runs: host code that
// dereferences a device pointer (which faults on a GPU) is reported as a use-after-poison.
#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <vector>

#include "cuda_runtime.h"
#include "cuda_sim/sim.hpp"
#include "internal.hpp"
#include "sanitizers.hpp"

namespace cudasim {
namespace detail {
namespace {

// ---- device profile ----------------------------------------------------------------------

device_profile default_profile() {
  device_profile p{};
  const char* which = std::getenv("CUDA_SIM_DEVICE");
  const bool a100 = which != nullptr && std::strcmp(which, "a100") == 0;
  std::snprintf(p.name, sizeof(p.name), "kvevict CUDA simulator (%s limits, sm_%d0)", a100 ? "A100" : "H100",
                a100 ? 8 : 9);
  p.major = a100 ? 8 : 9;
  p.minor = 0;
  p.multiprocessors = a100 ? 108 : 132;
  p.shared_per_block = 48 * 1024;
  p.shared_per_block_optin = a100 ? 166912 : 232448;
  p.shared_per_multiprocessor = a100 ? 167936 : 233472;
  p.global_memory = static_cast<std::size_t>(80) << 30;
  p.l2_bytes = a100 ? 40 << 20 : 50 << 20;
  p.host_pointer_for_registered_memory = true;
  return p;
}

std::mutex g_profile_mutex;
device_profile& profile_locked() {
  static device_profile p = default_profile();
  return p;
}
device_profile profile() {
  std::lock_guard<std::mutex> lock(g_profile_mutex);
  return profile_locked();
}

// ---- errors ------------------------------------------------------------------------------

thread_local cudaError_t t_last_error = cudaSuccess;

void warn(const char* format, ...) __attribute__((format(printf, 1, 2)));
void warn(const char* format, ...) {
  std::fprintf(stderr, "cudasim: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, "\n");
}

// ---- memory registry ---------------------------------------------------------------------

enum class memory_kind { device, managed, pinned_host, registered_host };

struct allocation {
  std::uintptr_t base = 0;
  std::size_t bytes = 0;
  memory_kind kind = memory_kind::device;
  std::uintptr_t device_alias = 0;  // registered host memory: its device address
};

std::mutex g_memory_mutex;
std::map<std::uintptr_t, allocation> g_allocations;  // by base address
unsigned g_kernels_running = 0;                      // under g_memory_mutex

// Registered host memory on a device that cannot use host pointers gets device addresses
// in a reserved, inaccessible range: nothing else lives there, and a dereference faults, as
// it would on the host for a device address.
std::uintptr_t reserve_alias(std::size_t bytes) {
  void* p = mmap(nullptr, bytes, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  return p == MAP_FAILED ? 0 : reinterpret_cast<std::uintptr_t>(p);
}

const allocation* find_locked(const void* p) {
  const auto a = reinterpret_cast<std::uintptr_t>(p);
  auto it = g_allocations.upper_bound(a);
  if (it == g_allocations.begin()) return nullptr;
  --it;
  const allocation& x = it->second;
  return a < x.base + (x.bytes == 0 ? 1 : x.bytes) ? &x : nullptr;
}

bool device_only(const allocation* a) {
  return a != nullptr && a->kind == memory_kind::device;
}
bool device_accessible(const allocation* a) {
  return a != nullptr && a->kind != memory_kind::registered_host;
}

void poison_device_memory_locked(bool poison) {
  if (!asan_active()) return;
  for (const auto& e : g_allocations)
    if (e.second.kind == memory_kind::device) {
      if (poison) {
        asan_poison(reinterpret_cast<void*>(e.second.base), e.second.bytes);
      } else {
        asan_unpoison(reinterpret_cast<void*>(e.second.base), e.second.bytes);
      }
    }
}

cudaError_t allocate(void** out, std::size_t bytes, memory_kind kind, const char* fn) {
  if (out == nullptr) return record_error(cudaErrorInvalidValue);
  *out = nullptr;
  if (bytes == 0) return cudaSuccess;
  if (in_kernel()) fatal("%s called from device code", fn);
  void* p = nullptr;
  // Exactly `bytes` (an overrun is a heap-buffer-overflow under ASan), 256-byte aligned like
  // cudaMalloc, filled with a pattern instead of zeroes so that unwritten output shows.
  if (posix_memalign(&p, 256, bytes) != 0) return record_error(cudaErrorMemoryAllocation);
  std::memset(p, 0xa5, bytes);
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  allocation a;
  a.base = reinterpret_cast<std::uintptr_t>(p);
  a.bytes = bytes;
  a.kind = kind;
  g_allocations[a.base] = a;
  if (kind == memory_kind::device && g_kernels_running == 0) asan_poison(p, bytes);
  *out = p;
  return cudaSuccess;
}

cudaError_t release(void* p, bool host, const char* fn) {
  if (p == nullptr) return cudaSuccess;
  if (in_kernel()) fatal("%s called from device code", fn);
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  auto it = g_allocations.find(reinterpret_cast<std::uintptr_t>(p));
  const bool host_kind = it != g_allocations.end() && it->second.kind == memory_kind::pinned_host;
  const bool device_kind =
      it != g_allocations.end() && (it->second.kind == memory_kind::device || it->second.kind == memory_kind::managed);
  if ((host && !host_kind) || (!host && !device_kind)) {
    warn("%s(%p): not the start of a live %s allocation", fn, p, host ? "cudaMallocHost/cudaHostAlloc" : "device");
    return record_error(cudaErrorInvalidValue);
  }
  asan_unpoison(p, it->second.bytes);
  g_allocations.erase(it);
  std::free(p);
  return cudaSuccess;
}

/// Checks [p, p + bytes) against the registry for one side of a copy or memset.
bool check_range(const void* p, std::size_t bytes, bool want_device, const char* fn, const char* side) {
  const allocation* a = find_locked(p);
  if (want_device) {
    if (!device_accessible(a)) {
      warn("%s: the %s %p is not device memory (cudaMalloc/cudaMallocManaged/pinned host)", fn, side, p);
      return false;
    }
    if (reinterpret_cast<std::uintptr_t>(p) + bytes > a->base + a->bytes) {
      warn("%s: %zu bytes at the %s %p run past its %zu-byte allocation at %p", fn, bytes, side, p, a->bytes,
           reinterpret_cast<void*>(a->base));
      return false;
    }
    return true;
  }
  if (device_only(a)) {
    warn("%s: the %s %p is device memory, but the copy's kind says host", fn, side, p);
    return false;
  }
  return true;
}

/// memcpy/memset with the device allocations involved unpoisoned for the duration.
void with_unpoisoned_locked(const void* a, const void* b, const std::function<void()>& f) {
  const allocation* x = find_locked(a);
  const allocation* y = b != nullptr ? find_locked(b) : nullptr;
  if (device_only(x)) asan_unpoison(reinterpret_cast<void*>(x->base), x->bytes);
  if (device_only(y)) asan_unpoison(reinterpret_cast<void*>(y->base), y->bytes);
  f();
  if (g_kernels_running == 0) {
    if (device_only(x)) asan_poison(reinterpret_cast<void*>(x->base), x->bytes);
    if (device_only(y)) asan_poison(reinterpret_cast<void*>(y->base), y->bytes);
  }
}

// ---- kernels' attributes -----------------------------------------------------------------

struct function_info {
  int max_dynamic_shared = -1;    // -1: never set (the default limit applies)
  std::size_t static_shared = 0;  // learned from launches
  bool launched = false;
};
std::mutex g_function_mutex;
std::map<std::uintptr_t, function_info> g_functions;

// ---- streams, events, graphs -------------------------------------------------------------

struct recorded_op {
  enum class kind { kernel, memset, memcpy } what = kind::kernel;
  kernel_launch launch;
  void* payload = nullptr;  // owned copy of the kernel's arguments
  void* ptr = nullptr;
  const void* src = nullptr;
  int value = 0;
  std::size_t bytes = 0;
  cudaMemcpyKind copy_kind = cudaMemcpyDefault;
};

void destroy_ops(std::vector<recorded_op>& ops) {
  for (recorded_op& op : ops)
    if (op.payload != nullptr) op.launch.destroy_payload(op.payload);
  ops.clear();
}

}  // namespace
}  // namespace detail
}  // namespace cudasim

struct CUstream_st {
  unsigned flags = 0;
  bool capturing = false;
  bool capture_invalidated = false;
  cudaStreamCaptureMode capture_mode = cudaStreamCaptureModeGlobal;
  std::vector<cudasim::detail::recorded_op> captured;
};
struct CUevent_st {
  std::chrono::steady_clock::time_point time{};
  bool recorded = false;
};
struct CUgraph_st {
  std::vector<cudasim::detail::recorded_op> ops;
};
struct CUgraphExec_st {
  std::vector<cudasim::detail::recorded_op> ops;
};

namespace cudasim {
namespace detail {
namespace {

std::mutex g_stream_mutex;
std::set<cudaStream_t> g_streams;
std::set<cudaEvent_t> g_events;
unsigned g_global_captures = 0;  // streams capturing in global mode

bool valid_stream_locked(cudaStream_t s) {
  return s == nullptr || s == cudaStreamLegacy || s == cudaStreamPerThread || g_streams.count(s) != 0;
}
cudaStream_t capturing_stream_locked(cudaStream_t s) {
  return (s != nullptr && s != cudaStreamLegacy && s != cudaStreamPerThread && s->capturing) ? s : nullptr;
}

/// A synchronous call (or one on the legacy stream) while a global-mode capture is open
/// invalidates the capture, as the driver does.
cudaError_t check_no_global_capture(const char* fn) {
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (g_global_captures == 0) return cudaSuccess;
  for (cudaStream_t s : g_streams)
    if (s->capturing && s->capture_mode == cudaStreamCaptureModeGlobal) s->capture_invalidated = true;
  warn("%s during a global-mode stream capture: not permitted, the capture is invalidated", fn);
  return record_error(cudaErrorStreamCaptureImplicit);
}

std::vector<launch_record>& launch_log_ref() {
  thread_local std::vector<launch_record> log;
  return log;
}
std::function<void(const launch_record&)>& after_launch_hook_ref() {
  thread_local std::function<void(const launch_record&)> hook;
  return hook;
}

cudaError_t execute_launch(const kernel_launch& l) {
  const device_profile dev = profile();
  std::size_t known_static = 0;
  {
    std::lock_guard<std::mutex> lock(g_function_mutex);
    const function_info& f = g_functions[l.kernel];
    known_static = f.static_shared;
    const std::size_t limit = f.max_dynamic_shared >= 0
                                  ? static_cast<std::size_t>(f.max_dynamic_shared)
                                  : dev.shared_per_block - std::min(known_static, dev.shared_per_block);
    if (l.dynamic_smem > limit) {
      warn("a launch asks for %zu bytes of dynamic shared memory; the kernel allows %zu (%s)", l.dynamic_smem, limit,
           f.max_dynamic_shared >= 0 ? "its cudaFuncAttributeMaxDynamicSharedMemorySize"
                                     : "the default 48 KiB: raise it with cudaFuncSetAttribute");
      return record_error(cudaErrorInvalidValue);
    }
  }
  {
    std::lock_guard<std::mutex> lock(g_memory_mutex);
    if (g_kernels_running++ == 0) poison_device_memory_locked(false);
  }
  const std::size_t static_bytes = run_grid(l, dev.shared_per_block_optin);
  {
    std::lock_guard<std::mutex> lock(g_memory_mutex);
    if (--g_kernels_running == 0) poison_device_memory_locked(true);
  }
  {
    std::lock_guard<std::mutex> lock(g_function_mutex);
    function_info& f = g_functions[l.kernel];
    f.static_shared = std::max(f.static_shared, static_bytes);
    f.launched = true;
  }
  launch_record r;
  r.kernel = l.kernel;
  r.grid = l.grid;
  r.block = l.block;
  r.dynamic_smem = l.dynamic_smem;
  r.static_smem = static_bytes;
  r.stream = l.stream;
  launch_log_ref().push_back(r);
  if (after_launch_hook_ref()) after_launch_hook_ref()(r);
  return cudaSuccess;
}

cudaError_t do_memset(void* p, int value, std::size_t bytes, const char* fn) {
  if (bytes == 0) return cudaSuccess;
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  if (!check_range(p, bytes, true, fn, "destination")) return record_error(cudaErrorInvalidValue);
  with_unpoisoned_locked(p, nullptr, [&] { std::memset(p, value, bytes); });
  return cudaSuccess;
}

cudaError_t do_memcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind, const char* fn) {
  if (bytes == 0) return cudaSuccess;
  if (dst == nullptr || src == nullptr) return record_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  bool dst_device = false, src_device = false;
  switch (kind) {
    case cudaMemcpyHostToHost:
      break;
    case cudaMemcpyHostToDevice:
      dst_device = true;
      break;
    case cudaMemcpyDeviceToHost:
      src_device = true;
      break;
    case cudaMemcpyDeviceToDevice:
      dst_device = src_device = true;
      break;
    case cudaMemcpyDefault:
      dst_device = device_accessible(find_locked(dst)) && find_locked(dst)->kind == memory_kind::device;
      src_device = device_accessible(find_locked(src)) && find_locked(src)->kind == memory_kind::device;
      break;
    default:
      return record_error(cudaErrorInvalidMemcpyDirection);
  }
  if (!check_range(dst, bytes, dst_device, fn, "destination") || !check_range(src, bytes, src_device, fn, "source"))
    return record_error(cudaErrorInvalidValue);
  with_unpoisoned_locked(dst, src, [&] { std::memcpy(dst, src, bytes); });
  return cudaSuccess;
}

/// Runs or (on a capturing stream) records one operation.
cudaError_t enqueue(cudaStream_t stream, recorded_op op, const char* fn) {
  {
    std::lock_guard<std::mutex> lock(g_stream_mutex);
    if (!valid_stream_locked(stream)) {
      warn("%s: %p is not a live stream", fn, static_cast<void*>(stream));
      return record_error(cudaErrorInvalidResourceHandle);
    }
    if (cudaStream_t s = capturing_stream_locked(stream)) {
      if (op.what == recorded_op::kind::kernel) op.payload = op.launch.clone_payload(op.launch.payload);
      s->captured.push_back(op);
      return cudaSuccess;
    }
  }
  if ((stream == nullptr || stream == cudaStreamLegacy) && op.what != recorded_op::kind::kernel)
    if (check_no_global_capture(fn) != cudaSuccess) return cudaErrorStreamCaptureImplicit;
  switch (op.what) {
    case recorded_op::kind::kernel:
      return execute_launch(op.launch);
    case recorded_op::kind::memset:
      return do_memset(op.ptr, op.value, op.bytes, fn);
    case recorded_op::kind::memcpy:
      return do_memcpy(op.ptr, op.src, op.bytes, op.copy_kind, fn);
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t record_error(cudaError_t err) noexcept {
  if (err != cudaSuccess) t_last_error = err;
  return err;
}

cudaError_t launch(const kernel_launch& l) noexcept {
  if (in_kernel()) fatal("a kernel launched a kernel (dynamic parallelism is not simulated)");
  const device_profile dev = profile();
  const dim3 b = l.block, g = l.grid;
  const unsigned long long threads = static_cast<unsigned long long>(b.x) * b.y * b.z;
  if (b.x == 0 || b.y == 0 || b.z == 0 || b.x > 1024 || b.y > 1024 || b.z > 64 || threads > 1024) {
    warn(
        "a launch with block (%u,%u,%u): each dimension must be >= 1 (x, y <= 1024, z <= 64) and the block at most "
        "1024 threads",
        b.x, b.y, b.z);
    return record_error(cudaErrorInvalidConfiguration);
  }
  if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 2147483647u || g.y > 65535 || g.z > 65535) {
    warn("a launch with grid (%u,%u,%u): x must be in [1, 2^31 - 1], y and z in [1, 65535]", g.x, g.y, g.z);
    return record_error(cudaErrorInvalidConfiguration);
  }
  if (l.dynamic_smem > dev.shared_per_block_optin) {
    warn("a launch asks for %zu bytes of dynamic shared memory; the device has %zu per block", l.dynamic_smem,
         dev.shared_per_block_optin);
    return record_error(cudaErrorInvalidValue);
  }
  recorded_op op;
  op.what = recorded_op::kind::kernel;
  op.launch = l;
  return enqueue(l.stream, op, "kernel launch");
}

cudaError_t func_set_attribute(const void* kernel_ptr, cudaFuncAttribute attr, int value) noexcept {
  const auto kernel = reinterpret_cast<std::uintptr_t>(kernel_ptr);
  if (kernel == 0) return record_error(cudaErrorInvalidDeviceFunction);
  const device_profile dev = profile();
  std::lock_guard<std::mutex> lock(g_function_mutex);
  function_info& f = g_functions[kernel];
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    // The driver's rule: static + this limit <= the opt-in maximum. The static size is known
    // once the kernel has run in this process.
    if (value < 0 || static_cast<std::size_t>(value) + f.static_shared > dev.shared_per_block_optin) {
      warn(
          "cudaFuncSetAttribute(MaxDynamicSharedMemorySize, %d): with %zu bytes of static shared memory the "
          "device allows at most %zu",
          value, f.static_shared, dev.shared_per_block_optin - f.static_shared);
      return record_error(cudaErrorInvalidValue);
    }
    f.max_dynamic_shared = value;
    return cudaSuccess;
  }
  if (attr == cudaFuncAttributePreferredSharedMemoryCarveout) {
    if (value < -1 || value > 100) return record_error(cudaErrorInvalidValue);
    return cudaSuccess;
  }
  return record_error(cudaErrorInvalidValue);
}

cudaError_t func_get_attributes(cudaFuncAttributes* attr, const void* kernel_ptr) noexcept {
  const auto kernel = reinterpret_cast<std::uintptr_t>(kernel_ptr);
  if (attr == nullptr || kernel == 0) return record_error(cudaErrorInvalidValue);
  const device_profile dev = profile();
  std::lock_guard<std::mutex> lock(g_function_mutex);
  const function_info& f = g_functions[kernel];
  *attr = cudaFuncAttributes{};
  attr->sharedSizeBytes = f.static_shared;
  attr->maxThreadsPerBlock = 1024;
  attr->ptxVersion = dev.major * 10 + dev.minor;
  attr->binaryVersion = attr->ptxVersion;
  attr->maxDynamicSharedSizeBytes =
      f.max_dynamic_shared >= 0
          ? f.max_dynamic_shared
          : static_cast<int>(dev.shared_per_block - std::min(f.static_shared, dev.shared_per_block));
  attr->preferredShmemCarveout = -1;
  return cudaSuccess;
}

}  // namespace detail

std::vector<launch_record> launch_log() {
  return detail::launch_log_ref();
}
void clear_launch_log() {
  detail::launch_log_ref().clear();
}
void set_after_launch_hook(std::function<void(const launch_record&)> hook) {
  detail::after_launch_hook_ref() = std::move(hook);
}
device_profile get_device_profile() {
  return detail::profile();
}
void set_device_profile(const device_profile& p) {
  std::lock_guard<std::mutex> lock(detail::g_profile_mutex);
  detail::profile_locked() = p;
}

}  // namespace cudasim

using cudasim::detail::record_error;

// ---- errors and devices ------------------------------------------------------------------

cudaError_t cudaGetLastError() noexcept {
  const cudaError_t e = cudasim::detail::t_last_error;
  cudasim::detail::t_last_error = cudaSuccess;
  return e;
}
cudaError_t cudaPeekAtLastError() noexcept {
  return cudasim::detail::t_last_error;
}

const char* cudaGetErrorName(cudaError_t err) noexcept {
  switch (err) {
#define CUDA_SIM_NAME(e) \
  case e:                \
    return #e;
    CUDA_SIM_NAME(cudaSuccess)
    CUDA_SIM_NAME(cudaErrorInvalidValue)
    CUDA_SIM_NAME(cudaErrorMemoryAllocation)
    CUDA_SIM_NAME(cudaErrorInitializationError)
    CUDA_SIM_NAME(cudaErrorInvalidConfiguration)
    CUDA_SIM_NAME(cudaErrorInvalidSymbol)
    CUDA_SIM_NAME(cudaErrorInvalidDevicePointer)
    CUDA_SIM_NAME(cudaErrorInvalidMemcpyDirection)
    CUDA_SIM_NAME(cudaErrorInvalidDeviceFunction)
    CUDA_SIM_NAME(cudaErrorNoDevice)
    CUDA_SIM_NAME(cudaErrorInvalidDevice)
    CUDA_SIM_NAME(cudaErrorInvalidResourceHandle)
    CUDA_SIM_NAME(cudaErrorNotReady)
    CUDA_SIM_NAME(cudaErrorIllegalAddress)
    CUDA_SIM_NAME(cudaErrorLaunchOutOfResources)
    CUDA_SIM_NAME(cudaErrorLaunchFailure)
    CUDA_SIM_NAME(cudaErrorNotSupported)
    CUDA_SIM_NAME(cudaErrorStreamCaptureUnsupported)
    CUDA_SIM_NAME(cudaErrorStreamCaptureInvalidated)
    CUDA_SIM_NAME(cudaErrorStreamCaptureUnmatched)
    CUDA_SIM_NAME(cudaErrorStreamCaptureUnjoined)
    CUDA_SIM_NAME(cudaErrorStreamCaptureImplicit)
    CUDA_SIM_NAME(cudaErrorUnknown)
#undef CUDA_SIM_NAME
  }
  return "cudaErrorUnknown";
}

const char* cudaGetErrorString(cudaError_t err) noexcept {
  switch (err) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorInvalidDevicePointer:
      return "invalid device pointer";
    case cudaErrorInvalidMemcpyDirection:
      return "invalid copy direction for memcpy";
    case cudaErrorInvalidDeviceFunction:
      return "invalid device function";
    case cudaErrorInvalidDevice:
      return "invalid device ordinal";
    case cudaErrorInvalidResourceHandle:
      return "invalid resource handle";
    case cudaErrorNotSupported:
      return "operation not supported";
    case cudaErrorStreamCaptureImplicit:
      return "operation would make the legacy stream depend on a capturing blocking stream";
    case cudaErrorStreamCaptureInvalidated:
      return "operation failed due to a previous error during capture";
    case cudaErrorStreamCaptureUnsupported:
      return "operation not permitted when stream is capturing";
    default:
      return cudaGetErrorName(err);
  }
}

cudaError_t cudaGetDeviceCount(int* count) noexcept {
  if (count == nullptr) return record_error(cudaErrorInvalidValue);
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) noexcept {
  if (device == nullptr) return record_error(cudaErrorInvalidValue);
  *device = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) noexcept {
  return device == 0 ? cudaSuccess : record_error(cudaErrorInvalidDevice);
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) noexcept {
  if (prop == nullptr) return record_error(cudaErrorInvalidValue);
  if (device != 0) return record_error(cudaErrorInvalidDevice);
  const cudasim::device_profile d = cudasim::get_device_profile();
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof(prop->name), "%s", d.name);
  prop->totalGlobalMem = d.global_memory;
  prop->sharedMemPerBlock = d.shared_per_block;
  prop->sharedMemPerBlockOptin = d.shared_per_block_optin;
  prop->sharedMemPerMultiprocessor = d.shared_per_multiprocessor;
  prop->regsPerBlock = 65536;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  prop->maxThreadsDim[0] = 1024;
  prop->maxThreadsDim[1] = 1024;
  prop->maxThreadsDim[2] = 64;
  prop->maxGridSize[0] = 2147483647;
  prop->maxGridSize[1] = 65535;
  prop->maxGridSize[2] = 65535;
  prop->multiProcessorCount = d.multiprocessors;
  prop->major = d.major;
  prop->minor = d.minor;
  prop->l2CacheSize = d.l2_bytes;
  prop->unifiedAddressing = 1;
  prop->managedMemory = 1;
  prop->canUseHostPointerForRegisteredMem = d.host_pointer_for_registered_memory ? 1 : 0;
  return cudaSuccess;
}

cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) noexcept {
  if (value == nullptr) return record_error(cudaErrorInvalidValue);
  if (device != 0) return record_error(cudaErrorInvalidDevice);
  const cudasim::device_profile d = cudasim::get_device_profile();
  switch (attr) {
    case cudaDevAttrMaxThreadsPerBlock:
    case cudaDevAttrMaxBlockDimX:
    case cudaDevAttrMaxBlockDimY:
      *value = 1024;
      return cudaSuccess;
    case cudaDevAttrMaxBlockDimZ:
      *value = 64;
      return cudaSuccess;
    case cudaDevAttrMaxGridDimX:
      *value = 2147483647;
      return cudaSuccess;
    case cudaDevAttrMaxGridDimY:
    case cudaDevAttrMaxGridDimZ:
      *value = 65535;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlock:
      *value = static_cast<int>(d.shared_per_block);
      return cudaSuccess;
    case cudaDevAttrWarpSize:
      *value = 32;
      return cudaSuccess;
    case cudaDevAttrMultiProcessorCount:
      *value = d.multiprocessors;
      return cudaSuccess;
    case cudaDevAttrL2CacheSize:
      *value = d.l2_bytes;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMajor:
      *value = d.major;
      return cudaSuccess;
    case cudaDevAttrComputeCapabilityMinor:
      *value = d.minor;
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *value = static_cast<int>(d.shared_per_multiprocessor);
      return cudaSuccess;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *value = static_cast<int>(d.shared_per_block_optin);
      return cudaSuccess;
  }
  return record_error(cudaErrorInvalidValue);
}

cudaError_t cudaDeviceSynchronize() noexcept {
  return cudasim::detail::check_no_global_capture("cudaDeviceSynchronize");
}

// ---- memory ------------------------------------------------------------------------------

cudaError_t cudaMalloc(void** ptr, std::size_t bytes) noexcept {
  if (cudasim::detail::check_no_global_capture("cudaMalloc") != cudaSuccess) return cudaErrorStreamCaptureImplicit;
  return cudasim::detail::allocate(ptr, bytes, cudasim::detail::memory_kind::device, "cudaMalloc");
}
cudaError_t cudaMallocManaged(void** ptr, std::size_t bytes, unsigned) noexcept {
  return cudasim::detail::allocate(ptr, bytes, cudasim::detail::memory_kind::managed, "cudaMallocManaged");
}
cudaError_t cudaMallocHost(void** ptr, std::size_t bytes) noexcept {
  return cudasim::detail::allocate(ptr, bytes, cudasim::detail::memory_kind::pinned_host, "cudaMallocHost");
}
cudaError_t cudaHostAlloc(void** ptr, std::size_t bytes, unsigned) noexcept {
  return cudasim::detail::allocate(ptr, bytes, cudasim::detail::memory_kind::pinned_host, "cudaHostAlloc");
}
cudaError_t cudaFree(void* ptr) noexcept {
  return cudasim::detail::release(ptr, false, "cudaFree");
}
cudaError_t cudaFreeHost(void* ptr) noexcept {
  return cudasim::detail::release(ptr, true, "cudaFreeHost");
}

cudaError_t cudaHostRegister(void* ptr, std::size_t bytes, unsigned) noexcept {
  using namespace cudasim::detail;
  if (ptr == nullptr || bytes == 0) return record_error(cudaErrorInvalidValue);
  const bool host_pointer = cudasim::get_device_profile().host_pointer_for_registered_memory;
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  if (find_locked(ptr) != nullptr) {
    warn("cudaHostRegister(%p): already registered or allocated by the runtime", ptr);
    return record_error(cudaErrorInvalidValue);
  }
  allocation a;
  a.base = reinterpret_cast<std::uintptr_t>(ptr);
  a.bytes = bytes;
  a.kind = memory_kind::registered_host;
  a.device_alias = host_pointer ? a.base : reserve_alias(bytes);
  if (a.device_alias == 0) return record_error(cudaErrorMemoryAllocation);
  g_allocations[a.base] = a;
  return cudaSuccess;
}
cudaError_t cudaHostUnregister(void* ptr) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  auto it = g_allocations.find(reinterpret_cast<std::uintptr_t>(ptr));
  if (it == g_allocations.end() || it->second.kind != memory_kind::registered_host)
    return record_error(cudaErrorInvalidValue);
  if (it->second.device_alias != it->second.base)
    munmap(reinterpret_cast<void*>(it->second.device_alias), it->second.bytes);
  g_allocations.erase(it);
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void** device_ptr, void* host_ptr, unsigned) noexcept {
  using namespace cudasim::detail;
  if (device_ptr == nullptr) return record_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  const allocation* a = find_locked(host_ptr);
  if (a == nullptr || (a->kind != memory_kind::pinned_host && a->kind != memory_kind::registered_host))
    return record_error(cudaErrorInvalidValue);
  const std::uintptr_t offset = reinterpret_cast<std::uintptr_t>(host_ptr) - a->base;
  const std::uintptr_t base = a->kind == memory_kind::registered_host ? a->device_alias : a->base;
  *device_ptr = reinterpret_cast<void*>(base + offset);
  return cudaSuccess;
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes* attr, const void* ptr) noexcept {
  using namespace cudasim::detail;
  if (attr == nullptr) return record_error(cudaErrorInvalidValue);
  *attr = cudaPointerAttributes{cudaMemoryTypeUnregistered, 0, nullptr, nullptr};
  std::lock_guard<std::mutex> lock(g_memory_mutex);
  const allocation* a = find_locked(ptr);
  if (a == nullptr) {
    // A device address of registered host memory (a device that cannot use host pointers).
    const auto p = reinterpret_cast<std::uintptr_t>(ptr);
    for (const auto& e : g_allocations) {
      const allocation& r = e.second;
      if (r.kind == memory_kind::registered_host && r.device_alias != r.base && p >= r.device_alias &&
          p < r.device_alias + r.bytes) {
        attr->type = cudaMemoryTypeHost;
        attr->devicePointer = const_cast<void*>(ptr);
        attr->hostPointer = reinterpret_cast<void*>(r.base + (p - r.device_alias));
        return cudaSuccess;
      }
    }
    return cudaSuccess;  // CUDA 11+: unregistered host memory is not an error
  }
  void* p = const_cast<void*>(ptr);
  const std::uintptr_t offset = reinterpret_cast<std::uintptr_t>(ptr) - a->base;
  switch (a->kind) {
    case memory_kind::device:
      attr->type = cudaMemoryTypeDevice;
      attr->devicePointer = p;
      break;
    case memory_kind::managed:
      attr->type = cudaMemoryTypeManaged;
      attr->devicePointer = p;
      attr->hostPointer = p;
      break;
    case memory_kind::pinned_host:
      attr->type = cudaMemoryTypeHost;
      attr->devicePointer = p;
      attr->hostPointer = p;
      break;
    case memory_kind::registered_host:
      attr->type = cudaMemoryTypeHost;
      attr->devicePointer = reinterpret_cast<void*>(a->device_alias + offset);
      attr->hostPointer = p;
      break;
  }
  return cudaSuccess;
}

cudaError_t cudaMemcpy(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind) noexcept {
  using namespace cudasim::detail;
  if (in_kernel()) fatal("cudaMemcpy called from device code");
  recorded_op op;
  op.what = recorded_op::kind::memcpy;
  op.ptr = dst;
  op.src = src;
  op.bytes = bytes;
  op.copy_kind = kind;
  return enqueue(nullptr, op, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, std::size_t bytes, cudaMemcpyKind kind,
                            cudaStream_t stream) noexcept {
  using namespace cudasim::detail;
  if (in_kernel()) fatal("cudaMemcpyAsync called from device code");
  recorded_op op;
  op.what = recorded_op::kind::memcpy;
  op.ptr = dst;
  op.src = src;
  op.bytes = bytes;
  op.copy_kind = kind;
  return enqueue(stream, op, "cudaMemcpyAsync");
}
cudaError_t cudaMemset(void* ptr, int value, std::size_t bytes) noexcept {
  return cudaMemsetAsync(ptr, value, bytes, nullptr);
}
cudaError_t cudaMemsetAsync(void* ptr, int value, std::size_t bytes, cudaStream_t stream) noexcept {
  using namespace cudasim::detail;
  if (in_kernel()) fatal("cudaMemsetAsync called from device code");
  recorded_op op;
  op.what = recorded_op::kind::memset;
  op.ptr = ptr;
  op.value = value;
  op.bytes = bytes;
  return enqueue(stream, op, "cudaMemsetAsync");
}

// ---- streams, events, graphs -------------------------------------------------------------

cudaError_t cudaStreamCreate(cudaStream_t* stream) noexcept {
  return cudaStreamCreateWithFlags(stream, 0);
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned flags) noexcept {
  using namespace cudasim::detail;
  if (stream == nullptr) return record_error(cudaErrorInvalidValue);
  auto* s = new CUstream_st();
  s->flags = flags;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  g_streams.insert(s);
  *stream = s;
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (g_streams.erase(stream) == 0) return record_error(cudaErrorInvalidResourceHandle);
  if (stream->capturing && stream->capture_mode == cudaStreamCaptureModeGlobal) --g_global_captures;
  destroy_ops(stream->captured);
  delete stream;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (!valid_stream_locked(stream)) return record_error(cudaErrorInvalidResourceHandle);
  if (cudaStream_t s = capturing_stream_locked(stream)) {
    s->capture_invalidated = true;
    warn("cudaStreamSynchronize on a capturing stream: not permitted, the capture is invalidated");
    return record_error(cudaErrorStreamCaptureUnsupported);
  }
  return cudaSuccess;  // work ran when it was enqueued
}
cudaError_t cudaStreamQuery(cudaStream_t stream) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  return valid_stream_locked(stream) ? cudaSuccess : record_error(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (!valid_stream_locked(stream) || g_events.count(event) == 0) return record_error(cudaErrorInvalidResourceHandle);
  return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* event) noexcept {
  return cudaEventCreateWithFlags(event, 0);
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned) noexcept {
  using namespace cudasim::detail;
  if (event == nullptr) return record_error(cudaErrorInvalidValue);
  auto* e = new CUevent_st();
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  g_events.insert(e);
  *event = e;
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t event) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (g_events.erase(event) == 0) return record_error(cudaErrorInvalidResourceHandle);
  delete event;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (g_events.count(event) == 0 || !valid_stream_locked(stream)) return record_error(cudaErrorInvalidResourceHandle);
  event->time = std::chrono::steady_clock::now();
  event->recorded = true;
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  return g_events.count(event) != 0 ? cudaSuccess : record_error(cudaErrorInvalidResourceHandle);
}
cudaError_t cudaEventQuery(cudaEvent_t event) noexcept {
  return cudaEventSynchronize(event);
}
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t start, cudaEvent_t end) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (ms == nullptr) return record_error(cudaErrorInvalidValue);
  if (g_events.count(start) == 0 || g_events.count(end) == 0) return record_error(cudaErrorInvalidResourceHandle);
  if (!start->recorded || !end->recorded) return record_error(cudaErrorInvalidResourceHandle);
  *ms = std::chrono::duration<float, std::milli>(end->time - start->time).count();
  return cudaSuccess;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) noexcept {
  using namespace cudasim::detail;
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (stream == nullptr || stream == cudaStreamLegacy || stream == cudaStreamPerThread || g_streams.count(stream) == 0)
    return record_error(cudaErrorStreamCaptureUnsupported);  // the legacy stream cannot be captured
  if (stream->capturing) return record_error(cudaErrorIllegalAddress);
  stream->capturing = true;
  stream->capture_invalidated = false;
  stream->capture_mode = mode;
  if (mode == cudaStreamCaptureModeGlobal) ++g_global_captures;
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t* graph) noexcept {
  using namespace cudasim::detail;
  if (graph == nullptr) return record_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (g_streams.count(stream) == 0 || !stream->capturing) return record_error(cudaErrorStreamCaptureUnmatched);
  stream->capturing = false;
  if (stream->capture_mode == cudaStreamCaptureModeGlobal) --g_global_captures;
  if (stream->capture_invalidated) {
    destroy_ops(stream->captured);
    *graph = nullptr;
    return record_error(cudaErrorStreamCaptureInvalidated);
  }
  auto* g = new CUgraph_st();
  g->ops = std::move(stream->captured);
  stream->captured.clear();
  *graph = g;
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus* status) noexcept {
  using namespace cudasim::detail;
  if (status == nullptr) return record_error(cudaErrorInvalidValue);
  std::lock_guard<std::mutex> lock(g_stream_mutex);
  if (!valid_stream_locked(stream)) return record_error(cudaErrorInvalidResourceHandle);
  const cudaStream_t s = capturing_stream_locked(stream);
  *status = s == nullptr
                ? cudaStreamCaptureStatusNone
                : (s->capture_invalidated ? cudaStreamCaptureStatusInvalidated : cudaStreamCaptureStatusActive);
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) noexcept {
  using namespace cudasim::detail;
  if (exec == nullptr || graph == nullptr) return record_error(cudaErrorInvalidValue);
  auto* e = new CUgraphExec_st();
  for (const recorded_op& op : graph->ops) {
    recorded_op copy = op;
    if (op.payload != nullptr) copy.payload = op.launch.clone_payload(op.payload);
    e->ops.push_back(copy);
  }
  *exec = e;
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t stream) noexcept {
  using namespace cudasim::detail;
  if (exec == nullptr) return record_error(cudaErrorInvalidValue);
  for (recorded_op op : exec->ops) {
    if (op.what == recorded_op::kind::kernel) {
      op.launch.payload = op.payload;
      op.launch.stream = stream;
      op.payload = nullptr;
    }
    const cudaError_t e = enqueue(stream, op, "cudaGraphLaunch");
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) noexcept {
  if (exec == nullptr) return record_error(cudaErrorInvalidValue);
  cudasim::detail::destroy_ops(exec->ops);
  delete exec;
  return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) noexcept {
  if (graph == nullptr) return record_error(cudaErrorInvalidValue);
  cudasim::detail::destroy_ops(graph->ops);
  delete graph;
  return cudaSuccess;
}
