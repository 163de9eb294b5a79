// SPDX-License-Identifier: Apache-2.0
// kvevict_bench_vs_torch: kvevict's SnapKV layer (score + select + evict) side by side with
// the PyTorch pipeline kvpress users run today (repeat_kv, matmul, causal mask, softmax,
// window mean, avg_pool1d, GQA mean, topk, gather of K and V), on the same data, same shape,
// one thread each, in one invocation. For every (dtype, L) it
//   1. builds the layer and writes Q, K, V (raw storage bits) to a work directory,
//   2. runs kvevict once (its keep-lists and scores are saved for the check) and times it,
//   3. runs torch_pipeline.py on the same files: it times the PyTorch pipeline the same way
//      (median process CPU time), and checks that kvevict kept the same tokens as the
//      pipeline evaluated in float32 (identical sets except swaps at near-ties),
//   4. on the CPU paths below AVX-512 (KVEVICT_ISA=avx2 or scalar) times PyTorch again as it
//      runs on a CPU without AVX-512 (bf16 matmuls off oneDNN: torch_pipeline.py
//      --without-avx512),
//   5. prints the ratios, and writes everything to a JSON file.
//
// Usage: kvevict_bench_vs_torch [--quick] [--out results.json] [--work DIR]
//                               [--tokens 4096,32768] [--dtypes bf16,fp16,f32]
//                               [--python /usr/bin/python3] [--script torch_pipeline.py]
#include <sys/stat.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "cases.hpp"
#include "common.hpp"

#ifndef KVEVICT_BENCH_PYTHON
#define KVEVICT_BENCH_PYTHON "/usr/bin/python3"
#endif
#ifndef KVEVICT_BENCH_TORCH_SCRIPT
#define KVEVICT_BENCH_TORCH_SCRIPT "bench/torch_pipeline.py"
#endif

namespace {

struct options {
  bool quick = false;
  std::string out = "vs_torch.json";
  std::string work = "/tmp/kvevict_vs_torch";
  std::string python = KVEVICT_BENCH_PYTHON;
  std::string script = KVEVICT_BENCH_TORCH_SCRIPT;
  std::vector<std::int64_t> tokens = {4096, 32768, 131072};
  std::vector<std::string> dtypes = {"bf16", "fp16", "f32"};
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, ',')) out.push_back(item);
  return out;
}

template <class V>
void write_raw(const std::string& path, const V& v) {
  std::FILE* f = std::fopen(path.c_str(), "wb");
  if (f == nullptr || std::fwrite(v.data(), sizeof(v[0]), v.size(), f) != v.size()) {
    std::fprintf(stderr, "cannot write %s\n", path.c_str());
    std::exit(1);
  }
  std::fclose(f);
}

/// "key value" lines written by torch_pipeline.py.
std::map<std::string, std::string> read_result(const std::string& path) {
  std::map<std::string, std::string> out;
  std::ifstream in(path);
  std::string line;
  while (std::getline(in, line)) {
    const auto sp = line.find(' ');
    if (sp != std::string::npos) out[line.substr(0, sp)] = line.substr(sp + 1);
  }
  return out;
}

std::string json_value(const std::string& v) {
  char* end = nullptr;
  std::strtod(v.c_str(), &end);
  if (!v.empty() && end != nullptr && *end == '\0') return v;
  std::string q = "\"";
  for (char c : v) q += (c == '"' || c == '\\') ? std::string("\\") + c : std::string(1, c);
  return q + "\"";
}

struct case_result {
  std::string dtype;
  std::int64_t tokens = 0;
  double kvevict_ms = 0.0;
  std::map<std::string, std::string> torch;
};

template <class T>
case_result run_case(const options& opt, std::int64_t tokens) {
  const kb::model_shape s = kb::reference_model;
  const std::string dir = opt.work + "/" + kb::dtype_name<T>() + "_" + std::to_string(tokens);
  ::mkdir(opt.work.c_str(), 0755);
  ::mkdir(dir.c_str(), 0755);

  auto lay = std::make_shared<kb::layer<T>>(s, tokens, kb::reference_window);
  write_raw(dir + "/q.bin", lay->q);
  write_raw(dir + "/k.bin", lay->k);
  write_raw(dir + "/v.bin", lay->v);

  kb::snapkv_layer<T> p(lay);
  p.run();  // on the original data: these are the keep-lists the check compares
  {
    const kvevict::const_keep_list_view keep = p.keep.view();
    std::vector<std::int64_t> idx(keep.indices, keep.indices + keep.total());
    write_raw(dir + "/keep.bin", idx);
    write_raw(dir + "/scores.bin", p.scores);
  }
  std::ofstream meta(dir + "/meta.txt");
  meta << "dtype " << kb::dtype_name<T>() << "\nhq " << s.hq << "\nhkv " << s.hkv << "\nd " << s.d << "\ntokens "
       << tokens << "\nwindow " << kb::reference_window << "\nbudget " << kb::reference_budget << "\n";
  meta.close();

  // Later runs evict the already compacted cache again: the same work, different bytes.
  const double t = kb::median_seconds([&] { p.run(); }, opt.quick ? 2 : 3, opt.quick ? 0.2 : 1.0, 20);
  case_result r;
  r.dtype = kb::dtype_name<T>();
  r.tokens = tokens;
  r.kvevict_ms = t * 1e3;

  const std::string env = "OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 OPENBLAS_CORETYPE=SkylakeX ";
  const std::string cmd = env + opt.python + " " + opt.script + " --case " + dir + (opt.quick ? " --quick" : "");
  const int rc = std::system(cmd.c_str());
  if (rc != 0) {
    std::fprintf(stderr, "torch pipeline failed (%d): %s\n", rc, cmd.c_str());
    r.torch["error"] = "torch_pipeline.py exited with " + std::to_string(rc);
  } else {
    r.torch = read_result(dir + "/result.txt");
  }
  // On the paths below AVX-512 also time PyTorch as it runs on such a CPU (an AVX2 machine
  // has no AVX-512 kernels for PyTorch either): both sides then use the same instructions.
  if (rc == 0 && static_cast<int>(kvevict::active_cpu_isa()) < static_cast<int>(kvevict::cpu_isa::avx512)) {
    const std::string cmd2 = env + "OPENBLAS_CORETYPE=Haswell " + opt.python + " " + opt.script + " --case " + dir +
                             " --without-avx512" + (opt.quick ? " --quick" : "");
    if (std::system(cmd2.c_str()) == 0) {
      const auto extra = read_result(dir + "/result_without_avx512.txt");
      r.torch.insert(extra.begin(), extra.end());
    }
  }
  for (const char* f : {"q.bin", "k.bin", "v.bin", "keep.bin", "scores.bin"}) std::remove((dir + "/" + f).c_str());
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  options opt;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n", a.c_str());
        std::exit(2);
      }
      return argv[++i];
    };
    if (a == "--quick") {
      opt.quick = true;
      opt.tokens = {4096};
      opt.dtypes = {"bf16"};
    } else if (a == "--out") {
      opt.out = next();
    } else if (a == "--work") {
      opt.work = next();
    } else if (a == "--python") {
      opt.python = next();
    } else if (a == "--script") {
      opt.script = next();
    } else if (a == "--tokens") {
      opt.tokens.clear();
      for (const auto& t : split(next())) opt.tokens.push_back(std::atoll(t.c_str()));
    } else if (a == "--dtypes") {
      opt.dtypes = split(next());
    } else {
      std::fprintf(stderr, "usage: %s [--quick] [--out FILE] [--work DIR] [--tokens L,..] [--dtypes bf16,fp16,f32]\n",
                   argv[0]);
      return 2;
    }
  }

  std::printf("kvevict SnapKV layer vs the PyTorch kvpress pipeline (%s; one thread each, CPU time)\n",
              kb::build_line().c_str());
  std::printf("shape: %s, Hq=32 Hkv=8 d=128, W=%lld, B=%lld (window inside), kvpress conventions\n\n",
              kb::reference_model.name, static_cast<long long>(kb::reference_window),
              static_cast<long long>(kb::reference_budget));
  std::printf(
      "| dtype | L | kvevict (ms) | PyTorch (ms) | speed-up | same keep sets |\n|---|---:|---:|---:|---:|---|\n");
  std::fflush(stdout);

  std::vector<case_result> results;
  for (std::int64_t l : opt.tokens)
    for (const auto& dt : opt.dtypes) {
      case_result r;
      if (dt == "bf16")
        r = run_case<kb::bf16>(opt, l);
      else if (dt == "fp16")
        r = run_case<kb::fp16>(opt, l);
      else if (dt == "f32")
        r = run_case<float>(opt, l);
      else {
        std::fprintf(stderr, "unknown dtype %s\n", dt.c_str());
        return 2;
      }
      const double torch_ms = r.torch.count("torch_ms") ? std::atof(r.torch["torch_ms"].c_str()) : 0.0;
      std::string agree = r.torch.count("agree") ? (r.torch["agree"] == "1" ? "yes" : "NO") : "n/a";
      if (r.torch.count("near_tie_swaps") && r.torch["near_tie_swaps"] != "0")
        agree += " (" + r.torch["near_tie_swaps"] + " near-tie swaps)";
      std::printf("| %s | %lld | %.1f | %.1f | %.1fx | %s |\n", r.dtype.c_str(), static_cast<long long>(l),
                  r.kvevict_ms, torch_ms, torch_ms > 0 ? torch_ms / r.kvevict_ms : 0.0, agree.c_str());
      if (r.torch.count("torch_without_avx512_ms")) {
        const double t2 = std::atof(r.torch["torch_without_avx512_ms"].c_str());
        std::printf("|   PyTorch as on a CPU without AVX-512 | | | %.1f | %.1fx | |\n", t2, t2 / r.kvevict_ms);
      }
      std::fflush(stdout);
      results.push_back(r);
    }

  std::ofstream out(opt.out);
  out << "{\n  \"build\": " << json_value(kb::build_line()) << ",\n  \"cases\": [\n";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const auto& r = results[i];
    out << "    {\"dtype\": \"" << r.dtype << "\", \"tokens\": " << r.tokens << ", \"kvevict_ms\": " << r.kvevict_ms;
    for (const auto& kv : r.torch) out << ", \"" << kv.first << "\": " << json_value(kv.second);
    out << "}" << (i + 1 < results.size() ? "," : "") << "\n";
  }
  out << "  ]\n}\n";
  std::printf("\nwrote %s\n", opt.out.c_str());
  return 0;
}
