// The long-generation fidelity bench (kvevict_tinylm --long-generation): decode-time budgets
// (compressor_options::decoding, design.md §13 "Long generation") on a task whose answer the
// model writes one token at a time, each from its own previous one (longchain: the 16
// variables of a chain, each found through the statement that names the previous one).
//
// At prefill_end the prompt is kept whole (per_head = ratio(0)) or compressed once (H2O, or
// SnapKV as in the main bench); then every decode step is one run() per layer with the step's
// query, and the step that leaves a layer holding more than target + N rows per head compresses
// it again with the decode scorer. The engine's cache follows the reports: the next token's
// row is report.next_slot, its RoPE position report.next_position.
#pragma once

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "model.hpp"
#include "policies.hpp"

namespace tinylm {

/// H2O's decode window: the decode queries whose attention it accumulates. At least the
/// longest answer, so it accumulates every decode query of the answer (H2O's running sum).
constexpr std::int64_t kH2ODecodeWindow = 32;

/// A decode scorer (compressor_options::decoding.policy). Like the prompt policies of the
/// main bench, every scorer but StreamingLLM keeps the newest kWindow tokens inside the target.
struct decode_scorer {
  std::string name;
  kvevict::policy_config policy;
  std::int64_t window = 0;  // decoding.window (H2O only)
};

inline std::vector<decode_scorer> decode_scorers() {
  std::vector<decode_scorer> s;
  s.push_back({"snapkv", kvevict::policy::snapkv(snap_config()), 0});  // the last 8 decode queries
  kvevict::tova_config tova;                                           // the newest decode query
  tova.protected_tail = kWindow;
  s.push_back({"tova", kvevict::policy::tova(tova), 0});
  s.push_back({"h2o",
               kvevict::policy::h2o({kWindow, kvevict::protected_mode::inside_budget, kvevict::gqa_reduction::mean}),
               kH2ODecodeWindow});
  s.push_back({"knorm", kvevict::policy::knorm({kWindow, kvevict::protected_mode::inside_budget}), 0});
  s.push_back({"streaming_llm", kvevict::policy::streaming_llm({4}), 0});  // 4 sinks + the newest tokens
  kvevict::keydiff_config keydiff;
  keydiff.protected_tail = kWindow;
  s.push_back({"keydiff", kvevict::policy::keydiff(keydiff), 0});
  return s;
}

/// The prompt's one-shot policy at prefill_end: SnapKV (the main bench's) or H2O (every prompt
/// query observes).
inline kvevict::policy_config prompt_policy(const std::string& name) {
  if (name == "snapkv") return kvevict::policy::snapkv(snap_config());
  if (name == "h2o")
    return kvevict::policy::h2o({kWindow, kvevict::protected_mode::inside_budget, kvevict::gqa_reduction::mean});
  throw std::runtime_error("prompt policy " + name + ": expected snapkv or h2o");
}

/// One configuration: the full cache, the prompt compressed once (decoding off), or the prompt
/// compressed once and then decode-time budgets.
struct generation_config {
  enum class kind { full, prompt_only, decoding };
  kind mode = kind::full;
  kvevict::policy_config prompt;          // the prompt's policy at prefill_end
  std::int64_t prompt_budget = 0;         // tokens per KV head after prefill_end; 0: the whole prompt
  const decode_scorer* scorer = nullptr;  // decoding only
  std::int64_t target = 0, interval = 0;  // decoding only
};

struct generation_result {
  std::vector<std::int32_t> generated;
  std::int64_t rounds = 0;     // decode-time compressions, summed over layers
  std::int64_t most_rows = 0;  // the most rows a head held after a decode step's call
  // Each layer's first decode-time compression, summed over layers and KV heads: the rows before
  // it and those it dropped, and among them the rows of the chain statements the answer still
  // had to read (see run_generation's `chain`).
  std::int64_t first_rows = 0, first_dropped = 0, first_unread = 0, first_unread_dropped = 0;
};

/// Greedy decoding of `n` tokens after the prompt under `config`, one compressor run() per
/// layer per model step. Throws when the compressor refuses a call or a report disagrees with
/// the engine (a head length other than next_slot, a position that does not follow).
/// `chain` (optional, [prompt tokens]): for a prompt position inside a statement of the asked
/// chain, the index of the answer token that statement gives (its destination), else -1. The
/// engine follows every row's position through the keep lists, so the first decode-time
/// compression of each layer can be told apart: which rows of the statements still to be read
/// (answer tokens after the step that compresses) it dropped.
inline generation_result run_generation(const model& m, const prefill_state& p, std::size_t n,
                                        const generation_config& config,
                                        const std::vector<std::int64_t>* chain = nullptr) {
  const std::int64_t lp = p.prompt_tokens, hq = m.cfg.heads, hkv = m.cfg.kv_heads, d = m.cfg.head_dim;
  const std::int64_t layers = m.cfg.layers;
  generation_result out;
  out.generated = {p.first_token};
  kv_cache cache = p.cache;
  std::int64_t position = lp;  // RoPE position of the next token
  if (config.mode == generation_config::kind::full) {
    while (out.generated.size() < n) {
      const matrix logits = forward(m, cache, &out.generated.back(), 1, position++);
      out.generated.push_back(argmax(logits, 0));
    }
    out.generated.resize(n);
    return out;
  }

  kvevict::compressor_options o = model_options(m, config.prompt_budget, cache.capacity);
  o.policy = config.prompt;
  if (config.prompt_budget <= 0) o.per_head = kvevict::budget::ratio(0);  // the prompt kept whole
  if (config.mode == generation_config::kind::decoding) {
    o.decoding.target = kvevict::budget::tokens(config.target);
    o.decoding.interval = config.interval;
    o.decoding.policy = config.scorer->policy;
    o.decoding.window = config.scorer->window;
  }
  std::int64_t calls = 0;
  o.tracer = {&calls, [](void* ctx, const kvevict::run_trace&) { ++*static_cast<std::int64_t*>(ctx); }};
  kvevict::compressor compressor;
  check(kvevict::compressor::plan(o, &compressor));
  kvevict::workspace ws(compressor.workspace_size());
  std::vector<std::uint64_t> state(compressor.sequence_state_size() / 8 + 1);
  check(compressor.reset_sequence(state.data(), state.size() * 8));
  std::vector<std::int64_t> lengths(static_cast<std::size_t>(hkv));
  std::vector<std::int64_t> kept(static_cast<std::size_t>(compressor.keep_capacity()));
  // positions[l][h][row]: the position of every row the engine holds (per-head keep sets).
  std::vector<std::vector<std::vector<std::int64_t>>> positions(
      static_cast<std::size_t>(layers), std::vector<std::vector<std::int64_t>>(static_cast<std::size_t>(hkv)));
  for (auto& per_layer : positions)
    for (auto& head : per_layer) head = p.positions;
  std::vector<bool> compressed_while_decoding(static_cast<std::size_t>(layers), false);
  // Rows of a chain statement the answer reads after the step that has produced `generated` tokens.
  auto unread = [&](std::int64_t at, std::size_t generated) {
    return chain != nullptr && at < lp &&
           (*chain)[static_cast<std::size_t>(at)] >= static_cast<std::int64_t>(generated) + 1;
  };

  // One call for one layer; the cache's rows for that layer then follow the report.
  auto run = [&](std::int64_t layer, kvevict::sequence_event event, kvevict::query_view<const float> queries) {
    kvevict::sequence_io<float> io = layer_io(cache, layer, event, queries, state.data(), lengths.data(), kept.data());
    kvevict::sequence_report report;
    check(compressor.run(layer, &io, 1, &report, ws));
    auto& rows = cache.lengths[static_cast<std::size_t>(layer)];
    if (report.action == kvevict::sequence_action::evicted) {
      const bool first =
          event == kvevict::sequence_event::decode && !compressed_while_decoding[static_cast<std::size_t>(layer)];
      std::size_t offset = 0;
      for (std::int64_t h = 0; h < hkv; ++h) {  // uniform heads: every head keeps next_slot rows
        const std::int64_t length = lengths[static_cast<std::size_t>(h)];
        if (length != report.next_slot)
          throw std::runtime_error("head " + std::to_string(h) + " holds " + std::to_string(length) +
                                   " rows, next_slot " + std::to_string(report.next_slot));
        // The keep list holds row indices (no key_positions): map them to positions.
        auto& head = positions[static_cast<std::size_t>(layer)][static_cast<std::size_t>(h)];
        if (static_cast<std::int64_t>(head.size()) != io.keys.num_tokens)
          throw std::runtime_error("the engine lost track of the rows' positions");
        std::vector<std::int64_t> now;
        for (std::int64_t j = 0; j < length; ++j) now.push_back(head.at(static_cast<std::size_t>(kept[offset++])));
        if (first) {
          std::int64_t before = 0, after = 0;
          for (const std::int64_t q : head) before += unread(q, out.generated.size()) ? 1 : 0;
          for (const std::int64_t q : now) after += unread(q, out.generated.size()) ? 1 : 0;
          out.first_rows += static_cast<std::int64_t>(head.size());
          out.first_dropped += static_cast<std::int64_t>(head.size()) - length;
          out.first_unread += before;
          out.first_unread_dropped += before - after;
        }
        head = std::move(now);
      }
      if (static_cast<std::int64_t>(offset) != report.kept) throw std::runtime_error("keep list of another length");
      if (first) compressed_while_decoding[static_cast<std::size_t>(layer)] = true;
    } else if (report.next_slot != rows[0]) {
      throw std::runtime_error("next_slot " + std::to_string(report.next_slot) + " after a call that kept " +
                               std::to_string(rows[0]) + " rows");
    }
    std::fill(rows.begin(), rows.end(), report.next_slot);  // the next token's row
    return report;
  };

  for (std::int64_t l = 0; l < layers; ++l) {
    const kvevict::sequence_report r =
        run(l, kvevict::sequence_event::prefill_end,
            kvevict::contiguous_queries<const float>(p.queries[static_cast<std::size_t>(l)].data(), hq, lp, d,
                                                     p.positions.data()));
    // (ratio(0) keeps the whole prompt: the call reports an eviction that dropped nothing)
    const std::int64_t rows = config.prompt_budget > 0 ? config.prompt_budget : lp;
    if (r.action != kvevict::sequence_action::evicted || r.next_slot != rows || r.next_position != lp)
      throw std::runtime_error("prefill_end: the prompt was not compressed to " + std::to_string(rows) + " rows");
  }
  std::int64_t steps = 1;
  while (out.generated.size() < n) {
    const std::int64_t here = position;
    std::int64_t next = -1;
    const attention_hook hook = [&](std::int64_t layer, const float* q, std::int64_t) {
      for (auto& head : positions[static_cast<std::size_t>(layer)]) head.push_back(here);  // the step's row
      const kvevict::sequence_report r =
          run(layer, kvevict::sequence_event::decode, kvevict::token_major_queries<const float>(q, hq, 1, d, &here));
      if (r.action == kvevict::sequence_action::evicted) ++out.rounds;
      out.most_rows = std::max(out.most_rows, r.next_slot);
      if (next >= 0 && r.next_position != next) throw std::runtime_error("layers disagree on the next position");
      next = r.next_position;
    };
    const matrix logits = forward(m, cache, &out.generated.back(), 1, position, nullptr, hook);
    out.generated.push_back(argmax(logits, 0));
    if (next != here + 1) throw std::runtime_error("next_position does not follow the decoded token");
    position = next;
    ++steps;
  }
  if (calls != layers * steps)
    throw std::runtime_error(std::to_string(calls) + " compressor calls for " + std::to_string(steps) + " steps of " +
                             std::to_string(layers) + " layers");
  out.generated.resize(n);
  return out;
}

}  // namespace tinylm
