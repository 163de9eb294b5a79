#!/usr/bin/env python3
"""PyTorch baselines for the GPU benchmarks, on the same GPU and shapes as
kvevict_cuda_bench: torch.topk over one layer's and a whole model's score rows, a lean
kvpress-style SnapKV scoring (repeat_kv, matmul, softmax in float32, window mean, avg_pool1d,
GQA mean) with topk and gather, and kvpress' pipeline exactly as bench/torch_pipeline.py
defines it for the CPU comparison (its kvpress_snapkv: the mask built with ones_like and triu,
softmax cast back to bf16, the max().item() host sync), which scripts/gpu-model.py models.

Prints a markdown table plus "@@ key value" lines for scripts/gpu-check. Exits 77 (skipped)
when torch cannot be imported or has no CUDA device.
"""
import argparse
import math
import os
import sys


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--window", type=int, default=32)
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    try:
        import torch
        import torch.nn.functional as F
    except Exception as e:  # noqa: BLE001 - any import failure means "no baseline"
        print(f"PyTorch baseline skipped: torch not importable ({e})")
        return 77
    if not torch.cuda.is_available():
        print(f"PyTorch baseline skipped: torch {torch.__version__} has no CUDA device")
        return 77

    reps = 5 if args.quick else 20
    hq, hkv, d, L, W, B, layers = 32, 8, 128, args.tokens, args.window, 2048, 32
    G = hq // hkv
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)

    def median_us(fn):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            a = torch.cuda.Event(enable_timing=True)
            b = torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1000.0)
        times.sort()
        return times[len(times) // 2]

    q = torch.randn(1, hq, W, d, device=dev, dtype=torch.bfloat16, generator=gen) * 2
    k = torch.randn(1, hkv, L, d, device=dev, dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, hkv, L, d, device=dev, dtype=torch.bfloat16, generator=gen)
    causal = torch.full((W, W), float("-inf"), device=dev).triu(1)

    def scores_only():
        keys = k.repeat_interleave(G, dim=1)  # kvpress repeat_kv
        attn = torch.matmul(q, keys.transpose(-1, -2)) / math.sqrt(d)
        attn[..., -W:] += causal
        attn = F.softmax(attn, dim=-1, dtype=torch.float32)
        s = attn[..., :-W].mean(dim=-2)
        s = F.avg_pool1d(s, kernel_size=5, padding=2, stride=1)
        s = s.view(1, hkv, G, L - W).mean(2)
        return F.pad(s, (0, W), value=float("inf"))

    def pipeline():
        s = scores_only()
        idx = s.topk(B, dim=-1).indices
        idx = idx.unsqueeze(-1).expand(-1, -1, -1, d)
        return k.gather(2, idx), v.gather(2, idx)

    idx_fixed = scores_only().topk(B, dim=-1).indices.unsqueeze(-1).expand(-1, -1, -1, d)

    def gather_only():
        return k.gather(2, idx_fixed), v.gather(2, idx_fixed)

    print("| PyTorch %s (%s) | time (us) |" % (torch.__version__, torch.cuda.get_device_name()))
    print("|---|---:|")
    res = {}
    res["torch_scores_us"] = median_us(scores_only)
    print("| kvpress-style scoring (repeat_kv, matmul, softmax f32, mean, avg_pool1d, GQA mean) | %.1f |"
          % res["torch_scores_us"])
    res["torch_pipeline_us"] = median_us(pipeline)
    print("| full kvpress-style pipeline (scoring + topk + gather K, V) | %.1f |" % res["torch_pipeline_us"])
    res["torch_gather_us"] = median_us(gather_only)
    try:  # kvpress' own sequence of ops, shared with the CPU comparison (needs numpy)
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
        from torch_pipeline import kvpress_snapkv
        res["torch_kvpress_us"] = median_us(lambda: kvpress_snapkv(q, k, v, W, B))
        print("| kvpress SnapKV pipeline exactly (bench/torch_pipeline.py kvpress_snapkv: mask via ones_like/triu, "
              "softmax cast to bf16, max().item() sync, topk, gather) | %.1f |" % res["torch_kvpress_us"])
    except (ImportError, SystemExit) as e:  # torch_pipeline exits 77 without numpy
        print("| kvpress SnapKV pipeline exactly: skipped (bench/torch_pipeline.py not importable: %s) | n/a |" % e)
    print("| gather K and V (%d of %d per head, out of place) | %.1f |" % (B, L, res["torch_gather_us"]))
    for rows, key in ((hkv, "layer"), (layers * hkv, "model")):
        s = torch.rand(rows, L, device=dev, generator=gen)
        res[f"torch_topk_{key}_us"] = median_us(lambda s=s: s.topk(B, dim=-1))
        res[f"torch_topk_sorted_{key}_us"] = median_us(lambda s=s: s.topk(B, dim=-1).indices.sort(dim=-1))
        print("| torch.topk k=%d, %d rows x %d | %.1f |" % (B, rows, L, res[f"torch_topk_{key}_us"]))
        print("| torch.topk + ascending sort of the indices, %d rows | %.1f |" % (rows, res[f"torch_topk_sorted_{key}_us"]))
    for key, value in res.items():
        print(f"@@ {key} {value:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
