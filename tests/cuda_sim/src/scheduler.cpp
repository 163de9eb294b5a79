// The simulator's scheduler: one fiber per CUDA thread, the blocks of a grid one after
// another on the launching host thread, __syncthreads as a block barrier, warp collectives
// resolved when every lane their mask names has arrived, and per-block shared memory.
//
// Under ThreadSanitizer this translation unit is compiled without TSan instrumentation
// (CMake adds -fno-sanitize=thread): the fiber entry never returns and the yield is
// re-entered by pooled fibers, which instrumented code would record as ever-deeper call
// stacks; and the scheduler's own bookkeeping is not an access of the simulated threads.
// Happens-before is added only where CUDA gives it: host -> every thread of a launch, each
// __syncthreads (release on arrival, acquire on leaving), __syncwarp within its mask, and
// every thread -> host at the end of the launch. Warp shuffles give none, and nothing orders
// one block after another, so a missing barrier or a cross-block race stays a race.
#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cuda_sim/device.hpp"
#include "interleave.hpp"
#include "internal.hpp"
#include "sanitizers.hpp"

#if !defined(__x86_64__) || defined(CUDA_SIM_UCONTEXT)
#define CUDA_SIM_USE_UCONTEXT 1
#include <ucontext.h>
#endif

namespace cudasim {
namespace detail {
struct fiber;
}  // namespace detail
}  // namespace cudasim

extern "C" [[noreturn]] void cudasim_fiber_main(cudasim::detail::fiber* f) noexcept;

#if !defined(CUDA_SIM_USE_UCONTEXT)
// A context switch saves the callee-saved registers on the current stack, stores the stack
// pointer, loads the other one and pops its registers: about a hundred times cheaper than
// swapcontext, which also saves the signal mask with a system call. MXCSR and the x87 control
// word are per host thread, shared by every fiber (a test that sets flush-to-zero sets it for
// its kernels too).
extern "C" void cudasim_switch(void** save_sp, void* to_sp) noexcept;
extern "C" void cudasim_fiber_start() noexcept;
asm(R"(
  .text
  .globl cudasim_switch
  .hidden cudasim_switch
  .type cudasim_switch, @function
cudasim_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size cudasim_switch, .-cudasim_switch

  .globl cudasim_fiber_start
  .hidden cudasim_fiber_start
  .type cudasim_fiber_start, @function
cudasim_fiber_start:
  .cfi_startproc
  .cfi_undefined rip
  movq %r12, %rdi
  callq *%r13
  ud2
  .cfi_endproc
  .size cudasim_fiber_start, .-cudasim_fiber_start
)");
#endif

namespace cudasim {
namespace detail {

namespace {

constexpr unsigned kMaxThreads = 1024;
constexpr unsigned kMaxWarps = kMaxThreads / 32;
constexpr std::size_t kStackBytes = 256 * 1024;
constexpr std::size_t kStaticSharedLimit = 48 * 1024;
constexpr unsigned full_warp_mask = 0xffffffffu;
// Fiber pools per host thread: as many pools of blockDim fibers as fit in kFiberBudget
// fibers, at least 2 and at most kMaxPools. Each fiber is a TSan thread: GCC's TSan runtime
// (the one CI's TSan stage links) tells 8,192 threads apart exactly, while clang 14's shares
// 256 slots among all threads, which hid races between blocks of >= 256 threads.
// Host threads that launch at once share a process budget: past it, a host thread gets 2 pools.
constexpr unsigned kMaxPools = 16;
constexpr std::size_t kFiberBudget = 2048;
constexpr std::size_t kProcessFiberBudget = 2560;
std::atomic<std::size_t> g_fiber_count{0};  // fibers of every host thread

/// Pools for a launch of `threads` per block on a host thread that owns `own` fibers.
unsigned pools_for(unsigned threads, std::size_t own) {
  const std::size_t others = g_fiber_count.load() - own;
  std::size_t budget = kFiberBudget;
  if (others + budget > kProcessFiberBudget) budget = others < kProcessFiberBudget ? kProcessFiberBudget - others : 0;
  const std::size_t p = budget / threads;
  return p < 2 ? 2u : (p > kMaxPools ? kMaxPools : static_cast<unsigned>(p));
}

struct machine_context {
#if defined(CUDA_SIM_USE_UCONTEXT)
  ucontext_t uc;
#else
  void* sp = nullptr;
#endif
};

}  // namespace

/// A pooled execution context for one CUDA thread index: its stack (with a guard page
/// below it), its TSan fiber, and ASan's fake-stack handle.
struct fiber {
  machine_context context;
  void* mapping = nullptr;
  std::size_t mapping_bytes = 0;
  const void* stack_lo = nullptr;
  std::size_t stack_bytes = 0;
  void* tsan = nullptr;
  void* asan_fake_stack = nullptr;
};

namespace {

// preempted: switched out at a memory access by the interleaving schedule; ready again in
// the block's next round.
enum class thread_state : std::uint8_t { ready, barrier, collective, preempted, done };

const char* op_name(warp_op op) {
  switch (op) {
    case warp_op::shfl:
      return "__shfl_sync";
    case warp_op::shfl_up:
      return "__shfl_up_sync";
    case warp_op::shfl_down:
      return "__shfl_down_sync";
    case warp_op::shfl_xor:
      return "__shfl_xor_sync";
    case warp_op::ballot:
      return "__ballot_sync";
    case warp_op::any:
      return "__any_sync";
    case warp_op::all:
      return "__all_sync";
    case warp_op::match_any:
      return "__match_any_sync";
    case warp_op::match_all:
      return "__match_all_sync";
    case warp_op::reduce_add:
      return "__reduce_add_sync";
    case warp_op::reduce_min_signed:
    case warp_op::reduce_min_unsigned:
      return "__reduce_min_sync";
    case warp_op::reduce_max_signed:
    case warp_op::reduce_max_unsigned:
      return "__reduce_max_sync";
    case warp_op::reduce_and:
      return "__reduce_and_sync";
    case warp_op::reduce_or:
      return "__reduce_or_sync";
    case warp_op::reduce_xor:
      return "__reduce_xor_sync";
    case warp_op::syncwarp:
      return "__syncwarp";
    case warp_op::mma_bf16:
      return "mma.sync.m16n8k16.bf16";
    case warp_op::mma_f16:
      return "mma.sync.m16n8k16.f16";
  }
  return "a warp function";
}

const char* barrier_name(barrier_op op) {
  switch (op) {
    case barrier_op::sync:
      return "__syncthreads";
    case barrier_op::count:
      return "__syncthreads_count";
    case barrier_op::all:
      return "__syncthreads_and";
    case barrier_op::any:
      return "__syncthreads_or";
  }
  return "__syncthreads";
}

bool same_site(const char* f1, int l1, const char* f2, int l2) {
  return l1 == l2 && (f1 == f2 || std::strcmp(f1, f2) == 0);
}

struct sim_thread {
  thread_state state = thread_state::ready;
  // Where the thread waits, for diagnostics.
  const char* file = "";
  int line = 0;
  warp_op op = warp_op::syncwarp;
  // This lane's contribution to the pending warp collective, and the results handed back.
  std::uint64_t value = 0;
  int param = 0;
  warp_result result{0, 0};
  int barrier_result = 0;
};

struct pending_collective {
  warp_op op = warp_op::syncwarp;
  unsigned mask = 0;
  unsigned arrived = 0;
  int bytes = 0;
  int width = 32;
  const char* file = "";
  int line = 0;
  unsigned first_lane = 0;
  char* sync = nullptr;  // __syncwarp's synchronisation word
};

struct warp_state {
  unsigned lanes = 0;   // lanes that exist (the last warp of a block may be partial)
  unsigned exited = 0;  // lanes whose thread has returned
  // Collectives in progress: their masks are disjoint (lanes 0-15 and 16-31 may each run
  // their own); a lane is in at most one.
  pending_collective pending[32];
  int num_pending = 0;
  unsigned syncwarps = 0;  // __syncwarp instances so far (picks the next word)
};

/// Synchronisation words of one block, allocated afresh per block so that TSan's clocks
/// never carry from one block to the next. Consecutive barriers (and __syncwarps) use
/// different words: a thread that has passed a barrier may release into the next one before
/// a slower thread has acquired from this one, and that slower thread must not inherit the
/// fast one's later accesses.
constexpr unsigned kBarrierWords = 4;
constexpr unsigned kSyncwarpWords = 64;
struct block_sync {
  char barrier[kBarrierWords] = {};
  char warp[kMaxWarps][kSyncwarpWords] = {};
};
/// Synchronisation words of one launch.
struct launch_sync {
  char start = 0;
  char end = 0;
};

struct static_declaration {
  const void* site;
  void* storage;
  std::size_t bytes;
};

/// One block in execution: its threads' states, warps, barrier and shared memory. A launch
/// runs one block at a time, or, when the simulator interleaves (interleave.hpp), up to
/// kMaxResident blocks at once, each on its own fiber pool.
struct block_run {
  uint3 block{0, 0, 0};
  unsigned pool = 0;  // thread t runs on fibers[pool * num_threads + t]
  bool active = false;
  unsigned exited = 0;
  unsigned preempted = 0;  // threads switched out at a memory access this round
  sim_thread threads[kMaxThreads];
  warp_state warps[kMaxWarps];
  unsigned barrier_waiting = 0;
  unsigned barriers = 0;  // completed barriers of the block (picks the next word)
  barrier_op barrier_kind = barrier_op::sync;
  const char* barrier_file = "";
  int barrier_line = 0;
  int barrier_true = 0;
  block_sync* sync = nullptr;
  void* dynamic_smem = nullptr;
  std::size_t dynamic_bytes = 0;
  std::vector<static_declaration> statics;
  std::size_t static_bytes = 0;
};

constexpr unsigned kMaxResident = 4;

struct exec_context {
  // The host thread's own context while a fiber runs.
  machine_context host;
  void* host_tsan_fiber = nullptr;
  void* host_fake_stack = nullptr;
  const void* host_stack_lo = nullptr;
  std::size_t host_stack_bytes = 0;
  // Fibers: a fiber's program order is a happens-before edge for TSan, and a barrier passes
  // it on to the whole block, so two blocks that share any fiber look ordered. A launch of n
  // threads per block splits the fibers into pools_for(n) pools of n, and blocks take the pools
  // round robin by their linear index in the launch: two blocks of a launch share fibers only
  // when their indices differ by a multiple of the pool count. Launches are ordered by the host
  // anyway, so reusing fibers from launch to launch hides nothing. Interleaved blocks (never
  // under TSan) each hold a pool of their own while resident.
  std::vector<std::unique_ptr<fiber>> fibers;

  // The launch in progress.
  const kernel_launch* launch = nullptr;
  launch_sync* lsync = nullptr;
  std::size_t shared_limit = 0;
  std::size_t largest_static = 0;
  unsigned num_threads = 0;
  unsigned num_warps = 0;
  interleave_schedule schedule;
  unsigned long long launches = 0;  // launches made by this host thread (seeds each schedule)

  // The block whose thread runs (or ran last), and that thread.
  block_run* run = nullptr;
  unsigned current = 0;
  std::unique_ptr<block_run> runs[kMaxResident];

  ~exec_context();
};

thread_local std::unique_ptr<exec_context> tls_context;

exec_context& context() {
  if (!tls_context) tls_context = std::make_unique<exec_context>();
  return *tls_context;
}

exec_context& kernel_context(const char* what) {
  exec_context* c = tls_context.get();
  if (c == nullptr || c->launch == nullptr) fatal("%s called outside a kernel", what);
  return *c;
}

// ---- fibers ----------------------------------------------------------------------------

std::unique_ptr<fiber> make_fiber(unsigned index) {
  auto f = std::make_unique<fiber>();
  g_fiber_count.fetch_add(1);
  const std::size_t page = static_cast<std::size_t>(sysconf(_SC_PAGESIZE));
  f->mapping_bytes = kStackBytes + page;
  f->mapping =
      mmap(nullptr, f->mapping_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (f->mapping == MAP_FAILED) fatal("cannot map a %zu-byte fiber stack", f->mapping_bytes);
  // The page below the stack faults on overflow instead of corrupting a neighbour's stack.
  if (mprotect(f->mapping, page, PROT_NONE) != 0) fatal("cannot protect a fiber stack's guard page");
  auto* lo = static_cast<unsigned char*>(f->mapping) + page;
  f->stack_lo = lo;
  f->stack_bytes = kStackBytes;
#if defined(CUDA_SIM_USE_UCONTEXT)
  getcontext(&f->context.uc);
  f->context.uc.uc_stack.ss_sp = lo;
  f->context.uc.uc_stack.ss_size = kStackBytes;
  f->context.uc.uc_link = nullptr;
  const auto bits = reinterpret_cast<std::uintptr_t>(f.get());
  makecontext(&f->context.uc, reinterpret_cast<void (*)()>(+[](unsigned hi, unsigned lo_bits) {
    cudasim_fiber_main(reinterpret_cast<fiber*>((static_cast<std::uintptr_t>(hi) << 32) | lo_bits));
  }),
              2, static_cast<unsigned>(bits >> 32), static_cast<unsigned>(bits & 0xffffffffu));
#else
  // Initial frame, as cudasim_switch pops it: r15 r14 r13 r12 rbx rbp, then the return
  // address cudasim_fiber_start, which calls r13(r12) = cudasim_fiber_main(fiber) with the
  // stack 16-byte aligned. rbp = 0 ends frame-pointer unwinding there.
  auto top = reinterpret_cast<std::uintptr_t>(lo + kStackBytes) & ~static_cast<std::uintptr_t>(15);
  auto* frame = reinterpret_cast<std::uintptr_t*>(top - 9 * sizeof(std::uintptr_t));
  std::memset(frame, 0, 9 * sizeof(std::uintptr_t));
  frame[2] = reinterpret_cast<std::uintptr_t>(&cudasim_fiber_main);
  frame[3] = reinterpret_cast<std::uintptr_t>(f.get());
  frame[6] = reinterpret_cast<std::uintptr_t>(&cudasim_fiber_start);
  f->context.sp = frame;
#endif
  if (__tsan_create_fiber != nullptr) {
    f->tsan = __tsan_create_fiber(0);
    if (__tsan_set_fiber_name != nullptr) {
      char name[64];
      std::snprintf(name, sizeof(name), "simulator fiber %u", index);
      __tsan_set_fiber_name(f->tsan, name);
    }
  }
  return f;
}

exec_context::~exec_context() {
  for (auto& f : fibers) {
    // Frames of the parked fiber leave ASan poison behind; clear it before the pages can
    // be mapped again for something else.
    asan_unpoison(f->stack_lo, f->stack_bytes);
    if (f->tsan != nullptr && __tsan_destroy_fiber != nullptr) __tsan_destroy_fiber(f->tsan);
    munmap(f->mapping, f->mapping_bytes);
  }
  g_fiber_count.fetch_sub(fibers.size());
}

inline void raw_switch(machine_context& from, machine_context& to) {
#if defined(CUDA_SIM_USE_UCONTEXT)
  swapcontext(&from.uc, &to.uc);
#else
  cudasim_switch(&from.sp, to.sp);
#endif
}

fiber& fiber_of(exec_context& c, unsigned t) {
  return *c.fibers[c.run->pool * c.num_threads + t];
}

fiber& current_fiber(exec_context& c) {
  return fiber_of(c, c.current);
}

/// Host -> fiber of thread `t` of block `r`; returns when that thread waits, ends, or is
/// preempted.
void resume(exec_context& c, block_run& r, unsigned t) {
  c.run = &r;
  c.current = t;
  const dim3 b = c.launch->block;
  threadIdx = uint3{t % b.x, (t / b.x) % b.y, t / (b.x * b.y)};
  blockIdx = r.block;
  fiber& f = fiber_of(c, t);
  if (__tsan_switch_to_fiber != nullptr) __tsan_switch_to_fiber(f.tsan, 1 /* no sync */);
  if (__sanitizer_start_switch_fiber != nullptr)
    __sanitizer_start_switch_fiber(&c.host_fake_stack, f.stack_lo, f.stack_bytes);
  if (c.schedule.on) interleave_arm(f.stack_lo, f.stack_bytes, &c.schedule);
  raw_switch(c.host, f.context);
  if (c.schedule.on) interleave_disarm();
  if (__sanitizer_finish_switch_fiber != nullptr) __sanitizer_finish_switch_fiber(c.host_fake_stack, nullptr, nullptr);
}

/// Fiber -> host: the current thread waits (or has ended); returns when it is resumed.
void yield(exec_context& c) {
  fiber& f = current_fiber(c);
  if (__tsan_switch_to_fiber != nullptr) __tsan_switch_to_fiber(c.host_tsan_fiber, 1 /* no sync */);
  if (__sanitizer_start_switch_fiber != nullptr)
    __sanitizer_start_switch_fiber(&f.asan_fake_stack, c.host_stack_lo, c.host_stack_bytes);
  raw_switch(f.context, c.host);
  if (__sanitizer_finish_switch_fiber != nullptr)
    __sanitizer_finish_switch_fiber(f.asan_fake_stack, &c.host_stack_lo, &c.host_stack_bytes);
}

// ---- diagnostics -----------------------------------------------------------------------

struct thread_name {
  char text[96];
};
/// "thread (x,y,z) [warp w lane l]" of thread t of the current block (for messages only).
thread_name who(const exec_context& c, unsigned t) {
  thread_name n;
  const dim3 b = c.launch->block;
  std::snprintf(n.text, sizeof(n.text), "thread (%u,%u,%u) [warp %u lane %u]", t % b.x, (t / b.x) % b.y,
                t / (b.x * b.y), t / 32, t % 32);
  return n;
}

void format_lanes(unsigned mask, char* out, std::size_t n) {
  std::size_t used = 0;
  out[0] = '\0';
  for (unsigned lane = 0; lane < 32 && used + 8 < n; ++lane) {
    if (!(mask & (1u << lane))) continue;
    unsigned end = lane;
    while (end + 1 < 32 && (mask & (1u << (end + 1)))) ++end;
    const int w = end > lane ? std::snprintf(out + used, n - used, "%s%u-%u", used ? "," : "", lane, end)
                             : std::snprintf(out + used, n - used, "%s%u", used ? "," : "", lane);
    used += static_cast<std::size_t>(w > 0 ? w : 0);
    lane = end;
  }
}

[[noreturn]] void deadlock(exec_context& c) {
  std::fprintf(stderr, "cudasim: deadlock: no thread of the block can proceed\n");
  unsigned shown = 0;
  for (unsigned t = 0; t < c.num_threads && shown < 12; ++t) {
    const sim_thread& s = c.run->threads[t];
    if (s.state == thread_state::done || s.state == thread_state::ready || s.state == thread_state::preempted) continue;
    if (s.state == thread_state::barrier) {
      std::fprintf(stderr, "  %s waits at %s (%s:%d)\n", who(c, t).text, barrier_name(c.run->barrier_kind), s.file,
                   s.line);
    } else {
      const warp_state& w = c.run->warps[t / 32];
      unsigned waiting_for = 0;
      for (int i = 0; i < w.num_pending; ++i)
        if (w.pending[i].mask & (1u << (t % 32))) waiting_for = w.pending[i].mask & ~w.pending[i].arrived;
      char lanes[160];
      format_lanes(waiting_for, lanes, sizeof(lanes));
      std::fprintf(stderr, "  %s waits in %s (%s:%d) for lanes %s\n", who(c, t).text, op_name(s.op), s.file, s.line,
                   lanes);
    }
    ++shown;
  }
  fatal("deadlock in a kernel (see the waiting threads above)");
}

// ---- blocks ----------------------------------------------------------------------------

void begin_block(exec_context& c, block_run& r, uint3 block, unsigned pool) {
  r.block = block;
  r.pool = pool;
  r.active = true;
  r.exited = 0;
  r.preempted = 0;
  r.barrier_waiting = 0;
  r.barriers = 0;
  r.statics.clear();
  r.static_bytes = 0;
  for (unsigned t = 0; t < c.num_threads; ++t) r.threads[t] = sim_thread{};
  for (unsigned w = 0; w < c.num_warps; ++w) {
    warp_state& ws = r.warps[w];
    const unsigned n = c.num_threads - w * 32 < 32 ? c.num_threads - w * 32 : 32;
    ws.lanes = n == 32 ? 0xffffffffu : ((1u << n) - 1u);
    ws.exited = 0;
    ws.num_pending = 0;
    ws.syncwarps = 0;
  }
  tsan_ignore_scope ignore;
  r.sync = new block_sync();
  // The dynamic arena is exactly the launch's size (an overrun is a heap-buffer-overflow
  // under ASan), 16-byte aligned like CUDA's, and holds 0xff: no zeroes to hide reads of
  // memory no thread of the block wrote.
  r.dynamic_bytes = c.launch->dynamic_smem;
  if (posix_memalign(&r.dynamic_smem, 16, r.dynamic_bytes) != 0) fatal("cannot allocate dynamic shared memory");
  std::memset(r.dynamic_smem, 0xff, r.dynamic_bytes);
}

/// One round of block `r`: a warp at a time, each of its threads resumed until it waits at a
/// barrier, has ended or was preempted (a preempted thread runs again next round: warps only
/// wait for each other at barriers). Returns whether any thread ran; none did and the block
/// is not done is a deadlock, since no other block can release a barrier of this one.
bool run_round(exec_context& c, block_run& r) {
  bool progress = false;
  for (unsigned w = 0; w < c.num_warps; ++w) {
    const unsigned t_end = (w + 1) * 32 < c.num_threads ? (w + 1) * 32 : c.num_threads;
    for (bool again = true; again;) {
      again = false;
      for (unsigned t = w * 32; t < t_end; ++t) {
        if (r.threads[t].state != thread_state::ready) continue;
        resume(c, r, t);
        progress = again = true;
      }
    }
  }
  if (r.preempted > 0) {
    for (unsigned t = 0; t < c.num_threads; ++t)
      if (r.threads[t].state == thread_state::preempted) r.threads[t].state = thread_state::ready;
    r.preempted = 0;
  }
  return progress;
}

void end_block(exec_context& c, block_run& r) {
  if (r.static_bytes > c.largest_static) c.largest_static = r.static_bytes;
  tsan_ignore_scope ignore;
  for (const static_declaration& d : r.statics) std::free(d.storage);
  r.statics.clear();
  std::free(r.dynamic_smem);
  r.dynamic_smem = nullptr;
  delete r.sync;
  r.sync = nullptr;
  r.active = false;
}

uint3 block_of(const dim3 grid, unsigned long long linear) {
  return uint3{static_cast<unsigned>(linear % grid.x), static_cast<unsigned>((linear / grid.x) % grid.y),
               static_cast<unsigned>(linear / (static_cast<unsigned long long>(grid.x) * grid.y))};
}

/// Every block of the launch, one after another; block b on pool b mod num_pools.
void run_blocks_in_order(exec_context& c, unsigned num_pools, unsigned long long num_blocks) {
  block_run& r = *c.runs[0];
  for (unsigned long long b = 0; b < num_blocks; ++b) {
    begin_block(c, r, block_of(c.launch->grid, b), static_cast<unsigned>(b % num_pools));
    while (r.exited < c.num_threads)
      if (!run_round(c, r)) {
        c.run = &r;
        deadlock(c);
      }
    end_block(c, r);
  }
}

/// Up to `resident` blocks in execution at once, each on its own pool: the next round goes to
/// a block drawn from the launch's generator, and a finished block's slot takes the next block
/// in linear order.
void run_blocks_interleaved(exec_context& c, unsigned resident, unsigned long long num_blocks) {
  unsigned long long next = 0;
  unsigned active = 0;
  for (unsigned s = 0; s < resident && next < num_blocks; ++s, ++next, ++active)
    begin_block(c, *c.runs[s], block_of(c.launch->grid, next), s);
  while (active > 0) {
    unsigned s = c.schedule.next() % resident;
    while (!c.runs[s]->active) s = (s + 1) % resident;
    block_run& r = *c.runs[s];
    if (!run_round(c, r)) {
      c.run = &r;
      deadlock(c);
    }
    if (r.exited < c.num_threads) continue;
    end_block(c, r);
    if (next < num_blocks) {
      begin_block(c, r, block_of(c.launch->grid, next++), s);
    } else {
      --active;
    }
  }
}

void thread_exit(exec_context& c) {
  sim_thread& me = c.run->threads[c.current];
  me.state = thread_state::done;
  ++c.run->exited;
  const unsigned lane = c.current % 32;
  warp_state& w = c.run->warps[c.current / 32];
  w.exited |= 1u << lane;
  if (c.run->barrier_waiting > 0)
    fatal(
        "%s returned while %u threads of its block wait at %s (%s:%d): a barrier must be reached by every thread "
        "of the block (a barrier in divergent code, or after some threads exited)",
        who(c, c.current).text, c.run->barrier_waiting, barrier_name(c.run->barrier_kind), c.run->barrier_file,
        c.run->barrier_line);
  for (int i = 0; i < w.num_pending; ++i) {
    const pending_collective& p = w.pending[i];
    if ((p.mask & (1u << lane)) && !(p.arrived & (1u << lane)))
      fatal("%s returned while lanes of its warp wait for it in %s (%s:%d), whose mask 0x%08x names it",
            who(c, c.current).text, op_name(p.op), p.file, p.line, p.mask);
  }
}

// ---- warp collectives ------------------------------------------------------------------

std::uint64_t mask_bytes(std::uint64_t v, int bytes) {
  return bytes >= 8 ? v : (v & ((std::uint64_t{1} << (8 * bytes)) - 1));
}

// One lane's operands of a pending mma_m16n8k16 (on that lane's stack, which stays live while
// the lane waits in the collective).
struct mma_lane {
  const std::uint32_t* a;
  const std::uint32_t* b;
  float* d;
};

float half_bits_to_float(std::uint32_t h, mma_operands type) noexcept {
  std::uint32_t bits = 0;
  if (type == mma_operands::bf16) {
    bits = h << 16;
  } else {
    const std::uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    if (exp == 0x1fu) {
      bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
      bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
      bits = sign;
    } else {  // subnormal: value man * 2^-24, exact in float32
      const float v = static_cast<float>(man) * 0x1p-24f;
      std::memcpy(&bits, &v, 4);
      bits |= sign;
    }
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float half_of(std::uint32_t word, int upper, mma_operands type) noexcept {
  return half_bits_to_float(upper ? word >> 16 : word & 0xffffu, type);
}

// D = A * B + D over the warp's fragments (layouts in device.hpp), every lane's D written back.
void resolve_mma(sim_thread* lanes, mma_operands type) noexcept {
  float a[16][16], b[16][8], d[16][8];
  for (unsigned lane = 0; lane < 32; ++lane) {
    const mma_lane& f = *reinterpret_cast<const mma_lane*>(static_cast<std::uintptr_t>(lanes[lane].value));
    const unsigned g = lane / 4, t = lane % 4;
    for (int h = 0; h < 2; ++h) {
      a[g][2 * t + h] = half_of(f.a[0], h, type);
      a[g + 8][2 * t + h] = half_of(f.a[1], h, type);
      a[g][2 * t + 8 + h] = half_of(f.a[2], h, type);
      a[g + 8][2 * t + 8 + h] = half_of(f.a[3], h, type);
      b[2 * t + h][g] = half_of(f.b[0], h, type);
      b[2 * t + 8 + h][g] = half_of(f.b[1], h, type);
      d[g][2 * t + h] = f.d[h];
      d[g + 8][2 * t + h] = f.d[2 + h];
    }
  }
  for (int m = 0; m < 16; ++m)
    for (int n = 0; n < 8; ++n) {
      float acc = d[m][n];
      // The product is exact in float32, so a contracted multiply-add rounds the same.
      for (int k = 0; k < 16; ++k) acc += a[m][k] * b[k][n];
      d[m][n] = acc;
    }
  for (unsigned lane = 0; lane < 32; ++lane) {
    const mma_lane& f = *reinterpret_cast<const mma_lane*>(static_cast<std::uintptr_t>(lanes[lane].value));
    const unsigned g = lane / 4, t = lane % 4;
    for (int h = 0; h < 2; ++h) {
      f.d[h] = d[g][2 * t + h];
      f.d[2 + h] = d[g + 8][2 * t + h];
    }
  }
}

/// Computes every participating lane's result; called by the lane that completes the set.
void resolve(exec_context& c, unsigned warp, const pending_collective& p) {
  sim_thread* lanes = &c.run->threads[warp * 32];
  if (p.op == warp_op::mma_bf16 || p.op == warp_op::mma_f16) {
    resolve_mma(lanes, p.op == warp_op::mma_bf16 ? mma_operands::bf16 : mma_operands::f16);
    return;
  }
  const unsigned width = static_cast<unsigned>(p.width);
  auto source = [&](unsigned lane, unsigned src) -> const sim_thread& {
    if (!(p.mask & (1u << src))) {
      fatal("%s reads lane %u in %s (%s:%d), but the mask 0x%08x does not name that lane: the value is undefined",
            who(c, warp * 32 + lane).text, src, op_name(p.op), p.file, p.line, p.mask);
    }
    return lanes[src];
  };
  for (unsigned lane = 0; lane < 32; ++lane) {
    if (!(p.mask & (1u << lane))) continue;
    sim_thread& me = lanes[lane];
    warp_result r{0, 0};
    const unsigned segment = lane & ~(width - 1);
    switch (p.op) {
      case warp_op::shfl: {
        const int w = static_cast<int>(width);
        const unsigned src = segment + static_cast<unsigned>(((me.param % w) + w) % w);
        r.value = source(lane, src).value;
        break;
      }
      case warp_op::shfl_up: {
        const unsigned delta = static_cast<unsigned>(me.param);
        r.value = (lane - segment) >= delta ? source(lane, lane - delta).value : me.value;
        break;
      }
      case warp_op::shfl_down: {
        const unsigned delta = static_cast<unsigned>(me.param);
        r.value = (lane - segment) + delta < width ? source(lane, lane + delta).value : me.value;
        break;
      }
      case warp_op::shfl_xor: {
        const unsigned src = lane ^ static_cast<unsigned>(me.param);
        // Lanes of later segments (or past the warp) are not readable: own value, as CUDA.
        r.value = (src >= 32 || (src & ~(width - 1)) > segment) ? me.value : source(lane, src).value;
        break;
      }
      case warp_op::ballot:
      case warp_op::any:
      case warp_op::all: {
        unsigned bits = 0;
        for (unsigned l = 0; l < 32; ++l)
          if ((p.mask & (1u << l)) && lanes[l].value != 0) bits |= 1u << l;
        r.value = bits;
        r.predicate = p.op == warp_op::any ? (bits != 0) : (bits == p.mask);
        break;
      }
      case warp_op::match_any:
      case warp_op::match_all: {
        unsigned same = 0;
        for (unsigned l = 0; l < 32; ++l)
          if ((p.mask & (1u << l)) && mask_bytes(lanes[l].value, p.bytes) == mask_bytes(me.value, p.bytes))
            same |= 1u << l;
        if (p.op == warp_op::match_any) {
          r.value = same;
        } else {
          r.predicate = same == p.mask;
          r.value = r.predicate ? p.mask : 0u;
        }
        break;
      }
      case warp_op::reduce_add:
      case warp_op::reduce_min_signed:
      case warp_op::reduce_max_signed:
      case warp_op::reduce_min_unsigned:
      case warp_op::reduce_max_unsigned:
      case warp_op::reduce_and:
      case warp_op::reduce_or:
      case warp_op::reduce_xor: {
        bool first = true;
        std::uint32_t acc = 0;
        for (unsigned l = 0; l < 32; ++l) {
          if (!(p.mask & (1u << l))) continue;
          const auto v = static_cast<std::uint32_t>(lanes[l].value);
          const auto sv = static_cast<std::int32_t>(v), sacc = static_cast<std::int32_t>(acc);
          if (first) {
            acc = v;
            first = false;
            continue;
          }
          switch (p.op) {
            case warp_op::reduce_add:
              acc += v;
              break;
            case warp_op::reduce_min_signed:
              acc = static_cast<std::uint32_t>(sv < sacc ? sv : sacc);
              break;
            case warp_op::reduce_max_signed:
              acc = static_cast<std::uint32_t>(sv > sacc ? sv : sacc);
              break;
            case warp_op::reduce_min_unsigned:
              acc = v < acc ? v : acc;
              break;
            case warp_op::reduce_max_unsigned:
              acc = v > acc ? v : acc;
              break;
            case warp_op::reduce_and:
              acc &= v;
              break;
            case warp_op::reduce_or:
              acc |= v;
              break;
            default:
              acc ^= v;
              break;
          }
        }
        r.value = acc;
        break;
      }
      case warp_op::syncwarp:
      case warp_op::mma_bf16:
      case warp_op::mma_f16:
        break;
    }
    me.result = r;
  }
}

}  // namespace

// ---- entry points ------------------------------------------------------------------------

bool in_kernel() noexcept {
  const exec_context* c = tls_context.get();
  return c != nullptr && c->launch != nullptr;
}

void fatal(const char* format, ...) noexcept {
  std::fflush(stdout);
  std::fprintf(stderr, "cudasim: ");
  va_list args;
  va_start(args, format);
  std::vfprintf(stderr, format, args);
  va_end(args);
  std::fprintf(stderr, "\n");
  const exec_context* c = tls_context.get();
  if (c != nullptr && c->launch != nullptr) {
    const dim3 g = c->launch->grid, b = c->launch->block;
    std::fprintf(stderr,
                 "cudasim:   in a launch of grid (%u,%u,%u) x block (%u,%u,%u), %zu bytes of dynamic shared memory; "
                 "block (%u,%u,%u), thread (%u,%u,%u)\n",
                 g.x, g.y, g.z, b.x, b.y, b.z, c->launch->dynamic_smem, blockIdx.x, blockIdx.y, blockIdx.z, threadIdx.x,
                 threadIdx.y, threadIdx.z);
  }
  std::fflush(stderr);
  std::abort();
}

std::size_t run_grid(const kernel_launch& l, std::size_t shared_limit) noexcept {
  exec_context& c = context();
  if (c.launch != nullptr) fatal("a kernel launched a kernel (dynamic parallelism is not simulated)");
  const unsigned threads = l.block.x * l.block.y * l.block.z;
  const unsigned num_pools = pools_for(threads, c.fibers.size());
  while (c.fibers.size() < num_pools * threads) c.fibers.push_back(make_fiber(static_cast<unsigned>(c.fibers.size())));
  const interleave_settings& settings = interleave_config();
  c.schedule.on = settings.enabled;
  c.schedule.resident = 1;
  if (c.schedule.on) {
    unsigned resident = settings.resident < num_pools ? settings.resident : num_pools;
    c.schedule.resident = resident < kMaxResident ? resident : kMaxResident;
    // splitmix64 of (seed, launch number on this host thread): never zero for xorshift.
    std::uint64_t z = settings.seed + 0x9E3779B97F4A7C15ull * ++c.launches;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    c.schedule.rng = (z ^ (z >> 31)) | 1u;
  }
  for (unsigned s = 0; s < c.schedule.resident; ++s)
    if (!c.runs[s]) c.runs[s] = std::make_unique<block_run>();
  c.run = c.runs[0].get();
  if (__tsan_get_current_fiber != nullptr) c.host_tsan_fiber = __tsan_get_current_fiber();
  c.launch = &l;
  c.shared_limit = shared_limit;
  c.largest_static = 0;
  {
    tsan_ignore_scope ignore;
    c.lsync = new launch_sync();
  }
  tsan_release(&c.lsync->start);  // everything the host did before the launch
  gridDim = l.grid;
  blockDim = l.block;
  c.num_threads = threads;
  c.num_warps = (threads + 31) / 32;
  const unsigned long long num_blocks = static_cast<unsigned long long>(l.grid.x) * l.grid.y * l.grid.z;
  if (c.schedule.on) {
    run_blocks_interleaved(c, c.schedule.resident, num_blocks);
  } else {
    run_blocks_in_order(c, num_pools, num_blocks);
  }
  tsan_acquire(&c.lsync->end);  // the host sees everything the kernel did
  {
    tsan_ignore_scope ignore;
    delete c.lsync;
    c.lsync = nullptr;
  }
  c.launch = nullptr;
  threadIdx = uint3{0, 0, 0};
  blockIdx = uint3{0, 0, 0};
  return c.largest_static;
}

int barrier(barrier_op op, int predicate, const char* file, int line) noexcept {
  exec_context& c = kernel_context(barrier_name(op));
  sim_thread& me = c.run->threads[c.current];
  if (c.run->exited > 0) {
    unsigned first = 0;
    while (c.run->threads[first].state != thread_state::done) ++first;
    fatal(
        "%s reached %s (%s:%d) after %u threads of its block returned (first %s): a barrier must be reached by "
        "every thread of the block",
        who(c, c.current).text, barrier_name(op), file, line, c.run->exited, who(c, first).text);
  }
  if (c.run->barrier_waiting == 0) {
    c.run->barrier_kind = op;
    c.run->barrier_file = file;
    c.run->barrier_line = line;
    c.run->barrier_true = 0;
  } else if (op != c.run->barrier_kind || !same_site(file, line, c.run->barrier_file, c.run->barrier_line)) {
    fatal(
        "divergent barrier: %s reached %s (%s:%d) while %u threads of its block wait at %s (%s:%d); every thread "
        "of a block must reach the same barrier",
        who(c, c.current).text, barrier_name(op), file, line, c.run->barrier_waiting, barrier_name(c.run->barrier_kind),
        c.run->barrier_file, c.run->barrier_line);
  }
  c.run->barrier_true += predicate != 0 ? 1 : 0;
  char* word = &c.run->sync->barrier[c.run->barriers % kBarrierWords];
  tsan_release(word);
  if (++c.run->barrier_waiting == c.num_threads) {
    int result = c.run->barrier_true;
    if (op == barrier_op::all) result = c.run->barrier_true == static_cast<int>(c.num_threads);
    if (op == barrier_op::any) result = c.run->barrier_true != 0;
    for (unsigned t = 0; t < c.num_threads; ++t) {
      if (c.run->threads[t].state != thread_state::barrier) continue;
      c.run->threads[t].barrier_result = result;
      c.run->threads[t].state = thread_state::ready;
    }
    me.barrier_result = result;
    c.run->barrier_waiting = 0;
    ++c.run->barriers;
  } else {
    me.state = thread_state::barrier;
    me.file = file;
    me.line = line;
    yield(c);
  }
  tsan_acquire(word);
  return me.barrier_result;
}

warp_result warp_collective(warp_op op, unsigned mask, std::uint64_t value, int bytes, int param, int width,
                            const char* file, int line) noexcept {
  exec_context& c = kernel_context(op_name(op));
  const unsigned t = c.current, warp = t / 32, lane = t % 32, bit = 1u << lane;
  sim_thread& me = c.run->threads[t];
  warp_state& w = c.run->warps[warp];
  if (width < 1 || width > 32 || (width & (width - 1)) != 0)
    fatal("%s calls %s (%s:%d) with width %d: expected a power of two in [1, 32]", who(c, t).text, op_name(op), file,
          line, width);
  if (!(mask & bit))
    fatal("%s calls %s (%s:%d) with mask 0x%08x, which does not name its own lane", who(c, t).text, op_name(op), file,
          line, mask);
  if (mask & ~w.lanes)
    fatal("%s calls %s (%s:%d) with mask 0x%08x, which names lanes that do not exist (the block has %u threads)",
          who(c, t).text, op_name(op), file, line, mask, c.num_threads);
  if (mask & w.exited) {
    char lanes[160];
    format_lanes(mask & w.exited, lanes, sizeof(lanes));
    fatal("%s calls %s (%s:%d) with mask 0x%08x, which names lanes %s that have returned", who(c, t).text, op_name(op),
          file, line, mask, lanes);
  }
  pending_collective* p = nullptr;
  for (int i = 0; i < w.num_pending; ++i) {
    pending_collective& q = w.pending[i];
    if (!(q.mask & mask)) continue;
    if (q.mask != mask || q.op != op || q.bytes != bytes || q.width != width) {
      fatal(
          "mismatched warp functions: %s calls %s (%s:%d) with mask 0x%08x while %s waits in %s (%s:%d) with mask "
          "0x%08x; the lanes a mask names must all call the same function with the same mask",
          who(c, t).text, op_name(op), file, line, mask, who(c, warp * 32 + q.first_lane).text, op_name(q.op), q.file,
          q.line, q.mask);
    }
    p = &q;
  }
  if (p == nullptr) {
    p = &w.pending[w.num_pending++];
    *p = pending_collective{op, mask, 0, bytes, width, file, line, lane, nullptr};
    if (op == warp_op::syncwarp) p->sync = &c.run->sync->warp[warp][w.syncwarps++ % kSyncwarpWords];
  }
  char* word = p->sync;
  me.value = value;
  me.param = param;
  p->arrived |= bit;
  if (word != nullptr) tsan_release(word);
  if (p->arrived == mask) {
    resolve(c, warp, *p);
    for (unsigned l = 0; l < 32; ++l)
      if ((mask & (1u << l)) && l != lane) c.run->threads[warp * 32 + l].state = thread_state::ready;
    *p = w.pending[--w.num_pending];
  } else {
    me.state = thread_state::collective;
    me.op = op;
    me.file = file;
    me.line = line;
    yield(c);
  }
  if (word != nullptr) tsan_acquire(word);
  return me.result;
}

void preempt_current() noexcept {
  exec_context& c = kernel_context("a memory access");
  block_run& r = *c.run;
  r.threads[c.current].state = thread_state::preempted;
  ++r.preempted;
  yield(c);
}

unsigned active_mask() noexcept {
  exec_context& c = kernel_context("__activemask");
  const warp_state& w = c.run->warps[c.current / 32];
  return w.lanes & ~w.exited;
}

}  // namespace detail

void mma_m16n8k16(mma_operands type, float (&d)[4], const std::uint32_t (&a)[4], const std::uint32_t (&b)[2],
                  const char* file, int line) noexcept {
  using namespace detail;
  const mma_lane me{a, b, d};
  warp_collective(type == mma_operands::bf16 ? warp_op::mma_bf16 : warp_op::mma_f16, full_warp_mask,
                  static_cast<std::uint64_t>(reinterpret_cast<std::uintptr_t>(&me)), 8, 0, 32, file, line);
}

namespace detail {

void* static_shared(const void* site, std::size_t bytes, std::size_t align, const char* name) noexcept {
  exec_context& c = kernel_context("a __shared__ declaration");
  for (const static_declaration& d : c.run->statics)
    if (d.site == site) return d.storage;
  // The first thread of the block to reach the declaration allocates it for the block.
  if (c.run->static_bytes + bytes > kStaticSharedLimit)
    fatal("static shared memory of the kernel exceeds 48 KiB at '%s' (%zu + %zu bytes)", name, c.run->static_bytes,
          bytes);
  if (c.run->static_bytes + bytes + c.run->dynamic_bytes > c.shared_limit)
    fatal(
        "static (%zu bytes with '%s') plus dynamic (%zu bytes) shared memory exceeds the device's %zu bytes per "
        "block: the launch would fail",
        c.run->static_bytes + bytes, name, c.run->dynamic_bytes, c.shared_limit);
  void* p = nullptr;
  {
    tsan_ignore_scope ignore;
    if (posix_memalign(&p, align < 16 ? 16 : align, bytes) != 0) fatal("cannot allocate shared memory '%s'", name);
    std::memset(p, 0xff, bytes);
  }
  c.run->statics.push_back({site, p, bytes});
  c.run->static_bytes += bytes;
  return p;
}

void* dynamic_shared(std::size_t align, const char* name) noexcept {
  exec_context& c = kernel_context("extern __shared__");
  if (align > 16)
    fatal("dynamic shared memory '%s' needs %zu-byte alignment; the arena is 16-byte aligned", name, align);
  return c.run->dynamic_smem;
}

void device_trap(const char* file, int line) noexcept {
  fatal("__trap() at %s:%d", file, line);
}

void misaligned(const void* p, std::size_t align, const char* what, const char* file, int line) noexcept {
  fatal(
      "misaligned address: %s at %s:%d reads or writes %p, which is not %zu-byte aligned (a misaligned-address "
      "fault on a GPU)",
      what, file, line, p, align);
}

}  // namespace detail
}  // namespace cudasim

extern "C" void cudasim_fiber_main(cudasim::detail::fiber* f) noexcept {
  using namespace cudasim::detail;
  exec_context& c = context();
  if (__sanitizer_finish_switch_fiber != nullptr)
    __sanitizer_finish_switch_fiber(f->asan_fake_stack, &c.host_stack_lo, &c.host_stack_bytes);
  for (;;) {
    tsan_acquire(&c.lsync->start);
    c.launch->run_thread(c.launch->payload);
    tsan_release(&c.lsync->end);
    thread_exit(c);
    yield(c);
  }
}
