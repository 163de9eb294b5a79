// Compile cost: runtime_dtype.cpp's engine TU when kvevict::compressor's members that are not
// templates (the runtime-dtype run() among them) are compiled in another TU of the program
// (kvevict/compressor/compile_once.hpp).
#include <kvevict/compressor/compile_once.hpp>
#include <kvevict/compressor/compressor.hpp>

KVEVICT_EXTERN_COMPRESSOR(kvevict::default_policies);

kvevict::status run_any(const kvevict::compressor& c, std::int64_t layer, const kvevict::any_sequence_io* s,
                        std::int64_t n, kvevict::sequence_report* r, kvevict::workspace_span ws) {
  return c.run(layer, s, n, r, ws);
}
