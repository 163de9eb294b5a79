"""A kvpress press backed by kvevict.

``KvevictPress`` is a kvpress ``BasePress``: wherever kvpress takes a press (its pipeline,
``with press(model): model(...)``), it compresses each attention layer's cache at the end of
prefill with kvevict's compressor, in place on the cache's own tensors. With
``preset="kvpress"`` (the default) the SnapKV scores follow kvpress's ``SnapKVPress``
conventions, so swapping ``SnapKVPress(compression_ratio=r, window_size=w)`` for
``KvevictPress("snapkv", compression_ratio=r, window_size=w)`` keeps the same tokens
(python/tests/test_kvpress.py checks it on a transformers Llama).

Policies read at the end of prefill: snapkv, streaming_llm, knorm, h2o, tova, keydiff, dapq
(DapQ's re-rotated window by default: the last N prompt queries rotated N positions on, with the
model's RoPE; with options={"dapq_source": "pseudo_tokens"} the paper's pseudo tokens: the
press appends N pseudo tokens, the first ``pseudo_first`` (8) and last N - 8 prompt tokens, to
the prefill's input at positions Lp .. Lp+N-1, scores the prompt with their queries in each
layer, drops their rows, and cuts their positions off the output, so the logits are the
prompt's; decoding goes on at position Lp) (and
``chunk_length`` > 0 for ChunkKV over any of them). DeferKV observes the prompt's window at the
end of prefill and evicts after the ``delay``-th decoded token: keep the press's context open
while decoding (``with press(model): model(prompt); model(token)...``). Heads keep equal counts
(uniform budgets), as kvpress's ScorerPress does, except with options={"heads": "adakv"}: AdaKV's
per-head lengths are served as kvpress's AdaKVPress serves them (module.masked_key_indices, the
cache keeps its rows), with AdaKVPress's allocation under ``preset="kvpress"`` (each head's top
int(0.2 n_kept) first, then the layer's global top: ``adakv_rule="kvpress"``) and the AdaKV
paper's otherwise (or with options={"adakv_rule": "paper"}). The kept rows of each head stay in position order (kvpress's
``topk`` gathers them in score order; attention does not depend on the order beyond float
rounding).
"""
from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress, is_prefilling
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from ._kvevict import Compressor

# Compressor options the press sets itself, or cannot serve (per-head or per-layer lengths,
# a keep set across layers, a cache left where it is).
_OWN_OPTIONS = {"window", "kernel_size", "preset", "compression_ratio", "max_tokens", "max_sequences"}
_UNSERVED_OPTIONS = {"layers", "scope", "compaction", "chunked_prefill"}
# Options of the press itself, not of the compressor.
_PRESS_OPTIONS = {"pseudo_first"}
# Decoded tokens a DeferKV plan has room for beyond the prompt (steps of several tokens:
# speculative verification); a longer step before eviction is refused by name.
_DECODE_HEADROOM = 256
_TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Queries each policy observes at prefill_end: the window, every prompt query, or none.
_QUERIES = {"snapkv": "window", "h2o": "all", "tova": "last", "streaming_llm": None, "knorm": None, "keydiff": None,
            "deferkv": "window", "dapq": "pseudo"}


def _rope_theta(config) -> float:
    """The model's RoPE base; DapQ's re-rotation follows plain RoPE only (rope_type 'default')."""
    params = getattr(config, "rope_parameters", None) or {}
    kind = params.get("rope_type", "default")
    if kind != "default":
        raise ValueError(f"policy: DapQ's re-rotation follows plain RoPE here, got rope_type {kind!r}")
    theta = params.get("rope_theta", getattr(config, "rope_theta", None))
    if theta is None:
        raise ValueError("policy: DapQ needs the model's rope_theta")
    return float(theta)


def _refuse_padding(kwargs: dict):
    """Each batch row must be one whole prompt at positions 0..L-1: a padded row would be scored
    and compacted with its pad tokens as context. Without padding the last query sees every key."""
    mask = kwargs.get("attention_mask")
    if mask is None or not torch.is_tensor(mask) or mask.dim() != 4:
        return
    last = mask[..., -1, :]
    padded = not bool(last.all()) if last.dtype == torch.bool else bool((last < 0).any())
    if padded:
        raise ValueError("attention_mask: KvevictPress expects unpadded prompts (each batch row one whole "
                         "prompt); run padded batches one row at a time")


@dataclass
class KvevictPress(BasePress):
    """kvevict's compressor as a kvpress press.

    policy: one of snapkv, streaming_llm, knorm, h2o, tova, keydiff, deferkv, dapq.
    compression_ratio: the fraction of each head's tokens removed (kvpress's meaning).
    window_size, kernel_size: SnapKV's observation window and pooling kernel.
    preset: the SnapKV conventions ('kvpress', 'snapkv_paper', 'kvcache_factory', 'adakv').
    layer_schedule: 'uniform', or 'pyramidkv': kvpress's PyramidKVPress layer budgets (its float
        schedule with beta, rounded per layer, and its fallback to round(L (1 - r))), computed
        here, so KvevictPress("snapkv", layer_schedule="pyramidkv") keeps PyramidKVPress's
        tokens. kvevict's own PyramidKV (integer budgets with the exact mean) is
        kvevict.Compressor(layers="pyramidkv").
    options: further kvevict.Compressor keyword arguments (sinks, protected_tail, chunk_length,
        protect, tokens: a budget in tokens per head instead of compression_ratio).
    """

    policy: str = "snapkv"
    compression_ratio: float = 0.0
    window_size: int = 64
    kernel_size: int = 5
    preset: str = "kvpress"
    layer_schedule: str = "uniform"
    beta: float = 20.0
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.policy not in _QUERIES:
            raise ValueError(f"policy: expected one of {', '.join(_QUERIES)}, got {self.policy!r}")
        if not 0 <= self.compression_ratio < 1:
            raise ValueError(f"compression_ratio: expected a value in [0, 1), got {self.compression_ratio}")
        for name in self.options:
            if name in _OWN_OPTIONS:
                raise ValueError(f"options: {name!r} is the press's own field or set by it; pass it to KvevictPress")
            if name in _UNSERVED_OPTIONS:
                raise ValueError(f"options: {name!r} is not served through the press (uniform head budgets, each "
                                 "layer compacted in place); use kvevict.Compressor")
        if self.options.get("heads", "uniform") not in ("uniform", "adakv"):
            raise ValueError(f"options: heads {self.options['heads']!r}: expected 'uniform' or 'adakv'")
        if self.options.get("heads") == "adakv" and self.policy == "deferkv":
            raise ValueError("options: heads 'adakv' through the press is served at the end of prefill, not for deferkv")
        if self.layer_schedule not in ("uniform", "pyramidkv"):
            raise ValueError(f"layer_schedule: expected 'uniform' or 'pyramidkv', got {self.layer_schedule!r}")
        if self.layer_schedule == "pyramidkv" and "tokens" in self.options:
            raise ValueError("options: 'tokens' and layer_schedule='pyramidkv' both set the budget")
        self._plans: dict = {}

    def _dapq_source(self) -> str:
        return self.options.get("dapq_source", "rerotated_window")

    def _pseudo(self) -> bool:
        return self.policy == "dapq" and self._dapq_source() == "pseudo_tokens"

    # ---- DapQ's pseudo tokens: appended to the prefill's input, cut from its output ---------

    @contextmanager
    def __call__(self, model):
        if not self._pseudo():
            with super().__call__(model):
                yield
            return
        # On the decoder stack (kvpress's own choice of module), so that a call of the causal LM
        # and one of its inner model (kvpress's pipeline prefills through model.model) both get
        # them; the LM head then sees the trimmed hidden states.
        inner = getattr(model, "model", model)
        inner = getattr(inner, "language_model", inner)
        self._appended = 0
        hooks = [inner.register_forward_pre_hook(self._append_pseudo_tokens, with_kwargs=True),
                 inner.register_forward_hook(self._drop_pseudo_outputs, with_kwargs=True)]
        try:
            with super().__call__(model):
                yield
        finally:
            for hook in hooks:
                hook.remove()

    def _append_pseudo_tokens(self, model, args, kwargs):
        """A prefill (an empty cache) gets N pseudo tokens after its prompt: DapQ's first m + last
        N - m prompt tokens (kvevict::dapq_pseudo_tokens_first_last; short prompts repeat their
        ends), at the positions after the prompt's."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        cache = kwargs.get("past_key_values")
        self._appended = 0
        if ids is None:
            raise ValueError("input_ids: DapQ's pseudo tokens are token ids; inputs_embeds is not served")
        if cache is None or cache.get_seq_length() > 0:
            return None  # decoding, or no cache to compress
        n = self.options.get("pseudo_tokens", 32)
        first = self.options.get("pseudo_first", 8)
        if not 0 <= first <= n:
            raise ValueError(f"options: pseudo_first {first}: expected 0 <= pseudo_first <= pseudo_tokens ({n})")
        prompt = ids.shape[1]
        head = torch.arange(first).clamp(max=prompt - 1)
        tail = (torch.arange(n - first) + prompt - (n - first)).clamp(min=0)
        pseudo = ids[:, torch.cat([head, tail])]
        kwargs = dict(kwargs)
        args = tuple(args[1:]) if args and "input_ids" not in kwargs else tuple(args)
        kwargs["input_ids"] = torch.cat([ids, pseudo], dim=1)
        step = torch.arange(1, n + 1)
        if kwargs.get("position_ids") is not None:
            p = kwargs["position_ids"]
            kwargs["position_ids"] = torch.cat([p, p[:, -1:] + step], dim=1)
        if kwargs.get("cache_position") is not None:
            c = kwargs["cache_position"]
            kwargs["cache_position"] = torch.cat([c, c[-1:] + step])
        if kwargs.get("attention_mask") is not None:
            m = kwargs["attention_mask"]
            kwargs["attention_mask"] = torch.cat([m, m.new_ones(m.shape[0], n)], dim=1)
        self._appended = n
        return args, kwargs

    def _drop_pseudo_outputs(self, model, args, kwargs, output):
        """The caller sees the prompt's outputs: the pseudo tokens' positions are cut off."""
        n = getattr(self, "_appended", 0)
        if n == 0:
            return output
        self._appended = 0
        for name in ("logits", "last_hidden_state"):
            value = getattr(output, name, None)
            if value is not None:
                setattr(output, name, value[:, :-n])
        if getattr(output, "hidden_states", None) is not None:
            output.hidden_states = tuple(h[:, :-n] for h in output.hidden_states)
        return output

    def _pyramid_tokens(self, module, tokens: int) -> int:
        """PyramidKVPress.get_layer_budget: the tokens layer `module.layer_idx` keeps, window inside."""
        w, r, layers = self.window_size, self.compression_ratio, module.config.num_hidden_layers
        capacity = w + tokens * (1 - r)
        low = (capacity - w) / self.beta
        high = (capacity - w) * 2 - low
        if high >= tokens - w:
            high = tokens - w
            low = (capacity - w) * 2 - high
        if not (tokens >= high >= low >= w):
            return max(1, round(tokens * (1 - r)))
        step = (high - low) / (layers - 1) if layers > 1 else 0.0
        return round(high - module.layer_idx * step)

    def _compressor(self, module, keys: torch.Tensor, window: int, budget: int = None) -> Compressor:
        """One plan per shape, dtype and cache length (planning sizes the workspace once)."""
        batch, kv_heads, tokens, head_dim = keys.shape
        heads = module.config.num_attention_heads
        if keys.dtype not in _TORCH_DTYPES:
            raise ValueError(f"keys: expected float32, float16 or bfloat16, got {keys.dtype}")
        if keys.device.type != "cpu":
            raise ValueError(f"keys: KvevictPress runs on CPU tensors, got a {keys.device.type} cache")
        layers = module.config.num_hidden_layers
        # Every field the plan depends on: kvpress's wrappers (PerLayerCompressionPress, ...) set
        # compression_ratio between layers.
        config = (self.policy, self.compression_ratio, self.window_size, self.kernel_size, self.preset,
                  tuple(sorted((k, repr(v)) for k, v in self.options.items())), budget)
        key = (heads, kv_heads, head_dim, keys.dtype, batch, tokens, window, layers, config)
        plan = self._plans.get(key)
        if plan is None:
            kwargs = dict(self.options)
            if self.policy == "snapkv":
                kwargs.update(window=window, kernel_size=self.kernel_size, preset=self.preset)
            if self.policy == "deferkv":
                kwargs.update(window=window, kernel_size=self.kernel_size)
                tokens += kwargs.get("delay", 1) + _DECODE_HEADROOM  # decoded tokens before eviction
            if kwargs.get("heads") == "adakv":  # per-head lengths: kvpress's masking, the cache stays
                kwargs["compaction"] = "keep_list_only"
                kwargs.setdefault("adakv_rule", "kvpress" if self.preset == "kvpress" else "paper")
            for name in _PRESS_OPTIONS:
                kwargs.pop(name, None)
            if self.policy == "dapq":
                kwargs.update(dapq_source=self._dapq_source(), rope_theta=_rope_theta(module.config))
            if budget is not None:
                kwargs["tokens"] = budget
            elif "tokens" not in kwargs:
                kwargs["compression_ratio"] = self.compression_ratio
            plan = Compressor(layers, heads, kv_heads, head_dim, _TORCH_DTYPES[keys.dtype], self.policy,
                              max_sequences=batch, max_tokens=tokens, **kwargs)
            self._plans[key] = plan
        return plan

    def _queries(self, module, hidden_states: torch.Tensor, kwargs: dict, count: int) -> torch.Tensor:
        """The last `count` post-RoPE queries [batch, heads, count, head_dim], as SnapKVPress computes them."""
        queries = get_prerope_query_states(module, hidden_states[:, -count:])
        cos, sin = kwargs["position_embeddings"]
        cos, sin = cos[:, -count:].unsqueeze(1), sin[:, -count:].unsqueeze(1)
        return (queries * cos) + (rotate_half(queries) * sin)

    def compress(self, module, hidden_states, keys, values, attentions, kwargs):
        if self.compression_ratio == 0 and "tokens" not in self.options:
            return keys, values
        _refuse_padding(kwargs)
        tokens = keys.shape[2]
        if self._pseudo() and getattr(self, "_appended", 0) != self.options.get("pseudo_tokens", 32):
            raise ValueError("input_ids: DapQ's pseudo tokens were not appended to this prefill (call the model "
                             "inside the press's context, with input_ids)")
        observe = _QUERIES[self.policy]
        pseudo = self.options.get("pseudo_tokens", 32)
        count = {"window": min(self.window_size, tokens), "all": tokens, "last": 1, "pseudo": min(pseudo, tokens),
                 None: 0}[observe]
        budget = self._pyramid_tokens(module, tokens) if self.layer_schedule == "pyramidkv" else None
        plan = self._compressor(module, keys, self.window_size, budget)
        queries = positions = None
        if count > 0:
            queries = self._queries(module, hidden_states, kwargs, count).to(keys.dtype)
            positions = torch.arange(tokens - count, tokens, dtype=torch.int64)
        keys = keys if keys.is_contiguous() else keys.contiguous()
        values = values if values.is_contiguous() else values.contiguous()
        lengths = torch.empty(keys.shape[0], keys.shape[1], dtype=torch.int64)
        if self.options.get("heads") == "adakv":
            return self._mask_adakv(module, plan, keys, values, queries, positions, lengths)
        reports = plan.run(module.layer_idx, keys, values, queries, positions, head_lengths=lengths)
        if reports[0].action != "evicted":
            return keys, values
        kept = int(lengths[0, 0])  # uniform head budgets (the options that change that are refused)
        return keys[:, :, :kept], values[:, :, :kept]

    def _mask_adakv(self, module, plan, keys, values, queries, positions, lengths):
        """AdaKV's per-head lengths the way kvpress serves them (AdaKVPress): the cache keeps every
        row and `module.masked_key_indices` lists the evicted (batch, head, token) entries, which
        kvpress's attention patch hides from every later query."""
        kept = torch.empty(keys.shape[0], plan.keep_capacity, dtype=torch.int64)
        reports = plan.run(module.layer_idx, keys, values, queries, positions, head_lengths=lengths,
                           kept_positions=kept)
        if reports[0].action != "evicted":
            return keys, values
        keep = torch.zeros(keys.shape[0], keys.shape[1], keys.shape[2], dtype=torch.bool)
        for b in range(keys.shape[0]):
            start = 0
            for h in range(keys.shape[1]):
                n = int(lengths[b, h])
                keep[b, h, kept[b, start:start + n]] = True
                start += n
        module.masked_key_indices = (~keep).nonzero(as_tuple=True)
        return keys, values

    # ---- DeferKV: an observation at the end of prefill, eviction at a decode step ------------

    def forward_hook(self, module, input, kwargs, output):
        if self.policy != "deferkv":
            return super().forward_hook(module, input, kwargs, output)
        hidden_states = kwargs["hidden_states"]
        layer = kwargs["past_key_values"].layers[module.layer_idx]
        steps = hidden_states.shape[1]
        prefill = is_prefilling(kwargs["cache_position"], steps)
        if prefill and module.layer_idx == 0:
            self._deferred = {"prompt": steps, "decoded": {}, "plan": None, "states": None}
        d = getattr(self, "_deferred", None)
        if d is None:  # decoding without a prefill under this press: nothing to defer
            return output
        keys, values = layer.keys, layer.values
        if prefill:
            _refuse_padding(kwargs)
            count = min(self.window_size, steps)
            queries = self._queries(module, hidden_states, kwargs, count).to(keys.dtype)
            positions = torch.arange(steps - count, steps, dtype=torch.int64)
            event = "prefill_end"
            if d["plan"] is None:
                d["plan"] = self._compressor(module, keys, self.window_size)
                d["states"] = torch.zeros(keys.shape[0], d["plan"].state_size, dtype=torch.uint8)
                for state in d["states"]:
                    d["plan"].reset_state(state)
        else:
            if d.get("evicted", {}).get(module.layer_idx):
                return output
            done = d["decoded"].get(module.layer_idx, 0)
            queries = self._queries(module, hidden_states, kwargs, steps).to(keys.dtype)
            position = d["prompt"] + done
            positions = torch.arange(position, position + steps, dtype=torch.int64)
            d["decoded"][module.layer_idx] = done + steps
            event = "decode"
        keys = keys if keys.is_contiguous() else keys.contiguous()
        values = values if values.is_contiguous() else values.contiguous()
        lengths = torch.empty(keys.shape[0], keys.shape[1], dtype=torch.int64)
        reports = d["plan"].run(module.layer_idx, keys, values, queries, positions, event=[event],
                                states=d["states"], head_lengths=lengths)
        if reports[0].action == "evicted":
            kept = int(lengths[0, 0])
            layer.keys, layer.values = keys[:, :, :kept], values[:, :, :kept]
            d.setdefault("evicted", {})[module.layer_idx] = True
        return output
