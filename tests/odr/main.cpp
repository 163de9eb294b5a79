// The ODR test's driver (tests/odr/README.md), compiled without -march. Plain C library
// only: the driver must not itself share C++ symbols with the native translation unit.
//
//   odr_test compare               run the generic and the native TU on the same layer: both
//                                  succeed, their kvevict namespaces differ, and they agree
//                                  bit for bit (same CPU path, same kernels)
//   odr_test dump FILE             run only the generic TU (the one a CPU without AVX-512
//                                  may run) and write its output to FILE
//   odr_test diff A B exact|close  compare two dumps: bit for bit, or scores within the
//                                  scoring tolerance and keep-lists equal except at near-ties
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "odr.h"

namespace {

float g_keys[odr_hkv * odr_tokens * odr_dim];
float g_queries[odr_hq * odr_window * odr_dim];
odr_output g_a, g_b;

void make_layer() {
  unsigned s = 12345u;
  auto next = [&s] {
    s = s * 1664525u + 1013904223u;
    return static_cast<float>(s >> 8) / 16777216.0f - 0.5f;
  };
  for (float& x : g_keys) x = 3.0f * next();
  for (float& x : g_queries) x = 6.0f * next();
}

bool same_bits(const odr_output& a, const odr_output& b) {
  return std::memcmp(a.scores, b.scores, sizeof(a.scores)) == 0 && std::memcmp(a.keep, b.keep, sizeof(a.keep)) == 0;
}

/// Scores within 1e-4 relative + 1e-6 of the row's largest finite score; keep-lists equal
/// except for tokens whose score lies within that tolerance of the row's budget edge.
bool close(const odr_output& a, const odr_output& b) {
  for (int c = 0; c < odr_cases; ++c)
    for (int h = 0; h < odr_hkv; ++h) {
      const float* sa = a.scores[c] + h * odr_tokens;
      const float* sb = b.scores[c] + h * odr_tokens;
      double scale = 0.0;
      for (int j = 0; j < odr_tokens; ++j)
        if (std::isfinite(sa[j])) scale = std::fmax(scale, std::fabs(static_cast<double>(sa[j])));
      for (int j = 0; j < odr_tokens; ++j) {
        const double x = sa[j], y = sb[j];
        if (std::isinf(x) || std::isinf(y) ? x != y : std::fabs(x - y) > 1e-4 * std::fabs(x) + 1e-6 * scale) {
          std::printf("case %d head %d token %d: %.9g vs %.9g\n", c, h, j, x, y);
          return false;
        }
      }
      const int64_t* ka = a.keep[c] + h * odr_budget;
      const int64_t* kb = b.keep[c] + h * odr_budget;
      double edge = INFINITY;  // the smallest kept score
      for (int i = 0; i < odr_budget; ++i) edge = std::fmin(edge, static_cast<double>(sa[ka[i]]));
      for (int i = 0; i < odr_budget; ++i) {
        if (ka[i] == kb[i]) continue;
        const int64_t differing[2] = {ka[i], kb[i]};
        for (int64_t k : differing)
          if (std::fabs(static_cast<double>(sa[k]) - edge) > 1e-4 * std::fabs(edge) + 1e-6 * scale) {
            std::printf("case %d head %d: keep-lists differ at token %lld, not a near-tie\n", c, h,
                        static_cast<long long>(k));
            return false;
          }
      }
    }
  return true;
}

bool load(const char* path, odr_output* out) {
  std::FILE* f = std::fopen(path, "rb");
  const bool ok = f != nullptr && std::fread(out, sizeof(*out), 1, f) == 1;
  if (f != nullptr) std::fclose(f);
  return ok;
}

}  // namespace

int main(int argc, char** argv) {
  const char* mode = argc > 1 ? argv[1] : "";
  make_layer();
  const odr_layer in{g_keys, g_queries};
  if (std::strcmp(mode, "compare") == 0) {
    if (odr_generic_run(&in, &g_a) != 0 || odr_native_run(&in, &g_b) != 0) {
      std::printf("FAIL: a translation unit's kvevict calls failed\n");
      return 1;
    }
    std::printf("generic TU: kvevict::%s, CPU path %s\nnative TU:  kvevict::%s, CPU path %s\n", g_a.abi, g_a.cpu_path,
                g_b.abi, g_b.cpu_path);
    if (std::strcmp(g_a.abi, g_b.abi) == 0) {
      std::printf("FAIL: both TUs use the same kvevict namespace: their symbols can be shared\n");
      return 1;
    }
    if (std::strcmp(g_a.cpu_path, g_b.cpu_path) != 0 || !same_bits(g_a, g_b)) {
      std::printf("FAIL: the two TUs disagree\n");
      return 1;
    }
    std::printf("OK: both ran and agree bit for bit (scores and keep-lists of %d cases)\n", odr_cases);
    return 0;
  }
  if (std::strcmp(mode, "dump") == 0 && argc == 3) {
    if (odr_generic_run(&in, &g_a) != 0) return 1;
    std::FILE* f = std::fopen(argv[2], "wb");
    if (f == nullptr || std::fwrite(&g_a, sizeof(g_a), 1, f) != 1) return 1;
    std::fclose(f);
    std::printf("generic TU: kvevict::%s, CPU path %s\n", g_a.abi, g_a.cpu_path);
    return 0;
  }
  if (std::strcmp(mode, "diff") == 0 && argc == 5) {
    if (!load(argv[2], &g_a) || !load(argv[3], &g_b)) return 2;
    const bool exact = std::strcmp(argv[4], "exact") == 0;
    const bool ok = exact ? same_bits(g_a, g_b) : close(g_a, g_b);
    std::printf("%s (%s) vs %s (%s): %s\n", argv[2], g_a.cpu_path, argv[3], g_b.cpu_path,
                ok ? (exact ? "identical" : "within tolerance") : (exact ? "DIFFERENT" : "NOT within tolerance"));
    return ok ? 0 : 1;
  }
  std::fprintf(stderr, "usage: %s compare | dump FILE | diff A B exact|close\n", argv[0]);
  return 2;
}
