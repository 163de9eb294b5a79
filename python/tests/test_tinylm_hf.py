"""The TinyLM weights as a Hugging Face Llama (examples/tinylm/train/export_hf.py): the exported
model's logits equal the PyTorch training model's reference logits, and kvevict's press runs on
it through transformers' own attention hook. The full fidelity rows through this route are
compared with the C++ engine's by examples/tinylm/train/fidelity_hf.py --check (docs/python.md)."""
import contextlib
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kvpress")
pytest.importorskip("safetensors")

from transformers import DynamicCache, LlamaForCausalLM  # noqa: E402

TINYLM = Path(__file__).resolve().parents[2] / "examples" / "tinylm"
sys.path.insert(0, str(TINYLM / "train"))
from export_hf import export  # noqa: E402
import fidelity_hf  # noqa: E402


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    out = export(str(TINYLM / "weights" / "tinylm.safetensors"), str(tmp_path_factory.mktemp("tinylm-hf")))
    return LlamaForCausalLM.from_pretrained(out, attn_implementation="sdpa").eval()


def reference_logits():
    lines = (TINYLM / "data" / "reference_logits.txt").read_text().splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("P "):
            parts = lines[i].split()
            t = int(parts[1])
            ids = [int(x) for x in parts[2:2 + t]]
            rows = np.array([[float(x) for x in lines[i + 2 + r].split()] for r in range(t)])
            yield ids, rows
            i += 2 + t
        else:
            i += 1


def test_exported_model_reproduces_the_reference_logits(model):
    n = 0
    for ids, want in reference_logits():
        with torch.inference_mode():
            got = model(torch.tensor([ids])).logits[0].double().numpy()
        np.testing.assert_allclose(got, want, atol=1e-3, rtol=0)  # measured: 8.6e-5 at most
        n += 1
    assert n >= 3


def test_the_fidelity_route_compresses_and_answers(model):
    """Three prompts per task: the full cache answers them (as in the C++ rows) and at a 3%
    budget StreamingLLM loses answers that SnapKV keeps, so the press really evicts."""
    prompts = fidelity_hf.load_prompts(TINYLM / "data" / "eval_prompts.txt", 3)
    rows = fidelity_hf.rows(model, prompts, ["full", "streaming_llm", "snapkv", "dapq_rerotate",
                                             "deferkv_eta0.9_d3"], [0.03])
    correct = {p: sum(c[0] for c in b[0].values()) for p, b in rows.items()}
    assert correct["full"] == 12
    assert correct["streaming_llm"] < min(correct["snapkv"], correct["dapq_rerotate"], correct["deferkv_eta0.9_d3"])


from test_kvpress import CASES, GENERATION_CASES, knorm_ties_only, row_sets  # noqa: E402


def tinylm_prompts():
    """The first held-out prompt of each task (about 1,030 tokens)."""
    return [ids for _, ids, _ in fidelity_hf.load_prompts(TINYLM / "data" / "eval_prompts.txt", 1)]


def prefill_keys(model, press, ids):
    cache = DynamicCache()
    with torch.inference_mode(), press(model):
        model(torch.tensor([ids]), past_key_values=cache)
    return cache


@pytest.mark.parametrize("name,theirs,ours", CASES, ids=[c[0] for c in CASES])
def test_kvpress_and_kvevict_keep_the_same_tokens_on_tinylm(model, name, theirs, ours):
    """kvpress's own presses against KvevictPress on the trained TinyLM (ratio 0.75: 258 of
    1,030 tokens kept, more than SnapKV's window of 64)."""
    for ids in tinylm_prompts():
        a = row_sets(prefill_keys(model, theirs(0.75), ids))
        b = row_sets(prefill_keys(model, ours(0.75), ids))
        with torch.inference_mode():
            full = [k.keys.clone() for k in prefill_keys(model, lambda m: contextlib.nullcontext(), ids).layers]
        for layer, (ka, kb) in enumerate(zip(a, b)):
            assert ka.shape == kb.shape
            same = bool((ka == kb).all())
            if name == "knorm" and not same:
                assert knorm_ties_only(full[layer], ka, kb), f"knorm layer {layer}: beyond exact ties"
                continue
            assert same, f"{name} layer {layer}: keep sets differ"


@pytest.mark.parametrize("name,theirs,ours", GENERATION_CASES, ids=[c[0] for c in GENERATION_CASES])
def test_kvpress_and_kvevict_answer_alike_on_tinylm(model, name, theirs, ours):
    """Greedy answers after compression at ratio 0.75, at the true positions."""
    for ids in tinylm_prompts():
        outs = [fidelity_hf.answer(model, press, ids, 8) for press in (theirs(0.75), ours(0.75))]
        assert outs[0] == outs[1], f"{name}: kvpress {outs[0]} vs kvevict {outs[1]}"


def test_adakv_keeps_adakvpress_entries_on_tinylm(model):
    """AdaKV through the press (AdaKVPress's rule, the default under preset 'kvpress') against
    kvpress's own AdaKVPress on the trained TinyLM: the same masked entries in every layer, and
    the same greedy answers (ratio 0.75, SnapKV's window of 64)."""
    from test_kvpress import masked_sets  # noqa: E402
    import kvpress  # noqa: E402
    from kvevict.kvpress import KvevictPress  # noqa: E402

    for ids in tinylm_prompts():
        prompt = torch.tensor([ids])
        theirs = masked_sets(model, kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.75)), prompt)
        ours = masked_sets(model, KvevictPress("snapkv", compression_ratio=0.75, options={"heads": "adakv"}), prompt)
        for layer, (a, b) in enumerate(zip(theirs, ours)):
            assert torch.equal(a, b), f"layer {layer}: {(a != b).sum().item()} entries differ"
        answers = [fidelity_hf.answer(model, press, ids, 8)
                   for press in (kvpress.AdaKVPress(kvpress.SnapKVPress(compression_ratio=0.75)),
                                 KvevictPress("snapkv", compression_ratio=0.75, options={"heads": "adakv"}))]
        assert answers[0] == answers[1], f"kvpress {answers[0]} vs kvevict {answers[1]}"
