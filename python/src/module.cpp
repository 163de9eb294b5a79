// SPDX-License-Identifier: Apache-2.0
// The Python binding (nanobind): tensors arrive through DLPack (torch, numpy, anything with
// __dlpack__) and become kvevict views over their memory — extents and strides as the tensor
// has them, no copy. The compressor is planned once and run per layer with the GIL released;
// its workspace is allocated at plan time and reused by every call.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <cstring>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace nb = nanobind;
using namespace nb::literals;

namespace {

using i64 = std::int64_t;
using array = nb::ndarray<nb::device::cpu>;             // written (caches, outputs)
using in_array = nb::ndarray<nb::ro, nb::device::cpu>;  // only read (read-only arrays too)

// ---- errors ---------------------------------------------------------------------------------

/// kvevict's status as a Python exception: ValueError for what the caller passed or the order
/// it called in (the message names the argument), NotImplementedError for combinations kvevict
/// does not implement, RuntimeError for the rest (a workspace the binding sized, a device or
/// collective failure).
[[noreturn]] void raise(const kvevict::status& st) {
  using kvevict::errc;
  switch (st.code()) {
    case errc::unsupported:
      PyErr_SetString(PyExc_NotImplementedError, st.message());
      throw nb::python_error();
    case errc::workspace_too_small:
    case errc::device_error:
    case errc::collective_error:
      throw std::runtime_error(st.message());
    default:
      throw nb::value_error(st.message());
  }
}

void check(const kvevict::status& st) {
  if (!st.ok()) raise(st);
}

[[noreturn]] void bad(const std::string& message) {
  throw nb::value_error(message.c_str());
}

// ---- names ----------------------------------------------------------------------------------

template <class E>
struct named {
  const char* name;
  E value;
};

template <class E, std::size_t N>
E parse(const std::string& text, const named<E> (&table)[N], const char* argument) {
  std::string options;
  for (const auto& e : table) {
    if (text == e.name) return e.value;
    options += options.empty() ? "" : ", ";
    options += e.name;
  }
  bad(std::string(argument) + ": expected one of " + options + ", got '" + text + "'");
}

const named<kvevict::dtype> kDtypes[] = {{"float32", kvevict::dtype::f32},
                                         {"float16", kvevict::dtype::f16},
                                         {"bfloat16", kvevict::dtype::bf16},
                                         {"float8_e4m3", kvevict::dtype::f8_e4m3},
                                         {"float8_e5m2", kvevict::dtype::f8_e5m2}};
const named<kvevict::sequence_event> kEvents[] = {{"idle", kvevict::sequence_event::idle},
                                                  {"prefill_end", kvevict::sequence_event::prefill_end},
                                                  {"decode", kvevict::sequence_event::decode},
                                                  {"prefill_chunk", kvevict::sequence_event::prefill_chunk}};
const named<kvevict::head_allocation> kHeads[] = {{"uniform", kvevict::head_allocation::uniform},
                                                  {"adakv", kvevict::head_allocation::adakv}};
const named<kvevict::adakv_rule> kAdakvRules[] = {{"paper", kvevict::adakv_rule::paper},
                                                  {"kvpress", kvevict::adakv_rule::kvpress_safeguard}};
const named<kvevict::layer_allocation> kLayers[] = {{"uniform", kvevict::layer_allocation::uniform},
                                                    {"pyramidkv", kvevict::layer_allocation::pyramidkv}};
const named<kvevict::selection_scope> kScopes[] = {{"per_head", kvevict::selection_scope::per_head},
                                                   {"per_layer", kvevict::selection_scope::per_layer},
                                                   {"per_sequence", kvevict::selection_scope::per_sequence}};
const named<kvevict::compaction> kCompactions[] = {{"in_place", kvevict::compaction::in_place},
                                                   {"out_of_place", kvevict::compaction::out_of_place},
                                                   {"keep_list_only", kvevict::compaction::keep_list_only}};
const named<kvevict::dapq_source> kDapqSources[] = {{"pseudo_tokens", kvevict::dapq_source::pseudo_tokens},
                                                    {"rerotated_window", kvevict::dapq_source::rerotated_window}};
const named<kvevict::rope_pairing> kPairings[] = {{"neox", kvevict::rope_pairing::neox},
                                                  {"gptj", kvevict::rope_pairing::gptj}};
const named<kvevict::protected_mode> kProtect[] = {{"inside_budget", kvevict::protected_mode::inside_budget},
                                                   {"on_top_of_budget", kvevict::protected_mode::on_top_of_budget}};

/// SnapKV-family presets by the name of the implementation they follow.
kvevict::window_config window_preset(const std::string& name) {
  if (name == "kvpress") return kvevict::presets::kvpress_snapkv();
  if (name == "snapkv_paper") return kvevict::presets::snapkv_paper();
  if (name == "kvcache_factory") return kvevict::presets::kvcache_factory_longbench();
  if (name == "adakv") return kvevict::presets::adakv();
  bad("preset: expected one of kvpress, snapkv_paper, kvcache_factory, adakv, got '" + name + "'");
}

// ---- tensors --------------------------------------------------------------------------------

/// The kvevict dtype of a tensor: its DLPack type; 8-bit float caches are carried as uint8
/// (the plan's dtype says which fp8 format).
template <class A>
kvevict::dtype dtype_of(const A& a, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (t.lanes == 1 && code == nb::dlpack::dtype_code::Float && t.bits == 32) return kvevict::dtype::f32;
  if (t.lanes == 1 && code == nb::dlpack::dtype_code::Float && t.bits == 16) return kvevict::dtype::f16;
  if (t.lanes == 1 && code == nb::dlpack::dtype_code::Bfloat && t.bits == 16) return kvevict::dtype::bf16;
  if (t.lanes == 1 && code == nb::dlpack::dtype_code::UInt && t.bits == 8) return kvevict::dtype::f8_e4m3;
  bad(std::string(name) + ": expected float32, float16, bfloat16 (or uint8 holding fp8) elements, got DLPack code " +
      std::to_string(t.code) + " bits " + std::to_string(t.bits));
}

template <class A>
void require_dims(const A& a, std::size_t ndim, const char* name, const char* shape) {
  if (a.ndim() != ndim)
    bad(std::string(name) + ": expected " + std::to_string(ndim) + " dimensions " + shape + ", got " +
        std::to_string(a.ndim()));
}

template <class A>
std::string shape_text(const A& a) {
  std::string s = "[";
  for (std::size_t i = 0; i < a.ndim(); ++i) s += (i ? ", " : "") + std::to_string(a.shape(i));
  return s + "]";
}

/// Element `s` along dimension 0, in bytes from `data` (strides may be negative: numpy views).
inline std::ptrdiff_t byte_offset(i64 s, i64 stride, std::size_t bytes) {
  return static_cast<std::ptrdiff_t>(s * stride) * static_cast<std::ptrdiff_t>(bytes);
}

std::size_t element_bytes(kvevict::dtype t) {
  switch (t) {
    case kvevict::dtype::f32:
      return 4;
    case kvevict::dtype::f16:
    case kvevict::dtype::bf16:
      return 2;
    default:
      return 1;
  }
}

/// Positions as int32 or int64, any stride along the query axis is refused: kvevict reads
/// them as a dense array.
kvevict::index_ptr index_of(const in_array& a, i64 offset, const char* name) {
  const nb::dlpack::dtype t = a.dtype();
  const auto code = static_cast<nb::dlpack::dtype_code>(t.code);
  if (a.stride(a.ndim() - 1) != 1 && a.shape(a.ndim() - 1) > 1)
    bad(std::string(name) + ": expected contiguous positions along the last dimension");
  if (code == nb::dlpack::dtype_code::Int && t.bits == 64) return static_cast<const std::int64_t*>(a.data()) + offset;
  if (code == nb::dlpack::dtype_code::Int && t.bits == 32) return static_cast<const std::int32_t*>(a.data()) + offset;
  bad(std::string(name) + ": expected int32 or int64 positions");
}

// ---- the compressor -------------------------------------------------------------------------

using report = kvevict::sequence_report;  // returned as it is: Python reads its fields

const char* action_name(kvevict::sequence_action a) {
  switch (a) {
    case kvevict::sequence_action::observed:
      return "observed";
    case kvevict::sequence_action::evicted:
      return "evicted";
    default:
      return "none";
  }
}

class compressor {
 public:
  compressor(i64 num_layers, i64 num_heads, i64 num_kv_heads, i64 head_dim, const std::string& dtype,
             const std::string& policy, std::optional<double> compression_ratio, std::optional<i64> tokens,
             std::optional<i64> window, std::optional<i64> kernel_size, const std::string& preset, i64 sinks, i64 delay,
             double eta, i64 pseudo_tokens, i64 protected_tail, i64 chunk_length, const std::string& heads,
             const std::string& layers, const std::string& scope, const std::string& compaction, i64 max_sequences,
             i64 max_tokens, std::optional<std::string> query_dtype, bool chunked_prefill,
             std::optional<std::string> protect, const std::string& dapq_source, double rope_theta,
             const std::string& rope_pairing, i64 rotary_dim, double adakv_alpha, const std::string& adakv_rule,
             std::optional<i64> decoding_tokens, std::optional<double> decoding_ratio, i64 decoding_interval,
             std::optional<std::string> decoding_policy, i64 decoding_window) {
    kvevict::compressor_options& o = options_;
    o.model.num_layers = num_layers;
    o.model.num_query_heads = num_heads;
    o.model.num_kv_heads = num_kv_heads;
    o.model.head_dim = head_dim;
    o.model.storage = parse(dtype, kDtypes, "dtype");
    if (query_dtype) o.model.query_storage = parse(*query_dtype, kDtypes, "query_dtype");
    if (compression_ratio && tokens) bad("compression_ratio, tokens: expected one of them, got both");
    o.per_head = tokens ? kvevict::budget::tokens(*tokens) : kvevict::budget::ratio(compression_ratio.value_or(0.5));
    o.policy = make_policy(policy, window, kernel_size, preset, sinks, delay, eta, pseudo_tokens, protected_tail);
    const kvevict::dapq_source source = parse(dapq_source, kDapqSources, "dapq_source");
    const kvevict::rope_pairing pairing = parse(rope_pairing, kPairings, "rope_pairing");
    if (kvevict::dapq_config* d = o.policy.get_if<kvevict::dapq_traits>()) {
      d->source = source;
      d->rope.head_dim = head_dim;  // the re-rotation's RoPE: the model's
      d->rope.rotary_dim = rotary_dim;
      d->rope.theta = rope_theta;
      d->rope.pairing = pairing;
    }
    if (protect)
      set_protect<kvevict::snapkv_traits, kvevict::knorm_traits, kvevict::h2o_traits, kvevict::deferkv_traits,
                  kvevict::dapq_traits, kvevict::tova_traits, kvevict::keydiff_traits>(
          &o.policy, parse(*protect, kProtect, "protect"));
    if (chunk_length > 0) o.policy = o.policy.chunked(chunk_length);
    o.heads = parse(heads, kHeads, "heads");
    o.adakv.alpha = adakv_alpha;
    o.adakv.rule = parse(adakv_rule, kAdakvRules, "adakv_rule");
    o.layers = parse(layers, kLayers, "layers");
    o.scope = parse(scope, kScopes, "scope");
    o.compact = parse(compaction, kCompactions, "compaction");
    if (o.scope == kvevict::selection_scope::per_sequence && o.compact != kvevict::compaction::keep_list_only)
      bad("scope: 'per_sequence' compacts every layer at the last layer's call, which needs every layer's cache "
          "at once: this binding serves it with compaction='keep_list_only'");
    o.sharing = kvevict::block_sharing::none;  // tensors, not paged pools
    o.limits.max_sequences = max_sequences;
    o.limits.max_tokens = max_tokens;
    o.chunked_prefill = chunked_prefill;
    // Decode-time budgets (compressor_options::decoding): the decode scorer is built from the
    // same window, kernel_size, preset, sinks and protected_tail (not chunk_length or protect,
    // which stay the prompt policy's); the C++ plan names what it refuses (decoding.policy, ...).
    if (decoding_tokens && decoding_ratio) bad("decoding_tokens, decoding_ratio: expected one of them, got both");
    if (decoding_tokens || decoding_ratio) {
      o.decoding.target =
          decoding_tokens ? kvevict::budget::tokens(*decoding_tokens) : kvevict::budget::ratio(*decoding_ratio);
      o.decoding.interval = decoding_interval;
      o.decoding.policy = make_policy(decoding_policy.value_or(policy), window, kernel_size, preset, sinks, delay, eta,
                                      pseudo_tokens, protected_tail);
      o.decoding.window = decoding_window;
    } else if (decoding_policy) {
      bad("decoding_policy: expected decoding_tokens or decoding_ratio with it (decode-time budgets are off)");
    }
    check(kvevict::compressor::plan(o, &c_));
    ws_ = kvevict::workspace(c_.any_workspace_size());
    io_.resize(static_cast<std::size_t>(max_sequences));
    reports_.resize(static_cast<std::size_t>(max_sequences));
  }

  std::size_t state_size() const { return c_.sequence_state_size(); }
  i64 keep_capacity() const { return c_.keep_capacity(); }
  i64 keep_capacity_per_head() const { return c_.keep_capacity_per_head(); }
  std::size_t workspace_size() const { return ws_.size(); }
  i64 observation_window() const { return c_.observation_window(); }

  void reset_state(array state) {
    // One dense run of bytes: kvevict writes state_size bytes from data() on.
    if (state.ndim() != 1 || state.itemsize() != 1 || (state.shape(0) > 1 && state.stride(0) != 1) ||
        state.shape(0) < c_.sequence_state_size())
      bad("state: expected contiguous uint8 [>= " + std::to_string(c_.sequence_state_size()) + "], got " +
          shape_text(state));
    std::unique_lock<std::mutex> turn(busy_, std::defer_lock);
    {
      nb::gil_scoped_release unlocked;
      turn.lock();
    }
    check(c_.reset_sequence(state.data(), state.shape(0)));
  }

  /// One layer of a batch [B, Hkv, L, d]: see the docstring in the module definition.
  std::vector<report> run(i64 layer, array keys, array values, std::optional<in_array> queries,
                          std::optional<in_array> query_positions, const std::vector<std::string>& events,
                          std::optional<array> states, std::optional<in_array> seq_lens,
                          std::optional<array> head_lengths, std::optional<array> kept_positions, float key_scale,
                          float value_scale, std::optional<array> dst_keys, std::optional<array> dst_values) {
    require_dims(keys, 4, "keys", "[batch, kv_heads, tokens, head_dim]");
    require_dims(values, 4, "values", "[batch, kv_heads, tokens, head_dim]");
    const i64 b = static_cast<i64>(keys.shape(0));
    if (b > static_cast<i64>(io_.size()))
      bad("keys: expected at most max_sequences = " + std::to_string(io_.size()) + " sequences, got " +
          std::to_string(b));
    if (static_cast<i64>(values.shape(0)) != b || values.shape(1) != keys.shape(1) || values.shape(2) != keys.shape(2))
      bad("values: expected the keys' [batch, kv_heads, tokens] = " + shape_text(keys) + ", got " + shape_text(values));
    if (b > 1 && (keys.stride(0) == 0 || values.stride(0) == 0))  // an expanded tensor: one cache for all
      bad(std::string(keys.stride(0) == 0 ? "keys" : "values") +
          ": expected one cache per sequence, got a batch stride of 0 (compaction would write them all)");
    const kvevict::dtype storage = options_.model.storage;
    for (const auto* t : {&keys, &values}) {
      const kvevict::dtype got = dtype_of(*t, t == &keys ? "keys" : "values");
      const bool fp8 = storage == kvevict::dtype::f8_e4m3 || storage == kvevict::dtype::f8_e5m2;
      if (got != storage && !(fp8 && got == kvevict::dtype::f8_e4m3))
        bad(std::string(t == &keys ? "keys" : "values") + ": expected " + kvevict::to_string(storage) +
            " elements (the plan's dtype), got " + kvevict::to_string(got));
    }
    // Out of place (compaction='out_of_place'): each sequence's kept rows go to its own rows of
    // dst_keys / dst_values, tensors of their own [batch, kv_heads, >= keep_capacity_per_head,
    // head_dim]; the sources are read only (prefix-shared blocks, a swap to the fresh buffers).
    const bool into = options_.compact == kvevict::compaction::out_of_place;
    if (!into && (dst_keys || dst_values))
      bad(std::string(dst_keys ? "dst_keys" : "dst_values") +
          ": only compaction='out_of_place' writes destinations (this plan compacts " +
          (options_.compact == kvevict::compaction::in_place ? "in place)" : "nothing: keep-lists only)"));
    if (into) {
      for (const auto* t : {&dst_keys, &dst_values}) {
        const char* name = t == &dst_keys ? "dst_keys" : "dst_values";
        const array& src = t == &dst_keys ? keys : values;
        if (!*t)
          bad(std::string(name) +
              ": compaction='out_of_place' writes the kept rows there: expected [batch, kv_heads, " +
              ">= keep_capacity_per_head = " + std::to_string(c_.keep_capacity_per_head()) + ", head_dim]");
        require_dims(**t, 4, name, "[batch, kv_heads, tokens, head_dim]");
        if (static_cast<i64>((*t)->shape(0)) != b || (*t)->shape(1) != src.shape(1) || (*t)->shape(3) != src.shape(3))
          bad(std::string(name) + ": expected [" + std::to_string(b) + ", " + std::to_string(src.shape(1)) +
              ", tokens, " + std::to_string(src.shape(3)) + "] (the sources' batch, kv_heads and head_dim), got " +
              shape_text(**t));
        if (dtype_of(**t, name) != dtype_of(src, name))
          bad(std::string(name) + ": expected the sources' element type, got " +
              kvevict::to_string(dtype_of(**t, name)));
        if (b > 1 && (*t)->stride(0) == 0)
          bad(std::string(name) + ": expected one destination per sequence, got a batch stride of 0");
      }
    }
    if (events.size() != 1 && static_cast<i64>(events.size()) != b)
      bad("event: expected one event or one per sequence (" + std::to_string(b) + "), got " +
          std::to_string(events.size()));
    if (queries) {
      require_dims(*queries, 4, "queries", "[batch, heads, window, head_dim]");
      if (static_cast<i64>(queries->shape(0)) != b)
        bad("queries: expected " + std::to_string(b) + " sequences, got " + shape_text(*queries));
      const kvevict::dtype qt = dtype_of(*queries, "queries");
      kvevict::dtype want = options_.model.query_storage;
      if (want == kvevict::dtype_query_default)
        want =
            storage == kvevict::dtype::f8_e4m3 || storage == kvevict::dtype::f8_e5m2 ? kvevict::dtype::bf16 : storage;
      if (qt != want)
        bad(std::string("queries: expected ") + kvevict::to_string(want) + " elements, got " + kvevict::to_string(qt));
      if (!query_positions) bad("query_positions: expected the queries' positions ([window] or [batch, window])");
      if (query_positions->ndim() != 1 && query_positions->ndim() != 2)
        bad("query_positions: expected [window] or [batch, window], got " + shape_text(*query_positions));
      if (query_positions->shape(query_positions->ndim() - 1) != queries->shape(2))
        bad("query_positions: expected " + std::to_string(queries->shape(2)) + " positions, got " +
            shape_text(*query_positions));
      if (query_positions->ndim() == 2 && static_cast<i64>(query_positions->shape(0)) != b)
        bad("query_positions: expected " + std::to_string(b) + " rows, got " + shape_text(*query_positions));
    }
    const std::size_t state_bytes = c_.sequence_state_size();
    if (state_bytes > 0) {
      if (!states)
        bad("states: this plan keeps " + std::to_string(state_bytes) + " bytes per sequence: expected states");
      if (states->ndim() != 2 || static_cast<i64>(states->shape(0)) < b || states->shape(1) < state_bytes ||
          states->itemsize() != 1 || states->stride(1) != 1)
        bad("states: expected uint8 [batch, >= " + std::to_string(state_bytes) + "] with contiguous rows, got " +
            shape_text(*states));
    }
    if (seq_lens) {
      if (seq_lens->ndim() != 1 || static_cast<i64>(seq_lens->shape(0)) != b)
        bad("seq_lens: expected [" + std::to_string(b) + "], got " + shape_text(*seq_lens));
      for (i64 s = 0; s < b; ++s) {  // a view has no capacity of its own: the tensor's tokens bound it
        const i64 len = read_index(*seq_lens, s);
        if (len < 0 || len > static_cast<i64>(keys.shape(2)))
          bad("seq_lens: expected lengths in [0, " + std::to_string(keys.shape(2)) + "] (the tensors' tokens), got " +
              std::to_string(len) + " at " + std::to_string(s));
      }
    }
    const i64 hkv = static_cast<i64>(keys.shape(1));
    if (head_lengths && (head_lengths->ndim() != 2 || static_cast<i64>(head_lengths->shape(0)) != b ||
                         static_cast<i64>(head_lengths->shape(1)) != hkv || head_lengths->stride(1) != 1 ||
                         dtype_of_index(*head_lengths) != 64))
      bad("head_lengths: expected contiguous int64 [" + std::to_string(b) + ", " + std::to_string(hkv) + "], got " +
          shape_text(*head_lengths));
    if (kept_positions && (kept_positions->ndim() != 2 || static_cast<i64>(kept_positions->shape(0)) != b ||
                           static_cast<i64>(kept_positions->shape(1)) < c_.keep_capacity() ||
                           kept_positions->stride(1) != 1 || dtype_of_index(*kept_positions) != 64))
      bad("kept_positions: expected contiguous int64 [" + std::to_string(b) +
          ", >= keep_capacity = " + std::to_string(c_.keep_capacity()) + "], got " + shape_text(*kept_positions));

    // One call at a time per compressor (its workspace and views are shared): wait for the
    // turn without the GIL, so the thread running now can take the GIL back when it is done.
    std::unique_lock<std::mutex> turn(busy_, std::defer_lock);
    {
      nb::gil_scoped_release unlocked;
      turn.lock();
    }
    const std::size_t kvb = element_bytes(storage);
    for (i64 s = 0; s < b; ++s) {
      kvevict::any_sequence_io& e = io_[static_cast<std::size_t>(s)];
      e = kvevict::any_sequence_io{};
      e.event = parse(events.size() == 1 ? events[0] : events[static_cast<std::size_t>(s)], kEvents, "event");
      i64 len = static_cast<i64>(keys.shape(2));
      if (seq_lens) len = read_index(*seq_lens, s);
      e.keys = view_of(keys, s, len, kvb);
      e.values = view_of(values, s, len, kvb);
      e.keys.scale = key_scale;
      e.values.scale = value_scale;
      if (queries) {
        const std::size_t qb = element_bytes(dtype_of(*queries, "queries"));
        const auto* base = static_cast<const unsigned char*>(queries->data()) + byte_offset(s, queries->stride(0), qb);
        e.queries.data = reinterpret_cast<const kvevict::any_element*>(base);
        e.queries.num_heads = static_cast<i64>(queries->shape(1));
        e.queries.num_queries = static_cast<i64>(queries->shape(2));
        e.queries.head_dim = static_cast<i64>(queries->shape(3));
        e.queries.head_stride = queries->stride(1);
        e.queries.query_stride = queries->stride(2);
        e.queries.dim_stride = queries->stride(3);
        e.queries.positions = index_of(
            *query_positions, query_positions->ndim() == 2 ? s * query_positions->stride(0) : 0, "query_positions");
      }
      if (state_bytes > 0) e.state = static_cast<unsigned char*>(states->data()) + byte_offset(s, states->stride(0), 1);
      if (head_lengths) e.head_lengths = static_cast<i64*>(head_lengths->data()) + s * head_lengths->stride(0);
      if (kept_positions) e.kept_positions = static_cast<i64*>(kept_positions->data()) + s * kept_positions->stride(0);
      if (into) {  // (the library checks their capacity and that they share no memory with a source)
        e.dst_keys = view_of(*dst_keys, s, static_cast<i64>(dst_keys->shape(2)), kvb);
        e.dst_values = view_of(*dst_values, s, static_cast<i64>(dst_values->shape(2)), kvb);
        e.dst_keys.scale = key_scale;
        e.dst_values.scale = value_scale;
      }
    }
    kvevict::status st;
    {
      nb::gil_scoped_release unlocked;
      st = c_.run(layer, io_.data(), b, reports_.data(), ws_);
    }
    check(st);
    return std::vector<report>(reports_.begin(), reports_.begin() + b);
  }

 private:
  // Where the policy's protected tokens count (each policy has its default).
  template <class... Traits>
  static void set_protect(kvevict::policy_config* p, kvevict::protected_mode mode) {
    auto set = [&](auto* c) {
      if (c != nullptr) c->protect = mode;
    };
    (set(p->get_if<Traits>()), ...);
  }

  static kvevict::policy_config make_policy(const std::string& name, std::optional<i64> window,
                                            std::optional<i64> kernel_size, const std::string& preset, i64 sinks,
                                            i64 delay, double eta, i64 pseudo_tokens, i64 protected_tail) {
    if (name == "snapkv") {
      kvevict::window_config c = window_preset(preset);
      if (window) c.window = *window;
      if (kernel_size) c.scoring.pool.kernel = *kernel_size;
      return kvevict::policy::snapkv(c);
    }
    if (name == "streaming_llm") {
      kvevict::streaming_llm_config c;
      c.sinks = sinks;
      return kvevict::policy::streaming_llm(c);
    }
    if (name == "knorm") {
      kvevict::knorm_config c;
      c.protected_tail = protected_tail;
      return kvevict::policy::knorm(c);
    }
    if (name == "h2o") {
      kvevict::h2o_config c;
      c.recent_window = protected_tail;
      return kvevict::policy::h2o(c);
    }
    if (name == "deferkv") {
      kvevict::deferkv_config c;
      if (window) c.window = *window;
      if (kernel_size) c.pool.kernel = *kernel_size;
      c.delay = delay;
      c.eta = eta;
      return kvevict::policy::deferkv(c);
    }
    if (name == "dapq") {
      kvevict::dapq_config c;
      c.pseudo_tokens = pseudo_tokens;
      c.first = pseudo_tokens / 4;
      c.last = pseudo_tokens - c.first;
      if (kernel_size) c.scoring.pool.kernel = *kernel_size;
      return kvevict::policy::dapq(c);
    }
    if (name == "tova") {
      kvevict::tova_config c;
      if (protected_tail > 0) c.protected_tail = protected_tail;
      return kvevict::policy::tova(c);
    }
    if (name == "keydiff") {
      kvevict::keydiff_config c;
      c.protected_tail = protected_tail;
      return kvevict::policy::keydiff(c);
    }
    bad("policy: expected one of snapkv, streaming_llm, knorm, h2o, deferkv, dapq, tova, keydiff, got '" + name + "'");
  }

  static int dtype_of_index(const array& a) {
    const nb::dlpack::dtype t = a.dtype();
    return static_cast<nb::dlpack::dtype_code>(t.code) == nb::dlpack::dtype_code::Int ? t.bits : 0;
  }

  static i64 read_index(const in_array& a, i64 i) {
    const nb::dlpack::dtype t = a.dtype();
    if (static_cast<nb::dlpack::dtype_code>(t.code) != nb::dlpack::dtype_code::Int || (t.bits != 32 && t.bits != 64))
      bad("seq_lens: expected int32 or int64 lengths");
    return t.bits == 64 ? static_cast<const std::int64_t*>(a.data())[i * a.stride(0)]
                        : static_cast<const std::int32_t*>(a.data())[i * a.stride(0)];
  }

  /// Sequence s of a [B, Hkv, L, d] tensor: a strided view with the tensor's own strides.
  static kvevict::any_cache_view view_of(const array& t, i64 s, i64 len, std::size_t bytes) {
    auto* base = static_cast<unsigned char*>(t.data()) + byte_offset(s, t.stride(0), bytes);
    return kvevict::strided_cache(reinterpret_cast<kvevict::any_element*>(base), static_cast<i64>(t.shape(1)), len,
                                  static_cast<i64>(t.shape(3)), t.stride(1), t.stride(2), t.stride(3));
  }

  kvevict::compressor_options options_;
  kvevict::compressor c_;
  kvevict::workspace ws_;
  std::vector<kvevict::any_sequence_io> io_;
  std::vector<kvevict::sequence_report> reports_;
  std::mutex busy_;
};

// ---- the building blocks --------------------------------------------------------------------

/// Calls f(T{}) with the element type `t` (float, fp16, bf16; the fp8 types when Fp8: the
/// query types exclude them).
template <bool Fp8, class F>
void with_type(kvevict::dtype t, F&& f) {
  switch (t) {
    case kvevict::dtype::f32:
      return f(float{});
    case kvevict::dtype::f16:
      return f(kvevict::fp16{});
    case kvevict::dtype::bf16:
      return f(kvevict::bf16{});
    default:
      if constexpr (Fp8) {
        if (t == kvevict::dtype::f8_e4m3) return f(kvevict::fp8_e4m3{});
        if (t == kvevict::dtype::f8_e5m2) return f(kvevict::fp8_e5m2{});
      }
  }
  bad("unsupported element type");
}

template <class T>
kvevict::cache_view<T> head_major_view(const array& t, i64 len) {
  return kvevict::strided_cache(static_cast<T*>(t.data()), static_cast<i64>(t.shape(0)), len,
                                static_cast<i64>(t.shape(2)), t.stride(0), t.stride(1), t.stride(2));
}

template <class T>
kvevict::cache_view<const T> head_major_view(const in_array& t, i64 len) {
  return kvevict::strided_cache(static_cast<const T*>(t.data()), static_cast<i64>(t.shape(0)), len,
                                static_cast<i64>(t.shape(2)), t.stride(0), t.stride(1), t.stride(2));
}

template <class T, std::size_t N>
nb::ndarray<nb::numpy, T> owned(const std::size_t (&shape)[N]) {
  std::size_t n = 1;
  for (std::size_t e : shape) n *= e;
  T* data = new T[n == 0 ? 1 : n]();
  nb::capsule owner(data, [](void* p) noexcept { delete[] static_cast<T*>(p); });
  return nb::ndarray<nb::numpy, T>(data, N, shape, owner);
}

kvevict::budget budget_of(std::optional<i64> tokens, std::optional<double> compression_ratio) {
  if (tokens && compression_ratio) bad("compression_ratio, tokens: expected one of them, got both");
  if (!tokens && !compression_ratio) bad("compression_ratio, tokens: expected one of them");
  return tokens ? kvevict::budget::tokens(*tokens) : kvevict::budget::ratio(*compression_ratio);
}

/// Prompt-window observation scores [Hkv, L] (kvevict::observation_scores).
nb::object observation_scores(in_array queries, in_array keys, in_array query_positions, const std::string& preset,
                              std::optional<i64> kernel_size, i64 protected_tail, std::optional<array> out) {
  require_dims(queries, 3, "queries", "[heads, window, head_dim]");
  require_dims(keys, 3, "keys", "[kv_heads, tokens, head_dim]");
  require_dims(query_positions, 1, "query_positions", "[window]");
  if (query_positions.shape(0) != queries.shape(1))
    bad("query_positions: expected " + std::to_string(queries.shape(1)) + " positions, got " +
        shape_text(query_positions));
  const kvevict::dtype kt = dtype_of(keys, "keys"), qt = dtype_of(queries, "queries");
  if (kt != qt) bad("queries: expected the keys' element type, got another");
  kvevict::scoring_params params = window_preset(preset).scoring;
  if (kernel_size) params.pool.kernel = *kernel_size;
  params.protected_tail = protected_tail;
  const i64 hkv = static_cast<i64>(keys.shape(0)), len = static_cast<i64>(keys.shape(1));
  nb::object result;
  float* dst = nullptr;
  i64 row_stride = len;
  if (out) {
    if (out->ndim() != 2 || static_cast<i64>(out->shape(0)) != hkv || static_cast<i64>(out->shape(1)) != len ||
        out->dtype() != nb::dtype<float>() || out->stride(1) != 1)
      bad("out: expected float32 [" + std::to_string(hkv) + ", " + std::to_string(len) + "] with contiguous rows");
    dst = static_cast<float*>(out->data());
    row_stride = out->stride(0);
    result = nb::cast(*out);
  } else {
    auto a = owned<float>({static_cast<std::size_t>(hkv), static_cast<std::size_t>(len)});
    dst = a.data();
    result = nb::cast(a);
  }
  kvevict::status st;
  with_type<false>(kt, [&](auto tag) {
    using T = decltype(tag);
    kvevict::query_view<const T> q;
    q.data = static_cast<const T*>(queries.data());
    q.num_heads = static_cast<i64>(queries.shape(0));
    q.num_queries = static_cast<i64>(queries.shape(1));
    q.head_dim = static_cast<i64>(queries.shape(2));
    q.head_stride = queries.stride(0);
    q.query_stride = queries.stride(1);
    q.dim_stride = queries.stride(2);
    q.positions = index_of(query_positions, 0, "query_positions");
    const kvevict::cache_view<const T> k = head_major_view<T>(keys, len);
    const kvevict::layer_shape shape{q.num_heads, hkv, q.head_dim, len, q.num_queries};
    kvevict::workspace ws(kvevict::observation_scores_workspace_size(shape, params));
    nb::gil_scoped_release unlocked;
    st = kvevict::observation_scores(q, k, params, {dst, hkv, len, row_stride}, ws);
  });
  check(st);
  return result;
}

/// Exact top-B per head (kvevict::select): (offsets [Hkv + 1], indices [total]) ascending per head.
nb::tuple select_tokens(in_array scores, std::optional<i64> tokens, std::optional<double> compression_ratio,
                        i64 protected_tail, const std::string& protect) {
  if (scores.ndim() != 2 || scores.dtype() != nb::dtype<float>() || scores.stride(1) != 1)
    bad("scores: expected float32 [kv_heads, tokens] with contiguous rows, got " + shape_text(scores));
  const kvevict::budget b = budget_of(tokens, compression_ratio);
  const kvevict::selection_params params{protected_tail, parse(protect, kProtect, "protect")};
  const i64 hkv = static_cast<i64>(scores.shape(0)), len = static_cast<i64>(scores.shape(1));
  const i64 capacity = kvevict::select_capacity(hkv, len, b, params);
  auto offsets = owned<i64>({static_cast<std::size_t>(hkv + 1)});
  auto indices = owned<i64>({static_cast<std::size_t>(capacity)});
  kvevict::workspace ws(kvevict::select_workspace_size(len));
  kvevict::status st;
  {
    nb::gil_scoped_release unlocked;
    st = kvevict::select({static_cast<const float*>(scores.data()), hkv, len, scores.stride(0)}, b, params,
                         {hkv, offsets.data(), indices.data(), capacity}, ws);
  }
  check(st);
  return nb::make_tuple(offsets, indices);
}

/// Compacts keys and values [Hkv, L, d] in place to the keep-list (kvevict::evict); returns
/// each head's new length.
nb::object evict_tokens(array keys, array values, in_array offsets, in_array indices) {
  require_dims(keys, 3, "keys", "[kv_heads, tokens, head_dim]");
  require_dims(values, 3, "values", "[kv_heads, tokens, head_dim]");
  const kvevict::dtype kt = dtype_of(keys, "keys"), vt = dtype_of(values, "values");
  if (kt != vt) bad("values: expected the keys' element type");
  if (values.shape(0) != keys.shape(0) || values.shape(1) != keys.shape(1))
    bad("values: expected the keys' [kv_heads, tokens] = " + shape_text(keys) + ", got " + shape_text(values));
  const i64 hkv = static_cast<i64>(keys.shape(0)), len = static_cast<i64>(keys.shape(1));
  if (offsets.ndim() != 1 || static_cast<i64>(offsets.shape(0)) != hkv + 1 || offsets.dtype() != nb::dtype<i64>() ||
      offsets.stride(0) != 1)
    bad("offsets: expected contiguous int64 [" + std::to_string(hkv + 1) + "]");
  if (indices.ndim() != 1 || indices.dtype() != nb::dtype<i64>() || (indices.shape(0) > 1 && indices.stride(0) != 1))
    bad("indices: expected contiguous int64 [total]");
  auto lengths = owned<i64>({static_cast<std::size_t>(hkv)});
  const kvevict::const_keep_list_view keep{hkv, static_cast<const i64*>(offsets.data()),
                                           static_cast<const i64*>(indices.data()), static_cast<i64>(indices.shape(0))};
  kvevict::status st;
  with_type<true>(kt, [&](auto tag) {
    using T = decltype(tag);
    kvevict::eviction_result r;
    r.head_lengths = lengths.data();
    nb::gil_scoped_release unlocked;
    st = kvevict::evict(head_major_view<T>(keys, len), head_major_view<T>(values, len), keep, r);
  });
  check(st);
  return nb::cast(lengths);
}

}  // namespace

NB_MODULE(_kvevict, m) {
  m.doc() = "kvevict: KV-cache eviction policies over tensors you own (zero-copy, DLPack).";
  m.attr("__version__") = "0.1.0";
  m.def(
      "active_cpu_isa", [] { return std::string(kvevict::to_string(kvevict::active_cpu_isa())); },
      "The CPU path kvevict's kernels take in this process (KVEVICT_ISA chooses another).");

  m.def("observation_scores", &observation_scores, "queries"_a, "keys"_a, "query_positions"_a, nb::kw_only(),
        "preset"_a = "kvpress", "kernel_size"_a = nb::none(), "protected_tail"_a = 0, "out"_a = nb::none(),
        "Prompt-window scores [kv_heads, tokens] (float32) of keys [kv_heads, tokens, head_dim] observed by "
        "queries [heads, window, head_dim] at query_positions [window], with a SnapKV preset's conventions "
        "('kvpress', 'snapkv_paper', 'kvcache_factory', 'adakv'); the last protected_tail tokens score +inf. "
        "Written into out when given (no allocation but the call's workspace).");
  m.def("select", &select_tokens, "scores"_a, nb::kw_only(), "tokens"_a = nb::none(),
        "compression_ratio"_a = nb::none(), "protected_tail"_a = 0, "protect"_a = "inside_budget",
        "Exact top-B per head of scores [kv_heads, tokens] (equal scores keep the smaller index; NaN ranks "
        "lowest): a CSR keep-list (offsets int64 [kv_heads + 1], indices int64 [capacity]), each head's "
        "indices ascending.");
  m.def("evict", &evict_tokens, "keys"_a, "values"_a, "offsets"_a, "indices"_a,
        "Compact keys and values [kv_heads, tokens, head_dim] in place to a keep-list: head h's kept rows "
        "move to its first rows, in order. Returns each head's new length (int64 [kv_heads]). On an error "
        "nothing moves.");

  nb::class_<report>(m, "Report", "What one run() did to one sequence.")
      .def_prop_ro(
          "action", [](const report& r) { return std::string(action_name(r.action)); },
          "'none', 'observed' or 'evicted'.")
      .def_ro("length", &report::length, "Tokens the cache holds now (the longest head).")
      .def_ro("next_position", &report::next_position, "RoPE position of the next token.")
      .def_ro("kept", &report::kept, "Entries written to kept_positions.")
      .def_ro("dropped", &report::dropped, "Tokens dropped by this call.")
      .def_ro("nonfinite_queries", &report::nonfinite_queries)
      .def_ro("nonfinite_keys", &report::nonfinite_keys)
      .def_ro("nonfinite_scores", &report::nonfinite_scores)
      .def("__repr__", [](const report& r) {
        return "Report(action='" + std::string(action_name(r.action)) + "', length=" + std::to_string(r.length) +
               ", dropped=" + std::to_string(r.dropped) + ")";
      });

  nb::class_<compressor>(m, "Compressor",
                         "A compressor planned once per model; run() once per layer for a batch of sequences.")
      .def(nb::init<i64, i64, i64, i64, const std::string&, const std::string&, std::optional<double>,
                    std::optional<i64>, std::optional<i64>, std::optional<i64>, const std::string&, i64, i64, double,
                    i64, i64, i64, const std::string&, const std::string&, const std::string&, const std::string&, i64,
                    i64, std::optional<std::string>, bool, std::optional<std::string>, const std::string&, double,
                    const std::string&, i64, double, const std::string&, std::optional<i64>, std::optional<double>, i64,
                    std::optional<std::string>, i64>(),
           "num_layers"_a, "num_heads"_a, "num_kv_heads"_a, "head_dim"_a, "dtype"_a, "policy"_a = "snapkv",
           nb::kw_only(), "compression_ratio"_a = nb::none(), "tokens"_a = nb::none(), "window"_a = nb::none(),
           "kernel_size"_a = nb::none(), "preset"_a = "kvpress", "sinks"_a = 4, "delay"_a = 1, "eta"_a = 0.9,
           "pseudo_tokens"_a = 32, "protected_tail"_a = 0, "chunk_length"_a = 0, "heads"_a = "uniform",
           "layers"_a = "uniform", "scope"_a = "per_head", "compaction"_a = "in_place", "max_sequences"_a = 1,
           "max_tokens"_a, "query_dtype"_a = nb::none(), "chunked_prefill"_a = false, "protect"_a = nb::none(),
           "dapq_source"_a = "pseudo_tokens", "rope_theta"_a = 10000.0, "rope_pairing"_a = "neox", "rotary_dim"_a = 0,
           "adakv_alpha"_a = 0.2, "adakv_rule"_a = "paper", "decoding_tokens"_a = nb::none(),
           "decoding_ratio"_a = nb::none(), "decoding_interval"_a = 64, "decoding_policy"_a = nb::none(),
           "decoding_window"_a = 0,
           "Plan a compressor (kvevict::compressor::plan). dtype: the K/V element type ('float32', "
           "'float16', 'bfloat16', 'float8_e4m3', 'float8_e5m2'). policy: 'snapkv', 'streaming_llm', "
           "'knorm', 'h2o', 'deferkv', 'dapq', 'tova', 'keydiff' (chunk_length > 0: ChunkKV over it). "
           "Budget per KV head: compression_ratio (kvpress's meaning: the fraction removed) or tokens. "
           "protect: 'inside_budget' or 'on_top_of_budget' (the policy's default when absent). "
           "DapQ: dapq_source 'pseudo_tokens' (the engine prefills N pseudo tokens and hands their queries) or "
           "'rerotated_window' (the last N prompt queries rotated N positions on, with the model's RoPE: "
           "rope_theta, rope_pairing 'neox' or 'gptj', rotary_dim, 0 for head_dim). "
           "heads: 'uniform' or 'adakv' (adakv_alpha, the floor fraction; adakv_rule 'paper', the AdaKV "
           "paper's allocation, or 'kvpress', AdaKVPress's: each head's top int(alpha (B + T)) first, then the "
           "layer's global top); layers: 'uniform' or 'pyramidkv'. compaction: 'in_place', 'out_of_place' "
           "(run() reads the caches and writes the kept rows to dst_keys, dst_values) or 'keep_list_only'. "
           "Decode-time budgets for long "
           "generation: decoding_tokens (or decoding_ratio, the fraction removed) per KV head after each "
           "decode-time compression, which comes at the 'decode' step that leaves a layer more than "
           "decoding_interval tokens over it; decoding_policy names the decode scorer (default: policy, "
           "built from the same window, kernel_size, preset, sinks and protected_tail, not chunk_length or "
           "protect; 'snapkv', 'tova', 'h2o' over decoding_window decode queries, 'knorm', "
           "'streaming_llm', 'keydiff'); compression_ratio=0 keeps the prompt whole. The workspace is "
           "allocated here, once.")
      .def_prop_ro("state_size", &compressor::state_size, "Bytes of state each sequence needs (0: none).")
      .def_prop_ro("keep_capacity", &compressor::keep_capacity, "Entries kept_positions needs per sequence.")
      .def_prop_ro("keep_capacity_per_head", &compressor::keep_capacity_per_head)
      .def_prop_ro("workspace_size", &compressor::workspace_size, "Bytes of the workspace planned once.")
      .def_prop_ro("observation_window", &compressor::observation_window,
                   "Queries the policy observes at prefill_end (SnapKV and DeferKV W, DapQ N).")
      .def("reset_state", &compressor::reset_state, "state"_a, "Set up one sequence's state (uint8, state_size bytes).")
      .def("run", &compressor::run, "layer"_a, "keys"_a, "values"_a, "queries"_a = nb::none(),
           "query_positions"_a = nb::none(), "event"_a = std::vector<std::string>{"prefill_end"},
           "states"_a = nb::none(), "seq_lens"_a = nb::none(), "head_lengths"_a = nb::none(),
           "kept_positions"_a = nb::none(), "key_scale"_a = 1.0f, "value_scale"_a = 1.0f, "dst_keys"_a = nb::none(),
           "dst_values"_a = nb::none(),
           "One layer of a batch. keys, values: [batch, kv_heads, tokens, head_dim] tensors of the plan's "
           "dtype, any strides, compacted in place (each head's kept rows first, in order), or with "
           "compaction='out_of_place' read only, the kept rows written to the first rows of dst_keys, "
           "dst_values ([batch, kv_heads, >= keep_capacity_per_head, head_dim], the same dtype, memory of "
           "their own). queries: "
           "[batch, heads, window, head_dim] with query_positions [window] or [batch, window] (int32/int64). "
           "event: a list of one name for every sequence or one per sequence. states: uint8 [batch, "
           ">= state_size]. seq_lens: tokens of each sequence (default: every row's tokens). head_lengths "
           "(int64 [batch, kv_heads]) and kept_positions (int64 [batch, >= keep_capacity]) are written "
           "when a sequence is evicted. The GIL is released while kvevict works; on an error nothing is "
           "changed and ValueError names the argument.");
}
