// Compile cost: the runtime-dtype entry (every storage and query type, every policy).
#include <kvevict/compressor/compressor.hpp>

kvevict::status run_any(const kvevict::compressor& c, std::int64_t layer, const kvevict::any_sequence_io* s,
                        std::int64_t n, kvevict::sequence_report* r, kvevict::workspace_span ws) {
  return c.run(layer, s, n, r, ws);
}
