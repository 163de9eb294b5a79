// SPDX-License-Identifier: Apache-2.0
// Included before docs/integration.md's runtime-dtype recipe (tests/docs/CMakeLists.txt). The
// recipes are compiled, never linked, so the runtime-dtype compressor's members (every storage
// and query type: nearly all of that recipe's compile) need not be compiled there: the unit
// tests that run them compile them with the same flags and warnings. Only what the declaration
// needs, so that the recipe's own includes are still checked.
#ifndef KVEVICT_TESTS_DOCS_EXTERN_COMPRESSOR_HPP
#define KVEVICT_TESTS_DOCS_EXTERN_COMPRESSOR_HPP

#include "kvevict/compressor/compile_once.hpp"
#include "kvevict/policies/policy_list.hpp"

KVEVICT_EXTERN_COMPRESSOR(kvevict::default_policies);

#endif  // KVEVICT_TESTS_DOCS_EXTERN_COMPRESSOR_HPP
