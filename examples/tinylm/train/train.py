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

Fidelity-2 additions (the 4-layer model, TRAINING.md "Fidelity-2 model (4 layers)"):
--warm_from copies a smaller model's layers into a deeper one (new layers' output
projections zero, so training starts from the smaller model's function); the long-answer
tasks of tasks.LONG_TASKS can be named in --tasks; --attn_sup_hold/--attn_sup_zero anneal
the attention supervision linearly to zero; --ckpt_every writes a full, resumable
checkpoint (model, optimizer, step, RNG states, arguments) atomically and exports --out
with it; --resume continues that checkpoint's schedule exactly; --stop_at ends a run early
at a given step (with a checkpoint) so a long schedule can be spread over several runs.
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
# arguments a resumed run takes from its command line; every other one comes from the checkpoint
RUNTIME_ARGS = ("threads", "log_every", "out", "ckpt", "ckpt_every", "resume", "stop_at")


def atomic_save(obj, path):
    tmp = path + ".tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def warm_start(model, path, mapping):
    """Copy a smaller TinyLM (safetensors) into model: embeddings, final norm and the layers
    named by mapping {src: dst}; every other layer keeps its random init except its attention
    output (wo) and MLP down projection (w2), which are zeroed: with pre-norm residual blocks
    such a layer is the identity, so the deeper model computes the smaller model's function."""
    from export import load_safetensors
    sd, meta = load_safetensors(path)
    own = model.state_dict()
    n_src = 1 + max(int(k.split(".")[1]) for k in sd if k.startswith("layers."))
    if not mapping:
        mapping = {i: i for i in range(n_src - 1)}
        mapping[n_src - 1] = model.c.n_layers - 1
    new = {}
    for k, v in sd.items():
        if k.startswith("layers."):
            parts = k.split(".")
            if int(parts[1]) not in mapping:
                continue
            k = ".".join(["layers", str(mapping[int(parts[1])])] + parts[2:])
        assert own[k].shape == v.shape, (k, own[k].shape, v.shape)
        new[k] = v
    filled = set(mapping.values())
    for l in range(model.c.n_layers):
        if l not in filled:
            new["layers.%d.attention.wo.weight" % l] = torch.zeros_like(own["layers.%d.attention.wo.weight" % l])
            new["layers.%d.feed_forward.w2.weight" % l] = torch.zeros_like(own["layers.%d.feed_forward.w2.weight" % l])
    missing, unexpected = model.load_state_dict(new, strict=False)
    assert not unexpected, unexpected
    print("warm start from", path, "layers", mapping, "random (zero wo/w2):",
          [l for l in range(model.c.n_layers) if l not in filled], flush=True)


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


def attn_sup_loss(model, ids, src, ret_layer=-1):
    """Attention supervision (training aid, see TRAINING.md). Layer 0: query head 0
    attends to the previous token, head 4 to the token two back, head 1 (at answer
    positions) to the last token of the question being answered. Layer 1: query head 0
    of every KV group (heads 0 and 4) attends, at every target position, to the context
    token being copied. src = [2, B, T]: copy source and question-end position."""
    B, T = ids.shape
    p0 = model.layers[0].probs                  # [B,H,T,T]
    p1 = model.layers[ret_layer].probs           # the 2-layer model: layer 1
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


def loss_fn(model, ids, mask, src, w_sup, ret_layer=-1):
    model.layers[0].keep_probs = w_sup > 0
    model.layers[ret_layer].keep_probs = w_sup > 0
    h = model.hidden(ids)                       # [B,T,d]
    tgt = torch.roll(ids, -1, dims=1)
    hs = h[mask]                                # only answer-predicting positions
    logits = model.output(hs)
    y = tgt[mask]
    loss = F.cross_entropy(logits, y)
    acc = (logits.argmax(-1) == y).float().mean()
    l_sup = l_ret = torch.zeros(())
    if w_sup > 0:
        l_sup, l_ret = attn_sup_loss(model, ids, src, ret_layer)
        for layer in model.layers:
            layer.keep_probs, layer.probs = False, None
    return loss, acc, l_sup, l_ret


@torch.no_grad()
def quick_eval(model, seed, ctx_len, n=16, task_list=tasks.TASKS):
    """Teacher-forced exact match (== greedy exact match) on n fresh prompts per task
    (long-answer tasks: at >= 256 tokens of context, plus their per-token accuracy)."""
    rng = np.random.RandomState(seed)
    res = {}
    model.eval()
    for t in task_list:
        if t in tasks.LONG_TASKS:
            ok = tok = ntok = 0
            for _ in range(n):
                p, a = tasks.make_prompt(rng, t, max(ctx_len, 256), **tasks.LONG_EVAL_TASKS[t])
                pred = model(torch.tensor([p + a[:-1]]))[0, len(p) - 1:].argmax(-1).tolist()
                ok += int(pred == a)
                tok += sum(int(x == y) for x, y in zip(pred, a))
                ntok += len(a)
            res[t] = ok / n
            res[t + "_tok"] = round(tok / ntok, 3)
            continue
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
    ap.add_argument("--ckpt", default="", help="also save a torch checkpoint here (at phase ends, and every "
                                               "--ckpt_every steps)")
    ap.add_argument("--init", default="", help="start from this torch checkpoint (weights only)")
    ap.add_argument("--warm_from", default="",
                    help="start from a smaller model's safetensors: its layers go to --warm_map positions, the "
                         "other layers get zero output projections (wo, w2) so the deeper model starts as it")
    ap.add_argument("--warm_map", default="",
                    help="src:dst layer pairs, e.g. 0:0,1:3 (default: first to first, the rest to the last ones)")
    ap.add_argument("--sup_ret_layer", type=int, default=-1,
                    help="layer whose retrieval heads get the copy-source supervision (default: the last)")
    ap.add_argument("--attn_sup_hold", type=float, default=1.0,
                    help="fraction of the schedule at the full --attn_sup weight; then linear decay ...")
    ap.add_argument("--attn_sup_zero", type=float, default=1.0,
                    help="... reaching 0 at this fraction of the schedule, 0 after it (default 1.0/1.0: no anneal)")
    ap.add_argument("--ckpt_every", type=int, default=0,
                    help="also write the full checkpoint (--ckpt) and export --out every N steps")
    ap.add_argument("--resume", default="", help="continue a --ckpt checkpoint's schedule exactly (its arguments "
                                                 "win over the command line except for RUNTIME_ARGS given there)")
    ap.add_argument("--stop_at", type=int, default=0, help="stop at this step (checkpoint written), 0: at the end")
    args = ap.parse_args()
    ck = None
    argv_hist = [" ".join(sys.argv)]      # every command of a resumed schedule, the first first
    if args.resume:
        ck = torch.load(args.resume)
        given = vars(args)
        explicit = {x[2:].split("=")[0] for x in sys.argv[1:] if x.startswith("--")}
        for k, v in ck["args"].items():
            # schedule arguments always from the checkpoint; runtime ones (paths, logging,
            # threads) from the command line where given there, else from the checkpoint too
            if k in ("resume", "stop_at") or (k in RUNTIME_ARGS and k in explicit):
                continue
            if given.get(k) != v:
                setattr(args, k, v)
        argv_hist = ck.get("argv", []) + argv_hist
        print("resume", args.resume, "at step", ck["step"], flush=True)

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
    if args.warm_from and not ck:
        warm_start(model, args.warm_from,
                   {int(a): int(b) for a, b in (p.split(":") for p in args.warm_map.split(","))} if args.warm_map else {})
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
        if len(f) < 4:
            mix = task_probs
        else:
            w = f[3].split("/")
            mix = {t: float(x) for t, x in zip(tasks.TASKS if len(w) == 4 else tasks.ALL_TASKS, w)}
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

    def sup_at(step):
        """Attention-supervision weight: --attn_sup until attn_sup_hold of the schedule, then a
        linear decay to 0 at attn_sup_zero, 0 after (the defaults keep it constant)."""
        f, h, z = step / max(1, total), args.attn_sup_hold, args.attn_sup_zero
        if f < h:
            return args.attn_sup
        if f >= z:
            return 0.0
        return args.attn_sup * (z - f) / (z - h)

    def save_state(step):
        if not args.ckpt:
            return
        atomic_save({"model": model.state_dict(), "config": cfg.to_dict(), "step": step,
                     "opt": opt.state_dict(), "np_rng": rng.get_state(), "torch_rng": torch.get_rng_state(),
                     "args": {k: v for k, v in vars(args).items()}, "total": total, "argv": argv_hist,
                     "wall": wall0 + time.time() - t_start}, args.ckpt)
        if args.ckpt_every and args.out:
            tmp = args.out + ".tmp"
            save_safetensors(model, tmp, meta={"seed": str(args.seed), "argv": " ; ".join(argv_hist),
                                                "config": json.dumps(cfg.to_dict()), "step": str(step)})
            os.replace(tmp, args.out)

    step, wall0 = 0, 0.0
    if ck:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["opt"])
        rng.set_state(ck["np_rng"])
        torch.set_rng_state(ck["torch_rng"])
        step, wall0 = ck["step"], ck.get("wall", 0.0)
        assert ck["total"] == total
        del ck
    t_start = time.time()
    stop = args.stop_at or sum(p[2] for p in phases)
    ph_end = 0
    for pi, (ctx_len, batch, nsteps, mix) in enumerate(phases):
        ph_start, ph_end = ph_end, ph_end + nsteps
        if step >= ph_end or step >= stop:
            continue
        run_loss = run_acc = run_sup = run_ret = 0.0
        nrun = 0
        t_ph = time.time()
        while step < ph_end and step < stop:
            for g in opt.param_groups:
                g["lr"] = lr_at(step)
            w_sup = sup_at(step)
            ids, mask, src = make_batch(rng, mix, ctx_len, batch)
            loss, acc, l_sup, l_ret = loss_fn(model, ids, mask, src, w_sup, args.sup_ret_layer)
            opt.zero_grad(set_to_none=True)
            (loss + w_sup * l_sup).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip)
            opt.step()
            step += 1
            run_loss += loss.item()
            run_acc += acc.item()
            run_sup += l_sup.item()
            run_ret += l_ret.item()
            nrun += 1
            if step % args.log_every == 0:
                el = wall0 + time.time() - t_start
                print("step %5d ctx %4d loss %.4f acc %.3f sup %.3f (ret %.3f) w_sup %.2f lr %.2e  %.3fs/step  "
                      "elapsed %.0fs" % (
                          step, ctx_len, run_loss / nrun, run_acc / nrun, run_sup / nrun, run_ret / nrun, w_sup,
                          lr_at(step - 1), (time.time() - t_ph) / max(1, nrun), el), flush=True)
                run_loss = run_acc = run_sup = run_ret = 0.0
                nrun = 0
                t_ph = time.time()
            if step == ph_end:
                ev = quick_eval(model, 999 + pi, min(ctx_len, 1024),
                                task_list=[t for t in tasks.ALL_TASKS if t in mix and mix[t] > 0])
                print("phase %d done (ctx %d) step %d elapsed %.0fs quick_eval %s" % (
                    pi, ctx_len, step, wall0 + time.time() - t_start, json.dumps(ev)), flush=True)
                save_state(step)
            elif step == stop or (args.ckpt_every and step % args.ckpt_every == 0):
                save_state(step)
                print("checkpoint step %d -> %s" % (step, args.ckpt), flush=True)
    print("training wall time %.0fs (this run %.0fs), step %d of %d" % (
        wall0 + time.time() - t_start, time.time() - t_start, step, total), flush=True)
    if args.out and step == sum(p[2] for p in phases):
        save_safetensors(model, args.out, meta={"seed": str(args.seed), "argv": " ; ".join(argv_hist),
                                                "config": json.dumps(cfg.to_dict())})
        print("wrote", args.out, flush=True)


if __name__ == "__main__":
    main()
