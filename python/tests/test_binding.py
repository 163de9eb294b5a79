"""The binding: zero-copy views over torch and numpy tensors, the compressor and the building
blocks, bad input, threads. kvevict's math is checked against its references in the C++
suite; here the checks are that Python reaches it intact (same results through every route,
the tensors' own memory, errors that name the argument and change nothing)."""
import threading

import numpy as np
import pytest

import kvevict

torch = pytest.importorskip("torch")

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def batch(b=2, hq=8, hkv=2, length=97, d=32, w=16, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    v = torch.randn(b, hkv, length, d, generator=g).to(dtype)
    q = (2 * torch.randn(b, hq, w, d, generator=g)).to(dtype)
    pos = torch.arange(length - w, length, dtype=torch.int64)
    return k, v, q, pos


def reference_scores(q, k, pos, kernel=5):
    """SnapKV at kvpress's conventions in double precision, over every key (no protected tail):
    softmax over the keys each query sees, mean over the window, average pool counting padding,
    then the mean over each KV head's query group."""
    q, k = q.double().numpy(), k.double().numpy()
    hq, w, d = q.shape
    hkv, length, _ = k.shape
    group = hq // hkv
    out = np.zeros((hkv, length))
    for h in range(hq):
        logits = q[h] @ k[h // group].T / np.sqrt(d)
        logits[np.arange(length)[None, :] > pos.numpy()[:, None]] = -np.inf
        p = np.exp(logits - logits.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        s = np.convolve(np.pad(p.mean(axis=0), kernel // 2), np.ones(kernel) / kernel, mode="valid")
        out[h // group] += s / group
    return out


def test_observation_scores_match_a_double_reference():
    k, _, q, pos = batch()
    got = kvevict.observation_scores(q[0], k[0], pos)
    want = reference_scores(q[0], k[0], pos)
    np.testing.assert_allclose(got, want, rtol=2e-4, atol=2e-6 * np.abs(want).max())


@pytest.mark.parametrize("dtype", list(DTYPES))
def test_compressor_equals_the_building_blocks_in_the_tensors_own_memory(dtype):
    k, v, q, pos = batch(dtype=DTYPES[dtype])
    k0, v0 = k.clone(), v.clone()
    c = kvevict.Compressor(1, 8, 2, 32, dtype, "snapkv", tokens=40, window=16, max_sequences=2, max_tokens=97)
    lengths = torch.zeros(2, 2, dtype=torch.int64)
    kept = torch.full((2, c.keep_capacity), -1, dtype=torch.int64)
    ptr = k.data_ptr()
    reports = c.run(0, k, v, q, pos, head_lengths=lengths, kept_positions=kept)
    assert k.data_ptr() == ptr
    assert [r.action for r in reports] == ["evicted", "evicted"]
    assert lengths.eq(40).all()
    for s in range(2):
        scores = kvevict.observation_scores(q[s], k0[s], pos, protected_tail=16)
        offsets, indices = kvevict.select(scores, tokens=40, protected_tail=16)
        kb, vb = k0[s].clone(), v0[s].clone()
        assert kvevict.evict(kb, vb, offsets, indices).tolist() == [40, 40]
        assert torch.equal(k[s, :, :40], kb[:, :40]) and torch.equal(v[s, :, :40], vb[:, :40])
        assert kept[s, :80].tolist() == indices.tolist()  # positions are indices here


def test_strided_views_read_the_tensor_as_it_lies():
    k, v, q, pos = batch()
    # vLLM's NHD order [batch, tokens, kv_heads, d], handed over as a [batch, kv_heads, tokens, d] view.
    k_nhd = k.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    v_nhd = v.permute(0, 2, 1, 3).contiguous().permute(0, 2, 1, 3)
    assert not k_nhd.is_contiguous()
    c = kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", compression_ratio=0.5, window=16,
                           max_sequences=2, max_tokens=97)
    c.run(0, k, v, q, pos)
    c.run(0, k_nhd, v_nhd, q, pos)
    assert torch.equal(k[:, :, :48], k_nhd[:, :, :48]) and torch.equal(v[:, :, :48], v_nhd[:, :, :48])


def test_numpy_arrays_and_int32_positions():
    k, v, q, pos = batch()
    kn, vn, qn = k.numpy().copy(), v.numpy().copy(), q.numpy()
    c = kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", compression_ratio=0.5, window=16,
                           max_sequences=2, max_tokens=97)
    c.run(0, k, v, q, pos)
    c.run(0, kn, vn, qn, pos.numpy().astype(np.int32))
    np.testing.assert_array_equal(kn[:, :, :48], k[:, :, :48].numpy())


def test_bad_input_names_the_argument_and_changes_nothing():
    k, v, q, pos = batch()
    c = kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", compression_ratio=0.5, window=16,
                           max_sequences=2, max_tokens=97)
    k0, v0 = k.clone(), v.clone()
    cases = [
        (dict(queries=q.half()), "queries"),
        (dict(query_positions=pos[:3]), "query_positions"),
        (dict(event=["prefill_start"]), "event"),
        (dict(keys=k.half(), values=v.half()), "keys"),
        (dict(values=v[:, :, :50]), "values"),
        (dict(query_positions=pos.float()), "query_positions"),
        (dict(keys=torch.zeros(3, 2, 97, 32), values=torch.zeros(3, 2, 97, 32)), "max_sequences"),
    ]
    for change, name in cases:
        args = dict(keys=k, values=v, queries=q, query_positions=pos)
        args.update(change)
        with pytest.raises(ValueError, match=name):
            c.run(0, **args)
        assert torch.equal(k, k0) and torch.equal(v, v0), name
    with pytest.raises(ValueError, match="policy"):
        kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv2", max_tokens=97)
    with pytest.raises(ValueError, match="dtype"):
        kvevict.Compressor(1, 8, 2, 32, "float64", max_tokens=97)
    with pytest.raises(ValueError, match="num_kv_heads|model"):
        kvevict.Compressor(1, 8, 3, 32, "float32", max_tokens=97)


def test_threads_share_nothing_but_the_process():
    """The GIL is released during run(): compressors in four threads at once give what each
    gives alone, and so does one compressor called from four threads (its calls take turns)."""
    inputs = [batch(length=1500, seed=s) for s in range(4)]

    def plan():
        return kvevict.Compressor(1, 8, 2, 32, "float32", compression_ratio=0.7, window=16, max_sequences=2,
                                  max_tokens=1500)

    alone = []
    for k, v, q, pos in inputs:
        k, v = k.clone(), v.clone()
        plan().run(0, k, v, q, pos)
        alone.append((k, v))
    shared = plan()
    for compressor_of in (lambda i: plan(), lambda i: shared):
        caches = [(k.clone(), v.clone()) for k, v, _, _ in inputs]
        threads = [threading.Thread(target=lambda i=i: compressor_of(i).run(0, *caches[i], *inputs[i][2:]))
                   for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for (k, v), (ka, va) in zip(caches, alone):
            assert torch.equal(k[:, :, :450], ka[:, :, :450]) and torch.equal(v[:, :, :450], va[:, :, :450])


def test_deferkv_observes_then_evicts_at_the_first_decode_step():
    k, v, q, pos = batch(b=1, length=97 + 1, w=16)
    c = kvevict.Compressor(1, 8, 2, 32, "float32", "deferkv", tokens=24, window=16, delay=1,
                           max_sequences=1, max_tokens=98)
    assert c.state_size > 0
    states = torch.zeros(1, c.state_size, dtype=torch.uint8)
    c.reset_state(states[0])
    r = c.run(0, k, v, q, pos, states=states, seq_lens=torch.tensor([97]))
    assert r[0].action == "observed"
    step_q = torch.randn(1, 8, 1, 32)
    r = c.run(0, k, v, step_q, torch.tensor([97]), event=["decode"], states=states)
    assert r[0].action == "evicted" and r[0].length == 24 + 16 + 1  # B candidates, window and the step on top
    with pytest.raises(ValueError, match="states"):
        c.run(0, k, v, q, pos)


def test_fp8_caches_are_compacted_as_bytes():
    k = torch.randint(0, 255, (2, 50, 16), dtype=torch.uint8)
    v = torch.randint(0, 255, (2, 50, 16), dtype=torch.uint8)
    k0 = k.clone()
    offsets, indices = kvevict.select(torch.randn(2, 50), tokens=10)
    lengths = kvevict.evict(k, v, offsets, indices)
    assert lengths.tolist() == [10, 10]
    for h in range(2):
        assert torch.equal(k[h, :10], k0[h, indices[offsets[h]:offsets[h + 1]]])


def test_type_stubs_are_installed_with_the_docstrings():
    import importlib.resources

    stub = importlib.resources.files("kvevict").joinpath("_kvevict.pyi").read_text()
    assert "class Compressor" in stub and "def run(" in stub and "def observation_scores(" in stub
    assert importlib.resources.files("kvevict").joinpath("py.typed").is_file()
    assert "GIL is released" in kvevict.Compressor.run.__doc__


def test_views_stay_inside_the_tensors():
    """Arguments that would make kvevict read or write outside a tensor are refused by name:
    lengths past the tokens axis, values shorter than keys, an expanded (stride 0) batch, a
    state buffer that is not one dense run of bytes."""
    k, v, q, pos = batch()
    c = kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", compression_ratio=0.5, window=16,
                           max_sequences=2, max_tokens=200)
    k0, v0 = k.clone(), v.clone()
    with pytest.raises(ValueError, match="seq_lens"):
        c.run(0, k, v, q, pos, seq_lens=torch.tensor([97, 150]))
    with pytest.raises(ValueError, match="keys"):
        c.run(0, k[:1].expand(2, -1, -1, -1), v, q, pos)
    assert torch.equal(k, k0) and torch.equal(v, v0)
    offsets, indices = kvevict.select(torch.randn(2, 97), tokens=10)
    with pytest.raises(ValueError, match="values"):
        kvevict.evict(k[0].clone(), v[0, :, :10].clone(), offsets, indices)
    d = kvevict.Compressor(1, 8, 2, 32, "float32", "deferkv", tokens=24, window=16, max_tokens=98)
    with pytest.raises(ValueError, match="state"):
        d.reset_state(torch.zeros(1, dtype=torch.uint8).expand(d.state_size))
    with pytest.raises(ValueError, match="scope"):
        kvevict.Compressor(1, 8, 2, 32, "float32", scope="per_sequence", max_tokens=97)


def test_read_only_inputs_are_read_where_they_lie():
    k, v, q, pos = batch()
    qn = q.numpy().copy()
    qn.setflags(write=False)
    positions = np.broadcast_to(pos.numpy(), (16,))  # read-only
    c = kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", compression_ratio=0.5, window=16,
                           max_sequences=2, max_tokens=97)
    c.run(0, k.numpy(), v.numpy(), qn, positions)


def test_out_of_place_writes_the_in_place_rows_to_the_destinations_and_reads_the_sources_only():
    """compaction='out_of_place': the sources are left as they were, and each head's kept rows
    are those in-place compaction leaves, in the destinations' first rows; at decode-time
    compressions too (the engine swaps to the destinations after each evicting call)."""
    k, v, q, pos = batch(dtype=torch.bfloat16)
    common = dict(tokens=40, window=16, max_sequences=2, max_tokens=97)
    here = kvevict.Compressor(1, 8, 2, 32, "bfloat16", "snapkv", **common)
    there = kvevict.Compressor(1, 8, 2, 32, "bfloat16", "snapkv", compaction="out_of_place", **common)
    assert there.keep_capacity_per_head == 40
    ki, vi = k.clone(), v.clone()
    here.run(0, ki, vi, q, pos)
    k0, v0 = k.clone(), v.clone()
    dk = torch.full((2, 2, 40, 32), 7.0, dtype=torch.bfloat16)
    dv = torch.full((2, 2, 40, 32), 7.0, dtype=torch.bfloat16)
    lengths = torch.zeros(2, 2, dtype=torch.int64)
    reports = there.run(0, k, v, q, pos, head_lengths=lengths, dst_keys=dk, dst_values=dv)
    assert [r.action for r in reports] == ["evicted", "evicted"] and lengths.eq(40).all()
    assert torch.equal(k, k0) and torch.equal(v, v0)
    assert torch.equal(dk, ki[:, :, :40]) and torch.equal(dv, vi[:, :, :40])

    # Decode-time budgets (KNorm, target 12, interval 3), the engine swapping buffers each round.
    hq, hkv, d, prompt, steps = 4, 2, 16, 20, 30
    g = torch.Generator().manual_seed(5)
    rows = torch.randn(hkv, prompt + steps, d, generator=g)
    opts = dict(compression_ratio=0.0, decoding_tokens=12, decoding_interval=3, decoding_policy="knorm",
                max_tokens=64)
    a = kvevict.Compressor(1, hq, hkv, d, "float32", "knorm", **opts)
    b = kvevict.Compressor(1, hq, hkv, d, "float32", "knorm", compaction="out_of_place", **opts)
    sa = torch.zeros(1, a.state_size, dtype=torch.uint8)
    sb = torch.zeros(1, b.state_size, dtype=torch.uint8)
    a.reset_state(sa[0])
    b.reset_state(sb[0])
    ca, cb = torch.zeros(1, hkv, 64, d), torch.zeros(1, hkv, 64, d)
    cv_a, cv_b = torch.zeros(1, hkv, 64, d), torch.zeros(1, hkv, 64, d)
    ca[0, :, :prompt] = cb[0, :, :prompt] = rows[:, :prompt]
    cv_a[0, :, :prompt] = cv_b[0, :, :prompt] = -rows[:, :prompt]
    fresh_k, fresh_v = torch.zeros_like(cb), torch.zeros_like(cv_b)
    qq = torch.randn(1, hq, 1, d, generator=g)
    length, rounds = prompt, 0
    for step in range(steps + 1):
        event = "prefill_end" if step == 0 else "decode"
        if step > 0:
            ca[0, :, length] = cb[0, :, length] = rows[:, prompt + step - 1]
            cv_a[0, :, length] = cv_b[0, :, length] = -rows[:, prompt + step - 1]
            length += 1
        p = torch.tensor([prompt + step - 1], dtype=torch.int64)
        n = torch.tensor([length])
        ra = a.run(0, ca, cv_a, qq, p, event=[event], states=sa, seq_lens=n)[0]
        before = cb.clone(), cv_b.clone()
        rb = b.run(0, cb, cv_b, qq, p, event=[event], states=sb, seq_lens=n, dst_keys=fresh_k,
                   dst_values=fresh_v)[0]
        assert (ra.action, ra.length) == (rb.action, rb.length)
        assert torch.equal(cb, before[0]) and torch.equal(cv_b, before[1])
        if rb.action == "evicted":
            rounds += 1
            cb, fresh_k = fresh_k, cb  # the engine's swap: the fresh rows are the cache now
            cv_b, fresh_v = fresh_v, cv_b
            length = rb.length
        assert torch.equal(ca[:, :, :length], cb[:, :, :length]), step
        assert torch.equal(cv_a[:, :, :length], cv_b[:, :, :length]), step
    assert rounds >= 4


def test_out_of_place_destinations_are_checked_by_name_and_nothing_changes():
    k, v, q, pos = batch()
    common = dict(tokens=40, window=16, max_sequences=2, max_tokens=97)
    there = kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", compaction="out_of_place", **common)
    here = kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", **common)
    dk, dv = torch.zeros(2, 2, 40, 32), torch.zeros(2, 2, 40, 32)
    k0, v0 = k.clone(), v.clone()
    cases = [
        (there, dict(dst_keys=None), "dst_keys"),
        (there, dict(dst_values=dk[:, :1]), "dst_values"),
        (there, dict(dst_keys=dk.half()), "dst_keys"),
        (there, dict(dst_keys=dk[:, :, :39]), "dst_keys"),  # fewer rows than a head keeps
        (there, dict(dst_keys=k[:, :, :40]), "dst_keys"),   # the source's own rows
        (here, dict(), "dst_keys"),                          # destinations under in_place
    ]
    for plan, change, name in cases:
        args = dict(keys=k, values=v, queries=q, query_positions=pos, dst_keys=dk, dst_values=dv)
        args.update(change)
        with pytest.raises(ValueError, match=name):
            plan.run(0, **args)
        assert torch.equal(k, k0) and torch.equal(v, v0), name
        assert dk.eq(0).all() and dv.eq(0).all(), name


def test_unsupported_combinations_raise_not_implemented():
    with pytest.raises(NotImplementedError):
        kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", scope="per_layer", heads="adakv", max_tokens=97)


def test_decoding_budgets_hold_a_long_generation_against_a_key_norm_reference():
    """Decode-time budgets (decoding_tokens, decoding_interval): the prompt kept whole, KNorm as
    the decode scorer. Every decode step appends a row and makes one run(); the step that leaves
    more than target + N rows compacts each head to its target rows of lowest key norm (KNorm's
    score, written here from its definition), in order, and positions run on."""
    hq, hkv, d, prompt, steps, target, n = 8, 2, 16, 30, 120, 24, 8
    g = torch.Generator().manual_seed(7)
    k = torch.zeros(1, hkv, prompt + steps, d)
    v = torch.zeros(1, hkv, prompt + steps, d)
    k[:, :, :prompt] = torch.randn(1, hkv, prompt, d, generator=g)
    v[:, :, :prompt] = torch.randn(1, hkv, prompt, d, generator=g)
    c = kvevict.Compressor(1, hq, hkv, d, "float32", "knorm", compression_ratio=0.0, decoding_tokens=target,
                           decoding_interval=n, max_tokens=prompt + steps)
    states = torch.zeros(1, c.state_size, dtype=torch.uint8)
    c.reset_state(states[0])
    lengths = torch.zeros(1, hkv, dtype=torch.int64)
    kept = torch.full((1, c.keep_capacity), -1, dtype=torch.int64)
    q = torch.randn(1, hq, prompt, d, generator=g)
    r = c.run(0, k, v, q, torch.arange(prompt), states=states, seq_lens=torch.tensor([prompt]),
              head_lengths=lengths, kept_positions=kept)
    assert r[0].dropped == 0 and r[0].length == prompt  # the prompt's one-shot compression keeps it all
    length, position, rounds = prompt, prompt, 0
    for _ in range(steps):
        k[0, :, length] = torch.randn(hkv, d, generator=g)
        v[0, :, length] = torch.randn(hkv, d, generator=g)
        length += 1
        before_k, before_v = k[0, :, :length].clone(), v[0, :, :length].clone()
        r = c.run(0, k, v, torch.randn(1, hq, 1, d, generator=g), torch.tensor([position]), event=["decode"],
                  states=states, seq_lens=torch.tensor([length]), head_lengths=lengths, kept_positions=kept)
        position += 1
        if length > target + n:
            assert r[0].action == "evicted" and r[0].length == target and r[0].next_position == position
            rounds += 1
            for h in range(hkv):
                norms = before_k[h].double().norm(dim=1)
                keep = np.sort(np.argsort(norms.numpy(), kind="stable")[:target])
                assert torch.equal(k[0, h, :target], before_k[h, keep]), (rounds, h)
                assert torch.equal(v[0, h, :target], before_v[h, keep]), (rounds, h)
            assert lengths.tolist() == [[target] * hkv]
            length = target
        else:
            assert r[0].action != "evicted" and torch.equal(k[0, :, :length], before_k)
        assert length <= target + n
    # 30 -> 33 rows at the third step (a round), then a round every N + 1 = 9 steps: 1 + 117 // 9.
    assert rounds == 14


def test_decoding_budget_options_are_checked_by_name():
    with pytest.raises(ValueError, match="decoding_policy"):
        kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", decoding_policy="knorm", max_tokens=97)
    with pytest.raises(ValueError, match="decoding_tokens, decoding_ratio"):
        kvevict.Compressor(1, 8, 2, 32, "float32", "snapkv", decoding_tokens=8, decoding_ratio=0.5, max_tokens=97)
    with pytest.raises((ValueError, NotImplementedError), match="decoding.policy"):
        kvevict.Compressor(1, 8, 2, 32, "float32", "deferkv", decoding_tokens=16, max_tokens=97)
    with pytest.raises(ValueError, match="decoding.interval"):
        kvevict.Compressor(1, 8, 2, 32, "float32", "knorm", decoding_tokens=16, decoding_interval=0, max_tokens=97)
