"""Full-KV greedy-decoding accuracy of TinyLM on the held-out prompts.

    /usr/bin/python3 examples/tinylm/train/eval.py [--weights W] [--prompts P] [--threads 1]

For every prompt the model decodes len(answer) tokens greedily (argmax, full KV cache:
the whole sequence is recomputed each step) and the prompt counts as correct only if
all answer tokens match exactly. Prints per-task exact-match accuracy and per-answer-
position token accuracy as JSON.
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from export import load_model  # noqa: E402
from make_data import read_prompts, ROOT  # noqa: E402


@torch.no_grad()
def greedy_kv(model, prompt, n_new):
    """Greedy decoding with an explicit KV cache (same math as model.forward)."""
    import math
    c = model.c
    KV, G, hd = c.n_kv_heads, c.n_heads // c.n_kv_heads, c.head_dim
    ids = torch.tensor([prompt])
    caches = [None] * c.n_layers
    out = []
    pos0 = 0
    x_ids = ids
    for step in range(n_new):
        T = x_ids.shape[1]
        cos, sin = model.rope_cos[pos0:pos0 + T], model.rope_sin[pos0:pos0 + T]
        x = model.tok_embeddings(x_ids)
        for li, layer in enumerate(model.layers):
            att = layer.attention
            h = layer.attention_norm(x)
            q = att.wq(h).view(1, T, KV, G, hd).permute(0, 2, 3, 1, 4)
            k = att.wk(h).view(1, T, KV, hd).permute(0, 2, 1, 3)
            v = att.wv(h).view(1, T, KV, hd).permute(0, 2, 1, 3)
            from model import apply_rope
            q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
            if caches[li] is not None:
                k = torch.cat([caches[li][0], k], dim=2)
                v = torch.cat([caches[li][1], v], dim=2)
            caches[li] = (k, v)
            S = k.shape[2]
            s = torch.matmul(q.reshape(1, KV, G * T, hd), k.transpose(-1, -2)).view(1, KV, G, T, S)
            s = s / math.sqrt(hd)
            mask = torch.full((T, S), float("-inf")).triu(S - T + 1)
            p = torch.softmax(s + mask, dim=-1)
            o = torch.matmul(p.view(1, KV, G * T, S), v).view(1, KV, G, T, hd)
            x = x + att.wo(o.permute(0, 3, 1, 2, 4).reshape(1, T, KV * G * hd))
            x = x + layer.feed_forward(layer.ffn_norm(x))
        logits = model.output(model.norm(x[:, -1]))
        nxt = int(logits[0].argmax())
        out.append(nxt)
        pos0 += T
        x_ids = torch.tensor([[nxt]])
    return out


def evaluate(model, prompts, limit=None):
    res = {}
    for t, p, a in prompts:
        r = res.setdefault(t, {"n": 0, "exact": 0, "pos": [0] * len(a)})
        if limit and r["n"] >= limit:
            continue
        pred = greedy_kv(model, p, len(a))
        r["n"] += 1
        r["exact"] += int(pred == a)
        for i, (x, y) in enumerate(zip(pred, a)):
            r["pos"][i] += int(x == y)
    summary = {}
    for t, r in res.items():
        summary[t] = {"n": r["n"], "exact_match": r["exact"] / r["n"],
                      "token_acc_by_position": [round(x / r["n"], 3) for x in r["pos"]]}
    return summary


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights", default=os.path.join(ROOT, "weights", "tinylm.safetensors"))
    ap.add_argument("--prompts", default=os.path.join(ROOT, "data", "eval_prompts.txt"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--limit", type=int, default=0, help="at most this many prompts per task")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model, meta = load_model(args.weights)
    t0 = time.time()
    summary = evaluate(model, read_prompts(args.prompts), args.limit or None)
    for t, r in summary.items():
        print("%-10s n=%3d exact_match=%.3f  per-position %s" % (t, r["n"], r["exact_match"], r["token_acc_by_position"]))
    print(json.dumps(summary))
    print("eval time %.0fs" % (time.time() - t0))


if __name__ == "__main__":
    main()
