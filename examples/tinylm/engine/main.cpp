// kvevict_tinylm: a C++ engine for TinyLM that uses kvevict exactly as an engine would, and
// the fidelity bench that measures what each policy keeps and loses.
//
//   kvevict_tinylm --check-logits            logits vs the PyTorch model (reference_logits.txt)
//   kvevict_tinylm --bench [--per-task N] [--budgets 0.5,0.25] [--policies a,b] [--json out]
//   kvevict_tinylm --ci                       2 prompts per task, 2 budgets, every policy
//   kvevict_tinylm --demo                     logits check + a few prompts, printed
//   kvevict_tinylm --long-generation [--tasks longchain] [--per-task N] [--setup P:F:T,..:N]..
//                  [--scorers a,b|none] [--json out] [--markdown out]
//                                             decode-time budgets on the 4-layer model's longchain
//                                             (a setup: the prompt's policy none|h2o|snapkv, the
//                                             fraction of the prompt it keeps, targets, N)
//   kvevict_tinylm --long-generation-ci       the same, 2 prompts, one target, every scorer
//   kvevict_tinylm --fidelity2 [--per-task N] [--tasks t,..] [--settings S1,S2,S3] [--budgets f,..]
//                  [--policies a,b] [--jsonl out] [--prompts f1,f2] [--skip-per-task N]
//                                             the Fidelity-2 bench (fidelity2.hpp): DeferKV, DapQ
//                                             and the rest on the 4-layer model's long-answer tasks,
//                                             per-prompt JSON lines (prompt indices run on
//                                             across the files; --skip-per-task N leaves out
//                                             each task's first N)
//   kvevict_tinylm --fidelity2 --quick        2 prompts per task, 2 budgets, every policy and
//                                             setting; fails when a check does not hold
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

#include "fidelity2.hpp"
#include "long_generation.hpp"
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
    kvevict::sequence_io<float> io = layer_io(cache, layer, event, queries, state.data(), lengths.data());
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

std::vector<std::int64_t> parse_ints(const std::string& s) {
  std::vector<std::int64_t> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(std::stoll(item));
  return v;
}

std::vector<std::string> parse_names(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream in(s);
  std::string item;
  while (std::getline(in, item, ',')) v.push_back(item);
  return v;
}

/// What one row of the long-generation tables adds up over a task's prompts at one target.
struct generation_cell {
  std::int64_t prompts = 0, exact = 0, tokens = 0, tokens_right = 0, rounds = 0, most_rows = 0;
  std::int64_t first_rows = 0, first_dropped = 0, first_unread = 0, first_unread_dropped = 0;
};

/// For each prompt position inside a statement `[VAR] src -> dst` of the asked chain
/// (vartrack, longchain), the index of dst in the answer; -1 elsewhere and for other tasks.
std::vector<std::int64_t> chain_statements(const prompt_case& pc) {
  std::vector<std::int64_t> at(pc.ids.size(), -1);
  if (pc.task != "longchain" && pc.task != "vartrack") return at;
  constexpr std::int32_t kVar = 5;  // [VAR] (MODEL.md, vocabulary)
  for (std::size_t q = 0; q + 3 < pc.ids.size(); ++q) {
    if (pc.ids[q] != kVar) continue;
    const auto it = std::find(pc.answer.begin(), pc.answer.end(), pc.ids[q + 3]);
    if (it != pc.answer.end())
      for (std::size_t k = 0; k < 4; ++k) at[q + k] = it - pc.answer.begin();
  }
  return at;
}

/// One table of the long-generation bench: the prompt's policy and budget, then the decode
/// targets at one interval N. "none" keeps the whole prompt (per_head = ratio(0)).
struct generation_setup {
  std::string prompt_policy = "none";
  double prompt_fraction = 0;  // of the prompt, kept per KV head at prefill_end; 0 with "none"
  std::vector<std::int64_t> targets;
  std::int64_t interval = 4;
};

/// POLICY:FRACTION:TARGETS[:N], e.g. h2o:0.5:384,256,128,64:4.
generation_setup parse_setup(const std::string& text) {
  std::vector<std::string> parts;
  std::stringstream in(text);
  std::string item;
  while (std::getline(in, item, ':')) parts.push_back(item);
  if (parts.size() < 3 || parts.size() > 4)
    throw std::runtime_error("--setup " + text + ": expected POLICY:FRACTION:TARGETS[:N]");
  generation_setup s;
  s.prompt_policy = parts[0];
  s.prompt_fraction = std::stod(parts[1]);
  s.targets = parse_ints(parts[2]);
  if (parts.size() == 4) s.interval = std::stoll(parts[3]);
  if ((s.prompt_policy == "none") != (s.prompt_fraction == 0) || s.prompt_fraction < 0 || s.prompt_fraction >= 1)
    throw std::runtime_error("--setup " + text + ": \"none\" keeps the whole prompt (fraction 0); " +
                             "a policy compresses it to a fraction in (0, 1)");
  if (s.targets.empty() || s.interval < 1) throw std::runtime_error("--setup " + text + ": no targets, or N < 1");
  (void)prompt_policy(s.prompt_policy == "none" ? "snapkv" : s.prompt_policy);  // refuses an unknown name
  return s;
}

std::string setup_text(const generation_setup& s) {
  char fraction[32];
  std::snprintf(fraction, sizeof(fraction), "%g", s.prompt_fraction);
  std::string t = s.prompt_policy + ":" + fraction + ":";
  for (std::size_t i = 0; i < s.targets.size(); ++i) t += (i ? "," : "") + std::to_string(s.targets[i]);
  return t + ":" + std::to_string(s.interval);
}

struct long_generation_settings {
  std::vector<std::string> tasks = {"longchain"};
  std::int64_t per_task = 100;
  // The whole prompt kept, then decode-time budgets only, N = 4 (compressions at decode steps 1,
  // 6 and 11 of the 16-token answer) and N = 16 (one compression, at step 1); the prompt
  // compressed by H2O to half of it, then targets below that; the same with SnapKV, the main
  // bench's prompt policy, whose window of the last 8 prompt queries sees the question but not
  // the chain.
  std::vector<generation_setup> setups = {{"none", 0, {1016, 960, 896, 768, 512, 256}, 4},
                                          {"none", 0, {960, 768, 512}, 16},
                                          {"h2o", 0.5, {448, 384, 256, 128}, 4},
                                          {"snapkv", 0.5, {384, 128}, 4}};
  std::vector<std::string> scorers;  // empty: every decode scorer; {"none"}: none (full KV, prompt only)
  std::string weights_name, prompts_name;
};

/// The engine's command line that reproduces a run with these settings.
std::string long_generation_command(const long_generation_settings& s) {
  auto join = [](const std::vector<std::string>& v) {
    std::string out;
    for (std::size_t i = 0; i < v.size(); ++i) out += (i ? "," : "") + v[i];
    return out;
  };
  std::string c =
      "kvevict_tinylm --long-generation --tasks " + join(s.tasks) + " --per-task " + std::to_string(s.per_task);
  for (const auto& setup : s.setups) c += " --setup " + setup_text(setup);
  if (!s.scorers.empty()) c += " --scorers " + join(s.scorers);
  return c;
}

/// The long-generation bench: per prompt, full KV, and per setup the prompt compressed once
/// (decoding off) and every decode scorer at every target. Returns the number of full-KV
/// wrong answers; with `smoke`, -1 unless every decoding row compressed during the answer and
/// stayed within target + N rows.
int long_generation(const model& m, const std::vector<prompt_case>& all, const long_generation_settings& s,
                    const std::string& json_path, const std::string& markdown_path, bool verbose, bool smoke) {
  std::vector<decode_scorer> scorers;
  for (const auto& sc : decode_scorers())
    if (s.scorers.empty() || std::find(s.scorers.begin(), s.scorers.end(), sc.name) != s.scorers.end())
      scorers.push_back(sc);
  for (const auto& name : s.scorers) {
    const auto known = decode_scorers();
    if (name != "none" &&
        std::none_of(known.begin(), known.end(), [&](const decode_scorer& k) { return k.name == name; }))
      throw std::runtime_error("--scorers: no decode scorer " + name);
  }
  std::map<std::string, std::int64_t> taken;
  std::vector<prompt_case> prompts;
  for (const auto& pc : all)
    if (std::find(s.tasks.begin(), s.tasks.end(), pc.task) != s.tasks.end() && taken[pc.task] < s.per_task) {
      ++taken[pc.task];
      prompts.push_back(pc);
    }
  if (prompts.empty()) throw std::runtime_error("no prompts of the tasks asked for");
  std::vector<std::string> tasks;
  for (const auto& t : s.tasks)
    if (taken[t] > 0) tasks.push_back(t);
  std::vector<std::string> rows = {"prompt_only"};
  for (const auto& sc : scorers) rows.push_back(sc.name);
  // full[task]; cells[task][setup][row][target index] (prompt_only fills index 0).
  std::map<std::string, generation_cell> full;
  std::map<std::string, std::vector<std::map<std::string, std::vector<generation_cell>>>> cells;
  std::map<std::string, std::int64_t> prompt_tokens, answer_tokens;
  std::map<std::string, std::vector<std::int64_t>> prompt_rows;  // [task][setup]
  auto add = [](generation_cell& c, const prompt_case& pc, const generation_result& r) {
    const std::size_t n = pc.answer.size();
    ++c.prompts;
    c.exact += r.generated == pc.answer ? 1 : 0;
    c.tokens += static_cast<std::int64_t>(n);
    for (std::size_t t = 0; t < n; ++t) c.tokens_right += r.generated[t] == pc.answer[t] ? 1 : 0;
    c.rounds += r.rounds;
    c.most_rows = std::max(c.most_rows, r.most_rows);
    c.first_rows += r.first_rows;
    c.first_dropped += r.first_dropped;
    c.first_unread += r.first_unread;
    c.first_unread_dropped += r.first_unread_dropped;
  };
  const auto t0 = std::chrono::steady_clock::now();
  for (std::size_t i = 0; i < prompts.size(); ++i) {
    const prompt_case& pc = prompts[i];
    const prefill_state p = prefill(m, pc, false);
    const std::size_t n = pc.answer.size();
    const std::vector<std::int64_t> chain = chain_statements(pc);
    prompt_tokens[pc.task] = p.prompt_tokens;
    answer_tokens[pc.task] = static_cast<std::int64_t>(n);
    generation_config config;
    add(full[pc.task], pc, run_generation(m, p, n, config));
    auto& per_setup = cells[pc.task];
    per_setup.resize(s.setups.size());
    prompt_rows[pc.task].assign(s.setups.size(), 0);
    for (std::size_t u = 0; u < s.setups.size(); ++u) {
      const generation_setup& setup = s.setups[u];
      config.prompt = prompt_policy(setup.prompt_policy == "none" ? "snapkv" : setup.prompt_policy);
      config.prompt_budget = setup.prompt_fraction > 0 ? budget_tokens(setup.prompt_fraction, p.prompt_tokens) : 0;
      prompt_rows[pc.task][u] = config.prompt_budget > 0 ? config.prompt_budget : p.prompt_tokens;
      for (const auto& row : rows) per_setup[u][row].resize(setup.targets.size());
      config.mode = generation_config::kind::prompt_only;
      add(per_setup[u]["prompt_only"][0], pc, run_generation(m, p, n, config, &chain));
      config.mode = generation_config::kind::decoding;
      config.interval = setup.interval;
      for (const auto& sc : scorers) {
        config.scorer = &sc;
        for (std::size_t b = 0; b < setup.targets.size(); ++b) {
          config.target = setup.targets[b];
          add(per_setup[u][sc.name][b], pc, run_generation(m, p, n, config, &chain));
        }
      }
    }
    if (verbose && (i + 1) % 10 == 0)
      std::fprintf(stderr, "  %zu/%zu prompts (%.0f s)\n", i + 1, prompts.size(),
                   std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  auto exact = [](const generation_cell& c) {
    return 100.0 * static_cast<double>(c.exact) / static_cast<double>(c.prompts);
  };
  auto per_token = [](const generation_cell& c) {
    return 100.0 * static_cast<double>(c.tokens_right) / static_cast<double>(c.tokens);
  };
  auto cell_of = [&](const std::string& task, std::size_t u, const std::string& row,
                     std::size_t b) -> const generation_cell& {
    return cells[task][u][row][row == "prompt_only" ? 0 : b];
  };
  auto rounds_per_layer = [&](const generation_cell& c) {
    return static_cast<double>(c.rounds) / static_cast<double>(m.cfg.layers * c.prompts);
  };
  auto unread_dropped = [](const generation_cell& c) {
    return c.first_unread > 0
               ? 100.0 * static_cast<double>(c.first_unread_dropped) / static_cast<double>(c.first_unread)
               : 0.0;
  };
  auto all_dropped = [](const generation_cell& c) {
    return c.first_rows > 0 ? 100.0 * static_cast<double>(c.first_dropped) / static_cast<double>(c.first_rows) : 0.0;
  };
  auto has_chain = [&](const std::string& task, std::size_t u) {
    return !scorers.empty() && cell_of(task, u, scorers[0].name, 0).first_unread > 0;
  };
  auto setup_title = [&](const std::string& task, std::size_t u) {
    const generation_setup& setup = s.setups[u];
    char buf[256];
    if (setup.prompt_policy == "none")
      std::snprintf(buf, sizeof(buf), "the whole prompt (%lld rows per KV head) kept, N = %lld",
                    static_cast<long long>(prompt_tokens[task]), static_cast<long long>(setup.interval));
    else
      std::snprintf(buf, sizeof(buf), "the prompt compressed by %s to %lld rows per KV head (%g of it), N = %lld",
                    setup.prompt_policy == "h2o" ? "H2O" : "SnapKV", static_cast<long long>(prompt_rows[task][u]),
                    setup.prompt_fraction, static_cast<long long>(setup.interval));
    return std::string(buf);
  };

  // The compressions per layer and the most rows a head held depend on the target and N only:
  // checked equal for every scorer.
  bool smoke_ok = true;
  for (const auto& task : tasks)
    for (std::size_t u = 0; u < s.setups.size(); ++u)
      for (std::size_t b = 0; b < s.setups[u].targets.size(); ++b)
        for (const auto& sc : scorers) {
          const generation_cell &c = cell_of(task, u, sc.name, b), &first = cell_of(task, u, scorers[0].name, b);
          if (c.rounds != first.rounds || c.most_rows != first.most_rows)
            throw std::runtime_error(sc.name + ": other compressions than " + scorers[0].name);
          if (c.rounds == 0 || c.most_rows > s.setups[u].targets[b] + s.setups[u].interval) smoke_ok = false;
        }

  for (const auto& task : tasks)
    for (std::size_t u = 0; u < s.setups.size(); ++u) {
      const generation_setup& setup = s.setups[u];
      std::printf("%s, %s: exact match %% (per-token %%), %lld prompts\n", task.c_str(), setup_title(task, u).c_str(),
                  static_cast<long long>(taken[task]));
      std::printf("%-16s", "target");
      for (auto t : setup.targets) std::printf(" %15lld", static_cast<long long>(t));
      std::printf("\n%-16s    %5.1f (%5.1f)\n", "full", exact(full[task]), per_token(full[task]));
      for (const auto& row : rows) {
        std::printf("%-16s", row.c_str());
        for (std::size_t b = 0; b < (row == "prompt_only" ? 1 : setup.targets.size()); ++b) {
          const generation_cell& c = cell_of(task, u, row, b);
          std::printf("    %5.1f (%5.1f)", exact(c), per_token(c));
        }
        std::printf("\n");
      }
      if (!scorers.empty()) {
        std::printf("%-16s", "rounds/layer");
        for (std::size_t b = 0; b < setup.targets.size(); ++b)
          std::printf(" %15.2f", rounds_per_layer(cell_of(task, u, scorers[0].name, b)));
        std::printf("\n");
        if (has_chain(task, u)) {
          std::printf(
              "first decode-time compression: %% of the unread chain statement rows dropped (%% of all rows)\n");
          for (const auto& sc : scorers) {
            std::printf("%-16s", sc.name.c_str());
            for (std::size_t b = 0; b < setup.targets.size(); ++b) {
              const generation_cell& c = cell_of(task, u, sc.name, b);
              std::printf("    %5.1f (%5.1f)", unread_dropped(c), all_dropped(c));
            }
            std::printf("\n");
          }
        }
      }
    }
  std::printf("(%zu prompts, %.1f s)\n", prompts.size(), seconds);

  const std::string command = long_generation_command(s);
  if (!json_path.empty()) {
    std::ofstream j(json_path);
    auto cell_json = [](const generation_cell& c) {
      return "{\"prompts\": " + std::to_string(c.prompts) + ", \"exact\": " + std::to_string(c.exact) +
             ", \"tokens_right\": " + std::to_string(c.tokens_right) + ", \"tokens\": " + std::to_string(c.tokens) +
             ", \"rounds\": " + std::to_string(c.rounds) + ", \"most_rows\": " + std::to_string(c.most_rows) +
             ", \"first_round\": {\"rows\": " + std::to_string(c.first_rows) +
             ", \"dropped\": " + std::to_string(c.first_dropped) +
             ", \"unread_chain_rows\": " + std::to_string(c.first_unread) +
             ", \"unread_chain_dropped\": " + std::to_string(c.first_unread_dropped) + "}}";
    };
    // No timings in the file: the results of a run are a function of the code and the data.
    j << "{\n  \"command\": \"" << command << "\",\n  \"weights\": \"" << s.weights_name << "\",\n  \"prompts\": \""
      << s.prompts_name << "\",\n  \"layers\": " << m.cfg.layers << ",\n  \"results\": {\n";
    for (std::size_t t = 0; t < tasks.size(); ++t) {
      const auto& task = tasks[t];
      j << "    \"" << task << "\": {\"prompt_tokens\": " << prompt_tokens[task]
        << ", \"answer_tokens\": " << answer_tokens[task] << ", \"full\": " << cell_json(full[task])
        << ", \"setups\": [\n";
      for (std::size_t u = 0; u < s.setups.size(); ++u) {
        const generation_setup& setup = s.setups[u];
        j << "      {\"prompt_policy\": \"" << setup.prompt_policy
          << "\", \"prompt_fraction\": " << setup.prompt_fraction << ", \"prompt_rows\": " << prompt_rows[task][u]
          << ", \"interval\": " << setup.interval << ", \"targets\": [";
        for (std::size_t b = 0; b < setup.targets.size(); ++b) j << (b ? ", " : "") << setup.targets[b];
        j << "],\n       \"prompt_only\": " << cell_json(cell_of(task, u, "prompt_only", 0))
          << ",\n       \"decoding\": {";
        for (std::size_t r = 1; r < rows.size(); ++r) {
          j << (r > 1 ? ",\n                   " : "") << "\"" << rows[r] << "\": [";
          for (std::size_t b = 0; b < setup.targets.size(); ++b)
            j << (b ? ", " : "") << cell_json(cell_of(task, u, rows[r], b));
          j << "]";
        }
        j << "}}" << (u + 1 < s.setups.size() ? "," : "") << "\n";
      }
      j << "    ]}" << (t + 1 < tasks.size() ? "," : "") << "\n";
    }
    j << "  }\n}\n";
  }
  if (!markdown_path.empty()) {
    std::ofstream md(markdown_path);
    char buf[512];
    md << "# Long generation: decode-time budgets\n\n"
       << "TinyLM, 4 layers (`examples/tinylm/weights/" << s.weights_name
       << "`, 8 query / 2 KV heads), on held-out prompts of `examples/tinylm/data/" << s.prompts_name
       << "`. The answer is written one token at a time under greedy decoding; in `longchain` each answer "
          "token is found from the model's own previous one: the question `[TRK] V` asks for the 16 variables "
          "of a chain `[VAR] V -> X1`, `[VAR] X1 -> X2`, ... hidden in 1024 tokens of filler beside a "
          "distractor chain, so X(i+1) is read from the statement that names X(i), the token just written.\n\n"
       << "Every configuration runs through kvevict's compressor, one `run()` per layer per model step. At "
          "`prefill_end` the prompt is kept whole (`per_head = ratio(0)`) or compressed once by the setup's "
          "policy (H2O: attention accumulated over every prompt query; SnapKV: the main bench's, the last 8 "
          "prompt queries; both keep the last 8 prompt tokens inside the budget). **prompt only** stops there "
          "(`decoding` off: the cache grows by one row per token). The **decode scorer** rows turn on "
          "`compressor_options::decoding`: every decode step hands each layer its query, and the step that "
          "leaves a layer holding more than target + N rows per KV head compresses it back to `target` rows "
          "with that scorer; the engine writes the next token at `report.next_slot` with RoPE position "
          "`report.next_position`, and every head keeps the same number of rows. Decode scorers: `snapkv` "
          "(the last 8 decode queries observe, max-pool 7), `tova` (the newest decode query), `h2o` (attention "
          "accumulated over the last "
       << kH2ODecodeWindow
       << " decode queries: every one of the answer), `knorm` and `keydiff` (keys only); those five keep the "
          "newest 8 tokens inside the target; `streaming_llm` keeps 4 sink tokens and the newest ones.\n\n"
       << "**Exact match**: every answer token right. **Per-token**: the share of answer positions right in "
          "the greedy (free-running) answer, so a wrong variable usually costs the rest of the chain. The "
          "first answer token comes from the prompt's logits, so a 16-token answer is 15 decode steps.\n\n"
       << "Generated by `scripts/fidelity --long-generation` (engine: `" << command << "`).\n";
    for (const auto& task : tasks)
      for (std::size_t u = 0; u < s.setups.size(); ++u) {
        const generation_setup& setup = s.setups[u];
        std::snprintf(buf, sizeof(buf),
                      "\n## %s, %s\n\nExact match %% (per-token %%), %lld prompts of %lld tokens, answers of %lld "
                      "tokens. Target: rows per KV head after a decode-time compression.\n\n",
                      task.c_str(), setup_title(task, u).c_str(), static_cast<long long>(taken[task]),
                      static_cast<long long>(prompt_tokens[task]), static_cast<long long>(answer_tokens[task]));
        md << buf << "| |";
        for (auto t : setup.targets) md << " target " << t << " |";
        md << "\n|---|";
        for (std::size_t b = 0; b < setup.targets.size(); ++b) md << "---:|";
        md << "\n";
        auto line = [&](const std::string& label, const std::function<const generation_cell&(std::size_t)>& at) {
          md << "| " << label << " |";
          for (std::size_t b = 0; b < setup.targets.size(); ++b) {
            std::snprintf(buf, sizeof(buf), " %.0f (%.1f) |", exact(at(b)), per_token(at(b)));
            md << buf;
          }
          md << "\n";
        };
        line("full KV", [&](std::size_t) -> const generation_cell& { return full[task]; });
        std::snprintf(buf, sizeof(buf), "prompt only (%s, decoding off)",
                      setup.prompt_policy == "none" ? "the whole prompt"
                                                    : ((setup.prompt_policy == "h2o" ? "H2O, " : "SnapKV, ") +
                                                       std::to_string(prompt_rows[task][u]) + " rows")
                                                          .c_str());
        line(buf, [&](std::size_t) -> const generation_cell& { return cell_of(task, u, "prompt_only", 0); });
        for (const auto& sc : scorers)
          line("decode scorer: " + sc.name,
               [&](std::size_t b) -> const generation_cell& { return cell_of(task, u, sc.name, b); });
        if (!scorers.empty()) {
          md << "| decode-time compressions per layer in one answer |";
          for (std::size_t b = 0; b < setup.targets.size(); ++b) {
            std::snprintf(buf, sizeof(buf), " %.2f |", rounds_per_layer(cell_of(task, u, scorers[0].name, b)));
            md << buf;
          }
          md << "\n| most rows a KV head held after a decode step |";
          for (std::size_t b = 0; b < setup.targets.size(); ++b)
            md << " " << cell_of(task, u, scorers[0].name, b).most_rows << " |";
          md << "\n";
        }
        if (has_chain(task, u)) {
          md << "\nWhat each layer's first decode-time compression dropped, over every layer, KV head and "
                "prompt: % of the cached rows of the asked chain's statements that the answer had still to read "
                "(those of the answer tokens after that step), and in the last row % of all cached rows.\n\n| |";
          for (auto t : setup.targets) md << " target " << t << " |";
          md << "\n|---|";
          for (std::size_t b = 0; b < setup.targets.size(); ++b) md << "---:|";
          md << "\n";
          for (const auto& sc : scorers) {
            md << "| " << sc.name << " |";
            for (std::size_t b = 0; b < setup.targets.size(); ++b) {
              std::snprintf(buf, sizeof(buf), " %.1f |", unread_dropped(cell_of(task, u, sc.name, b)));
              md << buf;
            }
            md << "\n";
          }
          md << "| every row |";
          for (std::size_t b = 0; b < setup.targets.size(); ++b) {
            std::snprintf(buf, sizeof(buf), " %.1f |", all_dropped(cell_of(task, u, scorers[0].name, b)));
            md << buf;
          }
          md << "\n";
        }
      }
  }
  int full_wrong = 0;
  for (const auto& task : tasks) full_wrong += static_cast<int>(full[task].prompts - full[task].exact);
  if (smoke && !smoke_ok) return -1;
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
  bool per_task_given = false, weights_given = false, prompts_given = false;
  bool quick = false, tasks_given = false, budgets_given = false;
  std::string settings_list = "S1,S2,S3", jsonl;
  std::int64_t skip_per_task = 0;
  long_generation_settings long_settings;
  std::vector<std::string> setups;  // --setup, parsed below
  std::string markdown;
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
      weights = next(), weights_given = true;
    else if (a == "--prompts")
      prompts_path = next(), prompts_given = true;
    else if (a == "--reference")
      ref = next();
    else if (a == "--per-task")
      per_task = std::stoll(next()), per_task_given = true;
    else if (a == "--budgets")
      budget_list = next(), budgets_given = true;
    else if (a == "--policies")
      policy_list = next();
    else if (a == "--json")
      json = next();
    else if (a == "--long-generation")
      mode = "long";
    else if (a == "--long-generation-ci")
      mode = "long_ci";
    else if (a == "--tasks")
      long_settings.tasks = parse_names(next()), tasks_given = true;
    else if (a == "--setup")
      setups.push_back(next());
    else if (a == "--scorers")
      long_settings.scorers = parse_names(next());
    else if (a == "--markdown")
      markdown = next();
    else if (a == "--fidelity2")
      mode = "fidelity2";
    else if (a == "--quick")
      quick = true;
    else if (a == "--settings")
      settings_list = next();
    else if (a == "--jsonl")
      jsonl = next();
    else if (a == "--skip-per-task")
      skip_per_task = std::stoll(next());
    else {
      std::fprintf(stderr,
                   "usage: %s [--check-logits|--bench|--ci|--demo] [--per-task N] [--budgets f,..] "
                   "[--policies a,..] [--json out] [--weights f] [--prompts f]\n"
                   "       %s --long-generation|--long-generation-ci [--tasks t,..] [--per-task N] "
                   "[--setup POLICY:FRACTION:TARGETS[:N]].. [--scorers a,..|none] [--json out] [--markdown out] "
                   "[--weights f] [--prompts f]\n"
                   "       %s --fidelity2 [--quick] [--tasks t,..] [--per-task N] [--settings S1,S2,S3] "
                   "[--budgets f,..] [--policies a,..] [--jsonl out] [--weights f] [--prompts f1,f2] "
                   "[--skip-per-task N]\n",
                   argv[0], argv[0], argv[0]);
      return 2;
    }
  }
  try {
    if (mode == "fidelity2") {  // the 4-layer model and the two-question long-answer prompts
      if (!weights_given) weights = dir + "/weights/tinylm4d.safetensors";
      if (!prompts_given) prompts_path = dir + "/data/eval_prompts_long_q2.txt";
      fid2_settings fs;
      if (tasks_given) fs.tasks = long_settings.tasks;
      fs.settings = parse_names(settings_list);
      if (budgets_given) fs.budgets = parse_doubles(budget_list);
      if (policy_list != "all") fs.policies = parse_names(policy_list);
      fs.per_task = per_task_given ? per_task : 100;
      fs.skip_per_task = skip_per_task;
      if (quick) {  // seconds: 2 prompts per task, 2 budgets
        if (!per_task_given) fs.per_task = 2;
        if (!budgets_given) fs.budgets = {0.0625, 0.25};
      }
      if (jsonl.empty()) jsonl = quick ? "fidelity2_quick.jsonl" : "fidelity2.jsonl";
      const model m = model::load(weights);
      const fid2_summary sum = fidelity2(m, load_fid2_prompts(prompts_path), fs, jsonl, quick);
      if (quick)
        std::printf("tinylm fidelity2 slice: %s\n",
                    sum.failures == 0 ? "every check held" : (std::to_string(sum.failures) + " checks failed").c_str());
      return sum.failures == 0 ? 0 : 1;
    }
    if (mode == "long" || mode == "long_ci") {  // the 4-layer model and the long-answer prompts
      if (!weights_given) weights = dir + "/weights/tinylm4d.safetensors";
      if (!prompts_given) prompts_path = dir + "/data/eval_prompts_long.txt";
      long_settings.weights_name = weights.substr(weights.find_last_of('/') + 1);
      long_settings.prompts_name = prompts_path.substr(prompts_path.find_last_of('/') + 1);
      if (per_task_given) long_settings.per_task = per_task;
      if (!setups.empty()) long_settings.setups.clear();
      for (const auto& text : setups) long_settings.setups.push_back(parse_setup(text));
      if (mode == "long_ci") {  // seconds: two prompts, the whole prompt kept, one target
        if (!per_task_given) long_settings.per_task = 2;
        if (setups.empty()) long_settings.setups = {{"none", 0, {256}, 4}};
      }
      const model m = model::load(weights);
      const int wrong = long_generation(m, load_prompts(prompts_path), long_settings, json, markdown, mode == "long",
                                        mode == "long_ci");
      if (mode == "long_ci") {
        std::printf("tinylm long-generation slice: %s; full-KV wrong answers: %d\n",
                    wrong < 0 ? "a decode scorer did not compress within target + N"
                              : "every decode scorer "
                                "compressed during the answer within target + N",
                    wrong < 0 ? 0 : wrong);
        return wrong == 0 ? 0 : 1;
      }
      if (wrong > 0) std::printf("note: full KV answered %d prompts wrong\n", wrong);
      return 0;
    }
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
