"""The TinyLM weights as a Hugging Face Llama (examples/tinylm/train/export_hf.py): the exported
model's logits equal the PyTorch training model's reference logits, and kvevict's press runs on
it through transformers' own attention hook. The full fidelity rows through this route are
compared with the C++ engine's by examples/tinylm/train/fidelity_hf.py --check (docs/python.md)."""
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("kvpress")
pytest.importorskip("safetensors")

from transformers import LlamaForCausalLM  # noqa: E402

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
    rows = fidelity_hf.rows(model, prompts, ["full", "streaming_llm", "snapkv"], [0.03])
    correct = {p: sum(c[0] for c in b[0].values()) for p, b in rows.items()}
    assert correct["full"] == 12
    assert correct["streaming_llm"] < correct["snapkv"]
