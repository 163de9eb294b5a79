// SPDX-License-Identifier: Apache-2.0
#ifndef KVEVICT_CPU_ISA_HPP
#define KVEVICT_CPU_ISA_HPP

// Which instruction-set path kvevict's CPU kernels take (docs/cpu-dispatch.md).
//
// Every build contains every path (detail/isa/target.hpp); the process picks one, once, at
// its first kvevict call that needs a CPU kernel (or its first call below): the best path
// the CPU and the operating system support, lowered by the environment variable
//
//   KVEVICT_ISA=scalar | avx2 | avx512 | avx512bf16 | amx
//
// for tests, benchmarks and debugging. A request above what the machine supports, or an
// unknown value, is not an error: kvevict takes the best supported path and says so once on
// stderr (and cpu_isa_report() tells it). On a CPU with AMX the choice of `amx` asks Linux
// for tile state (arch_prctl(ARCH_REQ_XCOMP_PERM), which enlarges every signal frame of the
// process by about 8 KB); refused, kvevict takes avx512bf16. Define KVEVICT_NO_AMX to leave
// AMX out at compile time, or set KVEVICT_ISA=avx512bf16.

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "kvevict/config.hpp"
#include "kvevict/detail/isa/target.hpp"

#if KVEVICT_X86_DISPATCH
#include <cpuid.h>
#endif
#if KVEVICT_AMX_DISPATCH
#include <sys/syscall.h>
#include <unistd.h>
#endif

KVEVICT_NAMESPACE_BEGIN

/// The CPU paths, each a superset of the one before.
enum class cpu_isa : std::int32_t {
  scalar = 0,      ///< portable C++, compiled for the translation unit's baseline
  avx2 = 1,        ///< AVX2 + FMA + F16C (+ BMI1/2, LZCNT, POPCNT): Haswell, Zen 1 and later
  avx512 = 2,      ///< + AVX-512 F/BW/VL/DQ/CD: Skylake-SP, Ice Lake, Zen 4 and later
  avx512bf16 = 3,  ///< + AVX512_BF16 (VDPBF16PS for bf16 x bf16 products): Cooper Lake, Zen 4
  amx = 4,         ///< + AMX-TILE/AMX-BF16 (tile products for bf16 x bf16): Sapphire Rapids
};

inline const char* to_string(cpu_isa isa) noexcept {
  switch (isa) {
    case cpu_isa::scalar:
      return "scalar";
    case cpu_isa::avx2:
      return "avx2";
    case cpu_isa::avx512:
      return "avx512";
    case cpu_isa::avx512bf16:
      return "avx512bf16";
    case cpu_isa::amx:
      return "amx";
  }
  return "unknown";
}

/// Parses a path name as KVEVICT_ISA spells it; false for anything else.
inline bool parse_cpu_isa(const char* name, cpu_isa* out) noexcept {
  if (name == nullptr || out == nullptr) return false;
  for (int i = 0; i <= static_cast<int>(cpu_isa::amx); ++i) {
    const auto isa = static_cast<cpu_isa>(i);
    if (std::strcmp(name, to_string(isa)) == 0) {
      *out = isa;
      return true;
    }
  }
  return false;
}

/// How the process's path was chosen.
struct cpu_isa_report {
  cpu_isa supported = cpu_isa::scalar;  ///< best path of this CPU and OS (compiled-in paths only)
  cpu_isa active = cpu_isa::scalar;     ///< the path kvevict runs
  bool requested = false;               ///< KVEVICT_ISA was set (and not empty or "auto")
  cpu_isa request = cpu_isa::scalar;    ///< the parsed request, when valid
  bool request_valid = false;           ///< the request named a path
  bool amx_refused = false;             ///< AMX was chosen but Linux refused tile state
  char note[192] = {};                  ///< why `active` differs from the request, or ""
};

namespace detail {

/// What the CPU and the OS support, as the paths need it.
inline cpu_isa detect_supported_cpu_isa() noexcept {
#if KVEVICT_X86_DISPATCH
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid_max(0, nullptr) < 7) return cpu_isa::scalar;
  __get_cpuid(1, &a, &b, &c, &d);
  const bool fma = (c >> 12) & 1u, popcnt = (c >> 23) & 1u, osxsave = (c >> 27) & 1u, avx = (c >> 28) & 1u,
             f16c = (c >> 29) & 1u;
  if (!osxsave || !avx) return cpu_isa::scalar;
  unsigned xcr0_lo = 0, xcr0_hi = 0;
  // XGETBV(0): which register states the OS saves and restores across context switches.
  __asm__ volatile("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0u));
  const std::uint64_t xcr0 = (static_cast<std::uint64_t>(xcr0_hi) << 32) | xcr0_lo;
  const bool os_avx = (xcr0 & 0x6u) == 0x6u;                  // SSE, AVX (YMM upper halves)
  const bool os_avx512 = (xcr0 & 0xe6u) == 0xe6u;             // + opmask, ZMM_Hi256, Hi16_ZMM
  const bool os_amx = (xcr0 & (3ull << 17)) == (3ull << 17);  // XTILECFG, XTILEDATA
  __get_cpuid_count(7, 0, &a, &b, &c, &d);
  const bool bmi1 = (b >> 3) & 1u, avx2 = (b >> 5) & 1u, bmi2 = (b >> 8) & 1u;
  const bool avx512f = (b >> 16) & 1u, avx512dq = (b >> 17) & 1u, avx512cd = (b >> 28) & 1u, avx512bw = (b >> 30) & 1u,
             avx512vl = (b >> 31) & 1u;
  const bool amx_bf16 = (d >> 22) & 1u, amx_tile = (d >> 24) & 1u;
  unsigned a1 = 0, b1 = 0, c1 = 0, d1 = 0;
  __get_cpuid_count(7, 1, &a1, &b1, &c1, &d1);
  const bool avx512bf16 = (a1 >> 5) & 1u;
  unsigned ea = 0, eb = 0, ec = 0, ed = 0;
  const bool lzcnt = __get_cpuid(0x80000001u, &ea, &eb, &ec, &ed) && ((ec >> 5) & 1u);

  if (!(os_avx && avx2 && fma && f16c && bmi1 && bmi2 && lzcnt && popcnt)) return cpu_isa::scalar;
  if (!(os_avx512 && avx512f && avx512bw && avx512vl && avx512dq && avx512cd)) return cpu_isa::avx2;
  if (!avx512bf16) return cpu_isa::avx512;
#if KVEVICT_AMX_DISPATCH
  if (os_amx && amx_tile && amx_bf16) return cpu_isa::amx;
#else
  (void)os_amx, (void)amx_tile, (void)amx_bf16;
#endif
  return cpu_isa::avx512bf16;
#else
  return cpu_isa::scalar;
#endif
}

/// Linux grants AMX tile state only on request (kernel 5.16+); a refusal (older kernel,
/// seccomp) is final for the process.
inline bool request_amx_permission() noexcept {
#if KVEVICT_AMX_DISPATCH
  return ::syscall(SYS_arch_prctl, 0x1023 /* ARCH_REQ_XCOMP_PERM */, 18 /* XFEATURE_XTILEDATA */) == 0;
#else
  return false;
#endif
}

inline cpu_isa_report resolve_cpu_isa() noexcept {
  cpu_isa_report r;
  r.supported = detect_supported_cpu_isa();
  r.active = r.supported;
  const char* env = std::getenv("KVEVICT_ISA");
  if (env != nullptr && env[0] != '\0' && std::strcmp(env, "auto") != 0) {
    r.requested = true;
    r.request_valid = parse_cpu_isa(env, &r.request);
    if (!r.request_valid) {
      std::snprintf(r.note, sizeof(r.note),
                    "KVEVICT_ISA=%.40s is not one of scalar, avx2, avx512, avx512bf16, amx, auto; using %s", env,
                    to_string(r.supported));
    } else if (static_cast<int>(r.request) > static_cast<int>(r.supported)) {
      std::snprintf(r.note, sizeof(r.note), "KVEVICT_ISA=%s is beyond this CPU and OS (best: %s); using %s", env,
                    to_string(r.supported), to_string(r.supported));
    } else {
      r.active = r.request;
    }
  }
  if (r.active == cpu_isa::amx && !request_amx_permission()) {
    r.amx_refused = true;
    r.active = cpu_isa::avx512bf16;
    std::snprintf(r.note, sizeof(r.note), "Linux refused AMX tile state (arch_prctl); using avx512bf16");
  }
  if (r.note[0] != '\0') std::fprintf(stderr, "kvevict: %s\n", r.note);
  return r;
}

inline const cpu_isa_report& dispatch_state() noexcept {
  static const cpu_isa_report report = resolve_cpu_isa();
  return report;
}

}  // namespace detail

/// The path kvevict's CPU kernels take in this process (chosen once; see the top of this header).
inline cpu_isa active_cpu_isa() noexcept {
  return detail::dispatch_state().active;
}

/// The best path this CPU and OS support, whatever KVEVICT_ISA says.
inline cpu_isa supported_cpu_isa() noexcept {
  return detail::dispatch_state().supported;
}

/// Whether this machine can run `isa` (every path up to supported_cpu_isa()).
inline bool cpu_isa_supported(cpu_isa isa) noexcept {
  return static_cast<int>(isa) <= static_cast<int>(supported_cpu_isa());
}

/// The whole decision: what was supported, requested and chosen, and why.
inline const cpu_isa_report& cpu_isa_details() noexcept {
  return detail::dispatch_state();
}

KVEVICT_NAMESPACE_END

#endif  // KVEVICT_CPU_ISA_HPP
