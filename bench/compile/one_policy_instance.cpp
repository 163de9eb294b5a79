// Compile cost: the program's one TU that compiles the SnapKV compressor's run() for every
// engine TU declaring it extern (one_policy_compiled_once.cpp).
#include <kvevict/compressor/basic_compressor.hpp>
#include <kvevict/compressor/compile_once.hpp>
#include <kvevict/policies/snapkv.hpp>

using snapkv_compressor = kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>>;
KVEVICT_INSTANTIATE_COMPRESSOR_RUN(snapkv_compressor, kvevict::bf16, kvevict::bf16);
