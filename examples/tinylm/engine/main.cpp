// kvevict_tinylm: a C++ engine for TinyLM that uses kvevict exactly as an engine would, and
// the fidelity bench that measures what each policy keeps and loses.
//
//   kvevict_tinylm --check-logits            logits vs the PyTorch model (reference_logits.txt)
//   kvevict_tinylm --bench [--per-task N] [--budgets 0.5,0.25] [--policies a,b] [--json out]
//   kvevict_tinylm --ci                       2 prompts per task, 2 budgets, every policy
//   kvevict_tinylm --demo                     logits check + a few prompts, printed
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "model.hpp"
#include "policies.hpp"

#ifndef KVEVICT_TINYLM_DIR
#define KVEVICT_TINYLM_DIR "."
#endif

namespace tinylm {
namespace {

struct prompt_case {
  std::string task;
  std::vector<std::int32_t> ids, answer;
};

std::vector<std::int32_t> parse_ids(const std::string& s) {
  std::vector<std::int32_t> v;
  std::istringstream in(s);
  long x = 0;
  while (in >> x) v.push_back(static_cast<std::int32_t>(x));
  return v;
}

std::vector<prompt_case> load_prompts(const std::string& path) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::vector<prompt_case> out;
  std::string line;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    const auto a = line.find('|'), b = line.find('|', a + 1);
    out.push_back({line.substr(0, a), parse_ids(line.substr(a + 1, b - a - 1)), parse_ids(line.substr(b + 1))});
  }
  return out;
}

prefill_state prefill(const model& m, const prompt_case& pc, bool with_pseudo) {
  prefill_state p;
  p.prompt_tokens = static_cast<std::int64_t>(pc.ids.size());
  const std::int64_t capacity = p.prompt_tokens + kPseudoTokens + static_cast<std::int64_t>(pc.answer.size()) + 8;
  p.cache = kv_cache(m.cfg, capacity);
  const matrix logits = forward(m, p.cache, pc.ids.data(), p.prompt_tokens, 0, &p.queries);
  p.first_token = argmax(logits, p.prompt_tokens - 1);
  for (std::int64_t t = 0; t < p.prompt_tokens; ++t) p.positions.push_back(t);
  if (with_pseudo) {
    // DapQ: N pseudo tokens (first 8 + last 24 prompt tokens) prefilled at Lp .. Lp+N-1.
    std::vector<std::int32_t> pseudo(static_cast<std::size_t>(kPseudoTokens));
    check(kvevict::dapq_pseudo_tokens_first_last(pc.ids.data(), p.prompt_tokens, 8, kPseudoTokens - 8, pseudo.data()));
    p.pseudo_positions.resize(static_cast<std::size_t>(kPseudoTokens));
    kvevict::dapq_pseudo_positions(p.prompt_tokens, kPseudoTokens, p.pseudo_positions.data());
    p.pseudo_cache = p.cache;
    forward(m, p.pseudo_cache, pseudo.data(), kPseudoTokens, p.prompt_tokens, &p.pseudo_queries);
  }
  return p;
}

/// The attention hook of a decode step: the layer, its post-RoPE queries [1, Hq * d] and the
/// position of the token being decoded.
using decode_hook = std::function<void(std::int64_t layer, const float* queries, std::int64_t position)>;

/// Greedy decoding until `generated` holds n tokens; the next fed token is generated.back()
/// at `position`. Returns the number of model steps run.
std::int64_t decode(const model& m, kv_cache& cache, std::vector<std::int32_t>& generated, std::int64_t position,
                    std::size_t n, const decode_hook& hook = nullptr) {
  std::int64_t steps = 0;
  while (generated.size() < n) {
    const std::int64_t here = position;
    attention_hook h = nullptr;
    if (hook) h = [&](std::int64_t layer, const float* q, std::int64_t) { hook(layer, q, here); };
    const matrix logits = forward(m, cache, &generated.back(), 1, position++, nullptr, h);
    generated.push_back(argmax(logits, 0));
    ++steps;
  }
  return steps;
}

std::int64_t budget_tokens(double fraction, std::int64_t prompt_tokens) {
  return std::max<std::int64_t>(1,
                                static_cast<std::int64_t>(std::llround(fraction * static_cast<double>(prompt_tokens))));
}

struct outcome {
  bool correct = false;
  bool evicted_before_answer = true;  // false when the answer was complete before eviction
};

struct call_counter {
  std::int64_t calls = 0;
  static void on_run(void* ctx, const kvevict::run_trace&) { ++static_cast<call_counter*>(ctx)->calls; }
};

/// One policy at one budget on one prompt, as an engine runs it: the prompt's prefill (shared
/// by every case, so its hook calls are made here on the saved queries), DapQ's pseudo-token
/// prefill, then greedy decoding -- with exactly one compressor run() per layer per model
/// step. Throws if the call count differs.
outcome run_case(const model& m, const prefill_state& p, const prompt_case& pc, const policy_spec& spec,
                 double fraction) {
  const std::int64_t lp = p.prompt_tokens, hq = m.cfg.heads, hkv = m.cfg.kv_heads, d = m.cfg.head_dim;
  const std::size_t n = pc.answer.size();
  std::vector<std::int32_t> generated = {p.first_token};
  outcome out;
  if (spec.kind == policy_kind::full) {
    kv_cache cache = p.cache;
    decode(m, cache, generated, lp, n);
    generated.resize(n);
    out.correct = generated == pc.answer;
    return out;
  }
  const bool pseudo = spec.kind == policy_kind::dapq;
  kv_cache cache = pseudo ? p.pseudo_cache : p.cache;
  kvevict::compressor_options options = compressor_for(m, spec, budget_tokens(fraction, lp), cache.capacity);
  call_counter counter;
  options.tracer = {&counter, &call_counter::on_run};
  kvevict::compressor compressor;
  check(kvevict::compressor::plan(options, &compressor));
  kvevict::workspace ws(compressor.workspace_size());
  std::vector<std::uint64_t> state(compressor.sequence_state_size() / 8 + 1);
  check(compressor.reset_sequence(state.data(), state.size() * 8));
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(hkv));
  std::int64_t next_position = lp;
  bool evicted = false;
  // The hook: one run() for this layer (tinylm's batch is one sequence).
  auto run = [&](std::int64_t layer, kvevict::sequence_event event, kvevict::query_view<const float> queries) {
    kvevict::sequence_io<float> io;
    io.event = event;
    io.keys = cache.keys(layer, cache.length(layer));
    io.values = cache.values(layer, cache.length(layer));
    io.queries = queries;
    io.state = state.data();
    io.head_lengths = lengths.data();
    std::vector<kvevict::layer_cache<float>> layers;  // a keep set shared by every layer compacts them all
    for (std::int64_t l = 0; l < m.cfg.layers; ++l)
      layers.emplace_back(cache.keys(l, cache.length(l)), cache.values(l, cache.length(l)));
    io.layers = layers.data();
    kvevict::sequence_report report;
    check(compressor.run(layer, &io, 1, &report, ws));
    if (report.action == kvevict::sequence_action::evicted) {
      if (spec.scope == kvevict::selection_scope::per_sequence) {  // every layer compacted at the last one
        for (auto& per_layer : cache.lengths) per_layer = lengths;
      } else {
        cache.lengths[static_cast<std::size_t>(layer)] = lengths;  // per head (AdaKV)
      }
      next_position = report.next_position;
      evicted = true;
    }
  };
  std::int64_t steps = 1;
  if (pseudo) {  // the prompt's step: nothing to do yet; then the pseudo tokens' step
    for (std::int64_t l = 0; l < m.cfg.layers; ++l) run(l, kvevict::sequence_event::idle, {});
    ++steps;
    for (std::int64_t l = 0; l < m.cfg.layers; ++l)
      run(l, kvevict::sequence_event::prefill_end,
          kvevict::contiguous_queries<const float>(p.pseudo_queries[static_cast<std::size_t>(l)].data(), hq,
                                                   kPseudoTokens, d, p.pseudo_positions.data()));
  } else {
    for (std::int64_t l = 0; l < m.cfg.layers; ++l)
      run(l, kvevict::sequence_event::prefill_end,
          kvevict::contiguous_queries<const float>(p.queries[static_cast<std::size_t>(l)].data(), hq, lp, d,
                                                   p.positions.data()));
  }
  if (!evicted) next_position = lp;  // DeferKV: eviction comes at a decode step
  std::size_t generated_at_eviction = 0;
  steps +=
      decode(m, cache, generated, next_position, n, [&](std::int64_t layer, const float* q, std::int64_t position) {
        const bool before = evicted;
        run(layer, kvevict::sequence_event::decode, kvevict::token_major_queries<const float>(q, hq, 1, d, &position));
        if (!before && evicted) generated_at_eviction = generated.size() + 1;
      });
  if (spec.kind == policy_kind::deferkv) out.evicted_before_answer = evicted && generated_at_eviction < n;
  if (counter.calls != m.cfg.layers * steps)
    throw std::runtime_error(spec.name + ": " + std::to_string(counter.calls) + " compressor calls for " +
                             std::to_string(steps) + " steps of " + std::to_string(m.cfg.layers) + " layers");
  generated.resize(n);
  out.correct = generated == pc.answer;
  return out;
}

int check_logits(const model& m, const std::string& path, bool verbose) {
  std::ifstream f(path);
  if (!f) throw std::runtime_error("cannot open " + path);
  std::string line;
  double worst = 0.0;
  int prompts = 0, argmax_mismatch = 0;
  while (std::getline(f, line)) {
    if (line.empty() || line[0] == '#') continue;
    if (line[0] != 'P') continue;
    std::vector<std::int32_t> head = parse_ids(line.substr(1));
    const std::int64_t t = head[0];
    std::vector<std::int32_t> ids(head.begin() + 1, head.end());
    std::getline(f, line);  // answer line
    kv_cache cache(m.cfg, t + 4);
    const matrix logits = forward(m, cache, ids.data(), t, 0);
    for (std::int64_t i = 0; i < t; ++i) {
      std::getline(f, line);
      std::istringstream in(line);
      Eigen::Index best = 0, ref_best = 0;
      float ref_max = -1e30f;
      for (std::int64_t c = 0; c < m.cfg.vocab; ++c) {
        double r = 0;
        in >> r;
        worst = std::max(worst, std::fabs(r - static_cast<double>(logits(i, c))));
        if (static_cast<float>(r) > ref_max) {
          ref_max = static_cast<float>(r);
          ref_best = c;
        }
      }
      logits.row(i).maxCoeff(&best);
      argmax_mismatch += best != ref_best ? 1 : 0;
    }
    ++prompts;
  }
  const bool ok = prompts > 0 && worst < 1e-3 && argmax_mismatch == 0;
  if (verbose || !ok)
    std::printf("logits vs PyTorch: %d prompts, max |diff| = %.3g (tolerance 1e-3), argmax mismatches %d: %s\n",
                prompts, worst, argmax_mismatch, ok ? "ok" : "FAILED");
  return ok ? 0 : 1;
}

std::vector<double> parse_doubles(const std::string& s) {
  std::vector<double> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::stod(item));
  return v;
}

int bench(const model& m, const std::vector<prompt_case>& all, std::int64_t per_task,
          const std::vector<double>& budgets, const std::vector<policy_spec>& policies, const std::string& json_path,
          bool verbose) {
  std::map<std::string, std::int64_t> taken;
  std::vector<prompt_case> prompts;
  for (const auto& pc : all)
    if (taken[pc.task]++ < per_task) prompts.push_back(pc);
  const auto t0 = std::chrono::steady_clock::now();
  // results[policy][budget index][task] = {correct, total}
  std::map<std::string, std::vector<std::map<std::string, std::pair<int, int>>>> results;
  std::map<std::string, int> late;
  bool need_pseudo = false;
  for (const auto& s : policies) need_pseudo |= s.kind == policy_kind::dapq;
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const prompt_case& pc = prompts[i];
    const prefill_state p = prefill(m, pc, need_pseudo);
    for (const auto& spec : policies) {
      auto& per_budget = results[spec.name];
      per_budget.resize(budgets.size());
      for (std::size_t b = 0; b < budgets.size(); ++b) {
        const outcome o = run_case(m, p, pc, spec, budgets[b]);
        auto& cell = per_budget[b][pc.task];
        cell.first += o.correct ? 1 : 0;
        cell.second += 1;
        if (b == 0 && !o.evicted_before_answer) ++late[spec.name];
      }
    }
    if (verbose && (i + 1) % 20 == 0)
      std::fprintf(stderr, "  %zu/%zu prompts (%.0f s)\n", i + 1, prompts.size(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::vector<std::string> tasks;
  for (const auto& kv : taken) tasks.push_back(kv.first);

  // Print a compact table: mean accuracy over tasks per policy and budget.
  std::printf("%-22s", "policy \\ budget");
  for (double b : budgets) std::printf(" %7.2f%%", 100 * b);
  std::printf("\n");
  for (const auto& spec : policies) {
    std::printf("%-22s", spec.name.c_str());
    for (std::size_t b = 0; b < budgets.size(); ++b) {
      double acc = 0;
      for (const auto& t : tasks) {
        const auto& c = results[spec.name][b][t];
        acc += c.second ? static_cast<double>(c.first) / c.second : 0;
      }
      std::printf(" %7.1f%%", 100 * acc / static_cast<double>(tasks.size()));
    }
    std::printf("\n");
  }
  std::printf("(%zu prompts, %.1f s)\n", prompts.size(), seconds);

  if (!json_path.empty()) {
    std::ofstream j(json_path);
    // No timings in the file: the results of a run are a function of the code and the data.
    j << "{\n  \"prompts_per_task\": " << per_task << ",\n  \"context_tokens\": 1024,\n  \"budgets\": [";
    for (std::size_t b = 0; b < budgets.size(); ++b) j << (b ? ", " : "") << budgets[b];
    j << "],\n  \"tasks\": [";
    for (std::size_t t = 0; t < tasks.size(); ++t) j << (t ? ", " : "") << '"' << tasks[t] << '"';
    j << "],\n  \"results\": {\n";
    for (std::size_t s = 0; s < policies.size(); ++s) {
      const auto& name = policies[s].name;
      j << "    \"" << name << "\": {\"late_eviction\": " << late[name] << ", \"accuracy\": [";
      for (std::size_t b = 0; b < budgets.size(); ++b) {
        j << (b ? ", " : "") << "{";
        for (std::size_t t = 0; t < tasks.size(); ++t) {
          const auto& c = results[name][b][tasks[t]];
          j << (t ? ", " : "") << '"' << tasks[t] << "\": [" << c.first << ", " << c.second << "]";
        }
        j << "}";
      }
      j << "]}" << (s + 1 < policies.size() ? "," : "") << "\n";
    }
    j << "  }\n}\n";
  }
  // The bench is meaningless unless full KV answers correctly.
  int full_wrong = 0;
  for (const auto& kv : results["full"].empty() ? std::map<std::string, std::pair<int, int>>() : results["full"][0])
    full_wrong += kv.second.second - kv.second.first;
  return full_wrong;
}

}  // namespace
}  // namespace tinylm

int main(int argc, char** argv) {
  using namespace tinylm;
  std::string dir = KVEVICT_TINYLM_DIR;
  std::string weights = dir + "/weights/tinylm.safetensors", prompts_path = dir + "/data/eval_prompts.txt";
  std::string ref = dir + "/data/reference_logits.txt", json;
  std::string mode = "demo", policy_list = "all", budget_list = "0.5,0.25,0.125,0.0625,0.03";
  std::int64_t per_task = 100;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return argv[++i];
    };
    if (a == "--check-logits")
      mode = "check";
    else if (a == "--bench")
      mode = "bench";
    else if (a == "--ci")
      mode = "ci";
    else if (a == "--demo")
      mode = "demo";
    else if (a == "--weights")
      weights = next();
    else if (a == "--prompts")
      prompts_path = next();
    else if (a == "--reference")
      ref = next();
    else if (a == "--per-task")
      per_task = std::stoll(next());
    else if (a == "--budgets")
      budget_list = next();
    else if (a == "--policies")
      policy_list = next();
    else if (a == "--json")
      json = next();
    else {
      std::fprintf(stderr,
                   "usage: %s [--check-logits|--bench|--ci|--demo] [--per-task N] [--budgets f,..] "
                   "[--policies a,..] [--json out] [--weights f] [--prompts f]\n",
                   argv[0]);
      return 2;
    }
  }
  try {
    const model m = model::load(weights);
    std::vector<policy_spec> policies;
    for (const auto& p : all_policies())
      if (policy_list == "all" || ("," + policy_list + ",").find("," + p.name + ",") != std::string::npos)
        policies.push_back(p);
    if (mode == "check") return check_logits(m, ref, true);
    const auto prompts = load_prompts(prompts_path);
    if (mode == "ci") {
      if (check_logits(m, ref, true) != 0) return 1;
      const int wrong = bench(m, prompts, 2, {0.25, 0.0625}, all_policies(), json, false);
      std::printf("tinylm CI slice: every policy ran end to end; full-KV wrong answers: %d\n", wrong);
      return wrong == 0 ? 0 : 1;
    }
    if (mode == "demo") {
      if (check_logits(m, ref, true) != 0) return 1;
      std::vector<policy_spec> some;
      for (const auto& p : all_policies())
        if (p.name == "full" || p.name == "streaming_llm" || p.name == "snapkv" || p.name == "deferkv_eta0.9_d1" ||
            p.name == "dapq")
          some.push_back(p);
      bench(m, prompts, 5, {0.125, 0.03}, some, json, false);
      return 0;
    }
    const int wrong = bench(m, prompts, per_task, parse_doubles(budget_list), policies, json, true);
    if (wrong > 0) std::printf("note: full KV answered %d prompts wrong\n", wrong);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "kvevict_tinylm: %s\n", e.what());
    return 1;
  }
}
