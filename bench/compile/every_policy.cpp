// Compile cost: an engine TU that serves every policy (kvevict::compressor, typed bf16 run()).
#include <kvevict/compressor/compressor.hpp>

kvevict::status plan_all(const kvevict::compressor_options& o, kvevict::compressor* c) {
  return kvevict::compressor::plan(o, c);
}
kvevict::status run_all(const kvevict::compressor& c, std::int64_t layer, const kvevict::sequence_io<kvevict::bf16>* s,
                        std::int64_t n, kvevict::sequence_report* r, kvevict::workspace_span ws) {
  return c.run(layer, s, n, r, ws);
}
