"""Synthetic long-context tasks for TinyLM (see ../MODEL.md, section "Tasks").

Every prompt is  BOS <context> <question>  and the answer is a list of tokens that
the model must produce by greedy decoding right after the last prompt token.
The question is always at the END of the prompt.

Vocabulary (256 ids):
    0 PAD   1 BOS   2 [N] (needle)   3 [Q] (question, single/multi-key)
    4 [QM] (question, multi-value)   5 [VAR]   6 ->   7 [TRK] (question, var. tracking)
    8..11  ordinals #1..#4 (multi-value)   12..15 unused
    12 [ALL] (question, list every needle value; long-answer tasks only)   13..15 unused
    16..127  filler words (112)
    128..191 key words (64), also variable names in variable tracking
    192..255 value words (64), also the tracked values in variable tracking
Inside one prompt all key words are distinct and all value words are distinct.

Tasks (eval settings in EVAL_TASKS):
    single     : 1 needle    "[N] k1 k2 v1 v2 v3"       question "[Q] k1 k2"   answer "v1 v2 v3"
    multikey   : n needles of the same form (distinct keys); one of them is asked
    multivalue : m keys, each with `nv` needles "[N] k1 k2 #j a_j b_j" (j=1..nv, shuffled
                 positions); question "[QM] k1 k2"; answer "#1 a_1 b_1 #2 a_2 b_2 ... "
    vartrack   : c chains "[VAR] V -> X1", "[VAR] X1 -> X2", ..., "[VAR] X(h-1) -> Xh"
                 ("src -> dst": dst takes the value of src)
                 (statements of a chain appear in chain order; chains interleaved);
                 question "[TRK] V"; answer "X1 X2 ... Xh"
Long-answer tasks (RULER-style, Fidelity 2; used by the 4-layer model, see LONG_TASKS and
LONG_EVAL_TASKS; the four tasks above are generated exactly as before):
    longneedle : n needles "[N] k1 k2 v1 .. vL" (L >= 16 at eval), distinct keys; one is asked
                 with "[Q] k1 k2"; answer "v1 .. vL"
    gather     : m keys, each with `nn` needles "[N] k1 k2 #j v1 .. vk" (needles of all keys
                 shuffled; #j = the needle's rank among its key's needles in CONTEXT order);
                 question "[QM] k1 k2"; answer "#1 v.. #2 v.. .." = that key's needles in
                 context order (nn * (k + 1) >= 16 at eval)
    longchain  : the vartrack generator with long chains (12-16 hops) and a distractor chain
    listall    : n <= 7 needles "[N] #j k1 k2 v1 v2 v3" with distinct keys, #j = the needle's
                 rank in context order; question "[ALL] [ALL]"; answer "#1 v v v #2 v v v .."
                 = every needle's values in context order (4n tokens)
The ordinals of gather and listall (version 2 of these tasks) are what makes "in context
order" learnable at this size: without them the 4-layer model reached 0% exact match
(teacher-forced per-token accuracy 0.80 and 0.73) after 5000 steps (TRAINING.md).
Filler is i.i.d. uniform over the filler words; needles are put at uniformly random
depths of the context.
"""
import numpy as np

PAD, BOS, NDL, Q, QM, VAR, ARROW, TRK = 0, 1, 2, 3, 4, 5, 6, 7
ORD0 = 8                     # #1 = 8 ... #4 = 11
MAX_ORD = 4
ALL = 12                     # [ALL]: "list every needle value in order" (listall only)
ORDINALS = (8, 9, 10, 11, 13, 14, 15)   # #1 .. #7 (gather and listall; 12 is [ALL])
FILLER = np.arange(16, 128)
KEYS = np.arange(128, 192)
VALUES = np.arange(192, 256)
VOCAB_SIZE = 256

TASKS = ("single", "multikey", "multivalue", "vartrack")

# settings for the held-out evaluation prompts
EVAL_TASKS = {
    "single": dict(),
    "multikey": dict(n_needles=6),
    "multivalue": dict(n_keys=2, n_values=3),
    "vartrack": dict(n_chains=2, n_hops=4),
}


# long-answer tasks (Fidelity 2) and their held-out settings: every answer is >= 16 tokens
LONG_TASKS = ("longneedle", "gather", "longchain", "listall")
LONG_EVAL_TASKS = {
    "longneedle": dict(n_needles=2, val_len=16),
    "gather": dict(n_keys=2, n_needles=4, val_len=4),
    "longchain": dict(n_chains=2, n_hops=16),
    "listall": dict(n_needles=6),
}
ALL_TASKS = TASKS + LONG_TASKS


def eval_kw(task):
    """Held-out settings of any task (the four original ones or the long-answer ones)."""
    return dict(EVAL_TASKS[task] if task in EVAL_TASKS else LONG_EVAL_TASKS[task])


def token_name(t):
    names = {PAD: "<pad>", BOS: "<bos>", NDL: "[N]", Q: "[Q]", QM: "[QM]", VAR: "[VAR]", ARROW: "->", TRK: "[TRK]",
             ALL: "[ALL]"}
    if t in names:
        return names[t]
    if t in ORDINALS:
        return "#%d" % (ORDINALS.index(t) + 1)
    if 16 <= t < 128:
        return "f%d" % (t - 16)
    if 128 <= t < 192:
        return "K%d" % (t - 128)
    if 192 <= t < 256:
        return "V%d" % (t - 192)
    return "<unused%d>" % t


def _place(rng, needles, ctx_len, keep_order_groups=None):
    """Insert needles (list of token lists, in the order given) into filler so that the
    context has exactly ctx_len tokens; needle i goes to a uniformly random depth, the
    given order is kept."""
    n_tok = sum(len(n) for n in needles)
    n_fill = ctx_len - n_tok
    assert n_fill >= 0, "context too short for the needles"
    filler = rng.choice(FILLER, size=n_fill)
    cuts = np.sort(rng.randint(0, n_fill + 1, size=len(needles)))
    out, prev = [], 0
    for c, nd in zip(cuts, needles):
        out.extend(filler[prev:c].tolist())
        out.extend(nd)
        prev = c
    out.extend(filler[prev:].tolist())
    return out


def _kv_needles(rng, n, key_len=2, val_len=3):
    toks_k = rng.choice(KEYS, size=n * key_len, replace=False).reshape(n, key_len)
    toks_v = rng.choice(VALUES, size=n * val_len, replace=False).reshape(n, val_len)
    return [(k.tolist(), v.tolist()) for k, v in zip(toks_k, toks_v)]


def make_example(rng, task, ctx_len, n_questions=1, **kw):
    """Returns (context, qa) where context is the token list after BOS and qa is a list of
    (question_tokens, answer_tokens). A prompt is [BOS] + context + qa[0][0], answer qa[0][1].
    With n_questions > 1 (training) several questions follow each other:
    context, q1, a1, q2, a2, ...  (n_questions=None: ask about every needle group)."""
    if task in ("single", "multikey"):
        n = 1 if task == "single" else kw.get("n_needles", 6)
        kvs = _kv_needles(rng, n)
        needles = [[NDL] + k + v for k, v in kvs]
        qa = [([Q] + k, v) for k, v in kvs]
    elif task == "multivalue":
        m, nv = kw.get("n_keys", 2), kw.get("n_values", 3)
        keys = rng.choice(KEYS, size=m * 2, replace=False).reshape(m, 2).tolist()
        vals = rng.choice(VALUES, size=m * nv * 2, replace=False).reshape(m, nv, 2).tolist()
        needles, qa = [], []
        for i in range(m):
            ans = []
            for j in range(nv):
                needles.append([NDL] + keys[i] + [ORD0 + j] + vals[i][j])
                ans += [ORD0 + j] + vals[i][j]
            qa.append(([QM] + keys[i], ans))
        rng.shuffle(needles)
    elif task == "longneedle":
        n, L = kw.get("n_needles", 2), kw.get("val_len", 16)
        kvs = _kv_needles(rng, n, val_len=L)
        needles = [[NDL] + k + v for k, v in kvs]
        qa = [([Q] + k, v) for k, v in kvs]
    elif task == "gather":
        m, nn_, vl = kw.get("n_keys", 2), kw.get("n_needles", 4), kw.get("val_len", 4)
        keys = rng.choice(KEYS, size=m * 2, replace=False).reshape(m, 2).tolist()
        vals = rng.choice(VALUES, size=m * nn_ * vl, replace=False).reshape(m, nn_, vl).tolist()
        groups = [i for i in range(m) for _ in range(nn_)]
        groups = [groups[i] for i in rng.permutation(len(groups))]   # the context order of the needles
        rank, needles = [0] * m, []
        for g in groups:
            needles.append([NDL] + keys[g] + [ORDINALS[rank[g]]] + vals[g][rank[g]])
            rank[g] += 1
        qa = [([QM] + keys[i], [t for j in range(nn_) for t in [ORDINALS[j]] + vals[i][j]]) for i in range(m)]
    elif task == "listall":
        n = kw.get("n_needles", 6)
        assert n <= len(ORDINALS)
        kvs = _kv_needles(rng, n)
        needles = [[NDL, ORDINALS[j]] + k + v for j, (k, v) in enumerate(kvs)]   # placed in this order
        qa = [([ALL, ALL], [t for j, (_, v) in enumerate(kvs) for t in [ORDINALS[j]] + v])]
    elif task in ("vartrack", "longchain"):
        c, h = kw.get("n_chains", 2), kw.get("n_hops", 4)
        names = rng.choice(KEYS, size=c * h, replace=False).reshape(c, h).tolist()
        vals = rng.choice(VALUES, size=c, replace=False).tolist()
        chains = []
        qa = []
        for i in range(c):
            st = [[VAR, vals[i], ARROW, names[i][0]]]
            for j in range(1, h):
                st.append([VAR, names[i][j - 1], ARROW, names[i][j]])
            chains.append(st)
            qa.append(([TRK, vals[i]], list(names[i])))
        # random interleaving that keeps each chain's order
        order = np.concatenate([[i] * h for i in range(c)])
        rng.shuffle(order)
        ptr = [0] * c
        needles = []
        for i in order:
            needles.append(chains[i][ptr[i]])
            ptr[i] += 1
    else:
        raise ValueError(task)
    context = _place(rng, needles, ctx_len)
    perm = rng.permutation(len(qa))
    qa = [qa[i] for i in perm]
    if n_questions is not None:
        qa = qa[:n_questions]
    return context, qa


def make_prompt(rng, task, ctx_len, **kw):
    """Held-out style prompt: (prompt_ids, answer_ids); prompt length = 1 + ctx_len + len(question)."""
    context, qa = make_example(rng, task, ctx_len, n_questions=1, **kw)
    qtok, ans = qa[0]
    return [BOS] + context + qtok, ans


def copy_source(ids, ctx_end, task, qtok, y):
    """Context position (< ctx_end) holding the token that answer token y copies:
    the token y itself inside the relevant needle. Used only to supervise one
    retrieval head during training (see train.py)."""
    cand = [p for p in range(1, ctx_end) if ids[p] == y]
    if task in ("vartrack", "longchain"):
        cand = [p for p in cand if ids[p - 1] == ARROW]
    elif task == "multivalue" and ORD0 <= y < ORD0 + MAX_ORD:
        cand = [p for p in cand if ids[p - 1] == qtok[-1]]
    return cand[0] if len(cand) == 1 else -1   # ambiguous (k2 of a multivalue key): none


def make_train_sequence(rng, task, ctx_len, aux=True, **kw):
    """Training sequence: BOS context q1 a1 q2 a2 ... with every needle group asked once.
    Returns (ids, loss_mask, src, qsrc):
      loss_mask[t] = 1 if ids[t+1] is a target: every answer token and, with aux=True,
        the second key word of a question (k2 of "[Q] k1 k2"), which is predictable
        from k1 by the same copy mechanism;
      src[t]  = context position of the token that target ids[t+1] copies (-1 elsewhere
        or if ambiguous);
      qsrc[t] = position of the last token of the current question, for targets in the
        answer part (-1 elsewhere).
    src/qsrc are only used for the attention supervision in train.py."""
    context, qa = make_example(rng, task, ctx_len, n_questions=None, **kw)
    ids = [BOS] + context
    ctx_end = len(ids)
    tgt = [0] * len(ids)
    qend = [-1] * len(ids)       # for answer tokens: position of the question's last token
    for qtok, ans in qa:
        ids += qtok
        tgt += [0, 0] + [1 if aux else 0] * (len(qtok) - 2)   # every question has >= 2 tokens
        qend += [-1] * len(qtok)
        last = len(ids) - 1
        ids += ans
        tgt += [1] * len(ans)
        qend += [last] * len(ans)
    # mask[t] marks positions whose NEXT token is a target
    mask = tgt[1:] + [0]
    src = [-1] * len(ids)
    qsrc = qend[1:] + [-1]
    for t in range(len(ids) - 1):
        if mask[t]:
            if qsrc[t] >= 0:
                qk = ids[qsrc[t] - 2:qsrc[t] + 1]
            else:   # aux target inside a question: only the k2 of a (unambiguous) key
                qk = ids[t - 1:t + 1]
            src[t] = copy_source(ids, ctx_end, task, qk, ids[t + 1])
    return ids, mask, src, qsrc


def sample_train_kw(rng, task, ctx_len, fill=0.8):
    """Random difficulty for a training sequence (number of needles etc.), limited so the
    needles take at most `fill` of the context."""
    budget = int(fill * ctx_len)
    if task == "single":
        return {}
    if task == "multikey":
        hi = max(2, min(16, budget // 6))
        return dict(n_needles=rng.randint(2, hi + 1))
    if task == "multivalue":
        m = rng.randint(1, 4)
        nv = rng.randint(2, MAX_ORD + 1)
        while m * nv * 6 > budget and m > 1:
            m -= 1
        while m * nv * 6 > budget and nv > 1:
            nv -= 1
        return dict(n_keys=m, n_values=nv)
    if task == "longneedle":
        n = rng.randint(1, 4)
        L = rng.randint(8, 25)
        while n * (L + 3) > budget and n > 1:
            n -= 1
        while (n * (L + 3) > budget or n * L > len(VALUES)) and L > 3:
            L -= 1
        while n * L > len(VALUES):
            n -= 1
        return dict(n_needles=n, val_len=L)
    if task == "gather":
        m = rng.randint(1, 4)
        nn_ = rng.randint(2, 5)          # ranks #1 .. #4
        vl = rng.randint(2, 7)
        while (m * nn_ * (vl + 4) > budget or m * nn_ * vl > len(VALUES)) and m > 1:
            m -= 1
        while (m * nn_ * (vl + 4) > budget or m * nn_ * vl > len(VALUES)) and vl > 1:
            vl -= 1
        while (m * nn_ * (vl + 4) > budget or m * nn_ * vl > len(VALUES)) and nn_ > 2:
            nn_ -= 1
        return dict(n_keys=m, n_needles=nn_, val_len=vl)
    if task == "longchain":
        c = rng.randint(2, 4)           # the asked chain and 1-2 distractor chains
        h = rng.randint(8, 17)
        while c * h * 4 > budget and c > 2:
            c -= 1
        while c * h * 4 > budget and h > 2:
            h -= 1
        return dict(n_chains=c, n_hops=h)
    if task == "listall":
        hi = max(2, min(len(ORDINALS), budget // 7))
        return dict(n_needles=rng.randint(2, hi + 1))
    if task == "vartrack":
        c = rng.randint(1, 4)
        h = rng.randint(2, 6)
        while c * h * 4 > budget and c > 1:
            c -= 1
        while c * h * 4 > budget and h > 1:
            h -= 1
        return dict(n_chains=c, n_hops=h)
    raise ValueError(task)


if __name__ == "__main__":
    import sys
    rng = np.random.RandomState(0)
    if "--long" in sys.argv:
        for t in LONG_TASKS:
            p, a = make_prompt(rng, t, 160, **LONG_EVAL_TASKS[t])
            print(t, " ".join(token_name(x) for x in p), "->", " ".join(token_name(x) for x in a))
            ids, m, src, qsrc = make_train_sequence(rng, t, 128, **sample_train_kw(rng, t, 128))
            print("  train:", " ".join(token_name(x) + ("*%d/%d" % (sr, q) if mm else "")
                                       for x, mm, sr, q in zip(ids, m, src, qsrc)))
        sys.exit(0)
    for t in TASKS:
        p, a = make_prompt(rng, t, 48, **EVAL_TASKS[t]) if t != "multikey" else make_prompt(rng, t, 48, n_needles=3)
        print(t, " ".join(token_name(x) for x in p), "->", " ".join(token_name(x) for x in a))
        ids, m, src, qsrc = make_train_sequence(rng, t, 64, **sample_train_kw(rng, t, 64))
        print("  train:", " ".join(token_name(x) + ("*%d/%d" % (sr, q) if mm else "") for x, mm, sr, q in zip(ids, m, src, qsrc)))
