#!/usr/bin/env python3
"""The PyTorch side of kvevict_bench_vs_torch.

Times the SnapKV pipeline kvpress users run today (SnapKVPress.compute_window_attention plus
ScorerPress.compress): repeat_kv, matmul, the causal mask built as ones_like * -inf then triu,
softmax in float32 cast back to the model dtype, window mean, avg_pool1d (k = 5, padding
counted), GQA mean, window padded with the max score, topk, gather of K and V. Same shape,
same data as kvevict, one thread (torch.set_num_threads(1); the driver also sets
OMP/MKL/OPENBLAS_NUM_THREADS=1), median process CPU time over repetitions after a warm-up.

CPU PyTorch has no float16 matmul, so for fp16 caches the pipeline computes in float32 (the
inputs upcast); bf16 and f32 run in their own dtype, as kvpress does.

It then checks kvevict's keep-lists against the same pipeline evaluated in float32 (what
kvevict computes: fp32 arithmetic on the stored values): per KV head the kept sets must be
identical except for swaps between tokens whose reference scores are within 1e-4 (relative)
of the B-th score. It also reports how many of kvevict's tokens the native-dtype pipeline
keeps too (kvpress rounds attention to bf16, which moves the selection by itself).

Usage: torch_pipeline.py --case DIR [--quick]   (DIR holds meta.txt, q/k/v/keep/scores.bin)
Writes DIR/result.txt ("key value" lines). Exit 77 when torch is not importable.
"""
import argparse
import math
import sys
import time

try:
    import numpy as np
    import torch
    import torch.nn.functional as F
except ImportError as e:  # noqa: F841
    print("SKIPPED: PyTorch is not importable by", sys.executable,
          "(Debian's python3-torch imports only in /usr/bin/python3)")
    sys.exit(77)


def load_case(d):
    meta = dict(line.split() for line in open(f"{d}/meta.txt"))
    hq, hkv, dim, L = (int(meta[k]) for k in ("hq", "hkv", "d", "tokens"))
    w, b = int(meta["window"]), int(meta["budget"])
    dtype = meta["dtype"]

    def raw(name, shape):
        if dtype == "bf16":  # numpy has no bfloat16: reinterpret the 16-bit patterns
            return torch.from_numpy(np.fromfile(f"{d}/{name}", dtype=np.int16)).view(torch.bfloat16).reshape(shape)
        np_type = np.float16 if dtype == "fp16" else np.float32
        return torch.from_numpy(np.fromfile(f"{d}/{name}", dtype=np_type)).reshape(shape)

    q = raw("q.bin", (1, hq, w, dim))
    k = raw("k.bin", (1, hkv, L, dim))
    v = raw("v.bin", (1, hkv, L, dim))
    keep = torch.from_numpy(np.fromfile(f"{d}/keep.bin", dtype=np.int64)).reshape(hkv, b)
    scores = torch.from_numpy(np.fromfile(f"{d}/scores.bin", dtype=np.float32)).reshape(hkv, L)
    return dict(dtype=dtype, hq=hq, hkv=hkv, d=dim, L=L, w=w, b=b, q=q, k=k, v=v, keep=keep, scores=scores)


def repeat_kv(x, n_rep):
    """transformers' repeat_kv: [b, hkv, L, d] -> [b, hkv * n_rep, L, d] (a copy)."""
    b, hkv, L, d = x.shape
    return x[:, :, None, :, :].expand(b, hkv, n_rep, L, d).reshape(b, hkv * n_rep, L, d)


def kvpress_snapkv(q, k, v, window, budget, kernel_size=5, compute_dtype=None):
    """kvpress SnapKVPress (window_size = W, kernel_size = 5) + ScorerPress.compress with
    n_kept = budget. Returns scores [1, Hkv, L], kept indices, compressed K and V."""
    bsz, hkv, L, d = k.shape
    groups = q.shape[1] // hkv
    qc = q if compute_dtype is None else q.to(compute_dtype)
    kc = k if compute_dtype is None else k.to(compute_dtype)
    key_states = repeat_kv(kc, groups)
    attn = torch.matmul(qc, key_states.transpose(2, 3)) / math.sqrt(d)
    mask = torch.ones_like(attn) * float("-inf")
    mask = torch.triu(mask, diagonal=L - window + 1)
    attn += mask
    attn = F.softmax(attn, dim=-1, dtype=torch.float32).to(qc.dtype)
    attn = attn[..., :-window]
    scores = attn.mean(dim=-2)
    scores = F.avg_pool1d(scores, kernel_size=kernel_size, padding=kernel_size // 2, stride=1)
    scores = scores.view(bsz, hkv, groups, L - window).mean(2)
    scores = F.pad(scores, (0, window), value=scores.max().item())
    indices = scores.topk(budget, dim=-1).indices
    gather = indices.unsqueeze(-1).expand(-1, -1, -1, d)
    keys = k.gather(2, gather).contiguous()
    values = v.gather(2, gather).contiguous()
    return scores, indices, keys, values


def median_cpu_seconds(fn, reps):
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    times.sort()
    return times[len(times) // 2]


def check_keep_sets(c, ref_scores):
    """kvevict's keep set vs the float32 pipeline's, per head: identical but for near-ties."""
    hkv, b, L, w = c["hkv"], c["b"], c["L"], c["w"]
    agree, swaps = True, 0
    for h in range(hkv):
        s = ref_scores[h]
        ref = set(s.topk(b).indices.tolist())
        got = set(c["keep"][h].tolist())
        diff = ref ^ got
        if not diff:
            continue
        kth = s.topk(b).values[-1].item()
        tol = 1e-4 * abs(kth)
        if all(abs(s[t].item() - kth) <= tol for t in diff):
            swaps += len(diff) // 2
        else:
            agree = False
    return agree, swaps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", required=True)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--without-avx512", action="store_true",
                    help="only time the pipeline as PyTorch runs it on a CPU without AVX-512 (result_without_avx512.txt)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.set_num_interop_threads(1)
    c = load_case(args.case)
    native = None if c["dtype"] in ("bf16", "f32") else torch.float32  # CPU torch: no fp16 matmul

    if args.without_avx512:
        # PyTorch 1.13 sends bf16 matmuls to oneDNN only where the CPU has AVX-512 (its
        # mkldnn_bf16_device_check); elsewhere they take ATen's own gemm. Disabling mkldnn here
        # reproduces that; ATen's kernels already run at the AVX2 capability in this build.
        torch.backends.mkldnn.enabled = False
        reps = 2 if args.quick else 3
        t = median_cpu_seconds(lambda: kvpress_snapkv(c["q"], c["k"], c["v"], c["w"], c["b"], compute_dtype=native),
                               reps)
        with open(f"{args.case}/result_without_avx512.txt", "w") as f:
            f.write(f"torch_without_avx512_ms {t * 1e3:.3f}\n")
        return 0

    reps = 2 if args.quick else (3 if c["L"] > 32768 else 5)
    t = median_cpu_seconds(lambda: kvpress_snapkv(c["q"], c["k"], c["v"], c["w"], c["b"], compute_dtype=native), reps)
    _, native_idx, _, _ = kvpress_snapkv(c["q"], c["k"], c["v"], c["w"], c["b"], compute_dtype=native)

    # The same pipeline in float32 throughout (no bf16 round trip of the attention): the
    # computation kvevict performs.
    qf, kf = c["q"].float(), c["k"].float()
    hkv, groups, L, w = c["hkv"], c["hq"] // c["hkv"], c["L"], c["w"]
    attn = torch.matmul(qf, repeat_kv(kf, groups).transpose(2, 3)) / math.sqrt(c["d"])
    attn += torch.triu(torch.ones_like(attn) * float("-inf"), diagonal=L - w + 1)
    attn = F.softmax(attn, dim=-1, dtype=torch.float32)[..., :-w].mean(dim=-2)
    ref = F.avg_pool1d(attn, kernel_size=5, padding=2, stride=1).view(1, hkv, groups, L - w).mean(2)[0]
    ref_padded = F.pad(ref, (0, w), value=ref.max().item())
    agree, swaps = check_keep_sets(c, ref_padded)
    got = c["scores"][:, : L - w]
    max_rel = ((got - ref).abs() / ref.abs().clamp_min(1e-30)).max().item()

    overlap = 0.0
    for h in range(hkv):
        overlap += len(set(native_idx[0, h].tolist()) & set(c["keep"][h].tolist())) / c["b"]
    overlap /= hkv

    blas = "unknown"
    cfg = torch.__config__.show()
    for line in cfg.splitlines():
        if "BLAS_INFO" in line:
            blas = line.split("BLAS_INFO=")[1].split(",")[0]
    with open(f"{args.case}/result.txt", "w") as f:
        f.write(f"torch_ms {t * 1e3:.3f}\n")
        f.write(f"torch_version {torch.__version__}\n")
        f.write(f"torch_threads {torch.get_num_threads()}\n")
        f.write(f"torch_blas {blas}\n")
        f.write(f"torch_compute {'float32 (upcast)' if native is not None else c['dtype']}\n")
        f.write(f"agree {1 if agree else 0}\n")
        f.write(f"near_tie_swaps {swaps}\n")
        f.write(f"max_rel_score_err {max_rel:.3g}\n")
        f.write(f"overlap_with_native_pipeline {overlap:.4f}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
