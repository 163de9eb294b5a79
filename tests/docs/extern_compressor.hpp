// SPDX-License-Identifier: Apache-2.0
// Included before each recipe of docs/integration.md (tests/docs/CMakeLists.txt). The recipes
// are compiled, never linked, so the runtime-dtype compressor's members (every storage and
// query type: most of the runtime-dtype recipe's compile) need not be compiled here: the unit
// tests that run them compile them with the same flags and warnings.
#ifndef KVEVICT_TESTS_DOCS_EXTERN_COMPRESSOR_HPP
#define KVEVICT_TESTS_DOCS_EXTERN_COMPRESSOR_HPP

#include "kvevict/compressor/compile_once.hpp"
#include "kvevict/kvevict.hpp"

KVEVICT_EXTERN_COMPRESSOR(kvevict::default_policies);

#endif  // KVEVICT_TESTS_DOCS_EXTERN_COMPRESSOR_HPP
