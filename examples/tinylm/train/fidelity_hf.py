"""The TinyLM fidelity rows through Hugging Face transformers and kvpress: the exported model
(export_hf.py) runs each held-out prompt with kvevict's kvpress press at each budget, decodes the
answer greedily, and counts exact answers per task -- the C++ bench's procedure
(engine/main.cpp, policies.hpp: the same policies, windows, protected tails and budgets), with
another model implementation, another attention hook and another decoding loop. Equal rows
mean the C++ engine and bench are sound; --check compares with docs/fidelity/results.json.

    python fidelity_hf.py [--per-task N] [--budgets 0.5,0.25] [--policies snapkv,h2o] [--check]

Policies served here: full, streaming_llm, knorm, h2o, snapkv, deferkv_eta<eta>_d<d>,
dapq (pseudo tokens appended by the press), dapq_rerotate (14 of the bench's 26 rows; the
allocator combinations and the shared scopes are not served by the press). Run in a venv with kvevict, kvpress, transformers and torch (scripts/test python's).
"""
import argparse
import contextlib
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import DynamicCache, LlamaForCausalLM

from kvevict.kvpress import KvevictPress

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from export_hf import export  # noqa: E402

WINDOW = 8  # policies.hpp kWindow: the question, kept by every policy


def press_for(policy: str, budget: int):
    """policies.hpp compressor_for, as a press with a budget in tokens per head."""
    inside = {"protect": "inside_budget", "tokens": budget}
    if policy == "streaming_llm":
        return KvevictPress("streaming_llm", options={"sinks": 4, "tokens": budget})
    if policy == "knorm":
        return KvevictPress("knorm", options={"protected_tail": WINDOW, **inside})
    if policy == "h2o":
        return KvevictPress("h2o", options={"protected_tail": WINDOW, **inside})
    if policy == "snapkv":  # KVCache-Factory's LongBench preset (W = 8, max pool 7, sum), inside the budget
        return KvevictPress("snapkv", window_size=WINDOW, kernel_size=7, preset="kvcache_factory", options=inside)
    if policy == "dapq_rerotate":  # N = 32 re-rotated prompt queries, inside the budget (policies.hpp)
        return KvevictPress("dapq", options={"pseudo_tokens": 32, **inside})
    if policy == "dapq":  # N = 32 pseudo tokens, the first 8 + last 24 prompt tokens (main.cpp)
        return KvevictPress("dapq", options={"pseudo_tokens": 32, "pseudo_first": 8, "dapq_source": "pseudo_tokens",
                                             "tokens": budget})
    if policy.startswith("deferkv_eta"):  # deferkv_eta0.9_d1: eta and the delay d
        eta, delay = policy[len("deferkv_eta"):].split("_d")
        return KvevictPress("deferkv", window_size=WINDOW, kernel_size=7,
                            options={"eta": float(eta), "delay": int(delay), **inside})
    raise ValueError(f"policy: {policy} is not served here")


def load_prompts(path: Path, per_task: int):
    prompts, seen = [], {}
    for line in path.read_text().splitlines():
        if not line or line.startswith("#"):
            continue
        task, ids, answer = line.split("|")
        if seen.get(task, 0) >= per_task:
            continue
        seen[task] = seen.get(task, 0) + 1
        prompts.append((task, [int(x) for x in ids.split()], [int(x) for x in answer.split()]))
    return prompts


def answer(model, press, ids, n):
    """Prefill with the press, then n - 1 greedy steps at the true positions (after eviction the
    cache is shorter than the position of the next token), inside the press's context (DeferKV
    evicts at a decode step; the other policies act at prefill only)."""
    cache = DynamicCache()
    with torch.inference_mode(), (press(model) if press is not None else contextlib.nullcontext()):
        out = model(torch.tensor([ids]), past_key_values=cache)
        tokens = [int(out.logits[0, -1].argmax())]
        for i in range(n - 1):
            out = model(torch.tensor([[tokens[-1]]]), past_key_values=cache,
                        position_ids=torch.tensor([[len(ids) + i]]))
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


def rows(model, prompts, policies, budgets):
    results = {}
    for policy in policies:
        per_budget = []
        for fraction in (budgets if policy != "full" else budgets[:1]):
            counts = {}
            for task, ids, want in prompts:
                budget = max(1, math.floor(fraction * len(ids) + 0.5))  # llround
                got = answer(model, None if policy == "full" else press_for(policy, budget), ids, len(want))
                c = counts.setdefault(task, [0, 0])
                c[0] += int(got == want)
                c[1] += 1
            per_budget.append(counts)
        if policy == "full":
            per_budget = per_budget * len(budgets)
        results[policy] = per_budget
    return results


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=str(HERE.parent / "weights" / "tinylm.safetensors"))
    ap.add_argument("--prompts", default=str(HERE.parent / "data" / "eval_prompts.txt"))
    ap.add_argument("--per-task", type=int, default=100)
    ap.add_argument("--budgets", default="0.5,0.25,0.125,0.0625,0.03")
    ap.add_argument("--policies", default="full,streaming_llm,knorm,h2o,snapkv")
    ap.add_argument("--check", action="store_true", help="compare with docs/fidelity/results.json")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as d:
        model = LlamaForCausalLM.from_pretrained(export(args.weights, d), attn_implementation="sdpa").eval()
    prompts = load_prompts(Path(args.prompts), args.per_task)
    budgets = [float(b) for b in args.budgets.split(",")]
    policies = args.policies.split(",")
    t0 = time.time()
    results = rows(model, prompts, policies, budgets)
    print(f"{len(prompts)} prompts, {len(policies)} policies, {len(budgets)} budgets in {time.time() - t0:.0f} s")
    for policy, per_budget in results.items():
        cells = [f"{100 * sum(c[0] for c in b.values()) / sum(c[1] for c in b.values()):.1f}" for b in per_budget]
        print(f"{policy:16s} " + " ".join(f"{c:>6s}" for c in cells))
    if args.json:
        Path(args.json).write_text(json.dumps({"budgets": budgets, "results": results}, indent=1) + "\n")
    if args.check:
        ref = json.loads((HERE.parents[2] / "docs" / "fidelity" / "results.json").read_text())
        if args.per_task != ref["prompts_per_task"]:
            sys.exit(f"--check needs --per-task {ref['prompts_per_task']} (the committed rows' count)")
        bad = 0
        for policy, per_budget in results.items():
            for fraction, counts in zip(budgets, per_budget):
                if fraction not in ref["budgets"]:
                    sys.exit(f"--budgets: {fraction} has no committed row (results.json has {ref['budgets']})")
                want = ref["results"][policy]["accuracy"][ref["budgets"].index(fraction)]
                for task, c in counts.items():
                    if c != want[task]:
                        bad += 1
                        print(f"differs: {policy} at {fraction}: {task} {c} here, {want[task]} in the C++ rows")
        print("every row equals the C++ engine's" if bad == 0 else f"{bad} cells differ")
        sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
