/* The C interface between the ODR test's translation units (tests/odr/README.md): plain C
   types only, so the TUs share no C++ symbol except through kvevict itself. */
#ifndef KVEVICT_TESTS_ODR_H
#define KVEVICT_TESTS_ODR_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum { odr_hq = 8, odr_hkv = 2, odr_dim = 128, odr_tokens = 1000, odr_window = 16, odr_budget = 200 };
enum { odr_cases = 6 }; /* {f32, fp16, bf16} x {prompt window W = 16, decode step W = 1} */

/* One layer's inputs as raw storage: keys [Hkv, L, d], queries [Hq, W, d], float32 values
   (the TU converts them to the case's storage type). */
struct odr_layer {
  const float* keys;
  const float* queries;
};

/* Scores [cases][Hkv, L] and keep-lists [cases][Hkv, budget] of SnapKV on every case. */
struct odr_output {
  float scores[odr_cases][odr_hkv * odr_tokens];
  int64_t keep[odr_cases][odr_hkv * odr_budget];
  char cpu_path[32]; /* kvevict::active_cpu_isa() of the process, as this TU sees it */
  char abi[64];      /* the TU's kvevict inline namespace (detail/abi.hpp) */
};

/* 0 on success; compiled once without -march (generic) and once with -march=native. */
int odr_generic_run(const struct odr_layer* in, struct odr_output* out);
int odr_native_run(const struct odr_layer* in, struct odr_output* out);

#ifdef __cplusplus
}
#endif

#endif
