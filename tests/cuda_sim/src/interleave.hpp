// Interleaving: the simulator's schedule when a non-atomic read-modify-write must give a
// wrong result, so that comparing with the CPU path catches a lost update (an atomicAdd
// written as +=, an atomicOr as |=) without ThreadSanitizer.
//
// The kernels' translation units are compiled with the compiler's ThreadSanitizer
// instrumentation (-fsanitize=thread at compile time only: no TSan runtime is linked), which
// calls a hook before every load and store of memory that is not a private local. The hooks
// in interleave.cpp switch the running simulated thread out:
//   - before it writes an address it read since it last ran (the store of a read-modify-
//     write), so every other thread's access to that address comes in between; and
//   - at a random access, about one in `mean_gap`, so other orders happen too;
// and the scheduler keeps up to kMaxResident blocks of a launch in execution at once, picking
// which block runs next from a seeded generator, so the same happens between blocks. Every
// schedule produced is one a GPU may produce; a correct kernel gives the same result.
#pragma once

#include <cstddef>
#include <cstdint>

namespace cudasim {
namespace detail {

struct interleave_settings {
  bool enabled = false;    // hooks linked and not switched off by CUDA_SIM_INTERLEAVE=0
  std::uint64_t seed = 1;  // CUDA_SIM_SEED
  unsigned resident = 4;   // CUDA_SIM_RESIDENT_BLOCKS: blocks in execution at once (1-4)
  unsigned mean_gap = 64;  // accesses between random switches, on average
};

/// The settings of this process, read from the environment once.
const interleave_settings& interleave_config() noexcept;

/// Whether the kernels' accesses reach the hooks (a build with KVEVICT_SIM_INTERLEAVE).
bool interleave_hooks_linked() noexcept;

/// A launch's schedule: its own generator, so a launch's schedule depends on the seed and on
/// how many launches the host thread made before it, not on other host threads.
struct interleave_schedule {
  bool on = false;
  unsigned resident = 1;
  std::uint64_t rng = 0;
  unsigned next() noexcept {  // xorshift64*
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return static_cast<unsigned>((rng * 0x2545F4914F6CDD1Dull) >> 32);
  }
};

/// Arms the hooks for the simulated thread about to run on a fiber whose stack is
/// [stack_lo, stack_lo + stack_bytes) (accesses there are private); `schedule` draws the gaps.
void interleave_arm(const void* stack_lo, std::size_t stack_bytes, interleave_schedule* schedule) noexcept;
/// Back on the host: the hooks do nothing until the next arm.
void interleave_disarm() noexcept;

/// Implemented by the scheduler: the running simulated thread stops here and continues in a
/// later round of its block.
void preempt_current() noexcept;

}  // namespace detail
}  // namespace cudasim
