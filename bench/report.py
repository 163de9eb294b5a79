#!/usr/bin/env python3
"""Turns one scripts/bench run into docs/benchmarks/: results.json (everything), results.md
(the tables, targets first) and results.png (the plots).

Inputs: kvevict_bench's Google Benchmark JSON (--micro), kvevict_bench_vs_torch's JSON
(--torch), and the machine description scripts/bench recorded (--machine, "key: value").
Every ratio is formed within this one run (the machine is shared; see docs/benchmarks.md).

With --paths DIR (DIR/<path>/micro.json and DIR/<path>/vs_torch.json, one run per CPU path
under KVEVICT_ISA=<path>) it also writes paths.md and paths.json: the reference shape on
every path, each against the rooflines its own run measured.
"""
import argparse
import json
import os
import sys

REF_L, REF_DTYPE, SEL_L = 32768, "bf16", 131072
TARGETS = [
    # key, what, target text, threshold (ratio must be >= it)
    ("score", "observation scoring without engine LSE (executed GEMM GFLOP/s / FMA peak)", ">= 60% of FMA peak", 0.60),
    ("score_lse", "observation scoring with engine LSE, one sweep (same count)", "(reported)", None),
    ("score_f32", "(not the reference dtype) observation scoring, f32 cache, no engine LSE: FMA path", ">= 60% of FMA peak",
     0.60),
    ("score_fp16", "(not the reference dtype) observation scoring, fp16 cache, no engine LSE: FMA path",
     ">= 60% of FMA peak", 0.60),
    ("select", "selection at L = 128K (std::nth_element time / kvevict time)", ">= 10x", 10.0),
    ("compact", "compaction of K and V (GB/s copied / memcpy GB/s)", ">= 50% of memcpy", 0.50),
    ("decode", "decode observation (K GB/s / read GB/s)", ">= 50% of read", 0.50),
    ("pipeline", "whole SnapKV layer vs the PyTorch pipeline (torch time / kvevict time)", ">= 5x", 5.0),
]


def load_micro(path):
    data = json.load(open(path))
    ctx = data.get("context", {})
    # With --benchmark_repetitions the median of the repetitions stands for a benchmark;
    # without, its one run does.
    rows = {}
    for b in data["benchmarks"]:
        if b.get("error_occurred"):
            continue
        unit = {"ns": 1e-6, "us": 1e-3, "ms": 1.0, "s": 1e3}[b.get("time_unit", "ns")]
        b["ms"] = b["cpu_time"] * unit
        if b.get("run_type") == "aggregate":
            if b.get("aggregate_name") == "median":
                rows[b["run_name"]] = b
        elif b["name"] not in rows:
            rows[b["name"]] = b
    return ctx, rows


def pct(x):
    return f"{100 * x:.1f}%"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--micro", default=None)
    ap.add_argument("--torch", default=None)
    ap.add_argument("--machine", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--command", default="scripts/bench")
    ap.add_argument("--paths", default=None)
    args = ap.parse_args()
    machine = {}
    for line in open(args.machine):
        if ":" in line:
            k, v = line.split(":", 1)
            machine[k.strip()] = v.strip()
    if args.micro is None:  # the per-path tables only
        if not args.paths:
            ap.error("--micro and --torch, or --paths")
        os.makedirs(args.out, exist_ok=True)
        write_paths(args.paths, args.out, args.command, machine)
        return 0

    ctx, micro = load_micro(args.micro)
    torch_res = json.load(open(args.torch)) if args.torch and os.path.exists(args.torch) else {"cases": []}
    fma = float(ctx.get("kvevict_fma_peak_gflops", "nan"))
    amx = float(ctx.get("kvevict_amx_bf16_peak_gflops", "0") or 0)
    read = float(ctx.get("kvevict_read_gbs", "nan"))
    memcpy = float(ctx.get("kvevict_memcpy_gbs", "nan"))

    def get(name):
        return micro.get(name)

    def suffix(dtype, L):
        return f"/{dtype}/L:{L}"

    lengths = sorted({int(n.split("L:")[1]) for n in micro if "/L:" in n})
    dtypes = [d for d in ("bf16", "fp16", "f32") if any(f"/{d}/" in n for n in micro)]

    # ---- targets at the reference shape ------------------------------------------------------
    achieved = {}
    s = suffix(REF_DTYPE, REF_L)
    if get("score_prompt/window" + s):
        g = get("score_prompt/window" + s)["GFLOP"]
        achieved["score"] = (f"{g:.1f} GFLOP/s of {fma:.1f}", g / fma)
    def on_amx(b):
        return b.get("amx", 0) == 1 and amx > 0

    def gemm_name(b):
        if on_amx(b):
            return "AMX"
        return "VDPBF16PS" if b.get("vdpbf16ps", 0) == 1 else "FMA"

    if get("score_prompt/window" + s) and on_amx(get("score_prompt/window" + s)):
        g = get("score_prompt/window" + s)["GFLOP"]
        achieved["score"] = (f"{g:.1f} GFLOP/s of {fma:.1f} (GEMM on AMX: {pct(g / amx)} of its {amx:.0f} GFLOP/s bf16 "
                             "peak)", g / fma)
    if get("score_prompt/engine_lse" + s):
        g = get("score_prompt/engine_lse" + s)["GFLOP"]
        achieved["score_lse"] = (f"{g:.1f} GFLOP/s of {fma:.1f}", g / fma)
    for d in ("f32", "fp16"):
        b = get("score_prompt/window" + suffix(d, REF_L))
        if b:
            achieved["score_" + d] = (f"{b['GFLOP']:.1f} GFLOP/s of {fma:.1f}", b["GFLOP"] / fma)
    sel_l = SEL_L if get(f"select/kvevict/L:{SEL_L}") else (lengths[-1] if lengths else None)
    if sel_l and get(f"select/kvevict/L:{sel_l}") and get(f"select/std_nth_element/L:{sel_l}"):
        a, b = get(f"select/kvevict/L:{sel_l}")["ms"], get(f"select/std_nth_element/L:{sel_l}")["ms"]
        achieved["select"] = (f"{a * 1e3:.0f} us vs {b * 1e3:.0f} us (L = {sel_l})", b / a)
    if get("compact/kv" + s):
        g = get("compact/kv" + s)["GB"]
        achieved["compact"] = (f"{g:.2f} GB/s of {memcpy:.2f}", g / memcpy)
    if get("score_decode/step" + s):
        g = get("score_decode/step" + s)["GB"]
        achieved["decode"] = (f"{g:.2f} GB/s of {read:.2f}", g / read)
    for c in torch_res["cases"]:
        if c["dtype"] == REF_DTYPE and c["tokens"] == REF_L and "torch_ms" in c:
            achieved["pipeline"] = (f"{c['kvevict_ms']:.0f} ms vs {c['torch_ms']:.0f} ms", c["torch_ms"] / c["kvevict_ms"])

    md = []
    md.append("# kvevict benchmark results\n")
    md.append(f"Generated by `{args.command}` (methodology: [docs/benchmarks.md](../benchmarks.md)). "
              "One thread, CPU time, median of 3 repetitions; every ratio below is formed within this one run.\n")
    md.append("## Machine\n")
    for k in ("cpu", "cores", "memory", "compiler", "flags", "kvevict build", "torch", "date", "load"):
        if k in machine:
            md.append(f"- **{k}**: {machine[k]}")
    amx_txt = f", AMX bf16 peak {amx:.0f} GFLOP/s" if amx > 0 else ""
    dot = float(ctx.get("kvevict_vdpbf16ps_peak_gflops", "0") or 0)
    dot_txt = f", VDPBF16PS peak {dot:.0f} GFLOP/s" if dot > 0 else ""
    path = ctx.get("kvevict_cpu_isa", "?")
    md.append(f"- **CPU path**: {path} (best this machine supports: {ctx.get('kvevict_cpu_isa_supported', '?')}; "
              "[docs/cpu-dispatch.md](../cpu-dispatch.md)); every path: [paths.md](paths.md)")
    md.append(f"- **rooflines (measured in this run)**: fp32 FMA peak of the {path} path {fma:.1f} GFLOP/s"
              f"{dot_txt}{amx_txt}, DRAM read {read:.2f} GB/s, memcpy {memcpy:.2f} GB/s (bytes copied)\n")

    md.append(f"## Targets (reference shape: Llama-3.1-8B layer, L = {REF_L}, W = 32, B = 2048, {REF_DTYPE}, one thread)\n")
    md.append("| target | achieved | ratio | goal | met |")
    md.append("|---|---|---:|---|---|")
    for key, what, goal, thr in TARGETS:
        if key not in achieved:
            md.append(f"| {what} | not measured | | {goal} | |")
            continue
        txt, ratio = achieved[key]
        r = f"{ratio:.1f}x" if key in ("select", "pipeline") else pct(ratio)
        met = "" if thr is None else ("yes" if ratio >= thr else f"**no** ({ratio / thr:.2f} of goal)")
        md.append(f"| {what} | {txt} | {r} | {goal} | {met} |")
    md.append("")

    md.append("## Observation scoring, decode observation, compaction (every dtype and L)\n")
    md.append("Scoring GFLOP/s count the logit GEMM's executed FLOPs (2 per multiply-add, times the sweeps over "
              "the keys the CPU path takes: without an engine LSE two on the portable path and for bf16 pair "
              "products, one on the AVX2/AVX-512 float32 paths, which keep 16 rows' logits; with it one); "
              "\"useful\" GFLOP/s count one sweep whatever the path does. The exp of the softmax is not counted. "
              "Decode GB/s = K bytes read once per step; compaction GB/s = K and V bytes copied.\n")
    md.append("\"GEMM on\": float32 FMA micro-kernels, or for bf16 × bf16 VDPBF16PS pair products (avx512bf16) or "
              "AMX tiles (amx), whose fraction of the fp32 FMA peak can exceed 100%; the AMX column gives the "
              "fraction of the AMX bf16 peak.\n")
    md.append("| dtype | L | GEMM on | score (ms) | sweeps | GFLOP/s | of FMA peak | useful GFLOP/s | of AMX peak | "
              "score + LSE (ms) | GFLOP/s | of FMA peak | decode step (ms) | GB/s | of read | compaction (ms) | GB/s | "
              "of memcpy |")
    md.append("|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    table_rows = []
    for d in dtypes:
        for L in lengths:
            sx = suffix(d, L)
            a, b = get("score_prompt/window" + sx), get("score_prompt/engine_lse" + sx)
            c, e = get("score_decode/step" + sx), get("compact/kv" + sx)
            if not (a and b and c and e):
                continue
            row = dict(dtype=d, L=L, score_ms=a["ms"], score_gflops=a["GFLOP"], score_frac=a["GFLOP"] / fma,
                       lse_ms=b["ms"], lse_gflops=b["GFLOP"], lse_frac=b["GFLOP"] / fma,
                       decode_ms=c["ms"], decode_gbs=c["GB"], decode_frac=c["GB"] / read,
                       compact_ms=e["ms"], compact_gbs=e["GB"], compact_frac=e["GB"] / memcpy)
            row["gemm"] = gemm_name(a)
            table_rows.append(row)
            amx_frac = pct(a["GFLOP"] / amx) if on_amx(a) else ""
            md.append(f"| {d} | {L} | {row['gemm']} | {a['ms']:.1f} | {a.get('sweeps', 2):.0f} | {a['GFLOP']:.1f} | "
                      f"{pct(row['score_frac'])} | {a.get('useful_GFLOP', 0):.1f} | {amx_frac} | {b['ms']:.1f} | "
                      f"{b['GFLOP']:.1f} | {pct(row['lse_frac'])} | {c['ms']:.2f} | {c['GB']:.2f} | "
                      f"{pct(row['decode_frac'])} | {e['ms']:.2f} | {e['GB']:.2f} | {pct(row['compact_frac'])} |")
    md.append("")

    md.append("## Whole per-layer pipelines\n")
    md.append("SnapKV: score + select + evict. DeferKV: prefill observation (W = 32) + d decode observations "
              "+ scores + select + evict. DapQ: re-rotation of the window queries to the pseudo positions + "
              "score + select + evict. Scratch = workspace bytes (plus DeferKV's [Hkv, L] state).\n")
    md.append("| dtype | L | SnapKV (ms) | DeferKV d=1 (ms) | DeferKV d=4 (ms) | DapQ (ms) | SnapKV scratch (MiB) "
              "| DeferKV scratch (MiB) |")
    md.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    pipe_rows = []
    for d in dtypes:
        for L in lengths:
            sx = suffix(d, L)
            p = [get(n + sx) for n in ("snapkv/layer", "deferkv/layer_d1", "deferkv/layer_d4", "dapq/layer_rerotate")]
            if not all(p):
                continue
            pipe_rows.append(dict(dtype=d, L=L, snapkv_ms=p[0]["ms"], deferkv_d1_ms=p[1]["ms"],
                                  deferkv_d4_ms=p[2]["ms"], dapq_ms=p[3]["ms"],
                                  snapkv_scratch=p[0]["scratch_bytes"], deferkv_scratch=p[1]["scratch_bytes"]))
            md.append(f"| {d} | {L} | {p[0]['ms']:.1f} | {p[1]['ms']:.1f} | {p[2]['ms']:.1f} | {p[3]['ms']:.1f} | "
                      f"{p[0]['scratch_bytes'] / 2**20:.2f} | {p[1]['scratch_bytes'] / 2**20:.2f} |")
    md.append("")

    md.append("## Selection (Hkv = 8 rows of L scores, B = 2048, window of 32 inside)\n")
    md.append("The baselines produce the same ascending keep-lists: an index array ordered by "
              "(score desc, index asc) with std::nth_element or std::partial_sort, then the kept indices sorted.\n")
    md.append("| L | kvevict (us) | ns/elem | std::nth_element (us) | speed-up | std::partial_sort (us) | speed-up |")
    md.append("|---:|---:|---:|---:|---:|---:|---:|")
    sel_rows = []
    for L in lengths:
        a, b, c = (get(f"select/{n}/L:{L}") for n in ("kvevict", "std_nth_element", "std_partial_sort"))
        if not (a and b and c):
            continue
        sel_rows.append(dict(L=L, kvevict_us=a["ms"] * 1e3, ns_per_elem=a["ns_per_elem"], nth_us=b["ms"] * 1e3,
                             partial_us=c["ms"] * 1e3))
        md.append(f"| {L} | {a['ms'] * 1e3:.0f} | {a['ns_per_elem']:.2f} | {b['ms'] * 1e3:.0f} | {b['ms'] / a['ms']:.1f}x | "
                  f"{c['ms'] * 1e3:.0f} | {c['ms'] / a['ms']:.1f}x |")
    md.append("")

    md.append("## SnapKV layer vs the PyTorch pipeline (kvpress conventions, same data)\n")
    if torch_res["cases"]:
        c0 = torch_res["cases"][0]
        md.append(f"PyTorch {c0.get('torch_version', '?')}, {c0.get('torch_threads', '?')} thread, "
                  f"BLAS {c0.get('torch_blas', '?')} (OpenBLAS, OPENBLAS_CORETYPE=SkylakeX: its own detection "
                  "picks the SSE3 'Prescott' kernels on this VM). \"same keep sets\": kvevict's kept tokens equal "
                  "the float32 pipeline's per head, except swaps at near-ties (|score - B-th| <= 1e-4 relative); "
                  "\"overlap\": share of kvevict's tokens the native-dtype pipeline keeps too (kvpress rounds the "
                  "attention to bf16).\n")
        md.append("| dtype | L | kvevict (ms) | PyTorch (ms) | torch computes in | speed-up | same keep sets | "
                  "max rel. score diff | overlap with native |")
        md.append("|---|---:|---:|---:|---|---:|---|---:|---:|")
        for c in torch_res["cases"]:
            if "torch_ms" not in c:
                md.append(f"| {c['dtype']} | {c['tokens']} | {c['kvevict_ms']:.1f} | failed: {c.get('error', '')} | | | | | |")
                continue
            agree = "yes" if c.get("agree") == 1 else "**no**"
            if c.get("near_tie_swaps", 0):
                agree += f" ({c['near_tie_swaps']} near-tie swaps)"
            md.append(f"| {c['dtype']} | {c['tokens']} | {c['kvevict_ms']:.1f} | {c['torch_ms']:.1f} | "
                      f"{c.get('torch_compute', '')} | {c['torch_ms'] / c['kvevict_ms']:.1f}x | {agree} | "
                      f"{c.get('max_rel_score_err', '')} | {100 * float(c.get('overlap_with_native_pipeline', 0)):.1f}% |")
    else:
        md.append("Not run (PyTorch not importable).")
    md.append("")

    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    merged = dict(machine=machine, rooflines=dict(fma_gflops=fma, amx_bf16_gflops=amx, read_gbs=read, memcpy_gbs=memcpy),
                  targets={k: dict(achieved=v[0], ratio=v[1]) for k, v in achieved.items()},
                  kernels=table_rows, pipelines=pipe_rows, selection=sel_rows, vs_torch=torch_res["cases"],
                  google_benchmark=dict(context=ctx, benchmarks=list(micro.values())))
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(merged, f, indent=1)
    plot(args.out, table_rows, pipe_rows, sel_rows, torch_res["cases"], lengths)
    print("\n".join(md))
    if args.paths:
        write_paths(args.paths, args.out, args.command, machine)
    return 0


PATH_ORDER = ("scalar", "avx2", "avx512", "avx512bf16", "amx")


def write_paths(root, out, command, machine):
    """paths.md / paths.json: the reference shape on every CPU path, one run each."""
    runs = []
    for p in PATH_ORDER:
        micro_path = os.path.join(root, p, "micro.json")
        if not os.path.exists(micro_path):
            continue
        ctx, micro = load_micro(micro_path)
        torch_path = os.path.join(root, p, "vs_torch.json")
        cases = json.load(open(torch_path))["cases"] if os.path.exists(torch_path) else []
        runs.append((p, ctx, micro, cases))
    md = ["# kvevict on every CPU path\n",
          f"Generated by `{command}` (methodology: [docs/benchmarks.md](../benchmarks.md); the paths: "
          "[docs/cpu-dispatch.md](../cpu-dispatch.md)). One process per path, `KVEVICT_ISA=<path>`, the same binary "
          "(built without `-march`); each run measures its own rooflines and its own PyTorch baseline, so every ratio "
          "in a row is formed within that path's run. Reference shape: Llama-3.1-8B layer (Hq = 32, Hkv = 8, d = 128), "
          f"L = {REF_L}, W = 32, B = 2048, one thread, CPU time, median of 3 repetitions.\n"]
    for k in ("cpu", "cores", "compiler", "flags", "torch", "date", "load"):
        if k in machine:
            md.append(f"- **{k}**: {machine[k]}")
    md.append("")
    md.append("Scoring (no engine LSE) GFLOP/s count the logit GEMM's executed FLOPs: 2 per multiply-add times the "
              "sweeps over the keys the path takes (two on the portable path and for bf16 pair products; one on the "
              "AVX2/AVX-512 float32 paths, which keep 16 rows' logits), against the float32 FMA peak of the path's "
              "own vector width (scalar: the portable loop as the x86-64 baseline compiles it). bf16 × bf16 products "
              "on avx512bf16 / amx are also given against their own peak. The time (ms) compares paths whatever "
              "they execute.\n")
    md.append("| path | FMA peak (GFLOP/s) | scoring bf16 (ms) | GEMM on | sweeps | GFLOP/s | of FMA peak | of product "
              "peak | scoring f32 (ms) | sweeps | GFLOP/s | of FMA peak | decode bf16 GB/s | of read | compaction bf16 "
              "GB/s | of memcpy | "
              "selection 128K vs nth_element | SnapKV layer (ms) | PyTorch (ms) | speed-up | PyTorch as without AVX-512 "
              "(ms) | speed-up | same keep sets |")
    md.append("|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
              "---|")
    rows = []
    for p, ctx, micro, cases in runs:
        fma = float(ctx.get("kvevict_fma_peak_gflops", "nan"))
        read = float(ctx.get("kvevict_read_gbs", "nan"))
        memcpy = float(ctx.get("kvevict_memcpy_gbs", "nan"))
        amx = float(ctx.get("kvevict_amx_bf16_peak_gflops", "0") or 0)
        dot = float(ctx.get("kvevict_vdpbf16ps_peak_gflops", "0") or 0)
        g = lambda n: micro.get(n)
        sb, sf = g(f"score_prompt/window/bf16/L:{REF_L}"), g(f"score_prompt/window/f32/L:{REF_L}")
        dec, comp = g(f"score_decode/step/bf16/L:{REF_L}"), g(f"compact/kv/bf16/L:{REF_L}")
        sel, nth = g(f"select/kvevict/L:{SEL_L}"), g(f"select/std_nth_element/L:{SEL_L}")
        torch_case = next((c for c in cases if c["dtype"] == REF_DTYPE and c["tokens"] == REF_L and "torch_ms" in c), None)
        row = dict(path=ctx.get("kvevict_cpu_isa", p), fma_peak=fma, read_gbs=read, memcpy_gbs=memcpy)
        cells = [row["path"], f"{fma:.1f}"]
        if sb:
            on = "AMX" if sb.get("amx", 0) == 1 else ("VDPBF16PS" if sb.get("vdpbf16ps", 0) == 1 else "FMA")
            prod_peak = amx if on == "AMX" else (dot if on == "VDPBF16PS" else 0)
            row.update(score_bf16_ms=sb["ms"], score_bf16_sweeps=sb.get("sweeps", 2), score_bf16_gflops=sb["GFLOP"],
                       score_bf16_frac=sb["GFLOP"] / fma, score_bf16_on=on)
            cells += [f"{sb['ms']:.1f}", on, f"{sb.get('sweeps', 2):.0f}", f"{sb['GFLOP']:.1f}", pct(sb["GFLOP"] / fma),
                      pct(sb["GFLOP"] / prod_peak) if prod_peak else ""]
        else:
            cells += ["", "", "", "", "", ""]
        if sf:
            row.update(score_f32_ms=sf["ms"], score_f32_sweeps=sf.get("sweeps", 2), score_f32_gflops=sf["GFLOP"],
                       score_f32_frac=sf["GFLOP"] / fma)
            cells += [f"{sf['ms']:.1f}", f"{sf.get('sweeps', 2):.0f}", f"{sf['GFLOP']:.1f}", pct(sf["GFLOP"] / fma)]
        else:
            cells += ["", "", "", ""]
        if dec:
            row.update(decode_gbs=dec["GB"], decode_frac=dec["GB"] / read)
            cells += [f"{dec['GB']:.2f}", pct(dec["GB"] / read)]
        else:
            cells += ["", ""]
        if comp:
            row.update(compact_gbs=comp["GB"], compact_frac=comp["GB"] / memcpy)
            cells += [f"{comp['GB']:.2f}", pct(comp["GB"] / memcpy)]
        else:
            cells += ["", ""]
        if sel and nth:
            row.update(select_us=sel["ms"] * 1e3, nth_us=nth["ms"] * 1e3, select_speedup=nth["ms"] / sel["ms"])
            cells.append(f"{nth['ms'] / sel['ms']:.1f}x ({sel['ms'] * 1e3:.0f} vs {nth['ms'] * 1e3:.0f} us)")
        else:
            cells.append("")
        if torch_case:
            k, t = torch_case["kvevict_ms"], torch_case["torch_ms"]
            row.update(snapkv_ms=k, torch_ms=t, speedup=t / k, same_keep=torch_case.get("agree") == 1)
            agree = "yes" if torch_case.get("agree") == 1 else "**no**"
            if torch_case.get("near_tie_swaps", 0):
                agree += f" ({torch_case['near_tie_swaps']} near-tie swaps)"
            t2 = float(torch_case.get("torch_without_avx512_ms", 0) or 0)
            if t2 > 0:
                row.update(torch_without_avx512_ms=t2, speedup_without_avx512=t2 / k)
            cells += [f"{k:.1f}", f"{t:.1f}", f"{t / k:.1f}x", f"{t2:.0f}" if t2 > 0 else "",
                      f"{t2 / k:.1f}x" if t2 > 0 else "", agree]
        else:
            cells += ["", "", "", "", "", ""]
        rows.append(row)
        md.append("| " + " | ".join(cells) + " |")
    md.append("")
    md.append("\"PyTorch\": the kvpress pipeline as PyTorch runs it on this machine (bf16 matmul on oneDNN's "
              "AVX512_BF16 kernels where the CPU has them). \"PyTorch as without AVX-512\" (paths below avx512 only): "
              "the same pipeline as PyTorch 1.13 runs it on a CPU without AVX-512, where it does not send bf16 "
              "matmuls to oneDNN (`torch.backends.mkldnn.enabled = False`; `OPENBLAS_CORETYPE=Haswell`), so that both "
              "sides use the same instructions. \"same keep sets\": kvevict's kept tokens equal the float32 pipeline's "
              "except swaps at near-ties.\n")
    with open(os.path.join(out, "paths.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(out, "paths.json"), "w") as f:
        json.dump(dict(machine=machine, command=command, paths=rows), f, indent=1)
    print("\n".join(md))


def plot(out, rows, pipes, sels, torch_cases, lengths):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no results.png", file=sys.stderr)
        return
    fig, ax = plt.subplots(2, 2, figsize=(13, 9))
    colors = {"bf16": "tab:blue", "fp16": "tab:orange", "f32": "tab:green"}

    a = ax[0][0]
    for key, marker, label in (("score_frac", "o", "scoring / FMA peak"), ("decode_frac", "s", "decode / read BW"),
                               ("compact_frac", "^", "compaction / memcpy")):
        for d in colors:
            pts = [(r["L"], 100 * r[key]) for r in rows if r["dtype"] == d]
            if pts:
                a.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, color=colors[d],
                       linestyle="-" if key == "score_frac" else ("--" if key == "decode_frac" else ":"),
                       label=f"{label} ({d})")
    a.axhline(60, color="gray", lw=0.8)
    a.axhline(50, color="gray", lw=0.8, ls="--")
    a.set_xscale("log", base=2)
    a.set_xlabel("L (tokens)")
    a.set_ylabel("% of this machine's roofline")
    a.set_title("Kernels against their rooflines (targets 60% / 50%)")
    a.legend(fontsize=6, ncol=2)

    a = ax[0][1]
    for d in colors:
        pts = [p for p in pipes if p["dtype"] == d]
        if pts:
            a.plot([p["L"] for p in pts], [p["snapkv_ms"] for p in pts], "o-", color=colors[d], label=f"SnapKV {d}")
            a.plot([p["L"] for p in pts], [p["deferkv_d1_ms"] for p in pts], "s--", color=colors[d],
                   label=f"DeferKV d=1 {d}")
            a.plot([p["L"] for p in pts], [p["dapq_ms"] for p in pts], "^:", color=colors[d], label=f"DapQ {d}")
        tc = [c for c in torch_cases if c["dtype"] == d and "torch_ms" in c]
        if tc:
            a.plot([c["tokens"] for c in tc], [c["torch_ms"] for c in tc], "x-", color=colors[d], alpha=0.5,
                   label=f"PyTorch kvpress {d}")
    a.set_xscale("log", base=2)
    a.set_yscale("log")
    a.set_xlabel("L (tokens)")
    a.set_ylabel("ms per layer (one thread)")
    a.set_title("Whole per-layer pipelines")
    a.legend(fontsize=6, ncol=2)

    a = ax[1][0]
    if sels:
        x = [s["L"] for s in sels]
        a.plot(x, [s["kvevict_us"] for s in sels], "o-", label="kvevict::select")
        a.plot(x, [s["nth_us"] for s in sels], "s--", label="std::nth_element")
        a.plot(x, [s["partial_us"] for s in sels], "^:", label="std::partial_sort")
        a.set_xscale("log", base=2)
        a.set_yscale("log")
    a.set_xlabel("L (tokens)")
    a.set_ylabel("us per layer (8 rows, B = 2048)")
    a.set_title("Selection")
    a.legend(fontsize=8)

    a = ax[1][1]
    labels, vals, cols = [], [], []
    for c in torch_cases:
        if "torch_ms" in c:
            labels.append(f"{c['dtype']}\n{c['tokens'] // 1024}K")
            vals.append(c["torch_ms"] / c["kvevict_ms"])
            cols.append(colors.get(c["dtype"], "gray"))
    if vals:
        a.bar(range(len(vals)), vals, color=cols)
        a.set_xticks(range(len(vals)))
        a.set_xticklabels(labels, fontsize=7)
        a.axhline(5, color="gray", lw=0.8)
    a.set_ylabel("PyTorch time / kvevict time")
    a.set_title("SnapKV layer vs the PyTorch pipeline (target 5x)")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "results.png"), dpi=110)


if __name__ == "__main__":
    sys.exit(main())
