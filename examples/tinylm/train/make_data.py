"""Write the held-out evaluation prompts and the reference logits.

    /usr/bin/python3 examples/tinylm/train/make_data.py            # both files
    /usr/bin/python3 examples/tinylm/train/make_data.py --prompts  # only eval_prompts.txt
    /usr/bin/python3 examples/tinylm/train/make_data.py --long     # only eval_prompts_long.txt
    /usr/bin/python3 examples/tinylm/train/make_data.py --long-q2  # only eval_prompts_long_q2.txt
    /usr/bin/python3 examples/tinylm/train/make_data.py --fid2     # only eval_prompts_fid2.txt

data/eval_prompts.txt  (seed 20240, 100 prompts per task, context 1024 tokens)
    one prompt per line:  TASK|PROMPT_IDS|ANSWER_IDS   (ids separated by single spaces)
    lines starting with '#' are comments.
data/eval_prompts_long.txt  (seed 20241, 100 prompts per long-answer task, context 1024 tokens)
    the same format for tasks.LONG_TASKS at tasks.LONG_EVAL_TASKS (the 4-layer model's tasks;
    the long-generation fidelity bench, `kvevict_tinylm --long-generation`, reads longchain)
data/eval_prompts_long_q2.txt  (seed 20241: the prompts of eval_prompts_long.txt, line for line)
    TASK|PROMPT_IDS|ANSWER_IDS|QUESTION2_IDS|ANSWER2_IDS: the first three fields are those of
    eval_prompts_long.txt (the same random stream: the prompt's other needle group is the second
    question); the last two are a second question on the same context and its answer (another
    key / needle / chain of the same task), empty for listall (its one question asks for every
    needle). The Fidelity-2 bench (`kvevict_tinylm --fidelity2`) reads this file; its setting S3
    asks the second question after the first answer.
data/eval_prompts_fid2.txt  (seed 20242, 150 more prompts per long-answer task, same format as
    eval_prompts_long_q2.txt: held-out prompts for the Fidelity-2 bench beyond the first 100)
data/reference_logits.txt  (3 short prompts, float32 logits of the committed weights)
    see MODEL.md, "Reference logits". The 4-layer model's:
    /usr/bin/python3 examples/tinylm/train/make_data.py --weights examples/tinylm/weights/tinylm4.safetensors \
        --reference examples/tinylm/data/reference_logits4.txt
"""
import argparse
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import tasks  # noqa: E402
from export import load_model  # noqa: E402

ROOT = os.path.normpath(os.path.join(HERE, ".."))
EVAL_SEED = 20240
LONG_EVAL_SEED = 20241
FID2_SEED = 20242
N_PER_TASK = 100
N_FID2_PER_TASK = 150
CTX_LEN = 1024
REF_SEED = 777


def write_prompts(path, seed=EVAL_SEED, n=N_PER_TASK, ctx_len=CTX_LEN):
    rng = np.random.RandomState(seed)
    with open(path, "w") as f:
        f.write("# tinylm held-out prompts: seed %d, %d per task, context %d tokens "
                "(prompt = BOS + context + question); format TASK|PROMPT_IDS|ANSWER_IDS\n"
                % (seed, n, ctx_len))
        for t in tasks.TASKS:
            for _ in range(n):
                p, a = tasks.make_prompt(rng, t, ctx_len, **tasks.EVAL_TASKS[t])
                f.write("%s|%s|%s\n" % (t, " ".join(map(str, p)), " ".join(map(str, a))))


def write_long_prompts(path, seed=LONG_EVAL_SEED, n=N_PER_TASK, ctx_len=CTX_LEN):
    """The long-answer tasks' held-out prompts (tasks.LONG_EVAL_TASKS), same format."""
    rng = np.random.RandomState(seed)
    with open(path, "w") as f:
        f.write("# tinylm held-out long-answer prompts: seed %d, %d per task, context %d tokens "
                "(prompt = BOS + context + question); format TASK|PROMPT_IDS|ANSWER_IDS\n"
                % (seed, n, ctx_len))
        for t in tasks.LONG_TASKS:
            for _ in range(n):
                p, a = tasks.make_prompt(rng, t, ctx_len, **tasks.LONG_EVAL_TASKS[t])
                f.write("%s|%s|%s\n" % (t, " ".join(map(str, p)), " ".join(map(str, a))))


def write_two_question_prompts(path, seed=LONG_EVAL_SEED, n=N_PER_TASK, ctx_len=CTX_LEN):
    """The long-answer tasks' prompts with a second question on the same context:
    TASK|PROMPT_IDS|ANSWER_IDS|QUESTION2_IDS|ANSWER2_IDS. make_example with every question
    (n_questions=None) draws exactly what make_prompt draws (the question list is cut after the
    draws), so with the same seed the first three fields equal write_long_prompts' lines."""
    rng = np.random.RandomState(seed)
    with open(path, "w") as f:
        f.write("# tinylm held-out long-answer prompts with a second question: seed %d, %d per task, context %d "
                "tokens (prompt = BOS + context + question); format TASK|PROMPT_IDS|ANSWER_IDS|QUESTION2_IDS|"
                "ANSWER2_IDS (the last two empty where the task has one question)\n" % (seed, n, ctx_len))
        for t in tasks.LONG_TASKS:
            for _ in range(n):
                context, qa = tasks.make_example(rng, t, ctx_len, n_questions=None, **tasks.LONG_EVAL_TASKS[t])
                (q1, a1), rest = qa[0], qa[1:]
                q2, a2 = rest[0] if rest else ([], [])
                f.write("%s|%s|%s|%s|%s\n" % (t, " ".join(map(str, [tasks.BOS] + context + q1)), " ".join(map(str, a1)),
                                             " ".join(map(str, q2)), " ".join(map(str, a2))))


def read_prompts(path):
    out = []
    with open(path) as f:
        for line in f:
            if line.startswith("#") or not line.strip():
                continue
            t, p, a = line.strip().split("|")[:3]   # (two-question files: QUESTION2|ANSWER2 follow)
            out.append((t, [int(x) for x in p.split()], [int(x) for x in a.split()]))
    return out


def reference_prompts():
    rng = np.random.RandomState(REF_SEED)
    return [
        tasks.make_prompt(rng, "single", 24),
        tasks.make_prompt(rng, "multikey", 48, n_needles=3),
        tasks.make_prompt(rng, "vartrack", 64, n_chains=2, n_hops=3),
    ]


def write_reference(path, weights):
    model, _ = load_model(weights)
    with open(path, "w") as f:
        f.write("# tinylm reference logits (float32, model %s)\n" % os.path.basename(weights))
        f.write("# per prompt: 'P T id_0 .. id_{T-1}', then 'A n ans_0 .. ans_{n-1}', then T lines of "
                "%d logits (row t = logits after reading ids[0..t])\n" % tasks.VOCAB_SIZE)
        for p, a in reference_prompts():
            with torch.no_grad():
                lg = model(torch.tensor([p]))[0].float().numpy()
            f.write("P %d %s\n" % (len(p), " ".join(map(str, p))))
            f.write("A %d %s\n" % (len(a), " ".join(map(str, a))))
            for row in lg:
                f.write(" ".join("%.8g" % x for x in row) + "\n")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", action="store_true", help="only write eval_prompts.txt")
    ap.add_argument("--long", action="store_true", help="only write eval_prompts_long.txt")
    ap.add_argument("--long-q2", action="store_true",
                    help="only write eval_prompts_long_q2.txt (the same prompts with a second question)")
    ap.add_argument("--fid2", action="store_true",
                    help="only write eval_prompts_fid2.txt (%d more two-question prompts per task, seed %d)"
                    % (N_FID2_PER_TASK, FID2_SEED))
    ap.add_argument("--weights", default=os.path.join(ROOT, "weights", "tinylm.safetensors"))
    ap.add_argument("--reference", default=os.path.join(ROOT, "data", "reference_logits.txt"),
                    help="where the reference logits go (data/reference_logits4.txt for tinylm4)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    os.makedirs(os.path.join(ROOT, "data"), exist_ok=True)
    if args.long_q2:
        write_two_question_prompts(os.path.join(ROOT, "data", "eval_prompts_long_q2.txt"))
        return
    if args.fid2:
        write_two_question_prompts(os.path.join(ROOT, "data", "eval_prompts_fid2.txt"), seed=FID2_SEED,
                                   n=N_FID2_PER_TASK)
        return
    if args.long:
        write_long_prompts(os.path.join(ROOT, "data", "eval_prompts_long.txt"))
        return
    write_prompts(os.path.join(ROOT, "data", "eval_prompts.txt"))
    if not args.prompts:
        write_reference(args.reference, args.weights)


if __name__ == "__main__":
    main()
