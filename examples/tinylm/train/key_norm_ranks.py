"""Why KNorm scores 0% in the fidelity bench: where the needle values' keys rank by norm.

For a few held-out prompts, prints per layer and KV head the mean rank (0 = smallest norm,
1 = largest) of the key norms at the positions holding the answer's first token. KNorm keeps
the smallest-norm keys, so a rank near 1 means it evicts the needle first.
Run from this directory with /usr/bin/python3.
"""
import sys

import numpy as np
import torch

sys.path.insert(0, ".")
from export import load_model  # noqa: E402
from make_data import read_prompts  # noqa: E402

TAIL = 8  # the protected question window of the bench (kWindow)
KV_HEADS = 2


def main():
    torch.set_num_threads(1)
    model, _ = load_model("../weights/tinylm.safetensors")
    keys = {}
    for layer, block in enumerate(model.layers):
        block.attention.wk.register_forward_hook(lambda m, i, o, layer=layer: keys.__setitem__(layer, o.detach()))
    ranks = {layer: [] for layer in range(len(model.layers))}
    for _, prompt, answer in read_prompts("../data/eval_prompts.txt")[:40:5]:
        with torch.no_grad():
            model(torch.tensor([prompt]))
        n = len(prompt) - TAIL
        needle = [i for i in range(n) if prompt[i] == answer[0]]
        if not needle:
            continue
        for layer, k in keys.items():
            norms = k[0].view(len(prompt), KV_HEADS, -1).norm(dim=-1)[:n]
            for h in range(norms.shape[1]):
                rank = torch.empty(n)
                rank[torch.argsort(norms[:, h])] = torch.arange(n, dtype=torch.float32) / (n - 1)
                ranks[layer].append(float(rank[needle].mean()))
    for layer, r in ranks.items():
        print("layer %d: needle key-norm rank mean %.2f (min %.2f, max %.2f over %d prompt-heads)"
              % (layer, np.mean(r), np.min(r), np.max(r), len(r)))


if __name__ == "__main__":
    main()
