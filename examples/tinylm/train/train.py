"""Train TinyLM on the synthetic long-context tasks (tasks.py).

The committed weights came from three runs of this script, chained through --init
checkpoints; examples/tinylm/train/reproduce.sh has the exact commands and
examples/tinylm/TRAINING.md the logs, timings and the setups that did not work.
The schedule is a context-length curriculum given by --phases as
"ctx_len:batch:steps[:w_single/w_multikey/w_multivalue/w_vartrack],...";
without the 4th field a phase uses the --tasks mixture. Loss is cross-entropy on answer tokens
only; every training sequence asks about every needle group (dense supervision).
No evaluation runs inside the loop except a cheap one at phase ends
(teacher-forced exact match on a few prompts, see eval.py).
"""
import argparse
import json
import math
import os
import sys
import time


def _threads_from_argv(default=1):
    for i, a in enumerate(sys.argv):
        if a == "--threads" and i + 1 < len(sys.argv):
            return sys.argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return str(default)


# Debian's torch does its matmuls in OpenBLAS, which ignores torch.set_num_threads and
# would otherwise use every core: pin all thread pools before numpy/torch are imported.
for _v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[_v] = _threads_from_argv()

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from model import Config, TinyLM  # noqa: E402
import tasks  # noqa: E402
from export import save_safetensors  # noqa: E402

DEFAULT_PHASES = "32:32:1000,64:32:400,128:16:300,256:8:300,512:4:300,1024:2:800"


def make_batch(rng, task_probs, ctx_len, batch):
    seqs, masks, srcs, qsrcs = [], [], [], []
    names = list(task_probs)
    p = np.array([task_probs[n] for n in names], dtype=np.float64)
    p /= p.sum()
    for _ in range(batch):
        t = names[rng.choice(len(names), p=p)]
        # jitter the context length a little so the model sees varied positions
        cl = int(ctx_len * rng.uniform(0.75, 1.0))
        kw = tasks.sample_train_kw(rng, t, cl)
        ids, m, sr, qs = tasks.make_train_sequence(rng, t, cl, **kw)
        seqs.append(ids)
        masks.append(m)
        srcs.append(sr)
        qsrcs.append(qs)
    T = max(len(s) for s in seqs)
    ids = np.zeros((batch, T), dtype=np.int64)
    mask = np.zeros((batch, T), dtype=bool)
    src = np.full((2, batch, T), -1, dtype=np.int64)
    for i, (s, m, sr, qs) in enumerate(zip(seqs, masks, srcs, qsrcs)):
        ids[i, :len(s)] = s
        mask[i, :len(m)] = m
        src[0, i, :len(sr)] = sr
        src[1, i, :len(qs)] = qs
    return torch.from_numpy(ids), torch.from_numpy(mask), torch.from_numpy(src)


def attn_sup_loss(model, ids, src):
    """Attention supervision (training aid, see TRAINING.md). Layer 0: query head 0
    attends to the previous token, head 4 to the token two back, head 1 (at answer
    positions) to the last token of the question being answered. Layer 1: query head 0
    of every KV group (heads 0 and 4) attends, at every target position, to the context
    token being copied. src = [2, B, T]: copy source and question-end position."""
    B, T = ids.shape
    p0 = model.layers[0].probs                  # [B,H,T,T]
    p1 = model.layers[1].probs
    valid = (ids != tasks.PAD)
    t = torch.arange(T)
    l_prev1 = -torch.log(p0[:, 0, t[1:], t[:-1]] + 1e-9)[valid[:, 1:]].mean()
    l_prev2 = -torch.log(p0[:, 4, t[2:], t[:-2]] + 1e-9)[valid[:, 2:]].mean()
    bq, tq = torch.nonzero(src[1] >= 0, as_tuple=True)
    l_q = -torch.log(p0[bq, 1, tq, src[1][bq, tq]] + 1e-9).mean()
    bi, ti = torch.nonzero(src[0] >= 0, as_tuple=True)
    G = model.c.n_heads // model.c.n_kv_heads
    l_ret = 0.0
    for h in range(0, model.c.n_heads, G):      # the first query head of every KV group
        l_ret = l_ret - torch.log(p1[bi, h, ti, src[0][bi, ti]] + 1e-9).mean()
    l_ret = l_ret / model.c.n_kv_heads
    return l_prev1 + l_prev2 + l_q + l_ret, l_ret


def loss_fn(model, ids, mask, src, w_sup):
    for layer in model.layers:
        layer.keep_probs = w_sup > 0
    h = model.hidden(ids)                       # [B,T,d]
    tgt = torch.roll(ids, -1, dims=1)
    hs = h[mask]                                # only answer-predicting positions
    logits = model.output(hs)
    y = tgt[mask]
    loss = F.cross_entropy(logits, y)
    acc = (logits.argmax(-1) == y).float().mean()
    l_sup = l_ret = torch.zeros(())
    if w_sup > 0:
        l_sup, l_ret = attn_sup_loss(model, ids, src)
        for layer in model.layers:
            layer.keep_probs, layer.probs = False, None
    return loss, acc, l_sup, l_ret


@torch.no_grad()
def quick_eval(model, seed, ctx_len, n=16):
    """Teacher-forced exact match (== greedy exact match) on n fresh prompts per task."""
    rng = np.random.RandomState(seed)
    res = {}
    model.eval()
    for t in tasks.TASKS:
        ok = 0
        for _ in range(n):
            kw = dict(tasks.EVAL_TASKS[t])
            if t == "multikey":
                kw["n_needles"] = min(6, max(2, int(0.5 * ctx_len) // 6))
            if t == "multivalue" and ctx_len < 128:
                kw = dict(n_keys=1, n_values=3)
            p, a = tasks.make_prompt(rng, t, ctx_len, **kw)
            ids = torch.tensor([p + a[:-1]])
            pred = model(ids)[0, len(p) - 1:].argmax(-1).tolist()
            ok += int(pred == a)
        res[t] = ok / n
    model.train()
    return res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--phases", default=DEFAULT_PHASES)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min_lr_frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=100)
    ap.add_argument("--decay_steps", type=int, default=800, help="cosine decay over the last N steps")
    ap.add_argument("--schedule_steps", type=int, default=0,
                    help="length of the learning-rate schedule (default: the sum of the phases); "
                         "lets a run stop part-way through a longer schedule")
    ap.add_argument("--wd", type=float, default=0.01)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--n_layers", type=int, default=2)
    ap.add_argument("--d_model", type=int, default=128)
    ap.add_argument("--n_heads", type=int, default=8)
    ap.add_argument("--n_kv_heads", type=int, default=2)
    ap.add_argument("--head_dim", type=int, default=32)
    ap.add_argument("--ffn_dim", type=int, default=256)
    ap.add_argument("--rope_theta", type=float, default=1e6)
    ap.add_argument("--tie", type=int, default=1)
    ap.add_argument("--attn_sup", type=float, default=1.0, help="weight of the attention-supervision loss")
    ap.add_argument("--tasks", default="single:1,multikey:1,multivalue:2,vartrack:2")
    ap.add_argument("--log_every", type=int, default=25)
    ap.add_argument("--out", default="examples/tinylm/weights/tinylm.safetensors")
    ap.add_argument("--ckpt", default="", help="also save a torch checkpoint here")
    ap.add_argument("--init", default="", help="start from this torch checkpoint")
    args = ap.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    rng = np.random.RandomState(args.seed)
    cfg = Config(vocab_size=tasks.VOCAB_SIZE, n_layers=args.n_layers, d_model=args.d_model,
                 n_heads=args.n_heads, n_kv_heads=args.n_kv_heads, head_dim=args.head_dim,
                 ffn_dim=args.ffn_dim, rope_theta=args.rope_theta,
                 tie_embeddings=bool(args.tie))
    model = TinyLM(cfg)
    if args.init:
        model.load_state_dict(torch.load(args.init)["model"])
    nparam = sum(p.numel() for p in model.parameters())
    print("config", json.dumps(cfg.to_dict()), "params", nparam, flush=True)
    print("argv", " ".join(sys.argv), flush=True)

    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (no_decay if p.dim() < 2 else decay).append(p)
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.98), eps=1e-8)
    task_probs = {kv.split(":")[0]: float(kv.split(":")[1]) for kv in args.tasks.split(",")}
    phases = []
    for ph in args.phases.split(","):
        f = ph.split(":")
        mix = task_probs if len(f) < 4 else {t: float(w) for t, w in zip(tasks.TASKS, f[3].split("/"))}
        phases.append((int(f[0]), int(f[1]), int(f[2]), mix))
    total = args.schedule_steps or sum(p[2] for p in phases)

    def lr_at(step):
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        d0 = total - args.decay_steps
        if step < d0:
            return args.lr
        f = (step - d0) / max(1, args.decay_steps)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * f)))

    t_start = time.time()
    step = 0
    for pi, (ctx_len, batch, nsteps, mix) in enumerate(phases):
        run_loss = run_acc = run_sup = run_ret = 0.0
        nrun = 0
        t_ph = time.time()
        for _ in range(nsteps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            ids, mask, src = make_batch(rng, mix, ctx_len, batch)
            loss, acc, l_sup, l_ret = loss_fn(model, ids, mask, src, args.attn_sup)
            opt.zero_grad(set_to_none=True)
            (loss + args.attn_sup * l_sup).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            step += 1
            run_loss += loss.item()
            run_acc += acc.item()
            run_sup += l_sup.item()
            run_ret += l_ret.item()
            nrun += 1
            if step % args.log_every == 0:
                el = time.time() - t_start
                print("step %5d ctx %4d loss %.4f acc %.3f sup %.3f (ret %.3f) lr %.2e  %.3fs/step  elapsed %.0fs" % (
                    step, ctx_len, run_loss / nrun, run_acc / nrun, run_sup / nrun, run_ret / nrun, lr_at(step - 1),
                    (time.time() - t_ph) / max(1, nrun), el), flush=True)
                run_loss = run_acc = run_sup = run_ret = 0.0
                nrun = 0
                t_ph = time.time()
        ev = quick_eval(model, 999 + pi, min(ctx_len, 1024))
        print("phase %d done (ctx %d) step %d elapsed %.0fs quick_eval %s" % (
            pi, ctx_len, step, time.time() - t_start, json.dumps(ev)), flush=True)
        if args.ckpt:
            torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "step": step}, args.ckpt)
    print("training wall time %.0fs" % (time.time() - t_start), flush=True)
    if args.out:
        save_safetensors(model, args.out, meta={"seed": str(args.seed), "argv": " ".join(sys.argv),
                                                "config": json.dumps(cfg.to_dict())})
        print("wrote", args.out, flush=True)


if __name__ == "__main__":
    main()
