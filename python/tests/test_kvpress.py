"""kvpress as the oracle: kvpress's own presses and KvevictPress on one transformers Llama.

The model is a small Llama with seeded random weights built here (no hub). Each test runs the
same prompt through a kvpress press and through KvevictPress and compares, per layer and KV
head, the set of kept key rows (rows are distinct random vectors, so equal row sets mean
equal keep sets) and then the greedy continuations.
"""
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
kvpress = pytest.importorskip("kvpress")

from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM  # noqa: E402

from kvevict import Compressor  # noqa: E402
from kvevict.kvpress import KvevictPress  # noqa: E402

PROMPT_TOKENS = 203  # odd, not a multiple of the window


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=8,
        num_key_value_heads=2, max_position_embeddings=1024, rope_theta=10000.0, attn_implementation="sdpa",  # eager hands presses attention weights, which ChunkKVPress refuses
        initializer_range=0.2,  # the default 0.02 gives layer-0 keys of near-equal norms (float32 ties)
    )
    m = LlamaForCausalLM(config).eval()
    return m


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(1)
    return torch.randint(0, 128, (2, PROMPT_TOKENS), generator=g)


def prefill(model, press, ids):
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        out = model(ids, past_key_values=cache)
    return cache, out


def row_sets(cache):
    """Per layer: keys [batch, kv_heads, kept, d] with each head's rows sorted (order-free)."""
    result = []
    for layer in cache.layers:
        k = layer.keys.clone()
        order = torch.argsort(k[..., 0], dim=-1)
        result.append(torch.gather(k, 2, order.unsqueeze(-1).expand_as(k)))
    return result


def greedy(model, press, ids, steps=12):
    """Greedy tokens after a compressed prefill, each at its true position (the cache is shorter)."""
    cache, out = prefill(model, press, ids)
    tokens = []
    nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    with torch.inference_mode():
        for i in range(steps):
            tokens.append(nxt)
            position = torch.full((ids.shape[0], 1), ids.shape[1] + i)
            out = model(nxt, past_key_values=cache, position_ids=position)
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
    return torch.cat(tokens, dim=1)


def full_keys(model, ids):
    """Every layer's uncompressed keys: prefill's outputs do not depend on the press (each layer
    is compressed after its own attention), so a run without one gives the keys both presses see."""
    cache = DynamicCache()
    with torch.inference_mode():
        model(ids, past_key_values=cache)
    return [layer.keys.clone() for layer in cache.layers]


def knorm_ties_only(full, a, b):
    """Whether rows kept by only one side all score (-||k||, in double) what the boundary token
    scores: exact ties, which kvpress breaks by torch.topk's order and kvevict by the smaller
    position (docs/peer-conventions.md). Repeated tokens tie exactly in KNorm: RoPE keeps norms."""
    kept = a.shape[2]
    for bi in range(a.shape[0]):
        for h in range(a.shape[1]):
            norms = full[bi, h].double().norm(dim=-1)
            boundary = torch.sort(norms).values[kept - 1]
            only = [r for r in a[bi, h] if not (b[bi, h] == r).all(-1).any()]
            only += [r for r in b[bi, h] if not (a[bi, h] == r).all(-1).any()]
            for r in only:
                if abs(r.double().norm().item() - boundary.item()) > 1e-6 * boundary.item():
                    return False
    return True


CASES = [
    ("snapkv", lambda r: kvpress.SnapKVPress(compression_ratio=r, window_size=16, kernel_size=5),
     lambda r: KvevictPress("snapkv", compression_ratio=r, window_size=16, kernel_size=5)),
    ("snapkv_w64", lambda r: kvpress.SnapKVPress(compression_ratio=r),
     lambda r: KvevictPress("snapkv", compression_ratio=r)),
    ("streaming_llm", lambda r: kvpress.StreamingLLMPress(compression_ratio=r, n_sink=4),
     lambda r: KvevictPress("streaming_llm", compression_ratio=r, options={"sinks": 4})),
    ("knorm", lambda r: kvpress.KnormPress(compression_ratio=r),
     lambda r: KvevictPress("knorm", compression_ratio=r)),
    ("tova", lambda r: kvpress.TOVAPress(compression_ratio=r),
     lambda r: KvevictPress("tova", compression_ratio=r)),
    ("keydiff", lambda r: kvpress.KeyDiffPress(compression_ratio=r),
     lambda r: KvevictPress("keydiff", compression_ratio=r)),
    ("pyramidkv", lambda r: kvpress.PyramidKVPress(compression_ratio=r, window_size=8),
     lambda r: KvevictPress("snapkv", compression_ratio=r, window_size=8, layer_schedule="pyramidkv")),
]


@pytest.mark.parametrize("name,theirs,ours", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.6])  # 0.6 keeps 81 of 203: more than W = 64
def test_same_keep_sets_as_kvpress(model, prompt, name, theirs, ours, ratio):
    cache_a, _ = prefill(model, theirs(ratio), prompt)
    cache_b, _ = prefill(model, ours(ratio), prompt)
    full = full_keys(model, prompt)
    for layer, (a, b) in enumerate(zip(row_sets(cache_a), row_sets(cache_b))):
        assert a.shape == b.shape, f"layer {layer}: kvpress kept {tuple(a.shape)}, kvevict {tuple(b.shape)}"
        same = (a == b).all(dim=-1).all(dim=-1)  # [batch, kv_heads]
        if name == "knorm" and not bool(same.all()):
            assert knorm_ties_only(full[layer], a, b), f"knorm layer {layer}: keep sets differ beyond exact ties"
            continue
        assert bool(same.all()), f"{name} layer {layer}: keep sets differ at (batch, head) {same.logical_not().nonzero().tolist()}"


def test_budget_below_window_keeps_the_window(model, prompt):
    """The one measured convention difference for SnapKV: with fewer tokens to keep than the window
    (203 tokens, ratio 0.8: 40 < 64), kvpress keeps 40 of the window's 64 tokens (all scored
    max + 1: torch.topk picks among equals) and kvevict keeps the whole window, its protected tail."""
    cache_a, _ = prefill(model, kvpress.SnapKVPress(compression_ratio=0.8), prompt)
    cache_b, _ = prefill(model, KvevictPress("snapkv", compression_ratio=0.8), prompt)
    full = full_keys(model, prompt)
    assert cache_a.layers[0].keys.shape[2] == 40
    for layer, full_k in zip(cache_b.layers, full):
        assert torch.equal(layer.keys, full_k[:, :, -64:])


# KNorm is left out: its exact ties (a repeated token's key norm at every position) are broken
# differently (test above), so the two keep the same token at different positions, whose keys
# differ after RoPE, and the generations part ways; measured on this model, both prompts.
GENERATION_CASES = [c for c in CASES if c[0] != "knorm"]


@pytest.mark.parametrize("name,theirs,ours", GENERATION_CASES, ids=[c[0] for c in GENERATION_CASES])
def test_same_greedy_generation_as_kvpress(model, prompt, name, theirs, ours):
    a = greedy(model, theirs(0.5), prompt)
    b = greedy(model, ours(0.5), prompt)
    assert torch.equal(a, b), f"{name}: kvpress {a.tolist()} vs kvevict {b.tolist()}"


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.6])
def test_chunkkv_budgets_are_exact_in_tokens(model, prompt, ratio):
    """The measured ChunkKV difference (docs/peer-conventions.md): kvpress keeps
    max(1, int(chunks * (1 - r))) whole chunks of 20 (the partial last chunk counts as one), so its
    count is not int(L * (1 - r)); kvevict keeps exactly int(L * (1 - r)) tokens per head, whole
    chunks in score order and the earliest tokens of the chunk the budget ends in, with the
    window protected. Both keep the same tokens in every head."""
    theirs = kvpress.ChunkKVPress(press=kvpress.SnapKVPress(compression_ratio=ratio, window_size=16), chunk_length=20)
    ours = KvevictPress("snapkv", compression_ratio=ratio, window_size=16, options={"chunk_length": 20})
    cache_a, _ = prefill(model, theirs, prompt)
    cache_b, _ = prefill(model, ours, prompt)
    chunks = -(-PROMPT_TOKENS // 20)
    kept_chunks = max(1, int(chunks * (1 - ratio)))
    counts = {kept_chunks * 20, (kept_chunks - 1) * 20 + PROMPT_TOKENS % 20}
    full = full_keys(model, prompt)
    for layer_a, layer_b, k in zip(cache_a.layers, cache_b.layers, full):
        assert layer_a.keys.shape[2] in counts
        assert layer_b.keys.shape[2] == int(PROMPT_TOKENS * (1 - ratio))
        assert torch.equal(layer_b.keys[:, :, -16:], k[:, :, -16:])  # the window, kept
        # every head keeps the same positions: rows of head 0 and head 1 come from one token set
        rows = [[int(((k[0, h] == r).all(-1)).nonzero()[0]) for r in layer_b.keys[0, h]] for h in range(2)]
        assert rows[0] == rows[1]


def test_deferkv_through_the_press_evicts_at_the_delayed_decode_step(model, prompt):
    """kvpress has no DeferKV: KvevictPress observes the window at the end of prefill and evicts
    after the d-th decoded token, while the press's context stays open (B = 50 candidates, the
    window of 16 and the decoded tokens on top: DeferKV's default)."""
    press = KvevictPress("deferkv", window_size=16, options={"tokens": 50, "delay": 2})
    cache = DynamicCache()
    lengths = []
    with torch.inference_mode(), press(model):
        out = model(prompt, past_key_values=cache)
        lengths.append(cache.layers[0].keys.shape[2])
        for i in range(3):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            out = model(nxt, past_key_values=cache, position_ids=torch.full((2, 1), PROMPT_TOKENS + i))
            lengths.append([layer.keys.shape[2] for layer in cache.layers])
    assert lengths == [PROMPT_TOKENS, [PROMPT_TOKENS + 1] * 3, [50 + 16 + 2] * 3, [50 + 16 + 3] * 3]


def test_press_options_it_cannot_serve_are_refused_and_plans_follow_the_ratio(model, prompt):
    with pytest.raises(ValueError, match="scope"):
        KvevictPress("snapkv", compression_ratio=0.5, options={"scope": "per_layer"})
    with pytest.raises(ValueError, match="heads"):
        KvevictPress("snapkv", compression_ratio=0.5, options={"heads": "per_token"})
    with pytest.raises(ValueError, match="window"):
        KvevictPress("snapkv", compression_ratio=0.5, options={"window": 8})
    press = KvevictPress("knorm", compression_ratio=0.5)
    kept = []
    for ratio in (0.5, 0.75):  # kvpress's wrappers change compression_ratio between calls
        press.compression_ratio = ratio
        cache, _ = prefill(model, press, prompt)
        kept.append(cache.layers[0].keys.shape[2])
    assert kept == [int(PROMPT_TOKENS * 0.5), int(PROMPT_TOKENS * 0.25)]


@pytest.mark.parametrize("window", [4, 16])  # W = 4: a pyramid; W = 16: PyramidKVPress's fallback
@pytest.mark.parametrize("ratio", [0.25, 0.5])
def test_pyramidkv_schedule_keeps_pyramidkvpress_tokens(model, prompt, window, ratio):
    """KvevictPress("snapkv", layer_schedule="pyramidkv") against kvpress's PyramidKVPress: the
    same per-layer counts and the same tokens per layer and head."""
    cache_a, _ = prefill(model, kvpress.PyramidKVPress(compression_ratio=ratio, window_size=window), prompt)
    cache_b, _ = prefill(model, KvevictPress("snapkv", compression_ratio=ratio, window_size=window,
                                             layer_schedule="pyramidkv"), prompt)
    counts = [layer.keys.shape[2] for layer in cache_a.layers]
    if window == 4:
        assert counts[0] > counts[-1]  # a pyramid, not the fallback
    for layer, (a, b) in enumerate(zip(row_sets(cache_a), row_sets(cache_b))):
        assert a.shape == b.shape, f"layer {layer}: kvpress kept {tuple(a.shape)}, kvevict {tuple(b.shape)}"
        assert bool((a == b).all()), f"layer {layer}: keep sets differ"


def masked_sets(model, press, ids):
    """Per layer: the [batch, kv_heads, tokens] entries kvpress's attention patch will hide."""
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model(ids, past_key_values=cache)
    out = []
    for layer in model.model.layers:
        mask = torch.zeros(ids.shape[0], cache.layers[0].keys.shape[1], ids.shape[1], dtype=torch.bool)
        mask[layer.self_attn.masked_key_indices] = True
        out.append(mask)
    return out


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_adakv_keeps_adakvpress_entries(model, prompt, ratio):
    """KvevictPress(options={"heads": "adakv"}) serves per-head lengths as kvpress's AdaKVPress does
    (masked_key_indices; the cache keeps its rows) with AdaKVPress's rule by default (preset
    'kvpress': each head's top int(0.2 n_kept) first, then the layer's global top): the same
    (batch, head, token) entries are masked in every layer."""
    theirs = masked_sets(model, kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=16)), prompt)
    ours = masked_sets(model, KvevictPress("snapkv", compression_ratio=ratio, window_size=16,
                                           options={"heads": "adakv"}), prompt)
    for layer, (a, b) in enumerate(zip(theirs, ours)):
        assert torch.equal(a, b), f"layer {layer}: {(a != b).sum().item()} entries differ"


def test_adakv_same_greedy_generation_as_adakvpress(model, prompt):
    a = greedy(model, kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.5, window_size=16)), prompt)
    b = greedy(model, KvevictPress("snapkv", compression_ratio=0.5, window_size=16, options={"heads": "adakv"}), prompt)
    assert torch.equal(a, b), f"kvpress {a.tolist()} vs kvevict {b.tolist()}"


@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_adakv_paper_rule_against_adakvpress(model, prompt, ratio):
    """The AdaKV paper's allocation (adakv_rule 'paper': head h keeps round(c_h (1 - a) + floor(a B))
    of the global top; docs/policies/adakv.md) against AdaKVPress: measured here 99.1-99.8 % of the
    (head, token) entries agree, head counts differ by at most 3 and layer totals by at most 2
    (= Hkv, rounding per head)."""
    theirs = masked_sets(model, kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=ratio, window_size=16)), prompt)
    ours = masked_sets(model, KvevictPress("snapkv", compression_ratio=ratio, window_size=16,
                                           options={"heads": "adakv", "adakv_rule": "paper"}), prompt)
    for layer, (a, b) in enumerate(zip(theirs, ours)):
        assert (a == b).float().mean().item() >= 0.98, f"layer {layer}"
        kept_a, kept_b = (~a).sum(-1), (~b).sum(-1)
        assert bool(((kept_a - kept_b).abs() <= 3).all()), f"layer {layer}: {kept_a.tolist()} vs {kept_b.tolist()}"
        assert bool(((kept_a.sum(-1) - kept_b.sum(-1)).abs() <= 2).all())
        assert not bool(b[:, :, -16:].any())  # the window is never masked


def test_padded_batches_are_refused(model, prompt):
    """A left-padded row would be scored with its pad tokens as context: refused, cache untouched."""
    mask = torch.ones_like(prompt)
    mask[1, :5] = 0
    cache = DynamicCache()
    with pytest.raises(ValueError, match="attention_mask"):
        with torch.inference_mode(), KvevictPress("snapkv", compression_ratio=0.5, window_size=16)(model):
            model(prompt, attention_mask=mask, past_key_values=cache)
    assert cache.layers[0].keys.shape[2] == PROMPT_TOKENS


def test_dapq_pseudo_tokens_through_the_press(model, prompt):
    """options={"dapq_source": "pseudo_tokens"}: the press appends N pseudo tokens (the first 8 and
    last N - 8 prompt tokens) at positions Lp .. Lp+N-1, scores the prompt with their queries,
    keeps B prompt rows per head and no pseudo row, and hands back the prompt's logits. The keep
    sets equal kvevict.Compressor's on the queries and keys of a plain forward of prompt + pseudo
    tokens (the engine's way: pseudo tokens prefilled on the full cache), and the generation goes
    on at position Lp."""
    n, first, budget = 12, 4, 60
    pseudo_ids = torch.cat([prompt[:, :first], prompt[:, -(n - first):]], dim=1)
    press = KvevictPress("dapq", options={"pseudo_tokens": n, "pseudo_first": first,
                                          "dapq_source": "pseudo_tokens", "tokens": budget})
    cache, out = prefill(model, press, prompt)
    with torch.inference_mode():
        plain = model(prompt).logits
        captured = {}

        def capture(module, args, kwargs, output):  # each layer's post-RoPE pseudo queries
            captured[module.layer_idx] = press._queries(module, kwargs["hidden_states"], kwargs, n)

        hooks = [layer.self_attn.register_forward_hook(capture, with_kwargs=True) for layer in model.model.layers]
        whole = DynamicCache()
        try:
            appended = model(torch.cat([prompt, pseudo_ids], dim=1), past_key_values=whole).logits
        finally:
            for h in hooks:
                h.remove()
    assert torch.equal(out.logits, appended[:, :PROMPT_TOKENS])  # the prompt's logits, the pseudo ones cut
    torch.testing.assert_close(out.logits, plain, atol=1e-4, rtol=1e-4)  # (sdpa rounds by length: 1.1e-5 seen)
    config = model.config
    for layer, (got, full) in enumerate(zip(cache.layers, whole.layers)):
        assert got.keys.shape[2] == budget
        plan = Compressor(config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
                          got.keys.shape[3], "float32", "dapq", tokens=budget, pseudo_tokens=n,
                          max_sequences=prompt.shape[0], max_tokens=PROMPT_TOKENS + n)
        keys, values = full.keys.contiguous().clone(), full.values.contiguous().clone()
        lengths = torch.empty(keys.shape[0], keys.shape[1], dtype=torch.int64)
        positions = torch.arange(PROMPT_TOKENS, PROMPT_TOKENS + n, dtype=torch.int64)
        reports = plan.run(layer, keys, values, captured[layer].contiguous(), positions, head_lengths=lengths)
        assert reports[0].action == "evicted" and reports[0].next_position == PROMPT_TOKENS
        assert torch.equal(got.keys, keys[:, :, :budget]) and torch.equal(got.values, values[:, :, :budget])
        prompt_rows = full.keys[:, :, :PROMPT_TOKENS]  # every kept row is a prompt row
        for b in range(prompt.shape[0]):
            for h in range(keys.shape[1]):
                assert all(bool((prompt_rows[b, h] == r).all(-1).any()) for r in got.keys[b, h])
    tokens = greedy(model, press, prompt, steps=4)  # decoding at Lp, Lp + 1, ...
    assert tokens.shape == (prompt.shape[0], 4)
    # kvpress's pipeline prefills through the inner model: the same pseudo tokens, the same cache.
    inner_cache = DynamicCache()
    with torch.inference_mode(), press(model):
        hidden = model.model(prompt, past_key_values=inner_cache).last_hidden_state
    assert hidden.shape[1] == PROMPT_TOKENS
    for got, again in zip(cache.layers, inner_cache.layers):
        assert torch.equal(got.keys, again.keys) and torch.equal(got.values, again.values)
