// The compressors whose run() the unit tests compile once, in test_compile_once.cpp, as an
// engine would (kvevict/compressor/compile_once.hpp): every other TU sees these declarations
// and calls the one compiled copy.
#ifndef KVEVICT_TESTS_UNIT_COMPILE_ONCE_LISTS_HPP
#define KVEVICT_TESTS_UNIT_COMPILE_ONCE_LISTS_HPP

#include "kvevict/compressor/basic_compressor.hpp"
#include "kvevict/compressor/compile_once.hpp"
#include "kvevict/dtype.hpp"
#include "kvevict/policies/policy_list.hpp"

namespace test {
using snapkv_only = kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>>;
// Another order, and the deferred policy: kinds stay default_policies' indices.
using deferkv_knorm = kvevict::basic_compressor<kvevict::policy_list<kvevict::deferkv_traits, kvevict::knorm_traits>>;
using streaming_only = kvevict::basic_compressor<kvevict::policy_list<kvevict::streaming_llm_traits>>;
}  // namespace test

KVEVICT_EXTERN_COMPRESSOR_RUN(test::snapkv_only, kvevict::bf16, kvevict::bf16);
KVEVICT_EXTERN_COMPRESSOR_RUN(test::deferkv_knorm, kvevict::bf16, kvevict::bf16);
KVEVICT_EXTERN_COMPRESSOR(kvevict::policy_list<kvevict::streaming_llm_traits>);

#endif  // KVEVICT_TESTS_UNIT_COMPILE_ONCE_LISTS_HPP
