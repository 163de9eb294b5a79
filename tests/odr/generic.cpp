// The generic translation unit: compiled without -march (x86-64 baseline).
#define ODR_ENTRY odr_generic_run
#define ODR_TU odr_generic
#include "layer.inc"
