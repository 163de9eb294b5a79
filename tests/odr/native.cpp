// The native translation unit: compiled with -march=native.
#define ODR_ENTRY odr_native_run
#define ODR_TU odr_native
#include "layer.inc"
