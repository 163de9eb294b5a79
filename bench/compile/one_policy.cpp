// Compile cost: an engine TU that serves SnapKV only (typed bf16 run()).
#include <kvevict/compressor/basic_compressor.hpp>
#include <kvevict/policies/snapkv.hpp>

using snapkv_compressor = kvevict::basic_compressor<kvevict::policy_list<kvevict::snapkv_traits>>;

kvevict::status plan_one(const kvevict::compressor_options& o, snapkv_compressor* c) {
  return snapkv_compressor::plan(o, c);
}
kvevict::status run_one(const snapkv_compressor& c, std::int64_t layer, const kvevict::sequence_io<kvevict::bf16>* s,
                        std::int64_t n, kvevict::sequence_report* r, kvevict::workspace_span ws) {
  return c.run(layer, s, n, r, ws);
}
