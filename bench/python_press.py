"""kvevict's kvpress press against kvpress's own, on one CPU transformers model and prompt.

Per layer: press.compress() on the same captured inputs (hidden states, keys, values, RoPE),
kvpress's SnapKVPress and KvevictPress("snapkv") with the same settings, median of N calls.
End to end: a prefill of the whole prompt through the model with each press (and with none).

Usage (in a venv with kvevict installed, e.g. build/python-venv after `scripts/test python`):
    python bench/python_press.py [--tokens 4096] [--repeats 7] [--threads 1]
Prints one line per measurement; docs/benchmarks.md quotes a run.
"""
import argparse
import statistics
import time

import torch
from kvpress import SnapKVPress
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from kvevict.kvpress import KvevictPress


def median_seconds(fn, repeats):
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ratio", type=float, default=0.5)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    # Llama-3-8B's attention shape per layer (32 query heads, 8 KV heads, d = 128) on a
    # 2-layer model: the compress call sees what it would see in the real model.
    config = LlamaConfig(vocab_size=1024, hidden_size=4096, intermediate_size=1024, num_hidden_layers=2,
                         num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=args.tokens + 64,
                         rope_theta=500000.0, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    attn = model.model.layers[0].self_attn
    n = args.tokens
    hidden = torch.randn(1, n, config.hidden_size)
    position_ids = torch.arange(n).unsqueeze(0)
    kwargs = {"position_embeddings": model.model.rotary_emb(hidden, position_ids)}
    keys = torch.randn(1, 8, n, 128)
    values = torch.randn(1, 8, n, 128)

    theirs = SnapKVPress(compression_ratio=args.ratio, window_size=64, kernel_size=5)
    ours = KvevictPress("snapkv", compression_ratio=args.ratio, window_size=64, kernel_size=5)
    print(f"shape: Hq 32, Hkv 8, d 128, L {n}, W 64, ratio {args.ratio}, float32, torch threads {args.threads}, "
          f"torch {torch.__version__}, kvevict path {__import__('kvevict').active_cpu_isa()}")
    with torch.inference_mode():
        ours.compress(attn, hidden, keys.clone(), values.clone(), None, kwargs)  # plans once, outside timing
        copies = [(keys.clone(), values.clone()) for _ in range(args.repeats)]
        it = iter(copies)
        t_ours = median_seconds(lambda: ours.compress(attn, hidden, *next(it), None, kwargs), args.repeats)
        t_theirs = median_seconds(lambda: theirs.compress(attn, hidden, keys, values, None, kwargs), args.repeats)
    print(f"per layer: kvpress SnapKVPress {t_theirs * 1e3:.1f} ms, KvevictPress {t_ours * 1e3:.1f} ms "
          f"({t_theirs / t_ours:.2f}x)")

    ids = torch.randint(0, 1024, (1, n))

    def prefill(press):
        cache = DynamicCache()
        with torch.inference_mode():
            if press is None:
                model(ids, past_key_values=cache)
            else:
                with press(model):
                    model(ids, past_key_values=cache)

    prefill(ours)
    reps = max(3, args.repeats // 2)
    t_none = median_seconds(lambda: prefill(None), reps)
    t_theirs = median_seconds(lambda: prefill(theirs), reps)
    t_ours = median_seconds(lambda: prefill(ours), reps)
    print(f"prefill of {n} tokens, 2 layers: no press {t_none * 1e3:.0f} ms, kvpress {t_theirs * 1e3:.0f} ms "
          f"(+{(t_theirs - t_none) * 1e3:.0f}), kvevict {t_ours * 1e3:.0f} ms (+{(t_ours - t_none) * 1e3:.0f})")


if __name__ == "__main__":
    main()
