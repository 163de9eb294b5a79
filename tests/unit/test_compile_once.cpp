// The one TU that compiles the run() entries unit/compile_once_lists.hpp declares extern; the
// tests that call them ("a compressor over a list of policies ..." in test_compressor.cpp)
// link against these copies, so a declaration and an instantiation that disagree fail to link.
#include "kvevict/policies/deferkv.hpp"
#include "kvevict/policies/knorm.hpp"
#include "kvevict/policies/snapkv.hpp"
#include "kvevict/policies/streaming_llm.hpp"
#include "unit/compile_once_lists.hpp"

KVEVICT_INSTANTIATE_COMPRESSOR_RUN(test::snapkv_only, kvevict::bf16, kvevict::bf16);
KVEVICT_INSTANTIATE_COMPRESSOR_RUN(test::deferkv_knorm, kvevict::bf16, kvevict::bf16);
KVEVICT_INSTANTIATE_COMPRESSOR(kvevict::policy_list<kvevict::streaming_llm_traits>);
