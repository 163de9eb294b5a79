// Writes random SnapKV cases and kvevict's scores and keep-lists for them, for
// kvpress_snapkv_oracle.py to check with PyTorch. Usage: kvevict_torch_oracle <dir>
#include <kvevict/kvevict.hpp>

#include <cstdio>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

template <class T>
void write(const std::string& path, const std::vector<T>& v) {
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(v.data()), static_cast<std::streamsize>(v.size() * sizeof(T)));
}

template <class T>
int run_case(const std::string& dir, int id, std::int64_t hkv, std::int64_t g, std::int64_t d, std::int64_t l,
             std::int64_t w, double ratio, std::ofstream& manifest) {
  const std::int64_t hq = hkv * g;
  std::mt19937_64 rng(static_cast<std::uint64_t>(1000 + id));
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<T> k(static_cast<std::size_t>(hkv * l * d)), q(static_cast<std::size_t>(hq * w * d));
  std::vector<float> kf(k.size()), qf(q.size());
  for (std::size_t i = 0; i < k.size(); ++i) {
    k[i] = kvevict::from_float<T>(normal(rng));
    kf[i] = kvevict::to_float(k[i]);
  }
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = kvevict::from_float<T>(1.5f * normal(rng));
    qf[i] = kvevict::to_float(q[i]);
  }
  std::vector<std::int64_t> pos;
  for (std::int64_t t = 0; t < w; ++t) pos.push_back(l - w + t);

  kvevict::window_config cfg = kvevict::presets::kvpress_snapkv();
  cfg.window = w;
  kvevict::snapkv<T> policy(cfg);
  kvevict::layer_inputs<T> in;
  in.keys = kvevict::hf_contiguous(k.data(), hkv, l, d);
  in.queries = kvevict::contiguous_queries(q.data(), hq, w, d, pos.data());
  std::vector<float> scores(static_cast<std::size_t>(hkv * l));
  kvevict::workspace ws(policy.workspace_size({hq, hkv, d, l, w}));
  kvevict::status st = policy.score(in, {scores.data(), hkv, l, l}, ws);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message());
    return 1;
  }
  const auto budget = kvevict::budget::ratio(ratio);
  kvevict::keep_list keep(hkv, kvevict::select_capacity(hkv, l, budget, policy.selection()));
  kvevict::workspace sws(kvevict::select_workspace_size(l));
  st = kvevict::select(kvevict::const_score_view{scores.data(), hkv, l, l}, budget, policy.selection(), keep, sws);
  if (!st.ok()) {
    std::fprintf(stderr, "%s\n", st.message());
    return 1;
  }
  std::vector<std::int64_t> kept;
  for (std::int64_t h = 0; h < hkv; ++h) {
    const auto v = keep.head(h);
    kept.insert(kept.end(), v.begin(), v.end());
  }
  const std::string base = dir + "/case" + std::to_string(id);
  write(base + ".k.f32", kf);
  write(base + ".q.f32", qf);
  write(base + ".scores.f32", scores);
  write(base + ".keep.i64", kept);
  manifest << id << ' ' << kvevict::to_string(kvevict::dtype_of<T>::value) << ' ' << hkv << ' ' << g << ' ' << d << ' '
           << l << ' ' << w << ' ' << ratio << ' ' << keep.size(0) << '\n';
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 2) {
    std::fprintf(stderr, "usage: %s <dir>\n", argv[0]);
    return 2;
  }
  const std::string dir = argv[1];
  std::ofstream manifest(dir + "/manifest.txt");
  int id = 0, rc = 0;
  rc |= run_case<float>(dir, id++, 2, 4, 64, 301, 16, 0.5, manifest);
  rc |= run_case<kvevict::bf16>(dir, id++, 8, 4, 128, 1025, 64, 0.75, manifest);
  rc |= run_case<kvevict::fp16>(dir, id++, 4, 1, 64, 513, 32, 0.9, manifest);
  rc |= run_case<kvevict::bf16>(dir, id++, 1, 8, 128, 2049, 64, 0.8, manifest);
  rc |= run_case<float>(dir, id++, 2, 2, 64, 97, 64, 0.3, manifest);
  return rc;
}
