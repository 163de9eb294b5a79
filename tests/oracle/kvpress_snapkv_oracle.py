#!/usr/bin/env python3
"""PyTorch oracle for kvevict's kvpress_snapkv preset, written from design.md §4 the way
kvpress users compute it today: matmul, causal mask, softmax, mean over the window, avg_pool1d
(k=5, padding counted), mean over the GQA group, top-k, window kept inside the budget.

Reads the cases kvevict_torch_oracle wrote into <dir>, checks kvevict's scores (allclose) and
keep-lists (identical sets wherever the k-th/(k+1)-th scores are not near-tied).
Exit 77 (ctest: skipped) when PyTorch is not importable.
"""
import sys

try:
    import torch
    import torch.nn.functional as F
except ImportError:
    print("SKIPPED: PyTorch is not importable by", sys.executable,
          "(install Debian's python3-torch; it imports only in /usr/bin/python3)")
    sys.exit(77)

import numpy as np


def load(path, dtype, shape):
    return torch.from_numpy(np.fromfile(path, dtype=dtype).reshape(shape))


def kvpress_snapkv_scores(q, k, window):
    hq, w, d = q.shape
    hkv, l, _ = k.shape
    g = hq // hkv
    keys = k.repeat_interleave(g, dim=0)                       # [Hq, L, d]
    logits = torch.matmul(q, keys.transpose(-1, -2)) / d ** 0.5  # [Hq, W, L]
    pos = torch.arange(l - w, l).view(1, w, 1)
    visible = torch.arange(l).view(1, 1, l) <= pos
    logits = logits.masked_fill(~visible, float("-inf"))
    attn = torch.softmax(logits, dim=-1, dtype=torch.float32)
    candidates = l - window
    scores = attn[..., :candidates].mean(dim=-2)                # [Hq, C]
    scores = F.avg_pool1d(scores.unsqueeze(1), kernel_size=5, padding=2, stride=1).squeeze(1)
    return scores.view(hkv, g, candidates).mean(dim=1)          # [Hkv, C]


def main(directory):
    torch.set_num_threads(1)
    failures = 0
    for line in open(f"{directory}/manifest.txt"):
        case, dtype, hkv, g, d, l, w, ratio, kept = line.split()
        hkv, g, d, l, w, kept = map(int, (hkv, g, d, l, w, kept))
        ratio = float(ratio)
        base = f"{directory}/case{case}"
        k = load(base + ".k.f32", np.float32, (hkv, l, d))
        q = load(base + ".q.f32", np.float32, (hkv * g, w, d))
        got = load(base + ".scores.f32", np.float32, (hkv, l))
        got_keep = load(base + ".keep.i64", np.int64, (hkv, kept))
        want = kvpress_snapkv_scores(q.double(), k.double(), w).float()
        c = l - w
        if not torch.allclose(got[:, :c], want, rtol=1e-4, atol=1e-7):
            print(f"case {case} ({dtype}): scores differ, max abs err {(got[:, :c] - want).abs().max().item():.3g}")
            failures += 1
        if not torch.isinf(got[:, c:]).all():
            print(f"case {case}: protected window not scored +inf")
            failures += 1
        n_kept = int(l * (1 - ratio))
        assert n_kept == kept, (n_kept, kept)
        for h in range(hkv):
            k_cand = max(0, n_kept - w)
            top = torch.topk(want[h], k_cand).indices if k_cand > 0 else torch.empty(0, dtype=torch.long)
            expected = set(top.tolist()) | set(range(c, l))
            ordered = torch.sort(want[h], descending=True).values
            near_tie = 0 < k_cand < c and abs(ordered[k_cand - 1] - ordered[k_cand]) <= 1e-4 * abs(ordered[k_cand - 1])
            if not near_tie and set(got_keep[h].tolist()) != expected:
                print(f"case {case} ({dtype}) head {h}: keep-lists differ")
                failures += 1
        print(f"case {case}: {dtype} Hkv={hkv} G={g} d={d} L={l} W={w} keep {kept}: "
              f"{'ok' if failures == 0 else 'FAILED'}")
    print("PyTorch oracle:", "all cases agree" if failures == 0 else f"{failures} failure(s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
