// SPDX-License-Identifier: Apache-2.0
// The CPU kernels of kvevict's own test programs, compiled once per build: the test
// translation units are compiled with KVEVICT_EXTERN_KERNELS=1 (cmake/kvevict_internal.cmake,
// docs/compile-cost.md). The packaging consumers, examples, benchmarks and fuzzers stay
// header-only, so both forms are built. Included first and twice: this TU is also the
// header's self-containment check (tests/CMakeLists.txt leaves it out of the per-header TUs).
#include "kvevict/instantiate_kernels.hpp"
#include "kvevict/instantiate_kernels.hpp"  // NOLINT(readability-duplicate-include)
