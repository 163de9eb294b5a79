"""A kvpress press backed by kvevict.

``KvevictPress`` is a kvpress ``BasePress``: wherever kvpress takes a press (its pipeline,
``with press(model): model(...)``), it compresses each attention layer's cache at the end of
prefill with kvevict's compressor, in place on the cache's own tensors. With
``preset="kvpress"`` (the default) the SnapKV scores follow kvpress's ``SnapKVPress``
conventions, so swapping ``SnapKVPress(compression_ratio=r, window_size=w)`` for
``KvevictPress("snapkv", compression_ratio=r, window_size=w)`` keeps the same tokens
(python/tests/test_kvpress.py checks it on a transformers Llama).

Policies read at the end of prefill: snapkv, streaming_llm, knorm, h2o, tova, keydiff (and
``chunk_length`` > 0 for ChunkKV over any of them). Heads keep equal counts (uniform budgets),
as kvpress's ScorerPress does. The kept rows of each head stay in position order (kvpress's
``topk`` gathers them in score order; attention does not depend on the order beyond float
rounding).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from kvpress.presses.base_press import BasePress
from kvpress.utils import get_prerope_query_states
from transformers.models.llama.modeling_llama import rotate_half

from ._kvevict import Compressor

_TORCH_DTYPES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}
# Queries each policy observes at prefill_end: the window, every prompt query, or none.
_QUERIES = {"snapkv": "window", "h2o": "all", "tova": "last", "streaming_llm": None, "knorm": None, "keydiff": None}


@dataclass
class KvevictPress(BasePress):
    """kvevict's compressor as a kvpress press.

    policy: one of snapkv, streaming_llm, knorm, h2o, tova, keydiff.
    compression_ratio: the fraction of each head's tokens removed (kvpress's meaning).
    window_size, kernel_size: SnapKV's observation window and pooling kernel.
    preset: the SnapKV conventions ('kvpress', 'snapkv_paper', 'kvcache_factory', 'adakv').
    options: further kvevict.Compressor keyword arguments (sinks, protected_tail, chunk_length,
        protect, tokens: a budget in tokens per head instead of compression_ratio).
    """

    policy: str = "snapkv"
    compression_ratio: float = 0.0
    window_size: int = 64
    kernel_size: int = 5
    preset: str = "kvpress"
    options: dict = field(default_factory=dict)

    def __post_init__(self):
        if self.policy not in _QUERIES:
            raise ValueError(f"policy: expected one of {', '.join(_QUERIES)}, got {self.policy!r}")
        if not 0 <= self.compression_ratio < 1:
            raise ValueError(f"compression_ratio: expected a value in [0, 1), got {self.compression_ratio}")
        self._plans: dict = {}

    def _compressor(self, module, keys: torch.Tensor, window: int) -> Compressor:
        """One plan per shape, dtype and cache length (planning sizes the workspace once)."""
        batch, kv_heads, tokens, head_dim = keys.shape
        heads = module.config.num_attention_heads
        if keys.dtype not in _TORCH_DTYPES:
            raise ValueError(f"keys: expected float32, float16 or bfloat16, got {keys.dtype}")
        key = (heads, kv_heads, head_dim, keys.dtype, batch, tokens, window)
        plan = self._plans.get(key)
        if plan is None:
            kwargs = dict(self.options)
            if self.policy == "snapkv":
                kwargs.update(window=window, kernel_size=self.kernel_size, preset=self.preset)
            if "tokens" not in kwargs:
                kwargs["compression_ratio"] = self.compression_ratio
            plan = Compressor(1, heads, kv_heads, head_dim, _TORCH_DTYPES[keys.dtype], self.policy,
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
        tokens = keys.shape[2]
        observe = _QUERIES[self.policy]
        count = {"window": min(self.window_size, tokens), "all": tokens, "last": 1, None: 0}[observe]
        plan = self._compressor(module, keys, self.window_size)
        queries = positions = None
        if count > 0:
            queries = self._queries(module, hidden_states, kwargs, count).to(keys.dtype)
            positions = torch.arange(tokens - count, tokens, dtype=torch.int64)
        keys = keys if keys.is_contiguous() else keys.contiguous()
        values = values if values.is_contiguous() else values.contiguous()
        lengths = torch.empty(keys.shape[0], keys.shape[1], dtype=torch.int64)
        plan.run(0, keys, values, queries, positions, head_lengths=lengths)
        kept = int(lengths[0, 0])
        if not bool((lengths == kept).all()):
            raise RuntimeError("kvevict kept different counts per head: KvevictPress serves uniform budgets only")
        return keys[:, :, :kept], values[:, :, :kept]
