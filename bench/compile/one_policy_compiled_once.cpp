// Compile cost: one_policy.cpp's engine TU when run() is compiled once per program
// (kvevict/compressor/compile_once.hpp): the declaration below keeps this TU from compiling
// it; one_policy_instance.cpp is the program's one TU that does.
#include <kvevict/compressor/basic_compressor.hpp>
#include <kvevict/compressor/compile_once.hpp>
#include <kvevict/policies/snapkv.hpp>

using snapkv_compressor = kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>>;
KVEVICT_EXTERN_COMPRESSOR_RUN(snapkv_compressor, kvevict::bf16, kvevict::bf16);

kvevict::status plan_one(const kvevict::compressor_options& o, snapkv_compressor* c) {
  return snapkv_compressor::plan(o, c);
}
kvevict::status run_one(const snapkv_compressor& c, std::int64_t layer, const kvevict::sequence_io<kvevict::bf16>* s,
                        std::int64_t n, kvevict::sequence_report* r, kvevict::workspace_span ws) {
  return c.run(layer, s, n, r, ws);
}
